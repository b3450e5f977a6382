"""Attention in canonical form, before the analysis: eager attention chains become
``scaled_dot_product_attention`` nodes, and attention scalars read from graph inputs become constants.

**Eager attention.** HuggingFace's ``eager_attention_forward`` (and any model written the same way)
computes, with ``k``/``v`` already expanded to the query heads (``repeat_kv``)::

    s = matmul(q, k.transpose(-2, -1)) * c         # or / c, or no scaling (c = 1)
    s = tanh(s / cap) * cap                         # optional logit soft-capping (Gemma2)
    s = s + M                                       # optional additive float mask
    p = softmax(s, dim=-1[, dtype=d]).to(q.dtype)   # d of at least s's precision
    p = dropout(p, p=0)                             # identity (p = 0 or not training)
    o = matmul(p, v)

which is, elementwise, ``o = softmax(c * q k^T + M) v`` — exactly
``scaled_dot_product_attention(q, k, v, attn_mask=M, scale=c)`` with a float mask (added to the
scaled scores), for every query row that has at least one finite score. The chain is replaced by that
node in a *copy* of the graph (the user's graph is untouched and still runs as the original), so the
mask classification (:mod:`..masks`) and the SDPA rule (:mod:`.attention`) decide the rest. Every step is
checked: the transpose swaps exactly the last two dims of ``k``; the scale is a number (or a guarded
scalar input); the mask is a float tensor that does not enlarge the scores; the
softmax runs over the key dim in the scores' precision or higher (a float64 -> float32 softmax rounds the
probabilities and overflows the mask's lowest float64 value to ``-inf``, which tree attention would not
reproduce — refused); the cast returns to the query's dtype; dropout is the identity; and no
intermediate (scores, probabilities) has another user (``output_attentions=True`` would read them; an operand
of a mask step expanded to the scores' shape, ``M.expand_as(s)``, is ``M``: :func:`_implicit_broadcast`).
Soft-capping (``tanh(s / cap) * cap`` with one number ``cap`` on both sides) is kept on the SDPA node as
``node.meta["br_softcap"]`` and becomes the ``softcap`` argument of tree attention (the canonical copy is
only analysed; a probe that reads the node evaluates it by :func:`canonical_attention`). Anything else between the scores and the softmax (a bias, another function) is
refused with the op named.

**Dtypes (autocast).** Tree attention computes ``q k^T`` and ``p v`` in one dtype, the SDPA node's (its output's;
the SDPA rule casts q, k, v to it, :func:`.rules.attention.attention_dtype`), so the chain must too
(:func:`_check_compute_dtype`): both products of one dtype ``d``, the probabilities in q's dtype or ``d``. Under
``torch.autocast`` both products run in its dtype whatever q, k, v are (HF's q/k are float32 after the rotary,
v bfloat16), the float32 mask promotes the bfloat16 scores exactly to float32 and the softmax runs there
(:func:`_check_mask_precision`; the canonical mask keeps that precision, :func:`_mask_dtype`): tree attention in
``d`` sees the same inputs, its scores unrounded in its accumulation dtype. A chain whose products run in two
dtypes (an autocast region around one of them) is refused with the dtypes named.

**Attention by meaning, not by one spelling.** Ops are matched through :mod:`..spellings` (every spelling
of a family). The scores may be ``einsum("bhqd,bhkd->bhqk", q, k)`` and the output
``einsum("bhqk,bhkd->bhqd", p, v)``, any letters, or the same over [B, L, H, D] operands (heads in dim 2:
``einsum("bqhd,bkhd->bhqk", q, k)``, ``einsum("bhqk,bkhd->bqhd", p, v)``, any operand and output layout that names
two batch dims, the positions and the contracted feature: :func:`_einsum_4d`), whose q, k, v are permuted into
[B, H, L, D] for the SDPA node and its output back into the einsum's layout; k^T may be any permute of a 4-D value (:func:`_key_of`); a scale applied to q (or k) before the scores is part of q (the SDPA
scale is then 1). Between the scores and the softmax, mask and scale steps may come in any order
(:func:`_mask_or_scale_step`): ``s + M``; ``s.masked_fill(C, v)`` / ``where(C, v, s)`` (nanoGPT's
``att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))``); ``where(C, s, v)`` (GPT-J); ``s * c``,
``s / c`` with a number ``c``; a blend ``s * B + A`` (OpenAI-GPT's ``w * b + -1e4 * (1 - b)``,
:func:`_blended_scores`). A fill value ``v`` must be a large negative constant: at most ``BLOCKING``
(``-1e4``) as the softmax sees it (times the positive scales after it) — ``-1e9``, ``finfo.min``, ``-inf``.
Then a masked score's probability is exactly 0, as it is in tree attention, provided the visible scores
of its row lie within the exp underflow range above ``v`` (745 in float64, 104 in float32; scores of
that size are not seen in practice). The same assumption makes a floor ``max(s, c)`` / ``s.clamp(min=c)`` at a
blocking ``c`` (XGLM's ``torch.max(s + M, torch.full((), finfo.min))``) leave every probability as it is
(:func:`_floor_step`). A value may be a one-element constant made in the graph (``torch.scalar_tensor(-inf)``,
``torch.full((), v)``: :func:`_constant`). The steps become one canonical float mask (:func:`_canonical_mask`:
0 where every step lets a key through, ``-inf`` where one blocks it; additive values <= ``BLOCKING``
become ``-inf``, other values stay and the classification refuses them as a bias), classified by the
probes of :mod:`..masks` like any mask. A cast of the scores to their own dtype is the identity; a cast
right before the softmax (MPT's and XLM's ``softmax(scores.float())``) is the softmax's dtype
(:func:`_softmax_input_cast`). An additive mask of lower precision than the scores is promoted exactly by the
sum (a per-head bias of lower precision is refused: its rounding is not reproduced). After the softmax,
``p.masked_fill(C, 0)`` with the condition of a blocking ``masked_fill`` step (CPM-Ant, the condition built a
second time) only zeroes probabilities that are 0 already (:func:`_zeroes_blocked`).

**3-D attention** (HF BLOOM, Megatron): the product runs on views that merge (B, H) —
``s3 = bias.baddbmm(q3, k3^T, beta=b, alpha=a)`` (or ``bmm(q3, k3^T)``) with ``q3 = q.reshape(B*H, Lq, D)``,
``s = s3.view(B, H, Lq, Lk)``, the mask steps and softmax on ``s``, then ``bmm(p.view(B*H, Lq, Lk), v3)``
(:func:`_scores_3d`, :func:`_match_output`). Each view is checked to merge (split) exactly dims 0 and 1 of a
[B, H, L, D] value by its shapes (a row-major reshape to that shape does nothing else), q, k, v and the scores
with one (B, H). Then ``s[b, h] = a * q[b, h] k[b, h]^T + b * bias[b*H + h]``: ``a`` joins the SDPA scale and
the ``baddbmm`` input is a bias step (``("bias", M, H, post)``) read as [B, H, ...]
(``M.unflatten(0, (-1, H))``, :func:`_split_heads_operand`; none at ``b = 0``); ``a`` and ``b`` read from scalar
inputs (``dynamic=True``) are specialised under a per-call guard. The output view back to [B, H, Lq, D] becomes the
SDPA node; any other use of the [B*H, Lq, D] product reads ``sdpa.flatten(0, 1)``. The fold of the heads into the
batch may come and go anywhere in the chain (:func:`_softmax_frame`, :func:`_match_probabilities`): HF BART
(MVP, TrOCR, XGLM) adds the mask to ``s3.view(B, H, Lq, Lk)`` and takes the softmax of its ``[B*H, Lq, Lk]``
view; a softmax may read the 3-D product itself (no mask then but the ``baddbmm`` input; a mask on the folded
scores is refused by name); GPT-NeoX-Japanese takes the softmax and the product with the values in 4-D after
``baddbmm`` scores.

**ALiBi.** An additive operand with a head dim (``[H, Lq, Lk]``, ``[H, 1, Lk]``, ``[B, H, Lq, Lk]``, any
broadcastable per-head bias) is a *bias step*: it joins the canonical mask unthresholded (times the scales
after it), so the mask's finite values carry it. :mod:`..masks` then splits the mask into visibility and
bias on its probes and accepts the bias only where it is exactly ALiBi, ``m[h] * (pos[k] - pos[q])`` up to a
per-query shift (the tree attention ``alibi`` feature); anything else is refused there as a bias.

**Per-key bias** (HF Doge). An additive operand ``M`` (an eager chain's, or a native SDPA node's ``attn_mask``)
built from a value ``u`` [B, Hu, 1, Lk] of the key tokens computed from a trainable tensor is one more q/k
feature: ``q' = cat(q, 1)``, ``k' = cat(k, post / c * T(u)^T)``, ``v' = cat(v, 0)``, and ``M - T(u)`` the mask
(:func:`_key_feature`); the mask classification proves on its probes that this is a mask, or refuses the bias.

**Relative bias** (HF Inkling2, Inkling). An additive operand ``M`` (an eager chain's, or a native SDPA node's
``attn_mask``) built along its first operands from ``gather(T, -1, idx)`` of a value ``T`` [B, H, Lq, E] computed
from a trainable tensor (each query token's row of bias-vs-distance values, a projection of its hidden state)
is tree attention's relative bias (:func:`_relative_bias`): the table ``F`` is T through the casts and the
factors constant along the keys on the way to ``M`` (Inkling's per-query ``tau``), zero-filled from distance E
on when a ``masked_fill(·, C, 0)`` / ``where(C, 0, ·)`` is on the way, and ``M - G(F)`` replaces ``M``, with
``G(F)[b, h, i, j] = F[b, h, i, clamp(i - j, 0, E - 1)]`` (0 from distance E on when zero-filled,
:func:`relative_bias_dense`). The mask classification evaluates ``M - G(F)`` on its probes with ``T`` itself
a random value (``node.meta["br_relbias_source"]``, :func:`..masks.classify`), so it proves that the bias is
that function of the query token's table and the clamped distance alone, whatever T is, or refuses it. ``F``
becomes the SDPA node's ``br_relbias`` keyword (``node.meta["br_relbias_zero"]``: the zero fill).

**Attention sinks** (GPT-OSS): ``combined = cat([s, S.reshape(1, -1, 1, 1).expand(B, -1, Lq, -1)], -1)``,
optionally ``combined - combined.max(-1, keepdim=True).values`` (a per-row shift: the softmax is the same),
``softmax(combined)[..., :-1]`` — one value-less logit ``S[h]`` per query row (:func:`_match_sinks`); a sink
column computed per query token (Inkling2: ``cat([s, proj(h).transpose(1, 2).unsqueeze(-1)], -1)``, a
[B, H, Lq, 1] value) is the same softmax with ``S[b, h, i]``, and ``S`` is that column. GraniteMoE-SWA applies
the sink after the attention, ``o * sigmoid(logsumexp(s, -1) - S.view(1, H, 1)).unsqueeze(-1)``: the same
attention (:func:`_match_lse_sink`). The node ``S`` ([H], or the per-query column) becomes the SDPA node's
``br_sinks`` keyword (a dependency edge of the canonical copy, which is analysed, not run as a whole: a probe that
reads such a node evaluates it by :func:`canonical_attention`) and the
``sinks`` argument of tree attention (it gets its gradient there; a per-query column is packed like any token
value, and the SDPA rule refuses one that is not a value of the query token).

A fully masked query row differs: the original's additive mask makes it uniform over all keys (or NaN
when the lowest value overflows), tree attention makes it 0. Where the mask has key padding, the rewrite
therefore adds a per-call guard (:func:`mask_guards`): no row may start with padding. The same holds for a native
SDPA call whose float ``attn_mask`` blocks with a finite value (``-1e9``, ``finfo.min``: ``MaskInfo.finite_blocking``,
:mod:`..masks`); one that blocks with ``-inf`` (or a bool mask) makes such a row 0 as tree attention does.

**Scalars.** Under ``dynamic=True`` Dynamo passes float module attributes (``attention_dropout``,
``scaling``) as 0-dim tensor inputs read with ``.item()``, without a guard on their value. An
attention's ``dropout_p`` and ``scale`` read that way are replaced by their compile-time values, and a
per-call guard (:func:`..guards.scalar_equals`) sends a call with another value to the original graph.

Also: nodes without users (Dynamo keeps e.g. an unused full-attention mask of an all-sliding model) are
removed from the copy when they are pure and not in-place, so they need no token-axis rule.
"""
from __future__ import annotations

import dataclasses
import logging
import numbers
import operator
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from brcompile.passes.axes import example_value, hint, is_inplace, is_static_input, normalize_dim
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.passes.guards import BatchGuard, no_query_without_keys, scalar_equals
from brcompile.passes.masks import BLOCKING, ancestors
from brcompile.passes.meta import CANONICAL, RELBIAS_SOURCE, RELBIAS_ZERO, SOFTCAP
from brcompile.passes.rules.attention import SDPA, _sdpa_args, sdpa_bind
from brcompile.passes.spellings import (
    CONSTANT_FILLS, COPIES, FLOORS, GATHERS, LOGSUMEXP, MAX, OPERATORS_NOT_INPLACE, RESHAPE_VIEWS, SAME_VALUE, arg,
    copy_graph_module, is_op, op_name as _op_name, random_draw, spellings,
)

log = logging.getLogger(__name__)

SOFTMAX = spellings("softmax")
MATMUL = spellings("matmul")
TRANSPOSE = spellings("transpose", "permute")
MUL = spellings("mul")
DIV = spellings("div")
ADD = spellings("add")
CAST = spellings("cast")
DROPOUT = spellings("dropout")
MASKED_FILL = spellings("masked_fill")
WHERE = spellings("where")
EINSUM = spellings("einsum")
RESHAPE = spellings("reshape")
BMM = spellings("bmm")
BADDBMM = spellings("baddbmm")

#: How far back from a softmax an unmatched chain is searched for a q @ k^T matmul, to tell an
#: attention that cannot be canonicalised (refuse, with the op named) from an unrelated softmax.
_SEARCH_DEPTH = 6


@dataclasses.dataclass
class Canonical:
    """The canonical copy of a graph and what the canonicalisation assumed.

    ``additive``: SDPA nodes built from eager chains with a float mask (they need :func:`mask_guards`).
    ``guards``: per-call guards of specialised scalars. ``notes``: one line per rewrite, for reports.
    """

    gm: fx.GraphModule
    guards: list[BatchGuard] = dataclasses.field(default_factory=list)
    additive: list[fx.Node] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class EagerChain:
    """A matched eager attention: ``out = matmul(probs, v)`` computes ``softmax(scale * q k^T + mask) v``."""

    q: fx.Node
    k: fx.Node
    v: fx.Node
    scale: Any  # number or a scalar node (resolved later)
    masks: list  # mask steps, softmax-side first: ("add", M, post) | ("fill"/"keep", C, value, post) | ("floor", c, post)
    #              | ("blend", B, A, post): s * B + A (:func:`_blended_scores`)
    #              | ("bias", M, H, post): a baddbmm input M of a 3-D attention, [B*H | 1, ...] read as [B, H, ...]
    dropout_p: Any
    dropout_training: Any
    out: fx.Node
    dead: list[fx.Node]  # chain nodes replaced by the SDPA node, output-side first
    softcap: Any = 0.0  # > 0: the scores were soft-capped, tanh(s / softcap) * softcap; or the two scalar
    #                     nodes (divisor, factor) read from inputs under dynamic=True, resolved by canonicalize
    sinks: Optional[fx.Node] = None  # the sink logits joined to the softmax: [H], or a [B, H, Lq, 1] column
    heads: Optional[int] = None  # H of a 3-D attention (bmm / baddbmm on [B*H, ...] views)
    merged_out: bool = False  # ``out`` is the [B*H, Lq, D] product: the SDPA output is flattened for its users
    k_dims: Optional[tuple] = None  # the SDPA key is ``k.permute(k_dims)`` (:func:`_key_of`)
    q_dims: Optional[tuple] = None  # the SDPA query is ``q.permute(q_dims)`` (:func:`_einsum_4d`)
    v_dims: Optional[tuple] = None  # the SDPA value is ``v.permute(v_dims)`` (:func:`_einsum_4d`)
    out_dims: Optional[tuple] = None  # ``out`` is the SDPA output ``.permute(out_dims)`` (:func:`_einsum_4d`)


# --------------------------------------------------------------------------------------------------
# driver


def canonicalize(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Canonical:
    """A copy of ``gm`` with eager attention chains as SDPA nodes and attention scalars as constants."""
    new_gm = copy_graph_module(gm)
    graph = new_gm.graph
    canon = Canonical(new_gm)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    values = dict(zip(placeholders, example_inputs))
    removed = _remove_dead_code(graph)
    for sm in [n for n in graph.nodes if _is_softmax(n)]:
        chain = match_eager_attention(sm, lambda n: _guarded_scalar(n, placeholders, values, canon))
        if chain is not None:
            canon.additive.extend(_replace_with_sdpa(graph, chain, canon, values))
    _resolve_softcaps(graph, placeholders, values, canon)
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in SDPA]:
        _specialise_scalars(node, placeholders, values, canon)
        if CANONICAL.get(node) is None:
            _key_bias_sdpa(graph, node, values, canon)
            _relative_bias_sdpa(graph, node, values, canon)
    for node in [n for n in graph.nodes if _call_in(n, DROPOUT)]:
        _specialise_dropout(node, placeholders, values, canon)
    removed += _remove_dead_code(graph)
    if not removed and not canon.notes:
        return Canonical(gm)  # nothing to canonicalise: analyse the graph itself
    graph.lint()
    new_gm.recompile()
    return canon


def _guarded_scalar(n: fx.Node, placeholders: list, values: dict, canon: Canonical) -> Optional[float]:
    """The value of the scalar node ``n`` read from an input (``x.item()``, ``1 / x.item()``), with a per-call
    guard on that input; None when it is computed otherwise."""
    value, src = _scalar_value(n, placeholders, values)
    if value is None:
        return None
    pos, transform = src
    canon.guards.append(scalar_equals(pos, value, f"attention factor {n.name} (input {placeholders[pos].name})"))
    canon.notes.append(f"{n.name}: specialised to {transform(value)}")
    return float(transform(value))


def mask_guards(canon: Canonical, classified: dict, placeholders: Sequence[fx.Node]) -> list[BatchGuard]:
    """Guards for the attentions whose additive mask has key padding and makes a query row without a visible key
    other than 0 (module docstring): the canonicalised eager attentions, and the SDPA calls whose float
    ``attn_mask`` blocks with a finite value (``MaskInfo.finite_blocking``: ``-1e9``, ``finfo.min``)."""
    keypads = {}  # (key-padding input, window) -> what
    for a, info in classified.items():
        what = "eager attention with an additive mask" if a in canon.additive else \
            "attention whose float mask blocks with a finite value" if info.finite_blocking else None
        if what is not None and info.keypad is not None:
            keypads.setdefault((info.keypad, info.window), what)
    return [no_query_without_keys(placeholders.index(k), f"{what} on {k.name}", w)
            for (k, w), what in keypads.items()]


def _remove_dead_code(graph: fx.Graph) -> int:
    """Erase nodes without users that are pure and not in-place (FX's own DCE keeps no such promise for
    ``call_method`` mutations, so it is not used here); returns how many."""
    removed = 0
    for node in reversed(list(graph.nodes)):
        if node.op in ("call_function", "call_method", "get_attr") and not node.users \
                and not _mutates(node) and not node.is_impure():
            graph.erase_node(node)
            removed += 1
    return removed


def _mutates(node: fx.Node) -> bool:
    """``axes.is_inplace``, except that ``operator.and_``/``or_``… (named with a trailing ``_`` only to
    avoid Python keywords) do not mutate."""
    return node.target not in OPERATORS_NOT_INPLACE and is_inplace(node)


# --------------------------------------------------------------------------------------------------
# matching


def _is_softmax(n: fx.Node) -> bool:
    return n.op in ("call_function", "call_method") and n.target in SOFTMAX


def _tensor(n: Any) -> Optional[torch.Tensor]:
    v = example_value(n)
    return v if isinstance(v, torch.Tensor) else None


def _is_scalar(a: Any) -> bool:
    """A Python number or a node producing one (``.item()`` of a scalar input)."""
    if isinstance(a, bool):
        return False
    if isinstance(a, numbers.Number):
        return True
    return isinstance(a, fx.Node) and isinstance(example_value(a), (torch.SymFloat, torch.SymInt, float, int))


def _only_user(n: fx.Node) -> Optional[fx.Node]:
    return next(iter(n.users)) if len(n.users) == 1 else None


def _softmax_args(sm: fx.Node) -> tuple[fx.Node, Any, Any]:
    """(input, dim, dtype) of a softmax call (``F.softmax(x, dim, _stacklevel, dtype)``,
    ``torch.softmax(x, dim, dtype)``, ``x.softmax(dim, dtype)``)."""
    a = list(sm.args)
    dim = sm.kwargs.get("dim", a[1] if len(a) > 1 else None)
    dtype_pos = 3 if sm.target is F.softmax else 2
    dtype = sm.kwargs.get("dtype", a[dtype_pos] if len(a) > dtype_pos else None)
    return a[0], dim, dtype


def _transposed_last_two(n: Any, ndim: int = 4) -> Optional[fx.Node]:
    """``k`` if ``n`` is ``k.transpose(-2, -1)`` (any spelling) of an ``ndim``-D ``k``, else None."""
    if not isinstance(n, fx.Node) or n.op not in ("call_function", "call_method") or n.target not in TRANSPOSE:
        return None
    k = n.args[0]
    t = _tensor(k)
    if t is None or t.dim() != ndim:
        return None
    if is_op(n, "permute"):
        dims = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else n.args[1:]
        if not dims:
            dims = n.kwargs.get("dims", ())
        return k if [normalize_dim(d, ndim) for d in dims] == [*range(ndim - 2), ndim - 1, ndim - 2] else None
    d = list(n.args[1:3]) or [n.kwargs.get("dim0"), n.kwargs.get("dim1")]
    if None in d or {normalize_dim(x, ndim) for x in d} != {ndim - 2, ndim - 1}:
        return None
    return k


def _einsum_4d(n: Any, kind: str) -> Optional[tuple[fx.Node, fx.Node, Optional[tuple], Optional[tuple]]]:
    """An einsum of two 4-D operands that is an attention product, any letters and operand layouts, else None.

    ``kind="scores"``: ``s = einsum(A,B->bhij, q, k)`` with ``s[b, h, i, j] = sum_d q[..] k[..]`` — the output
    names the two batch dims (b, h, in both operands), the query position i (first operand only) and the key
    position j (second operand only); the one other letter d, in both operands, is contracted. Then
    ``s = q' k'^T`` for ``q' = q.permute(q_dims)``, ``k' = k.permute(k_dims)`` in the [b, h, i | j, d] layout:
    ``einsum("bhqd,bhkd->bhqk")`` (identity dims) and ``einsum("bqhd,bkhd->bhqk")`` over [B, L, H, D] operands
    (dims (0, 2, 1, 3)). Returns (q, k, q_dims, k_dims).

    ``kind="output"``: ``o = einsum(bhij,C->O, p, v)`` of the probabilities p [b, h, i, j] (their own layout)
    and the values, contracting j: the value holds b, h, j and the head feature d, the output b, h, i, d in any
    order. Then ``o = (p v').permute(out_dims)`` for ``v' = v.permute(v_dims)`` in the [b, h, j, d] layout and
    ``p v'`` in [b, h, i, d]: ``einsum("bhqk,bhkd->bhqd")`` (identity) and ``einsum("bhqk,bkhd->bqhd")`` (the
    output [B, L, H, D]: out_dims (0, 2, 1, 3)). Returns (p, v, v_dims, out_dims).

    Identity dims are None (no permute)."""
    if not _call_in(n, EINSUM) or n.kwargs:
        return None
    eq, ops = n.args[0], list(n.args[1:])
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    if not isinstance(eq, str) or "->" not in eq or len(ops) != 2:
        return None
    lhs, out = eq.replace(" ", "").split("->")
    terms = lhs.split(",")
    if len(terms) != 2 or any(len(t) != 4 or len(set(t)) != 4 for t in (*terms, out)) \
            or len(set(terms[0] + terms[1] + out)) != 5:
        return None
    a, b = terms
    if kind == "scores":
        bh, i, j = out[:2], out[2], out[3]
        d = _only((set(a) & set(b)) - set(out))
        if d is None or set(a) != {*bh, i, d} or set(b) != {*bh, j, d}:
            return None
        return ops[0], ops[1], _layout(a, (*bh, i, d)), _layout(b, (*bh, j, d))
    if kind == "output":
        bh, i, j = a[:2], a[2], a[3]
        d = _only((set(b) & set(out)) - set(a))
        if d is None or set(b) != {*bh, j, d} or set(out) != {*bh, i, d}:
            return None
        return ops[0], ops[1], _layout(b, (*bh, j, d)), _layout((*bh, i, d), out)
    return None


def _only(letters: set) -> Optional[str]:
    """The one element of ``letters``, else None."""
    return next(iter(letters)) if len(letters) == 1 else None


def _layout(term: Sequence[str], canonical: Sequence[str]) -> Optional[tuple]:
    """The dims ``p`` with ``x.permute(p)`` in the ``canonical`` letter order for an ``x`` laid out as ``term``
    (``p[k] = term.index(canonical[k])``); None for the identity."""
    dims = tuple(list(term).index(c) for c in canonical)
    return None if dims == (0, 1, 2, 3) else dims


@dataclasses.dataclass
class Scores:
    """The attention scores ``s = alpha * q k^T + beta * bias`` ([B, H, Lq, Lk]) as one op computes them.

    ``q`` [B, H, Lq, D] and ``k`` [B, H, Lk, D] are 4-D; ``nodes`` compute ``s`` from them (output side first,
    replaced with the chain). ``heads`` is H when the product runs on [B*H, ...] views (``bmm`` / ``baddbmm``,
    :func:`_scores_3d`): ``bias`` (the ``baddbmm`` input, [B*H | 1, Lq | 1, Lk] or fewer dims) is then read as
    [B, H, ...] (:func:`_split_heads_operand`)."""

    q: fx.Node
    k: fx.Node
    nodes: list
    alpha: Any = 1.0  # a number, or a scalar node until _fold_scores_op resolves it
    bias: Any = None
    beta: Any = 1.0
    heads: Optional[int] = None
    folded: bool = False  # the scores are the [B*H, Lq, Lk] product itself, not its [B, H, Lq, Lk] view
    k_dims: Optional[tuple] = None  # the key is ``k.permute(k_dims)`` (k^T was another permute of k: :func:`_key_of`)
    q_dims: Optional[tuple] = None  # the query is ``q.permute(q_dims)`` (an einsum over [B, L, H, D]: :func:`_einsum_4d`)


def _scores_op(n: Any) -> Optional[Scores]:
    """The scores ``n`` computes: ``matmul(q, k^T)`` (any spelling) or ``einsum("bhqd,bhkd->bhqk", q, k)`` of
    two 4-D values, or a 3-D product of merged heads viewed back as [B, H, Lq, Lk] (:func:`_scores_3d`)."""
    qk = _einsum_4d(n, "scores")
    if qk is not None:
        q, k, q_dims, k_dims = qk
        tq, tk = _tensor(q), _tensor(k)
        ok = tq is not None and tk is not None and tq.dim() == tk.dim() == 4
        return Scores(q, k, [n], k_dims=k_dims, q_dims=q_dims) if ok else None
    if not isinstance(n, fx.Node) or n.op not in ("call_function", "call_method"):
        return None
    if n.target in RESHAPE:
        return _scores_3d(n)
    prod = _product_3d(n)
    if prod is not None:
        return _scores_folded(n, *prod)
    if n.target not in MATMUL or len(n.args) != 2 or n.kwargs:
        return None
    q, kt = n.args
    key = _key_of(kt)
    tq = _tensor(q)
    if key is None or tq is None or tq.dim() != 4:
        return None
    return Scores(q, key[0], [n], k_dims=key[1])


def _key_of(kt: Any) -> Optional[tuple[fx.Node, Optional[tuple]]]:
    """(k, dims) when ``kt`` is k^T for a key ``k.permute(dims)`` (dims None: ``k`` itself): ``k.transpose(-2, -1)``
    (any spelling), or any permute / transpose of a 4-D value ``x`` (OpenAI-GPT splits the key heads straight into
    k^T, ``x.permute(0, 2, 3, 1)`` of x [B, L, H, D]): ``x.permute(p)`` with its last two dims swapped back is the
    key, ``x.permute(p[0], p[1], p[3], p[2])``. Whether its dim 2 is the tokens is the attention rule's to check."""
    k = _transposed_last_two(kt)
    if k is not None:
        return k, None
    p = _permutation(kt)
    if p is None:
        return None
    return kt.args[0], (p[0], p[1], p[3], p[2])


def _permutation(n: Any) -> Optional[list[int]]:
    """The dims ``p`` when ``n`` is ``x.permute(p)`` or ``x.transpose(a, b)`` (any spelling) of a 4-D ``x``, else
    None."""
    if not _call_in(n, TRANSPOSE) or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    t = _tensor(n.args[0])
    if t is None or t.dim() != 4:
        return None
    if is_op(n, "permute"):
        dims = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else n.args[1:]
        dims = dims or n.kwargs.get("dims", ())
    else:
        ab = list(n.args[1:3]) or [n.kwargs.get("dim0"), n.kwargs.get("dim1")]
        if len(ab) != 2 or not all(isinstance(d, int) for d in ab):
            return None
        dims = list(range(4))
        a, b = (normalize_dim(d, 4) for d in ab)
        dims[a], dims[b] = dims[b], dims[a]
    if len(dims) != 4 or not all(isinstance(d, int) for d in dims):
        return None
    dims = [normalize_dim(d, 4) for d in dims]
    return dims if sorted(dims) == [0, 1, 2, 3] else None


def _key_value(sc: "Scores") -> Optional[torch.Tensor]:
    """The example value of the [B, H, Lk, D] key of ``sc`` (``k.permute(k_dims)`` where the dims are given)."""
    return _permuted_value(sc.k, sc.k_dims)


def _query_value(sc: "Scores") -> Optional[torch.Tensor]:
    """The example value of the [B, H, Lq, D] query of ``sc`` (``q.permute(q_dims)`` where the dims are given)."""
    return _permuted_value(sc.q, sc.q_dims)


def _permuted_value(n: Any, dims: Optional[tuple]) -> Optional[torch.Tensor]:
    """The example value of ``n.permute(dims)`` (of ``n`` for None)."""
    t = _tensor(n)
    return t.permute(dims) if t is not None and dims is not None else t


def _scores_folded(n: fx.Node, q: fx.Node, k: fx.Node, bias: Any, beta: Any, alpha: Any) -> Optional[Scores]:
    """The scores of a 3-D attention whose softmax reads the [B*H, Lq, Lk] product ``n`` itself (BART without
    a mask): ``n[b*H + h] = alpha * q[b, h] k[b, h]^T + beta * bias[b*H + h]``, the 4-D scores with the heads
    folded into the batch (``folded``; :func:`_softmax_frame`). H static, alpha and beta numbers or scalar nodes."""
    tq = _tensor(q)
    if not (_is_scalar(beta) and _is_scalar(alpha)) or not isinstance(tq.shape[1], int):
        return None
    return Scores(q, k, [n], alpha, bias, beta, int(tq.shape[1]), folded=True)


def _same(a: Any, b: Any) -> bool:
    """Whether two sizes (ints or SymInts) are provably equal (adds no guard)."""
    return bool(statically_known_true(a == b))


def _reshape_of(n: Any, src_dim: int, dst_dim: int) -> Optional[tuple[fx.Node, Any, Any]]:
    """(x, shape of x, shape of n) when ``n`` is a reshape (any spelling of the family: view, reshape,
    flatten, unflatten, view_as ...; all keep the row-major element order) of an ``src_dim``-D ``x`` to
    ``dst_dim`` dims."""
    if not _call_in(n, RESHAPE) or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    x = n.args[0]
    tx, tn = _tensor(x), _tensor(n)
    if tx is None or tn is None or tx.dim() != src_dim or tn.dim() != dst_dim:
        return None
    return x, tx.shape, tn.shape


def _merges_dims_01(four: Any, three: Any) -> bool:
    """Whether the 3-D shape ``three`` is the 4-D shape ``four`` [B, H, L, D] with dims 0 and 1 merged,
    [B*H, L, D] (in row-major order a reshape between them moves no element: [b, h, l, d] <-> [b*H + h, l, d])."""
    return _same(three[0], four[0] * four[1]) and _same(three[1], four[2]) and _same(three[2], four[3])


def _merged_heads(n: Any) -> Optional[fx.Node]:
    """``x`` when ``n`` is a reshape of a 4-D ``x`` [B, H, L, D] to [B*H, L, D]. In row-major order that
    shape merges exactly dims 0 and 1: element [b, h, l, d] lands at [b*H + h, l, d]."""
    r = _reshape_of(n, 4, 3)
    return r[0] if r is not None and _merges_dims_01(r[1], r[2]) else None


def _split_heads(n: Any) -> Optional[fx.Node]:
    """``x`` when ``n`` is a reshape of a 3-D ``x`` [B*H, L, D] to [B, H, L, D], which splits exactly dim 0:
    element [i, l, d] lands at [i // H, i % H, l, d] (the inverse of :func:`_merged_heads`)."""
    r = _reshape_of(n, 3, 4)
    return r[0] if r is not None and _merges_dims_01(r[2], r[1]) else None


def _merged_key(kt: Any) -> Optional[fx.Node]:
    """``k`` [B, H, Lk, D] when ``kt`` is ``k^T`` on merged heads: ``merge(k).transpose(-2, -1)`` or
    ``merge(k.transpose(-2, -1))`` (both [B*H, D, Lk] with ``kt[b*H + h] = k[b, h]^T``)."""
    k3 = _transposed_last_two(kt, 3)
    if k3 is not None:
        return _merged_heads(k3)
    return _transposed_last_two(_merged_heads(kt), 4)


def _product_3d(n: Any) -> Optional[tuple[fx.Node, fx.Node, Any, Any, Any]]:
    """(q, k, bias, beta, alpha) when ``n`` is ``bmm(q3, k3^T)`` (or ``matmul`` of the 3-D values) or
    ``baddbmm(bias, q3, k3^T, beta=beta, alpha=alpha)`` with q3, k3 the merged-head views of 4-D q, k of the
    same (B, H): ``n[b*H + h] = alpha * q[b, h] k[b, h]^T + beta * bias``. beta and alpha as written (numbers
    or nodes); bias None for a bmm."""
    if not _call_in(n, MATMUL + BMM + BADDBMM):
        return None
    a, kw = list(n.args), n.kwargs
    if n.target in BADDBMM:
        names = ("input", "batch1", "batch2")
        ops = [a[i] if i < len(a) else kw.get(names[i]) for i in range(3)]
        if len(a) > 3 or set(kw) - {*names, "beta", "alpha"}:
            return None
        bias, q3, kt3 = ops
        beta, alpha = kw.get("beta", 1), kw.get("alpha", 1)
    elif len(a) == 2 and not kw:
        (q3, kt3), bias, beta, alpha = a, None, 1, 1
    else:
        return None
    q, k = _merged_heads(q3), _merged_key(kt3)
    tq, tk = _tensor(q), _tensor(k)
    if q is None or k is None or tq is None or tk is None or not (_same(tq.shape[0], tk.shape[0])
                                                                 and _same(tq.shape[1], tk.shape[1])):
        return None
    return q, k, bias, beta, alpha


def _scores_3d(n: fx.Node) -> Optional[Scores]:
    """The scores of a 3-D attention (HF BLOOM): ``n`` = ``s3.view(B, H, Lq, Lk)`` splitting dim 0 of
    ``s3 = _product_3d(...)`` into the (B, H) of q and k, with a number ``alpha`` and ``beta`` and a static head
    count H; then ``n[b, h] = s3[b*H + h] = alpha * q[b, h] k[b, h]^T + beta * bias[b*H + h]``. ``alpha`` and
    ``beta`` are numbers or scalar nodes (``.item()`` of inputs under dynamic=True), resolved by
    :func:`_fold_scores_op`."""
    s3 = _split_heads(n)
    prod = _product_3d(s3)
    if prod is None:
        return None
    q, k, bias, beta, alpha = prod
    tq, tn = _tensor(q), _tensor(n)
    if not (_is_scalar(beta) and _is_scalar(alpha)) or not isinstance(tq.shape[1], int) \
            or not (_same(tn.shape[0], tq.shape[0]) and _same(tn.shape[1], tq.shape[1])):
        return None
    return Scores(q, k, [n, s3], alpha, bias, beta, int(tq.shape[1]))


def _refuse(sm: fx.Node, at: fx.Node, why: str):
    """An attention (the softmax ``sm``) whose chain is not exactly the eager math: stop, naming ``at``."""
    raise CannotReplay(Code.EAGER_ATTENTION, f"eager attention: {why}", at)


def _looks_like_attention(start: Any) -> bool:
    """A q @ k^T matmul (4-D, or a 3-D product of merged heads) within a few nodes upstream of ``start`` (so an unmatched softmax is an attention
    we cannot canonicalise, not an unrelated softmax such as a router's)."""
    frontier = [start]
    for _ in range(_SEARCH_DEPTH):
        nxt = []
        for n in frontier:
            if not isinstance(n, fx.Node):
                continue
            if _scores_op(n) is not None or _product_3d(n) is not None:
                return True
            nxt.extend(n.all_input_nodes)
        frontier = nxt
    return False


CONTRACTIONS = MATMUL + BMM + BADDBMM + EINSUM


def unrecognised_attention(gm: fx.GraphModule) -> Optional[tuple[fx.Node, str]]:
    """(contraction, reason) for a graph in which no attention was recognised but a softmax reads, within a few
    nodes, a contraction (matmul, bmm, baddbmm, einsum) of two values computed from the batch (not parameters
    alone): the shape of an attention whose scores are not one this module matches (:func:`_scores_op`). The reason
    names the chain and the operands' shapes; None when there is no such softmax (a router's softmax reads a
    product with a weight)."""
    for sm in (n for n in gm.graph.nodes if _is_softmax(n)):
        x = _softmax_args(sm)[0]
        found = _contraction_path(x) if isinstance(x, fx.Node) else None
        if found is None:
            continue
        c, path = found
        shapes = " and ".join(f"[{', '.join(str(d) for d in _tensor(o).shape)}]" for o in _batch_operands(c))
        chain = " <- ".join([_op_name(sm), *path])
        return c, (f"a softmax over a contraction of two batch values (`{chain}`, operands {shapes}) is not "
                   "recognised as an attention: its scores are not q @ k^T of 4-D [B, H, Lq, D] and [B, H, Lk, D] "
                   "values (k^T a transpose or permute of a 4-D value; einsum 'bhqd,bhkd->bhqk' or over [B, L, H, D] "
                   "operands 'bqhd,bkhd->bhqk'; bmm / baddbmm of merged-head [B*H, L, D] views)")
    return None


def _contraction_path(start: fx.Node) -> Optional[tuple[fx.Node, list[str]]]:
    """(contraction, op names from ``start`` to it) for the nearest contraction of two batch values within
    ``_SEARCH_DEPTH`` nodes upstream of ``start``."""
    frontier = [(start, [])]
    for _ in range(_SEARCH_DEPTH):
        nxt = []
        for n, path in frontier:
            if _call_in(n, CONTRACTIONS) and len(_batch_operands(n)) >= 2:
                return n, path + [_op_name(n)]
            nxt.extend((a, path + [_op_name(n)]) for a in n.all_input_nodes)
        frontier = nxt
    return None


def _batch_operands(c: fx.Node) -> list[fx.Node]:
    """The tensor operands of ``c`` computed from a graph input that is not a parameter or a buffer."""
    out = []
    for a in c.all_input_nodes:
        t = _tensor(a)
        if t is not None and t.dim() >= 2 and any(
                p.op == "placeholder" and not is_static_input(p) and isinstance(_tensor(p), torch.Tensor)
                for p in ancestors(a)):
            out.append(a)
    return out


def match_eager_attention(sm: fx.Node, scalar: Optional[Callable[[fx.Node], Optional[float]]] = None
                          ) -> Optional[EagerChain]:
    """The eager chain around softmax ``sm`` (module docstring), None when ``sm`` is not an attention's
    softmax; raises CannotReplay when it is one but the chain is not exactly that math. Walks back from the
    softmax (sinks, mask and scale steps, soft-cap, scale, scores), then forward (probabilities, output).
    ``scalar`` gives the value of a scalar node read from an input (and guards it), for ``baddbmm``'s
    ``alpha`` / ``beta`` under dynamic=True."""
    x, dim, dtype = _softmax_args(sm)
    if not isinstance(x, fx.Node) or _tensor(x) is None:
        return None
    if not _looks_like_attention(x):
        return None
    x, dtype, cast = _softmax_input_cast(x, dtype)
    sinks, x, shift = _match_sinks(sm, x, dim)
    if not _looks_like_attention(x):
        return None
    dead = [sm, *cast, *shift]
    x, folded = _softmax_frame(sm, x, dim, dead)
    masks, post, cur = _match_mask_steps(sm, x, dead)
    softcap, cur = _match_softcap(cur, dead)
    if softcap and post != 1.0:
        _refuse(sm, x, "a scale between the soft-capped scores and the softmax")
    scale, cur = _match_scores_scale(cur, dead)
    scale = _with_post_scale(sm, x, scale, post)
    sc = _scores_op(cur)
    if sc is None:
        _refuse_scores(sm, cur)
    dead.extend(sc.nodes)
    scale = _fold_scores_op(sm, x, scale, sc, masks, scalar)
    _check_scores(sm, x, cur, sc, masks, dtype)
    _check_mask_precision(sm, x, cur, masks)
    probs, p, training, folded = _match_probabilities(sm, sinks, sc, dead, folded, masks)
    gate = _match_lse_sink(sm, x, sinks, dead)
    out, v, merged_out, (v_dims, out_dims) = _match_output(sm, probs, sc, dead, folded,
                                                            gate[2] if gate is not None else None)
    _check_compute_dtype(sm, sc, probs, out)
    if gate is not None:
        sinks, out = _lse_sink_output(sm, gate, out, merged_out, dead)
    return EagerChain(sc.q, sc.k, v, scale, masks, p, training, out, dead, softcap, sinks,
                      _heads(sc) if merged_out else sc.heads, merged_out, sc.k_dims, sc.q_dims, v_dims, out_dims)


def _softmax_input_cast(x: fx.Node, dtype: Any) -> tuple[fx.Node, Any, list]:
    """(scores, dtype, [cast]) when the softmax input ``x`` is a float cast of the scores (MPT's and XLM's
    ``softmax(scores.float())``): ``softmax(s.to(d))`` is ``softmax(s, dtype=d)`` (the softmax casts its input
    first), so the cast is the softmax's dtype (the lower precision of the two when the softmax names one too,
    :func:`_check_scores` judges it); (x, dtype, []) otherwise."""
    if not (_call_in(x, CAST) and x.op == "call_method" and x.args and isinstance(x.args[0], fx.Node)
            and len(x.users) == 1):
        return x, dtype, []
    src, to = _tensor(x.args[0]), _tensor(x)
    if src is None or to is None or not (src.is_floating_point() and to.is_floating_point()):
        return x, dtype, []
    if isinstance(dtype, torch.dtype) and dtype.itemsize < to.dtype.itemsize:
        return x.args[0], dtype, [x]
    return x.args[0], to.dtype, [x]


def _softmax_frame(sm: fx.Node, x: fx.Node, dim: Any, dead: list) -> tuple[fx.Node, bool]:
    """(scores, folded): the softmax runs over the key dim of the scores, either 4-D [B, H, Lq, Lk] (dim 3;
    ``folded`` False) or with the heads folded into the batch, [B*H, Lq, Lk] (dim 2; ``folded`` True). A folded
    softmax input is the merged-heads view of 4-D scores (BART: the mask is added to ``s.view(B, H, Lq, Lk)``,
    the sum viewed back as [B*H, Lq, Lk]; row b*H + h of the view is [b, h], so the softmax over its last dim is
    the softmax over the key dim of the 4-D scores: the view joins the chain and the 4-D scores are returned)
    or a chain of numeric scales of the 3-D product itself (:func:`_check_scores` refuses a mask there)."""
    t = _tensor(x)
    if t.dim() not in (3, 4) or dim is None or normalize_dim(dim, t.dim()) != t.dim() - 1:
        _refuse(sm, sm, f"softmax over dim {dim} of a {t.dim()}-D value, not the key dim")
    if t.dim() == 4:
        return x, False
    x4 = _merged_heads(x)
    if x4 is not None:
        dead.append(x)
        return x4, True
    return x, True


def _heads(sc: Scores) -> int:
    """H of the attention (static: a folded output is unflattened by it)."""
    return sc.heads if sc.heads is not None else int(_query_value(sc).shape[1])


def _match_mask_steps(sm: fx.Node, x: fx.Node, dead: list) -> tuple[list, float, Any]:
    """(masks, post, node) walking back from the softmax input ``x`` over mask steps (additive masks,
    masked_fill / where with a large negative value) and numeric scales in any order: each mask step with
    the product of the scales between it and the softmax; ``post`` the product of all of them; ``node`` the
    first node that is neither (a soft-cap, the scale, the scores)."""
    masks: list[tuple] = []  # ("add", M, post) | ("fill", C, v, post) | ("keep", C, v, post) | ("blend", B, A, post)
    post = 1.0
    cur = x
    while True:
        step = _mask_or_scale_step(sm, cur)
        if step is None:
            return masks, post, cur
        kind, payload, nxt, *inner = step  # inner: a blend's product s * B
        if kind == "scale":
            post *= payload
        else:
            payload = tuple(_implicit_broadcast(a, cur, dead) for a in payload)
            masks.append((kind, *payload, post))
        dead.append(cur)
        dead.extend(inner)
        cur = nxt


EXPAND_AS = spellings("expand_as")


def _implicit_broadcast(a: Any, step: fx.Node, dead: list) -> Any:
    """A mask step's operand without its expansion to the scores' shape: ``M`` for ``M.expand_as(t)`` where ``t``
    has the shape of the step's result (XLM: ``(mask == 0).view(B, 1, 1, Lk).expand_as(scores)``, then
    ``scores.masked_fill_(that, v)``). The step (``masked_fill``, ``where``, ``+``, ``*``) broadcasts ``M`` to
    the scores itself, so ``step(s, M.expand_as(t)) == step(s, M)`` elementwise; the expansion reads only
    ``t``'s shape, and ``t`` is often the scores themselves, a chain value that would otherwise keep a user
    outside the chain. The expansion joins the chain (``dead``); any other user of it refuses the chain
    (:func:`_match_output`)."""
    if not (_call_in(a, EXPAND_AS) and len(a.args) == 2 and not a.kwargs and isinstance(a.args[1], fx.Node)):
        return a
    m, t = a.args
    tt, ts = _tensor(t), _tensor(step)
    if not isinstance(m, fx.Node) or tt is None or ts is None or tt.dim() != ts.dim() \
            or not all(statically_known_true(x == y) for x, y in zip(tt.shape, ts.shape)):
        return a
    dead.append(a)
    return m


def _match_scores_scale(cur: Any, dead: list) -> tuple[Any, Any]:
    """(c, scores) for ``scores * c`` / ``c * scores`` / ``scores / c`` (``("div", c)``) with ``c`` a number
    or a scalar node, directly on the scores; (1.0, cur) without one."""
    if _call_in(cur, MUL + DIV) and len(cur.args) == 2 and not cur.kwargs:
        a, b = cur.args
        if _scores_op(a) is not None and _is_scalar(b):
            dead.append(cur)
            return (("div", b) if cur.target in DIV else b), a
        if cur.target in MUL and _scores_op(b) is not None and _is_scalar(a):
            dead.append(cur)
            return a, b
    return 1.0, cur


def _with_post_scale(sm: fx.Node, x: fx.Node, scale: Any, post: float) -> Any:
    """The scale of ``q k^T`` with the numeric scales between the masks and the softmax folded in (then a
    number: ``post * c``, or ``post / c``)."""
    if post == 1.0:
        return scale
    if isinstance(scale, fx.Node) or (isinstance(scale, tuple) and isinstance(scale[1], fx.Node)):
        _refuse(sm, x, "a scale read from an input combined with another scale of the scores")
    return post * (1.0 / scale[1] if isinstance(scale, tuple) else scale)


def _fold_scores_op(sm: fx.Node, x: fx.Node, scale: Any, sc: Scores, masks: list,
                    scalar: Optional[Callable[[fx.Node], Optional[float]]] = None) -> Any:
    """The SDPA scale once the scores op's own factors are in: ``c * (alpha * q k^T + beta * bias)`` is
    ``(c * alpha) * q k^T`` plus the bias step ``("bias", bias, H, c * beta)`` (a ``baddbmm``'s input, read
    as [B, H, ...] by :func:`_canonical_mask`; none at ``beta = 0``, where torch does not read the input).
    ``alpha`` / ``beta`` read from scalar inputs take their values through ``scalar`` (guarded there)."""
    for name in ("alpha", "beta"):
        f = getattr(sc, name)
        if isinstance(f, fx.Node):
            value = scalar(f) if scalar is not None else None
            if value is None:
                _refuse(sm, f, f"the baddbmm {name} of the scores is computed in the graph, not a number or a "
                        "scalar input")
            setattr(sc, name, float(value))
    if sc.beta == 0:
        sc.bias = None
    if sc.alpha == 1.0 and sc.bias is None:
        return scale
    if isinstance(scale, fx.Node) or (isinstance(scale, tuple) and isinstance(scale[1], fx.Node)):
        _refuse(sm, x, "a scale read from an input on baddbmm scores")
    c = 1.0 / scale[1] if isinstance(scale, tuple) else scale
    if sc.bias is not None:
        masks.append(("bias", sc.bias, sc.heads, c * sc.beta))
    return c * sc.alpha


def _refuse_scores(sm: fx.Node, cur: Any):
    """Refuse a chain whose scores are not a q @ k^T product, naming the ops on the way."""
    path = _path_to_scores(cur)
    capped = " (logit soft-capping)" if "tanh" in path else ""
    if any(p in ("cat", "concat", "concatenate") for p in path):
        _refuse(sm, cur, f"`{' <- '.join(path)}`: logits concatenated to the scores before the softmax "
                "in a form that is not an attention sink (one [H] logit per head joined on the key dim, "
                "dropped after the softmax)")
    _refuse(sm, cur, f"`{' <- '.join(path)}` between the scores matmul and the softmax{capped} "
            "is not supported")


def _check_scores(sm: fx.Node, x: fx.Node, cur: fx.Node, sc: Scores, masks: list, dtype: Any) -> None:
    """Shapes and dtypes: the masks do not enlarge the scores and are float of the scores' dtype, q and k
    have the same heads, and the softmax runs in the scores' precision or higher."""
    tq, tk, ts = _query_value(sc), _key_value(sc), _tensor(cur)
    if tuple(_tensor(x).shape) != tuple(ts.shape):
        _refuse(sm, x, "the attention mask enlarges the scores")
    if sc.folded and any(m[0] not in ("bias", "floor") for m in masks):
        _refuse(sm, x, "a mask on [B*H, Lq, Lk] scores (heads folded into the batch dim): only a mask on their "
                "[B, H, Lq, Lk] view is read per head")
    _check_mask_steps(sm, x, masks)
    for m in masks:
        if m[0] in ("add", "blend"):
            tm = _tensor(_added(m))
            if tm is None or not tm.is_floating_point():
                _refuse(sm, x, "the value added to the scores is not a float tensor (a bool mask added is a bias)")
    if tq.shape[:2] != tk.shape[:2]:
        _refuse(sm, cur, "query and key heads differ (no repeat_kv before the scores)")
    sd = ts.dtype
    sm_dtype = dtype if isinstance(dtype, torch.dtype) else sd
    if sm_dtype.itemsize < sd.itemsize:
        _refuse(sm, sm, f"the softmax of {sd} scores is computed in {sm_dtype}: the original rounds the "
                f"probabilities to {sm_dtype} (and overflows a lowest-{sd} mask value to -inf), which tree "
                f"attention in {sd} does not reproduce; use {sd} throughout or attn_implementation='sdpa'")


def _check_mask_precision(sm: fx.Node, x: fx.Node, cur: fx.Node, masks: list) -> None:
    """An additive mask of another float dtype than the scores ``cur``. One of lower precision is promoted
    exactly by the sum (``s + M == s + M.to(s.dtype)``; :func:`_canonical_mask` casts it) and accepted, unless it
    is a per-head bias, whose rounding tree attention does not reproduce (refused). One of higher precision
    promotes the scores themselves, exactly (a bfloat16 score is a float32 value; autocast's bfloat16 ``q k^T``
    plus HF's float32 mask): the softmax then sees the scores unrounded plus the mask in its precision, as tree
    attention sees them (its scores and bias in its accumulation dtype), so it is accepted, and the canonical
    mask keeps that precision (:func:`_mask_dtype`). A 0/1 blend factor of higher precision likewise. Runs after
    :func:`_check_scores`, so a softmax in lower precision than the scores is named first."""
    ts = _tensor(cur)
    for m in masks:
        tm = _tensor(_added(m)) if m[0] in ("add", "blend") else None
        if tm is None or torch.promote_types(tm.dtype, ts.dtype) == tm.dtype:  # at least the scores' precision
            continue
        if _per_head(_added(m)):
            _refuse(sm, x, f"a {tm.dtype} per-head bias (ALiBi) added to {ts.dtype} scores: tree attention "
                    f"does not reproduce its {tm.dtype} rounding (build the bias in {ts.dtype})")


def _check_compute_dtype(sm: fx.Node, sc: Scores, probs: fx.Node, out: fx.Node) -> None:
    """The chain computes in one dtype, the one the canonical SDPA node computes in (its output's, the SDPA
    rule casts q, k, v to it: :func:`..rules.attention.attention_dtype`): the scores product ``q k^T`` and the
    product with the values have one dtype ``d`` (autocast runs both in its dtype whatever q, k, v are), and the
    probabilities reach the second product in the query's dtype or in ``d`` (autocast's product rounds float32
    probabilities to ``d``, as it rounds v). Refused otherwise, with the dtypes named."""
    td, to, tp = _tensor(sc.nodes[0]), _tensor(out), _tensor(probs)
    if td is None or to is None or tp is None:
        _refuse(sm, out, "the attention's dtypes are unknown (no traced values)")
    if td.dtype != to.dtype:
        _refuse(sm, out, f"the scores q k^T are computed in {td.dtype}, the product with the values in {to.dtype}: "
                "tree attention computes both in one dtype")
    tq = _query_value(sc)
    if tp.dtype not in (tq.dtype, to.dtype):
        _refuse(sm, probs, f"the probabilities are {tp.dtype}, the query is {tq.dtype} and the attention "
                f"computes in {to.dtype}")


def _added(m: tuple) -> Any:
    """The operand a mask step adds to the scores: M of ``("add", M, post)``, A of ``("blend", B, A, post)``."""
    return m[2] if m[0] == "blend" else m[1]


def _match_probabilities(sm: fx.Node, sinks: Optional[fx.Node], sc: Scores, dead: list, folded: bool,
                         masks: Sequence = ()) -> tuple[fx.Node, Any, Any, bool]:
    """(probs, dropout p, training, folded) walking forward from the softmax: [drop the sink column] -> [cast to
    the query's dtype] and [dropout] in either order, and any views folding the heads into the batch
    ([B, H, Lq, Lk] -> [B*H, Lq, Lk], :func:`_merged_heads`) or unfolding them (:func:`_split_heads`, into q's
    (B, H)): each keeps the elements, only the frame changes. ``folded`` is the frame of the softmax's output
    on entry and of ``probs`` on return; ``probs`` is the last node of the walk (the product's operand).
    Also once: ``p.masked_fill(C, 0)`` with the condition ``C`` of a blocking ``masked_fill`` step of the scores
    (CPM-Ant; :func:`_zeroes_blocked`)."""
    tq = _query_value(sc)
    cur = sm
    nxt = _only_user(cur)
    if sinks is not None:
        if not _drops_last_column(nxt, cur):
            _refuse(sm, nxt or sm, "the softmax over the scores and the sink logits is not followed by dropping the "
                    "sink column (`probs[..., :-1]`)")
        dead.insert(0, nxt)
        cur, nxt = nxt, _only_user(nxt)
    p, training = 0.0, False
    seen_cast = seen_dropout = seen_zero = False
    while nxt is not None:
        if not seen_cast and nxt.op == "call_method" and nxt.target in CAST and nxt.args[0] is cur:
            if _tensor(nxt) is None or not _tensor(nxt).is_floating_point():
                _refuse(sm, nxt, "the probabilities are not cast to a float dtype")
            seen_cast = True
        elif not seen_dropout and nxt.target in DROPOUT and nxt.args[0] is cur:
            p = arg(nxt, 1, "p", 0.5)
            training = arg(nxt, 2, "training", True)
            if arg(nxt, 3, "inplace", False):
                _refuse(sm, nxt, "in-place dropout of the probabilities")
            seen_dropout = True
        elif not seen_zero and not folded and _zeroes_blocked(nxt, cur, masks):
            seen_zero = True
        elif not folded and _merged_heads(nxt) is cur:
            folded = True
        elif folded and _split_heads(nxt) is cur and tuple(_tensor(nxt).shape[:2]) == tuple(tq.shape[:2]):
            folded = False
        else:
            break
        dead.insert(0, nxt)
        cur, nxt = nxt, _only_user(nxt)
    if nxt is None:
        _refuse(sm, cur, "the attention probabilities have other users (output_attentions=True?)")
    return cur, p, training, folded


def _zeroes_blocked(n: fx.Node, p: fx.Node, masks: Sequence) -> bool:
    """``n`` is ``p.masked_fill(C, 0)`` where ``C`` computes the same condition as a ``fill`` mask step of the
    scores (:func:`_same_value`; the step blocks with a large negative value, :func:`_check_mask_steps`): a
    blocked key's probability is already exactly 0, and a query row with no key left (NaN or uniform in the
    original) becomes 0, as in tree attention. So ``n`` is ``p``."""
    if not _call_in(n, MASKED_FILL) or n.kwargs or len(n.args) != 3 or n.args[0] is not p or _number(n.args[2]) != 0:
        return False
    return any(m[0] == "fill" and _same_value(m[1], n.args[1]) for m in masks)


def _same_value(a: Any, b: Any, depth: int = 6) -> bool:
    """Whether ``a`` and ``b`` provably hold the same value: the same node or constant, or two calls of the same
    deterministic op on arguments that hold the same values (CPM-Ant builds its mask condition twice:
    ``mask.view(B, 1, Lq, Lk) == torch.tensor(False)``)."""
    if a is b:
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y, depth) for x, y in zip(a, b))
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return not isinstance(a, fx.Node) and not isinstance(b, fx.Node) and type(a) is type(b) and a == b
    if depth == 0 or a.op not in ("call_function", "call_method") or (a.op, a.target) != (b.op, b.target) \
            or a.is_impure() or _mutates(a) or set(a.kwargs) != set(b.kwargs) \
            or random_draw(a, by_name=True) is not None:
        return False
    return _same_value(a.args, b.args, depth - 1) and all(_same_value(a.kwargs[k], b.kwargs[k], depth - 1)
                                                          for k in a.kwargs)


def _match_output(sm: fx.Node, probs: fx.Node, sc: Scores, dead: list, folded: bool, gated: Optional[fx.Node] = None
                  ) -> tuple[fx.Node, fx.Node, bool, tuple]:
    """(out, v, merged, (v_dims, out_dims)) for the product of the probabilities with the values: ``matmul(p, v)``
    of a 4-D ``v``, or an einsum over ``p`` and ``v.permute(v_dims)`` whose result is the [B, H, Lq, D] output
    ``.permute(out_dims)`` (``einsum("bhqk,bhkd->bhqd", p, v)``, ``einsum("bhqk,bkhd->bqhd", p, v)`` of a
    [B, L, H, D] ``v``: :func:`_einsum_4d`); for ``folded`` [B*H, Lq, Lk] probabilities ``bmm(p3, v3)``
    with ``v3`` the merged-heads view of a 4-D ``v`` of q's (B, H), and ``out`` the view of its result back to [B, H, Lq, D]
    when that is its only user (``merged`` False), else the [B*H, Lq, D] product itself (``merged`` True: the
    SDPA output is flattened for its users). Checks that no chain node has a user outside the chain (``gated``
    included)."""
    tq, tk = _query_value(sc), _key_value(sc)
    layout = (None, None)
    nxt = _only_user(probs)
    if nxt is None:
        _refuse(sm, probs, "the attention probabilities have other users (output_attentions=True?)")
    if folded:
        pv = (nxt.args[0], _merged_heads(nxt.args[1])) if _call_in(nxt, MATMUL + BMM) and len(nxt.args) == 2 \
            and not nxt.kwargs else None
        if pv is None or pv[1] is None:
            _refuse(sm, nxt, f"the [B*H, Lq, Lk] probabilities go to `{_op_name(nxt)}`, not to a bmm with "
                    "the merged-heads view [B*H, Lk, D] of the values")
        if not isinstance(tq.shape[1], int):
            _refuse(sm, nxt, "a 3-D attention with a symbolic head count")
    else:
        pv = _einsum_4d(nxt, "output")
        if pv is None and (nxt.target not in MATMUL or len(nxt.args) != 2 or nxt.kwargs):
            _refuse(sm, nxt, f"the probabilities go to `{_op_name(nxt)}`, not to a matmul with the values")
        if pv is not None:
            pv, layout = pv[:2], pv[2:]
        else:
            pv = nxt.args
    p_, v = pv
    if p_ is not probs:
        _refuse(sm, nxt, "the probabilities are not the first operand of the matmul with the values")
    tv = _permuted_value(v, layout[0])
    if tv is None or tv.dim() != 4 or tv.shape[:2] != tq.shape[:2] or tv.shape[2] != tk.shape[2]:
        _refuse(sm, nxt, "the values are not [B, H, Lk, D] like the keys")
    inside = {*dead, nxt, gated}  # gated: the product of the output with a sink gate (_match_lse_sink)
    for n in dead:
        if not set(n.users) <= inside:
            _refuse(sm, n, f"the intermediate `{n.name}` has other users (attention weights returned?)")
    dead.insert(0, nxt)
    if not folded:
        return nxt, v, False, layout
    user = _only_user(nxt)
    if user is not None and _split_heads(user) is nxt and tuple(_tensor(user).shape[:2]) == tuple(tq.shape[:2]):
        dead.insert(0, user)
        return user, v, False, layout
    return nxt, v, True, layout




def _match_sinks(sm: fx.Node, x: fx.Node, dim: Any) -> tuple[Optional[fx.Node], fx.Node, list]:
    """(S, scores, shift) when the softmax input ``x`` is ``cat([scores, sinks], -1)``, optionally minus its row
    maximum (``c - c.max(-1, keepdim=True).values`` / ``amax``: a per-row shift, the softmax is unchanged;
    stripped also without a concatenation: (None, c, shift); ``shift`` the nodes of the shift and the
    concatenation, output side first, [] without either),
    with ``sinks`` a ``[B, H, Lq, 1]`` column: a view/expand of a 1-D node S of the H heads' logits (head h
    reads S[h]: only reshape/view/unsqueeze/expand, which keep the element order), or else the column itself
    as S, one logit per query row (Inkling2's projection of the hidden states; the SDPA rule requires it to be
    a value of the query token); (None, x) when ``x`` is no concatenation; raises CannotReplay for a
    concatenation onto attention scores that is not that."""
    c, shift = x, []
    if _call_in(x, spellings("sub")) and len(x.args) == 2 and not x.kwargs:
        c0, m = x.args
        if isinstance(c0, fx.Node) and _is_row_max(m, c0):
            c = c0
            if set(c.users) != {x, _max_source(m)}:
                _refuse(sm, c, "the scores shifted by their row maximum have other users")
            shift = [x] + ([m] if m is not _max_source(m) else []) + [_max_source(m)]
    if not (_call_in(c, spellings("cat")) and _tensor(c) is not None and _tensor(c).dim() == 4):
        return None, c, shift
    ops = c.args[0] if c.args else c.kwargs.get("tensors")
    cdim = arg(c, 1, "dim", 0)
    if not (isinstance(ops, (list, tuple)) and len(ops) == 2 and all(isinstance(o, fx.Node) for o in ops)):
        return None, c, shift
    scores, sink = ops
    if not _looks_like_attention(scores):
        return None, c, shift
    ts, te = _tensor(scores), _tensor(sink)
    if normalize_dim(cdim, 4) != 3 or dim is None or normalize_dim(dim, 4) != 3 or te is None or ts is None:
        _refuse(sm, c, "logits concatenated to the scores on a dim other than the key dim")
    H = ts.shape[1]
    if te.dim() != 4 or tuple(te.shape) != (ts.shape[0], H, ts.shape[2], 1):
        _refuse(sm, c, "logits concatenated to the scores that are not one sink logit per query row "
                f"(a [B, H, Lq, 1] column; got {list(te.shape)} beside scores {list(ts.shape)})")
    source = _sink_source(sink)
    if source is not None and (_tensor(source).numel() != H or sum(int(d) != 1 for d in _tensor(source).shape) > 1):
        _refuse(sm, c, "logits concatenated to the scores that are a view of neither one logit per head "
                "(an [H] tensor viewed as [1, H, 1, 1] and expanded) nor a [B, H, Lq, 1] value per query row")
    if len(c.users) != 1 and c is x:
        _refuse(sm, c, "the scores concatenated with the sink logits have other users")
    # per head: the [H] source; per query row: the [B, H, Lq, 1] column itself (attention.sdpa requires it to be
    # a value of the query token, its token axis the queries')
    return source if source is not None else sink, scores, shift + [c]


SIGMOID = spellings("sigmoid")


def _match_lse_sink(sm: fx.Node, x: fx.Node, sinks: Optional[fx.Node], dead: list
                    ) -> Optional[tuple[fx.Node, fx.Node, fx.Node]]:
    """(S, gate, mul) when the scores ``x`` also feed a sink applied after the attention (GraniteMoE-SWA)::

        g = sigmoid(logsumexp(x, -1) - S.view(1, H, 1)).unsqueeze(-1)     # [B, H, Lq, 1]
        o = (softmax(x) @ v) * g

    ``sigmoid(lse - S) = sum_j e^x_j / (sum_j e^x_j + e^S)``, so ``o = sum_j e^x_j v_j / (sum_j e^x_j + e^S)``:
    attention with one value-less sink logit ``S[h]`` per head, like :func:`_match_sinks`. Casts on the way
    must keep the dtype (a rounding cast would change the gate). The gate's nodes join ``dead``; ``mul`` is
    checked against the attention output by :func:`_lse_sink_output`. None when no user of ``x`` is a
    logsumexp; raises CannotReplay for one that is not this form."""
    lse = next((u for u in x.users if _call_in(u, LOGSUMEXP)), None)
    if lse is None:
        return None
    tx = _tensor(x)
    d = arg(lse, 1, "dim")
    d = d[0] if isinstance(d, (list, tuple)) and len(d) == 1 else d
    keep = arg(lse, 2, "keepdim", False)
    if sinks is not None or tx.dim() != 4 or not isinstance(d, int) or normalize_dim(d, 4) != 3 or keep:
        _refuse(sm, lse, "the scores also go to a logsumexp that is not a sink gate sigmoid(logsumexp(s, -1) - S) "
                "on the attention output")
    H = tx.shape[1]
    chain = [lse]
    sub = _only_user(lse)
    if not (_call_in(sub, spellings("sub")) and len(sub.args) == 2 and not sub.kwargs and sub.args[0] is lse
            and isinstance(sub.args[1], fx.Node)):
        _refuse(sm, sub or lse, "the logsumexp of the scores is not a sink gate (logsumexp - S per head)")
    sv, source = _tensor(sub.args[1]), _sink_source(sub.args[1])
    if source is None or sv is None or sv.dim() not in (2, 3) or tuple(sv.shape[-2:]) != (H, 1) \
            or any(int(e) != 1 for e in sv.shape[:-2]) or _tensor(source).numel() != H:
        _refuse(sm, sub, "the logsumexp of the scores minus something other than one sink logit per head "
                "(an [H] tensor viewed as [1, H, 1])")
    chain.append(sub)
    cur, seen_sigmoid, seen_unsqueeze = sub, False, False
    while True:
        nxt = _only_user(cur)
        if nxt is None:
            _refuse(sm, cur, "the sink gate of the attention has other users")
        if _call_in(nxt, CAST) and nxt.op == "call_method" and nxt.args[0] is cur:
            if _tensor(nxt).dtype != _tensor(cur).dtype:
                _refuse(sm, nxt, f"the sink gate sigmoid(logsumexp(s) - S) is computed in {_tensor(nxt).dtype}, "
                        f"the scores are {_tensor(cur).dtype}: its rounding is not reproduced")
        elif not seen_sigmoid and _call_in(nxt, SIGMOID) and nxt.args[0] is cur:
            seen_sigmoid = True
        elif seen_sigmoid and not seen_unsqueeze and _call_in(nxt, ("unsqueeze", torch.unsqueeze)) \
                and nxt.args[0] is cur and _tensor(nxt).dim() == 4 and _tensor(nxt).shape[-1] == 1:
            seen_unsqueeze = True
        elif seen_unsqueeze and _call_in(nxt, MUL) and len(nxt.args) == 2 and not nxt.kwargs:
            dead.extend(reversed(chain))
            return source, cur, nxt
        else:
            _refuse(sm, nxt, f"the logsumexp of the scores goes to `{_op_name(nxt)}`, not to a sink gate "
                    "sigmoid(logsumexp(s) - S).unsqueeze(-1) multiplying the attention output")
        chain.append(nxt)
        cur = nxt


def _lse_sink_output(sm: fx.Node, gate: tuple, out: fx.Node, merged: bool, dead: list) -> tuple[fx.Node, fx.Node]:
    """(S, mul): the sink gate of :func:`_match_lse_sink` multiplies the [B, H, Lq, D] attention output ``out``
    (its only user); ``mul`` is then the chain's output."""
    source, g, mul = gate
    if merged or _only_user(out) is not mul or {a for a in mul.args} != {out, g}:
        _refuse(sm, mul, "the sink gate sigmoid(logsumexp(s) - S) does not multiply the attention output")
    dead.insert(0, mul)
    return source, mul


def _max_source(m: fx.Node) -> Optional[fx.Node]:
    """The ``max``/``amax`` node whose values ``m`` reads (``m`` itself for ``amax``)."""
    if _call_in(m, MAX) and m.target in (torch.amax, "amax"):
        return m
    if isinstance(m, fx.Node) and m.op == "call_function" and m.target in (operator.getitem, getattr) \
            and m.args[1] in (0, "values") and _call_in(m.args[0], MAX):
        return m.args[0]
    return None


def _is_row_max(m: Any, c: fx.Node) -> bool:
    """``m`` is ``c.max(dim=-1, keepdim=True).values`` (or ``[0]``, or ``amax(c, -1, keepdim=True)``)."""
    src = _max_source(m) if isinstance(m, fx.Node) else None
    if src is None or src.args[0] is not c:
        return False
    d = arg(src, 1, "dim")
    keep = arg(src, 2, "keepdim", False)
    if isinstance(d, (list, tuple)) and len(d) == 1:
        d = d[0]
    return isinstance(d, int) and normalize_dim(d, 4) == 3 and keep is True


def _sink_source(n: fx.Node) -> Optional[fx.Node]:
    """The 1-D (or one-non-singleton-dim) node that ``n`` is a chain of reshape/view/unsqueeze/expand of, or
    None when another op is on the way."""
    while _call_in(n, RESHAPE_VIEWS):
        n = n.args[0]
        t = _tensor(n)
        if t is not None and sum(int(d) != 1 for d in t.shape) <= 1 and not _call_in(n, RESHAPE_VIEWS):
            return n
    return None


def _drops_last_column(n: Optional[fx.Node], probs: fx.Node) -> bool:
    """``n`` is ``probs[..., :-1]`` (the sink column dropped)."""
    if n is None or n.op != "call_function" or n.target is not operator.getitem or n.args[0] is not probs:
        return False
    idx = n.args[1]
    if not isinstance(idx, tuple):
        return False
    if idx and idx[0] is Ellipsis:
        idx = idx[1:]
    else:
        idx = tuple(i for i in idx[3:]) if all(i == slice(None) for i in idx[:3]) and len(idx) == 4 else None
    return idx == (slice(None, -1, None),)


TANH = spellings("tanh")


def _blended_scores(n: Any) -> Optional[tuple[fx.Node, fx.Node]]:
    """(s, B) when ``n`` is ``s * B`` (either order) with ``s`` from the scores and ``B`` a tensor that is not: the
    scores side of a blend ``s * B + A`` (OpenAI-GPT's ``w * b + -1e4 * (1 - b)``). Where B is 1 that is ``s + A``,
    where B is 0 it is ``A``, which drops the score: a mask with fill ``A`` there when A blocks
    (:func:`_canonical_mask` marks every other entry for the classification to refuse). B must vary along the key
    dim (its last dim not broadcast): a factor constant over the keys (a per-head or per-query scale such as a
    learned ``[H, 1, 1]`` temperature) scales the scores, it does not mask them, and is refused as a scale."""
    if not (_call_in(n, MUL) and len(n.args) == 2 and not n.kwargs):
        return None
    x, y = n.args
    for s, B in ((x, y), (y, x)):
        tb = _tensor(B) if isinstance(B, fx.Node) else None
        if isinstance(s, fx.Node) and tb is not None and tb.dim() >= 1 and tb.shape[-1] != 1 \
                and _looks_like_attention(s) and not _looks_like_attention(B):
            return s, B
    return None


def _mask_or_scale_step(sm: fx.Node, cur: Any):
    """One step between the scores and the softmax, walking towards the scores: ``("scale", c, s)`` for
    ``s * c`` / ``c * s`` / ``s / c`` with a number ``c``; ``("add", (M,), s)`` for ``s + M``;
    ``("fill", (C, v), s)`` for ``s.masked_fill(C, v)`` / ``where(C, v, s)``; ``("keep", (C, v), s)`` for
    ``where(C, s, v)`` / ``s.where(C, v)``; ``("blend", (B, A), s, s * B)`` for ``s * B + A``
    (:func:`_blended_scores`); None for anything else. ``s`` is the operand that comes from
    the scores; the mask values are checked by the caller."""
    if not isinstance(cur, fx.Node) or cur.op not in ("call_function", "call_method"):
        return None
    a = list(cur.args)
    if cur.op == "call_method" and cur.target in CAST and a and isinstance(a[0], fx.Node) \
            and _tensor(cur) is not None and _tensor(a[0]) is not None and _tensor(cur).dtype == _tensor(a[0]).dtype \
            and _looks_like_attention(a[0]):
        return "scale", 1.0, a[0]  # a cast to the scores' own dtype (MPT's .float() of float32 scores)
    if _call_in(cur, ADD) and len(a) == 2 and not cur.kwargs:
        side = [o for o in a if isinstance(o, fx.Node) and _looks_like_attention(o)]
        if len(side) == 2:
            _refuse(sm, cur, "an addition to the scores where the mask operand cannot be told apart "
                    "(both operands come from q @ k^T)")
        if len(side) == 1:
            M = a[1] if side[0] is a[0] else a[0]
            blend = _blended_scores(side[0])
            if blend is not None:
                return "blend", (blend[1], M), blend[0], side[0]
            return "add", (M,), side[0]
        return None
    if _call_in(cur, MUL + DIV) and len(a) == 2 and not cur.kwargs:
        s, c = a
        if cur.target in MUL and _number(s) is not None:
            s, c = c, s
        if _number(c) is None or not _looks_like_attention(s) or _scores_op(s) is not None \
                or _call_in(s, TANH):
            return None  # a scale directly on the scores (or a soft-cap's factor) is matched by the caller
        return "scale", (1.0 / _number(c) if cur.target in DIV else _number(c)), s
    floor = _floor_step(cur)
    if floor is not None:
        return floor
    if _call_in(cur, MASKED_FILL):
        s = a[0] if a else cur.kwargs.get("input")
        C = a[1] if len(a) > 1 else cur.kwargs.get("mask")
        v = a[2] if len(a) > 2 else cur.kwargs.get("value")
        if isinstance(s, fx.Node) and _looks_like_attention(s):
            return "fill", (C, v), s
        return None
    if _call_in(cur, WHERE) and not cur.kwargs:
        if cur.op == "call_method" and len(a) == 3:  # s.where(C, v)
            s, C, v = a
            kind = "keep"
        elif len(a) == 3:
            C, x, y = a
            kind, s, v = ("keep", x, y) if isinstance(x, fx.Node) and _looks_like_attention(x) else ("fill", y, x)
        else:
            return None
        if isinstance(s, fx.Node) and _looks_like_attention(s):
            return kind, (C, v), s
    return None




def _floor_step(cur: fx.Node):
    """``("floor", (c,), s)`` for ``max(s, c)`` / ``maximum(s, c)`` with a constant one-element tensor ``c``
    (XGLM's ``torch.max(s + M, torch.full((), finfo.min))``) or ``s.clamp(min=c)`` / ``clamp_min(s, c)`` with a
    number ``c``, ``s`` from the scores; None otherwise. It raises only scores below ``c``, and ``c`` must be a
    blocking value (:func:`_check_mask_steps`): a visible score lies above it (the assumption of every mask
    value, ``BLOCKING``) and a masked one stays at or below it, so its probability stays exactly 0."""
    if not _call_in(cur, FLOORS):
        return None
    a, kw = list(cur.args), cur.kwargs
    if cur.target in (torch.maximum, "maximum", torch.max, "max"):
        if len(a) != 2 or kw or not isinstance(a[1], fx.Node):  # max(s, 3) is a reduction over dim 3
            return None
        s, c = a
        if _constant(s) is not None:
            s, c = c, s
        value = _constant(c)
    else:
        s = a[0] if a else None
        if cur.target in (torch.clamp_min, "clamp_min"):
            c, hi = (a[1] if len(a) > 1 else kw.get("min")), None
        else:
            c, hi = (a[1] if len(a) > 1 else kw.get("min")), (a[2] if len(a) > 2 else kw.get("max"))
        value = _number(c) if hi is None else None
    if value is None or not isinstance(s, fx.Node) or not _looks_like_attention(s):
        return None
    return "floor", (value,), s


def _check_mask_steps(sm: fx.Node, x: fx.Node, masks: list) -> None:
    """Each mask step must block with a large negative value (``BLOCKING``), as seen by the softmax (after
    the scales between it and the softmax, which must be positive), on a bool condition."""
    for m in masks:
        kind, post = m[0], m[-1]
        if post <= 0:
            _refuse(sm, x, f"an attention mask followed by a non-positive scale {post}")
        if kind in ("add", "bias", "blend"):
            continue
        if kind == "floor":
            if not m[1] * post <= BLOCKING:
                _refuse(sm, x, f"the scores are raised to at least {m[1]} before the softmax (max / clamp): not a "
                        f"blocking value (<= {BLOCKING:g}, finfo.min), so visible scores may change")
            continue
        C, v = m[1], m[2]
        tc = _tensor(C)
        if tc is None or tc.dtype != torch.bool:
            _refuse(sm, x, "masked_fill / where on the scores with a condition that is not a bool tensor")
        value = _number(v)
        if value is None or not value * post <= BLOCKING:
            what = "a value computed in the graph" if value is None else f"{value}"
            _refuse(sm, x, f"masked_fill / where on the scores with {what}: not a large negative constant "
                    f"(<= {BLOCKING:g}, -inf, finfo.min), so it is a bias, not a mask")


def _number(x: Any) -> Optional[float]:
    """The value of a Python number, or of a one-element constant tensor made in the graph (:func:`_constant`)."""
    if isinstance(x, fx.Node):
        return _constant(x)
    return float(x) if isinstance(x, numbers.Real) and not isinstance(x, bool) else None






def _constant(n: fx.Node) -> Optional[float]:
    """``v`` rounded to the node's dtype when ``n`` makes a one-element tensor of the number ``v``
    (``spellings.CONSTANT_FILLS``), through calls that keep their operand's value (``spellings.SAME_VALUE``),
    else None."""
    while _call_in(n, SAME_VALUE) and n.args and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    t = _tensor(n)
    if n.op != "call_function" or n.target not in CONSTANT_FILLS or t is None or not t.is_floating_point() \
            or t.numel() != 1:
        return None
    a = list(n.args)
    v = a[1] if n.target is torch.full and len(a) > 1 else (a[0] if n.target is not torch.full and a else None)
    if n.target is torch.full and v is None:
        v = n.kwargs.get("fill_value")
    if not isinstance(v, numbers.Real) or isinstance(v, bool):
        return None
    return float(torch.tensor(float(v), dtype=t.dtype).item())


def _match_softcap(cur: Any, dead: list) -> tuple[Any, Any]:
    """(cap, scores) for ``mul(tanh(div(scores, cap)), cap)`` (either operand order of the mul): one
    positive number ``cap`` on both sides, or two scalar nodes (``.item()`` of inputs under dynamic=True:
    returned as a pair, resolved and guarded by :func:`_resolve_softcaps`); (0.0, cur) for anything else."""
    if not (_call_in(cur, MUL) and len(cur.args) == 2 and not cur.kwargs):
        return 0.0, cur
    a, b = cur.args
    th, factor = (a, b) if _call_in(a, TANH) else (b, a)
    if not _call_in(th, TANH) or not _is_scalar(factor) or len(th.args) != 1 or th.kwargs:
        return 0.0, cur
    d = th.args[0]
    if not (_call_in(d, DIV) and len(d.args) == 2 and not d.kwargs and _is_scalar(d.args[1])):
        return 0.0, cur
    divisor = d.args[1]
    if isinstance(divisor, fx.Node) or isinstance(factor, fx.Node):
        cap: Any = (divisor, factor)
    elif _number(divisor) == _number(factor) and _number(factor) > 0:
        cap = _number(factor)
    else:
        return 0.0, cur
    dead.extend([cur, th, d])
    return cap, d.args[0]


def _resolve_softcaps(graph: fx.Graph, placeholders: list, values: dict, canon: "Canonical") -> None:
    """Soft-caps read from scalar inputs: both sides must hold one positive value; it is specialised,
    with a per-call guard on each input (like the attention scale)."""
    for node in graph.nodes:
        src = SOFTCAP.get(node)
        if not isinstance(src, tuple):
            continue
        got = []
        for side in src:
            if isinstance(side, fx.Node):
                value, guard_src = _scalar_value(side, placeholders, values)
                if value is None:
                    raise CannotReplay(Code.ATTENTION_SCALAR,
                                       "eager attention: the soft-cap is computed in the graph, not read from a "
                                       "scalar input", node)
                pos, transform = guard_src
                canon.guards.append(scalar_equals(pos, value, f"attention soft-cap of {node.name} "
                                                              f"(input {placeholders[pos].name})"))
                got.append(float(transform(value)))
            else:
                got.append(float(side))
        if got[0] != got[1] or got[0] <= 0:
            raise CannotReplay(Code.EAGER_ATTENTION,
                               f"eager attention: tanh soft-capping divides by {got[0]} and multiplies by "
                               f"{got[1]}", node)
        SOFTCAP.set(node, got[0])
        canon.notes.append(f"{node.name}: soft-cap specialised to {got[0]}")


def _call_in(n: Any, targets) -> bool:
    return isinstance(n, fx.Node) and n.op in ("call_function", "call_method") and n.target in targets


def _path_to_scores(n: fx.Node) -> list[str]:
    """Op names from ``n`` back to the scores matmul, following the input that leads there."""
    names = []
    while isinstance(n, fx.Node) and _scores_op(n) is None and len(names) < _SEARCH_DEPTH:
        names.append(_op_name(n))
        n = next((a for a in n.all_input_nodes if _looks_like_attention(a)), None)
    return names + ["q @ k^T"]


# --------------------------------------------------------------------------------------------------
# rewriting


def _replace_with_sdpa(graph: fx.Graph, ch: EagerChain, canon: Canonical,
                       values: Optional[dict] = None) -> list[fx.Node]:
    """Insert ``scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=c, dropout_p=p)`` after the
    chain's output matmul, redirect its users, erase the chain. Returns the node if it has a mask. A per-key
    bias computed from trainable tensors (:func:`_key_bias`) becomes one more q/k feature."""
    scale = ch.scale
    if isinstance(scale, tuple):  # division by c
        c = scale[1]
        if isinstance(c, fx.Node):  # 1.0 / x.item(): resolved to a constant by _specialise_scalars
            with graph.inserting_after(c):
                scale = graph.call_function(operator.truediv, (1.0, c))
        else:
            scale = 1.0 / c
    p = ch.dropout_p if ch.dropout_training is not False else 0.0
    width = None
    with graph.inserting_before(ch.out):
        q, k, v = (x if dims is None else _call(graph, "permute", (x, *dims))
                   for x, dims in ((ch.q, ch.q_dims), (ch.k, ch.k_dims), (ch.v, ch.v_dims)))
        ch = dataclasses.replace(ch, q=q, v=v, q_dims=None, v_dims=None)
        keyed = _key_bias(graph, ch, k, scale, values or {})
        if keyed is not None:
            (q, k, v), masks, width, _ = keyed
            ch = dataclasses.replace(ch, masks=masks)
        relative = _relative_step(graph, ch, values or {})
        if relative is not None:
            masks, relative = relative
            ch = dataclasses.replace(ch, masks=masks)
        mask = _canonical_mask(graph, ch)
    kwargs = {"attn_mask": mask, "dropout_p": p, "is_causal": False, "scale": scale}
    if ch.sinks is not None:  # read by attention.emit_sdpa and canonical_attention (the probes)
        kwargs["br_sinks"] = ch.sinks
    if relative is not None:
        kwargs["br_relbias"] = relative[0]
    with graph.inserting_after(ch.out):
        node = graph.call_function(F.scaled_dot_product_attention, (q, k, v), kwargs)
    node.meta.update(ch.out.meta)
    out = _attention_output_value(ch)
    node.meta["example_value"] = out
    CANONICAL.set(node, "eager attention")
    if relative is not None:
        _mark_relative(node, relative, canon)
    if ch.softcap:
        SOFTCAP.set(node, ch.softcap)
    chain = " -> ".join(n.name for n in reversed(ch.dead))
    result = node
    if width is not None:  # the values carry one zero feature for the key bias: drop it from the output
        node.meta["example_value"] = torch.cat([out, out[..., :1]], -1) if out is not None else None
        with graph.inserting_after(node):
            result = graph.call_function(operator.getitem, (node, (Ellipsis, slice(None, width))))
        result.meta["example_value"] = out
        canon.notes.append(f"{node.name}: per-key bias {keyed[3].name} as one more q/k feature")
    if ch.out_dims is not None:  # the einsum's output layout ([B, L, H, D]) of the [B, H, Lq, D] attention output
        with graph.inserting_after(result):
            result = _call(graph, "permute", (result, *ch.out_dims))
    if ch.merged_out:  # the users read the [B*H, Lq, D] product: the [B, H, Lq, D] output with (B, H) merged
        node.meta["example_value"] = example_value(ch.out).unflatten(0, (-1, ch.heads))
        with graph.inserting_after(node):
            result = _call(graph, "flatten", (node, 0, 1))
    ch.out.replace_all_uses_with(result)
    for n in ch.dead:
        if not n.users:
            graph.erase_node(n)
    # k^T (and a no-longer-used repeat_kv) become dead: removed by the final dead-code pass.
    canon.notes.append(f"{node.name}: eager attention {chain} -> scaled_dot_product_attention")
    log.debug("canonical attention %s from eager chain %s", node.name, chain)
    return [node] if mask is not None else []


def _attention_output_value(ch: EagerChain) -> Optional[torch.Tensor]:
    """The example value of the chain's [B, H, Lq, D] attention output: ``out``'s, with its einsum layout
    ``out = o.permute(out_dims)`` undone (``o = out.permute(argsort(out_dims))``)."""
    out = example_value(ch.out)
    if out is None or ch.out_dims is None:
        return out
    return out.permute(tuple(sorted(range(4), key=ch.out_dims.__getitem__)))


def canonical_attention(node: fx.Node, args: tuple, kwargs: dict) -> torch.Tensor:
    """What the canonical attention ``node`` computes, on real values ``args``/``kwargs`` (its own, mapped):
    ``o = softmax(cap · tanh(c · q kᵀ / cap) + M [, S]) v`` with the sink logit ``S`` (``br_sinks``) a
    value-less last column dropped after the softmax, the soft-cap ``cap`` (``node.meta["br_softcap"]``) only
    where there is one, ``M`` a float mask added (``-inf`` blocks) or a bool mask (False blocks), and a query
    row with no visible key and no sink 0 — tree attention's value there (the original's value on such a row
    is a padding query's, which the guards keep out of every replayed call).

    The canonical copy is analysed, not run as a whole; its probes (:func:`..masks.evaluate`: a mask or a
    repacked region computed from an earlier attention's output, HY-V4's top-k index over the hidden states)
    evaluate the attention by this meaning, not by the ``scaled_dot_product_attention`` call it is spelled as
    (that call takes neither the sinks nor the soft-cap). A random dropout has no single value: refused."""
    a = sdpa_bind(args, kwargs)
    q, k, v, M = a["query"], a["key"], a["value"], a["attn_mask"]
    if a["dropout_p"]:
        raise CannotReplay(Code.ATTENTION_DROPOUT,
                           f"a probe evaluates {node.name}, an attention with dropout (p={a['dropout_p']}): "
                           "random, it has no single value", node)
    if a["enable_gqa"] and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    scale = a["scale"] if a["scale"] is not None else q.shape[-1] ** -0.5
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    cap = float(SOFTCAP.get(node, 0.0) or 0.0)
    if cap:
        s = torch.tanh(s / cap) * cap
    if a["is_causal"]:
        Lq, Lk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(Lq, Lk, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    if M is not None:
        s = s.masked_fill(~M, float("-inf")) if M.dtype == torch.bool else s + M
    S = a.get("br_sinks")
    if S is not None:
        column = S.reshape(1, -1, 1, 1) if S.dim() == 1 else S
        s = torch.cat([s, column.to(s.dtype).expand(*s.shape[:-1], 1)], -1)
    seen = s.amax(-1, keepdim=True) > float("-inf")
    p = torch.softmax(s.masked_fill(~seen, 0.0), -1).masked_fill(~seen, 0.0)
    if S is not None:
        p = p[..., :-1]
    return torch.matmul(p.to(v.dtype), v)


#: How far back from an additive mask operand its per-key bias is searched (:func:`_key_bias_source`).
_KEY_BIAS_DEPTH = 12


def _key_bias(graph: fx.Graph, ch: EagerChain, k: fx.Node, scale: Any, values: dict) -> Optional[tuple]:
    """An eager chain's additive mask step with a per-key bias (:func:`_key_feature`), as one more q/k feature:
    ((q', k', v'), the mask steps with that step's operand replaced, D, u), or None. Not for soft-capped
    scores (the bias is added after the cap) or 3-D attention."""
    if ch.softcap or ch.heads is not None or ch.merged_out:
        return None
    for i, step in enumerate(ch.masks):
        if step[0] != "add":
            continue
        found = _key_feature(graph, ch.q, k, ch.v, step[1], scale, step[-1], values)
        if found is not None:
            qkv, rest, width, u = found
            masks = list(ch.masks)
            masks[i] = ("add", rest, step[-1])
            return qkv, masks, width, u
    return None


def _key_bias_sdpa(graph: fx.Graph, node: fx.Node, values: dict, canon: Canonical) -> None:
    """The same for an SDPA node whose float ``attn_mask`` carries a per-key bias (HF Doge under ``sdpa``):
    its q, k, v and mask are replaced in place and its users read the output without the extra feature."""
    a = _sdpa_args(node)
    M, q, k, v = a["attn_mask"], a["query"], a["key"], a["value"]
    if not isinstance(M, fx.Node) or a["is_causal"] is not False or SOFTCAP.get(node) \
            or any(_tensor(x) is None for x in (q, M)) or not _tensor(M).is_floating_point():
        return
    scale = a["scale"] if a["scale"] is not None else float(hint(_tensor(q).shape[-1])) ** -0.5
    with graph.inserting_before(node):
        found = _key_feature(graph, q, k, v, M, scale, 1.0, values)
    if found is None:
        return
    (q2, k2, v2), rest, width, u = found
    for name, x in (("query", q2), ("key", k2), ("value", v2), ("attn_mask", rest), ("scale", scale)):
        _set_sdpa_arg(node, name, x)
    out = example_value(node)
    with graph.inserting_after(node):
        sliced = graph.call_function(operator.getitem, (node, (Ellipsis, slice(None, width))))
    node.replace_all_uses_with(sliced, delete_user_cb=lambda n: n is not sliced)
    sliced.meta["example_value"] = out
    node.meta["example_value"] = torch.cat([out, out[..., :1]], -1) if out is not None else None
    canon.notes.append(f"{node.name}: per-key bias {u.name} as one more q/k feature")


def _key_feature(graph: fx.Graph, q: Any, k: Any, v: Any, M: Any, scale: Any, post: float,
                 values: dict) -> Optional[tuple]:
    """A per-key bias ``u[b, h, k]`` in the additive mask operand ``M`` as one more q/k feature, or None.

    When ``M`` (added to the [B, H, Lq, Lk] scores, times ``post``) is built from a value ``u`` of shape
    [B, Hu, 1, Lk] (constant along the queries: :func:`_key_bias_source`) computed from a trainable tensor (a
    projection of the hidden states, HF Doge's ``exp(A * softplus(dt_proj(v)))``), then, with ``c`` the SDPA
    scale,

        ``c * q k^T + post * M  =  c * q' k'^T + post * (M - T(u))``,
        ``q' = cat(q, 1)``, ``k' = cat(k, post / c * T(u)^T)``, ``v' = cat(v, 0)``

    where ``T`` maps u's heads onto the H query heads (as repeat_kv: query head h reads u head
    ``h // (H / Hu)``). ``M - T(u)`` replaces ``M``: exactly 0 where ``M`` was ``T(u)``, blocking where ``M``
    blocked, so the mask classification proves on its probes (trainable tensors perturbed,
    :func:`..masks.classify`) that the bias was ``T(u)`` wherever a key is visible, and refuses it as a bias
    otherwise. v gets a zero feature so that q, k, v share one head dim (the tree-attention kernels); the output
    drops it. Gradients reach u through k' (exact up to the reassociation of one product). Returns
    ((q', k', v'), ``M - T(u)``, D (v's head dim), u); None when there is no such u, the scale is not a
    number, q, k, v are not 4-D with one head count, Hu does not divide H, or u, M, q, k, v differ in dtype."""
    if not isinstance(scale, numbers.Number) or not scale:
        return None
    tq, tk, tv = (_tensor(x) if isinstance(x, fx.Node) else None for x in (q, k, v))
    if tq is None or tk is None or tv is None or tq.dim() != 4 or tk.dim() != 4 or tv.dim() != 4 \
            or not _same(tq.shape[1], tk.shape[1]) or not _same(tk.shape[1], tv.shape[1]):
        return None
    H = int(hint(tq.shape[1]))
    u = _key_bias_source(M, tq, tk, values)
    if u is None:
        return None
    hu = int(hint(_tensor(u).shape[1]))
    if H % hu or len({_tensor(x).dtype for x in (u, M, q, k, v)}) != 1:  # one dtype: no rounding to reproduce
        return None
    tu = u if hu in (1, H) else _call(graph, "repeat_interleave", (u, H // hu, 1))  # [B, H | 1, 1, Lk]
    rest = _call(graph, operator.sub, (M, tu))
    col = _call(graph, "transpose", (tu, -1, -2))  # [B, H | 1, Lk, 1]
    col = _call(graph, operator.mul, (col, post / scale))
    if hu == 1 and H != 1:
        col = _call(graph, "expand", (col, -1, H, -1, -1))
    col = _call(graph, "to", (col, tk.dtype))
    q2 = _call(graph, torch.cat, ([q, _call(graph, torch.ones_like, (_call(graph, operator.getitem, (
        q, (Ellipsis, slice(None, 1)))),))], -1))
    k2 = _call(graph, torch.cat, ([k, col], -1))
    v2 = _call(graph, torch.cat, ([v, _call(graph, torch.zeros_like, (_call(graph, operator.getitem, (
        v, (Ellipsis, slice(None, 1)))),))], -1))
    log.debug("per-key bias %s of %s: one more q/k feature", u.name, M.name)
    return (q2, k2, v2), rest, int(hint(tv.shape[-1])), u


def _key_bias_source(M: Any, tq: torch.Tensor, tk: torch.Tensor, values: dict) -> Optional[fx.Node]:
    """The value ``u`` of shape [B, Hu, 1, Lk] (B and Lk the key's, Lq > 1) that the additive mask operand
    ``M`` is built from along its first tensor operand (through views, expands, casts, ``masked_fill``,
    ``where``: any op, the probes check the result), when u depends on a trainable tensor; else None."""
    n = M
    for _ in range(_KEY_BIAS_DEPTH):
        if not isinstance(n, fx.Node) or n.op not in ("call_function", "call_method"):
            return None
        t = _tensor(n)
        if t is not None and t.dim() == 4 and t.is_floating_point() and _same(t.shape[2], 1) \
                and not _same(tq.shape[2], 1) and _same(t.shape[3], tk.shape[2]) and _same(t.shape[0], tk.shape[0]) \
                and _trainable(n, values):
            return n
        n = _carried_operand(n)
    return None




def relative_bias_dense(table: torch.Tensor, like: torch.Tensor, zero_beyond: bool) -> torch.Tensor:
    """``G(F)[b, h, i, j] = F[b, h, i, clamp(i - j, 0, E - 1)]`` for a [B, H, Lq, E] table F over the last two
    dims of ``like`` (the [.., Lq, Lk] operand it is compared with), 0 where ``i - j >= E`` when ``zero_beyond``.
    Only evaluated by the mask classification's probes (the canonical copy is never run)."""
    lq, lk, extent = like.shape[-2], like.shape[-1], table.shape[-1]
    d = torch.arange(lq, device=table.device)[:, None] - torch.arange(lk, device=table.device)[None, :]
    g = table.gather(-1, d.clamp(0, extent - 1).expand(*table.shape[:-2], lq, lk))
    return g.masked_fill(d >= extent, 0.0) if zero_beyond else g


def _relative_step(graph: fx.Graph, ch: EagerChain, values: dict) -> Optional[tuple]:
    """An eager chain's additive mask step with a relative bias (:func:`_relative_bias`): (the mask steps with
    that step's operand replaced by ``M - G(F)``, (F, T, zero_beyond)), or None. Not for 3-D attention or a
    step scaled after the sum (``post`` != 1)."""
    if ch.heads is not None or ch.merged_out:
        return None
    for i, step in enumerate(ch.masks):
        if step[0] != "add" or step[-1] != 1.0:
            continue
        found = _relative_bias(graph, ch.q, step[1], values)
        if found is not None:
            rest, relative = found
            masks = list(ch.masks)
            masks[i] = ("add", rest, step[-1])
            return masks, relative
    return None


def _relative_bias_sdpa(graph: fx.Graph, node: fx.Node, values: dict, canon: Canonical) -> None:
    """The same for an SDPA node whose float ``attn_mask`` carries a relative bias (HF Inkling under ``sdpa``:
    ``where(mask, position_bias, min)``): its mask is replaced in place."""
    a = _sdpa_args(node)
    M, q = a["attn_mask"], a["query"]
    if not isinstance(M, fx.Node) or a["is_causal"] is not False or SOFTCAP.get(node) \
            or _tensor(q) is None or _tensor(M) is None or not _tensor(M).is_floating_point():
        return
    with graph.inserting_before(node):
        found = _relative_bias(graph, q, M, values)
    if found is None:
        return
    rest, relative = found
    _set_sdpa_arg(node, "attn_mask", rest)
    node.update_kwarg("br_relbias", relative[0])
    _mark_relative(node, relative, canon)


def _mark_relative(node: fx.Node, relative: tuple, canon: Canonical) -> None:
    """Record a relative bias on the SDPA node: the zero fill and the table's source T (the probes' free value)."""
    table, source, zero = relative
    RELBIAS_ZERO.set(node, zero)
    RELBIAS_SOURCE.set(node, source)
    canon.notes.append(f"{node.name}: relative bias, the per-query table {table.name} from {source.name} over the "
                       f"clamped distance{' (0 beyond it)' if zero else ''}")


def _relative_bias(graph: fx.Graph, q: Any, M: Any, values: dict) -> Optional[tuple]:
    """A relative bias in the additive operand ``M`` of the [B, H, Lq, Lk] scores: (``M - G(F)``, (F, T,
    zero_beyond)), or None (module docstring).

    ``M`` is walked back along its carried operands (:func:`_carried_operand`) to ``gather(T, -1, idx)`` with T
    a floating [B, H, Lq, E] value (H the query heads) computed from a trainable tensor. The ops on the way are
    each one of: a cast, ``contiguous``/``clone``, a product or quotient with an operand constant along the keys
    (last dim 1: a factor per query row), ``masked_fill(C, 0)`` / ``where(C, 0, x)`` (a zero fill: the bias is 0
    where C holds, read as 0 from distance E on), a ``masked_fill`` / ``where`` with a blocking value or a sum
    (mask parts, which ``M - G(F)`` keeps for the classification); anything else: None. F is T through the casts
    and factors in their order (the same elementwise ops: ``G(F)`` equals the gathered bias bit for bit where
    the bias is what the probes prove). The probes decide the rest: the index, the fill's condition and every
    mask part are only evaluated."""
    tq = _tensor(q) if isinstance(q, fx.Node) else None
    if tq is None or tq.dim() != 4:
        return None
    path, n = [], M
    for _ in range(_KEY_BIAS_DEPTH):
        if not isinstance(n, fx.Node) or n.op not in ("call_function", "call_method"):
            return None
        if _call_in(n, GATHERS):
            break
        path.append(n)
        n = _carried_operand(n)
    else:
        return None
    T, dim = (n.args[0], n.args[1]) if len(n.args) >= 2 else (n.args[0], n.kwargs.get("dim"))
    t = _tensor(T) if isinstance(T, fx.Node) else None
    if t is None or t.dim() != 4 or not t.is_floating_point() or not isinstance(dim, int) \
            or normalize_dim(dim, 4) != 3 or not _same(t.shape[1], tq.shape[1]) \
            or not _same(t.shape[2], tq.shape[2]) or not _same(t.shape[0], tq.shape[0]) or not _trainable(T, values):
        return None
    table, zero = T, False
    for step in reversed(path):  # gather side first
        carried = _carried_operand(step)
        if _call_in(step, CAST) or _call_in(step, COPIES):
            if _call_in(step, CAST):
                table = _copy_on(graph, step, carried, table)
            continue
        if _call_in(step, MUL) or _call_in(step, DIV):
            other = [a for a in step.args if a is not carried]
            if len(step.args) != 2 or step.kwargs or (_call_in(step, DIV) and step.args[0] is not carried) \
                    or not all(_number(a) is not None or _row_factor(a) for a in other):
                return None
            table = _copy_on(graph, step, carried, table)
            continue
        fill = _fill_value(step, carried)
        if fill is None:
            if _call_in(step, ADD):
                continue
            return None
        if fill == 0.0:
            zero = True
        elif fill > BLOCKING:
            return None
    if _tensor(table) is None or _tensor(table).dim() != 4:  # a factor that broadcast the table to more dims
        return None
    rest = _call(graph, operator.sub, (M, _call(graph, relative_bias_dense, (table, M, zero))))
    log.debug("relative bias of %s: table %s from %s", M.name, table.name, T.name)
    return rest, (table, T, zero)


def _row_factor(a: Any) -> bool:
    """Whether ``a`` is a tensor node constant along the keys: at most 4 dims, the last of extent 1."""
    t = _tensor(a) if isinstance(a, fx.Node) else None
    return t is not None and 0 < t.dim() <= 4 and _same(t.shape[-1], 1)


def _fill_value(step: fx.Node, carried: fx.Node) -> Optional[float]:
    """The number a ``masked_fill(x, C, v)`` / ``where(C, v, x)`` / ``where(C, x, v)`` writes over the carried
    operand ``x``, or None when ``step`` is no such fill."""
    if _call_in(step, MASKED_FILL) and len(step.args) >= 3 and step.args[0] is carried:
        return _number(step.args[2])
    if _call_in(step, WHERE) and step.op == "call_function" and len(step.args) == 3:
        other = step.args[2] if step.args[1] is carried else step.args[1] if step.args[2] is carried else None
        return None if other is None else _number(other)
    return None


def _copy_on(graph: fx.Graph, step: fx.Node, old: fx.Node, new: fx.Node) -> fx.Node:
    """A copy of ``step`` reading ``new`` where it read ``old``, with its example value computed."""
    node = graph.node_copy(step, lambda a: new if a is old else a)
    node.meta = {}
    try:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), example_value)
        node.meta["example_value"] = (getattr(args[0], node.target)(*args[1:], **kwargs)
                                      if node.op == "call_method" else node.target(*args, **kwargs))
    except Exception:  # pragma: no cover - metadata is best effort; the probes evaluate the real thing
        log.debug("no example value for %s", node.name, exc_info=True)
    return node


def _carried_operand(n: fx.Node) -> Optional[fx.Node]:
    """The operand an op carries along: ``where``'s first non-bool tensor value, else the first tensor argument."""
    ops = [a for a in n.args if isinstance(a, fx.Node)]
    if _call_in(n, WHERE):
        ops = [a for a in ops[1:] if _tensor(a) is not None and _tensor(a).dtype != torch.bool] \
            if n.op == "call_function" else ops[:1]
    return ops[0] if ops else None


def _trainable(n: fx.Node, values: dict) -> bool:
    """Whether ``n`` depends on a graph input that requires grad (a parameter)."""
    return any(p.op == "placeholder" and isinstance(values.get(p), torch.Tensor) and values[p].requires_grad
               for p in ancestors(n))


def _canonical_mask(graph: fx.Graph, ch: EagerChain) -> Optional[fx.Node]:
    """One float mask of the masked scores' dtype (:func:`_mask_dtype`), 0 where every mask step lets a key through and ``-inf`` where
    one blocks it (a masked score's probability is exactly 0 either way, ``BLOCKING``): an additive mask
    ``M`` (seen as ``M * post``) keeps 0 and turns values <= ``BLOCKING`` into ``-inf``, leaving any other
    value for the mask classification to refuse as a bias; a ``masked_fill``/``where`` condition becomes
    ``where(C, -inf, 0)`` (or its complement); a blend ``s * B + A`` is :func:`_blend_part`. None without mask steps. The nodes only build the mask: the
    classification (:mod:`..masks`) evaluates them on probes, the packed graph never runs them."""
    steps = [m for m in ch.masks if m[0] != "floor"]  # a floor at a blocking value leaves the mask as it is
    if not steps:
        return None
    dtype = _mask_dtype(ch, steps)
    parts = []
    for kind, *rest in steps:
        if kind in ("add", "bias"):
            M, post = (rest[0], rest[-1]) if kind == "add" else (_split_heads_operand(graph, rest[0], rest[1]),
                                                                 rest[-1])
            m = _additive_part(graph, M, post, dtype)
        elif kind == "blend":
            m = _blend_part(graph, *rest, dtype)
        else:
            C, _, _ = rest
            inf = float("-inf")
            m = _call(graph, torch.where, (C, inf, 0.0) if kind == "fill" else (C, 0.0, inf))
            m = _call(graph, "to", (m, dtype))
        parts.append(m)
    total = parts[0]
    for m in parts[1:]:
        total = _call(graph, operator.add, (total, m))
    return total


def _mask_dtype(ch: EagerChain, steps: list) -> torch.dtype:
    """The dtype the softmax sees the masked scores in: the scores' (the output's, :func:`_check_compute_dtype`)
    promoted by every float operand added to them (a float32 mask on autocast's bfloat16 scores,
    :func:`_check_mask_precision`), so the canonical mask keeps the values the original added. A ``baddbmm``
    input (``bias``) is not a sum with the scores: the product rounds it to the scores' dtype."""
    dtype = _tensor(ch.out).dtype
    for m in steps:
        operands = (m[1],) if m[0] == "add" else (m[1], m[2]) if m[0] == "blend" else ()
        for t in map(_tensor, operands):
            if t is not None and t.is_floating_point():
                dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _additive_part(graph: fx.Graph, M: fx.Node, post: float, dtype: torch.dtype) -> fx.Node:
    """``M * post`` in ``dtype`` (a lower-precision mask is promoted exactly by the sum, :func:`_check_scores`) with
    values <= ``BLOCKING`` as ``-inf``; a per-head operand is a bias (ALiBi), kept as it is for the classification."""
    if _tensor(M) is not None and _tensor(M).dtype != dtype:
        M = _call(graph, "to", (M, dtype))
    m = M if post == 1.0 else _call(graph, operator.mul, (M, post))
    if not _per_head(M):
        m = _call(graph, "masked_fill", (m, _call(graph, operator.le, (m, BLOCKING)), float("-inf")))
    return m


def _blend_part(graph: fx.Graph, B: fx.Node, A: fx.Node, post: float, dtype: torch.dtype) -> fx.Node:
    """The mask of a blend ``s * B + A`` (:func:`_blended_scores`): where B is 1 the scores get ``A`` added (its
    :func:`_additive_part`); where B is 0 the score is dropped for ``A``, a mask when ``A * post <= BLOCKING``
    (``-inf``); every other entry (B neither 0 nor 1, or 0 where A does not block) scales the scores or keeps a
    finite value without them: NaN, which the classification refuses (:func:`..masks.split_bias`)."""
    m = _additive_part(graph, A, post, dtype)
    dropped = _call(graph, operator.eq, (B, 0))
    blocked = _call(graph, operator.and_, (dropped, _call(graph, operator.le, (m, BLOCKING))))
    kept = _call(graph, operator.eq, (B, 1))
    m = _call(graph, "masked_fill", (m, _call(graph, operator.invert, (kept,)), float("nan")))
    return _call(graph, "masked_fill", (m, blocked, float("-inf")))


def _split_heads_operand(graph: fx.Graph, M: Any, heads: int) -> Any:
    """A ``baddbmm`` input ``M`` of a 3-D attention (broadcast to the [B*H, Lq, Lk] scores) as an operand of
    the [B, H, Lq, Lk] scores: a dim 0 of extent B*H split into (B, H) (``M.unflatten(0, (-1, H))``: row
    b*H + h is [b, h], as :func:`_split_heads` reads the scores); a dim 0 of extent 1, or fewer than 3 dims,
    broadcasts over (B, H) as it is."""
    t = _tensor(M)
    if t is None or t.dim() < 3 or _same(t.shape[0], 1):
        return M
    return _call(graph, "unflatten", (M, 0, (-1, heads)))


def _per_head(M: Any) -> bool:
    """Whether the additive operand ``M`` varies over the heads: a head dim of extent > 1 (dim 1 of a 4-D
    operand, dim 0 of a 3-D one): a bias such as ALiBi, not a mask."""
    t = _tensor(M)
    return t is not None and ((t.dim() == 4 and t.shape[1] != 1) or (t.dim() == 3 and t.shape[0] != 1))


def _call(graph: fx.Graph, target, args) -> fx.Node:
    """A new node (call_method for a string target) with its example value computed from its inputs'."""
    op = "call_method" if isinstance(target, str) else "call_function"
    node = graph.create_node(op, target, args, {})
    try:
        vals = list(fx.node.map_arg(tuple(args), example_value))
        node.meta["example_value"] = (getattr(vals[0], target)(*vals[1:]) if op == "call_method"
                                      else target(*vals))
    except Exception:  # pragma: no cover - metadata is best effort; the probes evaluate the real thing
        log.debug("no example value for %s", node.name, exc_info=True)
    return node


def _specialise_scalars(node: fx.Node, placeholders: list[fx.Node], values: dict, canon: Canonical) -> None:
    """Replace a node-valued ``dropout_p``/``scale`` of an SDPA node by its value, under a guard."""
    a = _sdpa_args(node)
    for name in ("dropout_p", "scale"):
        arg = a[name]
        if not isinstance(arg, fx.Node):
            continue
        value, guard_src = _scalar_value(arg, placeholders, values)
        if value is None:
            raise CannotReplay(Code.ATTENTION_SCALAR,
                               f"attention {name} is computed in the graph, not read from a scalar input",
                               node)
        pos, transform = guard_src
        what = f"attention {name} of {node.name}"
        expected = transform(value)
        canon.guards.append(scalar_equals(pos, value, f"{what} (input {placeholders[pos].name})"))
        _set_sdpa_arg(node, name, expected)
        canon.notes.append(f"{node.name}: {name} specialised to {expected}")


def _specialise_dropout(node: fx.Node, placeholders: list[fx.Node], values: dict, canon: Canonical) -> None:
    """A hidden-state dropout whose ``p`` is a scalar input (``dynamic=True``): its value, under a guard
    (the dropout rule then sees a number: identity at 0, refused otherwise)."""
    in_args = len(node.args) > 1
    p = node.args[1] if in_args else node.kwargs.get("p")
    training = arg(node, 2, "training", True)
    if not isinstance(p, fx.Node) or training is False:
        return  # a number, or an identity whatever p is
    value, src = _scalar_value(p, placeholders, values)
    if value is None:
        return  # left to the dropout rule, which refuses a non-constant p
    pos, transform = src
    canon.guards.append(scalar_equals(pos, value, f"dropout p of {node.name} (input {placeholders[pos].name})"))
    if in_args:
        node.args = (node.args[0], transform(value)) + tuple(node.args[2:])
    else:
        node.kwargs = {**node.kwargs, "p": transform(value)}
    canon.notes.append(f"{node.name}: p specialised to {transform(value)}")


def _scalar_value(arg: fx.Node, placeholders, values):
    """(value of the scalar input, (placeholder position, f)) for ``arg`` = ``x.item()``,
    ``1.0 / x.item()`` or a scalar placeholder ``x``; f maps the input's value to ``arg``'s."""
    ident = lambda v: v  # noqa: E731
    recip = lambda v: 1.0 / v  # noqa: E731
    f = ident
    n = arg
    if n.op == "call_function" and n.target is operator.truediv and n.args[0] == 1.0 and isinstance(
            n.args[1], fx.Node):
        f, n = recip, n.args[1]
    if n.op == "call_method" and n.target == "item" and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    if n.op != "placeholder" or n not in values:
        return None, None
    v = values[n]
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            return None, None
        v = v.item()
    v = hint(v)
    if not isinstance(v, numbers.Number):
        return None, None
    return v, (placeholders.index(n), f)


def _set_sdpa_arg(node: fx.Node, name: str, value) -> None:
    names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
    i = names.index(name)
    if i < len(node.args):
        args = list(node.args)
        args[i] = value
        node.args = tuple(args)
    else:
        kwargs = dict(node.kwargs)
        kwargs[name] = value
        node.kwargs = kwargs


__all__ = ["Canonical", "EagerChain", "canonicalize", "mask_guards", "match_eager_attention", "unrecognised_attention"]
