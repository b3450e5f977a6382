"""The Triton tree linear scan and causal conv (backends/scan/triton.py) against the torch impl (backends/scan/op.py),
on CPU through TRITON_INTERPRET=1 when no GPU exists.

Multi-level trees (prompt groups branching at several depths, several roots after left padding), forward and
backward, with the operands broadcast as state-space layers do (a decay shared over the state dims, Mamba2's
``[1, N, H, 1, 1]`` against ``[1, N, H, P, S]``; a per-token scalar), the token dim not first. float64 is held
to reassociation; float32 to 1e-5; float16 to one rounding of the float32 result (the kernels accumulate in
float32 and round once per output). Tiny sizes: the interpreter runs the kernels' token loop in Python.
"""
import os

import torch

if not torch.cuda.is_available():  # must precede the first `import triton` in this process
    os.environ["TRITON_INTERPRET"] = "1"

import functools  # noqa: E402

import pytest  # noqa: E402

import brcompile  # noqa: E402
from brcompile.backends.scan import op as scan  # noqa: E402
from brcompile.backends.scan import triton as tscan  # noqa: E402
from brcompile.testing import assert_exact  # noqa: E402
from tests.backends.scan.test_scan import dense_of, dense_recurrence, tree_of  # noqa: E402
from tests.passes.canonical.scans.test_linear_scans import scan_lm  # noqa: E402
from tests.helpers import assert_compiles_for_sm90, assert_grads_exact  # noqa: E402
from tests.passes.analysis.rules.test_scan_rules import grpo_like_batch, packed_code, token_loss  # noqa: E402

pytestmark = pytest.mark.triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F64, F32, F16 = torch.float64, torch.float32, torch.float16
EXACT = 1e-12

#: (a's shape, b's shape, token dim) with N for the tokens: a full, a shared over the state dims, Mamba2's
#: per-head decay, a per-token scalar
FULL = ((1, 3, "N", 4), (1, 3, "N", 4), 2)
SHARED_STATES = ((1, 3, "N", 1), (1, 3, "N", 4), 2)
MAMBA2_HEADS = ((1, "N", 2, 1, 1), (1, "N", 2, 3, 2), 1)
SCALAR = (("N", 1), ("N", 5), 0)
#: every layout in float32, broadcast ones in float64 and float16
CASES = [(FULL, F32), (SHARED_STATES, F32), (MAMBA2_HEADS, F32), (SCALAR, F32), (MAMBA2_HEADS, F64),
         (SHARED_STATES, F16)]
CASE_IDS = ["f32-full", "f32-shared_states", "f32-mamba2_heads", "f32-scalar", "f64-mamba2_heads",
            "f16-shared_states"]


def _shape(spec, n):
    return tuple(n if s == "N" else s for s in spec)


def operands(tree, layout, dtype, seed=0):
    """``(a, b)`` on DEVICE in ``dtype``: decays in (0.5, 1.5) (so the states neither vanish nor blow up over a
    path), inputs normal."""
    sa, sb, d = layout
    n = tree.end.shape[0]
    g = torch.Generator().manual_seed(seed)
    a = 0.5 + torch.rand(_shape(sa, n), generator=g, dtype=F64)
    b = torch.randn(_shape(sb, n), generator=g, dtype=F64)
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype), d


def check_close(got, want, dtype, what):
    """float64: reassociation; float32: 1e-5; float16: ``want`` (the float32 computation) rounded once."""
    if dtype == F16:
        torch.testing.assert_close(got.double(), want.double(), rtol=2 ** -10, atol=2 ** -14, msg=what)
    else:
        assert_exact(got.double(), want.double(), EXACT if dtype == F64 else 1e-5, what)


@pytest.mark.parametrize("layout,dtype", CASES, ids=CASE_IDS)
def test_kernels_match_torch_impl_forward_and_backward(layout, dtype):
    """The launchers (forward and backward) against the torch impl on the same inputs; float16 against the
    torch impl in float32 (the kernels' accumulation dtype)."""
    _, _, tree = tree_of(0, groups=2, rows=3, length=9)
    parent = tree.parent.to(DEVICE)
    a, b, d = operands(tree, layout, dtype)
    ref_dtype = F32 if dtype == F16 else dtype
    h = tscan.linear_scan(a, b, parent, d)
    want = scan._torch_linear_scan(a.to(ref_dtype), b.to(ref_dtype), parent, d)
    assert h.dtype == dtype and h.shape == want.shape and h.is_contiguous()
    check_close(h, want, dtype, "h")
    g = torch.randn(h.shape, generator=torch.Generator().manual_seed(5), dtype=F64).to(DEVICE, dtype)
    ga, gb = tscan.linear_scan_backward(g, a, h, parent, d)
    wga, wgb = scan._torch_linear_scan_backward(g.to(ref_dtype), a.to(ref_dtype), h.to(ref_dtype), parent, d)
    check_close(ga, wga, dtype, "grad_a (full shape)")
    check_close(gb, wgb, dtype, "grad_b")


def test_op_with_triton_impl_is_the_dense_recurrence_per_row():
    """The op (impl="triton") through autograd: every root-to-leaf path read through ``index`` is the dense
    recurrence, forward and backward (a shared token's gradient sums its rows'; a's gradient summed back
    over the state dims it was broadcast over), float64; the kernels ran (a spy on their per-token arrays)."""
    _, _, tree = tree_of(1, groups=2, rows=3, length=8)
    n = tree.end.shape[0]
    g = torch.Generator().manual_seed(3)
    a = (0.5 + torch.rand(n, 2, 1, generator=g, dtype=F64)).to(DEVICE).requires_grad_()
    b = torch.randn(n, 2, 3, generator=g, dtype=F64).to(DEVICE).requires_grad_()
    calls = []
    links = tscan.tree_links

    def spy(parent):
        calls.append(parent)
        return links(parent)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tscan, "tree_links", spy)
        out = scan.tree_linear_scan(a, b, tree.parent.to(DEVICE), 0, impl="triton")
        w = torch.randn(tree.index.shape + (2, 3), generator=g, dtype=F64).to(DEVICE)
        got = torch.autograd.grad((dense_of(out, tree.index.to(DEVICE)) * w).sum(), (a, b))
    assert len(calls) == 2, "the triton forward and backward kernels did not both run"
    ref = dense_recurrence(dense_of(a, tree.index.to(DEVICE)), dense_of(b, tree.index.to(DEVICE)))
    assert_exact(dense_of(out, tree.index.to(DEVICE)), ref, EXACT, "tree_linear_scan (triton)")
    want = torch.autograd.grad((ref * w).sum(), (a, b))
    assert got[0].shape == a.shape
    for name, x, y in zip("ab", got, want):
        assert_exact(x, y, EXACT, f"grad of {name}")


def test_tree_links_chains_roots_and_branch_slots():
    """``link``: CHAIN where the parent is the previous token, -1 at roots, else the parent's slot; slots
    only at tokens with a child other than the next token, numbered in preorder."""
    #        0 -> 1 -> 2, 1 -> 3 -> 4, 0 -> 5, root 6 -> 7
    parent = torch.tensor([-1, 0, 1, 1, 3, 0, -1, 6])
    link, slot, count = tscan.tree_links(parent)
    C = tscan.CHAIN
    assert link.tolist() == [-1, C, C, 1, C, 0, -1, C]
    assert slot.tolist() == [0, 1, -1, -1, -1, -1, -1, -1]
    assert count == 2


def test_chain_forest_and_empty():
    """A chain (the dense linear_scan), a forest of single tokens (h = b, zero grad of a) and N = 0."""
    a, b = torch.rand(2, 9, 3, dtype=F64).to(DEVICE), torch.randn(2, 9, 3, dtype=F64).to(DEVICE)
    chain = scan.chain_parent(9, DEVICE)
    assert_exact(tscan.linear_scan(a, b, chain, 1), dense_recurrence(a, b), EXACT, "chain")
    roots = torch.full((9,), -1, device=DEVICE)
    assert torch.equal(tscan.linear_scan(a, b, roots, 1), b)
    ga, gb = tscan.linear_scan_backward(torch.ones_like(b), a, b, roots, 1)
    assert torch.equal(ga, torch.zeros_like(b)) and torch.equal(gb, torch.ones_like(b))
    e = torch.zeros(2, 0, 3, device=DEVICE)
    assert tscan.linear_scan(e, e, torch.zeros(0, dtype=torch.int64, device=DEVICE), 1).shape == (2, 0, 3)


def test_small_blocks_span_several_programs():
    """Features over several programs (block_f 16 against 40 features), one partial."""
    _, _, tree = tree_of(2, groups=2, rows=3, length=7)
    parent = tree.parent.to(DEVICE)
    a, b, d = operands(tree, ((1, 5, "N", 8), (1, 5, "N", 8), 2), F32, seed=4)
    cfg = tscan.ScanConfig(block_f=16, num_warps=1)
    check_close(tscan.linear_scan(a, b, parent, d, cfg), scan._torch_linear_scan(a, b, parent, d), F32, "h")


def test_registry_auto_and_errors():
    """``"auto"`` is torch off CUDA and triton on it; unknown names raise ScanError (also at trace time)."""
    auto = scan.get_scan_impl("auto", DEVICE, F32).name
    assert auto == ("triton" if DEVICE == "cuda" else "torch")
    assert scan.get_scan_impl("triton", DEVICE, F16).linear_scan is tscan.linear_scan
    assert set(scan.SCAN_IMPLS.names()) >= {"torch", "triton"}
    with pytest.raises(scan.ScanError, match="unknown tree scan impl"):
        scan.get_scan_impl("fast", "cpu")
    with pytest.raises(scan.ScanError, match="unknown tree scan impl"):
        scan.tree_linear_scan(torch.ones(3), torch.ones(3), torch.tensor([-1, 0, 1]), 0, impl="fast")
    with pytest.raises(scan.ScanError, match="does not run on"):
        scan.get_scan_impl("triton", DEVICE, torch.int64)


# ------------------------------------------------------------------------------------------ causal conv


@pytest.mark.parametrize("dtype,bias", [(F32, True), (F32, False), (F64, True), (F16, True)],
                         ids=["f32", "f32-nobias", "f64", "f16"])
def test_conv_kernels_match_torch_impl(dtype, bias):
    """Forward and backward of the conv against the torch impl (float16 against it in float32) on a
    multi-level tree with several roots; tiles of 16 tokens x 16 channels so siblings in one tile share an
    ancestor (the atomic adds meet at one address); x not contiguous (a transposed view)."""
    _, _, tree = tree_of(0, groups=2, rows=3, length=9)
    n = tree.end.shape[0]
    parent = tree.parent.to(DEVICE)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 18, 2, generator=g, dtype=F64).permute(2, 1, 0).to(DEVICE, dtype)  # [2, 18, N], strided
    w = torch.randn(18, 1, 4, generator=g, dtype=F64).to(DEVICE, dtype)
    b = torch.randn(18, generator=g, dtype=F64).to(DEVICE, dtype) if bias else None
    cfg = tscan.ConvConfig(block_n=16, block_c=16, num_warps=1)
    ref = F32 if dtype == F16 else dtype
    up = (lambda t: None if t is None else t.to(ref))
    out = tscan.causal_conv1d(x, w, b, parent, cfg)
    assert out.dtype == dtype and out.stride() == torch.empty_like(x).stride()
    check_close(out, scan.causal_conv1d_forward(up(x), up(w), up(b), parent), dtype, "conv out")
    gr = torch.randn(x.shape, generator=g, dtype=F64).to(DEVICE, dtype)
    got = tscan.causal_conv1d_backward(gr, x, w, parent, cfg)
    want = scan.causal_conv1d_backward(up(gr), up(x), up(w), parent)
    for name, u, v in zip(("dx", "dweight", "dbias"), got, want):
        assert u.shape == v.shape and u.dtype == dtype
        check_close(u, v, dtype, name)


def test_conv_op_with_triton_impl_is_the_dense_conv_per_row():
    """The op (impl="triton") through autograd: each dense row read through ``index`` is the dense causal
    conv (``conv1d(padding=W-1, groups=C)[..., :L]``), forward and every gradient (float64)."""
    _, _, tree = tree_of(3, groups=2, rows=3, length=8)
    n = tree.end.shape[0]
    g = torch.Generator().manual_seed(11)
    xp = torch.randn(1, 3, n, generator=g, dtype=F64).to(DEVICE).requires_grad_()
    w = torch.randn(3, 1, 3, generator=g, dtype=F64).to(DEVICE).requires_grad_()
    b = torch.randn(3, generator=g, dtype=F64).to(DEVICE).requires_grad_()
    index = tree.index.to(DEVICE)
    out = scan.tree_causal_conv1d(xp, w, b, tree.parent.to(DEVICE), impl="triton")
    dense_x = xp[0][:, index].permute(1, 0, 2)  # [B, C, L]: each row read from its packed tokens
    ref = torch.nn.functional.conv1d(dense_x, w, b, padding=2, groups=3)[..., :index.shape[1]]
    got_rows = out[0][:, index].permute(1, 0, 2)
    assert_exact(got_rows, ref, EXACT, "tree_causal_conv1d (triton)")
    wt = torch.randn(ref.shape, generator=g, dtype=F64).to(DEVICE)
    got = torch.autograd.grad((got_rows * wt).sum(), (xp, w, b))
    want = torch.autograd.grad((ref * wt).sum(), (xp, w, b))
    for name, u, v in zip(("x", "weight", "bias"), got, want):
        assert_exact(u, v, EXACT, f"grad of {name}")


#: Compiles the kernels for sm_90 (to cubin) in a process without the interpreter: the interpreter does not
#: type-check what the compiler does (a branch that redefines a value with another dtype, say).
COMPILE_SM90 = r"""
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from brcompile.backends.scan import triton as tscan

CONSTEXPRS = ("ACC", "BLOCK_F", "W", "HAS_BIAS", "BLOCK_N", "BLOCK_C", "BLOCK_D", "BLOCK_E")

def signature(fn, dtype, acc, acc_ptrs=("stash_ptr", "dx_ptr", "dw_ptr")):
    out = {}
    for name in fn.arg_names:
        if name in CONSTEXPRS:
            out[name] = "constexpr"
        elif name in acc_ptrs:
            out[name] = "*" + acc
        elif name in ("link_ptr", "slot_ptr", "parent_ptr") or name.endswith("_off_ptr"):
            out[name] = "*i64"
        else:
            out[name] = "*" + dtype if name.endswith("_ptr") else "i32"
    return out

def build(fn, dtype, acc, constexprs, **kw):
    src = ASTSource(fn, signature(fn, dtype, acc, **kw), constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]

for dtype, acc, tl_acc in (("fp16", "fp32", tl.float32),):  # float64 differs in ACC only; each build is slow
    for fn in (tscan._tree_linear_scan_fwd, tscan._tree_linear_scan_bwd):
        assert "bar.sync" in build(fn, dtype, acc, {"ACC": tl_acc, "BLOCK_F": 128}), (fn, dtype)  # branch points
    build(tscan._tree_causal_conv1d_fwd, dtype, acc,
          {"W": 4, "HAS_BIAS": True, "ACC": tl_acc, "BLOCK_N": 64, "BLOCK_C": 32})
    assert "atom" in build(tscan._tree_causal_conv1d_bwd, dtype, acc, {"W": 4, "BLOCK_N": 64, "BLOCK_C": 32})
    # the matrix scan: the outputs in the accumulation dtype; small blocks (the float32 dot unrolls d*d*e FMAs)
    blocks = {"BLOCK_D": 32, "BLOCK_E": 16}
    assert "bar.sync" in build(tscan._tree_matrix_scan_fwd, dtype, acc, blocks, acc_ptrs=("h_ptr",))
    ptx = build(tscan._tree_matrix_scan_bwd, dtype, acc, blocks, acc_ptrs=("gM_ptr", "gb_ptr"))
    assert "bar.sync" in ptx and "atom" in ptx
print("compiled")
"""


@pytest.mark.slow  # a fresh process and six CUDA compiles (~30 s)
def test_kernels_compile_for_sm90():
    """The kernels (float16 inputs, float32 accumulation) go through Triton's whole CUDA pipeline (ttir, ttgir,
    llir, ptx, cubin for sm_90), which the interpreter skips; the scans' branch-point barriers and the conv
    and matrix scan backwards' atomics are in the PTX."""
    assert_compiles_for_sm90(COMPILE_SM90)


# ------------------------------------------------------------------------------------ through the backend


def test_backend_scan_option_runs_the_triton_kernels_exactly():
    """``brcompile.backend(scan="triton")``: the packed graph's tree_linear_scan names the triton impl and
    the loss and every gradient of a state-space LM equal eager's (float64; the scan as the higher-order op,
    which traces fast, against the inlined scan run eagerly: tests/passes/canonical/scans/test_linear_scans.py says why)."""
    model = scan_lm(layers=1, form="generic")
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    fn = functools.partial(token_loss, model)
    args = grpo_like_batch()
    want = fn(*args)
    gw = torch.autograd.grad(want, params)
    model.form = "hop"
    backend = brcompile.backend(compiler="eager", scan="triton", strict=True)
    got = torch.compile(fn, backend=backend)(*args)
    gg = torch.autograd.grad(got, params)
    assert_exact(got, want, EXACT, "loss")
    assert_grads_exact(gg, gw, names, F64)
    code = packed_code(backend)
    assert "brcompile.tree_linear_scan" in code and "'triton'" in code, code


def test_backend_refuses_a_scan_impl_that_does_not_run_here():
    """A scan impl that does not run on the inputs' device is a CannotReplay naming it (the original graph
    runs, exactly), not an error at run time."""
    cuda_only = scan.ScanImpl("triton", tscan.linear_scan, tscan.linear_scan_backward, tscan.causal_conv1d,
                              tscan.causal_conv1d_backward, tscan.matrix_scan, tscan.matrix_scan_backward,
                              device_types=frozenset({"cuda"}))
    model = scan_lm(layers=1, form="hop")  # the higher-order op traces faster than the inlined scan
    fn = functools.partial(token_loss, model)
    args = grpo_like_batch()
    backend = brcompile.backend(compiler="eager", scan="triton", strict=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(scan.SCAN_IMPLS._impls, "triton", cuda_only)
        got = torch.compile(fn, backend=backend)(*args)
    assert_exact(got, fn(*args), EXACT, "loss of the original graph")
    reasons = [r.reason for r in backend.records]
    assert not any(r.rewritten for r in backend.records), reasons
    assert brcompile.Code.SCAN_IMPL in [r.code for r in backend.records], reasons
    assert any("does not run on cpu" in (r or "") and "scan='triton'" in (r or "") for r in reasons), reasons
