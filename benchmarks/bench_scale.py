"""Long context at scale: streaming replay of a GRPO step up to 2.1M logical positions.

    python benchmarks/bench_scale.py                       # CPU ladder, example GPT (about 15 minutes)
    python benchmarks/bench_scale.py --tiny                # seconds: the same flow on a tiny ladder
    python benchmarks/bench_scale.py --device cuda         # GPU: Qwen2-1.5B-shaped random model, bf16
    python benchmarks/bench_scale.py --out scale.md        # also write the markdown table
    python benchmarks/bench_scale.py --context-parallel 8  # the seed's batch split over 8 gloo ranks (below)

Each rung of the ladder is one GRPO batch (``num_prompts`` groups of ``G`` responses, prompts of P tokens,
responses of T tokens) run in a fresh subprocess, so its peak RSS (or CUDA peak) is its own. In the
worker: the model is built, ``torch.compile(grpo_loss, dynamic=True, backend=brcompile.backend(
mode="replay"))`` is warmed up on a small batch (the compile a trainer pays once), then the rung's batch runs
twice (forward + backward): the **first call** at that size (any recompile and the compile-time analysis
included: it must not grow with the batch) and a **steady call**. The first rung is also run densely
and compared (loss and every gradient) on a small batch (:data:`CHECK_BATCH`) — the exactness check before
anything is timed. On CUDA the ladder runs in one process (one compile; the allocator's peak is reset per
rung) and the first out-of-memory error ends it; on CPU each rung is a subprocess.

Columns: logical positions B·L, executed (packed) tokens N, first/steady call seconds, the peak memory
of the step above the model's own (CPU: RSS high-water mark after a reset; CUDA: max_memory_allocated),
and its parts, from the runtime's own records: parameters (+ grads), **prefix** = the prefix's saved
activations + the cached K/V (bytes saved for backward by the streaming node), **chunk** = the trunk's
activation bytes per token (the streaming split's estimate) x the largest chunk, **frontier** = the [N, D]
trunk output, **loss side** = the [B, L] inputs and per-position loss tensors, **tree** = the packed tree's
index arrays. **dense (projected)** = what a dense step would hold: the trunk's bytes per token x B·L,
B·L·V logits, and a [B, 1, L, L] bool mask. A rung that fails (out of memory, time) ends the ladder; the
largest that ran is reported.

**Context parallelism** (``--context-parallel R``): the seed's batch (``--groups`` 8 x ``--group-size`` 8 x
(``--prompt-len`` 32768 + ``--response-len`` 512) = 2.1M logical positions) over R gloo ranks spawned on this
machine (loopback; the port picked by the OS through a parent TCPStore; one thread per rank). Every rank builds the
model (same seed), compiles ``grpo_loss`` with ``brcompile.backend(mode="replay", context_parallel=WORLD)``, warms
it up on a small batch, then runs one forward + backward of the batch and all-reduces the gradients. Per rank: its
packed tokens and the cut's work (brcompile/runtime/context_parallel.py ``LastCut``; imbalance = max/min work - 1),
the step's peak RSS above the RSS before it (VmHWM after a reset) and the process's lifetime ``ru_maxrss``, the K/V
bytes received per attention layer (the earlier tokens its queries see) against an all-gather of the other pieces,
and seconds (step, all-reduce).
The same batch then runs on a 1-process group (the same code path, ``context_parallel`` over one rank: its whole
trunk in one piece) as the reference: the loss and the all-reduced gradients are compared with it (relative error),
and its step peak and seconds are the 1-rank column.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.harness import saved_activation_bytes  # noqa: E402
from benchmarks.bench_replay import maxrss_bytes, peak_bytes, reset_peak, rss_bytes  # noqa: E402

log = logging.getLogger(__name__)

#: (num_prompts, G, P, T) rungs.
CPU_LADDER = ((1, 16, 8192, 512), (1, 16, 16384, 512), (1, 16, 32768, 1024), (8, 8, 32768, 512))
GPU_LADDER = ((1, 8, 4096, 512), (1, 16, 16384, 1024), (1, 16, 32768, 1024), (2, 16, 32768, 1024),
              (4, 16, 32768, 1024), (8, 8, 32768, 512))
TINY_LADDER = ((1, 4, 48, 8), (2, 4, 96, 16))

#: Model shapes: (vocab, dim, layers, heads, kv_heads, hidden_dim).
MODELS = {
    "gpt-small": (256, 32, 2, 2, 1, 64),  # the CPU ladder: small enough for 2.1M positions on 24 GiB
    "gpt-tiny": (64, 16, 1, 2, 1, 32),
    "qwen2-1.5b": (151936, 1536, 28, 12, 2, 8960),
    "qwen2-tiny": (128, 32, 2, 4, 2, 64),
}


def _reset_peak(device: str) -> None:
    """Free what can be freed and reset the peak mark (CUDA allocator stats, or Linux's VmHWM)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_peak()


def _peak(device: str) -> int:
    return torch.cuda.max_memory_allocated() if device == "cuda" else peak_bytes()


def _current(device: str) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else rss_bytes()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build_model(name: str, device: str, dtype: torch.dtype):
    """(model, forward(ids, am) -> logits, config tuple) for a model name of :data:`MODELS`."""
    from examples.gpt import GPT, GPTConfig

    vocab, dim, layers, heads, kv, hidden = MODELS[name]
    cfg = GPTConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv, hidden_dim=hidden)
    if name.startswith("gpt"):
        model = GPT(cfg, seed=0).to(device=device, dtype=dtype)
        return model, model, cfg
    from examples.hf import qwen2_model

    with torch.device(device):  # initialised where it runs (1.5B parameters: seconds on a GPU)
        model = qwen2_model(cfg, max_positions=1 << 21, dtype=dtype)

    def forward(ids, am):
        return model(input_ids=ids, attention_mask=am, use_cache=False).logits
    return model, forward, cfg


def _batch(rung, vocab: int, device: str, dtype, seed: int = 0):
    from examples.grpo import make_grpo_batch

    k, g, p, t = rung
    b = make_grpo_batch(num_prompts=k, group_size=g, prompt_len=p, response_len=t, vocab_size=vocab, seed=seed,
                        device=device, dtype=dtype)
    return (b["input_ids"], b["attention_mask"], b["completion_mask"], b["advantages"], b["old_logprobs"])


#: The exactness check's batch (groups, G, P, T): small enough for a dense run of the GPU model.
CHECK_BATCH = (1, 4, 512, 64)


class Bench:
    """The model and its compiled GRPO loss, warmed up (the compile a trainer pays once)."""

    def __init__(self, args):
        import brcompile
        from examples.grpo import grpo_loss

        self.device, self.dtype = args.device, getattr(torch, args.dtype)
        torch.manual_seed(0)
        self.model, self.forward, self.cfg = build_model(args.model, self.device, self.dtype)
        self.params = [p for p in self.model.parameters()]
        self.backend = brcompile.backend(mode="replay", chunk_tokens=args.chunk_tokens, compiler=args.compiler,
                                         attention="triton" if self.device == "cuda" else "cpu")
        self.loss = grpo_loss
        self.fn = torch.compile(grpo_loss, dynamic=True, backend=self.backend)
        t0 = time.perf_counter()
        for seed, rung in ((1, (1, 2, 16, 4)), (2, (1, 3, 20, 5))):  # a second size: the dynamic graph
            torch.autograd.grad(self.fn(self.forward, *self.batch(rung, seed)), self.params)
        self.warmup_s = time.perf_counter() - t0

    def batch(self, rung, seed: int = 0):
        return _batch(rung, self.cfg.vocab_size, self.device, self.dtype, seed)

    def check(self) -> dict:
        """Loss and every gradient vs the dense (uncompiled) run on :data:`CHECK_BATCH`."""
        from brcompile.testing import rel_err

        batch = self.batch(CHECK_BATCH, seed=3)
        ref = self.loss(self.forward, *batch)
        gref = torch.autograd.grad(ref, self.params)
        out = self.fn(self.forward, *batch)
        gout = torch.autograd.grad(out, self.params)
        return {"loss_rel_err": rel_err(out.float(), ref.float()),
                "max_grad_rel_err": max(rel_err(a.float(), b.float()) for a, b in zip(gout, gref))}

    def run(self, rung) -> dict:
        """One rung: first and steady call, the step's peak memory and its parts (module docstring)."""
        import brcompile

        device, cfg = self.device, self.cfg
        before = brcompile.stats()
        batch = self.batch(rung)
        result = {"rung": list(rung), "logical": int(batch[0].numel()), "param_bytes":
                  sum(p.numel() * p.element_size() for p in self.params), "warmup_s": self.warmup_s}
        _reset_peak(device)
        base = _current(device)
        holder = []
        t0 = time.perf_counter()
        saved = saved_activation_bytes(lambda: holder.append(self.fn(self.forward, *batch)), exclude=set())
        grads = torch.autograd.grad(holder.pop(), self.params)
        _sync(device)
        result["first_s"] = time.perf_counter() - t0
        result["step_peak"] = _peak(device) - base
        del grads
        t0 = time.perf_counter()
        torch.autograd.grad(self.fn(self.forward, *batch), self.params)
        _sync(device)
        result["steady_s"] = time.perf_counter() - t0
        s = brcompile.stats()
        reasons = {k: v - before.fallback_reasons.get(k, 0) for k, v in s.fallback_reasons.items()
                   if v > before.fallback_reasons.get(k, 0)}
        result.update(replayed=s.replayed_calls - before.replayed_calls,
                      streamed=s.streamed_calls - before.streamed_calls, fallbacks=reasons)
        rec = next(r for r in reversed(self.backend.records) if r.rewritten)
        rt = rec.runtime
        tree = rt.last_tree
        sched = rt.streaming.trunk.last_schedule if rt.streaming is not None else None
        largest = 0 if sched is None else max((c.tokens for c in sched.chunks), default=0)
        n = tree.stats.executed_tokens
        bpt = (rec.replay or {}).get("bytes_per_token", 0)
        elt = torch.tensor([], dtype=self.dtype).element_size()
        B, L = batch[0].shape
        result.update(
            executed=n, prefix_tokens=0 if sched is None else sched.prefix_tokens, largest_chunk=largest,
            saved_bytes=saved,
            kv_bytes=0 if sched is None else sched.prefix_tokens * cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * elt,
            chunk_bytes=bpt * largest, frontier_bytes=n * cfg.dim * elt,
            loss_side_bytes=sum(t.numel() * t.element_size() for t in batch) + 8 * B * L * 4,  # + ~8 fp32 [B, L]
            tree_bytes=sum(t.numel() * t.element_size() for t in (tree.index, tree.rep_row, tree.position, tree.end,
                                                                 tree.valid, tree.segments)),
            dense_projected=bpt * B * L + B * L * cfg.vocab_size * elt + B * L * L)
        return result


def worker(args) -> dict:
    """One rung in this process (the CPU ladder: a process per rung, so that its peak RSS is its own)."""
    bench = Bench(args)
    result = bench.check() if args.check else {}
    result.update(bench.run(tuple(args.rung)))
    return result


def in_process_ladder(args, ladder, limit: float) -> list[dict]:
    """The CUDA ladder: one process (compile once), the allocator's peak reset per rung; the first
    out-of-memory error (or the time limit) ends it."""
    t_start = time.perf_counter()
    bench = Bench(args)
    first = bench.check()
    print(f"  exactness vs dense on {CHECK_BATCH}: {first}; warm-up {bench.warmup_s:.0f} s", file=sys.stderr)
    results, last = [], 0.0
    for rung in ladder:
        left = limit - (time.perf_counter() - t_start)
        if left < 3 * last + 10:
            print(f"  time limit: stopping before {rung}", file=sys.stderr)
            break
        t0 = time.perf_counter()
        try:
            r = {**(first if not results else {}), **bench.run(rung)}
        except (torch.cuda.OutOfMemoryError, MemoryError) as e:
            results.append({"rung": list(rung), "error": f"OOM: {str(e).splitlines()[0][:200]}"})
            break
        finally:
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()
        last = time.perf_counter() - t0
        results.append(r)
        _report(rung, r)
    return results


def _report(rung, r: dict) -> None:
    print(f"  {rung}: logical {r['logical']:,}, executed {r['executed']:,}, first {r['first_s']:.1f} s, "
          f"steady {r['steady_s']:.1f} s, step peak {_gib(r['step_peak'])} GiB, replayed {r['replayed']} "
          f"(streamed {r['streamed']}), fallbacks {r['fallbacks']}", file=sys.stderr, flush=True)


def run_rung(args, rung, check: bool, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--rung", *map(str, rung), "--model", args.model, "--device",
           args.device, "--dtype", args.dtype, "--chunk-tokens", str(args.chunk_tokens), "--compiler",
           args.compiler] + (["--check"] if check else [])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    except subprocess.TimeoutExpired:
        return {"rung": list(rung), "error": f"time limit ({timeout:.0f} s)"}
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        oom = "out of memory" in proc.stderr.lower() or "can't allocate" in proc.stderr or proc.returncode == -9
        return {"rung": list(rung), "error": ("OOM: " if oom else "") + tail[0][:300],
                "stderr": proc.stderr[-3000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:,.2f}"


def markdown(results: list[dict], args) -> str:
    vocab, dim, layers, heads, kv, hidden = MODELS[args.model]
    lines = [f"{args.model} (vocab {vocab}, dim {dim}, {layers} layers, {heads} heads / {kv} kv, MLP {hidden}), "
             f"{args.dtype}, {args.device}; streaming replay (chunks <= {args.chunk_tokens} tokens), compiler "
             f"{args.compiler}; memory in GiB.", "",
             "| groups x G x P + T | logical B·L | executed N | first s | steady s | step peak | params | prefix "
             "(saved + K/V) | K/V | chunk | frontier | loss side | tree | dense (projected) |",
             "|---|" + "---|" * 13]
    for r in results:
        k, g, p, t = r["rung"]
        name = f"{k} x {g} x {p} + {t}"
        if "error" in r:
            lines.append(f"| {name} | {k * g * (p + t):,} | failed: {r['error']} |" + " |" * 11)
            continue
        lines.append(
            f"| {name} | {r['logical']:,} | {r['executed']:,} | {r['first_s']:.1f} | {r['steady_s']:.1f} | "
            f"{_gib(r['step_peak'])} | {_gib(r['param_bytes'])} | {_gib(r['saved_bytes'])} | {_gib(r['kv_bytes'])} | "
            f"{_gib(r['chunk_bytes'])} | {_gib(r['frontier_bytes'])} | {_gib(r['loss_side_bytes'])} | "
            f"{_gib(r['tree_bytes'])} | {_gib(r['dense_projected'])} |")
    ok = [r for r in results if "error" not in r]
    if ok:
        big = max(ok, key=lambda r: r["logical"])
        lines += ["", f"Largest rung that ran: {big['logical']:,} logical positions ({big['executed']:,} executed, "
                      f"{big['logical'] / big['executed']:.1f}x fewer)."]
    chk = [r for r in ok if "max_grad_rel_err" in r]
    if chk:
        lines.append(f"Exactness vs the dense run on a {CHECK_BATCH} batch: loss rel err {chk[0]['loss_rel_err']:.1e}, "
                     f"max grad rel err {chk[0]['max_grad_rel_err']:.1e}.")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------
# context parallelism: the seed's batch over R gloo ranks (module docstring)

#: The seed's batch: (groups, G, prompt, response) = 8 x 8 x (32768 + 512) = 2,129,920 logical positions.
SEED_BATCH = (8, 8, 32768, 512)
#: The warm-up batches of every rank (the compile a trainer pays once; two sizes: the dynamic graph).
CP_WARMUP = ((1, 2, 16, 4), (1, 3, 20, 5))


def _cp_rank(spec: dict) -> dict:
    """This rank's run of ``spec``'s batch under ``context_parallel`` over the default group (module docstring)."""
    import torch.distributed as dist

    import brcompile
    from examples.grpo import grpo_loss

    rank, ranks = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, spec["dtype"])
    torch.manual_seed(0)
    model, forward, cfg = build_model(spec["model"], "cpu", dtype)
    params = list(model.parameters())
    backend = brcompile.backend(mode="replay", context_parallel=dist.group.WORLD, compiler=spec["compiler"],
                                attention="cpu")
    fn = torch.compile(grpo_loss, dynamic=True, backend=backend)
    t0 = time.perf_counter()
    for seed, rung in enumerate(CP_WARMUP, 1):
        torch.autograd.grad(fn(forward, *_batch(rung, cfg.vocab_size, "cpu", dtype, seed)), params)
    warmup_s = time.perf_counter() - t0
    batch = _batch(tuple(spec["rung"]), cfg.vocab_size, "cpu", dtype)
    brcompile.reset_stats()
    from torch._dynamo.utils import counters

    graphs_before = counters["stats"]["unique_graphs"]
    dist.barrier()
    reset_peak()
    base = rss_bytes()
    t0 = time.perf_counter()
    loss = fn(forward, *batch)
    grads = torch.autograd.grad(loss, params)
    step_s = time.perf_counter() - t0
    step_peak = peak_bytes() - base
    t1 = time.perf_counter()
    for g in grads:
        dist.all_reduce(g)
    allreduce_s = time.perf_counter() - t1
    dist.barrier()
    wall_s = time.perf_counter() - t0  # the step on every rank (the slowest's) + the all-reduce
    # graphs compiled during the step: a first call at this size (a piece's 0/1-sized arrays specialize)
    step_compiles = counters["stats"]["unique_graphs"] - graphs_before
    st = brcompile.stats()
    rec = next(r for r in reversed(backend.records) if r.rewritten and r.runtime.cp is not None
               and r.runtime.cp.trunk is not None and r.runtime.cp.trunk.last is not None)
    cut = rec.runtime.cp.trunk.last
    layers = cfg.n_layers
    result = dict(rank=rank, ranks=ranks, tokens=cut.tokens, stats_tokens=st.context_parallel_tokens,
                  offsets=cut.offsets, work=cut.work, cross_rows=cut.cross_rows,
                  kv_received_per_layer=cut.kv_bytes_received / layers,
                  kv_all_gather_per_layer=cut.kv_bytes_all_gather / layers,
                  cp_calls=st.context_parallel_calls, whole_calls=st.context_parallel_whole_calls,
                  whole_reasons=dict(st.context_parallel_reasons), fallbacks=dict(st.fallback_reasons),
                  loss=loss.item(), step_s=step_s, allreduce_s=allreduce_s, wall_s=wall_s, warmup_s=warmup_s,
                  step_peak=step_peak, base_rss=base, maxrss=maxrss_bytes(), logical=int(batch[0].numel()),
                  layers=layers, step_compiles=step_compiles)
    if rank == 0:
        result["grads"] = [g.detach().clone() for g in grads]
    log.info("rank %d/%d: %d tokens, step %.1f s, step peak %.2f GiB", rank, ranks, cut.tokens, step_s,
             step_peak / 2**30)
    return result


def _cp_worker(rank: int, ranks: int, port: int, spec: dict, out_dir: str) -> None:
    """A spawned rank: joins the group through the parent's TCPStore, runs :func:`_cp_rank`, saves its result."""
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ranks, timeout=datetime.timedelta(minutes=20))
    try:
        torch.save(_cp_rank(spec), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def launch_cp(spec: dict, ranks: int) -> list[dict]:
    """Spawns ``ranks`` processes (gloo, loopback) running :func:`_cp_rank` on ``spec``; their results by rank."""
    import tempfile

    import torch.distributed as dist
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        mp.start_processes(_cp_worker, args=(ranks, store.port, spec, tmp), nprocs=ranks, join=True,
                           start_method="spawn")
        log.info("%d rank(s): %.0f s including start-up and compile", ranks, time.perf_counter() - t0)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(ranks)]


def cp_summary(results: list[dict], ref: Optional[list[dict]] = None) -> dict:
    """The run's figures: tokens, work imbalance, K/V, memory, seconds, and against the 1-rank ``ref`` the loss's and
    the all-reduced gradients' relative errors."""
    from brcompile.testing import rel_err

    work = [w for w in results[0]["work"]]
    s = dict(ranks=len(results), logical=results[0]["logical"], tokens=[r["tokens"] for r in results],
             executed=sum(r["tokens"] for r in results), offsets=results[0]["offsets"], work=work,
             imbalance=max(work) / min(work) - 1.0, max_over_mean=max(work) / (sum(work) / len(work)) - 1.0,
             same_cut=all(r["offsets"] == results[0]["offsets"] for r in results),
             losses=[r["loss"] for r in results], wall_s=max(r["wall_s"] for r in results),
             step_peak_max=max(r["step_peak"] for r in results), maxrss_max=max(r["maxrss"] for r in results),
             all_split=all(r["cp_calls"] >= 1 and not r["whole_calls"] and not r["fallbacks"] for r in results))
    s["loss_spread"] = max(abs(x - s["losses"][0]) for x in s["losses"]) / max(abs(s["losses"][0]), 1.0)
    if ref is not None:
        r0 = ref[0]
        s.update(ref_loss=r0["loss"], ref_tokens=r0["tokens"], ref_step_peak=r0["step_peak"], ref_maxrss=r0["maxrss"],
                 ref_step_s=r0["step_s"], ref_wall_s=r0["wall_s"], ref_step_compiles=r0["step_compiles"],
                 loss_rel_err=abs(results[0]["loss"] - r0["loss"]) / max(abs(r0["loss"]), 1.0),
                 max_grad_rel_err=max(rel_err(a.double(), b.double())
                                      for a, b in zip(results[0]["grads"], r0["grads"])))
    return s


def cp_markdown(results: list[dict], s: dict, args) -> str:
    vocab, dim, layers, heads, kv, hidden = MODELS[args.model]
    k, g, p, t = args.cp_rung
    lines = [f"{args.model} (vocab {vocab}, dim {dim}, {layers} layers, {heads} heads / {kv} kv, MLP {hidden}), "
             f"{args.dtype}, cpu, compiler {args.compiler}; batch {k} groups x {g} x ({p} + {t}) = "
             f"{s['logical']:,} logical positions, {s['executed']:,} packed tokens; {s['ranks']} gloo rank(s), one "
             f"thread each, on {os.cpu_count()} cores; memory in GiB (step peak: RSS high-water mark of the "
             "forward + backward above the RSS before it; maxrss: the process's lifetime ru_maxrss).", "",
             "| rank | packed tokens | work | work / mean | K/V received per layer (MiB) | an all-gather's per layer "
             "(MiB) | cross rows | step peak | maxrss | step s | graphs compiled in the step | all-reduce s |",
             "|---|" + "---|" * 11]
    mean = sum(s["work"]) / len(s["work"])
    for r in results:
        w = s["work"][r["rank"]]
        lines.append(f"| {r['rank']} | {r['tokens']:,} | {w:.4g} | {w / mean:.3f} | "
                     f"{r['kv_received_per_layer'] / 2**20:,.2f} | {r['kv_all_gather_per_layer'] / 2**20:,.2f} | "
                     f"{r['cross_rows']} | {_gib(r['step_peak'])} | {_gib(r['maxrss'])} | {r['step_s']:.1f} | "
                     f"{r['step_compiles']} | {r['allreduce_s']:.2f} |")
    if "ref_loss" in s:
        lines.append(f"| 1-rank reference | {s['ref_tokens']:,} | {sum(s['work']):.4g} | - | 0 | 0 | 0 | "
                     f"{_gib(s['ref_step_peak'])} | {_gib(s['ref_maxrss'])} | {s['ref_step_s']:.1f} | "
                     f"{s['ref_step_compiles']} | - |")
    lines += ["", f"Tokens over the ranks: {s['executed']:,} (sum; every rank the same cut: {s['same_cut']}). "
                  f"Work imbalance: max/min - 1 = {s['imbalance']:.1%}, max/mean - 1 = {s['max_over_mean']:.1%} "
                  f"(goal: within 10%).",
              f"Wall clock of the step (slowest rank, + all-reduce): {s['wall_s']:.1f} s"
              + (f"; 1-rank reference: {s['ref_wall_s']:.1f} s." if "ref_wall_s" in s else "."),
              f"Largest step peak over the ranks: {_gib(s['step_peak_max'])} GiB"
              + (f" (1-rank reference: {_gib(s['ref_step_peak'])} GiB)." if "ref_step_peak" in s else ".")]
    if "ref_loss" in s:
        lines.append(f"Loss {s['losses'][0]:.9g} on every rank (spread {s['loss_spread']:.1e}) vs the 1-rank run "
                     f"{s['ref_loss']:.9g}: rel err {s['loss_rel_err']:.1e}; all-reduced gradients vs the 1-rank run: "
                     f"max rel err {s['max_grad_rel_err']:.1e}.")
    return "\n".join(lines)


def context_parallel_main(args) -> int:
    """``--context-parallel R``: the batch over R ranks, then the 1-rank reference; prints the table."""
    rung = tuple(args.cp_rung)
    spec = dict(model=args.model, dtype=args.dtype, compiler=args.compiler, rung=rung)
    print(f"  context parallel: {rung} over {args.context_parallel} rank(s) ...", file=sys.stderr, flush=True)
    results = launch_cp(spec, args.context_parallel)
    ref = None
    if args.context_parallel > 1 and not args.no_reference:
        print("  the 1-rank reference ...", file=sys.stderr, flush=True)
        ref = launch_cp(spec, 1)
    if args.raw:
        torch.save(dict(args=vars(args), results=results, ref=ref), args.raw)
    s = cp_summary(results, ref)
    table = cp_markdown(results, s, args)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    tol = 1e-4 if args.dtype == "float32" else 1e-9
    ok = (s["all_split"] and s["same_cut"] and s["executed"] == results[0]["offsets"][-1] and s["loss_spread"] == 0.0
          and (ref is None or (s["loss_rel_err"] <= tol and s["max_grad_rel_err"] <= tol)))
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--model", choices=sorted(MODELS), help="default: gpt-small on cpu, qwen2-1.5b on cuda")
    p.add_argument("--dtype", help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--chunk-tokens", type=int, default=4096)
    p.add_argument("--compiler", default="aot_eager", choices=("aot_eager", "inductor", "eager"),
                   help="how the packed graphs run (inductor fuses pointwise ops but compiles for minutes on a "
                        "28-layer model)")
    p.add_argument("--time-limit", type=float, default=None, help="seconds for the whole ladder (cuda: 480)")
    p.add_argument("--tiny", action="store_true", help="a tiny ladder and model (seconds): a smoke run")
    p.add_argument("--in-process", action="store_true",
                   help="run the ladder in this process, as on CUDA (default there), stopping at the first OOM")
    p.add_argument("--out", help="also write the markdown table to this file")
    p.add_argument("--context-parallel", type=int, metavar="R",
                   help="the seed's batch over R gloo ranks on this machine, then a 1-rank reference (CPU)")
    p.add_argument("--groups", type=int, default=SEED_BATCH[0], help="--context-parallel: prompts (groups)")
    p.add_argument("--group-size", type=int, default=SEED_BATCH[1], help="--context-parallel: responses per prompt")
    p.add_argument("--prompt-len", type=int, default=SEED_BATCH[2], help="--context-parallel: prompt tokens")
    p.add_argument("--response-len", type=int, default=SEED_BATCH[3], help="--context-parallel: response tokens")
    p.add_argument("--no-reference", action="store_true", help="--context-parallel: skip the 1-rank reference run")
    p.add_argument("--raw", help="--context-parallel: also save every rank's raw results (torch.save) to this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rung", type=int, nargs=4, help=argparse.SUPPRESS)
    p.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    cuda = args.device == "cuda"
    args.model = args.model or (("qwen2-tiny" if cuda else "gpt-tiny") if args.tiny else
                                ("qwen2-1.5b" if cuda else "gpt-small"))
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    if args.context_parallel:
        if cuda:
            raise SystemExit("--context-parallel runs gloo ranks on the CPU")
        args.cp_rung = (args.groups, args.group_size, args.prompt_len, args.response_len)
        return context_parallel_main(args)
    ladder = TINY_LADDER if args.tiny else (GPU_LADDER if cuda else CPU_LADDER)
    limit = args.time_limit or (480.0 if cuda else 3600.0)
    if cuda or args.in_process:
        results = in_process_ladder(args, ladder, limit)
    else:
        t_start = time.perf_counter()
        results = []
        for i, rung in enumerate(ladder):
            left = limit - (time.perf_counter() - t_start)
            if left < 30:
                print(f"  time limit: stopping before {rung}", file=sys.stderr)
                break
            r = run_rung(args, rung, check=(i == 0), timeout=left)
            results.append(r)
            if "error" in r:
                print(f"  {rung}: {r['error']}", file=sys.stderr)
                break
            _report(rung, r)
    table = markdown(results, args)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    ok = [r for r in results if "error" not in r]
    return 0 if ok and all(r["streamed"] >= 2 and not r["fallbacks"] for r in ok) else 1


if __name__ == "__main__":
    sys.exit(main())
