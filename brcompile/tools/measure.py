"""Measuring one forward+backward: FLOPs (split into attention and the rest), bytes saved for backward, time.

Used by :mod:`brcompile.tools.explain` (its predicted cost, docs/ARCHITECTURE.md §9) and by the benchmark
scripts of a checkout. Conventions:

* FLOPs are what torch's flop counter counts (``torch.utils.flop_counter``): matmul-like ops and attention,
  not pointwise ops. Torch has no formula for the CPU attention kernels
  (``aten._scaled_dot_product_flash_attention_for_cpu[_backward]``), so :data:`CPU_ATTENTION_FLOPS` maps
  them to torch's own SDPA formulas: dense attention is counted over the full s_q x s_k score matrix, as
  torch does on GPU (causal or masked pairs are not discounted). ``brcompile::tree_attention`` counts exactly
  the visible (query, key) pairs of the tree (its registered formula): 4D forward + 10D backward per pair
  and query head (D the head width).
* Bytes saved for backward: the distinct storages packed by ``saved_tensors_hooks`` during the forward,
  each counted once, storages of the inputs that require grad (the parameters) excluded.
* The limit of a batch: the FLOPs of computing each distinct tree node once,

      limit = (F_dense - A_dense) * N / (B * L) + A_tree

  with F_dense/A_dense all/attention FLOPs of the dense forward+backward, N the tree's nodes (executed
  tokens), B * L the logical positions and A_tree the tree attention's FLOPs (every visible pair once).
  Everything but attention costs the same per position, so over N tokens it costs N / (B L) as much.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


def _sdpa_cpu_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of ``aten._scaled_dot_product_flash_attention_for_cpu``: torch's SDPA forward formula over the
    full s_q x s_k score matrix (``sdpa_flop_count``: 4 D per score and head)."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                            **kwargs) -> int:
    """FLOPs of ``aten._scaled_dot_product_flash_attention_for_cpu_backward``: torch's SDPA backward formula
    over the full score matrix (``sdpa_backward_flop_count``: 10 D per score and head)."""
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


#: FlopCounterMode ``custom_mapping`` for the CPU SDPA kernels (torch counts them as 0). The values take op
#: shapes, as FlopCounterMode's custom mappings do (wrap them with ``flop_counter.shape_wrapper`` to call
#: them on the op's arguments).
CPU_ATTENTION_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward_flop,
}


def is_attention_op(op) -> bool:
    """Whether ``op`` counts as attention: SDPA kernels (any backend), flex attention and brcompile's tree
    attention (cached or not), forward or backward — by the op's name."""
    name = str(op)
    return "scaled_dot_product" in name or "tree_attention" in name or "flex_attention" in name


@dataclasses.dataclass(frozen=True)
class Cost:
    """What :func:`measure_fwd_bwd` counted over one forward (+ backward when ``backward``): all FLOPs, the
    attention part of them (:func:`is_attention_op`), and the bytes autograd saved for backward."""

    flops: int
    attention_flops: int
    saved_bytes: int
    backward: bool

    @property
    def other_flops(self) -> int:
        """Non-attention FLOPs (projections, MLP, LM head)."""
        return self.flops - self.attention_flops


def _storage_key(t: torch.Tensor) -> Optional[tuple[int, int]]:
    """(data_ptr, nbytes) of a tensor's storage, or None for tensors without one (subclasses, fakes)."""
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def storage_ptrs(tensors) -> set[int]:
    """The data_ptrs of the storages of ``tensors`` (those that have one): what :class:`SavedBytes` excludes."""
    return {k[0] for k in map(_storage_key, tensors) if k is not None}


class SavedBytes:
    """A ``saved_tensors_hooks`` context that counts the bytes autograd saves for backward: the sum over the
    distinct storages packed inside it (each once), skipping those whose data_ptr is in ``exclude`` (the
    parameters) and tensors without a storage. ``.total`` after exit."""

    def __init__(self, exclude: set[int] = frozenset()):
        self.exclude = set(exclude)
        self.seen: dict[int, int] = {}

        @torch._dynamo.disable  # hooks fire inside compiled regions too; never trace them into a graph
        def pack(t):
            key = _storage_key(t)
            if key is not None and key[0] not in self.exclude:
                self.seen[key[0]] = key[1]
            return t

        @torch._dynamo.disable
        def unpack(t):
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    @property
    def total(self) -> int:
        """Bytes of the distinct storages saved so far."""
        return sum(self.seen.values())

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


def split_flops(counter: FlopCounterMode) -> tuple[int, int]:
    """(total, attention) FLOPs counted by a finished FlopCounterMode; attention is the ops for which
    :func:`is_attention_op` holds."""
    per_op = counter.get_flop_counts().get("Global", {})
    attention = sum(n for op, n in per_op.items() if is_attention_op(op))
    return int(counter.get_total_flops()), int(attention)


def _backward_to(outs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
    """Backward of ``outs`` (gradient of ones) down to ``inputs`` only, leaving every ``.grad`` as it was.

    ``torch.autograd.backward(..., inputs=...)`` rather than ``autograd.grad``: FlopCounterMode's module
    tracker puts multi-grad hooks on module inputs, which ``autograd.grad`` does not support on leaves.
    The inputs' ``.grad`` are set aside (so nothing accumulates into them) and put back after.
    """
    saved = [t.grad for t in inputs]
    for t in inputs:
        t.grad = None
    try:
        torch.autograd.backward(outs, grad_tensors=[torch.ones_like(o) for o in outs], inputs=inputs)
    finally:
        for t, g in zip(inputs, saved):
            t.grad = g


def measure_fwd_bwd(fn: Callable, args: Sequence[Any]) -> Cost:
    """Counts one eager forward+backward of ``fn(*args)``: runs it and, when an output requires grad, the
    backward of every such output (gradient of ones) down to every input that requires grad
    (:func:`_backward_to`: every ``.grad`` is left as it was); a non-leaf input is detached first, so the
    user's autograd graph upstream of ``args`` is neither run nor freed.

    Returns the FLOPs of both (FlopCounterMode with :data:`CPU_ATTENTION_FLOPS`; under FlopCounterMode Dynamo
    skips compiled code, so ``fn`` should be an eager graph) and the bytes saved for backward during the
    forward (:class:`SavedBytes`), storages of the inputs that require grad excluded.
    """
    # an input computed by the user's graph (a hidden state from the previous block) is cut off it: the
    # backward measured stops there and never runs (or frees) the user's own graph
    args = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.requires_grad and not a.is_leaf
            else a for a in args]
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
        with SavedBytes(storage_ptrs(inputs)) as saved:
            out = fn(*args)
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
        backward = bool(outs and inputs)
        if backward:
            _backward_to(outs, inputs)
    total, attention = split_flops(counter)
    return Cost(total, attention, saved.total, backward)


def limit_flops(dense: Cost, logical_tokens: int, executed_tokens: int, tree_attention_flops: int) -> int:
    """The limit of a batch (module docstring): ``(F_dense - A_dense) * N / (B L) + A_tree``, the FLOPs of
    computing each distinct tree node once; ``logical_tokens`` is B L, ``executed_tokens`` N."""
    if logical_tokens <= 0:
        raise ValueError(f"logical_tokens={logical_tokens} must be > 0")
    return int(round(dense.other_flops * executed_tokens / logical_tokens)) + int(tree_attention_flops)


def sync(device: torch.device) -> None:
    """Waits for the device's queued work (CUDA), so that wall-clock times include it; no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
