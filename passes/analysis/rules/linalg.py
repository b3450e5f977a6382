"""Linear algebra that contracts over a non-token dim: linear, matmul/bmm with a constant, einsum, embedding.

``linear(x, W)[..., o] = sum_i x[..., i] W[o, i]``: each output element reads one input "row vector"
(the same leading coordinates), so the token dims of ``x`` pass through when neither is the contracted
(last) dim and ``W`` is a constant. ``embedding(ids, W)[..., :] = W[ids[...]]`` is a lookup per element.
A product of two TOKEN values (``q @ k^T``) mixes positions: that is attention, handled elsewhere.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Optional

import torch
import torch.fx as fx

from brcompile.passes.analysis.axes import AxesContext, Local, axis_rule, dense_fallback, get_axes, shape_of, token
from brcompile.passes.spellings import BROADCASTS, SAME_VALUE, family_of, names, op_name, spellings


@dataclasses.dataclass(frozen=True)
class Narrow:
    """The note (``AxesContext.note``) of a product of a TOKEN operand and a constant ``const`` broadcast along
    output token dims (:func:`_product`): ``const``'s ``dims`` hold the same values at every index, so the
    packed product reads it narrowed to extent 1 there (:func:`emit_product`)."""

    const: fx.Node
    dims: tuple[int, ...]


@axis_rule(local=Local.CARRY)
def linear(ctx: AxesContext, node):
    """linear(x, W, b): token dims of x must not be its last (contracted) dim; W, b constant."""
    x = node.args[0]
    ax = get_axes(x)
    others = list(node.args[1:]) + list(node.kwargs.values())
    if not ax.is_token or any(get_axes(o).is_token or get_axes(o).is_dense for o in others):
        return dense_fallback(ctx, node, "linear with a non-constant weight")
    if ax.ndim - 1 in ax.token_dims():
        return dense_fallback(ctx, node, "linear contracts a token dim")
    return token(ax.ndim, ax.row, ax.pos, ax.window)


def _matmul_dims(sa, sb) -> Optional[tuple[int, dict, dict]]:
    """(R, out dim of each dim of a, of each dim of b) for ``matmul(a, b)`` with shapes ``sa``, ``sb``;
    contracted dims map to None. None for a 0-D operand."""
    na, nb = len(sa), len(sb)
    if na == 0 or nb == 0:
        return None
    if na == 1 and nb == 1:
        return 0, {0: None}, {0: None}
    if nb == 1:  # [..., K] @ [K] -> [...]
        return na - 1, {d: (d if d < na - 1 else None) for d in range(na)}, {0: None}
    if na == 1:  # [K] @ [..., K, M] -> [..., M]
        R = nb - 1
        return R, {0: None}, {d: (d if d < nb - 2 else (R - 1 if d == nb - 1 else None)) for d in range(nb)}
    R = max(na, nb)
    da = {d: (d + R - na if d < na - 2 else (R - 2 if d == na - 2 else None)) for d in range(na)}
    db = {d: (d + R - nb if d < nb - 2 else (R - 1 if d == nb - 1 else None)) for d in range(nb)}
    return R, da, db


#: the names of :data:`SAME_VALUE` and :data:`BROADCASTS` (the walk compares ``op_name``)
_COPIES = names(SAME_VALUE)
_BROADCASTS = names(BROADCASTS)


def invariant_along(node, dim: int) -> bool:
    """Whether the value of ``node`` is the same at every index of its ``dim``: it is made by ``expand`` /
    ``expand_as`` / ``broadcast_to`` from extent 1 there (or from a new leading dim), through casts and copies
    (``inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)``, HF's rotary with per-row
    ``position_ids``: a constant broadcast over the rows)."""
    n = node
    while isinstance(n, fx.Node) and n.op in ("call_function", "call_method") and n.args:
        if family_of(n) == "cast" or op_name(n) in _COPIES:
            n = n.args[0]
            continue
        if op_name(n) not in _BROADCASTS:
            return False
        ins, outs = shape_of(n.args[0]), shape_of(n)
        if ins is None or outs is None:
            return False
        off = len(outs) - len(ins)
        if dim < off or ins[dim - off] == 1:
            return True
        n, dim = n.args[0], dim - off
    return False


def _narrowed_args(pk, node):
    """``node``'s arguments on packed operands, a constant that is broadcast along an output token dim
    (:func:`_product`'s note) narrowed to its first index there: the same values, extent 1 as packed."""
    note = pk.note(node, Narrow)
    const, dims = (note.const, note.dims) if note is not None else (None, ())

    def arg(a):
        v = pk.packed(a)
        if a is const:
            for d in dims:
                v = pk.graph.call_method("narrow", (v, d, 0, 1))
        return v

    return fx.node.map_aggregate((node.args, node.kwargs), lambda a: arg(a) if isinstance(a, fx.Node) else a)


def emit_product(pk, node):
    """The same product on packed operands, a constant broadcast along a token dim narrowed there."""
    args, kwargs = _narrowed_args(pk, node)
    return pk.graph.create_node(node.op, node.target, tuple(args), dict(kwargs))


@axis_rule(emit=emit_product, local=Local.CARRY)
def matmul(ctx: AxesContext, node):
    """matmul/bmm/mm of one TOKEN operand and one constant, in either order: ``out[..., i, j] = sum_k a[..., i,
    k] b[..., k, j]``. Each output element reads one row of ``a`` and one column of ``b`` at the same
    (broadcast) batch coordinates, so a TOKEN operand keeps a token dim that is a batch dim, ``a``'s row
    dim (``h @ W``) or ``b``'s column dim (``inv_freq[None, :, None] @ position_ids[:, None, :]``, HF's
    rotary: the column is the position) — never the contracted dim. The constant must have extent 1 at
    the output's token dims (a constant batch indexed by row or position would depend on dense
    coordinates) or be the same at every index there (:func:`invariant_along`: a broadcast, narrowed to extent
    1 in the packed graph). Two TOKEN operands (``q @ k^T``) mix positions: that is attention, handled by the
    eager canonicalisation; here they are materialised."""
    return _product(ctx, node, node.args[0], node.args[1])


def _product(ctx: AxesContext, node, a, b):
    """The fact of ``a @ b`` computed by ``node`` (matmul's proof above), or the dense fallback."""
    fa, fb = get_axes(a), get_axes(b)
    sa, sb, out = shape_of(a), shape_of(b), shape_of(node)
    if fa.is_token and fb.is_token and None not in (sa, sb, out):
        batched = _batched_token_matmul(sa, sb, fa, fb)
        if batched is not None:
            return batched
    if fa.is_token == fb.is_token or fa.is_dense or fb.is_dense or None in (sa, sb, out):
        return dense_fallback(ctx, node, "matmul of two token values (attention scores) or of a dense value")
    dims = _matmul_dims(sa, sb)
    if dims is None:
        return dense_fallback(ctx, node, "matmul of a 0-D value")
    R, da, db = dims
    tok, tdims, const, cshape, cdims = (fa, da, b, sb, db) if fa.is_token else (fb, db, a, sa, da)
    if any(tdims[d] is None for d in tok.token_dims()):
        return dense_fallback(ctx, node, "matmul contracts a token dim")
    out_tok = {tdims[d] for d in tok.token_dims()}
    narrow = []
    for d, o in cdims.items():
        if o in out_tok and cshape[d] != 1:
            if not invariant_along(const, d):
                return dense_fallback(ctx, node, "matmul with a constant that is not broadcast along a token dim")
            narrow.append(d)
    if narrow:
        ctx.set_note(node, Narrow(const, tuple(narrow)))
    return token(R, None if tok.row is None else tdims[tok.row], tdims[tok.pos], tok.window)


def _addmm_operands(args, kwargs) -> list:
    """``[c, a, b, beta, alpha]`` of ``addmm(c, a, b, beta=, alpha=)`` / ``baddbmm(c, batch1, batch2, …)`` in any
    spelling (``c.baddbmm(a, b)`` has the same positions: the receiver is the addend); None where absent."""
    names = (("input",), ("mat1", "batch1"), ("mat2", "batch2"), ("beta",), ("alpha",))
    out = []
    for i, keys in enumerate(names):
        v = args[i] if len(args) > i else None
        for k in keys:
            v = kwargs.get(k, v)
        out.append(v)
    return out


def emit_addmm(pk, node):
    """``addmm`` as is; ``baddbmm(c, a, b, beta=β, alpha=α)`` as ``β·c + α·bmm(a, b)`` on the packed
    operands: the same sum (a reassociation at most), but torch's ``baddbmm`` kernel needs concrete sizes under
    fake tensors, which would tie the packed graph to the example batch's N (passes/emit/check.py)."""
    args, kwargs = _narrowed_args(pk, node)
    if node.target not in spellings("baddbmm"):
        return pk.graph.create_node(node.op, node.target, tuple(args), dict(kwargs))
    c, a, b, beta, alpha = _addmm_operands(args, kwargs)
    g = pk.graph
    prod = g.call_function(torch.bmm, (a, b))
    if alpha not in (None, 1):
        prod = g.call_function(operator.mul, (prod, alpha))
    if beta not in (None, 1):
        c = g.call_function(operator.mul, (c, beta))
    return g.call_function(operator.add, (c, prod))


@axis_rule(emit=emit_addmm, local=Local.CARRY)
def addmm(ctx: AxesContext, node):
    """``addmm(c, a, b, beta=β, alpha=α) = β·c + α·(a @ b)`` (GPT-2's ``Conv1D``: ``addmm(bias, x.view(-1, D),
    W)`` of flattened tokens) and its batched twin ``baddbmm`` (RecurrentGemma's block-diagonal gates:
    ``baddbmm(bias[:, None, :], x_flat.view(n, H, W).permute(1, 0, 2), W)``, a per-head ``mm`` whose row dim
    is the flattened tokens). The product keeps a token dim exactly as ``mm``/``bmm`` do (matmul above); the sum
    then is a pointwise op of the product and ``c`` broadcast to ``[n, m]``, so it keeps the product's fact
    when ``c`` is a constant with extent 1 along the product's token dims (a bias ``[m]``) or a TOKEN value
    with the product's own token dims and window (a residual). β and α must be constants: they scale every
    element alike. Anything else is materialised."""
    c, a, b, *scalars = _addmm_operands(node.args, node.kwargs)
    if any(not get_axes(s).is_const for s in scalars):
        return dense_fallback(ctx, node, "addmm with a per-token beta or alpha")
    prod = _product(ctx, node, a, b)
    if not prod.is_token:
        return prod
    fc, sc = get_axes(c), shape_of(c)
    if fc.is_token:
        same = fc.ndim == prod.ndim and (fc.row, fc.pos, fc.window) == (prod.row, prod.pos, prod.window)
        return prod if same else dense_fallback(ctx, node, "addmm of a token value not aligned with the product")
    if fc.is_dense or sc is None:
        return dense_fallback(ctx, node, "addmm with a dense addend")
    off = prod.ndim - len(sc)
    if any(d - off >= 0 and sc[d - off] != 1 for d in prod.token_dims()):
        return dense_fallback(ctx, node, "addmm with a constant addend that is not broadcast along a token dim")
    return prod


def _batched_token_matmul(sa, sb, fa, fb):
    """Two TOKEN operands whose token dims are the same *batch* dims of the product (a per-token matmul:
    ``bmm(W[expert_ids], h.unsqueeze(-1))`` of batched experts): output element ``[z, i, j]`` reads only
    ``a[z, i, :]`` and ``b[z, :, j]`` at the same batch coordinates z, so when both operands put their row and
    position (same layout and window) on the same output batch dims, each output element reads one token —
    of the same (row, position) — in both operands. None otherwise (attention scores ``q @ kᵀ``)."""
    dims = _matmul_dims(sa, sb)
    if dims is None:
        return None
    R, da, db = dims
    if (fa.flat, fa.order, fa.window) != (fb.flat, fb.order, fb.window):
        return None
    ta = [da[d] for d in fa.token_dims()]
    tb = [db[d] for d in fb.token_dims()]
    if None in ta or ta != tb or any(o >= R - 2 for o in ta) or len(sa) < 3 or len(sb) < 3:
        return None
    if (fa.row is None) != (fb.row is None) or any(sa[d] != sb[d + len(sb) - len(sa)] for d in fa.token_dims()
                                                    if 0 <= d + len(sb) - len(sa) < len(sb)):
        return None
    return token(R, None if fa.row is None else da[fa.row], da[fa.pos], fa.window)


def _einsum_operands(node):
    eq = node.args[0]
    ops = list(node.args[1:])
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    return eq, ops


@axis_rule(local=Local.CARRY)
def einsum(ctx: AxesContext, node):
    """einsum with an explicit output (``"i , j -> i j"``, ``"bld,od->blo"``): an output element is a sum
    over the contracted letters of products of operand elements at the output's coordinates. When every
    TOKEN operand carries its row and position on the same letters, those letters are kept in the output
    and are absent from the constants, each output element reads only its own (row, position) of the
    TOKEN operands — causal and row-independent, like a pointwise op. Contracting a token letter (``q``
    against ``k`` in attention scores) mixes positions: materialised. Flattened tokens (one letter on the
    flat dim of every TOKEN operand, all in one layout: gpt-fast's ``einsum("ti,taoi->tao", x, w1[idx])``
    over per-token expert weights) keep their layout, entry by entry, like a pointwise op."""
    eq, ops = _einsum_operands(node)
    if not isinstance(eq, str) or "->" not in eq or "." in eq:
        return dense_fallback(ctx, node, "einsum without an explicit output or with an ellipsis")
    lhs, rhs = eq.replace(" ", "").split("->")
    terms = lhs.split(",")
    if len(terms) != len(ops):
        return dense_fallback(ctx, node, "einsum operands do not match the equation")
    letters = None
    window = None
    for t, o in zip(terms, ops):
        ax = get_axes(o)
        if ax.is_dense:
            return dense_fallback(ctx, node, "einsum of a dense value")
        if not ax.is_token:
            continue
        if len(t) != ax.ndim or len(set(t)) != len(t):
            return dense_fallback(ctx, node, "einsum with a repeated letter on a token value")
        mine = (None if ax.row is None else t[ax.row], t[ax.pos])
        if letters is not None and (mine[1] != letters[1] or (None not in (mine[0], letters[0])
                                                              and mine[0] != letters[0])):
            return dense_fallback(ctx, node, "einsum contracting or mixing token dims (attention scores?)")
        if window is not None and ax.window != window:
            return dense_fallback(ctx, node, "einsum of token values with different windows")
        letters = (mine[0] if letters is None or letters[0] is None else letters[0], mine[1])
        window = ax.window
    tl = [x for x in letters if x is not None]
    if any(rhs.count(x) != 1 for x in tl):
        return dense_fallback(ctx, node, "einsum contracting or mixing token dims (attention scores?)")
    for t, o in zip(terms, ops):
        if not get_axes(o).is_token and any(x in t for x in tl):
            return dense_fallback(ctx, node, "einsum with a constant indexed by a token dim")
    return token(len(rhs), None if letters[0] is None else rhs.index(letters[0]), rhs.index(letters[1]), window)


@axis_rule()
def embedding(ctx: AxesContext, node):
    """embedding(ids, W): one row of W per id; the ids' token dims pass through, a new last dim appears."""
    ids = node.args[0]
    ax = get_axes(ids)
    if not ax.is_token or not get_axes(node.args[1]).is_const:
        return dense_fallback(ctx, node, "embedding of dense ids or with a non-constant table")
    return token(ax.ndim + 1, ax.row, ax.pos, ax.window)
