"""Views and layout ops: one view algebra, plus indexing, cat/stack and split/chunk.

A layout op moves elements without mixing them, so a TOKEN value stays TOKEN iff its row and position
dims each land on one output dim of their own. The packed graph runs the same op with the token dims'
sizes replaced (row -> 1, position -> N).

View algebra (as DTensor's ``view_groups``): input and output dims are grouped into minimal runs with
equal products. A group holding a token dim must map it to a single output dim of the same extent, every
other dim of the group having extent 1; merging a token dim with other dims (``view(B * H, L, D)``) or
splitting it is refused (TOKEN operands are then materialised).
"""
from __future__ import annotations

import operator
from typing import Optional, Sequence

import torch

from brcompile.passes.analysis.axes import (
    AxesContext, Local, axis_rule, dense_fallback, example_value, get_axes, normalize_dim, shape_of, token,
)
from brcompile.passes.refusals import Code
from brcompile.passes.spellings import arg, spellings


# --------------------------------------------------------------------------------------------------
# view / reshape


def view_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Split two shapes of equal numel into minimal (input dims, output dims) groups of equal product.

    Extent-1 dims form their own groups where they can, so ``[B, L, D] -> [B, L, 1, D]`` maps one to one.
    """
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    n, m = len(in_shape), len(out_shape)
    while i < n or j < m:
        if i < n and j < m and in_shape[i] == out_shape[j]:
            groups.append(([i], [j]))
            i, j = i + 1, j + 1
            continue
        if i < n and in_shape[i] == 1:
            groups.append(([i], []))
            i += 1
            continue
        if j < m and out_shape[j] == 1:
            groups.append(([], [j]))
            j += 1
            continue
        gi, gj = [i], [j]
        pi, pj = in_shape[i], out_shape[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                if i >= n:
                    raise ValueError("shapes do not match")
                pi *= in_shape[i]
                gi.append(i)
                i += 1
            else:
                if j >= m:
                    raise ValueError("shapes do not match")
                pj *= out_shape[j]
                gj.append(j)
                j += 1
        groups.append((gi, gj))
    return groups


def map_token_dims(in_shape, out_shape, dims: Sequence[int]) -> Optional[dict[int, int]]:
    """Output dim of each input token dim through a view, or None when a token dim is merged/split."""
    try:
        groups = view_groups(list(in_shape), list(out_shape))
    except ValueError:
        return None
    mapping = {}
    for d in dims:
        g = next((g for g in groups if d in g[0]), None)
        if g is None or len(g[0]) != 1 or len(g[1]) != 1:
            return None
        mapping[d] = g[1][0]
    return mapping


def emit_reshape(pk, node):
    """``reshape(x, out_shape)`` with the token dims' extents replaced by 1 (row) and N (position)."""
    ax = get_axes(node)
    sizes = pk.static_sizes(node)
    if ax.row is not None:
        sizes[ax.row] = 1
    sizes[ax.pos] = -1 if ax.flat else pk.N()  # a flattened token dim: N·k, the only unknown extent
    return pk.graph.call_method("reshape", (pk.packed(node.args[0]), sizes))


@axis_rule(emit=emit_reshape, local=Local.OWN)
def view(ctx: AxesContext, node):
    """view/reshape/flatten/unflatten: token dims must survive one-to-one (view algebra above)."""
    x = node.args[0]
    ax = get_axes(x)
    if node.target in ("view", "view_as", "reshape_as") and len(node.args) == 2 and not isinstance(
            node.args[1], (int, torch.SymInt, list, tuple, torch.Size)) and not hasattr(node.args[1], "meta"):
        return dense_fallback(ctx, node, "view(dtype) reinterprets bits")
    if not ax.is_token:
        return dense_fallback(ctx, node, "view of a non-token value with token operands")
    ins, outs = shape_of(x), shape_of(node)
    m = None if ax.local else map_token_dims(ins, outs, ax.token_dims())
    if m is None:
        flat = flatten_view(ctx, ax, ins, outs)
        if flat is not None:
            return flat
        if ax.region:
            ctx.fail(Code.TOKEN_LOCAL_REGION,
                     node, f"view {list(ins)} -> {list(outs)} of a value in a sort order of the flattened tokens")
        return dense_fallback(ctx, node, f"view {list(ins)} -> {list(outs)} merges or splits a token dim")
    return token(len(outs), None if ax.row is None else m[ax.row], m[ax.pos], ax.window)


def flatten_view(ctx: AxesContext, ax, ins, outs):
    """Flattening the tokens and unflattening them back (MoE blocks: ``h.view(-1, D)`` … ``reshape(B, L, D)``).

    Row-major order puts the elements of one token together when the token dims lead: an input
    ``[1…, B, L, inner…]`` (row right before position) or ``[1…, B·L·k, inner…]`` (flattened, ``k`` entries per
    token) holds token (b, t)'s ``I`` elements contiguously at ``(b·L + t)·I``. A view to
    ``[1…, e, inner'…]`` with ``e = B·L·k'`` (``k'`` >= 1) therefore gives out entry ``i`` the elements of token
    ``i // k'`` only: a flattened value (``flat = k'``), causal and row-independent entry by entry; ``e = B``
    followed by ``L`` unflattens back to row and position dims. The packed value is the same view of
    ``[1…, N·k, inner…]`` (``N`` tokens in place of ``B·L``). Only a whole window, in natural order, is
    flattened (a sorted or sliced token dim has no such layout)."""
    if ax.order is not None or ax.points is not None or ax.groups is not None or not ax.window.is_whole:
        return None
    lead = ax.row if ax.row is not None else ax.pos
    if ax.row is not None and ax.pos != ax.row + 1:
        return None
    if any(ins[d] != 1 for d in range(lead)):
        return None
    BL = ctx.B * ctx.L
    j = next((j for j, e in enumerate(outs) if e != 1), None)
    if j is None or any(outs[d] != 1 for d in range(j)):
        return None
    if j + 1 < len(outs) and outs[j] == ctx.B and outs[j + 1] == ctx.L:
        return token(len(outs), j, j + 1, ax.window)
    if outs[j] % BL == 0:
        return token(len(outs), None, j, ax.window, flat=outs[j] // BL)
    return None


def emit_expand(pk, node):
    """The expand on the packed value: its token dims keep their packed extents (-1; a row dim that is new,
    ``broadcast_row``, is 1)."""
    ax = get_axes(node)
    sizes = pk.static_sizes(node)
    off = len(sizes) - get_axes(node.args[0]).ndim
    for d in ax.token_dims():
        sizes[d] = -1 if d >= off else 1
    return pk.graph.call_method("expand", (pk.packed(node.args[0]), sizes))


def broadcast_row(ctx: AxesContext, ax, ins, outs) -> Optional[int]:
    """The row dim a position-only value (``ax.row`` None) gets when it is broadcast over the rows: the one
    output dim of extent B that is new or of extent 1 in the input (``ins`` right-aligned in ``outs``), other
    than its position dim (``arange(L)[None].expand(B, -1)``, Qwen's ``positions.expand(3, B, -1)``). The
    value is the same at every index of a broadcast dim, so its dense value at (b, t) is its value at t
    whatever b is: the packed invariant holds with that dim as the row dim (packed extent 1). Taking it as a
    row dim, rather than as a feature dim of extent B that the packed value would keep, is what lets it meet
    a value with a row dim (q·cos) and keeps every packed extent free of B. None when no dim (or several,
    B > 1 only) is such a dim."""
    if ax.row is not None or ctx.B <= 1 or ax.local:
        return None
    off = len(outs) - len(ins)
    cands = [d for d in range(len(outs)) if d != ax.pos + off and outs[d] == ctx.B
             and (d < off or ins[d - off] == 1)]
    return cands[0] if len(cands) == 1 else None


@axis_rule(emit=emit_expand, local=Local.CARRY)
def expand(ctx: AxesContext, node):
    """expand: new leading dims and extent-1 dims broadcast; token dims keep their place (shifted by the
    number of new leading dims) and must not be expanded themselves. A position-only value broadcast over
    the rows gets that dim as its row dim (``broadcast_row``)."""
    x = node.args[0]
    ax = get_axes(x)
    if not ax.is_token:  # expand_as(constant, token value): the token value only gives the (dense) shape
        return dense_fallback(ctx, node, "expand of a value without token dims to a token value's shape")
    ins, outs = shape_of(x), shape_of(node)
    off = len(outs) - len(ins)
    for d in ax.token_dims():
        if ins[d] != outs[d + off]:
            return dense_fallback(ctx, node, "expand of a token dim")
    row = broadcast_row(ctx, ax, ins, outs)
    return token(len(outs), row if ax.row is None else ax.row + off, ax.pos + off, ax.window)


# --------------------------------------------------------------------------------------------------
# permutations and unit dims


def _perm_of(node, ndim: int) -> list[int]:
    t = node.target
    a = list(node.args[1:])
    if t in spellings("transpose"):
        d0, d1 = (normalize_dim(a[0], ndim), normalize_dim(a[1], ndim)) if a else (
            node.kwargs["dim0"], node.kwargs["dim1"])
        p = list(range(ndim))
        p[d0], p[d1] = p[d1], p[d0]
        return p
    if t in ("permute", torch.permute):
        dims = a[0] if len(a) == 1 and isinstance(a[0], (list, tuple)) else a
        if not dims:
            dims = node.kwargs["dims"]
        return [normalize_dim(d, ndim) for d in dims]
    if t in ("t",):
        return [1, 0] if ndim == 2 else list(range(ndim))
    if t in ("movedim", torch.movedim):
        src, dst = a[0], a[1]
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        src = [normalize_dim(s, ndim) for s in src]
        dst = [normalize_dim(s, ndim) for s in dst]
        order = [None] * ndim
        for s, d in zip(src, dst):
            order[d] = s
        rest = iter([i for i in range(ndim) if i not in src])
        return [o if o is not None else next(rest) for o in order]
    raise AssertionError(t)


@axis_rule(local=Local.CARRY)
def permute(ctx: AxesContext, node):
    """Permutations: output dim i is input dim perm[i]."""
    ax = get_axes(node.args[0])
    perm = _perm_of(node, ax.ndim)
    inv = {p: i for i, p in enumerate(perm)}
    return token(ax.ndim, None if ax.row is None else inv[ax.row], inv[ax.pos], ax.window)


@axis_rule(local=Local.CARRY)
def unsqueeze(ctx: AxesContext, node):
    """unsqueeze(d): dims at or after d shift by one."""
    ax = get_axes(node.args[0])
    d = node.args[1] if len(node.args) > 1 else node.kwargs["dim"]
    d = normalize_dim(d, ax.ndim + 1)
    sh = lambda x: None if x is None else (x + 1 if x >= d else x)  # noqa: E731
    return token(ax.ndim + 1, sh(ax.row), sh(ax.pos), ax.window)


def emit_squeeze(pk, node):
    ax = get_axes(node.args[0])
    dims = _squeezed(node, ax)
    return pk.graph.call_method("squeeze", (pk.packed(node.args[0]), tuple(dims)))


def _squeezed(node, ax) -> list[int]:
    shp = shape_of(node.args[0])
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dim is None:
        return [i for i, s in enumerate(shp) if s == 1]
    dims = [dim] if isinstance(dim, int) else list(dim)
    return [normalize_dim(d, ax.ndim) for d in dims if shp[normalize_dim(d, ax.ndim)] == 1]


@axis_rule(emit=emit_squeeze, local=Local.CARRY)
def squeeze(ctx: AxesContext, node):
    """squeeze: removes extent-1 dims; squeezing a token dim (B == 1 or L == 1) is refused."""
    ax = get_axes(node.args[0])
    dims = _squeezed(node, ax)
    if any(d in ax.token_dims() for d in dims):
        return dense_fallback(ctx, node, "squeeze of a token dim of extent 1")
    sh = lambda x: None if x is None else x - sum(1 for d in dims if d < x)  # noqa: E731
    return token(ax.ndim - len(dims), sh(ax.row), sh(ax.pos), ax.window)


def emit_repeat(pk, node):
    """``x.repeat(sizes)`` on the packed value: the token dims' repeats are 1, so the sizes stand, but for a
    row dim the repeat made (``broadcast_row``): 1 there."""
    ax, x = get_axes(node), get_axes(node.args[0])
    if x.row is not None or ax.row is None:
        return pk.copy(node)
    reps = list(node.args[1:])
    if len(reps) == 1 and isinstance(reps[0], (list, tuple, torch.Size)):
        reps = list(reps[0])
    if not reps:
        reps = list(node.kwargs.get("repeats", ()))
    reps[ax.row] = 1
    return pk.graph.call_method("repeat", (pk.packed(node.args[0]), tuple(reps)))


@axis_rule(emit=emit_repeat, local=Local.CARRY)
def repeat(ctx: AxesContext, node):
    """``x.repeat(r_0, …, r_k)`` tiles x: output element ``[i_0, …]`` is ``x[i_0 % s_0, …]`` (leading
    repeats add dims). With a repeat of 1 on each token dim, the element at a token dim's coordinate t
    reads x at t itself — the same (row, position) — so the value stays causal and row-independent
    (``torch.outer(t, theta).repeat(1, 2)`` of a position value, a rotary cache). Repeating a token dim
    would copy other positions or rows in: materialised."""
    ax = get_axes(node.args[0])
    reps = list(node.args[1:])
    if len(reps) == 1 and isinstance(reps[0], (list, tuple, torch.Size)):
        reps = list(reps[0])
    if not reps:
        reps = list(node.kwargs.get("repeats", ()))
    off = len(reps) - ax.ndim
    if off < 0 or any(hasattr(r, "meta") for r in reps):
        return dense_fallback(ctx, node, "repeat with symbolic or too few repeats")
    if any(reps[d + off] != 1 for d in ax.token_dims()):
        return dense_fallback(ctx, node, "repeat along a token dim")
    row = broadcast_row(ctx, ax, [1] * off + list(shape_of(node.args[0])), shape_of(node))
    return token(ax.ndim + off, row if ax.row is None else ax.row + off, ax.pos + off, ax.window)


@axis_rule()
def view_as_complex(ctx: AxesContext, node):
    """``view_as_complex(x)``: ``[..., 2]`` real pairs -> ``[...]`` complex; an element pairs two numbers
    of one (row, position), so token dims (never the last dim) stay where they are."""
    ax = get_axes(node.args[0])
    if ax.ndim - 1 in ax.token_dims():
        return dense_fallback(ctx, node, "view_as_complex over a token dim")
    return token(ax.ndim - 1, ax.row, ax.pos, ax.window)


@axis_rule()
def view_as_real(ctx: AxesContext, node):
    """``view_as_real(z)``: ``[...]`` complex -> ``[..., 2]`` real; a new last dim, token dims stay."""
    ax = get_axes(node.args[0])
    return token(ax.ndim + 1, ax.row, ax.pos, ax.window)


@axis_rule(local=Local.OWN)
def repeat_interleave(ctx: AxesContext, node):
    """repeat_interleave(n, dim) along a non-token dim (GQA's repeat_kv written this way): output index
    i along ``dim`` reads input index ``i // n`` there, and the same coordinates elsewhere, so token dims
    keep their coordinates (a repeat along a token dim would copy positions: materialised)."""
    ax = get_axes(node.args[0])
    dim = arg(node, 2, "dim")
    reps = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
    if ax.flat and ax.order is None and dim is not None and isinstance(reps, int) and \
            normalize_dim(dim, ax.ndim) == ax.pos:
        # along the flattened token dim: out entry i reads entry i // reps, so each of a token's k·reps
        # entries reads that token only (batched experts: one copy of the hidden state per top-k slot)
        return token(ax.ndim, None, ax.pos, ax.window, flat=ax.flat * reps)
    if ax.region:
        ctx.fail(Code.TOKEN_LOCAL_REGION, node, "repeat_interleave of a value in a sort order of the flattened tokens")
    if dim is None or hasattr(reps, "meta") or normalize_dim(dim, ax.ndim) in ax.token_dims():
        return dense_fallback(ctx, node, "repeat_interleave over a token dim")
    return ax


# --------------------------------------------------------------------------------------------------
# indexing


def _normalize_index(idx, ndim: int) -> Optional[list]:
    """Expand an index tuple to one entry per consumed input dim plus ``None`` insertions.

    Returns a list of entries: slice, int, or None (new dim); None if it holds tensors/bools/Ellipsis twice.
    """
    if not isinstance(idx, tuple):
        idx = (idx,)
    if any(hasattr(i, "meta") or isinstance(i, (torch.Tensor, list, bool)) for i in idx):
        return None
    n_consumed = sum(1 for i in idx if i is not None and i is not Ellipsis)
    out = []
    seen_ellipsis = False
    for i in idx:
        if i is Ellipsis:
            if seen_ellipsis:
                return None
            seen_ellipsis = True
            out.extend([slice(None)] * (ndim - n_consumed))
        else:
            out.append(i)
    consumed = sum(1 for i in out if i is not None)
    out.extend([slice(None)] * (ndim - consumed))
    return out


def _walk_index(entries):
    """Yield (input dim or None, output dim or None, entry) for a normalised index."""
    d_in = d_out = 0
    for e in entries:
        if e is None:
            yield None, d_out, e
            d_out += 1
        elif isinstance(e, slice):
            yield d_in, d_out, e
            d_in += 1
            d_out += 1
        else:
            yield d_in, None, e
            d_in += 1


def _constant_array_index(idx, ndim: int):
    """``(entries, marker, array)`` when ``idx`` holds exactly one *constant 1-D integer array* (a list of ints,
    or a CONST integer tensor of rank 1: Falcon's fused ``qkv[..., [-2], :]``) and otherwise only slices, None
    and Ellipsis: ``entries`` is the normalised index with the array replaced by ``marker`` (a slice object
    compared by identity). With a single array index and no integer index, torch keeps the dims in place:
    the array's dim becomes one output dim of extent ``len(array)`` at the same place, every other dim moves
    as under basic indexing. None otherwise (several arrays, an array beside an int, a bool mask, ...)."""
    items = list(idx) if isinstance(idx, tuple) else [idx]
    arrays = [i for i, e in enumerate(items) if not (e is None or e is Ellipsis or isinstance(e, slice))]
    if len(arrays) != 1:
        return None
    arr = items[arrays[0]]
    if isinstance(arr, list):
        if not arr or any(type(v) is not int for v in arr):
            return None
    else:
        v = example_value(arr)
        if not (hasattr(arr, "meta") and get_axes(arr).is_const and isinstance(v, torch.Tensor) and v.dim() == 1
                and v.dtype in (torch.int64, torch.int32)):
            return None
    marker = slice(None, None, None)
    items[arrays[0]] = marker
    entries = _normalize_index(tuple(items), ndim)
    return None if entries is None else (entries, marker, arr)


def emit_getitem(pk, node):
    """The same index on the packed data, with token dims left whole (their slicing went to the index)."""
    x = node.args[0]
    ax = get_axes(x)
    if isinstance(example_value(x), (tuple, list)) or not ax.is_token:
        return pk.copy(node)  # an element of a split/chunk result, or a constant looked up by token values
    entries = _normalize_index(node.args[1], ax.ndim)
    array = None if entries is not None or ax.local else _constant_array_index(node.args[1], ax.ndim)
    if array is not None:
        entries = array[0]
    elif entries is None or ax.local:  # a gather inside a token-local region (rules/moe.py): the same index
        return pk.copy(node)
    new = []
    for d_in, _, e in _walk_index(entries):
        if array is not None and e is array[1]:
            new.append(pk.packed(array[2]))
        else:
            new.append(slice(None) if d_in is not None and d_in in ax.token_dims() else e)
    return pk.graph.call_function(operator.getitem, (pk.packed(x), tuple(new)))


def _keeps_all(s: slice, n: int) -> bool:
    """Whether slice ``s`` of a dim of extent ``n`` is the identity (``[:]``, ``[0:]``, ``[-n:]``, ``[:n]``):
    OPT's ``position_ids[:, past_key_values_length:]``, HF's ``attention_mask[:, -seq_len:]``. Int bounds only."""
    if s == slice(None):
        return True
    start_ok = s.start is None or (isinstance(s.start, int) and (s.start == 0 or s.start <= -n))
    stop_ok = s.stop is None or (isinstance(s.stop, int) and s.stop >= n)
    return start_ok and stop_ok and s.step in (None, 1)


@axis_rule(emit=emit_getitem, local=Local.OWN)
def getitem(ctx: AxesContext, node):
    """Basic indexing. Non-token dims: as is. A token dim: a whole slice keeps it; a partial slice on the
    position dim (``logits[:, :-1]``) or on the row dim goes to the lazy window — the packed data stays
    whole and the ``[B, L]`` index is sliced; an int or a tensor index on a token dim materialises. One
    constant integer array on a non-token dim (``qkv[..., [-2], :]``) selects along that dim only: each
    output element is one element of the same token, so the token dims stay (``_constant_array_index``)."""
    x = node.args[0]
    ax = get_axes(x)
    if isinstance(example_value(x), (tuple, list)):
        if ax.is_token and ax.points == ("pair",):  # (values, indices) of a sort along the flattened tokens
            from brcompile.passes.analysis.rules import moe
            return moe.sort_output(ctx, node)
        return ax  # an element of a split/chunk result: same fact as its siblings
    if not ax.is_token:
        return _lookup(ctx, node)
    entries = _normalize_index(node.args[1], ax.ndim)
    array = None if entries is not None or ax.local else _constant_array_index(node.args[1], ax.ndim)
    if array is not None:
        entries = array[0]  # one constant array on a dim: that dim is selected in place (_constant_array_index)
    elif entries is None or ax.local:
        if ax.local:
            from brcompile.passes.analysis.rules import moe
            return moe.region_getitem(ctx, node)
        return dense_fallback(ctx, node, "advanced indexing of a token value")
    window = ax.window
    row = pos = None
    for d_in, d_out, e in _walk_index(entries):
        if d_in is None or d_in not in ax.token_dims():
            continue
        if array is not None and e is array[1]:
            return dense_fallback(ctx, node, "indexing a token dim by an array")
        if d_out is None:
            return dense_fallback(ctx, node, "integer index on a token dim")
        if not _keeps_all(e, shape_of(x)[d_in]):
            if ax.row is None:
                return dense_fallback(ctx, node, "slicing a position-only value")
            window = window.sliced("row" if d_in == ax.row else "pos", e)
        if d_in == ax.row:
            row = d_out
        else:
            pos = d_out
    out_ndim = len(shape_of(node))
    return token(out_ndim, row, pos, window)


def _lookup(ctx: AxesContext, node):
    """``table[idx]`` — a constant indexed along one dim by an integer TOKEN value (gpt-fast's
    ``freqs_cis[input_pos]``, GPT-J's ``embed_positions[position_ids]``): like ``embedding``, the output
    at idx's coordinates is the table's slice ``idx[...]``, a function of that one element of idx, so
    idx's token dims pass through (placed where the indexed dim was; only whole slices may precede it,
    and only whole slices or nothing follow it)."""
    x, idx = node.args[0], node.args[1]
    entries = list(idx) if isinstance(idx, tuple) else [idx]
    toks = [i for i, e in enumerate(entries) if hasattr(e, "meta") and get_axes(e).is_token]
    if len(toks) != 1 or not get_axes(x).is_const:
        return dense_fallback(ctx, node, "indexing a constant by several or dense indices")
    d = toks[0]
    if any(e != slice(None) for e in entries[:d] + entries[d + 1:]):
        return dense_fallback(ctx, node, "indexing a constant by a token value beside other indices")
    ix = entries[d]
    v = example_value(ix)
    if not isinstance(v, torch.Tensor) or v.dtype not in (torch.int64, torch.int32) or v.dim() == 0:
        return dense_fallback(ctx, node, "indexing a constant by a non-integer or 0-D token value")
    ax = get_axes(ix)
    if ax.points is not None or ax.groups is not None:
        ctx.fail(Code.TOKEN_LOCAL_REGION,
                 node, "a constant indexed by a permutation index or group offsets of a token-local region")
    sh = lambda a: None if a is None else a + d  # noqa: E731
    # a flattened (or sorted) index keeps its layout: entry e reads the table at e's own key
    return token(len(shape_of(node)), sh(ax.row), sh(ax.pos), ax.window, flat=ax.flat, order=ax.order)


# --------------------------------------------------------------------------------------------------
# cat / stack / split / chunk / unbind


def _same_token_facts(ctx, node, tensors):
    facts = [get_axes(t) for t in tensors]
    if not all(f.is_token for f in facts) or len({(f.row, f.pos, f.window, f.ndim) for f in facts}) != 1:
        return None
    return facts[0]


@axis_rule(local=Local.CARRY)
def cat(ctx: AxesContext, node):
    """cat along a non-token dim of operands that are all TOKEN with the same token dims (rotary halves);
    along any dim when every other operand is an empty constant (appending to an empty KV cache)."""
    tensors = node.args[0] if node.args else node.kwargs["tensors"]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    # Empty constants (an empty KV cache: torch.tensor([]) or size 0 along dim) contribute nothing.
    live = [t for t in tensors if not _is_empty_const(t, dim)]
    f = _same_token_facts(ctx, node, live)
    if f is None or (len(live) > 1 and normalize_dim(dim, f.ndim) in f.token_dims()):
        return dense_fallback(ctx, node, "cat of mixed operands or along a token dim")
    return f


def _is_empty_const(t, dim) -> bool:
    shp = shape_of(t)
    if shp is None or not get_axes(t).is_const:
        return False
    return shp == (0,) or (len(shp) > 0 and shp[normalize_dim(dim, len(shp))] == 0)


@axis_rule(local=Local.CARRY)
def stack(ctx: AxesContext, node):
    """stack inserts a new dim at ``dim``; token dims at or after it shift by one."""
    tensors = node.args[0] if node.args else node.kwargs["tensors"]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    f = _same_token_facts(ctx, node, tensors)
    if f is None:
        return dense_fallback(ctx, node, "stack of mixed operands")
    d = normalize_dim(dim, f.ndim + 1)
    sh = lambda x: None if x is None else (x + 1 if x >= d else x)  # noqa: E731
    return token(f.ndim + 1, sh(f.row), sh(f.pos), f.window)


@axis_rule(local=Local.CARRY)
def split(ctx: AxesContext, node):
    """split/chunk along a non-token dim: every piece keeps the token dims (the tuple's fact is the
    pieces' fact). ``torch.Tensor.split`` is how Dynamo records ``x.split([sizes], dim)`` (a Python method)."""
    ax = get_axes(node.args[0])
    dim = arg(node, 2, "dim", 0)
    if normalize_dim(dim, ax.ndim) in ax.token_dims():
        return dense_fallback(ctx, node, "split along a token dim")
    return ax


@axis_rule(local=Local.CARRY)
def unbind(ctx: AxesContext, node):
    """unbind(dim) along a non-token dim: pieces lose that dim."""
    ax = get_axes(node.args[0])
    dim = normalize_dim(arg(node, 1, "dim", 0), ax.ndim)
    if dim in ax.token_dims():
        return dense_fallback(ctx, node, "unbind along a token dim")
    sh = lambda x: None if x is None else (x - 1 if x > dim else x)  # noqa: E731
    return token(ax.ndim - 1, sh(ax.row), sh(ax.pos), ax.window)


@axis_rule(local=Local.CARRY)
def slice_scatter(ctx: AxesContext, node):
    """``slice_scatter(x, src, d, start, stop, step)`` / ``select_scatter(x, src, d, i)``: x with its slice
    (or its index i) along dim d replaced by ``src`` (an in-place write into a view, made out of place by
    passes/lower/functionalize.py). Along a non-token dim d, the output at the token coordinates (b, t) holds x's
    and src's elements at the same (b, t) only, so with x and src TOKEN with the same token dims (src's
    shifted down past a selected d) and window, the output is TOKEN with x's fact and the same op on the
    packed operands computes it. Otherwise (a write along a token dim, a constant or dense operand, whose
    dense extents on the token dims the packed value does not have) it is materialised."""
    args = dict(zip(("input", "src", "dim"), node.args))
    args.update(node.kwargs)
    x, src, dim = args.get("input"), args.get("src"), args.get("dim", 0)
    ax, sx = get_axes(x), get_axes(src)
    if not (ax.is_token and sx.is_token) or not isinstance(dim, int):
        return dense_fallback(ctx, node, "a slice written into a value, not both token values")
    d = normalize_dim(dim, ax.ndim)
    if d in ax.token_dims():
        return dense_fallback(ctx, node, "a slice written along a token dim")
    select = node.target in (torch.select_scatter, "select_scatter")
    sh = (lambda k: None if k is None else (k - 1 if k > d else k)) if select else (lambda k: k)  # noqa: E731
    if (sx.ndim, sx.row, sx.pos, sx.window) != (ax.ndim - select, sh(ax.row), sh(ax.pos), ax.window):
        return dense_fallback(ctx, node, "a slice written from a value with other token dims")
    return token(ax.ndim, ax.row, ax.pos, ax.window)


__all__ = ["view_groups", "map_token_dims"]
