"""Attention sinks computed per query token (Inkling2): tree attention's ``sinks`` as a [Hq, N] tensor.

Row (h, q) joins the value-less logit ``sinks[h, q]`` to its softmax; the dense oracle is HF's spelling per
batch row (``cat([scores, sink column], -1) -> softmax -> drop the sink column``, test_alibi_sink_attention's
``dense_rows``) with the column read from the packed tokens (``sinks[:, index[b]]``), values and gradients in
float64 — the sinks' own gradient ``d s[h, q] = -exp(s[h, q] - lse'[h, q]) * rowsum(dO * O)[h, q]`` included.
The op merges the sinks around every impl (reference, cpu, triton: through the Triton interpreter on CPU), so
each impl is checked through the op.
"""
import os

import torch

if not torch.cuda.is_available():  # must precede the first `import triton` in this process
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from brcompile.backends.attention.op import TreeAttentionError, tree_attention
from brcompile.runtime.tree import build_tree
from tests.backends.attention.test_alibi_sink_attention import assert_cached_matches_uncached, dense_rows
from tests.helpers import grouped_rows, tree_qkv

SLOPES = [0.5, 0.25, 0.125, 0.0625]


def batch(seed: int, pad: bool):
    """2 groups with shared prompts and a shared response prefix; optional left padding and holes."""
    return grouped_rows(seed, pad, groups=((7, 3), (5, 2)), response=4,
                        holes=((0, slice(-2, None)), (3, slice(4, 5))))


def query_sinks(n: int, dtype=torch.float64, seed: int = 5) -> torch.Tensor:
    """[4, n] per-query sink logits that require grad."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(4, n, generator=g, dtype=dtype) * 1.5).requires_grad_()


def dense_loss(dense, w, tree):
    """Each packed token once, at the row it is read from (rep_row)."""
    return sum((d * w[:, tree.index[b]] * (tree.rep_row[tree.index[b]] == b)[None, :, None]).sum()
               for b, d in enumerate(dense))


@pytest.mark.parametrize("alibi", [None, SLOPES], ids=["plain", "alibi"])
@pytest.mark.parametrize("pad", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_equals_dense_rows(impl, pad, alibi):
    """out and the gradients of q, k, v and the per-query sinks equal HF's per-row spelling in float64."""
    ids, am = batch(1, pad)
    tree = build_tree(ids, attention_mask=am)
    n = tree.stats.executed_tokens
    q, k, v = tree_qkv(n)
    sinks = query_sinks(n)
    out = tree_attention(q, k, v, tree, scale=0.4, impl=impl, alibi=alibi, sinks=sinks)
    dense = dense_rows(q, k, v, tree, ids, am, 0.4, alibi=alibi, sinks=sinks)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    g_tree = torch.autograd.grad((out * w).sum(), (q, k, v, sinks))
    g_dense = torch.autograd.grad(dense_loss(dense, w, tree), (q, k, v, sinks))
    for b, d in enumerate(dense):
        torch.testing.assert_close(out[:, tree.index[b]], d, atol=1e-12, rtol=1e-12)
    for name, a, e in zip(["q", "k", "v", "sinks"], g_tree, g_dense):
        torch.testing.assert_close(a, e, atol=1e-11, rtol=1e-11, msg=lambda m: f"grad of {name}: {m}")
    assert g_tree[3].abs().max() > 1e-3  # the sinks get a gradient of every query


def test_gradcheck_query_sinks():
    """d s[h, q] = -p_sink(h, q) * (dO . O)(h, q) and the q/k/v gradients, by finite differences in float64
    (the sink merge and its gradient are the op's, around every impl; the cpu impl equals the dense rows
    above)."""
    ids, am = batch(4, True)
    tree = build_tree(ids[:3, :8], attention_mask=am[:3, :8])
    n = tree.stats.executed_tokens
    q, k, v = tree_qkv(n, d=4)
    sinks = query_sinks(n)

    def f(q, k, v, sinks):
        return tree_attention(q, k, v, tree, scale=0.4, impl="reference", window=3, alibi=SLOPES, sinks=sinks)

    assert torch.autograd.gradcheck(f, (q, k, v, sinks), atol=1e-8, rtol=1e-6)


def test_per_head_sinks_are_the_broadcast():
    """A per-head [Hq] sink is the per-query sink broadcast over the queries: same output; its gradient is the
    per-query gradient summed over the queries."""
    ids, am = batch(2, True)
    tree = build_tree(ids, attention_mask=am)
    n = tree.stats.executed_tokens
    q, k, v = tree_qkv(n)
    head = torch.tensor([0.3, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    rows = head.detach()[:, None].expand(-1, n).clone().requires_grad_()
    a = tree_attention(q, k, v, tree, scale=0.4, impl="cpu", sinks=head)
    b = tree_attention(q, k, v, tree, scale=0.4, impl="cpu", sinks=rows)
    w = torch.randn(a.shape, generator=torch.Generator().manual_seed(3), dtype=a.dtype)
    (ga,) = torch.autograd.grad((a * w).sum(), head)
    (gb,) = torch.autograd.grad((b * w).sum(), rows)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(ga, gb.sum(1), atol=1e-13, rtol=1e-13)


def test_query_that_sees_nothing_with_a_query_sink():
    """A query without visible keys: 0 output (the sink carries no value), no gradient to q or its sink."""
    ids, am = batch(5, True)
    tree = build_tree(ids, attention_mask=am)
    n = tree.stats.executed_tokens
    q, k, v = tree_qkv(n)
    sinks = query_sinks(n)
    valid = torch.ones(n, dtype=torch.bool)
    valid[::3] = False
    out = tree_attention(q, k, v, (tree.end, valid, tree.segments), scale=0.4, impl="cpu", sinks=sinks)
    gq, gs = torch.autograd.grad(out.sum(), (q, sinks))
    keys = torch.arange(n)
    alone = torch.tensor([not bool(((keys <= t) & (tree.end > t) & valid).any()) for t in range(n)])
    assert bool(alone.any())
    assert bool((out[:, alone] == 0).all()) and bool((gq[:, alone] == 0).all()) and bool((gs[:, alone] == 0).all())


def test_opcheck_query_sinks():
    ids, am = batch(6, True)
    tree = build_tree(ids, attention_mask=am)
    n = tree.stats.executed_tokens
    q, k, v = tree_qkv(n)
    args = (q.detach().requires_grad_(), k.detach().requires_grad_(), v.detach().requires_grad_(), tree.end,
            tree.valid, tree.segments, 0.4, "cpu", 0, tree.position, 0.0, SLOPES, query_sinks(n))
    torch.library.opcheck(torch.ops.brcompile.tree_attention_forward.default, args)


def test_sinks_of_another_length_are_typed_errors():
    ids, am = batch(7, False)
    tree = build_tree(ids, attention_mask=am)
    n = tree.stats.executed_tokens
    q, k, v = tree_qkv(n)
    op = torch.ops.brcompile.tree_attention_forward
    for bad in (torch.zeros(4, n + 1), torch.zeros(n, 4), torch.zeros(4, n, 1)):
        with pytest.raises(TreeAttentionError, match=r"sinks must be a floating \[Hq=4\] or \[Hq=4, N="):
            op(q, k, v, tree.end, tree.valid, tree.segments, 0.4, "cpu", 0, None, 0.0, None, bad.double())


def test_cached_with_query_sinks_matches_uncached():
    """Chunks against a cached prefix, each with its own queries' sinks (``sinks[:, chunk]``), merged once after
    both parts: values and gradients (the sinks' included) equal the whole tree's."""
    ids, am = batch(8, False)
    tree = build_tree(ids, attention_mask=am)
    n = tree.stats.executed_tokens
    q, k, v = tree_qkv(n)
    sinks = query_sinks(n)
    assert_cached_matches_uncached(tree, q, k, v, sinks, lambda t: sinks[:, t])


@pytest.mark.triton
def test_triton_with_query_sinks_matches_reference():
    """``impl="triton"`` (the interpreter on CPU) with per-query sinks through the op: out and the q, k, v and
    sinks gradients in float32 against the float64 reference."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids, am = batch(9, True)
    tree = build_tree(ids, attention_mask=am).to(device)
    n = tree.stats.executed_tokens
    q, k, v = (x.detach().to(device) for x in tree_qkv(n, d=16))
    sinks = query_sinks(n).detach().to(device)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(4), dtype=q.dtype).to(device)
    res = {}
    for impl, dtype in (("triton", torch.float32), ("reference", torch.float64)):
        xs = [x.to(dtype).requires_grad_() for x in (q, k, v, sinks)]
        out = tree_attention(*xs[:3], tree, scale=0.25, impl=impl, sinks=xs[3])
        res[impl] = (out, *torch.autograd.grad((out * w.to(dtype)).sum(), xs))
    for name, a, b in zip(["out", "q", "k", "v", "sinks"], res["triton"], res["reference"]):
        err = (a.double() - b).abs().max().item() / b.abs().max().item()
        assert err <= 1e-4, (name, err)
