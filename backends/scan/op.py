"""Causal scans along the tree paths: ``brcompile::tree_parent``, ``tree_cumsum``, ``tree_causal_conv1d``,
``tree_linear_scan`` (docs/ARCHITECTURE.md §6).

A causal scan over positions computes each position's value from the state at the previous position and the
token there. In the prefix tree (§4) every node's dense positions share their row's earlier tokens, which are
the node's ancestors, so the scan of a dense row at ``(b, t)`` equals the scan along the tree path from the
root to ``index[b, t]``:

- ``tree_cumsum(x, parent, dim)``: ``out[k] = sum of x[j] over the ancestors-or-self j of k`` — the dense
  ``cumsum`` along the row. Backward: ``dx[j] = sum of dout[k] over k in j's subtree`` (``j <= k < end[j]``).
- ``tree_causal_conv1d(x, weight, bias, parent)``: ``out[:, c, k] = bias[c] + sum_{i<W} weight[c, 0, W-1-i] *
  x[:, c, anc_i(k)]`` with ``anc_0(k) = k``, ``anc_{i+1}(k) = parent[anc_i(k)]`` and zero past a root — the
  dense depthwise ``conv1d(x, w, b, padding=W-1, groups=C)[..., :L]``, which reads the previous W-1 positions
  of the row (zeros before its start). The ancestors along the path, not the previous packed positions.
- ``tree_linear_scan(a, b, parent, dim)``: ``h[k] = a[k] * h[parent[k]] + b[k]`` (``h = b`` at a root) — the
  first-order linear recurrence ``h_t = a_t h_{t-1} + b_t`` of a state-space layer (a Mamba selective scan's
  state, ``h_{-1} = 0``), elementwise. Forward by pointer doubling over the composed affine maps
  (:func:`path_linear_scan`), backward by the transposed rounds (:func:`subtree_linear_scan`).

All are exact up to reassociation of the sums (the dense op adds the same terms in another order). Nothing
loops over tokens: the path sums use pointer jumping (Hillis–Steele along the paths: after round r each
token holds the sum over its 2^r nearest ancestors-or-self; ``ceil(log2(depth))`` rounds of O(N) gathers),
the subtree sums the transposed rounds (scatter-adds), the conv W-1 gathers of ``parent``. The four
doubling loops (path / subtree sums, the linear scan and its transpose) are one, ``ancestor_doubling``
(paths.py, with the tree arrays), with a direction and an optional multiplier. The oracles are in reference.py.

These are the ``"torch"`` implementations (any device, any floating dtype). ``tree_linear_scan``,
``tree_causal_conv1d``, ``tree_matrix_scan`` (backends/scan/matrix.py) and their backwards take an ``impl``
name (default ``"auto"``) looked up in
:data:`SCAN_IMPLS`, a :class:`~brcompile.backends.common.registry.Registry` of :class:`ScanImpl`: ``"torch"`` (here)
and ``"triton"`` (``backends/scan/triton.py``, imported on first use); ``"auto"`` is triton on CUDA, torch
elsewhere. ``tree_cumsum`` (integer position ids, mostly: a handful of features) runs here only.

``parent`` is not a tree array of the packed graph; ``tree_parent(end)`` derives it from the subtree ends
(the preorder property ``j is an ancestor-or-self of k  <=>  j <= k < end[j]``), once per emitted scan.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from brcompile.backends.common.registry import Impl, Registry
from brcompile.backends.scan.paths import (
    PATH, SUBTREE, ScanError, ancestor_doubling, broadcast_rows, chain_parent, check_tree_array, in_layout_of,
    parent_from_end, path_ancestors, path_sum, prefix_rows, subtree_sum,
)

__all__ = ["SCAN_IMPLS", "ScanError", "ScanImpl", "get_scan_impl", "register_scan_impl", "tree_parent",
           "tree_cumsum", "tree_causal_conv1d", "tree_linear_scan", "linear_scan", "TREE_PATH_OPS",
           "tree_linear_scan_cached", "tree_cumsum_cached", "tree_causal_conv1d_cached"]


# ------------------------------------------------------------------------------------------ tree_parent


@torch.library.custom_op("brcompile::tree_parent", mutates_args=())
def _tree_parent_op(end: Tensor) -> Tensor:
    """See :func:`tree_parent`."""
    check_tree_array(end, "end")
    return parent_from_end(end)


@_tree_parent_op.register_fake
def _tree_parent_fake(end):
    check_tree_array(end, "end")
    return end.new_empty(end.shape, dtype=torch.int64)


def tree_parent(end: Tensor) -> Tensor:
    """``brcompile::tree_parent(end) -> parent [N]`` (int64, -1 at roots); see :func:`parent_from_end`."""
    return torch.ops.brcompile.tree_parent(end)


# ------------------------------------------------------------------------------------------- impls


@dataclasses.dataclass(frozen=True)
class ScanImpl(Impl):
    """An implementation of the tree scans ``tree_linear_scan``, ``tree_causal_conv1d`` and
    ``tree_matrix_scan`` (backends/scan/matrix.py) and their backwards (the ops check the arguments first).

    linear_scan(a, b, parent, d) -> h
        ``h[k] = a[k] * h[parent[k]] + b[k]`` along dim ``d`` of the broadcast shape of ``a`` and ``b``
        (either may be broadcast; ``d`` normalised); ``h`` contiguous in that shape, ``a``'s dtype.
    linear_scan_backward(grad, a, h, parent, d) -> (grad_a, grad_b)
        both in the shape of ``h`` (contiguous): ``grad_b = gb``, the reverse scan over the subtrees,
        ``grad_a[k] = gb[k] * h[parent[k]]`` (0 at a root); ``grad`` and ``a`` may be broadcast.
    causal_conv1d(x, weight, bias, parent) -> out
        ``out[:, c, k] = bias[c] + sum_i weight[c, 0, W-1-i] * x[:, c, anc_i(k)]``, ``[B', C, N]`` in x's dtype.
    causal_conv1d_backward(grad, x, weight, parent) -> (dx, dweight, dbias)
        in the shapes and dtypes of x, weight and bias ``[C]`` (:func:`causal_conv1d_backward`).
    matrix_scan(M, b, parent, d) -> h
        ``h[k] = M[k] @ h[parent[k]] + b[k]`` along batch dim ``d`` (normalised) of ``M [..., s, s]`` and
        ``b [..., s, e]``; ``h`` in b's shape and dtype.
    matrix_scan_backward(grad, M, h, parent, d) -> (grad_M, grad_b)
        in the shapes of ``M`` and ``h``: ``grad_b = gb``, ``gb[k] = grad[k] + sum over the children c of k
        of M[c]ᵀ @ gb[c]``, ``grad_M[k] = gb[k] @ h[parent[k]]ᵀ`` (0 at a root).

    ``device_types`` / ``dtypes`` (keyword): where the impl runs (None: anywhere).
    """

    Error = ScanError
    op = "tree scan"

    linear_scan: Callable
    linear_scan_backward: Callable
    causal_conv1d: Callable
    causal_conv1d_backward: Callable
    matrix_scan: Callable
    matrix_scan_backward: Callable


def _triton_on_cuda_else_torch(device: torch.device) -> tuple[str, ...]:
    """``"auto"``: triton on CUDA (when it imports and takes the inputs), else torch."""
    return ("triton", "torch") if device.type == "cuda" else ("torch",)


#: The tree scan impls: torch (registered below, after the op bodies) and triton (imported on first use).
SCAN_IMPLS = Registry("tree scan", ScanImpl, builtins={"triton": "brcompile.backends.scan.triton"},
                      auto=_triton_on_cuda_else_torch)


def register_scan_impl(impl: ScanImpl, *, override: bool = False) -> None:
    """Register a tree scan implementation under ``impl.name``; a name already registered raises
    unless ``override=True`` (which replaces it)."""
    SCAN_IMPLS.register(impl, override=override)


def get_scan_impl(name: str, device, dtype: Optional[torch.dtype] = None) -> ScanImpl:
    """The implementation ``name`` for inputs on ``device`` (of ``dtype``); ``"auto"`` is triton on CUDA
    (when it imports and takes the dtype), else torch. Raises ScanError when it is unknown or does not run
    there."""
    return SCAN_IMPLS.get(name, device, dtype)


def _check_cumsum(x: Tensor, parent: Tensor, dim: int) -> int:
    check_tree_array(parent, "parent")
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        raise ScanError(f"tree_cumsum: dim {dim} out of range for x of shape {tuple(x.shape)}")
    d = dim % x.dim()
    if x.shape[d] != parent.shape[0]:
        raise ScanError(f"tree_cumsum: x has {x.shape[d]} entries along dim {dim}, parent has {parent.shape[0]}")
    return d


@torch.library.custom_op("brcompile::tree_cumsum", mutates_args=())
def _tree_cumsum_op(x: Tensor, parent: Tensor, dim: int) -> Tensor:
    """See :func:`tree_cumsum`."""
    d = _check_cumsum(x, parent, dim)
    return in_layout_of(path_sum(x.movedim(d, 0), parent).movedim(0, d), x)


@_tree_cumsum_op.register_fake
def _tree_cumsum_fake(x, parent, dim):
    _check_cumsum(x, parent, dim)
    return torch.empty_like(x)


@torch.library.custom_op("brcompile::tree_cumsum_backward", mutates_args=())
def _tree_cumsum_backward_op(grad: Tensor, parent: Tensor, dim: int) -> Tensor:
    """d(tree_cumsum)/dx for ``grad``: the subtree sums of ``grad`` along ``dim``."""
    d = _check_cumsum(grad, parent, dim)
    return in_layout_of(subtree_sum(grad.movedim(d, 0), parent).movedim(0, d), grad)


@_tree_cumsum_backward_op.register_fake
def _tree_cumsum_backward_fake(grad, parent, dim):
    _check_cumsum(grad, parent, dim)
    return torch.empty_like(grad)


def _cumsum_setup(ctx, inputs, output):
    _, parent, dim = inputs
    ctx.save_for_backward(parent)
    ctx.dim = dim


def _cumsum_grad(ctx, grad):
    (parent,) = ctx.saved_tensors
    return torch.ops.brcompile.tree_cumsum_backward(grad, parent, ctx.dim), None, None


def _cumsum_backward_grad(ctx, grad):
    """The subtree sum is linear; its transpose is the path sum (double backward)."""
    (parent,) = ctx.saved_tensors
    return torch.ops.brcompile.tree_cumsum(grad, parent, ctx.dim), None, None


torch.library.register_autograd("brcompile::tree_cumsum", _cumsum_grad, setup_context=_cumsum_setup)
torch.library.register_autograd("brcompile::tree_cumsum_backward", _cumsum_backward_grad,
                                setup_context=_cumsum_setup)


def tree_cumsum(x: Tensor, parent: Tensor, dim: int) -> Tensor:
    """``brcompile::tree_cumsum``: the dense ``cumsum`` along the token dim ``dim`` of a packed value,
    computed along the tree paths (module docstring). ``x``'s dtype is kept (cast before, as
    ``torch.cumsum`` promotes integers to int64)."""
    return torch.ops.brcompile.tree_cumsum(x, parent, dim)


# ----------------------------------------------------------------------------------------- causal conv1d


def _check_conv(x: Tensor, weight: Tensor, bias: Optional[Tensor], parent: Tensor) -> None:
    check_tree_array(parent, "parent")
    if x.dim() != 3 or weight.dim() != 3 or weight.shape[1] != 1 or weight.shape[0] != x.shape[1]:
        raise ScanError(f"tree_causal_conv1d: x must be [B, C, N] and weight [C, 1, W] (depthwise); got x "
                        f"{tuple(x.shape)}, weight {tuple(weight.shape)}")
    if x.shape[2] != parent.shape[0]:
        raise ScanError(f"tree_causal_conv1d: x has {x.shape[2]} tokens, parent {parent.shape[0]}")
    if bias is not None and tuple(bias.shape) != (x.shape[1],):
        raise ScanError(f"tree_causal_conv1d: bias must be [C]={x.shape[1]}, got {tuple(bias.shape)}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ScanError(f"tree_causal_conv1d: dtypes differ (x {x.dtype}, weight {weight.dtype}"
                        f"{'' if bias is None else f', bias {bias.dtype}'})")


def _taps(x: Tensor, anc: Tensor) -> Tensor:
    """``x[:, :, anc]`` with zeros where ``anc == -1``: ``[B, C, N]`` for ``anc [N]``."""
    got = x[:, :, anc.clamp(min=0)]
    return got.masked_fill(anc.lt(0).view(1, 1, -1), 0)


def causal_conv1d_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], parent: Tensor) -> Tensor:
    """``out[:, c, k] = bias[c] + sum_i weight[c, 0, W-1-i] * x[:, c, anc_i(k)]`` (module docstring)."""
    W = weight.shape[2]
    anc = path_ancestors(parent, W)
    out = torch.zeros_like(x) if bias is None else bias.view(1, -1, 1).expand_as(x).clone()
    for i in range(W):  # W taps (a handful), not tokens
        out = out + weight[:, 0, W - 1 - i].view(1, -1, 1) * _taps(x, anc[i])
    return out


def causal_conv1d_backward(grad: Tensor, x: Tensor, weight: Tensor, parent: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dweight, dbias)``: tap i sends ``weight[c, W-1-i] * grad[:, c, k]`` to ``anc_i(k)``
    (a scatter-add: a shared token sums every descendant that reads it), ``dweight[c, 0, W-1-i] =
    sum_{b, k} grad[b, c, k] * x[b, c, anc_i(k)]``, ``dbias[c] = sum_{b, k} grad[b, c, k]``."""
    W = weight.shape[2]
    anc = path_ancestors(parent, W)
    dx = torch.zeros_like(x)
    dw = torch.zeros_like(weight)
    for i in range(W):
        keep = (anc[i] >= 0).nonzero().squeeze(1)
        contrib = grad[:, :, keep] * weight[:, 0, W - 1 - i].view(1, -1, 1)
        dx = dx.index_add(2, anc[i][keep], contrib)
        dw[:, 0, W - 1 - i] = (grad * _taps(x, anc[i])).sum((0, 2))
    return dx, dw, grad.sum((0, 2))


@torch.library.custom_op("brcompile::tree_causal_conv1d", mutates_args=())
def _tree_causal_conv1d_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], parent: Tensor,
                           impl: str = "auto") -> Tensor:
    """See :func:`tree_causal_conv1d`."""
    _check_conv(x, weight, bias, parent)
    return in_layout_of(get_scan_impl(impl, x.device, x.dtype).causal_conv1d(x, weight, bias, parent), x)


@_tree_causal_conv1d_op.register_fake
def _tree_causal_conv1d_fake(x, weight, bias, parent, impl="auto"):
    _check_conv(x, weight, bias, parent)
    SCAN_IMPLS.check_name(impl)
    return torch.empty_like(x)


@torch.library.custom_op("brcompile::tree_causal_conv1d_backward", mutates_args=())
def _tree_causal_conv1d_backward_op(grad: Tensor, x: Tensor, weight: Tensor, parent: Tensor,
                                    impl: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """d(tree_causal_conv1d)/d(x, weight, bias); see :func:`causal_conv1d_backward`."""
    _check_conv(x, weight, None, parent)
    dx, dw, db = get_scan_impl(impl, x.device, x.dtype).causal_conv1d_backward(grad, x, weight, parent)
    return in_layout_of(dx, x), in_layout_of(dw, weight), db.contiguous()


@_tree_causal_conv1d_backward_op.register_fake
def _tree_causal_conv1d_backward_fake(grad, x, weight, parent, impl="auto"):
    _check_conv(x, weight, None, parent)
    SCAN_IMPLS.check_name(impl)
    return torch.empty_like(x), torch.empty_like(weight), x.new_empty(x.shape[1])


def _conv_setup(ctx, inputs, output):
    x, weight, bias, parent, impl = inputs
    ctx.save_for_backward(x, weight, parent)
    ctx.has_bias = bias is not None
    ctx.impl = impl


def _conv_grad(ctx, grad):
    x, weight, parent = ctx.saved_tensors
    dx, dw, db = torch.ops.brcompile.tree_causal_conv1d_backward(grad, x, weight, parent, ctx.impl)
    return dx, dw, (db if ctx.has_bias else None), None, None


torch.library.register_autograd("brcompile::tree_causal_conv1d", _conv_grad, setup_context=_conv_setup)


def tree_causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor], parent: Tensor,
                       impl: str = "auto") -> Tensor:
    """``brcompile::tree_causal_conv1d``: the dense causal depthwise conv (``nn.Conv1d(C, C, W, groups=C,
    padding=W-1)`` then ``[..., :L]``) of a packed ``[B', C, N]`` value along the tree paths. ``impl`` names a
    :class:`ScanImpl` in :data:`SCAN_IMPLS` (``"auto"``: triton on CUDA, torch elsewhere)."""
    return torch.ops.brcompile.tree_causal_conv1d(x, weight, bias, parent, impl)


# ----------------------------------------------------------------------------------------- linear scan


def path_linear_scan(a: Tensor, b: Tensor, parent: Tensor) -> Tensor:
    """``h[k] = a[k] * h[parent[k]] + b[k]`` along dim 0 (``h = b`` at a root), by pointer doubling over the
    composed affine maps (:func:`ancestor_doubling`, PATH): ``ceil(log2(depth))`` rounds."""
    return ancestor_doubling(b, parent, a, PATH)


def subtree_linear_scan(g: Tensor, a: Tensor, parent: Tensor) -> Tensor:
    """``gb[k] = g[k] + sum over the children c of k of a[c] * gb[c]`` along dim 0: the transpose of
    :func:`path_linear_scan` (``gb[j] = sum over the descendants-or-self d of j of g[d] * P(d, j)``, ``P(d, j)``
    the product of ``a`` over the path from d up to j, j excluded; :func:`ancestor_doubling`, SUBTREE)."""
    return ancestor_doubling(g, parent, a, SUBTREE)


def _check_linear_scan(a: Tensor, b: Tensor, parent: Tensor, dim: int) -> tuple[torch.Size, int]:
    """The broadcast shape of ``a`` and ``b`` and the token dim in it (normalised)."""
    check_tree_array(parent, "parent")
    if a.dtype != b.dtype or not a.is_floating_point():
        raise ScanError(f"tree_linear_scan: a and b must be floating point of one dtype, got {a.dtype}, {b.dtype}")
    try:
        shape = torch.broadcast_shapes(a.shape, b.shape)
    except RuntimeError as e:
        raise ScanError(f"tree_linear_scan: a {tuple(a.shape)} and b {tuple(b.shape)} do not broadcast") from e
    if len(shape) == 0 or not -len(shape) <= dim < len(shape):
        raise ScanError(f"tree_linear_scan: dim {dim} out of range for shape {tuple(shape)}")
    d = dim % len(shape)
    if shape[d] != parent.shape[0]:
        raise ScanError(f"tree_linear_scan: {shape[d]} entries along dim {dim}, parent has {parent.shape[0]}")
    return shape, d


def _scan_layout(x: Tensor, shape: torch.Size, d: int) -> Tensor:
    """``x`` broadcast to ``shape``, the token dim first."""
    return x.expand(shape).movedim(d, 0)


def _torch_linear_scan(a: Tensor, b: Tensor, parent: Tensor, d: int) -> Tensor:
    """:func:`path_linear_scan` on the token-first layout (``ScanImpl.linear_scan``)."""
    shape = torch.broadcast_shapes(a.shape, b.shape)
    h = path_linear_scan(_scan_layout(a, shape, d), _scan_layout(b, shape, d), parent)
    return h.movedim(0, d).contiguous()


def _torch_linear_scan_backward(grad: Tensor, a: Tensor, h: Tensor, parent: Tensor, d: int) -> tuple[Tensor, Tensor]:
    """``gb = subtree_linear_scan(grad, a)``, ``grad_a[k] = gb[k] * h[parent[k]]`` (0 at a root)
    (``ScanImpl.linear_scan_backward``)."""
    shape = h.shape
    gb = subtree_linear_scan(_scan_layout(grad, shape, d), _scan_layout(a, shape, d), parent)
    hp = _scan_layout(h, shape, d)[parent.clamp(min=0)]
    ga = torch.where(broadcast_rows(parent >= 0, gb), gb * hp, torch.zeros((), dtype=gb.dtype, device=gb.device))
    return ga.movedim(0, d).contiguous(), gb.movedim(0, d).contiguous()


def _torch_matrix_scan(M: Tensor, b: Tensor, parent: Tensor, d: int) -> Tensor:
    """``path_matrix_scan`` of backends/scan/matrix.py on the token-first layout (``ScanImpl.matrix_scan``;
    imported when called: that module imports this one)."""
    from brcompile.backends.scan.matrix import torch_matrix_scan

    return torch_matrix_scan(M, b, parent, d)


def _torch_matrix_scan_backward(grad: Tensor, M: Tensor, h: Tensor, parent: Tensor, d: int) -> tuple[Tensor, Tensor]:
    """``subtree_matrix_scan`` of backends/scan/matrix.py and ``grad_M`` (``ScanImpl.matrix_scan_backward``)."""
    from brcompile.backends.scan.matrix import torch_matrix_scan_backward

    return torch_matrix_scan_backward(grad, M, h, parent, d)


register_scan_impl(ScanImpl("torch", _torch_linear_scan, _torch_linear_scan_backward, causal_conv1d_forward,
                            causal_conv1d_backward, _torch_matrix_scan, _torch_matrix_scan_backward))


# ------------------------------------------------------------------------------------------- the op


@torch.library.custom_op("brcompile::tree_linear_scan", mutates_args=())
def _tree_linear_scan_op(a: Tensor, b: Tensor, parent: Tensor, dim: int, impl: str = "auto") -> Tensor:
    """See :func:`tree_linear_scan`."""
    _, d = _check_linear_scan(a, b, parent, dim)
    return get_scan_impl(impl, a.device, a.dtype).linear_scan(a, b, parent, d)


@_tree_linear_scan_op.register_fake
def _tree_linear_scan_fake(a, b, parent, dim, impl="auto"):
    shape, _ = _check_linear_scan(a, b, parent, dim)
    SCAN_IMPLS.check_name(impl)
    return a.new_empty(shape)


@torch.library.custom_op("brcompile::tree_linear_scan_backward", mutates_args=())
def _tree_linear_scan_backward_op(grad: Tensor, a: Tensor, h: Tensor, parent: Tensor,
                                  dim: int, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """``(grad_a, grad_b)`` in the output's shape: ``gb`` the reverse scan of ``grad`` over the subtrees,
    ``grad_a[k] = gb[k] * h[parent[k]]`` (0 at a root), ``grad_b = gb`` (``ScanImpl.linear_scan_backward``)."""
    _, d = _check_linear_scan(a, h, parent, dim)
    return get_scan_impl(impl, h.device, h.dtype).linear_scan_backward(grad, a, h, parent, d)


@_tree_linear_scan_backward_op.register_fake
def _tree_linear_scan_backward_fake(grad, a, h, parent, dim, impl="auto"):
    shape, _ = _check_linear_scan(a, h, parent, dim)
    SCAN_IMPLS.check_name(impl)
    return grad.new_empty(shape), grad.new_empty(shape)


def _linear_scan_setup(ctx, inputs, output):
    a, b, parent, dim, impl = inputs
    ctx.save_for_backward(a, output, parent)
    ctx.dim = dim
    ctx.impl = impl
    ctx.shapes = (a.shape, b.shape)


def _linear_scan_grad(ctx, grad):
    """Exact: the backward op's full-shape gradients summed back to a's and b's shapes (broadcasting)."""
    a, h, parent = ctx.saved_tensors
    ga, gb = torch.ops.brcompile.tree_linear_scan_backward(grad, a, h, parent, ctx.dim, ctx.impl)
    a_shape, b_shape = ctx.shapes
    return ga.sum_to_size(a_shape), gb.sum_to_size(b_shape), None, None, None


torch.library.register_autograd("brcompile::tree_linear_scan", _linear_scan_grad, setup_context=_linear_scan_setup)


def tree_linear_scan(a: Tensor, b: Tensor, parent: Tensor, dim: int, impl: str = "auto") -> Tensor:
    """``brcompile::tree_linear_scan``: ``h[k] = a[k] * h[parent[k]] + b[k]`` (``h = b`` at a root) along the
    packed token dim ``dim`` of ``a`` and ``b`` broadcast together — the dense ``h_t = a_t h_{t-1} + b_t``
    along a row (``h_{-1} = 0``), computed along the tree paths.

    Backward (exact): with ``g = dL/dh``, ``gb[k] = g[k] + sum over the children c of k of a[c] * gb[c]`` (a
    reverse scan over the subtrees, the transpose of the forward), ``dL/da[k] = gb[k] * h[parent[k]]`` (0 at a
    root), ``dL/db = gb``; each summed back to its input's shape where it was broadcast. ``impl`` names a
    :class:`ScanImpl` in :data:`SCAN_IMPLS` (``"auto"``: triton on CUDA, torch elsewhere)."""
    return torch.ops.brcompile.tree_linear_scan(a, b, parent, dim, impl)


def linear_scan(a: Tensor, b: Tensor, dim: int) -> Tensor:
    """The dense ``h_t = a_t h_{t-1} + b_t`` along ``dim`` of ``a`` and ``b`` broadcast together (``h_0 =
    b_0``): ``tree_linear_scan`` over the chain of the dense positions (every row is its own path). What
    ``torch._higher_order_ops.associative_scan`` with the affine combine computes (passes/canonical/scans/linear.py)."""
    n = torch.broadcast_shapes(a.shape, b.shape)[dim]
    return torch.ops.brcompile.tree_linear_scan(a, b, chain_parent(n, a.device), dim)


# ------------------------------------------------------------------------------------------- flops


@register_flop_formula(torch.ops.brcompile.tree_causal_conv1d, get_raw=True)
def _conv_flop(x, weight, bias, parent, *args, out_val=None, **kwargs) -> int:
    """A multiply and an add per tap and output element, as the dense conv: 2 * B * C * N * W."""
    return 2 * x.numel() * weight.shape[2]


@register_flop_formula(torch.ops.brcompile.tree_causal_conv1d_backward, get_raw=True)
def _conv_backward_flop(grad, x, weight, parent, *args, out_val=None, **kwargs) -> int:
    """dx and dweight: twice the forward."""
    return 4 * x.numel() * weight.shape[2]


@register_flop_formula(torch.ops.brcompile.tree_linear_scan, get_raw=True)
def _linear_scan_flop(a, b, parent, dim, *args, out_val=None, **kwargs) -> int:
    """A multiply and an add per output element, as the dense recurrence: 2 * numel."""
    return 2 * torch.broadcast_shapes(a.shape, b.shape).numel()


@register_flop_formula(torch.ops.brcompile.tree_linear_scan_backward, get_raw=True)
def _linear_scan_backward_flop(grad, a, h, parent, dim, *args, out_val=None, **kwargs) -> int:
    """The reverse recurrence (a multiply and an add) and grad_a's multiply per element: 3 * numel."""
    return 3 * grad.numel()


#: Ops whose output at a token reads its ancestors along the tree path (not token-local): the streaming
#: split runs them on a chunk of tails with the cached values of the chunk's ancestors in the prefix (the
#: ``*_cached`` functions below; passes/emit/split.py).
TREE_PATH_OPS = (torch.ops.brcompile.tree_cumsum.default, torch.ops.brcompile.tree_causal_conv1d.default,
                 torch.ops.brcompile.tree_linear_scan.default)


# ----------------------------------------------------------------------------- against a cached prefix
#
# Streaming replay (passes/emit/split.py) runs a scan on a chunk of tail tokens whose local tree (``parent``)
# holds the chunk's own tokens only: a chunk token whose path leaves the chunk continues in the prefix,
# which ran before. ``ancestors [R, n]`` (brcompile.runtime.streaming.Chunk.ancestors) holds, row i-1, the
# prefix-local id of the chunk token's i-th ancestor when that is a prefix token, else -1; along a path
# the chunk's tokens come first, then prefix tokens only. Each function adds the prefix's part to the
# local scan with ordinary (differentiable) ops, so the gradient of the cached prefix values is exact and
# flows back into the prefix like the cached K/V's.


def tree_linear_scan_cached(a: Tensor, b: Tensor, parent: Tensor, dim: int, impl: str, h_cache: Tensor,
                            ancestors: Tensor) -> Tensor:
    """``h[k] = a[k] * h[parent(k)] + b[k]`` where the parent of a chunk root may be a prefix token: its
    state is the prefix scan's output ``h_cache`` there. The chunk's scan with ``b[k] + a[k] *
    h_cache[p(k)]`` at those roots (``p(k) = ancestors[0, k]``; 0 added elsewhere): the root's recurrence
    step, then the local recurrence unchanged."""
    b = b + a * prefix_rows(h_cache, ancestors[0], dim % h_cache.dim())
    return torch.ops.brcompile.tree_linear_scan(a, b, parent, dim, impl)


def tree_cumsum_cached(x: Tensor, parent: Tensor, dim: int, out_cache: Tensor, ancestors: Tensor) -> Tensor:
    """The path sum where a chunk root's parent may be a prefix token: ``x[k] + out_cache[p(k)]`` at those
    roots (the prefix's path sum at the parent, ``p(k) = ancestors[0, k]``), then the local path sum."""
    x = x + prefix_rows(out_cache, ancestors[0], dim % out_cache.dim())
    return torch.ops.brcompile.tree_cumsum(x, parent, dim)


def tree_causal_conv1d_cached(x: Tensor, weight: Tensor, bias: Optional[Tensor], parent: Tensor, impl: str,
                              x_cache: Tensor, ancestors: Tensor) -> Tensor:
    """The causal conv where the last W-1 ancestors of a chunk token may be prefix tokens: the local conv
    (taps past the chunk are zero there) plus ``sum_{1<=i<W} weight[c, 0, W-1-i] * x_cache[:, c,
    ancestors[i-1, k]]`` (zero where that ancestor is not a prefix token) — the taps the local tree misses."""
    out = torch.ops.brcompile.tree_causal_conv1d(x, weight, bias, parent, impl)
    W = weight.shape[2]
    for i in range(1, W):  # W-1 taps (a handful), not tokens
        out = out + weight[:, 0, W - 1 - i].view(1, -1, 1) * prefix_rows(x_cache, ancestors[i - 1], 2)
    return out


