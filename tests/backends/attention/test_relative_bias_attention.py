"""Relative bias: a per-query-token table R [Hq, N, E] over the clamped query-key distance (Inkling2).

The score of (q, k) in head h gets ``R[h, q, min(position[q] - position[k], E - 1)]``; its gradient is the score
gradient summed per distance bucket. The dense oracle is HF's spelling per batch row: the table read at the
row's packed tokens (``R[:, index[b]]``), ``gather(-1, clamp(i - j, 0, E - 1))`` over the columns, added to the
scores; values and every gradient (q, k, v and the table) in float64, on a tree of two branching levels with
and without left padding and holes, with a window, a soft-cap, ALiBi and per-query sinks beside it.
"""
import pytest
import torch

from brcompile.backends.attention.op import (
    AttentionImpl, AttentionImplError, TreeAttentionError, check_impl_supports, tree_attention,
)
from brcompile.backends.attention.reference import reference_backward, reference_forward
from brcompile.runtime.tree import build_tree
from tests.helpers import grouped_rows, tree_qkv

SLOPES = [0.5, 0.25, 0.125, 0.0625]


def batch(seed: int, pad: bool):
    """2 groups with shared prompts and a shared response prefix (two branching levels); optional left padding
    and holes."""
    return grouped_rows(seed, pad, groups=((7, 3), (5, 2)), response=4,
                        holes=((0, slice(-2, None)), (3, slice(4, 5))))


def table(n: int, extent: int, dtype=torch.float64, seed: int = 7, zero_beyond: bool = False) -> torch.Tensor:
    """[4, n, extent] relative-bias table that requires grad; ``zero_beyond``: its last column is 0 (a bias that
    is 0 from distance extent - 1 on, Inkling2's)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(4, n, extent, generator=g, dtype=dtype) * 1.5
    if zero_beyond:
        t[..., -1] = 0
    return t.requires_grad_()


def dense_rows(q, k, v, tree, ids, am, scale, rel, window=0, softcap=0.0, alibi=None, sinks=None):
    """Per row b: softmax over the visible keys of ``scale q.k [capped] + m (j - i) + R[h, i, clamp(i - j)]``
    (and the sink column, joined on the key dim and dropped after)."""
    L = ids.shape[1]
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    buckets = (i - j).clamp(0, rel.shape[-1] - 1)
    outs = []
    for b in range(ids.shape[0]):
        idx = tree.index[b]
        kb, vb = k[:, idx].repeat_interleave(2, 0), v[:, idx].repeat_interleave(2, 0)
        s = q[:, idx] @ kb.transpose(-1, -2) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        if alibi is not None:
            s = s + torch.tensor(alibi, dtype=s.dtype)[:, None, None] * (j - i).to(s.dtype)
        s = s + rel[:, idx].gather(-1, buckets.expand(rel.shape[0], L, L))
        seen = (j <= i) & am[b].bool()[None, :]
        if window:
            seen &= (i - j) < window
        s = s.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks[:, idx, None]], -1)
        p = torch.softmax(s, -1).nan_to_num(0.0)
        if sinks is not None:
            p = p[..., :-1]
        outs.append(p @ vb)
    return outs


def dense_loss(dense, w, tree):
    """Each packed token once, at the row it is read from (rep_row)."""
    return sum((d * w[:, tree.index[b]] * (tree.rep_row[tree.index[b]] == b)[None, :, None]).sum()
               for b, d in enumerate(dense))


@pytest.mark.parametrize("features", ["plain", "window", "softcap+alibi", "sinks"])
@pytest.mark.parametrize("pad", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_equals_dense_rows(impl, pad, features):
    """out and the gradients of q, k, v and the table equal HF's per-row spelling in float64."""
    ids, am = batch(1, pad)
    tree = build_tree(ids, attention_mask=am)
    n = tree.stats.executed_tokens
    q, k, v = tree_qkv(n)
    rel = table(n, 5, zero_beyond=features == "plain")
    g = torch.Generator().manual_seed(3)
    sinks = (torch.randn(4, n, generator=g, dtype=torch.float64)).requires_grad_() if features == "sinks" else None
    opts = dict(window=4 if features == "window" else 0, softcap=2.0 if features == "softcap+alibi" else 0.0,
                alibi=SLOPES if features == "softcap+alibi" else None)
    out = tree_attention(q, k, v, tree, scale=0.4, impl=impl, relbias=rel, sinks=sinks, **opts)
    dense = dense_rows(q, k, v, tree, ids, am, 0.4, rel, sinks=sinks, **opts)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    wrt = [x for x in (q, k, v, rel, sinks) if x is not None]
    g_tree = torch.autograd.grad((out * w).sum(), wrt)
    g_dense = torch.autograd.grad(dense_loss(dense, w, tree), wrt)
    for b, d in enumerate(dense):
        torch.testing.assert_close(out[:, tree.index[b]], d, atol=1e-12, rtol=1e-12)
    for name, a, e in zip(["q", "k", "v", "relbias", "sinks"], g_tree, g_dense):
        torch.testing.assert_close(a, e, atol=1e-11, rtol=1e-11, msg=lambda m: f"grad of {name}: {m}")
    assert g_tree[3].abs().max() > 1e-3  # the table gets a gradient
    # the clamped column (every distance >= E - 1) too, unless the window (4 < E) hides those keys
    assert bool((g_tree[3][..., -1] != 0).any()) == (not opts["window"])


def test_cpu_equals_reference_float32():
    """The cpu impl (blocked explicit math) equals the float64 reference in float32, values and gradients."""
    ids, am = batch(2, True)
    tree = build_tree(ids, attention_mask=am)
    n = tree.stats.executed_tokens
    q, k, v = tree_qkv(n, dtype=torch.float32)
    rel = table(n, 6, dtype=torch.float32)
    w = torch.randn(4, n, 8, generator=torch.Generator().manual_seed(4))
    res = {}
    for impl in ("reference", "cpu"):
        out = tree_attention(q, k, v, tree, scale=0.3, impl=impl, relbias=rel, window=5)
        res[impl] = (out, *torch.autograd.grad((out * w).sum(), (q, k, v, rel)))
    for a, e in zip(res["cpu"], res["reference"]):
        torch.testing.assert_close(a, e, atol=2e-6, rtol=2e-5)


def test_gradcheck_relbias():
    """dR (and dq, dk, dv) by finite differences in float64, with a window and ALiBi beside it."""
    ids, am = batch(4, True)
    tree = build_tree(ids[:3, :8], attention_mask=am[:3, :8])
    n = tree.stats.executed_tokens
    q, k, v = tree_qkv(n, d=4)
    rel = table(n, 3)

    def f(q, k, v, rel):
        return tree_attention(q, k, v, tree, scale=0.4, impl="cpu", window=5, alibi=SLOPES, relbias=rel)

    assert torch.autograd.gradcheck(f, (q, k, v, rel), atol=1e-8, rtol=1e-6)


def test_bad_table_and_unsupported_impl():
    """A table of the wrong shape, or without positions, is refused by the op; an impl without
    ``supports_relbias`` is never handed one (the backend then runs the original graph, naming the feature)."""
    ids, am = batch(1, False)
    tree = build_tree(ids, attention_mask=am)
    n = tree.stats.executed_tokens
    q, k, v = tree_qkv(n)
    with pytest.raises(TreeAttentionError, match="relbias must be a floating"):
        tree_attention(q, k, v, tree, impl="reference", relbias=table(n + 1, 3))
    with pytest.raises(TreeAttentionError, match="relbias needs position"):
        tree_attention(q, k, v, (tree.end, tree.valid, tree.segments),
                       impl="reference", relbias=table(n, 3))
    plain = AttentionImpl(name="no-relbias", forward=reference_forward, backward=reference_backward,
                          supports_window=True, supports_softcap=True, supports_alibi=True)
    with pytest.raises(AttentionImplError, match="does not support relative biases"):
        check_impl_supports(plain, relbias=True)
    check_impl_supports(plain)


def test_opcheck_relbias():
    """The forward op with a relative bias (beside sinks): fake impl, autograd registration (dR through the
    backward op's fourth output), schema."""
    ids, am = batch(6, True)
    tree = build_tree(ids, attention_mask=am)
    n = tree.stats.executed_tokens
    q, k, v = tree_qkv(n)
    sinks = torch.randn(4, n, generator=torch.Generator().manual_seed(1), dtype=torch.float64).requires_grad_()
    args = (q, k, v, tree.end, tree.valid, tree.segments, 0.4, "cpu", 0, tree.position, 0.0, None, sinks,
            table(n, 4))
    torch.library.opcheck(torch.ops.brcompile.tree_attention_forward.default, args)
