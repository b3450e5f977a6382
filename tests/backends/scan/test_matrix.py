"""brcompile::tree_matrix_scan (backends/scan/matrix.py) against the dense matrix recurrence per row.

The truth: for a dense batch whose rows are read from packed tokens through the tree's ``index`` (rows sharing
a prefix share its values), the op's packed output read back through ``index`` equals the sequential
``h_t = M_t @ h_{t-1} + b_t`` along each row, and the gradients w.r.t. the packed inputs (through the gather, so
a shared token sums its rows) equal the loop's. Multi-level random trees (tests/backends/scan/test_scan.py), float64.
"""
from __future__ import annotations

import pytest
import torch

from brcompile.backends.scan import matrix as ms, reference
from brcompile.backends.scan.paths import ScanError, chain_parent
from brcompile.testing import assert_exact
from tests.backends.scan.test_scan import tree_of

F64 = torch.float64
#: the ops multiply the loop's factors in another grouping: float64 reassociation only
EXACT = 1e-12


def dense_matrix_recurrence(M: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The sequential oracle along dim 1 of ``[B, L, ..., d, d]`` / ``[B, L, ..., d, e]``: a Python loop."""
    h, out = torch.zeros_like(b[:, 0]), []
    for t in range(b.shape[1]):
        h = M[:, t] @ h + b[:, t]
        out.append(h)
    return torch.stack(out, 1)


def operands(n: int, seed: int, lead=(), d: int = 3, e: int = 2, requires_grad: bool = True):
    """Contractive-ish random ``M [n, *lead, d, d]`` (the delta rule's ``exp(g)(I - β k kᵀ)`` is) and ``b``."""
    g = torch.Generator().manual_seed(seed)
    M = 0.6 * torch.randn(n, *lead, d, d, generator=g, dtype=F64) / d ** 0.5 + 0.3 * torch.eye(d, dtype=F64)
    b = torch.randn(n, *lead, d, e, generator=g, dtype=F64)
    return M.requires_grad_(requires_grad), b.requires_grad_(requires_grad)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_forward_backward_vs_dense_rows(seed):
    """Every root-to-leaf path (a dense row read through ``index``) is the sequential recurrence, forward and
    backward (a shared token's gradient sums its rows'); the preorder oracle agrees too."""
    _, _, tree = tree_of(seed)
    N = tree.end.shape[0]
    M, b = operands(N, seed + 40, lead=(2,))
    out = ms.tree_matrix_scan(M, b, tree.parent, 0)
    ref = dense_matrix_recurrence(M[tree.index], b[tree.index])
    assert_exact(out[tree.index], ref, EXACT, "tree_matrix_scan")
    assert_exact(out, reference.reference_matrix_scan(M, b, tree.end, 0), EXACT, "vs oracle")
    w = torch.randn(ref.shape, dtype=F64, generator=torch.Generator().manual_seed(seed))
    got = torch.autograd.grad((out[tree.index] * w).sum(), (M, b))
    want = torch.autograd.grad((ref * w).sum(), (M, b))
    for name, x, y in zip(("M", "b"), got, want):
        assert_exact(x, y, EXACT, f"grad of {name}")


def test_not_a_scan_over_packed_order():
    """The previous packed token is not the path's parent: the chain over packed order differs."""
    _, _, tree = tree_of(1)
    N = tree.end.shape[0]
    M, b = operands(N, 5, requires_grad=False)
    assert not torch.allclose(ms.tree_matrix_scan(M, b, tree.parent, 0),
                              ms.tree_matrix_scan(M, b, chain_parent(N), 0))


def test_dense_matrix_scan_is_the_chain_along_a_later_dim():
    """``matrix_scan`` (what the delta-rule rewrite emits) along dim 2 of ``[B, H, L, d, d]``, as the loop;
    gradients too."""
    M, b = operands(2, 7, lead=(3, 9), d=4, e=3)  # [B=2, H=3, L=9, 4, 4]
    got = ms.matrix_scan(M, b, 2)
    want = dense_matrix_recurrence(M.transpose(1, 2), b.transpose(1, 2)).transpose(1, 2)
    assert_exact(got, want, EXACT, "dense matrix scan")
    assert_exact(ms.matrix_scan(M, b, -1), got, EXACT, "dim -1 of the batch dims")
    w = torch.randn_like(want)
    for name, x, y in zip(("M", "b"), torch.autograd.grad((got * w).sum(), (M, b)),
                          torch.autograd.grad((want * w).sum(), (M, b))):
        assert_exact(x, y, EXACT, f"grad of {name}")


def test_gradcheck_and_opcheck():
    _, _, tree = tree_of(9, groups=2, rows=3, length=7)
    N = tree.end.shape[0]
    M, b = operands(N, 3, d=2, e=2)
    assert torch.autograd.gradcheck(lambda M, b: ms.tree_matrix_scan(M, b, tree.parent, 0), (M, b))
    torch.library.opcheck(torch.ops.brcompile.tree_matrix_scan.default, (M, b, tree.parent, 0))


def test_bad_arguments_are_named():
    M, b = operands(4, 0, requires_grad=False)
    with pytest.raises(ScanError, match="same batch dims"):
        ms.tree_matrix_scan(M, b[..., :2, :], chain_parent(4), 0)
    with pytest.raises(ScanError, match="parent has"):
        ms.tree_matrix_scan(M, b, chain_parent(5), 0)
    with pytest.raises(ScanError, match="one dtype"):
        ms.tree_matrix_scan(M.float(), b, chain_parent(4), 0)


def test_flops_are_the_dense_recurrences():
    """FlopCounterMode counts the forward as the dense loop's ``[d, d] @ [d, e]`` products and adds."""
    from torch.utils.flop_counter import FlopCounterMode
    M, b = operands(5, 1, lead=(2,), d=3, e=2, requires_grad=False)
    with FlopCounterMode(display=False) as fc:
        ms.matrix_scan(M, b, 0)
    assert fc.get_total_flops() == 5 * 2 * (2 * 3 * 2 * (3 + 1))
