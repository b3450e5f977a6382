"""Per call, for a graph whose tree keys it computes itself (passes/canonical/keys.py, docs/ARCHITECTURE.md §3.4):
the keys evaluated on the call's inputs and passed after them."""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from brcompile.runtime.packed import PackedRuntime

log = logging.getLogger(__name__)

__all__ = ["ComputedKeysRuntime"]


class _OwnInputs:
    """The original graph called with a call's own inputs only (the computed keys after them dropped)."""

    def __init__(self, original: Callable, inputs: int):
        self.original = original
        self.inputs = inputs

    def __call__(self, *args):
        return self.original(*args[:self.inputs])


class ComputedKeysRuntime(PackedRuntime):
    """A :class:`PackedRuntime` whose packed graph reads keys that the original graph computes from its inputs
    (CPM-Ant's prompt ids joined to the input ids): each call evaluates ``keys`` (a
    ``passes.canonical.keys.ComputedKeys``: the key graph, ``keys.inputs`` inputs in, a tuple of keys out) on
    its inputs and runs as a :class:`PackedRuntime` on the inputs followed by the keys, the placeholders the
    analysis gave them. The guards, the tree (over the keys), the liveness and the packed graph read them
    there; the original graph, on a fallback or for ``verify``, gets the call's own inputs."""

    def __init__(self, keys: Callable[[Sequence[Any]], tuple], original: Callable, *args, **kwargs):
        super().__init__(_OwnInputs(original, keys.inputs), *args, **kwargs)
        self.keys = keys

    def __call__(self, *args):
        return super().__call__(*args, *self.keys(args))
