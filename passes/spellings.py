"""The op vocabulary: every way a Dynamo graph can spell an op family, and the named groups of ops.

Dynamo records the op a model *wrote*, not a canonical one: ``a * b`` is ``operator.mul``, ``torch.mul(a,
b)`` is ``torch.mul``, ``a.mul(b)`` is the method ``"mul"``, ``2 * a`` may be ``"__rmul__"``, and
``torch.multiply`` is an alias of the same op. Matchers and rules that list spellings themselves drift
apart (one knows ``"true_divide"``, another ``"truediv"``); they all read the op records (passes/ops/) instead,
whose named families are :data:`FAMILIES`.

A family groups spellings with the *same math and argument order*: ``sub`` is ``a - b`` (``__rsub__`` and
``torch.rsub`` compute ``b - a`` and are the family ``rsub``); ``div`` is ``a / b`` (``__rtruediv__`` is
``rdiv``). Callables are ``call_function`` targets, strings ``call_method`` targets (Tensor method names).

``family_of(node)`` names the family of a node, ``is_op(node, family, ...)`` tests membership, and
``spellings(family, ...)`` is the tuple of a family's targets, for matchers. Op sets that are not one op are
*named groups* below the table (``COPIES``, ``INDEX_CASTS``, ...), each
saying how it differs from its neighbours; ``random_draw`` is the one test for randomness. It also holds the
few graph helpers every pass shares (``copy_graph_module``, ``arg`` for a call's bound argument).
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._functorch import predispatch

from brcompile.passes import ops as _ops

__all__ = ["FAMILIES", "arg", "copy_graph_module", "family_of", "is_op", "names", "op_name", "random_draw", "spellings",
           "target_name"]

#: family -> every target spelling it (callables for call_function, method names for call_method): the named
#: families of the op records (passes/ops/, ``register_op(..., named=True)``)
FAMILIES: dict[str, tuple] = _ops.families()

#: views and casts of a value: a TOKEN value read densely through only these is recomputed from the dense inputs
#: (passes/emit/pack.py ``_input_derived``), so it is exact whatever the tree leaves out (passes/analysis/liveness.py)
CHEAP_VIEWS = frozenset({"view", "reshape", "unsqueeze", "squeeze", "transpose", "permute", "expand", "contiguous",
                         operator.getitem, "bool", "float", "long", "to", "int", "type_as", "double", "__getitem__"})


def _of(*families: str) -> tuple:
    """Every target of the named families, in table order, each once (:func:`spellings`)."""
    out: list = []
    for f in families:
        for t in FAMILIES[f]:
            if t not in out:
                out.append(t)
    return tuple(out)


# --------------------------------------------------------------------------------------------------
# named groups: op sets a pass matches that are not one family (each says what it holds and how it differs
# from its neighbours). Membership is by target (``node.target in GROUP``) unless a docstring says names.

#: copies of a value (same numbers, maybe new storage; a graph edge stays differentiable): ``x.contiguous()``,
#: ``x.clone()``, ``torch.clone(x)``
COPIES = ("contiguous", "clone", torch.clone)
#: detaches: the value itself, cut from autograd (``x.detach()``, ``torch.detach(x)``)
DETACHES = ("detach", torch.detach)
#: calls whose value is their operand's: :data:`COPIES` and :data:`DETACHES` (the ATen level's
#: ``torch.tensor(v).detach()``)
SAME_VALUE = COPIES + DETACHES
#: the ``cast`` family and :data:`COPIES`: a value's numbers unchanged when the dtype is (the LM-head walk
#: checks the dtype)
CASTS_AND_COPIES = frozenset({*FAMILIES["cast"], *COPIES})
#: method casts an integer index or group count may go through (passes/analysis/rules/moe.py): unlike the ``cast``
#: family it has ``int`` / ``long`` and lacks ``half`` / ``bfloat16`` (a count in half precision is not exact)
INDEX_CASTS = frozenset({"to", "long", "int", "float", "double", "type", "type_as"})
#: the method ops allowed on a MoE group count (passes/emit/split.py): :data:`INDEX_CASTS` and ``cumsum``
GROUP_COUNT_STEPS = INDEX_CASTS | {"cumsum"}
#: methods that cast to a floating dtype (KDA's ``decay_mask.exp().float()``); unlike the ``cast`` family no
#: ``to`` / ``type`` / ``type_as``, whose target dtype is an argument
FLOAT_CASTS = ("float", "half", "bfloat16", "double")
#: broadcasts of a value to a larger shape: ``x.expand(...)``, ``x.expand_as(t)``, ``torch.broadcast_to``
BROADCASTS = ("expand", "expand_as", torch.broadcast_to)
#: the ``reshape`` family, ``expand`` and ``unsqueeze``: the views a 1-D value reaches a mask through
RESHAPE_VIEWS = FAMILIES["reshape"] + ("expand", "unsqueeze", torch.unsqueeze)
#: flattening reshapes only (``reshape``, ``view``, ``flatten``): unlike the ``reshape`` family no ``unflatten``,
#: ``view_as`` or ``reshape_as`` and no ``torch.unflatten`` (the LM head's ``[B·L, D]`` operand)
FLAT_RESHAPES = frozenset({"reshape", "view", torch.reshape, "flatten", torch.flatten})
#: ``flatten`` (function and method)
FLATTENS = frozenset({torch.flatten, "flatten"})
#: ``movedim`` (function and method)
MOVEDIMS = frozenset({torch.movedim, "movedim"})
#: ``unsqueeze`` / ``squeeze`` (functions and methods)
SQUEEZES = (torch.unsqueeze, "unsqueeze", torch.squeeze, "squeeze")
#: the 2-D transpose ``t`` (function and method)
MATRIX_TRANSPOSES = (torch.t, "t")
#: how a weight is transposed before a matrix product reads it: the ``T`` / ``mT`` attributes (through
#: ``getattr``), ``t``, ``transpose``, ``permute``
WEIGHT_TRANSPOSES = frozenset({"T", "mT", "t", "transpose", "permute", torch.t, torch.transpose, torch.permute})
#: matrix products whose second operand is a weight (``x @ W``, ``x.mm(W)``, ``F.linear(x, W)``)
MATRIX_RIGHT_OPERAND = frozenset({operator.matmul, torch.matmul, "matmul", "__matmul__", torch.mm, "mm",
                                  torch.nn.functional.linear})
#: the matrix products, by family (and ATen packet) name: a token's FLOPs in them, 2 x (the first operand's last dim)
#: x (the output's entries per token), weigh it against its attention in the context-parallel cut
#: (passes/emit/split.py ``_work_alpha``)
MATMUL_NAMES = frozenset({"linear", "mm", "addmm", "matmul", "bmm", "baddbmm"})
#: ``gather`` (function and method)
GATHERS = (torch.gather, "gather")
#: ``max`` / ``amax`` (functions and methods)
MAX = (torch.max, "max", torch.amax, "amax")
#: the elementwise ``max(s, c)``: ``torch.maximum``, ``torch.max`` of two tensors, ``clamp(s, min=c)``
FLOORS = (torch.maximum, "maximum", torch.max, "max", torch.clamp, "clamp", torch.clip, "clip", torch.clamp_min,
          "clamp_min")
#: ``logsumexp`` (function and method)
LOGSUMEXP = (torch.logsumexp, "logsumexp")
#: constructors of a tensor filled with one number: ``torch.full(size, v)``, ``torch.tensor(v)``,
#: ``torch.scalar_tensor(v)`` (CPM-Ant's mask value, XGLM's ``torch.full((), finfo.min)``)
CONSTANT_FILLS = (torch.full, torch.tensor, torch.scalar_tensor)
#: ``embedding`` lookups (``F.embedding``, ``torch.embedding``)
EMBEDDINGS = (torch.nn.functional.embedding, torch.embedding)
#: the cross-entropy loss (``F.cross_entropy``)
CROSS_ENTROPY = (F.cross_entropy,)
#: grouped matrix products of a MoE (the ``grouped_mm`` record's spellings: passes/ops/moe.py)
GROUPED_MM = _ops.record_named("grouped_mm").spellings
#: ops that move floating-point values without computing on them (flatten, index and copy: pack's dense reads)
VALUE_MOVES = frozenset({"flatten", "index_select", "gather", "take", "take_along_dim", "clone", torch.flatten,
                         torch.index_select, torch.gather, torch.take, torch.take_along_dim, torch.clone})
#: op *names* (``op_name``, the part before a ``.``) that move stored values without computing on them: how
#: cached keys reach an attention (a dynamic cache's concatenation with the new key, a static cache's in-place
#: write, the heads repeated for grouped queries)
CACHE_MOVES = frozenset({
    "cat", "concat", "concatenate", "view", "reshape", "expand", "getitem", "__getitem__", "transpose",
    "permute", "unsqueeze", "squeeze", "contiguous", "to", "clone", "detach", "float", "double", "half",
    "bfloat16", "type_as", "repeat", "repeat_interleave", "narrow", "flatten", "index_copy", "index_copy_",
    "index_put", "index_put_", "scatter", "slice_scatter", "select_scatter", "copy", "copy_", "alias",
    "_unsafe_view"})
#: reads of a checkpointed region's inputs that stay outside it: indexing, ``unsqueeze``, ``size``
CHECKPOINT_READS = (operator.getitem, "__getitem__", "unsqueeze", "size")
#: Ops (by name, the overload dropped) that read a value's sizes or rank only, never its elements.
SIZE_READS = frozenset({"size", "sym_size", "sym_numel", "numel", "dim"})
#: activation-checkpoint higher-order ops, as Dynamo records them
CHECKPOINT_HOPS = (torch.ops.higher_order.tag_activation_checkpoint,)
#: autocast region markers in a graph (enter / exit)
AUTOCAST_REGION = (torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast)

#: op *names* of a row gather (``x[idx]``, ``x.index_select(0, idx)``)
GATHER_NAMES = ("getitem", "index_select")

# the ATen level and functorch's inline transforms

#: ATen elementwise arithmetic overloads
POINTWISE_ATEN = frozenset({torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor,
                            torch.ops.aten.neg.default})
#: ATen ``slice`` (the packet and its ``Tensor`` overload)
ATEN_SLICES = frozenset({torch.ops.aten.slice, torch.ops.aten.slice.Tensor})
#: torch.vmap's bookkeeping as traced by Dynamo (no data: nesting levels and the lazy decompositions)
VMAP_CONTROL = frozenset({predispatch.lazy_load_decompositions, predispatch._vmap_increment_nesting,
                          predispatch._vmap_decrement_nesting})
#: torch.vmap's data ops (a batch dim added / removed)
VMAP_DATA = frozenset({predispatch._add_batch_dim, predispatch._remove_batch_dim})

# in-place and allocating ops (passes/lower/functionalize.py, passes/analysis/axes.py)

#: Python's in-place operators (``x += y`` ...) and ``x[i] = y``, as Dynamo records them; the keys of
#: :data:`OUT_OF_PLACE_OPERATORS` and ``ilshift`` / ``irshift`` / ``setitem``, which have no twin there
INPLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor, operator.ilshift,
    operator.irshift, operator.setitem})
#: ``operator`` functions with a trailing ``_`` only to avoid a Python keyword (``and_``): they do not mutate
OPERATORS_NOT_INPLACE = (operator.and_, operator.or_, operator.xor, operator.not_, operator.is_,
                         operator.is_not, operator.concat)
#: in-place operator -> its out-of-place twin
OUT_OF_PLACE_OPERATORS = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv, operator.imod: operator.mod,
    operator.ipow: operator.pow, operator.imatmul: operator.matmul, operator.iand: operator.and_,
    operator.ior: operator.or_, operator.ixor: operator.xor,
}
#: call_function targets whose result is always a new tensor
ALLOCATING_FUNCTIONS = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.pow,
    operator.matmul, operator.neg,
    torch.add, torch.sub, torch.mul, torch.div, torch.true_divide, torch.matmul, torch.bmm, torch.mm,
    torch.baddbmm, torch.einsum, torch.exp, torch.log, torch.sqrt, torch.rsqrt, torch.tanh, torch.sigmoid,
    torch.softmax, torch.log_softmax, torch.sum, torch.mean, torch.cumsum, torch.where, torch.cat, torch.stack,
    torch.slice_scatter, torch.select_scatter, torch.clone, torch.zeros, torch.ones, torch.empty, torch.full,
    torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.arange, torch.cos, torch.sin, torch.tril,
    torch.triu, torch.masked_fill, torch.pow, torch.abs,
    F.linear, torch._C._nn.linear, F.softmax, F.log_softmax, F.silu, F.gelu, F.relu, F.embedding,
    F.layer_norm, F.one_hot, torch.gather, torch.index_select, torch.take_along_dim, F.sigmoid, F.softplus,
    # comparisons: a new bool tensor (``x[x == v] = 0`` reads x into the mask before the write)
    operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
    torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge,
})
#: call_method names whose result is always a new tensor
ALLOCATING_METHODS = frozenset({
    "add", "sub", "mul", "div", "pow", "neg", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "softmax",
    "log_softmax", "sum", "mean", "cumsum", "clone", "masked_fill", "new_zeros", "new_ones", "new_empty",
    "new_full", "abs", "gather", "index_select", "take_along_dim", "__add__", "__sub__", "__mul__",
    "__truediv__", "__radd__", "__rmul__", "__rsub__", "__neg__", "__matmul__",
    "eq", "ne", "lt", "le", "gt", "ge", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
    "cos", "sin", "tan", "sign", "square", "reciprocal", "expm1", "log1p", "tril", "triu", "prod", "amax",
    "amin", "repeat",
})
#: ops returning a tuple of new tensors (read through ``getitem``)
ALLOCATING_TUPLES = frozenset({torch.topk, torch.sort, torch.max, torch.min, "topk", "sort"})
#: method views that rearrange a tensor's elements one-to-one (each element of the view is one element of its
#: base), and methods that return their input or a copy of it (``contiguous``, ``type_as`` / ``to`` of its own
#: dtype)
LAYOUT_VIEW_METHODS = frozenset({"permute", "transpose", "view", "reshape", "unsqueeze", "squeeze", "flatten",
                                 "unflatten", "t", "contiguous", "type_as", "to"})
#: the function spellings of the one-to-one views of :data:`LAYOUT_VIEW_METHODS`
LAYOUT_VIEW_FUNCTIONS = frozenset({torch.permute, torch.transpose, torch.reshape, torch.unsqueeze, torch.squeeze,
                                   torch.flatten, torch.t})
#: ops that return their input (``dropout`` with p = 0 or not training: ATen returns the input itself) or a new
#: tensor (a dropout that draws): either way nothing but their input shares their storage
INPUT_OR_NEW_FUNCTIONS = frozenset({F.dropout, torch.dropout})
#: methods ``y.op(t)`` whose result is ``y`` (a view of it or a copy) shaped or typed like ``t``
LIKE_METHODS = frozenset({"expand_as", "view_as", "reshape_as", "type_as"})

# randomness

#: Tensor methods that overwrite their tensor with random draws (``empty_like(x).exponential_()``: Gumbel noise)
RANDOM_FILLS = frozenset({"exponential_", "uniform_", "normal_", "bernoulli_", "random_", "geometric_", "cauchy_",
                          "log_normal_"})
#: name parts of ops that draw random numbers (``rand``, ``randn_like``, ``dropout``, ``normal_`` ...)
RANDOM_NAME_PARTS = ("rand", "bernoulli", "normal", "multinomial", "dropout", "poisson", "exponential", "uniform",
                     "cauchy", "geometric")


#: split / chunk spellings (passes/lower/splits.py) (functions and Tensor methods) -> their kind
SPLITS: dict[Any, str] = {
    torch.tensor_split: "tensor_split", "tensor_split": "tensor_split",
    torch.split: "split", torch.Tensor.split: "split", "split": "split",
    torch.chunk: "chunk", "chunk": "chunk",
}

_FAMILY_OF: dict[Any, str] = {}
for _family, _targets in FAMILIES.items():
    for _t in _targets:
        # a target belongs to one family; the first listing wins (no target is listed twice above)
        _FAMILY_OF.setdefault(_t, _family)


def spellings(*families: str) -> tuple:
    """Every target of the named families (for matchers and membership tests)."""
    return _of(*families)


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


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """The argument ``name`` of a call node: its keyword if given, else its ``index``-th positional argument if
    there are that many, else ``default`` (``x.sum(dim)`` / ``x.sum(dim=d)``)."""
    return node.kwargs.get(name, node.args[index] if len(node.args) > index else default)


def names(targets) -> frozenset:
    """The short names (:func:`op_name`: a method's name, a function's ``__name__``) of a group's targets, for
    matchers that compare ``op_name(node)`` rather than the target."""
    return frozenset(t if isinstance(t, str) else getattr(t, "__name__", repr(t)) for t in targets)


def random_draw(node: fx.Node, *, by_name: bool = False) -> Optional[str]:
    """The name of the random draw ``node`` makes, or None: a Tensor method of :data:`RANDOM_FILLS`, or an ATen
    op tagged ``nondeterministic_seeded`` (the ATen level, docs/ARCHITECTURE.md §3.0: ``exponential_`` is the
    functional ``aten.exponential`` there, named by the in-place method the model called when there is one).

    ``by_name=True`` also names any call whose short name contains one of :data:`RANDOM_NAME_PARTS`
    (``torch.rand``, ``x.bernoulli()``, ``F.dropout``): the conservative test of a rewrite that must not treat
    two calls as one value (a false positive costs it a missed merge, never a wrong one)."""
    if node.op == "call_method" and node.target in RANDOM_FILLS:
        return node.target
    op = node.target if node.op == "call_function" else None
    if isinstance(op, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in op.tags:
        name = op._schema.name.split("::")[-1]
        return f"{name}_ ({op})" if f"{name}_" in RANDOM_FILLS else str(op)
    if by_name and node.op in ("call_function", "call_method"):
        name = op_name(node)
        if any(part in name for part in RANDOM_NAME_PARTS):
            return name
    return None


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
