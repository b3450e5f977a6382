"""Triton tree attention over DFS-packed prefix-tree tokens (docs/ARCHITECTURE.md §4, §6).

Shapes (packed layout, one tree or a forest of ``N`` tokens in depth-first preorder)::

    q        [Hq,  N, D]   query head h reads kv head h // (Hq // Hkv)  (GQA)
    k, v     [Hkv, N, D]
    end      [N] int       exclusive end of each token's subtree range
    valid    [N] bool      key visible at all (padding keys are not)
    segments [S, 3] int    rows (start, stop, subtree_end): maximal single-child chains; [start, stop)
                           contiguous, the segment's descendants exactly [stop, subtree_end)
    out      [Hq, N, D]    softmax(scale * q k^T + mask) v, 0 for a query that sees no key
    lse      [Hq, N] f32   natural-log logsumexp of the visible scaled scores, -inf for such a query

Mask: query ``q`` sees key ``k``  <=>  ``k <= q < end[k]`` and ``valid[k]``. On the device ``valid`` is
folded into ``end`` (``kend = end if valid else 0``): a key with ``kend = 0`` is seen by nobody, so the
kernels read one int32 per key.

Sliding window (``window`` W > 0, ``position`` [N] int: the tree position = batch column of each token):
also ``position[q] - position[k] < W``. The kernels take it as a runtime int behind the constexpr flag
HAS_WINDOW (without a window they compile as before and read no positions). The forward and dQ then
start each query block at its first key tile that can hold a key inside some query's window
(:func:`window_tile_starts`): the ancestors of a block come in increasing position, so out-of-window
ancestor tiles are skipped and a block's work is O(W) keys. dK/dV masks per element only.

Logit soft-capping (``softcap`` c > 0, Gemma2): the natural-log scores become ``c * tanh(scale * q.k / c)``
before masking and the softmax (``lse`` is their logsumexp); the backward multiplies dS by
``1 - t^2``, ``t = tanh(scale * q.k / c)``, before forming dQ and dK (dV is unchanged). The kernels take
c as a runtime float behind the constexpr flag HAS_SOFTCAP (without it they compile as before) and cap
the natural-log scores before converting to base 2: ``s2 = c * log2(e) * t``. ``tanh`` is
:func:`_tanh_and_slope` (exp2 and a short series, the same in the interpreter and on the GPU). A window
and a soft-cap combine.

ALiBi (``alibi`` slopes m[Hq], with ``position``): the natural-log score of (q, k) in head h gains
``m[h] * (position[k] - position[q])`` after the soft-cap. The kernels take ``SLOPES`` = m * log2(e) (float32
[Hq]) behind the constexpr flag HAS_ALIBI (without it they compile as before and read no slopes) and add
``SLOPES[h] * (pos[k] - pos[q])`` to the base-2 score; the bias is constant in q and k, so dS (and the
soft-cap's factor) are unchanged. It combines with a window and a soft-cap. Trainable slopes (``a.slopes``, a
[Hq] tensor) run the same kernels; their gradient ``sum over visible (q, k) of dS[h, q, k] (pos[k] - pos[q])``
(dS of the natural-log, post-cap score) is summed per query row by the dQ kernel, which owns every row
(HAS_ALIBI_GRAD: ``DSLOPES[h, q]`` in float32, no atomics), and over the rows on the host.

Relative bias (``relbias``: a table R [Hq, N, E] of the query token, with ``position``): the natural-log score
of (q, k) in head h gains ``R[h, q, clamp(position[q] - position[k], 0, E - 1)]`` after the soft-cap. The
kernels take the table as given (any strides and floating dtype, read in float32) behind the constexpr flag
HAS_RELBIAS, gather its entry per visible pair (:func:`_relative_bias`) and add ``log2(e)`` times it to the
base-2 score; dS is unchanged (the bias does not depend on q or k). Its gradient ``dR[h, q, e] = sum over
visible k in bucket e of dS[h, q, k]`` (dS of the post-cap score) is the dQ kernel's, whose program owns its
query rows: the far column ``E - 1`` per row in registers, the nearer buckets by uncontended atomic adds to a
zeroed float32 [Hq, N, E] (see :func:`_tree_attn_bwd_dq`). The GPU tiles are halved with it
(:func:`_relbias_tiles`).

Schedule, without any N x N or (N/block)^2 structure:

* Forward and dQ: a query block ``[b0, b1)`` can only see ``{k < b1 : kend[k] > b0}``, and for ``k < b0``
  that is exactly the ancestors of token ``b0`` (subtree ranges are contiguous). So the block walks the
  ancestor segments of ``b0``'s segment (whole), its own segment up to ``b0``, and the diagonal
  ``[b0, b1)``; every visited tile is masked per element, which keeps blocks that straddle segment or
  subtree boundaries exact. These key ranges are built on the tensors' device from the segment table in
  O(N/BLOCK_M * depth) (:func:`build_key_tiles`), adjacent ranges merged, and cut into key tiles.

  Layout (CSR of key tiles): ``tile_ptr[nblocks + 1]`` int32 and ``tiles[T, 2]`` int32 rows
  ``(lo, hi)`` with ``0 < hi - lo <= BLOCK_N``; query block ``b`` visits tiles
  ``tile_ptr[b] : tile_ptr[b + 1]`` and keys ``lo <= k < hi`` of each. Tiles of one block are disjoint
  and cover every key the block can see.

* dK/dV: the queries that see any key of the key block ``[c0, c1)`` lie in the one contiguous range
  ``[c0, max kend over the block)``; the kernel walks it for every query head of its kv head's group
  and accumulates dK and dV in registers — all branches' gradients in one pass, no atomics.

The key tiles depend only on the segment table and the tile sizes; they are cached per segments
tensor (same object, same version counter), so a model's layers and the backward share one build.

Numerics follow Triton's fused-attention tutorial: base-2 online softmax in float32, scores scaled by
``scale * log2(e)``; float32 operands use IEEE dots (no TF32) so float32 stays exact to ~1e-6.
Supported: float16, bfloat16, float32; head dims 1..256 (padded to a power of two >= 16 and masked).
Triton 3.6's interpreter cannot run these kernels with NumPy >= 2 (its ``__index__`` of a loaded loop
bound fails; fixed in 3.7); compiled 3.6 is fine.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from brcompile.backends.attention.op import TreeAttentionArgs, attention_backward, attention_forward

log = logging.getLogger(__name__)

__all__ = [
    "KernelConfig",
    "LaunchConfig",
    "KeyTiles",
    "TreeAttentionFunction",
    "build_key_tiles",
    "default_launch_config",
    "is_interpreter",
    "tree_attention",
    "tree_attention_backward",
    "tree_attention_forward",
    "window_tile_starts",
]

_LOG2E = 1.4426950408889634  # the kernels spell log2(e) and ln(2) as literals (jit globals must be constexpr)
_MAX_HEAD_DIM = 256
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_DELTA_BLOCK_M = 32  # rows per program of the (memory-bound) delta kernel
_MAX_BLOCK = 256  # the largest tile side (KernelConfig)


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


# The kernels use only builtins of triton.language plus these combine functions, not its @jit helpers
# (tl.zeros, tl.max, tl.sum): those are decorated when triton.language is first imported, and if that
# happened before TRITON_INTERPRET=1 was set they would not run inside an interpreted kernel.
@triton.jit
def _maximum(a, b):
    """Combine function of a max-reduction."""
    return tl.maximum(a, b)


@triton.jit
def _add(a, b):
    """Combine function of a sum-reduction."""
    return a + b


@triton.jit
def _block_and_head(NUM_HEADS, HEAVY_LAST: tl.constexpr):
    """(block, head) of this program in a 1-D grid of nblocks * NUM_HEADS programs.

    Heads vary fastest, so the query heads of one GQA group run together and share K/V reads in L2. With
    HEAVY_LAST (forward, dQ: a query block's work grows with its position) blocks are handed out
    last-to-first, so the heaviest do not form the tail; dK/dV work shrinks with position and keeps the
    natural order. A 1-D grid also has no 65535 limit on the number of blocks.
    """
    pid = tl.program_id(0)
    nblocks = tl.num_programs(0) // NUM_HEADS
    block = pid // NUM_HEADS
    if HEAVY_LAST:
        block = nblocks - 1 - block
    return block, pid % NUM_HEADS


@triton.jit
def _tanh_and_slope(x):
    """(t, 1 - t^2) with t = tanh(x), elementwise in float32, accurate to a few ulp; no overflow.

    With ``e = exp(-2|x|)`` in (0, 1]: ``|t| = (1 - e) / (1 + e)`` and ``1 - t^2 = 4 e / (1 + e)^2`` (no
    cancellation where |t| -> 1; above |x| = 1/4, ``1 - e >= 0.39`` loses under an ulp to cancellation).
    For ``|x| < 1/4``, where ``1 - e`` would lose bits (absolute error ~eps, not relative), ``|t|`` is the
    Taylor series ``a - a^3/3 + 2a^5/15 - 17a^7/315 + 62a^9/2835`` (next term < 1e-8 relative).
    triton.language has no tanh (Triton 3.7), hence this formula, the same in the interpreter and on a GPU.
    """
    a = tl.abs(x)
    e = tl.exp2(a * -2.8853900817779268)  # exp(-2|x|) = 2^(-2 log2(e) |x|)
    r = 1.0 / (1.0 + e)
    y = a * a
    series = a * (1.0 + y * (-0.3333333333333333 + y * (0.13333333333333333
                                                     + y * (-0.05396825396825397 + y * 0.021869488536155203))))
    t_abs = tl.where(a < 0.25, series, (1.0 - e) * r)
    return tl.where(x < 0.0, -t_abs, t_abs), 4.0 * e * r * r


@triton.jit
def _softcap_factors(qk_scale, SOFTCAP):
    """(cap_in, cap_out) with ``s2 = cap_out * tanh(cap_in * q.k)`` the base-2 capped score: ``cap_in =
    scale / c`` (from ``qk_scale = scale * log2(e)``), ``cap_out = c * log2(e)``."""
    cap_out = SOFTCAP * 1.4426950408889634
    return qk_scale / cap_out, cap_out


@triton.jit
def _walk_setup(qk_scale, SOFTCAP, POS, offs_m, m_in, TILE_START, TILE_PTR, pid_m,
                HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                HAS_RELBIAS: tl.constexpr):
    """(cap_in, cap_out, pos_q, t_begin, t_end) for a query block's walk over its key tiles (forward, dQ):
    the soft-cap factors, the block's positions (read with a window, ALiBi or a relative bias), and its tile
    range — from the window's first reachable tile (TILE_START) with a window, else from the CSR pointer."""
    if HAS_SOFTCAP:
        cap_in, cap_out = _softcap_factors(qk_scale, SOFTCAP)
    else:
        cap_in, cap_out = 0.0, 0.0  # unused
    if HAS_WINDOW:
        pos_q = tl.load(POS + offs_m, mask=m_in, other=0)
        t_begin = tl.load(TILE_START + pid_m)
    else:
        pos_q = offs_m  # unused
        t_begin = tl.load(TILE_PTR + pid_m)
    if HAS_ALIBI or HAS_RELBIAS:
        pos_q = tl.load(POS + offs_m, mask=m_in, other=0)
    t_end = tl.load(TILE_PTR + pid_m + 1)
    return cap_in, cap_out, pos_q, t_begin, t_end


@triton.jit
def _key_tile(TILES, KEND, t, offs_n0):
    """(lo, offs_n, n_in, kend) of key tile ``t`` of the CSR walk: its start, its key ids, which of them
    are in the tile (< its stop), and their subtree ends (0 outside the tile)."""
    lo = tl.load(TILES + 2 * t)
    hi = tl.load(TILES + 2 * t + 1)
    offs_n = lo + offs_n0
    n_in = offs_n < hi
    kend = tl.load(KEND + offs_n, mask=n_in, other=0)
    return lo, offs_n, n_in, kend


@triton.jit
def _relative_bucket(dist, REL_E):
    """The relative bias's column of each pair: ``clamp(dist, 0, REL_E - 1)`` of ``dist = pos[q] - pos[k]``, int32
    (exact: clamped before the cast)."""
    return tl.minimum(tl.maximum(dist, 0), REL_E - 1).to(tl.int32)


@triton.jit
def _relative_bias(REL_ROWS, rows, dist, visible, stride_rn, stride_re, REL_E):
    """``R[h, q, clamp(dist, 0, REL_E - 1)]`` of one tile, in either layout ([M, N] or [N, M]), in float32
    (natural log; 0 off the visible pairs, whose entries are not read), with ``dist = pos[q] - pos[k]``.
    ``REL_ROWS``: the table of the head at the tile's first query, ``rows``: the tile's queries counted from it,
    broadcast to the tile ([M, 1] or [1, M]); offsets within the tile stay 32-bit (fewer registers)."""
    bucket = _relative_bucket(dist, REL_E)
    bias = tl.load(REL_ROWS + (rows * stride_rn + bucket * stride_re), mask=visible, other=0.0)
    return bias.to(tl.float32)


@triton.jit
def _query_key_scores(qk, offs_m, offs_n, n_in, kend, pos_q, POS, WINDOW, qk_scale, cap_in, cap_out, alibi2,
                      REL_ROWS, stride_rn, stride_re, REL_E,
                      HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                      HAS_RELBIAS: tl.constexpr):
    """(s2, visible, slope) of one [BLOCK_M, BLOCK_N] tile for the forward and dQ walks: base-2 scores
    ``s2`` (soft-capped: ``cap_out * tanh(cap_in * q.k)``; plus ``alibi2 * (pos[k] - pos[q])``, the head's
    ALiBi slope in base 2; plus ``log2(e) * R[h, q, clamp(pos[q] - pos[k], 0, REL_E - 1)]``, the relative bias,
    ``REL_ROWS`` the head's table at the block's first query), the tree mask ``k <= q < kend[k]`` (and
    ``pos[q] - pos[k] < WINDOW``), and d(capped)/d(raw) = 1 - t^2 (1.0 without a cap)."""
    visible = (offs_n[None, :] <= offs_m[:, None]) & (offs_m[:, None] < kend[None, :])
    if HAS_WINDOW:
        pos_k = tl.load(POS + offs_n, mask=n_in, other=0)
        visible = visible & ((pos_q[:, None] - pos_k[None, :]) < WINDOW)
    if HAS_SOFTCAP:
        t_cap, slope = _tanh_and_slope(qk * cap_in)
        s2 = t_cap * cap_out
    else:
        s2 = qk * qk_scale
        slope = 1.0
    if HAS_ALIBI:
        pos_kb = tl.load(POS + offs_n, mask=n_in, other=0)
        s2 = s2 + alibi2 * (pos_kb[None, :] - pos_q[:, None]).to(tl.float32)
    if HAS_RELBIAS:
        pos_kr = tl.load(POS + offs_n, mask=n_in, other=0)
        rows = tl.arange(0, offs_m.shape[0])[:, None]
        s2 = s2 + _relative_bias(REL_ROWS, rows, pos_q[:, None] - pos_kr[None, :], visible, stride_rn, stride_re,
                                 REL_E) * 1.4426950408889634
    return s2, visible, slope


@triton.jit
def _tree_attn_fwd(
    Q, K, V, KEND, POS, SLOPES, REL, TILE_PTR, TILE_START, TILES, OUT, LSE,
    stride_qh, stride_qn, stride_qd,
    stride_kh, stride_kn, stride_kd,
    stride_vh, stride_vn, stride_vd,
    stride_oh, stride_on, stride_od,
    stride_lh,
    stride_rh, stride_rn, stride_re,
    N, NUM_HEADS, qk_scale, WINDOW, SOFTCAP, REL_E,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_RELBIAS: tl.constexpr,
):
    """out[h, q] = sum_k p[q, k] v[k],  p = softmax_k(scale * q.k) over visible k;  lse[h, q] = log sum exp.

    With HAS_SOFTCAP the scores are ``SOFTCAP * tanh(scale * q.k / SOFTCAP)`` instead of ``scale * q.k``; with
    HAS_ALIBI they gain ``m[h] * (pos[k] - pos[q])`` (``SLOPES[h] = m[h] * log2(e)`` on the base-2 scores); with
    HAS_RELBIAS ``REL[h, q, min(pos[q] - pos[k], REL_E - 1)]`` (the [Hq, N, REL_E] table, any strides).

    One program per (query block, query head); see :func:`_block_and_head` for the order. Visible:
    ``k <= q < kend[k]``, and with HAS_WINDOW also ``pos[q] - pos[k] < WINDOW``; the block then starts at
    ``TILE_START[block]`` (its leading tiles, out of every query's window, are skipped), else at
    ``TILE_PTR[block]``. Online softmax in base 2:
    ``s2 = q.k * scale * log2(e)`` (capped: ``c * log2(e) * tanh(scale * q.k / c)``), running max ``m``,
    running sum ``l``; ``lse = (m + log2 l) * ln 2``.
    A query that sees nothing keeps ``l = 0`` and gets ``out = 0``, ``lse = -inf``.
    """
    tl.static_assert(BLOCK_M >= 16)
    tl.static_assert(BLOCK_N >= 16)
    tl.static_assert(BLOCK_D >= 16)
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(GROUP >= 1)
    pid_m, pid_h = _block_and_head(NUM_HEADS, True)
    kv_h = pid_h // GROUP

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n0 = tl.arange(0, BLOCK_N)
    m_in = offs_m < N
    d_in = offs_d < HEAD_DIM

    q_ptrs = (Q + pid_h.to(tl.int64) * stride_qh + (pid_m * BLOCK_M).to(tl.int64) * stride_qn
              + tl.arange(0, BLOCK_M)[:, None] * stride_qn + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=m_in[:, None] & d_in[None, :], other=0.0)
    k_head = K + kv_h.to(tl.int64) * stride_kh
    v_head = V + kv_h.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)

    cap_in, cap_out, pos_q, t_begin, t_end = _walk_setup(qk_scale, SOFTCAP, POS, offs_m, m_in, TILE_START, TILE_PTR,
                                                         pid_m, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_RELBIAS)
    alibi2 = tl.load(SLOPES + pid_h) if HAS_ALIBI else 0.0
    rel_rows = REL + pid_h.to(tl.int64) * stride_rh + (pid_m * BLOCK_M).to(tl.int64) * stride_rn
    for t in range(t_begin, t_end):
        lo, offs_n, n_in, kend = _key_tile(TILES, KEND, t, offs_n0)
        kT_ptrs = (k_head + lo.to(tl.int64) * stride_kn
                   + offs_n0[None, :] * stride_kn + offs_d[:, None] * stride_kd)
        kT = tl.load(kT_ptrs, mask=n_in[None, :] & d_in[:, None], other=0.0)
        qk = tl.dot(q, kT, input_precision=INPUT_PRECISION)
        s2, visible, _ = _query_key_scores(qk, offs_m, offs_n, n_in, kend, pos_q, POS, WINDOW, qk_scale, cap_in,
                                           cap_out, alibi2, rel_rows, stride_rn, stride_re, REL_E, HAS_WINDOW,
                                           HAS_SOFTCAP, HAS_ALIBI, HAS_RELBIAS)
        s = tl.where(visible, s2, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _maximum))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_sub[:, None])
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.reduce(p, 1, _add)
        v_ptrs = (v_head + lo.to(tl.int64) * stride_vn
                  + offs_n0[:, None] * stride_vn + offs_d[None, :] * stride_vd)
        v = tl.load(v_ptrs, mask=n_in[:, None] & d_in[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    o_ptrs = (OUT + pid_h.to(tl.int64) * stride_oh + (pid_m * BLOCK_M).to(tl.int64) * stride_on
              + tl.arange(0, BLOCK_M)[:, None] * stride_on + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=m_in[:, None] & d_in[None, :])
    tl.store(LSE + pid_h.to(tl.int64) * stride_lh + offs_m, lse, mask=m_in)


@triton.jit
def _tree_attn_bwd_delta(
    OUT, DO, DELTA,
    stride_oh, stride_on, stride_od,
    stride_doh, stride_don, stride_dod,
    stride_lh,
    N,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """delta[h, q] = sum_d dO[h, q, d] * out[h, q, d] in float32 (the softmax backward's row term)."""
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_in = offs_m < N
    mask = m_in[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = tl.arange(0, BLOCK_M)[:, None]
    o = tl.load(OUT + pid_h.to(tl.int64) * stride_oh + (pid_m * BLOCK_M).to(tl.int64) * stride_on
                + rows * stride_on + offs_d[None, :] * stride_od, mask=mask, other=0.0)
    do = tl.load(DO + pid_h.to(tl.int64) * stride_doh + (pid_m * BLOCK_M).to(tl.int64) * stride_don
                 + rows * stride_don + offs_d[None, :] * stride_dod, mask=mask, other=0.0)
    delta = tl.reduce(o.to(tl.float32) * do.to(tl.float32), 1, _add)
    tl.store(DELTA + pid_h.to(tl.int64) * stride_lh + offs_m, delta, mask=m_in)


@triton.jit
def _tree_attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, KEND, POS, SLOPES, REL, DK, DV,
    stride_qh, stride_qn, stride_qd,
    stride_kh, stride_kn, stride_kd,
    stride_vh, stride_vn, stride_vd,
    stride_doh, stride_don, stride_dod,
    stride_dkh, stride_dkn, stride_dkd,
    stride_dvh, stride_dvn, stride_dvd,
    stride_lh,
    stride_rh, stride_rn, stride_re,
    N, NUM_HEADS, sm_scale, qk_scale, WINDOW, SOFTCAP, REL_E,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_RELBIAS: tl.constexpr,
):
    """dV[k] = sum_q P[q, k] dO[q];  dK[k] = scale * sum_q dS[q, k] q[q],  dS = P (dO.v[k] - delta[q]).

    One program per (key block [c0, c1), kv head); ``P = exp(scale q.k - lse[q])`` on visible pairs,
    ``delta[q] = dO[q].out[q]``. Queries that see a key of the block lie in ``[c0, max kend)``; the
    program walks that range for each of the GROUP query heads sharing this kv head (no atomics). With
    HAS_WINDOW a pair is visible only if also ``pos[q] - pos[k] < WINDOW``. With HAS_SOFTCAP ``P`` uses the
    capped score ``c tanh(scale q.k / c)`` and ``dS`` is multiplied by ``1 - t^2``, ``t = tanh(scale q.k / c)``.
    With HAS_ALIBI ``P`` includes the bias ``m[h] (pos[k] - pos[q])`` (``dS`` needs nothing more: it is constant),
    with HAS_RELBIAS the relative bias ``REL[h, q, min(pos[q] - pos[k], REL_E - 1)]`` (likewise: dK and dV only
    read dS; the table's gradient is the dQ kernel's).
    """
    tl.static_assert(BLOCK_M >= 16)
    tl.static_assert(BLOCK_N >= 16)
    tl.static_assert(BLOCK_D >= 16)
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(GROUP >= 1)
    pid_n, kv_h = _block_and_head(NUM_HEADS, False)
    c0 = pid_n * BLOCK_N

    offs_n = c0 + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    n_in = offs_n < N
    d_in = offs_d < HEAD_DIM
    nd_mask = n_in[:, None] & d_in[None, :]

    kend = tl.load(KEND + offs_n, mask=n_in, other=0)
    if HAS_WINDOW:
        pos_k = tl.load(POS + offs_n, mask=n_in, other=0)
    if HAS_ALIBI or HAS_RELBIAS:
        pos_kb = tl.load(POS + offs_n, mask=n_in, other=0)
    k_ptrs = (K + kv_h.to(tl.int64) * stride_kh + c0.to(tl.int64) * stride_kn
              + tl.arange(0, BLOCK_N)[:, None] * stride_kn + offs_d[None, :] * stride_kd)
    k = tl.load(k_ptrs, mask=nd_mask, other=0.0)
    v_ptrs = (V + kv_h.to(tl.int64) * stride_vh + c0.to(tl.int64) * stride_vn
              + tl.arange(0, BLOCK_N)[:, None] * stride_vn + offs_d[None, :] * stride_vd)
    v = tl.load(v_ptrs, mask=nd_mask, other=0.0)

    dk = tl.full([BLOCK_N, BLOCK_D], 0.0, dtype=tl.float32)
    dv = tl.full([BLOCK_N, BLOCK_D], 0.0, dtype=tl.float32)
    q_hi = tl.reduce(kend, 0, _maximum)
    if HAS_SOFTCAP:
        cap_in, cap_out = _softcap_factors(qk_scale, SOFTCAP)
    for g in range(GROUP):
        h = kv_h * GROUP + g
        q_head = Q + h.to(tl.int64) * stride_qh
        do_head = DO + h.to(tl.int64) * stride_doh
        l_head = LSE + h.to(tl.int64) * stride_lh
        d_head = DELTA + h.to(tl.int64) * stride_lh
        alibi2 = tl.load(SLOPES + h) if HAS_ALIBI else 0.0
        rel_rows = REL + h.to(tl.int64) * stride_rh + c0.to(tl.int64) * stride_rn  # the table at query m0
        qT_ptrs = (q_head + c0.to(tl.int64) * stride_qn
                   + offs_m0[None, :] * stride_qn + offs_d[:, None] * stride_qd)
        do_ptrs = (do_head + c0.to(tl.int64) * stride_don
                   + offs_m0[:, None] * stride_don + offs_d[None, :] * stride_dod)
        for m0 in range(c0, q_hi, BLOCK_M):
            offs_m = m0 + offs_m0
            m_in = offs_m < q_hi
            qT = tl.load(qT_ptrs, mask=d_in[:, None] & m_in[None, :], other=0.0)
            lse = tl.load(l_head + offs_m, mask=m_in, other=0.0)
            qkT = tl.dot(k, qT, input_precision=INPUT_PRECISION)
            visible = (offs_n[:, None] <= offs_m[None, :]) & (offs_m[None, :] < kend[:, None])
            if HAS_WINDOW:
                pos_q = tl.load(POS + offs_m, mask=m_in, other=0)
                visible = visible & ((pos_q[None, :] - pos_k[:, None]) < WINDOW)
            if HAS_SOFTCAP:
                tT, slopeT = _tanh_and_slope(qkT * cap_in)
                s2T = tT * cap_out
            else:
                s2T = qkT * qk_scale
            if HAS_ALIBI or HAS_RELBIAS:
                pos_qb = tl.load(POS + offs_m, mask=m_in, other=0)
            if HAS_ALIBI:
                s2T = s2T + alibi2 * (pos_kb[:, None] - pos_qb[None, :]).to(tl.float32)
            if HAS_RELBIAS:
                relT = _relative_bias(rel_rows, offs_m0[None, :], pos_qb[None, :] - pos_kb[:, None], visible,
                                      stride_rn, stride_re, REL_E)
                s2T = s2T + relT * 1.4426950408889634
            pT = tl.where(visible, tl.exp2(s2T - lse[None, :] * 1.4426950408889634), 0.0)
            do = tl.load(do_ptrs, mask=m_in[:, None] & d_in[None, :], other=0.0)
            dv += tl.dot(pT.to(do.dtype), do, input_precision=INPUT_PRECISION)
            delta = tl.load(d_head + offs_m, mask=m_in, other=0.0)
            dpT = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
            dsT = pT * (dpT - delta[None, :])
            if HAS_SOFTCAP:
                dsT = dsT * slopeT
            dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT), input_precision=INPUT_PRECISION)
            qT_ptrs += BLOCK_M * stride_qn
            do_ptrs += BLOCK_M * stride_don
            rel_rows += BLOCK_M * stride_rn
    dk = dk * sm_scale

    dk_ptrs = (DK + kv_h.to(tl.int64) * stride_dkh + c0.to(tl.int64) * stride_dkn
               + tl.arange(0, BLOCK_N)[:, None] * stride_dkn + offs_d[None, :] * stride_dkd)
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=nd_mask)
    dv_ptrs = (DV + kv_h.to(tl.int64) * stride_dvh + c0.to(tl.int64) * stride_dvn
               + tl.arange(0, BLOCK_N)[:, None] * stride_dvn + offs_d[None, :] * stride_dvd)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=nd_mask)


@triton.jit
def _tree_attn_bwd_dq(
    Q, K, V, DO, LSE, DELTA, KEND, POS, SLOPES, REL, TILE_PTR, TILE_START, TILES, DQ, DSLOPES, DREL,
    stride_qh, stride_qn, stride_qd,
    stride_kh, stride_kn, stride_kd,
    stride_vh, stride_vn, stride_vd,
    stride_doh, stride_don, stride_dod,
    stride_dqh, stride_dqn, stride_dqd,
    stride_lh,
    stride_rh, stride_rn, stride_re,
    N, NUM_HEADS, sm_scale, qk_scale, WINDOW, SOFTCAP, REL_E,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_ALIBI_GRAD: tl.constexpr, HAS_RELBIAS: tl.constexpr,
):
    """dQ[q] = scale * sum_k dS[q, k] k[k],  dS = P (dO[q].v[k] - delta[q]),  P = exp(scale q.k - lse[q]).

    One program per (query block, query head), visiting the same key tiles (and window mask) as the
    forward. With HAS_SOFTCAP, ``P`` from the capped score and ``dS`` times ``1 - t^2`` (as for dK); with
    HAS_ALIBI, ``P`` from the score plus its ALiBi bias; with HAS_ALIBI_GRAD also
    ``DSLOPES[h, q] = sum_k dS[q, k] (pos[k] - pos[q])`` (dS before the soft-cap factor: the bias is added after
    the cap). With HAS_RELBIAS, ``P`` also from the relative bias, and its gradient ``DREL[h, q, e] = sum over
    visible k with bucket(q, k) = e of dS[q, k]`` (dS before the soft-cap factor, as for the slopes; ``DREL`` a
    zeroed contiguous float32 [Hq, N, REL_E]): this program owns rows q of head h, so no other program writes
    them. The last column (every distance >= REL_E - 1, most pairs of a long context) is summed per row in
    registers and stored once; a nearer bucket holds one key per row for tree positions (the ancestors' positions
    are distinct) and is added with an uncontended atomic, which keeps arbitrary positions (two visible keys in one
    bucket of a tile) exact.
    """
    tl.static_assert(BLOCK_M >= 16)
    tl.static_assert(BLOCK_N >= 16)
    tl.static_assert(BLOCK_D >= 16)
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(GROUP >= 1)
    pid_m, pid_h = _block_and_head(NUM_HEADS, True)
    kv_h = pid_h // GROUP
    b0 = pid_m * BLOCK_M

    offs_m = b0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n0 = tl.arange(0, BLOCK_N)
    m_in = offs_m < N
    d_in = offs_d < HEAD_DIM
    md_mask = m_in[:, None] & d_in[None, :]

    q = tl.load(Q + pid_h.to(tl.int64) * stride_qh + b0.to(tl.int64) * stride_qn
                + tl.arange(0, BLOCK_M)[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                mask=md_mask, other=0.0)
    do = tl.load(DO + pid_h.to(tl.int64) * stride_doh + b0.to(tl.int64) * stride_don
                 + tl.arange(0, BLOCK_M)[:, None] * stride_don + offs_d[None, :] * stride_dod,
                 mask=md_mask, other=0.0)
    lse = tl.load(LSE + pid_h.to(tl.int64) * stride_lh + offs_m, mask=m_in, other=0.0)
    delta = tl.load(DELTA + pid_h.to(tl.int64) * stride_lh + offs_m, mask=m_in, other=0.0)
    lse2 = lse * 1.4426950408889634
    k_head = K + kv_h.to(tl.int64) * stride_kh
    v_head = V + kv_h.to(tl.int64) * stride_vh

    dq = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    dslope = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    drel_last = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    cap_in, cap_out, pos_q, t_begin, t_end = _walk_setup(qk_scale, SOFTCAP, POS, offs_m, m_in, TILE_START, TILE_PTR,
                                                         pid_m, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_RELBIAS)
    alibi2 = tl.load(SLOPES + pid_h) if HAS_ALIBI else 0.0
    rel_rows = REL + pid_h.to(tl.int64) * stride_rh + b0.to(tl.int64) * stride_rn
    drel_rows = DREL + (pid_h.to(tl.int64) * N + b0) * REL_E  # the block's first row; its rows are contiguous
    for t in range(t_begin, t_end):
        lo, offs_n, n_in, kend = _key_tile(TILES, KEND, t, offs_n0)
        dn_mask = d_in[:, None] & n_in[None, :]
        kT = tl.load(k_head + lo.to(tl.int64) * stride_kn
                     + offs_n0[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                     mask=dn_mask, other=0.0)
        vT = tl.load(v_head + lo.to(tl.int64) * stride_vn
                     + offs_n0[None, :] * stride_vn + offs_d[:, None] * stride_vd,
                     mask=dn_mask, other=0.0)
        qk = tl.dot(q, kT, input_precision=INPUT_PRECISION)
        s2, visible, slope = _query_key_scores(qk, offs_m, offs_n, n_in, kend, pos_q, POS, WINDOW, qk_scale,
                                               cap_in, cap_out, alibi2, rel_rows, stride_rn, stride_re, REL_E,
                                               HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_RELBIAS)
        p = tl.where(visible, tl.exp2(s2 - lse2[:, None]), 0.0)
        dp = tl.dot(do, vT, input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        if HAS_ALIBI_GRAD:  # ds is 0 off the visible pairs (p is)
            pos_kd = tl.load(POS + offs_n, mask=n_in, other=0)
            dslope += tl.reduce(ds * (pos_kd[None, :] - pos_q[:, None]).to(tl.float32), 1, _add)
        if HAS_RELBIAS:  # ds is 0 off the visible pairs; the far column in registers, nearer buckets by atomics
            pos_kr = tl.load(POS + offs_n, mask=n_in, other=0)
            bucket = _relative_bucket(pos_q[:, None] - pos_kr[None, :], REL_E)
            far = bucket == REL_E - 1
            drel_last += tl.reduce(tl.where(far, ds, 0.0), 1, _add)
            tl.atomic_add(drel_rows + (tl.arange(0, BLOCK_M)[:, None] * REL_E + bucket), ds,
                          mask=visible & (bucket < REL_E - 1), sem="relaxed")
        if HAS_SOFTCAP:
            ds = ds * slope
        dq += tl.dot(ds.to(kT.dtype), tl.trans(kT), input_precision=INPUT_PRECISION)
    dq = dq * sm_scale
    if HAS_ALIBI_GRAD:
        tl.store(DSLOPES + pid_h.to(tl.int64) * N + offs_m, dslope, mask=m_in)
    if HAS_RELBIAS:
        tl.store(drel_rows + (tl.arange(0, BLOCK_M) * REL_E + (REL_E - 1)), drel_last, mask=m_in)

    dq_ptrs = (DQ + pid_h.to(tl.int64) * stride_dqh + b0.to(tl.int64) * stride_dqn
               + tl.arange(0, BLOCK_M)[:, None] * stride_dqn + offs_d[None, :] * stride_dqd)
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=md_mask)


# --------------------------------------------------------------------------------------------------
# Launch settings
# --------------------------------------------------------------------------------------------------


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch settings of one kernel: BLOCK_M queries x BLOCK_N keys per step."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if not (isinstance(value, int) and _is_pow2(value) and 16 <= value <= _MAX_BLOCK):
                raise ValueError(f"KernelConfig.{name} must be a power of two in [16, {_MAX_BLOCK}], got {value!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"KernelConfig.num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps!r}")
        if not (isinstance(self.num_stages, int) and 1 <= self.num_stages <= 8):
            raise ValueError(f"KernelConfig.num_stages must be an int in [1, 8], got {self.num_stages!r}")


@dataclass(frozen=True)
class LaunchConfig:
    """Settings of the three kernels: forward, backward dK/dV, backward dQ."""

    fwd: KernelConfig
    dkdv: KernelConfig
    dq: KernelConfig


def is_interpreter() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 at import time)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_tree_attn_fwd, InterpretedFunction)


def _block_d(head_dim: int) -> int:
    """Head dim padded to a power of two (>= 16, the smallest tl.dot size); padded lanes are masked."""
    return max(16, triton.next_power_of_2(head_dim))


# (fwd, dkdv, dq) per (operand width, padded head dim), each (block_m, block_n, num_warps, num_stages).
# Chosen by compiling for sm_90 offline (ptxas -v): no register spills, shared memory <= 196 KiB; fp32 uses
# IEEE FMA dots (no tensor cores), whose register use grows with the tile, hence its small tiles.
# Offline, without a GPU: triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=
# GPUTarget("cuda", 90, 32), options=dict(num_warps=, num_stages=)), with tt.divisibility 16 on pointers and
# strides and the unit head-dim strides as constexpr 1 (as a real launch specializes them), then Triton's
# bundled ptxas -v --gpu-name=sm_90a on asm["ptx"]. With HAS_WINDOW every config still compiles; ptxas
# then reports a few small spills (<= 28 bytes: fp32 D=64 dK/dV, 16-bit D=128 dQ; dK/dV at D=256 spilled
# ~20 bytes before the window too). With HAS_SOFTCAP (alone or with HAS_WINDOW; Triton 3.7.1's ptxas) every
# config compiles with unchanged shared memory; spills stay small (<= 80 bytes, the most at 16-bit D=256; none
# at 16-bit D=64 nor in the fp32 forward).
_GPU_CONFIGS = {
    ("16bit", 64): ((128, 64, 8, 3), (32, 128, 8, 3), (128, 64, 8, 3)),
    ("16bit", 128): ((128, 64, 8, 3), (32, 128, 8, 3), (128, 64, 8, 3)),
    ("16bit", 256): ((128, 64, 8, 2), (16, 64, 8, 2), (64, 32, 8, 2)),
    ("fp32", 64): ((32, 32, 4, 2), (16, 32, 4, 2), (32, 32, 4, 2)),
    ("fp32", 128): ((16, 16, 4, 2), (16, 32, 4, 2), (32, 32, 4, 2)),
    ("fp32", 256): ((16, 32, 8, 2), (16, 16, 8, 2), (16, 32, 4, 2)),
}
_HOPPER_SMEM = 200 * 1024  # below this much shared memory per block: fewer stages, narrower D=256 tiles


def _relbias_tiles(fwd: tuple, dkdv: tuple, dq: tuple) -> tuple:
    """The tiles with a relative bias: each kernel's tile of pairs halved along its gathered side (the keys of
    the forward and dQ, the queries of dK/dV; dK/dV's keys where its queries are already 16), at least 16.

    Each pair of a tile gathers its table entry through a 64-bit address, which at the tuned tiles pushes the
    kernels past 255 registers (sm_90, bf16, window + soft-cap + relative bias, offline as above: D=128 spills
    704 / 400 / 920 bytes in forward / dK/dV / dQ, against 40 / 72 / 80 without the bias). Halved: D=64 0 / 0 /
    48 bytes, D=128 32 / 40 / 176, D=256 384 / 0 / 144; float32 D=64 none. Not timed on a GPU yet."""
    def half(b):
        return max(16, b // 2)

    fwd = (fwd[0], half(fwd[1]), *fwd[2:])
    dq = (dq[0], half(dq[1]), *dq[2:])
    dkdv = (half(dkdv[0]), dkdv[1], *dkdv[2:]) if dkdv[0] > 16 else (dkdv[0], half(dkdv[1]), *dkdv[2:])
    return fwd, dkdv, dq


def default_launch_config(head_dim: int, dtype: torch.dtype, device: torch.device,
                          relbias: bool = False) -> LaunchConfig:
    """Tile sizes per head dim and dtype: 16x16 tiles in the interpreter, tuned ones on a GPU.

    GPU tiles follow Triton's fused-attention tutorial (forward 128 queries x 64 keys; dK/dV 32 queries x
    128 keys; dQ 128 x 64, which lets dQ reuse the forward's key tiles), tuned for H100/H200; on GPUs with
    less shared memory per block the pipelines get at most 2 stages and D = 256 forward tiles 64 x 32. With a
    relative bias (``relbias``) the tiles are halved (:func:`_relbias_tiles`).
    """
    device = torch.device(device)
    if device.type != "cuda":
        small = KernelConfig(16, 16, num_warps=1, num_stages=1)
        return LaunchConfig(fwd=small, dkdv=small, dq=small)
    width = "fp32" if dtype == torch.float32 else "16bit"
    fwd, dkdv, dq = _GPU_CONFIGS[(width, max(64, _block_d(head_dim)))]
    props = torch.cuda.get_device_properties(device)
    smem = getattr(props, "shared_memory_per_block_optin", None)
    roomy = smem >= _HOPPER_SMEM if smem is not None else props.major in (9, 10)
    if not roomy:
        if width == "16bit" and _block_d(head_dim) == 256:
            fwd = (64, 32, 8, 2)
        fwd, dkdv, dq = ((bm, bn, w, min(st, 2)) for bm, bn, w, st in (fwd, dkdv, dq))
    if relbias:
        fwd, dkdv, dq = _relbias_tiles(fwd, dkdv, dq)
    return LaunchConfig(fwd=KernelConfig(*fwd), dkdv=KernelConfig(*dkdv), dq=KernelConfig(*dq))


# --------------------------------------------------------------------------------------------------
# Per-query-block key tiles (CSR)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyTiles:
    """CSR of key tiles per query block: block b visits rows ``tiles[ptr[b]:ptr[b+1]]`` = (lo, hi)."""

    ptr: torch.Tensor  # [nblocks + 1] int32
    tiles: torch.Tensor  # [T, 2] int32, 0 < hi - lo <= block_n
    block_m: int
    block_n: int

    @property
    def num_tiles(self) -> int:
        return int(self.tiles.shape[0])


def _sorted_segments(segments: torch.Tensor, n: int, end: torch.Tensor | None):
    """Segments sorted by start and checked; returns (start, stop, subtree_end, depth, max_depth).

    Checks: the segments partition [0, n) into contiguous chains, subtree ends lie in [stop, n], and,
    when ``end`` is given, every token's end equals its segment's subtree end (true of a chain of
    single-child nodes). ``depth[s]`` counts the strict ancestor segments of s:
    ``#{p : start[p] < start[s] < subtree_end[p]}``, from a difference array over token positions.
    One host synchronisation carries the checks and the maximum depth.
    """
    if segments.dim() != 2 or segments.shape[1] != 3:
        raise ValueError(f"segments must be [S, 3] (start, stop, subtree_end), got shape {tuple(segments.shape)}")
    if segments.dtype == torch.bool or segments.is_floating_point() or segments.is_complex():
        raise TypeError(f"segments must be an integer tensor, got {segments.dtype}")
    if segments.shape[0] == 0:
        raise ValueError(f"segments is empty but there are {n} tokens")
    seg = segments.to(torch.int64)
    start, order = torch.sort(seg[:, 0])
    stop = seg[order, 1]
    subend = seg[order, 2]
    diff = torch.zeros(n + 2, dtype=torch.int64, device=seg.device)
    ones = torch.ones_like(start)
    diff.index_add_(0, (start + 1).clamp(0, n + 1), ones)
    diff.index_add_(0, subend.clamp(0, n + 1), -ones)
    depth = torch.cumsum(diff, 0)[start.clamp(0, n + 1)]
    checks = {
        "first start is 0": start[0] == 0,
        f"last stop is N={n}": stop[-1] == n,
        "stop[i] == start[i+1]": (stop[:-1] == start[1:]).all(),
        "stop > start": (stop > start).all(),
        f"stop <= subtree_end <= N={n}": ((subend >= stop) & (subend <= n)).all(),
    }
    if end is not None:
        tok = torch.arange(n, device=seg.device)
        seg_of = (torch.searchsorted(start, tok, right=True) - 1).clamp(min=0)
        checks["end[t] == subtree_end of t's segment"] = (end.to(torch.int64) == subend[seg_of]).all()
    facts = torch.cat([torch.stack(list(checks.values())).to(torch.int64), depth.max().reshape(1)]).tolist()
    failed = [name for name, good in zip(checks, facts[:-1]) if not good]
    if failed:
        raise ValueError(f"segments do not describe the {n} packed tokens as a DFS-ordered tree of chains: "
                         f"failed {failed}")
    return start, stop, subend, depth, int(facts[-1])


def _segment_parents(start: torch.Tensor, depth: torch.Tensor, n: int) -> torch.Tensor:
    """parent[s] = the segment holding the parent of token start[s], -1 for a root segment.

    In DFS order the parent segment is the last segment before s one level shallower (every segment
    in between lies inside the parent's subtree, so is deeper): sort segments by (depth, start) and
    search for the last key below (depth[s] - 1, start[s]).
    """
    key = depth * (n + 1) + start
    sorted_key, order = torch.sort(key)
    idx = torch.searchsorted(sorted_key, key - (n + 1)) - 1
    return torch.where(depth > 0, order[idx.clamp(min=0)], torch.full_like(order, -1))


def build_key_tiles(segments: torch.Tensor, n: int, block_m: int, block_n: int,
                    end: torch.Tensor | None = None) -> KeyTiles:
    """Key tiles for each query block of ``block_m`` tokens, from the segment table; O(N/block_m * depth).

    Query block ``[b0, b1)`` visits keys ``ancestors(b0) U [b0, b1)``: the ranges
    ``[start[s0], b1)`` (own segment s0 of b0, up to the block end) and ``[start[p], stop[p])`` for each
    ancestor segment p of s0. Adjacent ranges are merged; each range is cut into tiles of ``block_n``.
    """
    if n <= 0:
        raise ValueError(f"build_key_tiles needs at least one token, got n={n}")
    device = segments.device
    start, stop, subend, depth, max_depth = _sorted_segments(segments, n, end)
    parent = _segment_parents(start, depth, n)
    nblocks = triton.cdiv(n, block_m)
    b0 = torch.arange(nblocks, device=device, dtype=torch.int64) * block_m
    b1 = (b0 + block_m).clamp(max=n)
    cur = torch.searchsorted(start, b0, right=True) - 1

    # ranges[b, j] for j = 0 (own segment + diagonal) .. max_depth (root), descending positions.
    los = [start[cur]]
    his = [b1]
    for _ in range(max_depth):
        cur = torch.where(cur >= 0, parent[cur.clamp(min=0)], cur)
        alive = cur >= 0
        idx = cur.clamp(min=0)
        los.append(torch.where(alive, start[idx], 0))
        his.append(torch.where(alive, stop[idx], 0))
    lo = torch.stack(los[::-1], 1)  # ascending positions within a row
    hi = torch.stack(his[::-1], 1)
    row = torch.arange(nblocks, device=device).unsqueeze(1).expand_as(lo)
    keep = hi > lo
    lo, hi, row = lo[keep], hi[keep], row[keep]

    # merge ranges that touch: a run starts where the row changes or the range does not continue.
    prev_hi = torch.cat([hi.new_full((1,), -1), hi[:-1]])
    prev_row = torch.cat([row.new_full((1,), -1), row[:-1]])
    new_run = (row != prev_row) | (lo != prev_hi)
    last_of_run = torch.cat([new_run[1:], new_run.new_ones(1)])
    run_lo, run_hi, run_row = lo[new_run], hi[last_of_run], row[new_run]

    ntiles = (run_hi - run_lo + block_n - 1) // block_n
    first_tile = torch.cumsum(ntiles, 0) - ntiles
    total = int(first_tile[-1] + ntiles[-1])
    tile_run = torch.repeat_interleave(torch.arange(run_lo.numel(), device=device), ntiles,
                                       output_size=total)
    within = torch.arange(total, device=device) - first_tile[tile_run]
    tile_lo = run_lo[tile_run] + within * block_n
    tile_hi = torch.minimum(tile_lo + block_n, run_hi[tile_run])
    per_block = torch.zeros(nblocks, dtype=torch.int64, device=device)
    per_block.index_add_(0, run_row, ntiles)
    ptr = torch.cat([per_block.new_zeros(1), torch.cumsum(per_block, 0)])
    tiles = torch.stack([tile_lo, tile_hi], 1)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("key tiles: n=%d block_m=%d block_n=%d blocks=%d depth=%d tiles=%d",
                  n, block_m, block_n, nblocks, max_depth, total)
    return KeyTiles(ptr=ptr.to(torch.int32), tiles=tiles.to(torch.int32).contiguous(),
                    block_m=block_m, block_n=block_n)


class _TensorKeyedCache:
    """A small cache of values built from a tensor (plus hashable parameters), LRU by insertion.

    An entry holds a strong reference to the tensor, so a hit requires the very same tensor object (its
    memory cannot have been reused) at the same version counter (no in-place change) with equal
    parameters — a tree's layers, and its backward, share one build within a call.
    """

    def __init__(self, build, maxsize: int = 8):
        self.build = build
        self.maxsize = maxsize
        self._entries: list[tuple[torch.Tensor, int, tuple, object]] = []

    def get(self, tensor: torch.Tensor, params: tuple, *args):
        """``build(*args)`` cached under (tensor, its version, params)."""
        try:
            version = tensor._version
        except RuntimeError:  # inference-mode tensors track no version: do not cache
            return self.build(*args)
        for t, ver, prm, value in self._entries:
            if t is tensor and ver == version and _same_params(prm, params):
                return value
        value = self.build(*args)
        self._entries.append((tensor, version, params, value))
        if len(self._entries) > self.maxsize:
            self._entries.pop(0)
        return value

    def clear(self) -> None:
        self._entries.clear()


def _same_params(a: tuple, b: tuple) -> bool:
    """Numbers and strings compare by value, anything else (a KeyTiles object) by identity — the entry
    holds it, so its id cannot have been reused."""
    return len(a) == len(b) and all(
        (x == y) if isinstance(x, (int, float, str)) and isinstance(y, (int, float, str)) else (x is y)
        for x, y in zip(a, b))


#: Key tiles per segments tensor: ``_TILE_CACHE.get(segments, (n, block_m, block_n), segments, n, block_m,
#: block_n, end)`` (``end`` is checked against the segments when building).
_TILE_CACHE = _TensorKeyedCache(lambda segments, n, bm, bn, end=None: build_key_tiles(segments, n, bm, bn, end))

_TILE_MAX_CHUNK = 1 << 22  # gathered positions per step of window_tile_starts (bounds its temporary)


def window_tile_starts(kt: KeyTiles, position: torch.Tensor, window: int, n: int) -> torch.Tensor:
    """First key tile of each query block that may hold a key inside some query's window: [nblocks] int32.

    With ``far(t) = min_{q in block} pos[q] - max_{k in tile t} pos[k] >= window`` every pair of a far
    tile is outside the window (``pos[q] - pos[k] >= window``). ``start[b]`` is the first tile of block b
    in ``[ptr[b], ptr[b+1])`` that is not far (``ptr[b+1]`` if none), so the skipped leading tiles are
    all far: sound for any positions. With tree positions (increasing along every root-to-leaf path) the
    ancestor tiles come in increasing position, so this skips every out-of-window ancestor tile and the
    forward/dQ work of a block is O(window) keys instead of O(depth). No host synchronisation.
    """
    if window <= 0:
        raise ValueError(f"window_tile_starts needs window > 0, got {window}")
    device = kt.ptr.device
    ptr = kt.ptr.to(torch.int64)
    nblocks = ptr.numel() - 1
    pos = position.to(device=device, dtype=torch.int64)
    padded = pos.new_full((nblocks * kt.block_m,), torch.iinfo(torch.int64).max)
    padded[:n] = pos
    q_min = padded.view(nblocks, kt.block_m).amin(1)
    total = kt.num_tiles
    tile_ids = torch.arange(total, device=device)
    tile_block = torch.searchsorted(ptr[1:], tile_ids, right=True)
    tile_max = torch.empty(total, dtype=torch.int64, device=device)
    offs = torch.arange(kt.block_n, device=device)
    step = max(1, _TILE_MAX_CHUNK // kt.block_n)
    for t0 in range(0, total, step):
        lo_hi = kt.tiles[t0:t0 + step].to(torch.int64)
        keys = lo_hi[:, :1] + offs
        inside = keys < lo_hi[:, 1:]
        vals = pos[keys.clamp(max=n - 1)].masked_fill(~inside, torch.iinfo(torch.int64).min)
        tile_max[t0:t0 + step] = vals.amax(1)
    far = (q_min[tile_block] - tile_max) >= window
    candidate = torch.where(far, ptr[tile_block + 1], tile_ids)
    start = ptr[1:].clone().scatter_reduce_(0, tile_block, candidate, "amin")
    if log.isEnabledFor(logging.DEBUG):
        log.debug("window %d: %d of %d key tiles skipped", window, int((start - ptr[:-1]).sum()), total)
    return start.to(torch.int32)


#: Window tile starts per positions tensor (and key tiles object, window): ``_WINDOW_CACHE.get(position,
#: (kt, window, n), kt, position, window, n)``; the KeyTiles object comes from ``_TILE_CACHE``.
_WINDOW_CACHE = _TensorKeyedCache(window_tile_starts)


# --------------------------------------------------------------------------------------------------
# Host wrappers
# --------------------------------------------------------------------------------------------------


def _check_inputs(a: TreeAttentionArgs) -> None:
    """What the kernels add to the op's contract (:meth:`TreeAttentionArgs.check`): a supported dtype and
    head dim, one device, CUDA (or the interpreter). Raises TypeError / ValueError / RuntimeError."""
    q, d = a.q, a.q.shape[2]
    if not 1 <= d <= _MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in [1, {_MAX_HEAD_DIM}], got {d}")
    if q.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"q, k, v must share one dtype of {_SUPPORTED_DTYPES}; got {q.dtype}")
    devices = {t.device for t in (q, a.k, a.v, *a.tree) + ((a.position,) if _reads_positions(a) else ())
               + (() if a.relbias is None else (a.relbias,))}
    if len(devices) != 1:
        raise ValueError(f"all tree-attention inputs must be on one device, got {sorted(map(str, devices))}")
    if q.device.type != "cuda" and not is_interpreter():
        raise RuntimeError(
            f"Triton tree attention runs on CUDA tensors (or on CPU with TRITON_INTERPRET=1 set before "
            f"triton is imported); got device {q.device}")


def _reads_positions(a: TreeAttentionArgs) -> bool:
    """Whether the kernels read the positions: a window, ALiBi or a relative bias."""
    return bool(a.window or a.has_alibi or a.relbias is not None)


def _positions_arg(a: TreeAttentionArgs, kend: torch.Tensor) -> torch.Tensor:
    """The POS kernel argument: int64 contiguous positions; without a window, ALiBi or a relative bias (never
    read) ``kend`` stands in, so every launch passes plain tensors."""
    return a.position.to(torch.int64).contiguous() if _reads_positions(a) else kend


def _relbias_args(a: TreeAttentionArgs, kend: torch.Tensor) -> tuple:
    """The REL kernel argument, its three strides and REL_E: the [Hq, N, E] relative-bias table as given (any
    strides, any floating dtype: the kernels read it in float32) unless a tile's offsets into it could pass
    int32 (:func:`_relative_bias` keeps them 32-bit; e.g. a view with E outermost), then a contiguous copy;
    without one (HAS_RELBIAS=False, never read) ``kend``, zero strides and E = 1."""
    if a.relbias is None:
        return kend, 0, 0, 0, 1
    rel, extent = a.relbias, a.relbias.shape[2]
    if _MAX_BLOCK * abs(rel.stride(1)) + extent * abs(rel.stride(2)) >= 2 ** 31:
        rel = rel.contiguous()
    return (rel, *rel.stride(), extent)


def _slopes_arg(a: TreeAttentionArgs, kend: torch.Tensor) -> torch.Tensor:
    """The SLOPES kernel argument: the ALiBi slopes times log2(e) (the kernels' scores are base 2), float32
    [Hq], rounded once from float64 (trainable ``slopes``: their values); without ALiBi (HAS_ALIBI=False, never
    read) ``kend`` stands in."""
    if a.slopes is not None:
        return (a.slopes.detach().to(device=kend.device, dtype=torch.float64) * _LOG2E).to(torch.float32)
    if not a.alibi:
        return kend
    return torch.tensor([float(m) * _LOG2E for m in a.alibi], dtype=torch.float32, device=kend.device)


def _tile_start_arg(window: int, position, kt: KeyTiles, n: int) -> torch.Tensor:
    """The TILE_START kernel argument: each query block's first key tile inside its window
    (:func:`window_tile_starts`, cached); without a window (never read) the tile pointers stand in."""
    return _WINDOW_CACHE.get(position, (kt, window, n), kt, position, window, n) if window else kt.ptr


def _input_precision(dtype: torch.dtype) -> str | None:
    """IEEE float32 dots for float32 operands (TF32 would cost ~1e-3 relative error); None (the
    backend's default, irrelevant for 16-bit operands) otherwise."""
    return "ieee" if dtype == torch.float32 else None


def _key_end(end: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """kend[k] = end[k] if valid[k] else 0: the one int32 array the kernels read per key."""
    return torch.where(valid, end, torch.zeros((), dtype=end.dtype, device=end.device)).to(torch.int32).contiguous()


def _launch(kernel, grid, cfg: KernelConfig, *args, **constexprs) -> None:
    """kernel[grid](*args) with cfg's warps/stages; on OutOfResources (shared memory) retry with one stage,
    then raise a RuntimeError naming the settings."""
    try:
        kernel[grid](*args, **constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return
    except triton.runtime.errors.OutOfResources as e:
        if cfg.num_stages == 1:
            raise RuntimeError(f"{kernel.__name__}: launch settings {cfg} exceed this GPU's resources ({e}); "
                               f"pass a smaller LaunchConfig") from e
        log.warning("%s: %s with %s; retrying with num_stages=1", kernel.__name__, e, cfg)
    kernel[grid](*args, **constexprs, num_warps=cfg.num_warps, num_stages=1)


@attention_forward
def tree_attention_forward(a: TreeAttentionArgs, *, config: LaunchConfig | None = None):
    """(out [Hq, N, D] q.dtype, lse [Hq, N] float32) of tree attention; see the module docstring.

    ``a.window`` W > 0 restricts query q to keys with ``position[q] - position[k] < W`` (position: [N] int).
    ``a.softcap`` c > 0 caps the scores: ``c * tanh(scale * q.k / c)`` (lse is over the capped scores).
    ``a.alibi`` (slopes m[Hq]) adds ``m[h] * (position[k] - position[q])`` to them, ``a.relbias`` (R [Hq, N, E])
    ``R[h, q, min(position[q] - position[k], E - 1)]``.
    Also callable as ``tree_attention_forward(q, k, v, end, valid, segments, scale, window=0, position=None,
    softcap=0.0, *, config=None)`` (:func:`brcompile.backends.attention.op.attention_forward`).
    """
    _check_inputs(a)
    q, k, v, end, valid, segments = a.q, a.k, a.v, *a.tree
    window, position, softcap = int(a.window), a.position, float(a.softcap)
    hq, n, d = q.shape
    hkv = k.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # every row is written by the kernel
    lse = torch.empty((hq, n), dtype=torch.float32, device=q.device)
    if n == 0 or hq == 0:
        return out, lse
    cfg = (config or default_launch_config(d, q.dtype, q.device, a.relbias is not None)).fwd
    kt = _TILE_CACHE.get(segments, (n, cfg.block_m, cfg.block_n), segments, n, cfg.block_m, cfg.block_n, end)
    kend = _key_end(end, valid)
    pos, slopes = _positions_arg(a, kend), _slopes_arg(a, kend)
    rel, *rel_strides, extent = _relbias_args(a, kend)
    tile_start = _tile_start_arg(window, position, kt, n)
    _launch(
        _tree_attn_fwd, (triton.cdiv(n, cfg.block_m) * hq,), cfg,
        q, k, v, kend, pos, slopes, rel, kt.ptr, tile_start, kt.tiles, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0),
        *rel_strides,
        n, hq, float(a.scale) * _LOG2E, window, softcap, extent,
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_D=_block_d(d),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, INPUT_PRECISION=_input_precision(q.dtype),
        HAS_WINDOW=window > 0, HAS_SOFTCAP=softcap > 0, HAS_ALIBI=a.has_alibi, HAS_RELBIAS=a.relbias is not None,
    )
    return out, lse


@attention_backward
def tree_attention_backward(a: TreeAttentionArgs, grad_out, out, lse, *, config: LaunchConfig | None = None):
    """(dq, dk, dv) of tree attention given the forward's out and lse; grads in the inputs' dtypes; with a relative
    bias ``a.relbias`` then dR (from the dQ kernel, accumulated in float32, in the table's dtype); with trainable
    ``a.slopes`` then dslopes (the dQ kernel's per-row sums, summed in float64, in the slopes' dtype).

    ``a`` as the forward got it. Also callable as ``tree_attention_backward(grad_out, q, k, v, out, lse, end,
    valid, segments, scale, window=0, position=None, softcap=0.0, *, config=None)``.
    """
    _check_inputs(a)
    q, k, v, end, valid, segments = a.q, a.k, a.v, *a.tree
    window, position, softcap = int(a.window), a.position, float(a.softcap)
    hq, n, d = q.shape
    hkv = k.shape[0]
    if grad_out.shape != q.shape or out.shape != q.shape or lse.shape != (hq, n):
        raise ValueError(f"grad_out and out must be {tuple(q.shape)} and lse {(hq, n)}; got "
                         f"{tuple(grad_out.shape)}, {tuple(out.shape)}, {tuple(lse.shape)}")
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # every row is written by the kernels
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    extra = (() if a.relbias is None else (torch.zeros_like(a.relbias),)) \
        + (() if a.slopes is None else (torch.zeros_like(a.slopes),))
    if n == 0 or hq == 0:
        return (dq, dk, dv, *extra)
    launch = config or default_launch_config(d, q.dtype, q.device, a.relbias is not None)
    grad_out = grad_out.to(q.dtype)
    lse = lse.to(torch.float32).contiguous()
    delta = torch.empty((hq, n), dtype=torch.float32, device=q.device)
    _tree_attn_bwd_delta[(triton.cdiv(n, _DELTA_BLOCK_M), hq)](
        out, grad_out, delta,
        out.stride(0), out.stride(1), out.stride(2),
        grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
        delta.stride(0), n,
        HEAD_DIM=d, BLOCK_D=_block_d(d), BLOCK_M=_DELTA_BLOCK_M,
    )
    kend = _key_end(end, valid)
    pos, slopes = _positions_arg(a, kend), _slopes_arg(a, kend)
    rel, *rel_strides, extent = _relbias_args(a, kend)
    sm_scale = float(a.scale)
    qk_scale = sm_scale * _LOG2E
    group = hq // hkv
    common = dict(GROUP=group, HEAD_DIM=d, BLOCK_D=_block_d(d), INPUT_PRECISION=_input_precision(q.dtype),
                  HAS_WINDOW=window > 0, HAS_SOFTCAP=softcap > 0, HAS_ALIBI=a.has_alibi,
                  HAS_RELBIAS=a.relbias is not None)

    cfg = launch.dkdv
    _launch(
        _tree_attn_bwd_dkdv, (triton.cdiv(n, cfg.block_n) * hkv,), cfg,
        q, k, v, grad_out, lse, delta, kend, pos, slopes, rel, dk, dv,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2),
        lse.stride(0),
        *rel_strides,
        n, hkv, sm_scale, qk_scale, window, softcap, extent,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **common,
    )
    cfg = launch.dq
    kt = _TILE_CACHE.get(segments, (n, cfg.block_m, cfg.block_n), segments, n, cfg.block_m, cfg.block_n, end)
    tile_start = _tile_start_arg(window, position, kt, n)
    rows = kend if a.slopes is None else torch.empty((hq, n), dtype=torch.float32, device=q.device)
    # zeroed: the dQ kernel adds the near buckets atomically (and stores the far column)
    drel = kend if a.relbias is None else torch.zeros((hq, n, extent), dtype=torch.float32, device=q.device)
    _launch(
        _tree_attn_bwd_dq, (triton.cdiv(n, cfg.block_m) * hq,), cfg,
        q, k, v, grad_out, lse, delta, kend, pos, slopes, rel, kt.ptr, tile_start, kt.tiles, dq, rows, drel,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        lse.stride(0),
        *rel_strides,
        n, hq, sm_scale, qk_scale, window, softcap, extent,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_ALIBI_GRAD=a.slopes is not None, **common,
    )
    grads = (dq, dk, dv) if a.relbias is None else (dq, dk, dv, drel.to(a.relbias.dtype))
    if a.slopes is None:
        return grads
    return (*grads, rows.sum(-1, dtype=torch.float64).to(a.slopes.dtype))


class TreeAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: q [Hq, N, D], k/v [Hkv, N, D], tree arrays -> out [Hq, N, D] (lse not differentiable).

    For standalone use and benchmarks; the graph rewrite calls ``torch.ops.brcompile.tree_attention``,
    whose autograd lives in ``brcompile.backends.attention.op``.
    """

    @staticmethod
    def forward(ctx, q, k, v, end, valid, segments, scale, config, window=0, position=None, softcap=0.0, alibi=None):
        a = TreeAttentionArgs(q, k, v, end, valid, segments, scale, window, position, softcap, alibi).check()
        out, lse = tree_attention_forward(a, config=config)
        a.save_for_backward(ctx, out, lse)
        ctx.config = config
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        a, (out, lse) = TreeAttentionArgs.saved(ctx)
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv = tree_attention_backward(a, grad_out, out, lse, config=ctx.config)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def tree_attention(q, k, v, end, valid, segments, scale=None, *, config: LaunchConfig | None = None,
                   window: int = 0, position: torch.Tensor | None = None, softcap: float = 0.0, alibi=None):
    """Differentiable tree attention (Triton). scale defaults to 1/sqrt(D); ``window`` > 0 with ``position``
    [N] adds the sliding window ``position[q] - position[k] < window``; ``softcap`` c > 0 caps the scores
    at ``c * tanh(scale * q.k / c)``; ``alibi`` (Hq slopes m, with ``position``) adds ``m[h] * (position[k] -
    position[q])``. Returns (out, lse)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return TreeAttentionFunction.apply(q, k, v, end, valid, segments, scale, config, window, position, softcap,
                                       alibi)
