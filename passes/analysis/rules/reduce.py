"""Reductions and normalisations over non-token dims.

``mean(x, d)``, ``softmax(x, d)``, ``layer_norm``/``rms_norm`` over trailing dims … combine elements that
share every other coordinate; when ``d`` is not a token dim, each output element still belongs to one
(row, position), so TOKEN stays TOKEN (token dims renumbered when ``d`` is dropped). A reduction over a
token dim (``x.mean(0)`` mixes rows, ``x.sum(1)`` mixes positions) needs the dense value.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from brcompile.passes.analysis.axes import (
    AxesContext, Local, axis_rule, dense_fallback, example_value, get_axes, normalize_dim, token,
)
from brcompile.passes.analysis.rules import pointwise as _pointwise
from brcompile.passes.spellings import arg


def _reduced_dims(node, ndim: int):
    name = node.target if isinstance(node.target, str) else node.target.__name__
    if name in ("norm", "vector_norm", "linalg_vector_norm"):  # (x, ord, dim, ...): torch.linalg.vector_norm's name
        dim = arg(node, 2, "dim")
    else:
        dim = arg(node, 1, "dim")
    if dim is None:
        return list(range(ndim))
    if isinstance(dim, int):
        dim = [dim]
    return [normalize_dim(d, ndim) for d in dim]


@axis_rule(local=Local.CARRY)
def reduction(ctx: AxesContext, node):
    """Reduce over ``dim`` (kept or dropped): allowed iff no token dim is reduced."""
    ax = get_axes(node.args[0])
    dims = _reduced_dims(node, ax.ndim)
    if any(d in ax.token_dims() for d in dims):
        return dense_fallback(ctx, node, "reduction over a token dim (mixes rows or positions)")
    out = example_value(node)
    out_ndim = (out[0] if isinstance(out, (tuple, list)) else out).dim()  # (values, indices) of max/min
    if out_ndim == ax.ndim:
        return ax
    sh = lambda x: None if x is None else x - sum(1 for d in dims if d < x)  # noqa: E731
    return token(out_ndim, sh(ax.row), sh(ax.pos), ax.window)


@axis_rule(emit=_pointwise.emit_pointwise, local=Local.CARRY)
def max_min(ctx: AxesContext, node):
    """``max``/``min`` in their three forms: ``x.max()`` over every element and ``x.max(dim)`` -> (values,
    indices) over ``dim`` are reductions (both outputs reduce the same elements, so the tuple's fact is its
    elements': per token when ``dim`` is not a token dim); ``max(x, other)`` with a tensor ``other`` is the
    elementwise maximum (pointwise)."""
    other = arg(node, 1, "other")
    if isinstance(other, fx.Node):
        return _pointwise.pointwise(ctx, node)
    return reduction(ctx, node)


@axis_rule(local=Local.CARRY)
def softmax(ctx: AxesContext, node):
    """softmax/log_softmax/cumsum along ``dim``: shape-preserving, allowed along a non-token dim (a cumsum
    along the positions runs along the tree paths: ``passes/analysis/rules/scan.py``, which calls this otherwise)."""
    ax = get_axes(node.args[0])
    dim = arg(node, 1, "dim")
    if ax.flat and dim is not None and normalize_dim(dim, ax.ndim) == ax.pos:
        return dense_fallback(ctx, node, "cumsum/softmax over the flattened tokens: each entry depends on every "
                                         "other token of the batch (an expert capacity count, token dropping by "
                                         "capacity depends on the number of tokens in the batch)")
    if dim is None or normalize_dim(dim, ax.ndim) in ax.token_dims():
        return dense_fallback(ctx, node, "softmax/cumsum along a token dim")
    return ax


@axis_rule(local=Local.CARRY)
def layer_norm(ctx: AxesContext, node):
    """layer_norm/rms_norm (``F.rms_norm``, ``torch.rms_norm``, ``nn.RMSNorm``) normalise over the trailing
    ``len(normalized_shape)`` dims: ``y = x / rms(x[..., trailing]) * w`` reads only the elements that
    share every leading coordinate, so when no token dim is normalised each output element belongs to
    the (row, position) of its input (causal, row-independent); the weights (and bias) must be constant."""
    ax = get_axes(node.args[0])
    nshape = node.args[1] if len(node.args) > 1 else node.kwargs["normalized_shape"]
    k = 1 if isinstance(nshape, int) else len(nshape)
    others = list(node.args[2:]) + [v for kk, v in node.kwargs.items() if kk != "normalized_shape"]
    if node.target is F.group_norm or any(d >= ax.ndim - k for d in ax.token_dims()) or any(
            not get_axes(o).is_const for o in others):
        return dense_fallback(ctx, node, "normalisation over a token dim or with non-constant weights")
    return ax
