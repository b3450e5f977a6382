"""The attention canonicaliser's driver: every eager attention of a graph matched and rewritten as SDPA; the
guards of what was proven at the example values (:class:`Canonical`)."""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch.fx as fx

from brcompile.passes.analysis.guards import BatchGuard, no_query_without_keys, scalar_equals
from brcompile.passes.meta import CANONICAL
from brcompile.passes.analysis.rules.attention import SDPA
from brcompile.passes.spellings import copy_graph_module
from brcompile.passes.canonical.attention.bias import key_bias_sdpa, relative_bias_sdpa
from brcompile.passes.canonical.attention.common import Canonical, DROPOUT, call_in, mutates
from brcompile.passes.canonical.attention.match import match_eager_attention
from brcompile.passes.canonical.attention.rewrite import replace_with_sdpa
from brcompile.passes.canonical.attention.scalars import scalar_value, specialise_dropout, specialise_scalars
from brcompile.passes.canonical.attention.scores import is_softmax
from brcompile.passes.canonical.attention.steps import resolve_softcaps

log = logging.getLogger(__name__)


def canonicalize(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Canonical:
    """A copy of ``gm`` with eager attention chains as SDPA nodes and attention scalars as constants."""
    new_gm = copy_graph_module(gm)
    graph = new_gm.graph
    canon = Canonical(new_gm)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    values = dict(zip(placeholders, example_inputs))
    removed = _remove_dead_code(graph)
    for sm in [n for n in graph.nodes if is_softmax(n)]:
        chain = match_eager_attention(sm, lambda n: _guarded_scalar(n, placeholders, values, canon))
        if chain is not None:
            canon.additive.extend(replace_with_sdpa(graph, chain, canon, values))
    resolve_softcaps(graph, placeholders, values, canon)
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in SDPA]:
        specialise_scalars(node, placeholders, values, canon)
        if CANONICAL.get(node) is None:
            key_bias_sdpa(graph, node, values, canon)
            relative_bias_sdpa(graph, node, values, canon)
    for node in [n for n in graph.nodes if call_in(n, DROPOUT)]:
        specialise_dropout(node, placeholders, values, canon)
    removed += _remove_dead_code(graph)
    if not removed and not canon.notes:
        return Canonical(gm)  # nothing to canonicalise: analyse the graph itself
    graph.lint()
    new_gm.recompile()
    return canon


def _guarded_scalar(n: fx.Node, placeholders: list, values: dict, canon: Canonical) -> Optional[float]:
    """The value of the scalar node ``n`` read from an input (``x.item()``, ``1 / x.item()``), with a per-call
    guard on that input; None when it is computed otherwise."""
    value, src = scalar_value(n, placeholders, values)
    if value is None:
        return None
    pos, transform = src
    canon.guards.append(scalar_equals(pos, value, f"attention factor {n.name} (input {placeholders[pos].name})"))
    canon.notes.append(f"{n.name}: specialised to {transform(value)}")
    return float(transform(value))


def mask_guards(canon: Canonical, classified: dict, placeholders: Sequence[fx.Node]) -> list[BatchGuard]:
    """Guards for the attentions whose additive mask has key padding and makes a query row without a visible key
    other than 0 (module docstring): the canonicalised eager attentions, and the SDPA calls whose float
    ``attn_mask`` blocks with a finite value (``MaskInfo.finite_blocking``: ``-1e9``, ``finfo.min``)."""
    keypads = {}  # (key-padding input, window) -> what
    for a, info in classified.items():
        what = "eager attention with an additive mask" if a in canon.additive else \
            "attention whose float mask blocks with a finite value" if info.finite_blocking else None
        if what is not None and info.keypad is not None:
            keypads.setdefault((info.keypad, info.window), what)
    return [no_query_without_keys(placeholders.index(k), f"{what} on {k.name}", w)
            for (k, w), what in keypads.items()]


def _remove_dead_code(graph: fx.Graph) -> int:
    """Erase nodes without users that are pure and not in-place (FX's own DCE keeps no such promise for
    ``call_method`` mutations, so it is not used here); returns how many."""
    removed = 0
    for node in reversed(list(graph.nodes)):
        if node.op in ("call_function", "call_method", "get_attr") and not node.users \
                and not mutates(node) and not node.is_impure():
            graph.erase_node(node)
            removed += 1
    return removed
