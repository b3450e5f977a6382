"""Elementwise ops: arithmetic, comparisons, activations, casts and copies, dropout, fills.

Every op here computes each output element from the operands' elements at the same coordinates (broadcasting),
so one token-axis rule covers them (``pointwise``, passes/analysis/rules/pointwise.py), a dense result keeps its
operand's token dims where they are (``Liveness.POSITIONWISE``) and each routed pair's row reads that pair's rows
only (pair rule ``pointwise``). A product, a ``where`` and a ``masked_fill`` also kill the positions their per-call
operand zeroes or replaces (``Kill``).
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from brcompile.passes.ops.registry import Kill, Liveness, register_op
from brcompile.passes.ops.respell import bound, factory, fn, method, torch_fns

aten = torch.ops.aten
_nn = torch._C._nn
_EW = dict(axes="pointwise", liveness=Liveness.POSITIONWISE, pair="pointwise")  # the facts of every elementwise op


# --------------------------------------------------------------------------------------------------
# arithmetic (named families: ``a - b`` is ``sub``, ``b - a`` is ``rsub``; the argument order is the math)

def _add_sub(target):
    """``aten.add(a, b, alpha=c)`` → ``a + b`` when c is 1, else ``torch.add(a, b, alpha=c)`` (``a + c·b``)."""
    def respell(node, args, kwargs):
        alpha = kwargs.get("alpha", 1)
        if alpha == 1:
            return "call_function", target, args[:2], {}
        return "call_function", torch.add if target is operator.add else torch.sub, args[:2], {"alpha": alpha}
    return respell


register_op("add", named=True, spellings=(operator.add, *torch_fns("add"), "add", "__add__", "__radd__"),
            aten=(aten.add,), respell=_add_sub(operator.add), **_EW)
register_op("sub", named=True, spellings=(operator.sub, *torch_fns("sub", "subtract"), "sub", "subtract", "__sub__"),
            aten=(aten.sub, aten.subtract), respell=_add_sub(operator.sub), **_EW)
register_op("rsub", named=True, spellings=(*torch_fns("rsub"), "__rsub__"), aten=(aten.rsub,),
            respell=fn(torch.rsub, keep=("alpha",)), **_EW)
register_op("mul", named=True, spellings=(operator.mul, *torch_fns("mul", "multiply"), "mul", "multiply", "__mul__",
                                          "__rmul__"),
            aten=(aten.mul, aten.multiply), respell=fn(operator.mul), kill=Kill.PRODUCT, **_EW)


@register_op("div", named=True, spellings=(operator.truediv, *torch_fns("div", "divide", "true_divide"), "div",
                                           "divide", "true_divide", "truediv", "__truediv__"),
             aten=(aten.div, aten.divide, aten.true_divide), **_EW)
def _div(node, args, kwargs):
    """``aten.div(a, b)`` → ``a / b``; with a ``rounding_mode`` → ``torch.div(a, b, rounding_mode=…)``."""
    mode = kwargs.get("rounding_mode")
    if mode is None:
        return "call_function", operator.truediv, args[:2], {}
    return "call_function", torch.div, args[:2], {"rounding_mode": mode}


register_op("rdiv", named=True, spellings=("__rtruediv__",), **_EW)
register_op("floordiv", named=True, spellings=(operator.floordiv, *torch_fns("floor_divide"), "floor_divide",
                                               "__floordiv__"),
            aten=(aten.floor_divide,), respell=fn(torch.floor_divide), **_EW)
register_op("pow", named=True, spellings=(operator.pow, *torch_fns("pow", "float_power"), "pow", "float_power",
                                          "__pow__"),
            aten=(aten.pow,), respell=fn(torch.pow), **_EW)
register_op("rpow", named=True, spellings=("__rpow__",), **_EW)
register_op("neg", named=True, spellings=(operator.neg, *torch_fns("neg", "negative"), "neg", "negative", "__neg__"),
            aten=(aten.neg, aten.negative), respell=fn(operator.neg), **_EW)
register_op("mod", spellings=(operator.mod,), **_EW)
register_op("remainder", spellings=(torch.remainder,), aten=(aten.remainder,), respell=fn(torch.remainder), **_EW)
register_op("fmod", spellings=(torch.fmod,), aten=(aten.fmod,), respell=fn(torch.fmod), **_EW)
register_op("pos", spellings=(operator.pos,), **_EW)
register_op("abs", spellings=(operator.abs, torch.abs, "abs"), aten=(aten.abs, aten.absolute), respell=fn(torch.abs),
            **_EW)
register_op("lerp", spellings=(torch.lerp, "lerp"), aten=(aten.lerp,), respell=fn(torch.lerp), **_EW)
register_op("atan2", spellings=(torch.atan2,), aten=(aten.atan2, aten.arctan2), respell=fn(torch.atan2), **_EW)
register_op("addcmul", spellings=(torch.addcmul,), aten=(aten.addcmul,), respell=fn(torch.addcmul, keep=("value",)),
            **_EW)
register_op("addcdiv", spellings=(torch.addcdiv,), aten=(aten.addcdiv,), respell=fn(torch.addcdiv, keep=("value",)),
            **_EW)

# comparisons, bounds and logic
for _name, _op, _aliases in (("eq", operator.eq, ()), ("ne", operator.ne, (aten.not_equal,)),
                             ("lt", operator.lt, (aten.less,)), ("le", operator.le, (aten.less_equal,)),
                             ("gt", operator.gt, (aten.greater,)), ("ge", operator.ge, (aten.greater_equal,))):
    register_op(_name, spellings=(_op, getattr(torch, _name), _name), aten=(getattr(aten, _name), *_aliases),
                respell=fn(getattr(torch, _name)), **_EW)
for _name in ("maximum", "minimum", "logical_and", "logical_or", "logical_not"):
    register_op(_name, spellings=(getattr(torch, _name), _name), aten=(getattr(aten, _name),),
                respell=fn(getattr(torch, _name)), **_EW)
register_op("clamp", spellings=(torch.clamp, torch.clip, "clamp", "clip"), aten=(aten.clamp, aten.clip),
            respell=fn(torch.clamp), **_EW)
register_op("clamp_min", spellings=("clamp_min",), aten=(aten.clamp_min,), respell=method("clamp_min"), **_EW)
register_op("clamp_max", spellings=("clamp_max",), aten=(aten.clamp_max,), respell=method("clamp_max"), **_EW)
register_op("and", spellings=(operator.and_, "__and__"), aten=(aten.bitwise_and, aten.__and__),
            respell=fn(operator.and_), **_EW)
register_op("or", spellings=(operator.or_, "__or__"), aten=(aten.bitwise_or, aten.__or__), respell=fn(operator.or_),
            **_EW)
register_op("xor", spellings=(operator.xor,), aten=(aten.__xor__, aten.bitwise_xor), respell=fn(operator.xor), **_EW)
register_op("invert", spellings=(operator.invert, "__invert__"), aten=(aten.bitwise_not,),
            respell=fn(operator.invert), **_EW)
# respelled but without a rule yet (a token operand is materialised)
register_op("logical_xor", aten=(aten.logical_xor,), respell=fn(torch.logical_xor))
register_op("masked_fill", named=True, spellings=(*torch_fns("masked_fill"), "masked_fill"), aten=(aten.masked_fill,),
            respell=fn(torch.masked_fill), kill=Kill.FILL, **_EW)
register_op("where", named=True, spellings=(*torch_fns("where"), "where"), aten=(aten.where,), respell=fn(torch.where),
            kill=Kill.SELECT, **_EW)

# --------------------------------------------------------------------------------------------------
# functions of one operand

register_op("exp", named=True, spellings=(*torch_fns("exp"), "exp"), aten=(aten.exp,), respell=fn(torch.exp), **_EW)
register_op("tanh", named=True, spellings=(*torch_fns("tanh"), F.tanh, "tanh"), aten=(aten.tanh,),
            respell=fn(torch.tanh), **_EW)
register_op("sigmoid", named=True, spellings=(*torch_fns("sigmoid", "special.expit"), F.sigmoid, "sigmoid"),
            aten=(aten.sigmoid,), respell=fn(torch.sigmoid), **_EW)
register_op("silu", named=True, spellings=(F.silu, _nn.silu, "silu"), aten=(aten.silu,), respell=fn(F.silu), **_EW)


@register_op("gelu", named=True, spellings=(F.gelu, _nn.gelu, "gelu"), aten=(aten.gelu,), **_EW)
def _gelu(node, args, kwargs):
    """``aten.gelu(x, approximate=a)`` → ``F.gelu(x)``, ``approximate`` kept unless "none"."""
    approx = kwargs.get("approximate", "none")
    return "call_function", F.gelu, args[:1], ({"approximate": approx} if approx != "none" else {})


for _name in ("exp2", "expm1", "log", "log1p", "log2", "sqrt", "rsqrt", "sin", "cos", "tan", "sign", "square",
              "reciprocal", "floor", "ceil", "round", "isnan", "isinf", "isfinite", "nan_to_num"):
    register_op(_name, spellings=(getattr(torch, _name), _name), aten=(getattr(aten, _name),),
                respell=fn(getattr(torch, _name)), **_EW)
register_op("relu", spellings=(torch.relu, F.relu, "relu"), aten=(aten.relu,), respell=fn(torch.relu), **_EW)
register_op("erf", spellings=(torch.erf, torch.special.erf, "erf"), aten=(aten.erf,), respell=fn(torch.erf), **_EW)
register_op("trunc", spellings=(torch.trunc, "trunc"), aten=(aten.trunc, aten.fix), respell=fn(torch.trunc), **_EW)
register_op("real", spellings=(torch.real,), aten=(aten.real,), respell=fn(torch.real), **_EW)
register_op("imag", spellings=(torch.imag,), aten=(aten.imag,), respell=fn(torch.imag), **_EW)
register_op("conj", spellings=(torch.conj, "conj"), **_EW)
register_op("softplus", spellings=(F.softplus,), aten=(aten.softplus,), respell=fn(F.softplus), **_EW)
register_op("logsigmoid", spellings=(F.logsigmoid,), aten=(aten.log_sigmoid,), respell=fn(F.logsigmoid), **_EW)
for _f in (F.leaky_relu, F.elu, F.mish, F.hardtanh, F.relu6):
    register_op(_f.__name__, spellings=(_f,), **_EW)
# hardswish(x) = x · relu6(x + 3) / 6 (MobileNetV3; the "hardswish" of transformers' activations)
register_op("hardswish", spellings=(F.hardswish,), aten=(aten.hardswish,), respell=fn(F.hardswish), **_EW)
# complex values from pairs: elementwise, emitted as a stacked (real, imaginary) pair
register_op("polar", spellings=(torch.polar,), aten=(aten.polar,), respell=fn(torch.polar), axes="complex_pair")
register_op("complex", spellings=(torch.complex,), aten=(aten.complex,), respell=fn(torch.complex),
            axes="complex_pair")

# --------------------------------------------------------------------------------------------------
# casts and copies (the same numbers: ``cast`` is the family of dtype casts; ``int`` / ``long`` / ``bool`` are not
# in it, nor are copies)

register_op("cast", named=True, spellings=("to", "type", "type_as", "float", "double", "half", "bfloat16"), **_EW)
for _name in ("int", "long", "bool"):
    register_op(_name, spellings=(_name,), **_EW)
register_op("detach", spellings=("detach", torch.detach), aten=(aten.detach,), respell=method("detach"), **_EW)
register_op("clone", spellings=("clone", torch.clone), aten=(aten.clone,), respell=method("clone"), **_EW)
register_op("contiguous", spellings=("contiguous",), aten=(aten.contiguous,), respell=method("contiguous"), **_EW)


@register_op("dropout", named=True, spellings=(F.dropout, *torch_fns("dropout"), "dropout"), aten=(aten.dropout,),
             axes="dropout")
def _dropout(node, args, kwargs):
    """``aten.dropout(x, p, train)`` → ``F.dropout(x, p, training=train)``."""
    b = bound(node, args, kwargs)
    return "call_function", F.dropout, (b["input"], b["p"]), {"training": b["train"]}


register_op("alpha_dropout", spellings=(F.alpha_dropout,), axes="dropout")

# --------------------------------------------------------------------------------------------------
# fills: every element one constant, shaped like an operand

for _name in ("ones_like", "zeros_like", "full_like"):
    register_op(_name, spellings=(getattr(torch, _name),), aten=(getattr(aten, _name),),
                respell=factory(getattr(torch, _name)), axes="filled_like")
register_op("empty_like", aten=(aten.empty_like,), respell=factory(torch.empty_like))
for _name in ("new_zeros", "new_ones", "new_full"):
    register_op(_name, spellings=(_name,), aten=(getattr(aten, _name),), respell=factory(_name, "call_method"),
                axes="new_filled")
