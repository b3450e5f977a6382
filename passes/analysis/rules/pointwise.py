"""Pointwise and broadcasting ops.

``out[i] = f(a[i], b[i], …)`` with numpy broadcasting: each output element depends on the operands'
elements at the same (broadcast) coordinates, so a TOKEN operand keeps its token dims (right-aligned into
the output) and the result is TOKEN, provided

* all TOKEN operands put their position dim on the same output dim, their row dims agree (or are absent:
  a position-only value such as a rotary table broadcasts over rows, with extent 1 on the output's row
  dim), and share one lazy window;
* a CONST operand has extent 1 along the output's token dims (a constant indexed by row would make the
  value depend on the dense row, not on the tree node) — or it is a **position table**: extent 1 along
  the row dim and exactly the dense length L along the position dim, with the TOKEN operands' window
  whole (a ``[T, hs]`` rotary cache ``cos[:T]`` broadcast against ``[B, H, T, hs]``, a learned
  ``[L, D]`` position table). Then the dense element at column t reads the table's entry t, and the
  column of a packed token is its tree position (§4), so the packed graph reads the table at
  ``position[k]`` (``index_select``): a function of the position alone, causal and row-independent.

Otherwise the TOKEN operands are materialised and the result is DENSE (still exact).
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from brcompile.passes.analysis.axes import (
    DENSE, AxesContext, Local, axis_rule, dense_fallback, get_axes, shape_of, token,
)
from brcompile.passes.refusals import Code
from brcompile.passes.spellings import arg


@dataclasses.dataclass(frozen=True)
class PositionTables:
    """The note (``AxesContext.note``) of an elementwise op with constant position tables among its operands
    (module docstring; :func:`pointwise`): ``tables`` pairs each table with its position dim, along which the
    packed op reads it at the tokens' positions (:func:`emit_pointwise`, :func:`emit_complex`)."""

    tables: tuple[tuple[fx.Node, int], ...]


def broadcast_token_axes(ctx: AxesContext, node, operands, tables: dict | None = None) -> object:
    """Fact of a broadcasting op's output, or None if its operands cannot stay packed.

    An operand of rank r sits right-aligned in the output of rank R: its dim d is output dim R - r + d.
    With ``tables`` (a dict), CONST position tables are admitted (module docstring) and recorded as
    ``tables[operand] = its position dim``; without it they make the result None.
    """
    out_shape = shape_of(node)
    if out_shape is None:
        return None
    R = len(out_shape)
    row = pos = window = None
    has_row = False
    for a in operands:
        ax = get_axes(a)
        if not ax.is_token:
            continue
        off = R - ax.ndim
        p = ax.pos + off
        r = None if ax.row is None else ax.row + off
        if pos is not None and p != pos:
            return None
        if r is not None:
            if has_row and r != row:
                return None
            row, has_row = r, True
        if window is not None and ax.window != window:
            return None
        pos, window = p, ax.window
    if has_row and row == pos:
        return None
    for a in operands:
        ax = get_axes(a)
        if ax.is_token:
            # a position-only operand with extent > 1 on the output's row dim (a feature dim of it that is as
            # long as the batch) would keep that extent packed, where the row operand has extent 1
            shp, off = shape_of(a), R - ax.ndim
            if has_row and ax.row is None and shp is not None and row - off >= 0 and shp[row - off] != 1:
                return None
            continue
        if ax.is_dense:
            return None
        shp = shape_of(a)
        if shp is None:
            continue  # python scalar
        off = R - len(shp)
        if row is not None and row - off >= 0 and shp[row - off] != 1:
            return None
        if pos - off >= 0 and shp[pos - off] != 1:
            if tables is None or shp[pos - off] != ctx.L or not window.is_whole:
                return None
            tables[a] = pos - off  # a position table: read at each packed token's position
    return token(R, row if has_row else None, pos, window)


def _packed_operands(pk, node):
    """``node``'s arguments as the packed graph sees them; a position table (module docstring) is read at the
    packed tokens' positions, ``table.index_select(d, position)``."""
    note = pk.note(node, PositionTables)
    tables = dict(note.tables) if note is not None else {}

    def arg(a):
        if a in tables:
            return pk.graph.call_method("index_select", (pk.packed(a), tables[a], pk.tree("position")))
        return pk.packed(a)

    return fx.node.map_aggregate((node.args, node.kwargs), lambda a: arg(a) if isinstance(a, fx.Node) else a)


def emit_pointwise(pk, node):
    """The same op on packed operands (position tables read at the tokens' positions)."""
    if pk.note(node, PositionTables) is None:
        return pk.copy(node)
    args, kwargs = _packed_operands(pk, node)
    return pk.graph.create_node(node.op, node.target, tuple(args), dict(kwargs))


def emit_complex(pk, node):
    """``torch.complex(re, im)`` / ``torch.polar(r, θ)`` on packed operands, built as
    ``view_as_complex(stack(broadcast_tensors(re, im), -1))`` with ``re = r·cos θ``, ``im = r·sin θ`` for
    polar: the same elements (polar's kernel forms exactly these products; a complex number is stored as its
    (real, imaginary) pair), but torch's fake kernels of ``complex``/``polar`` fix every symbolic size to
    the example's, which would tie the packed graph to the example batch's N (passes/emit/check.py)."""
    args, kwargs = _packed_operands(pk, node)
    names = ("abs", "angle") if node.target is torch.polar else ("real", "imag")
    a, b = [kwargs.get(k, args[i] if len(args) > i else None) for i, k in enumerate(names)]
    g = pk.graph
    if node.target is torch.polar:
        a, b = (g.call_function(operator.mul, (a, g.call_function(torch.cos, (b,)))),
                g.call_function(operator.mul, (a, g.call_function(torch.sin, (b,)))))
    pair = g.call_function(torch.stack, (g.call_function(torch.broadcast_tensors, (a, b)), -1))
    return g.call_function(torch.view_as_complex, (pair,))


@axis_rule(emit=emit_pointwise, local=Local.CARRY)
def pointwise(ctx: AxesContext, node):
    """Elementwise ops: the output element is f of the operands' elements at the same coordinates; a
    constant position table is read at each token's position (module docstring)."""
    operands = [a for a in list(node.args) + list(node.kwargs.values())]
    flat = []
    for a in operands:
        if isinstance(a, (list, tuple)):
            flat.extend(a)
        else:
            flat.append(a)
    if node.target in ("to", "type") and not _is_dtype_cast(node):
        return dense_fallback(ctx, node, "Tensor.to with a device/other argument")
    tables: dict = {}
    ax = broadcast_token_axes(ctx, node, [a for a in flat if hasattr(a, "meta")], tables)
    if ax is None:
        return dense_fallback(ctx, node, "operands are not aligned on the token dims")
    if tables:
        ctx.set_note(node, PositionTables(tuple(tables.items())))
    return ax


@axis_rule(emit=emit_complex, local=Local.CARRY)
def complex_pair(ctx: AxesContext, node):
    """``complex(re, im)`` and ``polar(r, θ) = r·cos θ + i·r·sin θ`` (a complex rotary table of positions):
    elementwise, as any pointwise op (its proof); emitted as a stacked (real, imaginary) pair (emit_complex)."""
    return pointwise(ctx, node)


def _is_dtype_cast(node) -> bool:
    """``Tensor.to`` / ``type`` with a dtype, a device, flags or a ``memory_format`` (strides only: the same
    elements at the same coordinates, HF's ``x.to(torch.float32, memory_format=torch.contiguous_format)``)."""
    rest = list(node.args[1:]) + list(node.kwargs.values())
    return all(isinstance(a, (torch.dtype, bool, torch.memory_format)) or a is None or isinstance(a, torch.device)
               for a in rest)


@axis_rule(local=Local.CARRY)
def dropout(ctx: AxesContext, node):
    """Dropout: the identity when ``p == 0`` or not training; otherwise its random mask is drawn per
    dense element, which a packed run cannot reproduce — refuse."""
    p = arg(node, 1, "p", 0.5)
    training = arg(node, 2, "training", True)
    if p == 0 or training is False:
        return get_axes(node.args[0])
    ctx.fail(Code.RANDOM_DRAW, node, f"dropout with p={p} in training draws a random mask per dense element")
    return DENSE



@axis_rule(local=Local.CARRY)
def filled_like(ctx: AxesContext, node):
    """``ones_like(x)`` / ``zeros_like(x)`` / ``full_like(x, v)``: x's shape filled with a constant. Every element
    is the same constant wherever it sits, so the packed op on packed x is the packing of the dense result: the
    fact is x's (its token dims), with ``dtype``/``device`` keywords as given."""
    x = node.args[0] if node.args else node.kwargs.get("input")
    ax = get_axes(x)
    return ax if ax.is_token else DENSE if ax.is_dense else ax


def _new_filled_parts(node) -> tuple[list, tuple]:
    """(size, the arguments after it) of ``x.new_zeros(*size)`` / ``new_ones(size)`` / ``new_full(size, v)``."""
    if node.target == "new_full":
        size = node.args[1] if len(node.args) > 1 else node.kwargs["size"]
        return list(size), tuple(node.args[2:])
    size = list(node.args[1:])
    if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)):
        size = list(size[0])
    return size, ()


def emit_new_filled(pk, node):
    """The same fill on the packed ``x`` with its token dims' extents 1 (row) and N (position)."""
    ax = get_axes(node)
    sizes = pk.static_sizes(node)
    if ax.row is not None:
        sizes[ax.row] = 1
    sizes[ax.pos] = pk.N()
    _, rest = _new_filled_parts(node)
    kwargs = {k: v for k, v in node.kwargs.items() if k != "size"}
    return pk.graph.call_method(node.target, (pk.packed(node.args[0]), sizes, *rest), kwargs)


@axis_rule(emit=emit_new_filled, local=Local.CARRY)
def new_filled(ctx: AxesContext, node):
    """``x.new_zeros(size)`` / ``new_ones`` / ``new_full(size, v)`` in the shape of a token value ``x`` at its
    token dims (HF Inkling2's ``inputs_embeds.new_zeros(*inputs_embeds.shape[:-1], 0, D)``, an empty stack of
    block states): every element is the same constant wherever it sits, so with x's token dims at the same
    places (extents B and L there) the packed fill ([1, N] there) is the packing of the dense one. Otherwise a
    constant of a token value's dtype only: CONST (or DENSE for a dense ``x``)."""
    x = node.args[0]
    ax = get_axes(x)
    if not ax.is_token:
        return DENSE if ax.is_dense else ax
    ins, outs = shape_of(x), shape_of(node)
    dims = ax.token_dims()
    if ax.local or ax.flat or ax.window != ctx.full_window() or ins is None or outs is None \
            or any(d >= len(outs) or outs[d] != ins[d] for d in dims):
        return dense_fallback(ctx, node, f"a fill of shape {list(outs or ())} that does not keep the token dims of "
                              f"{list(ins or ())} in place")
    return token(len(outs), ax.row, ax.pos, ax.window)
