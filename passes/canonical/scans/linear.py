"""Associative scans of affine maps as one ``linear_scan`` node, before the analysis (docs/ARCHITECTURE.md §3.3).

``torch._higher_order_ops.associative_scan(combine_fn, (a, b), dim)`` with the combine of two affine maps

    ((a1, b1), (a2, b2)) -> (a1 * a2, a2 * b1 + b2)

(HF Mamba / FalconMamba with ``config.use_associative_scan=True``: ``(discrete_A, deltaB_u)`` along the
positions, dim 2) computes the prefix compositions of the maps ``h -> a_t h + b_t``: its second output is the
first-order recurrence ``h_t = a_t h_{t-1} + b_t`` (``h_0 = b_0``) — ``backends.scan.linear_scan(a, b, dim)`` —
and its first the running product ``cumprod(a, dim)``. Dynamo records it in one of two forms, both turned
into those two nodes here, in the analysis copy (the user's graph is untouched):

* **the higher-order op** ``torch.ops.higher_order.associative_scan(combine_graph, [a, b], ())`` on the
  leaves moved to dim 0 (``combine_mode="pointwise"``: CUDA / XPU tensors). The combine graph is proved the
  affine composition: every op in it is pointwise arithmetic (``_POINTWISE``) and, evaluated on random float64
  inputs, it equals the formula (a polynomial identity of degree 2, checked at random points).
* **inlined** (``combine_mode="generic"``, what HF picks on CPU): Dynamo traces the odd/even recursion of
  ``generic_associative_scan`` — slices of step 2 along dim 0, the combine under ``torch.vmap`` (predispatch
  ``_add_batch_dim`` / ``_remove_batch_dim``), ``cat`` / ``pad`` / ``stack`` / ``flatten`` interleaves — between
  ``movedim(x, d, 0)`` of the leaves and ``movedim(y, 0, d)`` of the outputs. The region is taken whole: every
  node from the leaves' ``movedim`` to the outputs' is one of those ops (data movement along dim 0 only, the
  vmap bookkeeping, pointwise arithmetic), nothing outside reads an intermediate, and evaluated on random
  float64 leaves (the example's length along the scan dim, at most two entries along every other dim: the
  ops treat those dims alike) its outputs equal ``cumprod(a)`` and ``linear_scan(a, b)``. A region that
  fails a check stays as it is (its ops then go dense, with their own reasons).

The rule of ``linear_scan`` (passes/analysis/rules/scan.py) then makes the scan along the positions a
``brcompile::tree_linear_scan`` of the packed graph: the recurrence along the tree paths.
"""
from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any, Optional

import torch
import torch.fx as fx
from torch._functorch import predispatch

from brcompile.backends.scan.op import linear_scan
from brcompile.passes import probe
from brcompile.passes.analysis.axes import example_value
from brcompile.passes.spellings import (
    ATEN_SLICES, FLATTENS, MOVEDIMS, POINTWISE_ATEN, VMAP_CONTROL, VMAP_DATA, is_op, spellings,
)

log = logging.getLogger(__name__)

__all__ = ["HOP", "LEFT", "VMAP_DATA", "canonicalize_linear_scans", "is_affine_combine"]

#: the words of a note on a scan that is not rewritten (the no-attention refusal quotes those notes)
LEFT = "left as is"

#: the HOP as Dynamo records it (absent from torch builds without it)
HOP = getattr(getattr(torch.ops, "higher_order", None), "associative_scan", None)
#: ``cat`` and ``pad`` (the families' spellings)
_CATS = frozenset(spellings("cat"))
_PADS = frozenset(spellings("pad"))


def _is_pointwise(n: fx.Node) -> bool:
    return is_op(n, "add", "sub", "mul", "neg") or (n.op == "call_function" and n.target in POINTWISE_ATEN)


# --------------------------------------------------------------------------------------------------
# the combine function


def is_affine_combine(body: fx.GraphModule) -> Optional[str]:
    """None when ``body`` (placeholders ``a1, b1, a2, b2``; outputs ``(a, b)``) is ``(a1 * a2, a2 * b1 + b2)``:
    pointwise arithmetic only, equal to the formula on random float64 inputs; otherwise why not."""
    ph = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(ph) != 4:
        return f"a combine_fn of {len(ph)} inputs (two affine maps (a, b) are 4)"
    for n in body.graph.nodes:
        if n.op in ("call_function", "call_method") and not _is_pointwise(n):
            return f"a combine_fn that calls {n.target} (not pointwise arithmetic)"
        if n.op in ("call_module", "get_attr"):
            return f"a combine_fn that reads {n.target}"
    g = probe.generator(0)
    for _ in range(2):
        a1, b1, a2, b2 = (probe.normal(5, g) for _ in range(4))
        try:
            with torch.no_grad():
                out = probe.run(body, a1, b1, a2, b2)
        except Exception as e:  # noqa: BLE001  (a body that cannot run on these inputs is not the formula)
            return f"a combine_fn that does not run on probes ({type(e).__name__})"
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            return "a combine_fn without two outputs"
        if not (_agree(out[0], a1 * a2) and _agree(out[1], a2 * b1 + b2)):
            return "a combine_fn that is not the affine composition (a1 * a2, a2 * b1 + b2)"
    return None


def _agree(x: Any, y: torch.Tensor) -> bool:
    """``x`` agrees with the formula's value ``y`` on a float64 probe (:data:`.probe.RECURRENCE`)."""
    return probe.close(x, y, probe.RECURRENCE)


# --------------------------------------------------------------------------------------------------
# driver


def canonicalize_linear_scans(gm: fx.GraphModule) -> list[str]:
    """Rewrite every affine associative scan of ``gm`` (modified in place: the analysis copy) as
    ``linear_scan`` / ``cumprod`` nodes; returns one note per rewrite (or per scan left as it is)."""
    notes: list[str] = []
    graph = gm.graph
    if HOP is not None:
        for hop in [n for n in graph.nodes if n.op == "call_function" and n.target is HOP]:
            notes.append(_rewrite_hop(gm, hop))
    for region in _inlined_regions(graph):
        notes.append(_rewrite_region(graph, region))
    if notes:
        graph.lint()
        gm.recompile()
        for line in notes:
            log.debug("%s", line)
    return notes


def _leaves_problem(a: fx.Node, b: fx.Node) -> Optional[str]:
    """Why the leaves cannot be ``linear_scan``'s operands (None: they can): floating point of one dtype
    and shapes that broadcast, as the example values show."""
    va, vb = example_value(a), example_value(b)
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
        return "leaves without example values"
    if va.dtype != vb.dtype or not va.is_floating_point():
        return f"leaves of dtypes {va.dtype} and {vb.dtype} (one floating dtype is supported)"
    try:
        torch.broadcast_shapes(va.shape, vb.shape)
    except RuntimeError:
        return f"leaves of shapes {list(va.shape)} and {list(vb.shape)} that do not broadcast"
    return None


def _replace_outputs(graph: fx.Graph, before: fx.Node, a: fx.Node, b: fx.Node, uses: dict[int, list]) -> None:
    """Insert ``cumprod(a, 0)`` (if read) and ``linear_scan(a, b, 0)`` before ``before``; ``uses[i]`` lists
    the nodes that stand for output i (0: the products, 1: the states)."""
    with graph.inserting_before(before):
        made = {}
        if uses.get(0):
            made[0] = graph.call_function(torch.cumprod, (a, 0))
        if uses.get(1):
            made[1] = graph.call_function(linear_scan, (a, b, 0))
    for i, nodes in uses.items():
        if nodes:  # the same value: its example (shape, dtype) for the analysis
            made[i].meta.update({k: v for k, v in nodes[0].meta.items() if k in ("example_value", "val")})
        for n in nodes:
            n.replace_all_uses_with(made[i])


def _rewrite_hop(gm: fx.GraphModule, hop: fx.Node) -> str:
    """The HOP form (module docstring): ``associative_scan(combine, [a, b], ())[i]`` -> the two nodes."""
    body_node, xs, extra = (list(hop.args) + [None, None, None])[:3]
    if not isinstance(xs, (list, tuple)) or len(xs) != 2 or extra:
        return f"{hop.name}: associative_scan over {len(xs) if isinstance(xs, (list, tuple)) else '?'} leaves " \
               f"with additional inputs {extra!r} {LEFT} (two leaves (a, b), none extra, are an affine scan)"
    if not isinstance(body_node, fx.Node) or body_node.op != "get_attr":
        return f"{hop.name}: associative_scan whose combine_fn is not a subgraph {LEFT}"
    why = is_affine_combine(getattr(gm, body_node.target)) or _leaves_problem(xs[0], xs[1])
    if why is not None:
        return f"{hop.name}: associative_scan with {why} {LEFT}"
    uses: dict[int, list] = {0: [], 1: []}
    for u in hop.users:
        if u.target is not operator.getitem or not isinstance(u.args[1], int):
            return f"{hop.name}: associative_scan whose result is read by {u.name} {LEFT}"
        uses[u.args[1]].append(u)
    _replace_outputs(gm.graph, hop, xs[0], xs[1], uses)
    for i in (0, 1):
        for u in uses[i]:
            gm.graph.erase_node(u)
    gm.graph.erase_node(hop)
    return f"{hop.name}: associative_scan of affine maps -> linear_scan"


# --------------------------------------------------------------------------------------------------
# the inlined form


@dataclasses.dataclass
class _Region:
    """An inlined generic associative scan: ``entries`` (``movedim(x, d, 0)`` of the leaves, in graph order),
    ``exits`` (``movedim(y, 0, d)`` of the outputs), ``inner`` every node strictly between them."""

    entries: list[fx.Node]
    exits: list[fx.Node]
    inner: list[fx.Node]
    dim: int


def _movedim_args(n: fx.Node) -> Optional[tuple[fx.Node, int, int]]:
    if n.op not in ("call_function", "call_method") or n.target not in MOVEDIMS:
        return None
    args = list(n.args) + [n.kwargs.get(k) for k in ("source", "destination") if k in n.kwargs]
    if len(args) != 3 or not isinstance(args[0], fx.Node) or not all(isinstance(d, int) for d in args[1:]):
        return None
    return args[0], args[1], args[2]


def _is_entry(n: fx.Node) -> bool:
    m = _movedim_args(n)
    return m is not None and m[2] == 0 and m[1] > 0


def _data_movement_ok(n: fx.Node) -> bool:
    """A node of the inlined recursion that moves data along dim 0 only (module docstring)."""
    t = n.target
    args = list(n.args)
    if n.op == "call_function" and t in ATEN_SLICES:
        return len(args) >= 2 and args[1] == 0
    if n.op == "call_function" and t in _CATS:
        return n.kwargs.get("dim", args[1] if len(args) > 1 else 0) == 0
    if n.op == "call_function" and t is torch.stack:
        return n.kwargs.get("dim", args[1] if len(args) > 1 else 0) in (0, 1)
    if t in FLATTENS:
        start = n.kwargs.get("start_dim", args[1] if len(args) > 1 else 0)
        end = n.kwargs.get("end_dim", args[2] if len(args) > 2 else -1)
        return start == 0 and end == 1
    if n.op == "call_function" and t in _PADS:
        pad = n.kwargs.get("pad", args[1] if len(args) > 1 else None)
        mode = n.kwargs.get("mode", args[2] if len(args) > 2 else "constant")
        return isinstance(pad, (list, tuple)) and len(pad) >= 2 and not any(pad[:-2]) and mode == "constant"
    if n.op == "call_function" and t is predispatch._add_batch_dim:
        return len(args) >= 2 and args[1] == 0
    if n.op == "call_function" and t is predispatch._remove_batch_dim:
        return len(args) >= 4 and args[3] == 0
    return False


def _allowed_inner(n: fx.Node) -> bool:
    if n.op == "call_function" and n.target in VMAP_CONTROL:
        return True
    return n.op in ("call_function", "call_method") and (_data_movement_ok(n) or _is_pointwise(n))


def _inlined_regions(graph: fx.Graph) -> list[_Region]:
    """Every maximal span ``entries, inner..., exits`` of the graph that has the inlined form's shape: it
    starts with ``movedim(x, d, 0)`` nodes, holds vmap bookkeeping (one ``_add_batch_dim`` at least), and its
    inner nodes are all allowed ops (data movement along dim 0, pointwise arithmetic); it ends with the
    ``movedim(y, 0, d)`` nodes that read the inner nodes."""
    nodes = list(graph.nodes)
    regions = []
    i = 0
    while i < len(nodes):
        if not _is_entry(nodes[i]):
            i += 1
            continue
        d = _movedim_args(nodes[i])[1]
        j = i
        entries = []
        while j < len(nodes) and _is_entry(nodes[j]) and _movedim_args(nodes[j])[1] == d:
            entries.append(nodes[j])
            j += 1
        inner = []
        while j < len(nodes) and _allowed_inner(nodes[j]) and not _is_exit(nodes[j], d):
            inner.append(nodes[j])
            j += 1
        exits = []
        while j < len(nodes) and _is_exit(nodes[j], d):
            exits.append(nodes[j])
            j += 1
        if len(entries) == 2 and exits and any(n.target is predispatch._add_batch_dim for n in inner):
            regions.append(_Region(entries, exits, inner, d))
        i = max(j, i + 1)
    return regions


def _is_exit(n: fx.Node, d: int) -> bool:
    m = _movedim_args(n)
    return m is not None and m[1] == 0 and m[2] == d


def _closed(region: _Region) -> Optional[str]:
    """Why the region is not self-contained (None: it is): an inner node read outside it, an inner node or
    exit reading a node outside it (other than the entries)."""
    inside = set(region.entries) | set(region.inner)
    for n in region.inner:
        for u in n.users:
            if u not in inside and u not in region.exits:
                return f"{n.name} is read by {u.name} outside the scan"
    for n in region.inner + region.exits:
        for a in n.all_input_nodes:
            if a not in inside:
                return f"{n.name} reads {a.name} from outside the scan"
    for e in region.entries:
        for u in e.users:
            if u not in inside:
                return f"the leaf {e.name} is read by {u.name} outside the scan"
    return None


def _probe_region(graph: fx.Graph, region: _Region) -> tuple[Optional[dict[fx.Node, int]], str]:
    """Evaluate the region on random float64 leaves: ``({exit: 0 | 1}, "")`` when leaf 0 is a and leaf 1 is b
    and every exit is ``cumprod(a)`` (0) or ``linear_scan(a, b)`` (1) moved back; (None, why) otherwise."""
    fn = probe.region_module(region.entries, region.inner, tuple(x.args[0] for x in region.exits), prefix="leaf")
    shapes = []
    for e in region.entries:
        v = example_value(e)
        if not isinstance(v, torch.Tensor) or not all(isinstance(s, int) for s in v.shape):
            return None, f"the leaf {e.name} has no static shape"
        shapes.append((v.shape[0],) + tuple(min(s, 2) for s in v.shape[1:]))
    g = probe.generator(0)
    a = 0.5 + probe.uniform(shapes[0], g)
    b = probe.normal(shapes[1], g)
    try:
        with torch.no_grad():
            outs = probe.run(fn, a, b)  # closes a vmap level the failed probe left open
    except Exception as e:  # noqa: BLE001  (a region that does not run on the probe is not proved)
        return None, f"the scan does not run on probes ({type(e).__name__}: {e})"
    want = (torch.cumprod(a, 0), linear_scan(a, b, 0))
    which = {}
    for x, got in zip(region.exits, outs):
        k = next((k for k in (1, 0) if _agree(got, want[k])), None)
        if k is None:
            return None, f"{x.name} is neither the running product nor the affine recurrence of the leaves"
        which[x] = k
    return which, ""


def _rewrite_region(graph: fx.Graph, region: _Region) -> str:
    first = region.entries[0].name
    why = _closed(region) or _leaves_problem(*region.entries)
    which = None
    if why is None:
        which, why = _probe_region(graph, region)
    if which is None:
        return f"{first}: an inlined associative_scan {LEFT}: {why}"
    a, b = region.entries
    uses = {0: [x.args[0] for x, k in which.items() if k == 0 and x.users],
            1: [x.args[0] for x, k in which.items() if k == 1]}
    dead = [x for x, k in which.items() if k == 0 and not x.users]
    _replace_outputs(graph, region.exits[0], a, b, uses)
    for n in dead + list(reversed(region.inner)):
        graph.erase_node(n)
    return f"{first}: inlined associative_scan of affine maps along dim {region.dim} -> linear_scan"
