"""Linear algebra that contracts over a non-token dim: linear, matmul/bmm with a constant, embedding.

``linear(x, W)[..., o] = sum_i x[..., i] W[o, i]``: each output element reads one input "row vector"
(the same leading coordinates), so the token dims of ``x`` pass through when neither is the contracted
(last) dim and ``W`` is a constant. ``embedding(ids, W)[..., :] = W[ids[...]]`` is a lookup per element.
A product of two TOKEN values (``q @ k^T``) mixes positions: that is attention, handled elsewhere.
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from brcompile.passes.axes import AxesContext, dense_fallback, get_axes, register_rule, shape_of, token


@register_rule([F.linear, torch._C._nn.linear])
def linear(ctx: AxesContext, node):
    """linear(x, W, b): token dims of x must not be its last (contracted) dim; W, b constant."""
    x = node.args[0]
    ax = get_axes(x)
    others = list(node.args[1:]) + list(node.kwargs.values())
    if not ax.is_token or any(get_axes(o).is_token or get_axes(o).is_dense for o in others):
        return dense_fallback(ctx, node, "linear with a non-constant weight")
    if ax.ndim - 1 in ax.token_dims():
        return dense_fallback(ctx, node, "linear contracts a token dim")
    return token(ax.ndim, ax.row, ax.pos, ax.window)


@register_rule([torch.matmul, operator.matmul, "matmul", torch.bmm, "bmm",
                "__matmul__"])
def matmul(ctx: AxesContext, node):
    """matmul(a, b) with a TOKEN and b a constant matrix (or b TOKEN and a constant with token dims in
    b's batch dims): the contracted dim must not be a token dim; batch dims broadcast like pointwise."""
    a, b = node.args[0], node.args[1]
    fa, fb = get_axes(a), get_axes(b)
    out = shape_of(node)
    if fa.is_token and fb.is_const:
        sb = shape_of(b)
        if fa.ndim - 1 in fa.token_dims() or sb is None or len(sb) > 2:
            return dense_fallback(ctx, node, "matmul contracts a token dim or broadcasts a constant batch")
        return token(len(out), fa.row, fa.pos, fa.window)  # batch dims stay; last dim is contracted
    return dense_fallback(ctx, node, "matmul of two token values (attention scores) or of a dense value")


@register_rule([F.embedding, torch.embedding])
def embedding(ctx: AxesContext, node):
    """embedding(ids, W): one row of W per id; the ids' token dims pass through, a new last dim appears."""
    ids = node.args[0]
    ax = get_axes(ids)
    if not ax.is_token or not get_axes(node.args[1]).is_const:
        return dense_fallback(ctx, node, "embedding of dense ids or with a non-constant table")
    return token(ax.ndim + 1, ax.row, ax.pos, ax.window)
