"""ALiBi position biases and attention sinks in tree attention (reference, CPU, cached, Triton).

Oracle: the reference impl, itself checked against dense per-row math: scores ``scale q.k + m[h] (j - i)``
(ALiBi over the batch columns = the tree positions), one extra value-less logit ``sinks[h]`` per query
row in the softmax (GPT-OSS: ``cat([scores, sinks]) -> softmax -> drop the sink column``). The sinks'
gradient is checked by gradcheck in float64.
"""
import pytest
import torch

import brcompile.backends.attention.cpu as cpu
from brcompile.backends.attention.op import AttentionImplError, TreeAttentionError, tree_attention
from brcompile.runtime.tree import build_tree
from tests.helpers import grouped_rows, tree_qkv

SLOPES = [0.5, 0.25, 0.125, 0.0625]


def batch(seed: int, pad: bool):
    """2 groups with shared prompts and a shared response prefix; optional left padding and holes."""
    return grouped_rows(seed, pad, groups=((7, 3), (5, 2)), response=4,
                        holes=((0, slice(-2, None)), (3, slice(4, 5))))

qkv = tree_qkv


def sinks_param(dtype=torch.float64):
    return torch.tensor([0.3, -1.0, 2.0, 0.0], dtype=dtype, requires_grad=True)


def dense_rows(q, k, v, tree, ids, am, scale, alibi=None, sinks=None, softcap=0.0):
    """Per row b: softmax over the visible keys (and the sink column, joined on the key dim and dropped after)
    of ``scale q.k [capped] + m (j - i)`` (``alibi``: the slopes m, numbers or a differentiable tensor)."""
    L = ids.shape[1]
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    outs = []
    for b in range(ids.shape[0]):
        idx = tree.index[b]
        kb, vb = k[:, idx].repeat_interleave(2, 0), v[:, idx].repeat_interleave(2, 0)
        s = q[:, idx] @ kb.transpose(-1, -2) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        if alibi is not None:
            s = s + torch.as_tensor(alibi, dtype=s.dtype)[:, None, None] * (j - i).to(s.dtype)
        s = s.masked_fill(~((j <= i) & am[b].bool()[None, :]), float("-inf"))
        if sinks is not None:  # one logit per head [H], or per head and query token [H, N]
            col = sinks[:, idx, None] if sinks.dim() == 2 else sinks[:, None, None].expand(-1, L, 1)
            s = torch.cat([s, col], -1)
        p = torch.softmax(s, -1).nan_to_num(0.0)
        if sinks is not None:
            p = p[..., :-1]
        outs.append(p @ vb)
    return outs


@pytest.mark.parametrize("features", ["alibi", "sinks", "both"])
@pytest.mark.parametrize("pad", [False, True], ids=["dense", "padded"])
def test_reference_equals_dense_rows(features, pad):
    ids, am = batch(1, pad)
    tree = build_tree(ids, attention_mask=am)
    q, k, v = qkv(tree.stats.executed_tokens)
    alibi = SLOPES if features in ("alibi", "both") else None
    sinks = sinks_param() if features in ("sinks", "both") else None
    out = tree_attention(q, k, v, tree, scale=0.4, impl="reference", alibi=alibi, sinks=sinks)
    dense = dense_rows(q, k, v, tree, ids, am, 0.4, alibi, sinks)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    wrt = [x for x in (q, k, v, sinks) if x is not None]
    g_tree = torch.autograd.grad((out * w).sum(), wrt)
    # each packed token once: at the row it is read from (rep_row)
    loss = sum((d * w[:, tree.index[b]] * (tree.rep_row[tree.index[b]] == b)[None, :, None]).sum()
               for b, d in enumerate(dense))
    g_dense = torch.autograd.grad(loss, wrt)
    for b, d in enumerate(dense):
        torch.testing.assert_close(out[:, tree.index[b]], d, atol=1e-12, rtol=1e-12)
    for a, e in zip(g_tree, g_dense):
        torch.testing.assert_close(a, e, atol=1e-11, rtol=1e-11)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (3, 0.0), (0, 0.9)])
@pytest.mark.parametrize("pad", [False, True], ids=["dense", "padded"])
def test_cpu_matches_reference(window, softcap, pad, monkeypatch):
    monkeypatch.setattr(cpu, "WINDOW_QUERY_BLOCK", 4)
    ids, am = batch(3, pad)
    tree = build_tree(ids, attention_mask=am)
    q, k, v = qkv(tree.stats.executed_tokens)
    sinks = sinks_param()
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=q.dtype)
    kw = dict(scale=0.4, window=window, softcap=softcap, alibi=SLOPES, sinks=sinks)
    want = tree_attention(q, k, v, tree, impl="reference", **kw)
    gwant = torch.autograd.grad((want * w).sum(), (q, k, v, sinks))
    got = tree_attention(q, k, v, tree, impl="cpu", **kw)
    ggot = torch.autograd.grad((got * w).sum(), (q, k, v, sinks))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    for name, a, b in zip(["q", "k", "v", "sinks"], ggot, gwant):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=lambda m: f"grad of {name}: {m}")
    # the features change the result (a test that could not fail otherwise)
    plain = tree_attention(q, k, v, tree, impl="cpu", scale=0.4, window=window, softcap=softcap)
    assert (got - plain).abs().max() > 1e-3


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_gradcheck_sinks_and_qkv(impl):
    """d sinks[h] = -sum_q p_sink(h, q) * (dO . O)(h, q), and the q/k/v gradients with the sink, by finite
    differences in float64."""
    ids, am = batch(4, True)
    tree = build_tree(ids[:3, :8], attention_mask=am[:3, :8])
    q, k, v = qkv(tree.stats.executed_tokens, d=4)
    sinks = sinks_param()

    def f(q, k, v, sinks):
        return tree_attention(q, k, v, tree, scale=0.4, impl=impl, alibi=SLOPES, sinks=sinks)

    assert torch.autograd.gradcheck(f, (q, k, v, sinks), atol=1e-8, rtol=1e-6)


def slopes_param(dtype=torch.float64):
    return torch.tensor(SLOPES, dtype=dtype).mul(torch.tensor([1.0, -0.5, 2.0, 0.7], dtype=dtype)).requires_grad_()


@pytest.mark.parametrize("impl", ["reference", "cpu"])
@pytest.mark.parametrize("softcap", [0.0, 0.9], ids=["plain", "capped"])
@pytest.mark.parametrize("pad", [False, True], ids=["dense", "padded"])
def test_trainable_slopes_equal_dense_rows(impl, softcap, pad, monkeypatch):
    """Trainable ALiBi slopes (a [Hq] tensor): output and the gradients of q, k, v, the sinks and the slopes,
    ``d m[h] = sum over visible (q, k) of dS[h, q, k] (pos[k] - pos[q])``, equal the dense per-row oracle's
    (autograd through ``m (j - i)``) in float64, on a tree of two branching levels (shared prompts, a shared
    response prefix) with and without padding holes."""
    monkeypatch.setattr(cpu, "WINDOW_QUERY_BLOCK", 4)
    ids, am = batch(8, pad)
    tree = build_tree(ids, attention_mask=am)
    q, k, v = qkv(tree.stats.executed_tokens)
    slopes, sinks = slopes_param(), sinks_param()
    out = tree_attention(q, k, v, tree, scale=0.4, impl=impl, softcap=softcap, slopes=slopes, sinks=sinks)
    dense = dense_rows(q, k, v, tree, ids, am, 0.4, slopes, sinks, softcap)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    wrt = (q, k, v, sinks, slopes)
    g_tree = torch.autograd.grad((out * w).sum(), wrt)
    loss = sum((d * w[:, tree.index[b]] * (tree.rep_row[tree.index[b]] == b)[None, :, None]).sum()
               for b, d in enumerate(dense))
    g_dense = torch.autograd.grad(loss, wrt)
    for b, d in enumerate(dense):
        torch.testing.assert_close(out[:, tree.index[b]], d, atol=1e-12, rtol=1e-12)
    for name, a, e in zip(["q", "k", "v", "sinks", "slopes"], g_tree, g_dense):
        torch.testing.assert_close(a, e, atol=1e-11, rtol=1e-11, msg=lambda m: f"grad of {name}: {m}")
    assert g_tree[-1].abs().min() > 1e-4  # every head's slope gets a gradient (not a vacuous zero)
    const = tree_attention(q, k, v, tree, scale=0.4, impl=impl, softcap=softcap, alibi=slopes.tolist(), sinks=sinks)
    torch.testing.assert_close(out, const, atol=1e-13, rtol=1e-13)  # the same forward as constant slopes


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_gradcheck_slopes(impl):
    """The slopes' gradient (and q, k, v's beside it) by finite differences in float64."""
    ids, am = batch(4, True)
    tree = build_tree(ids[:3, :8], attention_mask=am[:3, :8])
    q, k, v = qkv(tree.stats.executed_tokens, d=4)

    def f(q, k, v, slopes):
        return tree_attention(q, k, v, tree, scale=0.4, impl=impl, slopes=slopes)

    assert torch.autograd.gradcheck(f, (q, k, v, slopes_param()), atol=1e-8, rtol=1e-6)


def test_trainable_slopes_need_an_impl_that_differentiates_them():
    """An impl with ALiBi but without ``supports_alibi_grad`` is refused with the missing feature named; constant
    and tensor slopes together, or slopes of the wrong shape, are contract errors."""
    from brcompile.backends.attention.op import AttentionImpl, check_impl_supports

    ref = cpu.cpu_forward, cpu.cpu_backward
    no_grad = AttentionImpl(name="no_slope_grad", forward=ref[0], backward=ref[1], supports_alibi=True)
    check_impl_supports(no_grad, alibi=SLOPES)
    with pytest.raises(AttentionImplError, match="trainable ALiBi slopes"):
        check_impl_supports(no_grad, slopes=slopes_param())
    ids, am = batch(7, False)
    tree = build_tree(ids, attention_mask=am)
    q, k, v = qkv(tree.stats.executed_tokens)
    with pytest.raises(TreeAttentionError, match="given twice"):
        tree_attention(q, k, v, tree, impl="cpu", alibi=SLOPES, slopes=slopes_param())
    with pytest.raises(TreeAttentionError, match="slopes must be a floating"):
        tree_attention(q, k, v, tree, impl="cpu", slopes=slopes_param()[:2])


def test_opcheck_trainable_slopes():
    ids, am = batch(6, True)
    tree = build_tree(ids, attention_mask=am)
    q, k, v = qkv(tree.stats.executed_tokens)
    args = (q.detach().requires_grad_(), k.detach().requires_grad_(), v.detach().requires_grad_(), tree.end,
            tree.valid, tree.segments, 0.4, "cpu", 0, tree.position, 0.0, None, sinks_param(), None, slopes_param())
    torch.library.opcheck(torch.ops.brcompile.tree_attention_forward.default, args)


def test_query_that_sees_nothing_with_a_sink():
    """A query without visible keys: 0 output (the sink carries no value), no gradient to q or the sink."""
    ids, am = batch(5, True)
    tree = build_tree(ids, attention_mask=am)
    n = tree.stats.executed_tokens
    q, k, v = qkv(n)
    sinks = sinks_param()
    valid = torch.zeros(n, dtype=torch.bool)
    out = tree_attention(q, k, v, (tree.end, valid, tree.segments), scale=0.4, impl="cpu", sinks=sinks)
    assert bool((out == 0).all())
    gq, gs = torch.autograd.grad(out.sum(), (q, sinks))
    assert bool((gq == 0).all()) and bool((gs == 0).all())


def test_opcheck_alibi_and_sinks():
    ids, am = batch(6, True)
    tree = build_tree(ids, attention_mask=am)
    q, k, v = qkv(tree.stats.executed_tokens)
    args = (q.detach().requires_grad_(), k.detach().requires_grad_(), v.detach().requires_grad_(), tree.end,
            tree.valid, tree.segments, 0.4, "cpu", 0, tree.position, 0.0, SLOPES, sinks_param())
    torch.library.opcheck(torch.ops.brcompile.tree_attention_forward.default, args)


def test_errors_are_typed():
    ids, am = batch(7, False)
    tree = build_tree(ids, attention_mask=am)
    q, k, v = qkv(tree.stats.executed_tokens)
    op = torch.ops.brcompile.tree_attention_forward
    with pytest.raises(TreeAttentionError, match="alibi needs position"):
        op(q, k, v, tree.end, tree.valid, tree.segments, 0.4, "cpu", 0, None, 0.0, SLOPES)
    with pytest.raises(TreeAttentionError, match="4 finite slopes"):
        op(q, k, v, tree.end, tree.valid, tree.segments, 0.4, "cpu", 0, tree.position, 0.0, SLOPES[:2])
    with pytest.raises(TreeAttentionError, match="sinks must be"):
        op(q, k, v, tree.end, tree.valid, tree.segments, 0.4, "cpu", 0, None, 0.0, None, torch.zeros(3))


def assert_cached_matches_uncached(tree, q, k, v, sinks, sinks_of, alibi=None):
    """The prefix and each chunk of a streaming plan (``chunk_tokens=4``) through ``tree_attention_cached``, the
    chunk's sinks ``sinks_of(token ids)``, merged once after both parts (with ``alibi``: the slopes over the
    chunk's and the cache's positions on the cross pairs): values and the q, k, v and sinks gradients equal the
    whole tree's (reference impl)."""
    from brcompile.backends.attention.cached import tree_attention_cached
    from brcompile.runtime.streaming import plan_replay

    want = tree_attention(q, k, v, tree, scale=0.4, impl="reference", sinks=sinks, alibi=alibi)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=q.dtype)
    gwant = torch.autograd.grad((want * w).sum(), (q, k, v, sinks))
    plan = plan_replay(tree.end, tree.segments, chunk_tokens=4)
    pre = plan.prefix_ids
    kc, vc, pv, ppos = k[:, pre], v[:, pre], tree.valid[pre], tree.position[pre]
    got = torch.zeros_like(want)
    loss = 0
    assert plan.chunks and plan.prefix_tokens
    for ch in plan.chunks:
        t = ch.ids
        o = tree_attention_cached(q[:, t], k[:, t], v[:, t], (ch.end, tree.valid[t], ch.segments), kc, vc, pv,
                                  ch.cross, 0.4, impl="cpu", position=tree.position[t], cache_position=ppos,
                                  sinks=sinks_of(t), alibi=alibi)
        got[:, t] = o.detach()
        loss = loss + (o * w[:, t]).sum()
    po = tree_attention(q[:, pre], kc, vc, (plan.prefix_end, pv, plan.prefix_segments), scale=0.4, impl="cpu",
                        position=ppos, sinks=sinks_of(pre), alibi=alibi)
    got[:, pre] = po.detach()
    loss = loss + (po * w[:, pre]).sum()
    ggot = torch.autograd.grad(loss, (q, k, v, sinks))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    for name, a, b in zip(["q", "k", "v", "sinks"], ggot, gwant):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=lambda m: f"grad of {name}: {m}")


def test_cached_with_sinks_matches_uncached():
    """A chunk against a cached prefix, sinks merged once after both parts: equals the whole tree's rows."""
    ids, am = batch(8, False)
    tree = build_tree(ids, attention_mask=am)
    q, k, v = qkv(tree.stats.executed_tokens)
    sinks = sinks_param()
    assert_cached_matches_uncached(tree, q, k, v, sinks, lambda t: sinks)


def test_cached_alibi_with_sinks_matches_uncached():
    """ALiBi and sinks together against a cached prefix (BLOOM-style slopes with GPT-OSS-style sinks): the cross
    pairs carry the bias over the chunk's and the cache's positions, the sinks merge once after both parts."""
    ids, am = batch(9, False)
    tree = build_tree(ids, attention_mask=am)
    q, k, v = qkv(tree.stats.executed_tokens)
    sinks = sinks_param()
    assert_cached_matches_uncached(tree, q, k, v, sinks, lambda t: sinks, alibi=SLOPES)
