"""Attention and the lazy gather.

``scaled_dot_product_attention(q, k, v, mask)`` with q, k, v TOKEN ([B, H, L, D], row 0, position 2) and
a causal (optionally key-padded, optionally sliding-window) mask equals tree attention over the packed tokens: in the dense batch
query (b, i) sees keys (b, j <= i) — exactly the ancestors-or-self of its tree node, since the rows that
contain a node agree on every earlier token — so ``k <= q < end[k]`` (and ``valid[k]`` under key
padding) selects the same keys with the same values, and the softmax over them is the same. A sliding window W
(query column i sees key columns j > i - W) is ``position[q] - position[k] < W`` on the tree positions.
An ALiBi bias ``m[h] * (pos[k] - pos[q])`` (classified by :mod:`..masks`) is tree attention's ``alibi`` over
the tree positions (the columns), or over ``count(X)[rep_row, position]`` — the running count of a 0/1
input X at the token's column, which depends only on the token's ancestors, like every tree value. Trained
slopes (``MaskInfo.alibi_node``, a per-head value computed from parameters) are its differentiable ``slopes``
(:func:`_slopes`), computed by the packed graph. Attention
sinks (``br_sinks``, from the eager canonicalisation) are its ``sinks`` argument: one learned logit per head
([H], dense), or one logit per query row — a [B, H, L, 1] TOKEN value (row 0, position 2: the query's token
axis, e.g. a projection of the query's hidden state), packed to tree attention's [H, N] like any token value
(row (b, i) reads its token's logit, as q does). A sink column that is not such a value (it mixes rows, or
positions other than the query's) is refused. A relative bias (``br_relbias``, from the eager canonicalisation:
a [B, H, L, E] table F of the query token with ``bias[b, h, i, j] = F[b, h, i, clamp(i - j, 0, E - 1)]``, 0 from
distance E on with ``node.meta["br_relbias_zero"]``) is its ``relbias`` argument: F packed to [H, N, E] (with a
zero column appended for the zero fill), indexed by the tree positions' distance (the columns' distance in
every row, as HF's ``arange(Lq)[:, None] - arange(Lk)[None, :]``). A table that is not such a value is refused.
A value head dim other than the query/key one (MLA) is zero-padded to one D and the output sliced back
(:func:`pad_head_dims`).

An SDPA whose token dims are among its *batch* dims (every dim but the last two) is no attention over the tokens
but a per-token op (:func:`per_token_attention`): Inkling2's block-attention residual, a learned query against
each token's own stack of block outputs ([B, L, 1, D] against [B, L, S, D]). It stays the same SDPA on the packed
operands and is none of the graph's tree attentions.

``gather(x, -1, idx)`` of a TOKEN ``x`` (log-probs) with a dense index (the targets) reads
``x.packed[index[b, t], idx[b, t, j]]`` — B·L·J scalars, never the dense [B, L, V] value.
"""
from __future__ import annotations

import dataclasses
import operator

import torch

import torch.fx as fx

from brcompile.passes.analysis.axes import (
    DENSE, AxesContext, Local, axis_rule, dense_fallback, example_value, get_axes, normalize_dim, shape_of, token,
)
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.passes.analysis.masks.values import MaskInfo
from brcompile.passes.emit.fuse_logprob import emit_fused_gather
from brcompile.passes.meta import RELBIAS_ZERO, SOFTCAP
from brcompile.backends.attention.features import feature_tail, needs_position
from brcompile.passes.spellings import BROADCASTS, spellings
from brcompile.backends.read_packed.op import read_packed

SDPA = list(spellings("sdpa"))


@dataclasses.dataclass(frozen=True)
class PerTokenAttention:
    """The note (``AxesContext.note``) of an SDPA that is a per-token op (:func:`per_token_attention`), not a tree
    attention: written by :func:`sdpa` in place of the attention's ``MaskInfo``, read by :func:`emit_sdpa` (the
    same SDPA on packed operands) and by the pipeline's token-axes stage, which takes it off the attention list."""


@dataclasses.dataclass(frozen=True)
class LazyGather:
    """The note of ``gather(x, 2, idx)`` of a TOKEN ``x`` [B, L, V] by a dense index (:func:`gather`): DENSE, yet
    emitted as :func:`packed_gather` (or a fused read-out) without the dense [B, L, V] value. Read by
    :func:`emit_gather` and by ``Analysis.lazy_gathers`` (explain's graphs table)."""


def sdpa_args(node):
    return sdpa_bind(node.args, node.kwargs)


def sdpa_bind(args, kwargs) -> dict:
    """``scaled_dot_product_attention``'s arguments by name (defaults filled in), from a call's args and kwargs."""
    names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
    defaults = [None, None, None, None, 0.0, False, None, False]
    bound = dict(zip(names, defaults))
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound


def attention_dtype(node) -> tuple[torch.dtype | None, str | None]:
    """(dtype, None): the dtype the SDPA ``node`` computed in, when its traced q/k/v dtypes differ from
    it — autocast's lower-precision policy cast q, k, v to the output's dtype (a bfloat16 ``v`` beside
    float32 ``q``/``k`` after HF's float32 rotary, or float32 q/k/v in a bfloat16 region) — so tree
    attention gets the same casts; (None, None) when q, k, v and the output share one dtype; (None,
    reason) when the dtypes are unknown or are not what autocast produces (the attention cannot be
    reproduced)."""
    a = sdpa_args(node)
    vals = [example_value(a[n]) for n in ("query", "key", "value")]
    out = example_value(node)
    if not all(isinstance(x, torch.Tensor) for x in (*vals, out)):
        return None, "attention q/k/v/output dtypes are unknown (no traced values)"
    dtypes = [x.dtype for x in vals]
    names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
    if not all(d.is_floating_point for d in (*dtypes, out.dtype)):
        return None, f"attention on non-floating q/k/v ({names})"
    if set(dtypes) == {out.dtype}:
        return None, None
    if out.dtype == torch.float64 or torch.float64 in dtypes:
        # autocast never casts float64: a float64 among q/k/v or as the output of mixed inputs is not
        # its policy, so what the original attention computed is unknown
        return None, (f"attention q/k/v dtypes ({names}) -> {str(out.dtype).replace('torch.', '')} "
                      "are not autocast's casts")
    return out.dtype, None


def emit_sdpa(pk, node):
    """A per-token SDPA (:class:`PerTokenAttention`): :func:`emit_per_token_sdpa`. Otherwise q, k, v [1, H, N, D] -> brcompile::tree_attention on [H, N, D] -> [1, H, N, D]. Under autocast q, k,
    v are cast to the dtype the original attention computed in (:func:`attention_dtype`) explicitly, so
    the packed graph does not depend on the autocast state it runs under (a streaming tail re-run in
    backward) and the cached K/V of streaming replay have that dtype."""
    if pk.note(node, PerTokenAttention) is not None:
        return emit_per_token_sdpa(pk, node)
    a = sdpa_args(node)
    info = pk.note(node, MaskInfo)  # the masks stage's meaning (the sdpa rule refused an attention without one)
    q, k, v = (pk.graph.call_method("squeeze", (pk.packed(a[n]), 0)) for n in ("query", "key", "value"))
    k, v = broadcast_heads(pk, node, k, v)
    cast, why = attention_dtype(node)
    if why is not None:  # checked by the rule; a graph changed since must not reach the op
        raise CannotReplay(Code.ATTENTION_DTYPE, why, node)
    if cast is not None:  # all three, whatever their traced dtype: a no-op where it already is ``cast``
        q, k, v = (pk.graph.call_method("to", (x, cast)) for x in (q, k, v))
    D = pk.static_shape(a["query"])[-1]
    scale = a["scale"] if a["scale"] is not None else D ** -0.5
    q, k, v, dv = pad_head_dims(pk, q, k, v, D, pk.static_shape(a["value"])[-1])
    valid = pk.tree("valid") if info.keypad is not None else pk.tree("all_valid")
    args = (q, k, v, pk.tree("end"), valid, pk.tree("segments"), float(scale), pk.options.attention)
    softcap = float(SOFTCAP.get(node, 0.0))  # Gemma2's logit soft-capping (eager canonicalisation)
    alibi = info.alibi
    slopes = info.alibi_node  # trainable ALiBi slopes (:mod:`..masks`)
    sinks = a.get("br_sinks")  # attention sinks (eager canonicalisation)
    rel = a.get("br_relbias")  # relative bias (canonicalisation)
    features = dict(window=info.window, softcap=softcap, alibi=list(alibi) if alibi and slopes is None else None,
                    sinks=sinks, relbias=rel, slopes=slopes)  # the graph values: packed below, after the positions
    if needs_position(features):  # the tree positions (a sliding window, a position bias)
        features["position"] = _positions(pk, info)
    if sinks is not None:
        features["sinks"] = _sinks(pk, sinks)
    if rel is not None:
        features["relbias"] = _relbias(pk, rel, bool(RELBIAS_ZERO.get(node)))
    if slopes is not None:
        features["slopes"] = _slopes(pk, slopes, pk.static_shape(a["query"])[1])
    out_lse = pk.graph.call_function(torch.ops.brcompile.tree_attention_forward.default,
                                     args + feature_tail(features))
    out = pk.graph.call_function(operator.getitem, (out_lse, 0))
    if dv is not None:
        out = pk.graph.call_function(operator.getitem, (out, (Ellipsis, slice(None, dv))))
    return pk.graph.call_method("unsqueeze", (out, 0))


def _slopes(pk, node, hq: int):
    """The ``slopes`` argument of tree attention for trainable ALiBi: the dense value of the slopes node (one
    number per query head, or one for all), as [Hq]."""
    g = pk.graph
    flat = g.call_method("reshape", (pk.dense(node), -1))
    return flat if pk.static_shape(node) and _numel(pk.static_shape(node)) == hq else g.call_method("expand", (flat, hq))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _sinks(pk, sinks):
    """The ``sinks`` argument of tree attention: a per-head node (dense, its H logits as [H]), a per-query
    [B, H, L, 1] TOKEN column packed ([1, H, N, 1] -> [H, N])."""
    if not get_axes(sinks).is_token:
        dense = pk.dense(sinks)
        return dense if len(pk.static_shape(sinks)) == 1 else pk.graph.call_method("reshape", (dense, -1))
    return pk.graph.call_method("squeeze", (pk.graph.call_method("squeeze", (pk.packed(sinks), -1)), 0))


def _relbias(pk, table, zero_beyond: bool):
    """The ``relbias`` argument of tree attention: the [B, H, L, E] TOKEN table packed ([1, H, N, E] -> [H, N, E]),
    with a zero column appended when the bias is 0 from distance E on (bucket E of the clamp is then that 0)."""
    g = pk.graph
    t = g.call_method("squeeze", (pk.packed(table), 0))
    if not zero_beyond:
        return t
    zero = g.call_function(torch.zeros_like, (g.call_function(operator.getitem, (t, (Ellipsis, slice(None, 1)))),))
    return g.call_function(torch.cat, ((t, zero), -1))


def pad_head_dims(pk, q, k, v, dk: int, dv: int):
    """(q, k, v, None) when the q/k head dim ``dk`` equals v's ``dv``; else the three with one head dim, and
    the ``dv`` to slice the output back to (None when it needs no slice). SDPA takes a value head dim of its
    own (MLA: DeepSeek's qk 192 beside v 128); tree attention takes one D. Zero columns change nothing exactly:
    appended to q and k (dv > dk) they add 0 to every score ``q . k`` (the scale is the original one, passed
    explicitly); appended to v (dv < dk) they make output columns ``sum_j p_j * 0 = 0``, sliced away. The
    padding's gradient is the slice of the incoming one, so every gradient is the unpadded attention's."""
    if dk == dv:
        return q, k, v, None
    g = pk.graph

    def pad(t, n):  # cat n zero columns; F.pad's symbolic shape rule would fix the packed token count N
        zero = g.call_function(torch.zeros_like, (g.call_function(operator.getitem, (t, (Ellipsis, slice(None, 1)))),))
        return g.call_function(torch.cat, ((t, g.call_method("expand", (zero, -1, -1, n))), -1))

    if dv > dk:
        return pad(q, dv - dk), pad(k, dv - dk), v, None
    return q, k, pad(v, dk - dv), dv


def _positions(pk, info: MaskInfo):
    """The [N] positions of a window or ALiBi: the tree's, or for ALiBi over ``count(X)`` the running count
    of ``X != 0`` along the row read at each token's (rep_row, position)."""
    X = info.alibi_count
    if X is None:
        return pk.tree("position")
    g = pk.graph
    dense = pk.dense(X)
    count = g.call_function(torch.cumsum, (g.call_function(operator.ne, (dense, 0)), -1))
    return g.call_function(operator.getitem, (count, (pk.tree("rep_row"), pk.tree("position"))))


_QKV = ("query", "key", "value")


def per_token_attention(ctx: AxesContext, node):
    """The token fact of an SDPA whose token dims are batch dims of the attention, None when it is not one.

    SDPA on q [..., Lq, E], k [..., S, E], v [..., S, Ev] (the same number of dims) computes, for every index
    beta of the batch dims (all dims but the last two), ``softmax(q[beta] @ k[beta]^T * scale (+ causal)) @
    v[beta]`` from q, k and v at beta alone (``enable_gqa`` maps the head dim -3 of k and v to ``h // g``: a
    batch dim other than -3, or -3 where the extents agree and g = 1). When the operands' token dims (row,
    position) are batch dims with the same place in q, k and v, the output at token (b, t) reads q, k and v at
    token (b, t) only: like a pointwise op, it is a TOKEN value with those token dims, and rows whose tree keys
    agree up to column t have equal operands at (b, t), hence equal outputs. On the packed operands ([1, N, ...]
    in place of [B, L, ...]) batch index (0, n) is token n: the same SDPA computes every tree node's value once,
    and its backward is the SDPA's own, per batch index, so every gradient is the dense one read at the tokens.

    Each operand is a TOKEN value with those token dims, or a value constant along them: an ``expand`` (or
    ``expand_as`` / ``broadcast_to``) of a non-token value whose extents there are 1 or new (a learned query
    expanded over (B, L)); its value at every token is the expanded source, so on the packed side it is the
    same source expanded to the packed extents. The attention mask must be absent (a mask is a tree attention's
    or refused), dropout 0, and no canonicalised extra (sinks, relative bias, soft-cap): the same plain SDPA
    then runs on the packed operands."""
    a = sdpa_args(node)
    if a["attn_mask"] is not None or a["dropout_p"] not in (0, 0.0) or a.get("br_sinks") is not None \
            or a.get("br_relbias") is not None or SOFTCAP.get(node):
        return None
    facts = [get_axes(a[n]) for n in _QKV]
    tokens = {(f.ndim, f.row, f.pos, f.window) for f in facts if f.is_token}
    if len(tokens) != 1 or any(f.local for f in facts):
        return None
    ndim, row, pos, window = next(iter(tokens))
    shapes = [ctx.shape(a[n]) for n in _QKV]
    dims = [d for d in (row, pos) if d is not None]
    if any(s is None or len(s) != ndim for s in shapes) or max(dims) >= ndim - 2:
        return None
    if a["enable_gqa"] and ndim - 3 in dims and len({s[ndim - 3] for s in shapes}) != 1:
        return None
    token_shape = next(s for s, f in zip(shapes, facts) if f.is_token)
    for n, f, s in zip(_QKV, facts, shapes):
        if not f.is_token and (_broadcast_source(a[n], dims) is None
                               or any(s[d] != token_shape[d] for d in dims)):
            return None
    return token(ndim, row, pos, window)


def _broadcast_source(x, dims):
    """The source of ``x`` when ``x`` is an ``expand`` / ``expand_as`` / ``broadcast_to`` of a non-token value
    whose extents at the output dims ``dims`` are 1 or new (``x`` is constant along them), else None."""
    if not isinstance(x, fx.Node) or x.target not in BROADCASTS or not x.args or not isinstance(x.args[0], fx.Node):
        return None
    src = x.args[0]
    ins, outs = shape_of(src), shape_of(x)
    if get_axes(src).is_token or ins is None or outs is None:
        return None
    off = len(outs) - len(ins)
    return src if all(d < off or ins[d - off] == 1 for d in dims) else None


def emit_per_token_sdpa(pk, node):
    """The same SDPA call on the packed operands (:func:`per_token_attention`): TOKEN q/k/v packed, an operand
    constant along the token dims as its source expanded to the packed extents (position dim N, row dim 1)."""
    ax = get_axes(node)
    a = sdpa_args(node)
    operands = {}
    for n in _QKV:
        x = a[n]
        if get_axes(x).is_token or x in operands:
            continue
        sizes: list = list(pk.static_shape(x))
        sizes[ax.pos] = pk.N()
        if ax.row is not None:
            sizes[ax.row] = 1
        src = _broadcast_source(x, ax.token_dims())
        operands[x] = pk.graph.call_method("expand", (pk.dense(src), *sizes))
    return pk._emit_copy(node, lambda x: operands[x] if x in operands else pk.packed(x))


@axis_rule(emit=emit_sdpa, always=True)
def sdpa(ctx: AxesContext, node):
    """scaled_dot_product_attention -> tree attention (see module docstring); an SDPA whose token dims are its
    batch dims -> the same SDPA per token (:func:`per_token_attention`)."""
    a = sdpa_args(node)
    _, why = attention_dtype(node)
    per_token = per_token_attention(ctx, node) if why is None else None
    if per_token is not None:
        ctx.set_note(node, PerTokenAttention())
        return per_token
    facts = [get_axes(a[n]) for n in ("query", "key", "value")]
    if not all(f.is_token for f in facts):
        ctx.fail(Code.ATTENTION_UNPACKED, node, "attention inputs are not packed token values: "
                 + (ctx.first_materialisation() or "they depend on dense data"))
    if any((f.ndim, f.row, f.pos) != (4, 0, 2) or f.window != ctx.full_window() for f in facts):
        ctx.fail(Code.ATTENTION_LAYOUT, node, "attention inputs are not [B, H, L, D] token values")
    if a["dropout_p"] not in (0, 0.0):
        ctx.fail(Code.ATTENTION_DROPOUT, node, f"attention dropout p={a['dropout_p']}")
    _, why = attention_dtype(node)
    if why is not None:
        ctx.fail(Code.ATTENTION_DTYPE, node, why)
    if ctx.note(node, MaskInfo) is None:
        if a["attn_mask"] is None and not a["is_causal"]:
            ctx.fail(Code.MASK_NOT_CAUSAL, node, "bidirectional attention (is_causal=False and no mask) is not causal")
        ctx.fail(Code.MASK_UNPROVEN, node, "attention mask was not classified")
    why = head_counts_unsupported(ctx.shape(a["query"])[1], ctx.shape(a["key"])[1], ctx.shape(a["value"])[1],
                                  a["enable_gqa"])
    if why is not None:
        ctx.fail(Code.ATTENTION_LAYOUT, node, why)
    _check_sinks(ctx, node, a.get("br_sinks"))
    _check_relbias(ctx, node, a.get("br_relbias"))
    return facts[0]


def _check_sinks(ctx: AxesContext, node, sinks) -> None:
    """Sinks are absent, a dense per-head [H] value, or a per-query [B, H, L, 1] TOKEN value with the queries'
    token axes (row 0, position 2, the full window): row (b, i)'s sink logit is its token's, so the packed
    column is tree attention's [H, N] per-query sinks. Anything else (a column that mixes the rows or reads
    other positions, made dense) is refused."""
    if sinks is None:
        return
    f = get_axes(sinks)
    shape = ctx.shape(sinks)
    if not f.is_token:
        if shape is not None and sum(int(d) != 1 for d in shape) <= 1:  # one logit per head
            return
        ctx.fail(Code.ATTENTION_SINKS,
                 node, "attention sink logits per query row that are not a value of the query token (they "
                 "depend on other rows or positions): "
                 + (ctx.first_materialisation() or "they depend on dense data"))
    if (f.ndim, f.row, f.pos) != (4, 0, 2) or f.window != ctx.full_window() or f.local \
            or shape is None or shape[-1] != 1:
        ctx.fail(Code.ATTENTION_SINKS,
                 node, f"attention sink logits per query row are a token value {f} of shape {shape}, not a "
                 "[B, H, L, 1] column along the queries' token axis")


def _check_relbias(ctx: AxesContext, node, table) -> None:
    """A relative bias's table is absent or a [B, H, L, E] TOKEN value with the queries' token axes (row 0,
    position 2, the full window) and H the query heads: row (b, i)'s table is its token's, so the packed table
    is tree attention's [H, N, E]. Its positions are the tree's: ALiBi over attention-mask counts beside it is
    refused."""
    if table is None:
        return
    f = get_axes(table)
    shape = ctx.shape(table)
    if not f.is_token:
        ctx.fail(Code.RELATIVE_BIAS,
                 node, "relative-bias table that is not a value of the query token (it depends on other rows or "
                 "positions): " + (ctx.first_materialisation() or "it depends on dense data"))
    if (f.ndim, f.row, f.pos) != (4, 0, 2) or f.window != ctx.full_window() or f.local or shape is None \
            or shape[1] != ctx.shape(sdpa_args(node)["query"])[1]:
        ctx.fail(Code.RELATIVE_BIAS,
                 node, f"relative-bias table is a token value {f} of shape {shape}, not a [B, H, L, E] table "
                 "along the queries' token axis")
    info = ctx.note(node, MaskInfo)
    if info is not None and info.alibi_count is not None:
        ctx.fail(Code.RELATIVE_BIAS,
                 node, "relative bias beside ALiBi over attention-mask counts (two position spaces)")


def head_counts_unsupported(hq: int, hk: int, hv: int, enable_gqa: bool) -> str | None:
    """None when tree attention computes SDPA's heads exactly, else the reason.

    Without ``enable_gqa`` SDPA is ``softmax(q @ k^T) @ v`` with the head dim broadcast like any batch dim:
    it accepts exactly head counts that broadcast (each 1 or the common extent H), and query head h reads
    k head ``h if Hk == H else 0`` and v head ``h if Hv == H else 0``. Tree attention's grouping reads kv
    head ``h // (Hq // Hkv)``: with Hq == H and Hk == Hv in {1, H} that is the same head (0 or h); a lone
    one-head k or v beside an H-head one is expanded to H heads (:func:`broadcast_heads`). A one-head query
    against H > 1 kv heads (output of H heads) is refused. With ``enable_gqa`` SDPA itself requires Hk == Hv
    dividing Hq, and query head h reads kv head ``h // (Hq // Hkv)``: tree attention's grouping."""
    if enable_gqa:
        if hk != hv or hq % hk:
            return f"attention with enable_gqa and head counts q {hq}, k {hk}, v {hv}"
        return None
    if {hk, hv} - {1, hq}:
        return f"query, key and value head counts ({hq}, {hk}, {hv}) differ without enable_gqa"
    return None


def broadcast_heads(pk, node, k, v):
    """k, v [Hk, N, D], [Hv, N, D] with heads in {1, Hq} (:func:`head_counts_unsupported`): a one-head k or
    v beside an Hq-head one is expanded to Hq heads (SDPA's broadcast), so both have Hkv heads."""
    a = sdpa_args(node)
    hk, hv = pk.static_shape(a["key"])[1], pk.static_shape(a["value"])[1]
    if hk == hv:
        return k, v
    hq = pk.static_shape(a["query"])[1]
    expand = lambda t: pk.graph.call_method("contiguous", (pk.graph.call_method("expand", (t, hq, -1, -1)),))
    return (expand(k) if hk == 1 else k), (expand(v) if hv == 1 else v)


def emit_gather(pk, node):
    """A lazy gather (:class:`LazyGather`) as a fused read-out when it is one, else :func:`packed_gather`; any
    other gather as the same op on packed operands."""
    if pk.note(node, LazyGather) is None:
        return pk.copy(node)
    fused = emit_fused_gather(pk, node)  # head -> log_softmax -> gather as brcompile::packed_logprob
    if fused is not None:
        return fused
    x, _, idx = _gather_args(node)
    ax = get_axes(x)
    return pk.graph.call_function(
        packed_gather, (pk.packed(x), pk.index(ax.window), ax.row, ax.pos, pk.dense(idx),
                        pk.options.drop_padding))


def _gather_args(node):
    """(x, dim, idx) of ``gather(x, dim, idx)`` or ``take_along_dim(x, idx, dim)`` (dim None: flattened)."""
    take = node.target in (torch.take_along_dim, "take_along_dim")
    names = ("input", "indices", "dim") if take else ("input", "dim", "index")
    bound = dict(zip(names, node.args))
    bound.update(node.kwargs)
    return bound.get("input", bound.get("self")), bound.get("dim"), bound.get("indices", bound.get("index"))


@axis_rule(emit=emit_gather, local=Local.CARRY)
def gather(ctx: AxesContext, node):
    """gather(x, dim, idx) along a non-token dim: ``out[p] = x[p with p[dim] := idx[p]]`` for every coordinate
    p of idx — every coordinate but ``dim``, the token dims among them, is kept, so each token's slice (each
    flattened entry's row, for flattened tokens in any one layout: ``local=Local.CARRY``) of ``out`` reads only
    the same token's slices of x and idx: per token when idx is a TOKEN value with x's token dims, window and
    extents there (``take_along_dim`` also broadcasts the non-token dims: still per token). A dense idx (the
    shifted targets) with x [B, L, V] (row 0, position 1, dim 2) -> the lazy gather (DENSE)."""
    x, dim, idx = _gather_args(node)
    fx_, fi = get_axes(x), get_axes(idx)
    if not fx_.is_token:
        return dense_fallback(ctx, node, "gather from a dense value")
    if not isinstance(dim, int):
        return dense_fallback(ctx, node, "take_along_dim of the flattened input")
    d = normalize_dim(dim, fx_.ndim)
    if d in fx_.token_dims():
        return dense_fallback(ctx, node, "gather along a token dim")
    sx, si = ctx.shape(x), ctx.shape(idx)
    if fi.is_token and (fi.row, fi.pos, fi.window, fi.ndim) == (fx_.row, fx_.pos, fx_.window, fx_.ndim) \
            and sx is not None and si is not None and all(sx[t] == si[t] for t in fx_.token_dims()):
        return fx_
    if fx_.ndim == 3 and (fx_.row, fx_.pos) == (0, 1) and d == 2 and node.target in (torch.gather, "gather") \
            and not fx_.local:
        if fi.is_token:
            ctx.materialise(idx, node, "gather index with a different window")
        ctx.set_note(node, LazyGather())
        return DENSE
    return dense_fallback(ctx, node, "gather with an index that is not aligned")


def packed_gather(data: torch.Tensor, index: torch.Tensor, row: int, pos: int, idx: torch.Tensor,
                  dropped: bool = False):
    """``out[b, t, j] = data[0, index[b, t], idx[b, t, j]]`` for packed ``data`` [1, N, V], index [B', L'],
    idx [B', L', J] — the dense ``gather(data[index], 2, idx)`` without forming [B', L', V]. 0 where
    ``index[b, t] == -1`` (dropped padding); a nonzero gradient there raises DroppedPositionGradError
    (brcompile::read_packed)."""
    flat = data.squeeze(row)  # [N, V]
    if dropped:
        return read_packed(flat, index, idx)
    return flat[index.unsqueeze(-1).expand_as(idx), idx]
