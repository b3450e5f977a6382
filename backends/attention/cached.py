"""Tree attention of a chunk of tail tokens against cached prefix K/V (streaming replay, docs/ARCHITECTURE.md §7).

``brcompile::tree_attention_cached_forward(q, k, v, end, valid, segments, k_cache, v_cache,
cache_valid, cross, scale, impl) -> (out, lse)``

The queries are the n tokens of one chunk (q [Hq, n, D]); they see two key sets:

- their own chunk: ``k``/``v`` [Hkv, n, D] with the chunk's tree arrays ``end``/``valid``/``segments``
  (the tree mask of brcompile::tree_attention, computed by the impl named ``impl``);
- the cached prefix: ``k_cache``/``v_cache`` [Hkv, P, D], keys whose ``cache_valid`` bit is set, through
  ``cross`` [C, 4] int64 rows ``(q_start, q_stop, k_start, k_stop)``: queries [q_start, q_stop) of the
  chunk see cache keys [k_start, k_stop) (all of them: a cached segment is an ancestor chain of every
  chunk token below it, so the pair is non-causal — Hydragen's shared-prefix call).

Both parts merge by logsumexp, exactly as the CPU segment-pair schedule merges its calls:

    lse = logaddexp(lse_a, lse_b),   out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)

Backward of each part runs with the MERGED out and lse (``p = exp(s - lse)``, ``delta = rowsum(dout *
out)``), which is the exact gradient of the combined softmax restricted to that part's pairs; dq sums
over the parts, dk_cache/dv_cache collect the chunk's contribution to the prefix K/V (the streaming
runtime sums them over chunks before the prefix backward). The cached K/V is never copied.

On CPU, float32/float64 without a feature (the "cpu" impl's compiled kernel takes the chunk: cpu_kernel.py
``runs_cached``), one kernel call computes both parts, forward and backward (cpu_kernel.py: the cache's ranges are
more key ranges of the same online softmax and more key blocks of the same backward). Otherwise cross pairs run
through ``aten._scaled_dot_product_flash_attention_for_cpu`` on CPU and by explicit float64-capable matmuls elsewhere
(one [Hq, nq, nk] score block per cross row).

Attention sinks (``sinks`` [Hq], or [Hq, n] per chunk query) are merged once, after both parts
(``ops.sink_merge``), and their gradient is ``ops.sink_grad`` of the merged out and lse, as for the uncached
op. Position biases need the cache's positions ``cache_position`` [P] (as a window does) and run the cross pairs
as explicit math with the bias of each (chunk query q, cached key k):

    ALiBi (constant ``alibi`` or trainable ``slopes`` m):  m[h] * (cache_position[k] - position[q])
    relative bias (the chunk queries' table R [Hq, n, E]):  R[h, q, min(position[q] - cache_position[k], E - 1)]

their gradients (``dslopes`` = sum over pairs of dS * distance, ``drelbias`` = dS summed per distance bucket) are
the chunk part's plus the cross part's, both from the merged out and lse.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from brcompile.backends.attention.features import (
    CACHE_POSITION, CACHED_FEATURES, CACHED_FEATURES_AT, call_features,
)
from brcompile.backends.attention.args import (
    TreeAttentionArgs, TreeAttentionError, check_qkv, check_window, sink_grad, sink_merge,
)
from brcompile.backends.attention import cpu_kernel
from brcompile.backends.attention.op import (
    ATTENTION_IMPLS, count_visible_pairs, feature_grads, impl_for, register_lower_precision_autocast,
)

__all__ = ["CachedPrefix", "cross_calls", "tree_attention_cached"]


#: Largest cache-key range one cross call covers off the CPU, where the pair is explicit matmuls: the
#: [Hq, nq, nk] score block stays bounded, and the blocks merge by logsumexp like any other part.
MATH_KEY_BLOCK = 4096
#: Cross calls on CPU use the CPU flash kernel; False selects the explicit matmuls there too (tests).
USE_CPU_FLASH = True
#: Chunk and cross pairs in one call of the compiled CPU kernel where it takes them (cpu_kernel.runs_cached); False
#: runs the chunk through its impl and the cross pairs as below (tests, the benchmarks' "before").
USE_CPU_KERNEL = True


def _flash(a: TreeAttentionArgs) -> bool:
    """Whether the cross pairs of ``a`` run through the CPU flash kernel (CPU, no soft-cap, no position bias)."""
    return a.q.device.type == "cpu" and USE_CPU_FLASH and not (a.softcap or a.has_alibi or a.relbias is not None)


def cross_calls(cross: Tensor, cache_valid: Tensor, max_keys: Optional[int] = None) -> list:
    """The cross rows as backends.cpu.AttentionCall objects (non-causal; q range in the chunk, k range in
    the cache), each trimmed to its first..last valid cache key, optionally cut into key ranges of at most
    ``max_keys`` (each trimmed again); ranges without a valid key are dropped."""
    from brcompile.backends.attention.cpu import AttentionCall

    cross, cache_valid = cross.cpu(), cache_valid.cpu()
    calls = []
    if cross.numel() == 0:
        return calls
    valid_before = torch.zeros(cache_valid.shape[0] + 1, dtype=torch.int64)
    valid_before[1:] = cache_valid.cumsum(0)
    valid_pos = cache_valid.nonzero().flatten()
    for q0, q1, k0, k1 in cross.tolist():
        step = max_keys or max(k1 - k0, 1)
        for b0 in range(k0, k1, step):
            b1 = min(b0 + step, k1)
            count = int(valid_before[b1] - valid_before[b0])
            if q1 <= q0 or count == 0:
                continue
            first = int(valid_pos[int(valid_before[b0])])
            last = int(valid_pos[int(valid_before[b0]) + count - 1])
            calls.append(AttentionCall(q0, q1, first, last + 1, causal=False, holes=(last - first + 1) != count))
    return calls


@dataclass(frozen=True)
class CachedPrefix:
    """The cached prefix a chunk's queries also see (module docstring): ``k_cache``/``v_cache`` [Hkv, P, D],
    ``cache_valid`` [P] bool, ``cross`` [C, 4] int64 rows ``(q_start, q_stop, k_start, k_stop)`` and, with a
    window, the cache's positions ``cache_position`` [P]."""

    k_cache: Tensor
    v_cache: Tensor
    cache_valid: Tensor
    cross: Tensor
    cache_position: Optional[Tensor] = None

    def check(self, a: TreeAttentionArgs) -> "CachedPrefix":
        """Raise TreeAttentionError unless the cache fits the chunk's arguments ``a`` (works on fake
        tensors); returns self."""
        q, k_cache = a.q, self.k_cache
        check_qkv(q, k_cache, self.v_cache, "tree_attention_cached")  # the cache as k, v: q's D and dtype
        if self.cache_valid.dtype != torch.bool or self.cache_valid.shape != k_cache.shape[1:2]:
            raise TreeAttentionError(f"tree_attention_cached: cache_valid must be bool [P={k_cache.shape[1]}]")
        if self.cross.dtype != torch.int64 or self.cross.dim() != 2 or self.cross.shape[1] != 4:
            raise TreeAttentionError(f"tree_attention_cached: cross must be int64 [C, 4], got {self.cross.dtype} "
                                     f"{tuple(self.cross.shape)}")
        check_window(a.window, self.cache_position, k_cache.shape[1])
        if (a.has_alibi or a.relbias is not None) and self.cache_position is None:
            raise TreeAttentionError("tree_attention_cached: a position bias (ALiBi, relbias) needs the cache's "
                                     "positions (cache_position)")
        return self

    def pieces(self, a: TreeAttentionArgs) -> list:
        """The cross calls as kernel calls (cpu.py's Piece, never causal), cut into key ranges of at
        most MATH_KEY_BLOCK where they run as explicit math; with a window, query blocks whose keys are
        trimmed to the reachable positions and masked by the window (cpu.py's query_blocks, with the
        chunk's positions for the queries and the cache's for the keys)."""
        cv = self.cache_valid.cpu()
        pos = None if a.position is None else a.position.cpu()
        cpos = None if self.cache_position is None else self.cache_position.cpu()
        max_keys = None if _flash(a) else MATH_KEY_BLOCK
        return list(_pieces(cross_calls(self.cross, cv, max_keys), cv, a.window, pos, cpos))


def _pieces(calls, cache_valid: Tensor, window: int, position: Optional[Tensor], cache_position: Optional[Tensor],
            block: int = 512):
    """The kernel calls of ``calls`` (see :meth:`CachedPrefix.pieces`)."""
    from brcompile.backends.attention.cpu import Piece, query_blocks

    for call in calls:
        if not window:
            seen = cache_valid[None, call.k_start:call.k_stop] if call.holes else None
            yield Piece(call.q_start, call.q_stop, call.k_start, call.k_stop, False, None, None, seen)
            continue
        for q0, q1, k0, k1, seen in query_blocks(call.q_start, call.q_stop, call.k_start, call.k_stop, position,
                                                 cache_position, cache_valid, window, block):
            yield Piece(q0, q1, k0, k1, False, None, ~seen.any(1), seen)


def _cross_forward(a: TreeAttentionArgs, c: CachedPrefix, out: Tensor, lse: Tensor) -> None:
    """Merge every cross piece's (out_i, lse_i) into (out, lse)."""
    from brcompile.backends.attention.cpu import flash_fwd, group_kv, merge_safe, additive_mask, math_forward

    hkv = c.k_cache.shape[0]
    g = a.q.shape[0] // hkv
    qg = a.q.unflatten(0, (hkv, g))
    slopes = a.alibi_slopes()
    for pc in c.pieces(a):
        qs = slice(pc.q0, pc.q1)
        kg, vg = group_kv(c.k_cache, pc, g), group_kv(c.v_cache, pc, g)
        if _flash(a):
            o, l = flash_fwd(qg[:, :, qs], kg, vg, 0.0, False, attn_mask=additive_mask(pc.seen, a.q.dtype),
                              scale=a.scale)
        else:
            o, l = math_forward(qg[:, :, qs].to(lse.dtype), kg.to(lse.dtype), vg.to(lse.dtype), pc.seen, a.scale,
                                a.softcap, _cross_bias(a, c, slopes, pc, hkv))
        o, l = o.flatten(0, 1), l.flatten(0, 1)
        if pc.empty_rows is not None:
            e = pc.empty_rows.to(o.device)
            o, l = o.masked_fill(e[None, :, None], 0.0), l.masked_fill(e[None, :], float("-inf"))
        merge_safe(out[:, qs], lse[:, qs], o, l)


def _cross_bias(a: TreeAttentionArgs, c: CachedPrefix, slopes: Optional[Tensor], pc, hkv: int) -> Optional[Tensor]:
    """The position bias of cross piece ``pc`` (chunk queries against cached keys), [Hkv, g, nq, nk] in the
    accumulation dtype, or None: ALiBi ``m[h] * (cache_position[k] - position[q])`` plus the relative bias
    ``R[h, q, min(position[q] - cache_position[k], E - 1)]`` (module docstring)."""
    from brcompile.backends.attention.cpu import position_bias

    if slopes is None and a.relbias is None:
        return None
    return position_bias(a, slopes, pc.q0, a.position.cpu()[pc.q0:pc.q1], c.cache_position.cpu()[pc.k0:pc.k1], hkv)


def _cross_backward(a: TreeAttentionArgs, c: CachedPrefix, grad_out: Tensor, out: Tensor, lse: Tensor,
                    dq: Tensor, dk: Tensor, dv: Tensor, drel: Optional[Tensor] = None,
                    dslopes: Optional[Tensor] = None) -> None:
    """Accumulate the cross pieces' (dq, dk_cache, dv_cache), and the position biases' gradients into ``drel``
    [Hq, n, E] and ``dslopes`` [Hq] when given, with the merged out and lse (a row that sees nothing at all gets
    lse = +inf, so every p of it is 0)."""
    from brcompile.backends.attention.cpu import (
        accumulate_bias_grads, additive_mask, flash_bwd, group_kv, math_backward,
    )

    hkv = c.k_cache.shape[0]
    g = a.q.shape[0] // hkv
    qg, gog, outg = (t.unflatten(0, (hkv, g)) for t in (a.q, grad_out.to(a.q.dtype), out))
    lseg = lse.masked_fill(torch.isneginf(lse), float("inf")).unflatten(0, (hkv, g))
    slopes = a.alibi_slopes()
    for pc in c.pieces(a):
        qs, ks = slice(pc.q0, pc.q1), slice(pc.k0, pc.k1)
        kg, vg = group_kv(c.k_cache, pc, g), group_kv(c.v_cache, pc, g)
        if _flash(a):
            gq, gk, gv = flash_bwd(gog[:, :, qs], qg[:, :, qs], kg, vg, outg[:, :, qs], lseg[:, :, qs], 0.0,
                                    False, attn_mask=additive_mask(pc.seen, a.q.dtype), scale=a.scale)
        else:
            acc = lse.dtype
            gq, gk, gv, *ds = math_backward(gog[:, :, qs].to(acc), qg[:, :, qs].to(acc), kg.to(acc), vg.to(acc),
                                            outg[:, :, qs].to(acc), lseg[:, :, qs], pc.seen, a.scale, a.softcap,
                                            _cross_bias(a, c, slopes, pc, hkv),
                                            score_grad=drel is not None or dslopes is not None)
            if ds:
                accumulate_bias_grads(ds[0].flatten(0, 1), qs, a.position.cpu()[qs], c.cache_position.cpu()[ks],
                                      drel, dslopes)
        dq[:, qs] += gq.flatten(0, 1).to(dq.dtype)
        dk[:, ks] += gk.sum(1, dtype=dk.dtype)
        dv[:, ks] += gv.sum(1, dtype=dv.dtype)


def _arguments(q, k, v, end, valid, segments, k_cache, v_cache, cache_valid, cross, scale, window, position,
               cache_position, softcap, alibi=None, sinks=None, relbias=None,
               slopes=None) -> tuple[TreeAttentionArgs, CachedPrefix]:
    """The op's arguments (but ``impl``) as (chunk args, cached prefix), checked."""
    a = TreeAttentionArgs(q, k, v, end, valid, segments, scale, window, position, softcap, alibi, sinks, relbias,
                          slopes).check()
    return a, CachedPrefix(k_cache, v_cache, cache_valid, cross, cache_position).check(a)


def _kernel(impl: str, a: TreeAttentionArgs, c: CachedPrefix) -> bool:
    """Whether one call of the compiled CPU kernel computes both parts of ``a`` (no sinks) and ``c``: the chunk's
    impl is "cpu" and its kernel takes the chunk and the cache (cpu_kernel.runs_cached)."""
    return USE_CPU_KERNEL and impl_for(impl, a).name == "cpu" and cpu_kernel.runs_cached(a, c)


def _with_sinks(out: Tensor, lse: Tensor, sinks: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    out, lse = sink_merge(out, lse, sinks)
    return out.to(dtype), lse


@torch.library.custom_op("brcompile::tree_attention_cached_forward", mutates_args=())
def _cached_forward_op(q: Tensor, k: Tensor, v: Tensor, end: Tensor, valid: Tensor, segments: Tensor,
                       k_cache: Tensor, v_cache: Tensor, cache_valid: Tensor, cross: Tensor, scale: float,
                       impl: str, window: int = 0, position: Optional[Tensor] = None,
                       cache_position: Optional[Tensor] = None, softcap: float = 0.0,
                       alibi: Optional[list[float]] = None, sinks: Optional[Tensor] = None,
                       relbias: Optional[Tensor] = None, slopes: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(out [Hq, n, D], lse [Hq, n]) over the chunk's own tree keys and its cached prefix keys (and the sinks)."""
    a, c = _arguments(q, k, v, end, valid, segments, k_cache, v_cache, cache_valid, cross, scale, window, position,
                      cache_position, softcap, alibi, sinks, relbias, slopes)
    a = a.without_sinks()
    if _kernel(impl, a, c):
        out, lse = cpu_kernel.cached_forward(a, c)
        return (out, lse) if sinks is None else _with_sinks(out, lse, sinks, q.dtype)
    out_t, lse_t = impl_for(impl, a).forward(a)
    out, lse = out_t.to(a.lse_dtype).contiguous(), lse_t.to(a.lse_dtype).contiguous()
    _cross_forward(a, c, out, lse)
    if sinks is not None:
        out, lse = sink_merge(out, lse, sinks)
    return out.to(q.dtype), lse


@_cached_forward_op.register_fake
def _cached_forward_fake(q, k, v, end, valid, segments, k_cache, v_cache, cache_valid, cross, scale, impl,
                         window=0, position=None, cache_position=None, softcap=0.0, alibi=None, sinks=None,
                         relbias=None, slopes=None):
    a, _ = _arguments(q, k, v, end, valid, segments, k_cache, v_cache, cache_valid, cross, scale, window, position,
                      cache_position, softcap, alibi, sinks, relbias, slopes)
    ATTENTION_IMPLS.check_name(impl)
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=a.lse_dtype)


@torch.library.custom_op("brcompile::tree_attention_cached_backward", mutates_args=())
def _cached_backward_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        end: Tensor, valid: Tensor, segments: Tensor, k_cache: Tensor, v_cache: Tensor,
                        cache_valid: Tensor, cross: Tensor, scale: float,
                        impl: str, window: int = 0, position: Optional[Tensor] = None,
                        cache_position: Optional[Tensor] = None,
                        softcap: float = 0.0, alibi: Optional[list[float]] = None,
                        sinks: Optional[Tensor] = None, relbias: Optional[Tensor] = None,
                        slopes: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                  Tensor]:
    """(dq, dk, dv, dk_cache, dv_cache, drelbias, dslopes): each part's backward with the merged out and lse
    (sinks merged in); ``drelbias`` and ``dslopes`` sum both parts (empty tensors without them)."""
    a, c = _arguments(q, k, v, end, valid, segments, k_cache, v_cache, cache_valid, cross, scale, window, position,
                      cache_position, softcap, alibi, sinks, relbias, slopes)
    a = a.without_sinks()
    if _kernel(impl, a, c):
        return (*cpu_kernel.cached_backward(a, c, grad_out, out, lse), q.new_empty(0), q.new_empty(0))
    dq, dk, dv, *extra = impl_for(impl, a, backward=True).backward(a, grad_out, out, lse)
    acc = a.lse_dtype
    dq = dq.to(acc).contiguous()
    dkc = torch.zeros(k_cache.shape, dtype=acc, device=q.device)
    dvc = torch.zeros(v_cache.shape, dtype=acc, device=q.device)
    drel = None if relbias is None else extra.pop(0).to(acc).contiguous()
    dslopes = None if slopes is None else extra.pop(0).to(acc).contiguous()
    _cross_backward(a, c, grad_out, out, lse.to(acc), dq, dkc, dvc, drel, dslopes)
    drel = q.new_empty(0) if drel is None else drel.to(relbias.dtype)
    dslopes = q.new_empty(0) if dslopes is None else dslopes.to(slopes.dtype)
    return dq.to(q.dtype), dk, dv, dkc.to(k_cache.dtype), dvc.to(v_cache.dtype), drel, dslopes


@_cached_backward_op.register_fake
def _cached_backward_fake(grad_out, q, k, v, out, lse, end, valid, segments, k_cache, v_cache, cache_valid,
                          cross, scale, impl, window=0, position=None, cache_position=None, softcap=0.0,
                          alibi=None, sinks=None, relbias=None, slopes=None):
    drel = q.new_empty(0) if relbias is None else relbias.new_empty(relbias.shape)
    dslopes = q.new_empty(0) if slopes is None else slopes.new_empty(slopes.shape)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), k_cache.new_empty(k_cache.shape),
            v_cache.new_empty(v_cache.shape), drel, dslopes)


def _setup_context(ctx, inputs, output):
    """Save what backward needs (the chunk's arguments as TreeAttentionArgs, the cache's beside out and lse);
    lse is an auxiliary output without gradient."""
    q, k, v, end, valid, segments, k_cache, v_cache, cache_valid, cross, scale, impl = inputs[:CACHED_FEATURES_AT]
    features = call_features(inputs, CACHED_FEATURES_AT, CACHED_FEATURES)
    cache_position = features.pop(CACHE_POSITION.name)
    a = TreeAttentionArgs(q, k, v, end, valid, segments, scale, **features)
    a.save_for_backward(ctx, *output, k_cache, v_cache, cache_valid, cross, cache_position)
    ctx.impl = impl
    ctx.mark_non_differentiable(output[1])


def _cached_tail(a: TreeAttentionArgs, cache_position) -> tuple:
    """The cached op's feature arguments (:data:`CACHED_FEATURES`) of the chunk's ``a`` and the cache's
    positions, all of them."""
    features = {**a.features, CACHE_POSITION.name: cache_position}
    return tuple(features[f.name] for f in CACHED_FEATURES)


def _backward(ctx, grad_out, grad_lse):
    """d(out)/d(q, k, v, k_cache, v_cache, relbias, slopes) via the cached backward op, d(out)/d(sinks) by
    :func:`sink_grad`."""
    a, (out, lse, k_cache, v_cache, cache_valid, cross, cache_position) = TreeAttentionArgs.saved(ctx)
    dq, dk, dv, dkc, dvc, drel, dslopes = torch.ops.brcompile.tree_attention_cached_backward(
        grad_out, a.q, a.k, a.v, out, lse, a.end, a.valid, a.segments, k_cache, v_cache, cache_valid, cross, a.scale,
        ctx.impl, *_cached_tail(a, cache_position))
    grads = {"sinks": lambda: sink_grad(grad_out, out, lse, a.sinks), "relbias": lambda: drel,
             "slopes": lambda: dslopes}
    return (dq, dk, dv, None, None, None, dkc, dvc, None, None, None, None,
            *feature_grads(ctx, a, grads, CACHED_FEATURES_AT, CACHED_FEATURES))


torch.library.register_autograd("brcompile::tree_attention_cached_forward", _backward,
                                setup_context=_setup_context)
# SDPA's autocast policy (backends/attention/op.py): q, k, v and the cached K/V cast to the autocast dtype (the trainable
# slopes kept, as for tree_attention_forward)
register_lower_precision_autocast("brcompile::tree_attention_cached_forward", keep=("slopes",))


def tree_attention_cached(q: Tensor, k: Tensor, v: Tensor, tree, k_cache: Tensor, v_cache: Tensor,
                          cache_valid: Tensor, cross: Tensor, scale: float, impl: str = "auto", window: int = 0,
                          position: Optional[Tensor] = None, cache_position: Optional[Tensor] = None,
                          softcap: float = 0.0, sinks: Optional[Tensor] = None,
                          alibi: Optional[list[float]] = None, relbias: Optional[Tensor] = None,
                          slopes: Optional[Tensor] = None) -> Tensor:
    """Out [Hq, n, D] of a chunk's queries over its own tree (``tree``: (end, valid, segments)) and the
    cached prefix K/V through ``cross`` (see the module docstring); ``window`` > 0 with the chunk's and the
    cache's positions: HF's sliding window; ``sinks``: [Hq] sink logits; ``alibi`` / ``slopes`` / ``relbias``:
    the position biases of :func:`brcompile.backends.attention.op.tree_attention` over the chunk's and the cache's
    positions. Differentiable in q, k, v, the cache, the sinks, the relative bias and the slopes."""
    end, valid, segments = tree
    constants = None if alibi is None else [float(m) for m in alibi]
    return torch.ops.brcompile.tree_attention_cached_forward(
        q, k, v, end, valid, segments, k_cache, v_cache, cache_valid, cross, float(scale), impl, window, position,
        cache_position, float(softcap), constants, sinks, relbias, slopes)[0]


def _cross_pairs(cross: Tensor, cache_valid: Tensor) -> int:
    """Visible (query, cached key) pairs: per cross row, its queries times its valid cache keys."""
    from brcompile.backends.attention.op import has_data

    if not (has_data(cross) and has_data(cache_valid)):
        return 0
    before = torch.zeros(cache_valid.shape[0] + 1, dtype=torch.int64, device=cache_valid.device)
    before[1:] = cache_valid.cumsum(0)
    c = cross.to(before.device)
    return int(((c[:, 1] - c[:, 0]) * (before[c[:, 3]] - before[c[:, 2]])).sum().item()) if c.numel() else 0


@register_flop_formula(torch.ops.brcompile.tree_attention_cached_forward, get_raw=True)
def _cached_forward_flop(q, k, v, end, valid, segments, k_cache, v_cache, cache_valid, cross, scale, impl,
                         window=0, position=None, cache_position=None, softcap=0.0, alibi=None, sinks=None, *args,
                         out_val=None,
                         **kwargs) -> int:
    """As tree_attention_forward's, over the chunk's own visible pairs plus its cross pairs (with a window,
    the cross pairs are counted without it: an upper bound)."""
    pairs = count_visible_pairs(end, valid, window, position) + _cross_pairs(cross, cache_valid)
    return pairs * q.shape[0] * (2 * q.shape[-1] + 2 * v.shape[-1])


@register_flop_formula(torch.ops.brcompile.tree_attention_cached_backward, get_raw=True)
def _cached_backward_flop(grad_out, q, k, v, out, lse, end, valid, segments, k_cache, v_cache, cache_valid,
                          cross, scale, impl, window=0, position=None, cache_position=None, softcap=0.0, alibi=None,
                          sinks=None, *args, out_val=None, **kwargs) -> int:
    pairs = count_visible_pairs(end, valid, window, position) + _cross_pairs(cross, cache_valid)
    return pairs * q.shape[0] * (6 * q.shape[-1] + 4 * v.shape[-1])
