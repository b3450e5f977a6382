"""The "cpu" impl's compiled kernel (backends/common/cpu/tree_attention.cpp): tree attention in one pass over the tree.

The segment-pair schedule (``cpu.py``) runs tree attention as many calls of torch's CPU flash kernel, two per
segment, merged by logsumexp. On a ragged RL batch that is dozens of small calls per layer: each computes its
whole causal square (the flash kernel skips no key block below 512 keys), runs its own parallel region, and pays
Python's cost for its slicing and merge. The kernel computes exactly the visible pairs in one call:

- **forward**: per kv head and query block of one segment (the group's query heads stacked), an online softmax
  over the block's key ranges: its strict ancestors' segments whole, its own segment causally;
- **backward**: flash-attention-2's schedule per kv head and key block of one segment: the block is seen by the
  rest of its segment (causally) and by every query of its descendants, one contiguous range; dq is summed by
  the blocks in per-worker buffers added in a fixed order, so the result does not depend on thread timing.

It takes float32 and float64 CPU tensors and no attention feature (window, soft-cap, ALiBi, relative bias):
:func:`runs` says whether a call can use it; the ``"cpu"`` impl runs the segment-pair schedule otherwise, and
when the compiled kernels are off or could not be built (backends/common/cpu: ``BRCOMPILE_CPU_KERNELS``).

**Cached** (a streamed chunk against a cached prefix, ``cached.py``): :func:`cached_forward` /
:func:`cached_backward` run the chunk's tree and its cross rows against the cache in the same call: the cache's
ranges are more key ranges of a query block's online softmax, and the cache's key blocks more units of the
backward (seen by the query ranges of the cross rows holding them), so (out, lse) come merged over both parts and
the backward gives (dq, dk, dv, dk_cache, dv_cache) from the merged out and lse. :func:`runs_cached` says when.
"""
from __future__ import annotations

import torch
from torch import Tensor

from brcompile.backends.common import cpu as kernels

__all__ = ["DTYPES", "backward", "cached_backward", "cached_forward", "forward", "runs", "runs_cached"]

#: dtypes the kernel takes (half precision runs the segment-pair schedule, whose flash kernel takes it).
DTYPES = (torch.float32, torch.float64)


def runs(a) -> bool:
    """Whether the kernel computes the attention of ``a`` (a TreeAttentionArgs without sinks): CPU tensors of
    float32 or float64, no attention feature on, and the compiled kernels available (built on first use)."""
    if a.q.device.type != "cpu" or a.q.dtype not in DTYPES:
        return False
    if a.window or a.softcap or a.has_alibi or a.relbias is not None:
        return False
    return kernels.available()


def forward(a) -> tuple[Tensor, Tensor]:
    """(out [Hq, N, D], lse [Hq, N]) of ``a`` (:func:`runs` holds)."""
    kernels.require()
    with _typed_errors():
        return torch.ops.brcompile_cpu.tree_attention_forward(a.q, a.k, a.v, a.end, a.valid, a.segments,
                                                              float(a.scale))


def backward(a, grad_out: Tensor, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of ``a`` for ``grad_out``, with the forward's ``out`` and ``lse`` (:func:`runs` holds)."""
    kernels.require()
    with _typed_errors():
        return torch.ops.brcompile_cpu.tree_attention_backward(grad_out, a.q, a.k, a.v, out, lse, a.end, a.valid,
                                                                a.segments, float(a.scale))


def runs_cached(a, cache) -> bool:
    """Whether the kernel computes the cached attention of ``a`` (a TreeAttentionArgs without sinks) against
    ``cache`` (cached.py's CachedPrefix): :func:`runs` holds and the cache is on the CPU in q's dtype."""
    return (cache.k_cache.device.type == "cpu" and cache.k_cache.dtype == a.q.dtype
            and cache.v_cache.dtype == a.q.dtype and runs(a))


def cached_forward(a, cache) -> tuple[Tensor, Tensor]:
    """(out [Hq, n, D], lse [Hq, n]) of the chunk ``a`` over its tree and ``cache`` (:func:`runs_cached` holds)."""
    kernels.require()
    with _typed_errors():
        return torch.ops.brcompile_cpu.tree_attention_cached_forward(
            a.q, a.k, a.v, a.end, a.valid, a.segments, cache.k_cache, cache.v_cache, cache.cache_valid.cpu(),
            cache.cross.cpu(), float(a.scale))


def cached_backward(a, cache, grad_out: Tensor, out: Tensor, lse: Tensor) -> tuple[Tensor, ...]:
    """(dq, dk, dv, dk_cache, dv_cache) of the chunk ``a`` and ``cache`` for ``grad_out``, with the merged ``out``
    and ``lse`` (:func:`runs_cached` holds)."""
    kernels.require()
    with _typed_errors():
        return torch.ops.brcompile_cpu.tree_attention_cached_backward(
            grad_out, a.q, a.k, a.v, out, lse, a.end, a.valid, a.segments, cache.k_cache, cache.v_cache,
            cache.cache_valid.cpu(), cache.cross.cpu(), float(a.scale))


class _typed_errors:
    """The kernel's argument checks (``TORCH_CHECK``: a RuntimeError "tree attention kernel: ...") re-raised as
    the op's TreeAttentionError, as the schedule raises them."""

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is not None and issubclass(kind, RuntimeError) and "tree attention kernel: " in str(exc):
            from brcompile.backends.attention.args import TreeAttentionError

            line = next(x for x in str(exc).splitlines() if "tree attention kernel: " in x)
            raise TreeAttentionError("tree_attention: " + line.split("tree attention kernel: ", 1)[1]) from None
        return False
