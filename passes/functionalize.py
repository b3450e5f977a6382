"""In-place writes into values the graph allocated become out-of-place ops (docs/ARCHITECTURE.md §3.1).

Dynamo records ``x /= s``, ``x.add_(y)``, ``out.index_add_(0, i, v)``, ``F.relu(x, inplace=True)`` as
writes. The token-axis rules reason about pure ops, so a write into a value derived from the token inputs
is refused (``passes/axes.py: propagate``). Most such writes in real models go into a tensor the graph
itself just made (a router's normalised top-k weights, a ``zeros_like`` accumulator): then

    w = op_(x, *args)          (x fresh: nothing else holds its storage)

is the same as ``x' = op(x, *args)`` read wherever ``x`` or ``w`` is read after the write, because

- ``x`` is **fresh**: the result of an op that always allocates (a pointwise or reduction result, a matmul,
  a factory, ``clone``, the values of ``topk``/``sort``), not a view or an op that may return its input;
- nothing **aliases** it: every other reader of ``x`` that runs before the write allocates its own result
  (so no view of ``x`` made before the write sees it), and readers after the write now read ``x'``;
- the write does not **change the dtype**: every tensor argument has ``x``'s dtype (an out-of-place op would
  promote; an in-place one casts back), checked on the example values.

One indexed write is made out of place too, the inverse of a permutation (MoE dispatch, HF's grouped
experts): ``inv = empty_like(p); inv[p] = arange(n)`` with ``p`` the indices of a 1-D ``sort``/``argsort``
of n elements (a permutation of ``0..n-1``, so every element of ``inv`` is written exactly once) is
``argsort(p)``: both give the i with ``p[i] == j`` at each j.

A fresh buffer filled by writes into slices of it that tile it along one dim (DeepSeek MLA's
``k = new_empty(...); k[..., :a].copy_(k_nope); k[..., a:].copy_(k_rot)``) becomes ``cat`` of the sources.
An indexed write ``x[index] = v`` into a fresh, unaliased ``x`` becomes ``x.masked_fill(mask, v)`` for a bool
mask of x's shape and a number (Gemma3's ``ids = input_ids.clone(); ids[image_mask] = 0``), or ``cat`` of x's
untouched slices and ``v`` for one int or static slice along one dim (a chunked scan's ``out[:, :, i] =
chunk``; ``_setitem_out_of_place``). Anything else stays a write (other indices, writes into inputs, views
or aliased values), and the analysis refuses it where it touches a token value. The pass works on a copy; the user's graph is not changed.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import operator
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from brcompile.passes.axes import example_value, is_inplace

log = logging.getLogger(__name__)

__all__ = ["functionalize"]

#: In-place operator -> its out-of-place twin.
OUT_OF_PLACE_OPERATORS = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv, operator.imod: operator.mod,
    operator.ipow: operator.pow, operator.imatmul: operator.matmul, operator.iand: operator.and_,
    operator.ior: operator.or_, operator.ixor: operator.xor,
}

#: call_function targets whose result is always a new tensor.
ALLOCATING_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.pow,
    operator.matmul, operator.neg,
    torch.add, torch.sub, torch.mul, torch.div, torch.true_divide, torch.matmul, torch.bmm, torch.mm,
    torch.baddbmm, torch.einsum, torch.exp, torch.log, torch.sqrt, torch.rsqrt, torch.tanh, torch.sigmoid,
    torch.softmax, torch.log_softmax, torch.sum, torch.mean, torch.cumsum, torch.where, torch.cat, torch.stack,
    torch.clone, torch.zeros, torch.ones, torch.empty, torch.full, torch.zeros_like, torch.ones_like,
    torch.empty_like, torch.full_like, torch.arange, torch.masked_fill, torch.pow, torch.abs,
    F.linear, torch._C._nn.linear, F.softmax, F.log_softmax, F.silu, F.gelu, F.relu, F.embedding,
    F.layer_norm, F.one_hot, torch.gather, torch.index_select, torch.take_along_dim, F.sigmoid, F.softplus,
    # comparisons: a new bool tensor (``x[x == v] = 0`` reads x into the mask before the write)
    operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
    torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge,
}

#: call_method names whose result is always a new tensor.
ALLOCATING_METHODS = {
    "add", "sub", "mul", "div", "pow", "neg", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "softmax",
    "log_softmax", "sum", "mean", "cumsum", "clone", "masked_fill", "new_zeros", "new_ones", "new_empty",
    "new_full", "abs", "gather", "index_select", "take_along_dim", "__add__", "__sub__", "__mul__",
    "__truediv__", "__radd__", "__rmul__", "__rsub__", "__neg__", "__matmul__",
    "eq", "ne", "lt", "le", "gt", "ge", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
}

#: Ops returning a tuple of new tensors (read through ``getitem``).
ALLOCATING_TUPLES = {torch.topk, torch.sort, torch.max, torch.min, "topk", "sort"}


def _is_fresh(x: Any) -> bool:
    """``x`` is the result of an op that always allocates (module docstring)."""
    if not isinstance(x, fx.Node):
        return False
    if x.op == "call_function" and x.target is operator.getitem:
        src = x.args[0]
        return isinstance(src, fx.Node) and isinstance(x.args[1], int) and (
            src.target in ALLOCATING_TUPLES and src.op in ("call_function", "call_method"))
    if x.op == "call_function":
        return x.target in ALLOCATING_FUNCTIONS and not x.kwargs.get("inplace") and "out" not in x.kwargs
    if x.op == "call_method":
        return x.target in ALLOCATING_METHODS
    return False


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
    """Every reader of ``x`` other than the write either runs after it or allocates its own result."""
    return all(u is write or order[u] > order[write] or _is_fresh(u) for u in x.users)


def functionalize(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with every write into a fresh, unaliased value made out of place (module
    docstring); ``gm`` itself when there is none."""
    writes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and is_inplace(n)]
    if not writes:
        return gm
    copy = fx.GraphModule(gm, _copy_graph(gm.graph))
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
            if (_is_fresh(x) or x in made) and _no_alias_before(x, n, order):
                new = _setitem_out_of_place(n)
                if new is not None:
                    made.add(new)
            continue
        twin = _out_of_place(n)
        if twin is None or not (_is_fresh(x) or x in made) or not _keeps_dtype(twin, x) or not _no_alias_before(x, n, order):
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


def _inverse_permutation(n: fx.Node, order: dict) -> Optional[fx.Node]:
    """``setitem(inv, p, arange(numel(p)))`` into ``inv = empty_like(p)`` read by nothing before it: replaced
    by ``argsort(p)`` (module docstring); the new node, or None when ``n`` is not that write."""
    if n.op != "call_function" or n.target is not operator.setitem or len(n.args) != 3:
        return None
    inv, p, a = n.args
    if not (isinstance(inv, fx.Node) and inv.target in (torch.empty_like, "new_empty") and inv.args
            and inv.args[0] is p and not inv.kwargs and _is_permutation(p)):
        return None
    if not (isinstance(a, fx.Node) and a.target is torch.arange and len(a.args) == 1
            and set(a.kwargs) <= {"device"}):
        return None
    pv, av = example_value(p), example_value(a)
    if not isinstance(av, torch.Tensor) or av.dtype != pv.dtype or tuple(av.shape) != tuple(pv.shape):
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


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    env: dict = {}
    out = new.graph_copy(graph, env)
    new.output(out)
    return new
