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
zeroed float32 [Hq, N, E] (see :func:`tree_attn_bwd_dq`). The GPU tiles are halved with it
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

from brcompile.backends.attention.args import TreeAttentionArgs, attention_backward, attention_forward
from brcompile.backends.attention.triton.kernels import (
    DELTA_BLOCK_M, LOG2E, MAX_BLOCK, MAX_HEAD_DIM, SUPPORTED_DTYPES, tree_attn_bwd_delta, tree_attn_bwd_dkdv,
    tree_attn_bwd_dq, tree_attn_fwd,
)

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
            if not (isinstance(value, int) and _is_pow2(value) and 16 <= value <= MAX_BLOCK):
                raise ValueError(f"KernelConfig.{name} must be a power of two in [16, {MAX_BLOCK}], got {value!r}")
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

    return isinstance(tree_attn_fwd, InterpretedFunction)


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


def _check_inputs(a: TreeAttentionArgs) -> None:
    """What the kernels add to the op's contract (:meth:`TreeAttentionArgs.check`): a supported dtype and
    head dim, one device, CUDA (or the interpreter). Raises TypeError / ValueError / RuntimeError."""
    q, d = a.q, a.q.shape[2]
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in [1, {MAX_HEAD_DIM}], got {d}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q, k, v must share one dtype of {SUPPORTED_DTYPES}; got {q.dtype}")
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
    if MAX_BLOCK * abs(rel.stride(1)) + extent * abs(rel.stride(2)) >= 2 ** 31:
        rel = rel.contiguous()
    return (rel, *rel.stride(), extent)


def _slopes_arg(a: TreeAttentionArgs, kend: torch.Tensor) -> torch.Tensor:
    """The SLOPES kernel argument: the ALiBi slopes times log2(e) (the kernels' scores are base 2), float32
    [Hq], rounded once from float64 (trainable ``slopes``: their values); without ALiBi (HAS_ALIBI=False, never
    read) ``kend`` stands in."""
    if a.slopes is not None:
        return (a.slopes.detach().to(device=kend.device, dtype=torch.float64) * LOG2E).to(torch.float32)
    if not a.alibi:
        return kend
    return torch.tensor([float(m) * LOG2E for m in a.alibi], dtype=torch.float32, device=kend.device)


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
        tree_attn_fwd, (triton.cdiv(n, cfg.block_m) * hq,), cfg,
        q, k, v, kend, pos, slopes, rel, kt.ptr, tile_start, kt.tiles, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0),
        *rel_strides,
        n, hq, float(a.scale) * LOG2E, window, softcap, extent,
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
    tree_attn_bwd_delta[(triton.cdiv(n, DELTA_BLOCK_M), hq)](
        out, grad_out, delta,
        out.stride(0), out.stride(1), out.stride(2),
        grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
        delta.stride(0), n,
        HEAD_DIM=d, BLOCK_D=_block_d(d), BLOCK_M=DELTA_BLOCK_M,
    )
    kend = _key_end(end, valid)
    pos, slopes = _positions_arg(a, kend), _slopes_arg(a, kend)
    rel, *rel_strides, extent = _relbias_args(a, kend)
    sm_scale = float(a.scale)
    qk_scale = sm_scale * LOG2E
    group = hq // hkv
    common = dict(GROUP=group, HEAD_DIM=d, BLOCK_D=_block_d(d), INPUT_PRECISION=_input_precision(q.dtype),
                  HAS_WINDOW=window > 0, HAS_SOFTCAP=softcap > 0, HAS_ALIBI=a.has_alibi,
                  HAS_RELBIAS=a.relbias is not None)

    cfg = launch.dkdv
    _launch(
        tree_attn_bwd_dkdv, (triton.cdiv(n, cfg.block_n) * hkv,), cfg,
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
        tree_attn_bwd_dq, (triton.cdiv(n, cfg.block_m) * hq,), cfg,
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
