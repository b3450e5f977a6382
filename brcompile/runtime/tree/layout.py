"""The packed layout of a prefix tree: :class:`PackedTree` (depth-first preorder, every subtree a range, every
single-child chain a segment), the arrays a packed graph takes (:class:`TreeArgs`), and the assembly of the layout
from the sorted rows and their common prefixes (:func:`assemble`)."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

log = logging.getLogger(__name__)

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
    live_tokens: int = -1  # kept nodes some live position holds (passes/analysis/liveness.py); -1: not analysed

    @classmethod
    def of_rows(cls, B: int, L: int, n: int, segments: int, mask: Optional[Tensor]) -> "TreeStats":
        """The stats of a tree over the B rows of a [B, L] batch with n tokens and ``segments`` segments (valid
        tokens: the mask's nonzeros, every position without one)."""
        return cls(rows=B, logical_tokens=B * L, executed_tokens=n,
                   valid_tokens=int(mask.sum()) if mask is not None else B * L, dedup_ratio=B * L / n, depth=L,
                   segments=segments)

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


def assemble(perm: Tensor, lcp: Tensor, mask: Optional[Tensor], L: int) -> PackedTree:
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

    stats = TreeStats.of_rows(B, L, num_tokens, num_segments, mask)
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
