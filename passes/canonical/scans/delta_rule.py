"""The chunked gated delta rule as one ``matrix_scan``, before the analysis (docs/ARCHITECTURE.md §3.3).

The gated delta rule keeps a state ``S_t [dk, dv]`` per head. With a scalar gate ``g [B, H, L]`` (Qwen3-Next's
gated DeltaNet, Qwen3.5, OLMo-hybrid):

    S_t = exp(g_t) (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ,    o_t = S_tᵀ q_t     (S_{-1} = 0)

with a per-channel gate ``g [B, H, L, dk]`` (Kimi-Linear's KDA: the decay first, then the delta update):

    S_t = (I - β_t k_t k_tᵀ) diag(exp g_t) S_{t-1} + β_t k_t v_tᵀ,    o_t = S_tᵀ q_t

a matrix-affine recurrence ``S_t = M_t S_{t-1} + b_t`` with ``M_t`` the factor of ``S_{t-1}`` and ``b_t = β_t k_t
v_tᵀ``. HF computes it chunked (``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention``): the sequence
padded to a multiple of the chunk, the UT transform of the delta updates inverted per chunk (a unit-triangular
``solve_triangular``, or a forward-substitution loop of writes ``attn[..., i, :i] = row + (row[..., None] *
sub).sum(-2)`` that Dynamo unrolls and passes/lower/functionalize.py makes select/slice scatters), a loop over chunks
carrying the state. No token-axis rule reads that: the chunk reshape mixes positions. This pass finds the region
and, when it is proved to be the recurrence, replaces it by ``M``, ``b``, ``S = matrix_scan(M, b, pos)``
(backends/scan/matrix.py) and ``o = Σ_i S[..., i, :] q[..., i]``, in the analysis copy (the user's graph is
untouched). The rule of ``matrix_scan`` (passes/analysis/rules/matrix_scan.py) then makes it ``brcompile::tree_matrix_scan``
along the tree paths.

**The region.** Anchored on a group of right pads of one token dim (``F.pad(x, (0, 0, 0, p))``, ``F.pad(x, (0,
p))``: the chunk padding): the nodes computed from sequence pads and constants only, one connected group of
them, that splits the token dim into chunks (a reshape ``[B, H, L, d] -> [B, H, L / c, c, d]``); how the chunk
system is inverted does not matter (the anchor only finds candidates, the proof decides). Its output ``o`` is
the first live node of the group (graph order) of the shape of a 4-D pad input whose backward closure, stopped
at the pads, is *closed*: none of its nodes but ``o`` is read outside it by a live node (the chunked loop's
unused final state is dead and goes with it), whose inputs (the pads' inputs, in the order of their pads) some
role assignment fits (below), and which is proved; the next such node is tried when one is not. Its inputs:
three ``[B, H, L, d]`` values and two ``[B, H, L]`` values (scalar gate) or four and one (per-channel gate), the
output ``[B, H, L, dv]``. A pad the region reads only through a multiplication by a number (KDA's ``F.pad(q, …)
* scale``) is the input times that number (``pad(x) · s = pad(x · s)``).

**The proof obligation.** Roles are assigned by shape (q and k ``[B, H, L, dk]``, v ``[B, H, L, dv]``, β ``[B,
H, L]``, g ``[B, H, L]`` or ``[B, H, L, dk]``, the gate form following g's shape); every assignment the shapes
allow is tried, the inputs' own order first. The region, copied with its floating dtypes made float64 and its
devices the CPU, is evaluated on two random float64 probes at the graph's own shapes (the chunk padding is a
constant of the captured graph: another length is another graph, proved anew) — k and q unit vectors as the
layer's l2-normalisation makes them, β in (0, 1), g in (-1, 0) (every entry, per head or per channel) — and
must equal the emitted replacement of that gate form (the very nodes inserted, run on the same probes) within
1e-9 relative (:data:`.probe.RECURRENCE`; casts to a floating dtype, ``.float()``
included, are float64 in the copy). An assignment that passes is the
rewrite. A region that fails any check stays as it is (its ops then go dense, and passes/analysis/repack.py may pack the
region's output again), with a note naming why.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from typing import Any, Optional

import torch
import torch.fx as fx

from brcompile.backends.scan.matrix import matrix_scan
from brcompile.passes.analysis.axes import example_value
from brcompile.passes import probe
from brcompile.passes.canonical.scans.linear import LEFT
from brcompile.passes.probe import ancestors
from brcompile.passes.spellings import FLOAT_CASTS, arg, is_op

log = logging.getLogger(__name__)

__all__ = ["canonicalize_delta_rules", "emit_delta_rule"]

_ROLES = ("q", "k", "v", "beta", "g")
#: the two gate forms: ``g [B, H, L]`` (one decay per head) or ``g [B, H, L, dk]`` (one per key channel)
GATES = ("scalar", "channel")


def _sequence_pad(n: fx.Node) -> bool:
    """``F.pad(x, (0, 0, 0, p))`` of a 4-D or ``F.pad(x, (0, p))`` of a 3-D value with zeros: a right pad of
    the token dim (dim 2 of ``[B, H, L, ...]``)."""
    if not is_op(n, "pad") or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    pad = arg(n, 1, "pad")
    mode = arg(n, 2, "mode", "constant")
    value = arg(n, 3, "value")
    v = example_value(n.args[0])
    if not isinstance(v, torch.Tensor) or not isinstance(pad, (tuple, list)) or mode != "constant" \
            or value not in (None, 0, 0.0):
        return False
    want = {4: 4, 3: 2}.get(v.dim())
    return want is not None and len(pad) == want and not any(pad[:-1])


def _chunk_reshape(n: fx.Node) -> bool:
    """A reshape of ``[B, H, L, d]`` into ``[B, H, L / c, c, d]`` or of ``[B, H, L]`` into ``[B, H, L / c, c]``:
    the token dim split into chunks."""
    if not is_op(n, "reshape") or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    x, y = example_value(n.args[0]), example_value(n)
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor) or x.dim() not in (3, 4) \
            or y.dim() != x.dim() + 1:
        return False
    xs, ys = tuple(x.shape), tuple(y.shape)
    return xs[:2] == ys[:2] and xs[3:] == ys[4:] and xs[2] == ys[2] * ys[3]


# --------------------------------------------------------------------------------------------------
# the region


@dataclasses.dataclass
class _Region:
    """``nodes`` (graph order, output included), ``inputs`` (the pads' inputs, in the order of their pads),
    ``output``, ``dead`` (nodes reading the region that nothing live reads: the loop's unused final state),
    ``scales`` (per input, the number its padded value is multiplied by before anything else reads it, or
    None)."""

    nodes: list[fx.Node]
    inputs: list[fx.Node]
    output: fx.Node
    dead: set
    scales: list


def _live(graph: fx.Graph) -> set:
    """Nodes the graph's output depends on."""
    return set(ancestors(next(n for n in reversed(graph.nodes) if n.op == "output")))


def _pad_groups(graph: fx.Graph) -> list[list[fx.Node]]:
    """The nodes computed from sequence pads and constants only (the pads included; a constant is a node
    computed from no graph input: ``ones``, ``eye``, ``zeros``), split into connected groups, each in graph
    order — one group per chunked computation of padded sequences."""
    derived: set = set()
    const: set = set()
    for n in graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        ins = n.all_input_nodes
        if _sequence_pad(n):
            derived.add(n)
        elif all(a in derived or a in const for a in ins):
            (derived if any(a in derived for a in ins) else const).add(n)
    root = {n: n for n in derived}

    def find(n: fx.Node) -> fx.Node:
        while root[n] is not n:
            root[n] = root[root[n]]
            n = root[n]
        return n

    for n in derived:
        for a in n.all_input_nodes:
            if a in derived:
                root[find(a)] = find(n)
    groups: dict = {}
    for n in graph.nodes:
        if n in derived:
            groups.setdefault(find(n), []).append(n)
    return list(groups.values())


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


def _candidates(group: list[fx.Node], order: dict, live: set) -> list[_Region]:
    """The closed regions of a pad group (module docstring), by their output in graph order: outputs of the
    shape of a 4-D pad input, live, whose closure no live node outside reads and whose inputs some role
    assignment fits."""
    shapes = {tuple(example_value(p.args[0]).shape) for p in group
              if _sequence_pad(p) and example_value(p.args[0]).dim() == 4}
    got = []
    for x in group:
        v = example_value(x)
        if _sequence_pad(x) or x not in live or not isinstance(v, torch.Tensor) or tuple(v.shape) not in shapes:
            continue
        closure = _closure(x)
        if closure is None or not _closed(closure[0], x, live):
            continue
        nodes, inputs = closure
        first_pad = {}
        for n in sorted(nodes, key=order.__getitem__):
            if _sequence_pad(n):
                first_pad.setdefault(n.args[0], order[n])
        inputs = sorted(inputs, key=first_pad.__getitem__)
        region = _Region(sorted(nodes, key=order.__getitem__), inputs, x, _dead(nodes, live),
                         [_pad_scale(i, nodes) for i in inputs])
        if _assignments(region):
            got.append(region)
    return got


def _pad_scale(x: fx.Node, nodes: set) -> Optional[float]:
    """The number ``s`` when the region reads the padded ``x`` only as ``pad(x) * s`` (KDA's ``F.pad(q, …) *
    scale``: ``pad(x) · s = pad(x · s)``, so the recurrence reads ``x · s``), else None."""
    scales = set()
    for p in x.users:
        if p not in nodes or not _sequence_pad(p):
            continue
        for u in p.users:
            if u not in nodes:
                continue
            other = [a for a in (*u.args, *u.kwargs.values()) if a is not p]
            if not is_op(u, "mul") or len(other) != 1 or isinstance(other[0], bool) \
                    or not isinstance(other[0], (int, float)):
                return None
            scales.add(other[0])
    return scales.pop() if len(scales) == 1 else None


def _closed(nodes: set, output: fx.Node, live: set) -> bool:
    """No node of the region but its output is read by a live node outside it."""
    return all(u in nodes or u not in live for n in nodes if n is not output for u in n.users)


def _dead(nodes: set, live: set) -> set:
    """The nodes reading ``nodes`` that nothing live reads, and their readers (a reader of a dead node is dead)."""
    dead: set = set()
    todo = [u for n in nodes for u in n.users if u not in live and u not in nodes]
    while todo:
        u = todo.pop()
        if u not in dead:
            dead.add(u)
            todo.extend(u.users)
    return dead


# --------------------------------------------------------------------------------------------------
# the replacement


def emit_delta_rule(graph: fx.Graph, q: Any, k: Any, v: Any, beta: Any, g: Any, dk: int, dtype: torch.dtype,
                    device: Any, gate: str = "scalar", scales: Optional[dict] = None) -> fx.Node:
    """Insert (at the graph's insertion point) ``o = Σ_i S[..., i, :] q[..., i]`` with ``S = matrix_scan(M, b,
    2)``, ``b = (β k) vᵀ`` and ``M = exp(g)[..., None, None] (I - β k kᵀ)`` for a scalar gate ``g [B, H, L]``,
    ``M = (I - β k kᵀ) diag(exp g)`` (column j scaled by ``exp(g_j)``) for a per-channel gate ``g [B, H, L, dk]``,
    the other operands ``[B, H, L, ·]``, each first multiplied by its number in ``scales`` (role -> number) if
    any; returns o."""
    def f(target, *args, **kwargs):
        return graph.call_function(target, args, kwargs)

    ops = dict(q=q, k=k, v=v, beta=beta, g=g)
    for r, s in (scales or {}).items():
        ops[r] = f(torch.mul, ops[r], s)
    q, k, v, beta, g = (ops[r] for r in _ROLES)

    kk = f(torch.mul, f(torch.unsqueeze, k, -1), f(torch.unsqueeze, k, -2))            # k kᵀ  [B, H, L, dk, dk]
    bet = f(torch.unsqueeze, beta, -1)                                                # [B, H, L, 1]
    eye = f(torch.eye, dk, dtype=dtype, device=device)
    delta = f(torch.sub, eye, f(torch.mul, f(torch.unsqueeze, bet, -1), kk))          # I - β k kᵀ
    if gate == "scalar":
        M = f(torch.mul, f(torch.unsqueeze, f(torch.unsqueeze, f(torch.exp, g), -1), -1), delta)
    else:
        M = f(torch.mul, delta, f(torch.unsqueeze, f(torch.exp, g), -2))              # (I - β k kᵀ) diag(exp g)
    b = f(torch.mul, f(torch.unsqueeze, f(torch.mul, bet, k), -1), f(torch.unsqueeze, v, -2))  # β k vᵀ
    S = f(matrix_scan, M, b, 2)
    return f(torch.sum, f(torch.mul, S, f(torch.unsqueeze, q, -1)), -2)              # Sᵀ q  [B, H, L, dv]


def _replacement(shapes: dict, dtype: torch.dtype, device: Any, gate: str, scales: dict) -> fx.GraphModule:
    """The emitted replacement as a graph module of (q, k, v, beta, g): the same nodes, in their own graph."""
    sub = fx.Graph()
    ph = [sub.placeholder(r) for r in _ROLES]
    sub.output(emit_delta_rule(sub, *ph, dk=shapes["q"][-1], dtype=dtype, device=device, gate=gate,
                               scales=scales))
    return fx.GraphModule(torch.nn.Module(), sub)


def _f64(x: Any) -> Any:
    """A floating dtype argument made float64 and a device the CPU (the probe's copy of the region computes in
    float64 on the CPU, whatever the graph's dtype and device)."""
    if isinstance(x, torch.dtype) and x.is_floating_point:
        return torch.float64
    if isinstance(x, torch.device):
        return torch.device("cpu")
    return x




def _region_callable(region: _Region) -> fx.GraphModule:
    """The region as a graph module of its inputs (in ``region.inputs`` order), computing in float64 on the CPU
    (:func:`_as_f64`)."""
    return probe.region_module(region.inputs, region.nodes, region.output, transform=_as_f64)


def _as_f64(c: fx.Node) -> None:
    """A region node's copy made to compute in float64 on the CPU: its floating dtypes and devices (:func:`_f64`),
    and its ``.float()``-style casts (``.double()``)."""
    c.args = fx.node.map_aggregate(c.args, _f64)
    c.kwargs = fx.node.map_aggregate(c.kwargs, _f64)
    if c.op == "call_method" and c.target in FLOAT_CASTS:  # ``.float()``: a cast to a floating dtype
        c.target = "double"


def _assignments(region: _Region) -> list[tuple[str, dict]]:
    """Every (gate form, role -> input index) the shapes allow (module docstring), the inputs' own order first."""
    shapes = [tuple(example_value(x).shape) for x in region.inputs]
    if not all(isinstance(s, int) for sh in shapes for s in sh):
        return []
    four = [i for i, s in enumerate(shapes) if len(s) == 4]
    three = [i for i, s in enumerate(shapes) if len(s) == 3]
    out_shape = tuple(example_value(region.output).shape)
    got = []
    for gate in GATES:
        roles4, roles3 = (("q", "k", "v"), ("beta", "g")) if gate == "scalar" else (("q", "k", "v", "g"), ("beta",))
        if len(four) != len(roles4) or len(three) != len(roles3):
            continue
        for p4, p3 in itertools.product(itertools.permutations(four), itertools.permutations(three)):
            role = {**dict(zip(roles4, p4)), **dict(zip(roles3, p3))}
            s = {r: shapes[i] for r, i in role.items()}
            bhl = s["q"][:3]
            if s["q"] == s["k"] and s["v"][:3] == bhl == s["beta"] and out_shape == s["v"] \
                    and s["g"] == (bhl if gate == "scalar" else s["q"]):
                got.append((gate, role))
    return got


def _probe_inputs(shapes: dict, seed: int) -> dict:
    """Random float64 probes: q, k unit vectors, β in (0, 1), g in (-1, 0) (each entry, per head or per
    channel), v normal."""
    gen = probe.generator(seed)
    unit = [probe.unit_vectors(shapes[r], gen) for r in ("q", "k")]
    return dict(q=unit[0], k=unit[1], v=probe.normal(shapes["v"], gen), beta=probe.uniform(shapes["beta"], gen),
                g=-probe.uniform(shapes["g"], gen))


def _prove(region: _Region) -> tuple[Optional[tuple[str, dict]], str]:
    """((gate form, role assignment), "") when the region equals the emitted recurrence on the probes, the
    assignments tried in turn; (None, why)."""
    roles = _assignments(region)
    if not roles:
        shapes = [list(example_value(x).shape) for x in region.inputs]
        return None, (f"inputs of shapes {shapes} and output {list(example_value(region.output).shape)} are not "
                      f"q, k [B, H, L, dk], v [B, H, L, dv], beta [B, H, L], g [B, H, L] or [B, H, L, dk] "
                      f"(static shapes)")
    fn = _region_callable(region)
    wanted: dict = {}  # (gate, shapes) -> (probes, the replacement's values on them)
    for gate, role in roles:
        shapes = {r: tuple(example_value(region.inputs[i]).shape) for r, i in role.items()}
        scales = _role_scales(region, role)
        key = (gate, tuple(shapes[r] for r in _ROLES), tuple(sorted(scales.items())))
        if key not in wanted:
            replacement = _replacement(shapes, torch.float64, torch.device("cpu"), gate, scales)
            probes = [_probe_inputs(shapes, seed) for seed in (0, 1)]
            try:
                with torch.no_grad():
                    wanted[key] = (probes, [probe.run(replacement, *(p[r] for r in _ROLES)) for p in probes])
            except Exception as e:  # noqa: BLE001  (a replacement that cannot run at these shapes proves nothing)
                wanted[key] = (probes, None)
                log.debug("the %s-gate recurrence does not run at %s: %s: %s", gate, shapes, type(e).__name__, e)
        probes, want = wanted[key]
        if want is not None and _agrees(fn, region, role, probes, want):
            return (gate, role), ""
    return None, ("the region does not equal the gated delta rule recurrence (scalar or per-channel gate) on "
                  "random probes")


def _role_scales(region: _Region, role: dict) -> dict:
    """role -> the number its input is scaled by in the region (:func:`_pad_scale`), for the scaled ones."""
    return {r: region.scales[i] for r, i in role.items() if region.scales[i] is not None}


def _agrees(fn: fx.GraphModule, region: _Region, role: dict, probes: list, want: list) -> bool:
    """Whether the region, its inputs given by ``role``, equals ``want`` on every probe."""
    for p, w in zip(probes, want):
        args = [None] * len(region.inputs)
        for r, i in role.items():
            args[i] = p[r]
        try:
            with torch.no_grad():
                got = probe.run(fn, *args)
        except Exception:  # noqa: BLE001  (a region that does not run on the probe is not proved)
            return False
        if not probe.close(got, w, probe.RECURRENCE):
            return False
    return True


def _fill_meta(nodes: list[fx.Node], like: Any) -> None:
    """Example values of inserted nodes: their ops run on the operands' example values, in the fake mode of
    ``like`` (an operand's example value) when it is a fake tensor."""
    mode = getattr(like, "fake_mode", None)
    for n in nodes:
        args = fx.node.map_arg(n.args, example_value)
        kwargs = fx.node.map_arg(n.kwargs, example_value)
        with mode if mode is not None else contextlib.nullcontext():
            n.meta["example_value"] = n.target(*args, **kwargs)


def _rewrite(graph: fx.Graph, region: _Region, gate: str, role: dict) -> None:
    q, k, v, beta, g = (region.inputs[role[r]] for r in _ROLES)
    kv = example_value(k)
    before = set(graph.nodes)
    with graph.inserting_before(region.output):
        o = emit_delta_rule(graph, q, k, v, beta, g, dk=kv.shape[-1], dtype=example_value(region.output).dtype,
                            device=kv.device, gate=gate, scales=_role_scales(region, role))
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
    ``matrix_scan``; returns one note per chunked computation rewritten or left as it is."""
    graph = gm.graph
    groups = [grp for grp in _pad_groups(graph) if any(_chunk_reshape(n) for n in grp)]
    if not groups:
        return []
    order = {n: i for i, n in enumerate(graph.nodes)}
    live = _live(graph)
    notes: list[str] = []
    for group in groups:
        name = next(n for n in group if _sequence_pad(n)).name
        regions = _candidates(group, order, live)
        if not regions:
            notes.append(f"{name}: sequence pads split into chunks without a closed region from them (q, k, v "
                         f"[B, H, L, d], beta [B, H, L], g [B, H, L] or [B, H, L, dk]) to one [B, H, L, dv] output "
                         f"(static shapes) {LEFT}")
            continue
        why = ""
        for region in regions:
            proved, why_not = _prove(region)
            if proved is not None:
                break
            why = why or f"{region.output.name}: {why_not}"
        if proved is None:
            notes.append(f"{name}: a chunked gated delta rule {LEFT}: {why}")
            continue
        gate, role = proved
        names = ", ".join(f"{r}={region.inputs[i].name}" for r, i in role.items())
        _rewrite(graph, region, gate, role)
        notes.append(f"{name}: chunked gated delta rule, {gate} gate ({names}) -> matrix_scan")
    if any(n.endswith("-> matrix_scan") for n in notes):
        graph.lint()
        gm.recompile()
    for line in notes:
        log.debug("%s", line)
    return notes
