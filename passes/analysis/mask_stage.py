"""The masks stage's helpers (passes/pipeline.py): every attention's mask classified, the key-padding and
sequence inputs, and the per-call guards of what the classes assume."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from brcompile.passes import probe
from brcompile.passes.analysis import input_masks, masks as masks_mod
from brcompile.passes.analysis.axes import is_static_input
from brcompile.passes.analysis.tree_inputs import AttentionSite
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.passes.analysis.guards import BatchGuard, scalar_equals
from brcompile.passes.meta import AXES
from brcompile.passes.canonical import attention as eager_attention
from brcompile.passes.spellings import arg


@dataclasses.dataclass(frozen=True)
class Masks:
    """What the masks stage found (passes/pipeline.py: ``state.masks``), read by the token-axes and guards stages."""

    #: the [B, L] tree inputs (ids, attention mask, position ids) the masks are probed and length-guarded with
    keys: list[fx.Node]
    #: the nodes that only build masks (``masks.mask_only_nodes``): no token facts, not emitted
    nodes: set[fx.Node]
    #: each tree attention -> its mask's meaning (an attention without a mask nor ``is_causal`` has none)
    meanings: dict[fx.Node, masks_mod.MaskInfo]
    #: the one key-padding input of every attention (``Analysis.keypad``), None without key padding
    keypad: Optional[fx.Node] = None
    #: a padding-free graph's position-id input (:func:`sequences_input`), None otherwise
    sequences: Optional[fx.Node] = None


def classify_masks(sites: Sequence[AttentionSite], mask_nodes, mask_keys, values, input_mask, outside: set) -> dict:
    """Every causal attention's :class:`.masks.MaskInfo`: ``is_causal`` alone is causal; a mask from outside the
    graph means what :mod:`.input_masks` read off it; any other mask is probed (:func:`.masks.classify`).
    Attentions without a mask and without ``is_causal`` are left out (the sdpa rule names them)."""
    classified: dict[fx.Node, masks_mod.MaskInfo] = {}
    for site in sites:
        a, m = site.node, site.mask
        is_causal = arg(a, 5, "is_causal", False)
        if m is None:
            if is_causal:
                classified[a] = masks_mod.MaskInfo("causal")
            continue
        if is_causal:
            raise CannotReplay(Code.MASK_USE, "attention with both a mask and is_causal=True", a)
        if a in outside:
            classified[a] = masks_mod.MaskInfo("causal+keypad", keypad=input_mask.source, window=input_mask.window)
            continue
        if m not in mask_nodes:
            raise CannotReplay(Code.MASK_USE, "attention mask is also used outside attention masks", a)
        if not mask_keys:
            raise CannotReplay(Code.MASK_SOURCE,
                               "the attention mask is built in the graph without any [B, L] input (token ids, "
                               "attention mask): its meaning cannot be probed; use is_causal=True", a)
        classified[a] = masks_mod.classify(a, m, mask_keys, values)
    return classified


def mask_guards(canon, sites: Sequence[AttentionSite], classified, outside, input_mask, sequences, mask_keys,
                placeholders, example_inputs) -> list[BatchGuard]:
    """The per-call guards of what the mask classification assumed: no query without keys (eager additive
    masks), the mask from outside the graph still causal & key padding, well-formed packed sequences, the
    length a probed meaning is proven for."""
    guards = eager_attention.mask_guards(canon, {a: i for a, i in classified.items() if a not in outside},
                                         placeholders)
    if input_mask is not None:
        guards.append(input_mask.guard())
    if sequences is not None:
        guards.append(masks_mod.sequences_guard(classified[sites[0].node], placeholders))
    raw = dict(zip(placeholders, example_inputs))
    for m in dict.fromkeys(s.mask for s in sites
                           if s.node in classified and s.node not in outside and isinstance(s.mask, fx.Node)):
        a = next(s.node for s in sites if s.mask is m)
        g = masks_mod.meaning_guard(a, m, classified[a], mask_keys, placeholders, raw)
        if g is not None:  # a dynamic-length graph whose mask is proven up to a length only: O(1) length guard
            guards.append(g)
    return guards


def outside_input_mask(outside: dict, placeholders: list, example_inputs: Sequence[Any]) -> Optional[input_masks.InputMask]:
    """The one mask from outside the graph that the attentions in ``outside`` use, classified
    (:mod:`.input_masks`); None when there is none. Attentions with different such masks: CannotReplay (the
    tree has one key padding)."""
    if not outside:
        return None
    masks = list(dict.fromkeys(outside.values()))
    if len(masks) > 1:
        raise CannotReplay(Code.INPUT_MASK, f"the attentions use {len(masks)} different masks from outside the graph "
                           f"({', '.join(m.name for m in masks)}); one is supported", next(iter(outside)))
    a = next(iter(outside))
    return input_masks.classify_input_mask(a, masks[0], placeholders, example_inputs)


def sequences_input(attentions: list[fx.Node], classified: dict) -> Optional[fx.Node]:
    """The position-id input of a padding-free graph (every attention ``causal+sequences`` of the same
    input), None when no attention is; CannotReplay when only some are (the tree is over sequences or over
    rows, not both)."""
    seqs = {classified[a].sequences if a in classified else None for a in attentions}
    if seqs <= {None}:
        return None
    if len(seqs) > 1:
        names = sorted(str(classified[a]) if a in classified else "bidirectional" for a in attentions)
        raise CannotReplay(Code.PACKED_SEQUENCES,
                           f"attentions disagree on packed sequences ({', '.join(dict.fromkeys(names))}): some "
                           f"are causal within the sequences of a padding-free row, others are not")
    return next(iter(seqs))


def check_column_free(gm: fx.GraphModule, mask_nodes: set, sequences: fx.Node) -> None:
    """In a padding-free graph a token's value may depend on its sequence only, not on its column in the
    row: a packed token stands for tokens at different columns. A TOKEN value without a row dim is a
    function of the column alone (``arange(L)`` outside the masks, a per-position table made outside the
    graph): CannotReplay."""
    for n in gm.graph.nodes:
        if n.op == "output" or n in mask_nodes:
            continue
        ax = AXES.get(n)
        if ax is not None and ax.is_token and ax.row is None and not ax.local:  # flattened tokens keep their rows
            what = "a per-position input" if n.op == "placeholder" else "a value computed from the column"
            raise CannotReplay(Code.PACKED_SEQUENCES,
                f"padding-free batch (the attentions are causal within the sequences that {sequences.name} "
                f"starts): {what} ({n.name}) depends on the column in the row, not on the position in the "
                f"sequence; pass position ids instead", n)


def mask_scalar_guards(sites: Sequence[AttentionSite], placeholders: list, values: dict) -> list:
    """A per-call ``scalar_equals`` guard for every 0-dim tensor input the mask of one of ``sites`` is computed
    from (a float module attribute Dynamo lifts under ``dynamic=True``, e.g. an embedding's ``norm_type`` on the
    way to a per-key bias projected from the hidden states): the mask's meaning is proven at its example value
    only."""
    seen, guards = set(), []
    for m in (s.mask for s in sites):
        if not isinstance(m, fx.Node):
            continue
        for n in probe.ancestors(m):
            v = values.get(n) if n.op == "placeholder" else None
            if n in seen or not isinstance(v, torch.Tensor) or v.dim() != 0 or is_static_input(n):
                continue
            seen.add(n)
            guards.append(scalar_equals(placeholders.index(n), v.item(), f"mask scalar {n.name}"))
    return guards
