"""Time brcompile.runtime.tree.build_tree on RL-shaped batches (median of repeats) and print the tree stats.

    python benchmarks/bench_tree.py [--device cpu|cuda] [--repeats 3]

Batches: G groups of R rollouts; each group a prompt (lengths vary by group), a response prefix shared by
the group, then ragged per-row tails, right-padded to L with a mask (tokens + mask + position ids).
"""
import argparse
import statistics
import time

import torch

from brcompile.runtime import tree as tree_mod
from brcompile.runtime.tree import build_tree

VOCAB = 32000


def rl_batch(groups, rows_per_group, length, prompt, shared_response, seed=0, device="cpu"):
    """(tokens, mask, positions) [B, L]: group g's prompt has length prompt * (1 - g / (4 * groups)) (at
    least 1); its rows share shared_response response tokens, then random tails of ragged length (from
    L / 2 to L), right-padded with 0."""
    g = torch.Generator().manual_seed(seed)
    B = groups * rows_per_group
    tokens = torch.randint(1, VOCAB, (B, length), generator=g)
    lengths = torch.randint(length // 2, length + 1, (B,), generator=g)
    for group in range(groups):
        rows = slice(group * rows_per_group, (group + 1) * rows_per_group)
        shared = min(length, max(1, prompt - prompt * group // (4 * groups)) + shared_response)
        tokens[rows, :shared] = tokens[group * rows_per_group, :shared].clone()
        lengths[rows] = lengths[rows].clamp(min=shared)
    mask = torch.arange(length) < lengths.unsqueeze(1)
    tokens = tokens.masked_fill(~mask, 0)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    return tokens.to(device), mask.to(device), positions.to(device)


def time_build(inputs, mask, repeats, device, hash_fn=None):
    """(median wall seconds, min wall seconds, median process CPU seconds, last tree) of build_tree over
    `repeats` runs after one warm-up. CPU time (all threads) and the minimum are less sensitive to other
    processes sharing the cores."""
    build_tree(inputs, mask, hash_fn=hash_fn)
    walls, cpus = [], []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        tree = build_tree(inputs, mask, hash_fn=hash_fn)
        if device.type == "cuda":
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), min(walls), statistics.median(cpus), tree


def zero_hash(codes):
    """A hash where everything collides: forces the exact sort (the fallback's cost)."""
    return torch.zeros_like(codes[0])


CASES = [
    # name, groups, rows/group, L, prompt, shared response, hash
    ("8x8 L=32768, 24k prompts", 8, 8, 32768, 24576, 256, None),
    ("8x8 L=32768, 24k prompts, exact fallback", 8, 8, 32768, 24576, 256, zero_hash),
    ("64 unrelated rows L=32768", 64, 1, 32768, 0, 0, None),
    ("16x16 L=16384, 12k prompts", 16, 16, 16384, 12288, 128, None),
    ("32x8 L=4096, 3k prompts", 32, 8, 4096, 3072, 64, None),
    ("128x8 L=1024, 512 prompts", 128, 8, 1024, 512, 32, None),
    ("256x8 L=1024, 512 prompts", 256, 8, 1024, 512, 32, None),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}; "
          f"times: median wall of {args.repeats} (min wall, median process CPU time)")
    for name, groups, rows, length, prompt, shared, hash_fn in CASES:
        tokens, mask, positions = rl_batch(groups, rows, length, prompt, shared, device=device)
        before = dict(tree_mod.counters)
        wall, fastest, cpu, tree = time_build([tokens, positions], mask, args.repeats, device, hash_fn)
        changed = [k for k in tree_mod.counters if k != "builds" and tree_mod.counters[k] != before.get(k, 0)]
        s = tree.stats
        print(
            f"{name:42s} {wall * 1e3:7.1f} ms (min {fastest * 1e3:7.1f}, cpu {cpu * 1e3:7.1f})  "
            f"B={s.rows} L={length} "
            f"N={s.executed_tokens} valid={s.valid_tokens} dedup={s.dedup_ratio:.2f} segments={s.segments} "
            f"path={','.join(sorted(changed))}"
        )


if __name__ == "__main__":
    main()
