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
position[q])``, a constant per pair, so the backward below is unchanged; with a relative bias R [Hq, N, E] they
get ``+ R[h, q, min(position[q] - position[k], E - 1)]``) and the backward (explicit formulas, from the saved out
and lse):

    dp = dout . v^T,  delta[h, q] = sum_d dout[h, q, d] out[h, q, d],  ds = p * (dp - delta)
    dq = scale * ds . k,  dk = scale * sum_{heads of the group} ds^T . q,  dv = sum_{group} p^T . dout
    dR[h, q, e] = sum_{k: bucket(q, k) = e} ds[h, q, k]      (ds taken before the soft-cap's factor 1 - t^2)
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from brcompile.backends.attention.args import (
    TreeAttentionArgs, attention_backward, attention_forward, relative_buckets, slopes_grad,
)
from brcompile.backends.attention.op import AttentionImpl, register_attention_impl

__all__ = ["alibi_bias", "dense_tree_mask", "reference_backward", "reference_forward", "relative_bias"]


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


def relative_bias(relbias: Tensor, qpos: Tensor, kpos: Tensor) -> Tensor:
    """[H, nq, nk] relative bias ``relbias[h, q, min(qpos[q] - kpos[k], E - 1)]`` of the [H, nq, E] table
    (distances clamped to [0, E - 1]: :func:`..ops.relative_buckets`)."""
    buckets = relative_buckets(qpos, kpos, relbias.shape[-1]).to(relbias.device)
    return relbias.gather(-1, buckets.expand(relbias.shape[0], -1, -1))


def relative_bias_grad(ds: Tensor, qpos: Tensor, kpos: Tensor, extent: int) -> Tensor:
    """[H, nq, E]: the score gradient ``ds`` [H, nq, nk] summed per distance bucket (the gradient of
    :func:`relative_bias`'s table; ds is 0 on pairs that are not seen)."""
    buckets = relative_buckets(qpos, kpos, extent).to(ds.device).expand(ds.shape[0], -1, -1)
    return ds.new_zeros(*ds.shape[:2], extent).scatter_add_(-1, buckets, ds)


def _masked_scores(q64: Tensor, k64: Tensor, mask: Tensor, scale: float, softcap: float = 0.0,
                   alibi: Optional[Tensor] = None, position: Optional[Tensor] = None,
                   relbias: Optional[Tensor] = None):
    """(s, t): s = scale * q.k^T (soft-capped: softcap * t with t = tanh(scale * q.k^T / softcap); plus the
    ALiBi bias of the [Hq] float64 slopes ``alibi`` over ``position``, plus the relative bias of the float64
    table ``relbias``) on visible pairs, -inf elsewhere: [Hq, N, N]; t is None without a soft-cap."""
    s = torch.matmul(q64, _expand_kv(k64, q64.shape[0]).transpose(-1, -2)) * scale
    t = None
    if softcap:
        t = torch.tanh(s / softcap)
        s = t * softcap
    if alibi is not None:
        s = s + alibi_bias(alibi, position, position)
    if relbias is not None:
        s = s + relative_bias(relbias, position, position)
    return s.masked_fill(~mask, float("-inf")), t


def _slopes64(a: TreeAttentionArgs) -> Optional[Tensor]:
    """The ALiBi slopes of ``a`` (constants or the ``slopes`` tensor) as a float64 [Hq] tensor, or None."""
    if a.slopes is not None:
        return a.slopes.detach().to(dtype=torch.float64, device=a.q.device)
    return None if not a.alibi else torch.tensor([float(m) for m in a.alibi], dtype=torch.float64,
                                                 device=a.q.device)


def _relbias64(a: TreeAttentionArgs) -> Optional[Tensor]:
    """The relative-bias table of ``a`` in float64, or None."""
    return None if a.relbias is None else a.relbias.double()


def _probabilities(s: Tensor, lse64: Tensor) -> Tensor:
    """p = exp(s - lse): 0 on masked pairs, also on rows that see nothing (lse = -inf)."""
    safe_lse = torch.where(torch.isfinite(lse64), lse64, torch.zeros_like(lse64))
    return torch.exp(s - safe_lse[..., None])


@attention_forward
def reference_forward(a: TreeAttentionArgs) -> tuple[Tensor, Tensor]:
    """(out [Hq, N, D] in q.dtype, lse [Hq, N]) by dense masked attention computed in float64."""
    mask = dense_tree_mask(a.end, a.valid, a.window, a.position)
    q64, k64, v64 = a.q.double(), a.k.double(), a.v.double()
    s, _ = _masked_scores(q64, k64, mask, a.scale, a.softcap, _slopes64(a), a.position, _relbias64(a))
    lse64 = torch.logsumexp(s, dim=-1)
    p = _probabilities(s, lse64)
    out64 = torch.matmul(p, _expand_kv(v64, a.q.shape[0]))
    return out64.to(a.q.dtype), lse64.to(a.lse_dtype)


@attention_backward
def reference_backward(a: TreeAttentionArgs, grad_out: Tensor, out: Tensor,
                       lse: Tensor) -> tuple[Tensor, ...]:
    """(dq, dk, dv), and dR with a relative bias, and dslopes with trainable ``slopes`` (:func:`slopes_grad`), from
    the saved out and lse, by the explicit formulas above, in float64 (soft-capped: ds is multiplied by
    d(softcap * tanh(x / softcap))/dx = 1 - t^2 before the q/k products, after dR and dslopes are taken)."""
    hq, hkv = a.q.shape[0], a.k.shape[0]
    mask = dense_tree_mask(a.end, a.valid, a.window, a.position)
    q64, k64, v64 = a.q.double(), a.k.double(), a.v.double()
    dout = grad_out.double()
    sc, t = _masked_scores(q64, k64, mask, a.scale, a.softcap, _slopes64(a), a.position, _relbias64(a))
    p = _probabilities(sc, lse.double())
    dp = torch.matmul(dout, _expand_kv(v64, hq).transpose(-1, -2))
    delta = (dout * out.double()).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    drel = None if a.relbias is None else relative_bias_grad(ds, a.position, a.position, a.relbias.shape[-1])
    dslopes = None if a.slopes is None else slopes_grad(ds, a.position, a.position).to(a.slopes.dtype)
    if a.softcap:
        ds = ds * (1 - t * t)
    dq = torch.matmul(ds, _expand_kv(k64, hq)) * a.scale
    dk = _reduce_kv(torch.matmul(ds.transpose(-1, -2), q64) * a.scale, hkv)
    dv = _reduce_kv(torch.matmul(p.transpose(-1, -2), dout), hkv)
    grads = (dq.to(a.q.dtype), dk.to(a.k.dtype), dv.to(a.v.dtype))
    grads = grads if drel is None else grads + (drel.to(a.relbias.dtype),)
    return grads if dslopes is None else grads + (dslopes,)


register_attention_impl(AttentionImpl(name="reference", forward=reference_forward, backward=reference_backward,
                                      supports_window=True, supports_softcap=True, supports_alibi=True,
                                      supports_relbias=True, supports_alibi_grad=True))
