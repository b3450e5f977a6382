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


# ----------------------------------------------------------------------------------------------------
# The needed positions and the needed tree, by hand


def _needed(ids, *, am=None, cm=None, labels=None, window=0, model_mask=True):
    """needed_mask and count_needed of a hand-made batch (ids, attention and completion masks as lists)."""
    ids = torch.tensor(ids)
    am_t = None if am is None else torch.tensor(am)
    live = harness.needed_mask(tuple(ids.shape), attention_mask=am_t if model_mask else None,
                               loss_mask=None if cm is None else torch.tensor(cm),
                               labels=None if labels is None else torch.tensor(labels), window=window)
    return live, harness.count_needed(ids, live, window)


def test_needed_right_padding():
    """Rows [5 6 | 7 8 . .] and [5 6 | 9 . . .] (prompt | response, right-padded). live[t] = cm[t + 1]:
    row 0 at t = 1, 2, row 1 at t = 1; needed = visible columns up to the last live one: t <= 2 and t <= 1.
    Tree: 5, 56, 567, 5678 and two pads | 569 and three pads = 10 nodes; needed 5, 56, 567 = 3 (row 1's are
    row 0's); live 56, 567 = 2; pairs 1 + 2 + 3 = 6. The last real token of a row (8, 9) predicts nothing:
    not needed."""
    live, n = _needed([[5, 6, 7, 8, 0, 0], [5, 6, 9, 0, 0, 0]], am=[[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]],
                      cm=[[0, 0, 1, 1, 0, 0], [0, 0, 1, 0, 0, 0]])
    assert live.live.tolist() == [[False, True, True, False, False, False], [False, True, False, False, False, False]]
    assert live.needed.sum(1).tolist() == [3, 2]
    assert (n.tree_nodes, n.nodes, n.live_nodes, n.pairs, n.needed_positions, n.live_positions) == (10, 3, 2, 6, 5, 3)
    ids = torch.tensor([[5, 6, 7, 8, 0, 0], [5, 6, 9, 0, 0, 0]])
    assert harness.count_tree(ids, (ids != 0).long()).nodes == n.tree_nodes   # two independent tree counts agree


def test_needed_right_padding_labels_and_no_mask():
    """The same batch from labels (-100 = ignored) instead of a completion mask, and with the model called
    without an attention mask: the pads follow the last live column, so nothing changes (3 nodes, 6 pairs)."""
    ids = [[5, 6, 7, 8, 0, 0], [5, 6, 9, 0, 0, 0]]
    labels = [[-100, -100, 7, 8, -100, -100], [-100, -100, 9, -100, -100, -100]]
    am = [[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]]
    for kw in (dict(labels=labels, am=am), dict(cm=am, labels=labels, am=am), dict(labels=labels, am=am, model_mask=False)):
        live, n = _needed(ids, **kw)
        assert (n.nodes, n.live_nodes, n.pairs) == (3, 2, 6), kw
    live, _ = _needed(ids, labels=labels, am=am, model_mask=False)
    assert bool(live.key_visible.all())


def test_needed_left_padding_and_window():
    """TRL's layout: rows [. . 5 6 | 7 8] and [. 4 5 6 | 9 .] (prompts left-padded). live: row 0 at t = 3, 4,
    row 1 at t = 3. needed: the visible columns up to there, row 0 t = 2..4, row 1 t = 1..3 (the left pads are
    no keys). Tree (the mask bit is part of a node): the two rows share only their first pad: 1 + 5 + 5 = 11
    nodes; needed 6 (no two rows share a needed prefix), live 3, pairs (1 + 2 + 3) * 2 = 12.
    logits_to_keep = 2 (window: columns 4, 5): only row 0's t = 4 is read: needed t = 2..4 of row 0, 6 pairs."""
    ids = [[0, 0, 5, 6, 7, 8], [0, 4, 5, 6, 9, 0]]
    am = [[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0]]
    cm = [[0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 0]]
    live, n = _needed(ids, am=am, cm=cm)
    assert live.needed.long().tolist() == [[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0]]
    assert (n.tree_nodes, n.nodes, n.live_nodes, n.pairs) == (11, 6, 3, 12)
    _, n3 = _needed(ids, am=am, cm=cm, window=3)   # logits_to_keep = C + 1 = 3 keeps every live position
    assert (n3.nodes, n3.live_nodes, n3.pairs, n3.window) == (6, 3, 12, 3)
    live2, n2 = _needed(ids, am=am, cm=cm, window=2)
    assert live2.live.long().tolist() == [[0, 0, 0, 0, 1, 0], [0] * 6]
    assert (n2.nodes, n2.live_nodes, n2.pairs) == (3, 1, 6)


def test_needed_left_padding_without_attention_mask():
    """The left-padded batch with the model called without a mask: every key is visible, the pads included.
    needed: row 0 t = 0..4, row 1 t = 0..3; tree over the ids alone: column 0 (pad) shared, so 5 + 3 = 8
    needed nodes; pairs: row 0 1+2+3+4+5 = 15, row 1's own columns 1..3: 2+3+4 = 9, 24 in all."""
    live, n = _needed([[0, 0, 5, 6, 7, 8], [0, 4, 5, 6, 9, 0]], am=[[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0]],
                      cm=[[0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 0]], model_mask=False)
    assert live.needed.sum(1).tolist() == [5, 4]
    assert (n.nodes, n.live_nodes, n.pairs) == (8, 3, 24)


def test_needed_keeps_a_masked_middle_position_as_key():
    """A multi-turn row [5 6 7 8 9 3] with the tool output 8 out of the loss (cm [0 0 1 0 1 1]): live t = 1, 3, 4;
    t = 0 and t = 2 are read by no loss term but attended by live queries: needed t = 0..4 (5 nodes, 15 pairs).
    A position with attention-mask bit 0 in the middle ([5 6 7 8 9], am [1 1 0 1 1], cm [0 0 0 1 1]): t = 2 is
    live (it predicts 8) though no key; needed t = 0..3; pairs: visible prefix counts 1, 2, 2, 3 = 8."""
    live, n = _needed([[5, 6, 7, 8, 9, 3]], am=[[1] * 6], cm=[[0, 0, 1, 0, 1, 1]])
    assert live.live.long().tolist() == [[0, 1, 0, 1, 1, 0]]
    assert live.needed.long().tolist() == [[1, 1, 1, 1, 1, 0]]
    assert (n.nodes, n.live_nodes, n.pairs) == (5, 3, 15)
    live, n = _needed([[5, 6, 7, 8, 9]], am=[[1, 1, 0, 1, 1]], cm=[[0, 0, 0, 1, 1]])
    assert live.needed.long().tolist() == [[1, 1, 1, 1, 0]]
    assert (n.nodes, n.live_nodes, n.pairs) == (4, 2, 8)


def test_needed_all_padding_row():
    """Rows [5 6 7 8] (cm [0 0 1 1]) and an all-padding row: the latter has no live position and needs
    nothing; row 0 needs t = 0..2. Tree 4 + 4 = 8 nodes; needed 3, live 2, pairs 6."""
    live, n = _needed([[5, 6, 7, 8], [0, 0, 0, 0]], am=[[1, 1, 1, 1], [0, 0, 0, 0]], cm=[[0, 0, 1, 1], [0, 0, 0, 0]])
    assert live.needed.sum(1).tolist() == [3, 0]
    assert (n.tree_nodes, n.nodes, n.live_nodes, n.pairs) == (8, 3, 2, 6)


def test_needed_shared_response_prefix():
    """A group of 3 sharing the prompt [5 6] and the first response token 7: rows [5 6 7 8 1], [5 6 7 9 2],
    [5 6 7 8 3], cm [0 0 1 1 1]. live t = 1..3, needed t = 0..3 per row (12 positions, 9 live). Tree: 5, 56, 567
    shared, 5678 (rows 0, 2) and 5679, then three last tokens: 8 nodes; needed 5, live 4 (56, 567, 5678, 5679);
    pairs 1 + 2 + 3 + 4 + 4 = 14."""
    live, n = _needed([[5, 6, 7, 8, 1], [5, 6, 7, 9, 2], [5, 6, 7, 8, 3]], am=[[1] * 5] * 3, cm=[[0, 0, 1, 1, 1]] * 3)
    assert (n.needed_positions, n.live_positions) == (12, 9)
    assert (n.tree_nodes, n.nodes, n.live_nodes, n.pairs) == (8, 5, 4, 14)


def test_needed_limit_formula():
    """The needed limit: body over the needed nodes, LM head over the live nodes, attention over the needed
    pairs; DPO's frozen reference adds one forward of each (4 + 14 FLOPs per pair and D, 3 + 1 head matmuls)."""
    config = GPTConfig(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=100)
    head = 6 * 64 * 100 * 400
    assert harness.lm_head_flops(config, 400) == head
    dense = harness.FlopCount(total=10_000_000 + head, attention=4_000_000)
    needed = harness.NeededCount(rows=4, logical=400, tree_nodes=150, nodes=100, live_nodes=40, pairs=1000,
                                 needed_positions=300, live_positions=120)
    limit = harness.needed_limit_flops(dense, needed, config)
    assert limit.attention == 3 * 4 * 1000 * 14 * 16
    assert limit.total == 6_000_000 // 4 + head * 40 // 400 + limit.attention
    dpo = harness.Passes(trained=1, frozen=1)
    assert (dpo.matmul_passes, dpo.pair_flops_per_d) == (4, 18)
    head_dpo = harness.lm_head_flops(config, 400, dpo)
    assert head_dpo == 8 * 64 * 100 * 400
    dense = harness.FlopCount(total=10_000_000 + head_dpo, attention=4_000_000)
    limit = harness.needed_limit_flops(dense, needed, config, dpo)
    assert limit.attention == 3 * 4 * 1000 * 18 * 16
    assert limit.total == 6_000_000 // 4 + head_dpo * 40 // 400 + limit.attention


def test_needed_mask_rejects_bad_shift_and_window():
    with pytest.raises(ValueError, match="shift"):
        harness.live_positions(torch.ones(2, 3, dtype=torch.bool), shift=3)
    with pytest.raises(ValueError, match="window"):
        harness.live_positions(torch.ones(2, 3, dtype=torch.bool), window=4)
