"""torch.library custom ops for the packed graph: ``brcompile::tree_attention``.

Three ops, mirroring how ``scaled_dot_product_attention`` is built from ``_scaled_dot_product_*``:

``brcompile::tree_attention(q, k, v, end, valid, segments, float scale, str impl) -> Tensor``
    What the graph rewrite emits. CompositeImplicitAutograd: it is ``tree_attention_forward(...)[0]``,
    so AOTAutograd traces through it to the two ops below.
``brcompile::tree_attention_forward(q, k, v, end, valid, segments, scale, impl, window=0, position=None,
  softcap=0.0, alibi=None, sinks=None, relbias=None, slopes=None) -> (Tensor out, Tensor lse)``
    Opaque custom op with a fake impl, a flop formula and an autograd formula. ``lse`` (natural-log
    logsumexp of the scaled scores of each query row, ``-inf`` for a query that sees no key) is saved
    for backward and is not differentiable (as for SDPA's logsumexp).
``brcompile::tree_attention_backward(grad_out, q, k, v, out, lse, end, valid, segments, scale, impl,
  window=0, position=None, softcap=0.0, alibi=None, sinks=None, relbias=None, slopes=None) -> (Tensor dq, Tensor dk,
  Tensor dv, Tensor drelbias, Tensor dslopes)``
    Opaque custom op with a fake impl and a flop formula, so AOTAutograd can trace the backward (``drelbias``,
    ``dslopes`` are empty tensors without a relative bias, without trainable slopes).

Shapes (N packed tokens in DFS preorder, see brcompile.runtime.tree.PackedTree)::

    q [Hq, N, D]   k [Hkv, N, D]   v [Hkv, N, D]   Hq % Hkv == 0; query head h uses kv head h // (Hq // Hkv)
    end [N] int64, valid [N] bool, segments [S, 3] int64 rows (start, stop, subtree_end)
    out [Hq, N, D] (q.dtype)   lse [Hq, N] (float32 for float16/bfloat16 inputs, else q.dtype)

Mask: query q sees key k  <=>  k <= q < end[k] and valid[k] (and, with ``window`` W > 0, also
position[q] - position[k] < W: HF's sliding window, over the tree positions = the batch columns). With
``softcap`` c > 0 the scores are ``c * tanh(scale * q.k / c)``. A query that sees no key outputs 0 and gets
zero gradient. ``out[:, q] = sum_k softmax_k(scale * q.k) v[:, k]`` over the visible keys.

ALiBi (``alibi``: per-query-head slopes m[Hq], numbers, with ``position``): the score of (q, k) in head h
gets ``+ m[h] * (position[k] - position[q])`` (after the soft-cap, if any). Softmax is invariant to a
per-query shift, so this is also BLOOM's ``m[h] * position[k]``. The slopes are either constants (``alibi``, no
gradient) or a [Hq] tensor (``slopes``, trainable ALiBi; not both), whose gradient, with ``dS[h, q, k]`` the
gradient of the (post-cap) score of a visible pair, is

    d slopes[h] = sum over visible (q, k) of dS[h, q, k] * (position[k] - position[q])

computed by impls that declare ``supports_alibi_grad`` (their backward then returns it last; the backward op
returns an empty ``dslopes`` without ``slopes``).

Relative bias (``relbias``: a per-query-token table R [Hq, N, E], differentiable, with ``position``): the score of
(q, k) in head h gets ``+ R[h, q, min(position[q] - position[k], E - 1)]`` (after the soft-cap, if any) — a
bias that is a value of the query token, indexed by the clamped distance to the key (Inkling2's relative
position bias, a projection of the query's hidden state mixed into a bank of bias-vs-distance profiles; a bias
that is 0 from distance E - 1 on is a table whose last column is 0). Visible keys are the query's ancestors, so
the distance is >= 0. Its gradient is the score gradient summed per distance bucket::

    d R[h, q, e] = sum over visible k with min(position[q] - position[k], E - 1) = e of ds[h, q, k]

with ``ds = p (dp - delta)`` the gradient of the (soft-capped) score, computed by the impl
(``supports_relbias``): its backward returns (dq, dk, dv, dR).

Attention sinks (``sinks``, differentiable): each query row's softmax has one more logit that carries no value,
either one learned logit per head (GPT-OSS: a [Hq] tensor s, row (h, q) reads ``s[h]``) or a logit computed per
query token (Inkling2: a [Hq, N] tensor s, row (h, q) reads ``s[h, q]``, e.g. a projection of the query's hidden
state). Writing ``s[h, q]`` for either (the [Hq] case broadcast over the queries)::

    lse'[h, q] = logaddexp(lse[h, q], s[h, q]),   out'[h, q] = out[h, q] * exp(lse[h, q] - lse'[h, q])

where (out, lse) are the attention without the sink (a query that sees no key: out' = 0, lse' = s[h, q]).
This is applied here, around every impl (impls never see a sink), and the backward of the keys is the
impl's with the merged (out', lse'): ``ds = p (dp - delta)`` with ``p = exp(score - lse')`` and ``delta =
rowsum(dout * out')`` is exactly the gradient of the softmax with the sink, restricted to the keys. The
sink's own gradient: with ``p_s = exp(s[h, q] - lse'[h, q])``, ``d out'[q] / d s[h, q] = -p_s out'[q]``, so

    d s[h, q] = - p_s[h, q] * delta[h, q],   delta[h, q] = sum_d dout[h, q, d] out'[h, q, d]

summed over the queries q for a per-head [Hq] sink (:func:`sink_merge`, :func:`sink_grad`).

The optional arguments after ``impl`` (window, position, soft-cap, ALiBi, sinks, relative bias, slopes) are the
features of backends/attention/features.py, in that order; code reads them by name through that list.

The op bodies gather their arguments (all but ``impl``) into one :class:`TreeAttentionArgs`, check it once
(:meth:`TreeAttentionArgs.check`) and hand it to the implementation named ``impl``, looked up in a registry
(``register_attention_impl``, :class:`brcompile.backends.common.registry.Registry`); ``"reference"``, ``"cpu"``,
``"triton"`` and ``"flex"`` (FlexAttention, backends/attention/flex.py) are imported lazily on first use and register
themselves.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

# The arguments and their checks live in args.py; the op's public names below include them (one import for users).
from brcompile.backends.attention.args import (
    TreeAttentionArgs, TreeAttentionError, attention_backward, attention_features, attention_forward, check_alibi,
    check_relbias, check_sinks, check_slopes, lse_dtype_for, relative_buckets, sink_grad, sink_merge, slopes_grad,
)
from brcompile.backends.attention.features import FEATURES, FORWARD_FEATURES_AT, impl_lacks, needs_position
from brcompile.backends.common.registry import Impl, Registry

log = logging.getLogger(__name__)

__all__ = [
    "ATTENTION_IMPLS",
    "AttentionImpl",
    "AttentionImplError",
    "TreeAttentionArgs",
    "TreeAttentionError",
    "attention_backward",
    "attention_features",
    "attention_forward",
    "check_alibi",
    "check_impl_supports",
    "check_relbias",
    "check_sinks",
    "check_slopes",
    "count_visible_pairs",
    "get_attention_impl",
    "lse_dtype_for",
    "register_attention_impl",
    "registered_attention_impls",
    "relative_buckets",
    "sink_grad",
    "sink_merge",
    "slopes_grad",
    "tree_attention",
]


class AttentionImplError(RuntimeError):
    """An attention implementation that is unknown, or unavailable for the device of the inputs."""


# ------------------------------------------------------------------------------------------ registry


@dataclass(frozen=True)
class AttentionImpl(Impl):
    """One way to execute tree attention.

    forward(args: TreeAttentionArgs) -> (out, lse)
    backward(args: TreeAttentionArgs, grad_out, out, lse) -> (dq, dk, dv)

    ``args`` has been checked (:meth:`TreeAttentionArgs.check`). With ``supports_window`` the impl honours
    ``args.window``/``args.position`` (query q sees key k only if also ``pos[q] - pos[k] < W``), with
    ``supports_softcap`` ``args.softcap`` (scores ``c * tanh(scale * q.k / c)``, Gemma2's logit
    soft-capping), with ``supports_alibi`` ``args.alibi`` (scores ``+ m[h] * (position[k] - position[q])``,
    read through ``args.alibi_slopes()``), with ``supports_alibi_grad`` also ``args.slopes`` (trainable: its
    backward returns the slopes' gradient last), with ``supports_relbias`` ``args.relbias`` (scores
    ``+ R[h, q, min(position[q] - position[k], E - 1)]``); its backward returns (dq, dk, dv), then dR with a
    relative bias, then dslopes with trainable slopes; an impl without the flag is never handed a window /
    soft-cap / ALiBi / trainable slopes / relative bias (:func:`check_impl_supports`).
    Sinks need no flag: the op applies them around every impl (module docstring).
    ``out``/``lse`` passed to backward are the ones forward returned (merged over the whole tree).
    ``device_types`` (keyword): the ``torch.device.type`` values the impl runs on; ``None`` means any.
    ``backward_device_types``: those its backward runs on (``None``: wherever it runs; FlexAttention's impl has
    no CPU backward), checked by :func:`check_impl_supports` with ``backward_device`` and by the backward op.
    Decorating forward/backward with :func:`attention_forward` / :func:`attention_backward` lets them be
    called with the op's positional arguments too.
    """

    Error = AttentionImplError
    op = "tree_attention"

    forward: Callable
    backward: Callable
    supports_window: bool = False
    supports_softcap: bool = False
    supports_alibi: bool = False
    supports_relbias: bool = False
    supports_alibi_grad: bool = False
    backward_device_types: Optional[frozenset] = None

    def __post_init__(self):
        super().__post_init__()
        if not callable(self.forward) or not callable(self.backward):
            raise AttentionImplError(f"attention impl {self.name!r}: forward and backward must be callable")

    @property
    def features(self) -> tuple[str, ...]:
        """The names of the attention features (backends/attention/features.py) this impl can be handed on: those
        whose support flags it all sets (sinks and positions, needing none, always)."""
        return tuple(f.name for f in FEATURES if all(getattr(self, s) for s in f.support))

    def backward_runs_on(self, device) -> bool:
        """Whether the impl's backward takes inputs on ``device`` (its forward must run there too)."""
        device = torch.device(device)
        return self.runs_on(device) and (self.backward_device_types is None
                                         or device.type in self.backward_device_types)


#: The tree-attention impls; the built-ins are imported on first use and register themselves.
ATTENTION_IMPLS = Registry("tree_attention", AttentionImpl, builtins={
    "reference": "brcompile.backends.attention.reference",
    "cpu": "brcompile.backends.attention.cpu",
    "triton": "brcompile.backends.attention.triton",
    "flex": "brcompile.backends.attention.flex",
})


def register_attention_impl(impl: AttentionImpl, *, override: bool = False) -> None:
    """Register an attention implementation under ``impl.name``; a name already registered raises
    unless ``override=True`` (which replaces it)."""
    ATTENTION_IMPLS.register(impl, override=override)


def registered_attention_impls() -> tuple[str, ...]:
    """Names usable as ``impl`` (registered or importable on demand), without ``"auto"``."""
    return ATTENTION_IMPLS.names()


def get_attention_impl(name: str, device) -> AttentionImpl:
    """The implementation ``name`` (``"auto"``: triton on CUDA when it imports, else cpu); raises
    AttentionImplError if it is unknown, cannot be imported, or does not run on ``device``."""
    return ATTENTION_IMPLS.get(name, device)


def check_impl_supports(impl: AttentionImpl, backward_device=None, **features) -> None:
    """Raise AttentionImplError when (``backward_device`` given) ``impl`` has no backward on that device, or
    when it lacks a support flag of a feature that ``features`` ({name: value}, e.g. ``window=2``,
    ``relbias=table``) turns on (``Feature.support``: a sliding window, soft-capping, ALiBi, a relative bias,
    trainable ALiBi slopes), checked in the features' order."""
    unknown = set(features) - {f.name for f in FEATURES}
    if unknown:
        raise TypeError(f"check_impl_supports: no attention feature named {', '.join(sorted(unknown))}")
    if backward_device is not None and not impl.backward_runs_on(backward_device):
        where = ", ".join(sorted(impl.backward_device_types)) if impl.backward_device_types else impl.placement()
        raise AttentionImplError(f"tree_attention impl {impl.name!r} has no backward on "
                                 f"{torch.device(backward_device).type} (its backward runs on {where})")
    lacking = impl_lacks(impl, features)
    if lacking is not None:
        raise AttentionImplError(f"tree_attention impl {impl.name!r} does not support {lacking.refusal}")


def impl_for(name: str, args: TreeAttentionArgs, backward: bool = False) -> AttentionImpl:
    """The impl ``name`` for ``args`` (its device; every feature ``args`` turns on supported; with ``backward``,
    a backward on that device)."""
    impl = get_attention_impl(name, args.q.device)
    check_impl_supports(impl, backward_device=args.q.device if backward else None, **args.features)
    return impl


def _check_result(name: str, what: str, got: Tensor, like_shape, like_dtype) -> None:
    """Raise AttentionImplError when an impl returned a tensor of the wrong shape or dtype."""
    if tuple(got.shape) != tuple(like_shape) or got.dtype != like_dtype:
        raise AttentionImplError(
            f"tree_attention impl {name!r} returned {what} {tuple(got.shape)} {got.dtype}, "
            f"expected {tuple(like_shape)} {like_dtype}"
        )


# --------------------------------------------------------------------------------------------- ops


@torch.library.custom_op("brcompile::tree_attention_forward", mutates_args=())
def _tree_attention_forward_op(
    q: Tensor, k: Tensor, v: Tensor, end: Tensor, valid: Tensor, segments: Tensor, scale: float, impl: str,
    window: int = 0, position: Optional[Tensor] = None, softcap: float = 0.0, alibi: Optional[list[float]] = None,
    sinks: Optional[Tensor] = None, relbias: Optional[Tensor] = None, slopes: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """(out [Hq, N, D], lse [Hq, N]) of tree attention, computed by the impl named ``impl`` (the sinks merged
    in afterwards: :func:`sink_merge`)."""
    a = TreeAttentionArgs(q, k, v, end, valid, segments, scale, window, position, softcap, alibi, sinks,
                          relbias, slopes).check()
    chosen = impl_for(impl, a)
    out, lse = chosen.forward(a.without_sinks())
    _check_result(chosen.name, "out", out, q.shape, q.dtype)
    _check_result(chosen.name, "lse", lse, q.shape[:2], a.lse_dtype)
    if sinks is not None:
        out, lse = sink_merge(out, lse, sinks)
    return out, lse


@_tree_attention_forward_op.register_fake
def _tree_attention_forward_fake(q, k, v, end, valid, segments, scale, impl, window=0, position=None, softcap=0.0,
                                 alibi=None, sinks=None, relbias=None, slopes=None):
    """Shapes only: out like q (contiguous), lse [Hq, N]."""
    a = TreeAttentionArgs(q, k, v, end, valid, segments, scale, window, position, softcap, alibi, sinks,
                          relbias, slopes).check()
    ATTENTION_IMPLS.check_name(impl)
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=a.lse_dtype)


@torch.library.custom_op("brcompile::tree_attention_backward", mutates_args=())
def _tree_attention_backward_op(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, end: Tensor, valid: Tensor,
    segments: Tensor, scale: float, impl: str, window: int = 0, position: Optional[Tensor] = None,
    softcap: float = 0.0, alibi: Optional[list[float]] = None, sinks: Optional[Tensor] = None,
    relbias: Optional[Tensor] = None, slopes: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, drelbias, dslopes) of tree attention for the upstream gradient ``grad_out`` (any strides);
    ``out``/``lse`` are the forward's, sinks merged in, so the impl's key gradients are those of the softmax
    with the sinks (the sinks' own gradient is :func:`sink_grad`, taken by the autograd formula). ``drelbias``:
    the relative bias's gradient from the impl, ``dslopes`` ([Hq], slopes' dtype) the trainable slopes' (empty
    tensors without them)."""
    a = TreeAttentionArgs(q, k, v, end, valid, segments, scale, window, position, softcap, alibi, sinks,
                          relbias, slopes).check()
    chosen = impl_for(impl, a, backward=True)
    grads = chosen.backward(a.without_sinks(), grad_out, out, lse)
    dq, dk, dv = grads[:3]
    _check_result(chosen.name, "dq", dq, q.shape, q.dtype)
    _check_result(chosen.name, "dk", dk, k.shape, k.dtype)
    _check_result(chosen.name, "dv", dv, v.shape, v.dtype)
    expected = 3 + (relbias is not None) + (slopes is not None)
    if len(grads) != expected:
        raise AttentionImplError(f"tree_attention impl {chosen.name!r} returned {len(grads)} gradients, expected "
                                 f"{expected} (dq, dk, dv{', drelbias' if relbias is not None else ''}"
                                 f"{', dslopes' if slopes is not None else ''})")
    extra = list(grads[3:])
    drel = q.new_empty(0) if relbias is None else extra.pop(0)
    dslopes = q.new_empty(0) if slopes is None else extra.pop(0)
    if relbias is not None:
        _check_result(chosen.name, "drelbias", drel, relbias.shape, relbias.dtype)
    if slopes is not None:
        _check_result(chosen.name, "dslopes", dslopes, slopes.shape, slopes.dtype)
    return dq, dk, dv, drel, dslopes


@_tree_attention_backward_op.register_fake
def _tree_attention_backward_fake(grad_out, q, k, v, out, lse, end, valid, segments, scale, impl, window=0,
                                  position=None, softcap=0.0, alibi=None, sinks=None, relbias=None, slopes=None):
    """Shapes only: dq like q, dk like k, dv like v (contiguous), drelbias like relbias, dslopes like slopes (empty
    without)."""
    TreeAttentionArgs(q, k, v, end, valid, segments, scale, window, position, softcap, alibi, sinks,
                      relbias, slopes).check()
    ATTENTION_IMPLS.check_name(impl)
    drel = q.new_empty(0) if relbias is None else relbias.new_empty(relbias.shape)
    dslopes = q.new_empty(0) if slopes is None else slopes.new_empty(slopes.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), drel, dslopes


def _forward_setup_context(ctx, inputs, output):
    """Save what backward needs; lse is an auxiliary output without gradient."""
    base, impl, features = inputs[:FORWARD_FEATURES_AT - 1], inputs[FORWARD_FEATURES_AT - 1], \
        inputs[FORWARD_FEATURES_AT:]
    TreeAttentionArgs(*base, *features).save_for_backward(ctx, *output)
    ctx.impl = impl
    ctx.mark_non_differentiable(output[1])


def feature_grads(ctx, a: TreeAttentionArgs, grads: dict, start: int, features=FEATURES) -> tuple:
    """The autograd formula's gradients of the feature arguments (from index ``start`` of the op's inputs), in
    their order: ``grads[name]()`` (a callable: computed only when needed) for a differentiable feature that is
    on and whose input needs a gradient, None for every other."""
    return tuple(grads[f.name]() if f.differentiable and f.is_on(getattr(a, f.name, None))
                 and ctx.needs_input_grad[start + i] else None for i, f in enumerate(features))


def _forward_backward(ctx, grad_out, grad_lse):
    """d(out)/d(q, k, v, relbias, slopes) via the tree_attention_backward op, d(out)/d(sinks) by
    :func:`sink_grad`; the tree arrays and constant ALiBi slopes get no gradient."""
    a, (out, lse) = TreeAttentionArgs.saved(ctx)
    dq, dk, dv, drel, dslopes = torch.ops.brcompile.tree_attention_backward(
        grad_out, a.q, a.k, a.v, out, lse, a.end, a.valid, a.segments, a.scale, ctx.impl, *a.features.values())
    grads = {"sinks": lambda: sink_grad(grad_out, out, lse, a.sinks), "relbias": lambda: drel,
             "slopes": lambda: dslopes}
    return dq, dk, dv, *(None,) * (FORWARD_FEATURES_AT - 3), *feature_grads(ctx, a, grads, FORWARD_FEATURES_AT)


torch.library.register_autograd(
    "brcompile::tree_attention_forward", _forward_backward, setup_context=_forward_setup_context
)

_LIB = torch.library.Library("brcompile", "FRAGMENT")
_LIB.define(
    "tree_attention(Tensor q, Tensor k, Tensor v, Tensor end, Tensor valid, Tensor segments, "
    "float scale, str impl) -> Tensor"
)


def _tree_attention_composite(q, k, v, end, valid, segments, scale, impl):
    """brcompile::tree_attention = tree_attention_forward(...)[0] (CompositeImplicitAutograd)."""
    return torch.ops.brcompile.tree_attention_forward(q, k, v, end, valid, segments, scale, impl)[0]


_LIB.impl("tree_attention", _tree_attention_composite, "CompositeImplicitAutograd")


# ---------------------------------------------------------------------------------------- autocast

#: Device types whose autocast gets SDPA's policy for the brcompile ops (those this torch supports).
AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu")
_AUTOCAST_LIB = torch.library.Library("brcompile", "FRAGMENT")
_AUTOCAST_REGISTERED: set = set()


def autocast_cast(x, device_type: str, dtype: torch.dtype):
    """Autocast's lower-precision cast (the policy of ``scaled_dot_product_attention``, ``linear``): a
    floating tensor on ``device_type`` that is not float64 becomes ``dtype``; anything else is unchanged."""
    if isinstance(x, Tensor) and x.is_floating_point() and x.device.type == device_type \
            and x.dtype != torch.float64:
        return x.to(dtype)
    return x


def register_lower_precision_autocast(qualname: str, keep: tuple[str, ...] = ()) -> None:
    """Give the op ``qualname`` SDPA's autocast rule on every autocast device type: inside an autocast
    region its floating inputs (not float64, on that device) are cast to the region's dtype
    (``torch.get_autocast_dtype``, read per call: ``autocast("cuda", dtype=torch.bfloat16)`` gets bfloat16),
    then the op runs with autocast off. ``torch.library.register_autocast`` fixes the dtype at
    registration, hence this equivalent. Integer/bool inputs (tree arrays, positions) are untouched, and so are
    the arguments named in ``keep`` (trainable ALiBi slopes: a bias ``m * distance`` over thousands of positions
    would carry the slope's bfloat16 rounding times the distance; the impls read them in their accumulation
    dtype)."""
    if qualname in _AUTOCAST_REGISTERED:
        return
    ns, name = qualname.split("::")
    op = getattr(getattr(torch.ops, ns), name).default
    names = [a.name for a in op._schema.arguments]
    for device_type in AUTOCAST_DEVICE_TYPES:
        try:
            if not torch._C._is_autocast_available(device_type):
                continue
            key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
            key = getattr(torch._C.DispatchKey, key_name)
        except (AttributeError, RuntimeError, ValueError):
            continue

        def kernel(_keyset, *args, _device_type=device_type, _key=key, **kwargs):
            dtype = torch.get_autocast_dtype(_device_type)
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_key)):
                return op(*(a if i < len(names) and names[i] in keep else autocast_cast(a, _device_type, dtype)
                            for i, a in enumerate(args)),
                          **{k: a if k in keep else autocast_cast(a, _device_type, dtype) for k, a in kwargs.items()})

        # disabled for Dynamo: the kernel runs from the dispatcher, also inside a compiled region that
        # runs a graph eagerly, where Dynamo would otherwise try to compile its frame (and break on the guard)
        _AUTOCAST_LIB.impl(name, torch._dynamo.disable(kernel), key_name, with_keyset=True)
    _AUTOCAST_REGISTERED.add(qualname)


# tree_attention (CompositeImplicitAutograd) reaches tree_attention_forward, which holds the rule; the
# backward op gets none: autograd hands it the forward's (already cast) q, k, v and a grad_out of out's
# dtype, and its float32 lse must stay float32.
register_lower_precision_autocast("brcompile::tree_attention_forward", keep=("slopes",))


# ------------------------------------------------------------------------------------------- flops


def has_data(t: Tensor) -> bool:
    """Whether t's values can be read (not a meta / fake tensor)."""
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type != "meta" and not is_fake(t)


def count_visible_pairs(end: Tensor, valid: Tensor, window: int = 0, position: Optional[Tensor] = None) -> int:
    """Number of visible (query, key) pairs: sum over valid keys k of (end[k] - k); with a window, of the
    descendants q of k with position[q] - position[k] < window (counted in blocks of keys).

    On tensors without data (fake/meta, e.g. during tracing) returns the dense causal bound N(N+1)/2.
    """
    n = end.shape[0]
    if not (has_data(end) and has_data(valid)) or (window and not has_data(position)):
        log.debug("tree_attention flops: tree arrays have no data; counting the causal bound over N=%s", n)
        return n * (n + 1) // 2
    idx = torch.arange(n, device=end.device, dtype=end.dtype)
    if not window:
        span = end - idx
        return int(span.masked_fill(~valid, 0).sum().item())
    total = 0
    for k0 in range(0, n, 256):  # [keys, N] blocks: q in [k, end[k]) and pos[q] - pos[k] < window
        k1 = min(k0 + 256, n)
        keys = idx[k0:k1, None]
        seen = (idx[None, :] >= keys) & (idx[None, :] < end[k0:k1, None]) \
            & (position[None, :] - position[k0:k1, None] < window) & valid[k0:k1, None]
        total += int(seen.sum().item())
    return total


@register_flop_formula(torch.ops.brcompile.tree_attention_forward, get_raw=True)
def _tree_attention_forward_flop(q, k, v, end, valid, segments, scale, impl, window=0, position=None, softcap=0.0,
                                 alibi=None, sinks=None, relbias=None, slopes=None, *args, out_val=None,
                                 **kwargs) -> int:
    """Forward: 2 matmuls (q.k and p.v) per visible pair and query head: 2*D + 2*Dv flops."""
    hq, _, d = q.shape
    dv = v.shape[-1]
    return count_visible_pairs(end, valid, window, position) * hq * (2 * d + 2 * dv)


@register_flop_formula(torch.ops.brcompile.tree_attention_backward, get_raw=True)
def _tree_attention_backward_flop(
    grad_out, q, k, v, out, lse, end, valid, segments, scale, impl, window=0, position=None, softcap=0.0, alibi=None,
    sinks=None, relbias=None, slopes=None, *args,
    out_val=None, **kwargs
) -> int:
    """Backward, as SDPA's formula: recompute q.k, then dv, dp, dq, dk; 6*D + 4*Dv per pair and head
    (2.5x the forward when Dv == D)."""
    hq, _, d = q.shape
    dv = v.shape[-1]
    return count_visible_pairs(end, valid, window, position) * hq * (6 * d + 4 * dv)


# ----------------------------------------------------------------------------------------- wrapper

TreeLike = Union[Sequence[Tensor], object]


def _tree_arrays(tree: TreeLike) -> tuple[Tensor, Tensor, Tensor]:
    """(end, valid, segments) of a PackedTree (duck-typed) or of an (end, valid, segments) tuple."""
    if isinstance(tree, (tuple, list)):
        if len(tree) != 3:
            raise TreeAttentionError(f"tree tuple must be (end, valid, segments), got {len(tree)} items")
        return tree[0], tree[1], tree[2]
    try:
        return tree.end, tree.valid, tree.segments
    except AttributeError as e:
        raise TreeAttentionError(
            f"tree must be a PackedTree or an (end, valid, segments) tuple, got {type(tree).__name__}"
        ) from e


def tree_attention(
    q: Tensor, k: Tensor, v: Tensor, tree: TreeLike, scale: Optional[float] = None, impl: str = "auto",
    window: int = 0, position: Optional[Tensor] = None, softcap: float = 0.0, alibi: Optional[Sequence[float]] = None,
    sinks: Optional[Tensor] = None, relbias: Optional[Tensor] = None, slopes: Optional[Tensor] = None,
) -> Tensor:
    """Tree attention over packed tokens: out [Hq, N, D] for q [Hq, N, D], k/v [Hkv, N, D].

    ``tree``: a PackedTree or an (end, valid, segments) tuple. ``scale`` defaults to D**-0.5.
    ``impl``: "auto" (triton on CUDA when available, else cpu), "cpu", "reference", "triton", "flex" or any
    registered name. ``window`` > 0: a sliding window over ``position`` (default: the tree's positions when
    ``tree`` is a PackedTree). ``softcap`` > 0: scores ``softcap * tanh(s / softcap)``. ``alibi``: Hq slopes m,
    scores ``+ m[h] * (position[k] - position[q])`` (positions as for a window); ``slopes``: the same m as a
    differentiable [Hq] tensor (trainable ALiBi; not with ``alibi``).
    ``sinks``: sink logits, [Hq] (one per head) or [Hq, N] (one per head and query token). ``relbias``: a
    per-query-token table R [Hq, N, E], scores ``+ R[h, q, min(position[q] - position[k], E - 1)]`` (positions
    as for a window). Differentiable in q, k, v, the sinks, the relative bias and the slopes.
    """
    end, valid, segments = _tree_arrays(tree)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    features = dict(window=window, position=position, softcap=softcap, alibi=alibi, sinks=sinks, relbias=relbias,
                    slopes=slopes)
    if needs_position(features) and position is None:
        features["position"] = getattr(tree, "position", None)
    if any(f.is_on(features[f.name]) for f in FEATURES if f.name != "position"):
        features.update(softcap=float(softcap), alibi=None if alibi is None else [float(m) for m in alibi])
        return torch.ops.brcompile.tree_attention_forward(q, k, v, end, valid, segments, float(scale), impl,
                                                          *(features[f.name] for f in FEATURES))[0]
    return torch.ops.brcompile.tree_attention(q, k, v, end, valid, segments, float(scale), impl)
