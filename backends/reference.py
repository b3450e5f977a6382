"""Reference tree attention: dense masked attention in float64, the oracle for every other impl.

O(N^2) memory and time; meant for tests and small inputs. Registered as impl ``"reference"``; its forward
and backward take a ``TreeAttentionArgs`` (or, standalone, the op's positional arguments).

With s[h, q, k] = scale * q[h, q] . k[h // g, k] (g = Hq // Hkv) and M the tree mask
(``dense_tree_mask``), the forward is

    lse[h, q] = log sum_{k: M[q, k]} exp(s[h, q, k])          (-inf when the row of M is empty)
    p[h, q, k] = exp(s[h, q, k] - lse[h, q]) if M[q, k] else 0
    out[h, q] = sum_k p[h, q, k] v[h // g, k]

(with a sliding window, M also requires ``position[q] - position[k] < window``; with a soft-cap c the
scores are ``c * tanh(s / c)``; with ALiBi slopes m the scores then get ``+ m[h] * (position[k] -
position[q])``, a constant per pair, so the backward below is unchanged) and the backward (explicit formulas, from the saved out and lse):

    dp = dout . v^T,  delta[h, q] = sum_d dout[h, q, d] out[h, q, d],  ds = p * (dp - delta)
    dq = scale * ds . k,  dk = scale * sum_{heads of the group} ds^T . q,  dv = sum_{group} p^T . dout
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import Tensor

from brcompile.backends.ops import (
    AttentionImpl, TreeAttentionArgs, attention_backward, attention_forward, register_attention_impl,
)

log = logging.getLogger(__name__)

__all__ = ["alibi_bias", "dense_tree_mask", "reference_backward", "reference_forward"]


def dense_tree_mask(end: Tensor, valid: Tensor, window: int = 0, position: Optional[Tensor] = None) -> Tensor:
    """[N, N] bool mask M[q, k] = (k <= q < end[k]) and valid[k] (and position[q] - position[k] < window
    when window > 0)."""
    n = end.shape[0]
    pos = torch.arange(n, device=end.device)
    qi = pos[:, None]
    ki = pos[None, :]
    m = (ki <= qi) & (qi < end[None, :]) & valid[None, :]
    if window:
        m &= (position[:, None] - position[None, :]) < window
    return m


def _expand_kv(t: Tensor, hq: int) -> Tensor:
    """[Hkv, N, D] -> [Hq, N, D]: query head h reads kv head h // (Hq // Hkv)."""
    return t.repeat_interleave(hq // t.shape[0], dim=0)


def _reduce_kv(t: Tensor, hkv: int) -> Tensor:
    """[Hq, N, D] -> [Hkv, N, D]: sum the query heads of each kv group."""
    hq, n, d = t.shape
    return t.view(hkv, hq // hkv, n, d).sum(1)


def alibi_bias(slopes: Tensor, qpos: Tensor, kpos: Tensor) -> Tensor:
    """[H, nq, nk] ALiBi bias ``slopes[h] * (kpos[k] - qpos[q])`` in the slopes' dtype."""
    rel = kpos.to(slopes.dtype)[None, :] - qpos.to(slopes.dtype)[:, None]
    return slopes[:, None, None] * rel[None]


def _masked_scores(q64: Tensor, k64: Tensor, mask: Tensor, scale: float, softcap: float = 0.0,
                   alibi: Optional[Tensor] = None, position: Optional[Tensor] = None):
    """(s, t): s = scale * q.k^T (soft-capped: softcap * t with t = tanh(scale * q.k^T / softcap); plus the
    ALiBi bias of the [Hq] float64 slopes ``alibi`` over ``position``) on visible pairs, -inf elsewhere:
    [Hq, N, N]; t is None without a soft-cap."""
    s = torch.matmul(q64, _expand_kv(k64, q64.shape[0]).transpose(-1, -2)) * scale
    t = None
    if softcap:
        t = torch.tanh(s / softcap)
        s = t * softcap
    if alibi is not None:
        s = s + alibi_bias(alibi, position, position)
    return s.masked_fill(~mask, float("-inf")), t


def _slopes64(a: TreeAttentionArgs) -> Optional[Tensor]:
    """The ALiBi slopes of ``a`` as a float64 [Hq] tensor, or None."""
    return None if not a.alibi else torch.tensor([float(m) for m in a.alibi], dtype=torch.float64,
                                                 device=a.q.device)


def _probabilities(s: Tensor, lse64: Tensor) -> Tensor:
    """p = exp(s - lse): 0 on masked pairs, also on rows that see nothing (lse = -inf)."""
    safe_lse = torch.where(torch.isfinite(lse64), lse64, torch.zeros_like(lse64))
    return torch.exp(s - safe_lse[..., None])


@attention_forward
def reference_forward(a: TreeAttentionArgs) -> tuple[Tensor, Tensor]:
    """(out [Hq, N, D] in q.dtype, lse [Hq, N]) by dense masked attention computed in float64."""
    mask = dense_tree_mask(a.end, a.valid, a.window, a.position)
    q64, k64, v64 = a.q.double(), a.k.double(), a.v.double()
    s, _ = _masked_scores(q64, k64, mask, a.scale, a.softcap, _slopes64(a), a.position)
    lse64 = torch.logsumexp(s, dim=-1)
    p = _probabilities(s, lse64)
    out64 = torch.matmul(p, _expand_kv(v64, a.q.shape[0]))
    return out64.to(a.q.dtype), lse64.to(a.lse_dtype)


@attention_backward
def reference_backward(a: TreeAttentionArgs, grad_out: Tensor, out: Tensor,
                       lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) from the saved out and lse, by the explicit formulas above, in float64 (soft-capped:
    ds is multiplied by d(softcap * tanh(x / softcap))/dx = 1 - t^2 before the q/k products)."""
    hq, hkv = a.q.shape[0], a.k.shape[0]
    mask = dense_tree_mask(a.end, a.valid, a.window, a.position)
    q64, k64, v64 = a.q.double(), a.k.double(), a.v.double()
    dout = grad_out.double()
    sc, t = _masked_scores(q64, k64, mask, a.scale, a.softcap, _slopes64(a), a.position)
    p = _probabilities(sc, lse.double())
    dp = torch.matmul(dout, _expand_kv(v64, hq).transpose(-1, -2))
    delta = (dout * out.double()).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    if a.softcap:
        ds = ds * (1 - t * t)
    dq = torch.matmul(ds, _expand_kv(k64, hq)) * a.scale
    dk = _reduce_kv(torch.matmul(ds.transpose(-1, -2), q64) * a.scale, hkv)
    dv = _reduce_kv(torch.matmul(p.transpose(-1, -2), dout), hkv)
    return dq.to(a.q.dtype), dk.to(a.k.dtype), dv.to(a.v.dtype)


register_attention_impl(AttentionImpl(name="reference", forward=reference_forward, backward=reference_backward,
                                      supports_window=True, supports_softcap=True, supports_alibi=True))
