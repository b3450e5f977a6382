"""One table of op spellings: every way a Dynamo graph can spell an op family.

Dynamo records the op a model *wrote*, not a canonical one: ``a * b`` is ``operator.mul``, ``torch.mul(a,
b)`` is ``torch.mul``, ``a.mul(b)`` is the method ``"mul"``, ``2 * a`` may be ``"__rmul__"``, and
``torch.multiply`` is an alias of the same op. Matchers and rules that list spellings themselves drift
apart (one knows ``"true_divide"``, another ``"truediv"``); they all read this table instead.

A family groups spellings with the *same math and argument order*: ``sub`` is ``a - b`` (``__rsub__`` and
``torch.rsub`` compute ``b - a`` and are the family ``rsub``); ``div`` is ``a / b`` (``__rtruediv__`` is
``rdiv``). Callables are ``call_function`` targets, strings ``call_method`` targets (Tensor method names).

``family_of(node)`` names the family of a node, ``is_op(node, family, ...)`` tests membership, and
``spellings(family, ...)`` is the tuple of targets a rule registers (``register_rule(spellings("mul"))``).
It also holds the few graph helpers every pass shares (``copy_graph_module``).
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

__all__ = ["FAMILIES", "copy_graph_module", "family_of", "is_op", "op_name", "spellings", "target_name"]

_nn = torch._C._nn


def _fn(*names: str) -> list:
    """``torch.<name>`` callables that exist in this torch build (aliases come and go between versions)."""
    out = []
    for name in names:
        obj: Any = torch
        try:
            for part in name.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        out.append(obj)
    return out


#: family -> every target spelling it (callables for call_function, method names for call_method).
FAMILIES: dict[str, tuple] = {
    # arithmetic
    "add": (operator.add, *_fn("add"), "add", "__add__", "__radd__"),
    "sub": (operator.sub, *_fn("sub", "subtract"), "sub", "subtract", "__sub__"),
    "rsub": (*_fn("rsub"), "__rsub__"),
    "mul": (operator.mul, *_fn("mul", "multiply"), "mul", "multiply", "__mul__", "__rmul__"),
    "div": (operator.truediv, *_fn("div", "divide", "true_divide"), "div", "divide", "true_divide",
            "truediv", "__truediv__"),
    "rdiv": ("__rtruediv__",),
    "floordiv": (operator.floordiv, *_fn("floor_divide"), "floor_divide", "__floordiv__"),
    "pow": (operator.pow, *_fn("pow", "float_power"), "pow", "float_power", "__pow__"),
    "rpow": ("__rpow__",),
    "neg": (operator.neg, *_fn("neg", "negative"), "neg", "negative", "__neg__"),
    "matmul": (operator.matmul, *_fn("matmul"), "matmul", "__matmul__"),
    "bmm": (*_fn("bmm"), "bmm"),
    "mm": (*_fn("mm"), "mm"),
    "addmm": (*_fn("addmm"), "addmm"),
    "baddbmm": (*_fn("baddbmm"), "baddbmm"),
    "einsum": (*_fn("einsum"),),
    "linear": (F.linear, _nn.linear),
    # pointwise functions
    "exp": (*_fn("exp"), "exp"),
    "tanh": (*_fn("tanh"), F.tanh, "tanh"),
    "sigmoid": (*_fn("sigmoid", "special.expit"), F.sigmoid, "sigmoid"),
    "silu": (F.silu, _nn.silu, "silu"),
    "gelu": (F.gelu, _nn.gelu, "gelu"),
    "masked_fill": (*_fn("masked_fill"), "masked_fill"),
    "where": (*_fn("where"), "where"),
    "cast": ("to", "type", "type_as", "float", "double", "half", "bfloat16"),
    "dropout": (F.dropout, *_fn("dropout"), "dropout"),
    # reductions and normalisations
    "sum": (*_fn("sum"), "sum"),
    "softmax": (F.softmax, *_fn("softmax", "special.softmax"), "softmax"),
    "log_softmax": (F.log_softmax, *_fn("log_softmax", "special.log_softmax"), "log_softmax"),
    "cumsum": (*_fn("cumsum"), "cumsum"),
    "cumprod": (*_fn("cumprod"), "cumprod"),
    "layer_norm": (F.layer_norm, *_fn("layer_norm"), "layer_norm"),
    "rms_norm": (*({getattr(F, "rms_norm", None)} - {None}), *_fn("rms_norm"), "rms_norm"),
    # layout
    "transpose": (*_fn("transpose", "swapaxes", "swapdims"), "transpose", "swapaxes", "swapdims"),
    "permute": (*_fn("permute"), "permute"),
    "reshape": ("view", "reshape", *_fn("reshape", "flatten", "unflatten"), "flatten", "unflatten",
                "view_as", "reshape_as"),
    "expand_as": ("expand_as",),  # x.expand_as(t): x broadcast to t's shape (no torch.expand_as function)
    "repeat": ("repeat",),
    "repeat_interleave": (*_fn("repeat_interleave"), "repeat_interleave"),
    "cat": (*_fn("cat", "concat", "concatenate"),),
    "view_as_complex": (*_fn("view_as_complex"),),
    "view_as_real": (*_fn("view_as_real"),),
    "pad": (F.pad, _nn.pad),
    "conv1d": (F.conv1d,),
    # attention
    "sdpa": (F.scaled_dot_product_attention, _nn.scaled_dot_product_attention),
}

#: views and casts of a value: a TOKEN value read densely through only these is recomputed from the dense inputs
#: (passes/pack.py ``_input_derived``), so it is exact whatever the tree leaves out (passes/liveness.py)
CHEAP_VIEWS = frozenset({"view", "reshape", "unsqueeze", "squeeze", "transpose", "permute", "expand", "contiguous",
                         operator.getitem, "bool", "float", "long", "to", "int", "type_as", "double", "__getitem__"})

_FAMILY_OF: dict[Any, str] = {}
for _family, _targets in FAMILIES.items():
    for _t in _targets:
        # a target belongs to one family; the first listing wins (no target is listed twice above)
        _FAMILY_OF.setdefault(_t, _family)


def spellings(*families: str) -> tuple:
    """Every target of the named families (for ``register_rule`` and membership tests)."""
    out: list = []
    for f in families:
        for t in FAMILIES[f]:
            if t not in out:
                out.append(t)
    return tuple(out)


def family_of(node: Any) -> Optional[str]:
    """The family of an FX ``call_function``/``call_method`` node (None for anything else)."""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return None
    try:
        return _FAMILY_OF.get(node.target)
    except TypeError:  # an unhashable target
        return None


def is_op(node: Any, *families: str) -> bool:
    """Whether ``node`` is a call of one of ``families`` (any spelling)."""
    return family_of(node) in families


def op_name(node: fx.Node) -> str:
    """The short name of a node's target (``mul``, ``view``, ``softmax``): a method's name, a function's
    ``__name__``."""
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", repr(t))


def target_name(node: fx.Node) -> str:
    """A readable name of a node's target (``torch.mul``, ``Tensor.view``, ``operator.mul``)."""
    t = node.target
    if isinstance(t, str):
        return f"Tensor.{t}"
    mod = getattr(t, "__module__", None) or ""
    return f"{mod}.{getattr(t, '__name__', repr(t))}".lstrip(".")


def copy_graph_module(gm: fx.GraphModule, env: Optional[dict] = None) -> fx.GraphModule:
    """A copy of ``gm`` that a pass may rewrite in place: a new graph with a copy of every node (its meta
    included; the output node is made again), in a module of ``gm``'s class name that holds the same
    submodules and attributes (``gm``'s objects, not copies). ``env``, when given, receives old node -> new
    node."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {} if env is None else env))
    return fx.GraphModule(gm, graph, class_name=type(gm).__name__)
