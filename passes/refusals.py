"""Typed refusals: why a graph (at compile time) or a call (at run time) runs the original graph.

Every refusal names one :class:`Code` (brcompile/codes.py, below both the passes and the runtime: the rules and
their stable values), the rule it breaks, plus free text (``detail``) saying how this graph or call breaks it.

* :class:`CannotReplay` — raised by any analysis or rewrite pass: the backend runs the captured graph
  unchanged and records the code, the detail and the node (docs/ARCHITECTURE.md §1).
* :class:`NothingToShare` — a :class:`CannotReplay` for a graph with nothing to share (no per-token work, or a
  decode step against a cache): run as it is, counted apart from the fallbacks.
* :class:`Refusal` — a per-call fallback at run time (a failed guard, a batch that shares too little): the
  same code and detail, not raised but returned and counted (``brcompile.stats().fallback_codes``).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch.fx as fx

from brcompile.codes import CONSTRUCTS, Code, Refusal, check_code, refusal

log = logging.getLogger(__name__)


class CannotReplay(RuntimeError):
    """A graph (or batch) that branch replay cannot rewrite exactly; the backend runs the original.

    ``code``: the rule broken; ``reason`` (= ``detail``): how; ``node``: where, when one node is to blame.
    ``str(exc)`` is the detail followed by the node (`` at `node` ``), as reports show it."""

    def __init__(self, code: Code, detail: str, node: Optional[fx.Node] = None):
        self.code = check_code(code)
        self.reason = detail
        self.node = node
        where = ""
        if node is not None:
            try:
                where = f" at `{node.format_node()}`"
            except Exception:  # pragma: no cover - format_node is best effort
                where = f" at node {node.name}"
        super().__init__(f"{detail}{where}")

    @property
    def detail(self) -> str:
        return self.reason

    @property
    def node_name(self) -> Optional[str]:
        return None if self.node is None else self.node.name


class NothingToShare(CannotReplay):
    """A graph in which rows sharing a prefix have nothing to compute once. Either it has no per-token work:
    nothing in it is a function of the batch's tokens (it only views, casts or indexes its inputs; or it reads
    no token ids, no floating-point per-token value and looks nothing up by an integer input: masks and
    position tables built from ``[B, L]`` metadata between two graph breaks). Or it is a decode step against a
    KV cache (passes/analysis/decode.py): one token per row whose prefix is the row's cache, not the batch. Running it as
    it is is all a replay could do; the backend does, and counts its calls apart from the fallbacks
    (``Stats.unshared_calls``)."""


__all__ = ["CONSTRUCTS", "CannotReplay", "Code", "NothingToShare", "Refusal", "refusal"]
