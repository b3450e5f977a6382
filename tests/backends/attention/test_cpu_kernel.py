"""The "cpu" impl's compiled kernel (backends/attention/cpu_kernel.py, backends/common/cpu): built where a C++
compiler is, exact against the float64 oracle on every tree shape its loops distinguish, deterministic, used by the
"cpu" impl exactly when it takes the call, and typed in its errors. (test_tree_attention.py runs the "cpu" impl both
ways against dense SDPA.)"""
from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from brcompile.backends.common import cpu as kernels
from brcompile.backends.attention import cpu_kernel
from brcompile.backends.attention.op import TreeAttentionArgs, TreeAttentionError, tree_attention
from brcompile.runtime.tree import build_tree, drop_positions
from brcompile.testing import TOLERANCE

HAS_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None
needs_kernel = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on PATH (the kernel is built on first use)")


@pytest.fixture(autouse=True)
def kernel_on(monkeypatch):
    """Every test here demands the kernel (a failed build raises) unless it says otherwise."""
    monkeypatch.setenv("BRCOMPILE_CPU_KERNELS", "1")


def _tree(rows: list[list[int]], mask: list[list[int]] | None = None, drop: bool = False):
    """The packed tree of ``rows`` (token ids; -1 marks a padded position when ``mask`` is None)."""
    ids = torch.tensor(rows)
    am = (ids >= 0) if mask is None else torch.tensor(mask).bool()
    tree = build_tree([ids.clamp(min=0)], attention_mask=am)
    return drop_positions(tree, am) if drop else tree


def _args(tree, hq, hkv, d, dtype, seed=0, scale=None):
    g = torch.Generator().manual_seed(seed)
    n = tree.num_tokens
    q, k, v = (torch.randn(h, n, d, generator=g, dtype=torch.float64).to(dtype) for h in (hq, hkv, hkv))
    return TreeAttentionArgs(q, k, v, tree.end, tree.valid, tree.segments, d**-0.5 if scale is None else scale)


def _oracle(a, grad_out):
    ref = torch.ops.brcompile.tree_attention_forward(*(x.double() for x in (a.q, a.k, a.v)), *a.tree, a.scale,
                                                     "reference")
    grads = torch.ops.brcompile.tree_attention_backward(grad_out.double(), *(x.double() for x in (a.q, a.k, a.v)),
                                                        *ref, *a.tree, a.scale, "reference")[:3]
    return ref, grads


def _assert_close(got, want, tol, what, floor=0.0):
    scale = max(want.abs().max().item(), floor, 1e-30)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


def _check(a, seed=1):
    """Kernel forward (out, lse) and backward equal the float64 oracle at the contract's bound of a's dtype."""
    out, lse = cpu_kernel.forward(a)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.dtype)
    (ref_out, ref_lse), ref_grads = _oracle(a, grad_out)
    tol = TOLERANCE[a.q.dtype]
    _assert_close(out, ref_out, tol, "out")
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), ~seen), "a query that sees no key has lse = -inf, every other a finite lse"
    _assert_close(lse[seen], ref_lse[seen], tol, "lse")
    assert (out[~seen.expand_as(out[..., 0])] == 0).all(), "a query that sees no key outputs 0"
    grads = cpu_kernel.backward(a, grad_out, out, lse)
    largest = max(g.abs().max().item() for g in ref_grads)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.dtype == a.q.dtype
        _assert_close(g, r, tol, f"d{name}", floor=largest)


@needs_kernel
def test_the_kernel_builds_where_a_compiler_is():
    """Where a C++ compiler is, the kernels build and load: CPU tree attention does not silently fall back."""
    assert kernels.available(), kernels.unavailable_reason()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name,rows,hq,hkv,d", [
    # one prompt, branches of every length, GQA
    ("group", [[5, 6, 7, 8, 1], [5, 6, 7, 8, 2, 3], [5, 6, 7, 9], [5, 6, 7, 9, 4, 4, 4, -1]], 6, 2, 24),
    # a segment longer than a query block (64) and than a key chunk (256): blocks and chunks inside one chain
    ("long_chain", [[1 + (t % 7) for t in range(300)] + [1], [1 + (t % 7) for t in range(300)] + [2, 2]], 2, 1, 16),
    # many tiny segments: nested branches, every leaf one token
    ("nested", [[1, 2, 3], [1, 2, 4], [1, 5, 3], [1, 5, 4], [6], [6, 7]], 3, 3, 8),
    # rows that share nothing, equal rows, D not a multiple of the vector width
    ("unshared", [[1, 2, 3, 4], [2, 3, 4, 5], [1, 2, 3, 4]], 4, 2, 37),
])
def test_kernel_matches_the_oracle(name, rows, hq, hkv, d, dtype):
    width = max(len(r) for r in rows)
    rows = [r + [-1] * (width - len(r)) for r in rows]
    _check(_args(_tree(rows, drop=True), hq, hkv, d, dtype))
    _check(_args(_tree(rows), hq, hkv, d, dtype))  # padding kept: invalid keys inside the tree


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_holes_and_queries_that_see_nothing(dtype):
    """Invalid keys in the middle of a chain are seen by nobody; a query before every valid key of its path
    (left padding) sees nothing: out 0, lse -inf, no gradient."""
    rows = [[0, 0, 3, 4, 5, 6], [0, 0, 3, 4, 7, 8], [0, 9, 9, 9, 9, 9]]
    mask = [[0, 0, 1, 0, 1, 1], [0, 0, 1, 0, 1, 1], [0, 1, 1, 1, 0, 1]]
    a = _args(_tree(rows, mask), 4, 2, 16, dtype)
    assert not bool(a.valid.all())
    _check(a)


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(groups=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 5)), min_size=1, max_size=3),
       tail=st.integers(1, 90), vocab=st.integers(2, 4), pad=st.sampled_from([0.0, 0.3]),
       heads=st.sampled_from([(1, 1), (4, 2), (6, 3), (8, 1)]), seed=st.integers(0, 10_000))
def test_property_random_forests(groups, tail, vocab, pad, heads, seed):
    """Random forests (prompts of several lengths, tails drawn from a small vocabulary so they branch and merge
    again, random invalid positions), float64: the kernel equals the oracle."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for p, n in groups:
        prompt = torch.randint(0, vocab, (p,), generator=g).tolist()
        rows += [prompt + torch.randint(0, vocab, (int(torch.randint(1, tail + 1, (1,), generator=g)),),
                                        generator=g).tolist() for _ in range(n)]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    am = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]).bool()
    am &= torch.rand(am.shape, generator=g) >= pad
    tree = build_tree([ids], attention_mask=am)
    _check(_args(tree, *heads, 8, torch.float64, seed=seed), seed=seed)


@needs_kernel
def test_results_do_not_depend_on_thread_timing():
    """Two runs with several threads give bitwise equal results (dq's per-worker sums are added in a fixed
    order)."""
    rows = [[1, 2, 3] + [4 + (i % 3)] * (10 + 7 * i) for i in range(9)]
    width = max(map(len, rows))
    a = _args(_tree([r + [-1] * (width - len(r)) for r in rows], drop=True), 4, 2, 32, torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        runs = []
        for _ in range(2):
            out, lse = cpu_kernel.forward(a)
            runs.append((out, lse, *cpu_kernel.backward(a, torch.ones_like(out), out, lse)))
    finally:
        torch.set_num_threads(threads)
    for x, y in zip(*runs):
        assert torch.equal(x, y)


@needs_kernel
def test_the_cpu_impl_uses_the_kernel_when_it_takes_the_call(monkeypatch):
    """impl "cpu" runs the kernel for plain float32/float64 calls and the segment-pair schedule for features the
    kernel lacks (a window here), for half precision, and with BRCOMPILE_CPU_KERNELS=0."""
    calls = []
    forward = cpu_kernel.forward
    monkeypatch.setattr(cpu_kernel, "forward", lambda a: calls.append(a.q.dtype) or forward(a))
    tree = _tree([[1, 2, 3, 4], [1, 2, 5, 6]])
    a = _args(tree, 2, 1, 8, torch.float64)

    def run(dtype=torch.float64, **kw):
        tree_attention(a.q.to(dtype), a.k.to(dtype), a.v.to(dtype), a.tree, impl="cpu", **kw)

    run()
    assert calls == [torch.float64]
    run(window=2, position=torch.arange(tree.num_tokens) % 4)
    run(torch.bfloat16)
    monkeypatch.setenv("BRCOMPILE_CPU_KERNELS", "0")
    run()
    assert calls == [torch.float64] and not kernels.available()


@needs_kernel
def test_malformed_trees_raise_the_ops_typed_error():
    """The kernel checks that the segments partition the tokens into chains agreeing with end[] (no range it
    reads can leave the tensors): TreeAttentionError, as the schedule raises it."""
    a = _args(_tree([[1, 2, 3], [1, 2, 4]]), 2, 1, 8, torch.float64)
    bad_end = a.end.clone()
    bad_end[0] -= 1
    with pytest.raises(TreeAttentionError, match="disagrees with segments"):
        cpu_kernel.forward(a.replace(end=bad_end))
    bad = a.segments.clone()
    bad[-1, 1] += 1
    with pytest.raises(TreeAttentionError, match="do not partition"):
        cpu_kernel.backward(a.replace(segments=bad), a.q, a.q, a.q[:, :, 0])


def test_a_failed_build_falls_back_or_raises_as_asked(monkeypatch):
    """Without the kernel (a failed build: no compiler), "auto" warns once and the schedule runs; "1" raises."""
    monkeypatch.setattr(kernels, "_STATE", {})
    monkeypatch.setattr(kernels, "_build", lambda how: (_ for _ in ()).throw(OSError("no compiler here")))
    monkeypatch.setenv("BRCOMPILE_CPU_KERNELS", "auto")
    assert not kernels.available() and "no compiler here" in kernels.unavailable_reason()
    a = _args(_tree([[1, 2, 3], [1, 2, 4]]), 2, 1, 8, torch.float64)
    assert not cpu_kernel.runs(a)
    out = tree_attention(a.q, a.k, a.v, a.tree, impl="cpu")  # the schedule
    torch.testing.assert_close(out, tree_attention(a.q, a.k, a.v, a.tree, impl="reference"), rtol=1e-12, atol=1e-12)
    monkeypatch.setenv("BRCOMPILE_CPU_KERNELS", "1")
    with pytest.raises(kernels.CpuKernelError, match="no compiler here"):
        kernels.available()
