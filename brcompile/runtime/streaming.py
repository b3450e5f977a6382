"""Streaming replay at run time (docs/ARCHITECTURE.md §7): prefix once, tails in chunks, one ``loss.backward()``.

The packed tree is cut in two (:func:`plan_replay`):

- the **prefix**: every segment that has children (a shared chain: a prompt, a shared response prefix,
  at any depth). It is closed under ancestors, so it is a forest of its own, in the same DFS order;
- the **tails**: the leaf segments (a chain that ends in a leaf — one rollout's own suffix). A leaf
  segment's ancestors are all prefix tokens, so a chunk of leaf segments needs, besides its own tokens,
  only the prefix's K/V and scan values ("everything above the chunk is cached"); ``Chunk.ancestors``
  says where along each chunk token's path the prefix starts (for the scans).

:class:`ReplayFunction` is one autograd node around the token-local part of the packed graph (the
"trunk", split off by :mod:`brcompile.passes.emit.split`):

forward
    run the prefix graph once with grad (its activations are the only ones kept; it also returns every
    attention's K/V and every tree scan's prefix values: the cached replay nodes), then each tail chunk under ``no_grad`` against the
    detached cache, writing the chunk's outputs into the full [.., N, ..] outputs.
backward
    re-run each chunk with grad against the cache (leaves), pull the chunk's share of the upstream
    gradient through it (``torch.autograd.grad``), accumulate its parameter gradients and its dK/dV of
    the cache; then one backward through the prefix with (its own output gradients, the summed cache
    gradients). Parameter gradients are returned as this node's input gradients, so they accumulate in
    ``.grad`` exactly as in the dense run, and ``torch.autograd.grad`` works too.

Peak activation memory: the prefix's activations + one chunk's, independent of the group size.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from brcompile.runtime.tree import TokenArrays
from brcompile.runtime.window import WindowFunction, active_window, current_call

if TYPE_CHECKING:
    from brcompile.runtime.tree import PackedTree

log = logging.getLogger(__name__)

__all__ = ["Chunk", "ReplayFunction", "ReplaySchedule", "ReplayTrunk", "StreamingRuntime", "plan_replay"]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One chunk of tail tokens: packed ids ``ids`` (sorted) and its own tree arrays (local ids)."""

    ids: Tensor  # [n] int64 packed ids of the chunk's tokens
    end: Tensor  # [n] local subtree ends (a chunk is a set of leaf chains)
    segments: Tensor  # [s, 3] local (start, stop, subtree_end)
    cross: Tensor  # [C, 4] (q_start, q_stop, k_start, k_stop): chunk queries x prefix keys
    ancestors: Tensor  # [R, n] prefix-local id of each token's i-th ancestor (row i-1) when it is a prefix token, else -1

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[0])


@dataclasses.dataclass(frozen=True)
class ReplaySchedule:
    """The prefix/tail cut of one tree and the chunk schedule."""

    prefix_ids: Tensor  # [P] packed ids of the prefix tokens (sorted)
    prefix_end: Tensor  # [P] prefix-local subtree ends
    prefix_segments: Tensor  # [Sp, 3] prefix-local segments
    chunks: tuple[Chunk, ...]
    n_tokens: int  # N

    @property
    def prefix_tokens(self) -> int:
        return int(self.prefix_ids.shape[0])

    def summary(self) -> dict:
        """Sizes for explain() and logs."""
        sizes = [c.tokens for c in self.chunks]
        return {"tokens": self.n_tokens, "prefix_tokens": self.prefix_tokens,
                "prefix_segments": int(self.prefix_segments.shape[0]), "chunks": len(sizes),
                "chunk_tokens": sizes, "largest_chunk": max(sizes, default=0),
                "cross_calls": sum(int(c.cross.shape[0]) for c in self.chunks)}


def count_before(mask: Tensor) -> Tensor:
    """c[i] = number of True in mask[:i], for i in 0..len(mask)."""
    c = torch.zeros(mask.shape[0] + 1, dtype=torch.int64, device=mask.device)
    c[1:] = mask.long().cumsum(0)
    return c


def plan_replay(end: Tensor, segments: Tensor, chunk_tokens: int, depth: int = 0) -> ReplaySchedule:
    """Cut a packed tree into prefix + chunks of leaf segments of at most ``chunk_tokens`` tokens each
    (a leaf segment longer than that is a chunk of its own). ``depth``: how many ancestors along its path
    each chunk token's tree scans read (``Chunk.ancestors``; 0 without scans).

    A segment (s0, s1, e) is a leaf chain iff s1 == e. Prefix = all other segments; in prefix-local ids a
    token's subtree end is the number of prefix tokens before its end. For a chunk with sorted packed ids
    ``ids`` and a prefix segment (s0, s1, e), the chunk's queries below it are the contiguous local
    range [searchsorted(ids, s1), searchsorted(ids, e)) and they see its keys [cnt(s0), cnt(s1)).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    end, segments = end.cpu(), segments.cpu()
    n = int(end.shape[0])
    s0, s1, e = segments[:, 0], segments[:, 1], segments[:, 2]
    leaf = s1 == e
    seg_len = s1 - s0
    in_prefix = torch.repeat_interleave(~leaf, seg_len, output_size=n)
    before = count_before(in_prefix)
    prefix_ids = in_prefix.nonzero().flatten()
    psegs = segments[~leaf]
    prefix_segments = torch.stack([before[psegs[:, 0]], before[psegs[:, 1]], before[psegs[:, 2]]], 1)
    prefix_end = before[end[prefix_ids]]

    anc = _prefix_ancestors(end, in_prefix, before, depth)
    leaves = segments[leaf]
    chunks = []
    sizes = (leaves[:, 1] - leaves[:, 0]).tolist()
    start = 0
    while start < len(sizes):
        stop, total = start + 1, sizes[start]
        while stop < len(sizes) and total + sizes[stop] <= chunk_tokens:
            total += sizes[stop]
            stop += 1
        chunks.append(_chunk(leaves[start:stop], psegs, before, anc))
        start = stop
    return ReplaySchedule(prefix_ids, prefix_end, prefix_segments, tuple(chunks), n)


def _prefix_ancestors(end: Tensor, in_prefix: Tensor, before: Tensor, depth: int) -> Tensor:
    """``[depth, N]``: row i-1 holds the prefix-local id of ``anc_i(k)``, the i-th ancestor of k along its
    path, when that is a prefix token, else -1 (past a root, or an ancestor in k's own leaf segment). A
    leaf segment's ancestors outside it are prefix tokens, so a chunk token reads along its path first
    tokens of its own chunk (the chunk's local tree), then cached prefix tokens (these ids)."""
    from brcompile.backends.scan.paths import parent_from_end, path_ancestors

    if depth == 0:
        return end.new_empty(0, end.shape[0], dtype=torch.int64)
    anc = path_ancestors(parent_from_end(end), depth + 1)[1:]
    hit = anc >= 0
    hit[hit.clone()] = in_prefix[anc[hit]]
    return torch.where(hit, before[anc.clamp(min=0)], -1)


def _chunk(leaves: Tensor, psegs: Tensor, before: Tensor, anc: Tensor) -> Chunk:
    """The chunk made of leaf segments ``leaves`` [s, 3] (packed ids), with its cross rows and its tokens'
    prefix ancestors (columns ``ids`` of ``anc``, :func:`_prefix_ancestors`)."""
    lens = leaves[:, 1] - leaves[:, 0]
    total = int(lens.sum())
    stops = lens.cumsum(0)
    starts = stops - lens
    ids = torch.repeat_interleave(leaves[:, 0] - starts, lens, output_size=total) + torch.arange(total)
    end = torch.repeat_interleave(stops, lens, output_size=total)
    segments = torch.stack([starts, stops, stops], 1)
    q0 = torch.searchsorted(ids, psegs[:, 1].contiguous())
    q1 = torch.searchsorted(ids, psegs[:, 2].contiguous())
    hit = q1 > q0
    cross = torch.stack([q0[hit], q1[hit], before[psegs[hit, 0]], before[psegs[hit, 1]]], 1)
    return Chunk(ids, end, segments, cross, anc[:, ids])


@dataclasses.dataclass(frozen=True)
class TrunkGraphs:
    """The two compiled halves of a trunk (see brcompile.passes.emit.split.ReplaySplit)."""

    prefix: Callable  # (*ext, rep_row, position, end, valid, all_valid, segments) -> (*frontier, *kv)
    tail: Callable  # (*ext, rep_row, position, end, valid, all_valid, segments, *cache, cache_valid,
    #                 cache_all_valid, cross, cache_position, cache_ancestors) -> (*frontier)
    frontier_dims: tuple[int, ...]  # the token dim of each frontier output
    n_cached: int  # number of cached tensors (2 per attention: K and V; 1 per tree scan; 1 per cached position)
    scan_depth: int = 0  # ancestors a tail token's scans read along its path (Chunk.ancestors' rows)
    #: the tail that also returns its own tokens' cached values (runtime/window/); None: no cross-call window
    tail_cache: Optional[Callable] = None
    #: graphs with one key compute the same trunk (their code), so a window's calls of either share one store
    #: (Dynamo recompiles a graph on a guard, e.g. DDP's no_sync flag, into a copy with another trunk object)
    window_key: Optional[str] = None
    #: the model checkpointed its layers (their bodies are inlined into these graphs): a prefix, or a window's
    #: piece, run with grad keeps only its inputs and outputs and recomputes its activations in backward
    recompute: bool = False
    bytes_per_token: int = 0  # trunk activation bytes per packed token (passes/emit/split.py)
    #: the packed-token dim of each of the ``n_cached`` cached tensors (a window keeps them per token along it)
    cache_dims: tuple[int, ...] = ()

    def run_kept(self, graph: Callable, *args, recompute: bool = False) -> tuple:
        """``graph(*args)`` with grad, its activations kept for backward, or with :attr:`recompute` (or
        ``recompute``) under non-reentrant activation checkpointing (recomputed in backward under the forward's
        autocast and RNG state, as the model's own checkpoints would: the same values, so the same gradients)."""
        if (recompute or self.recompute) and torch.is_grad_enabled():
            return tuple(torch.utils.checkpoint.checkpoint(graph, *args, use_reentrant=False))
        return tuple(graph(*args))


def _leaf(x):
    """A detached stand-in for an input: a leaf that requires grad iff the input did."""
    if isinstance(x, Tensor):
        return x.detach().requires_grad_(x.requires_grad)
    return x


def _take(x: Tensor, ids: Tensor) -> Tensor:
    """x[ids] along dim 0 for per-token arrays."""
    return x.index_select(0, ids.to(x.device))


class ReplayFunction(torch.autograd.Function):
    """The trunk of a packed graph run as prefix + streamed tail chunks (module docstring)."""

    @staticmethod
    def forward(ctx, graphs: TrunkGraphs, schedule: ReplaySchedule, need_grad: bool, n_ext: int, *inputs):
        ext, tree = inputs[:n_ext], TokenArrays(*inputs[n_ext:])
        rep_row, position, valid = tree.rep_row, tree.position, tree.valid
        dev = position.device
        leaves = [_leaf(x) for x in ext]
        pid = schedule.prefix_ids.to(dev)
        pre_valid, pre_position = _take(valid, pid), _take(position, pid)
        with torch.set_grad_enabled(need_grad):
            pre = graphs.run_kept(graphs.prefix, *leaves, *TokenArrays(
                rep_row=_take(rep_row, pid), position=pre_position, end=schedule.prefix_end.to(dev),
                valid=pre_valid, all_valid=torch.ones_like(pre_valid), segments=schedule.prefix_segments.to(dev)))
        nf = len(graphs.frontier_dims)
        pre_front, cache = tuple(pre[:nf]), tuple(pre[nf:])
        outs = [_full(t, d, schedule.n_tokens) for t, d in zip(pre_front, graphs.frontier_dims)]
        for o, t, d in zip(outs, pre_front, graphs.frontier_dims):
            o.index_copy_(d, pid, t.detach())
        detached_cache = [c.detach() for c in cache]
        with torch.no_grad():
            for chunk in schedule.chunks:
                part = _run_tail(graphs, leaves, chunk, rep_row, position, valid, detached_cache, pre_valid,
                                 pre_position)
                for o, t, d in zip(outs, part, graphs.frontier_dims):
                    o.index_copy_(d, chunk.ids.to(dev), t)
        ctx.graphs, ctx.schedule, ctx.n_ext = graphs, schedule, n_ext
        ctx.autocast = _autocast_state(dev)
        ctx.leaves, ctx.pre_front, ctx.cache = leaves, pre_front, cache
        ctx.tree = (rep_row, position, valid, pre_valid, pre_position)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.leaves is None:
            raise RuntimeError("branch_replay streaming: this graph was already backpropagated through and its "
                               "prefix graph freed; a second backward (retain_graph=True) needs mode='packed'")
        graphs, schedule, leaves = ctx.graphs, ctx.schedule, ctx.leaves
        rep_row, position, valid, pre_valid, pre_position = ctx.tree
        dev = position.device
        wrt = [i for i, x in enumerate(leaves) if isinstance(x, Tensor) and x.requires_grad]
        acc: list[Optional[Tensor]] = [None] * len(leaves)
        cache_grads = [torch.zeros_like(c) for c in ctx.cache]
        cwrt = [j for j, c in enumerate(ctx.cache) if c.requires_grad]
        dims = graphs.frontier_dims
        for chunk in schedule.chunks:
            ids = chunk.ids.to(dev)
            g_out = [None if g is None else g.index_select(d, ids) for g, d in zip(grads, dims)]
            if all(g is None for g in g_out):
                continue
            cache = [c.detach().requires_grad_(c.requires_grad) for c in ctx.cache]  # integer caches: no grad
            with torch.enable_grad(), _autocast_as(ctx.autocast):  # the forward's autocast, as checkpointing
                part = _run_tail(graphs, leaves, chunk, rep_row, position, valid, cache, pre_valid, pre_position)
                used = [(t, g) for t, g in zip(part, g_out) if g is not None and t.requires_grad]
                got = torch.autograd.grad([t for t, _ in used], [leaves[i] for i in wrt] + [cache[j] for j in cwrt],
                                          [g for _, g in used], allow_unused=True) if used else ()
            for i, g in zip(wrt, got[:len(wrt)]):
                _accumulate(acc, i, g)
            for j, g in zip(cwrt, got[len(wrt):]):
                if g is not None:
                    cache_grads[j].add_(g)
        pid = schedule.prefix_ids.to(dev)
        outs, gouts = [], []
        for t, g, d in zip(ctx.pre_front, grads, dims):
            if g is not None and t.requires_grad:
                outs.append(t)
                gouts.append(g.index_select(d, pid))
        for c, g in zip(ctx.cache, cache_grads):
            if c.requires_grad:
                outs.append(c)
                gouts.append(g)
        if outs and wrt:
            got = torch.autograd.grad(outs, [leaves[i] for i in wrt], gouts, allow_unused=True)
            for i, g in zip(wrt, got):
                _accumulate(acc, i, g)
        ctx.leaves = ctx.pre_front = ctx.cache = None  # free the prefix graph
        return (None, None, None, None, *acc, None, None, None, None, None, None)


def _autocast_state(device: torch.device) -> tuple:
    """(device type, enabled, dtype) of autocast for CPU and ``device``'s type: a chunk re-run in backward
    must compute what its forward computed (the backward usually runs outside the autocast region)."""
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                 for d in dict.fromkeys(("cpu", device.type)))


def _autocast_as(state: tuple) -> contextlib.ExitStack:
    """A context that restores the autocast ``state`` (only the device types that differ now)."""
    stack = contextlib.ExitStack()
    for d, enabled, dtype in state:
        if (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) != (enabled, dtype):
            stack.enter_context(torch.autocast(d, dtype=dtype, enabled=enabled))
    return stack


def _accumulate(acc: list, i: int, g: Optional[Tensor]) -> None:
    if g is not None:
        acc[i] = g if acc[i] is None else acc[i] + g


def _full(like: Tensor, dim: int, n: int) -> Tensor:
    """An uninitialised tensor like ``like`` with size ``n`` along ``dim`` (every row is written)."""
    shape = list(like.shape)
    shape[dim] = n
    return like.new_empty(shape)


def _run_tail(graphs: TrunkGraphs, ext: Sequence, chunk: Chunk, rep_row: Tensor, position: Tensor,
              valid: Tensor, cache: Sequence[Tensor], pre_valid: Tensor, pre_position: Tensor) -> tuple:
    """The tail graph on one chunk against the cache (``pre_*``: the prefix tokens' validity, positions)."""
    dev = position.device
    ids = chunk.ids.to(dev)
    v = _take(valid, ids)
    tree = TokenArrays(rep_row=_take(rep_row, ids), position=_take(position, ids), end=chunk.end.to(dev),
                       valid=v, all_valid=torch.ones_like(v), segments=chunk.segments.to(dev))
    out = graphs.tail(*ext, *tree, *cache, pre_valid, torch.ones_like(pre_valid), chunk.cross.to(dev),
                      pre_position, chunk.ancestors.to(dev))
    return tuple(out)


class ReplayTrunk(torch.nn.Module):
    """The outer graph's call into the trunk: plans the schedule for the tree and applies
    :class:`ReplayFunction`. ``last_schedule`` is kept for explain()."""

    def __init__(self, graphs: TrunkGraphs, n_ext: int, chunk_tokens: int):
        super().__init__()
        self.graphs = graphs
        self.n_ext = n_ext
        self.chunk_tokens = chunk_tokens
        self.last_schedule: Optional[ReplaySchedule] = None

    @torch._dynamo.disable
    def forward(self, *args):
        store = self.window_store(args)
        if store is not None:
            return WindowFunction.apply(self.graphs, store, current_call()[1:], self.n_ext, *args)
        tree = TokenArrays(*args[self.n_ext:])
        schedule = plan_replay(tree.end, tree.segments, self.chunk_tokens, self.graphs.scan_depth)
        self.last_schedule = schedule
        log.debug("branch_replay streaming: %s", schedule.summary())
        need_grad = torch.is_grad_enabled() and any(isinstance(x, Tensor) and x.requires_grad
                                                    for x in args[:self.n_ext])
        return ReplayFunction.apply(self.graphs, schedule, need_grad, self.n_ext, *args)

    def window_store(self, args: Sequence) -> Optional[Any]:
        """This call's store in the open cross-call window (runtime/window/), as the packed runtime counted the
        call into it, or None to stream it alone: no window, or an input that needs a gradient but is not a leaf
        (a window returns the deferred gradients to the parameters it was built on)."""
        call = current_call()
        if call is None or call[0] is None:
            return None
        if not call[0].grad:  # a no-grad call: forward only, nothing returned to the inputs
            return call[0]
        wanted = [x for x in args[:self.n_ext] if isinstance(x, Tensor) and x.requires_grad]
        if not wanted or any(x.grad_fn is not None for x in wanted):
            return None
        return call[0]


@dataclasses.dataclass
class StreamingRuntime:
    """What a rewritten graph needs to run in streaming mode (brcompile/runtime/streaming.py)."""

    mode: str  # "replay" or "auto"
    memory_budget: Optional[int]
    bytes_per_token: int  # trunk activation bytes per packed token (passes/emit/split.py)
    outer: Callable  # the packed graph with its trunk replaced by ``trunk``
    trunk: Any  # brcompile.runtime.streaming.ReplayTrunk
    #: the graph inputs (besides the per-token ones) the trunk reads: a window shares between calls that agree
    #: on them (brcompile/backend.py ``_window_inputs``)
    window_inputs: tuple[int, ...] = ()
    window_refusal: Optional[str] = None  # why the trunk shares within each call only (None: it shares across)

    def enter_window(self, args: Sequence) -> Optional[Any]:
        """The open cross-call window's store for this call (counting it), if the trunk can share across calls
        (runtime/window/); else None."""
        w = active_window()
        if w is None or self.window_refusal is not None or self.trunk.graphs.tail_cache is None:
            return None
        return w.enter_call(self.trunk, torch.is_grad_enabled(), [args[i] for i in self.window_inputs])

    def choose(self, tree: PackedTree) -> Optional[str]:
        """None to stream this batch, or why the packed mode runs instead."""
        seg = tree.segments
        leaf = seg[:, 1] == seg[:, 2]
        if bool(leaf.all()):
            return "no shared prefix to cache"
        if self.mode == "auto":
            need = self.bytes_per_token * tree.stats.executed_tokens
            if need <= self.memory_budget:
                return f"packed activations ~{need / 2**20:.1f} MiB fit memory_budget"
        return None
