"""Building the prefix tree of a batch: per-token codes, the exact lexicographic row order, the tree
(docs/ARCHITECTURE.md §4; the algorithm: brcompile/runtime/tree/__init__.py)."""
from __future__ import annotations

import collections
import logging
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor

log = logging.getLogger(__name__)

from brcompile.backends.common import cpu as kernels
from brcompile.runtime.tree.layout import PackedTree, TreeStats, assemble

counters: collections.Counter = collections.Counter()
"""Event counts, asserted exactly in tests. ``builds``: calls of build_tree; ``compiled``: the compiled CPU kernel
built the tree (backends/common/cpu/prefix_tree.cpp); ``hashed_order``: the hashed row order passed verification;
``hash_fallback``: it failed verification and the exact order was used; ``exact_order``: the exact order was
used directly (see _use_pairwise_search)."""

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

    On the CPU, without a ``hash_fn``, the compiled kernel builds the same tree in one call when the compiled CPU
    kernels are available (backends/common/cpu: an exact sort of the rows, no hash; ``counters["compiled"]``).

    Raises TreeInputError (a ValueError) on inputs that are not one [B, L] batch with B, L >= 1.
    """
    codes, mask = _token_codes(per_token, attention_mask)
    wide = [x for x in input_list(per_token) if x.dim() > 2]
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
    if hash_fn is None and codes[0].device.type == "cpu" and kernels.available():
        counters["compiled"] += 1
        return _compiled_tree(codes, mask)
    perm, lcp = _lexicographic_row_order(codes, hash_fn)
    return assemble(perm, lcp, mask, codes[0].shape[1])


def _compiled_tree(codes: tuple, mask: Optional[Tensor]) -> PackedTree:
    """The tree of the codes by the compiled CPU kernel (``brcompile_cpu::prefix_tree``): rows sorted exactly
    (stable, input 0 most significant), then the layout of :func:`assemble`, bitwise."""
    stacked = torch.stack([x.to(torch.int64) for x in codes]) if len(codes) > 1 else codes[0].unsqueeze(0)
    index, parent, end, position, valid, rep_row, segments = torch.ops.brcompile_cpu.prefix_tree(stacked, mask)
    stats = TreeStats.of_rows(*index.shape, parent.shape[0], segments.shape[0], mask)
    return PackedTree(index, parent, end, position, valid, rep_row, segments, stats)


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
    inputs = input_list(per_token)
    B, L = tree.batch_shape
    if bool((tree.index < 0).any()):
        return False
    flat = tree.index.reshape(-1)
    rep = tree.rep_row.index_select(0, flat).view(B, L)
    cols = tree.position.index_select(0, flat).view(B, L)  # t itself in a tree over rows
    for x in inputs:
        if x.dim() < 2 or tuple(x.shape[:2]) != (B, L) or x.device != tree.index.device:
            return False
        w = position_words(x) if x.dim() > 2 else _int64_code(x, "per_token")
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
    inputs = input_list(per_token)
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


def input_list(per_token: PerToken) -> list:
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


def position_words(x: Tensor) -> Tensor:
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
        words = position_words(x)
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
