"""The Triton kernels of tree attention (forward, and the backward's delta, dK/dV and dQ passes) and the
@jit helpers they share; launched by :mod:`.tree_attention`, whose docstring states the math and the layout.
Every @jit function stays in this one module: a kernel resolves the helpers it calls in its own globals."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


LOG2E = 1.4426950408889634  # the kernels spell log2(e) and ln(2) as literals (jit globals must be constexpr)
MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DELTA_BLOCK_M = 32  # rows per program of the (memory-bound) delta kernel
MAX_BLOCK = 256  # the largest tile side (KernelConfig)


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
def tree_attn_fwd(
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
def tree_attn_bwd_delta(
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
def tree_attn_bwd_dkdv(
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
def tree_attn_bwd_dq(
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
