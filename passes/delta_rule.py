"""The chunked gated delta rule as one ``matrix_scan``, before the analysis (docs/ARCHITECTURE.md §3.4).

The gated delta rule (Qwen3-Next's gated DeltaNet) keeps a state ``S_t [dk, dv]`` per head:

    S_t = exp(g_t) (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ,    o_t = S_tᵀ q_t     (S_{-1} = 0)

a matrix-affine recurrence ``S_t = M_t S_{t-1} + b_t`` with ``M_t = exp(g_t) (I - β_t k_t k_tᵀ)``, ``b_t = β_t k_t
v_tᵀ``. HF computes it chunked (``torch_chunk_gated_delta_rule``): the sequence padded to a multiple of the chunk,
a unit-triangular solve per chunk (the UT transform of the delta updates), a loop over chunks carrying the state.
No token-axis rule reads that: the chunk reshape mixes positions. This pass finds the region and, when it is
proved to be the recurrence, replaces it by ``M``, ``b``, ``S = matrix_scan(M, b, pos)`` (backends/matrix_scan.py)
and ``o = Σ_i S[..., i, :] q[..., i]``, in the analysis copy (the user's graph is untouched). The rule of
``matrix_scan`` (passes/rules/matrix_scan.py) then makes it ``brcompile::tree_matrix_scan`` along the tree paths.

**The region.** Anchored at a unit-triangular ``solve_triangular``. Its output ``o`` is the first 4-D descendant
of the anchor (graph order) whose shapes fit the roles (below) and whose backward closure — stopped at right pads of one token dim (``F.pad(x, (0, 0,
0, p))``, ``F.pad(x, (0, p))``: the chunk padding) — is *closed*: it reads nothing but those pads' inputs and
constants (no placeholder, no parameter), and none of its nodes but ``o`` is read outside it by a live node (the
chunked loop's unused final state is dead and goes with it). Its inputs are the pads' inputs: three
``[B, H, L, d]`` values and two ``[B, H, L]`` values, the output ``[B, H, L, dv]``.

**The proof obligation.** Roles are assigned by shape (q and k ``[B, H, L, dk]``, v ``[B, H, L, dv]``, β and g
``[B, H, L]``); every assignment the shapes allow is tried. The region, copied with its floating dtypes made
float64 and its devices the CPU, is evaluated on two random float64 probes at the graph's own shapes (the chunk
padding is a constant of the captured graph: another length is another graph, proved anew) — k and q unit
vectors as the layer's
l2-normalisation makes them, β in (0, 1), g in (-1, 0) — and must equal the emitted replacement (the very nodes
inserted, run on the same probes) within ``linear_scans.PROBE_TOL`` relative (:func:`.linear_scans.probes_agree`). An assignment that passes is the rewrite. A
region that fails any check stays as it is (its ops then go dense, and passes/repack.py may pack the region's
output again), with a note naming why.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from brcompile.backends.matrix_scan import matrix_scan
from brcompile.passes.axes import example_value
from brcompile.passes.masks import ancestors, descendants
from brcompile.passes.linear_scans import LEFT, probes_agree
from brcompile.passes.spellings import is_op

log = logging.getLogger(__name__)

__all__ = ["canonicalize_delta_rules", "emit_delta_rule"]

_SOLVE_TRIANGULAR = ("solve_triangular", "linalg_solve_triangular")
_ROLES = ("q", "k", "v", "beta", "g")


def _is_anchor(n: fx.Node) -> bool:
    """A unit-triangular ``solve_triangular`` (any spelling): the UT transform of a chunked delta rule."""
    name = getattr(n.target, "__name__", str(n.target))
    return n.op in ("call_function", "call_method") and name in _SOLVE_TRIANGULAR \
        and bool(n.kwargs.get("unitriangular", False))


def _sequence_pad(n: fx.Node) -> bool:
    """``F.pad(x, (0, 0, 0, p))`` of a 4-D or ``F.pad(x, (0, p))`` of a 3-D value with zeros: a right pad of
    the token dim (dim 2 of ``[B, H, L, ...]``)."""
    if not is_op(n, "pad") or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    pad = n.kwargs.get("pad", n.args[1] if len(n.args) > 1 else None)
    mode = n.kwargs.get("mode", n.args[2] if len(n.args) > 2 else "constant")
    value = n.kwargs.get("value", n.args[3] if len(n.args) > 3 else None)
    v = example_value(n.args[0])
    if not isinstance(v, torch.Tensor) or not isinstance(pad, (tuple, list)) or mode != "constant" \
            or value not in (None, 0, 0.0):
        return False
    want = {4: 4, 3: 2}.get(v.dim())
    return want is not None and len(pad) == want and not any(pad[:-1])


# --------------------------------------------------------------------------------------------------
# the region


@dataclasses.dataclass
class _Region:
    """``nodes`` (graph order, output included), ``inputs`` (the pads' inputs, graph order), ``output``,
    ``dead`` (nodes reading the region that nothing live reads: the loop's unused final state)."""

    nodes: list[fx.Node]
    inputs: list[fx.Node]
    output: fx.Node
    dead: set


def _live(graph: fx.Graph) -> set:
    """Nodes the graph's output depends on."""
    return set(ancestors(next(n for n in reversed(graph.nodes) if n.op == "output")))


def _closure(x: fx.Node) -> Optional[tuple[set, list]]:
    """The backward closure of ``x`` stopped at sequence pads: (nodes, pad inputs), or None when it reads a
    placeholder or a parameter (the region reads something it does not compute)."""
    nodes, inputs, todo = {x}, [], [x]
    while todo:
        n = todo.pop()
        if n.op in ("placeholder", "get_attr"):
            return None
        if _sequence_pad(n):
            if n.args[0] not in inputs:
                inputs.append(n.args[0])
            continue
        for a in n.all_input_nodes:
            if a not in nodes:
                nodes.add(a)
                todo.append(a)
    return nodes, inputs


def _region_at(anchor: fx.Node, order: dict, live: set) -> Optional[_Region]:
    """The closed region around ``anchor`` (module docstring), or None."""
    seen = descendants([anchor]) | {anchor}
    for x in sorted(seen, key=order.__getitem__):
        v = example_value(x)
        if not isinstance(v, torch.Tensor) or v.dim() != 4 or x not in live:
            continue
        got = _closure(x)
        if got is None:
            continue
        nodes, inputs = got
        if not _closed(nodes, x, live):
            continue
        dead = {u for n in nodes for u in descendants([n]) if u not in live}
        region = _Region(sorted(nodes, key=order.__getitem__), sorted(inputs, key=order.__getitem__), x, dead)
        if _assignments(region):
            return region
    return None


def _closed(nodes: set, output: fx.Node, live: set) -> bool:
    """No node of the region but its output is read by a live node outside it."""
    return all(u in nodes or u not in live for n in nodes if n is not output for u in n.users)


# --------------------------------------------------------------------------------------------------
# the replacement


def emit_delta_rule(graph: fx.Graph, q: Any, k: Any, v: Any, beta: Any, g: Any, dk: int, dtype: torch.dtype,
                    device: Any) -> fx.Node:
    """Insert (at the graph's insertion point) ``o = Σ_i S[..., i, :] q[..., i]`` with ``S = matrix_scan(M, b,
    2)``, ``M = exp(g)[..., None, None] (I - β k kᵀ)``, ``b = (β k) vᵀ`` for ``[B, H, L, ·]`` operands; returns o."""
    def f(target, *args, **kwargs):
        return graph.call_function(target, args, kwargs)

    kk = f(torch.mul, f(torch.unsqueeze, k, -1), f(torch.unsqueeze, k, -2))            # k kᵀ  [B, H, L, dk, dk]
    bet = f(torch.unsqueeze, beta, -1)                                                # [B, H, L, 1]
    eye = f(torch.eye, dk, dtype=dtype, device=device)
    decay = f(torch.unsqueeze, f(torch.unsqueeze, f(torch.exp, g), -1), -1)           # exp(g) [B, H, L, 1, 1]
    M = f(torch.mul, decay, f(torch.sub, eye, f(torch.mul, f(torch.unsqueeze, bet, -1), kk)))
    b = f(torch.mul, f(torch.unsqueeze, f(torch.mul, bet, k), -1), f(torch.unsqueeze, v, -2))  # β k vᵀ
    S = f(matrix_scan, M, b, 2)
    return f(torch.sum, f(torch.mul, S, f(torch.unsqueeze, q, -1)), -2)              # Sᵀ q  [B, H, L, dv]


def _replacement(shapes: dict, dtype: torch.dtype, device: Any) -> Callable:
    """The emitted replacement as a callable of (q, k, v, beta, g): the same nodes, in their own graph."""
    sub = fx.Graph()
    ph = [sub.placeholder(r) for r in _ROLES]
    sub.output(emit_delta_rule(sub, *ph, dk=shapes["q"][-1], dtype=dtype, device=device))
    return fx.GraphModule(torch.nn.Module(), sub)


def _f64(x: Any) -> Any:
    """A floating dtype argument made float64 and a device the CPU (the probe's copy of the region computes in
    float64 on the CPU, whatever the graph's dtype and device)."""
    if isinstance(x, torch.dtype) and x.is_floating_point:
        return torch.float64
    if isinstance(x, torch.device):
        return torch.device("cpu")
    return x


def _region_callable(region: _Region) -> Callable:
    sub = fx.Graph()
    env: dict = {x: sub.placeholder(f"in{i}") for i, x in enumerate(region.inputs)}
    for n in region.nodes:
        c = sub.node_copy(n, lambda a: env[a])
        c.args = fx.node.map_aggregate(c.args, _f64)
        c.kwargs = fx.node.map_aggregate(c.kwargs, _f64)
        env[n] = c
    sub.output(env[region.output])
    return fx.GraphModule(torch.nn.Module(), sub)


def _assignments(region: _Region) -> list[dict]:
    """Every role assignment of the inputs the shapes allow (module docstring)."""
    shapes = [tuple(example_value(x).shape) for x in region.inputs]
    if not all(isinstance(s, int) for sh in shapes for s in sh):
        return []
    four = [i for i, s in enumerate(shapes) if len(s) == 4]
    three = [i for i, s in enumerate(shapes) if len(s) == 3]
    out_shape = tuple(example_value(region.output).shape)
    if len(four) != 3 or len(three) != 2:
        return []
    got = []
    for (qi, ki, vi), (bi, gi) in itertools.product(itertools.permutations(four), itertools.permutations(three)):
        s = {"q": shapes[qi], "k": shapes[ki], "v": shapes[vi], "beta": shapes[bi], "g": shapes[gi]}
        if s["q"] == s["k"] and s["v"][:3] == s["q"][:3] == s["beta"] == s["g"] and out_shape == s["v"]:
            got.append(dict(q=qi, k=ki, v=vi, beta=bi, g=gi))
    return got


def _probe_inputs(shapes: dict, seed: int) -> dict:
    """Random float64 probes: q, k unit vectors, β in (0, 1), g in (-1, 0), v normal."""
    gen = torch.Generator().manual_seed(seed)
    unit = [torch.nn.functional.normalize(torch.randn(shapes[r], generator=gen, dtype=torch.float64), dim=-1)
            for r in ("q", "k")]
    return dict(q=unit[0], k=unit[1], v=torch.randn(shapes["v"], generator=gen, dtype=torch.float64),
                beta=torch.rand(shapes["beta"], generator=gen, dtype=torch.float64),
                g=-torch.rand(shapes["g"], generator=gen, dtype=torch.float64))


def _prove(region: _Region) -> tuple[Optional[dict], str]:
    """(the role assignment, "") when the region equals the emitted recurrence on the probes; (None, why)."""
    roles = _assignments(region)
    if not roles:
        shapes = [list(example_value(x).shape) for x in region.inputs]
        return None, (f"inputs of shapes {shapes} and output {list(example_value(region.output).shape)} are not "
                      f"q, k [B, H, L, dk], v [B, H, L, dv], beta, g [B, H, L] (static shapes)")
    fn = _region_callable(region)
    first = roles[0]
    shapes = {r: tuple(example_value(region.inputs[first[r]]).shape) for r in _ROLES}
    replacement = _replacement(shapes, torch.float64, torch.device("cpu"))
    probes = [_probe_inputs(shapes, seed) for seed in (0, 1)]
    try:
        with torch.no_grad():
            want = [replacement(*(p[r] for r in _ROLES)) for p in probes]
    except Exception as e:  # noqa: BLE001  (a replacement that cannot run at these shapes proves nothing)
        return None, f"the recurrence does not run at the region's shapes ({type(e).__name__}: {e})"
    for role in roles:
        ok = True
        for p, w in zip(probes, want):
            args = [None] * len(region.inputs)
            for r, i in role.items():
                args[i] = p[r]
            try:
                with torch.no_grad():
                    got = fn(*args)
            except Exception:  # noqa: BLE001  (a region that does not run on the probe is not proved)
                ok = False
                break
            if not probes_agree(got, w):
                ok = False
                break
        if ok:
            return role, ""
    return None, "the region does not equal the gated delta rule recurrence on random probes"


def _fill_meta(nodes: list[fx.Node], like: Any) -> None:
    """Example values of inserted nodes: their ops run on the operands' example values, in the fake mode of
    ``like`` (an operand's example value) when it is a fake tensor."""
    mode = getattr(like, "fake_mode", None)
    for n in nodes:
        args = fx.node.map_arg(n.args, example_value)
        kwargs = fx.node.map_arg(n.kwargs, example_value)
        with mode if mode is not None else contextlib.nullcontext():
            n.meta["example_value"] = n.target(*args, **kwargs)


def _rewrite(graph: fx.Graph, region: _Region, role: dict) -> None:
    q, k, v, beta, g = (region.inputs[role[r]] for r in _ROLES)
    kv = example_value(k)
    before = set(graph.nodes)
    with graph.inserting_before(region.output):
        o = emit_delta_rule(graph, q, k, v, beta, g, dk=kv.shape[-1], dtype=example_value(region.output).dtype,
                            device=kv.device)
    _fill_meta([n for n in graph.nodes if n not in before], kv)
    region.output.replace_all_uses_with(o)
    doomed = set(region.nodes) | region.dead
    for n in reversed(list(graph.nodes)):
        if n in doomed and not n.users:
            graph.erase_node(n)


# --------------------------------------------------------------------------------------------------
# driver


def canonicalize_delta_rules(gm: fx.GraphModule) -> list[str]:
    """Rewrite every proved chunked gated delta rule of ``gm`` (modified in place: the analysis copy) as a
    ``matrix_scan``; returns one note per region rewritten or left as it is."""
    graph = gm.graph
    anchors = [n for n in graph.nodes if _is_anchor(n)]
    if not anchors:
        return []
    notes: list[str] = []
    done: set = set()
    for anchor in anchors:
        if anchor in done or anchor.graph is not graph:
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        region = _region_at(anchor, order, _live(graph))
        if region is None:
            done.add(anchor)
            notes.append(f"{anchor.name}: a triangular solve without a closed region from sequence pads of q, k, "
                         f"v [B, H, L, d], beta, g [B, H, L] to one [B, H, L, dv] output (static shapes) {LEFT}")
            continue
        done.update(n for n in region.nodes if _is_anchor(n))
        role, why = _prove(region)
        if role is None:
            notes.append(f"{anchor.name}: a chunked gated delta rule {LEFT}: {why}")
            continue
        names = ", ".join(f"{r}={region.inputs[i].name}" for r, i in role.items())
        _rewrite(graph, region, role)
        notes.append(f"{anchor.name}: chunked gated delta rule ({names}) -> matrix_scan")
    if any(n.endswith("-> matrix_scan") for n in notes):
        graph.lint()
        gm.recompile()
    for line in notes:
        log.debug("%s", line)
    return notes
