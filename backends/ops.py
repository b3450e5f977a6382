"""torch.library custom ops for the packed graph: ``brcompile::tree_attention``.

Three ops, mirroring how ``scaled_dot_product_attention`` is built from ``_scaled_dot_product_*``:

``brcompile::tree_attention(q, k, v, end, valid, segments, float scale, str impl) -> Tensor``
    What the graph rewrite emits. CompositeImplicitAutograd: it is ``tree_attention_forward(...)[0]``,
    so AOTAutograd traces through it to the two ops below.
``brcompile::tree_attention_forward(...) -> (Tensor out, Tensor lse)``
    Opaque custom op with a fake impl, a flop formula and an autograd formula. ``lse`` (natural-log
    logsumexp of the scaled scores of each query row, ``-inf`` for a query that sees no key) is saved
    for backward and is not differentiable (as for SDPA's logsumexp).
``brcompile::tree_attention_backward(grad_out, q, k, v, out, lse, end, valid, segments, scale, impl)
  -> (Tensor dq, Tensor dk, Tensor dv)``
    Opaque custom op with a fake impl and a flop formula, so AOTAutograd can trace the backward.

Shapes (N packed tokens in DFS preorder, see brcompile.runtime.tree.PackedTree)::

    q [Hq, N, D]   k [Hkv, N, D]   v [Hkv, N, D]   Hq % Hkv == 0; query head h uses kv head h // (Hq // Hkv)
    end [N] int64, valid [N] bool, segments [S, 3] int64 rows (start, stop, subtree_end)
    out [Hq, N, D] (q.dtype)   lse [Hq, N] (float32 for float16/bfloat16 inputs, else q.dtype)

Mask: query q sees key k  <=>  k <= q < end[k] and valid[k] (and, with ``window`` W > 0, also
position[q] - position[k] < W: HF's sliding window, over the tree positions = the batch columns). A query
that sees no key outputs 0 and gets zero gradient. ``out[:, q] = sum_k softmax_k(scale * q.k) v[:, k]`` over the visible keys.

Implementations are looked up by name in a registry (``register_attention_impl``); ``"reference"``,
``"cpu"`` and ``"triton"`` are imported lazily on first use and register themselves.
"""
from __future__ import annotations

import importlib
import logging
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

log = logging.getLogger(__name__)

__all__ = [
    "AttentionImpl",
    "AttentionImplError",
    "TreeAttentionError",
    "attention_extras",
    "check_impl_supports",
    "count_visible_pairs",
    "get_attention_impl",
    "lse_dtype_for",
    "register_attention_impl",
    "registered_attention_impls",
    "tree_attention",
]


class TreeAttentionError(ValueError):
    """Inputs of tree_attention that do not satisfy the op's contract (shapes, dtypes, tree arrays)."""


class AttentionImplError(RuntimeError):
    """An attention implementation that is unknown, or unavailable for the device of the inputs."""


@dataclass(frozen=True)
class AttentionImpl:
    """One way to execute tree attention.

    forward(q, k, v, end, valid, segments, scale) -> (out, lse)
    backward(grad_out, q, k, v, out, lse, end, valid, segments, scale) -> (dq, dk, dv)

    With ``supports_window``, both also take ``window=W, position=pos`` (keyword; only passed when W > 0):
    query q then sees key k only if also ``pos[q] - pos[k] < W`` (a sliding window over tree positions).
    With ``supports_softcap``, both also take ``softcap=c`` (keyword; only passed when c > 0): the scores
    are ``c * tanh(scale * q.k / c)`` (Gemma2's logit soft-capping) before the softmax.

    ``out``/``lse`` passed to backward are the ones forward returned (merged over the whole tree).
    ``device_types``: the ``torch.device.type`` values the impl runs on; ``None`` means any.
    """

    name: str
    forward: Callable
    backward: Callable
    device_types: Optional[frozenset] = None
    supports_window: bool = False
    supports_softcap: bool = False

    def __post_init__(self):
        if not self.name or self.name == "auto":
            raise AttentionImplError(f"invalid attention impl name {self.name!r}")
        if not callable(self.forward) or not callable(self.backward):
            raise AttentionImplError(f"attention impl {self.name!r}: forward and backward must be callable")


_IMPLS: dict[str, AttentionImpl] = {}

# Built-in impls: imported on first use; each module calls register_attention_impl at import.
_LAZY_MODULES = {
    "reference": "brcompile.backends.reference",
    "cpu": "brcompile.backends.cpu",
    "triton": "brcompile.backends.triton",
}


def register_attention_impl(impl: AttentionImpl) -> None:
    """Register (or replace) an attention implementation under ``impl.name``."""
    if not isinstance(impl, AttentionImpl):
        raise AttentionImplError(f"register_attention_impl expects an AttentionImpl, got {type(impl).__name__}")
    if impl.name in _IMPLS and _IMPLS[impl.name] is not impl:
        log.info("tree_attention: replacing attention impl %r", impl.name)
    _IMPLS[impl.name] = impl


def registered_attention_impls() -> tuple[str, ...]:
    """Names usable as ``impl`` (registered or importable on demand), without ``"auto"``."""
    return tuple(sorted(set(_IMPLS) | set(_LAZY_MODULES)))


_TRITON_IMPORTABLE: Optional[bool] = None


def _triton_importable() -> bool:
    """Whether ``import triton`` succeeds (cached)."""
    global _TRITON_IMPORTABLE
    if _TRITON_IMPORTABLE is None:
        try:
            importlib.import_module("triton")
            _TRITON_IMPORTABLE = True
        except ImportError:
            _TRITON_IMPORTABLE = False
    return _TRITON_IMPORTABLE


def _resolve_name(name: str, device: torch.device) -> str:
    """``"auto"`` -> ``"triton"`` on CUDA when triton imports, else ``"cpu"``; other names unchanged."""
    if name != "auto":
        return name
    if device.type == "cuda" and _triton_importable():
        return "triton"
    return "cpu"


def get_attention_impl(name: str, device) -> AttentionImpl:
    """The implementation ``name`` (``"auto"`` resolved for ``device``); raises AttentionImplError if it
    is unknown, cannot be imported, or does not run on ``device``."""
    device = torch.device(device)
    resolved = _resolve_name(name, device)
    if resolved not in _IMPLS and resolved in _LAZY_MODULES:
        module = _LAZY_MODULES[resolved]
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise AttentionImplError(
                f"tree_attention impl {resolved!r} is unavailable: importing {module} failed ({e})"
            ) from e
    impl = _IMPLS.get(resolved)
    if impl is None:
        if resolved in _LAZY_MODULES:
            raise AttentionImplError(
                f"tree_attention impl {resolved!r}: {_LAZY_MODULES[resolved]} imported but registered nothing"
            )
        raise AttentionImplError(
            f"unknown tree_attention impl {name!r}; known: {', '.join(registered_attention_impls())} or 'auto'"
        )
    if impl.device_types is not None and device.type not in impl.device_types:
        raise AttentionImplError(
            f"tree_attention impl {resolved!r} runs on {sorted(impl.device_types)}, not on device "
            f"{device.type!r}" + (" (requested 'auto'; is triton installed?)" if name == "auto" else "")
        )
    return impl


def lse_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """dtype of the logsumexp output: float32 for float16/bfloat16 inputs, else the input dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, end: Tensor, valid: Tensor, segments: Tensor) -> None:
    """Raise TreeAttentionError unless the inputs match the op's contract (works on fake tensors)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise TreeAttentionError(
            f"tree_attention expects q [Hq, N, D], k and v [Hkv, N, D]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise TreeAttentionError(f"tree_attention: k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    hq, n, d = q.shape
    hkv = k.shape[0]
    if k.shape[1] != n or k.shape[2] != d:
        raise TreeAttentionError(
            f"tree_attention: q {tuple(q.shape)} and k {tuple(k.shape)} disagree on N or D"
        )
    if hkv == 0 or hq % hkv != 0:
        raise TreeAttentionError(f"tree_attention: Hq={hq} must be a positive multiple of Hkv={hkv}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise TreeAttentionError(
            f"tree_attention: q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if end.dtype != torch.int64 or end.dim() != 1 or end.shape[0] != n:
        raise TreeAttentionError(f"tree_attention: end must be int64 [N={n}], got {end.dtype} {tuple(end.shape)}")
    if valid.dtype != torch.bool or valid.dim() != 1 or valid.shape[0] != n:
        raise TreeAttentionError(
            f"tree_attention: valid must be bool [N={n}], got {valid.dtype} {tuple(valid.shape)}"
        )
    if segments.dtype != torch.int64 or segments.dim() != 2 or segments.shape[1] != 3:
        raise TreeAttentionError(
            f"tree_attention: segments must be int64 [S, 3], got {segments.dtype} {tuple(segments.shape)}"
        )


def _check_window(window: int, position: Optional[Tensor], n) -> None:
    """A window needs the [N] int64 positions of the tokens."""
    if window < 0:
        raise TreeAttentionError(f"tree_attention: window={window} must be >= 0 (0: no window)")
    if window and (position is None or position.dtype != torch.int64 or position.dim() != 1
                   or position.shape[0] != n):
        raise TreeAttentionError(f"tree_attention: window={window} needs position int64 [N={n}], got "
                                 f"{None if position is None else (position.dtype, tuple(position.shape))}")


def _window_kwargs(impl: "AttentionImpl", window: int, position: Optional[Tensor], softcap: float = 0.0) -> dict:
    """The impl's extra arguments for a window and a soft-cap (none without them); refuses an impl that
    does not support what is asked (see :func:`check_impl_supports`)."""
    kw = {}
    if window:
        kw.update(window=window, position=position)
    if softcap:
        kw["softcap"] = softcap
    if kw:
        check_impl_supports(impl, window, softcap)
    return kw


def attention_extras(args: Sequence) -> tuple:
    """(window, position, softcap) of a ``tree_attention_forward`` call's arguments, defaults filled in."""
    return (tuple(args[8:]) + (0, None, 0.0))[:3]


def check_impl_supports(impl: "AttentionImpl", window: int = 0, softcap: float = 0.0) -> None:
    """Raise AttentionImplError when ``impl`` cannot run a sliding window / soft-capped attention."""
    if window and not impl.supports_window:
        raise AttentionImplError(f"tree_attention impl {impl.name!r} does not support a sliding window")
    if softcap and not impl.supports_softcap:
        raise AttentionImplError(f"tree_attention impl {impl.name!r} does not support logit soft-capping")


def _check_impl_name(impl: str) -> None:
    """Raise AttentionImplError for a name that is neither 'auto' nor known (usable at trace time)."""
    if impl != "auto" and impl not in _IMPLS and impl not in _LAZY_MODULES:
        raise AttentionImplError(
            f"unknown tree_attention impl {impl!r}; known: {', '.join(registered_attention_impls())} or 'auto'"
        )


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
    window: int = 0, position: Optional[Tensor] = None, softcap: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """(out [Hq, N, D], lse [Hq, N]) of tree attention, computed by the impl named ``impl``."""
    _check_inputs(q, k, v, end, valid, segments)
    _check_window(window, position, q.shape[1])
    chosen = get_attention_impl(impl, q.device)
    out, lse = chosen.forward(q, k, v, end, valid, segments, scale,
                              **_window_kwargs(chosen, window, position, softcap))
    _check_result(chosen.name, "out", out, q.shape, q.dtype)
    _check_result(chosen.name, "lse", lse, q.shape[:2], lse_dtype_for(q.dtype))
    return out, lse


@_tree_attention_forward_op.register_fake
def _tree_attention_forward_fake(q, k, v, end, valid, segments, scale, impl, window=0, position=None, softcap=0.0):
    """Shapes only: out like q (contiguous), lse [Hq, N]."""
    _check_inputs(q, k, v, end, valid, segments)
    _check_window(window, position, q.shape[1])
    _check_impl_name(impl)
    out = q.new_empty(q.shape)
    lse = q.new_empty(q.shape[:2], dtype=lse_dtype_for(q.dtype))
    return out, lse


@torch.library.custom_op("brcompile::tree_attention_backward", mutates_args=())
def _tree_attention_backward_op(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    end: Tensor,
    valid: Tensor,
    segments: Tensor,
    scale: float,
    impl: str,
    window: int = 0,
    position: Optional[Tensor] = None,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of tree attention for the upstream gradient ``grad_out`` (any strides)."""
    _check_inputs(q, k, v, end, valid, segments)
    _check_window(window, position, q.shape[1])
    chosen = get_attention_impl(impl, q.device)
    dq, dk, dv = chosen.backward(grad_out, q, k, v, out, lse, end, valid, segments, scale,
                                 **_window_kwargs(chosen, window, position, softcap))
    _check_result(chosen.name, "dq", dq, q.shape, q.dtype)
    _check_result(chosen.name, "dk", dk, k.shape, k.dtype)
    _check_result(chosen.name, "dv", dv, v.shape, v.dtype)
    return dq, dk, dv


@_tree_attention_backward_op.register_fake
def _tree_attention_backward_fake(grad_out, q, k, v, out, lse, end, valid, segments, scale, impl, window=0,
                                  position=None, softcap=0.0):
    """Shapes only: dq like q, dk like k, dv like v (contiguous)."""
    _check_inputs(q, k, v, end, valid, segments)
    _check_impl_name(impl)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _forward_setup_context(ctx, inputs, output):
    """Save what backward needs; lse is an auxiliary output without gradient."""
    q, k, v, end, valid, segments, scale, impl, window, position, softcap = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, end, valid, segments, position)
    ctx.scale = scale
    ctx.impl = impl
    ctx.window = window
    ctx.softcap = softcap
    ctx.mark_non_differentiable(lse)


def _forward_backward(ctx, grad_out, grad_lse):
    """d(out)/d(q, k, v) via the tree_attention_backward op; the tree arrays get no gradient."""
    q, k, v, out, lse, end, valid, segments, position = ctx.saved_tensors
    dq, dk, dv = torch.ops.brcompile.tree_attention_backward(
        grad_out, q, k, v, out, lse, end, valid, segments, ctx.scale, ctx.impl, ctx.window, position, ctx.softcap
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None


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


def register_lower_precision_autocast(qualname: str) -> None:
    """Give the op ``qualname`` SDPA's autocast rule on every autocast device type: inside an autocast
    region its floating inputs (not float64, on that device) are cast to the region's dtype
    (``torch.get_autocast_dtype``, read per call: ``autocast("cuda", dtype=torch.bfloat16)`` gets bfloat16),
    then the op runs with autocast off. ``torch.library.register_autocast`` fixes the dtype at
    registration, hence this equivalent. Integer/bool inputs (tree arrays, positions) are untouched."""
    if qualname in _AUTOCAST_REGISTERED:
        return
    ns, name = qualname.split("::")
    op = getattr(getattr(torch.ops, ns), name).default
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
                return op(*(autocast_cast(a, _device_type, dtype) for a in args),
                          **{k: autocast_cast(a, _device_type, dtype) for k, a in kwargs.items()})

        # disabled for Dynamo: the kernel runs from the dispatcher, also inside a compiled region that
        # runs a graph eagerly, where Dynamo would otherwise try to compile its frame (and break on the guard)
        _AUTOCAST_LIB.impl(name, torch._dynamo.disable(kernel), key_name, with_keyset=True)
    _AUTOCAST_REGISTERED.add(qualname)


# tree_attention (CompositeImplicitAutograd) reaches tree_attention_forward, which holds the rule; the
# backward op gets none: autograd hands it the forward's (already cast) q, k, v and a grad_out of out's
# dtype, and its float32 lse must stay float32.
register_lower_precision_autocast("brcompile::tree_attention_forward")


# ------------------------------------------------------------------------------------------- flops


def _has_data(t: Tensor) -> bool:
    """Whether t's values can be read (not a meta / fake tensor)."""
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type != "meta" and not is_fake(t)


def count_visible_pairs(end: Tensor, valid: Tensor, window: int = 0, position: Optional[Tensor] = None) -> int:
    """Number of visible (query, key) pairs: sum over valid keys k of (end[k] - k); with a window, of the
    descendants q of k with position[q] - position[k] < window (counted in blocks of keys).

    On tensors without data (fake/meta, e.g. during tracing) returns the dense causal bound N(N+1)/2.
    """
    n = end.shape[0]
    if not (_has_data(end) and _has_data(valid)) or (window and not _has_data(position)):
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
                                 *args, out_val=None, **kwargs) -> int:
    """Forward: 2 matmuls (q.k and p.v) per visible pair and query head: 2*D + 2*Dv flops."""
    hq, _, d = q.shape
    dv = v.shape[-1]
    return count_visible_pairs(end, valid, window, position) * hq * (2 * d + 2 * dv)


@register_flop_formula(torch.ops.brcompile.tree_attention_backward, get_raw=True)
def _tree_attention_backward_flop(
    grad_out, q, k, v, out, lse, end, valid, segments, scale, impl, window=0, position=None, softcap=0.0, *args,
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
    window: int = 0, position: Optional[Tensor] = None, softcap: float = 0.0,
) -> Tensor:
    """Tree attention over packed tokens: out [Hq, N, D] for q [Hq, N, D], k/v [Hkv, N, D].

    ``tree``: a PackedTree or an (end, valid, segments) tuple. ``scale`` defaults to D**-0.5.
    ``impl``: "auto" (triton on CUDA when available, else cpu), "cpu", "reference", "triton" or any
    registered name. ``window`` > 0: a sliding window over ``position`` (default: the tree's positions when
    ``tree`` is a PackedTree). ``softcap`` > 0: scores ``softcap * tanh(s / softcap)``. Differentiable in
    q, k, v.
    """
    end, valid, segments = _tree_arrays(tree)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if window and position is None:
        position = getattr(tree, "position", None)
    if window or softcap:
        return torch.ops.brcompile.tree_attention_forward(q, k, v, end, valid, segments, float(scale), impl, window,
                                                          position, float(softcap))[0]
    return torch.ops.brcompile.tree_attention(q, k, v, end, valid, segments, float(scale), impl)
