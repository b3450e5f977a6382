"""Decode steps against a cache: graphs whose rows start before the batch, so nothing in it is shared.

Under ``generate`` (HF, TRL's rollouts), each step after the prefill runs the model on one new token per row
while every attention reads the row's earlier keys and values from a cache passed in as a graph input
(``past_key_values``: a ``DynamicCache``'s tensors concatenated with the new key, a static cache written in
place). The prefix tree merges rows whose tokens agree from column 0 of the batch (docs/ARCHITECTURE.md §4),
and it does so because column 0 is where each row starts. In a decode step it is not: a row's prefix is its
cache row, which is no tree key, and a row of the batch holds one token, which has no prefix within the batch
that another row could share. Two rows with the same new token compute different values when their caches
differ, and the tree cannot tell, so it must not merge them; with nothing else in a row, there is nothing to
compute once. The graph runs as it is, and the backend counts its calls as
unshared calls (:class:`passes.refusals.NothingToShare`), not as fallbacks.

The rule is structural and proven at compile time: the batch has one position per row (``L`` is the int 1:
Dynamo specialises a size of 1, so a graph captured with a symbolic ``L`` also serves longer batches and is
not a decode step), and some attention's query has one position per row and reads this batch's token, while
its keys span a position extent that is not 1 and hold a per-row floating-point graph input (leading extent
``B``, not a parameter) that the query does not read and that reaches the keys by moves only
(concatenation, views, a static cache's write, heads repeated): keys computed before this call, the cache.
An input the graph computes keys from (encoder states projected here, a context pooled by a learned query)
is not a cache: per-position work on it happens in this graph, so such a graph is analysed as any other. A
prefill with a cache (``L > 1``: a second turn, a chunked prefill) is not covered either: rows whose cached
prefixes are equal could share its tokens, so its refusal stays a refusal.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from brcompile.passes import probe
from brcompile.passes.analysis import masks as masks_mod
from brcompile.passes.analysis.axes import example_value, hint, is_static_input
from brcompile.passes.spellings import CACHE_MOVES, op_name

log = logging.getLogger(__name__)

__all__ = ["decode_against_cache"]


def _sdpa_operand(attn: fx.Node, i: int, name: str) -> Any:
    """The ``i``-th operand of a ``scaled_dot_product_attention`` call (query 0, key 1, value 2)."""
    return attn.args[i] if len(attn.args) > i else attn.kwargs.get(name)


def _is_one(size: Any) -> bool:
    """``size`` is 1 at every call: the int 1, or a symbol the shape environment proves is 1 (no guard added)."""
    return isinstance(size, (int, torch.SymInt)) and bool(statically_known_true(size == 1))


def _per_row_input(p: fx.Node, B: int) -> bool:
    """``p`` is a floating-point graph input of 3 dims or more whose leading extent is the batch's ``B`` rows and
    that is no parameter: per-row state passed into the graph (a cache's keys or values)."""
    v = example_value(p)
    return (p.op == "placeholder" and isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 3
            and not isinstance(v, torch.nn.Parameter) and hint(v.shape[0]) == B)


def _reads_batch_token(query: fx.Node, B: int) -> bool:
    """The query depends on a per-token input of the batch: a ``[B, 1, ...]`` graph input that is no parameter or
    buffer (token ids, position ids, hidden states of the new token)."""
    for n in probe.ancestors(query):
        v = example_value(n)
        if n.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim() >= 2 and not is_static_input(n) \
                and hint(tuple(v.shape[:2])) == (B, 1):
            return True
    return False




def _moved_only(source: fx.Node, key: fx.Node) -> bool:
    """Every node on a path from ``source`` to ``key`` (``key`` included) is a move (:data:`CACHE_MOVES`): ``key``
    holds ``source``'s stored values, none computed from them here."""
    on_path: set[fx.Node] = {source}
    for n in probe.ancestors(key):
        if n is source or not any(a in on_path for a in n.all_input_nodes):
            continue
        if op_name(n).split(".")[0] not in CACHE_MOVES:
            return False
        on_path.add(n)
    return key in on_path


def _cache_read_by_keys(attn: fx.Node, B: int) -> Optional[fx.Node]:
    """The cache an attention of a decode step reads its keys from, or None. It is one when the query has one
    position per row and reads this batch's token (:func:`_reads_batch_token`), the keys span a position extent
    that is not 1, and they depend on a per-row input (:func:`_per_row_input`) that the query does not read and
    that reaches them by moves only (:func:`_moved_only`): keys computed before this call. An input that the
    graph computes keys from (encoder states projected by ``k_proj``, a context pooled by a learned query) is
    no cache: per-position work on it is done here."""
    query, key = _sdpa_operand(attn, 0, "query"), _sdpa_operand(attn, 1, "key")
    q, k = example_value(query), example_value(key)
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() >= 2 and k.dim() >= 2):
        return None
    if not _is_one(q.shape[-2]) or _is_one(k.shape[-2]) or not _reads_batch_token(query, B):
        return None
    query_reads = set(probe.ancestors(query))
    for n in probe.ancestors(key):
        if n not in query_reads and _per_row_input(n, B) and _moved_only(n, key):
            return n
    return None


def decode_against_cache(attentions: list[fx.Node], L: Any, B: int) -> Optional[tuple[fx.Node, str]]:
    """(the attention, the reason) when the graph is a decode step against a cache (the module docstring): the
    batch's ``L`` is 1 at every call and an attention reads its keys from a per-row cache input; else None.
    ``L``: the batch's position extent as captured (an int, or a SymInt under dynamic shapes)."""
    if not _is_one(L):
        return None
    for attn in attentions:
        cache = _cache_read_by_keys(attn, B)
        if cache is None:
            continue
        reason = (f"a decode step against a cache: one token per row (L = 1), and the attention reads its keys "
                  f"from {cache.name}, a per-row input that reaches them by moves only and that its query does not "
                  f"read (past key values). Each row starts in its cache, not in the batch: a row's one token "
                  f"has no prefix within the batch that another row could share, and rows with the same token "
                  f"compute different values when their caches differ (nothing to share; it runs as it is)")
        log.debug("graph is a decode step: attention %s reads cache input %s", attn.name, cache.name)
        return attn, reason
    return None
