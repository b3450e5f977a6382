"""Reductions and normalisations along given dims: sums, means, extrema, norms, softmax, layer / RMS norms.

Along a dim that is no token dim each keeps the token dims (rules: passes/analysis/rules/reduce.py); a dense
result keeps the token dims not reduced (``Liveness.REDUCES``) or, for softmax-like ops along one dim, all of
them unless that dim is one (``Liveness.ALONG_DIM``). Routed pairs: along the feature dims only (pair rules
``along_dims``, ``norm``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from brcompile.passes.ops.registry import Liveness, register_op
from brcompile.passes.ops.respell import bound, fn, torch_fns

aten = torch.ops.aten


def _reduction(target):
    """``aten.sum.dim_IntList(x, dims, keepdim, dtype=)`` → ``torch.sum(x, dims, keepdim, dtype=)``."""
    def respell(node, args, kwargs):
        kw = {"dtype": kwargs["dtype"]} if kwargs.get("dtype") is not None else {}
        return "call_function", target, args, kw
    return respell


_REDUCE = dict(axes="reduction", liveness=Liveness.REDUCES)

register_op("sum", named=True, spellings=(*torch_fns("sum"), "sum"), aten=(aten.sum,), respell=_reduction(torch.sum),
            pair="along_dims", **_REDUCE)
register_op("mean", spellings=(torch.mean, "mean"), aten=(aten.mean,), respell=_reduction(torch.mean),
            pair="along_dims", **_REDUCE)
for _name in ("amax", "amin"):
    register_op(_name, spellings=(getattr(torch, _name), _name), aten=(getattr(aten, _name),),
                respell=fn(getattr(torch, _name)), pair="along_dims", **_REDUCE)
for _name in ("norm", "var", "std"):
    register_op(_name, spellings=(getattr(torch, _name), _name), pair="along_dims", **_REDUCE)
register_op("prod", spellings=(torch.prod, "prod"), aten=(aten.prod,), respell=_reduction(torch.prod), **_REDUCE)
register_op("logsumexp", spellings=(torch.logsumexp, "logsumexp"), aten=(aten.logsumexp,),
            respell=fn(torch.logsumexp), **_REDUCE)
for _name in ("all", "any"):
    register_op(_name, spellings=(getattr(torch, _name), _name), **_REDUCE)


@register_op("vector_norm", spellings=(torch.linalg.vector_norm,), aten=(aten.linalg_vector_norm,), **_REDUCE)
def _vector_norm(node, args, kwargs):
    """``aten.linalg_vector_norm(x, ord, dim, keepdim, dtype=)`` → ``torch.linalg.vector_norm`` (the same)."""
    b = bound(node, args, kwargs)
    kw = {"dtype": b["dtype"]} if b.get("dtype") is not None else {}
    return "call_function", torch.linalg.vector_norm, (b["self"], b["ord"], b["dim"], b["keepdim"]), kw


# ``max`` / ``min``: elementwise of two tensors, or along a dim (a (values, indices) pair)
for _name in ("max", "min"):
    register_op(_name, spellings=(getattr(torch, _name), _name), aten=(getattr(aten, _name),),
                respell=fn(getattr(torch, _name)), axes="max_min", liveness=Liveness.POSITIONWISE)


def _softmax(target):
    """``aten._softmax``-like ``aten.softmax(x, dim, dtype)`` → ``F.softmax(x, dim, dtype=)``."""
    def respell(node, args, kwargs):
        x, dim = args[:2]
        dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
        return "call_function", target, (x, dim), ({"dtype": dtype} if dtype is not None else {})
    return respell


register_op("softmax", named=True, spellings=(F.softmax, *torch_fns("softmax", "special.softmax"), "softmax"),
            aten=(aten.softmax,), respell=_softmax(F.softmax), axes="softmax", liveness=Liveness.ALONG_DIM,
            pair="along_dims")
register_op("log_softmax", named=True,
            spellings=(F.log_softmax, *torch_fns("log_softmax", "special.log_softmax"), "log_softmax"),
            aten=(aten.log_softmax,), respell=_softmax(F.log_softmax), axes="softmax", liveness=Liveness.ALONG_DIM,
            pair="along_dims")


@register_op("layer_norm", named=True, spellings=(F.layer_norm, *torch_fns("layer_norm"), "layer_norm"),
             aten=(aten.layer_norm,), axes="layer_norm", pair="norm")
def _layer_norm(node, args, kwargs):
    """``aten.layer_norm(x, shape, w, b, eps, cudnn_enable)`` → ``F.layer_norm(x, shape, w, b, eps)``."""
    a = bound(node, args, kwargs)
    return "call_function", F.layer_norm, (a["input"], a["normalized_shape"], a["weight"], a["bias"], a["eps"]), {}


register_op("rms_norm", named=True,
            spellings=(*({getattr(F, "rms_norm", None)} - {None}), *torch_fns("rms_norm"), "rms_norm"),
            aten=(aten.rms_norm,), respell=fn(torch.rms_norm), axes="layer_norm", pair="norm")
register_op("group_norm", spellings=(F.group_norm,), axes="layer_norm")
