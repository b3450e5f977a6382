"""Sliding-window tree attention (HF's sliding window over tree positions) on the CPU impl.

Oracle: the reference impl (dense mask ``k <= q < end[k] & valid[k] & pos[q] - pos[k] < W``, float64),
itself checked against per-row dense SDPA with the same band mask: a windowed tree equals the dense batch.
"""
import pytest
import torch
import torch.nn.functional as F

import brcompile.backends.attention.cpu as cpu
from brcompile.backends.attention.op import tree_attention
from brcompile.runtime.tree import build_tree
from tests.helpers import grouped_rows, tree_qkv


def batch(seed: int, pad: bool):
    """3 groups with shared prompts and a shared response prefix; optional left padding and holes."""
    return grouped_rows(seed, pad)

qkv = tree_qkv


@pytest.mark.parametrize("window", [1, 2, 5, 100])
@pytest.mark.parametrize("pad", [False, True], ids=["dense", "padded"])
def test_reference_window_equals_dense_rows(window, pad):
    """Tree attention with a window, read back per row, equals dense SDPA with the band mask."""
    ids, am = batch(1, pad)
    tree = build_tree(ids, attention_mask=am)
    q, k, v = qkv(tree.stats.executed_tokens)
    out = tree_attention(q, k, v, tree, scale=0.4, impl="reference", window=window)
    B, L = ids.shape
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    band = (j <= i) & (i - j < window)
    for b in range(B):
        idx = tree.index[b]
        m = band & am[b].bool()[None, :]
        dense = F.scaled_dot_product_attention(q[:, idx][None], k[:, idx].repeat_interleave(2, 0)[None],
                                               v[:, idx].repeat_interleave(2, 0)[None], attn_mask=m, scale=0.4)[0]
        seen = m.any(1)  # rows that see nothing: SDPA gives NaN/0 there, tree attention 0
        torch.testing.assert_close(out[:, idx][:, seen], dense[:, seen], atol=1e-12, rtol=1e-12)
        assert bool((out[:, idx][:, ~seen] == 0).all())


@pytest.mark.parametrize("block", [512, 3])
@pytest.mark.parametrize("window", [1, 3, 6, 100])
@pytest.mark.parametrize("pad", [False, True], ids=["dense", "padded"])
def test_cpu_window_matches_reference(window, pad, block, monkeypatch):
    monkeypatch.setattr(cpu, "WINDOW_QUERY_BLOCK", block)
    ids, am = batch(2, pad)
    tree = build_tree(ids, attention_mask=am)
    q, k, v = qkv(tree.stats.executed_tokens)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=q.dtype)
    want = tree_attention(q, k, v, tree, scale=0.4, impl="reference", window=window)
    gwant = torch.autograd.grad((want * w).sum(), (q, k, v))
    got = tree_attention(q, k, v, tree, scale=0.4, impl="cpu", window=window)
    ggot = torch.autograd.grad((got * w).sum(), (q, k, v))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    for name, a, b in zip("qkv", ggot, gwant):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=lambda m: f"grad of {name}: {m}")


def test_large_window_is_no_window():
    ids, am = batch(3, True)
    tree = build_tree(ids, attention_mask=am)
    q, k, v = qkv(tree.stats.executed_tokens)
    a = tree_attention(q, k, v, tree, scale=0.4, impl="cpu", window=10_000)
    b = tree_attention(q, k, v, tree, scale=0.4, impl="cpu")
    torch.testing.assert_close(a, b, atol=1e-13, rtol=1e-13)


def test_window_needs_positions_and_support():
    ids, am = batch(4, False)
    tree = build_tree(ids, attention_mask=am)
    q, k, v = qkv(tree.stats.executed_tokens)
    with pytest.raises(Exception, match="needs position"):
        torch.ops.brcompile.tree_attention_forward(q, k, v, tree.end, tree.valid, tree.segments, 0.4, "cpu", 3, None)


def test_opcheck_window():
    ids, am = batch(5, True)
    tree = build_tree(ids, attention_mask=am)
    q, k, v = qkv(tree.stats.executed_tokens)
    args = (q.detach().requires_grad_(), k.detach().requires_grad_(), v.detach().requires_grad_(), tree.end,
            tree.valid, tree.segments, 0.4, "cpu", 3, tree.position)
    torch.library.opcheck(torch.ops.brcompile.tree_attention_forward.default, args)


# ------------------------------------------------------------------------------------------- soft-capping


def test_reference_softcap_equals_dense_rows():
    """Soft-capped scores c * tanh(scale q.k / c): the tree read back per row equals dense math."""
    ids, am = batch(6, True)
    tree = build_tree(ids, attention_mask=am)
    q, k, v = qkv(tree.stats.executed_tokens)
    out = tree_attention(q, k, v, tree, scale=0.4, impl="reference", softcap=0.7)
    L = ids.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    for b in range(ids.shape[0]):
        idx = tree.index[b]
        m = causal & am[b].bool()[None, :]
        s = torch.tanh(q[:, idx] @ k[:, idx].repeat_interleave(2, 0).transpose(-1, -2) * 0.4 / 0.7) * 0.7
        p = torch.softmax(s.masked_fill(~m, float("-inf")), -1).nan_to_num(0.0)
        dense = p @ v[:, idx].repeat_interleave(2, 0)
        torch.testing.assert_close(out[:, idx], dense, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("pad", [False, True], ids=["dense", "padded"])
def test_cpu_softcap_matches_reference(window, pad, monkeypatch):
    monkeypatch.setattr(cpu, "WINDOW_QUERY_BLOCK", 4)
    ids, am = batch(7, pad)
    tree = build_tree(ids, attention_mask=am)
    q, k, v = qkv(tree.stats.executed_tokens)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=q.dtype)
    want = tree_attention(q, k, v, tree, scale=0.4, impl="reference", window=window, softcap=0.9)
    gwant = torch.autograd.grad((want * w).sum(), (q, k, v))
    got = tree_attention(q, k, v, tree, scale=0.4, impl="cpu", window=window, softcap=0.9)
    ggot = torch.autograd.grad((got * w).sum(), (q, k, v))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    for name, a, b in zip("qkv", ggot, gwant):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=lambda m: f"grad of {name}: {m}")
    # the cap changes the result (a test that could not fail otherwise)
    assert (got - tree_attention(q, k, v, tree, scale=0.4, impl="cpu", window=window)).abs().max() > 1e-3
