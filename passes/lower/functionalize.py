"""In-place writes into values the graph allocated become out-of-place ops (docs/ARCHITECTURE.md §3.1).

Dynamo records ``x /= s``, ``x.add_(y)``, ``out.index_add_(0, i, v)``, ``F.relu(x, inplace=True)`` as
writes. The token-axis rules reason about pure ops, so a write into a value derived from the token inputs
is refused (``passes/analysis/axes.py: propagate``). Most such writes in real models go into a tensor the graph
itself just made (a router's normalised top-k weights, a ``zeros_like`` accumulator): then

    w = op_(x, *args)          (x fresh: nothing else holds its storage)

is the same as ``x' = op(x, *args)`` read wherever ``x`` or ``w`` is read after the write, because

- ``x`` is **fresh**: the result of an op that always allocates (a pointwise or reduction result, a matmul,
  a factory, ``clone``, the values of ``topk``/``sort``, an operator whose schema returns an unaliased
  tensor: HF's ``grouped_mm`` custom op), not a view or an op that may return its input;
- nothing **aliases** it: every other reader of ``x`` that runs before the write allocates its own result or
  reads only ``x``'s shape or dtype (``m.expand_as(x)``: a view of ``m``), so no view of ``x`` made before the
  write sees it, and readers after the write now read ``x'``;
- the write does not **change the dtype**: every tensor argument has ``x``'s dtype (an out-of-place op would
  promote; an in-place one casts back), checked on the example values.

One indexed write is made out of place too, the inverse of a permutation (MoE dispatch, HF's grouped
experts): ``inv = empty_like(p); inv[p] = arange(n)`` with ``p`` the indices of a 1-D ``sort``/``argsort``
of n elements (a permutation of ``0..n-1``, so every element of ``inv`` is written exactly once) is
``argsort(p)``: both give the i with ``p[i] == j`` at each j.

A layout view (permute, transpose, view, reshape, (un)squeeze, flatten), or a ``dropout`` (its input at p = 0,
a new tensor otherwise), of a fresh value that is that value's only reader is as good as fresh: a write into it is seen only through it (Gemma 3n's AltUp ``predictions =
matmul(…).permute(…); predictions += hidden_states``), so ``x.op_(…)`` on it becomes ``op`` as above.

A fresh buffer filled by writes into slices of it that tile it along one dim (DeepSeek MLA's
``k = new_empty(...); k[..., :a].copy_(k_nope); k[..., a:].copy_(k_rot)``) becomes ``cat`` of the sources.
An indexed write ``x[index] = v`` into a fresh, unaliased ``x`` becomes ``x.masked_fill(mask, v)`` for a bool
mask of x's shape and a number (Gemma3's ``ids = input_ids.clone(); ids[image_mask] = 0``), or ``cat`` of x's
untouched slices and ``v`` for one int or static slice along one dim (a chunked scan's ``out[:, :, i] =
chunk``; ``_setitem_out_of_place``).

A write into a **view** of a fresh value — ``x[index] = v``, ``x.copy_(src)`` or ``x.op_(…)`` where ``x`` is
the fresh ``base`` or a chain of basic-index views of it (ints, slices with steps, an Ellipsis: Qwen3.5's
``freqs_thw = freq[0]; freqs_thw[..., 1::3] = freq[1, ..., 1::3]``, Kimi's ``a[..., i, :i] = row + …``) —
becomes ``base' = select_scatter/slice_scatter(base, …)`` composed up the chain, and every reader after the
write of ``base`` or of a basic-index view of it reads ``base'`` or the same view of ``base'``
(``_write_through_views``). It is exact when nothing but such views aliases ``base``: every other reader
of it or of its views allocates its own result or runs after the write. A graph input or a parameter is
not fresh, so a write into it or into a view of it stays, as does a write through a view made by another op
(``reshape``, ``transpose``, ``detach``). Anything else stays a write (other indices, writes into inputs or
aliased values), and the analysis refuses it where it touches a token value. The pass works on a copy; the
user's graph is not changed.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from brcompile.passes.analysis.axes import example_value, is_inplace
from brcompile.passes.spellings import (
    ALLOCATING_FUNCTIONS, ALLOCATING_METHODS, ALLOCATING_TUPLES, INPUT_OR_NEW_FUNCTIONS, LAYOUT_VIEW_FUNCTIONS,
    LAYOUT_VIEW_METHODS, LIKE_METHODS, OUT_OF_PLACE_OPERATORS, copy_graph_module,
)

log = logging.getLogger(__name__)

__all__ = ["functionalize"]


def _is_fresh(x: Any) -> bool:
    """``x`` is the result of an op that always allocates (module docstring)."""
    if not isinstance(x, fx.Node):
        return False
    if x.op == "call_function" and x.target is operator.getitem:
        src = x.args[0]
        return isinstance(src, fx.Node) and isinstance(x.args[1], int) and (
            src.target in ALLOCATING_TUPLES and src.op in ("call_function", "call_method"))
    if x.op == "call_function":
        if _returns_new_tensor(x.target):
            return "out" not in x.kwargs
        return x.target in ALLOCATING_FUNCTIONS and not x.kwargs.get("inplace") and "out" not in x.kwargs
    if x.op == "call_method":
        return x.target in ALLOCATING_METHODS
    return False


def _sole_view_of_fresh(x: Any, made: set) -> bool:
    """``x`` is a layout view (a permute, transpose, view, reshape, (un)squeeze, flatten: one-to-one in the
    elements) of a fresh value — or of such a view — or its input-or-copy (``contiguous``, ``type_as``, ``to``;
    ``dropout``, which returns its input at p = 0 and a new tensor otherwise), and is that value's only reader:
    nothing else holds the base's storage, so a write into ``x`` is seen only through ``x`` (Gemma 3n's AltUp:
    ``p = (h @ c).permute(…); p += h``; ``c = mul(…).contiguous().type_as(h); c[1:] += f``; XLM's
    ``t = dropout(layer_norm(…)); t *= mask``)."""
    if not isinstance(x, fx.Node) or not x.args or not isinstance(x.args[0], fx.Node):
        return False
    if not ((x.op == "call_method" and x.target in LAYOUT_VIEW_METHODS)
            or (x.op == "call_function" and x.target in LAYOUT_VIEW_FUNCTIONS)
            or (x.op == "call_function" and x.target in INPUT_OR_NEW_FUNCTIONS and not x.kwargs.get("inplace")
                and not (len(x.args) > 3 and x.args[3]))):
        return False
    base = x.args[0]
    return len(base.users) == 1 and (_is_fresh(base) or base in made or _sole_view_of_fresh(base, made))


def _returns_new_tensor(target: Any) -> bool:
    """``target`` is an operator (an ``OpOverload``, or a packet with one overload) whose schema returns one
    tensor with no alias annotation and mutates nothing (a custom op such as HF's grouped matmul): torch's
    operator contract is that such an output is a new tensor, never a view of an input."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        names = target.overloads()
        if len(names) != 1:
            return False
        target = getattr(target, names[0])
    schema = getattr(target, "_schema", None) if isinstance(target, torch._ops.OpOverload) else None
    if schema is None or schema.is_mutable or len(schema.returns) != 1:
        return False
    ret = schema.returns[0]
    return ret.alias_info is None and str(ret.type) == "Tensor"


def _out_of_place(node: fx.Node) -> Optional[tuple[str, Any, tuple, dict]]:
    """(op, target, args, kwargs) of the out-of-place twin of the write ``node``; None if it has none."""
    if node.op == "call_method":
        name = node.target
        if name.endswith("_") and not name.endswith("__") and hasattr(torch.Tensor, name[:-1]):
            return "call_method", name[:-1], node.args, dict(node.kwargs)
        return None
    if node.op != "call_function":
        return None
    if node.target in OUT_OF_PLACE_OPERATORS:
        return "call_function", OUT_OF_PLACE_OPERATORS[node.target], node.args, dict(node.kwargs)
    if node.kwargs.get("inplace") is True:
        return "call_function", node.target, node.args, {**node.kwargs, "inplace": False}
    try:
        sig = inspect.signature(node.target)
        bound = sig.bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):
        return None
    if bound.arguments.get("inplace") is True:
        bound.arguments["inplace"] = False
        return "call_function", node.target, tuple(bound.args), dict(bound.kwargs)
    return None


def _keeps_dtype(twin: tuple, x: fx.Node) -> bool:
    """The out-of-place twin, run on the example values (fake tensors, in their fake mode), returns ``x``'s
    dtype and shape: an in-place op casts back to ``x``'s dtype where the out-of-place one would promote."""
    op, target, args, kwargs = twin
    want = example_value(x)
    mode = getattr(want, "fake_mode", None)
    if not isinstance(want, torch.Tensor):
        return False
    vals = fx.node.map_arg((args, kwargs), example_value)
    try:
        with mode if mode is not None else contextlib.nullcontext():
            if op == "call_method":
                got = getattr(vals[0][0], target)(*vals[0][1:], **vals[1])
            else:
                got = target(*vals[0], **vals[1])
    except Exception:  # an op the fake mode cannot run: leave the write as it is
        return False
    return isinstance(got, torch.Tensor) and got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape)


def _no_alias_before(x: fx.Node, write: fx.Node, order: dict) -> bool:
    """Every reader of ``x`` other than the write either runs after it, allocates its own result or reads only
    ``x``'s shape or dtype (:func:`_reads_only_metadata`)."""
    return all(u is write or order[u] > order[write] or _is_fresh(u) or _reads_only_metadata(u, x)
               for u in x.users)


def _reads_only_metadata(u: fx.Node, x: fx.Node) -> bool:
    """``u`` reads ``x`` only for its shape or dtype: ``y.expand_as(x)``, ``y.view_as(x)``, ``y.reshape_as(x)``,
    ``y.type_as(x)`` with ``y`` not ``x`` (XLM's ``mask.expand_as(scores)`` before ``scores.masked_fill_(…)``). Its
    result is ``y``'s storage or a copy of ``y``, never ``x``'s, so it cannot see a later write into ``x``."""
    return u.op == "call_method" and u.target in LIKE_METHODS and len(u.args) == 2 and not u.kwargs \
        and u.args[1] is x and u.args[0] is not x


def functionalize(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with every write into a fresh, unaliased value made out of place (module
    docstring); ``gm`` itself when there is none."""
    writes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and is_inplace(n)]
    if not writes:
        return gm
    copy = copy_graph_module(gm)
    graph = copy.graph
    made: set[fx.Node] = set()  # the out-of-place twins: fresh by construction
    for base in [n for n in graph.nodes if _is_fresh(n)]:
        tiled = _tiling_writes(base)
        if tiled is not None:
            made.add(_cat_of_tiles(graph, base, *tiled))
    for n in [n for n in graph.nodes if n.op in ("call_function", "call_method") and is_inplace(n)]:
        order = {m: i for i, m in enumerate(graph.nodes)}
        inv = _inverse_permutation(n, order)
        if inv is not None:
            made.add(inv)
            continue
        x = n.args[0] if n.args else None
        if n.op == "call_function" and n.target is operator.setitem:
            new = None
            if (_is_fresh(x) or x in made) and _no_alias_before(x, n, order):
                new = _setitem_out_of_place(n)
            if new is None:
                new = _write_through_views(n, order, made)
            if new is not None:
                made.add(new)
            continue
        twin = _out_of_place(n)
        owned = _is_fresh(x) or x in made or _sole_view_of_fresh(x, made)
        if twin is None or not owned or not _keeps_dtype(twin, x) or not _no_alias_before(x, n, order):
            new = _write_through_views(n, order, made)
            if new is not None:
                made.add(new)
            continue
        op, target, args, kwargs = twin
        with graph.inserting_after(n):
            new = graph.create_node(op, target, args, kwargs, name=f"{x.name}_updated")
        new.meta.update(n.meta)
        for u in list(x.users):
            if u is not n and u is not new and order[u] > order[n]:
                u.replace_input_with(x, new)
        n.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
        graph.erase_node(n)
        made.add(new)
    if not made:
        return gm
    graph.lint()
    copy.recompile()
    log.debug("branch_replay: %d in-place write(s) made out of place", len(made))
    return copy


def _slice_along(index: Any, ndim: int) -> Optional[tuple[int, int, Optional[int]]]:
    """(dim, start, stop) when ``index`` selects one static range along one dim and everything along the
    others (``x[..., a:b]``, ``x[:, :, a:b]``); None for any other index."""
    idx = index if isinstance(index, tuple) else (index,)
    if sum(i is Ellipsis for i in idx) > 1 or any(not (i is Ellipsis or isinstance(i, slice)) for i in idx):
        return None
    if Ellipsis in idx:
        k = idx.index(Ellipsis)
        idx = idx[:k] + (slice(None),) * (ndim - len(idx) + 1) + idx[k + 1:]
    cut = [(d, i) for d, i in enumerate(idx) if i != slice(None)]
    if len(cut) != 1:
        return None
    d, sl = cut[0]
    if sl.step not in (None, 1) or not all(v is None or (isinstance(v, int) and v >= 0) for v in (sl.start, sl.stop)):
        return None
    return d, sl.start or 0, sl.stop


def _tiling_writes(base: fx.Node) -> Optional[tuple[int, list]]:
    """``(dim, [(start, source, view, write)...])`` when every use of the fresh ``base`` before its first read
    is ``base[..., a:b].copy_(source)`` along one dim, the ranges tile ``base``'s extent there exactly, and
    each view is used by its write only (DeepSeek MLA's ``k = new_empty(...); k[..., :a].copy_(k_nope);
    k[..., a:].copy_(k_rot)``); else None."""
    val = example_value(base)
    if not isinstance(val, torch.Tensor):
        return None
    tiles, dim = [], None
    for u in base.users:
        if not (u.op == "call_function" and u.target is operator.getitem and u.args[0] is base):
            continue
        cut = _slice_along(u.args[1], val.dim())
        writes = list(u.users)
        if cut is None or len(writes) != 1 or writes[0].op != "call_method" or writes[0].target != "copy_" \
                or writes[0].args[0] is not u or len(writes[0].args) != 2 or writes[0].kwargs or writes[0].users:
            return None
        d, a, b = cut
        size = val.shape[d]
        b = size if b is None else min(b, size)
        if dim not in (None, d) or not isinstance(writes[0].args[1], fx.Node):
            return None
        dim = d
        tiles.append((a, b, writes[0].args[1], u, writes[0]))
    if not tiles:
        return None
    tiles.sort(key=lambda t: t[0])
    if tiles[0][0] != 0 or tiles[-1][1] != val.shape[dim] or any(t[1] != n[0] for t, n in zip(tiles, tiles[1:])):
        return None
    order = {m: i for i, m in enumerate(base.graph.nodes)}
    last = max(order[t[4]] for t in tiles)
    views = {t[3] for t in tiles}
    if any(u not in views and order[u] < last for u in base.users) or any(
            order[t[2]] > order[t[4]] for t in tiles):
        return None
    for a, b, src, view, _ in tiles:  # copy_ broadcasts and casts; a tile's source must already fit
        sv, vv = example_value(src), example_value(view)
        if not isinstance(sv, torch.Tensor) or tuple(sv.shape) != tuple(vv.shape) or sv.dtype != vv.dtype:
            return None
    return dim, tiles


def _cat_of_tiles(graph: fx.Graph, base: fx.Node, dim: int, tiles: list) -> fx.Node:
    """Replace the tiling writes into ``base`` by ``cat(sources, dim)`` read wherever ``base`` is read
    after them."""
    last = max(tiles, key=lambda t: list(graph.nodes).index(t[4]))[4]
    with graph.inserting_after(last):
        cat = graph.call_function(torch.cat, ([t[2] for t in tiles],), {"dim": dim})
    cat.meta.update(base.meta)
    for _, _, _, view, write in tiles:
        write.replace_all_uses_with(cat)
        graph.erase_node(write)
        graph.erase_node(view)
    base.replace_all_uses_with(cat, delete_user_cb=lambda u: u is not cat)
    if not base.users:
        graph.erase_node(base)
    return cat


def _setitem_out_of_place(n: fx.Node) -> Optional[fx.Node]:
    """``x[index] = v`` into a fresh, unaliased ``x`` (checked by the caller), made out of place for two index
    forms; the new node, read wherever ``x`` is read after the write, or None (the write stays):

    * a boolean mask of ``x``'s shape and a Python number (Gemma3's ``ids = input_ids.clone();
      ids[image_mask] = 0``): ``x.masked_fill(mask, v)`` — the same elements, cast to ``x``'s dtype alike;
    * one int or one static slice along one dim, every other dim whole (``out[:, :, 0] = chunk``), and ``v``
      a tensor of the written view's shape and ``x``'s dtype: ``cat([x[.., :a, ..], v', x[.., b:, ..]], dim)``
      with ``v' = v`` (``v.unsqueeze(dim)`` for an int) — the copy as a concatenation, element for element;
      a number ``v`` fills ``full_like(x[.., a:b, ..], v)`` instead (the same cast as the write's).

    In both, the gradient reaching ``x`` is zero at the written elements and ``v`` receives the view's: the
    write's own gradients."""
    if len(n.args) != 3 or n.kwargs:
        return None
    x, index, v = n.args
    xv, iv, vv = example_value(x), example_value(index), example_value(v)
    number = type(v) in (int, float, bool)
    if not isinstance(xv, torch.Tensor) or not (number or isinstance(vv, torch.Tensor)):
        return None
    graph = n.graph
    if isinstance(index, fx.Node):
        if not (isinstance(iv, torch.Tensor) and iv.dtype is torch.bool and tuple(iv.shape) == tuple(xv.shape)
                and number):
            return None
        with graph.inserting_after(n):
            new = _with_value(graph.call_method("masked_fill", (x, index, v)), xv)
        return _reads_after_write(n, x, new, {new})
    cut = _index_along(index, xv.dim())
    if cut is None:
        return None
    d, a, b, is_int = cut
    size = xv.shape[d]
    b = size if b is None else b
    if not all(isinstance(k, int) for k in (size, a, b)) or not 0 <= a <= b <= size:
        return None
    written = list(xv.shape[:d]) + ([] if is_int else [b - a]) + list(xv.shape[d + 1:])
    if not number and (tuple(vv.shape) != tuple(written) or vv.dtype != xv.dtype):
        return None
    created = []

    def make(target, args, kwargs=None, method=False):
        node = (graph.call_method if method else graph.call_function)(target, args, kwargs or {})
        created.append(_with_value(node, xv))
        return node

    whole = (slice(None),) * d
    with graph.inserting_before(n.next):  # in order, right after the write
        if number:
            mid = make(torch.full_like, (make(operator.getitem, (x, whole + (slice(a, b),))), v))
        else:
            mid = make("unsqueeze", (v, d), method=True) if is_int else v
        parts = [make(operator.getitem, (x, whole + (slice(0, a),))), mid,
                 make(operator.getitem, (x, whole + (slice(b, None),)))]
        new = make(torch.cat, (parts,), {"dim": d})
    return _reads_after_write(n, x, new, set(created))


def _with_value(node: fx.Node, like: torch.Tensor) -> fx.Node:
    """``node`` with its example value (the rules read shapes from it), computed on its arguments' example
    values in ``like``'s fake mode; left unset if that fails (the rules then treat the shape as unknown)."""
    mode = getattr(like, "fake_mode", None)
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), example_value)
    try:
        with mode if mode is not None else contextlib.nullcontext():
            if node.op == "call_method":
                val = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                val = node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001  (a value the fake mode cannot compute: no example value)
        return node
    node.meta["example_value"] = val
    return node


def _index_along(index: Any, ndim: int) -> Optional[tuple[int, int, Optional[int], bool]]:
    """(dim, start, stop, is_int) when ``index`` is one non-negative int or one static step-1 slice along one
    dim and whole slices (or an Ellipsis) elsewhere (``x[:, :, 0]``, ``x[..., 2:5]``); None otherwise."""
    idx = index if isinstance(index, tuple) else (index,)
    if not all(i is Ellipsis or isinstance(i, slice) or (type(i) is int and i >= 0) for i in idx):
        return None
    cut = _slice_along(tuple(slice(i, i + 1) if type(i) is int else i for i in idx), ndim)
    if cut is None:
        return None
    d, a, b = cut
    return (d, a, a + 1, True) if any(type(i) is int for i in idx) else (d, a, b, False)


def _reads_after_write(n: fx.Node, x: fx.Node, new: fx.Node, created: set) -> fx.Node:
    """Readers of ``x`` after the write ``n`` read ``new`` instead; ``n`` is erased."""
    graph = n.graph
    order = {m: i for i, m in enumerate(graph.nodes)}
    for u in list(x.users):
        if u is not n and u not in created and order[u] > order[n]:
            u.replace_input_with(x, new)
    graph.erase_node(n)
    return new


def _is_permutation(p: Any) -> bool:
    """``p`` is the indices of a sort/argsort of a 1-D tensor: a permutation of ``0..n-1``."""
    if not isinstance(p, fx.Node) or p.op not in ("call_function", "call_method"):
        return False
    v = example_value(p)
    if not isinstance(v, torch.Tensor) or v.dim() != 1:
        return False
    if p.target in (torch.argsort, "argsort"):
        src = p.args[0]
    elif p.target is operator.getitem and p.args[1] == 1 and isinstance(p.args[0], fx.Node) and \
            p.args[0].target in (torch.sort, "sort"):
        src = p.args[0].args[0]
    else:
        return False
    sv = example_value(src)
    return isinstance(sv, torch.Tensor) and sv.dim() == 1


def writes_inverse_permutation(inv: Any, p: Any, a: Any) -> bool:
    """Whether writing ``a`` at the indices ``p`` into ``inv`` (``inv[p] = a``) leaves ``argsort(p)`` in inv:
    ``inv = empty_like(p)`` (every entry is written), ``p`` a permutation (:func:`_is_permutation`) and ``a =
    arange(numel(p))`` in p's dtype, so ``inv[p[i]] = i``, the i with ``p[i] == j`` at each j."""
    if not (isinstance(inv, fx.Node) and inv.target in (torch.empty_like, "new_empty") and inv.args
            and inv.args[0] is p and set(inv.kwargs) <= {"dtype", "device"} and _is_permutation(p)):
        return False
    if not (isinstance(a, fx.Node) and a.target is torch.arange and len(a.args) == 1
            and set(a.kwargs) <= {"device", "dtype"}):
        return False
    pv, iv, av = example_value(p), example_value(inv), example_value(a)
    return (isinstance(av, torch.Tensor) and av.dtype == pv.dtype == iv.dtype
            and tuple(av.shape) == tuple(pv.shape) == tuple(iv.shape))


def _inverse_permutation(n: fx.Node, order: dict) -> Optional[fx.Node]:
    """``setitem(inv, p, arange(numel(p)))`` into ``inv = empty_like(p)`` read by nothing before it: replaced
    by ``argsort(p)`` (module docstring); the new node, or None when ``n`` is not that write."""
    if n.op != "call_function" or n.target is not operator.setitem or len(n.args) != 3:
        return None
    inv, p, a = n.args
    if not writes_inverse_permutation(inv, p, a):
        return None
    if any(u is not n and order[u] < order[n] for u in inv.users):
        return None
    graph = n.graph
    with graph.inserting_after(n):
        new = graph.call_function(torch.argsort, (p,))
    new.meta.update({k: v for k, v in inv.meta.items() if k in ("example_value", "val", "stack_trace")})
    for u in list(inv.users):
        if u is not n and order[u] > order[n]:
            u.replace_input_with(inv, new)
    graph.erase_node(n)
    if not inv.users:
        graph.erase_node(inv)
    return new


# --------------------------------------------------------------------------------------------------
# writes into views of a fresh value


def _basic_entries(index: Any, shape: tuple) -> Optional[list]:
    """``index`` as one entry per dim of a tensor of ``shape``: a non-negative int or a slice with int (or
    None) bounds and a positive step, when it is basic indexing (Python ints, such slices, at most one
    Ellipsis); None for any other index (a tensor, a list, a bool, ``None`` adding a dim, a symbolic bound)."""
    idx = index if isinstance(index, tuple) else (index,)

    def bound(v):
        return v is None or type(v) is int

    if sum(i is Ellipsis for i in idx) > 1 or not all(
            i is Ellipsis or type(i) is int or (isinstance(i, slice) and bound(i.start) and bound(i.stop)
                                                and (i.step is None or (type(i.step) is int and i.step > 0)))
            for i in idx):
        return None
    consumed = sum(i is not Ellipsis for i in idx)
    if consumed > len(shape):
        return None
    out: list = []
    for i in idx:
        out.extend([slice(None)] * (len(shape) - consumed) if i is Ellipsis else [i])
    for d, e in enumerate(out):
        if type(e) is int:
            if e < 0 and not isinstance(shape[d], int):
                return None
            e = e + shape[d] if e < 0 else e
            if e < 0 or (isinstance(shape[d], int) and e >= shape[d]):
                return None
            out[d] = e
    return out


def _is_whole(e: Any) -> bool:
    return isinstance(e, slice) and e.start in (None, 0) and e.stop is None and e.step in (None, 1)


def _view_parent(v: Any) -> Optional[tuple[fx.Node, list]]:
    """``(parent, entries)`` when ``v = parent[index]`` with a basic index (``_basic_entries``) into a tensor:
    a view of ``parent`` whose elements are known exactly; None for anything else."""
    if not (isinstance(v, fx.Node) and v.op == "call_function" and v.target is operator.getitem
            and isinstance(v.args[0], fx.Node)):
        return None
    pv = example_value(v.args[0])
    if not isinstance(pv, torch.Tensor):
        return None
    entries = _basic_entries(v.args[1], tuple(pv.shape))
    return None if entries is None else (v.args[0], entries)


def _views_of(base: fx.Node) -> list[fx.Node]:
    """``base`` and every value reached from it through basic-index views (``_view_parent``), in graph order."""
    seen, todo = [base], [base]
    while todo:
        w = todo.pop()
        for u in w.users:
            if u not in seen and (_view_parent(u) or (None,))[0] is w:
                seen.append(u)
                todo.append(u)
    order = {m: i for i, m in enumerate(base.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _write_through_views(n: fx.Node, order: dict, made: set) -> Optional[fx.Node]:
    """A write ``n`` into ``x`` — ``x[index] = v`` (a basic index), ``x.copy_(src)`` or ``x.op_(…)`` with an
    out-of-place twin that keeps x's dtype — where ``x`` is a fresh value ``base`` or a basic-index view of it
    (``x = base[i][j]…``), made out of place:

        x'    = x with x[index] replaced by v        (``_scatter``: slice_scatter / select_scatter)
        p'    = p with p[j] replaced by x'           (up the chain of views, for x = p[j])
        base' = …

    and every reader after the write of ``base`` or of any basic-index view ``w = base[k]…`` of it (made before
    the write or not) reads ``base'`` or ``base'[k]…``: after an in-place write, a view shows the written
    elements and the other elements of its base, which is what ``base'[k]…`` holds. ``v`` is broadcast to the
    view's shape and cast to its dtype first (``expand_as``, ``to``; a number fills ``full_like``), as the
    copy of an in-place write does. Exact when ``base`` is fresh (module docstring) and nothing else aliases it:
    every reader of ``base`` or of one of its views is such a view, the write, an op that allocates its
    result, or runs after the write. A graph input or a parameter is never fresh: a write into it, or into a
    view of it, stays (and is refused where it touches a token value), as does a write through a view made
    by any other op (``reshape``, ``transpose``, ``detach``), whose elements this pass does not track.
    Returns ``base'`` (a new node), or None when ``n`` is not such a write (the graph is unchanged)."""
    x = n.args[0] if n.args else None
    if not isinstance(x, fx.Node) or not isinstance(example_value(x), torch.Tensor):
        return None
    chain, base = [], x
    while (up := _view_parent(base)) is not None:
        chain.append((up[0], up[1], base))
        base = up[0]
    if not (_is_fresh(base) or base in made or _sole_view_of_fresh(base, made)):
        return None
    views = _views_of(base)
    if any(not (u is n or u in views or order[u] > order[n] or _is_fresh(u)) for w in views for u in w.users):
        return None
    graph = n.graph
    like = example_value(x)
    created: list[fx.Node] = []

    def make(target, args, method=False):
        node = (graph.call_method if method else graph.call_function)(target, args)
        created.append(_with_value(node, like))
        return node

    with graph.inserting_before(n.next):
        new = _written_value(n, x, make)
        for parent, entries, view in chain:  # up the chain: x' into its parent, …, into base
            if new is None:
                break
            new = _scatter(parent, entries, new, make)
        if new is not None and new not in created:  # a whole write: base' must be a value of its own
            new = make(torch.clone, (new,))
        if new is None or any(not isinstance(example_value(c), torch.Tensor) for c in created) or \
                tuple(example_value(new).shape) != tuple(example_value(base).shape) or \
                example_value(new).dtype != example_value(base).dtype:
            for c in reversed(created):
                graph.erase_node(c)
            return None
        again = {base: new}

        def after(w):  # w's value after the write: the same view of base'
            if w not in again:
                again[w] = make(operator.getitem, (after(w.args[0]), w.args[1]))
            return again[w]

        for w in views:
            if order[w] > order[n]:  # made after the write: it reads the new value through its parent
                continue
            later = [u for u in w.users if u is not n and u not in created and order[u] > order[n]]
            if later:
                w2 = after(w)
                for u in later:
                    u.replace_input_with(w, w2)
        if n.users:  # an in-place method returns its (written) first argument
            n.replace_all_uses_with(after(x))
    graph.erase_node(n)
    for c in reversed(created):  # views made only to read a shape
        if not c.users and c is not new:
            graph.erase_node(c)
    log.debug("branch_replay: %s written through %d view(s) of %s", n.name, len(chain), base.name)
    return new


def _written_value(n: fx.Node, x: fx.Node, make) -> Optional[fx.Node]:
    """``x``'s value after the write ``n`` (``_write_through_views``), as new nodes; None for another write."""
    xv = example_value(x)
    if n.op == "call_function" and n.target is operator.setitem:
        if len(n.args) != 3 or n.kwargs:
            return None
        entries = _basic_entries(n.args[1], tuple(xv.shape))
        return None if entries is None else _scatter(x, entries, n.args[2], make)
    if n.op == "call_method" and n.target == "copy_":
        if len(n.args) != 2 or n.kwargs:
            return None
        return _scatter(x, [slice(None)] * xv.dim(), n.args[1], make)
    twin = _out_of_place(n)
    if twin is None or twin[2][:1] != (x,) or not _keeps_dtype(twin, x):
        return None
    op, target, args, kwargs = twin
    node = make(target, args, method=op == "call_method")
    node.kwargs = kwargs
    return _with_value(node, xv)


def _scatter(t: fx.Node, entries: list, v: Any, make) -> Optional[fx.Node]:
    """``t`` with ``t[entries] = v`` done out of place (entries: ``_basic_entries``): ``v`` fitted to the view
    (``_fitted``), then, at the first dim d not taken whole, ``select_scatter(t, s', d, i)`` for an int i or
    ``slice_scatter(t, s', d, start, stop, step)`` for a slice, with ``s'`` the sub-view ``s = t[.., e_d]``
    with the rest of the index written into it the same way (``s' = v`` when the rest is whole). Each is
    element for element the copy the write makes; the gradient reaching ``t`` is zero at the written elements
    and ``v`` receives the view's, the write's own gradients. The fitted ``v`` itself for a whole index."""
    d = next((k for k, e in enumerate(entries) if not _is_whole(e)), None)
    if d is None:
        view = t
    else:
        view = make(operator.getitem, (t, tuple(entries)))
    src = _fitted(v, view, make)
    if src is None or d is None:
        return src
    return _scatter_entries(t, entries, src, make)


def _scatter_entries(t: fx.Node, entries: list, src: fx.Node, make) -> fx.Node:
    """``t`` with ``t[entries]`` replaced by ``src`` (of that view's shape and dtype): the nested
    select/slice_scatter of ``_scatter``."""
    d = next((k for k, e in enumerate(entries) if not _is_whole(e)), None)
    if d is None:
        return src
    e = entries[d]
    rest = [slice(None)] * (d if type(e) is int else d + 1) + list(entries[d + 1:])
    inner = src
    if any(not _is_whole(r) for r in rest):
        sub = make(operator.getitem, (t, (slice(None),) * d + (e,)))
        inner = _scatter_entries(sub, rest, src, make)
    if type(e) is int:
        return make(torch.select_scatter, (t, inner, d, e))
    return make(torch.slice_scatter, (t, inner, d, e.start, e.stop, e.step or 1))


def _fitted(v: Any, view: fx.Node, make) -> Optional[fx.Node]:
    """``v`` as the write copies it into ``view``: a number fills ``full_like(view, v)``; a tensor is cast to
    the view's dtype (``to``, the rounding of the copy) and broadcast to its shape (``expand_as``). None for a
    tensor of more dims than the view or on another device."""
    vv = example_value(view)
    if type(v) in (int, float, bool):
        return make(torch.full_like, (view, v))
    val = example_value(v)
    if not isinstance(val, torch.Tensor) or val.dim() > vv.dim() or val.device != vv.device:
        return None
    if val.dtype != vv.dtype:
        v = make("to", (v, vv.dtype), method=True)
    if tuple(val.shape) != tuple(vv.shape):
        v = make("expand_as", (v, view), method=True)
    return v
