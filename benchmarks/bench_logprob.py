"""Head + log-prob loss, fused (brcompile::packed_logprob) vs unfused (today's packed path).

Both variants start from the packed hidden states ``h [N, D]`` and the head weight ``W [V, D]`` and read
R = 2N next-token log-probs through ``index``/``targets`` (every packed token read at least once, half of
them twice: branch points), then back-propagate a weighted sum to h and W:

    unfused   logp = log_softmax(h @ W^T, -1)[index, targets]   (the lazy gather: [N, V] logits and
                                                                 log-probs built, kept for backward)
    fused     logp = brcompile::packed_logprob(h, W, None, index, targets, ...)   (chunks of rows)

Measured per (N, V, variant), each in a fresh subprocess so peaks do not mix:
  * bytes saved for backward (``torch.autograd.graph.saved_tensors_hooks``; distinct storages), in all
    and beyond the inputs (h, W, index, targets: kept by both variants anyway),
  * peak memory of head + loss: the peak resident set (``ru_maxrss``) during forward + backward minus
    the resident set just before (inputs already allocated), on CUDA ``max_memory_allocated`` likewise,
  * wall-clock of forward + backward (median of ``--reps`` after one warm-up), and the process CPU time
    (all threads; steadier than wall-clock on a shared machine),
  * the loss and the gradient norms, compared across variants (relative difference).

    python benchmarks/bench_logprob.py              # N in {8k, 32k}, V in {32k, 152k}, D 256
    python benchmarks/bench_logprob.py --quick      # N in {1k, 2k}, V in {32k, 152k}, D 128 (CPU)

An unfused run whose [N, V] buffers would not fit in the available memory is skipped (and said so).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

CHILD_FLAG = "--_one"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def make_inputs(N: int, V: int, D: int, dtype, device, seed: int = 0):
    """h [N, D], W [V, D] (leaves), index/targets [2, N] (row 0 reads every token, row 1 random ones),
    and fixed random loss weights."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(N, D, generator=g) / D ** 0.5).to(device, dtype).requires_grad_()
    W = (torch.randn(V, D, generator=g) * 0.02 * 4).to(device, dtype).requires_grad_()
    index = torch.stack([torch.arange(N), torch.randint(0, N, (N,), generator=g)]).to(device)
    targets = torch.randint(0, V, (2, N), generator=g).to(device)
    weights = torch.randn(2, N, generator=g).to(device, dtype)
    return h, W, index, targets, weights


def unfused(h, W, index, targets):
    """Today's packed path: [N, V] logits and log-probs, then logp_all[index, targets]."""
    logp_all = torch.log_softmax(h @ W.t(), dim=-1)
    return logp_all[index, targets]


def fused(h, W, index, targets):
    from brcompile.backends.logprob.op import packed_logprob

    return packed_logprob(h, W, index, targets)[0]


def run_one(spec: dict) -> dict:
    """One measurement (in this process): see the module docstring."""
    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    dtype = getattr(torch, spec["dtype"])
    fn = fused if spec["variant"] == "fused" else unfused
    importlib.import_module("torch._dynamo")  # a custom op's first call imports it: not part of the peak

    # warm-up on tiny inputs: one-time imports and registrations stay out of the measured peak
    tiny = make_inputs(8, 16, 4, dtype, device)
    torch.autograd.grad((fn(*tiny[:4]) * tiny[4]).sum(), tiny[:2])
    h, W, index, targets, weights = make_inputs(spec["N"], spec["V"], spec["D"], dtype, device)

    def step():
        loss = (fn(h, W, index, targets) * weights).sum()
        gh, gW = torch.autograd.grad(loss, (h, W))
        return loss, gh, gW

    # bytes saved for backward (distinct storages)
    storages = {}

    def pack(t):
        storages[(t.untyped_storage().data_ptr(), t.device)] = t.untyped_storage().nbytes()
        return t

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, gh, gW = step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    times, cpu_times = [], []
    for _ in range(spec["reps"]):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    inputs = {(t.untyped_storage().data_ptr(), t.device) for t in (h, W, index, targets, weights)}
    extra = sum(b for k, b in storages.items() if k not in inputs)
    return {**spec, "saved_bytes": sum(storages.values()), "saved_extra_bytes": extra, "peak_bytes": max(peak, 0),
            "seconds": statistics.median(times) if times else None,
            "cpu_seconds": statistics.median(cpu_times) if cpu_times else None, "loss": loss.item(),
            "grad_h_norm": gh.double().norm().item(), "grad_W_norm": gW.double().norm().item()}


def measure(spec: dict) -> dict:
    """run_one in a fresh subprocess."""
    out = subprocess.run([sys.executable, __file__, CHILD_FLAG, json.dumps(spec)], capture_output=True, text=True)
    if out.returncode != 0:
        return {**spec, "error": (out.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _gb(x) -> str:
    return "-" if x is None else f"{x / 2**30:.2f} GB" if x >= 2**30 else f"{x / 2**20:.1f} MB"


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes for a CPU")
    p.add_argument("--N", type=int, nargs="*", help="packed token counts")
    p.add_argument("--V", type=int, nargs="*", help="vocabulary sizes")
    p.add_argument("--D", type=int, help="hidden size")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, help="timed repetitions (median)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    Ns = a.N or ([1024, 2048] if a.quick else [8192, 32768])
    Vs = a.V or [32000, 152064]
    D = a.D or (128 if a.quick else 256)
    reps = a.reps if a.reps is not None else (2 if a.quick else 3)
    itemsize = torch.empty(0, dtype=getattr(torch, a.dtype)).element_size()
    results = []
    print(f"head + log-prob loss, fwd+bwd, D={D}, {a.dtype}, {a.device}, {a.threads} threads, R = 2N requests")
    print(f"{'N':>6} {'V':>7} {'variant':>8} {'saved for bwd':>14} {'(beyond inputs)':>16} {'peak':>10} "
          f"{'time':>9} {'cpu time':>9}  notes")
    for N in Ns:
        for V in Vs:
            row = {}
            for variant in ("unfused", "fused"):
                spec = dict(N=N, V=V, D=D, dtype=a.dtype, device=a.device, variant=variant, reps=reps,
                            threads=a.threads)
                need = 4 * N * V * itemsize  # logits, log-probs, and two [N, V] gradients in backward
                if variant == "unfused" and a.device == "cpu" and need > 0.8 * _available_bytes():
                    r = {**spec, "skipped": f"needs ~{_gb(need)}, {_gb(_available_bytes())} available"}
                else:
                    r = measure(spec)
                row[variant] = r
                results.append(r)
                note = r.get("skipped") or r.get("error") or ""
                t, c = r.get("seconds"), r.get("cpu_seconds")
                print(f"{N:>6} {V:>7} {variant:>8} {_gb(r.get('saved_bytes')):>14} "
                      f"{_gb(r.get('saved_extra_bytes')):>16} {_gb(r.get('peak_bytes')):>10} "
                      f"{(f'{t:.3f} s' if t is not None else '-'):>9} {(f'{c:.3f} s' if c is not None else '-'):>9}"
                      f"  {note}", flush=True)
            u, f = row["unfused"], row["fused"]
            if "loss" in u and "loss" in f and u["seconds"] and f["seconds"]:
                print(f"{'':>6} {'':>7} {'ratio':>8} {u['saved_bytes'] / f['saved_bytes']:>13.1f}x {'':>16} "
                      f"{u['peak_bytes'] / max(f['peak_bytes'], 1):>9.1f}x {u['seconds'] / f['seconds']:>8.2f}x "
                      f"{u['cpu_seconds'] / f['cpu_seconds']:>8.2f}x  "
                      f"(unfused / fused; loss rel diff {_rel(f['loss'], u['loss']):.1e}, grad norms "
                      f"{max(_rel(f['grad_h_norm'], u['grad_h_norm']), _rel(f['grad_W_norm'], u['grad_W_norm'])):.1e})")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return results


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == CHILD_FLAG:
        print(json.dumps(run_one(json.loads(sys.argv[2]))))
    else:
        main()
