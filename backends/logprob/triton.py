"""Triton row kernels for brcompile::packed_logprob (GPU; on CPU with TRITON_INTERPRET=1). Registers
impl ``"triton"``.

The op (brcompile.backends.logprob.op) forms the logits of a chunk of C packed tokens with one matmul
(cuBLAS does that best) and hands the [C, V] chunk to two kernels that each make a few passes over a
row, one program per row, BLOCK_V columns at a time, in float32::

    z        = scale * softcap * tanh(raw / softcap)          (scale * raw when softcap == 0)
    lse      = logsumexp_v z                                  online: running max and rescaled sum
    H        = -sum_v p log p,   log p = z - lse               (second pass, only when asked)
    draw     = (-p G - GH p (log p + H)) * scale * (1 - tanh^2(raw / softcap))    (backward, in place)

``_logprob_row_stats`` writes lse [C] (and H [C]), the requests' log-probs are ``z[rows, targets] - lse``;
``_logprob_row_grad`` overwrites the chunk with draw (the one-hot target term and the matmuls stay in
torch). Passes: 1 (lse), +1 (H), +1 (draw). Every
load and store is masked (the interpreter does not bounds-check). tanh is ``sign(y) (1 - e) / (1 + e)``
with ``e = exp(-2 |y|)`` (no overflow; absolute error ~1e-7 in float32).

Supported: float32 chunks (the driver upcasts float16/bfloat16 logits to float32 before the kernels);
float64 is left to impl "cpu".
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from brcompile.backends.logprob.op import LogprobImpl, register_logprob_impl, softcap_logits

__all__ = ["RowConfig", "is_interpreter", "row_forward", "row_grad", "row_stats"]


@triton.jit
def _softcap_scale(x, scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """(z, t): z = scale * softcap * tanh(x / softcap) with t = tanh(x / softcap); (scale * x, x) without
    a soft-cap."""
    if HAS_SOFTCAP:
        y = x / softcap
        e = tl.exp(-2.0 * tl.abs(y))
        t = (1.0 - e) / (1.0 + e)
        t = tl.where(y < 0, -t, t)
        z = t * softcap * scale
    else:
        t = x
        z = x * scale
    return z, t


@triton.jit
def _row_lse(base, V, scale, softcap, HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):
    """logsumexp over one row of z: a running (scalar) max m and sum s = sum exp(z - m), rescaled when
    m grows. Every tile holds at least one column, so the tile max is finite."""
    offs = tl.arange(0, BLOCK_V)
    m = tl.max(tl.full([BLOCK_V], -float("inf"), tl.float32), axis=0)
    s = tl.sum(tl.zeros([BLOCK_V], dtype=tl.float32), axis=0)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        mask = cols < V
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        z, _ = _softcap_scale(x, scale, softcap, HAS_SOFTCAP)
        z = tl.where(mask, z, -float("inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    return m + tl.log(s)


@triton.jit
def _row_entropy(base, V, lse, scale, softcap, HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):
    """H = -sum_v p log p of one row, log p = z - lse."""
    offs = tl.arange(0, BLOCK_V)
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        mask = cols < V
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        z, _ = _softcap_scale(x, scale, softcap, HAS_SOFTCAP)
        lp = z - lse
        acc += tl.where(mask, tl.exp(lp) * lp, 0.0)
    return -tl.sum(acc, axis=0)


@triton.jit
def _logprob_row_stats(raw_ptr, stride_row, lse_ptr, ent_ptr, V, scale, softcap,
                       HAS_SOFTCAP: tl.constexpr, WANT_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
    """Row i of raw [C, V]: lse[i] = logsumexp_v z[i, v]; ent[i] = -sum_v p log p (if WANT_ENTROPY)."""
    tl.static_assert(BLOCK_V >= 16)
    row = tl.program_id(0).to(tl.int64)
    base = raw_ptr + row * stride_row
    lse = _row_lse(base, V, scale, softcap, HAS_SOFTCAP, BLOCK_V)
    tl.store(lse_ptr + row, lse)
    if WANT_ENTROPY:
        tl.store(ent_ptr + row, _row_entropy(base, V, lse, scale, softcap, HAS_SOFTCAP, BLOCK_V))


@triton.jit
def _logprob_row_grad(raw_ptr, stride_row, g_ptr, gh_ptr, V, scale, softcap,
                      HAS_SOFTCAP: tl.constexpr, HAS_G: tl.constexpr, HAS_GH: tl.constexpr,
                      BLOCK_V: tl.constexpr):
    """Row i of raw [C, V], overwritten in place with
    draw = (-p G[i] - GH[i] p (log p + H)) * scale * (1 - tanh^2(raw / softcap))."""
    tl.static_assert(BLOCK_V >= 16)
    row = tl.program_id(0).to(tl.int64)
    base = raw_ptr + row * stride_row
    lse = _row_lse(base, V, scale, softcap, HAS_SOFTCAP, BLOCK_V)
    G = 0.0
    if HAS_G:
        G = tl.load(g_ptr + row).to(tl.float32)
    GH = 0.0
    H = 0.0
    if HAS_GH:
        GH = tl.load(gh_ptr + row).to(tl.float32)
        H = _row_entropy(base, V, lse, scale, softcap, HAS_SOFTCAP, BLOCK_V)
    offs = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        mask = cols < V
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        z, t = _softcap_scale(x, scale, softcap, HAS_SOFTCAP)
        lp = z - lse
        p = tl.exp(lp)
        dz = -p * G
        if HAS_GH:
            dz = dz - GH * p * (lp + H)
        if HAS_SOFTCAP:
            dr = dz * scale * (1.0 - t * t)
        else:
            dr = dz * scale
        tl.store(base + cols, dr, mask=mask)


# --------------------------------------------------------------------------------------------------
# launch


@dataclasses.dataclass(frozen=True)
class RowConfig:
    """Launch settings: columns per tile (a power of two in [16, 16384]) and warps (1, 2, 4, 8, 16)."""

    block_v: int = 4096
    num_warps: int = 8

    def __post_init__(self):
        if self.block_v < 16 or self.block_v > 16384 or self.block_v & (self.block_v - 1):
            raise ValueError(f"block_v must be a power of two in [16, 16384], got {self.block_v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")

    def for_vocab(self, V: int) -> "RowConfig":
        """The same config with block_v no wider than V needs."""
        return dataclasses.replace(self, block_v=max(16, min(self.block_v, triton.next_power_of_2(V))))


DEFAULT_CONFIG = RowConfig()


def is_interpreter() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 at import time)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_logprob_row_stats, InterpretedFunction)


def _check_chunk(raw: torch.Tensor) -> None:
    if raw.dim() != 2 or raw.dtype != torch.float32:
        raise TypeError(f"triton packed_logprob kernels take a float32 [C, V] chunk, got {raw.dtype} "
                        f"{tuple(raw.shape)} (float64: use impl='cpu')")
    if raw.stride(1) != 1:
        raise ValueError("triton packed_logprob kernels need unit stride along V")


def row_stats(raw: torch.Tensor, scale: float, softcap: float, want_entropy: bool,
              config: RowConfig = DEFAULT_CONFIG):
    """(lse [C], entropy [C] or None) of the chunk ``raw`` [C, V] (float32); see the module docstring."""
    _check_chunk(raw)
    C, V = raw.shape
    cfg = config.for_vocab(V)
    lse = torch.empty(C, dtype=torch.float32, device=raw.device)
    ent = torch.empty(C, dtype=torch.float32, device=raw.device) if want_entropy else lse
    if C:
        _logprob_row_stats[(C,)](raw, raw.stride(0), lse, ent, V, float(scale), float(softcap),
                                 HAS_SOFTCAP=softcap > 0, WANT_ENTROPY=want_entropy, BLOCK_V=cfg.block_v,
                                 num_warps=cfg.num_warps)
    return lse, (ent if want_entropy else None)


def row_forward(raw: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, scale: float, softcap: float,
                want_entropy: bool, work=None, config: RowConfig = DEFAULT_CONFIG):
    """(logp of the requests [r], entropy [C] or None): ``z[rows, targets] - lse[rows]`` with lse (and
    the entropy) from :func:`row_stats`; the requests' logits are transformed in torch."""
    z_t = softcap_logits(raw[rows, targets], scale, softcap)
    lse, ent = row_stats(raw, scale, softcap, want_entropy, config)
    return z_t - lse[rows], ent


def row_grad(raw: torch.Tensor, scale: float, softcap: float, G, GH, work=None,
             config: RowConfig = DEFAULT_CONFIG):
    """Overwrite ``raw`` [C, V] (float32) with d(-sum G lse + sum GH H)/d raw and return it."""
    _check_chunk(raw)
    C, V = raw.shape
    cfg = config.for_vocab(V)
    g = G.to(torch.float32).contiguous() if G is not None else raw
    gh = GH.to(torch.float32).contiguous() if GH is not None else raw
    if C:
        _logprob_row_grad[(C,)](raw, raw.stride(0), g, gh, V, float(scale), float(softcap),
                                HAS_SOFTCAP=softcap > 0, HAS_G=G is not None, HAS_GH=GH is not None,
                                BLOCK_V=cfg.block_v, num_warps=cfg.num_warps)
    return raw


register_logprob_impl(LogprobImpl(
    "triton", row_forward, row_grad,
    device_types=None if is_interpreter() else frozenset({"cuda"}),
    dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
))
