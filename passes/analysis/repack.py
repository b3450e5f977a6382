"""Dense causal regions, packed again (docs/ARCHITECTURE.md §3.6, "Dense regions, packed again").

An op with no token-axis rule hands its TOKEN operands to the dense side (:func:`axes.dense_fallback`),
and everything computed from there on is DENSE. Before this pass, one such op (a RoBERTa ``cumsum`` of
the mask, a Mamba mixer's chunked scan, GPT-2's ``addmm`` over flattened tokens) made every later
attention refuse, and the whole graph ran unchanged.

**The rule.** Let ``v`` be a DENSE value computed from the tree inputs, materialised TOKEN values and
constants only, with a row dim r of extent B and a position dim p of extent L. If ``v`` is a
*row-independent causal* function of those inputs — ``v[b, t]`` depends only on row b's inputs at
positions ``<= t`` — then rows that agree on their tree inputs up to column t agree on ``v[b, t]``: ``v``
satisfies the TOKEN invariant and can be packed again::

    packed[k] = v[rep_row[k], position[k]]                       (one dense copy of each packed token)

(``repack_tokens``). The region itself still runs densely on the B·L positions — no sharing inside it —
but everything after it is packed again: the attentions, the MLPs and the rest of the model.

**Exactness of the gradient.** The packed graph's loss gives token k the gradient ``G_k = Σ_{(b,t)∈k}
g_{b,t}`` (the dense gradients of its copies, summed: the later packed ops are exact). ``repack_tokens``
places ``G_k`` on the one copy ``(rep_row[k], position[k])``. The copies of k are the same function of the
same inputs (causality: they read identical prefixes), so their Jacobians agree, and
``Σ_{(b,t)∈k} g_{b,t} ∂v[b,t]/∂θ = G_k ∂v[rep(k)]/∂θ`` for every parameter or input θ of the region.

**The proof obligation is checked on probes** (``_Probe``), like the masks of :mod:`.masks`: the region
is evaluated on the example batch's integer inputs (ids, masks, positions: their domains matter) and
random floats, then again with (a) one row's inputs replaced by other values — only that row of ``v`` may
change, which also identifies r — and (b) every row's inputs at positions ``>= q`` replaced, for several q
— ``v`` at positions ``< q`` must not change, bitwise, which identifies p — and (c) the rows' inputs
rolled by one row — ``v``'s rows must roll with them (up to a few ulps of its largest entry: a kernel may
round a row moved to another place in the batch differently): the same function of every row's inputs (a
per-row constant, ``arange(L) * s[:B, None]``, passes (a) and (b) but gives rows that share a prefix
different values). The region is evaluated twice
on the same values first (a random op inside it makes the comparison meaningless: refused). A region
whose probes fail stays dense, as before, and the refusal is kept for the reason an attention reports.

Not re-packed: a region reading a per-batch input that is not a tree key (labels, advantages: rows that
share a prefix may differ there), a value without exactly one row and one position dim, packed-sequence
graphs (a token's column is not its position in its sequence there), ``drop_padding`` (the dense region
would read 0 where the original read the padding's values).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import torch
import torch.fx as fx

from brcompile.passes.analysis.axes import (
    AxesContext, axis_rule, example_value, get_axes, hint, node_args, set_axes, token,
)
from brcompile.passes import probe
from brcompile.passes.probe import ancestors
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.passes.ops.markers import packed_again
from brcompile.passes.meta import CHECKPOINT_REGION, REPACK_AXES

log = logging.getLogger(__name__)

#: Probe positions q for the causality check, as fractions of L (plus q = 1, 2, L - 2 and L - 1): several, so
#: that a look-ahead confined to some blocks of positions (a chunked algorithm's chunks) is crossed.
_CAUSAL_SPLITS = (1 / 3, 0.5, 2 / 3)


def repack_tokens(x: torch.Tensor, index: torch.Tensor, rep_row: torch.Tensor, position: torch.Tensor, row: int,
                  pos: int) -> torch.Tensor:
    """``x[rep_row[k], position[k]]`` along dims (row, pos), kept in place with extents (1, N).

    The backward is the indexing's: each packed token's gradient lands on its one representative copy.
    ``x`` must span the batch's [B, L] (``index``'s shape): a region that read a window of a token value
    that is not the whole batch on this call is an error, which the runtime answers by running the
    original graph."""
    if (x.shape[row], x.shape[pos]) != tuple(index.shape):
        raise RuntimeError(f"re-packed dense value has token extents ({x.shape[row]}, {x.shape[pos]}), the batch "
                           f"is {tuple(index.shape)}")
    moved = x.movedim((row, pos), (0, 1))[rep_row, position]  # [N, ...rest]
    return moved.unsqueeze(0).movedim((0, 1), (row, pos))


@dataclasses.dataclass(frozen=True)
class Repacked:
    """One re-packed dense value (for reports): the value, its token dims, the size of its dense region."""

    node: str
    row: int
    pos: int
    region_ops: int

    def __str__(self) -> str:
        return f"{self.node} (dense region of {self.region_ops} ops; row dim {self.row}, position dim {self.pos})"


def _emit_repack(pk, node: fx.Node) -> fx.Node:
    if pk.options.drop_padding and pk.options.drops_within_rows:
        # a kept token's representative row keeps every position before it only when nothing inside a row is
        # left out: the dense region then reads true values at every position a kept token depends on
        raise CannotReplay(Code.REPACK_PADDING,
                           f"{node.args[0].name} is re-packed from a dense region, which needs the padding "
                           f"positions' values; key-padded positions left out of the tree remove them", node)
    row, pos = node.args[1], node.args[2]
    return pk.graph.call_function(repack_tokens, (pk.dense(node.args[0]), pk.tree("index"), pk.tree("rep_row"),
                                                  pk.tree("position"), row, pos))


@axis_rule(emit=_emit_repack, always=True)
def _repack_rule(ctx: AxesContext, node: fx.Node):
    """The fact was proved when the node was made (:func:`repack_operands`)."""
    return REPACK_AXES.require(node)


def repack_operands(ctx: AxesContext, node: fx.Node) -> bool:
    """Re-pack the DENSE operands of ``node`` that can be (see module docstring) where it wants TOKEN
    ones: an op mixing DENSE and TOKEN operands (else its TOKEN operands are materialised), or the query,
    key and value of an attention. Returns whether an operand was replaced."""
    changed = False
    for a in _candidates(node):
        if not get_axes(a).is_dense or not _token_shaped(ctx, a):
            continue
        new = _repacked(ctx, a, node)
        if new is not None:
            node.replace_input_with(a, new)
            changed = True
    return changed


def _candidates(node: fx.Node) -> list[fx.Node]:
    from brcompile.passes.analysis.rules.attention import SDPA, sdpa_args
    if node.op == "call_function" and node.target in SDPA:
        a = sdpa_args(node)
        return [x for x in dict.fromkeys(a[k] for k in ("query", "key", "value")) if isinstance(x, fx.Node)]
    args = list(dict.fromkeys(node_args(node)))
    facts = [get_axes(a) for a in args]
    if any(f.is_token for f in facts) and any(f.is_dense for f in facts):
        return args
    return []


def _token_shaped(ctx: AxesContext, n: fx.Node) -> bool:
    v = example_value(n)
    if not isinstance(v, torch.Tensor):
        return False
    shape = hint(tuple(v.shape))
    return ctx.B in shape and ctx.L in shape and v.dim() >= 2


def _repacked(ctx: AxesContext, v: fx.Node, user: fx.Node) -> Optional[fx.Node]:
    """The re-packed twin of DENSE ``v`` (made once, before its first TOKEN user), or None with the reason
    kept in ``ctx.repack_refused``."""
    if v in ctx.repacked_nodes:
        return ctx.repacked_nodes[v]
    if v in ctx.repack_refused:
        return None
    try:
        row, pos, n_ops = _prove(ctx, v)
    except _NotCausal as e:
        ctx.repack_refused[v] = str(e)
        log.debug("not re-packed: %s: %s", v.name, e)
        return None
    with ctx.gm.graph.inserting_before(user):
        new = ctx.gm.graph.call_function(packed_again, (v, row, pos))
    new.meta["example_value"] = example_value(v)
    CHECKPOINT_REGION.copy(user, new)
    ax = token(example_value(v).dim(), row, pos, ctx.full_window())
    REPACK_AXES.set(new, ax)
    set_axes(new, ax)
    ctx.repacked_nodes[v] = new
    ctx.repacked.append(Repacked(v.name, row, pos, n_ops))
    log.debug("re-packed %s", ctx.repacked[-1])
    return new


class _NotCausal(Exception):
    """Why a dense value is not re-packed (a reason for reports, not a refusal of the graph)."""


def _region(ctx: AxesContext, v: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(DENSE nodes computing ``v``, in graph order; their non-DENSE inputs)."""
    order = ancestors(v, inside=lambda a: get_axes(a).is_dense or _window_of_token(ctx, a))
    for n in order:
        if n.op == "placeholder":
            raise _NotCausal(f"it reads {n.name}, a per-batch input that is not a tree key (rows sharing a "
                             f"prefix may differ there)")
        if n.op not in ("call_function", "call_method"):
            raise _NotCausal(f"its region holds a {n.op} node ({n.name})")
    seen = set(order)
    inputs = {a: None for n in order for a in n.all_input_nodes if a not in seen}
    for a in inputs if ctx.call_constants else ():
        const = next((c for c in ancestors(a) if c in ctx.call_constants), None)
        if const is not None:
            raise _NotCausal(f"it reads {const.name}, a per-call input (the probes would prove it for this "
                             f"call's value only)")
    return _with_side_effects(order, seen, inputs), list(inputs)


def _window_of_token(ctx: AxesContext, a: fx.Node) -> bool:
    """Whether ``a`` is a window of a TOKEN value (``x[:, t]`` of an unrolled recurrence): the region then
    computes it from the whole value, so the probes perturb every position of that value."""
    ax = get_axes(a)
    return (ax.is_token and not ax.region and a.op in ("call_function", "call_method")
            and not _whole_at_example(ctx, a, ax))


def _with_side_effects(order: list[fx.Node], seen: set, inputs: dict) -> list[fx.Node]:
    """``order`` plus the calls without users inside its span that read nothing else (state changes such as
    ``torch.vmap``'s nesting levels, which the region's ops need to run as traced)."""
    if not order:
        return order
    node, keep = order[0], set(seen)
    while node is not order[-1]:
        node = node.next
        if node.op == "call_function" and not node.users and all(a in keep or a in inputs
                                                                    for a in node.all_input_nodes):
            keep.add(node)
    return [n for n in order[0].graph.nodes if n in keep]


def _prove(ctx: AxesContext, v: fx.Node) -> tuple[int, int, int]:
    """(row dim, position dim, region size) of ``v`` if the probes prove it row-independent and causal."""
    if ctx.sequences:
        raise _NotCausal("the graph's attentions are over packed sequences (a dense value's column is not its "
                         "position in its sequence)")
    nodes, inputs = _region(ctx, v)
    probe = _Probe(ctx, nodes, inputs, v)
    return (*probe.dims(), len(nodes))


class _Probe:
    """Evaluates the region of ``v`` on probe values and finds its token dims (see module docstring)."""

    def __init__(self, ctx: AxesContext, nodes: list[fx.Node], inputs: list[fx.Node], v: fx.Node):
        self.ctx, self.nodes, self.v = ctx, nodes, v
        self.gen = probe.generator(0)
        self.values: dict[fx.Node, Any] = {}
        self.token_inputs: dict[fx.Node, Any] = {}  # input -> its TokenAxes
        for a in inputs:
            ax = get_axes(a)
            if ax.is_token:
                if ax.region or not _whole_at_example(ctx, a, ax):
                    raise _NotCausal(f"it reads {a.name} ({ax}), a value in a sort order, an index, group offsets or a "
                                     f"window of a token value")
                self.token_inputs[a] = ax
            self.values[a] = self._value(a, ax)

    def _value(self, a: fx.Node, ax) -> Any:
        if a.op == "get_attr":  # a submodule (a custom autograd.Function's fwd/bwd bodies) or a constant
            return _evaluate(a, self.ctx)
        ev = example_value(a)
        if not isinstance(ev, torch.Tensor):
            return hint(ev)
        if ax.is_token and (ev.is_floating_point() or ev.is_complex()):
            return probe.normal(hint(tuple(ev.shape)), self.gen, draw=ev.dtype, like=ev)
        return _evaluate(a, self.ctx)  # ints, bools and constants: their domains matter (ids, masks)

    def run(self, values: dict[fx.Node, Any]) -> torch.Tensor:
        """``v`` on ``values`` (the region's inputs): every region node run in order (:func:`.probe.evaluate`)."""
        with torch.no_grad():
            out = probe.evaluate(self.v, values, nodes=self.nodes, fail=_failed)
        if not isinstance(out, torch.Tensor):
            raise _NotCausal("it is not a tensor")
        return out

    def perturbed(self, rows: Optional[int] = None, from_pos: int = 0) -> dict[fx.Node, Any]:
        """The probe values with every token input changed at row ``rows`` (all rows if None) and
        positions ``>= from_pos``."""
        out = dict(self.values)
        for a, ax in self.token_inputs.items():
            x = self.values[a]
            if rows is not None and ax.row is None and not ax.flat:
                continue  # a position-only value belongs to no row
            out[a] = torch.where(self._where(x, ax, rows, from_pos), probe.differing(x, self.gen), x)
        return out

    def _where(self, x: torch.Tensor, ax, rows: Optional[int], from_pos: int) -> torch.Tensor:
        """The entries of token input ``x`` at row ``rows`` (all if None) and positions ``>= from_pos``; a
        flattened value's dim ``ax.pos`` holds entry ``(b·L + t)·k + s`` (:meth:`_layout`)."""
        shape, row, pos = self._layout(x, ax)
        where = torch.zeros(shape, dtype=torch.bool, device=x.device)
        index = [slice(None)] * len(shape)
        index[pos] = slice(from_pos, None)
        if rows is not None:
            index[row] = rows
        where[tuple(index)] = True
        return where.reshape(x.shape)

    def dims(self) -> tuple[int, int]:
        ctx = self.ctx
        base = self.run(self.values)
        if not _same(base, self.run(self.values)).all():
            raise _NotCausal("its region is not deterministic (a random op)")
        shape = tuple(base.shape)
        rows = [d for d, s in enumerate(shape) if s == ctx.B]
        poss = [d for d, s in enumerate(shape) if s == ctx.L]
        moved = False
        for b in sorted({0, ctx.B // 2, ctx.B - 1}):
            changed = ~_same(self.run(self.perturbed(rows=b)), base)
            moved |= bool(changed.any())
            rows = [d for d in rows if _only_at(changed, d, lambda i: i == b)]
        if not moved:
            raise _NotCausal("it does not depend on the rows' token values")
        splits = {1, 2, ctx.L - 2, ctx.L - 1, *(int(f * ctx.L) for f in _CAUSAL_SPLITS)}
        for q in sorted(q for q in splits if 0 < q < ctx.L):
            changed = ~_same(self.run(self.perturbed(from_pos=q)), base)
            poss = [d for d in poss if _only_at(changed, d, lambda i: i >= q)]
        pairs = [(r, p) for r in rows for p in poss if r != p]
        if len(pairs) != 1:
            raise _NotCausal("no row dim and position dim that it is row-independent and causal along"
                             if not pairs else f"its token dims are ambiguous ({pairs})")
        if ctx.B > 1 and not _close(self.run(self.rolled()), base.roll(1, pairs[0][0])):
            raise _NotCausal("it is not the same function of every row's inputs (a constant that differs "
                             "from row to row)")
        return pairs[0]

    def rolled(self) -> dict[fx.Node, Any]:
        """The probe values with every token input's rows rolled by one (row b holds row b - 1's values);
        a position-only input is the same in every row and stays."""
        out = dict(self.values)
        for a, ax in self.token_inputs.items():
            x = self.values[a]
            shape, row, _ = self._layout(x, ax)
            if row is not None:
                out[a] = x.reshape(shape).roll(1, row).reshape(x.shape)
        return out

    def _layout(self, x: torch.Tensor, ax) -> tuple[list, Optional[int], int]:
        """(shape, row dim, position dim) of token input ``x`` with a flattened dim ``ax.pos`` (entry
        ``(b·L + t)·k + s``, passes/analysis/rules/moe.py) unflattened to ``[B, L, k]``; ``x``'s own otherwise."""
        shape = list(x.shape)
        if ax.flat:
            shape[ax.pos:ax.pos + 1] = [self.ctx.B, self.ctx.L, ax.flat]
            return shape, ax.pos, ax.pos + 1
        return shape, ax.row, ax.pos


def _whole_at_example(ctx: AxesContext, a: fx.Node, ax) -> bool:
    """Whether TOKEN ``a``'s window keeps every row and position at the example's sizes (``mask[:, :L]``).
    ``repack_tokens`` checks the extents again on every call."""
    if ax.window.is_whole:
        return True
    if ax.flat:
        return False
    shape = hint(tuple(example_value(a).shape))
    return (ax.row is None or shape[ax.row] == ctx.B) and shape[ax.pos] == ctx.L


def _evaluate(a: fx.Node, ctx: AxesContext) -> Any:
    from brcompile.passes.analysis.masks import evaluate
    try:
        return evaluate(a, ctx.values)
    except Exception as e:
        raise _NotCausal(f"its input {a.name} could not be evaluated ({type(e).__name__}: {str(e)[:150]})") from e


def _failed(n: fx.Node, e: Exception) -> None:
    """A region op that raised on probe values (a value outside its domain): not proved."""
    raise _NotCausal(f"its region failed on probe values at {n.name}: {type(e).__name__}: {str(e)[:200]}") from e


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise bitwise-equal (:func:`.probe.identical`); a shape that differs is refused."""
    if a.shape != b.shape:
        raise _NotCausal("its shape depends on the values")
    return probe.identical(a, b)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` equals ``b`` up to a few rounding steps of ``b``'s largest entry (:data:`.probe.ROUNDING`; integers
    exactly, NaN equal to NaN); a shape that differs is refused."""
    if a.shape != b.shape:
        raise _NotCausal("its shape depends on the values")
    return probe.close(a, b, probe.ROUNDING)


def _only_at(changed: torch.Tensor, dim: int, allowed) -> bool:
    """Whether every changed entry's index along ``dim`` is allowed."""
    along = changed.movedim(dim, 0).reshape(changed.shape[dim], -1).any(dim=1)
    return all(allowed(i) for i in torch.nonzero(along).flatten().tolist())


__all__ = ["packed_again", "repack_tokens", "repack_operands", "Repacked"]
