"""Attention masks built outside the compiled graph (docs/ARCHITECTURE.md §8.2).

A per-block graph (``torch.compile(block)``, FSDP2 ``fully_shard`` per block, a graph break between the
model's mask construction and its layers) receives the ``[B | 1, 1 | H, L, L]`` mask its model built once,
as a graph input. :mod:`.masks` proves what a mask means by evaluating the subgraph that builds it; here
there is none, so the meaning is read off the tensor itself, at compile time from the example and at run
time from every call's mask, before the packed graph runs:

    vis[b, q, k]  = M[b, h, q, k]            (bool)   or   M[b, h, q, k] == 0   (additive float mask whose
                                                           other entries are -inf or finfo(dtype).min)
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

import dataclasses
import threading
import weakref
from typing import Optional

import torch
import torch.fx as fx

from brcompile.passes.axes import CannotReplay, example_value
from brcompile.passes.guards import BatchGuard

__all__ = ["InputMask", "classify_input_mask", "check_mask", "key_validity", "mask_guard"]

#: Elements of one query chunk of the check (bounds its temporary memory).
CHUNK_ELEMENTS = 1 << 24


@dataclasses.dataclass(frozen=True)
class InputMask:
    """What a mask input means: causal + key padding (its diagonal) [+ a sliding window]."""

    node: fx.Node  # the graph input holding the mask
    window: int = 0


def visible(mask: torch.Tensor) -> Optional[torch.Tensor]:
    """Which (q, k) pairs a mask lets through: a bool mask itself; an additive float mask's zeros, when
    every other entry is -inf or finfo(dtype).min (None otherwise: a bias, not a mask)."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        return None
    masked = (mask == float("-inf")) | (mask == torch.finfo(mask.dtype).min)
    if not bool((masked | (mask == 0)).all()):
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
            return "the mask holds values other than 0, -inf and finfo(dtype).min (a bias, not a mask)"
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


def classify_input_mask(attn: fx.Node, mask: fx.Node) -> InputMask:
    """The meaning of the example mask input ``mask`` of attention ``attn`` (CannotReplay if it has none
    that tree attention computes)."""
    x = example_value(mask)
    where = f"the attention mask comes from graph input {mask.name}"
    if not isinstance(x, torch.Tensor) or x.dim() not in (3, 4) or getattr(x, "fake_mode", None) is not None:
        raise CannotReplay(f"{where} (a mask built outside the compiled graph) and its example value cannot be "
                           "read", attn)
    m = x if x.dim() == 4 else x[:, None]
    vis = visible(m)
    if vis is None:
        raise CannotReplay(f"{where}: it holds values other than 0, -inf and finfo(dtype).min (an additive bias, "
                           f"not a mask)", attn)
    window = _window_of(vis)
    reason = check_mask(x, window)
    if reason is not None and window:
        window, reason = 0, check_mask(x, 0)
    if reason is not None:
        raise CannotReplay(f"{where} (a mask built outside the compiled graph, read from the tensor): {reason}",
                           attn)
    return InputMask(mask, window)


# --------------------------------------------------------------------------------------------------
# run time: each call's mask is checked once per tensor

_CHECKED: dict[int, tuple] = {}  # id(mask) -> (weakref, _version, data_ptr, shape, window, reason)
_LOCK = threading.Lock()


def _cached_check(mask: torch.Tensor, window: int) -> Optional[str]:
    key = (mask._version, mask.data_ptr(), tuple(mask.shape), window)
    with _LOCK:
        hit = _CHECKED.get(id(mask))
        if hit is not None and hit[0]() is mask and hit[1:5] == key:
            return hit[5]
    reason = check_mask(mask, window)
    try:
        ref = weakref.ref(mask, lambda _r, i=id(mask): _CHECKED.pop(i, None))
    except TypeError:
        return reason
    with _LOCK:
        _CHECKED[id(mask)] = (ref, *key, reason)
    return reason


def mask_guard(position: int, info: InputMask) -> BatchGuard:
    """Per call: input ``position`` is still causal + key padding (+ window) (module docstring)."""
    what = f"mask input {info.node.name} is causal & key padding" + (f" & window {info.window}" if info.window else "")

    def check(args):
        x = args[position]
        if not isinstance(x, torch.Tensor):
            return f"mask input {info.node.name} is {type(x).__name__} in this call, not a tensor"
        reason = _cached_check(x, info.window)
        return None if reason is None else f"mask input {info.node.name}: {reason}"

    return BatchGuard(f"{what} (input {position}, checked once per tensor)", check)
