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
two batch dims, the positions and the contracted feature: :func:`einsum_4d`), whose q, k, v are permuted into
[B, H, L, D] for the SDPA node and its output back into the einsum's layout; k^T may be any permute of a 4-D value (:func:`_key_of`); a scale applied to q (or k) before the scores is part of q (the SDPA
scale is then 1). Between the scores and the softmax, mask and scale steps may come in any order
(:func:`mask_or_scale_step`): ``s + M``; ``s.masked_fill(C, v)`` / ``where(C, v, s)`` (nanoGPT's
``att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))``); ``where(C, s, v)`` (GPT-J); ``s * c``,
``s / c`` with a number ``c``; a blend ``s * B + A`` (OpenAI-GPT's ``w * b + -1e4 * (1 - b)``,
:func:`_blended_scores`). A fill value ``v`` must be a large negative constant: at most ``BLOCKING``
(``-1e4``) as the softmax sees it (times the positive scales after it) — ``-1e9``, ``finfo.min``, ``-inf``.
Then a masked score's probability is exactly 0, as it is in tree attention, provided the visible scores
of its row lie within the exp underflow range above ``v`` (745 in float64, 104 in float32; scores of
that size are not seen in practice). The same assumption makes a floor ``max(s, c)`` / ``s.clamp(min=c)`` at a
blocking ``c`` (XGLM's ``torch.max(s + M, torch.full((), finfo.min))``) leave every probability as it is
(:func:`_floor_step`). A value may be a one-element constant made in the graph (``torch.scalar_tensor(-inf)``,
``torch.full((), v)``: :func:`constant`). The steps become one canonical float mask (:func:`canonical_mask`:
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
``softmax(combined)[..., :-1]`` — one value-less logit ``S[h]`` per query row (:func:`match_sinks`); a sink
column computed per query token (Inkling2: ``cat([s, proj(h).transpose(1, 2).unsqueeze(-1)], -1)``, a
[B, H, Lq, 1] value) is the same softmax with ``S[b, h, i]``, and ``S`` is that column. GraniteMoE-SWA applies
the sink after the attention, ``o * sigmoid(logsumexp(s, -1) - S.view(1, H, 1)).unsqueeze(-1)``: the same
attention (:func:`match_lse_sink`). The node ``S`` ([H], or the per-query column) becomes the SDPA node's
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
removed from the copy when they are pure and not in-place, so they need no token-axis rule."""
from __future__ import annotations

from brcompile.passes.canonical.attention.common import Canonical, EagerChain
from brcompile.passes.canonical.attention.rewrite import canonical_attention
from brcompile.passes.canonical.attention.driver import canonicalize, mask_guards
from brcompile.passes.canonical.attention.match import match_eager_attention
from brcompile.passes.canonical.attention.scores import unrecognised_attention

__all__ = ["Canonical", "EagerChain", "canonical_attention", "canonicalize", "mask_guards", "match_eager_attention", "unrecognised_attention"]
