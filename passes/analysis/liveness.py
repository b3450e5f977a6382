"""Live positions: which ``[B, L]`` positions a graph's outputs read, decided per call (docs/ARCHITECTURE.md §3.8).

A position ``(b, t)`` is **live** when its packed values can reach a graph output other than through

* a multiplication by a *per-call value* that is exactly 0 there (a completion or loss mask, an attention
  mask bit, ``labels != -100``, their products),
* a ``where`` / ``masked_fill`` whose per-call condition replaces it,
* a slice or index that drops it (``logits[:, P - 1:-1]``, ``logits_to_keep``),

and **needed** when it is live or a live query attends it (:meth:`LivePlan.needed`). Positions that are not
needed leave the prefix tree (``runtime.tree.drop_positions``): they are computed by nobody.

The analysis is a backward walk over the *dense side* of the analysed graph (the values after the packed
values are read densely: the loss), from the outputs to the TOKEN values the dense side reads (the
*boundaries*). Each value gets a list of *terms* ``(expr, steps)``: in the value's frame (its row and
position dims), sliced by ``steps``, the positions where ``expr`` holds are live (``expr`` None: all of
them). A term is built from per-call values only (graph inputs that are not parameters, through ops the
dense side computes exactly), so :class:`LivePlan` evaluates it on each call's inputs before the tree is
built, with a small graph of those values (``LivePlan.values_gm``). A TOKEN value the graph returns (a
model compiled without its loss) is live where the attention mask is 1 under ``drop_padding`` (the mask is
the user's declaration of padding), else everywhere.

The contract this gives (docs/guide/live-positions.md): the outputs equal the dense run's whenever the dense
run's values at dead positions are finite (``0 · x = 0``). A multiplication that kills a position reads its operand
through ``where(m != 0, x, 0)`` in the packed graph (:func:`safe_operand`), so a dead position's
zero-filled packed value never turns into ``0 · inf``.
"""
from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from brcompile.passes.analysis.axes import example_value, get_axes, node_args, normalize_dim
from brcompile.passes.analysis.repack import packed_again
from brcompile.passes.analysis.rules.reduce import _reduced_dims
from brcompile.passes.ops import Kill, Liveness, record_for
from brcompile.passes.spellings import CHEAP_VIEWS, arg

log = logging.getLogger(__name__)

__all__ = ["LivePlan", "analyse_liveness", "safe_operand"]


def _liveness(target) -> Optional[Liveness]:
    """How a dense value computed by ``target`` keeps its operand's token dims (its op record's ``liveness``)."""
    record = record_for(target)
    return None if record is None else record.liveness


def _kill(target) -> Optional[Kill]:
    """How a per-call operand of ``target`` kills the other (its op record's ``kill``)."""
    record = record_for(target)
    return None if record is None else record.kill


Steps = tuple  # ((which, (start, stop, step)), ...): which in {"row", "pos"}; bounds ints or value refs


@dataclasses.dataclass(frozen=True)
class Frame:
    """Where a dense value's token coordinates are: its ``row`` and ``pos`` dims (None: reduced away or
    broadcast), out of ``ndim``."""

    ndim: int
    row: Optional[int]
    pos: Optional[int]


# --- expressions: evaluated per call to a bool tensor [rB, rL] (rB in {B', 1}, rL in {L', 1}) ---------------


@dataclasses.dataclass(frozen=True)
class Nonzero:
    """``value != 0`` (``zero``: ``value == 0``) of per-call value ``ref``, aligned to a frame value of
    ``frame.ndim`` dims (right-aligned broadcasting), any() over the frame's other dims."""

    ref: int
    frame: Frame
    zero: bool = False


@dataclasses.dataclass(frozen=True)
class KeyPadding:
    """The call's key padding (the attention mask's bits), sliced by ``steps`` (a TOKEN output's window)."""

    steps: Steps = ()


@dataclasses.dataclass(frozen=True)
class Restrict:
    """``expr`` restricted to the sub-frame ``steps`` (a broadcast dim of extent 1 stays as it is)."""

    expr: Any
    steps: Steps


@dataclasses.dataclass(frozen=True)
class And:
    a: Any
    b: Any


@dataclasses.dataclass(frozen=True)
class AnyAlong:
    """any() of ``expr`` along ``which`` ("row" | "pos"), kept as extent 1 (an operand broadcast there)."""

    expr: Any
    which: str


Term = tuple  # (expr or None, steps)
ALL: Term = (None, ())


def _dim(which: str) -> int:
    return 0 if which == "row" else 1


class _Refs:
    """The per-call values the terms read, numbered in order of first use."""

    def __init__(self):
        self.nodes: list[fx.Node] = []

    def ref(self, v: Any) -> Any:
        if not isinstance(v, fx.Node):
            return v
        if v not in self.nodes:
            self.nodes.append(v)
        return ("ref", self.nodes.index(v))


@dataclasses.dataclass
class LivePlan:
    """What :func:`analyse_liveness` proved: how each call's live positions follow from its inputs.

    ``boundaries``: one ``(window steps, terms)`` per dense read of a TOKEN value; ``values_gm`` computes
    the per-call values the terms refer to (``("ref", i)`` = its i-th output) from the graph's inputs;
    ``keys_hidden``: every token-mixing op of the graph is an attention that hides key-padded positions (so a
    key-padded position no live query reads is not needed; otherwise only the positions after a row's last
    live one are dropped)."""

    boundaries: list
    values_gm: fx.GraphModule
    keys_hidden: bool
    killers: list = dataclasses.field(default_factory=list)  # mul nodes that kill: (node, operand, mask)
    value_names: tuple = ()  # the analysed graph's names of the per-call values (for explain)

    def describe(self) -> str:
        """One line for explain(): what decides liveness."""
        leaves = [x for _, terms in self.boundaries for e, _ in terms for x in _leaves_of(e)]
        masks = sorted({self.value_names[x.ref] for x in leaves if isinstance(x, Nonzero)})
        kinds = [f"per-call value(s) {', '.join(masks)}"] if masks else []
        if any(isinstance(x, KeyPadding) for x in leaves):
            kinds.append("the attention mask (drop_padding: outputs are 0 at padding)")
        if any(steps for _, terms in self.boundaries for _, steps in terms):
            kinds.append("slices")
        keys = "key-padded positions hidden from every query" if self.keys_hidden else \
            "positions before a row's last live one kept"
        return f"live positions decided by {' and '.join(kinds) or 'the outputs'} ({keys})"

    def live(self, args: Sequence[Any], B: int, L: int, key_padding: Optional[torch.Tensor],
             device) -> torch.Tensor:
        """The call's ``[B, L]`` live positions: the OR over the boundaries' terms, each scattered back through
        its window and steps."""
        vals = self.values_gm(*args) if self.values_gm is not None else ()
        full = torch.zeros((B, L), dtype=torch.bool, device=device)
        for window, terms in self.boundaries:
            for expr, steps in terms:
                view = full
                for which, bounds in tuple(window) + tuple(steps):
                    view = _slice(view, which, bounds, vals)
                if expr is None:
                    view.fill_(True)
                else:
                    e = _eval(expr, vals, key_padding)
                    view.logical_or_(e.expand_as(view))
        return full

    def needed(self, live: torch.Tensor, key_padding: Optional[torch.Tensor]) -> torch.Tensor:
        """``needed[b, t] = live[b, t] or (t <= last_live[b] and (t is a visible key or keys are not hidden))``.

        Under causal attention a key at t is read only by queries at t' >= t, so nothing after a row's last
        live position is read; a visible key before it is read by that live query, and through it (every
        query before it sees a subset of its visible keys: causal, key padding, windows) every value it
        depends on is needed too — the set is closed. A key-padded position is visible to nobody when every
        attention applies the key padding (``keys_hidden``); then only its own liveness keeps it."""
        L = live.shape[1]
        cols = torch.arange(L, device=live.device)
        last = torch.where(live, cols, -1).amax(dim=1, keepdim=True)  # -1: nothing live in the row
        upto = cols[None, :] <= last
        if self.keys_hidden and key_padding is not None:
            return live | (upto & key_padding.to(torch.bool))
        return upto | live


def _leaves_of(expr: Any) -> list:
    """The leaf expressions (Nonzero, KeyPadding) of an expression."""
    if expr is None:
        return []
    if isinstance(expr, And):
        return _leaves_of(expr.a) + _leaves_of(expr.b)
    if isinstance(expr, (AnyAlong, Restrict)):
        return _leaves_of(expr.expr)
    return [expr]


def _bound(v: Any, vals) -> Any:
    if isinstance(v, tuple) and len(v) == 2 and v[0] == "ref":
        x = vals[v[1]]
        return int(x) if isinstance(x, (torch.Tensor, torch.SymInt)) else x
    return v


def _slice(t: torch.Tensor, which: str, bounds, vals) -> torch.Tensor:
    s = slice(*(_bound(b, vals) for b in bounds))
    return t[s] if which == "row" else t[:, s]


def _eval(expr: Any, vals, key_padding: Optional[torch.Tensor]) -> torch.Tensor:
    """The bool tensor ``[rB, rL]`` of an expression (see the classes above)."""
    if isinstance(expr, And):
        return _eval(expr.a, vals, key_padding) & _eval(expr.b, vals, key_padding)
    if isinstance(expr, AnyAlong):
        return _eval(expr.expr, vals, key_padding).any(dim=_dim(expr.which), keepdim=True)
    if isinstance(expr, Restrict):
        e = _eval(expr.expr, vals, key_padding)
        for which, bounds in expr.steps:
            if e.shape[_dim(which)] > 1:
                e = _slice(e, which, bounds, vals)
        return e
    if isinstance(expr, KeyPadding):
        e = key_padding.to(torch.bool)
        for which, bounds in expr.steps:
            e = _slice(e, which, bounds, vals)
        return e
    if isinstance(expr, Nonzero):
        return _nonzero(vals[expr.ref], expr.frame, expr.zero)
    raise TypeError(f"not a liveness expression: {expr!r}")


def _nonzero(v: Any, frame: Frame, zero: bool) -> torch.Tensor:
    """``(v != 0)`` (or ``== 0``) aligned right to ``frame.ndim`` dims, any() over the non-token dims, as
    ``[rB, rL]`` (extent 1 where the frame has no such dim or ``v`` broadcasts)."""
    t = torch.as_tensor(v)
    t = (t == 0) if zero else (t != 0)
    t = t.reshape((1,) * (frame.ndim - t.dim()) + tuple(t.shape))
    keep = [d for d in (frame.row, frame.pos) if d is not None]
    other = [d for d in range(frame.ndim) if d not in keep]
    if other:
        t = t.any(dim=other, keepdim=True)
    sizes = [t.shape[d] for d in keep]
    t = t.permute(*keep, *other).reshape(sizes)  # the token dims, row first
    if frame.row is None and frame.pos is None:
        return t.reshape(1, 1)
    if frame.row is None:
        return t.reshape(1, -1)
    if frame.pos is None:
        return t.reshape(-1, 1)
    return t


# --- the analysis ----------------------------------------------------------------------------------------


def _is_parameter(n: fx.Node) -> bool:
    v = example_value(n)
    return isinstance(v, torch.nn.Parameter) or (isinstance(v, torch.Tensor) and v.requires_grad)


class _Liveness:
    def __init__(self, an, drop_padding: bool):
        self.an = an
        self.drop_padding = drop_padding
        self.refs = _Refs()
        self._per_call: dict[fx.Node, bool] = {}
        self.frames: dict[fx.Node, Optional[Frame]] = {}
        self.terms: dict[fx.Node, list] = {}
        self.boundaries: dict[fx.Node, list] = {}
        self.killers: list = []

    # per-call values: computed exactly from the call's non-parameter inputs, before any packed value
    def per_call(self, n: Any) -> bool:
        if not isinstance(n, fx.Node):
            return not isinstance(n, torch.Tensor)
        if n not in self._per_call:
            self._per_call[n] = self._compute_per_call(n)
        return self._per_call[n]

    def _compute_per_call(self, n: fx.Node) -> bool:
        if n.op == "placeholder":
            return not _is_parameter(n)
        if n.op == "get_attr":
            return False
        if n.op not in ("call_function", "call_method"):
            return False
        v = example_value(n)
        if isinstance(v, torch.Tensor) and v.requires_grad:
            return False
        if get_axes(n).is_token and n.target not in CHEAP_VIEWS:  # a TOKEN value read densely is materialised
            return False
        return all(self.per_call(a) for a in node_args(n))

    def token_operand(self, a: Any) -> bool:
        """A TOKEN value the dense side reads from the packed graph (not recomputed from the inputs)."""
        return isinstance(a, fx.Node) and get_axes(a).is_token and not self.per_call(a)

    def frame_of(self, a: fx.Node) -> Optional[Frame]:
        ax = get_axes(a)
        if ax.is_token:
            if ax.flat or ax.row is None or ax.groups is not None:
                return None
            return Frame(ax.ndim, ax.row, ax.pos)
        return self.frames.get(a)

    # forward: the frames of the dense side
    def forward(self) -> None:
        for n in self.an.gm.graph.nodes:
            if n.op not in ("call_function", "call_method") or not get_axes(n).is_dense or self.per_call(n):
                continue
            ops = [a for a in node_args(n) if get_axes(a).is_token and not self.per_call(a) or a in self.frames]
            if not ops:
                continue
            self.frames[n] = self._frame(n, ops)

    def _frame(self, n: fx.Node, ops: list) -> Optional[Frame]:
        v = example_value(n)
        if not isinstance(v, torch.Tensor):
            return None
        frames = [self.frame_of(a) for a in ops]
        if any(f is None for f in frames):
            return None
        t = n.target
        kind = _liveness(t)
        if kind in (Liveness.POSITIONWISE, Liveness.ALONG_DIM):
            if kind is Liveness.ALONG_DIM:
                dim = arg(n, 1, "dim")
                src = frames[0] if ops[0] is n.args[0] else None
                if not isinstance(dim, int) or src is None or normalize_dim(dim, src.ndim) in (src.row, src.pos):
                    return None
            return _broadcast_frame(v.dim(), frames)
        if kind is Liveness.REDUCES:
            if len(ops) != 1 or ops[0] is not n.args[0]:
                return None
            src = frames[0]
            dims = _reduced_dims(n, src.ndim)
            keep = v.dim() == src.ndim
            sh = lambda d: None if d is None or d in dims else (d if keep else d - sum(1 for r in dims if r < d))  # noqa: E731
            return Frame(v.dim(), sh(src.row), sh(src.pos))
        if t is operator.getitem or t == "__getitem__":
            if len(ops) != 1 or ops[0] is not n.args[0]:
                return None
            mapped = _index_map(n.args[1], frames[0])
            return None if mapped is None else Frame(v.dim(), *mapped[0])
        if kind is Liveness.LAYOUT:
            return _layout_frame(n, frames[0], v.dim()) if len(ops) == 1 and ops[0] is n.args[0] else None
        return None

    # backward: the terms of every value, from the outputs
    def backward(self) -> None:
        out = next(n for n in self.an.gm.graph.nodes if n.op == "output")
        # a write into a graph input (a buffer: axes.input_write_destination) is an output too: all it reads is live
        written = [a for w in self.an.ctx.input_writes for a in [w, *node_args(w)]]
        for a in written:
            if self.token_operand(a):
                self._add(self.boundaries, a, [ALL])
            elif a in self.frames:
                self._add(self.terms, a, [ALL])
        for a in _leaves(out.args[0]):
            if not isinstance(a, fx.Node):
                continue
            if self.token_operand(a):
                ax = get_axes(a)
                # a model compiled without its loss (token ids in, per-token values out): the attention mask
                # declares the padding. A per-block graph (hidden states in and out) keeps its positions, so
                # the next block can reuse its tree (runtime provenance).
                kp = self.drop_padding and self.an.keypad is not None and self.an.token_ids is not None \
                    and not ax.flat and ax.row is not None
                self._add(self.boundaries, a, [(KeyPadding(ax.window.steps), ())] if kp else [ALL])
            elif a in self.frames:
                self._add(self.terms, a, [ALL])
        for n in self.an.gm.graph.nodes:  # a value read by an op this walk does not follow: all of it is live
            # (a dense region packed again, passes/analysis/repack.py, is part of the model: what a kept token reads
            # of it lies on the token's own path, kept with it — the closure of LivePlan.needed)
            if n in self.frames and any(u.op != "output" and u not in self.frames and u.target is not packed_again
                                        for u in n.users):
                self._add(self.terms, n, [ALL])
            elif self.token_operand(n) and any(u.op != "output" and get_axes(u).is_dense and u not in self.frames
                                               for u in n.users):
                self._add(self.boundaries, n, [ALL])
        for n in reversed(list(self.an.gm.graph.nodes)):
            if n not in self.frames:
                continue
            terms = self.terms.get(n)
            if not terms:
                continue  # nothing reads it
            for a in node_args(n):
                if not (self.token_operand(a) or a in self.frames):
                    continue
                contrib = self._contribution(n, a, terms)
                self._add(self.boundaries if get_axes(a).is_token else self.terms, a, contrib)

    @staticmethod
    def _add(table: dict, n: fx.Node, terms: list) -> None:
        have = table.setdefault(n, [])
        if have == [ALL]:
            return
        if ALL in terms:
            table[n] = [ALL]
            return
        have.extend(terms)

    def _contribution(self, u: fx.Node, a: fx.Node, terms: list) -> list:
        """The terms of operand ``a`` that ``u``'s terms imply (ALL where the op is not understood)."""
        fu, fa = self.frames[u], self.frame_of(a)
        if fu is None or fa is None:
            return [ALL]
        t = u.target
        if t is operator.getitem or t == "__getitem__":
            mapped = _index_map(u.args[1], fa)
            if mapped is None:
                return [ALL]
            steps = tuple((w, tuple(self.refs.ref(b) for b in bounds)) for w, bounds in mapped[1])
            return [(e, steps + s) for e, s in terms]
        out = [self._project(e, s, fu, fa) for e, s in terms]
        kill = self._killer(u, a, fu)
        if kill is not None:
            out = [(And(e, Restrict(kill, s)) if e is not None else Restrict(kill, s), s) for e, s in out]
        return out

    @staticmethod
    def _project(e, steps, fu: Frame, fa: Frame) -> Term:
        """A term of ``u`` as one of an operand that lacks some of ``u``'s token dims (broadcast there)."""
        for which, du, da in (("row", fu.row, fa.row), ("pos", fu.pos, fa.pos)):
            if du is not None and da is None:
                e = None if e is None else AnyAlong(e, which)
                steps = tuple(st for st in steps if st[0] != which)
        return (e, steps)

    def _killer(self, u: fx.Node, a: fx.Node, fu: Frame) -> Optional[Nonzero]:
        """The per-call value that zeroes or replaces ``a``'s contribution to ``u``, as a Nonzero expression."""
        kill = _kill(u.target)
        args = list(u.args)
        if kill is Kill.PRODUCT and len(args) == 2 and a in args:
            other = args[1] if args[0] is a else args[0]
            if isinstance(other, fx.Node) and self.per_call(other) and other is not a:
                self.killers.append((u, a, other))
                return Nonzero(self.refs.ref(other)[1], fu)
        if kill is Kill.SELECT and len(args) == 3 and isinstance(args[0], fx.Node) and self.per_call(args[0]):
            if args[1] is a and args[2] is not a:
                return Nonzero(self.refs.ref(args[0])[1], fu)
            if args[2] is a and args[1] is not a:
                return Nonzero(self.refs.ref(args[0])[1], fu, zero=True)
        if kill is Kill.FILL and len(args) == 3 and args[0] is a and isinstance(args[1], fx.Node) \
                and self.per_call(args[1]):
            return Nonzero(self.refs.ref(args[1])[1], fu, zero=True)
        return None

    def plan(self) -> Optional[LivePlan]:
        if not self.boundaries or any(terms == [ALL] for terms in self.boundaries.values()):
            return None
        bounds = [(tuple((w, tuple(self.refs.ref(b) for b in bnds)) for w, bnds in get_axes(x).window.steps),
                   terms) for x, terms in self.boundaries.items()]
        if any(isinstance(e, KeyPadding) for _, terms in bounds for e, _ in terms) and self.an.keypad is None:
            return None
        return LivePlan(bounds, _values_graph(self.an, self.refs.nodes), _keys_hidden(self.an), self.killers,
                        tuple(n.name for n in self.refs.nodes))


def _leaves(x) -> list:
    out: list = []
    fx.node.map_aggregate(x, out.append)
    return out


def _broadcast_frame(ndim: int, frames: list) -> Optional[Frame]:
    """The frame of an elementwise result: the operands' token dims, right-aligned; they must agree."""
    row = pos = None
    for f in frames:
        shift = ndim - f.ndim
        for which, d in (("row", f.row), ("pos", f.pos)):
            if d is None:
                continue
            d += shift
            cur = row if which == "row" else pos
            if cur is not None and cur != d:
                return None
            if which == "row":
                row = d
            else:
                pos = d
    return Frame(ndim, row, pos)


def _index_map(idx: Any, f: Frame) -> Optional[tuple]:
    """Basic indexing ``x[idx]`` of a value with frame ``f``: ((row', pos') of the result, the token-dim steps)
    or None (tensor indices, anything else). An int index of a token dim is a one-long step, the dim gone."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    if any(i is Ellipsis for i in idx):
        k = idx.index(Ellipsis)
        fill = f.ndim - sum(1 for i in idx if i is not None and i is not Ellipsis)
        idx = idx[:k] + (slice(None),) * fill + idx[k + 1:]
    src = 0
    dst = 0
    row = pos = None
    steps = []
    for i in idx:
        if i is None:
            dst += 1
            continue
        which = "row" if src == f.row else "pos" if src == f.pos else None
        if isinstance(i, slice):
            if which is not None:
                if (i.start, i.stop, i.step) != (None, None, None):
                    steps.append((which, (i.start, i.stop, i.step)))
                row, pos = (dst, pos) if which == "row" else (row, dst)
            src += 1
            dst += 1
        elif isinstance(i, int) or (isinstance(i, fx.Node) and not isinstance(example_value(i), torch.Tensor)):
            if which is not None:
                stop = None if isinstance(i, int) and i == -1 else (i + 1 if isinstance(i, int) else None)
                if stop is None and not (isinstance(i, int) and i == -1):
                    return None  # a symbolic int index: its one-long slice is not spelt here
                steps.append((which, (i, stop, None)))
            src += 1
        else:
            return None
    for d in range(src, f.ndim):  # trailing dims not indexed
        if d == f.row:
            row = dst
        if d == f.pos:
            pos = dst
        dst += 1
    return (row, pos), tuple(steps)


def _layout_frame(n: fx.Node, f: Frame, ndim: int) -> Optional[Frame]:
    """transpose / permute / unsqueeze / squeeze: where the token dims go."""
    name = n.target if isinstance(n.target, str) else n.target.__name__
    args = list(n.args[1:])
    if name == "t":
        args = [0, 1] if f.ndim == 2 else [0, 0]
        name = "transpose"
    if name in ("transpose", "swapaxes", "swapdims"):
        if len(args) != 2 or not all(isinstance(d, int) for d in args):
            return None
        d0, d1 = (normalize_dim(d, f.ndim) for d in args)
        sw = lambda d: None if d is None else d1 if d == d0 else d0 if d == d1 else d  # noqa: E731
        return Frame(ndim, sw(f.row), sw(f.pos))
    if name == "permute":
        perm = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
        if not all(isinstance(d, int) for d in perm):
            return None
        perm = [normalize_dim(d, f.ndim) for d in perm]
        mv = lambda d: None if d is None else perm.index(d)  # noqa: E731
        return Frame(ndim, mv(f.row), mv(f.pos))
    if name == "unsqueeze":
        if len(args) != 1 or not isinstance(args[0], int):
            return None
        d = normalize_dim(args[0], ndim)
        up = lambda x: None if x is None else x + (1 if x >= d else 0)  # noqa: E731
        return Frame(ndim, up(f.row), up(f.pos))
    if name == "squeeze":
        if len(args) != 1 or not isinstance(args[0], int):
            return None
        d = normalize_dim(args[0], f.ndim)
        if d in (f.row, f.pos) or ndim == f.ndim:
            return None if ndim != f.ndim else f
        down = lambda x: None if x is None else x - (1 if x > d else 0)  # noqa: E731
        return Frame(ndim, down(f.row), down(f.pos))
    return None


def _keys_hidden(an) -> bool:
    """Every token-mixing op is an attention that applies the key padding (no scan, no conv, no attention
    without it): a key-padded position is then read by nobody."""
    from brcompile.passes.analysis.rules import scan as scan_rules

    if an.keypad is None or not an.attentions:
        return False
    if any(info.keypad is None for info in an.masks.values()) or len(an.masks) != len(an.attentions):
        return False
    return not scan_rules.scan_candidates(an.gm)


def _values_graph(an, nodes: list[fx.Node]) -> Optional[fx.GraphModule]:
    """A graph over the analysed graph's inputs that returns ``nodes`` (per-call values: their ancestors are
    non-parameter inputs and exact dense ops)."""
    if not nodes:
        return None
    g = fx.Graph()
    env: dict[fx.Node, Any] = {}
    need: set = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n in need:
            continue
        need.add(n)
        stack.extend(node_args(n))
    for n in an.gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = g.placeholder(n.name)
            env[n].meta.update(n.meta)
        elif n in need:
            env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[n] for n in nodes))
    gm = fx.GraphModule(an.gm, g, class_name="LiveValues")
    return gm


def analyse_liveness(an, *, drop_padding: bool) -> Optional[LivePlan]:
    """The live-position plan of an analysed graph (``passes.pack.Analysis``), or None when every position
    may be live (no term narrows any boundary, or a boundary is not understood): the tree keeps them all.

    ``drop_padding``: a TOKEN value the graph returns is live only where the attention mask is 1."""
    if an.sequences is not None or an.ctx.rows:
        return None  # packed sequences, [T, ...] rows: positions are not the tree's (b, t) here
    lv = _Liveness(an, drop_padding)
    lv.forward()
    lv.backward()
    plan = lv.plan()
    if plan is not None:
        log.debug("liveness: %d boundaries, %d per-call values, keys hidden: %s", len(plan.boundaries),
                  len(lv.refs.nodes), plan.keys_hidden)
    return plan


def safe_operand(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``where(m != 0, x, 0)``: a killing multiplication's operand as the packed graph reads it. Equal to ``x``
    wherever ``m != 0``; where ``m == 0`` the product is 0 either way, and a dead position's zero-filled value
    (through ops such as ``log``) can no longer make it ``0 * inf``. Gradient: ``g`` where ``m != 0``, else 0,
    as the dense run's ``g * m`` there."""
    return torch.where(m != 0, x, x.new_zeros(()))
