"""The packed rewrite: dense [B, L, …] graph -> packed [1, N, …] graph (docs/ARCHITECTURE.md §3), the
pipeline's emit stage (passes/pipeline.py).

:func:`build_packed_graph` emits a new graph that takes the original inputs plus the tree arrays
(``runtime.tree.TreeArgs``, placeholders ``tree_<name>``) and computes TOKEN values once per tree node, DENSE
values as before; a TOKEN value needed dense is materialised as ``packed[index]`` (:func:`materialize`) or, for
values derived from the inputs by cheap ops only, recomputed from the dense inputs. Transactional: the
analysed graph is read, never modified."""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from brcompile.passes.lower import checkpoint as checkpoints
from brcompile.passes.analysis.axes import (
    NoteT, Window, example_value, get_axes, hint, node_args, rule_for, shape_of,
)
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.passes.analysis.liveness import safe_operand
from brcompile.passes.meta import AXES, ROWS, SEQUENCES, TOKEN_OUTPUTS, WRITTEN_INPUTS, has_origin, record_origin
from brcompile.passes.spellings import CHEAP_VIEWS
from brcompile.runtime.tree import GRAPH_ARGS
from brcompile.backends.read_packed.op import read_packed
from brcompile.passes.analysis.tree_inputs import Analysis


#: A TOKEN value read through a window covering at most this fraction of the B·L positions is computed
#: densely from its inputs' dense values when they share the window (Packer._sinks_window).
WINDOW_SINK_FRACTION = 0.5


@dataclasses.dataclass
class PackOptions:
    attention: str = "auto"
    fuse_logprob: bool = True  # LM head -> log_softmax -> gather/cross_entropy as brcompile::packed_logprob
    drop_padding: bool = False  # the index may hold -1 (positions left out of the tree): reads check it
    #: with drop_padding: positions may be left out before a kept one of the same row (key-padded ones); False
    #: when only positions after a row's last needed one are (every kept token's row prefix is kept)
    drops_within_rows: bool = True
    scan: str = "auto"  # the impl of brcompile::tree_linear_scan (backends/scan/op.py: SCAN_IMPLS)


def materialize(data: torch.Tensor, index: torch.Tensor, row: Optional[int], pos: int, dropped: bool = False,
                flat: int = 0) -> torch.Tensor:
    """Dense value of a packed one: ``dense[.., b, .., t, ..] = data[.., 0, .., index[b, t], ..]``, and 0
    where ``index[b, t] == -1`` (a padded position that ``drop_padding=True`` left out of the tree). A
    position-only value (``row`` None, dense ``[.., L', ..]`` or ``[.., 1, .., L', ..]``: the original's
    shape, row-free) reads ``data[.., column_index(index)[t], ..]``.

    ``data`` has extent 1 at ``row`` and N at ``pos``; ``index`` is the (windowed) [B', L'] index.
    Its backward is a scatter-add: a packed token used by several (b, t) sums their gradients; a nonzero
    gradient at a dropped position raises brcompile.runtime.tree.DroppedPositionGradError (the loss read padding).

    ``dropped`` (option drop_padding): the index may hold -1, read through brcompile::read_packed (opaque to
    Inductor, so the backward check runs compiled); otherwise a plain gather Inductor can fuse.
    """
    if flat:  # a flattened value: [.., N·k, ..] -> [.., B·L·k, ..] (entry (b·L + t)·k + s = packed n·k + s)
        x = data.movedim(pos, 0).unflatten(0, (-1, flat))  # [N, k, ...]
        x = read_packed(x, index) if dropped else x[index]  # [B, L, k, ...]
        return x.flatten(0, 2).movedim(0, pos)
    if row is None:  # a position-only value: [.., N, ..] -> [.., L', ..], the original's shape
        x = data.movedim(pos, 0)  # [N, ...]
        col = column_index(index)
        x = read_packed(x, col) if dropped else x[col]  # [L', ...]
        return x.movedim(0, pos)
    x = data.movedim((row, pos), (0, 1))[0]  # [N, ...]
    x = read_packed(x, index) if dropped else x[index]  # [B', L', ...]
    return x.movedim((0, 1), (row, pos))


def column_index(index: torch.Tensor) -> torch.Tensor:
    """[B', L'] index -> [L']: for each column t the packed entry of some row's (b, t) that the tree kept.

    A position-only value's dense value at t is the same in every row (it has no row dim), and by the
    invariant its packed entry k equals it at every (b, t) with ``index[b, t] == k``: any kept entry of
    column t holds it. ``index.amax(0)`` is such an entry, or -1 only where every row's (b, t) was dropped
    (drop_padding) — then nothing defines it and it reads as a dropped position (0, gradient checked).
    The gradient of ``dense[t]`` lands on that one entry: the entries of column t are the same function of
    the position (same Jacobian), so the parameters' gradients are the dense ones."""
    return index.amax(0)


class Packer:
    """Builds the packed graph from an :class:`Analysis` (see module docstring)."""

    def __init__(self, an: Analysis, options: PackOptions):
        self.an = an
        self.options = options
        self.graph = fx.Graph()
        self.env: dict[fx.Node, Any] = {}  # CONST/DENSE value, or packed data for TOKEN
        self._dense: dict[fx.Node, Any] = {}
        self._index: dict[Window, fx.Node] = {}
        self._tree: dict[str, fx.Node] = {}
        self._N: Optional[fx.Node] = None

    # --- helpers used by rule emitters -----------------------------------------------------------
    def note(self, node: fx.Node, kind: type[NoteT]) -> Optional[NoteT]:
        """The rules' note of kind ``kind`` on ``node`` (``AxesContext.note``), None without one."""
        return self.an.ctx.note(node, kind)

    def has_note(self, node: fx.Node) -> bool:
        """Whether a rule noted anything on ``node`` (``AxesContext.has_note``)."""
        return self.an.ctx.has_note(node)

    def tree(self, name: str) -> fx.Node:
        return self._tree[name]

    def N(self) -> fx.Node:
        if self._N is None:
            self._N = self.graph.call_method("size", (self._tree["position"], 0))
        return self._N

    def index(self, window: Window) -> fx.Node:
        """The [B', L'] index of a window: the tree index with the window's slices applied."""
        if window not in self._index:
            idx = self._tree["index"]
            for which, s in window.steps:
                s = slice(*(self._map_scalar(v) for v in s))
                key = (slice(None), s) if which == "pos" else (s,)
                idx = self.graph.call_function(operator.getitem, (idx, key))
            self._index[window] = idx
        return self._index[window]

    def _map_scalar(self, v):
        return self.value(v) if isinstance(v, fx.Node) else v

    def static_shape(self, node: fx.Node) -> list[int]:
        return list(shape_of(node))

    def static_sizes(self, node: fx.Node) -> list[int]:
        """The dense output shape as ints; refuses symbolic non-token dims (they would be baked)."""
        ax = get_axes(node)
        v = example_value(node)
        sizes = []
        for d, s in enumerate(v.shape):
            if isinstance(s, torch.SymInt) and d not in ax.token_dims() and s.node.maybe_as_int() is None:
                raise CannotReplay(Code.SYMBOLIC_SIZE, "a non-token dim of a packed value has a symbolic size", node)
            sizes.append(hint(s))
        return sizes

    def packed(self, arg: Any) -> Any:
        """An argument as the packed graph sees it inside a TOKEN computation."""
        if not isinstance(arg, fx.Node):
            return arg
        if arg in self.an.tree_inputs and arg not in self.env and self.an.ctx.rows:
            # [T, ...] rows (L = 1) -> the flattened layout [N, ...]: node k is row rep_row[k]
            self.env[arg] = self.graph.call_function(operator.getitem, (self._placeholders[arg],
                                                                        self._tree["rep_row"]))
        elif arg in self.an.tree_inputs and arg not in self.env:
            x = self._placeholders[arg]  # [B, L, ...] -> [1, N, ...]
            g = self.graph.call_function(operator.getitem, (x, (self._tree["rep_row"], self._tree["position"])))
            self.env[arg] = self.graph.call_method("unsqueeze", (g, 0))
        elif arg in self.an.ctx.position_inputs and arg not in self.env:
            x = self._placeholders[arg]  # [L, ...] -> [N, ...], or [1, L, ...] -> [1, N, ...]
            key = self._tree["position"] if self.an.ctx.position_inputs[arg] == 0 else \
                (slice(None), self._tree["position"])
            self.env[arg] = self.graph.call_function(operator.getitem, (x, key))
        return self.env[arg]

    def value(self, arg: Any) -> Any:
        return self.packed(arg) if not get_axes(arg).is_token else self.dense(arg)

    def dense(self, arg: Any) -> Any:
        """An argument's dense value: a TOKEN value is materialised (once)."""
        if not isinstance(arg, fx.Node):
            return arg
        ax = get_axes(arg)
        if not ax.is_token:
            return self.packed(arg)
        if arg not in self._dense:
            if arg.op == "placeholder":
                self._dense[arg] = self._placeholders[arg]
            elif self._input_derived(arg) or self._sinks_window(arg):
                self._dense[arg] = self._emit_copy(arg, self.dense)
            else:
                self._dense[arg] = self.graph.call_function(
                    materialize, (self.packed(arg), self.index(ax.window), ax.row, ax.pos,
                                  self.options.drop_padding, ax.flat))
        return self._dense[arg]

    def _sinks_window(self, n: fx.Node) -> bool:
        """True when ``n``'s dense value is cheaper recomputed from its inputs' dense values than gathered.

        For a value read through a small window (``logits_to_keep``: the LM head on the last C + 1 columns
        only) the packed graph would run ``n`` on all N packed tokens and then gather B'·L' rows; when every
        token input of ``n`` has the same window and that window holds at most WINDOW_SINK_FRACTION of the
        B·L positions, ``n`` runs instead on the dense inputs — the original graph's own op on the original
        dense values, so exact — and the packed ``n`` becomes dead code unless something else needs it."""
        # with positions left out (drop_padding) the inputs read 0 there, so n's dense value there is n of zeros
        # (0 for a bias-free LM head); a gradient reaching them is still checked where the inputs are read
        if n.op not in ("call_function", "call_method") or self.has_note(n):
            return False
        ax = get_axes(n)
        if ax.window is None or ax.window.is_whole:
            return False
        toks = [a for a in node_args(n) if get_axes(a).is_token]
        if not toks or any(get_axes(a).window != ax.window for a in toks):
            return False
        shape = shape_of(n)
        kept = (1 if ax.row is None else hint(shape[ax.row])) * hint(shape[ax.pos])  # row None: position-only
        return kept <= WINDOW_SINK_FRACTION * self.an.ctx.B * self.an.ctx.L

    def _input_derived(self, n: fx.Node) -> bool:
        """True when ``n`` is a cheap function of the dense inputs (recompute it rather than gather)."""
        if n.op == "placeholder":
            return True
        if n.target not in CHEAP_VIEWS:
            return False
        return all(self._input_derived(a) if get_axes(a).is_token else not get_axes(a).is_dense
                   for a in node_args(n))

    def copy(self, node: fx.Node) -> fx.Node:
        return self._emit_copy(node, self.packed)

    def _emit_copy(self, node: fx.Node, mapper) -> fx.Node:
        args, kwargs = fx.node.map_aggregate((node.args, node.kwargs),
                                             lambda a: mapper(a) if isinstance(a, fx.Node) else a)
        new = self.graph.create_node(node.op, node.target, tuple(args), dict(kwargs))
        record_origin(new, node, __name__)
        return new

    def _emit_killer(self, node: fx.Node, operand: fx.Node, mask: fx.Node) -> fx.Node:
        """A multiplication by a per-call mask that kills positions (passes/analysis/liveness.py): its operand read as
        ``where(mask != 0, x, 0)`` (liveness.safe_operand), so a left-out position's zero-filled value cannot
        make the product ``0 * inf``."""
        safe = self.graph.call_function(safe_operand, (self.dense(operand), self.dense(mask)))
        args = tuple(safe if a is operand else self.dense(a) if isinstance(a, fx.Node) else a for a in node.args)
        kwargs = {k: self.dense(v) if isinstance(v, fx.Node) else v for k, v in node.kwargs.items()}
        new = self.graph.create_node(node.op, node.target, args, kwargs)
        record_origin(new, node, __name__)
        return new

    # --- driver -------------------------------------------------------------------------------
    def build(self) -> fx.GraphModule:
        gm = self.an.gm
        plan = self.an.liveness if self.options.drop_padding else None
        self._killers = {u: (a, m) for u, a, m in (plan.killers if plan is not None else ())}
        self._placeholders: dict[fx.Node, fx.Node] = {}
        for p in self.an.placeholders:
            new = self.graph.placeholder(p.name)
            new.meta.update({k: v for k, v in p.meta.items() if k != AXES.key})
            self._placeholders[p] = new
            if not get_axes(p).is_token:
                self.env[p] = new
        for name in GRAPH_ARGS:
            self._tree[name] = self.graph.placeholder(f"tree_{name}")
        spans = _checkpoint_spans(gm)
        regions: list[tuple[checkpoints.CheckpointRegion, list[fx.Node]]] = []  # packed nodes per checkpoint
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output") or node in self.an.ctx.mask_nodes:
                continue
            if node in spans:
                if not regions or regions[-1][0] is not spans[node]:
                    regions.append((spans[node], []))
                last = next(iter(reversed(self.graph.nodes)))
            ax = get_axes(node)
            rule = rule_for(node)
            if node in self._killers and not self.has_note(node):
                self.env[node] = self._emit_killer(node, *self._killers[node])
            elif ax.is_dense:
                if rule is not None and rule.emit is not None and self.has_note(node):
                    self.env[node] = rule.emit(self, node)
                else:
                    self.env[node] = self._emit_copy(node, self.dense)
            elif rule is not None and rule.emit is not None and (
                    ax.is_token or any(get_axes(a).is_token for a in node_args(node))):
                self.env[node] = rule.emit(self, node)
            elif ax.is_const and any(get_axes(a).is_token for a in node_args(node)):
                self.env[node] = self._emit_copy(node, self.value)
            else:
                self.env[node] = self.copy(node)
            if isinstance(self.env[node], fx.Node) and not has_origin(self.env[node]):
                record_origin(self.env[node], node, __name__)
            if node in spans:
                made = regions[-1][1]
                n = last.next
                while n.op != "root":
                    made.append(n)
                    n = n.next
        out = next(n for n in gm.graph.nodes if n.op == "output")
        outs = fx.node.map_aggregate(out.args[0], lambda a: self.dense(a) if isinstance(a, fx.Node) else a)
        self.graph.output(outs)
        writes = {self.env[n] for n in self.an.ctx.input_writes if n in self.env}  # unused results, kept
        self.graph.eliminate_dead_code(is_impure_node=lambda n: n in writes or n.is_impure())
        self.graph.lint()
        new_gm = fx.GraphModule(gm, self.graph, class_name="PackedGraph")
        if regions:  # the packed nodes of each activation checkpoint back into a checkpoint call
            checkpoints.outline_checkpoints(new_gm, regions)
        new_gm.recompile()
        TOKEN_OUTPUTS.set(new_gm, self._token_outputs(out))
        SEQUENCES.set(new_gm, self.an.sequences_position)  # padding-free: the tree is over sequences (runtime)
        ROWS.set(new_gm, self.an.ctx.rows)  # [T, ...] tree inputs: the runtime's keys are row_keys, [T, 1, ...]
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        kept = set(new_gm.graph.nodes)
        written = [n for n in self.an.ctx.input_writes if self.env.get(n) in kept]
        if len(written) != len(self.an.ctx.input_writes):  # a write the rewrite dropped would lose its effect
            raise CannotReplay(Code.INPUT_WRITE, "an in-place write into a graph input was dropped by the rewrite",
                               next(iter(self.an.ctx.input_writes)))
        # inputs the graph writes into (axes.input_write_destination): the runtime snapshots them
        WRITTEN_INPUTS.set(new_gm, tuple(sorted({placeholders.index(d) for d in self.an.ctx.input_writes.values()})))
        return new_gm

    def _token_outputs(self, out: fx.Node) -> tuple[int, ...]:
        """Positions of the graph's outputs that are whole [B, L, ...] TOKEN values read densely through the
        tree's index (row 0, position 1, no window): the runtime tags them with the call's tree, so a next
        graph that receives one reuses that tree (brcompile.runtime provenance). None under drop_padding."""
        outs = out.args[0]
        if self.options.drop_padding or not isinstance(outs, (tuple, list)):
            return ()
        B, L = self.an.ctx.B, self.an.ctx.L
        found = []
        for i, a in enumerate(outs):
            if not isinstance(a, fx.Node):
                continue
            ax = get_axes(a)
            shape = shape_of(a)
            if ax.is_token and ax.row == 0 and ax.pos == 1 and ax.window is not None and ax.window.is_whole \
                    and shape is not None and len(shape) >= 2 and tuple(shape[:2]) == (B, L):
                found.append(i)
        return tuple(found)


def _checkpoint_spans(gm: fx.GraphModule) -> dict[fx.Node, "checkpoints.CheckpointRegion"]:
    """Node -> its activation-checkpoint region (passes/lower/checkpoint.py): every node from a region's first to
    its last tagged node (canonicalisation's new nodes included). Regions that overlap: CannotReplay."""
    order = list(gm.graph.nodes)
    bounds: dict = {}
    for i, n in enumerate(order):
        r = checkpoints.region_of(n)
        if r is not None:
            bounds[r] = (bounds.get(r, (i, i))[0], i)
    spans: dict = {}
    for r, (lo, hi) in bounds.items():
        for n in order[lo:hi + 1]:
            if n in spans or checkpoints.region_of(n) not in (None, r):
                raise CannotReplay(Code.CHECKPOINT_INTERLEAVED,
                                   f"activation checkpoint {r.body}: its nodes are interleaved with others", n)
            spans[n] = r
    return spans


def build_packed_graph(an: Analysis, options: Optional[PackOptions] = None) -> fx.GraphModule:
    """Emit the packed graph of an analysed graph (transactional: ``an.gm`` is not modified)."""
    return Packer(an, options or PackOptions()).build()
