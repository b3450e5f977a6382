"""Run time (docs/ARCHITECTURE.md §4, §5, §7): what happens to one batch. Imports nothing from ``passes/``.

- ``plan``: ``ReplayPlan``, the one frozen object the backend hands the runtime per rewritten graph;
- ``tree``: the exact prefix tree of a batch and its packed layout (``build_tree``, ``PackedTree``);
- ``packed``: ``PackedRuntime`` (per call: computed keys, guards, tree, gate, then packed / streaming / original)
  and ``FallbackRuntime``; tree provenance between graphs;
- ``streaming``: streaming replay (prefix once, tails in chunks) and ``StreamingRuntime``;
- ``routed``: ``RoutedRuntime`` (routed pairs);
- ``context_parallel``: one batch's tokens split over a process group (``ContextParallel``, ``count_once``);
- ``stats``: the process-wide counters (``stats()``, ``reset_stats()``).
"""
from brcompile.runtime.packed import CallRecord, FallbackRuntime, PackedRuntime, provenance_of, tag_provenance
from brcompile.runtime.plan import ReplayPlan
from brcompile.runtime.stats import Stats, record_graph, reset_stats, stats
from brcompile.runtime.streaming import StreamingRuntime
from brcompile.runtime.tree import PackedTree, TreeStats, build_tree

__all__ = [
    "CallRecord", "FallbackRuntime", "PackedRuntime", "PackedTree", "ReplayPlan", "Stats", "StreamingRuntime",
    "TreeStats", "build_tree", "provenance_of", "record_graph", "reset_stats", "stats", "tag_provenance",
]
