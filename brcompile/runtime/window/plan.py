"""A call's tokens against the window's store: which were computed by an earlier call (:func:`match`), and the
call's tree cut there (:func:`plan_window`)."""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
from torch import Tensor

from brcompile.runtime.tree import build_tree
from brcompile.runtime.window.store import WindowError, _Piece, _Store

__all__ = ["WindowPlan", "match", "plan_window"]


# ------------------------------------------------------------------------------------------------------- the plan

@dataclasses.dataclass(frozen=True)
class WindowPlan:
    """One call's split into replayed tokens (``cached_ids``, their store slots) and a chunk of new ones."""

    cached_ids: Tensor  # [C] packed ids (of the call's tree) replayed from the store, ascending
    slots: Tensor  # [C] their store slots
    new_ids: Tensor  # [n] packed ids computed by this call, ascending
    end: Tensor  # [n] chunk-local subtree ends
    segments: Tensor  # [s, 3] chunk-local segments
    cross: Tensor  # [X, 4] (q_start, q_stop, k_start, k_stop): chunk queries x cache-local keys
    ancestors: Tensor  # [R, n] cache-local id of each new token's i-th ancestor (row i-1) if replayed, else -1


def plan_window(end: Tensor, segments: Tensor, cached: Tensor, slots: Tensor, depth: int = 0) -> WindowPlan:
    """Cut a call's tree into its replayed part ``cached`` (bool [N], ancestor-closed: within each segment a
    prefix ``[s0, c)``) and the chunk of the rest, as streaming cuts prefix and tails (runtime/streaming.py
    ``plan_replay``), but at any token. With ``b`` = cache-local ids (``before[k]`` replayed tokens before k) and
    ``bn`` = chunk-local ids: a segment's new part ``[c, s1)`` is the chunk segment ``(bn[c], bn[s1], bn[e])``;
    its replayed part ``[s0, c)`` is an ancestor chain of every chunk token in ``[c, e)``: the cross row
    ``(bn[c], bn[e], b[s0], b[c])``. ``slots``: the store slot of every token (-1 for new ones). ``depth``: how
    many ancestors along its path a new token's tree scans read (``TrunkGraphs.scan_depth``): the chunk's
    ``ancestors`` as a streaming chunk's (``_prefix_ancestors`` with the replayed tokens as the prefix; along a
    path new tokens come first, then replayed ones only, the replayed set being ancestor-closed)."""
    from brcompile.runtime.streaming import _prefix_ancestors, count_before  # streaming imports this module

    end, segments, cached = end.cpu(), segments.cpu(), cached.cpu()
    before, bn = count_before(cached), count_before(~cached)
    s0, s1, e = segments[:, 0], segments[:, 1], segments[:, 2]
    c = s0 + (before[s1] - before[s0])
    if bool(((bn[s1] - bn[c]) != (s1 - c)).any()):
        raise WindowError("internal: the replayed tokens are not a prefix of each segment")
    new_ids = (~cached).nonzero().flatten()
    part = c < s1
    seg = torch.stack([bn[c[part]], bn[s1[part]], bn[e[part]]], 1)
    rows = (c > s0) & (bn[e] > bn[c])
    cross = torch.stack([bn[c[rows]], bn[e[rows]], before[s0[rows]], before[c[rows]]], 1)
    cached_ids = cached.nonzero().flatten()
    ancestors = _prefix_ancestors(end, cached, before, depth)[:, new_ids]
    return WindowPlan(cached_ids, slots.cpu()[cached_ids], new_ids, bn[end[new_ids]], seg, cross, ancestors)


def _padded(x: Tensor, L: int, fill=0) -> Tensor:
    """``x`` [B, l, ...] padded with ``fill`` to [B, L, ...]."""
    if x.shape[1] == L:
        return x
    pad = x.new_full((x.shape[0], L - x.shape[1], *x.shape[2:]), fill)
    return torch.cat([x, pad], 1)


def match(store: _Store, per_token: Sequence[Tensor], mask: Optional[Tensor], tree) -> tuple[Tensor, Tensor, Tensor]:
    """(cached [N] bool, slots [N], reps [N]) for the call's packed tokens: which were computed by an earlier call
    of the window (and where they are stored); ``reps`` the flat (b·L + t) representative of each token. One exact
    prefix tree over the window's rows so far and the call's (``build_tree``): equal node <=> equal key path."""
    B, L = int(per_token[0].shape[0]), int(per_token[0].shape[1])
    m = torch.ones(B, L, dtype=torch.bool, device=per_token[0].device) if mask is None else mask.to(torch.bool)
    flat = tree.index.reshape(-1)
    keep = flat >= 0
    reps = torch.empty(tree.num_tokens, dtype=torch.int64, device=flat.device)
    reps[flat[keep]] = torch.arange(flat.numel(), device=flat.device)[keep]
    n = tree.num_tokens
    if not store.pieces:
        return torch.zeros(n, dtype=torch.bool), torch.full((n,), -1, dtype=torch.int64), reps
    Lw = max([L] + [k[0].shape[1] for k in store.keys])
    keys = [torch.cat([_padded(k[i], Lw) for k in store.keys] + [_padded(per_token[i], Lw)])
            for i in range(len(per_token))]
    masks = torch.cat([_padded(x, Lw, False) for x in store.masks] + [_padded(m, Lw, False)])
    combined = build_tree(keys, attention_mask=masks)
    slot_of = torch.full((combined.num_tokens,), -1, dtype=torch.int64)
    stored = combined.index[torch.cat(store.slot_row), torch.cat(store.slot_t)].cpu()
    slot_of[stored] = torch.arange(stored.shape[0])
    b, t = (reps // L).cpu(), (reps % L).cpu()
    slots = slot_of[combined.index[store.rows + b, t].cpu()]
    return slots >= 0, slots, reps


def _take(x: Tensor, ids: Tensor, dim: int = 0) -> Tensor:
    return x.index_select(dim, ids.to(x.device))


def _stored(pieces: Sequence[_Piece], get, slots: Tensor, dim: int) -> Tensor:
    """The store's values ``get(piece)`` at ``slots`` (pieces concatenated along ``dim`` in slot order)."""
    parts = [get(p) for p in pieces]
    whole = parts[0] if len(parts) == 1 else torch.cat(parts, dim)
    return _take(whole, slots, dim)
