"""The bench's counters (benchmarks/harness.py): the prefix tree counted by hand, the limit formula, attention
FLOPs of CPU SDPA, FLOPs of compiled code."""
import pytest
import torch

from benchmarks import harness
from examples.gpt import GPTConfig


def test_bench_count_tree_by_hand():
    """Rows [5 6 7 8], [5 6 9 0], [5 6 7 8], [4 0 0 0] with pads (id 0, mask 0).
    Nodes: 5,6,7,8 | 9,pad | - | 4,pad,pad,pad = 10; tree pairs: valid ancestors (self included) per node:
    1+2+3+4 | 3+3 | 1+1+1+1 = 20; dense pairs: 10 + 9 + 10 + 4 = 33."""
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 0], [5, 6, 7, 8], [4, 0, 0, 0]])
    tree = harness.count_tree(ids, (ids != 0).long())
    assert (tree.rows, tree.logical, tree.nodes, tree.tree_pairs, tree.dense_pairs) == (4, 16, 10, 20, 33)


def test_bench_limit_formula():
    config = GPTConfig(dim=64, n_layers=3, n_heads=4, n_kv_heads=2)
    dense = harness.FlopCount(total=10_000_000, attention=4_000_000)
    tree = harness.TreeCount(rows=4, logical=400, nodes=100, tree_pairs=1000, dense_pairs=5000)
    limit = harness.limit_flops(dense, tree, config)
    assert limit.attention == 3 * 4 * 1000 * 14 * 16
    assert limit.total == 6_000_000 // 4 + limit.attention


def test_bench_counts_cpu_attention_flops():
    """FlopCounterMode alone counts nothing for CPU SDPA; the benchmark's mapping counts torch's formula:
    fwd 4 * B H L^2 D, bwd 10 * B H L^2 D."""
    q = torch.randn(2, 3, 7, 8, requires_grad=True)
    step = lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    count = harness.count_flops(step)
    assert count.attention == count.total == 14 * 2 * 3 * 7 * 7 * 8


def test_bench_flop_counter_counts_compiled_code_and_keeps_it_compiled():
    """Under FlopCounterMode Dynamo skips compiled code (and keeps skipping it); the benchmark's counter
    must count what the compiled callable runs, and leave it compiled."""
    calls = []

    def backend(gm, example_inputs):
        def run(*args):
            calls.append(1)
            return gm(*args)
        return run

    f = torch.compile(lambda w, x: (x @ w).relu().sum(), backend=backend)
    w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(7, 5, dtype=torch.float64)
    f(w, x)
    count = harness.count_flops(lambda: f(w, x).backward())
    assert len(calls) == 2
    assert count.total == 2 * (2 * 7 * 5 * 3) and count.attention == 0     # x @ w, and x^T @ grad for w
    f(w, x)
    assert len(calls) == 3


def test_bench_count_tree_window_by_hand():
    """Rows [5 6 7 8], [5 6 9 0], [5 6 7 8], [4 0 0 0]; the last 2 columns hold the nodes 7, 8 | 9, pad |
    pad, pad = 6 (row 3 repeats row 1)."""
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 0], [5, 6, 7, 8], [4, 0, 0, 0]])
    tree = harness.count_tree(ids, (ids != 0).long(), window=2)
    assert (tree.nodes, tree.window, tree.window_nodes) == (10, 2, 6)
    assert harness.count_tree(ids, (ids != 0).long(), window=4).window_nodes == tree.nodes
    with pytest.raises(ValueError, match="window"):
        harness.count_tree(ids, (ids != 0).long(), window=5)


def test_bench_limit_formula_with_a_head_window():
    """logits_to_keep: the head's dense FLOPs (6 dim vocab per position, B * window positions) scale by
    window_nodes / (B * window), the rest of the non-attention FLOPs by N / (B L)."""
    config = GPTConfig(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=100)
    head = 6 * 64 * 100 * 4 * 10
    assert harness.lm_head_flops(config, 4 * 10) == head
    dense = harness.FlopCount(total=10_000_000 + head, attention=4_000_000)
    tree = harness.TreeCount(rows=4, logical=400, nodes=100, tree_pairs=1000, dense_pairs=5000, window=10,
                                window_nodes=25)
    limit = harness.limit_flops(dense, tree, config)
    assert limit.attention == 3 * 4 * 1000 * 14 * 16
    assert limit.total == 6_000_000 // 4 + head * 25 // 40 + limit.attention
