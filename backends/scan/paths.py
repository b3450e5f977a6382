"""The tree arrays the scans run on and the pointer doubling they share (docs/ARCHITECTURE.md §6).

``parent`` (-1 at a root) from the subtree ends (:func:`parent_from_end`), the ancestors along a path
(:func:`path_ancestors`), and :func:`ancestor_doubling`: the affine maps ``h -> A[k] * h + values[k]`` composed
along the tree paths (PATH) or pushed up to the ancestors (SUBTREE, the transpose) in ``ceil(log2(depth))``
rounds of O(N) gathers or scatter-adds — the path and subtree sums, the linear scan and its transpose. And the
helpers both scan modules (op.py, matrix.py) read: :func:`in_layout_of`, :func:`prefix_rows`, :func:`chain_parent`.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["ScanError", "tree_depth", "parent_from_end", "in_layout_of", "check_tree_array", "jump",
           "path_ancestors", "broadcast_rows", "PATH", "SUBTREE", "ancestor_doubling", "path_sum", "subtree_sum",
           "chain_parent", "prefix_rows"]


class ScanError(ValueError):
    """Bad arguments to a tree scan op (shapes, dtypes, dims)."""



# ----------------------------------------------------------------------------------------- tree arrays


def tree_depth(end: Tensor) -> Tensor:
    """``depth[k]`` = number of ancestors-or-self of k = ``#{j <= k : end[j] > k}``, in O(N): a +1 at every
    j and a -1 at ``end[j]``, prefix-summed (every j with ``end[j] <= k`` is some j < k, as ``end[j] > j``)."""
    n = end.shape[0]
    diff = torch.zeros(n + 1, dtype=torch.int64, device=end.device)
    diff[:n] += 1
    diff.index_add_(0, end.to(torch.int64), torch.full_like(end, -1, dtype=torch.int64))
    return torch.cumsum(diff, 0)[:n]


def parent_from_end(end: Tensor) -> Tensor:
    """``parent[k]`` (-1 for a root) from the subtree ends of a preorder forest.

    The parent of k is its deepest proper ancestor: the largest j < k with ``depth[j] = depth[k] - 1`` (every
    node strictly between the parent and k lies in the subtree of an earlier sibling of k, deeper than the
    parent). Keys ``depth * (N + 1) + j`` sorted once; for each k the largest key below
    ``(depth[k] - 1) * (N + 1) + k`` is that j when its depth is ``depth[k] - 1`` (none for a root). O(N log N)."""
    n = end.shape[0]
    if n == 0:
        return end.new_empty(0, dtype=torch.int64)
    ids = torch.arange(n, device=end.device)
    depth = tree_depth(end)
    keys, order = torch.sort(depth * (n + 1) + ids)
    at = torch.searchsorted(keys, (depth - 1) * (n + 1) + ids) - 1
    cand = order[at.clamp(min=0)]
    found = (at >= 0) & (depth[cand] == depth - 1)
    return torch.where(found, cand, -1)



def in_layout_of(out: Tensor, like: Tensor) -> Tensor:
    """``out`` with the strides of ``torch.empty_like(like)`` (what the ops' fake kernels promise; a compiled
    graph checks them), copied only when they differ. Shared with backends/scan/matrix.py."""
    ref = torch.empty_like(like)
    return out if out.stride() == ref.stride() else ref.copy_(out)


def check_tree_array(a: Tensor, name: str) -> None:
    if a.dim() != 1 or a.dtype != torch.int64:
        raise ScanError(f"{name} must be a 1-D int64 tensor, got {tuple(a.shape)} {a.dtype}")


def jump(anc: Tensor, parent_like: Tensor) -> Tensor:
    """``parent_like[anc]`` where ``anc >= 0``, -1 elsewhere (stepping up from a root leaves the tree)."""
    return torch.where(anc >= 0, parent_like[anc.clamp(min=0)], -1)


def path_ancestors(parent: Tensor, width: int) -> Tensor:
    """``[width, N]``: row i holds ``anc_i(k)``, the i-th ancestor of k along its path (row 0 is k itself),
    -1 past the root."""
    anc = [torch.arange(parent.shape[0], device=parent.device)]
    for _ in range(width - 1):
        anc.append(jump(anc[-1], parent))
    return torch.stack(anc) if anc else parent.new_empty(0, parent.shape[0])



# --------------------------------------------------------------------------------------- path doubling


def broadcast_rows(mask: Tensor, like: Tensor) -> Tensor:
    """A ``[N]`` mask shaped to broadcast against ``like`` ``[N, ...]``."""
    return mask.reshape(mask.shape + (1,) * (like.dim() - 1))


#: Directions of :func:`ancestor_doubling`: each token pulls from its 2^r-th ancestor (path scans) or pushes
#: to it (subtree scans, the transpose).
PATH, SUBTREE = "path", "subtree"


def _combine(B: Tensor, A: Optional[Tensor], anc: Tensor, direction: str) -> Tensor:
    """One round's combine along the current ancestor links ``anc`` (-1: none), ``A = None`` meaning 1:

    - PATH: ``B[k] += A[k] * B[anc[k]]`` (a gather from each token's ancestor);
    - SUBTREE: ``B[anc[d]] += A[d] * B[d]`` (a scatter-add from each token to its ancestor: the transpose).

    Out of place; reads the round's old ``B`` only."""
    has = anc >= 0
    if direction == PATH:
        got = B[anc.clamp(min=0)]
        return torch.where(broadcast_rows(has, B), (got if A is None else A * got) + B, B)
    src = has.nonzero().squeeze(1)
    return B.index_add(0, anc[src], B[src] if A is None else A[src] * B[src])


def ancestor_doubling(values: Tensor, parent: Tensor, A: Optional[Tensor] = None, direction: str = PATH) -> Tensor:
    """Pointer doubling of the affine maps ``h -> A[k] * h + values[k]`` along the tree paths (dim 0; ``A =
    None`` means 1, plain sums), ``ceil(log2(depth))`` rounds of :func:`_combine` with ``A[k] *= A[anc[k]]``
    and ``anc[k] = anc[anc[k]]`` after each, starting from ``anc = parent``:

    - PATH: ``out[k] = sum over the ancestors-or-self j of k of P(k, j) * values[j]``, ``P(k, j)`` the product
      of A over the path from k up to j, j excluded — the recurrence ``h[k] = A[k] * h[parent[k]] +
      values[k]`` (the path sum when A is None). Invariant after round r: ``out[k]`` holds the terms of the
      2^r nearest ancestors-or-self of k and ``A[k] = P(k, anc[k])``; a round composes k's map with its
      ancestor's, ``(A, B)∘(A', B') = (A * A', A * B' + B)``.
    - SUBTREE (the transpose): ``out[j] = sum over the descendants-or-self d of j of P(d, j) * values[d]``.
      Invariant after round r: ``out[j]`` holds the descendants of j at distance < 2^r; the descendants at
      distance [2^r, 2^(r+1)) lie below exactly one d at distance 2^r (``P(e, j) = P(e, d) P(d, j)``), so
      each d pushes ``A[d] * out[d]`` to its 2^r-th ancestor once.

    Each term is formed once: the sequential recurrence up to reassociation."""
    out = values.clone()
    anc = parent
    while bool((anc >= 0).any()):
        out = _combine(out, A, anc, direction)
        if A is not None:
            A = torch.where(broadcast_rows(anc >= 0, A), A * A[anc.clamp(min=0)], A)
        anc = jump(anc, anc)
    return out


def path_sum(x: Tensor, parent: Tensor) -> Tensor:
    """``out[k] = sum over the ancestors-or-self j of k of x[j]`` along dim 0 (pointer jumping: after round
    r ``out[k]`` sums the 2^r nearest ancestors-or-self of k)."""
    return ancestor_doubling(x, parent, None, PATH)


def subtree_sum(g: Tensor, parent: Tensor) -> Tensor:
    """``out[j] = sum over the descendants-or-self k of j of g[k]`` along dim 0: the transpose of
    :func:`path_sum`."""
    return ancestor_doubling(g, parent, None, SUBTREE)


# ------------------------------------------------------------------------------------------- helpers


def chain_parent(length: int, device=None) -> Tensor:
    """The parent array of one row as a chain: ``[-1, 0, 1, ..., L-2]``."""
    return torch.arange(-1, length - 1, device=device)

def prefix_rows(cache: Tensor, ids: Tensor, dim: int) -> Tensor:
    """``cache`` gathered along ``dim`` at the prefix-local ``ids`` (zeros where ``ids == -1``); the cached scans
    here and in backends/scan/matrix.py read a chunk root's prefix state with it."""
    if cache.shape[dim] == 0:  # no prefix token (every id is -1): a chain streamed alone, a window call's own tree
        shape = list(cache.shape)
        shape[dim] = ids.shape[0]
        return cache.new_zeros(shape)
    got = cache.index_select(dim, ids.clamp(min=0))
    keep = ids.ge(0).view([-1 if d == dim else 1 for d in range(got.dim())])
    return torch.where(keep, got, torch.zeros((), dtype=got.dtype, device=got.device))

