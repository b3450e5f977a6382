"""Token-axis facts and their propagation over a Dynamo FX graph.

Every value of the captured graph gets one :class:`TokenAxes` fact in ``node.meta["br_axes"]``:

* ``CONST``  — independent of the batch's per-token data (parameters, buffers, scalars, sizes).
* ``TOKEN``  — a *causal, row-independent* function of the tree inputs: the dense value at row ``b``,
  position ``t`` depends only on the tree inputs of row ``b`` at positions ``<= t``. Such a value is
  stored packed: the dense dims ``row`` and ``pos`` collapse to sizes 1 and N (one entry per tree node),
  and ``dense[b, t] == packed[index[b, t]]``. ``row`` may be ``None`` for position-only values (an
  ``arange(L)``, rotary tables). ``window`` records slicing of the token dims that is applied lazily, to
  the ``[B, L]`` index rather than to the data (the next-token shift ``logits[:, :-1]``).
* ``DENSE``  — everything else (the loss side): computed exactly as in the original graph; a ``TOKEN``
  operand of a dense op is *materialised* first (``packed[index]``).

The invariant every rule preserves: a TOKEN value's packed entry k equals its dense value at every
``(b, t)`` with ``index[b, t] == k``. Rules live in :mod:`brcompile.passes.analysis.rules`, one documented function
per op family, registered by target; an op that receives a TOKEN operand and has no rule is
materialised (exact, but it ends sharing), and if that leaves an attention un-packed the rewrite stops
with :class:`CannotReplay` naming the node.
"""
from __future__ import annotations

import dataclasses
import enum
import inspect
import logging
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.fx as fx

from brcompile.passes.meta import AXES, example_value
from brcompile.passes.ops import RuleCollision, record_for
from brcompile.passes.spellings import INPLACE_OPERATORS, random_draw, target_name
from brcompile.passes.refusals import CannotReplay, Code

log = logging.getLogger(__name__)

#: the type of a note (:meth:`AxesContext.note`)
NoteT = TypeVar("NoteT")


class Kind(enum.Enum):
    CONST = "const"
    TOKEN = "token"
    DENSE = "dense"


@dataclasses.dataclass(frozen=True)
class Window:
    """Lazy slicing of the dense token dims, applied to the ``[B, L]`` index instead of the packed data.

    ``steps`` is the sequence of ``("row" | "pos", (start, stop, step))`` slices applied in order; slice bounds are ints or
    FX nodes (symbolic sizes), so one window serves every batch size. ``Window()`` is the whole batch.
    """

    steps: tuple = ()

    @staticmethod
    def full() -> "Window":
        """The whole batch (no slicing), whatever its size."""
        return Window(())

    def sliced(self, which: str, s: slice) -> "Window":
        return Window(self.steps + ((which, (s.start, s.stop, s.step)),))

    @property
    def is_whole(self) -> bool:
        return not self.steps


@dataclasses.dataclass(frozen=True)
class TokenAxes:
    """The token fact of one value (see the module docstring)."""

    kind: Kind
    ndim: int = 0
    row: Optional[int] = None
    pos: Optional[int] = None
    window: Optional[Window] = None
    # -- token-local regions (passes/analysis/rules/moe.py); all unset for an ordinary TOKEN value --
    #: k >= 1: ``pos`` is the *flattened* token dim (``row`` None): dense extent B·L·k, entry (b·L + t)·k + s,
    #: packed extent N·k, entry n·k + s (k entries per token, e.g. its top-k expert slots)
    flat: int = 0
    #: the flat entries are listed in the order of this sort (its ``perm``) instead of their natural order
    order: Optional[Any] = None
    #: an integer index: entry e holds the place of e's own entry (or its token, factor f) in the flat space
    #: (f, order) it points into: ``(f, order)``
    points: Optional[tuple] = None
    #: per-group counts or offsets (no token dim) of the keys sorted by a sort: ``("counts" | "offsets", sort)``
    groups: Optional[tuple] = None

    def __post_init__(self):
        if self.kind is Kind.TOKEN and self.groups is not None:
            return
        if self.kind is Kind.TOKEN:
            if self.pos is None:
                raise ValueError("a TOKEN value needs a position dim")
            if self.flat and self.row is not None:
                raise ValueError("a flattened TOKEN value has no row dim")
            dims = [d for d in (self.row, self.pos) if d is not None]
            if any(not 0 <= d < self.ndim for d in dims) or len(set(dims)) != len(dims):
                raise ValueError(f"bad token dims row={self.row} pos={self.pos} for ndim={self.ndim}")
            if self.window is None:
                raise ValueError("a TOKEN value needs a window")
        elif self.row is not None or self.pos is not None:
            raise ValueError(f"{self.kind} value cannot have token dims")

    @property
    def is_token(self) -> bool:
        return self.kind is Kind.TOKEN

    @property
    def is_dense(self) -> bool:
        return self.kind is Kind.DENSE

    @property
    def is_const(self) -> bool:
        return self.kind is Kind.CONST

    def token_dims(self) -> tuple[int, ...]:
        return tuple(d for d in (self.row, self.pos) if d is not None)

    @property
    def local(self) -> bool:
        """A value of a token-local region (flattened tokens, a sort order, an index, group offsets)."""
        return bool(self.flat) or self.order is not None or self.points is not None or self.groups is not None

    @property
    def region(self) -> bool:
        """A region value other than a flattened value in its natural order (only region rules read it)."""
        return self.order is not None or self.points is not None or self.groups is not None

    def __str__(self) -> str:
        if self.kind is not Kind.TOKEN:
            return self.kind.value
        if self.groups is not None:
            return f"token({self.groups[0]} of {getattr(self.groups[1], 'name', self.groups[1])})"
        extra = "" if not self.flat else f", flat={self.flat}"
        if self.order is not None:
            extra += f", order={self.order.name}"
        if self.points is not None:  # any arity: (f, order) of an index, or a sort result's own tag
            extra += ", points=(" + ", ".join(str(getattr(p, "name", p)) for p in self.points) + ")"
        return f"token(row={self.row}, pos={self.pos}{extra})"


CONST = TokenAxes(Kind.CONST)
DENSE = TokenAxes(Kind.DENSE)


def token(ndim: int, row: Optional[int], pos: int, window: Window, **region) -> TokenAxes:
    return TokenAxes(Kind.TOKEN, ndim, row, pos, window, **region)


def get_axes(node: Any) -> TokenAxes:
    """The fact of an FX argument; non-node arguments (ints, dtypes …) are CONST."""
    if isinstance(node, fx.Node):
        return AXES.require(node)
    return CONST


def set_axes(node: fx.Node, axes: TokenAxes) -> None:
    AXES.set(node, axes)


# --------------------------------------------------------------------------------------------------
# values and sizes from node metadata


def hint(x: Any) -> Any:
    """A concrete int for an int or SymInt (its example hint), recursively for sequences."""
    if isinstance(x, torch.SymInt):
        return x.node.hint if x.node.has_hint() else int(x)
    if isinstance(x, (list, tuple, torch.Size)):
        return type(x)(hint(v) for v in x) if not isinstance(x, torch.Size) else tuple(hint(v) for v in x)
    return x


def shape_of(node: Any) -> Optional[tuple[int, ...]]:
    v = example_value(node)
    if isinstance(v, torch.Tensor):
        return tuple(hint(s) for s in v.shape)
    return None


# --------------------------------------------------------------------------------------------------
# the rule registry


class Local(enum.Enum):
    """What a rule knows of token-local regions (passes/analysis/rules/moe.py): operands of flattened tokens
    (``TokenAxes.flat``), maybe in the batch's sort order (``order``), and a region's indices and group offsets
    (``points``, ``groups``). :func:`propagate` reads it before the rule runs."""

    #: nothing: a flattened operand is materialised (the result is dense), any other region operand refused
    NONE = "none"
    #: a per-token op whose proof holds entry by entry: its token operands' one layout (``flat``, ``order``) is
    #: carried to its TOKEN result; operands of different layouts are refused
    CARRY = "carry"
    #: the rule takes region operands itself and sets its result's region fields (reshapes, indexing, sort, counts,
    #: grouped matmuls)
    OWN = "own"


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one op family propagates facts (``propagate``) and, optionally, how it is emitted into the
    packed graph (``emit``; default: the same op on packed operands)."""

    name: str
    propagate: Callable[["AxesContext", fx.Node], TokenAxes]
    emit: Optional[Callable] = None
    always: bool = False  # consulted whatever the operands' kinds: token sources (``arange(L)``)
    # and ops that must run packed (attention)
    #: what the rule knows of token-local regions (:class:`Local`)
    local: Local = Local.NONE


#: the token-axis rules by name; an op's record (passes/ops/) names the rule its spellings use
AXIS_RULES: dict[str, Rule] = {}


def axis_rule(*, emit: Optional[Callable] = None, always: bool = False, local: Local = Local.NONE,
              override: bool = False):
    """Decorator: register ``fn(ctx, node) -> TokenAxes`` as the token-axis rule named ``fn.__name__``; op records
    (``register_op(..., axes=name)``, passes/ops/) say which ops it covers. A name has one rule: registering a
    second raises :class:`RuleCollision` unless ``override=True`` (then the new rule replaces the old one)."""

    def deco(fn):
        rule = Rule(fn.__name__, fn, emit, always, local)
        if rule.name in AXIS_RULES and not override:
            raise RuleCollision(f"a token-axis rule named {rule.name!r} is already registered; pass override=True "
                                f"to replace it")
        if rule.name in AXIS_RULES:
            log.info("token-axis rule %r replaced", rule.name)
        AXIS_RULES[rule.name] = rule
        return fn

    return deco


def rule_for(node: fx.Node) -> Optional[Rule]:
    """The token-axis rule of ``node``: the one its op record names (found by target, else by a custom op's
    qualified name), None for an op without a record or a rule."""
    from brcompile.passes.analysis import rules as _rules  # noqa: F401  (fill AXIS_RULES)
    from brcompile.passes.emit import fuse_logprob as _fusion  # noqa: F401
    from brcompile.passes.analysis import repack as _repack  # noqa: F401

    if node.op not in ("call_function", "call_method"):
        return None
    record = record_for(node.target)
    if record is None and node.op == "call_function":
        name = getattr(node.target, "_qualified_op_name", None) or getattr(
            getattr(node.target, "_overloadpacket", None), "_qualified_op_name", None)
        if isinstance(name, str):
            record = record_for(name)
    return None if record is None or record.axes is None else AXIS_RULES[record.axes]


# --------------------------------------------------------------------------------------------------
# context and driver


@dataclasses.dataclass
class Materialisation:
    """A TOKEN value turned dense (``packed[index]``) because ``user`` needs it dense."""

    node: fx.Node
    user: fx.Node
    numel: int
    reason: str


@dataclasses.dataclass
class AxesContext:
    """What the rules see: the graph, the token dims (B, L), the tree inputs and mask-only nodes."""

    gm: fx.GraphModule
    B: int
    L: int
    tree_inputs: list[fx.Node]
    mask_nodes: set[fx.Node]
    training: bool = True
    materialised: dict[fx.Node, Materialisation] = dataclasses.field(default_factory=dict)
    #: node -> its note (:meth:`set_note`); read through :meth:`note`, :meth:`noted`, :meth:`has_note` only
    _notes: dict[fx.Node, Any] = dataclasses.field(default_factory=dict, init=False, repr=False)
    #: in-place writes into graph inputs (``input_write_destination``): write node -> the input it writes
    input_writes: dict[fx.Node, fx.Node] = dataclasses.field(default_factory=dict)
    # inputs shared by every row, [L, ...] or [1, L, ...]: placeholder -> its position dim (no tree key)
    position_inputs: dict[fx.Node, int] = dataclasses.field(default_factory=dict)
    # placeholder -> example value (for probes); a graph over packed sequences (passes/analysis/repack.py)
    values: dict[fx.Node, Any] = dataclasses.field(default_factory=dict)
    sequences: bool = False
    # dense values packed again (passes/analysis/repack.py): dense node -> its repack node; refusals; reports
    repacked_nodes: dict[fx.Node, fx.Node] = dataclasses.field(default_factory=dict)
    repack_refused: dict[fx.Node, str] = dataclasses.field(default_factory=dict)
    repacked: list = dataclasses.field(default_factory=list)
    # per-call guards a rule relied on (passes/analysis/guards.py), checked with the analysis's other guards
    guards: list = dataclasses.field(default_factory=list)
    #: the tree inputs are [T, ...] rows (a token-local graph over flattened tokens): B = T, L = 1, each row one
    #: token; their fact is the flattened layout (``flat=1``, position dim 0)
    rows: bool = False
    #: inputs of a token-local graph that are the same tensor for every row (``pack._call_constants``): CONST
    call_constants: set = dataclasses.field(default_factory=set)

    def axes(self, arg: Any) -> TokenAxes:
        return get_axes(arg)

    def full_window(self) -> Window:
        return Window.full()

    def shape(self, node: Any) -> Optional[tuple[int, ...]]:
        return shape_of(node)

    def first_materialisation(self) -> Optional[str]:
        m = next(iter(self.materialised.values()), None)
        if m is None:
            return None
        refused = next(iter(self.repack_refused.items()), None)  # passes/analysis/repack.py
        again = "" if refused is None else f"; {refused[0].name} is not packed again: {refused[1]}"
        return f"{m.node.name} was made dense by {m.user.name} ({m.reason}){again}"

    # --- notes: what a rule proved about one node, for its emitter and later stages ---------------
    def set_note(self, node: fx.Node, note: Any) -> None:
        """Note ``note`` on ``node``: a small frozen record whose type says what was proved (a
        ``rules.attention.LazyGather``, a ``rules.scan.CausalPad``, the attention's ``masks.MaskInfo`` …; each
        type's docstring names its writer and readers). A node has one note: a later one replaces it (a
        per-token SDPA's replaces its mask meaning)."""
        self._notes[node] = note

    def note(self, node: fx.Node, kind: type[NoteT]) -> Optional[NoteT]:
        """``node``'s note when it is a ``kind``, else None (no note, or one of another kind)."""
        note = self._notes.get(node)
        return note if isinstance(note, kind) else None

    def noted(self, kind: type[NoteT]) -> dict[fx.Node, NoteT]:
        """Every node with a ``kind`` note -> that note, in the order the nodes were first noted."""
        return {n: v for n, v in self._notes.items() if isinstance(v, kind)}

    def has_note(self, node: fx.Node) -> bool:
        """Whether some rule noted anything on ``node``, whatever its kind: the emitter then emits ``node`` by its
        rule even where it is dense, and never replaces it (a killing multiplication's safe operand, a
        window's dense recomputation, a fused read-out's entropy users)."""
        return node in self._notes

    def fail(self, code: Code, node: fx.Node, reason: str):
        """Refuse the graph at ``node``: CannotReplay with ``code`` (the rule broken) and ``reason``."""
        raise CannotReplay(code, reason, node)

    def materialise(self, arg: fx.Node, user: fx.Node, reason: str) -> None:
        """Record that TOKEN ``arg`` is used densely by ``user`` (it will be gathered to [B, L, …])."""
        ax = get_axes(arg)
        if ax.region:
            raise CannotReplay(Code.TOKEN_LOCAL_REGION,
                f"{arg.name} ({ax}) is a value of a token-local region in the batch's sort order, an index or "
                f"group offsets; {user.name} would need its dense value ({reason})", user)
        if arg not in self.materialised:
            shape = shape_of(arg) or ()
            numel = 1
            for s in shape:
                numel *= s
            self.materialised[arg] = Materialisation(arg, user, numel, reason)


def flat_args(node: fx.Node) -> list[Any]:
    out: list[Any] = []
    fx.node.map_aggregate((node.args, node.kwargs), out.append)
    return out


def node_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in flat_args(node) if isinstance(a, fx.Node)]


def dense_fallback(ctx: AxesContext, node: fx.Node, reason: str) -> TokenAxes:
    """The generic rule for an op whose result cannot stay packed: materialise its TOKEN operands."""
    for a in node_args(node):
        if get_axes(a).is_token:
            ctx.materialise(a, node, reason)
    return DENSE


def _register_state_changes() -> None:
    """functorch's level changes (``torch.vmap`` / ``jvp`` traced inline, as Dynamo records
    ``associative_scan``'s reference implementation) have no users but change how the ops between them
    run: dead-code elimination (FX's and the canonicaliser's, passes/canonical/attention/) must keep them."""
    from torch._functorch import predispatch

    for name in ("_vmap_increment_nesting", "_vmap_decrement_nesting", "_jvp_increment_nesting",
                 "_jvp_decrement_nesting", "_enter_dual_level", "_exit_dual_level", "lazy_load_decompositions"):
        fn = getattr(predispatch, name, None)
        if fn is not None:
            torch.fx.node.has_side_effect(fn)


_register_state_changes()


def _inplace_argument(node: fx.Node) -> bool:
    """An ``inplace`` parameter set to True, by keyword or by position (``F.relu(x, True)``,
    ``F.dropout(x, p, training, True)``): Dynamo keeps such calls as calls of the functional op."""
    if node.kwargs.get("inplace") is True:
        return True
    try:
        bound = inspect.signature(node.target).bind_partial(*node.args, **node.kwargs)
    except (TypeError, ValueError):  # builtins without a signature, arguments that do not bind
        return False
    return bound.arguments.get("inplace") is True


def is_inplace(node: fx.Node) -> bool:
    """Whether ``node`` may write into one of its arguments: a ``Tensor.op_`` method, an in-place
    operator or ``setitem``, ``out=``, an ``inplace=True`` argument, a mutable op schema."""
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__") and node.target not in (
            "requires_grad_",)
    if node.op != "call_function":
        return False
    if node.target in INPLACE_OPERATORS or "out" in node.kwargs:
        return True
    if getattr(node.target, "__module__", None) in ("_operator", "operator"):
        return False  # operator.and_/or_/xor/not_ are named with a trailing "_" but are pure
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return True
    name = getattr(node.target, "__name__", "")
    if name.endswith("_") and not name.startswith("_") and not name.endswith("__"):
        return True
    return callable(node.target) and _inplace_argument(node)


def input_write_destination(ctx: AxesContext, node: fx.Node, tainted: set) -> Optional[fx.Node]:
    """The graph input that in-place ``node`` writes values computed from the tokens into, when that write is
    exact in the packed graph: a placeholder that is no token value and needs no gradient (a buffer: a MoE's
    load counter, torchtitan's ``tokens_per_expert.add_(counts)``), written by a ``Tensor.op_`` method or an
    in-place operator as its only use, the result unused. The packed graph then makes the same write with
    its token operands materialised (their dense values, ``dense_fallback``), at the same point; the runtime
    snapshots the input around a verification or a failed run (runtime/packed.py). None when ``node`` writes
    into no such input (the caller refuses the in-place op); a write into another graph input is refused here,
    naming it."""
    dest = node.args[0] if node.args else None
    if not isinstance(dest, fx.Node) or dest.op != "placeholder" or dest in tainted:
        return None
    v = example_value(dest)
    if (node.op != "call_method" and node.target not in INPLACE_OPERATORS) or dest in ctx.tree_inputs \
            or not isinstance(v, torch.Tensor) or v.requires_grad or not get_axes(dest).is_const \
            or len(dest.users) != 1 or node.users or "out" in node.kwargs:
        ctx.fail(Code.INPUT_WRITE,
                 node, f"in-place write of values computed from the tokens into the graph input {dest.name}: "
                       f"only a buffer without gradient that the graph writes once and never reads (a load "
                       f"counter) is supported")
    return dest


def propagate(ctx: AxesContext) -> None:
    """Give every node of ``ctx.gm`` its fact (topological order), raising CannotReplay where a
    TOKEN value would be handled in a way no rule proves exact."""
    from brcompile.passes.analysis import repack

    tainted: set[fx.Node] = set()  # nodes with a TOKEN ancestor (mutating them is refused)
    for node in ctx.gm.graph.nodes:
        if node.op == "output":
            continue
        if node in ctx.mask_nodes:
            set_axes(node, CONST)
            continue
        args = node_args(node)
        if any(a in tainted or get_axes(a).is_token for a in args):
            tainted.add(node)
            draw = random_draw(node)
            if draw is not None:
                ctx.fail(Code.RANDOM_DRAW,
                         node, f"random draw {draw} over token values: every copy of a shared token draws "
                               f"its own numbers (training-mode sampling, e.g. the Gumbel noise of a router)")
            if is_inplace(node):
                dest = input_write_destination(ctx, node, tainted)
                if dest is None:
                    ctx.fail(Code.INPLACE_TOKEN_VALUE, node, "in-place op on a value derived from the token inputs")
                set_axes(node, dense_fallback(ctx, node, f"written in place into the graph input {dest.name}"))
                ctx.input_writes[node] = dest
                continue
        if node.op == "placeholder":
            set_axes(node, _placeholder_axes(ctx, node))
            continue
        if node.op == "get_attr":
            set_axes(node, CONST)
            continue
        if repack.repack_operands(ctx, node):  # dense causal operands packed again
            args = node_args(node)
        facts = [get_axes(a) for a in args]
        rule = rule_for(node)
        local = [f for f in facts if f.is_token and f.local]
        if any(f.points is not None or f.groups is not None for f in local) and (
                rule is None or rule.local is not Local.OWN):
            from brcompile.passes.analysis.rules import moe as _moe
            set_axes(node, _moe.region_op(ctx, node))  # an index or group offsets: the region's own ops only
            continue
        if local and (rule is None or rule.local is Local.NONE):
            if any(f.region for f in local):
                ctx.fail(Code.TOKEN_LOCAL_REGION,
                         node, f"a value of a token-local region ({next(f for f in local if f.region)}) is used "
                               f"by {_target_name(node)}, which no token-local rule covers")
            set_axes(node, dense_fallback(ctx, node, f"{_target_name(node)} of flattened tokens"))
            continue
        if local and rule.local is Local.CARRY:
            if len({(f.flat, f.order) for f in facts if f.is_token}) != 1:
                ctx.fail(Code.TOKEN_LOCAL_REGION,
                         node, f"{_target_name(node)} mixes values of different token-local layouts "
                               f"({', '.join(sorted({str(f) for f in facts if f.is_token}))})")
        if rule is not None:
            if rule.always or any(f.is_token for f in facts):
                ax = rule.propagate(ctx, node)
            elif any(f.is_dense for f in facts):
                ax = DENSE
            else:
                ax = CONST
            if local and rule.local is Local.CARRY and ax.is_token and not ax.local:
                ax = dataclasses.replace(ax, flat=local[0].flat, order=local[0].order)
        elif any(f.is_token for f in facts):
            ax = dense_fallback(ctx, node, f"no token-axis rule for {_target_name(node)}")
        elif any(f.is_dense for f in facts):
            ax = DENSE
        else:
            ax = CONST
        set_axes(node, ax)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("axes %-28s %s", node.name, ax)
    out = next(n for n in ctx.gm.graph.nodes if n.op == "output")
    set_axes(out, DENSE)
    for a in node_args(out):
        if get_axes(a).is_token:
            ctx.materialise(a, out, "graph output")


def _placeholder_axes(ctx: AxesContext, node: fx.Node) -> TokenAxes:
    if node in ctx.tree_inputs and ctx.rows:  # [T, ...] = [B·L, ...] with L = 1: the flattened tokens
        return token(example_value(node).dim(), None, 0, ctx.full_window(), flat=1)
    if node in ctx.tree_inputs:  # [B, L, ...]: row 0, position 1 (trailing dims: features)
        return token(max(example_value(node).dim(), 2) if isinstance(example_value(node), torch.Tensor) else 2,
                     0, 1, ctx.full_window())
    if node in ctx.position_inputs:  # [L, ...] or [1, L, ...]: the same in every row
        return token(example_value(node).dim(), None, ctx.position_inputs[node], ctx.full_window())
    v = example_value(node)
    if isinstance(v, torch.Tensor) and not is_static_input(node) and v.dim() >= 1 \
            and node not in ctx.call_constants:
        return DENSE
    return CONST


def is_static_input(node: fx.Node) -> bool:
    """A parameter or buffer lifted to a graph input (Dynamo marks them static; their values do not
    depend on the batch)."""
    if isinstance(example_value(node), torch.nn.Parameter):
        return True
    if "_dynamo_static_input_type" in (node.meta.get("tensor_dict") or {}):
        return True
    src = getattr(node.meta.get("grapharg"), "source", None)
    s = str(src) if src is not None else ""
    return "_parameters" in s or "_buffers" in s or "ParamBuffer" in s


_target_name = target_name  # (re-exported name used by the rules' messages)


def normalize_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


__all__ = [
    "Kind", "Window", "TokenAxes", "CONST", "DENSE", "token", "get_axes", "set_axes",
    "axis_rule", "RuleCollision", "rule_for", "AXIS_RULES", "AxesContext", "propagate", "shape_of", "example_value",
    "hint", "normalize_dim", "node_args", "flat_args", "dense_fallback", "Materialisation",
]
