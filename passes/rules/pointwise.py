"""Pointwise and broadcasting ops.

``out[i] = f(a[i], b[i], …)`` with numpy broadcasting: each output element depends on the operands'
elements at the same (broadcast) coordinates, so a TOKEN operand keeps its token dims (right-aligned into
the output) and the result is TOKEN, provided

* all TOKEN operands put their position dim on the same output dim, their row dims agree (or are absent:
  a position-only value such as a rotary table broadcasts over rows), and share one lazy window;
* a CONST operand has extent 1 along the output's token dims (a constant indexed by position or row would
  make the value depend on the dense coordinates, not on the tree node).

Otherwise the TOKEN operands are materialised and the result is DENSE (still exact).
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from brcompile.passes.axes import (
    DENSE, AxesContext, dense_fallback, get_axes, register_rule, shape_of, token,
)

BINARY = [
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.pow,
    operator.mod, operator.and_, operator.or_, operator.xor, operator.eq, operator.ne, operator.lt,
    operator.le, operator.gt, operator.ge,
    torch.add, torch.sub, torch.mul, torch.div, torch.true_divide, torch.pow, torch.maximum, torch.minimum,
    torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge, torch.logical_and, torch.logical_or,
    torch.where, torch.clamp, torch.clip, torch.lerp, torch.atan2, torch.fmod, torch.remainder,
    torch.masked_fill, torch.addcmul, torch.addcdiv,
    "add", "sub", "mul", "div", "truediv", "pow", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge",
    "masked_fill", "where", "clamp", "clip", "clamp_min", "clamp_max", "lerp", "logical_and", "logical_or",
    "__and__", "__or__", "__mul__", "__add__", "__sub__", "__truediv__", "__radd__", "__rmul__",
    "__rsub__", "__rtruediv__", "type_as",
]

UNARY = [
    operator.neg, operator.pos, operator.invert, operator.abs,
    torch.neg, torch.exp, torch.exp2, torch.expm1, torch.log, torch.log1p, torch.log2, torch.sqrt,
    torch.rsqrt, torch.sin, torch.cos, torch.tan, torch.tanh, torch.sigmoid, torch.abs, torch.sign,
    torch.square, torch.reciprocal, torch.erf, torch.floor, torch.ceil, torch.round, torch.trunc,
    torch.logical_not, torch.isnan, torch.isinf, torch.isfinite, torch.nan_to_num, torch.relu,
    torch.nn.functional.silu, F.gelu, F.relu, F.leaky_relu, F.elu, F.softplus, F.mish, F.hardtanh,
    F.relu6, F.logsigmoid, F.tanh, F.sigmoid, torch.special.expit, torch.special.erf,
    "neg", "exp", "exp2", "expm1", "log", "log1p", "log2", "sqrt", "rsqrt", "sin", "cos", "tan", "tanh",
    "sigmoid", "abs", "sign", "square", "reciprocal", "erf", "floor", "ceil", "round", "trunc",
    "logical_not", "isnan", "isinf", "isfinite", "nan_to_num", "relu", "float", "double", "half",
    "bfloat16", "int", "long", "bool", "to", "type", "detach", "clone", "contiguous", "__neg__",
    "__invert__", torch.clone, torch.detach,
]


def broadcast_token_axes(ctx: AxesContext, node, operands) -> object:
    """Fact of a broadcasting op's output, or None if its operands cannot stay packed.

    An operand of rank r sits right-aligned in the output of rank R: its dim d is output dim R - r + d.
    """
    out_shape = shape_of(node)
    if out_shape is None:
        return None
    R = len(out_shape)
    row = pos = window = None
    has_row = False
    for a in operands:
        ax = get_axes(a)
        if not ax.is_token:
            continue
        off = R - ax.ndim
        p = ax.pos + off
        r = None if ax.row is None else ax.row + off
        if pos is not None and p != pos:
            return None
        if r is not None:
            if has_row and r != row:
                return None
            row, has_row = r, True
        if window is not None and ax.window != window:
            return None
        pos, window = p, ax.window
    if has_row and row == pos:
        return None
    for a in operands:
        ax = get_axes(a)
        if ax.is_token:
            continue
        if ax.is_dense:
            return None
        shp = shape_of(a)
        if shp is None:
            continue  # python scalar
        off = R - len(shp)
        for d in (row, pos):
            if d is not None and d - off >= 0 and shp[d - off] != 1:
                return None
    return token(R, row if has_row else None, pos, window)


@register_rule(BINARY + UNARY)
def pointwise(ctx: AxesContext, node):
    """Elementwise ops: the output element is f of the operands' elements at the same coordinates."""
    operands = [a for a in list(node.args) + list(node.kwargs.values())]
    flat = []
    for a in operands:
        if isinstance(a, (list, tuple)):
            flat.extend(a)
        else:
            flat.append(a)
    if node.target in ("to", "type") and not _is_dtype_cast(node):
        return dense_fallback(ctx, node, "Tensor.to with a device/other argument")
    ax = broadcast_token_axes(ctx, node, [a for a in flat if hasattr(a, "meta")])
    if ax is None:
        return dense_fallback(ctx, node, "operands are not aligned on the token dims")
    return ax


def _is_dtype_cast(node) -> bool:
    rest = list(node.args[1:]) + list(node.kwargs.values())
    return all(isinstance(a, (torch.dtype, bool)) or a is None or isinstance(a, torch.device) for a in rest)


@register_rule([F.dropout, torch.dropout, "dropout", F.alpha_dropout])
def dropout(ctx: AxesContext, node):
    """Dropout: the identity when ``p == 0`` or not training; otherwise its random mask is drawn per
    dense element, which a packed run cannot reproduce — refuse."""
    p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
    training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
    if p == 0 or training is False:
        return get_axes(node.args[0])
    ctx.fail(node, f"dropout with p={p} in training draws a random mask per dense element")
    return DENSE

