"""brcompile::tree_cumsum / tree_causal_conv1d / tree_linear_scan / tree_parent (backends/scan/op.py) against the
dense ops per row.

The truth: for a dense batch whose rows are read from packed tokens through the tree's ``index`` (so rows
sharing a prefix share its values), the op's packed output read back through ``index`` equals the dense
op along each row — ``cumsum(dim=1)``, or ``conv1d(padding=W-1, groups=C)[..., :L]`` — and the gradients
w.r.t. the packed inputs (through the gather, so a shared token sums its rows) equal the op's. Multi-level
random trees (several prompt groups, branching at several depths), left padding included; float64.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from brcompile.backends.scan import op as scan, reference
from brcompile.runtime.tree import build_tree, drop_padding
from brcompile.testing import assert_exact

F64 = torch.float64
#: the ops add the dense op's terms in another order: float64 reassociation only
EXACT = 1e-12


def branching_batch(seed: int, groups: int = 3, rows: int = 4, length: int = 13, vocab: int = 3,
                    left_pad: bool = True):
    """``[B, L]`` ids of ``groups`` prompt groups whose rows branch at several depths (a small vocabulary
    makes rows share prefixes past the prompt), and an attention mask with left padding of 0–3 columns."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 1 + vocab, (groups * rows, length), generator=g)
    for k in range(groups):
        prompt = int(torch.randint(2, length // 2, (1,), generator=g))
        ids[k * rows:(k + 1) * rows, :prompt] = ids[k * rows, :prompt]
        ids[k * rows + 1, :length - 2] = ids[k * rows, :length - 2]  # a branch near the leaves
    am = torch.ones_like(ids)
    if left_pad:
        for b in range(ids.shape[0]):
            p = int(torch.randint(0, 4, (1,), generator=g))
            am[b, :p] = 0
            ids[b, :p] = 0
    return ids, am


def tree_of(seed: int, **kw):
    ids, am = branching_batch(seed, **kw)
    tree = build_tree(ids, attention_mask=am)
    assert tree.segments.shape[0] > 2 * kw.get("groups", 3)  # branches below the prompts too
    return ids, am, tree


SEEDS = [0, 1, 2]


# --------------------------------------------------------------------------------------- parent


@pytest.mark.parametrize("seed", SEEDS)
def test_parent_from_end_is_the_trees_parent(seed):
    _, _, tree = tree_of(seed)
    assert torch.equal(scan.tree_parent(tree.end), tree.parent)
    kept = drop_padding(tree)  # a forest with several roots and chains re-hung under kept ancestors
    assert torch.equal(scan.tree_parent(kept.end), kept.parent)


def test_parent_of_empty_and_single():
    assert scan.tree_parent(torch.zeros(0, dtype=torch.int64)).shape == (0,)
    assert scan.tree_parent(torch.tensor([1])).tolist() == [-1]
    assert scan.tree_parent(torch.tensor([3, 3, 3, 4])).tolist() == [-1, 0, 1, -1]


# --------------------------------------------------------------------------------------- cumsum


def dense_of(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[N, ...]`` packed values -> ``[B, L, ...]`` dense rows (a gather: shared tokens sum gradients)."""
    return packed[index]


@pytest.mark.parametrize("seed", SEEDS)
def test_cumsum_float64_forward_backward_vs_dense_rows(seed):
    _, _, tree = tree_of(seed)
    N = tree.end.shape[0]
    g = torch.Generator().manual_seed(seed + 10)
    xp = torch.randn(N, 5, generator=g, dtype=F64, requires_grad=True)
    out = scan.tree_cumsum(xp, tree.parent, 0)
    ref = dense_of(xp, tree.index).cumsum(1)
    assert_exact(dense_of(out, tree.index), ref, EXACT, "tree_cumsum")
    w = torch.randn(ref.shape, generator=g, dtype=F64)
    got, = torch.autograd.grad((dense_of(out, tree.index) * w).sum(), xp)
    want, = torch.autograd.grad((ref * w).sum(), xp)
    assert_exact(got, want, EXACT, "tree_cumsum grad")
    assert_exact(out, reference.reference_cumsum(xp, tree.end, 0), EXACT, "tree_cumsum vs oracle")


def test_cumsum_along_a_later_dim():
    """The token dim need not be the first: ``[1, H, N, D]`` along dim 2 (and a negative dim)."""
    _, _, tree = tree_of(3)
    N = tree.end.shape[0]
    xp = torch.randn(1, 2, N, 3, dtype=F64)
    dense = xp[0].movedim(1, 0)[tree.index]  # [B, L, H, D]
    want = dense.cumsum(1)
    for dim in (2, -2):
        out = scan.tree_cumsum(xp, tree.parent, dim)
        assert_exact(out[0].movedim(1, 0)[tree.index], want, EXACT, f"dim {dim}")


def test_cumsum_integers_exact_mask_positions():
    """Integer scans are exact: RoBERTa's ``cumsum(mask) * mask + pad`` and OPT's ``cumsum(mask) * mask - 1``
    position ids from the packed attention mask, bit for bit, and int64 values of any size."""
    ids, am, tree = tree_of(4)
    maskp = am[tree.rep_row, tree.position]  # the packed mask: the valid bit of each token
    c = scan.tree_cumsum(maskp, tree.parent, 0)
    assert torch.equal((c * maskp + 1)[tree.index], am.cumsum(1) * am + 1)
    assert torch.equal((c * maskp - 1)[tree.index], am.cumsum(1) * am - 1)
    big = torch.randint(-2 ** 40, 2 ** 40, (tree.end.shape[0],), dtype=torch.int64)
    assert torch.equal(scan.tree_cumsum(big, tree.parent, 0)[tree.index], big[tree.index].cumsum(1))


def test_cumsum_position_only_value():
    """A value without a row dim (a per-position table read at each token's column): the path of a token
    at column t holds columns 0..t, so the tree scan is the table's cumsum at t."""
    _, _, tree = tree_of(5)
    table = torch.randn(tree.index.shape[1], 4, dtype=F64)
    out = scan.tree_cumsum(table[tree.position], tree.parent, 0)
    assert_exact(out, table.cumsum(0)[tree.position], EXACT, "position-only cumsum")


def test_cumsum_gradcheck_and_double_backward():
    _, _, tree = tree_of(6, groups=2, rows=3, length=7)
    x = torch.randn(tree.end.shape[0], 2, dtype=F64, requires_grad=True)
    fn = lambda t: scan.tree_cumsum(t, tree.parent, 0)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


def test_cumsum_opcheck():
    _, _, tree = tree_of(7, groups=2, rows=3, length=7)
    x = torch.randn(tree.end.shape[0], 3, dtype=F64, requires_grad=True)
    torch.library.opcheck(torch.ops.brcompile.tree_cumsum.default, (x, tree.parent, 0))
    torch.library.opcheck(torch.ops.brcompile.tree_parent.default, (tree.end,))


def test_cumsum_bad_arguments():
    with pytest.raises(scan.ScanError, match="entries along dim"):
        scan.tree_cumsum(torch.zeros(4, 2), torch.tensor([-1, 0, 1]), 0)
    with pytest.raises(scan.ScanError, match="out of range"):
        scan.tree_cumsum(torch.zeros(3), torch.tensor([-1, 0, 1]), 1)
    with pytest.raises(scan.ScanError, match="int64"):
        scan.tree_cumsum(torch.zeros(3), torch.tensor([-1, 0, 1], dtype=torch.int32), 0)


# --------------------------------------------------------------------------------------- causal conv1d


def dense_conv(xp: torch.Tensor, index: torch.Tensor, w, b) -> torch.Tensor:
    """The dense causal depthwise conv of the rows read through ``index``: ``[B, C, L]``."""
    x = xp[0][:, index].permute(1, 0, 2)  # [C, B, L] -> [B, C, L]
    return F.conv1d(x, w, b, padding=w.shape[2] - 1, groups=x.shape[1])[..., :index.shape[1]]


def packed_read(out: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return out[0][:, index].permute(1, 0, 2)


@pytest.mark.parametrize("seed,width,bias", [(0, 4, True), (1, 2, False), (2, 1, True), (3, 6, True)])
def test_causal_conv1d_forward_backward_vs_dense_rows(seed, width, bias):
    """Reads the last W nodes of the path (not the previous packed positions): W = 6 crosses several
    branch points of the tree; W = 1 is a per-token scale."""
    _, _, tree = tree_of(seed)
    N, C = tree.end.shape[0], 3
    g = torch.Generator().manual_seed(seed + 20)
    xp = torch.randn(1, C, N, generator=g, dtype=F64, requires_grad=True)
    w = torch.randn(C, 1, width, generator=g, dtype=F64, requires_grad=True)
    b = torch.randn(C, generator=g, dtype=F64, requires_grad=True) if bias else None
    out = scan.tree_causal_conv1d(xp, w, b, tree.parent)
    ref = dense_conv(xp, tree.index, w, b)
    assert_exact(packed_read(out, tree.index), ref, EXACT, "tree_causal_conv1d")
    assert_exact(out, reference.reference_causal_conv1d(xp, w, b, tree.end), EXACT, "vs oracle")
    gout = torch.randn(ref.shape, generator=g, dtype=F64)
    wrt = [t for t in (xp, w, b) if t is not None]
    got = torch.autograd.grad((packed_read(out, tree.index) * gout).sum(), wrt)
    want = torch.autograd.grad((ref * gout).sum(), wrt)
    for name, a, c in zip(("x", "weight", "bias"), got, want):
        assert_exact(a, c, EXACT, f"grad of {name}")


def test_causal_conv1d_is_not_a_conv_over_packed_order():
    """The packed order's previous token is not the path's: a dense conv over the packed sequence differs
    (the test above would pass a wrong impl only if the tree had no branches)."""
    _, _, tree = tree_of(1)
    xp = torch.randn(1, 2, tree.end.shape[0], dtype=F64)
    w = torch.randn(2, 1, 3, dtype=F64)
    flat = F.conv1d(xp, w, None, padding=2, groups=2)[..., :xp.shape[2]]
    assert not torch.allclose(scan.tree_causal_conv1d(xp, w, None, tree.parent), flat)


def test_causal_conv1d_gradcheck_and_opcheck():
    _, _, tree = tree_of(8, groups=2, rows=3, length=7)
    xp = torch.randn(1, 2, tree.end.shape[0], dtype=F64, requires_grad=True)
    w = torch.randn(2, 1, 3, dtype=F64, requires_grad=True)
    b = torch.randn(2, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: scan.tree_causal_conv1d(x, w, b, tree.parent), (xp, w, b))
    torch.library.opcheck(torch.ops.brcompile.tree_causal_conv1d.default, (xp, w, b, tree.parent))
    torch.library.opcheck(torch.ops.brcompile.tree_causal_conv1d.default, (xp, w, None, tree.parent))


def test_scans_return_the_layout_their_fake_kernels_promise():
    """On strided inputs (a transposed view, as a chunk's gathered values are under streaming replay) the ops
    return ``empty_like(x)``'s strides, as the fake kernels say: a compiled graph asserts them."""
    _, _, tree = tree_of(8, groups=2, rows=3, length=7)
    n = tree.end.shape[0]
    x = torch.randn(n, 3, 1, dtype=F64).permute(2, 1, 0).requires_grad_()  # [1, 3, N], strided
    w, b = torch.randn(3, 1, 4, dtype=F64), torch.randn(3, dtype=F64)
    y = torch.randn(3, n, dtype=F64).T.requires_grad_()  # [N, 3], strided
    conv = torch.ops.brcompile.tree_causal_conv1d.default
    assert conv(x, w, b, tree.parent).stride() == torch.empty_like(x).stride()
    dx, dw, _ = torch.ops.brcompile.tree_causal_conv1d_backward.default(x.detach(), x, w, tree.parent)
    assert dx.stride() == torch.empty_like(x).stride() and dw.stride() == torch.empty_like(w).stride()
    assert torch.ops.brcompile.tree_cumsum.default(y, tree.parent, 0).stride() == torch.empty_like(y).stride()
    torch.library.opcheck(conv, (x, w, b, tree.parent))
    torch.library.opcheck(torch.ops.brcompile.tree_cumsum.default, (y, tree.parent, 0))


def test_causal_conv1d_bad_arguments():
    parent = torch.tensor([-1, 0, 1])
    with pytest.raises(scan.ScanError, match="depthwise"):
        scan.tree_causal_conv1d(torch.zeros(1, 2, 3), torch.zeros(2, 2, 3), None, parent)
    with pytest.raises(scan.ScanError, match="tokens"):
        scan.tree_causal_conv1d(torch.zeros(1, 2, 4), torch.zeros(2, 1, 3), None, parent)
    with pytest.raises(scan.ScanError, match="dtypes"):
        scan.tree_causal_conv1d(torch.zeros(1, 2, 3), torch.zeros(2, 1, 3, dtype=F64), None, parent)


def test_conv_flop_formula():
    from torch.utils.flop_counter import FlopCounterMode
    _, _, tree = tree_of(0)
    xp = torch.randn(1, 3, tree.end.shape[0], dtype=F64)
    with FlopCounterMode(display=False) as fc:
        scan.tree_causal_conv1d(xp, torch.randn(3, 1, 4, dtype=F64), None, tree.parent)
    assert fc.get_total_flops() == 2 * xp.numel() * 4


# --------------------------------------------------------------------------------------- linear scan


def dense_recurrence(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``h_t = a_t h_{t-1} + b_t`` along dim 1 of ``[B, L, ...]`` rows, ``h_{-1} = 0``: a loop over t."""
    h, out = torch.zeros_like(b[:, 0]), []
    for t in range(b.shape[1]):
        h = a[:, t] * h + b[:, t]
        out.append(h)
    return torch.stack(out, 1)


@pytest.mark.parametrize("seed", SEEDS)
def test_linear_scan_forward_backward_vs_dense_rows(seed):
    """Every root-to-leaf path (a dense row read through ``index``) is the dense recurrence, forward and
    backward (a shared token's gradient sums its rows'); the oracle (preorder loop) agrees too."""
    _, _, tree = tree_of(seed)
    N = tree.end.shape[0]
    g = torch.Generator().manual_seed(seed + 30)
    ap = (0.5 + torch.rand(N, 3, 2, generator=g, dtype=F64)).requires_grad_()
    bp = torch.randn(N, 3, 2, generator=g, dtype=F64, requires_grad=True)
    out = scan.tree_linear_scan(ap, bp, tree.parent, 0)
    ref = dense_recurrence(dense_of(ap, tree.index), dense_of(bp, tree.index))
    assert_exact(dense_of(out, tree.index), ref, EXACT, "tree_linear_scan")
    assert_exact(out, reference.reference_linear_scan(ap, bp, tree.end, 0), EXACT, "vs oracle")
    w = torch.randn(ref.shape, generator=g, dtype=F64)
    got = torch.autograd.grad((dense_of(out, tree.index) * w).sum(), (ap, bp))
    want = torch.autograd.grad((ref * w).sum(), (ap, bp))
    for name, x, y in zip("ab", got, want):
        assert_exact(x, y, EXACT, f"grad of {name}")


def test_linear_scan_is_not_a_scan_over_packed_order():
    """The previous packed token is not the path's parent: the chain recurrence over packed order differs."""
    _, _, tree = tree_of(1)
    N = tree.end.shape[0]
    a, b = torch.rand(N, 2, dtype=F64), torch.randn(N, 2, dtype=F64)
    flat = scan.tree_linear_scan(a, b, scan.chain_parent(N), 0)
    assert not torch.allclose(scan.tree_linear_scan(a, b, tree.parent, 0), flat)


def test_linear_scan_broadcast_and_later_dim():
    """``a`` broadcast against ``b`` (a decay shared by the channels: ``[1, N, 1, S]`` vs ``[1, N, D, S]``), the
    token dim not first (dim 1 and -3): the gradient of ``a`` is summed back to its shape."""
    _, _, tree = tree_of(2)
    N = tree.end.shape[0]
    a = torch.rand(1, N, 1, 2, dtype=F64, requires_grad=True)
    b = torch.randn(1, N, 3, 2, dtype=F64, requires_grad=True)
    full = a.expand(1, N, 3, 2)
    want = reference.reference_linear_scan(full, b, tree.end, 1)
    for dim in (1, -3):
        assert_exact(scan.tree_linear_scan(a, b, tree.parent, dim), want, EXACT, f"dim {dim}")
    w = torch.randn(1, N, 3, 2, dtype=F64)
    ga, gb = torch.autograd.grad((scan.tree_linear_scan(a, b, tree.parent, 1) * w).sum(), (a, b))
    assert ga.shape == a.shape
    wa, wb = torch.autograd.grad((reference.reference_linear_scan(full, b, tree.end, 1) * w).sum(), (a, b))
    assert_exact(ga, wa, EXACT, "grad of a")
    assert_exact(gb, wb, EXACT, "grad of b")


def test_dense_linear_scan_is_the_chain():
    """``scan.linear_scan`` (the dense op the associative-scan rewrite emits) is the row recurrence."""
    a, b = torch.rand(3, 9, 2, dtype=F64), torch.randn(3, 9, 2, dtype=F64)
    assert_exact(scan.linear_scan(a, b, 1), dense_recurrence(a, b), EXACT, "dense linear scan")


def test_linear_scan_gradcheck_and_opcheck():
    _, _, tree = tree_of(9, groups=2, rows=3, length=7)
    N = tree.end.shape[0]
    a = torch.rand(N, 2, dtype=F64, requires_grad=True)
    b = torch.randn(N, 2, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: scan.tree_linear_scan(a, b, tree.parent, 0), (a, b))
    a1 = torch.rand(N, 1, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: scan.tree_linear_scan(a, b, tree.parent, 0), (a1, b))
    torch.library.opcheck(torch.ops.brcompile.tree_linear_scan.default, (a, b, tree.parent, 0))
    torch.library.opcheck(torch.ops.brcompile.tree_linear_scan.default, (a1, b, tree.parent, 0, "torch"))


def test_linear_scan_bad_arguments():
    parent = torch.tensor([-1, 0, 1])
    with pytest.raises(scan.ScanError, match="entries along dim"):
        scan.tree_linear_scan(torch.zeros(4), torch.zeros(4), parent, 0)
    with pytest.raises(scan.ScanError, match="broadcast"):
        scan.tree_linear_scan(torch.zeros(3, 2), torch.zeros(3, 4), parent, 0)
    with pytest.raises(scan.ScanError, match="one dtype"):
        scan.tree_linear_scan(torch.zeros(3), torch.zeros(3, dtype=F64), parent, 0)


def test_linear_scan_flop_formula():
    from torch.utils.flop_counter import FlopCounterMode
    _, _, tree = tree_of(0)
    a = torch.rand(tree.end.shape[0], 4, dtype=F64, requires_grad=True)
    b = torch.randn(tree.end.shape[0], 4, dtype=F64)
    with FlopCounterMode(display=False) as fc:
        scan.tree_linear_scan(a, b, tree.parent, 0).sum().backward()
    assert fc.get_total_flops() == 5 * b.numel()
