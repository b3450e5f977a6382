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

import collections
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

log = logging.getLogger(__name__)

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

counters: collections.Counter = collections.Counter()
"""Event counts, asserted exactly in tests. ``builds``: calls of build_tree; ``hashed_order``: the hashed
row order passed verification; ``hash_fallback``: it failed verification and the exact order was used;
``exact_order``: the exact order was used directly (see _use_pairwise_search)."""

PAIRWISE_MAX_ROWS = 1024
"""Largest B for which the hashed pairwise search may run (its memory is O(B^2))."""

HashFn = Callable[[tuple], Tensor]
PerToken = Union[Tensor, Sequence[Tensor]]

# splitmix64 constants, as signed int64.
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB
# Odd multipliers that fold the 2nd, 3rd ... input into the first one's code before mixing.
_FOLD = (-3372029247567499371, 7640891576956012809, -5476377146882523141, 4354685564936845319)
_SIGNED_BY_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class TreeInputError(ValueError):
    """The per-token inputs or the attention mask cannot describe a batch of rows."""


@dataclass(frozen=True)
class TreeStats:
    """Sizes of one tree. dedup_ratio = logical_tokens / executed_tokens (>= 1)."""

    rows: int  # B
    logical_tokens: int  # B * L
    executed_tokens: int  # N (packed tokens)
    valid_tokens: int  # number of (b, t) whose attention-mask bit is 1 (B*L without a mask)
    dedup_ratio: float  # logical_tokens / executed_tokens
    depth: int  # longest root path in tokens (= L from build_tree; the most valid tokens of a row after drop_padding)
    segments: int  # S
    sequences: int = 0  # packed sequences the rows hold (build_sequence_tree); 0 for a tree over rows
    dead_tokens: int = 0  # tree nodes left out: no needed position holds them (drop_positions)
    live_tokens: int = -1  # kept nodes some live position holds (passes/liveness.py); -1: not analysed

    def to_dict(self) -> dict:
        """The fields as a plain dict (for logs and explain()); ``sequences`` only for a sequence tree."""
        d = dataclasses.asdict(self)
        if not self.sequences:
            del d["sequences"]
        if self.live_tokens < 0:  # no live-position plan: every node kept
            del d["live_tokens"], d["dead_tokens"]
        return d


class TokenArrays(NamedTuple):
    """The per-packed-token arrays of a tree, as a packed graph (and a streaming trunk graph) receives them:
    placeholders ``tree_<field>``. ``all_valid`` is ``valid`` with every bit set, for attentions without key
    padding. Generic in the element type: tensors at run time, the graph's placeholders at compile time."""

    rep_row: Any
    position: Any
    end: Any
    valid: Any
    all_valid: Any
    segments: Any


class TreeArgs(NamedTuple("_TreeArgs", [("index", Any), *((f, Any) for f in TokenArrays._fields)])):
    """Every tree input of a packed graph, after the original inputs (:meth:`PackedTree.graph_args`):
    ``index`` (dense ``[B, L]`` -> packed id, for the dense reads) then the :class:`TokenArrays`."""

    __slots__ = ()

    @property
    def tokens(self) -> TokenArrays:
        return TokenArrays(*self[1:])


#: The names of the tree inputs, in order; the rewrite names their placeholders ``tree_<name>``.
GRAPH_ARGS = TreeArgs._fields
TOKEN_ARRAYS = TokenArrays._fields


def tree_placeholders(gm) -> TreeArgs:
    """The tree placeholders of a packed graph, found by name (``tree_<name>``)."""
    by_name = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    missing = [a for a in GRAPH_ARGS if f"tree_{a}" not in by_name]
    if missing:
        raise ValueError(f"not a packed graph: no placeholder(s) {', '.join('tree_' + a for a in missing)}")
    return TreeArgs(*(by_name[f"tree_{a}"] for a in GRAPH_ARGS))


@dataclass(frozen=True, eq=False)
class PackedTree:
    """The prefix tree of a [B, L] batch in packed (depth-first preorder) layout; N packed tokens.

    index[b, t] is the packed id of position (b, t), or -1 for a position that :func:`drop_padding` left
    out (read it with :func:`read_packed`, which gives 0 there). For packed tokens k, q: k is an ancestor-or-self of
    q iff k <= q < end[k]. segments[s] = (start, stop, subtree_end): the packed range of a maximal chain
    of single-child nodes and the end of the subtree of its first node (= end[start]).
    """

    index: Tensor  # [B, L] int64: dense (b, t) -> packed token id in [0, N); -1: dropped (drop_padding)
    parent: Tensor  # [N] int64: packed id of the parent token, -1 for a root
    end: Tensor  # [N] int64: exclusive end of the token's subtree range in packed order
    position: Tensor  # [N] int64: the column of the token in row rep_row (a row tree: every row has it there)
    valid: Tensor  # [N] bool: the attention-mask bit of the token (all True without a mask)
    rep_row: Tensor  # [N] int64: smallest row b holding the token; index[rep_row[k], position[k]] == k
    segments: Tensor  # [S, 3] int64, rows (start, stop, subtree_end), sorted by start
    stats: TreeStats

    def __post_init__(self):
        """Check shapes and dtypes (no data-dependent checks: those would synchronise a GPU)."""
        if self.index.dim() != 2 or self.index.dtype != torch.int64:
            got = f"{tuple(self.index.shape)} {self.index.dtype}"
            raise ValueError(f"index must be a [B, L] int64 tensor, got {got}")
        n = self.parent.shape[0] if self.parent.dim() == 1 else -1
        for name in ("parent", "end", "position", "rep_row"):
            t = getattr(self, name)
            if t.dim() != 1 or t.shape[0] != n or t.dtype != torch.int64:
                raise ValueError(f"{name} must be an [N={n}] int64 tensor, got {tuple(t.shape)} {t.dtype}")
        if self.valid.dim() != 1 or self.valid.shape[0] != n or self.valid.dtype != torch.bool:
            got = f"{tuple(self.valid.shape)} {self.valid.dtype}"
            raise ValueError(f"valid must be an [N={n}] bool tensor, got {got}")
        if self.segments.dim() != 2 or self.segments.shape[1] != 3 or self.segments.dtype != torch.int64:
            raise ValueError(f"segments must be an [S, 3] int64 tensor, got {tuple(self.segments.shape)}")

    @property
    def num_tokens(self) -> int:
        """N, the number of packed tokens."""
        return self.parent.shape[0]

    @property
    def batch_shape(self) -> tuple:
        """(B, L) of the dense batch."""
        return (self.index.shape[0], self.index.shape[1])

    @property
    def packed_sequences(self) -> bool:
        """True for a tree over the sequences packed into the rows (:func:`build_sequence_tree`): a token's
        column may differ between the rows holding it, so only (rep_row, position) locates it densely."""
        return self.stats.sequences > 0

    def graph_args(self) -> TreeArgs:
        """The tree's inputs of a packed graph (``all_valid``: all True)."""
        return TreeArgs(self.index, self.rep_row, self.position, self.end, self.valid,
                        torch.ones_like(self.valid), self.segments)

    def to(self, device) -> "PackedTree":
        """The same tree with every tensor on ``device``."""
        names = [f.name for f in dataclasses.fields(self) if f.name != "stats"]
        moved = {name: getattr(self, name).to(device) for name in names}
        return PackedTree(stats=self.stats, **moved)


def build_tree(
    per_token: PerToken, attention_mask: Optional[Tensor] = None, *, hash_fn: Optional[HashFn] = None
) -> PackedTree:
    """The exact prefix tree of a batch, in packed depth-first layout.

    ``per_token``: a [B, L] tensor or a sequence of them (token ids, position ids, ...; int, bool or float
    dtypes, floats compared by bit pattern), or [B, L, ...] tensors (embeddings, hidden states: a position's
    trailing elements compared as bytes). A [B, L, ...] input enters as a 64-bit hash of each position's
    bytes; the finished tree is then checked exactly (:func:`rows_agree`: every position equals its node's
    representative, bitwise) and rebuilt from exact codes if a hash collided — a merge never rests on a hash. ``attention_mask``: optional [B, L], nonzero = valid; it is
    part of node identity and gives ``valid``. All on one device; the outputs are on it too.

    ``hash_fn(codes) -> Tensor``: the per-token hash of the fast path. ``codes`` is a tuple of [B, L]
    tensors: one int64 code per per-token input, then the bool mask if one is given (or a single int64
    key when they pack into one; equal tuples <=> equal tokens; do not modify them); it returns an
    integer [B, L] tensor h, and the prefix hash of (b, t) is the wrapping int64 sum of h[b, 0..t].
    Default: :func:`default_token_hash`. Any function is safe (the resulting order is verified exactly and
    replaced by an exact sort when wrong); a weak one only costs time. Unused when the exact sort is the
    cheaper way for the batch's shape (B > 64 and B * log2(L) > 4 L, or B > PAIRWISE_MAX_ROWS).

    Raises TreeInputError (a ValueError) on inputs that are not one [B, L] batch with B, L >= 1.
    """
    codes, mask = _token_codes(per_token, attention_mask)
    wide = [x for x in _input_list(per_token) if x.dim() > 2]
    counters["builds"] += 1
    tree = _tree_of_codes(codes, mask, hash_fn)
    if wide and not rows_agree(tree, wide):
        # a hash collision of two different [..] vectors at one column: node identity must not rest on it
        counters["wide_hash_fallback"] += 1
        log.info("per-position hash of a [B, L, ...] input collided; building the tree from exact codes")
        codes, mask = _token_codes(per_token, attention_mask, exact=True)
        tree = _tree_of_codes(codes, mask, hash_fn)
    log.debug("prefix tree: %s", tree.stats)
    return tree


def _tree_of_codes(codes: tuple, mask: Optional[Tensor], hash_fn: Optional[HashFn]) -> PackedTree:
    codes = _packed_codes(codes)
    perm, lcp = _lexicographic_row_order(codes, hash_fn)
    return _assemble(perm, lcp, mask, codes[0].shape[1])


def row_keys(per_token: Sequence[Tensor]) -> list[Tensor]:
    """``[T, ...]`` tree inputs of a graph over flattened tokens as ``[B, L, ...] = [T, 1, ...]`` tree keys: each
    row a sequence of one token."""
    return [x.unsqueeze(1) for x in per_token]


def rows_agree(tree: PackedTree, per_token: PerToken) -> bool:
    """True iff every position of every input equals, bitwise, the same input at its node's representative
    position: ``x[b, t] == x[rep_row[k], position[k]]`` for ``k = index[b, t]`` (all trailing elements; in a
    tree over rows ``position[k] == t``). O(B*L*D), one gather.

    For any prefix tree of the batch's rows (its nodes chain along each row) this is exactly "positions
    sharing a node agree on every input at every column up to theirs", i.e. the tree is a correct (maybe
    finer than necessary) tree of ``per_token``. A tree with dropped positions (index -1) never agrees."""
    inputs = _input_list(per_token)
    B, L = tree.batch_shape
    if bool((tree.index < 0).any()):
        return False
    flat = tree.index.reshape(-1)
    rep = tree.rep_row.index_select(0, flat).view(B, L)
    cols = tree.position.index_select(0, flat).view(B, L)  # t itself in a tree over rows
    for x in inputs:
        if x.dim() < 2 or tuple(x.shape[:2]) != (B, L) or x.device != tree.index.device:
            return False
        w = _position_words(x) if x.dim() > 2 else _int64_code(x, "per_token")
        if not torch.equal(w[rep, cols], w):
            return False
    return True


def default_token_hash(codes: tuple) -> Tensor:
    """h(b, t) = fmix(x(b, t) * m1) * m2, fmix(y) = y ^ (y >>> 31), with the column and the inputs folded
    as x = (codes[0] + t * golden) ^ (codes[1] * c1) ^ (codes[2] * c2) ...

    Mixing in the column makes the prefix sum order-sensitive; multiplying by an odd constant and the
    xorshift are bijections of 64-bit words, so tokens that differ in x at one column never share h there.
    In place in one buffer (plus a scratch one): the hash is a large part of build_tree's cost, and a
    weak spot only costs the exact fallback, never a wrong tree.
    """
    x = codes[0] + torch.arange(codes[0].shape[1], device=codes[0].device, dtype=torch.int64) * _GOLDEN
    scratch = torch.empty_like(x)
    for j, code in enumerate(codes[1:]):
        x ^= torch.mul(code, _FOLD[j % len(_FOLD)], out=scratch)
    x *= _MIX1
    x ^= _shift_right_logical(x, 31, out=scratch)
    x *= _MIX2
    return x


# ---------------------------------------------------------------------------------------------------------
# inputs


def _token_codes(per_token: PerToken, attention_mask: Optional[Tensor], exact: bool = False) -> tuple:
    """(codes, mask): one int64 [B, L] code tensor per input, then the bool mask (a 0/1 code), or None.
    A [B, L, ...] input's code is a per-position hash of its trailing bytes (:func:`_wide_hash`; with
    ``exact``, the exact dense id of the trailing bytes instead)."""
    inputs = _input_list(per_token)
    first = inputs[0]
    for j, x in enumerate(inputs):
        if x.dim() < 2:
            raise TreeInputError(f"per_token[{j}] must be a [B, L] tensor, got shape {tuple(x.shape)}")
        if x.shape[:2] != first.shape[:2]:
            shapes = f"{tuple(x.shape)}, per_token[0] has {tuple(first.shape)}"
            raise TreeInputError(f"per_token[{j}] has shape {shapes}")
        if x.device != first.device:
            raise TreeInputError(f"per_token[{j}] is on {x.device}, per_token[0] on {first.device}")
    B, L = first.shape[:2]
    if B == 0 or L == 0:
        raise TreeInputError(f"the batch is empty: B={B}, L={L} (both must be >= 1)")
    codes = [_int64_code(x, f"per_token[{j}]") if x.dim() == 2 else _wide_code(x, f"per_token[{j}]", exact)
             for j, x in enumerate(inputs)]
    mask = None
    if attention_mask is not None:
        if not isinstance(attention_mask, Tensor):
            raise TreeInputError(f"attention_mask must be a tensor, got {type(attention_mask).__name__}")
        if attention_mask.shape != first.shape[:2]:
            shapes = f"{tuple(attention_mask.shape)}, per_token has {tuple(first.shape[:2])}"
            raise TreeInputError(f"attention_mask has shape {shapes}")
        if attention_mask.device != first.device:
            raise TreeInputError(f"attention_mask is on {attention_mask.device}, per_token on {first.device}")
        if attention_mask.is_complex():
            raise TreeInputError(f"attention_mask has unsupported dtype {attention_mask.dtype}")
        mask = attention_mask.detach()
        mask = mask if mask.dtype == torch.bool else mask != 0
        codes.append(mask)
    return tuple(codes), mask


def _input_list(per_token: PerToken) -> list:
    """per_token as a non-empty list of tensors."""
    if isinstance(per_token, Tensor):
        return [per_token]
    if not isinstance(per_token, (list, tuple)):
        got = type(per_token).__name__
        raise TreeInputError(f"per_token must be a tensor or a sequence of tensors, got {got}")
    if len(per_token) == 0:
        raise TreeInputError("per_token is an empty sequence; give at least one [B, L] tensor")
    for j, x in enumerate(per_token):
        if not isinstance(x, Tensor):
            raise TreeInputError(f"per_token[{j}] must be a tensor, got {type(x).__name__}")
    return list(per_token)


def _int64_code(x: Tensor, name: str) -> Tensor:
    """An int64 tensor equal where x is equal: ints and bools by value, floats by their bit pattern."""
    x = x.detach()
    if x.dtype == torch.bool:
        return x.to(torch.int64)
    if x.is_complex() or x.is_quantized:
        raise TreeInputError(f"{name} has unsupported dtype {x.dtype} (use int, bool or float tensors)")
    if x.is_floating_point():
        return x.view(_SIGNED_BY_SIZE[x.element_size()]).to(torch.int64)
    if x.element_size() == 8:  # int64, uint64: reinterpret, injective
        return x.view(torch.int64)
    return x.to(torch.int64)


def _position_words(x: Tensor) -> Tensor:
    """The bytes of each position of a [B, L, ...] tensor as a [B, L, W] integer tensor (the widest of
    int64/int32/int16/uint8 that divides the position's byte count): equal iff bitwise equal (floats by
    bit pattern: -0.0 != 0.0, NaNs by payload)."""
    x = x.detach()
    if x.is_complex() or x.is_quantized:
        raise TreeInputError(f"a per-token input has unsupported dtype {x.dtype} (use int, bool or float tensors)")
    B, L = x.shape[:2]
    flat = x.contiguous().reshape(B, L, -1)
    if flat.shape[-1] == 0:
        return torch.zeros((B, L, 0), dtype=torch.uint8, device=x.device)
    nbytes = flat.shape[-1] * flat.element_size()
    word = next(d for d in (torch.int64, torch.int32, torch.int16, torch.uint8)
                if nbytes % torch.empty((), dtype=d).element_size() == 0)
    try:
        return flat.view(torch.uint8).view(word)
    except RuntimeError:  # a storage offset not aligned to the word size
        return flat.clone().view(torch.uint8).view(word)


_WIDE_MULTIPLIERS: dict = {}


def _wide_multipliers(n: int, device) -> Tensor:
    """n fixed odd int64 multipliers (deterministic), one per word of a position."""
    key = (n, str(device))
    if key not in _WIDE_MULTIPLIERS:
        g = torch.Generator().manual_seed(0x5EED)
        r = torch.randint(-(1 << 62), 1 << 62, (n,), generator=g, dtype=torch.int64).mul_(2).bitwise_or_(1)
        _WIDE_MULTIPLIERS[key] = r.to(device)
    return _WIDE_MULTIPLIERS[key]


def _wide_hash(words: Tensor) -> Tensor:
    """[B, L] int64: sum_w words[.., w] * r_w (wrapping, r_w odd and fixed), the multilinear hash of each
    position's words. Two positions differing in one word never collide (r_w is odd, so a nonzero word
    difference times r_w is nonzero mod 2^64); collisions need several compensating differences. Vectorised,
    O(B*L*W); a collision only costs the exact rebuild (build_tree checks every merge)."""
    if words.shape[-1] == 0:
        return torch.zeros(words.shape[:2], dtype=torch.int64, device=words.device)
    r = _wide_multipliers(words.shape[-1], words.device)
    w = words if words.dtype == torch.int64 else words.to(torch.int64)
    if w.device.type == "cpu":
        return w @ r  # integer matmul: exact mod 2^64 whatever the summation order; fast on CPU
    return torch.mul(w, r).sum(dim=-1)


def _wide_code(x: Tensor, name: str, exact: bool) -> Tensor:
    """The int64 [B, L] code of a [B, L, ...] input: a hash of each position's bytes, or (``exact``) the
    dense rank of the position's bytes among all positions (equal iff bitwise equal; a lexicographic sort
    of B*L rows of W words)."""
    try:
        words = _position_words(x)
    except TreeInputError as e:
        raise TreeInputError(f"{name}: {e}") from None
    if not exact:
        return _wide_hash(words)
    B, L, W = words.shape
    if W == 0:
        return torch.zeros((B, L), dtype=torch.int64, device=x.device)
    _, inverse = torch.unique(words.reshape(B * L, W), dim=0, return_inverse=True)
    return inverse.view(B, L).to(torch.int64)


def _packed_codes(codes: tuple) -> tuple:
    """Several codes as one int64 key when their value ranges fit in 63 bits together, else unchanged.

    key = sum_j (code_j - min_j) << shift_j with code 0 in the most significant bits, so keys are equal
    iff the tuples are, and ordered as the tuples are (RL batches: token ids, position ids and the mask
    bit fit easily). One gather, compare and sort instead of one per input downstream.
    """
    if len(codes) == 1:
        return codes
    numeric = [x for x in codes if x.dtype != torch.bool]
    extrema = iter(torch.stack([torch.stack(torch.aminmax(x)) for x in numeric]).tolist() if numeric else [])
    limits = [(0, 1) if x.dtype == torch.bool else tuple(next(extrema)) for x in codes]  # one sync
    widths = [(hi - lo).bit_length() for lo, hi in limits]
    if sum(widths) > 63:
        return codes
    key = None
    for x, (lo, _), width in zip(codes, limits, widths):
        if width == 0:
            continue  # constant input: carries no information
        part = x.to(torch.int64) if x.dtype == torch.bool else x - lo
        key = part if key is None else key.bitwise_left_shift_(width).bitwise_or_(part)
    return (key if key is not None else torch.zeros_like(codes[0]),)


# ---------------------------------------------------------------------------------------------------------
# row order


def _lexicographic_row_order(codes: tuple, hash_fn: Optional[HashFn]) -> tuple:
    """(perm, lcp): rows in lexicographic order (perm[i] = row at sorted place i) and, exactly, lcp[i] =
    the first column where sorted rows i and i+1 differ (L if equal)."""
    B, L = codes[0].shape
    if not _use_pairwise_search(B, L):
        counters["exact_order"] += 1
        return _verified_exact_order(codes)
    perm = _hashed_row_order(codes, hash_fn or default_token_hash)
    lcp = _adjacent_lcp(codes, perm)
    if _neighbours_strictly_increasing(codes, perm, lcp):
        counters["hashed_order"] += 1
        return perm, lcp
    counters["hash_fallback"] += 1
    log.info("prefix hash order failed exact verification (B=%d); sorting rows exactly", B)
    return _verified_exact_order(codes)


def _use_pairwise_search(B: int, L: int) -> bool:
    """Whether the hashed order is the cheaper way: its search costs ~B^2/2 * log2(L) gathers, the exact
    sort ~2 batched sorts of B*L keys per input (measured crossover near B * log2(L) = 5-10 L). Small B
    (<= 64: at most 2016 pairs) always qualifies; B > PAIRWISE_MAX_ROWS never does."""
    if B > PAIRWISE_MAX_ROWS:
        return False
    return B <= 64 or B * L.bit_length() <= 4 * L


def _verified_exact_order(codes: tuple) -> tuple:
    """The exact lexicographic order with its lcp; it must pass the same verification as the fast path."""
    perm = _exact_row_order(codes)
    lcp = _adjacent_lcp(codes, perm)
    if not _neighbours_strictly_increasing(codes, perm, lcp):
        raise RuntimeError("brcompile.runtime.tree: exact row sort produced an unsorted order (internal error)")
    return perm, lcp


def _hashed_row_order(codes: tuple, hash_fn: HashFn) -> Tensor:
    """perm sorting rows by the comparison 'a before b' decided at their hashed first difference c(a, b):
    codes at c compared as tuples; rows with no hashed difference keep index order.

    rank(x) = #{y : y before x}, perm = argsort(rank). Correct whenever the hash has no collision on the
    compared prefixes; the caller verifies it exactly.
    """
    B, L = codes[0].shape
    h = hash_fn(codes)
    if not isinstance(h, Tensor) or tuple(h.shape) != (B, L) or h.is_floating_point() or h.is_complex():
        got = f"{tuple(h.shape)} {h.dtype}" if isinstance(h, Tensor) else type(h).__name__
        raise TreeInputError(f"hash_fn must return an integer [B, L] = [{B}, {L}] tensor, got {got}")
    prefix = torch.cumsum(h.to(torch.int64), dim=1)
    a, b, c = _hashed_first_difference(prefix)
    col = c.clamp(max=L - 1)
    less, tied = _tuple_compare(codes, a, b, col)
    a_first = less | tied | (c >= L)
    later = torch.where(a_first, b, a)  # the row of each pair that the other one precedes
    rank = torch.bincount(later, minlength=B)
    return torch.argsort(rank, stable=True)


def _hashed_first_difference(prefix: Tensor) -> tuple:
    """(a, b, c) over pairs a < b: c = first column where prefix[a] != prefix[b] (L if none), by binary
    search assuming equality is monotone (exact without collisions). ceil(log2(L+1)) vectorised steps."""
    B, L = prefix.shape
    a, b = torch.triu_indices(B, B, offset=1, device=prefix.device)
    flat = prefix.reshape(-1)
    lo = torch.zeros_like(a)
    hi = torch.full_like(a, L)
    for _ in range(L.bit_length()):
        mid = (lo + hi) // 2
        col = mid.clamp(max=L - 1)
        differ = flat[a * L + col] != flat[b * L + col]
        active = lo < hi
        hi = torch.where(active & differ, mid, hi)
        lo = torch.where(active & ~differ, mid + 1, lo)
    return a, b, lo


def _tuple_compare(codes: tuple, rows0: Tensor, rows1: Tensor, col: Tensor) -> tuple:
    """(less, tied): codes[:][rows0, col] < / == codes[:][rows1, col] as tuples (input 0 most significant)."""
    less = torch.zeros(rows0.shape, dtype=torch.bool, device=rows0.device)
    tied = torch.ones(rows0.shape, dtype=torch.bool, device=rows0.device)
    for x in codes:
        x0, x1 = x[rows0, col], x[rows1, col]
        less |= tied & (x0 < x1)
        tied &= x0 == x1
    return less, tied


def _adjacent_lcp(codes: tuple, perm: Tensor) -> Tensor:
    """lcp[i] = first column where rows perm[i] and perm[i+1] differ in any input (L if none); exact."""
    B, L = codes[0].shape
    if B == 1:
        return torch.zeros(0, dtype=torch.int64, device=perm.device)
    differ = None
    for x in codes:
        xs = x.index_select(0, perm)
        d = xs[1:] != xs[:-1]
        differ = d if differ is None else differ.logical_or_(d)
    first = differ.view(torch.uint8).argmax(dim=1)  # the first True, or 0 when there is none
    found = differ.gather(1, first.unsqueeze(1)).squeeze(1)
    return torch.where(found, first, L)


def _neighbours_strictly_increasing(codes: tuple, perm: Tensor, lcp: Tensor) -> bool:
    """True iff every pair of adjacent sorted rows that differ is in strict order at its first difference,
    i.e. the order is lexicographic (equal rows are adjacent automatically then)."""
    L = codes[0].shape[1]
    if lcp.numel() == 0:
        return True
    less, _ = _tuple_compare(codes, perm[:-1], perm[1:], lcp.clamp(max=L - 1))
    return bool(((lcp >= L) | less).all())


def _exact_row_order(codes: tuple) -> Tensor:
    """perm sorting rows lexicographically, exactly: prefix doubling over column blocks.

    rank_0[t, b] = dense rank of the tuple (codes[0][b, t], codes[1][b, t], ...) within column t;
    rank_{w+1}[j, b] = dense rank of (rank_w[2j, b], rank_w[2j+1, b]) within block j (an odd last block
    pairs with 0). After ceil(log2 L) rounds rank[0, b] is the lexicographic rank of row b. Keys stay
    below B^2; the work is about twice that of the first round.
    """
    B = codes[0].shape[0]
    rank = None
    for x in codes:
        column_major = x.t().to(torch.int64).contiguous()  # [L, B]: one sort per column
        if rank is None:
            rank = _dense_rank_per_row(column_major)
        else:
            rank = _dense_rank_per_row(rank.mul_(B).add_(_dense_rank_per_row(column_major)))
    while rank.shape[0] > 1:
        half = rank.shape[0] // 2
        keys = rank.new_empty(rank.shape[0] - half, B)
        torch.add(rank[1 : 2 * half : 2], rank[0 : 2 * half : 2], alpha=B, out=keys[:half])
        if rank.shape[0] % 2:
            torch.mul(rank[-1], B, out=keys[half])
        rank = _dense_rank_per_row(keys)
    return torch.argsort(rank[0], stable=True)


def _dense_rank_per_row(keys: Tensor) -> Tensor:
    """out[r, j] = number of distinct values in keys[r] smaller than keys[r, j] (in [0, keys.shape[1]))."""
    ordered, where = torch.sort(keys, dim=1)
    new_value = torch.empty_like(ordered, dtype=torch.bool)
    new_value[:, 0] = False
    torch.ne(ordered[:, 1:], ordered[:, :-1], out=new_value[:, 1:])
    return torch.empty_like(keys).scatter_(1, where, new_value.cumsum(dim=1))


def _shift_right_logical(x: Tensor, s: int, out: Optional[Tensor] = None) -> Tensor:
    """x >> s on the 64-bit pattern (torch's >> on int64 is arithmetic)."""
    shifted = torch.bitwise_right_shift(x, s, out=out) if out is not None else x >> s
    return shifted.bitwise_and_((1 << (64 - s)) - 1)


# ---------------------------------------------------------------------------------------------------------
# layout


def _assemble(perm: Tensor, lcp: Tensor, mask: Optional[Tensor], L: int) -> PackedTree:
    """The packed layout from the sorted rows: sorted row i owns columns s_i.. L-1, s_0 = 0, s_i = lcp[i-1],
    laid out row after row (offset off_i = sum_{r<i} (L - s_r))."""
    device = perm.device
    B = perm.shape[0]
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    start_col = torch.cat([zero, lcp])  # s_i
    offset = torch.cat([zero, torch.cumsum(L - start_col, dim=0)])  # off_i, [B + 1]
    num_tokens = int(offset[-1])
    seg = _segment_table(perm, lcp, start_col, offset, L)
    num_segments = seg["start"].shape[0]

    seg_of = torch.repeat_interleave(
        torch.arange(num_segments, device=device), seg["stop"] - seg["start"], output_size=num_tokens
    )
    shift = seg["first_col"] - seg["start"]  # position - packed id, per segment
    position = torch.arange(num_tokens, device=device).add_(shift.index_select(0, seg_of))
    parent = torch.arange(-1, num_tokens - 1, device=device)
    parent[seg["start"]] = seg["parent"]
    end = seg["subtree_end"].index_select(0, seg_of)
    rep_row = seg["rep_row"].index_select(0, seg_of)
    if mask is not None:
        valid = mask.reshape(-1).index_select(0, rep_row * L + position)
    else:
        valid = torch.ones(num_tokens, dtype=torch.bool, device=device)
    index = _dense_index(perm, seg, L)

    stats = TreeStats(
        rows=B,
        logical_tokens=B * L,
        executed_tokens=num_tokens,
        valid_tokens=int(mask.sum()) if mask is not None else B * L,
        dedup_ratio=B * L / num_tokens,
        depth=L,
        segments=num_segments,
    )
    segments = torch.stack([seg["start"], seg["stop"], seg["subtree_end"]], dim=1)
    return PackedTree(index, parent, end, position, valid, rep_row, segments, stats)


def _segment_table(perm: Tensor, lcp: Tensor, start_col: Tensor, offset: Tensor, L: int) -> dict:
    """Per segment (sorted by packed start): start, stop, subtree_end, parent of its first node, first_col,
    row .. last_row (the sorted rows whose paths contain it), rep_row.

    Boundaries as (owner row, column): (i, s_i) for every row owning tokens, and (po(j), s_j) for every
    row j branching off at 0 < s_j < L, po(j) = max{r < j : s_r < s_j}. The rows sharing a segment of
    owner i whose last column is t are sorted rows i..m, m = min{j >= i : lcp[j] <= t} (lcp[B-1] := -1).
    """
    device = perm.device
    B = perm.shape[0]
    rows = torch.arange(B, device=device)
    owner_of_branch = _previous_strictly_smaller(start_col)
    owns = start_col < L
    branches = (start_col > 0) & owns
    width = L + 1
    row_starts = rows[owns] * width + start_col[owns]
    branch_starts = owner_of_branch[branches] * width + start_col[branches]
    keys = torch.cat([row_starts, branch_starts])
    keys = torch.unique(keys)  # sorted: owner row, then column = packed order
    row, first_col = keys // width, keys % width
    same_row_next = torch.cat([row[1:] == row[:-1], torch.zeros(1, dtype=torch.bool, device=device)])
    stop_col = torch.where(same_row_next, torch.cat([first_col[1:], first_col.new_full((1,), L)]), L)
    start = offset[row] + first_col - start_col[row]
    stop = start + (stop_col - first_col)

    # parent of the first node: the node at first_col - 1 on the same path, owned by `row` itself when
    # the segment starts inside the row's range, else by po(row).
    inside = first_col > start_col[row]
    parent_owner = torch.where(inside, row, owner_of_branch[row].clamp(min=0))
    parent = offset[parent_owner] + first_col - 1 - start_col[parent_owner]
    parent = torch.where(first_col == 0, -1, parent)

    lcp_sentinel = torch.cat([lcp, lcp.new_full((1,), -1)])
    last_row = _next_at_most(lcp_sentinel, row, stop_col - 1)
    return {
        "start": start,
        "stop": stop,
        "subtree_end": offset[last_row + 1],
        "parent": parent,
        "first_col": first_col,
        "row": row,
        "last_row": last_row,
        "rep_row": _range_min(perm, row, last_row),
    }


def _dense_index(perm: Tensor, seg: dict, L: int) -> Tensor:
    """index[b, t] = t + v(g), v(g) = start(g) - first_col(g), for g the segment of row b's path covering t.

    Along a path v only changes where a segment begins, so index[b] = t + cumsum_t D[b] with
    D[b, first_col(g)] = v(g) - v(parent segment of g) (v(g) for a root segment) for every segment g on
    the path, i.e. for the sorted rows row(g)..last_row(g). Three passes over [B, L]."""
    device = perm.device
    B = perm.shape[0]
    start, first_col, parent = seg["start"], seg["first_col"], seg["parent"]
    value = start - first_col
    parent_seg = torch.searchsorted(start, parent, right=True) - 1
    delta = value - torch.where(parent >= 0, value[parent_seg.clamp(min=0)], 0)
    rows_per_seg = seg["last_row"] - seg["row"] + 1
    num_pairs = int(rows_per_seg.sum())
    seg_ids = torch.arange(start.shape[0], device=device)
    pair_seg = torch.repeat_interleave(seg_ids, rows_per_seg, output_size=num_pairs)
    first_pair = torch.cumsum(rows_per_seg, dim=0) - rows_per_seg
    pair_row = seg["row"][pair_seg] + torch.arange(num_pairs, device=device) - first_pair[pair_seg]
    index = torch.zeros((B, L), dtype=torch.int64, device=device)
    index.view(-1)[perm[pair_row] * L + first_col[pair_seg]] = delta[pair_seg]
    index.cumsum_(dim=1)
    return index.add_(torch.arange(L, device=device))


def _previous_strictly_smaller(x: Tensor) -> Tensor:
    """out[j] = max{r < j : x[r] < x[j]} (-1 if none), by binary lifting over a range-min table:
    extend the window [pos, j) leftwards by 2^k while its minimum stays >= x[j]."""
    n = x.shape[0]
    table = _min_table(x)
    pos = torch.arange(n, device=x.device)
    for k in reversed(range(len(table))):
        step = 1 << k
        cand = pos - step
        ok = (cand >= 0) & (table[k][cand.clamp(min=0)] >= x)
        pos = torch.where(ok, cand, pos)
    return pos - 1


def _next_at_most(x: Tensor, begin: Tensor, bound: Tensor) -> Tensor:
    """out[q] = min{j >= begin[q] : x[j] <= bound[q]}; requires x[-1] <= every bound (a sentinel)."""
    n = x.shape[0]
    table = _min_table(x)
    pos = begin.clone()
    for k in reversed(range(len(table))):
        step = 1 << k
        ok = (pos + step <= n) & (table[k][pos.clamp(max=n - step)] > bound)
        pos = torch.where(ok, pos + step, pos)
    return pos


def _range_min(x: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """out[q] = min(x[lo[q] .. hi[q]]) (inclusive, lo <= hi): two overlapping power-of-two windows of a
    range-min table, level = floor(log2(hi - lo + 1))."""
    table = _min_table(x)
    length = hi - lo + 1
    level = sum((length >= (1 << k)).to(torch.int64) for k in range(len(table))) - 1
    width = torch.bitwise_left_shift(torch.ones_like(level), level)
    stacked = torch.stack([_padded(t, x.shape[0]) for t in table])  # [K, n]
    return torch.minimum(stacked[level, lo], stacked[level, hi - width + 1])


def _min_table(x: Tensor) -> list:
    """table[k][r] = min(x[r : r + 2^k]) for r <= n - 2^k (sparse table, O(n log n))."""
    table = [x]
    step = 1
    while 2 * step <= x.shape[0]:
        prev = table[-1]
        table.append(torch.minimum(prev[:-step], prev[step:]))
        step *= 2
    return table


def _padded(t: Tensor, n: int) -> Tensor:
    """t extended to length n (the padding is never read by _range_min)."""
    return torch.cat([t, t.new_zeros(n - t.shape[0])])


# ---------------------------------------------------------------------------------------------------------
# padding left out of the tree (drop_padding=True, docs/ARCHITECTURE.md §4)


def drop_padding(tree: PackedTree) -> PackedTree:
    """The tree without its invalid (attention-mask bit 0) tokens: :func:`drop_positions` keeping the valid
    ones."""
    return drop_positions(tree)


def drop_positions(tree: PackedTree, needed: Optional[Tensor] = None, live: Optional[Tensor] = None) -> PackedTree:
    """The tree without the tokens no needed position holds; dropped dense positions get index -1.

    ``needed`` ([B, L] bool, ``passes.liveness.LivePlan.needed``): a packed token is kept when some (b, t) it
    holds is needed; without it, the valid (attention-mask bit 1) tokens are kept (``drop_padding``).
    ``live`` ([B, L] bool, optional): counted into ``stats.live_tokens`` (the kept tokens some live
    position holds).

    Deleting nodes from a depth-first preorder leaves a preorder of the forest in which every kept node
    hangs under its nearest kept ancestor. With before[k] = #kept tokens < k (the new id of a kept k)::

        index'[b, t] = before[index[b, t]] if index[b, t] is kept, else -1
        end'[k']     = before[end[k]]          (the kept part of k's subtree range [k, end[k]))
        parent'[k']  = the new id of the last kept column < position[k] in row rep_row[k], or -1
        position', rep_row', valid' = position, rep_row, valid at the kept tokens

    so "k' is an ancestor-or-self of q'  <=>  k' <= q' < end'[k']" still holds. A dropped token is a key no
    kept query reads (its mask bit is 0, or it lies after every needed position of every row through it), so
    every kept query attends exactly the keys it did before. Segments are recomputed as the maximal
    single-child chains of the new forest (:func:`_chain_segments`). Stats: executed_tokens = N' (dedup_ratio =
    B*L / N', inf when nothing is kept), dead_tokens = N - N', depth = the most kept positions of a row; rows,
    logical_tokens, valid_tokens unchanged. A tree that keeps every token is returned as is (with its
    live_tokens counted). Vectorised: O(B*L + N) work, two host synchronisations.
    """
    if needed is None:
        keep = tree.valid
        live = None
    else:
        keep = torch.zeros(tree.num_tokens, dtype=torch.bool, device=tree.index.device)
        keep[tree.index[needed]] = True
    n_live = None
    if live is not None:
        held = torch.zeros(tree.num_tokens, dtype=torch.bool, device=tree.index.device)
        held[tree.index[live]] = True
        n_live = held
    if bool(keep.all()):
        if n_live is None:
            return tree
        return dataclasses.replace(tree, stats=dataclasses.replace(tree.stats, live_tokens=int(n_live.sum())))
    B, L = tree.batch_shape
    before = torch.zeros(tree.num_tokens + 1, dtype=torch.int64, device=keep.device)
    torch.cumsum(keep, dim=0, out=before[1:])
    kept = keep.nonzero().squeeze(1)  # old ids of the kept tokens, ascending (= new order)
    index = torch.where(keep, before[:-1], -1)[tree.index]  # [B, L]
    dense_keep = index >= 0
    position = tree.position[kept]
    rep_row = tree.rep_row[kept]
    end = before[tree.end[kept]]
    parent = _kept_parent(index, dense_keep, rep_row, position)
    segments = _chain_segments(parent, end)
    counts = [before[-1], dense_keep.sum(dim=1).max()] + ([] if n_live is None else [(n_live & keep).sum()])
    counts = torch.stack(counts).tolist()
    n_kept, depth = counts[0], counts[1]
    stats = dataclasses.replace(
        tree.stats,
        executed_tokens=n_kept,
        dedup_ratio=B * L / n_kept if n_kept else float("inf"),
        depth=depth,
        segments=segments.shape[0],
        dead_tokens=tree.num_tokens - n_kept,
        live_tokens=counts[2] if n_live is not None else tree.stats.live_tokens,
    )
    valid = tree.valid[kept]
    out = PackedTree(index, parent, end, position, valid, rep_row, segments, stats)
    log.debug("drop_positions: %d of %d packed tokens kept; %s", n_kept, tree.num_tokens, stats)
    return out


def _kept_parent(index: Tensor, dense_keep: Tensor, rep_row: Tensor, position: Tensor) -> Tensor:
    """parent'[k] = index[r, c] for r = rep_row[k] and c = the last column < position[k] whose position
    is kept in row r (-1 when there is none). Every row through k agrees with row r on every earlier
    column, so any of them gives the same node. prev[b, t] = max{c < t : keep[b, c]} is a running max."""
    B, L = index.shape
    cols = torch.arange(L, device=index.device)
    last_kept = torch.where(dense_keep, cols, -1).cummax(dim=1).values  # max{c <= t : keep[b, c]}
    prev = torch.cat([last_kept.new_full((B, 1), -1), last_kept[:, :-1]], dim=1)
    col = prev[rep_row, position]
    return torch.where(col >= 0, index[rep_row, col.clamp(min=0)], -1)


def _chain_segments(parent: Tensor, end: Tensor) -> Tensor:
    """[S, 3] (start, stop, subtree_end): the maximal chains of single-child nodes of a preorder forest.

    Token k continues the chain of k - 1 iff parent[k] == k - 1 and k - 1 has exactly one child, i.e. no
    sibling follows k's subtree inside k - 1's: end[k] == end[k - 1]. Every other token starts a segment."""
    n = parent.shape[0]
    if n == 0:
        return torch.zeros((0, 3), dtype=torch.int64, device=parent.device)
    ids = torch.arange(n, device=parent.device)
    continues = torch.zeros(n, dtype=torch.bool, device=parent.device)
    continues[1:] = (parent[1:] == ids[:-1]) & (end[1:] == end[:-1])
    starts = (~continues).nonzero().squeeze(1)
    stops = torch.cat([starts[1:], starts.new_full((1,), n)])
    return torch.stack([starts, stops, end[starts]], dim=1)


# ---------------------------------------------------------------------------------------------------------
# padding-free batches: several sequences packed into one row (docs/ARCHITECTURE.md §4, "Packed sequences")

#: A sequence tree lays the sequences out as [S, L_max] virtual rows; a batch whose layout would exceed
#: this many times its B * L cells (and SEQUENCE_LAYOUT_MIN_CELLS; one long sequence among many short ones)
#: is not replayed.
SEQUENCE_LAYOUT_FACTOR = 4
SEQUENCE_LAYOUT_MIN_CELLS = 1 << 16


def sequence_layout_problem(positions: Tensor) -> Optional[str]:
    """Why the [B, L] position ids ``positions`` do not describe rows of packed sequences, or None.

    Well formed: every row starts a sequence (position 0 at column 0) and every later column either
    starts one (position 0) or continues the previous column's (position + 1). The sequences then are the
    maximal runs ``0, 1, 2, ...`` of each row, and a sequence's position ids are the columns within it.
    Also refused: a layout of [S, L_max] virtual rows over SEQUENCE_LAYOUT_FACTOR * B * L cells (and over
    SEQUENCE_LAYOUT_MIN_CELLS). O(B*L)."""
    if not isinstance(positions, Tensor) or positions.dim() != 2 or positions.is_floating_point() \
            or positions.dtype == torch.bool or positions.numel() == 0:
        return "position ids are not a non-empty integer [B, L] tensor"
    p = positions.to(torch.int64)
    B, L = p.shape
    ok = torch.ones_like(p, dtype=torch.bool)
    ok[:, 0] = p[:, 0] == 0
    ok[:, 1:] = (p[:, 1:] == 0) | (p[:, 1:] == p[:, :-1] + 1)
    if not bool(ok.all()):
        b, t = (int(v) for v in (~ok).nonzero()[0])
        prev = "" if t == 0 else f" after {int(p[b, t - 1])}"
        return (f"position ids do not split the rows into sequences 0, 1, 2, ... (row {b}, column {t}: "
                f"{int(p[b, t])}{prev}; every sequence must start at 0 and count up by 1)")
    starts = (p == 0).reshape(-1).nonzero().squeeze(1)
    lengths = torch.diff(starts, append=starts.new_full((1,), B * L))
    S, L_max = starts.shape[0], int(lengths.max())
    if S * L_max > max(SEQUENCE_LAYOUT_FACTOR * B * L, SEQUENCE_LAYOUT_MIN_CELLS):
        return (f"packed sequences too uneven to lay out: {S} sequences of up to {L_max} tokens in a [{B}, {L}] "
                f"batch (over {SEQUENCE_LAYOUT_FACTOR}x its cells)")
    return None


def build_sequence_tree(per_token: PerToken, positions: Tensor, *, hash_fn: Optional[HashFn] = None) -> PackedTree:
    """The exact prefix tree of the **sequences** packed into the rows of a padding-free batch.

    ``positions``: [B, L] position ids that restart at 0 at every sequence (:func:`sequence_layout_problem`
    must hold, else TreeInputError). Two tokens are the same node iff their sequences agree on every
    per-token input at every position up to theirs: the tree of :func:`build_tree` with the sequences as
    rows. Built as exactly that: the S sequences become [S, L_max] virtual rows (cell (s, c) = the c-th
    token of sequence s; cells past a sequence's end are padding, dropped with :func:`drop_padding`), and
    the result is mapped back to the dense layout:

        index[b, t]          = virtual index of (sequence of (b, t), t - its first column)
        rep_row, position    = the dense row and column of the token's first occurrence (smallest sequence)
        parent, end, segments = the virtual tree's (a preorder forest of the sequences' nodes)

    so ``k <= q < end[k]`` is still "k is an ancestor-or-self of q" and ``x[rep_row, position]`` reads a
    token's inputs; ``position`` is a dense column, not the token's position in its sequence (a graph whose
    values depend on the column is refused for such batches at compile time). ``stats.sequences = S``;
    ``depth`` is L_max; logical/valid tokens are the dense B * L.
    """
    problem = sequence_layout_problem(positions)
    if problem is not None:
        raise TreeInputError(problem)
    inputs = _input_list(per_token)
    B, L = positions.shape
    for j, x in enumerate(inputs):
        if x.dim() < 2 or tuple(x.shape[:2]) != (B, L) or x.device != positions.device:
            raise TreeInputError(f"per_token[{j}] has shape {tuple(x.shape)} on {x.device}; the position ids "
                                 f"are [{B}, {L}] on {positions.device}")
    device = positions.device
    first = (positions == 0).reshape(-1)
    starts = first.nonzero().squeeze(1)  # flat index of each sequence's first token, in dense order
    lengths = torch.diff(starts, append=starts.new_full((1,), B * L))
    S, L_max = starts.shape[0], int(lengths.max())
    cols = torch.arange(L_max, device=device)
    real = cols[None, :] < lengths[:, None]  # [S, L_max]
    src = torch.where(real, starts[:, None] + cols[None, :], starts[:, None])  # padding repeats token 0
    virtual = [x.reshape(B * L, *x.shape[2:])[src] for x in inputs]
    vtree = build_tree(virtual, attention_mask=None if bool(real.all()) else real, hash_fn=hash_fn)
    vtree = drop_padding(vtree)
    seq_of = torch.cumsum(first, dim=0) - 1  # [B * L]: the sequence of each dense position
    column = torch.arange(B * L, device=device) - starts[seq_of]
    index = vtree.index[seq_of, column].view(B, L)
    rep_start = starts[vtree.rep_row]
    rep_row = torch.div(rep_start, L, rounding_mode="floor")
    position = rep_start % L + vtree.position
    n = vtree.num_tokens
    stats = TreeStats(rows=B, logical_tokens=B * L, executed_tokens=n, valid_tokens=B * L,
                      dedup_ratio=B * L / n, depth=L_max, segments=vtree.stats.segments, sequences=S)
    tree = PackedTree(index, vtree.parent, vtree.end, position, torch.ones(n, dtype=torch.bool, device=device),
                      rep_row, vtree.segments, stats)
    log.debug("sequence tree: %s", stats)
    return tree
