"""Benchmark: tree_attention ("cpu" impl) vs dense per-row SDPA on one prompt + G tails.

For each (G, P, T): the logical batch is G rows of P prompt tokens + T tail tokens, all rows sharing the
prompt. Dense: F.scaled_dot_product_attention(is_causal=True, enable_gqa=True) on [G, Hq, P+T, D]. Tree:
brcompile::tree_attention on the N = P + G*T packed tokens. Each side is timed for forward + backward
(median of --reps), and the bytes saved for backward are measured with saved_tensors_hooks (sum of
untyped_storage().nbytes(), each storage counted once). "pair ratio" = dense causal (q, k) pairs /
tree visible pairs, the FLOP ratio of the two.

    python benchmarks/bench_attention.py            # full grid (G 4/8/16 x P 1024/4096 x T 128/512)
    python benchmarks/bench_attention.py --quick    # G 4/8, P 1024, T 128
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from brcompile.backends.attention.op import tree_attention


def prompt_tails_tree(p: int, g: int, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(end, valid, segments) of one prompt of p tokens followed by g tails of t tokens (DFS order:
    prompt, tail 0, tail 1, ...)."""
    n = p + g * t
    end = torch.empty(n, dtype=torch.int64)
    end[:p] = n
    segments = [(0, p, n)]
    for i in range(g):
        a, b = p + i * t, p + (i + 1) * t
        end[a:b] = b
        segments.append((a, b, b))
    return end, torch.ones(n, dtype=torch.bool), torch.tensor(segments, dtype=torch.int64)


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for backward while running fn()."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(storages.values())


def time_fwd_bwd(fn, inputs, reps: int) -> float:
    """Median seconds of fn() forward + backward with a fixed random upstream gradient."""
    times = []
    grad = None
    for _ in range(reps):
        for x in inputs:
            x.grad = None
        t0 = time.perf_counter()
        out = fn()
        if grad is None:
            grad = torch.randn_like(out)
        out.backward(grad)
        times.append(time.perf_counter() - t0)
        del out
    return statistics.median(times)


def run_case(g: int, p: int, t: int, hq: int, hkv: int, d: int, reps: int, dtype: torch.dtype) -> dict:
    """Time and saved bytes of tree vs dense attention for one (G, P, T)."""
    gen = torch.Generator().manual_seed(0)
    n = p + g * t
    tree = prompt_tails_tree(p, g, t)
    q = torch.randn(hq, n, d, generator=gen, dtype=dtype).requires_grad_()
    k = torch.randn(hkv, n, d, generator=gen, dtype=dtype).requires_grad_()
    v = torch.randn(hkv, n, d, generator=gen, dtype=dtype).requires_grad_()

    def tree_fn():
        return tree_attention(q, k, v, tree, impl="cpu")

    l = p + t
    qd = torch.randn(g, hq, l, d, generator=gen, dtype=dtype).requires_grad_()
    kd = torch.randn(g, hkv, l, d, generator=gen, dtype=dtype).requires_grad_()
    vd = torch.randn(g, hkv, l, d, generator=gen, dtype=dtype).requires_grad_()

    def dense_fn():
        return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)

    tree_s = time_fwd_bwd(tree_fn, (q, k, v), reps)
    dense_s = time_fwd_bwd(dense_fn, (qd, kd, vd), reps)
    tree_pairs = p * (p + 1) // 2 + g * (t * p + t * (t + 1) // 2)
    dense_pairs = g * l * (l + 1) // 2
    return {
        "G": g, "P": p, "T": t, "N": n, "logical": g * l,
        "tree_ms": tree_s * 1e3, "dense_ms": dense_s * 1e3, "speedup": dense_s / tree_s,
        "pair_ratio": dense_pairs / tree_pairs,
        "tree_saved_mb": saved_bytes(tree_fn) / 2**20, "dense_saved_mb": saved_bytes(dense_fn) / 2**20,
    }


def format_table(rows: list[dict]) -> str:
    """Fixed-width table of run_case results."""
    head = (f"{'G':>3} {'P':>5} {'T':>4} {'N':>6} {'logical':>7} {'tree ms':>9} {'dense ms':>9} "
            f"{'speedup':>7} {'pairs x':>7} {'tree MB':>8} {'dense MB':>8} {'mem x':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['G']:>3} {r['P']:>5} {r['T']:>4} {r['N']:>6} {r['logical']:>7} {r['tree_ms']:>9.1f} "
            f"{r['dense_ms']:>9.1f} {r['speedup']:>7.2f} {r['pair_ratio']:>7.2f} {r['tree_saved_mb']:>8.1f} "
            f"{r['dense_saved_mb']:>8.1f} {r['dense_saved_mb'] / r['tree_saved_mb']:>6.2f}"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small grid: G 4/8, P 1024, T 128")
    ap.add_argument("--G", type=int, nargs="+", default=None)
    ap.add_argument("--P", type=int, nargs="+", default=None)
    ap.add_argument("--T", type=int, nargs="+", default=None)
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per side (median)")
    ap.add_argument("--heads", type=int, nargs=2, default=(8, 2), metavar=("HQ", "HKV"))
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared, oversubscribed CPU, OpenMP barriers make "
                         "multi-threaded elementwise ops pathologically slow and the timings meaningless)")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    gs = args.G or ([4, 8] if args.quick else [4, 8, 16])
    ps = args.P or ([1024] if args.quick else [1024, 4096])
    ts = args.T or ([128] if args.quick else [128, 512])
    hq, hkv = args.heads
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, Hq={hq} Hkv={hkv} D={args.head_dim} "
          f"{args.dtype}, fwd+bwd median of {args.reps}", flush=True)
    run_case(2, 64, 16, hq, hkv, args.head_dim, 1, dtype)  # warm up kernels and op registration
    rows = []
    t0 = time.perf_counter()
    for p in ps:
        for t in ts:
            for g in gs:
                rows.append(run_case(g, p, t, hq, hkv, args.head_dim, args.reps, dtype))
                print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(format_table(rows))
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
