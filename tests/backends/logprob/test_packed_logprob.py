"""brcompile::packed_logprob (cpu and triton impls) against the dense oracle; opcheck, flops, memory.

The oracle builds the dense [N, V] logits and log-probs with plain torch autograd
(``reference_packed_logprob``); the op must give the same log-probs, entropies and gradients of hidden,
weight and bias without any [N, V] buffer. Triton runs in its interpreter on CPU (float32, small V, D).
"""
import os

import torch

if not torch.cuda.is_available():  # must precede the first `import triton` in this process
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from brcompile.backends.logprob import op as lp
from brcompile.backends.logprob.op import (
    LogprobError, count_read_tokens, get_logprob_impl, logprob_backward, logprob_forward, packed_logprob,
    reference_packed_logprob,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float64: dict(atol=1e-12, rtol=1e-10), torch.float32: dict(atol=1e-5, rtol=1e-5)}


def make_inputs(N, D, V, shape, dtype=torch.float64, bias=True, seed=0, skip=0, device="cpu"):
    """Leaf tensors hidden [N, D], weight [V, D], bias [V]; index [*shape] over tokens [0, N - skip)
    (so some tokens are never read) with repeats (branch points), targets [*shape]."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g, dtype=torch.float64) * 0.5).to(device, dtype).requires_grad_()
    b = (torch.randn(V, generator=g, dtype=torch.float64) * 0.1).to(device, dtype).requires_grad_() if bias else None
    index = torch.randint(0, N - skip, shape, generator=g).to(device)
    targets = torch.randint(0, V, shape, generator=g).to(device)
    return h, w, b, index, targets


def grads_of(out, ent, leaves, seed=1):
    """Gradients of a random linear functional of (logp, entropy) w.r.t. ``leaves`` (None-safe)."""
    g = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=g, dtype=torch.float64).to(out)).sum()
    if ent is not None:
        loss = loss + (ent * torch.randn(ent.shape, generator=g, dtype=torch.float64).to(ent)).sum()
    leaves = [x for x in leaves if x is not None]
    return torch.autograd.grad(loss, leaves)


CASES = [
    # N, D, V, request shape, bias, scale, softcap, entropy, chunk, skip
    (13, 7, 29, (3, 5), True, 1.0, 0.0, False, 0, 2),
    (23, 9, 53, (4, 11), False, 1 / 0.7, 0.0, True, 4, 3),
    (17, 5, 37, (2, 9), True, 0.9, 5.0, True, 1, 0),
    (31, 6, 41, (5, 7), True, 1.0, 2.0, False, 7, 0),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", CASES, ids=[f"N{c[0]}V{c[2]}" for c in CASES])
def test_cpu_impl_matches_reference(case, dtype):
    N, D, V, shape, bias, scale, softcap, want_ent, chunk, skip = case
    h, w, b, index, targets = make_inputs(N, D, V, shape, dtype, bias, skip=skip)
    out, ent = packed_logprob(h, w, index, targets, b, scale=scale, softcap=softcap, want_entropy=want_ent,
                              chunk=chunk, impl="cpu")
    ref, rent = reference_packed_logprob(h, w, index, targets, b, scale=scale, softcap=softcap,
                                         want_entropy=want_ent)
    assert out.shape == index.shape and out.dtype == dtype
    assert_close(out, ref, **TOL[dtype])
    if want_ent:
        assert_close(ent, rent, **TOL[dtype])
    else:
        assert ent is None
    got = grads_of(out, ent, (h, w, b))
    want = grads_of(ref, rent, (h, w, b))
    for name, a, r in zip(("hidden", "weight", "bias"), got, want):
        assert_close(a, r, **TOL[dtype], msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_half_inputs_compute_softmax_in_float32(dtype):
    """Half inputs: matmuls in the input dtype, softmax in float32; close to the float32 oracle on the
    same (rounded) values, outputs and grads in the input dtype."""
    h, w, b, index, targets = make_inputs(14, 16, 37, (3, 5), dtype, True, skip=1)
    out, ent = packed_logprob(h, w, index, targets, b, softcap=4.0, want_entropy=True, chunk=4, impl="cpu")
    assert out.dtype == ent.dtype == dtype
    leaves = [x.detach().float().requires_grad_() for x in (h, w, b)]
    ref, rent = reference_packed_logprob(leaves[0], leaves[1], index, targets, leaves[2], softcap=4.0,
                                         want_entropy=True)
    assert_close(out.float(), ref, atol=5e-2, rtol=2e-2)
    assert_close(ent.float(), rent, atol=5e-2, rtol=2e-2)
    for a, r in zip(grads_of(out, ent, (h, w, b)), grads_of(ref, rent, leaves)):
        assert a.dtype == dtype
        assert_close(a.float(), r, atol=5e-2, rtol=5e-2)


def test_branch_point_with_many_targets_and_duplicates():
    """One packed token read by many requests (a branch point), some with the same target twice."""
    h, w, b, _, _ = make_inputs(9, 6, 31, (1,))
    index = torch.tensor([[4, 4, 4, 4, 4, 4], [4, 4, 0, 1, 2, 3]])
    targets = torch.tensor([[1, 2, 3, 5, 8, 1], [1, 30, 0, 0, 0, 0]])
    out, ent = packed_logprob(h, w, index, targets, b, want_entropy=True, chunk=2, impl="cpu")
    ref, rent = reference_packed_logprob(h, w, index, targets, b, want_entropy=True)
    assert_close(out, ref, **TOL[torch.float64])
    assert_close(ent, rent, **TOL[torch.float64])
    for a, r in zip(grads_of(out, ent, (h, w, b)), grads_of(ref, rent, (h, w, b))):
        assert_close(a, r, **TOL[torch.float64])


@pytest.mark.parametrize("which", ["logp", "entropy"])
def test_gradient_of_one_output_only(which):
    """Only one output reaches the loss: the other's gradient is None inside the op (not materialised)."""
    h, w, b, index, targets = make_inputs(11, 5, 23, (3, 4), skip=1)
    out, ent = packed_logprob(h, w, index, targets, b, softcap=3.0, want_entropy=True, chunk=3, impl="cpu")
    ref, rent = reference_packed_logprob(h, w, index, targets, b, softcap=3.0, want_entropy=True)
    x, rx = (out, ref) if which == "logp" else (ent, rent)
    # sum(): a stride-0 upstream gradient
    for a, r in zip(torch.autograd.grad(x.sum(), (h, w, b)), torch.autograd.grad(rx.sum(), (h, w, b))):
        assert_close(a, r, **TOL[torch.float64])


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("kept", ["some", "none"])
def test_requests_with_zero_gradient_are_left_out_exactly(entropy, kept, monkeypatch):
    """A masked loss (zero upstream gradient at most requests, e.g. an RL batch's prompt): the backward leaves
    those requests out (no logits recomputed for tokens only they read) and its gradients equal the reference's,
    also when every request's gradient is zero (dW, db exactly 0, not uninitialised)."""
    h, w, b, index, targets = make_inputs(19, 6, 31, (3, 8), skip=2)
    out, ent = packed_logprob(h, w, index, targets, b, softcap=3.0, want_entropy=entropy, chunk=3, impl="cpu")
    ref, rent = reference_packed_logprob(h, w, index, targets, b, softcap=3.0, want_entropy=entropy)
    mask = torch.zeros(index.shape, dtype=torch.float64)
    if kept == "some":
        mask[:, 5:] = 1.0
        mask[0, 2] = 1.0
    g = torch.Generator().manual_seed(3)
    wl, we = (torch.randn(index.shape, generator=g, dtype=torch.float64) * mask for _ in range(2))
    rows = []
    orig = lp._Workspace.logits
    monkeypatch.setattr(lp._Workspace, "logits", lambda self, hc, *a: rows.append(hc.shape[0]) or orig(self, hc, *a))
    loss = (out * wl).sum() + ((ent * we).sum() if entropy else 0)
    got = torch.autograd.grad(loss, (h, w, b))
    read = index[mask.bool()].unique().numel()
    assert sum(rows) == read, "the backward recomputes the logits of the tokens with a nonzero gradient only"
    rloss = (ref * wl).sum() + ((rent * we).sum() if entropy else 0)
    for a, r in zip(got, torch.autograd.grad(rloss, (h, w, b))):
        assert_close(a, r, **TOL[torch.float64])
    if kept == "none":
        assert all(not x.any() for x in got)


def test_empty_request_set():
    h, w, b, _, _ = make_inputs(5, 3, 7, (1,))
    index = torch.zeros(2, 0, dtype=torch.int64)
    out, ent = packed_logprob(h, w, index, index.clone(), b, want_entropy=True, impl="cpu")
    assert out.shape == (2, 0) and ent.shape == (2, 0)
    gh, gw, gb = torch.autograd.grad(out.sum() + ent.sum(), (h, w, b), allow_unused=True)
    assert all(g is None or not g.any() for g in (gh, gw, gb))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(N=st.integers(1, 20), D=st.integers(1, 6), V=st.integers(2, 40), B=st.integers(1, 4),
       L=st.integers(1, 6), chunk=st.integers(0, 7), softcap=st.sampled_from([0.0, 0.5, 4.0]),
       seed=st.integers(0, 10_000))
def test_property_random_shapes(N, D, V, B, L, chunk, softcap, seed):
    h, w, b, index, targets = make_inputs(N, D, V, (B, L), seed=seed)
    out, ent = packed_logprob(h, w, index, targets, b, scale=0.8, softcap=softcap, want_entropy=True,
                              chunk=chunk, impl="cpu")
    ref, rent = reference_packed_logprob(h, w, index, targets, b, scale=0.8, softcap=softcap, want_entropy=True)
    assert_close(out, ref, **TOL[torch.float64])
    assert_close(ent, rent, **TOL[torch.float64])
    for a, r in zip(grads_of(out, ent, (h, w, b), seed), grads_of(ref, rent, (h, w, b), seed)):
        assert_close(a, r, **TOL[torch.float64])


# ------------------------------------------------------------------------------ memory: no [N, V] anywhere


class LargestTensor(TorchDispatchMode):
    """Records the largest numel of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_forward_and_backward_stay_within_chunk_memory():
    """With chunk C, no op of the forward or backward returns more than max(C * V, V * D, N * D) elements
    (the full [N, V] logits never exist)."""
    N, D, V, C = 61, 4, 97, 5
    h, w, b, index, targets = make_inputs(N, D, V, (7, 9), bias=True)
    impl = get_logprob_impl("cpu", "cpu", torch.float64)
    with torch.no_grad(), LargestTensor() as mode:
        logprob_forward(h, w, b, index, targets, 1.0, 3.0, True, C, impl)
        g = torch.ones(index.shape, dtype=torch.float64)
        logprob_backward(g, g, h, w, b, index, targets, 1.0, 3.0, C, impl)
    bound = max(C * V, V * D, N * D)
    assert mode.largest <= bound < N * V, (mode.largest, bound)


def test_saved_for_backward_is_inputs_only():
    """Autograd keeps hidden, weight, bias, index and targets alive, nothing [N, V]."""
    N, D, V = 40, 6, 113
    h, w, b, index, targets = make_inputs(N, D, V, (6, 8))
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        packed_logprob(h, w, index, targets, b, want_entropy=True, impl="cpu")
    assert saved and max(saved) <= max(V * D, N * D), saved
    assert sum(saved) <= N * D + V * D + V + 2 * index.numel()


def test_automatic_chunk_rows(monkeypatch):
    monkeypatch.setattr(lp, "CHUNK_BYTES", 4 * 10 * 50)
    monkeypatch.setattr(lp, "MIN_CHUNK_ROWS", 4)
    cpu = torch.device("cpu")
    assert lp._chunk_rows(0, 50, 1000, cpu) == 10  # the byte budget
    assert lp._chunk_rows(0, 50, 3, cpu) == 3  # no more rows than there are
    assert lp._chunk_rows(7, 50, 1000, cpu) == 7  # explicit
    assert lp._chunk_rows(0, 10 ** 9, 1000, cpu) == 4  # the minimum
    assert lp._chunk_rows(0, 10 ** 9, 0, cpu) == 1


# ------------------------------------------------------------------------------- op registration


def _op_args(dtype=torch.float64, bias=True, impl="cpu", device="cpu"):
    h, w, b, index, targets = make_inputs(12, 5, 19, (3, 4), dtype, bias, skip=2, device=device)
    return (h, w, b, index, targets, 0.8, 2.0, True, 3, impl)


@pytest.mark.parametrize("bias", [True, False])
def test_opcheck(bias):
    """torch.library.opcheck: schema, fake impl, autograd registration, AOT dispatch (static + dynamic)."""
    args = _op_args(bias=bias)
    torch.library.opcheck(torch.ops.brcompile.packed_logprob.default, args)
    h, w, b, index, targets = (x.detach() if isinstance(x, torch.Tensor) else x for x in args[:5])
    g = torch.ones(index.shape, dtype=torch.float64).expand(index.shape)
    torch.library.opcheck(torch.ops.brcompile.packed_logprob_backward.default,
                          (g, None, h, w, b, index, targets, 0.8, 2.0, 3, "cpu"))


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        h, w = torch.empty(10, 4), torch.empty(33, 4)
        index = torch.empty(3, 7, dtype=torch.int64)
        out, ent = torch.ops.brcompile.packed_logprob(h, w, None, index, index, 1.0, 0.0, False, 0, "auto")
        assert out.shape == (3, 7) and ent.shape == (0,)
        out, ent = torch.ops.brcompile.packed_logprob(h, w, None, index, index, 1.0, 0.0, True, 0, "auto")
        assert ent.shape == (3, 7)


def test_flop_formula_counts_read_tokens():
    h, w, b, index, targets = make_inputs(12, 5, 19, (3, 4), skip=2)
    M = count_read_tokens(index, 12)
    assert M == torch.unique(index).numel() < 12
    with FlopCounterMode(display=False) as counter:
        out, _ = packed_logprob(h, w, index, targets, b, impl="cpu")
        out.sum().backward()
    assert counter.get_total_flops() == 2 * M * 5 * 19 + 6 * M * 5 * 19


def test_dropped_index_reads_zero_and_counts_no_token():
    """index -1 (a position drop_padding left out): log-prob and entropy 0, no token read; -2 is refused."""
    h, w, b, index, targets = make_inputs(7, 4, 13, (2, 5))
    index[0, 3:] = -1
    assert count_read_tokens(index, 7) == int(torch.unique(index[index >= 0]).numel())
    out, ent = packed_logprob(h, w, index, targets, b, want_entropy=True, impl="cpu")
    ref, rent = reference_packed_logprob(h, w, index, targets, b, want_entropy=True)
    assert bool((out[0, 3:] == 0).all()) and bool((ent[0, 3:] == 0).all())
    assert_close(out, ref, **TOL[torch.float64])
    assert_close(ent, rent, **TOL[torch.float64])
    with pytest.raises(LogprobError, match="or -1"):
        packed_logprob(h, w, index.clamp(min=-1) - (index < 0).long(), targets, b, impl="cpu")


def test_bad_inputs_raise():
    h, w, b, index, targets = make_inputs(6, 3, 11, (2, 3))
    with pytest.raises(LogprobError, match="disagree on D"):
        packed_logprob(h, w[:, :2], index, targets, b)
    with pytest.raises(LogprobError, match="differ in shape"):
        packed_logprob(h, w, index, targets[:, :2], b)
    with pytest.raises(LogprobError, match="int64"):
        packed_logprob(h, w, index.int(), targets, b)
    with pytest.raises(LogprobError, match="targets must be in"):
        packed_logprob(h, w, index, targets + 11, b, impl="cpu")
    with pytest.raises(LogprobError, match="index values must be in"):
        packed_logprob(h, w, index + 6, targets, b, impl="cpu")
    with pytest.raises(LogprobError, match="softcap"):
        packed_logprob(h, w, index, targets, b, softcap=-1.0)
    with pytest.raises(LogprobError, match="scale"):
        packed_logprob(h, w, index, targets, b, scale=0.0)
    with pytest.raises(LogprobError, match="unknown packed_logprob impl"):
        packed_logprob(h, w, index, targets, b, impl="nope")
    with pytest.raises(LogprobError, match="bias"):
        packed_logprob(h, w, index, targets, b[:3])


def test_auto_resolves_to_cpu_without_cuda_and_for_float64():
    assert get_logprob_impl("auto", "cpu", torch.float32).name == "cpu"
    assert get_logprob_impl("auto", "cuda", torch.float64).name == "cpu"


# ------------------------------------------------------------------------------------------- triton

triton_only = pytest.mark.triton


def _triton():
    pytest.importorskip("triton")
    from brcompile.backends.logprob import triton as tlp

    return tlp


@triton_only
@pytest.mark.parametrize("case", CASES[:3], ids=[f"N{c[0]}V{c[2]}" for c in CASES[:3]])
def test_triton_impl_matches_float64_reference(case):
    _triton()
    N, D, V, shape, bias, scale, softcap, want_ent, chunk, skip = case
    h, w, b, index, targets = make_inputs(N, D, V, shape, torch.float32, bias, skip=skip, device=DEVICE)
    out, ent = packed_logprob(h, w, index, targets, b, scale=scale, softcap=softcap, want_entropy=want_ent,
                              chunk=chunk, impl="triton")
    leaves64 = [x.detach().double().requires_grad_() if x is not None else None for x in (h, w, b)]
    ref, rent = reference_packed_logprob(leaves64[0], leaves64[1], index, targets, leaves64[2], scale=scale,
                                         softcap=softcap, want_entropy=want_ent)
    assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    if want_ent:
        assert_close(ent.double(), rent, atol=1e-5, rtol=1e-5)
    for a, r in zip(grads_of(out, ent, (h, w, b)), grads_of(ref, rent, leaves64)):
        assert_close(a.double(), r, atol=1e-5, rtol=1e-5)


@triton_only
def test_triton_row_kernels_multi_tile():
    """Rows wider than one tile (block_v 16 over V = 53): the online logsumexp rescales across tiles."""
    tlp = _triton()
    cfg = tlp.RowConfig(block_v=16, num_warps=1)
    g = torch.Generator().manual_seed(3)
    raw = (torch.randn(6, 53, generator=g) * 4).to(DEVICE)
    G, GH = torch.randn(6, generator=g).to(DEVICE), torch.randn(6, generator=g).to(DEVICE)
    cpu = get_logprob_impl("cpu", DEVICE, torch.float32)
    rows = torch.tensor([0, 0, 3, 5, 2], device=DEVICE)
    targets = torch.tensor([0, 52, 7, 16, 16], device=DEVICE)
    for softcap in (0.0, 3.0):
        lse, ent = tlp.row_stats(raw, 0.7, softcap, True, cfg)
        z = lp.softcap_logits(raw, 0.7, softcap)
        assert_close(lse, torch.logsumexp(z, -1), atol=1e-5, rtol=1e-5)
        lpz = torch.log_softmax(z, -1)
        assert_close(ent, -(lpz.exp() * lpz).sum(-1), atol=1e-5, rtol=1e-5)
        out, ent2 = tlp.row_forward(raw, rows, targets, 0.7, softcap, False, config=cfg)
        assert ent2 is None
        assert_close(out, lpz[rows, targets], atol=1e-5, rtol=1e-5)
        for g_, gh_ in ((G, GH), (None, GH), (G, None)):
            d = tlp.row_grad(raw.clone(), 0.7, softcap, g_, gh_, config=cfg)
            assert_close(d, cpu.row_grad(raw.clone(), 0.7, softcap, g_, gh_), atol=1e-6, rtol=1e-5)


@triton_only
def test_triton_opcheck():
    _triton()
    args = _op_args(torch.float32, impl="triton", device=DEVICE)
    torch.library.opcheck(torch.ops.brcompile.packed_logprob.default, args)


@triton_only
def test_triton_config_and_dtype_errors():
    tlp = _triton()
    with pytest.raises(ValueError, match="block_v"):
        tlp.RowConfig(block_v=24)
    with pytest.raises(ValueError, match="num_warps"):
        tlp.RowConfig(num_warps=3)
    with pytest.raises(TypeError, match="float32"):
        tlp.row_stats(torch.zeros(2, 5, dtype=torch.float64, device=DEVICE), 1.0, 0.0, False)
    h, w, b, index, targets = make_inputs(6, 3, 11, (2, 3), device=DEVICE)  # float64
    with pytest.raises(LogprobError, match="does not run"):
        packed_logprob(h, w, index, targets, b, impl="triton")
    assert tlp.is_interpreter() == (DEVICE == "cpu")
