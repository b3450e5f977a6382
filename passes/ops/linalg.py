"""Contractions: linear layers, matrix products, ``einsum``, and ``embedding`` lookups.

With a constant (weight) operand a contraction over feature dims keeps the token dims (rules:
passes/analysis/rules/linalg.py); routed pairs' rows are contracted with weights only (pair rules ``linear``,
``matmul``).
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from brcompile.passes.ops.registry import register_op
from brcompile.passes.ops.respell import bound, fn, torch_fns

aten = torch.ops.aten
_nn = torch._C._nn

register_op("linear", named=True, spellings=(F.linear, _nn.linear), aten=(aten.linear,), respell=fn(F.linear),
            axes="linear", pair="linear")
register_op("matmul", named=True, spellings=(operator.matmul, *torch_fns("matmul"), "matmul", "__matmul__"),
            aten=(aten.matmul,), respell=fn(torch.matmul), axes="matmul", pair="matmul")
register_op("bmm", named=True, spellings=(*torch_fns("bmm"), "bmm"), aten=(aten.bmm,), respell=fn(torch.bmm),
            axes="matmul")
register_op("mm", named=True, spellings=(*torch_fns("mm"), "mm"), aten=(aten.mm,), respell=fn(torch.mm), axes="matmul")
register_op("addmm", named=True, spellings=(*torch_fns("addmm"), "addmm"), aten=(aten.addmm,),
            respell=fn(torch.addmm, keep=("beta", "alpha")), axes="addmm")
register_op("baddbmm", named=True, spellings=(*torch_fns("baddbmm"), "baddbmm"), aten=(aten.baddbmm,),
            respell=fn(torch.baddbmm, keep=("beta", "alpha")), axes="addmm")


@register_op("einsum", named=True, spellings=(*torch_fns("einsum"),), aten=(aten.einsum,), axes="einsum")
def _einsum(node, args, kwargs):
    """``aten.einsum(eq, [a, b, …])`` → ``torch.einsum(eq, a, b, …)``."""
    eq, ops = args[:2]
    return "call_function", torch.einsum, (eq, *ops), {}


@register_op("embedding", spellings=(F.embedding, torch.embedding), aten=(aten.embedding,), axes="embedding")
def _embedding(node, args, kwargs):
    """``aten.embedding(W, ids, padding_idx, scale_grad_by_freq, sparse)`` → ``F.embedding(ids, W, ...)``: the
    arguments that change the gradient (padding row, frequency scaling, sparse) are kept."""
    b = bound(node, args, kwargs)
    weight, ids, pad = b["weight"], b["indices"], b["padding_idx"]
    kw = {"padding_idx": pad} if pad not in (-1, None) else {}
    kw.update({k: True for k in ("scale_grad_by_freq", "sparse") if b[k]})
    return "call_function", F.embedding, (ids, weight), kw
