"""The ATen lowering's own ops: identities, copies, casts and indexed writes, written back as the value or the
torch-level call they are (passes/lower/aten.py).

None has a Dynamo-level spelling of its own; what each becomes is read by the record of that op.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from brcompile.passes.meta import example_value
from brcompile.passes.ops.registry import register_op
from brcompile.passes.ops.respell import DROP, bound, identity, method

aten = torch.ops.aten

register_op("alias", aten=(aten.alias, aten.lift_fresh_copy), respell=identity)
register_op("type_as", aten=(aten.type_as,), respell=method("type_as"))


@register_op("assert_tensor_metadata", aten=(aten._assert_tensor_metadata,))
def _dropped(node, args, kwargs):
    """``_assert_tensor_metadata`` (a no-op ``.to(dtype)``): a check of dtype and device, which the trace fixed
    and the packed value shares."""
    return DROP


@register_op("copy", aten=(aten.copy,))
def _copy(node, args, kwargs):
    """Functional ``aten.copy(dst, src)``: src broadcast to dst's shape in dst's dtype — src itself when it has
    both already; otherwise it stays ``aten.copy`` (no rule: materialised)."""
    dst, src = args[:2]
    ev_d, ev_s = example_value(dst), example_value(src)
    if ev_d is not None and ev_s is not None and ev_d.shape == ev_s.shape and ev_d.dtype == ev_s.dtype:
        return src
    return None


@register_op("to", aten=(aten.to, aten._to_copy))
def _to(node, args, kwargs):
    """``aten.to`` (``.dtype``, ``.device``, ``.dtype_layout``) / ``aten._to_copy`` → ``x.to(dtype)``, or x itself
    without a dtype (the graph is functional: a copy is the value); a move to another device, or ``to.other``,
    stays ATen."""
    b = bound(node, args, kwargs)
    x, dtype, device = b.get("self"), b.get("dtype"), b.get("device")
    ev = example_value(x)
    if "other" in b or ev is None or (device is not None and torch.device(device) != ev.device):
        return None
    if dtype is None or dtype == ev.dtype:
        return x
    return "call_method", "to", (x, dtype), {}


@register_op("index_put", aten=(aten.index_put,))
def _index_put(node, args, kwargs):
    """Functional ``aten.index_put(inv, [p], arange(n))`` into ``inv = empty_like(p)``, p a permutation:
    ``argsort(p)``, the inverse permutation (MoE dispatch; passes/lower/functionalize.py's proof); ``x[mask] = v``
    (``index_put(x, [mask], v)``, a bool mask of x's shape, one value) is ``masked_fill(x, mask, v)``. Any other
    indexed write stays ATen (no rule: materialised)."""
    from brcompile.passes.lower.functionalize import writes_inverse_permutation

    b = bound(node, args, kwargs)
    indices, x, values = b["indices"], b["self"], b["values"]
    if b["accumulate"] or len(indices) != 1 or not isinstance(indices[0], fx.Node):
        return None
    if writes_inverse_permutation(x, indices[0], values):
        return "call_function", torch.argsort, (indices[0],), {}
    ev_x, ev_m, ev_v = example_value(x), example_value(indices[0]), example_value(values)
    if ev_x is not None and ev_m is not None and ev_m.dtype == torch.bool and ev_m.shape == ev_x.shape \
            and ev_v is not None and ev_v.dim() == 0:
        return "call_function", torch.masked_fill, (x, indices[0], values), {}
    return None

