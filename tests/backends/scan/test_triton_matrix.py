"""The Triton tree matrix scan (``brcompile::tree_matrix_scan``, backends/scan/triton.py) against the torch impl
(pointer doubling, backends/scan/matrix.py), on CPU through TRITON_INTERPRET=1 when no GPU exists.

Multi-level trees with several roots (left padding), forward and backward, state sizes below tl.dot's 16 and
not powers of two (the kernels pad with zeros), several column blocks (``grad_M`` summed over them), strided
operands, the token dim not first; float64 held to reassociation, float32 to 1e-5, float16 to one rounding of
the float32 result. The op through autograd against the dense recurrence per row, and a one-layer Qwen3-Next
(the gated delta rule) compiled with ``scan="triton"`` against eager. Tiny sizes: the interpreter runs the
kernels' token loop in Python.
"""
import os

import torch

if not torch.cuda.is_available():  # must precede the first `import triton` in this process
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

import brcompile  # noqa: E402
from brcompile.backends.scan import matrix as ms  # noqa: E402
from brcompile.backends.scan import op as scan  # noqa: E402
from brcompile.backends.scan import triton as tscan  # noqa: E402
from brcompile.testing import assert_exact  # noqa: E402
from tests.backends.scan.test_matrix import dense_matrix_recurrence  # noqa: E402
from tests.backends.scan.test_scan import tree_of  # noqa: E402
from tests.helpers import KeepFloat64, assert_grads_exact, assert_replayed, transformers_or_skip  # noqa: E402
from tests.models.test_hybrids import HYBRIDS, TINY, next_token_loss, tree_batch  # noqa: E402
from tests.passes.analysis.rules.test_scan_rules import packed_code  # noqa: E402

pytestmark = pytest.mark.triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F64, F32, F16 = torch.float64, torch.float32, torch.float16
EXACT = 1e-12


def tree_parent(seed=0):
    """A multi-level tree with two roots (two prompt groups, left padding): its ``parent`` on DEVICE."""
    _, _, tree = tree_of(seed, groups=2, rows=3, length=6)
    return tree, tree.parent.to(DEVICE)


def operands(n, d, e, dtype, seed=0, heads=2):
    """``M [heads, N, d, d]`` (a strided view: stored token-first) and ``b [heads, N, d, e]`` on DEVICE, the
    token dim 1; ``M`` near a scaled identity, as the delta rule's ``exp(g)(I - β k kᵀ)``."""
    g = torch.Generator().manual_seed(seed)
    M = 0.6 * torch.randn(n, heads, d, d, generator=g, dtype=F64) / d ** 0.5 + 0.3 * torch.eye(d, dtype=F64)
    b = torch.randn(heads, n, d, e, generator=g, dtype=F64)
    return M.to(DEVICE, dtype).transpose(0, 1), b.to(DEVICE, dtype)


def check_close(got, want, dtype, what):
    """float64: reassociation; float32: 1e-5; float16: ``want`` (the float32 computation) rounded once."""
    assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous(), what
    if dtype == F16:
        torch.testing.assert_close(got.double(), want.double(), rtol=2 ** -10, atol=2 ** -14, msg=what)
    else:
        assert_exact(got.double(), want.double(), EXACT if dtype == F64 else 1e-5, what)


#: (dtype, d, e, block_e): d and e below 16 and not powers of two; d above 16 with e over two column blocks
CASES = [(F64, 3, 5, 32), (F32, 3, 5, 32), (F32, 18, 20, 16), (F16, 4, 6, 32)]
CASE_IDS = ["f64-d3e5", "f32-d3e5", "f32-d18e20-two_blocks", "f16-d4e6"]


@pytest.mark.parametrize("dtype,d,e,block_e", CASES, ids=CASE_IDS)
def test_kernels_match_torch_impl_forward_and_backward(dtype, d, e, block_e):
    """The launchers against the torch impl on the same inputs (float16 against it in float32, the kernels'
    accumulation dtype): ``h``, and ``(grad_M, grad_b)`` for a random ``grad``."""
    tree, parent = tree_parent()
    assert int((parent < 0).sum()) > 1 and bool((parent[1:] != torch.arange(parent.shape[0] - 1)).any())
    M, b = operands(parent.shape[0], d, e, dtype, seed=d + e, heads=1 if d > 16 else 2)
    cfg = tscan.MatrixScanConfig(block_e=block_e, num_warps=1)
    ref = F32 if dtype == F16 else dtype
    h = tscan.matrix_scan(M, b, parent, 1, cfg)
    check_close(h, ms.torch_matrix_scan(M.to(ref), b.to(ref), parent, 1), dtype, "h")
    g = torch.randn(h.shape, generator=torch.Generator().manual_seed(5), dtype=F64).to(DEVICE, dtype)
    got = tscan.matrix_scan_backward(g, M, h, parent, 1, cfg)
    want = ms.torch_matrix_scan_backward(g.to(ref), M.to(ref), h.to(ref), parent, 1)
    for name, u, v in zip(("grad_M", "grad_b"), got, want):
        check_close(u, v, dtype, name)


def test_op_with_triton_impl_is_the_dense_recurrence_per_row():
    """The op (impl="triton") through autograd, float64: every root-to-leaf path read through ``index`` is the
    dense recurrence, forward and backward (a shared token's gradient sums its rows'); both kernels ran (a
    spy on their per-token arrays)."""
    tree, parent = tree_parent(1)
    n = parent.shape[0]
    M, b = operands(n, 3, 2, F64, seed=9, heads=1)
    M, b = M[0].detach().requires_grad_(), b[0].detach().requires_grad_()  # [N, d, d], [N, d, e]
    calls = []
    links = tscan.tree_links

    def spy(parent):
        calls.append(parent)
        return links(parent)

    index = tree.index.to(DEVICE)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tscan, "tree_links", spy)
        out = ms.tree_matrix_scan(M, b, parent, 0, impl="triton")
        w = torch.randn(index.shape + (3, 2), generator=torch.Generator().manual_seed(2), dtype=F64).to(DEVICE)
        got = torch.autograd.grad((out[index] * w).sum(), (M, b))
    assert len(calls) == 2, "the triton forward and backward kernels did not both run"
    ref = dense_matrix_recurrence(M[index], b[index])
    assert_exact(out[index], ref, EXACT, "tree_matrix_scan (triton)")
    want = torch.autograd.grad((ref * w).sum(), (M, b))
    for name, x, y in zip(("M", "b"), got, want):
        assert_exact(x, y, EXACT, f"grad of {name}")


def test_chain_forest_and_empty():
    """A chain (the dense matrix_scan), a forest of single tokens (h = b, grad_M zero, grad_b = grad) and
    N = 0."""
    M, b = operands(7, 2, 3, F64, seed=3)
    chain = scan.chain_parent(7, DEVICE)
    want = dense_matrix_recurrence(M, b)
    assert_exact(tscan.matrix_scan(M, b, chain, 1), want, EXACT, "chain")
    roots = torch.full((7,), -1, device=DEVICE)
    assert torch.equal(tscan.matrix_scan(M, b, roots, 1), b)
    gM, gb = tscan.matrix_scan_backward(torch.ones_like(b), M, b, roots, 1)
    assert torch.equal(gM, torch.zeros_like(M)) and torch.equal(gb, torch.ones_like(b))
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    M0, b0 = torch.zeros(2, 0, 2, 2, device=DEVICE), torch.zeros(2, 0, 2, 3, device=DEVICE)
    assert tscan.matrix_scan(M0, b0, none, 1).shape == (2, 0, 2, 3)
    assert [t.shape for t in tscan.matrix_scan_backward(b0, M0, b0, none, 1)] == [M0.shape, b0.shape]


def test_registry_dispatch_and_config():
    """The op's ``impl`` resolves through SCAN_IMPLS (triton's matrix scan is the launcher; "auto" is torch
    off CUDA); an unknown name is a ScanError at run and trace time; bad configs are refused."""
    assert scan.get_scan_impl("triton", DEVICE, F32).matrix_scan is tscan.matrix_scan
    assert scan.get_scan_impl("torch", DEVICE, F32).matrix_scan_backward is scan._torch_matrix_scan_backward
    assert scan.get_scan_impl("auto", DEVICE, F32).name == ("triton" if DEVICE == "cuda" else "torch")
    M, b = operands(3, 2, 2, F64, heads=1)
    with pytest.raises(scan.ScanError, match="unknown tree scan impl"):
        ms.tree_matrix_scan(M, b, scan.chain_parent(3, DEVICE), 1, impl="fast")
    with pytest.raises(scan.ScanError, match="unknown tree scan impl"):
        ms._tree_matrix_scan_fake(M, b, scan.chain_parent(3, DEVICE), 1, "fast")
    with pytest.raises(ValueError, match="block_e"):
        tscan.MatrixScanConfig(block_e=24)
    assert tscan.MatrixScanConfig(block_e=64).blocks(3, 100) == (16, 64)
    assert tscan.MatrixScanConfig(block_e=64).blocks(33, 5) == (64, 16)


@pytest.mark.slow  # a Hugging Face model traced, proved and packed (~35 s)
def test_gated_delta_rule_layer_with_triton_scan_is_exact():
    """A one-layer Qwen3-Next (its gated DeltaNet only, float64 with its float32 casts kept) compiled with
    ``scan="triton"`` on a three-level tree batch: loss and every parameter gradient equal eager's, the packed
    graph's tree_matrix_scan names the triton impl, the call replayed."""
    transformers = transformers_or_skip()
    cfg = transformers.AutoConfig.for_model("qwen3_next", **{
        **TINY, **HYBRIDS["qwen3_next"], "num_hidden_layers": 1, "layer_types": ["linear_attention"],
        "mlp_only_layers": [0], "linear_num_value_heads": 2, "linear_num_key_heads": 1})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").double()
    args = tree_batch()
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    with KeepFloat64():
        want = next_token_loss(model, *args)
    gw = torch.autograd.grad(want, params)
    backend = brcompile.backend(compiler="eager", scan="triton", strict=True)
    with KeepFloat64():
        got = torch.compile(next_token_loss, backend=backend)(model, *args)
    assert_exact(got, want, F64, "loss")
    assert_grads_exact(torch.autograd.grad(got, params), gw, names, F64)
    assert_replayed()
    code = packed_code(backend)
    assert "brcompile.tree_matrix_scan" in code and "'triton'" in code, code
