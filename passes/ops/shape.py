"""Layout and indexing: views, reshapes, transposes, broadcasts, repeats, joins, splits, indexing and writes into
slices.

Each moves elements without computing on them; its token-axis rule (passes/analysis/rules/shape.py: one view
algebra) says where the token dims go. Transposes, permutes and (un)squeezes move a dense result's token dims
(``Liveness.LAYOUT``); views, broadcasts, splits, joins and indexing keep routed pairs on dim 0 (pair rules
``layout``, ``split``, ``cat``, ``getitem``). At the ATen level a view is written back as ``reshape`` (a view of a
packed value may not be one of the dense value: strides differ; reshape is the same values wherever the view is
valid) and ``slice`` / ``select`` / ``index`` as ``x[…]``.
"""
from __future__ import annotations

import operator

import torch

from brcompile.passes.meta import example_value
from brcompile.passes.ops.registry import Liveness, register_op
from brcompile.passes.ops.respell import END, bound, fn, index_tuple, method, torch_fns, whole

aten = torch.ops.aten
_MOVES = dict(axes="permute", liveness=Liveness.LAYOUT, pair="layout")

# --------------------------------------------------------------------------------------------------
# views and moves of dims

register_op("transpose", named=True, spellings=(*torch_fns("transpose", "swapaxes", "swapdims"), "transpose",
                                                "swapaxes", "swapdims"),
            aten=(aten.transpose, aten.swapaxes, aten.swapdims), respell=method("transpose"), **_MOVES)
register_op("permute", named=True, spellings=(*torch_fns("permute"), "permute"), aten=(aten.permute,),
            respell=method("permute", star=True), **_MOVES)
register_op("t", spellings=("t",), aten=(aten.t,), respell=method("t"), axes="permute", liveness=Liveness.LAYOUT)
# the function spelling has no token-axis rule yet (its operand is materialised); liveness reads it as a move
register_op("t_function", spellings=(torch.t,), liveness=Liveness.LAYOUT)
register_op("movedim", spellings=("movedim", torch.movedim), aten=(aten.movedim, aten.moveaxis),
            respell=method("movedim"), axes="permute")
register_op("unsqueeze", spellings=("unsqueeze", torch.unsqueeze), aten=(aten.unsqueeze,), respell=method("unsqueeze"),
            axes="unsqueeze", liveness=Liveness.LAYOUT, pair="layout")


@register_op("squeeze", spellings=("squeeze", torch.squeeze), aten=(aten.squeeze,), axes="squeeze",
             liveness=Liveness.LAYOUT, pair="layout")
def _squeeze(node, args, kwargs):
    """``aten.squeeze(x)`` / ``aten.squeeze.dims(x, [d])`` → ``x.squeeze()`` / ``x.squeeze(d)``."""
    if len(args) == 1:
        return "call_method", "squeeze", args, {}
    x, dims = args[:2]
    if isinstance(dims, (list, tuple)):
        dims = dims[0] if len(dims) == 1 else tuple(dims)
    return "call_method", "squeeze", (x, dims), {}


register_op("reshape", named=True, spellings=("view", "reshape", *torch_fns("reshape", "flatten", "unflatten"),
                                               "flatten", "unflatten", "view_as", "reshape_as"),
            aten=(aten.view, aten.reshape, aten._unsafe_view), respell=method("reshape", star=True), axes="view",
            pair="layout")
# the reshape family's other ATen ops, each written as its own method
for _name in ("flatten", "unflatten", "view_as", "reshape_as"):
    register_op(_name, aten=(getattr(aten, _name),), respell=method(_name))
register_op("expand", spellings=("expand",), aten=(aten.expand,), respell=method("expand", star=True), axes="expand",
            pair="layout")
register_op("expand_as", named=True, spellings=("expand_as",), aten=(aten.expand_as,), respell=method("expand_as"),
            axes="expand")  # x.expand_as(t): x broadcast to t's shape (no torch.expand_as function)
register_op("broadcast_to", spellings=(torch.broadcast_to,), axes="expand")
register_op("repeat", named=True, spellings=("repeat",), aten=(aten.repeat,), respell=method("repeat", star=True),
            axes="repeat")
register_op("repeat_interleave", named=True, spellings=(*torch_fns("repeat_interleave"), "repeat_interleave"),
            aten=(aten.repeat_interleave,), respell=fn(torch.repeat_interleave, keep=("dim", "output_size")),
            axes="repeat_interleave")
register_op("view_as_complex", named=True, spellings=(*torch_fns("view_as_complex"),), aten=(aten.view_as_complex,),
            respell=fn(torch.view_as_complex), axes="view_as_complex")
register_op("view_as_real", named=True, spellings=(*torch_fns("view_as_real"),), aten=(aten.view_as_real,),
            respell=fn(torch.view_as_real), axes="view_as_real")

# --------------------------------------------------------------------------------------------------
# joins and splits

register_op("cat", named=True, spellings=(*torch_fns("cat", "concat", "concatenate"),),
            aten=(aten.cat, aten.concatenate, aten.concat), respell=fn(torch.cat), axes="cat", pair="cat")
register_op("stack", spellings=(torch.stack,), aten=(aten.stack,), respell=fn(torch.stack), axes="stack")
register_op("split", spellings=("split", torch.split, torch.Tensor.split), aten=(aten.split, aten.split_with_sizes),
            respell=method("split"), axes="split", pair="split")
register_op("chunk", spellings=("chunk", torch.chunk), aten=(aten.chunk,), respell=method("chunk"), axes="split",
            pair="split")
register_op("tensor_split", spellings=("tensor_split", torch.tensor_split), axes="split")
register_op("unbind", spellings=("unbind", torch.unbind), aten=(aten.unbind,), respell=method("unbind"),
            axes="unbind", pair="split")

# --------------------------------------------------------------------------------------------------
# indexing and writes into slices

register_op("getitem", spellings=(operator.getitem,), axes="getitem", pair="getitem")


@register_op("slice", aten=(aten.slice,))
def _slice(node, args, kwargs):
    """``aten.slice(x, d, start, end, step)`` → ``x[:, …, start:end:step]`` (the identity when it keeps the dim)."""
    b = bound(node, args, kwargs)
    x, d, start, end, step = b["self"], b["dim"], b.get("start"), b.get("end"), b.get("step", 1)
    ndim = example_value(x).dim()
    d = d + ndim if d < 0 else d
    if whole(start, end, step):
        return x
    start = None if start in (0, None) else start
    end = None if end is None or (isinstance(end, int) and end >= END) else end
    step = None if step in (1, None) else step
    return "call_function", operator.getitem, (x, index_tuple(d, slice(start, end, step))), {}


@register_op("select", aten=(aten.select,))
def _select(node, args, kwargs):
    """``aten.select(x, d, i)`` → ``x[:, …, i]``."""
    x, d, i = args
    ndim = example_value(x).dim()
    return "call_function", operator.getitem, (x, index_tuple(d + ndim if d < 0 else d, i)), {}


@register_op("index", aten=(aten.index,))
def _index(node, args, kwargs):
    """``aten.index(x, [i0, None, i2])`` → ``x[i0, :, i2]``."""
    x, indices = args
    return "call_function", operator.getitem, (x, tuple(slice(None) if i is None else i for i in indices)), {}


@register_op("slice_scatter", spellings=(torch.slice_scatter, "slice_scatter"), aten=(aten.slice_scatter,),
             axes="slice_scatter")
def _slice_scatter(node, args, kwargs):
    """``aten.slice_scatter(x, src, d, start, end, step)``; a write of the whole of x is ``src`` itself (writes
    that cover a dim become a ``cat`` after the respelling: passes/lower/aten.py ``_fold_tiled_writes``)."""
    b = bound(node, args, kwargs)
    x, src, d, start, end, step = b["self"], b["src"], b["dim"], b.get("start"), b.get("end"), b.get("step", 1)
    ev_x, ev_src = example_value(x), example_value(src)
    if whole(start, end, step) and ev_x is not None and ev_src is not None and ev_x.shape == ev_src.shape \
            and ev_x.dtype == ev_src.dtype:
        return src
    return "call_function", torch.slice_scatter, (x, src, d, start, end, step), {}


register_op("select_scatter", spellings=(torch.select_scatter, "select_scatter"), aten=(aten.select_scatter,),
            respell=fn(torch.select_scatter), axes="slice_scatter")
register_op("gather", spellings=(torch.gather, "gather"), aten=(aten.gather,), respell=fn(torch.gather),
            axes="gather", liveness=Liveness.ALONG_DIM)
register_op("take_along_dim", spellings=(torch.take_along_dim, "take_along_dim"), axes="gather")
# pair-local (a scatter back onto the tokens) without a token-axis rule
register_op("index_add", spellings=("index_add", torch.index_add), pair="index_add")
