"""brcompile: the ``branch_replay`` torch.compile backend.

``torch.compile(fn, backend="branch_replay")`` computes each distinct prefix of a batch of rollouts
once, with loss and gradients equal to the unmodified run (see README.md and docs/ARCHITECTURE.md).

Public API: ``backend(**options)`` (a backend object with options), ``branch_replay`` (the entry-point
backend), ``stats()`` / ``reset_stats()`` (counters that prove a rewrite ran), ``explain(fn, *args)``
(a report), ``build_tree`` / ``PackedTree`` (the prefix tree of a batch), ``CannotReplay``
(a typed refusal: ``.code``, a ``Code``, the rule broken; ``.reason``, how); ``window(calls=N)`` (a cross-call
window: the prefixes shared by N micro-batches computed once, brcompile/runtime/window/), ``WindowError``;
``compile_decoder(model)`` / ``BranchReplayCallback()`` (brcompile/integrations.py: an HF model's decoder
compiled in place, by hand or when a transformers/TRL trainer begins training; ``BranchReplayCallback`` is
made on first access, so ``import brcompile`` needs no transformers, and is not in ``__all__``).
"""
from brcompile.backend import BranchReplayBackend, Options, backend, branch_replay
from brcompile.integrations import NoDecoderError, compile_decoder
from brcompile.tools.explain import ExplainReport, explain
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.runtime import Stats, reset_stats, stats
from brcompile.runtime.tree import PackedTree, TreeStats, build_tree
from brcompile.runtime.window import WindowError, window

__version__ = "0.1.0"

__all__ = [
    "BranchReplayBackend", "CannotReplay", "Code", "ExplainReport", "NoDecoderError", "Options",
    "PackedTree", "Stats", "TreeStats", "backend", "branch_replay", "build_tree", "compile_decoder", "explain",
    "WindowError", "reset_stats", "stats", "window",
]


def __getattr__(name: str):
    """``brcompile.BranchReplayCallback`` on first access (it subclasses ``transformers.TrainerCallback``:
    ``import brcompile`` needs no transformers)."""
    if name == "BranchReplayCallback":
        from brcompile import integrations

        return integrations.BranchReplayCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
