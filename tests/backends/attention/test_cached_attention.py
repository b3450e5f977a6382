"""brcompile::tree_attention_cached_forward and the streaming schedule (brcompile.runtime.streaming.plan_replay).

The oracle is tree attention over the whole tree (impl "reference", float64). The schedule cuts the tree
into prefix + chunks; the prefix's queries run ordinary tree attention on the prefix forest, every
chunk's queries the cached op against the prefix K/V. Together they must give the same out at every
token and — through sum(out * w) — the same gradients of q, k and v as the whole tree.
"""
import pytest
import torch

import brcompile.backends.attention.cached  # noqa: F401  (registers the op)
from brcompile.backends.attention.cached import tree_attention_cached
from brcompile.backends.attention.op import tree_attention
from brcompile.runtime.streaming import plan_replay
from brcompile.runtime.tree import build_tree
from tests.helpers import tree_qkv


def nested_batch(seed: int, pad: bool):
    """Two groups: group 0 has 5 rows, 3 of them share 3 response tokens (a 3-level tree), group 1 has
    3 rows; optional left padding of group 1's prompt and right padding of some responses."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for prompt_len, n in ((9, 5), (6, 3)):
        prompt = torch.randint(1, 50, (prompt_len,), generator=g)
        for i in range(n):
            resp = torch.randint(1, 50, (5,), generator=g)
            if i < 3 and n == 5:
                resp[:3] = torch.tensor([7, 8, 9])
            rows.append(torch.cat([prompt, resp]))
    L = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for b, r in enumerate(rows):
        off = L - len(r) if (pad and b >= 5) else 0
        ids[b, off:off + len(r)] = r
        mask[b, off:off + len(r)] = 1
    if pad:
        mask[1, -2:] = 0  # right padding (ids stay: padding is defined by the mask)
        mask[6, -1] = 0
    return ids, mask


def streamed(q, k, v, tree, chunk_tokens, impl, window=0, softcap=0.0, alibi=None, slopes=None, relbias=None):
    """out [Hq, N, D] assembled from the prefix run and the cached chunk runs (a relative bias table
    [Hq, N, E] is sliced to each run's query tokens, as the streaming trunk computes it per chunk)."""
    sched = plan_replay(tree.end, tree.segments, chunk_tokens)
    out = torch.zeros_like(q)
    pid = sched.prefix_ids
    pv, ppos = tree.valid[pid], tree.position[pid]
    rows = (lambda t: None) if relbias is None else (lambda t: relbias[:, t])
    out[:, pid] = tree_attention(q[:, pid], k[:, pid], v[:, pid], (sched.prefix_end, pv, sched.prefix_segments),
                                 scale=0.3, impl=impl, window=window, position=ppos, softcap=softcap, alibi=alibi,
                                 slopes=slopes, relbias=rows(pid))
    for c in sched.chunks:
        out[:, c.ids] = tree_attention_cached(q[:, c.ids], k[:, c.ids], v[:, c.ids],
                                              (c.end, tree.valid[c.ids], c.segments), k[:, pid], v[:, pid], pv,
                                              c.cross, 0.3, impl, window, tree.position[c.ids], ppos, softcap,
                                              alibi=alibi, slopes=slopes, relbias=rows(c.ids))
    return out, sched


qkv = tree_qkv


IMPLS = {"cpu": (torch.float64, 1e-12), "reference": (torch.float64, 1e-12), "triton": (torch.float32, 2e-5)}


def _streamed_cells():
    """cpu and reference: every (pad, chunk_tokens); triton (the interpreter on CPU, ~10 s a cell): each
    chunk size once with the padding alternating, so every pair of the three factors is still covered
    (pad x chunk_tokens by the full products of the other two impls)."""
    cells = []
    for c, chunk_tokens in enumerate([1, 6, 1000]):
        for pad in (False, True):
            for impl, (dtype, tol) in IMPLS.items():
                if impl == "triton" and pad != bool(c % 2):
                    continue
                cells.append(pytest.param(impl, dtype, tol, pad, chunk_tokens, id=(
                    f"{chunk_tokens}-{'padded' if pad else 'dense'}-{impl}")))
    return cells


@pytest.mark.parametrize("impl,dtype,tol,pad,chunk_tokens", _streamed_cells())
def test_streamed_equals_whole_tree(impl, dtype, tol, pad, chunk_tokens):
    if impl == "triton":
        pytest.importorskip("triton")
    ids, mask = nested_batch(0, pad)
    tree = build_tree(ids, attention_mask=mask)
    q, k, v = qkv(tree.stats.executed_tokens, dtype)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    want = tree_attention(q, k, v, tree, scale=0.3, impl="reference")
    gwant = torch.autograd.grad((want * w).sum(), (q, k, v))
    got, sched = streamed(q, k, v, tree, chunk_tokens, impl)
    ggot = torch.autograd.grad((got * w).sum(), (q, k, v))
    assert sched.prefix_tokens > 0 and len(sched.chunks) >= 1
    if chunk_tokens == 1:
        assert len(sched.chunks) == 8  # one chunk per leaf chain (rows)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    for name, a, b in zip("qkv", ggot, gwant):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("flash", [True, False], ids=["cpu_flash", "math"])
@pytest.mark.parametrize("pad", [False, True], ids=["dense", "padded"])
def test_torch_cross_paths_with_key_blocks(pad, flash, monkeypatch):
    """The cross pairs without the compiled kernel (the chunk through its impl): torch's CPU flash kernel, or the
    explicit-matmul path (what runs off the CPU) with cache keys cut into blocks of 3."""
    import brcompile.backends.attention.cached as cached

    monkeypatch.setattr(cached, "USE_CPU_KERNEL", False)
    monkeypatch.setattr(cached, "USE_CPU_FLASH", flash)
    monkeypatch.setattr(cached, "MATH_KEY_BLOCK", 3)
    ids, mask = nested_batch(4, pad)
    tree = build_tree(ids, attention_mask=mask)
    q, k, v = qkv(tree.stats.executed_tokens, torch.float64)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = tree_attention(q, k, v, tree, scale=0.3, impl="reference")
    gwant = torch.autograd.grad((want * w).sum(), (q, k, v))
    got, _ = streamed(q, k, v, tree, 6, "cpu")
    ggot = torch.autograd.grad((got * w).sum(), (q, k, v))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    for a, b in zip(ggot, gwant):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("flash", [True, False], ids=["cpu_flash", "math"])
@pytest.mark.parametrize("window", [1, 3, 8])
@pytest.mark.parametrize("pad", [False, True], ids=["dense", "padded"])
def test_streamed_with_window(window, pad, flash, monkeypatch):
    """A sliding window (HF's, over tree positions) in the prefix run, the chunk's own tree and the cross
    pairs against the cache; cross query blocks of 2 rows so the block trimming is exercised."""
    import brcompile.backends.attention.cached as cached

    monkeypatch.setattr(cached, "USE_CPU_FLASH", flash)
    orig = cached._pieces
    monkeypatch.setattr(cached, "_pieces", lambda *a, **kw: orig(*a, block=2))
    ids, mask = nested_batch(5, pad)
    tree = build_tree(ids, attention_mask=mask)
    q, k, v = qkv(tree.stats.executed_tokens, torch.float64)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = tree_attention(q, k, v, tree, scale=0.3, impl="reference", window=window)
    gwant = torch.autograd.grad((want * w).sum(), (q, k, v))
    got, _ = streamed(q, k, v, tree, 6, "cpu", window=window)
    ggot = torch.autograd.grad((got * w).sum(), (q, k, v))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    for name, a, b in zip("qkv", ggot, gwant):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("window", [0, 3])
def test_streamed_with_softcap(window):
    """Gemma2's logit soft-capping (c * tanh(s / c)) in the prefix, the chunk's own tree and the cross pairs
    (explicit math there: the CPU flash kernel has no soft-cap)."""
    ids, mask = nested_batch(6, True)
    tree = build_tree(ids, attention_mask=mask)
    q, k, v = qkv(tree.stats.executed_tokens, torch.float64)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = tree_attention(q, k, v, tree, scale=0.3, impl="reference", window=window, softcap=0.8)
    gwant = torch.autograd.grad((want * w).sum(), (q, k, v))
    got, _ = streamed(q, k, v, tree, 6, "cpu", window=window, softcap=0.8)
    ggot = torch.autograd.grad((got * w).sum(), (q, k, v))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    for name, a, b in zip("qkv", ggot, gwant):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=lambda m: f"grad of {name}: {m}")


def _position_bias(kind: str, hq: int, n: int, dtype):
    """The keyword arguments of one position bias: constant ALiBi slopes, trainable slopes, or a relative bias
    table [Hq, N, E=5] (differentiable), and the tensors to differentiate besides q, k, v."""
    g = torch.Generator().manual_seed(11)
    if kind == "alibi":
        return dict(alibi=[0.5 / 2 ** h for h in range(hq)]), ()
    if kind == "slopes":
        slopes = (torch.rand(hq, generator=g, dtype=dtype) * 0.4).requires_grad_()
        return dict(slopes=slopes), (slopes,)
    table = torch.randn(hq, n, 5, generator=g, dtype=dtype).requires_grad_()
    return dict(relbias=table), (table,)


@pytest.mark.parametrize("impl", ["cpu", "reference"])
@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("kind", ["alibi", "slopes", "relbias"])
def test_streamed_with_position_bias(kind, window, impl, monkeypatch):
    """ALiBi (constant and trainable slopes) and a relative bias against the cache: the cross pairs' bias reads
    the chunk's and the cache's positions (padded batch: the positions are not the columns); cache keys cut into
    blocks of 3, so one query row's bias spans several cross pieces. Out and the gradients of q, k, v and of the
    slopes / the table equal the whole tree's."""
    import brcompile.backends.attention.cached as cached

    monkeypatch.setattr(cached, "MATH_KEY_BLOCK", 3)
    ids, mask = nested_batch(7, True)
    tree = build_tree(ids, attention_mask=mask)
    q, k, v = qkv(tree.stats.executed_tokens, torch.float64)
    bias, extra = _position_bias(kind, q.shape[0], q.shape[1], torch.float64)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = tree_attention(q, k, v, tree, scale=0.3, impl="reference", window=window, **bias)
    gwant = torch.autograd.grad((want * w).sum(), (q, k, v, *extra))
    got, sched = streamed(q, k, v, tree, 6, impl, window=window, **bias)
    ggot = torch.autograd.grad((got * w).sum(), (q, k, v, *extra))
    assert sched.prefix_tokens > 0 and len(sched.chunks) >= 2
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    for name, a, b in zip(["q", "k", "v", kind], ggot, gwant):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=lambda m: f"grad of {name}: {m}")


def test_position_bias_needs_cache_positions():
    """A position bias against a cache without its positions is a clear TreeAttentionError, not a wrong bias."""
    from brcompile.backends.attention.op import TreeAttentionError

    ids, mask = nested_batch(3, False)
    tree = build_tree(ids, attention_mask=mask)
    q, k, v = qkv(tree.stats.executed_tokens, torch.float64)
    cross = torch.zeros(0, 4, dtype=torch.long)
    with pytest.raises(TreeAttentionError, match="cache_position"):
        torch.ops.brcompile.tree_attention_cached_forward(
            q, k, v, tree.end, tree.valid, tree.segments, k, v, tree.valid, cross, 0.3, "cpu", 0, tree.position,
            None, 0.0, [0.5] * q.shape[0], None)


def test_schedule_cuts_at_leaf_chains():
    """Prefix = the segments with children (both prompts and the shared response prefix); every chunk's
    cross rows name exactly its ancestors in the prefix."""
    ids, mask = nested_batch(2, pad=False)
    tree = build_tree(ids, attention_mask=mask)
    sched = plan_replay(tree.end, tree.segments, 4)
    segs = tree.segments
    shared = segs[segs[:, 1] < segs[:, 2]]
    assert sched.prefix_tokens == int((shared[:, 1] - shared[:, 0]).sum())
    assert sched.prefix_segments.shape[0] == 3  # prompt 0, shared response of group 0, prompt 1
    pid = sched.prefix_ids
    for c in sched.chunks:
        assert c.tokens <= 4 or c.segments.shape[0] == 1
        for qi, tok in enumerate(c.ids.tolist()):
            seen = set()
            for q0, q1, k0, k1 in c.cross.tolist():
                if q0 <= qi < q1:
                    seen.update(pid[k0:k1].tolist())
            anc = {int(a) for a in pid if a <= tok < tree.end[a]}
            assert seen == anc, f"token {tok}"
    covered = torch.cat([pid] + [c.ids for c in sched.chunks]).sort().values
    assert torch.equal(covered, torch.arange(tree.stats.executed_tokens))


def test_opcheck():
    ids, mask = nested_batch(3, pad=True)
    tree = build_tree(ids, attention_mask=mask)
    sched = plan_replay(tree.end, tree.segments, 5)
    q, k, v = qkv(tree.stats.executed_tokens, torch.float64)
    c, pid = sched.chunks[0], sched.prefix_ids
    args = (q[:, c.ids].detach().requires_grad_(), k[:, c.ids].detach().requires_grad_(),
            v[:, c.ids].detach().requires_grad_(), c.end, tree.valid[c.ids], c.segments,
            k[:, pid].detach().requires_grad_(), v[:, pid].detach().requires_grad_(), tree.valid[pid], c.cross,
            0.3, "cpu")
    torch.library.opcheck(torch.ops.brcompile.tree_attention_cached_forward.default, args)
