"""brcompile: the ``branch_replay`` torch.compile backend.

``torch.compile(fn, backend="branch_replay")`` computes each distinct prefix of a batch of rollouts
once, with loss and gradients equal to the unmodified run (see README.md and DESIGN.md).
"""
import importlib

# Public names -> defining module. Resolved lazily so `import brcompile` stays cheap and so the
# torch_dynamo_backends entry point can import brcompile.backend without pulling in everything.
_EXPORTS = {
    "PackedTree": "brcompile.tree",
    "TreeStats": "brcompile.tree",
    "build_tree": "brcompile.tree",
    "backend": "brcompile.backend",
    "branch_replay": "brcompile.backend",
    "stats": "brcompile.runtime",
    "reset_stats": "brcompile.runtime",
    "Stats": "brcompile.runtime",
    "explain": "brcompile.explain",
    "CannotReplay": "brcompile.passes.axes",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'brcompile' has no attribute {name!r}")
