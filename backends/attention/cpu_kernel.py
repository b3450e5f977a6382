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
"""
from __future__ import annotations

import torch
from torch import Tensor

from brcompile.backends.common import cpu as kernels

__all__ = ["DTYPES", "backward", "forward", "runs"]

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
