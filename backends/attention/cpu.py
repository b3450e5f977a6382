"""Exact, memory-efficient CPU tree attention (docs/ARCHITECTURE.md §6), registered as impl ``"cpu"`` (the default
on CPU). Two ways, one answer:

- the **compiled kernel** (``cpu_kernel.py``, common/cpu/tree_attention.cpp): one call over the whole tree computing
  exactly the visible pairs; used when the compiled CPU kernels are available and it takes the call (float32 or
  float64, no window, soft-cap, ALiBi or relative bias: ``cpu_kernel.runs``);
- the **segment-pair schedule** below, over torch's CPU flash kernel, for everything else.

The segment-pair schedule. A segment s = [a, b) is a chain of single-child
nodes whose descendants are exactly [b, e) (e = its subtree end), so every key of s is seen by the
queries [k, e) and by no others. Trimmed to its valid keys [ka, kb) (ka, kb - 1: the first and last
valid key of s; keys before ka and from kb on are padding, visible to nobody), s needs two calls:

    causal:      queries [ka, kb) x keys [ka, kb), causal (top-left aligned, Lq == Lk)
    non-causal:  queries [kb, e)  x keys [ka, kb)  (the rest of s and all of its descendants at once,
                 Hydragen's trick: many queries against one shared K/V, no K/V copy per branch)

Queries [a, ka) see no key of s and take no part. Invalid keys strictly inside [ka, kb) ("holes") are
masked with an additive -inf attn_mask of q's dtype (the kernels require that dtype). Every query row of
every call sees at least key ka, so no call has a fully masked row; a query that sees nothing in the whole
tree is in no call and keeps out = 0, lse = -inf and zero gradient.

Each call is ``aten._scaled_dot_product_flash_attention_for_cpu`` -> (out_i, lse_i). The calls are planned
once per tree (:func:`_plan`: the schedule, each call's pieces, which rows an earlier call wrote) and the plan
is reused by every layer's forward and backward. (Batching the short causal calls into one padded call was
measured slower on CPU than the separate calls: the gathers cost more than the calls' overhead.) Partial
results merge by logsumexp:

    lse = logaddexp(lse_acc, lse_i),   out = out_acc * exp(lse_acc - lse) + out_i * exp(lse_i - lse)

Backward runs ``aten._scaled_dot_product_flash_attention_for_cpu_backward`` per call with the MERGED out
and lse. That is exact: with p = exp(s - lse) and delta = rowsum(dout * out) taken from the merged
values, ds = p * (dp - delta) restricted to the call's pairs is the true score gradient there; dq sums
over calls, dk/dv of a key sum over the (at most two) calls of its segment.

GQA: query heads are viewed as [Hkv, g, L, D]; K/V of a segment are expanded over g with stride 0 (no
copy by us). Memory: O(N * Hq * D) accumulators plus one call's operands and results.

Sliding window W (HF's, over tree positions): query q also needs ``pos[q] - pos[k] < W``. Each call is
then cut into query blocks of at most ``WINDOW_QUERY_BLOCK`` rows; a block's keys are trimmed to the
positions some query of the block can reach (a segment's positions increase along its chain), and the
rest of the window is an explicit additive [nq, nk] mask (holes included). A block row that sees no key of
the call gets out = 0, lse = -inf before the merge; in backward a row that sees nothing at all is given
lse = +inf so that every p = exp(s - lse) of it is 0.

Logit soft-capping c (Gemma2: scores ``c * tanh(scale * q.k / c)``) and ALiBi (scores ``+ m[h] * (pos[k] -
pos[q])``): the CPU flash kernel has neither, so each call runs in query blocks by explicit matmuls in the
accumulation dtype (``math_forward`` / ``math_backward``: ``ds = p (dp - delta) (1 - t^2)``; the ALiBi bias is
a constant per pair, so ds is unchanged), merged and differentiated like the rest. So does a relative bias
R [Hq, N, E] (scores ``+ R[h, q, min(pos[q] - pos[k], E - 1)]``, gathered per block); its gradient is each
block's ds summed per distance bucket into the block's query rows of dR (``relative_bias_grad``).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from brcompile.backends.attention.args import (
    TreeAttentionArgs, TreeAttentionError, attention_backward, attention_forward, slopes_grad,
)
from brcompile.backends.attention.op import AttentionImpl, register_attention_impl
from brcompile.backends.attention import cpu_kernel
from brcompile.backends.attention.reference import relative_bias, relative_bias_grad

log = logging.getLogger(__name__)

__all__ = ["AttentionCall", "cpu_backward", "cpu_forward", "segment_schedule"]

#: ATen's CPU flash-attention kernels, forward and backward (cached.py runs them too)
flash_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


@dataclass(frozen=True)
class AttentionCall:
    """One kernel call: queries [q_start, q_stop) attend keys [k_start, k_stop).

    ``causal``: query q_start + i sees keys k_start .. k_start + i (only with equal ranges).
    ``holes``: some key inside [k_start, k_stop) is invalid and must be masked.
    """

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    causal: bool
    holes: bool

    def __post_init__(self):
        if not (self.q_start < self.q_stop and self.k_start < self.k_stop):
            raise TreeAttentionError(f"empty attention call {self}")
        if self.causal and (self.q_start, self.q_stop) != (self.k_start, self.k_stop):
            raise TreeAttentionError(f"causal call needs equal query and key ranges: {self}")

    @property
    def pairs(self) -> int:
        """Number of (query, key) pairs the call evaluates (masked holes included)."""
        lq, lk = self.q_stop - self.q_start, self.k_stop - self.k_start
        return lq * (lq + 1) // 2 if self.causal else lq * lk


def _check_segments(end: Tensor, segments: Tensor) -> None:
    """Raise TreeAttentionError unless the segments partition [0, N) into consecutive ranges
    [start, stop) with start < stop <= subtree_end <= N, and end[k] == subtree_end for every k in a
    segment (each segment is a chain whose keys are seen exactly by [k, subtree_end))."""
    n = end.shape[0]
    starts, stops, sub_ends = segments[:, 0], segments[:, 1], segments[:, 2]
    s = segments.shape[0]
    if s == 0:
        if n != 0:
            raise TreeAttentionError(f"no segments for N={n} tokens")
        return
    ok = (
        int(starts[0]) == 0
        and int(stops[-1]) == n
        and bool((starts[1:] == stops[:-1]).all())
        and bool((starts < stops).all())
        and bool((stops <= sub_ends).all())
        and bool((sub_ends <= n).all())
    )
    if not ok:
        raise TreeAttentionError(
            f"segments do not partition [0, {n}) into chains (start, stop, subtree_end): {segments.tolist()[:8]}..."
        )
    seg_of_token = torch.repeat_interleave(torch.arange(s), stops - starts)
    bad = (end != sub_ends[seg_of_token]).nonzero()
    if bad.numel():
        k = int(bad[0, 0])
        raise TreeAttentionError(
            f"end[] disagrees with segments: token {k} has end {int(end[k])} but its segment "
            f"{segments[seg_of_token[k]].tolist()} ends its subtree at {int(sub_ends[seg_of_token[k]])}"
        )


def segment_schedule(end: Tensor, valid: Tensor, segments: Tensor) -> list[AttentionCall]:
    """The kernel calls of the segment-pair schedule (see the module docstring), after checking that
    ``segments`` agrees with ``end``. Covers exactly the visible (query, key) pairs."""
    end, valid, segments = end.cpu(), valid.cpu(), segments.cpu()
    _check_segments(end, segments)
    n = end.shape[0]
    if n == 0:
        return []
    starts, stops, sub_ends = (segments[:, i].contiguous() for i in range(3))
    valid_pos = valid.nonzero().flatten()
    n_valid_before = torch.zeros(n + 1, dtype=torch.int64)
    n_valid_before[1:] = valid.cumsum(0)
    count = n_valid_before[stops] - n_valid_before[starts]
    has_keys = count > 0
    if valid_pos.numel() == 0:
        return []
    lo = torch.searchsorted(valid_pos, starts).clamp(max=valid_pos.numel() - 1)
    hi = (torch.searchsorted(valid_pos, stops) - 1).clamp(min=0)
    first, last = valid_pos[lo], valid_pos[hi]
    holes = (last - first + 1) != count
    calls = []
    for ka, kl, e, h, use in zip(first.tolist(), last.tolist(), sub_ends.tolist(), holes.tolist(), has_keys.tolist()):
        if not use:
            continue
        kb = kl + 1
        calls.append(AttentionCall(ka, kb, ka, kb, causal=True, holes=h))
        if kb < e:
            calls.append(AttentionCall(kb, e, ka, kb, causal=False, holes=h))
    if log.isEnabledFor(logging.DEBUG):
        log.debug(
            "tree_attention cpu schedule: N=%d segments=%d calls=%d pairs=%d",
            n, segments.shape[0], len(calls), sum(c.pairs for c in calls),
        )
    return calls


def _require_cpu(*tensors: Tensor) -> None:
    """Raise TreeAttentionError if a tensor is not on the CPU."""
    for t in tensors:
        if t.device.type != "cpu":
            raise TreeAttentionError(f"tree_attention impl 'cpu' needs CPU tensors, got one on {t.device}")


WINDOW_QUERY_BLOCK = 512


@dataclass(frozen=True)
class Piece:
    """One kernel call: queries [q0, q1) x keys [k0, k1), causal or with an explicit mask."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    mask: Optional[Tensor]  # additive, [1 or nq, nk]
    empty_rows: Optional[Tensor]  # [nq] bool: rows that see no key of this piece (blocked pieces only)
    seen: Optional[Tensor] = None  # [nq, nk] bool visibility (blocked pieces only)
    touched: bool = True  # (planned calls) an earlier call of the plan wrote some of its query rows


def _pieces(call: AttentionCall, valid: Tensor, dtype: torch.dtype, window: int, position: Optional[Tensor],
            blocked: bool = False):
    """The kernel calls of one schedule call: itself, or (with a window, or ``blocked``) its query blocks
    with an explicit [nq, nk] visibility (module docstring)."""
    if not (window or blocked):
        yield Piece(call.q_start, call.q_stop, call.k_start, call.k_stop, call.causal,
                     _key_mask(valid, call, dtype), None)
        return
    blocks = query_blocks(call.q_start, call.q_stop, call.k_start, call.k_stop, position, position, valid, window,
                          WINDOW_QUERY_BLOCK, call.causal)
    for q0, q1, k0, k1, seen in blocks:
        yield Piece(q0, q1, k0, k1, False, additive_mask(seen, dtype), ~seen.any(1), seen)


def query_blocks(q_start: int, q_stop: int, k_start: int, k_stop: int, qpos: Optional[Tensor],
                 kpos: Optional[Tensor], kvalid: Tensor, window: int, block: int, causal: bool = False):
    """Queries [q_start, q_stop) x keys [k_start, k_stop) cut into query blocks of at most ``block`` rows:
    (q0, q1, k0, k1, seen [nq, nk] bool). ``qpos``/``kpos`` are the positions of the query and key index
    spaces (the same tensor for a tree's own keys, the cache's for cached keys); with a window, a block's
    keys start at the first one some query of the block can reach (the keys' positions increase: they are
    one chain) and ``seen`` holds ``qpos - kpos < window``; ``causal`` (equal ranges) adds ``k <= q``;
    ``kvalid`` masks invalid keys. Blocks whose key range is empty are skipped."""
    for q0 in range(q_start, q_stop, block):
        q1 = min(q0 + block, q_stop)
        k0 = k_start
        if window:
            qp = qpos[q0:q1]
            k0 += int(torch.searchsorted(kpos[k_start:k_stop], qp.min() - window + 1))
        k1 = k_stop if not causal else min(k_stop, q1)
        if k0 >= k1:
            continue
        seen = kvalid[None, k0:k1].expand(q1 - q0, k1 - k0)
        if window:
            seen = seen & ((qp[:, None] - kpos[None, k0:k1]) < window)
        if causal:
            seen = seen & (torch.arange(k0, k1)[None, :] <= torch.arange(q0, q1)[:, None])
        yield q0, q1, k0, k1, seen


def additive_mask(seen: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """0 where seen, -inf elsewhere, in ``dtype`` (the CPU flash kernels want q's dtype); None for None."""
    return None if seen is None else torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, float("-inf"))


def piece_bias(slopes: Optional[Tensor], qpos: Optional[Tensor], kpos: Optional[Tensor], hkv: int,
               dtype: torch.dtype) -> Optional[Tensor]:
    """The ALiBi bias of one piece, [Hkv, g, nq, nk] = ``slopes[h] * (kpos[k] - qpos[q])`` (query head h =
    kv head * g + group index), in ``dtype``; None without slopes."""
    if slopes is None:
        return None
    rel = kpos.to(dtype)[None, :] - qpos.to(dtype)[:, None]
    return slopes.to(dtype).unflatten(0, (hkv, -1))[:, :, None, None] * rel.to(slopes.device)


def piece_scores(qb: Tensor, kb: Tensor, seen: Optional[Tensor], scale: float, softcap: float = 0.0,
                 bias: Optional[Tensor] = None):
    """(s, t) over [Hkv, g, nq, nk]: s = scale q.k^T, soft-capped to softcap * t with t = tanh(scale q.k^T /
    softcap) (t None without a cap), plus ``bias`` (ALiBi, :func:`piece_bias`); -inf where not seen (None:
    every key)."""
    s = torch.matmul(qb, kb.transpose(-1, -2)) * scale
    t = None
    if softcap:
        t = torch.tanh(s / softcap)
        s = t * softcap
    if bias is not None:
        s = s + bias
    return (s if seen is None else s.masked_fill(~seen.to(s.device), float("-inf"))), t


def math_forward(qb: Tensor, kb: Tensor, vb: Tensor, seen: Optional[Tensor], scale: float, softcap: float = 0.0,
                 bias: Optional[Tensor] = None):
    """(out, lse) of one piece by explicit math (soft-capping, ALiBi ``bias``: the CPU flash kernel has
    neither; off the CPU: no flash kernel). A row that sees nothing gets lse = -inf and out = 0."""
    s, _ = piece_scores(qb, kb, seen, scale, softcap, bias)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.matmul(p, vb), lse


def math_backward(do: Tensor, qb: Tensor, kb: Tensor, vb: Tensor, ob: Tensor, lse: Tensor, seen: Optional[Tensor],
                  scale: float, softcap: float = 0.0, bias: Optional[Tensor] = None, score_grad: bool = False):
    """(dq, dk, dv) of one piece with the merged out and lse (lse = +inf: a row that sees nothing):
    ds = p (dp - delta), times 1 - t^2 under a soft-cap (a ``bias`` only enters p); with ``score_grad`` also
    ds itself (the gradient of the biased scores, before the soft-cap's factor; 0 where not seen)."""
    s, t = piece_scores(qb, kb, seen, scale, softcap, bias)
    p = torch.exp(s - lse.unsqueeze(-1))
    dp = torch.matmul(do, vb.transpose(-1, -2))
    delta = (do * ob).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dscore = ds
    if t is not None:
        ds = ds * (1 - t * t)
    grads = (torch.matmul(ds, kb) * scale, torch.matmul(ds.transpose(-1, -2), qb) * scale,
             torch.matmul(p.transpose(-1, -2), do))
    return grads + (dscore,) if score_grad else grads


def _key_mask(valid: Tensor, call: AttentionCall, dtype: torch.dtype):
    """Additive [1, Lk] mask (0 for valid keys, -inf for holes) in q's dtype, or None without holes."""
    if not call.holes:
        return None
    return additive_mask(valid[None, call.k_start : call.k_stop], dtype)


def group_kv(t: Tensor, call, g: int) -> Tensor:
    """Keys/values of a call or piece, [Hkv, Lk, D] -> [Hkv, g, Lk, D] expanded with stride 0 (no copy)."""
    k0, k1 = (call.k0, call.k1) if isinstance(call, Piece) else (call.k_start, call.k_stop)
    return _grouped(t[:, k0:k1], g)


def _grouped(t: Tensor, g: int) -> Tensor:
    """Keys/values [Hkv, N, D] -> [Hkv, g, N, D], expanded over the g query heads of each group with stride 0
    (no copy); a call's keys are a slice of it."""
    return t.unsqueeze(1).expand(t.shape[0], g, t.shape[1], t.shape[2])


def _merge_into(out_acc: Tensor, lse_acc: Tensor, out_part: Tensor, lse_part: Tensor) -> None:
    """In place: (out_acc, lse_acc) <- logsumexp-merge with a partial result whose lse is finite.

    lse = logaddexp(lse_acc, lse_part); out = out_acc * exp(lse_acc - lse) + out_part * exp(lse_part - lse).
    A row with lse_acc = -inf (nothing seen yet) gets weight 0 for its old (zero) out.
    """
    lse_new = torch.logaddexp(lse_acc, lse_part)
    w_old = torch.exp(lse_acc - lse_new).unsqueeze(-1)
    w_new = torch.exp(lse_part - lse_new).unsqueeze(-1)
    out_acc.mul_(w_old).add_(out_part.to(out_acc.dtype) * w_new)
    lse_acc.copy_(lse_new)


@attention_forward
def cpu_forward(a: TreeAttentionArgs) -> tuple[Tensor, Tensor]:
    """(out [Hq, N, D] in q.dtype, lse [Hq, N]): the compiled kernel when it takes ``a``, else the segment-pair
    schedule with logsumexp merging."""
    q, k, v = a.q, a.k, a.v
    _require_cpu(q, k, v)
    if cpu_kernel.runs(a):
        return cpu_kernel.forward(a)
    hq, n, d = q.shape
    hkv, g = k.shape[0], a.group
    acc_dtype = a.lse_dtype
    out = torch.zeros((hq, n, d), dtype=acc_dtype)
    lse = torch.full((hq, n), float("-inf"), dtype=acc_dtype)
    qg = q.unflatten(0, (hkv, g))
    kx, vx = _grouped(k, g), _grouped(v, g)
    outg, lseg = out.view(hkv, g, n, d), lse.view(hkv, g, n)
    slopes = a.alibi_slopes()
    explicit = _explicit_math(a)
    for pc in _plan(a):
        kk, vv = kx[:, :, pc.k0 : pc.k1], vx[:, :, pc.k0 : pc.k1]
        if explicit:
            o, l = math_forward(qg[:, :, pc.q0 : pc.q1].to(acc_dtype), kk.to(acc_dtype), vv.to(acc_dtype), pc.seen,
                                a.scale, a.softcap, _bias(a, slopes, pc, hkv))
        else:
            o, l = flash_fwd(qg[:, :, pc.q0 : pc.q1], kk, vv, 0.0, pc.causal, attn_mask=pc.mask, scale=a.scale)[:2]
        rows = slice(pc.q0, pc.q1)
        if pc.empty_rows is not None and bool(pc.empty_rows.any()):  # window: rows that saw nothing here
            o = o.masked_fill(pc.empty_rows[None, None, :, None], 0.0)
            l = l.masked_fill(pc.empty_rows[None, None, :], float("-inf"))
            merge_safe(outg[:, :, rows], lseg[:, :, rows], o, l)
        elif pc.touched:
            _merge_into(outg[:, :, rows], lseg[:, :, rows], o, l)
        else:  # first contribution to these rows: the merge would be a copy
            outg[:, :, rows] = o
            lseg[:, :, rows] = l
    return out.to(q.dtype), lse


def _explicit_math(a: TreeAttentionArgs) -> bool:
    """Whether the pieces of ``a`` run as explicit matmuls (soft-cap, ALiBi (constant or trainable slopes) or a
    relative bias: the flash kernel has none of them)."""
    return bool(a.softcap or a.has_alibi or a.relbias is not None)


def _bias(a: TreeAttentionArgs, slopes: Optional[Tensor], pc: "Piece", hkv: int) -> Optional[Tensor]:
    """The ALiBi bias plus the relative bias of piece ``pc`` (queries and keys both of ``a``'s tree),
    [Hkv, g, nq, nk] in the accumulation dtype, or None."""
    if slopes is None and a.relbias is None:
        return None
    pos = a.position.cpu()
    return position_bias(a, slopes, pc.q0, pos[pc.q0:pc.q1], pos[pc.k0:pc.k1], hkv)


def position_bias(a: TreeAttentionArgs, slopes: Optional[Tensor], q0: int, qpos: Tensor, kpos: Tensor,
                  hkv: int) -> Optional[Tensor]:
    """[Hkv, g, nq, nk] in the accumulation dtype, or None: ALiBi ``slopes[h] * (kpos[k] - qpos[q])`` plus the
    relative bias ``R[h, q0 + q, min(qpos[q] - kpos[k], E - 1)]`` of ``a``'s table, for the queries from ``q0`` on
    at positions ``qpos`` against keys at positions ``kpos`` (the tree's own or a cached prefix's)."""
    bias = None if slopes is None else piece_bias(slopes, qpos, kpos, hkv, a.lse_dtype)
    if a.relbias is not None:
        rows = a.relbias[:, q0:q0 + qpos.shape[0]].to(a.lse_dtype)
        rel = relative_bias(rows, qpos, kpos).unflatten(0, (hkv, -1))
        bias = rel if bias is None else bias + rel
    return bias


def accumulate_bias_grads(ds: Tensor, qs: slice, qpos: Tensor, kpos: Tensor, drel: Optional[Tensor],
                          dslopes: Optional[Tensor]) -> None:
    """Add one piece's share of the position biases' gradients, from the gradient ``ds`` [Hq, nq, nk] of its
    biased scores (0 where not seen): to ``drel`` [Hq, N, E] at the piece's query rows ``qs`` (summed per
    distance bucket) and to ``dslopes`` [Hq] (summed over pairs times the distance), each when given."""
    if drel is not None:
        drel[:, qs] += relative_bias_grad(ds, qpos, kpos, drel.shape[-1])
    if dslopes is not None:
        dslopes += slopes_grad(ds, qpos, kpos)


def _schedule_pieces(a: TreeAttentionArgs):
    """The kernel calls of the segment-pair schedule of ``a``'s tree: query blocks with a window, a
    soft-cap or ALiBi (the explicit-math path needs each block's visibility)."""
    valid = a.valid.cpu()
    position = None if a.position is None else a.position.cpu()
    for call in segment_schedule(*a.tree):
        yield from _pieces(call, valid, a.q.dtype, a.window, position, blocked=_explicit_math(a))


_PLANS: list = []  # [(key, end, valid, segments, position, plan)], the last few trees' plans, newest first
_PLANS_KEPT = 4


def _plan(a: TreeAttentionArgs) -> list:
    """The kernel calls of ``a``'s tree in order (:func:`_schedule_pieces`), each with ``touched`` set. A plan
    depends on the tree arrays, the positions (with a window or explicit math), the dtype, the window and the
    explicit-math choice alone, so it is kept for the last few trees and reused when all of them are equal
    (every layer of a step, forward and backward, has the same tree)."""
    end, valid, segments = (t.cpu() for t in a.tree)
    position = a.position.cpu() if a.position is not None and (a.window or _explicit_math(a)) else None
    key = (end.shape[0], segments.shape[0], a.q.dtype, a.window, _explicit_math(a), position is None)
    for k, e, v, sg, pos, plan in _PLANS:
        if k == key and torch.equal(e, end) and torch.equal(v, valid) and torch.equal(sg, segments) \
                and (pos is None or torch.equal(pos, position)):
            return plan
    plan = _with_touched(list(_schedule_pieces(a)), end.shape[0])
    _PLANS.insert(0, (key, end.clone(), valid.clone(), segments.clone(),
                      None if position is None else position.clone(), plan))
    del _PLANS[_PLANS_KEPT:]
    return plan


def _with_touched(items: list, n: int) -> list:
    """The items with ``touched`` set: whether an earlier item wrote some of their query rows."""
    written = torch.zeros(n, dtype=torch.bool)
    out = []
    for it in items:
        rows = slice(it.q0, it.q1)
        out.append(dataclasses.replace(it, touched=bool(written[rows].any())))
        written[rows] = True
    return out


def merge_safe(out_acc: Tensor, lse_acc: Tensor, out_part: Tensor, lse_part: Tensor) -> None:
    """_merge_into where either side may be -inf (a row that has seen nothing): weights 0 there."""
    lse_new = torch.logaddexp(lse_acc, lse_part)
    none = torch.isneginf(lse_new)
    w_old = torch.where(none, 0.0, torch.exp(lse_acc - lse_new)).unsqueeze(-1)
    w_new = torch.where(none, 0.0, torch.exp(lse_part - lse_new)).unsqueeze(-1)
    out_acc.copy_(out_acc * w_old + out_part.to(out_acc.dtype) * w_new)
    lse_acc.copy_(lse_new)


@attention_backward
def cpu_backward(a: TreeAttentionArgs, grad_out: Tensor, out: Tensor, lse: Tensor) -> tuple[Tensor, ...]:
    """(dq, dk, dv), and dR with a relative bias, and dslopes with trainable ``slopes``: per call, the flash backward
    with the merged out and lse; dq (and dR, dslopes) accumulates over calls, dk/dv over the calls of each key's
    segment and over the query heads of its group (each visible pair lies in one piece); or the compiled kernel's
    (dq, dk, dv) when it takes ``a``."""
    q, k, v = a.q, a.k, a.v
    _require_cpu(grad_out, q, k, v, out, lse)
    if cpu_kernel.runs(a):
        return cpu_kernel.backward(a, grad_out, out, lse)
    hq, n, d = q.shape
    hkv, g = k.shape[0], a.group
    acc_dtype = a.lse_dtype
    dq = torch.zeros((hq, n, d), dtype=acc_dtype)
    dk = torch.zeros((hkv, n, d), dtype=acc_dtype)
    dv = torch.zeros((hkv, n, d), dtype=acc_dtype)
    qg = q.unflatten(0, (hkv, g))
    gog = grad_out.to(q.dtype).unflatten(0, (hkv, g))
    outg = out.unflatten(0, (hkv, g))
    lse_k = lse.to(acc_dtype)
    if a.window or _explicit_math(a):  # a row that sees nothing anywhere: lse = +inf makes each p = exp(s - lse) 0
        lse_k = lse_k.masked_fill(torch.isneginf(lse_k), float("inf"))
    lseg = lse_k.unflatten(0, (hkv, g))
    slopes = a.alibi_slopes()
    drel = None if a.relbias is None else torch.zeros(a.relbias.shape, dtype=acc_dtype)
    dslopes = None if a.slopes is None else torch.zeros(hq, dtype=acc_dtype)
    pos = None if a.position is None else a.position.cpu()
    kx, vx = _grouped(k, g), _grouped(v, g)
    dqg = dq.view(hkv, g, n, d)
    explicit = _explicit_math(a)
    for pc in _plan(a):
        qs = slice(pc.q0, pc.q1)
        ks = slice(pc.k0, pc.k1)
        kg, vg = kx[:, :, ks], vx[:, :, ks]
        if explicit:
            gq, gk, gv, *ds = math_backward(gog[:, :, qs].to(acc_dtype), qg[:, :, qs].to(acc_dtype),
                                            kg.to(acc_dtype), vg.to(acc_dtype), outg[:, :, qs].to(acc_dtype),
                                            lseg[:, :, qs], pc.seen, a.scale, a.softcap, _bias(a, slopes, pc, hkv),
                                            score_grad=drel is not None or dslopes is not None)
            if ds:
                accumulate_bias_grads(ds[0].flatten(0, 1), qs, pos[qs], pos[ks], drel, dslopes)
        else:
            gq, gk, gv = flash_bwd(gog[:, :, qs], qg[:, :, qs], kg, vg, outg[:, :, qs], lseg[:, :, qs], 0.0,
                                    pc.causal, attn_mask=pc.mask, scale=a.scale)
        dqg[:, :, qs] += gq
        dk[:, ks] += gk.sum(1, dtype=acc_dtype)
        dv[:, ks] += gv.sum(1, dtype=acc_dtype)
    grads = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype))
    grads = grads if drel is None else grads + (drel.to(a.relbias.dtype),)
    return grads if dslopes is None else grads + (dslopes.to(a.slopes.dtype),)


register_attention_impl(
    AttentionImpl(name="cpu", forward=cpu_forward, backward=cpu_backward, device_types=frozenset({"cpu"}),
                  supports_window=True, supports_softcap=True, supports_alibi=True, supports_relbias=True,
                  supports_alibi_grad=True)
)
