"""Matrix-affine recurrences along the tree paths: ``brcompile::tree_matrix_scan`` (docs/ARCHITECTURE.md §6).

``tree_matrix_scan(M, b, parent, dim)``: ``h[k] = M[k] @ h[parent[k]] + b[k]`` (``h = b`` at a root), with
``M [..., d, d]`` and ``b [..., d, e]`` and the tokens along batch dim ``dim`` — the state recurrence of a
linear-attention layer: the gated delta rule ``S_t = exp(g_t) (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ``
(Qwen3-Next's gated DeltaNet, passes/canonical/scans/delta_rule.py) is ``M_t = exp(g_t) (I - β_t k_t k_tᵀ)``, ``b_t = β_t k_t
v_tᵀ`` (Kimi-Linear's per-channel KDA: ``M_t = (I - β_t k_t k_tᵀ) diag(exp g_t)``). The matrix counterpart of ``tree_linear_scan`` (op.py), where ``a`` is elementwise.

In the prefix tree (§4) a token's earlier positions in every row that holds it are its ancestors, so the dense
recurrence ``h_t = M_t h_{t-1} + b_t`` along a row (``h_{-1} = 0``) is this one along the token's path.

The op and its backward take an ``impl`` name (last, default ``"auto"``; the emitter passes the backend's
``scan`` option) looked up in the tree scans' ``SCAN_IMPLS`` (backends/scan/op.py, ``ScanImpl.matrix_scan`` /
``matrix_scan_backward``): ``"auto"`` is triton on CUDA, torch elsewhere.

* ``"torch"`` (here, any device and dtype). Forward by pointer doubling of affine maps
  (:func:`path_matrix_scan`): token k holds ``(A[k], B[k])`` and an ancestor ``anc[k]`` with ``h[k] = A[k]
  h[anc[k]] + B[k]``; a round composes k's map with its ancestor's, ``(A, B)∘(A', B') = (A A', A B' + B)``,
  and doubles ``anc``. ``ceil(log2(depth))`` rounds of batched d×d matmuls, O(N·d³·log depth); nothing loops
  over tokens. Backward (its own op, :func:`subtree_matrix_scan`): with ``g = dL/dh``, ``gb[k] = g[k] + sum
  over the children c of k of M[c]ᵀ gb[c]`` (the transposed rounds: scatter-adds to the 2^r-th ancestor),
  ``dL/dM[k] = gb[k] h[parent[k]]ᵀ`` (0 at a root), ``dL/db = gb``.
* ``"triton"`` (backends/scan/triton.py): the same recurrences token by token, one program per (batch entry,
  block of e columns) walking the tokens in preorder (forward) or reverse preorder (backward): O(N·d²·e), one
  launch each.

Exact up to the reassociation of the matrix products (the dense loop multiplies the same factors in another
grouping). ``matrix_scan(M, b, dim)`` is the dense form (every row its own chain), what the passes recognise
and the rule of passes/analysis/rules/matrix_scan.py makes the tree op.
"""
from __future__ import annotations


import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from brcompile.backends.scan.op import SCAN_IMPLS, get_scan_impl
from brcompile.backends.scan.paths import (
    ScanError, broadcast_rows, chain_parent, check_tree_array, in_layout_of, jump, prefix_rows,
)

__all__ = ["tree_matrix_scan", "matrix_scan", "path_matrix_scan", "subtree_matrix_scan", "torch_matrix_scan",
           "torch_matrix_scan_backward", "tree_matrix_scan_cached", "MATRIX_PATH_OPS"]


def path_matrix_scan(M: Tensor, b: Tensor, parent: Tensor) -> Tensor:
    """``h[k] = M[k] @ h[parent[k]] + b[k]`` along dim 0 (``h = b`` at a root), by pointer doubling.

    Invariant after round r: ``h[k] = A[k] @ h[anc[k]] + B[k]`` with ``anc[k]`` the 2^r-th ancestor of k
    (``h[-1] = 0``: past a root the map's constant is the value). ``A[k] = M[k] M[parent k] ... `` over the 2^r
    nearest ancestors-or-self of k. A round: ``(A[k], B[k]) <- (A[k] A[anc k], A[k] B[anc k] + B[k])``,
    ``anc[k] <- anc[anc[k]]``; at the end every ``anc`` is -1 and ``h = B``."""
    A, B = M.clone(), b.clone()
    anc = parent
    while bool((anc >= 0).any()):
        has = anc >= 0
        src = has.nonzero().squeeze(1)
        at = anc[src]
        A_src = A[src]
        B = B.index_copy(0, src, A_src @ B[at] + B[src])
        A = A.index_copy(0, src, A_src @ A[at])
        anc = jump(anc, anc)
    return B


def subtree_matrix_scan(g: Tensor, M: Tensor, parent: Tensor) -> Tensor:
    """``gb[k] = g[k] + sum over the children c of k of M[c]ᵀ @ gb[c]`` along dim 0: the transpose of
    :func:`path_matrix_scan` (``gb[j] = sum over the descendants-or-self d of j of P(d, j)ᵀ g[d]``, ``P(d, j) =
    M[d] M[parent d] ...`` over the path from d up to j, j excluded).

    Invariant after round r: ``S[j]`` sums the descendants of j at distance < 2^r, ``W[d] = P(d, anc[d])`` with
    ``anc[d]`` d's 2^r-th ancestor. A round pushes ``W[d]ᵀ S[d]`` from each d to ``anc[d]`` (the descendants of
    j at distance [2^r, 2^(r+1)) lie below exactly one d at distance 2^r, and ``P(e, j) = P(e, d) P(d, j)``),
    then ``W[d] <- W[d] W[anc[d]]`` and ``anc[d] <- anc[anc[d]]``."""
    S, W = g.clone(), M.clone()
    anc = parent
    while bool((anc >= 0).any()):
        has = anc >= 0
        src = has.nonzero().squeeze(1)
        at = anc[src]
        S = S.index_add(0, at, W[src].transpose(-1, -2) @ S[src])
        W = W.index_copy(0, src, W[src] @ W[at])
        anc = jump(anc, anc)
    return S


def _check(M: Tensor, b: Tensor, parent: Tensor, dim: int) -> int:
    """The token dim (normalised, counted among the batch dims); raises ScanError on bad arguments."""
    check_tree_array(parent, "parent")
    if M.dtype != b.dtype or not M.is_floating_point():
        raise ScanError(f"tree_matrix_scan: M and b must be floating point of one dtype, got {M.dtype}, {b.dtype}")
    if M.dim() < 3 or M.dim() != b.dim() or M.shape[:-2] != b.shape[:-2] or M.shape[-1] != M.shape[-2] \
            or M.shape[-1] != b.shape[-2]:
        raise ScanError(f"tree_matrix_scan: M must be [..., d, d] and b [..., d, e] with the same batch dims, got "
                        f"M {tuple(M.shape)}, b {tuple(b.shape)}")
    batch = M.dim() - 2
    if not -batch <= dim < batch:
        raise ScanError(f"tree_matrix_scan: dim {dim} out of range for batch dims {tuple(M.shape[:-2])}")
    d = dim % batch
    if M.shape[d] != parent.shape[0]:
        raise ScanError(f"tree_matrix_scan: {M.shape[d]} entries along dim {dim}, parent has {parent.shape[0]}")
    return d


def torch_matrix_scan(M: Tensor, b: Tensor, parent: Tensor, d: int) -> Tensor:
    """:func:`path_matrix_scan` along batch dim ``d`` (the torch ``ScanImpl.matrix_scan``, backends/scan/op.py)."""
    return path_matrix_scan(M.movedim(d, 0), b.movedim(d, 0), parent).movedim(0, d).contiguous()


def torch_matrix_scan_backward(grad: Tensor, M: Tensor, h: Tensor, parent: Tensor, d: int) -> tuple[Tensor, Tensor]:
    """``(grad_M, grad_b)``: ``gb = subtree_matrix_scan(grad, M)``, ``grad_M[k] = gb[k] @ h[parent[k]]ᵀ`` (0 at
    a root), ``grad_b = gb`` (the torch ``ScanImpl.matrix_scan_backward``)."""
    gb = subtree_matrix_scan(grad.movedim(d, 0), M.movedim(d, 0), parent)
    hp = h.movedim(d, 0)[parent.clamp(min=0)]
    gM = torch.where(broadcast_rows(parent >= 0, gb[..., :1]), gb @ hp.transpose(-1, -2),
                     torch.zeros((), dtype=gb.dtype, device=gb.device))
    return gM.movedim(0, d).contiguous(), gb.movedim(0, d).contiguous()


@torch.library.custom_op("brcompile::tree_matrix_scan", mutates_args=())
def _tree_matrix_scan_op(M: Tensor, b: Tensor, parent: Tensor, dim: int, impl: str = "auto") -> Tensor:
    """See :func:`tree_matrix_scan`."""
    d = _check(M, b, parent, dim)
    return in_layout_of(get_scan_impl(impl, M.device, M.dtype).matrix_scan(M, b, parent, d), b)


@_tree_matrix_scan_op.register_fake
def _tree_matrix_scan_fake(M, b, parent, dim, impl="auto"):
    _check(M, b, parent, dim)
    SCAN_IMPLS.check_name(impl)
    return torch.empty_like(b)


@torch.library.custom_op("brcompile::tree_matrix_scan_backward", mutates_args=())
def _tree_matrix_scan_backward_op(grad: Tensor, M: Tensor, h: Tensor, parent: Tensor,
                                  dim: int, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """``(grad_M, grad_b)``: ``gb[k] = grad[k] + sum over the children c of k of M[c]ᵀ gb[c]``, ``grad_M[k] =
    gb[k] @ h[parent[k]]ᵀ`` (0 at a root), ``grad_b = gb`` (``ScanImpl.matrix_scan_backward``)."""
    d = _check(M, h, parent, dim)
    gM, gb = get_scan_impl(impl, M.device, M.dtype).matrix_scan_backward(grad, M, h, parent, d)
    return in_layout_of(gM, M), in_layout_of(gb, h)


@_tree_matrix_scan_backward_op.register_fake
def _tree_matrix_scan_backward_fake(grad, M, h, parent, dim, impl="auto"):
    _check(M, h, parent, dim)
    SCAN_IMPLS.check_name(impl)
    return torch.empty_like(M), torch.empty_like(h)


def _setup(ctx, inputs, output):
    M, b, parent, dim, impl = inputs
    ctx.save_for_backward(M, output, parent)
    ctx.dim = dim
    ctx.impl = impl


def _grad(ctx, grad):
    M, h, parent = ctx.saved_tensors
    gM, gb = torch.ops.brcompile.tree_matrix_scan_backward(grad.contiguous(), M, h, parent, ctx.dim, ctx.impl)
    return gM, gb, None, None, None


torch.library.register_autograd("brcompile::tree_matrix_scan", _grad, setup_context=_setup)


def tree_matrix_scan(M: Tensor, b: Tensor, parent: Tensor, dim: int, impl: str = "auto") -> Tensor:
    """``brcompile::tree_matrix_scan``: ``h[k] = M[k] @ h[parent[k]] + b[k]`` (``h = b`` at a root) along the
    batch dim ``dim`` of ``M [..., d, d]`` and ``b [..., d, e]`` (module docstring). ``impl`` names a
    :class:`~brcompile.backends.scan.op.ScanImpl` in ``SCAN_IMPLS`` (``"auto"``: triton on CUDA, torch
    elsewhere)."""
    return torch.ops.brcompile.tree_matrix_scan(M, b, parent, dim, impl)


def matrix_scan(M: Tensor, b: Tensor, dim: int) -> Tensor:
    """The dense ``h_t = M_t @ h_{t-1} + b_t`` along batch dim ``dim`` (``h_0 = b_0``): ``tree_matrix_scan``
    over the chain of the dense positions (every row is its own path)."""
    n = M.shape[:-2][dim] if M.dim() > 2 else 0
    return torch.ops.brcompile.tree_matrix_scan(M, b, chain_parent(n, M.device), dim)


# ------------------------------------------------------------------------------------------- flops


@register_flop_formula(torch.ops.brcompile.tree_matrix_scan, get_raw=True)
def _matrix_scan_flop(M, b, parent, dim, *args, out_val=None, **kwargs) -> int:
    """As the dense recurrence: a ``[d, d] @ [d, e]`` product and an add per token, ``2 d e (d + 1)`` each
    (the pointer-doubling rounds reassociate the same products)."""
    d, e = b.shape[-2], b.shape[-1]
    return b.numel() // (d * e) * 2 * d * e * (d + 1)


@register_flop_formula(torch.ops.brcompile.tree_matrix_scan_backward, get_raw=True)
def _matrix_scan_backward_flop(grad, M, h, parent, dim, *args, out_val=None, **kwargs) -> int:
    """The reverse recurrence (``M[c]ᵀ gb[c]`` and an add) and ``grad_M``'s ``[d, e] @ [e, d]`` per token."""
    d, e = h.shape[-2], h.shape[-1]
    return h.numel() // (d * e) * (2 * d * e * (d + 1) + 2 * d * d * e)


#: ops whose output at a token reads its ancestors along the tree path: the streaming split runs them on a
#: chunk of tails against the prefix's state (:func:`tree_matrix_scan_cached`; passes/emit/split.py)
MATRIX_PATH_OPS = (torch.ops.brcompile.tree_matrix_scan.default,)


# ----------------------------------------------------------------------------- against a cached prefix


def tree_matrix_scan_cached(M: Tensor, b: Tensor, parent: Tensor, dim: int, impl: str, h_cache: Tensor,
                            ancestors: Tensor) -> Tensor:
    """``h[k] = M[k] @ h[parent(k)] + b[k]`` on a chunk of tail tokens (streaming replay, passes/emit/split.py),
    where the parent of a chunk root may be a prefix token: its state is the prefix scan's output ``h_cache``
    (``[..., P, ..., d, e]``, the prefix tokens along ``dim``) there. The chunk's scan with ``b[k] + M[k] @
    h_cache[p(k)]`` at those roots (``p(k) = ancestors[0, k]``, the prefix-local id of k's parent, -1 when it
    is no prefix token: a zero state, so nothing is added): the root's recurrence step, then the local
    recurrence unchanged (backends/scan/op.py's ``*_cached`` layout of ``ancestors``).

    Ordinary differentiable ops around ``tree_matrix_scan``: ``dL/dh_cache[p] = sum over the chunk roots k
    below p of M[k]ᵀ gb[k]`` (the transposed step) reaches the prefix graph as the cached K/V's gradients do,
    and ``dL/dM[k]`` gains ``gb[k] h_cache[p(k)]ᵀ``. Only the rows of ``h_cache`` at the branch points (prefix
    tokens with a child in a chunk) are read; the cache is the prefix scan's whole output, which its own
    backward keeps anyway."""
    d = dim % (M.dim() - 2)
    b = b + M @ prefix_rows(h_cache, ancestors[0], d)
    return torch.ops.brcompile.tree_matrix_scan(M, b, parent, dim, impl)
