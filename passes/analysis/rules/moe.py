"""Mixture-of-experts blocks: routing, dispatch to experts and combine are token-local.

A MoE block computes, for every token, ``y = sum_s w_s(h) · E_{e_s(h)}(h)`` where the router picks experts
``e_s`` and weights ``w_s`` from the token's own hidden state ``h``: each token's output depends on its own
hidden state only. Implementations reach that per-token function through batch-wide steps; each rule below
proves one of them keeps every token's result a function of that token alone, so a TOKEN value stays causal
and row-independent and the packed graph may run the same ops over the N packed tokens instead of B·L:

* **Flattened tokens** (``shape.flatten_view``): ``h.view(-1, D)`` gives a ``[B·L·k, …]`` value whose entry
  ``(b·L + t)·k + s`` belongs to token (b, t) (fact ``flat = k``); its packed twin is ``[N·k, …]`` with entry
  ``n·k + s``. Per-entry ops (pointwise, ``linear``, ``softmax``/``topk``/``max``/``one_hot`` on the expert dim,
  ``gather``/``scatter`` along it — a router that picks experts by bias-corrected scores and gathers the
  uncorrected ones at them, whose weights the experts then read as ``weights[perm]``), lookups
  ``W[expert_ids]``, ``repeat_interleave`` along the flat dim, batched per-token ``bmm``) keep it;
  ``reshape(B, L, D)`` unflattens it.
* **Token-local regions** (sort-based dispatch, HF's ``grouped_mm`` experts): ``sort(key)`` of a flattened
  integer key (the expert ids) gives the sorted keys and a permutation P. A value *in the order of P*
  (fact ``order = P``) lists entry ``P(i)``'s value at place i; an *index* (fact ``points = (f, o)``) holds
  at each entry the place of that same entry (or of its token, ``f = 1``) in the layout ``(flat f, order o)``
  — ``P`` itself points into the natural order, ``P // k`` at the token, ``argsort(P)`` (the inverse
  permutation, also ``inv[P] = arange``, functionalised to it) into P's order. ``x[idx]`` of a value laid
  out as idx points to returns, at each of idx's entries, the value of that entry's own token or entry:
  the layout becomes idx's own. Group offsets ``cumsum(histc(sorted keys, bins=E, min=0, max=E-1))`` (fact
  ``groups``) bound the runs of equal keys in P's order when the keys are integers in ``[0, E)`` (proved
  from their origin: indices of ``topk``/``max``/``argmax`` over E experts, or a concatenation of such); a
  grouped matmul ``grouped_mm(x, W, offs)`` of a value in P's order then multiplies the row of entry
  ``P(i)`` by ``W[key(P(i))]``: a per-entry function again.
  The packed graph computes the sort, the counts and the offsets over the N·k packed entries: a different
  permutation, but every value is still, entry by entry, the same function of its own token, and the
  inverse permutation brings it back to the natural order, where ``packed[n·k + s] == dense[(b·L + t)·k + s]``
  for every (b, t) of node n.

A region value in a sort order, an index or group offsets has no dense counterpart at the same place: any
op other than these is refused with ``CannotReplay`` naming it (``axes.propagate``), as is a cumsum over the
flattened tokens (a position-in-expert count: token dropping by capacity depends on the number of tokens
in the batch). A flattened value in its natural order needed dense (a router auxiliary loss over all
tokens) is materialised exactly (``packed[index]`` per entry, ``pack.materialize``).
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from brcompile.passes.analysis.axes import (
    AxesContext, Local, axis_rule, dense_fallback, example_value, get_axes, normalize_dim, shape_of, token,
)
from brcompile.passes.refusals import Code
from brcompile.passes.analysis.guards import integers_in_range
from brcompile.passes.analysis.rules import reduce as _reduce
from brcompile.passes.spellings import INDEX_CASTS, arg

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _dim(node, pos: int, default=None):
    return arg(node, pos, "dim", default)


# --------------------------------------------------------------------------------------------------
# per-token ops on the expert dim


@axis_rule(local=Local.CARRY)
def topk(ctx: AxesContext, node):
    """``topk(x, k, dim)`` along a non-token dim (the experts): the k largest of one token's scores and their
    indices — both outputs keep x's token dims (the tuple's fact is its elements' fact). Along a token dim it
    would compare tokens: materialised."""
    ax = get_axes(node.args[0])
    dim = _dim(node, 2, -1)
    if normalize_dim(dim, ax.ndim) in ax.token_dims():
        return dense_fallback(ctx, node, "topk along a token dim")
    return ax


@axis_rule(local=Local.CARRY)
def one_hot(ctx: AxesContext, node):
    """``one_hot(ids, E)``: a new last dim of extent E, each element a function of one id: token dims stay."""
    ax = get_axes(node.args[0])
    return token(ax.ndim + 1, ax.row, ax.pos, ax.window)


@axis_rule(local=Local.CARRY)
def scatter(ctx: AxesContext, node):
    """``x.scatter(dim, idx, src)`` along a non-token dim (group-limited routing: ``zeros_like(group_scores)
    .scatter(1, group_idx, 1)``): ``out`` is x with ``out[p with p[dim] := idx[p]] = src[p]`` (``+=`` for
    scatter_add) for every coordinate p of idx. Every other coordinate of p, the token dims among them, is
    kept, so each token's slice of ``out`` is written only from the same token's slices of x, idx and src:
    a per-token op when x, idx and a tensor src are TOKEN values with the same token dims (and the same
    extents there, so no token's slice of x is left out of the writes in one layout and not in the other).
    Along a token dim it would move values between tokens: materialised. The proof holds entry by entry for
    flattened tokens in one layout (``local=Local.CARRY``; a router's scatter mask is read back by
    ``gather(scores, 1, topk_indices)``, which carries them too: rules/attention.py)."""
    x = node.args[0] if node.args else node.kwargs.get("input")
    dim = _dim(node, 1)
    idx = arg(node, 2, "index")
    src = node.kwargs.get("src", arg(node, 3, "value"))
    ax, shp = get_axes(x), shape_of(x)
    if not isinstance(dim, int) or not ax.is_token or shp is None:
        return dense_fallback(ctx, node, "scatter into a value that is not a token value")
    if normalize_dim(dim, ax.ndim) in ax.token_dims():
        return dense_fallback(ctx, node, "scatter along a token dim")
    for o in (idx, src):
        fo, so = get_axes(o), shape_of(o)
        if so is None and not isinstance(o, fx.Node):
            continue  # a Python scalar src
        if not fo.is_token or so is None or (fo.ndim, fo.row, fo.pos, fo.window) != (ax.ndim, ax.row, ax.pos, ax.window) \
                or any(so[d] != shp[d] for d in ax.token_dims()):
            return dense_fallback(ctx, node, "scatter of an index or source not aligned with its target's tokens")
    return ax


@axis_rule(local=Local.CARRY)
def argmax(ctx: AxesContext, node):
    """argmax/argmin over a non-token dim (a top-1 router): a reduction over that dim."""
    if _dim(node, 1) is None:
        return dense_fallback(ctx, node, "argmax over all elements")
    return _reduce.reduction(ctx, node)


# --------------------------------------------------------------------------------------------------
# sort: along the expert dim (per token) or along the flattened tokens (a token-local region)


@axis_rule(local=Local.OWN)
def sort(ctx: AxesContext, node):
    """``sort``/``argsort`` along a non-token dim: per token (its facts stay). Along the flattened tokens of a
    1-D key in natural order: the start of a token-local region (module docstring) — the sorted keys are in
    the order of this sort (``order``), the permutation points into the natural order. ``argsort`` of a
    permutation index is its inverse: it points into that permutation's order."""
    x = node.args[0]
    ax = get_axes(x)
    name = node.target if isinstance(node.target, str) else node.target.__name__
    dim = _dim(node, 1, -1)
    if ax.points is not None:
        own = (ax.flat, ax.order)
        if name == "argsort" and ax.ndim == 1 and ax.order is not None and ax.points == (ax.flat, None):
            # a permutation of the entries (P, not P // k): argsort(P)[j] = the place of entry j in P's order
            return token(1, None, 0, ax.window, flat=own[0], points=(own[0], own[1]))
        ctx.fail(Code.TOKEN_LOCAL_REGION,
                 node, f"{name} of a permutation index other than the inverse of a sort of the flattened tokens")
    if ax.region:
        ctx.fail(Code.TOKEN_LOCAL_REGION, node, f"{name} of a value in a sort order of the flattened tokens")
    d = normalize_dim(dim, ax.ndim)
    if d not in ax.token_dims():
        return ax
    if not ax.flat or ax.ndim != 1:
        return dense_fallback(ctx, node, f"{name} along a token dim")
    if name == "argsort":
        return token(1, None, 0, ax.window, flat=ax.flat, order=node, points=(ax.flat, None))
    return token(1, None, 0, ax.window, flat=ax.flat, order=node, points=("pair",))


def sort_output(ctx: AxesContext, node):
    """``sort(key)[0]``: the keys in the sort's order; ``sort(key)[1]``: the permutation P, at place i the
    natural place of the entry ``P(i)`` listed there — it points into the natural order."""
    ax = get_axes(node.args[0])
    if node.args[1] == 0:
        return token(1, None, 0, ax.window, flat=ax.flat, order=ax.order)
    return token(1, None, 0, ax.window, flat=ax.flat, order=ax.order, points=(ax.flat, None))


# --------------------------------------------------------------------------------------------------
# indexing inside a region


def region_getitem(ctx: AxesContext, node):
    """``x[idx]`` with ``x`` laid out as the index ``idx`` points to: place i of the result reads x at the
    place of i's own entry (or its token), so the result is that entry's value, laid out as idx is. Basic
    indexing that keeps the flattened dim whole keeps the layout. Anything else: refused in a sort order,
    materialised in natural order."""
    from brcompile.passes.analysis.rules import shape
    x, idx = node.args[0], node.args[1]
    ax = get_axes(x)
    entries = list(idx) if isinstance(idx, tuple) else [idx]
    tensors = [i for i, e in enumerate(entries) if isinstance(e, fx.Node)]
    if ax.points is not None or ax.groups is not None:
        ctx.fail(Code.TOKEN_LOCAL_REGION, node, "indexing a permutation index or group offsets of a token-local region")
    if tensors:
        if tensors != [ax.pos] or any(e != slice(None) for i, e in enumerate(entries) if i != ax.pos):
            return _refuse(ctx, node, ax, "an index of the flattened tokens beside other indices")
        ix = get_axes(entries[ax.pos])
        v = example_value(entries[ax.pos])
        if not ix.is_token or ix.points is None or ix.points != (ax.flat, ax.order) or ix.ndim != 1 or \
                not isinstance(v, torch.Tensor) or v.dtype not in _INT_DTYPES:
            from brcompile.passes.probe import ancestors
            made = next((a for a in ancestors(entries[ax.pos]) if a.op == "placeholder"), None) \
                if ix.is_dense else None
            if made is not None:  # JetMoE's experts after the graph break that follows its routing sort
                return _refuse(ctx, node, ax, f"gathering flattened tokens by an index made outside the graph "
                                              f"({made.name}, such as a routing order computed before a graph "
                                              f"break: it names rows of the batch, not packed tokens)")
            return _refuse(ctx, node, ax, "gathering flattened tokens by an index that does not point into "
                                          "their layout")
        return token(len(shape_of(node)), None, ax.pos, ix.window, flat=ix.flat, order=ix.order)
    norm = shape._normalize_index(idx, ax.ndim)
    if norm is None:
        return _refuse(ctx, node, ax, "advanced indexing of flattened tokens")
    pos = None
    for d_in, d_out, e in shape._walk_index(norm):
        if d_in == ax.pos:
            if d_out is None or e != slice(None):
                return _refuse(ctx, node, ax, "slicing the flattened tokens")
            pos = d_out
    return token(len(shape_of(node)), None, pos, ax.window, flat=ax.flat, order=ax.order)


def _refuse(ctx, node, ax, reason):
    if ax.region:
        ctx.fail(Code.TOKEN_LOCAL_REGION, node, reason + " (in a sort order)")
    return dense_fallback(ctx, node, reason)


# --------------------------------------------------------------------------------------------------
# indices and group offsets: the few ops a region performs on them


def region_op(ctx: AxesContext, node):
    """An op with a permutation-index or group-offsets operand and no region rule of its own: an index may be
    divided by the number of entries per token (``P // k`` points at the token; any spelling:
    :func:`_floor_division`) or cast to another integer
    type; counts may be cast and summed up into offsets (``cumsum(counts, 0)``). Anything else would read
    the batch's token order: refused."""
    args = [a for a in node.args if isinstance(a, fx.Node)] + [
        a for a in node.kwargs.values() if isinstance(a, fx.Node)]
    facts = [get_axes(a) for a in args]
    x = node.args[0] if node.args else None
    ax = get_axes(x)
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    v = example_value(node)
    if len(args) == 1 and ax.is_token and (ax.points is not None or ax.groups is not None):
        if name in INDEX_CASTS and isinstance(v, torch.Tensor) and (ax.groups is not None or v.dtype in _INT_DTYPES):
            return ax
        if _floor_division(node) and ax.points is not None and isinstance(node.args[1], int) and node.args[1] > 0:
            f, o = ax.points
            c = node.args[1]
            if o is None and isinstance(f, int) and f % c == 0:
                # place of entry e = token·f + s; // c = token·(f/c) + s // c: the place of e in flat f/c
                return token(ax.ndim, None, ax.pos, ax.window, flat=ax.flat, order=ax.order, points=(f // c, None))
        if ax.groups is not None and ax.groups[0] == "counts" and name == "cumsum" and \
                normalize_dim(_dim(node, 1, 0), 1) == 0:
            return token(1, None, None, ax.window, groups=("offsets", ax.groups[1], ax.groups[2]))
    what = next(f for f in facts if f.is_token and (f.points is not None or f.groups is not None))
    ctx.fail(Code.TOKEN_LOCAL_REGION,
             node, f"{name} of a value of a token-local region ({what}) would read the batch's token order")


def _floor_division(node: fx.Node) -> bool:
    """``x // c`` in any spelling: ``floordiv``, or ``div(x, c, rounding_mode="floor")``; on an index also
    ``rounding_mode="trunc"`` (JetMoE's ``P.div(k, rounding_mode="trunc")``), which equals the floor on the
    non-negative places an index holds."""
    if node.target in (operator.floordiv, torch.floor_divide, "floor_divide", "__floordiv__"):
        return True
    return node.target in (torch.div, "div") and node.kwargs.get("rounding_mode") in ("floor", "trunc")


def _lookup_table(node: fx.Node) -> Optional[fx.Node]:
    """``table[i]`` with ``table`` an integer graph input that is no token value (a buffer: a hash router's
    token-to-expert map ``tid2eid[input_ids]``): the table, whose entries are the key's values; else None."""
    table = node.args[0]
    v = example_value(table)
    if not (isinstance(table, fx.Node) and table.op == "placeholder" and isinstance(v, torch.Tensor)
            and v.dtype in _INT_DTYPES and not v.requires_grad and get_axes(table).is_const):
        return None
    return table


def _key_range(node: fx.Node, depth: int = 0, tables: Optional[list] = None):
    """Bound E on an integer key's values (all in ``[0, E)``), from its origin: the indices of ``topk``/``sort``
    along a dim of extent E, or of ``max``/``min``/``argmax``/``argmin`` over it, through views and integer
    casts; a concatenation of such keys takes the largest of their bounds; ``masked_fill`` with an integer
    (:func:`_masked_fill_range`); else None. A lookup in an integer table input (:func:`_lookup_table`) bounds
    nothing by itself (0): the table goes to ``tables``, and the caller guards its entries per call
    (passes/analysis/guards.py ``integers_in_range``)."""
    seen = 0
    while isinstance(node, fx.Node) and seen < 32 and depth < 8:
        seen += 1
        if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            src = node.args[0]
            if tables is not None and (table := _lookup_table(node)) is not None:
                tables.append(table)
                return 0
            tname = src.target if isinstance(src.target, str) else getattr(src.target, "__name__", "")
            if tname in ("topk", "sort", "max", "min") and node.args[1] == 1:
                dim = _dim(src, 2 if tname == "topk" else 1, -1)
                shp = shape_of(src.args[0])
                if not isinstance(dim, int) or shp is None or not isinstance(example_value(src), (tuple, list)):
                    return None
                return shp[normalize_dim(dim, len(shp))]
            if tname == "sort" and node.args[1] == 0:
                node = src.args[0]  # the sorted keys take the keys' values
                continue
            if tname == "chunk":
                return None
            node = src if get_axes(src).is_token else None
            continue
        tname = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        if tname in ("argmax", "argmin"):
            shp = shape_of(node.args[0])
            return shp[normalize_dim(_dim(node, 1), len(shp))]
        if tname in ("cat", "concat", "concatenate"):  # each part's values in [0, E_i): all in [0, max E_i)
            parts = node.args[0] if node.args else node.kwargs.get("tensors")
            bounds = [_key_range(p, depth + 1, tables) for p in parts] if isinstance(parts, (list, tuple)) else [None]
            return None if not bounds or None in bounds else max(bounds)
        if tname in ("reshape", "view", "flatten", "contiguous", "clone", "detach") or tname in INDEX_CASTS:
            node = node.args[0]
            continue
        if tname == "masked_fill":
            return _masked_fill_range(node, depth, tables)
        return None
    return None


def _masked_fill_range(node: fx.Node, depth: int, tables: Optional[list] = None):
    """The bound of ``masked_fill(x, mask, v)`` for integer keys ``x`` in ``[0, E)`` and an integer ``v >= 0``:
    its values are x's and v, all in ``[0, max(E, v + 1))``; with ``mask = (x == E - 1)`` (ZAYA's router drops
    its extra "skip" expert, the top index, to 0) x's top value is gone: ``[0, max(E - 1, v + 1))``."""
    x, mask = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("mask")
    v = node.args[2] if len(node.args) > 2 else node.kwargs.get("value")
    E = _key_range(x, depth + 1, tables)
    if E is None or isinstance(v, bool) or not isinstance(v, int) or v < 0:
        return None
    if isinstance(mask, fx.Node) and mask.op in ("call_function", "call_method") and \
            mask.target in (operator.eq, torch.eq, "eq", "__eq__") and len(mask.args) == 2 and \
            mask.args[0] is x and mask.args[1] == E - 1 and not isinstance(mask.args[1], bool):
        return max(E - 1, v + 1)
    return max(E, v + 1)


@axis_rule(local=Local.OWN)
def histc(ctx: AxesContext, node):
    """``histc(sorted keys, bins=E, min=0, max=E-1)`` of integer keys in ``[0, E)``: bin ``b`` counts the key
    value b (``floor(v·E/(E-1)) = v`` for ``v < E-1``, the top value falls in the last bin), i.e. the size
    of each run of equal keys in the sort's order; ``cumsum`` makes them the runs' ends (group offsets). The
    counts are batch-wide, but only grouped matmuls of values in that same order read them (region_op)."""
    x = node.args[0]
    ax = get_axes(x)
    bins = arg(node, 1, "bins", 100)
    lo = arg(node, 2, "min", 0)
    hi = arg(node, 3, "max", 0)
    if ax.order is None or ax.points is not None or ax.ndim != 1:
        return _refuse(ctx, node, ax, "histc of flattened tokens that are not the keys of a sort")
    srt = ax.order
    descending = arg(srt, 2, "descending", False)
    if descending is not False:
        ctx.fail(Code.MOE_GROUPS, node, "group counts of keys sorted in descending order")
    tables: list[fx.Node] = []
    E = _key_range(x, tables=tables)
    if not (isinstance(bins, int) and bins >= 2 and lo == 0 and hi == bins - 1 and E is not None and E <= bins):
        ctx.fail(Code.MOE_GROUPS,
                 node, f"histc(bins={bins}, min={lo}, max={hi}) of keys not proved to be integers in [0, bins) "
                       f"(their origin gives {E} values): the counts need not be the runs of equal keys")
    placeholders = [n for n in ctx.gm.graph.nodes if n.op == "placeholder"]
    for t in dict.fromkeys(tables):  # keys looked up in a table input: its entries are guarded per call
        ctx.guards.append(integers_in_range(placeholders.index(t), bins, f"the key table {t.name} of {node.name}"))
    return token(1, None, None, ax.window, groups=("counts", srt, bins))


@axis_rule(local=Local.OWN)
def grouped_mm(ctx: AxesContext, node):
    """``grouped_mm(x, W, offs)`` with ``x`` the rows of flattened entries in a sort's order and ``offs`` the
    offsets of that sort's keys: row i lies in the run of its key, so it is multiplied by ``W[key(P(i))]``
    (``x[i] @ W[g]`` for the group g of row i): a per-entry function of entry ``P(i)``, in the same order."""
    x = node.args[0]
    w = node.args[1] if len(node.args) > 1 else node.kwargs.get("mat_b", node.kwargs.get("weight"))
    offs = arg(node, 2, "offs")
    ax, fw, fo = get_axes(x), get_axes(w), get_axes(offs)
    extra = [k for k, v in node.kwargs.items() if k not in ("offs", "mat_b", "weight", "out_dtype") and v is not None]
    if len(node.args) > 3 or extra:
        ctx.fail(Code.GROUPED_MM, node, "grouped_mm with a bias or other extra arguments")
    if not ax.is_token or ax.order is None or ax.points is not None or ax.pos != 0 or ax.ndim != 2:
        return _refuse(ctx, node, ax, "grouped_mm of rows that are not in a sort order of the flattened tokens")
    if not fw.is_const or fo.groups is None or fo.groups[0] != "offsets" or fo.groups[1] is not ax.order:
        ctx.fail(Code.GROUPED_MM,
                 node, "grouped_mm whose weights are not constant or whose offsets are not the group offsets of "
                       "the sort that orders its rows")
    ws = shape_of(w)
    if ws is None or len(ws) != 3 or ws[0] != fo.groups[2]:
        ctx.fail(Code.GROUPED_MM, node, "grouped_mm with a weight count other than the number of groups")
    return token(2, None, 0, ax.window, flat=ax.flat, order=ax.order)


__all__ = ["sort_output", "region_getitem", "region_op"]
