"""Triton kernels for ``brcompile::tree_linear_scan``, ``brcompile::tree_causal_conv1d``,
``brcompile::tree_matrix_scan`` and their backwards (GPU; on CPU with TRITON_INTERPRET=1). Registers the scan
impl ``"triton"`` (backends/scan/op.py, ``SCAN_IMPLS``).

The op: ``h[k] = a[k] * h[parent[k]] + b[k]`` along the packed token dim (``h = b`` at a root), ``a`` and ``b``
broadcast together; backward ``gb[k] = g[k] + sum over the children c of k of a[c] * gb[c]``, ``ga[k] = gb[k] *
h[parent[k]]`` (0 at a root).

Design: a **depth-ordered sequential kernel per feature block**, not one launch per pointer-doubling round.
The packed tokens are in DFS preorder, a topological order of the tree (``parent[k] < k``), so one pass over
k = 0..N-1 meets every parent before its children (forward) and the reverse pass every child before its
parent (backward). A program owns BLOCK_F features (the flattened non-token dims of the broadcast shape)
and walks all N tokens: O(N·F) work and one read of each operand and one write of each output — the
minimum — in a single launch, with no host sync per round. Pointer doubling would make ``ceil(log2
depth)`` launches that each read and write every (token, feature) element twice over (O(N·F·log depth)
traffic) and need a grid-wide barrier between rounds, which Triton has only as separate launches. The
price is N dependent steps per program, so the GPU is filled by the feature blocks: the selective scan's
``B'·D·S`` features per token (thousands) are many blocks; a scan with a handful of features is latency
bound (the torch impl's doubling rounds suit it better).

The state stays in registers along a chain (``parent[k] == k - 1``, every token of a segment but its
first). Only a branch point needs memory: a token with a child other than k+1 (``slot[k] >= 0``, one of
the tree's S branch points) stores its state, in the accumulation dtype, into a small ``[S', F]`` stash,
and such a child (``link[k] >= 0``) reads its parent's state from there. The backward mirrors it: the
children's contributions ``a[c] * gb[c]`` flow to ``k`` through a register carry from k+1 and, from the
other children, through the stash slot of k (added there, read when k is reached). A
``tl.debug_barrier()`` precedes each stash access, so a state stored by one thread of the program is
visible to another (once per branch point, not per token).

Per-token arrays built in torch by the launcher (O(N)): ``link[k]`` = -2 (chain: the state in registers),
-1 (a root: state 0), s >= 0 (read stash slot s); ``slot[k]`` = the stash slot k writes (-1: none).
Broadcasting and any strides: each operand is read at ``base + k * token_stride + offset[f]``, with an
int64 offset table per operand over the F features (stride 0 where an operand is broadcast, as Mamba's
decay over the state dims), so nothing is expanded in memory.

The causal conv ``out[:, c, k] = bias[c] + sum_{i<W} weight[c, 0, W-1-i] * x[:, c, anc_i(k)]`` has no
dependence between tokens: one program per (token block, channel block, row) walks the W ancestors of its
tokens (W-1 vector gathers of ``parent``), reading x at each and accumulating the taps — one pass instead
of the torch impl's W. Backward per tile: ``dx[anc_i(k)] += weight[c, W-1-i] * grad[k]`` by atomic adds
(siblings share ancestors; order-dependent rounding only), ``dweight[c, W-1-i] += sum_k grad[k] *
x[anc_i(k)]`` per tile by atomic adds, both into float32 / float64 buffers; ``dbias`` is a torch sum.

The matrix scan ``h[k] = M[k] @ h[parent[k]] + b[k]`` (``M [..., d, d]``, ``b [..., d, e]``; backends/scan/matrix.py)
is the same walk with a ``[d, BLOCK_E]`` state: one program per (batch entry g over the flattened non-token
batch dims, block of BLOCK_E columns of h; the columns are independent), ``state = tl.dot(M[k], prev) + b[k]``
with d padded to a power of two of at least 16 (tl.dot's smallest; the padding is zeros, so a small d is
exact). No stash: the output is written in the accumulation dtype, so a child other than k+1 re-reads its
parent's state from ``h[parent[k]]`` unrounded (a barrier first; half inputs get the output cast once at the
end). Backward in reverse preorder: ``gb[k] = g[k] + carry (+ gb_buf[k] at a branch point)``, ``M[k]ᵀ gb[k]``
carried in registers to k-1 (chain) or added into the parent's row of the zeroed accumulation-dtype ``gb``
buffer (which is also the output); ``grad_M[k] = gb[k] h[parent[k]]ᵀ`` summed over the column blocks by atomic
adds (order-dependent rounding only; exact when one block covers e). M[k]ᵀ and h[p]ᵀ are read through swapped
strides. The products are ``input_precision="ieee"`` (no TF32: float32 stays within 1e-5); O(N·d²·e) work,
each program loading M[k] once per token.

Dtypes: float32 / float16 / bfloat16 accumulate in float32 (the stored outputs are rounded to the input
dtype, the carried state and the stash are not), float64 in float64. Layout follows the Liger-Kernel /
Triton tutorial style: ``@triton.jit`` kernels, a small launcher, strides passed explicitly.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from brcompile.backends.scan.op import ScanImpl, register_scan_impl

__all__ = ["ConvConfig", "MatrixScanConfig", "ScanConfig", "causal_conv1d", "causal_conv1d_backward",
           "is_interpreter", "linear_scan", "linear_scan_backward", "matrix_scan", "matrix_scan_backward",
           "tree_links"]

#: ``link`` value of a token whose parent is the previous token (its state is the register state)
CHAIN = -2


@triton.jit
def _tree_linear_scan_fwd(a_ptr, b_ptr, h_ptr, stash_ptr, link_ptr, slot_ptr,
                          a_off_ptr, b_off_ptr, h_off_ptr, N, F, stride_a, stride_b, stride_h,
                          ACC: tl.constexpr, BLOCK_F: tl.constexpr):
    """Features [pid * BLOCK_F, +BLOCK_F) of every token, k = 0..N-1 in preorder:
    ``h[k] = a[k] * prev + b[k]`` with prev the register state (chain), 0 (root) or the stash slot
    ``link[k]``; the state is stashed at ``slot[k]`` when k has a child other than k+1."""
    pid = tl.program_id(0)
    offs = pid * BLOCK_F + tl.arange(0, BLOCK_F)
    fmask = offs < F
    a_off = tl.load(a_off_ptr + offs, mask=fmask, other=0)
    b_off = tl.load(b_off_ptr + offs, mask=fmask, other=0)
    h_off = tl.load(h_off_ptr + offs, mask=fmask, other=0)
    stash_off = offs.to(tl.int64)
    a_row = a_ptr + a_off
    b_row = b_ptr + b_off
    h_row = h_ptr + h_off
    state = tl.zeros([BLOCK_F], dtype=ACC)
    for k in range(0, N):
        link = tl.load(link_ptr + k)
        a = tl.load(a_row, mask=fmask, other=0.0).to(ACC)
        b = tl.load(b_row, mask=fmask, other=0.0).to(ACC)
        prev = tl.where(link == -2, state, tl.zeros([BLOCK_F], dtype=ACC))  # -2: CHAIN
        if link >= 0:
            tl.debug_barrier()
            prev = tl.load(stash_ptr + link * F + stash_off, mask=fmask, other=0.0)
        state = a * prev + b
        tl.store(h_row, state.to(h_ptr.dtype.element_ty), mask=fmask)
        slot = tl.load(slot_ptr + k)
        if slot >= 0:
            tl.debug_barrier()
            tl.store(stash_ptr + slot * F + stash_off, state, mask=fmask)
        a_row += stride_a
        b_row += stride_b
        h_row += stride_h


@triton.jit
def _tree_linear_scan_bwd(g_ptr, a_ptr, h_ptr, parent_ptr, ga_ptr, gb_ptr, stash_ptr, link_ptr, slot_ptr,
                          g_off_ptr, a_off_ptr, h_off_ptr, o_off_ptr, N, F,
                          stride_g, stride_a, stride_h, stride_o,
                          ACC: tl.constexpr, BLOCK_F: tl.constexpr):
    """Features [pid * BLOCK_F, +BLOCK_F), k = N-1..0 (every child before its parent):
    ``gb[k] = g[k] + carry + stash[slot[k]]`` (carry = ``a[k+1] * gb[k+1]`` when k+1 is k's chain child,
    the stash slot the sum of the other children's ``a[c] * gb[c]``), ``ga[k] = gb[k] * h[parent[k]]``
    (0 at a root); then ``a[k] * gb[k]`` goes to the carry (chain) or is added to the parent's slot."""
    pid = tl.program_id(0)
    offs = pid * BLOCK_F + tl.arange(0, BLOCK_F)
    fmask = offs < F
    g_off = tl.load(g_off_ptr + offs, mask=fmask, other=0)
    a_off = tl.load(a_off_ptr + offs, mask=fmask, other=0)
    h_off = tl.load(h_off_ptr + offs, mask=fmask, other=0)
    o_off = tl.load(o_off_ptr + offs, mask=fmask, other=0)
    stash_off = offs.to(tl.int64)
    last = tl.full([], 0, tl.int64) + (N - 1)  # int64: last * stride may pass 2^31
    g_row = g_ptr + g_off + last * stride_g
    a_row = a_ptr + a_off + last * stride_a
    ga_row = ga_ptr + o_off + last * stride_o
    gb_row = gb_ptr + o_off + last * stride_o
    carry = tl.zeros([BLOCK_F], dtype=ACC)
    for i in range(0, N):
        k = last - i
        link = tl.load(link_ptr + k)
        slot = tl.load(slot_ptr + k)
        p = tl.load(parent_ptr + k)
        gb = tl.load(g_row, mask=fmask, other=0.0).to(ACC) + carry
        if slot >= 0:
            tl.debug_barrier()
            gb += tl.load(stash_ptr + slot * F + stash_off, mask=fmask, other=0.0)
        tl.store(gb_row, gb.to(gb_ptr.dtype.element_ty), mask=fmask)
        hp = tl.load(h_ptr + h_off + tl.maximum(p, 0) * stride_h, mask=fmask, other=0.0).to(ACC)
        hp = tl.where(p >= 0, hp, tl.zeros([BLOCK_F], dtype=ACC))
        tl.store(ga_row, (gb * hp).to(ga_ptr.dtype.element_ty), mask=fmask)
        push = tl.load(a_row, mask=fmask, other=0.0).to(ACC) * gb
        carry = tl.where(link == -2, push, tl.zeros([BLOCK_F], dtype=ACC))
        if link >= 0:
            tl.debug_barrier()
            dst = stash_ptr + link * F + stash_off
            tl.store(dst, tl.load(dst, mask=fmask, other=0.0) + push, mask=fmask)
        g_row -= stride_g
        a_row -= stride_a
        ga_row -= stride_o
        gb_row -= stride_o


@triton.jit
def _conv_tile(pid_n, pid_c, N, C, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """(tokens [BLOCK_N] int64 with -1 past N, channels [BLOCK_C], channel mask) of a program's tile."""
    toks = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    chans = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    anc = tl.where(toks < N, toks, -1).to(tl.int64)
    return anc, chans, chans < C


@triton.jit
def _tree_causal_conv1d_fwd(x_ptr, w_ptr, bias_ptr, parent_ptr, out_ptr, N, C,
                            stride_xb, stride_xc, stride_xn, stride_wc, stride_wk,
                            stride_ob, stride_oc, stride_on,
                            W: tl.constexpr, HAS_BIAS: tl.constexpr, ACC: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """Tile (tokens, channels) of row ``program_id(2)``: ``out = bias + sum_i w[:, W-1-i] * x[:, anc_i]``,
    ``anc_0`` the tokens, ``anc_{i+1} = parent[anc_i]`` (-1 past a root: the tap reads 0)."""
    row = tl.program_id(2).to(tl.int64)
    toks, chans, cmask = _conv_tile(tl.program_id(0), tl.program_id(1), N, C, BLOCK_N, BLOCK_C)
    x_rows = x_ptr + row * stride_xb + chans[:, None].to(tl.int64) * stride_xc
    acc = tl.zeros([BLOCK_C, BLOCK_N], dtype=ACC)
    anc = toks
    for i in tl.static_range(W):
        live = anc >= 0
        xv = tl.load(x_rows + tl.maximum(anc, 0)[None, :] * stride_xn, mask=cmask[:, None] & live[None, :],
                     other=0.0).to(ACC)
        wv = tl.load(w_ptr + chans * stride_wc + (W - 1 - i) * stride_wk, mask=cmask, other=0.0).to(ACC)
        acc += wv[:, None] * xv
        if i + 1 < W:
            anc = tl.load(parent_ptr + tl.maximum(anc, 0), mask=live, other=-1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + chans, mask=cmask, other=0.0).to(ACC)[:, None]
    out = out_ptr + row * stride_ob + chans[:, None].to(tl.int64) * stride_oc + tl.maximum(toks, 0)[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=cmask[:, None] & (toks >= 0)[None, :])


@triton.jit
def _tree_causal_conv1d_bwd(grad_ptr, x_ptr, w_ptr, parent_ptr, dx_ptr, dw_ptr, N, C,
                            stride_gb, stride_gc, stride_gn, stride_xb, stride_xc, stride_xn,
                            stride_wc, stride_wk,
                            W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """Tile (tokens, channels) of row ``program_id(2)``; for each tap i: ``dx[:, anc_i] += w[:, W-1-i] *
    grad`` and ``dw[:, W-1-i] += sum over the tile's tokens of grad * x[:, anc_i]`` (atomic adds into the
    accumulation-dtype buffers ``dx [B', C, N]`` and ``dw [C, W]``, contiguous)."""
    row = tl.program_id(2).to(tl.int64)
    toks, chans, cmask = _conv_tile(tl.program_id(0), tl.program_id(1), N, C, BLOCK_N, BLOCK_C)
    ACC = dw_ptr.dtype.element_ty
    c64 = chans[:, None].to(tl.int64)
    g = tl.load(grad_ptr + row * stride_gb + c64 * stride_gc + tl.maximum(toks, 0)[None, :] * stride_gn,
                mask=cmask[:, None] & (toks >= 0)[None, :], other=0.0).to(ACC)
    x_rows = x_ptr + row * stride_xb + c64 * stride_xc
    dx_rows = dx_ptr + (row * C + c64) * N
    anc = toks
    for i in tl.static_range(W):
        live = anc >= 0
        m = cmask[:, None] & live[None, :]
        wv = tl.load(w_ptr + chans * stride_wc + (W - 1 - i) * stride_wk, mask=cmask, other=0.0).to(ACC)
        tl.atomic_add(dx_rows + tl.maximum(anc, 0)[None, :], wv[:, None] * g, mask=m)
        xv = tl.load(x_rows + tl.maximum(anc, 0)[None, :] * stride_xn, mask=m, other=0.0).to(ACC)
        tl.atomic_add(dw_ptr + chans * W + (W - 1 - i), tl.sum(g * xv, axis=1), mask=cmask)
        if i + 1 < W:
            anc = tl.load(parent_ptr + tl.maximum(anc, 0), mask=live, other=-1)


@triton.jit
def _tree_matrix_scan_fwd(M_ptr, b_ptr, h_ptr, link_ptr, parent_ptr, m_off_ptr, b_off_ptr, h_off_ptr, N, D, E,
                          stride_mk, stride_mi, stride_mj, stride_bk, stride_bi, stride_bj,
                          stride_hk, stride_hi, stride_hj,
                          BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr):
    """Columns [pid_e * BLOCK_E, +BLOCK_E) of the state of batch entry ``program_id(0)``, k = 0..N-1 in
    preorder: ``h[k] = M[k] @ prev + b[k]`` with prev the register state (chain), 0 (root) or, for a child
    other than k+1 (``link[k] >= 0``), ``h[parent[k]]`` read back from the output (written earlier by this
    program; ``h_ptr`` holds the accumulation dtype). Rows and columns past D and E are zeros."""
    rows = tl.arange(0, BLOCK_D)
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    mm = (rows < D)[:, None] & (rows < D)[None, :]
    bm = (rows < D)[:, None] & (cols < E)[None, :]
    M_tile = M_ptr + tl.load(m_off_ptr + tl.program_id(0)) + rows[:, None] * stride_mi + rows[None, :] * stride_mj
    b_tile = b_ptr + tl.load(b_off_ptr + tl.program_id(0)) + rows[:, None] * stride_bi + cols[None, :] * stride_bj
    h_tile = h_ptr + tl.load(h_off_ptr + tl.program_id(0)) + rows[:, None] * stride_hi + cols[None, :] * stride_hj
    ACC = h_ptr.dtype.element_ty
    state = tl.zeros([BLOCK_D, BLOCK_E], dtype=ACC)
    first = tl.full([], 0, tl.int64)  # int64: k * stride may pass 2^31
    for i in range(0, N):
        k = first + i
        link = tl.load(link_ptr + k)
        prev = tl.where(link == -2, state, tl.zeros([BLOCK_D, BLOCK_E], dtype=ACC))  # -2: CHAIN
        if link >= 0:
            tl.debug_barrier()
            prev = tl.load(h_tile + tl.load(parent_ptr + k) * stride_hk, mask=bm, other=0.0)
        Mk = tl.load(M_tile + k * stride_mk, mask=mm, other=0.0).to(ACC)
        bk = tl.load(b_tile + k * stride_bk, mask=bm, other=0.0).to(ACC)
        state = tl.dot(Mk, prev, input_precision="ieee") + bk
        tl.store(h_tile + k * stride_hk, state, mask=bm)


@triton.jit
def _tree_matrix_scan_bwd(g_ptr, M_ptr, h_ptr, gM_ptr, gb_ptr, link_ptr, slot_ptr, parent_ptr,
                          g_off_ptr, m_off_ptr, h_off_ptr, gm_off_ptr, gb_off_ptr, N, D, E,
                          stride_gk, stride_gi, stride_gj, stride_mk, stride_mi, stride_mj,
                          stride_hk, stride_hi, stride_hj, stride_gmk, stride_gmi, stride_gmj,
                          stride_gbk, stride_gbi, stride_gbj,
                          BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr):
    """Columns [pid_e * BLOCK_E, +BLOCK_E) of batch entry ``program_id(0)``, k = N-1..0 (every child before
    its parent): ``gb[k] = g[k] + carry (+ gb_buf[k] when k has a child other than k+1, slot[k] >= 0)``,
    stored to ``gb_buf[k]``; ``grad_M[k] += gb[k] @ h[parent[k]]ᵀ`` over this column block (an atomic add
    into the zeroed accumulation-dtype ``gM_ptr``; 0 at a root); ``M[k]ᵀ @ gb[k]`` goes to the carry
    (chain, ``link[k] == -2``) or is added to ``gb_buf[parent[k]]`` (``link[k] >= 0``)."""
    rows = tl.arange(0, BLOCK_D)
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    rmask = rows < D
    mm = rmask[:, None] & rmask[None, :]
    bm = rmask[:, None] & (cols < E)[None, :]
    bm_t = (cols < E)[:, None] & rmask[None, :]
    pid = tl.program_id(0)
    g_tile = g_ptr + tl.load(g_off_ptr + pid) + rows[:, None] * stride_gi + cols[None, :] * stride_gj
    # M[k]ᵀ and h[p]ᵀ read through swapped strides
    Mt_tile = M_ptr + tl.load(m_off_ptr + pid) + rows[:, None] * stride_mj + rows[None, :] * stride_mi
    ht_tile = h_ptr + tl.load(h_off_ptr + pid) + cols[:, None] * stride_hj + rows[None, :] * stride_hi
    gM_tile = gM_ptr + tl.load(gm_off_ptr + pid) + rows[:, None] * stride_gmi + rows[None, :] * stride_gmj
    gb_tile = gb_ptr + tl.load(gb_off_ptr + pid) + rows[:, None] * stride_gbi + cols[None, :] * stride_gbj
    ACC = gb_ptr.dtype.element_ty
    last = tl.full([], 0, tl.int64) + (N - 1)  # int64: k * stride may pass 2^31
    carry = tl.zeros([BLOCK_D, BLOCK_E], dtype=ACC)
    for i in range(0, N):
        k = last - i
        link = tl.load(link_ptr + k)
        p = tl.load(parent_ptr + k)
        gb = tl.load(g_tile + k * stride_gk, mask=bm, other=0.0).to(ACC) + carry
        if tl.load(slot_ptr + k) >= 0:
            tl.debug_barrier()
            gb += tl.load(gb_tile + k * stride_gbk, mask=bm, other=0.0)
        tl.store(gb_tile + k * stride_gbk, gb, mask=bm)
        hpt = tl.load(ht_tile + tl.maximum(p, 0) * stride_hk, mask=bm_t, other=0.0).to(ACC)
        hpt = tl.where(p >= 0, hpt, tl.zeros([BLOCK_E, BLOCK_D], dtype=ACC))  # a root adds 0
        tl.atomic_add(gM_tile + k * stride_gmk, tl.dot(gb, hpt, input_precision="ieee"), mask=mm)
        push = tl.dot(tl.load(Mt_tile + k * stride_mk, mask=mm, other=0.0).to(ACC), gb, input_precision="ieee")
        carry = tl.where(link == -2, push, tl.zeros([BLOCK_D, BLOCK_E], dtype=ACC))
        if link >= 0:
            tl.debug_barrier()
            dst = gb_tile + p * stride_gbk
            tl.store(dst, tl.load(dst, mask=bm, other=0.0) + push, mask=bm)


# --------------------------------------------------------------------------------------------------
# launch


@dataclasses.dataclass(frozen=True)
class ScanConfig:
    """Launch settings: features per program (a power of two in [16, 4096]) and warps (1, 2, 4, 8, 16)."""

    block_f: int = 128
    num_warps: int = 4

    def __post_init__(self):
        if self.block_f < 16 or self.block_f > 4096 or self.block_f & (self.block_f - 1):
            raise ValueError(f"block_f must be a power of two in [16, 4096], got {self.block_f}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")

    def for_features(self, F: int) -> "ScanConfig":
        """The same config with block_f no wider than F needs."""
        return dataclasses.replace(self, block_f=max(16, min(self.block_f, triton.next_power_of_2(max(F, 1)))))


DEFAULT_CONFIG = ScanConfig()


def is_interpreter() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 at import time)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_tree_linear_scan_fwd, InterpretedFunction)


def tree_links(parent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(link [N], slot [N], S')`` (int64) for the kernels (module docstring): a token k is a branch point
    when some child of k is not k+1; branch points get stash slots 0..S'-1 in preorder; ``link[k]`` is CHAIN
    when ``parent[k] == k - 1``, -1 at a root, else the parent's slot."""
    n = parent.shape[0]
    ids = torch.arange(n, device=parent.device)
    chain = (parent >= 0) & (parent == ids - 1)
    far = (parent >= 0) & ~chain
    branch = torch.zeros(n, dtype=torch.bool, device=parent.device)
    branch[parent[far]] = True
    slot = torch.where(branch, torch.cumsum(branch, 0) - 1, -1)
    link = torch.where(chain, CHAIN, torch.where(far, slot[parent.clamp(min=0)], -1))
    return link, slot, int(branch.sum())


def _token_layout(x: torch.Tensor, shape: torch.Size, d: int) -> tuple[torch.Tensor, int, torch.Tensor]:
    """``(x expanded to shape, its stride along d, offsets [F] int64)``: element (k, f) of the token-first
    flattening of ``shape`` lies at ``k * stride + offsets[f]`` from x's data (stride 0 where broadcast)."""
    full = x.expand(shape)
    off = torch.zeros((), dtype=torch.int64, device=x.device)
    for i, (size, stride) in enumerate(zip(full.shape, full.stride())):
        if i != d:
            off = off.unsqueeze(-1) + torch.arange(size, device=x.device) * stride
    return full, full.stride(d), off.reshape(-1)


def _acc_dtype(dtype: torch.dtype):
    """The accumulation dtype: float64 for float64 inputs, else float32."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def _stash(rows: int, F: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The branch points' states (zeros: the backward adds into them); one element when there are none."""
    return torch.zeros(max(rows * F, 1), dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                       device=device)


def linear_scan(a: torch.Tensor, b: torch.Tensor, parent: torch.Tensor, d: int,
                config: Optional[ScanConfig] = None) -> torch.Tensor:
    """``h`` (contiguous, the broadcast shape of a and b, a's dtype): the forward kernel (``ScanImpl.linear_scan``)."""
    shape = torch.broadcast_shapes(a.shape, b.shape)
    h = torch.empty(shape, dtype=a.dtype, device=a.device)
    N = shape[d]
    F = h.numel() // N if N else 0
    if N == 0 or F == 0:
        return h
    cfg = (config or DEFAULT_CONFIG).for_features(F)
    link, slot, branches = tree_links(parent)
    af, sa, a_off = _token_layout(a, shape, d)
    bf, sb, b_off = _token_layout(b, shape, d)
    _, sh, h_off = _token_layout(h, shape, d)
    stash = _stash(branches, F, a.dtype, a.device)
    grid = (triton.cdiv(F, cfg.block_f),)
    _tree_linear_scan_fwd[grid](af, bf, h, stash, link, slot, a_off, b_off, h_off, N, F, sa, sb, sh,
                                ACC=_acc_dtype(a.dtype), BLOCK_F=cfg.block_f, num_warps=cfg.num_warps)
    return h


def linear_scan_backward(grad: torch.Tensor, a: torch.Tensor, h: torch.Tensor, parent: torch.Tensor, d: int,
                         config: Optional[ScanConfig] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_a, grad_b)`` in h's shape (contiguous): the reverse kernel (``ScanImpl.linear_scan_backward``)."""
    shape = h.shape
    ga = torch.empty(shape, dtype=h.dtype, device=h.device)
    gb = torch.empty_like(ga)
    N = shape[d]
    F = h.numel() // N if N else 0
    if N == 0 or F == 0:
        return ga, gb
    cfg = (config or DEFAULT_CONFIG).for_features(F)
    link, slot, branches = tree_links(parent)
    gf, sg, g_off = _token_layout(grad, shape, d)
    af, sa, a_off = _token_layout(a, shape, d)
    hf, sh, h_off = _token_layout(h, shape, d)
    _, so, o_off = _token_layout(ga, shape, d)
    stash = _stash(branches, F, h.dtype, h.device)
    grid = (triton.cdiv(F, cfg.block_f),)
    _tree_linear_scan_bwd[grid](gf, af, hf, parent, ga, gb, stash, link, slot, g_off, a_off, h_off, o_off, N, F,
                                sg, sa, sh, so, ACC=_acc_dtype(h.dtype), BLOCK_F=cfg.block_f,
                                num_warps=cfg.num_warps)
    return ga, gb


@dataclasses.dataclass(frozen=True)
class ConvConfig:
    """Conv launch settings: tokens and channels per tile (powers of two in [16, 1024]) and warps."""

    block_n: int = 64
    block_c: int = 32
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_n", "block_c"):
            v = getattr(self, name)
            if v < 16 or v > 1024 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two in [16, 1024], got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")


DEFAULT_CONV_CONFIG = ConvConfig()


def _conv_grid(x: torch.Tensor, cfg: ConvConfig) -> tuple[int, int, int]:
    B, C, N = x.shape
    return triton.cdiv(N, cfg.block_n), triton.cdiv(C, cfg.block_c), B


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], parent: torch.Tensor,
                  config: Optional[ConvConfig] = None) -> torch.Tensor:
    """``out`` (x's layout and dtype): the forward kernel (``ScanImpl.causal_conv1d``)."""
    out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    cfg = config or DEFAULT_CONV_CONFIG
    _tree_causal_conv1d_fwd[_conv_grid(x, cfg)](
        x, weight, weight if bias is None else bias, parent, out, x.shape[2], x.shape[1],
        *x.stride(), weight.stride(0), weight.stride(2), *out.stride(),
        W=weight.shape[2], HAS_BIAS=bias is not None, ACC=_acc_dtype(x.dtype), BLOCK_N=cfg.block_n,
        BLOCK_C=cfg.block_c, num_warps=cfg.num_warps)
    return out


def causal_conv1d_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, parent: torch.Tensor,
                           config: Optional[ConvConfig] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dweight, dbias)`` in the layouts of x, weight and ``[C]``: the backward kernel
    (``ScanImpl.causal_conv1d_backward``)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    B, C, N = x.shape
    W = weight.shape[2]
    dx = torch.zeros((B, C, N), dtype=acc, device=x.device)
    dw = torch.zeros((C, W), dtype=acc, device=x.device)
    if x.numel():
        cfg = config or DEFAULT_CONV_CONFIG
        _tree_causal_conv1d_bwd[_conv_grid(x, cfg)](
            grad, x, weight, parent, dx, dw, N, C, *grad.stride(), *x.stride(), weight.stride(0), weight.stride(2),
            W=W, BLOCK_N=cfg.block_n, BLOCK_C=cfg.block_c, num_warps=cfg.num_warps)
    return (torch.empty_like(x).copy_(dx), torch.empty_like(weight).copy_(dw.view(C, 1, W)),
            grad.sum((0, 2)))


@dataclasses.dataclass(frozen=True)
class MatrixScanConfig:
    """Matrix scan launch settings: state columns per program (a power of two in [16, 256]) and warps; the
    state rows are d padded to a power of two (at least 16, tl.dot's smallest)."""

    block_e: int = 32
    num_warps: int = 4

    def __post_init__(self):
        if self.block_e < 16 or self.block_e > 256 or self.block_e & (self.block_e - 1):
            raise ValueError(f"block_e must be a power of two in [16, 256], got {self.block_e}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")

    def blocks(self, D: int, E: int) -> tuple[int, int]:
        """``(BLOCK_D, BLOCK_E)`` for a ``[D, E]`` state."""
        return max(16, triton.next_power_of_2(D)), max(16, min(self.block_e, triton.next_power_of_2(E)))


DEFAULT_MATRIX_CONFIG = MatrixScanConfig()


def _matrix_layout(x: torch.Tensor, d: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``(offsets [G] int64, (token, row, column) strides)`` of ``x [..., r, c]`` with the token at batch dim
    ``d``: matrix ``(k, g)`` starts at ``k * token_stride + offsets[g]`` (g over the other batch dims, in order;
    stride 0 where broadcast)."""
    off = torch.zeros((), dtype=torch.int64, device=x.device)
    for i, (size, stride) in enumerate(zip(x.shape[:-2], x.stride()[:-2])):
        if i != d:
            off = off.unsqueeze(-1) + torch.arange(size, device=x.device) * stride
    return off.reshape(-1), (x.stride(d), x.stride(-2), x.stride(-1))


def _acc_torch_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype as a torch dtype (:func:`_acc_dtype`)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def matrix_scan(M: torch.Tensor, b: torch.Tensor, parent: torch.Tensor, d: int,
                config: Optional[MatrixScanConfig] = None) -> torch.Tensor:
    """``h`` (contiguous, b's shape and dtype): the forward kernel (``ScanImpl.matrix_scan``); the kernel
    writes the accumulation dtype, so a branch point's state is read back unrounded."""
    h = torch.empty(b.shape, dtype=_acc_torch_dtype(b.dtype), device=b.device)
    N, D, E = b.shape[d], b.shape[-2], b.shape[-1]
    if h.numel():
        cfg = config or DEFAULT_MATRIX_CONFIG
        block_d, block_e = cfg.blocks(D, E)
        link, _, _ = tree_links(parent)
        m_off, sm = _matrix_layout(M, d)
        b_off, sb = _matrix_layout(b, d)
        h_off, sh = _matrix_layout(h, d)
        grid = (m_off.shape[0], triton.cdiv(E, block_e))
        _tree_matrix_scan_fwd[grid](M, b, h, link, parent, m_off, b_off, h_off, N, D, E, *sm, *sb, *sh,
                                    BLOCK_D=block_d, BLOCK_E=block_e, num_warps=cfg.num_warps)
    return h.to(b.dtype)


def matrix_scan_backward(grad: torch.Tensor, M: torch.Tensor, h: torch.Tensor, parent: torch.Tensor, d: int,
                         config: Optional[MatrixScanConfig] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_M, grad_b)`` (contiguous, the shapes and dtype of M and h): the reverse kernel
    (``ScanImpl.matrix_scan_backward``), into zeroed accumulation-dtype buffers (``grad_M`` sums the column
    blocks' atomic adds; ``grad_b`` doubles as the branch points' accumulator)."""
    acc = _acc_torch_dtype(h.dtype)
    gM = torch.zeros(M.shape, dtype=acc, device=M.device)
    gb = torch.zeros(h.shape, dtype=acc, device=h.device)
    N, D, E = h.shape[d], h.shape[-2], h.shape[-1]
    if h.numel():
        cfg = config or DEFAULT_MATRIX_CONFIG
        block_d, block_e = cfg.blocks(D, E)
        link, slot, _ = tree_links(parent)
        layouts = [_matrix_layout(x, d) for x in (grad.expand(h.shape), M, h, gM, gb)]
        grid = (layouts[0][0].shape[0], triton.cdiv(E, block_e))
        _tree_matrix_scan_bwd[grid](grad.expand(h.shape), M, h, gM, gb, link, slot, parent,
                                    *(off for off, _ in layouts), N, D, E,
                                    *(s for _, strides in layouts for s in strides),
                                    BLOCK_D=block_d, BLOCK_E=block_e, num_warps=cfg.num_warps)
    return gM.to(M.dtype), gb.to(h.dtype)


register_scan_impl(ScanImpl(
    "triton", linear_scan, linear_scan_backward, causal_conv1d, causal_conv1d_backward, matrix_scan,
    matrix_scan_backward,
    device_types=None if is_interpreter() else frozenset({"cuda"}),
    dtypes=frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16}),
))
