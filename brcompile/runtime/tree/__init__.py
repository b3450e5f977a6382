"""Prefix-tree detection: which (row, column) positions of a batch are the same token of the tree.

A batch is B rows x L columns of per-token inputs (token ids, position ids, the attention-mask bit, any
other [B, L] input). Positions (b, t) and (b', t) are the same **node** iff rows b and b' agree on every
input at every column 0..t. The nodes form a forest (one root per distinct first token); a causal,
row-independent model computes the same values at every position of a node, so it needs to run each
node once (docs/ARCHITECTURE.md §4).

How the tree is found (exact, vectorised):

1. Every input becomes an int64 code per token (floats by their bit pattern; a [B, L, ...] input by a hash
   of each position's trailing bytes, checked exactly once the tree is built), the mask a bool; codes
   whose value ranges fit in 63 bits together are packed into one order-preserving int64 key.
2. The rows are put in **lexicographic order** of their code sequences (per column, the tuple of the
   inputs' codes, compared as signed int64). Fast path: a per-token hash h(b, t) and the prefix hash
   H(b, t) = sum_{u <= t} h(b, u) (int64, wrapping); the first column where two rows differ is found by
   binary search on H for every pair of rows, and the values there decide which row comes first.
3. **Verification** (exact, whatever the hash): for adjacent rows of that order the first differing
   column lcp[i] is computed by comparing the codes themselves, and the codes at lcp[i] must be strictly
   increasing. A sequence whose neighbours are in strict lexicographic order is sorted, so the order is
   exact. If the check fails (a hash collision, or a deliberately weak ``hash_fn``), the rows are sorted
   exactly instead by prefix doubling over columns: the rank of the block [j*2w, (j+1)*2w) of a row is
   the rank of the pair (rank of its first half, rank of its second half), O(log L) batched sorts of B
   keys. No merge ever rests on a hash: node identity comes from exact comparisons only.
4. In sorted order, rows i-1 and i share exactly the nodes at columns < lcp[i-1], and rows i < j share
   columns < min(lcp[i..j-1]). Row i **owns** the new nodes at columns s_i = lcp[i-1] .. L-1 (s_0 = 0).
   Laying the owned ranges out row after row is a depth-first preorder of the forest (children ordered by
   their values), with every chain of single-child nodes contiguous, so the subtree of packed token k is
   [k, end[k]) and "k is an ancestor-or-self of q  <=>  k <= q < end[k]".

Segments (maximal single-child chains) start at the first owned column s_i of every row, and at column
s_j inside the owned range of row po(j) = max{r < j : s_r < s_j} for every row j that branches off at
0 < s_j < L (the parent, at column s_j - 1 of row po(j), then has >= 2 children: its first child, in
row po(j), starts a segment too). All nodes of a segment are shared by the same rows, sorted rows
i..m with m = min{j >= i : lcp[j] <= last column of the segment}, so end, rep_row are per segment.

Complexity: O(B*L) elementwise work plus O(B^2 log L) gathers for the pairwise search (the exact order
is used directly when that is cheaper: many rows, short rows); no Python loop over tokens or columns.

Padding-free batches (several sequences packed into one row, position ids restarting at 0 per sequence):
:func:`build_sequence_tree` builds the same tree with the sequences as rows ([S, L_max] virtual rows, the
padding past each sequence's end dropped) and maps it back to the dense [B, L] layout.

Padding (``drop_padding=True``): :func:`drop_padding` deletes the invalid tokens from a built tree (the
rest stays a preorder forest, every kept token under its nearest kept ancestor) and marks their dense
positions with index -1. Dense reads of packed values go through :func:`read_packed` (0 at -1); a nonzero
gradient at a dropped position raises :class:`DroppedPositionGradError` in backward.
"""
from __future__ import annotations

from brcompile.runtime.tree.build import (
    PAIRWISE_MAX_ROWS, TreeInputError, build_tree, counters, default_token_hash, row_keys, rows_agree,
)
from brcompile.runtime.tree.layout import (
    GRAPH_ARGS, TOKEN_ARRAYS, PackedTree, TokenArrays, TreeArgs, TreeStats, tree_placeholders,
)
from brcompile.runtime.tree.padding import (
    build_sequence_tree, drop_padding, drop_positions, sequence_layout_problem,
)

__all__ = [
    "GRAPH_ARGS",
    "PAIRWISE_MAX_ROWS",
    "TOKEN_ARRAYS",
    "TokenArrays",
    "TreeArgs",
    "PackedTree",
    "TreeInputError",
    "TreeStats",
    "build_sequence_tree",
    "build_tree",
    "counters",
    "row_keys",
    "default_token_hash",
    "drop_padding",
    "drop_positions",
    "rows_agree",
    "sequence_layout_problem",
    "tree_placeholders",
]
