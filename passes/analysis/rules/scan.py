"""Causal scans along the token axis: ``cumsum``, the causal depthwise ``conv1d`` and the first-order linear
recurrence ``linear_scan`` (docs/ARCHITECTURE.md §3.6).

A scan along the position dim of a TOKEN value reads the earlier positions of its row. A token's earlier
positions in every row that holds it are its ancestors in the prefix tree (§4: the rows holding node k agree
on every column before k's), so the dense scan at ``(b, t)`` is a function of the path from the root to
``index[b, t]`` — the same for every (b, t) of node k — and the packed graph computes it along the paths
(``backends/scan/op.py``). Causal and row-independent: the invariant of docs/ARCHITECTURE.md §3.6 holds.

* ``cumsum(x, dim=pos)`` (any spelling; ``dtype=`` and the int64 promotion of integer inputs kept) →
  ``brcompile::tree_cumsum(x, parent, pos)``: ``out[k] = sum of x over k's ancestors-or-self``. A TOKEN
  value with or without a row dim (a position-only value is read at the path's positions 0..t, its own
  columns). HF RoBERTa's ``cumsum(input_ids.ne(pad)) * mask + pad`` and OPT's ``cumsum(attention_mask)``
  positions. Along a non-token dim it stays the per-token op it was (``passes/analysis/rules/reduce.py``).
* ``conv1d(x [B, C, L], w [C, 1, W], b, stride=1, padding=W-1, dilation=1, groups=C)[..., :L]`` — the
  Mamba / LFM2 "short conv" — or ``conv1d(F.pad(x, (W-1, 0)), w, b, groups=C)`` →
  ``brcompile::tree_causal_conv1d(x, w, b, parent)``: output t is ``b + sum_i w[:, W-1-i] * x[:, :, t-i]``
  with zeros before the row's start, i.e. the last W positions of the path. The rule proves every part of
  the pattern (depthwise, constant weights, stride and dilation 1, left-only padding of exactly W-1, the
  token dim as the conv's length dim, every use of the padded output the slice that keeps the first L);
  anything else along the token dim is a dense fallback naming what failed (exact, no sharing past it).
  The padded intermediate (the conv's ``L + W - 1`` outputs, or the pad's ``L + W - 1`` inputs) is no
  TOKEN value: its fact carries a :class:`PaddedWindow` that only the proved slice (or conv) may read.
* ``linear_scan(a, b, dim=pos)`` — ``h_t = a_t h_{t-1} + b_t``, what passes/canonical/scans/linear.py makes of an
  ``associative_scan`` of affine maps (Mamba's selective scan with ``use_associative_scan=True``) →
  ``brcompile::tree_linear_scan(a, b, parent, pos)``: ``h[k] = a[k] h[parent[k]] + b[k]``, the recurrence along
  the path. TOKEN operands with one layout (an operand without the token dims broadcasts); an
  ``associative_scan`` left as it was (another combine) is dense, named.

:func:`scan_candidates` / :func:`is_tree_scan` tell passes/emit/pack.py whether a graph without attention shares
anything: its rows share work only through such scans and the matrix recurrence ``matrix_scan``
(passes/analysis/rules/matrix_scan.py; a gated delta rule without attention or short convs).

The scans are exact only where the tree's paths are the rows' prefixes: a padding-free graph (the tree is
over the sequences packed into a row, §4) and ``drop_padding`` (a kept token's path skips the dropped
padding the dense scan reads) are refused with the reason.
"""
from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from brcompile.backends.scan import matrix as _matrix_ops
from brcompile.backends.scan import op as _scan_ops  # noqa: F401  (registers brcompile::tree_* before emission)
from brcompile.passes.analysis.axes import (
    AxesContext, Local, Window, axis_rule, dense_fallback, example_value, get_axes, normalize_dim, shape_of, token,
)
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.passes.analysis.masks.values import MaskInfo
from brcompile.passes.analysis.rules import reduce
from brcompile.passes.analysis.rules.shape import _normalize_index
from brcompile.passes.spellings import arg, is_op

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# shared checks


def _sequences_input(ctx: AxesContext) -> Optional[fx.Node]:
    """The position-id input of a padding-free graph (its attentions are causal within packed sequences),
    read off the attentions' mask meanings (their ``MaskInfo`` notes); None otherwise."""
    for info in ctx.noted(MaskInfo).values():
        if isinstance(info.sequences, fx.Node):
            return info.sequences
    return None


def _path_problem(ctx: AxesContext, what: str) -> Optional[str]:
    """Why a scan along the rows cannot run along the tree paths of this graph (None: it can)."""
    seqs = _sequences_input(ctx)
    if seqs is not None:
        return (f"{what} along the row of a padding-free batch: the tree is over the sequences that {seqs.name} "
                f"starts, and the dense scan crosses from one sequence into the next")
    return None


def _refuse_dropped_padding(pk, node: fx.Node, what: str) -> None:
    """Positions left out of the tree *inside* a row (key-padded ones, ``PackOptions.drops_within_rows``): a kept
    token's tree path skips them, but the dense scan reads them (a left-padded row's first real token):
    CannotReplay (the backend then keeps them: passes/analysis/liveness.py). Positions left out only after a row's last
    needed one are read by no kept token's scan."""
    if pk.options.drop_padding and pk.options.drops_within_rows:
        raise CannotReplay(Code.SCAN_PADDING,
                           f"{what} along the tokens with key-padded positions left out of the tree: the dense "
                           f"scan reads the padded positions", node)


def _emit_parent(pk) -> fx.Node:
    """``brcompile::tree_parent(end)``: each packed token's parent (one node per scan, so a scan inside an
    activation-checkpoint body computes its own)."""
    return pk.graph.call_function(torch.ops.brcompile.tree_parent.default, (pk.tree("end"),))


# --------------------------------------------------------------------------------------------------
# cumsum


def _scan_dim(node: fx.Node) -> Any:
    return arg(node, 1, "dim")


def _is_tree_scan(node: fx.Node) -> bool:
    """A cumsum along the position dim of an ordinary (not flattened, not windowed) TOKEN value."""
    ax = get_axes(node.args[0])
    dim = _scan_dim(node)
    return ax.is_token and not ax.local and isinstance(dim, int) and normalize_dim(dim, ax.ndim) == ax.pos \
        and ax.window is not None and ax.window.is_whole and type(ax.window) is Window


def emit_cumsum(pk, node: fx.Node):
    """Along the position dim: ``tree_cumsum(x.to(out dtype), tree_parent(end), pos)``; along any other dim
    the same op on the packed value (``reduce.softmax``'s case)."""
    if not _is_tree_scan(node) or not get_axes(node).is_token:
        return pk.copy(node)
    _refuse_dropped_padding(pk, node, "cumsum")
    x = pk.packed(node.args[0])
    out_dtype = example_value(node).dtype
    if example_value(node.args[0]).dtype != out_dtype:  # torch.cumsum's promotion (ints -> int64) or dtype=
        x = pk.graph.call_method("to", (x, out_dtype))
    return pk.graph.call_function(torch.ops.brcompile.tree_cumsum.default,
                                  (x, _emit_parent(pk), get_axes(node.args[0]).pos))


@axis_rule(emit=emit_cumsum, local=Local.CARRY)
def cumsum(ctx: AxesContext, node: fx.Node):
    """``cumsum`` along the position dim of a TOKEN value: the dense value at (b, t) sums x over columns
    0..t of row b, which are the ancestors-or-self of node ``index[b, t]`` with their values (module
    docstring), so it is TOKEN with the operand's dims. Along a non-token dim: per token
    (``reduce.softmax``); along the row dim, over flattened tokens or of a sliced value: dense."""
    ax = get_axes(node.args[0])
    dim = _scan_dim(node)
    if not ax.is_token or ax.local or not isinstance(dim, int) or normalize_dim(dim, ax.ndim) != ax.pos:
        return reduce.softmax(ctx, node)
    if not ax.window.is_whole or type(ax.window) is not Window:
        return dense_fallback(ctx, node, "cumsum along the positions of a sliced token value (the scan would "
                                         "start at the slice, the tree's paths at the row's start)")
    problem = _path_problem(ctx, "cumsum")
    if problem:
        return dense_fallback(ctx, node, problem)
    return token(ax.ndim, ax.row, ax.pos, ax.window)


# --------------------------------------------------------------------------------------------------
# causal depthwise conv1d


@dataclasses.dataclass(frozen=True)
class CausalConv1d:
    """The note (``AxesContext.note``) of a depthwise conv1d proved causal along the positions (:func:`conv1d`):
    emitted as ``tree_causal_conv1d`` on the unpadded packed input (:func:`emit_conv1d`), one of the tree scans
    (:func:`is_tree_scan`)."""


@dataclasses.dataclass(frozen=True)
class CausalPad:
    """The note of ``F.pad(x, (P, 0))`` of the positions proved to feed only causal conv1ds of kernel P + 1
    (:func:`pad`): no value of the packed graph (:func:`emit_pad`); the conv rule reads it as its proved input."""

    P: int


@dataclasses.dataclass(frozen=True)
class PaddedWindow(Window):
    """The fact's window of a conv's intermediate along the token dim that is *not* a TOKEN value: the
    padded input ``F.pad(x, (W-1, 0))`` or the padded conv's ``L + W - 1`` outputs. Only the use the conv
    rule proved may read it: the slice that keeps the first L outputs (``sliced`` then gives ``base``, the
    window of the conv's input) or the conv of the pad. Never whole, equal to no other window, so any
    other rule treats it as a mismatch."""

    base: Window = Window()
    length: Any = None  # the dense length of the conv's input (an int or a sympy expression)
    pad: int = 0

    @property
    def is_whole(self) -> bool:
        return False

    def sliced(self, which: str, s: slice) -> Window:
        if which == "pos" and _keeps_first(s, self.length, self.pad):
            return self.base
        raise CannotReplay(Code.SCAN_SHAPE,
                           f"a slice {s} of a padded causal-conv intermediate other than the first L positions")


def _keeps_first(s: slice, length: Any, pad: int) -> bool:
    """``s`` keeps exactly the first ``length`` of ``length + pad`` entries: ``[:L]``, ``[0:L]``, ``[:-pad]``."""
    if not isinstance(s, slice) or s.start not in (None, 0) or s.step not in (None, 1):
        return False
    if isinstance(s.stop, int) and pad > 0 and s.stop == -pad:
        return True
    stop = example_value(s.stop)
    if isinstance(stop, torch.SymInt):
        return not isinstance(length, int) and bool(stop.node.expr == length)
    return isinstance(stop, int) and isinstance(length, int) and stop == length


def _length_key(x: fx.Node) -> Any:
    """The dense length of a ``[B, C, L]`` value as an int or the SymInt's expression (hashable)."""
    v = example_value(x).shape[2]
    return v.node.expr if isinstance(v, torch.SymInt) and v.node.maybe_as_int() is None else int(v)


def _conv_args(node: fx.Node) -> dict:
    """``conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1)`` by name."""
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    got = dict(zip(names, node.args))
    got.update(node.kwargs)
    defaults = dict(bias=None, stride=1, padding=0, dilation=1, groups=1)
    return {k: got.get(k, defaults.get(k)) for k in names}


def _single(v: Any) -> Any:
    """``(n,)`` / ``[n]`` / ``n`` -> n (a conv1d's stride, padding or dilation)."""
    return v[0] if isinstance(v, (tuple, list)) and len(v) == 1 else v


def _conv_problem(ctx: AxesContext, conv: fx.Node, x_ax, padding: int) -> Optional[str]:
    """Why ``conv`` is not a causal depthwise conv along the token dim of its input with ``padding`` on
    both sides (None: it is). ``x_ax`` is the fact of the (unpadded) input."""
    a = _conv_args(conv)
    w, b = a["weight"], a["bias"]
    if not get_axes(w).is_const or (b is not None and not get_axes(b).is_const):
        return "conv1d along the tokens with weights that are not constant"
    wshape = shape_of(w)
    if not x_ax.is_token or x_ax.local or (x_ax.ndim, x_ax.row, x_ax.pos) != (3, 0, 2):
        return (f"conv1d whose input ({x_ax}) is not [B, C, L] with the tokens as the conv's length dim "
                f"(row 0, position 2)")
    if not x_ax.window.is_whole or type(x_ax.window) is not Window:
        return "conv1d along the positions of a sliced token value"
    C = shape_of(a["input"])[1]
    if wshape is None or len(wshape) != 3 or wshape[1] != 1 or wshape[0] != C or a["groups"] != C:
        return f"conv1d that is not depthwise (weight {wshape}, groups {a['groups']}, {C} channels)"
    W = wshape[2]
    if _single(a["stride"]) != 1 or _single(a["dilation"]) != 1:
        return f"conv1d with stride {a['stride']} / dilation {a['dilation']} (1 and 1 are supported)"
    pad = _single(a["padding"])
    if pad == "valid":
        pad = 0
    if pad != padding or W - 1 < 1 and padding:
        return (f"conv1d with padding {a['padding']} and kernel {W}: only the causal conv (padding W-1 = {W - 1} "
                f"on the left, the first L outputs kept) reads no later token")
    if W < 1:
        return "conv1d with an empty kernel"
    return None


def _slice_users_problem(conv: fx.Node, length: Any, pad: int) -> Optional[str]:
    """Why some use of a padded conv's output is not ``out[..., :L]`` (None: every use is)."""
    for u in conv.users:
        if u.target is not operator.getitem or u.args[0] is not conv:
            return f"the padded conv's output is used by {u.name}, not only sliced to its first L positions"
        entries = _normalize_index(u.args[1], 3)
        if entries is None or len(entries) != 3 or entries[0] != slice(None) or entries[1] != slice(None) \
                or not _keeps_first(entries[2], length, pad):
            return f"the padded conv's output is sliced by {u.name} other than [..., :L]"
    return None


def emit_conv1d(pk, node: fx.Node):
    """``tree_causal_conv1d(x, weight, bias, tree_parent(end), impl)`` on the packed ``[1, C, N]`` input (the
    unpadded one: a left pad of W-1 is the tree path's own zeros before the root); ``impl`` is the backend's
    ``scan`` option."""
    if pk.note(node, CausalConv1d) is None:
        return pk.copy(node)
    _refuse_dropped_padding(pk, node, "causal conv1d")
    a = _conv_args(node)
    x = a["input"]
    if is_op(x, "pad"):
        x = x.args[0]
    return pk.graph.call_function(torch.ops.brcompile.tree_causal_conv1d.default, (
        pk.packed(x), pk.packed(a["weight"]), pk.packed(a["bias"]), _emit_parent(pk), pk.options.scan))


@axis_rule(emit=emit_conv1d)
def conv1d(ctx: AxesContext, node: fx.Node):
    """A depthwise conv along the position dim is causal only in the proved pattern (module docstring):
    output t reads input columns t-W+1..t of its row (zeros before 0), i.e. the last W nodes of the path of
    ``index[b, t]``, with the same weights everywhere. Padded by the conv (``padding=W-1``): its fact is a
    :class:`PaddedWindow` the slice ``[..., :L]`` turns back into the input's window. Fed by a proved
    ``F.pad(x, (W-1, 0))`` (padding 0): the output is TOKEN with x's window."""
    a = _conv_args(node)
    x = a["input"]
    x_ax = get_axes(x)
    if ctx.note(x, CausalPad) is not None:  # proved by the pad rule, with this conv
        ctx.set_note(node, CausalConv1d())
        base = get_axes(x).window.base
        return token(3, 0, 2, base)
    if not x_ax.is_token:
        return dense_fallback(ctx, node, "conv1d of a token-dependent weight")
    wshape = shape_of(a["weight"])
    W = wshape[2] if wshape is not None and len(wshape) == 3 else 0
    problem = _conv_problem(ctx, node, x_ax, W - 1) or _path_problem(ctx, "causal conv1d")
    length = _length_key(x) if not problem else None
    problem = problem or _slice_users_problem(node, length, W - 1)
    if problem:
        return dense_fallback(ctx, node, problem)
    ctx.set_note(node, CausalConv1d())
    return token(3, 0, 2, PaddedWindow(base=x_ax.window, length=length, pad=W - 1))


def _pad_args(node: fx.Node) -> tuple:
    """``pad(input, pad, mode='constant', value=None)`` -> (pad, mode, value)."""
    args = list(node.args) + [None] * 4
    pad = node.kwargs.get("pad", args[1])
    mode = node.kwargs.get("mode", args[2] if args[2] is not None else "constant")
    value = node.kwargs.get("value", args[3])
    return pad, mode, value


def _padded_dims(pad, ndim: int) -> dict:
    """``{dim: (before, after)}`` of an ``F.pad`` size tuple (pairs from the last dim backwards)."""
    return {ndim - 1 - i: (pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)}


def emit_pad(pk, node: fx.Node):
    """A pad of non-token dims runs as is; the causal pad of a proved conv is no value of the packed graph
    (the conv reads the unpadded input): the packed input stands in for it, read by nothing else."""
    if pk.note(node, CausalPad) is not None:
        return pk.packed(node.args[0])
    return pk.copy(node)


@axis_rule(emit=emit_pad)
def pad(ctx: AxesContext, node: fx.Node):
    """``F.pad`` of non-token dims pads each token's own entries: TOKEN with the same dims. A pad of the
    position dim is causal only as ``F.pad(x, (W-1, 0))`` feeding depthwise convs of kernel W with no
    padding of their own (the conv then reads columns t-W+1..t of its row): proved here for every user, the
    pad's fact is a :class:`PaddedWindow` and the conv rule makes its output TOKEN. Anything else along a
    token dim: dense."""
    x = node.args[0]
    ax = get_axes(x)
    size, mode, value = _pad_args(node)
    if not isinstance(size, (tuple, list)) or not all(isinstance(s, int) for s in size) or ax.local:
        return dense_fallback(ctx, node, "pad of a token value with symbolic sizes")
    dims = _padded_dims(size, ax.ndim)
    touched = [d for d in ax.token_dims() if dims.get(d, (0, 0)) != (0, 0)]
    if not touched:
        return token(ax.ndim, ax.row, ax.pos, ax.window)
    problem = None
    if touched != [ax.pos] or dims[ax.pos][1] != 0 or dims[ax.pos][0] < 1:
        problem = f"pad of a token dim by {size} (only a left pad of the positions feeding a causal conv is causal)"
    elif mode != "constant" or value not in (None, 0, 0.0):
        problem = f"pad of the positions with mode {mode!r}, value {value!r} (a causal conv pads with zeros)"
    elif not node.users:
        problem = "pad of the positions read by nothing"
    P = dims[ax.pos][0] if not problem else 0
    for u in node.users if not problem else ():
        if not is_op(u, "conv1d") or _conv_args(u)["input"] is not node:
            problem = f"the left pad of the positions is read by {u.name}, not as the input of a causal conv1d"
            break
        wshape = shape_of(_conv_args(u)["weight"])
        if wshape is None or len(wshape) != 3 or wshape[2] - 1 != P:
            problem = f"a left pad of {P} positions feeds {u.name} with kernel {wshape}: a causal conv pads W-1"
            break
        problem = _conv_problem(ctx, u, ax, 0)
        if problem:
            break
    problem = problem or _path_problem(ctx, "causal conv1d")
    if problem:
        return dense_fallback(ctx, node, problem)
    ctx.set_note(node, CausalPad(P))
    return token(3, 0, 2, PaddedWindow(base=ax.window, length=_length_key(x), pad=P))


# --------------------------------------------------------------------------------------------------
# first-order linear recurrence (an affine associative scan, passes/canonical/scans/linear.py)


def _broadcast_const_problem(ndim: int, row: Optional[int], pos: int, arg: Any) -> Optional[str]:
    """Why a non-TOKEN operand of a linear scan cannot broadcast against the packed tokens (None: it can:
    extent 1, or no dim, at the row and position dims of the result)."""
    shape = shape_of(arg) if isinstance(arg, fx.Node) else ()
    if shape is None:
        return f"a linear scan operand {getattr(arg, 'name', arg)} of unknown shape"
    offset = ndim - len(shape)
    for d in (row, pos):
        if d is not None and d - offset >= 0 and shape[d - offset] != 1:
            return (f"a linear scan whose operand {getattr(arg, 'name', arg)} {list(shape)} varies along the "
                    f"tokens without being a token value")
    return None


def _linear_scan_args(node: fx.Node) -> tuple[Any, Any, Any]:
    args = list(node.args) + [None] * 3
    return (node.kwargs.get("a", args[0]), node.kwargs.get("b", args[1]), node.kwargs.get("dim", args[2]))


def emit_linear_scan(pk, node: fx.Node):
    """``tree_linear_scan(a, b, tree_parent(end), pos, impl)`` on the packed operands (a broadcast operand as
    is); ``impl`` is the backend's ``scan`` option."""
    _refuse_dropped_padding(pk, node, "linear scan")
    a, b, _ = _linear_scan_args(node)
    return pk.graph.call_function(torch.ops.brcompile.tree_linear_scan.default,
                                  (pk.packed(a), pk.packed(b), _emit_parent(pk), get_axes(node).pos,
                                   pk.options.scan))


@axis_rule(emit=emit_linear_scan)
def linear_scan(ctx: AxesContext, node: fx.Node):
    """``linear_scan(a, b, dim)``: ``h_t = a_t h_{t-1} + b_t`` along ``dim``. Along the position dim of TOKEN
    operands (the same row and position dims, whole windows; any other operand of extent 1 there) the
    dense value at (b, t) is the recurrence over columns 0..t of row b, i.e. along the path of node
    ``index[b, t]`` (module docstring): TOKEN, computed by ``tree_linear_scan``. Anything else: dense."""
    a, b, dim = _linear_scan_args(node)
    out = example_value(node)
    ndim = out.dim()
    toks = [get_axes(x) for x in (a, b) if get_axes(x).is_token]
    if any(get_axes(x).is_dense for x in (a, b)):
        return dense_fallback(ctx, node, "a linear scan with an operand computed densely")
    first = toks[0]
    if any(t.local for t in toks) or any((t.ndim, t.row, t.pos) != (ndim, first.row, first.pos) for t in toks):
        return dense_fallback(ctx, node, f"a linear scan of token values with different layouts "
                                         f"({', '.join(str(t) for t in toks)})")
    if not isinstance(dim, int) or normalize_dim(dim, ndim) != first.pos:
        return dense_fallback(ctx, node, f"a linear scan along dim {dim}, not the token positions ({first.pos})")
    if any(not t.window.is_whole or type(t.window) is not Window for t in toks) or \
            any(t.window != first.window for t in toks):
        return dense_fallback(ctx, node, "a linear scan along the positions of a sliced token value")
    problem = _path_problem(ctx, "linear scan") or next(
        (p for x in (a, b) if not get_axes(x).is_token
         for p in [_broadcast_const_problem(ndim, first.row, first.pos, x)] if p), None)
    if problem:
        return dense_fallback(ctx, node, problem)
    return token(ndim, first.row, first.pos, first.window)


def _hop_scan(ctx: AxesContext, node: fx.Node):
    """An ``associative_scan`` left by passes/canonical/scans/linear.py (its combine is not the affine composition, or
    its form is another): no tree form, dense with the construct named."""
    return dense_fallback(ctx, node, "torch associative_scan whose combine_fn is not the affine composition "
                                     "((a1, b1), (a2, b2)) -> (a1 * a2, a2 * b1 + b2)")


#: the associative-scan higher-order op (absent from torch builds without it)
_HOP = getattr(getattr(torch.ops, "higher_order", None), "associative_scan", None)
if _HOP is not None:
    axis_rule()(_hop_scan)


# --------------------------------------------------------------------------------------------------
# graphs without attention


def scan_candidates(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes that may become tree scans (before the analysis): cumsums, conv1ds, linear and matrix scans."""
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")
            and (is_op(n, "cumsum", "conv1d") or n.target in (_scan_ops.linear_scan, _matrix_ops.matrix_scan)
                 or n.target is _HOP)]


def is_tree_scan(ctx: AxesContext, node: fx.Node) -> bool:
    """Whether the analysis made ``node`` a tree scan of the packed graph (``tree_cumsum``,
    ``tree_causal_conv1d``, ``tree_linear_scan``, ``tree_matrix_scan``): the ops that share work between rows
    in a graph without attention."""
    if not get_axes(node).is_token:
        return False
    if is_op(node, "cumsum"):
        return _is_tree_scan(node)
    if is_op(node, "conv1d"):
        return ctx.note(node, CausalConv1d) is not None
    return node.target in (_scan_ops.linear_scan, _matrix_ops.matrix_scan)
