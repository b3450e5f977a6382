"""The probe engine: proving a property of a graph region by evaluating it on probe values.

Several passes decide what a region of the analysed graph computes by running it at compile time on small
synthetic values and comparing with what the property predicts: the mask classification (:mod:`.masks`,
:mod:`.input_masks`), the re-packing of dense causal regions (:mod:`.repack`), the affine scans
(:mod:`.canonical.scans.linear`), the chunked state-space scans (:mod:`.canonical.scans.ssd`) and the gated delta rule
(:mod:`.canonical.scans.delta_rule`). This module is the one place they share for that:

* **regions** — :func:`ancestors` (the nodes a value depends on, stopping at a boundary) and
  :func:`region_module` (a list of nodes between given inputs and outputs copied into a graph module of its own);
* **the interpreter** — :func:`evaluate` (the nodes of a region, in graph order, with values bound to its
  inputs) and :func:`run` (a graph module through the same loop);
* **probe values** — seeded generators (:func:`generator`), random values of a shape and dtype (:func:`normal`,
  :func:`uniform`, :func:`unit_vectors`, :func:`in_range`, :func:`differing`) and structured ones
  (:func:`padding`, :func:`sequence_positions`);
* **agreement** — :func:`close` under a :class:`Tolerance`: :data:`RECURRENCE` (relative, for the float64 proofs
  of a recurrence against its formula) or :data:`ROUNDING` (a few rounding steps, for a region compared with
  itself on moved inputs); :func:`identical` for the bitwise comparisons.

What each pass proves, on which probes, stays in that pass; the engine holds no decisions of its own.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.fx as fx

log = logging.getLogger(__name__)

__all__ = [
    "UnsupportedNode", "ancestors", "region_module", "evaluate", "run", "generator", "normal", "uniform",
    "unit_vectors", "in_range", "differing", "padding", "sequence_positions", "Tolerance", "RECURRENCE",
    "ROUNDING", "close", "identical", "map_ints",
]


class UnsupportedNode(Exception):
    """A node the interpreter does not run (a ``call_module``, an ``output`` inside a region): ``node`` names it."""

    def __init__(self, node: fx.Node):
        super().__init__(f"a {node.op} node ({node.name})")
        self.node = node


# --------------------------------------------------------------------------------------------------
# regions


def ancestors(node: fx.Node, inside: Callable[[fx.Node], bool] = lambda n: True) -> list[fx.Node]:
    """All nodes ``node`` depends on (itself included), in graph order; the walk enters only the inputs
    for which ``inside`` holds (a region's boundary stays out)."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(a for a in n.all_input_nodes if inside(a))
    return [n for n in node.graph.nodes if n in seen]


def region_module(inputs: Sequence[fx.Node], nodes: Iterable[fx.Node], outputs: Any, *, prefix: str = "in",
                  transform: Optional[Callable[[fx.Node], None]] = None) -> fx.GraphModule:
    """The region ``nodes`` (in graph order, reading only ``inputs`` and each other) as a graph module of its own:
    placeholders ``{prefix}0, {prefix}1, ...`` for ``inputs`` in their order, a copy of every node, and ``outputs``
    (a node, or a tuple or list of nodes) returned. ``transform`` may edit each copy in place (the float64 copy of
    :mod:`.canonical.scans.delta_rule`). The module has no attributes: a ``get_attr`` in the region fails when it runs."""
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {a: sub.placeholder(f"{prefix}{i}") for i, a in enumerate(inputs)}
    for n in nodes:
        c = sub.node_copy(n, lambda a: env[a])
        if transform is not None:
            transform(c)
        env[n] = c
    sub.output(fx.node.map_arg(outputs, lambda a: env[a]))
    return fx.GraphModule(torch.nn.Module(), sub)


# --------------------------------------------------------------------------------------------------
# the interpreter


def map_ints(a: Any, f: Callable[[int], int]) -> Any:
    """``a`` with every int literal (not bool) inside tuples, lists, dicts and slices mapped by ``f``."""
    if isinstance(a, bool) or isinstance(a, fx.Node):
        return a
    if isinstance(a, int):
        return f(a)
    if isinstance(a, (tuple, list)):
        return type(a)(map_ints(x, f) for x in a)
    if isinstance(a, slice):
        return slice(map_ints(a.start, f), map_ints(a.stop, f), map_ints(a.step, f))
    if isinstance(a, dict):
        return {k: map_ints(v, f) for k, v in a.items()}
    return a


def evaluate(outputs: Any, values: dict, *, nodes: Optional[Sequence[fx.Node]] = None,
             literal: Optional[Callable[[int], int]] = None,
             call: Optional[Callable[[fx.Node, tuple, dict], Any]] = None,
             fail: Optional[Callable[[fx.Node, Exception], Any]] = None) -> Any:
    """The value of ``outputs`` (a node, or a tuple, list or dict of nodes) with ``values`` bound to nodes.

    The nodes run, in order, are ``nodes`` when given (every one of them, also those no output reads: the calls a
    region needs for their side effects), else the ancestors of ``outputs`` not behind a node of ``values``. A node
    of ``values`` takes that value and its own inputs are not evaluated (a placeholder, or a free value that
    replaces what the graph computes). ``get_attr`` reads the owning module; ``call_function`` and ``call_method``
    run their target on the bound arguments. ``literal`` rewrites every int literal of the ops' arguments first
    (a static size, for an evaluation at a probe size). ``call(node, args, kwargs)`` may compute any other node
    itself (return anything but ``NotImplemented``: an op evaluated by its meaning rather than as spelled). An op
    that raises goes to ``fail(node, error)`` when given (it raises the caller's reason), else propagates
    unchanged. A placeholder without a value raises ``KeyError``; a node ``call`` leaves that is no
    ``call_function`` or ``call_method`` (a ``call_module``, an ``output``) :class:`UnsupportedNode`. No grad mode is
    set: the caller's holds."""
    env: dict = {n: v for n, v in values.items() if isinstance(n, fx.Node)}
    if nodes is None:
        roots = [n for n in _nodes_of(outputs) if n not in env]
        seen: set[fx.Node] = set()
        for r in roots:
            seen.update(ancestors(r, lambda a: a not in env))
        nodes = [n for n in roots[0].graph.nodes if n in seen] if roots else []
    for n in nodes:
        if n in env:
            continue
        if n.op == "placeholder":
            raise KeyError(n)
        if n.op == "get_attr":
            env[n] = _attribute(n)
            continue
        args, kwargs = n.args, n.kwargs
        if literal is not None:
            args, kwargs = map_ints((args, kwargs), literal)
        args, kwargs = fx.node.map_arg((args, kwargs), lambda a: env[a])
        try:
            out = NotImplemented if call is None else call(n, args, kwargs)
            if out is NotImplemented:
                if n.op not in ("call_function", "call_method"):
                    raise UnsupportedNode(n)
                out = n.target(*args, **kwargs) if n.op == "call_function" else \
                    getattr(args[0], n.target)(*args[1:], **kwargs)
        except UnsupportedNode:
            raise
        except Exception as e:
            if fail is None:
                raise
            fail(n, e)
            raise
        env[n] = out
    return fx.node.map_arg(outputs, lambda a: env[a])


def _nodes_of(outputs: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(outputs, lambda a: found.append(a))
    return found


def _attribute(n: fx.Node) -> Any:
    """The value of a ``get_attr`` node: the attribute named by its target on the graph's owning module (one
    ``getattr``: a dotted target that names no attribute of the module itself fails)."""
    return getattr(n.graph.owning_module, n.target)


def run(gm: fx.GraphModule, *args: Any) -> Any:
    """``gm``'s output on ``args`` (one per placeholder, in order), evaluated by :func:`evaluate`. A failure that
    leaves a functorch vmap level open (a region of ``torch.vmap``'s calls that stopped between its increment and
    decrement of the nesting) closes it again before the error propagates."""
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    level = torch._C._functorch.maybe_current_level()
    try:
        return evaluate(out.args[0], dict(zip(ph, args)), nodes=body)
    except Exception:
        if torch._C._functorch.maybe_current_level() != level:
            from torch._functorch import predispatch
            while torch._C._functorch.maybe_current_level() != level:
                predispatch._vmap_decrement_nesting()
        raise


# --------------------------------------------------------------------------------------------------
# probe values: every generator draws from an explicit torch.Generator, so a probe is the same on every run


def generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``: the one source of a probe's randomness."""
    return torch.Generator().manual_seed(seed)


def normal(shape: Any, gen: torch.Generator, *, draw: torch.dtype = torch.float64,
           like: Optional[torch.Tensor] = None) -> torch.Tensor:
    """N(0, 1) entries of ``shape`` drawn in dtype ``draw`` (float64 unless the caller draws in its own dtype),
    then moved to ``like``'s device and dtype when given."""
    x = torch.randn(shape, generator=gen, dtype=draw)
    return x if like is None else x.to(device=like.device, dtype=like.dtype)


def uniform(shape: Any, gen: torch.Generator) -> torch.Tensor:
    """U[0, 1) float64 entries of ``shape``."""
    return torch.rand(shape, generator=gen, dtype=torch.float64)


def unit_vectors(shape: Any, gen: torch.Generator) -> torch.Tensor:
    """float64 vectors along the last dim of ``shape`` of norm 1 (normalised N(0, 1) draws)."""
    return torch.nn.functional.normalize(normal(shape, gen), dim=-1)


def in_range(x: torch.Tensor, shape: Any, gen: torch.Generator) -> torch.Tensor:
    """Integers of ``shape`` drawn uniformly from ``x``'s range ``[min, max]``, typed and placed like ``x`` (never
    past it: a token id past the largest one seen may be past an embedding's vocabulary); a constant ``x`` gets
    a second value next to it, below it when it can; an empty ``x`` the range ``[0, 1]``."""
    lo, hi = (int(x.min()), int(x.max())) if x.numel() else (0, 1)
    if lo == hi:
        lo, hi = (lo - 1, lo) if lo > 0 else (lo, lo + 1)
    return torch.randint(lo, hi + 1, shape, generator=gen).to(device=x.device, dtype=x.dtype)


def differing(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A tensor like ``x`` whose every entry differs from ``x``'s, staying in ``x``'s domain where it can:
    bools flipped, 0/1 integers flipped, other integers drawn from the values ``x`` holds (the next one
    where the draw repeats), floats fresh normals (drawn in ``x``'s dtype) plus 0.5."""
    if x.dtype == torch.bool:
        return ~x
    if x.is_floating_point() or x.is_complex():
        return torch.randn(x.shape, generator=gen, dtype=x.dtype).to(x.device) + 0.5
    vals = torch.unique(x)
    if len(vals) <= 2 and bool(((vals == 0) | (vals == 1)).all()):
        return 1 - x
    if len(vals) == 1:
        return x + 1
    pick = torch.randint(0, len(vals), x.shape, generator=gen).to(x.device)
    nxt = (torch.searchsorted(vals, x) + 1) % len(vals)
    other = vals[pick]
    return torch.where(other == x, vals[nxt], other)


#: The key-padding patterns of :func:`padding`: all ones, left padding, right padding, random 0/1.
PADDING_PATTERNS = (0, 1, 2, 3)


def padding(B: int, L: int, pattern: int, gen: torch.Generator) -> torch.Tensor:
    """A [B, L] bool key-padding probe (True: a token): pattern 0 all True, 1 left padding of random lengths
    (each row's pad count uniform in 0..L), 2 right padding (as 1, at the end), 3 random with P(True) = 0.6."""
    if pattern == 0:
        return torch.ones(B, L, dtype=torch.bool)
    if pattern in (1, 2):
        lens = torch.randint(0, L + 1, (B, 1), generator=gen)
        return torch.arange(L)[None, :] >= (L - lens) if pattern == 1 else torch.arange(L)[None, :] < lens
    return torch.rand(B, L, generator=gen) < 0.6


def sequence_positions(B: int, L: int, p_start: float, gen: torch.Generator) -> torch.Tensor:
    """[B, L] well-formed position ids: each row a concatenation of sequences 0, 1, 2, ... whose starts
    (after column 0) are drawn with probability ``p_start``."""
    starts = torch.rand(B, L, generator=gen) < p_start
    starts[:, 0] = True
    t = torch.arange(L).expand(B, L)
    return t - torch.where(starts, t, 0).cummax(dim=1).values


# --------------------------------------------------------------------------------------------------
# agreement


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How far a probe's value may be from the value it is compared with (:func:`close`).

    The bound is ``max(relative * max(1, s), ulps * eps * max(s, tiny))`` for the largest magnitude ``s`` of the
    expected value (``eps``, ``tiny``: of the compared dtype); one of the two terms is 0 in each policy.
    ``nonfinite`` says what an inf or NaN entry does: ``"fails"`` — the comparison fails where either side holds
    a NaN (a finite value against an expected inf is within the infinite bound that inf makes), or ``"equal"`` —
    a non-finite entry must be the same on both sides (NaN equal to NaN) and ``s`` is taken over the entries
    finite on both."""

    relative: float = 0.0
    ulps: int = 0
    nonfinite: str = "fails"

    def bound(self, dtype: torch.dtype, scale: float) -> float:
        """The largest admitted absolute difference for an expected value of largest magnitude ``scale``."""
        rel = self.relative * max(1.0, scale) if self.relative else 0.0
        if not self.ulps:
            return rel
        fi = torch.finfo(dtype)
        return max(rel, self.ulps * fi.eps * max(scale, fi.tiny))


#: Relative agreement of a float64 probe of a recurrence with its formula (:mod:`.canonical.scans.linear`,
#: :mod:`.canonical.scans.ssd`, :mod:`.canonical.scans.delta_rule`): reassociating a short float64 recurrence moves it by ~1e-15, a
#: different function by far more than 1e-9 of its scale (at least 1).
RECURRENCE = Tolerance(relative=1e-9)
#: A few rounding steps of the largest entry (:mod:`.repack`'s rolled rows, :mod:`.masks`' ALiBi fit): a row moved
#: to another place in a batch may be rounded differently by a kernel (a matmul's edge tiles) by a few ulps; a
#: per-row constant moves it by far more. Non-finite entries must match exactly.
ROUNDING = Tolerance(ulps=64, nonfinite="equal")


def identical(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise equality of two tensors of one shape, NaN equal to NaN (and ``0.0`` to ``-0.0``): where a probe
    left a value unchanged."""
    eq = a == b
    if a.is_floating_point() or a.is_complex():
        eq = eq | (torch.isnan(a) & torch.isnan(b))
    return eq


def close(got: Any, want: torch.Tensor, tol: Tolerance) -> bool:
    """Whether ``got`` is a tensor of ``want``'s shape and dtype within ``tol`` of it (:class:`Tolerance`).

    Integer and bool tensors must be equal under :data:`ROUNDING` (``nonfinite="equal"``) and are compared by
    difference under the other policies, as floats are. An empty tensor agrees under :data:`ROUNDING` and has no
    largest entry under the others (``RuntimeError``, as an empty reduction)."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        return False
    if tol.nonfinite == "fails":
        return bool(((got - want).abs().max() <= tol.bound(got.dtype, want.abs().max().item())).item())
    same = identical(got, want)
    if not (got.is_floating_point() or got.is_complex()):
        return bool(same.all())
    finite = torch.isfinite(got) & torch.isfinite(want)
    if not bool((same | finite).all()):
        return False
    if want.numel() == 0:
        return True
    diff = torch.where(same, torch.zeros_like(got), got - want).abs()
    scale = want.abs().masked_fill(~finite, 0).max().item()
    return diff.max().item() <= tol.bound(got.dtype, scale)
