"""Attention and the losses read off the LM head: ``scaled_dot_product_attention``, ``cross_entropy``.

SDPA becomes tree attention (rule ``sdpa``, passes/analysis/rules/attention.py); ``cross_entropy`` of the LM head
becomes the fused ``packed_logprob`` read-out (rule ``cross_entropy``, passes/emit/fuse_logprob.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from brcompile.passes.ops.registry import register_op
from brcompile.passes.ops.respell import bound

aten = torch.ops.aten
_REDUCTION = {0: "none", 1: "mean", 2: "sum"}


@register_op("sdpa", named=True, spellings=(F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention),
             aten=(aten.scaled_dot_product_attention,), axes="sdpa")
def _sdpa(node, args, kwargs):
    """``aten.scaled_dot_product_attention`` → ``F.scaled_dot_product_attention`` (the same arguments)."""
    return "call_function", F.scaled_dot_product_attention, args, dict(kwargs)


@register_op("cross_entropy", spellings=(F.cross_entropy,), aten=(aten.cross_entropy_loss,), axes="cross_entropy")
def _cross_entropy(node, args, kwargs):
    """``aten.cross_entropy_loss(x, target, weight, reduction, ignore_index, label_smoothing)`` →
    ``F.cross_entropy(x, target, …)``, every argument other than its default kept."""
    b = bound(node, args, kwargs)
    x, target, weight, reduction = b["self"], b["target"], b["weight"], b["reduction"]
    ignore_index, smoothing = b["ignore_index"], b["label_smoothing"]
    kw = {"reduction": _REDUCTION[reduction]}
    if weight is not None:
        kw["weight"] = weight
    if ignore_index != -100:
        kw["ignore_index"] = ignore_index
    if smoothing:
        kw["label_smoothing"] = smoothing
    return "call_function", F.cross_entropy, (x, target), kw
