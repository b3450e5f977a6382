"""Mamba-2's chunked state-space dual (SSD) as one ``linear_scan``, before the analysis (docs/ARCHITECTURE.md §3.3).

A Mamba-2 mixer (HF ``mamba2_chunk_scan`` / ``Mamba2Mixer.torch_forward``, copied into Bamba, Nemotron-H,
Zamba2, FalconH1, GraniteMoeHybrid) computes, per row, head h, head channel p and state channel n, the
recurrence

    h_t = exp(la_t) · h_{t-1} + u_t ⊗ B_t          (state [H, P, N], h_{-1} = 0, one decay per head)
    y_t = C_t · h_t  (+ d · x_t)                    (the sum over n; the skip term when D is inside)

with ``la = dt·A`` (the log-decay, [B, L, H]), ``u = dt·x`` ([B, L, H, P]), ``B``, ``C`` ([B, L, H, N], the
groups already repeated to the heads) — but spelled as chunks: the positions padded to a multiple of the
chunk size, reshaped to [B, c, l, ...], a masked ``cumsum`` ("segment sum") and ``exp`` for the decays inside
a chunk, ``einsum`` contractions for the diagonal blocks, the chunk states and the states passed between
chunks. None of those ops has a token-axis rule (a pad of the positions, a reshape that splits them, the
chunk einsums): the region ran densely on the B·L positions and its output was packed again
(passes/analysis/repack.py), sharing nothing inside it.

**The rewrite.** In the analysis copy (the user's graph is untouched) the region becomes

    a = exp(la)[..., None, None]                    [B, L, H, 1, 1]
    b = u[..., :, None] · B[..., None, :]           [B, L, H, P, N]
    h = linear_scan(a, b, dim=1)                    (backends.scan.op: h_t = a_t h_{t-1} + b_t)
    y = (h · C[..., None, :]).sum(-1)  (+ d · x)    [B, L, H, P]

whose ops all have token-axis rules: ``linear_scan`` along the positions becomes ``brcompile::tree_linear_scan``
(passes/analysis/rules/scan.py), the recurrence along the tree paths, so a prefix's states are computed once.

**The region** (:func:`_regions`). Let (B, L) be the token ids' shape; a value is *on the token layout* when its
leading dims are (B, L). A chunked algorithm leaves that layout (the padded length, the chunk split) and comes
back to it at its output. An output candidate O is an on-layout value that reads an off-layout value computed
from the tokens; its region is every ancestor reached from O through off-layout token values (plus the
constants built inside it, ``ones`` / ``tril`` masks), stopping at on-layout values and at values computed
from parameters only: those are the region's inputs. A region is a candidate only if it holds a ``cumsum``
and an ``exp`` (the segment sums of the decays) and no attention; it must be closed (no inner value read
outside it).

**Roles by shape** (:func:`_role_assignments`): one [B, L, H] input is ``la``; the [B, L, H, *] inputs are
``u``, ``B``, ``C`` and optionally ``x`` (``u``, ``x`` of one shape; ``B``, ``C`` of one shape); a parameter-only
input broadcasting against ``x`` is ``d`` (with ``x`` only). Every assignment that fits the shapes is tried.

**The proof obligation** (:func:`_proves`): the region, evaluated on random float64 inputs (a log-decay in
[-1.05, -0.05], normals elsewhere) of the example's shapes, equals the reference recurrence to a relative
1e-9 (:data:`.probe.RECURRENCE`; float64 reassociation of a chunked sum is ~1e-15). The region's shapes are the
example's (the pad size and the chunk count are constants of the graph, specialised on L): a region with symbolic
sizes is not rewritten. An assignment that fails is not the region's meaning; when none proves, the region stays as
it is (dense, packed again: today's behaviour) with a note. Exactness of the rewrite then follows: it computes the
reference on the region's own inputs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from typing import Any, Optional

import torch
import torch.fx as fx

from brcompile.backends.scan.op import linear_scan
from brcompile.passes.analysis.axes import example_value, hint
from brcompile.passes import probe
from brcompile.passes.canonical.scans.linear import LEFT
from brcompile.passes.spellings import is_op

log = logging.getLogger(__name__)

__all__ = ["canonicalize_ssd_scans", "reference_ssd"]

#: the roles of the region's inputs (module docstring)
_ROLES = ("la", "u", "B", "C", "x", "d")


def _apply(fn, *args):
    return fn(*args)


def reference_ssd(la: Any, u: Any, B: Any, C: Any, x: Any = None, d: Any = None, call=_apply) -> Any:
    """``y_t = C_t · h_t (+ d · x_t)`` with ``h_t = exp(la_t) h_{t-1} + u_t ⊗ B_t`` along dim 1 (module
    docstring); ``la`` [B, L, H], ``u``, ``x`` [B, L, H, P], ``B``, ``C`` [B, L, H, N]. ``call(fn, *args)``
    applies each op: on tensors (the probes' reference) or as graph nodes (the rewrite, :class:`_Emitter`)."""
    a = call(torch.unsqueeze, call(torch.unsqueeze, call(torch.exp, la), -1), -1)
    b = call(torch.mul, call(torch.unsqueeze, u, -1), call(torch.unsqueeze, B, -2))
    y = call(torch.sum, call(torch.mul, call(linear_scan, a, b, 1), call(torch.unsqueeze, C, -2)), -1)
    return y if x is None else call(torch.add, y, call(torch.mul, d, x))


@dataclasses.dataclass
class _Region:
    """A chunked region: ``output`` (on the token layout), ``nodes`` (its nodes in graph order, ``output``
    last), ``inputs`` (what it reads from outside, in graph order)."""

    output: fx.Node
    nodes: list[fx.Node]
    inputs: list[fx.Node]


def canonicalize_ssd_scans(gm: fx.GraphModule, batch: Optional[tuple[int, int]]) -> list[str]:
    """Rewrite every chunked SSD region of ``gm`` (modified in place: the analysis copy) whose probes prove it
    the recurrence (module docstring) as ``linear_scan`` ops; ``batch`` is (B, L), the token ids' shape (None:
    nothing is recognised). Returns one note per candidate region."""
    if batch is None:
        return []
    notes, replaced = [], {}
    for r in _regions(gm.graph, batch):
        r.inputs = [replaced.get(a, a) for a in r.inputs]  # an earlier region's output, rewritten
        roles, why = _prove_roles(r, batch)
        if roles is None:
            notes.append(f"{r.output.name}: a chunked scan {LEFT}: {why}")
            continue
        replaced[r.output], note = _rewrite(gm.graph, r, roles)
        notes.append(note)
    if notes:
        gm.graph.lint()
        gm.recompile()
        for line in notes:
            log.debug("%s", line)
    return notes


# --------------------------------------------------------------------------------------------------
# the region


def _shape(n: Any) -> Optional[tuple]:
    """The example shape, SymInts as their hints (comparing them would add guards to the user's graph)."""
    v = example_value(n)
    return hint(tuple(v.shape)) if isinstance(v, torch.Tensor) else None


def _symbolic(n: Any) -> bool:
    v = example_value(n)
    return isinstance(v, torch.Tensor) and not all(isinstance(d, int) for d in v.shape)


def _on_layout(n: fx.Node, batch: tuple[int, int]) -> bool:
    s = _shape(n)
    return s is not None and len(s) >= 2 and s[:2] == tuple(batch)


def _token_nodes(graph: fx.Graph, batch: tuple[int, int]) -> set[fx.Node]:
    """The nodes computed from a per-token placeholder (leading dims (B, L))."""
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if (n.op == "placeholder" and _on_layout(n, batch)) or any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _from_placeholders(graph: fx.Graph) -> set[fx.Node]:
    """The nodes computed from some placeholder (parameters included)."""
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op in ("placeholder", "get_attr") or any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _regions(graph: fx.Graph, batch: tuple[int, int]) -> list[_Region]:
    """The candidate regions (module docstring): one per on-layout output reading off-layout token values,
    holding a ``cumsum`` and an ``exp`` and no attention, closed."""
    from brcompile.passes.analysis.rules.attention import SDPA
    tokens, sourced = _token_nodes(graph, batch), _from_placeholders(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    out = []
    for o in graph.nodes:
        if o.op not in ("call_function", "call_method") or not _on_layout(o, batch) or o not in tokens:
            continue
        if not any(a in tokens and not _on_layout(a, batch) for a in o.all_input_nodes):
            continue
        inside, inputs, todo = {o}, {}, [o]
        while todo:
            for a in todo.pop().all_input_nodes:
                if a in inside or a in inputs:
                    continue
                if a.op in ("call_function", "call_method") and (
                        (a in tokens and not _on_layout(a, batch)) or a not in sourced):
                    inside.add(a)
                    todo.append(a)
                else:
                    inputs[a] = None
        nodes = sorted(inside, key=order.get)
        if not (any(is_op(n, "cumsum") for n in nodes) and any(is_op(n, "exp") for n in nodes)):
            continue
        if any(n.target in SDPA for n in nodes) or any(u not in inside for n in nodes if n is not o for u in n.users):
            continue
        out.append(_Region(o, nodes, sorted(inputs, key=order.get)))
    return out


# --------------------------------------------------------------------------------------------------
# roles and the proof


def _role_assignments(region: _Region, batch: tuple[int, int]) -> list[dict[str, fx.Node]]:
    """Every assignment of the region's inputs to the roles that fits their shapes (module docstring)."""
    shapes = {a: _shape(a) for a in region.inputs}
    if any(s is None for s in shapes.values()):
        return []
    la = [a for a in region.inputs if _on_layout(a, batch) and len(shapes[a]) == 3]
    four = [a for a in region.inputs if _on_layout(a, batch) and len(shapes[a]) == 4]
    rest = [a for a in region.inputs if a not in la and a not in four]
    if len(la) != 1 or len(four) not in (3, 4) or len(rest) != (len(four) == 4):
        return []
    H = shapes[la[0]][2]
    out = []
    for perm in itertools.permutations(four):
        roles = dict(zip(("u", "B", "C", "x"), perm), la=la[0])
        if rest:
            roles["d"] = rest[0]
        s = {k: shapes[v] for k, v in roles.items()}
        if any(s[k][2] != H for k in ("u", "B", "C")) or s["B"] != s["C"] or s.get("x", s["u"]) != s["u"]:
            continue
        if "d" in s:
            try:
                if torch.broadcast_shapes(s["d"], s["x"]) != s["x"]:
                    continue
            except RuntimeError:
                continue
        out.append(roles)
    return out


def _probe_values(roles: dict[str, fx.Node], seed: int) -> dict[str, torch.Tensor]:
    """Random float64 probes of the roles' shapes: the log-decay ``la`` in (-1.05, -0.05], the others normal (a
    uniform draw precedes each role's value, used by ``la`` only: the draws of the seed stay as they are)."""
    g = probe.generator(seed)
    vals = {}
    for k in _ROLES:
        if k in roles:
            shape = _shape(roles[k])
            r = probe.uniform(shape, g)
            vals[k] = -(0.05 + r) if k == "la" else probe.normal(shape, g)
    return vals


def _region_fn(region: _Region) -> fx.GraphModule:
    """The region as a graph module of its inputs (in ``region.inputs`` order)."""
    return probe.region_module(region.inputs, region.nodes, region.output)


def _proves(fn: fx.GraphModule, region: _Region, roles: dict[str, fx.Node]) -> bool:
    """Whether the region equals :func:`reference_ssd` under ``roles`` on two random float64 probes."""
    by_node = {v: k for k, v in roles.items()}
    for seed in (0, 1):
        vals = _probe_values(roles, seed)
        try:
            with torch.no_grad():
                got = probe.run(fn, *[vals[by_node[a]] for a in region.inputs])
        except Exception as e:  # noqa: BLE001  (a region that does not run on the probe is not proved)
            log.debug("%s: probe failed (%s: %s)", region.output.name, type(e).__name__, e)
            return False
        if not probe.close(got, reference_ssd(**vals), probe.RECURRENCE):
            return False
    return True


def _prove_roles(region: _Region, batch: tuple[int, int]) -> tuple[Optional[dict[str, fx.Node]], str]:
    """(the roles of the first assignment the probes prove, "") or (None, why not)."""
    if any(_symbolic(n) for n in region.inputs + region.nodes):
        return None, "its sizes are symbolic (the pad and the chunk count are proved at one length only)"
    assignments = _role_assignments(region, batch)
    if not assignments:
        shapes = ", ".join(f"{a.name} {list(_shape(a) or ['?'])}" for a in region.inputs)
        return None, f"its inputs ({shapes}) have no roles (la [B, L, H]; u, B, C, optionally x [B, L, H, *]; d)"
    fn = _region_fn(region)
    for roles in assignments:
        if _proves(fn, region, roles):
            return roles, ""
    return None, (f"it is not the state-space recurrence of its inputs on probes ({len(assignments)} role "
                  f"assignments tried)")


# --------------------------------------------------------------------------------------------------
# the rewrite


def _rewrite(graph: fx.Graph, region: _Region, roles: dict[str, fx.Node]) -> tuple[fx.Node, str]:
    """Replace the region's output by :func:`reference_ssd`'s ops on its inputs; erase the region. Returns
    the node now standing for the output, and the note."""
    o = region.output
    want = example_value(o)
    with graph.inserting_before(o):
        em = _Emitter(graph)
        node = reference_ssd(**roles, call=em.call)
        if example_value(node).dtype != want.dtype:
            node = em.call(torch.Tensor.to, node, want.dtype)
    o.replace_all_uses_with(node)
    for n in reversed(region.nodes):
        if not n.users:
            graph.erase_node(n)
    names = ", ".join(f"{k}={v.name}" for k, v in roles.items())
    return node, f"{o.name}: a chunked state-space scan ({names}) -> linear_scan"


class _Emitter:
    """Applies :func:`reference_ssd`'s ops as graph nodes, each with its example value (the op run on the
    operands' fake example values, in their fake mode)."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph

    def call(self, fn, *args) -> fx.Node:
        vals = [example_value(a) for a in args]
        mode = next((m for v in vals for m in [getattr(v, "fake_mode", None)] if m is not None), None)
        with mode if mode is not None else contextlib.nullcontext():
            ev = fn(*vals)
        n = self.graph.call_method("to", args) if fn is torch.Tensor.to else self.graph.call_function(fn, args)
        n.meta["example_value"] = ev
        return n
