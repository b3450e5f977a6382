"""The compile -> run handoff: one frozen :class:`ReplayPlan` per rewritten graph.

The backend (brcompile/backend.py) reads everything the runtime needs off the pipeline's results — the analysis,
the packed graph's facts (passes/meta.py: ``TOKEN_OUTPUTS``, ``SEQUENCES``, ``ROWS``, ``WRITTEN_INPUTS``), the
compiled graphs, the options — into one immutable plan, and :class:`~brcompile.runtime.packed.PackedRuntime` is
built from it alone. The runtime never sees an FX graph, an ``Analysis`` or a pass: what it calls (the guards, the
liveness plan, the computed keys, the graphs) it calls through the plan as opaque callables, so nothing of the
compile side stays alive through it but those.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

__all__ = ["ReplayPlan"]


@dataclasses.dataclass(frozen=True)
class ReplayPlan:
    """How to run one rewritten graph, per call (docs/ARCHITECTURE.md §5)."""

    #: the captured graph, run on a fallback and by ``verify`` (with the call's own inputs)
    original: Callable
    #: the packed graph as it runs (compiled once, at its first call)
    packed: Callable
    #: argument positions of the tree keys (the token inputs; after the call's inputs, the computed keys)
    tree_positions: tuple[int, ...]
    #: the packed graph uncompiled: ``verify`` runs it, and it replaces ``packed`` if compiling that fails
    eager_packed: Optional[Callable] = None
    #: args -> the tree's ``[B, L]`` key padding (None: every position is a key)
    key_padding: Optional[Callable] = None
    #: per-call guards (passes/analysis/guards.py ``BatchGuard``: args -> None or the reason to fall back)
    guards: tuple = ()
    #: positions no output needs leave the tree (passes/analysis/liveness.py ``LivePlan``; None: all are kept)
    liveness: Any = None
    #: keys the graph computes from its inputs (passes/canonical/keys.py ``ComputedKeys``: ``keys(args)`` returns
    #: them, ``keys.inputs`` is the number of the call's own inputs); None when every key is an input
    keys: Optional[Callable] = None
    #: outputs that are dense reads of packed values at every (b, t): they carry the tree (provenance)
    token_outputs: tuple[int, ...] = ()
    #: padding-free graphs: the argument position of the position ids (the tree is over packed sequences)
    sequences: Optional[int] = None
    #: ``[T, ...]`` tree keys, one token a row (the tree is over rows ``[T, 1, ...]``)
    rows: bool = False
    #: argument positions of inputs the graph writes into (restored when a run is not the call's only write)
    written: tuple[int, ...] = ()
    #: streaming replay (brcompile/runtime/streaming.py ``StreamingRuntime``); None: packed mode only
    streaming: Any = None
    #: context parallelism (brcompile/runtime/context_parallel.py ``ContextParallel``); None: off
    context_parallel: Any = None
    #: a call whose dedup ratio is below this runs the original graph
    min_dedup: float = 1.0
    #: re-raise a failing packed/streaming forward instead of running the original graph
    strict: bool = False
    #: compare the first replayed call's outputs with the original graph's
    verify: bool = False
    #: how many calls keep a record for explain()
    max_calls_logged: int = 64
