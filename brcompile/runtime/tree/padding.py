"""Positions left out of a built tree (padding, positions no output needs) and trees over the sequences packed
into the rows of a padding-free batch."""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Sequence

import torch
from torch import Tensor

log = logging.getLogger(__name__)

from brcompile.backends.common import cpu as kernels
from brcompile.runtime.tree.build import HashFn, PerToken, TreeInputError, build_tree, input_list
from brcompile.runtime.tree.layout import PackedTree, TreeStats

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
    live_tokens counted). Vectorised: O(B*L + N) work, two host synchronisations; on the CPU the compiled kernel
    (backends/common/cpu/prefix_tree.cpp, when available) does the same in one call.
    """
    if needed is None:  # drop_padding: the valid tokens, no liveness
        needed, live = tree.valid[tree.index], None
    if tree.index.device.type == "cpu" and kernels.available():
        *arrays, counts = torch.ops.brcompile_cpu.drop_positions(
            tree.index, tree.end, tree.position, tree.valid, tree.rep_row, needed.to(torch.bool), live)
        n_kept, depth, n_live = counts.tolist()
        return _dropped(tree, n_kept, n_live if live is not None else None, depth, arrays)
    keep = torch.zeros(tree.num_tokens, dtype=torch.bool, device=tree.index.device)
    keep[tree.index[needed]] = True
    held = None
    if live is not None:
        held = torch.zeros(tree.num_tokens, dtype=torch.bool, device=tree.index.device)
        held[tree.index[live]] = True
    if bool(keep.all()):
        return _dropped(tree, tree.num_tokens, None if held is None else int(held.sum()))
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
    counts = [before[-1], dense_keep.sum(dim=1).max()] + ([] if held is None else [(held & keep).sum()])
    counts = torch.stack(counts).tolist()
    return _dropped(tree, counts[0], counts[2] if held is not None else None, counts[1],
                    (index, parent, end, position, tree.valid[kept], rep_row, segments))


def _dropped(tree: PackedTree, n_kept: int, live_tokens: Optional[int], depth: int = 0,
             arrays: Optional[Sequence[Tensor]] = None) -> PackedTree:
    """The result of :func:`drop_positions`: ``tree`` itself when it keeps every token (its ``live_tokens`` counted
    when given), else the tree of ``arrays`` (index, parent, end, position, valid, rep_row, segments) with its stats:
    N' = ``n_kept`` executed tokens, the rest dead, ``depth`` the most kept positions of a row."""
    stats = tree.stats if live_tokens is None else dataclasses.replace(tree.stats, live_tokens=live_tokens)
    if n_kept == tree.num_tokens:
        return tree if stats is tree.stats else dataclasses.replace(tree, stats=stats)
    B, L = tree.batch_shape
    segments = arrays[-1]
    stats = dataclasses.replace(stats, executed_tokens=n_kept, dedup_ratio=B * L / n_kept if n_kept else float("inf"),
                                depth=depth, segments=segments.shape[0], dead_tokens=tree.num_tokens - n_kept)
    log.debug("drop_positions: %d of %d packed tokens kept; %s", n_kept, tree.num_tokens, stats)
    return PackedTree(*arrays, stats)


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
    inputs = input_list(per_token)
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
