"""Tree attention on ``torch.nn.attention.flex_attention`` (FlexAttention). Registered as impl ``"flex"``.

The packed tokens are one sequence of N tokens ([1, Hq, N, D] for FlexAttention), and the tree is a mask over
it. With the op's tree arrays (``backends/attention/op.py``), query q sees key k iff

    mask_mod(q, k) = valid[k] and k <= q < end[k]               (k an ancestor-or-self of q)
                     and position[q] - position[k] < W          (only with a sliding window W > 0)

and the scores s = scale * q.k of the visible pairs go through

    score_mod(s, h, q, k) = c * tanh(s / c)                      (soft-cap c > 0)
                            + m[h] * (position[k] - position[q])  (ALiBi slopes m, constant or trainable)
                            + R[h, q, min(position[q] - position[k], E - 1)]   (relative bias table R)

in that order (the reference's, ``backends/attention/reference.py``). The BlockMask is built per call from the tree arrays
(``create_block_mask`` over the mask_mod: blocks no query of a block can see are skipped). FlexAttention returns
(out, lse) with the natural-log logsumexp, -inf (and out = 0) for a query that sees no key: the op's contract.

Where it runs (:data:`FLEX_BACKWARD_DEVICES`):

- CUDA (:data:`COMPILED_DEVICES`): ``torch.compile(flex_attention)`` (fused Triton kernels; the first call per
  variant compiles, the first change of N compiles once more with dynamic shapes) and
  ``torch.compile(create_block_mask)``, within a raised Dynamo recompile limit (:data:`FLEX_RECOMPILE_LIMIT`);
  forward and backward.
- CPU: forward only. Inductor's CPU FlexAttention cannot return the logsumexp, so the forward runs
  FlexAttention's unfused path (it materialises the [Hq, N, N] scores: a check of the masks on small inputs,
  not a fast path), and FlexAttention has no CPU backward: the impl declares no CPU backward, so the op refuses a
  backward on CPU with :class:`~brcompile.backends.attention.op.AttentionImplError`, and the backend refuses
  ``attention="flex"`` for a CPU graph captured with grad enabled (the original graph runs, with that reason).
  Under ``torch.no_grad`` (evaluation, old/ref log-probs) it replays.

Backward (recompute): the op hands the impl the MERGED (out_g, lse_g) — with attention sinks or a cached prefix
they are not this impl's own (out_f, lse_f). The impl recomputes (out_f, lse_f) under autograd and backpropagates

    L = sum_{h,q} c[h, q] * (dout[h, q] . out_f[h, q]) + sum_{h,q} g[h, q] * lse_f[h, q]
    c = exp(lse_f - lse_g),   g = c * (rowsum(dout * out_f) - rowsum(dout * out_g))     (c = g = 0 where lse_f = -inf)

through FlexAttention's own backward. With p_f = exp(s - lse_f), d out_f / d s gives c p_f (dp - rowsum(dout *
out_f)) and d lse_f / d s = p_f gives g p_f; their sum is

    dL/ds = c p_f (dp - rowsum(dout * out_g)) = p_g (dp - delta_g),   p_g = exp(s - lse_g),

the score gradient of the merged softmax (the reference's formula), so dq, dk, dv and the gradients of the
tensors score_mod reads (R, trainable m) are exact. Without sinks or a cache, c = 1 and g = 0. The recompute
costs one more forward (and BlockMask) inside the backward.
"""
from __future__ import annotations

import logging
import warnings
from typing import Callable, Optional

import torch
from torch import Tensor

from brcompile.backends.attention.args import TreeAttentionArgs, attention_backward, attention_forward
from brcompile.backends.attention.op import AttentionImpl, AttentionImplError, register_attention_impl

log = logging.getLogger(__name__)

__all__ = ["COMPILED_DEVICES", "COMPILE_BACKEND", "FLEX_BACKWARD_DEVICES", "FLEX_DEVICES", "FLEX_RECOMPILE_LIMIT",
           "flex_backward", "flex_forward", "tree_block_mask", "tree_mask_mod", "tree_score_mod"]

#: Device types the forward runs on, and those with a backward (FlexAttention has no CPU backward).
FLEX_DEVICES = frozenset({"cpu", "cuda"})
FLEX_BACKWARD_DEVICES = frozenset({"cuda"})

#: The message of FlexAttention's warning about its unfused path, which the CPU forward takes on purpose.
_UNFUSED_WARNING = "flex_attention called without torch.compile"


def _flex_api():
    """(flex_attention, create_block_mask, AuxRequest or None); AuxRequest (``return_aux``) replaces the
    deprecated ``return_lse`` in newer torch."""
    from torch.nn.attention import flex_attention as fa

    return fa.flex_attention, fa.create_block_mask, getattr(fa, "AuxRequest", None)


#: Dynamo cache entries allowed per compiled FlexAttention function during its calls (Dynamo's default is 8): one
#: per (mask_mod, score_mod, grad mode, dtype) variant, and one more per variant when the first shape change makes
#: it dynamic; a model with sliding and full layers trained and evaluated in two dtypes needs more than 8, and past
#: the limit Dynamo would run FlexAttention unfused (the [Hq, N, N] scores materialised).
FLEX_RECOMPILE_LIMIT = 64

#: Device types whose calls run the compiled FlexAttention (and block-mask builder), and the torch.compile backend
#: used: Inductor's fused kernels on CUDA; elsewhere FlexAttention's unfused path (CPU Inductor cannot return lse).
COMPILED_DEVICES = frozenset({"cuda"})
COMPILE_BACKEND = "inductor"

_COMPILED: dict[tuple[str, str], Callable] = {}


def _recompile_limit():
    """A context raising Dynamo's recompile limit to at least FLEX_RECOMPILE_LIMIT (``recompile_limit``, called
    ``cache_size_limit`` in older torch) for the calls made inside it."""
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    return cfg.patch(**{name: max(getattr(cfg, name), FLEX_RECOMPILE_LIMIT)})


def _compiled(name: str, fn: Callable) -> Callable:
    """``torch.compile(fn, backend=COMPILE_BACKEND)``, made once per (name, backend): on CUDA the fused FlexAttention
    kernels (automatic dynamic shapes after the first change of N: one more compile, then none)."""
    key = (name, COMPILE_BACKEND)
    if key not in _COMPILED:
        log.debug("flex tree attention: torch.compile(%s, backend=%r)", name, COMPILE_BACKEND)
        _COMPILED[key] = torch.compile(fn, backend=COMPILE_BACKEND)
    return _COMPILED[key]


def tree_mask_mod(end: Tensor, valid: Tensor, window: int = 0, position: Optional[Tensor] = None) -> Callable:
    """FlexAttention mask_mod of the tree: ``valid[k] & (k <= q) & (q < end[k])``, and ``position[q] -
    position[k] < window`` when window > 0 (HF's sliding window over the tree positions). The window is read
    as a 0-d tensor (a captured buffer), not a Python number Dynamo could turn into a symbol inside
    FlexAttention's subgraphs."""

    def tree_visible(b, h, q_idx, kv_idx):
        return valid[kv_idx] & (kv_idx <= q_idx) & (q_idx < end[kv_idx])

    if not window:
        return tree_visible
    width = torch.tensor(window, dtype=position.dtype, device=position.device)

    def tree_visible_in_window(b, h, q_idx, kv_idx):
        return tree_visible(b, h, q_idx, kv_idx) & (position[q_idx] - position[kv_idx] < width)

    return tree_visible_in_window


def tree_score_mod(softcap: float = 0.0, slopes: Optional[Tensor] = None, relbias: Optional[Tensor] = None,
                   position: Optional[Tensor] = None, device=None) -> Optional[Callable]:
    """FlexAttention score_mod of the scaled score s: ``c * tanh(s / c)`` (softcap c > 0), then ``+ slopes[h] *
    (position[k] - position[q])`` (ALiBi), then ``+ relbias[h, q, min(position[q] - position[k], E - 1)]`` (relative
    bias); None when there is nothing to add. The distance is clamped to [0, E - 1] (a visible key is an ancestor;
    the clamp also keeps masked pairs' gathers in range). The soft-cap is read as a 0-d float64 tensor on
    ``device`` (a captured buffer: a Python float would become a symbol inside FlexAttention's subgraphs)."""
    if not softcap and slopes is None and relbias is None:
        return None
    extent = None if relbias is None else relbias.shape[-1]
    cap = torch.tensor(float(softcap), dtype=torch.float64, device=device) if softcap else None

    def tree_score(score, b, h, q_idx, kv_idx):
        if cap is not None:
            c = cap.to(score.dtype)
            score = c * torch.tanh(score / c)
        if slopes is not None:
            score = score + slopes[h] * (position[kv_idx] - position[q_idx]).to(score.dtype)
        if relbias is not None:
            bucket = torch.clamp(position[q_idx] - position[kv_idx], 0, extent - 1)
            score = score + relbias[h, q_idx, bucket].to(score.dtype)
        return score

    return tree_score


def tree_block_mask(a: TreeAttentionArgs):
    """The BlockMask of ``a``'s tree over its N packed tokens (one batch, heads broadcast), from
    :func:`tree_mask_mod`: compiled on CUDA (no [N, N] mask is materialised), eager elsewhere."""
    _, create_block_mask, _ = _flex_api()
    n = a.q.shape[1]
    mask_mod = tree_mask_mod(a.end, a.valid, a.window, a.position)
    compiled = a.q.device.type in COMPILED_DEVICES
    build = _compiled("create_block_mask", create_block_mask) if compiled else create_block_mask
    with _recompile_limit():
        return build(mask_mod, 1, 1, n, n, device=a.q.device)


def _score_tensors(a: TreeAttentionArgs, requires_grad: bool) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """(slopes, relbias) as score_mod reads them, in the accumulation dtype; with ``requires_grad`` the
    trainable ones (``a.slopes``, ``a.relbias``) are fresh leaves whose gradients the backward reads."""
    acc = a.lse_dtype
    slopes = a.alibi_slopes()
    if requires_grad and a.slopes is not None:
        slopes = slopes.clone().requires_grad_(True)
    relbias = None if a.relbias is None else a.relbias.detach().to(acc)
    if requires_grad and relbias is not None:
        relbias = relbias.clone().requires_grad_(True)
    return slopes, relbias


def _flex_call(q: Tensor, k: Tensor, v: Tensor, a: TreeAttentionArgs, slopes: Optional[Tensor],
               relbias: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(out [Hq, N, D], lse [Hq, N]) of FlexAttention over ``a``'s tree for q [Hq, N, D], k/v [Hkv, N, D]
    (differentiable when the inputs require grad): compiled on CUDA (COMPILED_DEVICES), FlexAttention's unfused path
    elsewhere."""
    flex_attention, _, aux_request = _flex_api()
    score_mod = tree_score_mod(a.softcap, slopes, relbias, a.position, q.device)
    kwargs = dict(score_mod=score_mod, block_mask=tree_block_mask(a), scale=a.scale, enable_gqa=a.group > 1)
    if aux_request is not None:
        kwargs["return_aux"] = aux_request(lse=True)
    else:  # torch without AuxRequest
        kwargs["return_lse"] = True
    with _recompile_limit():
        if q.device.type in COMPILED_DEVICES:
            out, aux = _compiled("flex_attention", flex_attention)(q[None], k[None], v[None], **kwargs)
        else:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_UNFUSED_WARNING)
                out, aux = flex_attention(q[None], k[None], v[None], **kwargs)
    lse = aux.lse if aux_request is not None else aux
    return out[0], lse[0]


def _require_device(a: TreeAttentionArgs, backward: bool) -> None:
    """AttentionImplError unless the flex impl runs (``backward``: differentiates) on q's device."""
    devices = FLEX_BACKWARD_DEVICES if backward else FLEX_DEVICES
    if a.q.device.type not in devices:
        what = "backward" if backward else "forward"
        raise AttentionImplError(
            f"tree_attention impl 'flex' has no {what} on {a.q.device.type} (FlexAttention's {what} runs on "
            f"{', '.join(sorted(devices))}); " + ("run it under torch.no_grad there, or use attention='cpu' or "
                                                  "'triton' for training" if backward else "use another impl"))


@attention_forward
def flex_forward(a: TreeAttentionArgs) -> tuple[Tensor, Tensor]:
    """(out [Hq, N, D] in q's dtype, lse [Hq, N] in the accumulation dtype) by FlexAttention with the tree's
    mask_mod and score_mod (module docstring)."""
    _require_device(a, backward=False)
    slopes, relbias = _score_tensors(a, requires_grad=False)
    with torch.no_grad():  # detached: FlexAttention refuses CPU inputs that require grad, even under no_grad
        out, lse = _flex_call(a.q.detach(), a.k.detach(), a.v.detach(), a, slopes, relbias)
    return out.to(a.q.dtype), lse.to(a.lse_dtype)


def _recompute_weights(grad_out: Tensor, out_f: Tensor, lse_f: Tensor, out: Tensor,
                       lse: Tensor) -> tuple[Tensor, Tensor]:
    """(c, g) of the module docstring, [Hq, N] in lse_f's dtype: ``c = exp(lse_f - lse)``, ``g = c *
    (rowsum(dout * out_f) - rowsum(dout * out))``, both 0 on rows that see no key (lse_f = -inf)."""
    acc = lse_f.dtype
    seen = torch.isfinite(lse_f)
    c = torch.where(seen, torch.exp(lse_f - lse.to(acc)), torch.zeros_like(lse_f))
    dout = grad_out.to(acc)
    delta_f = (dout * out_f.detach().to(acc)).sum(-1)
    delta = (dout * out.to(acc)).sum(-1)
    g = torch.where(seen, c * (delta_f - delta), torch.zeros_like(lse_f))
    return c, g


@attention_backward
def flex_backward(a: TreeAttentionArgs, grad_out: Tensor, out: Tensor, lse: Tensor) -> tuple[Tensor, ...]:
    """(dq, dk, dv), then dR with a relative bias, then dslopes with trainable slopes: FlexAttention's backward of
    the recomputed forward, weighted so that it is the backward of the given (merged) out and lse (module
    docstring)."""
    _require_device(a, backward=True)
    q, k, v = (t.detach().requires_grad_(True) for t in (a.q, a.k, a.v))
    slopes, relbias = _score_tensors(a, requires_grad=True)
    with torch.enable_grad():
        out_f, lse_f = _flex_call(q, k, v, a, slopes, relbias)
        c, g = _recompute_weights(grad_out, out_f, lse_f.detach(), out, lse)
        leaves = [q, k, v] + ([relbias] if a.relbias is not None else []) + ([slopes] if a.slopes is not None else [])
        grads = torch.autograd.grad((out_f, lse_f), leaves,
                                    ((c[..., None] * grad_out.to(c.dtype)).to(out_f.dtype), g.to(lse_f.dtype)))
    result = [grads[0].to(a.q.dtype), grads[1].to(a.k.dtype), grads[2].to(a.v.dtype)]
    rest = list(grads[3:])
    if a.relbias is not None:
        result.append(rest.pop(0).to(a.relbias.dtype))
    if a.slopes is not None:
        result.append(rest.pop(0).to(a.slopes.dtype))
    return tuple(result)


register_attention_impl(AttentionImpl(name="flex", forward=flex_forward, backward=flex_backward,
                                      device_types=FLEX_DEVICES, backward_device_types=FLEX_BACKWARD_DEVICES,
                                      supports_window=True, supports_softcap=True, supports_alibi=True,
                                      supports_relbias=True, supports_alibi_grad=True))
