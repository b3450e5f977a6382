"""Position sources and sizes.

``arange(L)`` is the position of every token: in the packed graph it becomes the packed tokens' column
``position[k]`` (a position-only TOKEN value, row dim absent). Sizes read off a TOKEN value's token dims
are the dense sizes (read from the lazy index, never from the packed data).
"""
from __future__ import annotations

import operator

import torch

from brcompile.passes.analysis.axes import (
    CONST, AxesContext, Local, axis_rule, example_value, get_axes, hint, normalize_dim, token,
)


def _arange_bounds(node):
    a = list(node.args)
    if len(a) == 1:
        return 0, a[0], 1
    if len(a) == 2:
        return a[0], a[1], 1
    if len(a) == 3:
        return tuple(a)
    return node.kwargs.get("start", 0), node.kwargs.get("end"), node.kwargs.get("step", 1)


def _sym_hint(v):
    if hasattr(v, "meta"):
        return hint(example_value(v))
    return hint(v)


def emit_arange(pk, node):
    """arange(L) -> position[k] of each packed token, in the arange's dtype."""
    dtype = node.kwargs.get("dtype") or torch.int64
    pos = pk.tree("position")
    if dtype != torch.int64:
        pos = pk.graph.call_method("to", (pos, dtype))
    return pos


@axis_rule(emit=emit_arange, always=True)
def arange(ctx: AxesContext, node):
    """``arange(L)`` (start 0, step 1, end the token length) gives positions; any other arange is a
    constant."""
    start, end, step = _arange_bounds(node)
    if _sym_hint(start) == 0 and _sym_hint(step) == 1 and _sym_hint(end) == ctx.L:
        return token(1, None, 0, ctx.full_window())
    return CONST


def emit_size(pk, node):
    """A size of a token dim is the dense size: read from the (windowed) index."""
    x = node.args[0]
    ax = get_axes(x)
    d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if d is None:  # x.size(): the whole dense shape, as a tuple of per-dim sizes
        return tuple(_emit_dim_size(pk, x, ax, k) for k in range(ax.ndim))
    return _emit_dim_size(pk, x, ax, normalize_dim(d, ax.ndim))


def _emit_dim_size(pk, x, ax, d):
    """The dense size of dim ``d`` of TOKEN ``x``: token dims from the (windowed) index, others packed."""
    if d in ax.token_dims():
        idx = pk.index(ax.window)
        if ax.flat:  # the flattened token dim: B·L·k
            n = pk.graph.call_method("numel", (idx,))
            return n if ax.flat == 1 else pk.graph.call_function(operator.mul, (n, ax.flat))
        return pk.graph.call_method("size", (idx, 0 if d == ax.row else 1))
    return pk.graph.call_method("size", (pk.packed(x), d))


@axis_rule(emit=emit_size, local=Local.OWN)
def size(ctx: AxesContext, node):
    """x.size(d): an int; x.size(): the dense shape (a tuple, its token dims read from the index)."""
    return CONST

