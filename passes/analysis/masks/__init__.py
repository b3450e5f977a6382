"""What an attention mask means — decided on small probe batches, never on the real batch's B·L².

An attention node's mask is either ``is_causal=True`` with no mask, or a tensor computed inside the
graph from the token inputs (HF builds it from ``arange`` comparisons and ``attention_mask``). We do not
pattern-match that subgraph: we *evaluate* it on probe values of the tree inputs at compile time and
compare with each candidate meaning:

* ``causal``:              visible(b, i, j) = j <= i
* ``causal & keypad(X)``:  visible(b, i, j) = j <= i and X[b, j] != 0, for a [B, L] tree input X
* either of them ``& window(W)``: also i - j < W (HF's sliding window over the batch columns, which are
  the tree positions)
* ``causal+sequences(P)``: visible(b, i, j) = j <= i and no sequence starts in row b at a column in (j, i],
  for a [B, L] integer tree input P (position ids) whose 0s start the sequences packed into a row
  (padding-free batches: HF's mask from ``position_ids`` without an attention mask). It is checked on
  trials whose P is well formed (every sequence counts 0, 1, 2, ...): the runtime replays only batches whose
  P is (a per-call guard, :func:`sequences_guard`), and builds the tree over the sequences.

**Float masks.** An additive float mask (``attn_mask`` of a ``scaled_dot_product_attention`` call, or the canonical
mask of an eager chain) is read as visibility and bias (:func:`split_bias`): a key is blocked where the value is at
most :data:`BLOCKING` (``-1e4``; ``-1e9``, ``finfo(dtype).min`` and ``-inf`` are masks), visible elsewhere, and a
visible value other than 0 is a bias. So ``(1 - causal.float()) * -1e9``, ``zeros(L, L).masked_fill(~causal,
finfo.min)``, ``where(visible, 0, -inf)``, ``triu(full(-inf), 1) + (1 - am) * finfo.min`` and sums of such parts
in either order classify like the boolean masks they spell (causal, causal & key padding, window). A blocked
key's probability is then exactly 0 in the original as in tree attention, provided the visible scores of its query
row lie within the exp underflow range above the blocked ones (the assumption the eager chains make,
:data:`BLOCKING`). A query row whose keys are all blocked differs: ``-inf`` makes it 0 in the original too, but a
finite blocking value makes it a softmax over all its keys; such a mask is ``MaskInfo.finite_blocking`` and, with
key padding, gets the per-call guard that no row starts with padding (``canonicalize.mask_guards``, as for an eager
chain's additive mask). A mask whose blocked values (or the lack of them) leave a query seeing a later key through
a finite nonzero value (``masked_fill(~causal, -5)``) is refused as a float bias, not a mask, by that name; a bias
at visible pairs is ALiBi or refused (below). Anything else (bidirectional prefixes, biases, other windows) stops the
rewrite with the reason, named where a probe shows it: a query that sees a later key (bidirectional attention),
a visibility that changes when only the token ids are reordered (a content-dependent mask: a top-k selection of
keys by a learned index with fewer picks than keys).

The subgraph may read an earlier attention's output (HY-V4's DeepSeek-sparse-attention indexer over the hidden
states): an attention the canonicalisation made, which the ``scaled_dot_product_attention`` call it is spelled
as does not compute (sinks, soft-cap), is evaluated by its meaning (:func:`is_canonical_attention`).

**ALiBi.** One bias is accepted (:func:`alibi_meaning`): a float mask whose finite values, on every trial
and at every visible pair, are ``m[h] * pos[b, k] + c[b, h, q]`` — a per-head slope times the key position
plus anything constant along the query row (softmax is invariant to it: this covers both
``m[h] * (k - q)`` and BLOOM's ``m[h] * k``). The positions are the columns (``pos[b, k] = k``) or the
count of attention-mask tokens up to k (BLOOM's ``cumsum(attention_mask) - 1``, ``count(X)`` for a [B, L]
0/1 tree input X). The slopes are read off a trial without padding and the form is then checked on every
trial (up to the rounding of the mask's dtype); the result is ``MaskInfo.alibi`` (the slopes) and
``MaskInfo.alibi_count`` (X, or None for the columns), tree attention's ``alibi`` feature. A bias on the
packed-sequence layout is refused.

**Trainable ALiBi slopes.** A bias that depends on trainable tensors is ALiBi with trainable slopes when one
value ``P`` of the subgraph, computed from trainable tensors (and parameters, buffers, constants) alone, with one
number per query head (or one for all), carries every trainable tensor into the mask (no path from a trainable
tensor to the mask avoids it: :func:`_slopes_node`), and the bias is ``P[h] * pos[b, k] + c[b, h, q]`` on every
trial (each with its own perturbed trainable values) and on one more trial with ``P`` itself replaced by random
numbers (so the slope is ``P``, not a function of it that agrees at the trainable values). Then
``MaskInfo.alibi_node`` is ``P``: the packed graph computes it (its ancestors are taken out of the mask-only
nodes) and hands it to tree attention as its differentiable ``slopes``, whose gradient reaches the trainable
tensors through ``P``'s own ops. Any other bias of trainable tensors is refused; the refusal says whether the
bias also follows the values of a token input (it changes when only that input is reordered on a probe: a
per-token bias such as a projection of the hidden states) or is a learned position bias (a relative-position
table). The probes evaluate the subgraph with every trainable tensor
perturbed (:func:`perturbed_parameters`; the example batch keeps the real values), so a learned value cannot hide
behind its initial value; a per-key bias has been moved into the keys by the canonicalisation before (what is left
must be a mask on every probe).

**Relative bias.** An attention whose canonicalisation found a relative bias (``attn.meta["br_relbias_source"]``:
the per-query table T [B, H, Lq, E] its bias is gathered from, :func:`..canonicalize._relative_bias`) has the
mask ``M - G(F)``; its probes give T itself a fresh random value (:func:`free_values`) instead of computing it, so
the mask is 0 at every visible pair only when the bias is ``G(F)`` — a function of the query token's table and
the clamped distance alone — whatever T is; else the bias is refused by that name. (The subgraph upstream of T is
not evaluated: it is the model's, and what it computes is the table's business, packed like any token value.)

**Probe sizes.** A mask is [B, 1, L, L]: evaluating it on the example batch costs B·L² (73 GB at
B = 16, L = 16,896). So the subgraph is evaluated at small synthetic sizes (B', L') instead, with every
size it reads scaled (:class:`Scaling`): a dynamic size (a SymInt placeholder whose example value is the
batch's B or L) is set to B' / L'; a static size baked into the graph as a literal (``arange(16896)``,
``expand(16, -1, 16896, 16896)``) is rewritten to B' / L' (L ± 2 too, for ``L - 1`` style literals) when
it cannot be mistaken for a dim index or for the other size. The probe lengths are a few odd base lengths
plus, for every other integer constant ``c`` of the subgraph (a window, a buffer's size), ``c``, ``c + 1``
and ``c + 2``: a mask built from comparisons of positions, sizes and constants changes meaning only at
lengths where a constant is crossed, and a window ``W`` shows only at L' > W. Two probe row counts (2, 3)
catch a literal that only looked like B (a window equal to the batch size reads as a window that follows
B' and is refused). The example batch itself is one more trial where it is small (rows·L² within
:data:`MAX_PROBE_ELEMENTS`).

**Admitted lengths.** A constant too large to probe (rows·L'² over :data:`MAX_PROBE_ELEMENTS`), or a
probe length at which the subgraph cannot be evaluated (a [T, T] buffer shorter than L'), bounds the
lengths the meaning is proven for: ``MaskInfo.max_length``. A static graph (one L) longer than that is
refused at compile time; a dynamic graph gets an O(1) per-call guard on the length
(:func:`meaning_guard`). Nothing here allocates more than :data:`MAX_PROBE_ELEMENTS` mask elements,
whatever the batch."""
from __future__ import annotations

from brcompile.passes.analysis.masks.values import (
    MAX_PROBE_ELEMENTS, MaskInfo, blocked, descendants, evaluate, finite_blocking, float_bias_reason,
    is_canonical_attention, mask_only_nodes, sliding_window, split_bias, visible,
)
from brcompile.passes.analysis.masks.sequences import SEQUENCE_PATTERNS
from brcompile.passes.analysis.masks.probes import Scaling
from brcompile.passes.analysis.masks.alibi import alibi_meaning
from brcompile.passes.analysis.masks.meaning import classify, meaning_guard, sequences_guard
from brcompile.passes.canonical.attention.common import BLOCKING

__all__ = ["BLOCKING", "MAX_PROBE_ELEMENTS", "MaskInfo", "SEQUENCE_PATTERNS", "Scaling", "alibi_meaning", "blocked",
           "classify", "descendants", "evaluate", "finite_blocking", "float_bias_reason",
           "is_canonical_attention", "mask_only_nodes", "meaning_guard", "sequences_guard",
           "sliding_window", "split_bias", "visible"]
