"""Causal scans along the positions: ``cumsum``, depthwise causal ``conv1d`` and its left ``pad``, the affine
``linear_scan`` and the matrix ``matrix_scan`` (what passes/canonical/scans/ writes), torch's associative scan.

Each reads a token's ancestors-or-self only, so it runs on the tree's paths (rules: passes/analysis/rules/scan.py,
matrix_scan.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from brcompile.backends.scan import matrix as _matrix_ops
from brcompile.backends.scan import op as _scan_ops
from brcompile.passes.meta import example_value
from brcompile.passes.ops.registry import register_op
from brcompile.passes.ops.reduce import _reduction
from brcompile.passes.ops.respell import bound, torch_fns

aten = torch.ops.aten

register_op("cumsum", named=True, spellings=(*torch_fns("cumsum"), "cumsum"), aten=(aten.cumsum,),
            respell=_reduction(torch.cumsum), axes="cumsum")
register_op("cumprod", named=True, spellings=(*torch_fns("cumprod"), "cumprod"))


@register_op("conv1d", named=True, spellings=(F.conv1d,), aten=(aten.conv1d,), axes="conv1d")
def _conv1d(node, args, kwargs):
    """``aten.conv1d(x, w, b, stride, padding, dilation, groups)`` → ``F.conv1d`` (the same arguments)."""
    return "call_function", F.conv1d, args, {}


@register_op("pad", named=True, spellings=(F.pad, torch._C._nn.pad), aten=(aten.constant_pad_nd, aten.pad), axes="pad")
def _pad(node, args, kwargs):
    """``aten.constant_pad_nd(x, pad, v)`` / ``aten.pad(x, pad, mode, v)`` → ``F.pad``."""
    b = bound(node, args, kwargs)
    if node.target is aten.constant_pad_nd.default:
        x, pad, value = b["self"], b["pad"], b["value"]
        return "call_function", F.pad, (x, pad), ({"value": value} if value != 0 else {})
    x, pad, mode, value = b["self"], b["pad"], b["mode"], b.get("value")
    kw = {"mode": mode} if mode != "constant" else {}
    if value not in (None, 0):
        kw["value"] = value
    return "call_function", F.pad, (x, pad), kw


register_op("linear_scan", spellings=(_scan_ops.linear_scan,), axes="linear_scan")
register_op("matrix_scan", spellings=(_matrix_ops.matrix_scan,), axes="matrix_scan")
_HOP = getattr(getattr(torch.ops, "higher_order", None), "associative_scan", None)
if _HOP is not None:
    register_op("associative_scan", spellings=(_HOP,), axes="_hop_scan")


@register_op("tree_linear_scan", aten=(torch.ops.brcompile.tree_linear_scan,))
def _chain_scan(node, args, kwargs):
    """``brcompile::tree_linear_scan(a, b, arange(-1, n - 1), dim)`` with n the length of ``dim`` — the tree
    of one chain per row, what the dense ``linear_scan(a, b, dim)`` traces to (backends/scan/op.py) —
    → ``linear_scan(a, b, dim)``; on any other parent (or impl) it stays the op."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    orig = bound(node, node.args, node.kwargs)
    parent, dim, impl = orig["parent"], orig["dim"], orig["impl"]
    if impl != "auto" or not isinstance(parent, torch.fx.Node) or parent.target not in (aten.arange.start,
                                                                                         aten.arange.start_step):
        return None
    start, step = parent.args[0], (parent.args[2] if len(parent.args) > 2 else 1)
    ev_a, ev_b, ev_p = example_value(orig["a"]), example_value(orig["b"]), example_value(parent)
    if start != -1 or step != 1 or ev_a is None or ev_b is None or ev_p is None or ev_p.dim() != 1:
        return None
    n = torch.broadcast_shapes(ev_a.shape, ev_b.shape)[dim]
    if not statically_known_true(ev_p.shape[0] == n):
        return None
    b = bound(node, args, kwargs)
    return "call_function", _scan_ops.linear_scan, (b["a"], b["b"], dim), {}
