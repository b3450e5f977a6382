"""The arguments of one tree attention and their checks (docs/ARCHITECTURE.md §6): :class:`TreeAttentionArgs`,
what every impl receives; :class:`TreeAttentionError`; the decorators that let an impl also be called the op's way
(:func:`attention_forward`, :func:`attention_backward`); and the feature math the op and its impls share: relative
bias buckets, the sink merge and its gradient, the ALiBi slopes' gradient (the formulas: op.py's docstring).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from brcompile.backends.attention.features import FEATURES, FORWARD_FEATURES_AT, call_features

__all__ = [
    "TreeAttentionArgs",
    "TreeAttentionError",
    "attention_backward",
    "attention_features",
    "attention_forward",
    "check_alibi",
    "check_qkv",
    "check_relbias",
    "check_sinks",
    "check_slopes",
    "check_window",
    "lse_dtype_for",
    "relative_buckets",
    "sink_grad",
    "sink_merge",
    "slopes_grad",
]


class TreeAttentionError(ValueError):
    """Inputs of tree_attention that do not satisfy the op's contract (shapes, dtypes, tree arrays)."""



def lse_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """dtype of the logsumexp output: float32 for float16/bfloat16 inputs, else the input dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# ------------------------------------------------------------------------------------------ arguments


@dataclass(frozen=True)
class TreeAttentionArgs:
    """The arguments of one tree attention (every op argument but ``impl``); what an impl receives.

    ``q [Hq, N, D]``, ``k``/``v [Hkv, N, D]``, the tree arrays ``end``/``valid``/``segments``, ``scale``;
    ``window`` W > 0 with ``position [N]``: the sliding window ``position[q] - position[k] < W``;
    ``softcap`` c > 0: scores ``c * tanh(scale * q.k / c)``; ``alibi`` (a tuple of Hq floats m, with
    ``position``): scores ``+ m[h] * (position[k] - position[q])``, or the same with ``slopes`` m a
    differentiable [Hq] tensor instead of the constants (not both); ``sinks`` ([Hq] or per query
    [Hq, N] tensor): one more logit per query row without a value (applied by the op around the impl: impls
    ignore it, see the module docstring); ``relbias`` ([Hq, N, E] tensor R, with ``position``): scores
    ``+ R[h, q, min(position[q] - position[k], E - 1)]``; ``slopes``: ALiBi's m as a differentiable [Hq]
    tensor instead of the constants ``alibi`` (not both). Neutral defaults (0, None, 0.0, None, None, None,
    None) mean off. The fields after ``scale`` are the features of backends/attention/features.py
    (:data:`FEATURES`, same names, order and defaults): a new attention feature is a new entry there and a new
    field here (docs/ARCHITECTURE.md §10.3). The field order is the op's argument order (without ``impl``), so
    ``TreeAttentionArgs(q, k, v, end, valid, segments, scale, window, position, softcap, alibi, sinks, relbias,
    slopes)`` reads like the op call.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    end: Tensor
    valid: Tensor
    segments: Tensor
    scale: float
    window: int = 0
    position: Optional[Tensor] = None
    softcap: float = 0.0
    alibi: Optional[Sequence[float]] = None
    sinks: Optional[Tensor] = None
    relbias: Optional[Tensor] = None
    slopes: Optional[Tensor] = None

    @property
    def features(self) -> dict:
        """{name: value} of the optional features (:data:`FEATURES`), in the op's order."""
        return {f.name: getattr(self, f.name) for f in FEATURES}

    @property
    def has_alibi(self) -> bool:
        """Whether the scores carry an ALiBi bias (constant ``alibi`` or tensor ``slopes``)."""
        return bool(self.alibi) or self.slopes is not None

    @property
    def tree(self) -> tuple[Tensor, Tensor, Tensor]:
        """(end, valid, segments)."""
        return self.end, self.valid, self.segments

    @property
    def group(self) -> int:
        """Query heads per kv head (Hq // Hkv)."""
        return self.q.shape[0] // self.k.shape[0]

    @property
    def lse_dtype(self) -> torch.dtype:
        """dtype of lse (and of the impls' accumulators): float32 for half inputs, else q's dtype."""
        return lse_dtype_for(self.q.dtype)

    def replace(self, **changes) -> "TreeAttentionArgs":
        """A copy with some fields changed (e.g. ``q=q.double()``)."""
        return dataclasses.replace(self, **changes)

    def check(self) -> "TreeAttentionArgs":
        """Raise TreeAttentionError unless the arguments match the op's contract (also on fake tensors:
        shapes and dtypes only); returns self."""
        check_qkv(self.q, self.k, self.v, "tree_attention")
        n = self.q.shape[1]
        if self.k.shape[1] != n:
            raise TreeAttentionError(
                f"tree_attention: q {tuple(self.q.shape)} and k {tuple(self.k.shape)} disagree on N or D")
        end, valid, segments = self.tree
        if end.dtype != torch.int64 or end.dim() != 1 or end.shape[0] != n:
            raise TreeAttentionError(f"tree_attention: end must be int64 [N={n}], got {end.dtype} {tuple(end.shape)}")
        if valid.dtype != torch.bool or valid.dim() != 1 or valid.shape[0] != n:
            raise TreeAttentionError(
                f"tree_attention: valid must be bool [N={n}], got {valid.dtype} {tuple(valid.shape)}")
        if segments.dtype != torch.int64 or segments.dim() != 2 or segments.shape[1] != 3:
            raise TreeAttentionError(
                f"tree_attention: segments must be int64 [S, 3], got {segments.dtype} {tuple(segments.shape)}")
        check_window(self.window, self.position, n)
        if isinstance(self.softcap, bool) or not isinstance(self.softcap, numbers.Real):
            raise TreeAttentionError(f"tree_attention: softcap must be a float (0: no soft-cap), "
                                     f"got {type(self.softcap).__name__}")
        if not (math.isfinite(self.softcap) and self.softcap >= 0):
            raise TreeAttentionError(f"tree_attention: softcap must be a finite float >= 0 (0: no soft-cap), "
                                     f"got {self.softcap}")
        check_alibi(self.alibi, self.position, self.q.shape[0], n)
        check_slopes(self.slopes, self.alibi, self.position, self.q.shape[0], n)
        check_sinks(self.sinks, self.q.shape[0], n)
        check_relbias(self.relbias, self.position, self.q.shape[0], n)
        return self

    def alibi_slopes(self) -> Optional[Tensor]:
        """The ALiBi slopes as a [Hq] tensor of the accumulation dtype on q's device (None without ALiBi); the
        ``slopes`` tensor's values, detached, or the constants."""
        if self.slopes is not None:
            return self.slopes.detach().to(dtype=self.lse_dtype, device=self.q.device)
        if not self.alibi:
            return None
        return torch.tensor([float(m) for m in self.alibi], dtype=self.lse_dtype, device=self.q.device)

    def without_sinks(self) -> "TreeAttentionArgs":
        """These arguments without the sinks: what an impl computes (the op merges the sinks in)."""
        return self if self.sinks is None else self.replace(sinks=None)

    def save_for_backward(self, ctx, *tensors: Optional[Tensor]) -> None:
        """Save the arguments (and ``tensors``, e.g. out and lse) on an autograd ``ctx``: q, k, v, the tree arrays
        and the tensor features as saved tensors, ``scale`` and the other features as constants; see
        :meth:`saved`."""
        ctx.save_for_backward(self.q, self.k, self.v, self.end, self.valid, self.segments,
                              *(getattr(self, f.name) for f in _TENSOR_FEATURES), *tensors)
        ctx.tree_attention = (self.scale, *(getattr(self, f.name) for f in _CONSTANT_FEATURES))

    @classmethod
    def saved(cls, ctx) -> tuple["TreeAttentionArgs", list]:
        """(args, [tensors]) as :meth:`save_for_backward` saved them."""
        saved = ctx.saved_tensors
        n = 6 + len(_TENSOR_FEATURES)
        scale, *constants = ctx.tree_attention
        features = {**dict(zip((f.name for f in _TENSOR_FEATURES), saved[6:n])),
                    **dict(zip((f.name for f in _CONSTANT_FEATURES), constants))}
        return cls(*saved[:6], scale, **features), list(saved[n:])


_FIELDS = tuple(f.name for f in dataclasses.fields(TreeAttentionArgs))
_TENSOR_FEATURES = tuple(f for f in FEATURES if f.is_tensor)
_CONSTANT_FEATURES = tuple(f for f in FEATURES if not f.is_tensor)


def check_qkv(q: Tensor, k: Tensor, v: Tensor, what: str) -> None:
    """q [Hq, N, D] and k, v [Hkv, M, D] of one floating dtype with Hq a multiple of Hkv (M: the keys,
    the cache's for cached attention); raises TreeAttentionError."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise TreeAttentionError(f"{what} expects q [Hq, N, D], k and v [Hkv, N, D]; got q {tuple(q.shape)}, "
                                 f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape != v.shape:
        raise TreeAttentionError(f"{what}: k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    hq, hkv = q.shape[0], k.shape[0]
    if k.shape[2] != q.shape[2]:
        raise TreeAttentionError(f"{what}: q {tuple(q.shape)} and k {tuple(k.shape)} disagree on N or D")
    if hkv == 0 or hq % hkv != 0:
        raise TreeAttentionError(f"{what}: Hq={hq} must be a positive multiple of Hkv={hkv}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise TreeAttentionError(f"{what}: q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")


def check_window(window: int, position: Optional[Tensor], n) -> None:
    """A window is an int >= 0 (0: none); a window needs the [N] integer positions of the tokens."""
    if isinstance(window, bool) or not isinstance(window, numbers.Integral):
        raise TreeAttentionError(f"tree_attention: window must be an int (0: no window), got {type(window).__name__}")
    if window < 0:
        raise TreeAttentionError(f"tree_attention: window must be >= 0 (0: no window), got {window}")
    if window and (position is None or position.dtype == torch.bool or position.is_floating_point()
                   or position.is_complex() or position.dim() != 1 or position.shape[0] != n):
        got = None if position is None else (position.dtype, tuple(position.shape))
        raise TreeAttentionError(f"tree_attention: window={window} needs position, the tokens' integer positions "
                                 f"[N={n}], got {got}")


def _integer_positions(position: Optional[Tensor], n) -> bool:
    """Whether ``position`` is an [N] integer tensor."""
    return not (position is None or position.dtype == torch.bool or position.is_floating_point()
                or position.is_complex() or position.dim() != 1 or position.shape[0] != n)


def _require_positions(position: Optional[Tensor], n, what: str) -> None:
    """The ALiBi slopes and the relative bias read the tokens' [N] integer positions."""
    if not _integer_positions(position, n):
        got = None if position is None else (position.dtype, tuple(position.shape))
        raise TreeAttentionError(f"tree_attention: {what} position, the tokens' integer positions [N={n}], "
                                 f"got {got}")


def check_alibi(alibi: Optional[Sequence[float]], position: Optional[Tensor], hq: int, n) -> None:
    """ALiBi slopes are None (off) or a sequence of Hq finite numbers, and need the [N] integer positions."""
    if alibi is None:
        return
    if isinstance(alibi, Tensor) or not isinstance(alibi, (list, tuple)) or len(alibi) != hq \
            or not all(isinstance(m, numbers.Real) and not isinstance(m, bool) and math.isfinite(m) for m in alibi):
        raise TreeAttentionError(f"tree_attention: alibi must be a list of {hq} finite slopes (one per query head), "
                                 f"got {alibi!r}")
    _require_positions(position, n, "alibi needs")


def check_slopes(slopes: Optional[Tensor], alibi, position: Optional[Tensor], hq: int, n) -> None:
    """Trainable ALiBi slopes are None (off) or a floating [Hq] tensor, not beside constant ``alibi``, and need
    the [N] integer positions."""
    if slopes is None:
        return
    if not isinstance(slopes, Tensor) or not slopes.is_floating_point() or tuple(slopes.shape) != (hq,):
        got = (slopes.dtype, tuple(slopes.shape)) if isinstance(slopes, Tensor) else type(slopes).__name__
        raise TreeAttentionError(f"tree_attention: slopes must be a floating [Hq={hq}] tensor, got {got}")
    if alibi:
        raise TreeAttentionError("tree_attention: ALiBi slopes given twice (constant alibi and a slopes tensor)")
    _require_positions(position, n, "slopes need")


def check_sinks(sinks: Optional[Tensor], hq: int, n: int) -> None:
    """Sinks are None (off) or a floating tensor of logits: [Hq] (one per head) or [Hq, N] (one per head and
    query token)."""
    if sinks is None:
        return
    if not isinstance(sinks, Tensor) or not sinks.is_floating_point() or tuple(sinks.shape) not in ((hq,), (hq, n)):
        got = (sinks.dtype, tuple(sinks.shape)) if isinstance(sinks, Tensor) else type(sinks).__name__
        raise TreeAttentionError(f"tree_attention: sinks must be a floating [Hq={hq}] or [Hq={hq}, N={n}] tensor, "
                                 f"got {got}")


def check_relbias(relbias: Optional[Tensor], position: Optional[Tensor], hq: int, n) -> None:
    """A relative bias is None (off) or a floating [Hq, N, E] table (E >= 1), and needs the [N] integer
    positions."""
    if relbias is None:
        return
    if not isinstance(relbias, Tensor) or not relbias.is_floating_point() or relbias.dim() != 3 \
            or relbias.shape[0] != hq or relbias.shape[1] != n or relbias.shape[2] < 1:
        got = (relbias.dtype, tuple(relbias.shape)) if isinstance(relbias, Tensor) else type(relbias).__name__
        raise TreeAttentionError(f"tree_attention: relbias must be a floating [Hq={hq}, N={n}, E] table (E >= 1), "
                                 f"got {got}")
    _require_positions(position, n, "relbias needs")


def relative_buckets(qpos: Tensor, kpos: Tensor, extent: int) -> Tensor:
    """[nq, nk] int64 bucket of each (query, key) pair of a relative bias with ``extent`` E columns:
    ``clamp(qpos[q] - kpos[k], 0, E - 1)`` (a visible key is an ancestor: its distance is >= 0)."""
    return (qpos[:, None] - kpos[None, :]).clamp(0, extent - 1).to(torch.int64)


def _sink_rows(sinks: Tensor, lse: Tensor) -> Tensor:
    """The sink logit of every query row, [Hq, N] in lse's dtype and device: ``s[h]`` repeated over the
    queries for per-head sinks, ``s[h, q]`` for per-query ones. Materialised (contiguous): torch's pointwise ops
    may round a stride-0 operand's loop differently, and a per-head sink must give the same bits as the same
    values per query."""
    s = sinks.to(device=lse.device, dtype=lse.dtype)
    return (s[:, None] if s.dim() == 1 else s).expand_as(lse).contiguous()


def sink_merge(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """(out', lse') with one value-less logit ``s[h, q]`` per query row joined to the softmax (``sinks[h]`` or
    ``sinks[h, q]``): ``lse' = logaddexp(lse, s)``, ``out' = out * exp(lse - lse')`` (0 where lse = -inf: a
    query that sees no key keeps out' = 0 and gets lse' = s). Computed in lse's dtype."""
    merged = torch.logaddexp(lse, _sink_rows(sinks, lse))
    weight = torch.exp(lse - merged)  # exp(-inf - finite) = 0
    return (out.to(lse.dtype) * weight[..., None]).to(out.dtype), merged


def sink_grad(grad_out: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """d loss / d s[h, q] = - exp(s[h, q] - lse'[h, q]) * sum_d dout[h, q, d] out'[h, q, d], from the merged
    (out', lse') (module docstring), summed over the queries for per-head [Hq] sinks; in sinks' dtype."""
    acc = lse.dtype
    delta = (grad_out.to(acc) * out.to(acc)).sum(-1)
    per_row = -torch.exp(_sink_rows(sinks, lse) - lse) * delta
    return (per_row.sum(-1) if sinks.dim() == 1 else per_row).to(sinks.dtype)


def slopes_grad(ds: Tensor, qpos: Tensor, kpos: Tensor) -> Tensor:
    """[H] ``sum_{q, k} ds[h, q, k] * (kpos[k] - qpos[q])`` (``ds`` [..., H, nq, nk], 0 on pairs not seen, the
    leading dims summed): the gradient of ALiBi slopes from the gradient of the (post-cap) scores, in ds's dtype,
    as ``sum_k ds kpos - sum_q qpos sum_k ds``."""
    ds = ds.reshape(-1, *ds.shape[-3:]).sum(0)
    kp, qp = kpos.to(ds.dtype), qpos.to(ds.dtype)
    return (ds * kp[None, None, :]).sum((-1, -2)) - (ds.sum(-1) * qp[None, :]).sum(-1)


def attention_forward(fn: Callable) -> Callable:
    """Decorator of an impl's ``forward(args: TreeAttentionArgs, **options) -> (out, lse)``: the result may
    also be called the op's way, ``forward(q, k, v, end, valid, segments, scale, window=0, position=None,
    softcap=0.0, alibi=None, **options)`` (standalone use: tests, benchmarks), which builds and checks the args."""

    @functools.wraps(fn)
    def forward(*args, **kwargs):
        if args and isinstance(args[0], TreeAttentionArgs):
            return fn(*args, **kwargs)
        fields = {name: kwargs.pop(name) for name in _FIELDS if name in kwargs}
        return fn(TreeAttentionArgs(*args, **fields).check(), **kwargs)

    return forward


def attention_backward(fn: Callable) -> Callable:
    """Decorator of an impl's ``backward(args, grad_out, out, lse, **options) -> (dq, dk, dv)``; the result
    may also be called the op's way, ``backward(grad_out, q, k, v, out, lse, end, valid, segments, scale,
    window=0, position=None, softcap=0.0, alibi=None, **options)``, which builds and checks the args."""

    @functools.wraps(fn)
    def backward(*args, **kwargs):
        if args and isinstance(args[0], TreeAttentionArgs):
            return fn(*args, **kwargs)
        grad_out, q, k, v, out, lse, *rest = args
        fields = {name: kwargs.pop(name) for name in _FIELDS[6:] if name in kwargs}
        return fn(TreeAttentionArgs(q, k, v, *rest, **fields).check(), grad_out, out, lse, **kwargs)

    return backward


def attention_features(args: Sequence) -> dict:
    """{name: value} of the features of a ``tree_attention_forward`` call's positional arguments (an FX node's
    ``args``), defaults filled in (backends/attention/features.py)."""
    return call_features(args, FORWARD_FEATURES_AT)
