"""Benchmark (GPU only, not a test): Triton tree attention vs FlexAttention vs per-row causal SDPA.

One prompt of P tokens and G rollouts of T tokens each (GRPO-style group), Hq/Hkv = 32/8, D = 128, bf16:

* tree    brcompile's Triton kernels on the N = P + G*T packed tokens (fwd + bwd, key tiles cached);
* flex    FlexAttention on the same packed tokens, BlockMask from the same tree
          (mask_mod: k <= q < end[k] and valid[k]), torch.compile'd;
* sdpa    F.scaled_dot_product_attention(is_causal=True, enable_gqa=True), flash backend, on the dense
          batch [G, Hq, P+T, D] (each row recomputes the prompt).

FLOPs are visible-pair FLOPs: forward 4*D*Hq per visible (query, key) pair, backward 10*D*Hq (the
formulas registered in brcompile.backends.attention.op). TFLOP/s of each method counts its own pairs (the tree's
for tree and flex, G*L(L+1)/2 for sdpa) and is set against a measured bf16 matmul peak. "tree speedup" is
the method's fwd+bwd time over the tree kernel's.

First it checks the kernels against the float64 reference on a small nested, padded tree (fp32 and
bf16), and Flex's mask on that tree, so a wrong mask cannot produce a fast number. Configurations whose
estimated time or memory does not fit the budget are skipped with a note.

    python benchmarks/bench_triton_attention.py --out benchmarks/out/triton_attention.md
    python benchmarks/bench_triton_attention.py --quick --out /tmp/t.md      # G=8, P 8k/32k, T 512
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import prompt_tails_tree  # noqa: E402  (the same tree as the CPU benchmark)

log = logging.getLogger("bench_triton_attention")

HQ, HKV, D = 32, 8, 128
FWD_FLOPS_PER_PAIR = 4 * D * HQ
BWD_FLOPS_PER_PAIR = 10 * D * HQ
ASSUMED_EFFICIENCY = 0.35  # of the matmul peak, for the time estimate that decides skips


# ------------------------------------------------------------------------------------------ trees


def group_tree(g: int, p: int, t: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(end, valid, segments) of one prompt of p tokens followed by g distinct tails of t tokens."""
    return tuple(x.to(device) for x in prompt_tails_tree(p, g, t))


def visible_pairs(end: torch.Tensor, valid: torch.Tensor) -> int:
    """sum over valid keys k of (end[k] - k): the (query, key) pairs tree attention computes."""
    span = end - torch.arange(end.numel(), device=end.device)
    return int(span.masked_fill(~valid, 0).sum())


def small_nested_tree(device, length: int = 700):
    """A ragged, right-padded batch of 3 groups x 5 rows of at most ``length`` tokens with branching
    responses (rows share 0, 10 or 20 response tokens), via brcompile.runtime.tree.build_tree."""
    from brcompile.runtime.tree import build_tree

    g = torch.Generator().manual_seed(0)
    rows, masks = [], []
    for _ in range(3):
        prompt = torch.randint(0, 50, (int(torch.randint(length // 7, length // 2, (1,), generator=g)),), generator=g)
        shared = torch.randint(0, 50, (20,), generator=g)
        for r in range(5):
            tail = torch.randint(0, 50, (int(torch.randint(1, length // 2, (1,), generator=g)),), generator=g)
            row = torch.cat([prompt, shared[: 10 * (r % 3)], tail])[:length]
            rows.append(torch.cat([row, torch.zeros(length - row.numel(), dtype=row.dtype)]))
            masks.append(torch.arange(length) < row.numel())
    tree = build_tree(torch.stack(rows), torch.stack(masks))
    return tuple(t.to(device) for t in (tree.end, tree.valid, tree.segments, tree.position))


# ----------------------------------------------------------------------------------------- timing


def cuda_time(fn, cap_s: float, max_reps: int) -> tuple[float, int]:
    """(median seconds, reps) of fn(); one untimed warm-up call, then up to max_reps within ~cap_s."""
    fn()
    torch.cuda.synchronize()
    times = []
    while len(times) < max_reps:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
        if sum(times) > cap_s:
            break
    return statistics.median(times), len(times)


def matmul_peak_tflops(device) -> float:
    """Measured dense bf16 matmul rate (8192^3), the ceiling the table is set against."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    sec, _ = cuda_time(lambda: a @ b, cap_s=1.0, max_reps=20)
    return 2 * 8192 ** 3 / sec / 1e12


# ---------------------------------------------------------------------------------------- methods


@dataclass
class Result:
    g: int
    p: int
    t: int
    method: str
    pairs: int
    fwd_s: float | None = None
    fwdbwd_s: float | None = None
    reps: int = 0
    note: str = ""
    extra: dict = field(default_factory=dict)


def _fwd_bwd(run, inputs, grad):
    """A closure doing forward then backward w.r.t. inputs (grads returned, never accumulated)."""
    def step():
        out = run(*inputs)
        torch.autograd.grad(out, inputs, grad)
    return step


def tree_method(end, valid, segments, scale):
    from brcompile.backends.attention.triton import tree_attention

    def run(q, k, v):
        return tree_attention(q, k, v, end, valid, segments, scale)[0]
    return run


_FLEX = {}


def compiled_flex():
    """One torch.compile'd flex_attention for the whole run (automatic dynamic shapes after the first
    size change, so the grid does not pay a full compile per configuration)."""
    if "fn" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX["fn"] = torch.compile(flex_attention)
    return _FLEX["fn"]


def flex_method(end, valid, n, scale, device):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < end[kv_idx]) & valid[kv_idx]

    try:
        block_mask = create_block_mask(mask_mod, None, None, n, n, device=device, _compile=True)
    except TypeError:  # a signature without _compile
        block_mask = create_block_mask(mask_mod, None, None, n, n, device=device)
    flex = compiled_flex()

    def run(q, k, v):
        out = flex(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), block_mask=block_mask, scale=scale,
                   enable_gqa=True)
        return out.squeeze(0)
    return run


def sdpa_method(scale, device):
    """Flash SDPA with native GQA; if this torch's flash kernel refuses enable_gqa, K/V heads are
    expanded inside the timed function (the expand's backward is a sum, small next to attention)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attend(q, k, v, gqa):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            if gqa:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            rep = q.shape[1] // k.shape[1]
            return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                  is_causal=True, scale=scale)

    probe = [torch.randn(1, h, 256, D, device=device, dtype=torch.bfloat16) for h in (HQ, HKV, HKV)]
    try:
        attend(*probe, gqa=True)
        gqa = True
    except RuntimeError as e:
        log.info("flash SDPA without enable_gqa (%s); expanding K/V heads", str(e).splitlines()[0])
        gqa = False

    def run(q, k, v):
        return attend(q, k, v, gqa)
    return run


def measure(make_run, shapes, dtype, device, cap_s, max_reps):
    """(fwd_s, fwdbwd_s, reps) of one method on fresh random inputs of the given shapes; the forward is
    timed in training mode (autograd recording), so it reuses the graphs compiled for fwd+bwd."""
    gen = torch.Generator(device=device).manual_seed(0)
    inputs = [torch.randn(s, device=device, dtype=dtype, generator=gen).requires_grad_() for s in shapes]
    grad = torch.randn(shapes[0], device=device, dtype=dtype, generator=gen)
    run = make_run()
    fwd_s, _ = cuda_time(lambda: run(*inputs), cap_s / 3, max_reps)  # training-mode forward
    fb_s, reps = cuda_time(_fwd_bwd(run, inputs, grad), cap_s, max_reps)
    del inputs, grad, run
    return fwd_s, fb_s, reps


# ------------------------------------------------------------------------------------------ checks


#: (sliding window, logit soft-cap, relative-bias extent E) variants the kernels are checked with: plain,
#: Mistral/Gemma-like window, Gemma2-like cap, both; an Inkling2-like relative bias (a per-query [Hq, N, E] table,
#: its gradient dR checked too), alone and with window and cap.
CHECK_VARIANTS = ((0, 0.0, 0), (64, 0.0, 0), (0, 30.0, 0), (64, 30.0, 0), (0, 0.0, 96), (64, 30.0, 48))


def check_small_case(device, length: int = 700, dtypes=((torch.float32, 1e-4), (torch.bfloat16, 5e-2)),
                     variants=CHECK_VARIANTS, flex: bool = True) -> list[str]:
    """Kernels (fp32 and bf16; with and without a sliding window, soft-capping and a relative bias) and Flex's
    mask vs the float64 reference on a nested, padded tree."""
    from brcompile.backends.attention.reference import reference_backward, reference_forward
    from brcompile.backends.attention.triton import tree_attention_backward, tree_attention_forward

    end, valid, segments, position = small_nested_tree(device, length)
    n = end.numel()
    lines = [f"check tree: N={n} tokens, {segments.shape[0]} segments, {int((~valid).sum())} padding keys"]
    gen = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(4, n, 64, device=device, generator=gen, dtype=torch.float64)
    k = torch.randn(2, n, 64, device=device, generator=gen, dtype=torch.float64)
    v = torch.randn(2, n, 64, device=device, generator=gen, dtype=torch.float64)
    go = torch.randn(4, n, 64, device=device, generator=gen, dtype=torch.float64)
    scale = 64 ** -0.5
    ok = True
    for window, softcap, extent in variants:
        extra = dict(window=window, position=position if window or extent else None, softcap=softcap)
        rel = torch.randn(4, n, extent, device=device, generator=gen, dtype=torch.float64) if extent else None
        r_out, r_lse = reference_forward(q, k, v, end, valid, segments, scale, relbias=rel, **extra)
        refs = (r_out,) + reference_backward(go, q, k, v, r_out, r_lse, end, valid, segments, scale, relbias=rel,
                                             **extra)
        for dtype, bound in dtypes:
            qc, kc, vc, goc = (t.to(dtype) for t in (q, k, v, go))
            relc = None if rel is None else rel.to(dtype)
            out, lse = tree_attention_forward(qc, kc, vc, end, valid, segments, scale, relbias=relc, **extra)
            grads = tree_attention_backward(goc, qc, kc, vc, out, lse, end, valid, segments, scale, relbias=relc,
                                            **extra)
            errs = {name: ((got.double() - ref).abs().max() / ref.abs().max().clamp(min=1)).item()
                    for name, got, ref in zip(("out", "dq", "dk", "dv", "dR"), (out,) + tuple(grads), refs)}
            good = max(errs.values()) <= bound
            ok &= good
            lines.append(f"triton {str(dtype).replace('torch.', '')} window={window} softcap={softcap:g}"
                         + (f" relbias E={extent}" if extent else "") + ": "
                         "max error / max|ref| " + ", ".join(f"{k}={v:.1e}" for k, v in errs.items())
                         + f" (bound {bound:g}) " + ("OK" if good else "FAILED"))
    r_out, _ = reference_forward(q, k, v, end, valid, segments, scale)
    try:
        if not flex:
            raise RuntimeError("not requested")
        flex = flex_method(end, valid, n, scale, device)
        out = flex(q.float(), k.float(), v.float())
        err = ((out.double() - r_out).abs().max() / r_out.abs().max()).item()
        good = err <= 1e-3
        ok &= good
        lines.append(f"flex mask (fp32): max error / max|ref| = {err:.1e} " + ("OK" if good else "FAILED"))
    except Exception as e:  # noqa: BLE001 - a missing/unsupported Flex is reported, not fatal
        lines.append(f"flex check skipped: {type(e).__name__}: {e}")
    if not ok:
        lines.append("CHECK FAILED: timings below are not trustworthy")
    return lines


# -------------------------------------------------------------------------------------------- main


def configs(quick: bool):
    if quick:
        return [(8, 8192, 512), (8, 32768, 512)]
    grid = [(g, p, t) for p in (8192, 32768, 131072) for t in (512, 2048) for g in (8, 16)]
    return sorted(grid, key=lambda c: c[1] + c[0] * c[2])


def bytes_needed(method, g, p, t) -> int:
    """Rough peak bytes of one fwd+bwd: inputs, outputs, grads, upstream grad (bf16) and row stats."""
    if method == "sdpa":
        rows, length = g, p + t
    else:
        rows, length = 1, p + g * t
    big = rows * HQ * length * D * 2  # q, out, dq, grad_out
    small = rows * HKV * length * D * 2  # k, v, dk, dv
    return 4 * big + 4 * small + rows * HQ * length * 8


def run_benchmark(args) -> list[Result]:
    device = torch.device("cuda")
    deadline = time.monotonic() + args.budget_s
    results: list[Result] = []
    scale = D ** -0.5
    compiled: set[str] = set()  # methods whose kernels/graphs are compiled already (warm-up is cheap)
    for g, p, t in configs(args.quick):
        end, valid, segments = group_tree(g, p, t, device)
        n = end.numel()
        tree_pairs = visible_pairs(end, valid)
        dense_pairs = g * (p + t) * (p + t + 1) // 2
        from brcompile.backends.attention.triton import build_key_tiles, default_launch_config

        cfg = default_launch_config(D, torch.bfloat16, device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tiles = build_key_tiles(segments, n, cfg.fwd.block_m, cfg.fwd.block_n, end)
        torch.cuda.synchronize()
        tiles_ms = (time.perf_counter() - t0) * 1e3
        methods = {
            "tree": (lambda: tree_method(end, valid, segments, scale), [(HQ, n, D), (HKV, n, D), (HKV, n, D)],
                     tree_pairs),
            "flex": (lambda: flex_method(end, valid, n, scale, device), [(HQ, n, D), (HKV, n, D), (HKV, n, D)],
                     tree_pairs),
            "sdpa": (lambda: sdpa_method(scale, device), [(g, HQ, p + t, D), (g, HKV, p + t, D), (g, HKV, p + t, D)],
                     dense_pairs),
        }
        for name, (make_run, shapes, pairs) in methods.items():
            res = Result(g, p, t, name, pairs)
            if name == "tree":
                res.extra = {"N": n, "tiles": tiles.num_tiles, "tiles_ms": tiles_ms}
            results.append(res)
            est = pairs * (FWD_FLOPS_PER_PAIR + BWD_FLOPS_PER_PAIR) / (ASSUMED_EFFICIENCY * args.peak * 1e12)
            warm = {"tree": 30.0, "flex": 90.0, "sdpa": 5.0}[name] if name not in compiled else 5.0
            left = deadline - time.monotonic()
            free, _ = torch.cuda.mem_get_info()
            need = bytes_needed(name, g, p, t)
            if name in args.skip:
                res.note = "skipped (--skip)"
            elif need > 0.85 * free:
                res.note = f"skipped: needs ~{need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"
            elif est > args.max_call_s:
                res.note = f"skipped: est. {est:.0f} s per fwd+bwd > --max-call-s {args.max_call_s:g}"
            elif 3.5 * est + warm > left:
                res.note = f"skipped: est. {3.5 * est + warm:.0f} s with warm-up > {left:.0f} s budget left"
            else:
                try:
                    res.fwd_s, res.fwdbwd_s, res.reps = measure(make_run, shapes, torch.bfloat16,
                                                                device, cap_s=min(args.cap_s, left / 4),
                                                                max_reps=args.max_reps)
                    compiled.add(name)
                except torch.cuda.OutOfMemoryError:
                    res.note = "out of memory"
                except Exception as e:  # noqa: BLE001 - one failing baseline must not end the run
                    res.note = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
                finally:
                    torch.cuda.empty_cache()
            print(format_line(res, args.peak), flush=True)
        del end, valid, segments, tiles
    return results


def tflops(res: Result, seconds: float | None, bwd: bool) -> float | None:
    if not seconds:
        return None
    per_pair = FWD_FLOPS_PER_PAIR + (BWD_FLOPS_PER_PAIR if bwd else 0)
    return res.pairs * per_pair / seconds / 1e12


def format_line(res: Result, peak: float) -> str:
    if res.fwdbwd_s is None:
        return f"G={res.g:2d} P={res.p:6d} T={res.t:4d} {res.method:5s} {res.note}"
    tf = tflops(res, res.fwdbwd_s, True)
    return (f"G={res.g:2d} P={res.p:6d} T={res.t:4d} {res.method:5s} fwd {res.fwd_s * 1e3:9.2f} ms  "
            f"fwd+bwd {res.fwdbwd_s * 1e3:9.2f} ms  {tf:6.1f} TFLOP/s ({100 * tf / peak:4.1f}% of peak)"
            f"  reps={res.reps} {res.note}")


def markdown(results: list[Result], peak: float, check_lines: list[str], args) -> str:
    tree_time = {(r.g, r.p, r.t): r.fwdbwd_s for r in results if r.method == "tree"}
    out = ["# Triton tree attention: fwd+bwd vs FlexAttention and per-row causal SDPA", "",
           f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton "
           f"{__import__('triton').__version__}; bf16, Hq/Hkv = {HQ}/{HKV}, D = {D}; "
           f"measured bf16 matmul peak {peak:.0f} TFLOP/s.", "",
           "Visible-pair FLOPs: fwd 4·D·Hq, bwd 10·D·Hq per (query, key) pair; each method counts its own "
           "pairs (tree and flex: the tree's; sdpa: G·L(L+1)/2 over the dense batch). "
           "tree speedup = method time / tree time (fwd+bwd).", "", "Check (small nested, padded tree):", ""]
    out += [f"- {line}" for line in check_lines]
    out += ["", "| G | P | T | method | N or G×L | pairs | fwd ms | fwd+bwd ms | TFLOP/s | % peak | tree speedup | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        size = r.extra.get("N", r.g * (r.p + r.t) if r.method == "sdpa" else r.p + r.g * r.t)
        tf = tflops(r, r.fwdbwd_s, True)
        tt = tree_time.get((r.g, r.p, r.t))
        speed = f"{r.fwdbwd_s / tt:.2f}×" if (tt and r.fwdbwd_s and r.method != "tree") else ""
        note = r.note
        if r.method == "tree" and "tiles" in r.extra:
            note = (note + " " if note else "") + f"{r.extra['tiles']} key tiles, built in {r.extra['tiles_ms']:.1f} ms"
        out.append("| " + " | ".join([
            str(r.g), str(r.p), str(r.t), r.method, str(size), f"{r.pairs:.3e}",
            f"{r.fwd_s * 1e3:.2f}" if r.fwd_s else "", f"{r.fwdbwd_s * 1e3:.2f}" if r.fwdbwd_s else "",
            f"{tf:.1f}" if tf else "", f"{100 * tf / peak:.1f}" if tf else "", speed, note]) + " |")
    out += ["", f"Settings: budget {args.budget_s:g} s, per-call cap {args.max_call_s:g} s, "
            f"timing cap {args.cap_s:g} s, max reps {args.max_reps}; median of the timed reps after one warm-up."]
    return "\n".join(out) + "\n"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/out/triton_attention.md", help="markdown table path")
    ap.add_argument("--quick", action="store_true", help="G=8, P in {8k, 32k}, T=512 only")
    ap.add_argument("--budget-s", type=float, default=400.0, help="wall-clock budget for the timed grid")
    ap.add_argument("--max-call-s", type=float, default=12.0,
                    help="skip a method whose estimated fwd+bwd takes longer than this")
    ap.add_argument("--cap-s", type=float, default=4.0, help="timing budget per measurement")
    ap.add_argument("--max-reps", type=int, default=10)
    ap.add_argument("--skip", nargs="*", default=[], choices=["tree", "flex", "sdpa"])
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_triton_attention: needs a CUDA GPU (none found); nothing measured. "
              "The kernels' CPU checks are tests/backends/attention/test_triton_attention.py (TRITON_INTERPRET=1).")
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("bench_triton_attention: triton is not installed; nothing measured.")
        return 1
    logging.basicConfig(level=logging.INFO)
    start = time.monotonic()
    device = torch.device("cuda")
    check_lines = check_small_case(device)
    print("\n".join(check_lines), flush=True)
    args.peak = matmul_peak_tflops(device)
    print(f"bf16 matmul peak: {args.peak:.0f} TFLOP/s", flush=True)
    args.budget_s -= time.monotonic() - start
    results = run_benchmark(args)
    text = markdown(results, args.peak, check_lines, args)
    import os

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out} ({time.monotonic() - start:.0f} s)")
    return 0 if not any("FAILED" in line for line in check_lines) else 2


if __name__ == "__main__":
    sys.exit(main())
