"""The canonical mask of a matched chain: its boolean or additive parts, their dtype, heads split."""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from brcompile.passes.canonical.attention.common import BLOCKING, EagerChain, call, same, tensor


def canonical_mask(graph: fx.Graph, ch: EagerChain) -> Optional[fx.Node]:
    """One float mask of the masked scores' dtype (:func:`_mask_dtype`), 0 where every mask step lets a key through and ``-inf`` where
    one blocks it (a masked score's probability is exactly 0 either way, ``BLOCKING``): an additive mask
    ``M`` (seen as ``M * post``) keeps 0 and turns values <= ``BLOCKING`` into ``-inf``, leaving any other
    value for the mask classification to refuse as a bias; a ``masked_fill``/``where`` condition becomes
    ``where(C, -inf, 0)`` (or its complement); a blend ``s * B + A`` is :func:`_blend_part`. None without mask steps. The nodes only build the mask: the
    classification (:mod:`..masks`) evaluates them on probes, the packed graph never runs them."""
    steps = [m for m in ch.masks if m[0] != "floor"]  # a floor at a blocking value leaves the mask as it is
    if not steps:
        return None
    dtype = _mask_dtype(ch, steps)
    parts = []
    for kind, *rest in steps:
        if kind in ("add", "bias"):
            M, post = (rest[0], rest[-1]) if kind == "add" else (_split_heads_operand(graph, rest[0], rest[1]),
                                                                 rest[-1])
            m = _additive_part(graph, M, post, dtype)
        elif kind == "blend":
            m = _blend_part(graph, *rest, dtype)
        else:
            C, _, _ = rest
            inf = float("-inf")
            m = call(graph, torch.where, (C, inf, 0.0) if kind == "fill" else (C, 0.0, inf))
            m = call(graph, "to", (m, dtype))
        parts.append(m)
    total = parts[0]
    for m in parts[1:]:
        total = call(graph, operator.add, (total, m))
    return total


def _mask_dtype(ch: EagerChain, steps: list) -> torch.dtype:
    """The dtype the softmax sees the masked scores in: the scores' (the output's, :func:`_check_compute_dtype`)
    promoted by every float operand added to them (a float32 mask on autocast's bfloat16 scores,
    :func:`_check_mask_precision`), so the canonical mask keeps the values the original added. A ``baddbmm``
    input (``bias``) is not a sum with the scores: the product rounds it to the scores' dtype."""
    dtype = tensor(ch.out).dtype
    for m in steps:
        operands = (m[1],) if m[0] == "add" else (m[1], m[2]) if m[0] == "blend" else ()
        for t in map(tensor, operands):
            if t is not None and t.is_floating_point():
                dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _additive_part(graph: fx.Graph, M: fx.Node, post: float, dtype: torch.dtype) -> fx.Node:
    """``M * post`` in ``dtype`` (a lower-precision mask is promoted exactly by the sum, :func:`_check_scores`) with
    values <= ``BLOCKING`` as ``-inf``; a per-head operand is a bias (ALiBi), kept as it is for the classification."""
    if tensor(M) is not None and tensor(M).dtype != dtype:
        M = call(graph, "to", (M, dtype))
    m = M if post == 1.0 else call(graph, operator.mul, (M, post))
    if not per_head(M):
        m = call(graph, "masked_fill", (m, call(graph, operator.le, (m, BLOCKING)), float("-inf")))
    return m


def _blend_part(graph: fx.Graph, B: fx.Node, A: fx.Node, post: float, dtype: torch.dtype) -> fx.Node:
    """The mask of a blend ``s * B + A`` (:func:`_blended_scores`): where B is 1 the scores get ``A`` added (its
    :func:`_additive_part`); where B is 0 the score is dropped for ``A``, a mask when ``A * post <= BLOCKING``
    (``-inf``); every other entry (B neither 0 nor 1, or 0 where A does not block) scales the scores or keeps a
    finite value without them: NaN, which the classification refuses (:func:`..masks.split_bias`)."""
    m = _additive_part(graph, A, post, dtype)
    dropped = call(graph, operator.eq, (B, 0))
    blocked = call(graph, operator.and_, (dropped, call(graph, operator.le, (m, BLOCKING))))
    kept = call(graph, operator.eq, (B, 1))
    m = call(graph, "masked_fill", (m, call(graph, operator.invert, (kept,)), float("nan")))
    return call(graph, "masked_fill", (m, blocked, float("-inf")))


def _split_heads_operand(graph: fx.Graph, M: Any, heads: int) -> Any:
    """A ``baddbmm`` input ``M`` of a 3-D attention (broadcast to the [B*H, Lq, Lk] scores) as an operand of
    the [B, H, Lq, Lk] scores: a dim 0 of extent B*H split into (B, H) (``M.unflatten(0, (-1, H))``: row
    b*H + h is [b, h], as :func:`split_heads` reads the scores); a dim 0 of extent 1, or fewer than 3 dims,
    broadcasts over (B, H) as it is."""
    t = tensor(M)
    if t is None or t.dim() < 3 or same(t.shape[0], 1):
        return M
    return call(graph, "unflatten", (M, 0, (-1, heads)))


def per_head(M: Any) -> bool:
    """Whether the additive operand ``M`` varies over the heads: a head dim of extent > 1 (dim 1 of a 4-D
    operand, dim 0 of a 3-D one): a bias such as ALiBi, not a mask."""
    t = tensor(M)
    return t is not None and ((t.dim() == 4 and t.shape[1] != 1) or (t.dim() == 3 and t.shape[0] != 1))
