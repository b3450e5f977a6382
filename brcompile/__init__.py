"""brcompile: the ``branch_replay`` torch.compile backend.

``torch.compile(fn, backend="branch_replay")`` computes each distinct prefix of a batch of rollouts
once, with loss and gradients equal to the unmodified run (see README.md and docs/ARCHITECTURE.md).

Public API: ``backend(**options)`` (a backend object with options), ``branch_replay`` (the entry-point
backend), ``stats()`` / ``reset_stats()`` (counters that prove a rewrite ran), ``explain(fn, *args)``
(a report), ``build_tree`` / ``PackedTree`` (the prefix tree of a batch), ``CannotReplay``.
"""
from brcompile.backend import BranchReplayBackend, Options, backend, branch_replay
from brcompile.tools.explain import ExplainReport, explain
from brcompile.passes.axes import CannotReplay
from brcompile.runtime import Stats, reset_stats, stats
from brcompile.runtime.tree import PackedTree, TreeStats, build_tree

__version__ = "0.1.0"

__all__ = [
    "BranchReplayBackend", "CannotReplay", "ExplainReport", "Options", "PackedTree", "Stats", "TreeStats",
    "backend", "branch_replay", "build_tree", "explain", "reset_stats", "stats",
]
