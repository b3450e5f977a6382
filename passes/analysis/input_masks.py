"""Attention masks built outside the compiled graph (docs/ARCHITECTURE.md §8).

A per-block graph (``torch.compile(block)``, FSDP2 ``fully_shard`` per block, a graph break between the
model's mask construction and its layers) receives the ``[B | 1, 1 | H, L, L]`` mask its model built once,
as a graph input. :mod:`.masks` proves what a mask means by evaluating the subgraph that builds it; here
there is none, so the meaning is read off the tensor itself, at compile time from the example and at run
time from every call's mask, before the packed graph runs:

    vis[b, q, k]  = M[b, h, q, k]            (bool)   or   M[b, h, q, k] == 0   (additive float mask whose
                                                           other entries block: <= masks.BLOCKING, -1e4 —
                                                           -1e9, finfo(dtype).min, -inf)
    valid[b, k]   = vis[b, k, k]             (under any causal mask a query sees itself iff it is a real token)
    expected      = (k <= q) & (W == 0 or q - k < W) & valid[b, k]

The mask is accepted iff ``vis == expected`` at every (b, h, q, k) for W = 0 or for the window W read off
the example (every head alike); the attention is then ``causal+keypad`` (+ ``window(W)``) with the key
validity ``valid``, the tree's key-padding array, derived from the call's mask (:func:`key_validity`). An
additive mask must also leave every query a visible key (a fully masked row is uniform under softmax, 0
under tree attention). Anything else, at compile time: ``CannotReplay``; at run time: the call runs the
original graph with the reason.

Cost: the check reads the mask once, O(B·H·L²) elementwise in query chunks of bounded size (the dense
attention it replaces reads it once per layer), and once per tensor: the same mask passed to every block is
checked once (keyed by identity, version counter and storage).
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from brcompile.passes import probe
from brcompile.passes.analysis import masks as masks_mod
from brcompile.passes.analysis.axes import example_value, is_static_input
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.passes.analysis.guards import BatchGuard

__all__ = ["InputMask", "check_mask", "classify_input_mask", "input_mask_source", "key_validity"]

#: Elements of one query chunk of the check (bounds its temporary memory).
CHUNK_ELEMENTS = 1 << 24


def visible(mask: torch.Tensor) -> Optional[torch.Tensor]:
    """Which (q, k) pairs a mask lets through: a bool mask itself; an additive float mask's zeros, when
    every other entry blocks (:func:`..masks.blocked`: at most ``masks.BLOCKING``; None otherwise: a bias, not a
    mask)."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        return None
    if not bool((masks_mod.blocked(mask) | (mask == 0)).all()):
        return None
    return mask == 0


def key_validity(mask: torch.Tensor) -> torch.Tensor:
    """``valid[b, k] = vis[b, k, k]`` of a ``[B, H, L, L]`` / ``[B, L, L]`` mask (head 0), shape ``[B, L]``."""
    m = mask if mask.dim() == 3 else mask[:, 0]
    d = m.diagonal(dim1=-2, dim2=-1)
    return d if d.dtype == torch.bool else d == 0


def _window_of(vis: torch.Tensor) -> int:
    """The widest span ``q - first visible key + 1`` over the query rows that see a key; 0 (no window)
    when it is the whole length (some query sees key 0 from the last column)."""
    L = vis.shape[-1]
    any_vis = vis.any(-1)
    first = torch.where(any_vis, vis.int().argmax(-1), torch.zeros((), dtype=torch.long))
    q = torch.arange(L, device=vis.device)
    span = torch.where(any_vis, q - first + 1, torch.zeros((), dtype=torch.long))
    w = int(span.max()) if span.numel() else 0
    return 0 if w >= L else w


def check_mask(mask: torch.Tensor, window: int) -> Optional[str]:
    """None when ``mask`` is causal + key padding (its diagonal) [+ window], else the first reason it is not
    (module docstring). Reads the mask in query chunks of at most :data:`CHUNK_ELEMENTS` elements."""
    if mask.dim() not in (3, 4) or mask.shape[-1] != mask.shape[-2]:
        return f"the mask has shape {list(mask.shape)}, not [B, H, L, L] with as many keys as queries"
    m = mask if mask.dim() == 4 else mask[:, None]
    L = m.shape[-1]
    if m.dtype != torch.bool and not m.is_floating_point():
        return f"the mask is {m.dtype}, neither bool nor an additive float mask"
    valid = key_validity(m)
    additive = m.dtype != torch.bool
    k = torch.arange(L, device=m.device)
    chunk = max(1, CHUNK_ELEMENTS // max(1, m.shape[0] * m.shape[1] * L))
    for q0 in range(0, L, chunk):
        part = visible(m[..., q0:q0 + chunk, :])
        if part is None:
            return (f"the mask holds values other than 0 and blocking values (<= {masks_mod.BLOCKING:g}: -1e9, "
                    "finfo(dtype).min, -inf): a bias, not a mask")
        q = torch.arange(q0, min(L, q0 + chunk), device=m.device)[:, None]
        allowed = k <= q
        if window:
            allowed = allowed & (q - k < window)
        expected = allowed[None, None] & valid[:, None, None, :]
        if not bool((part == expected).all()):
            bad = (part != expected).nonzero()[0].tolist()
            bad[2] += q0
            what = f"sliding window {window}" if window else "causal"
            return (f"the mask is not {what} & key padding (its diagonal): it differs at (row, head, query, key) "
                    f"= {tuple(bad)}")
        if additive and not bool(part.any(-1).all()):
            return ("an additive mask leaves a query with no visible key (a left-padded row?): the original "
                    "softmax makes that row uniform, tree attention makes it 0")
    return None


def input_mask_source(mask: Any) -> Optional[fx.Node]:
    """The graph input an attention mask is made from, when it comes from outside the graph: the mask
    itself, or the only non-static ``[B | 1, ..., L, L]`` input of the subgraph that computes it
    (``mask[:, :, :, :L]``, ``where(mask, 0, -inf)``). None for a mask built inside the graph."""
    if not isinstance(mask, fx.Node):
        return None
    sources = [n for n in probe.ancestors(mask) if n.op == "placeholder" and not is_static_input(n)
               and isinstance(example_value(n), torch.Tensor) and example_value(n).dim() in (3, 4)]
    return sources[0] if len(sources) == 1 else None


class InputMask:
    """An attention mask from outside the graph: what it means (causal & key padding [& window]), the
    per-call check and the tree's key padding, both computed once per call's mask tensor.

    ``mask``: the attention's mask node; ``inputs``: every graph input its subgraph reads, with its position
    (the first is the source: the ``[B, H, L, L]`` input)."""

    def __init__(self, mask: fx.Node, inputs: Sequence[tuple[fx.Node, int]], window: int):
        self.mask, self.inputs, self.window = mask, tuple(inputs), window
        self._seen: dict[int, tuple] = {}  # id(source) -> (weakref, key, reason, key padding)
        self._lock = threading.Lock()

    @property
    def source(self) -> fx.Node:
        return self.inputs[0][0]

    def __str__(self) -> str:
        w = f" & window {self.window}" if self.window else ""
        return f"mask input {self.source.name}: causal & key padding{w}"

    def value(self, args: Sequence[Any]) -> torch.Tensor:
        """The attention's mask for this call (its subgraph evaluated when it is computed from the input)."""
        if self.mask is self.source:
            return args[self.inputs[0][1]]
        return masks_mod.evaluate(self.mask, {n: args[i] for n, i in self.inputs})

    def examine(self, args: Sequence[Any]) -> tuple[Optional[str], Optional[torch.Tensor]]:
        """(why this call's mask is not what the rewrite assumed or None, the [B' , L] key padding)."""
        src = args[self.inputs[0][1]]
        if not isinstance(src, torch.Tensor):
            return f"{self.source.name} is {type(src).__name__} in this call, not a tensor", None
        key = (src._version, src.data_ptr(), tuple(src.shape),
               tuple(a if not isinstance(a, torch.Tensor) else (id(a), a._version)
                     for a in (args[i] for _, i in self.inputs[1:])))
        with self._lock:
            hit = self._seen.get(id(src))
            if hit is not None and hit[0]() is src and hit[1] == key:
                return hit[2], hit[3]
        mask = self.value(args)
        reason = check_mask(mask, self.window)
        found = (None if reason is None else f"{self.source.name}: {reason}",
                 None if reason is not None else key_validity(mask if mask.dim() == 4 else mask[:, None]))
        try:
            ref = weakref.ref(src, lambda _r, i=id(src), seen=self._seen: seen.pop(i, None))
        except TypeError:
            return found
        with self._lock:
            self._seen[id(src)] = (ref, key, *found)
        return found

    def guard(self) -> BatchGuard:
        """Per call: the mask is still causal & key padding (& window); checked once per mask tensor."""
        return BatchGuard(f"{self} (checked once per tensor)", lambda args: self.examine(args)[0],
                          code=Code.GUARD_INPUT_MASK)

    def key_padding(self, args: Sequence[Any]) -> torch.Tensor:
        """``valid[b, k]`` of this call's mask (after :meth:`guard` passed), ``[B' , L]``, B' = B or 1."""
        reason, valid = self.examine(args)
        if valid is None:
            raise RuntimeError(f"branch_replay: key padding of a mask that failed its check: {reason}")
        return valid


def classify_input_mask(attn: fx.Node, mask: fx.Node, placeholders: Sequence[fx.Node],
                        example: Sequence[Any]) -> InputMask:
    """The meaning of the mask ``mask`` of attention ``attn``, made from a graph input
    (:func:`input_mask_source`), read off the example (CannotReplay if tree attention does not compute it)."""
    source = input_mask_source(mask)
    where = f"the attention mask comes from graph input {source.name}"
    reads = [n for n in probe.ancestors(mask) if n.op == "placeholder"]
    inputs = [(source, placeholders.index(source))] + [(n, placeholders.index(n)) for n in reads if n is not source]
    try:
        x = InputMask(mask, inputs, 0).value(example)
    except CannotReplay:
        raise
    except Exception as e:
        raise CannotReplay(Code.INPUT_MASK,
                           f"{where} (a mask built outside the compiled graph) and the subgraph that reads it "
                           f"cannot be evaluated: {type(e).__name__}: {e}", attn) from e
    if not isinstance(x, torch.Tensor) or x.dim() not in (3, 4) or getattr(x, "fake_mode", None) is not None:
        raise CannotReplay(Code.INPUT_MASK,
                           f"{where} (a mask built outside the compiled graph) and its example value cannot be "
                           "read", attn)
    m = x if x.dim() == 4 else x[:, None]
    if m.shape[-1] != m.shape[-2]:
        raise CannotReplay(Code.INPUT_MASK,
                           f"{where} (a mask built outside the compiled graph): it spans {m.shape[-1]} key positions "
                           f"for {m.shape[-2]} query positions, keys that are not the batch's tokens (a static "
                           f"cache's); tree attention's keys are the batch's own positions", attn)
    vis = visible(m)
    if vis is None:
        raise CannotReplay(Code.INPUT_MASK,
                           f"{where}: it holds values other than 0 and blocking values (<= {masks_mod.BLOCKING:g}: "
                           "-1e9, finfo(dtype).min, -inf): an additive bias, not a mask", attn)
    window = _window_of(vis)
    reason = check_mask(x, window)
    if reason is not None and window:
        window, reason = 0, check_mask(x, 0)
    if reason is not None:
        raise CannotReplay(Code.INPUT_MASK,
                           f"{where} (a mask built outside the compiled graph, read from the tensor): {reason}",
                           attn)
    return InputMask(mask, inputs, window)
