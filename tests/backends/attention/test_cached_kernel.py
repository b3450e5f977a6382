"""The compiled kernel's cached entry (backends/common/cpu/tree_attention.cpp, ``brcompile_cpu::
tree_attention_cached_forward`` / ``_backward``; backends/attention/cpu_kernel.py ``cached_forward`` /
``cached_backward``): a chunk's queries over their own tree and a cached prefix's K/V through cross rows, in one
call, against a dense float64 oracle of the same definition (backends/attention/cached.py's docstring): query q of
the chunk sees chunk key k iff ``k <= q < end[k]`` and ``valid[k]``, and cache key c once per cross row
``(q0, q1, k0, k1)`` with ``q0 <= q < q1``, ``k0 <= c < k1`` and ``cache_valid[c]``. Cross rows here are arbitrary
(straddling segments, empty, overlapping), not only the ones the streaming and window plans make."""
from __future__ import annotations

import shutil

import pytest
import torch

import brcompile.backends.attention.cached as cached
from brcompile.backends.attention import cpu_kernel
from brcompile.backends.attention.args import TreeAttentionArgs, TreeAttentionError
from brcompile.backends.attention.cached import CachedPrefix, tree_attention_cached
from brcompile.runtime.tree import build_tree
from brcompile.testing import TOLERANCE

HAS_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None
pytestmark = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on PATH (the kernel is built on first use)")


@pytest.fixture(autouse=True)
def kernel_on(monkeypatch):
    """Every test here demands the kernel (a failed build raises)."""
    monkeypatch.setenv("BRCOMPILE_CPU_KERNELS", "1")


def _chunk_tree(seed: int, pad: bool):
    """A chunk's tree: rows sharing prefixes at several depths, optionally with invalid (padded) keys."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(1, 4, (5, 11), generator=g)
    rows[:3, :4] = 7
    rows[1:3, 4:6] = 8
    mask = torch.ones_like(rows, dtype=torch.bool)
    if pad:
        mask[0, -3:] = False
        mask[3, :2] = False
    return build_tree([rows], attention_mask=mask)


def _case(seed: int, hq: int, hkv: int, d: int, P: int, cross: list, pad: bool = True, dtype=torch.float64):
    tree = _chunk_tree(seed, pad)
    n = tree.num_tokens
    g = torch.Generator().manual_seed(seed + 100)
    q = torch.randn(hq, n, d, generator=g, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(hkv, n, d, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    kc, vc = (torch.randn(hkv, P, d, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    cv = torch.rand(P, generator=g) > 0.3
    a = TreeAttentionArgs(q, k, v, tree.end, tree.valid, tree.segments, d**-0.5)
    c = CachedPrefix(kc, vc, cv, torch.tensor(cross, dtype=torch.int64).reshape(-1, 4))
    return a, c


def _oracle(a, c, grad_out):
    """Dense float64 (out, lse) and (dq, dk, dv, dk_cache, dv_cache): weights counted with each pair's multiplicity
    (a pair two cross rows hold counts twice, as two merged calls would)."""
    q, k, v, kc, vc = (x.detach().double().requires_grad_() for x in (a.q, a.k, a.v, c.k_cache, c.v_cache))
    n, P, hkv = q.shape[1], kc.shape[1], k.shape[0]
    g = q.shape[0] // hkv
    idx = torch.arange(n)
    mult_tree = ((idx[None, :] <= idx[:, None]) & (idx[:, None] < a.end[None, :]) & a.valid[None, :]).double()
    mult_cache = torch.zeros(n, P, dtype=torch.float64)
    for q0, q1, k0, k1 in c.cross.tolist():
        if q1 > q0 and k1 > k0:
            mult_cache[q0:q1, k0:k1] += c.cache_valid[k0:k1].double()
    mult = torch.cat([mult_tree, mult_cache], 1)  # [n, n + P]
    keys = torch.cat([k, kc], 1).repeat_interleave(g, 0)
    vals = torch.cat([v, vc], 1).repeat_interleave(g, 0)
    s = (q @ keys.transpose(1, 2)) * a.scale
    s = s.masked_fill(mult[None] == 0, float("-inf")) + torch.log(mult.clamp(min=1))[None]
    lse = torch.logsumexp(s, -1)
    seen = mult.sum(1) > 0
    p = torch.where(seen[None, :, None], torch.exp(s - lse.masked_fill(~seen[None], 0)[..., None]), 0.0)
    out = p @ vals
    grads = torch.autograd.grad((out * grad_out.double()).sum(), (q, k, v, kc, vc))
    return out.detach(), lse.detach(), grads


def _assert_close(got, want, tol, what):
    scale = max(want.abs().max().item(), 1e-30) if want.numel() else 1.0
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


def _check(a, c, tol=None):
    tol = TOLERANCE[a.q.dtype] if tol is None else tol
    out, lse = cpu_kernel.cached_forward(a, c)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    want_out, want_lse, want_grads = _oracle(a, c, grad_out)
    _assert_close(out, want_out, tol, "out")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse)), "lse = -inf exactly where a query sees nothing"
    fin = torch.isfinite(want_lse)
    _assert_close(lse[fin], want_lse[fin], tol, "lse")
    grads = cpu_kernel.cached_backward(a, c, grad_out.to(a.q.dtype), out, lse)
    for name, got, want in zip(("dq", "dk", "dv", "dk_cache", "dv_cache"), grads, want_grads):
        assert got.shape == want.shape and got.dtype == a.q.dtype, name
        _assert_close(got, want, tol, name)


# cross rows: (q_start, q_stop, k_start, k_stop) over the chunk's queries and the cache's keys
CASES = {
    "one-row": (9, [(0, 10**9, 0, 9)]),  # q_stop clipped to n below
    "per-range": (40, [(0, 12, 0, 20), (12, 30, 20, 33), (5, 25, 33, 40)]),
    "straddling-and-empty": (30, [(3, 17, 2, 29), (8, 8, 0, 30), (10, 20, 5, 5), (0, 2, 0, 1)]),
    "overlapping": (50, [(0, 40, 0, 30), (10, 30, 10, 50), (10, 30, 10, 50)]),
    "long-cache": (700, [(0, 15, 0, 300), (15, 10**9, 0, 700), (2, 9, 299, 301)]),
}


def _clip(cross, n):
    return [(q0, min(q1, n), k0, k1) for q0, q1, k0, k1 in cross]


@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("name", list(CASES))
def test_cached_kernel_matches_the_oracle(name, heads):
    P, cross = CASES[name]
    n = _chunk_tree(0, True).num_tokens
    a, c = _case(0, *heads, 20, P, _clip(cross, n))
    _check(a, c, tol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cached_kernel_dtypes_and_no_holes(dtype):
    n = _chunk_tree(1, False).num_tokens
    a, c = _case(1, 4, 2, 16, 70, [(0, n // 2, 0, 40), (n // 2, n, 10, 70)], pad=False, dtype=dtype)
    _check(a, c)
    c = CachedPrefix(c.k_cache, c.v_cache, torch.ones_like(c.cache_valid), c.cross)
    _check(a, c)


def test_cache_ranges_without_a_valid_key_and_empty_caches():
    """A cross range whose cache keys are all invalid adds nothing; an empty cache or no cross rows is plain tree
    attention (the same as the plain kernel)."""
    n = _chunk_tree(2, True).num_tokens
    a, c = _case(2, 4, 2, 8, 12, [(0, n, 0, 6), (4, n, 6, 12)])
    cv = c.cache_valid.clone()
    cv[:6] = False
    _check(a, CachedPrefix(c.k_cache, c.v_cache, cv, c.cross), tol=1e-12)
    for cache in (CachedPrefix(c.k_cache, c.v_cache, c.cache_valid, c.cross[:0]),
                  CachedPrefix(c.k_cache[:, :0], c.v_cache[:, :0], c.cache_valid[:0], c.cross[:0])):
        _check(a, cache, tol=1e-12)
        out, lse = cpu_kernel.cached_forward(a, cache)
        plain = cpu_kernel.forward(a)
        assert torch.equal(out, plain[0]) and torch.equal(lse, plain[1])


def test_cached_kernel_is_deterministic_across_threads():
    n = _chunk_tree(3, True).num_tokens
    a, c = _case(3, 4, 2, 32, 600, [(0, n, 0, 600), (3, n - 2, 100, 400)])
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        go = torch.randn(a.q.shape, dtype=torch.float64)
        runs = []
        for _ in range(2):
            out, lse = cpu_kernel.cached_forward(a, c)
            runs.append((out, lse, *cpu_kernel.cached_backward(a, c, go, out, lse)))
    finally:
        torch.set_num_threads(threads)
    for x, y in zip(*runs):
        assert torch.equal(x, y)


def test_the_cached_op_runs_the_kernel_and_equals_the_other_path(monkeypatch):
    """brcompile::tree_attention_cached_forward/backward call the kernel once each for a featureless float64 CPU
    chunk with impl "cpu"; with it off (the chunk through its impl, the cross pairs through torch's flash kernel)
    values and gradients agree within float64's bound; impl "reference" never takes the kernel."""
    n = _chunk_tree(4, True).num_tokens
    a, c = _case(4, 4, 2, 16, 50, [(0, n, 0, 20), (6, n, 20, 50)])
    calls = []
    for fn in ("cached_forward", "cached_backward"):
        orig = getattr(cpu_kernel, fn)
        monkeypatch.setattr(cpu_kernel, fn, lambda *x, _o=orig, _f=fn: calls.append(_f) or _o(*x))

    def run(impl):
        q, k, v, kc, vc = (x.detach().clone().requires_grad_() for x in (a.q, a.k, a.v, c.k_cache, c.v_cache))
        out = tree_attention_cached(q, k, v, a.tree, kc, vc, c.cache_valid, c.cross, a.scale, impl)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)
        return (out, *torch.autograd.grad((out * w).sum(), (q, k, v, kc, vc)))

    on = run("cpu")
    assert calls == ["cached_forward", "cached_backward"]
    monkeypatch.setattr(cached, "USE_CPU_KERNEL", False)
    off, ref = run("cpu"), run("reference")
    assert calls == ["cached_forward", "cached_backward"]
    for x, y, z in zip(on, off, ref):
        _assert_close(x, y.double(), 1e-12, "kernel vs flash path")
        _assert_close(x, z.double(), 1e-12, "kernel vs reference")


def test_malformed_cross_rows_raise_the_ops_typed_error():
    n = _chunk_tree(5, False).num_tokens
    a, c = _case(5, 2, 2, 8, 10, [(0, n + 1, 0, 5)])
    with pytest.raises(TreeAttentionError, match="cross row 0"):
        cpu_kernel.cached_forward(a, c)
    a, c = _case(5, 2, 2, 8, 10, [(0, n, 0, 11)])
    with pytest.raises(TreeAttentionError, match="cross row 0"):
        cpu_kernel.cached_backward(a, c, a.q, a.q, a.q[..., 0])
