"""Context parallelism over the tree (docs/ARCHITECTURE.md §7.2): one batch's packed tokens split across the ranks of
a process group, each rank running the token-local part of the graph (the streaming trunk) on its own tokens only.

**The cut.** Every rank builds the same tree from the same batch. The packed axis, in depth-first order, is cut into
R contiguous pieces (:func:`cut_tokens`), balanced by work: a token costs ``alpha`` (its token-local FLOPs, in units of
one attention pair's) plus its depth (the keys it attends). Rank r holds tokens ``[o_r, o_{r+1})``.

**Attention across ranks.** A query's keys are its ancestors, which in depth-first order all come before it: on the
same rank, or an earlier one. Rank r runs each attention as the streaming tail's cached attention: its own tokens as
the chunk (:func:`shard`: their subtree ends and segments cut at the piece), and ``cross`` rows
``(0, min(e, o_{r+1}) - o_r, a0, min(a1, o_r))`` for each ancestor segment ``(a0, a1, e)`` of the piece's first token
that starts before it: every piece query below such a segment sees all of its keys before the piece. Those keys
(:func:`needed_keys`) are all the cache holds: per layer one all-to-all (``brcompile::exchange_tokens``,
:func:`exchange`) brings each rank the K and V of exactly them from the ranks that hold them (a long shared prompt
reaches every rank below it; a tail stays where it is), and its backward sends dK/dV back to the owners.

**The loss side.** The frontier (what the outer graph reads per token) is gathered whole on every rank, so the outer
graph (the dense reads, the loss) runs replicated and returns the same loss everywhere.

**Gradients: partial sums** (the contract: ``all_reduce(SUM)`` over the group gives the single-process gradient).
Every output of a graph run under context parallelism passes :func:`count_once`: its gradient flows on rank 0 and is
zero elsewhere, so the replicated outer graph's gradient is counted once over the group. The frontier's gather
reduce-scatters its gradient and the K/V exchange sends its gradient back and sums it at each owner, so each rank's
trunk sees its tokens' whole gradient and gives its parameters its tokens' share.

**Activations: held by rank 0.** A split graph's gradient of an input is a partial sum too. For a leaf (a parameter,
FSDP2's unsharded parameters included: ``nn.Parameter`` leaves) that is the contract. For an activation that needs
a gradient (a value computed before this graph: an earlier graph's output, e.g. the hidden states between FSDP2
units, which Dynamo compiles as one graph each) it is not: whoever computed it (an earlier graph's
:func:`count_once`, eager code using a parameter) reads only rank 0's gradient, the group's sum. So every call
looks, from outside, like the graph run whole with its gradient counted once: an activation input's gradient is the
whole gradient on rank 0 and zero elsewhere (:class:`_SumOnRankZero`: one reduce to rank 0 in the backward, of the
input's size), a parameter's a partial sum. By induction over the graphs, whatever feeds a graph output's gradient
is whole on rank 0 (replicated eager code downstream, other graphs' activation gradients held by rank 0), so each
graph's :func:`count_once` reads a complete gradient and the group's sum of every parameter's gradient is the
single-process gradient, for any composition of graphs, eager code, DDP or FSDP2 (which sums, not averages, over
the CP ranks: ``set_gradient_divide_factor``), but for a parameter that eager code uses after the graphs: that code
runs replicated, and the parameter's gradient is whole on every rank (the group's sum counts it R times). The reduce
pays where the graph attends (a block: its hidden states' gradient against its attention's); a graph with no
attention (a loss over logits: a [B, L, V] gradient against its log-softmax) runs whole instead, as does a graph
that writes the activation in place.

Composition with FSDP2 (examples/context_parallel.py ``--fsdp2``): ``fully_shard`` over a mesh dimension spanning
dp x cp (torchtitan's ``dp_shard_cp``), CP over its ``cp`` dimension, ``set_gradient_divide_factor(dp)`` on every
``FSDPModule`` (SUM over CP, mean over dp).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from brcompile.backends.gather_tokens.op import gather_tokens
from brcompile.runtime.tree import TokenArrays

log = logging.getLogger(__name__)

__all__ = ["ContextParallel", "ContextParallelTrunk", "Exchange", "Shard", "count_once", "cut_tokens", "exchange",
           "group_name", "needed_keys", "shard"]


def group_name(group: Any) -> str:
    """The process group's name for ``context_parallel=group``: a ``ProcessGroup``, a 1-D ``DeviceMesh``, a
    ``(DeviceMesh, dim)`` pair (a mesh dimension, by index or name), or a group's name."""
    if isinstance(group, str):
        return group
    if isinstance(group, tuple) and len(group) == 2:
        mesh, dim = group
        return mesh.get_group(dim).group_name
    if hasattr(group, "get_group"):  # a DeviceMesh
        if group.ndim != 1:
            raise ValueError(f"context_parallel: a {group.ndim}-D DeviceMesh; pass (mesh, dim) for its CP dimension")
        return group.get_group().group_name
    if hasattr(group, "group_name"):
        return group.group_name
    raise TypeError(f"context_parallel must be a ProcessGroup, a DeviceMesh or (DeviceMesh, dim), got "
                    f"{type(group).__name__}")


def _group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def group_rank_size(name: str) -> tuple[int, int]:
    """(this process's rank in the group, the group's size)."""
    import torch.distributed as dist

    pg = _group(name)
    return dist.get_rank(pg), dist.get_world_size(pg)


# --------------------------------------------------------------------------------------------------------------
# the cut and one rank's piece


def cumulative_work(end: Tensor, alpha: float) -> Tensor:
    """``W[k]`` (float64, CPU): the work of tokens ``0..k``, a token's being ``alpha + depth`` (depth: its
    ancestors-or-self, the keys it attends; ``alpha``: its token-local FLOPs over one attention pair's)."""
    from brcompile.backends.scan.paths import tree_depth

    return torch.cumsum(tree_depth(end.cpu()).to(torch.float64) + float(alpha), 0)


def cut_tokens(end: Tensor, ranks: int, alpha: float, total: Optional[Tensor] = None) -> Tensor:
    """``offsets`` [ranks + 1] (int64, CPU): the packed axis cut into contiguous pieces of equal work, each at least
    one token (``N >= ranks``): piece r ends at the r-th R-quantile of :func:`cumulative_work` (``total``, when the
    caller has it). Deterministic: every rank computes the same cut."""
    n = int(end.shape[0])
    if n < ranks:
        raise ValueError(f"context parallelism: {n} packed tokens for {ranks} ranks")
    total = cumulative_work(end, alpha) if total is None else total
    goals = total[-1] * torch.arange(1, ranks, dtype=torch.float64) / ranks
    inner = torch.searchsorted(total, goals) + 1  # the first token past each goal
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), inner, torch.tensor([n])])
    for r in range(1, ranks):  # every piece nonempty: o_r in [o_{r-1} + 1, n - (ranks - r)]
        offsets[r] = min(max(int(offsets[r]), int(offsets[r - 1]) + 1), n - (ranks - r))
    return offsets


@dataclasses.dataclass(frozen=True)
class Shard:
    """Rank ``rank``'s piece ``[start, stop)`` of the packed axis and its arrays (local ids: token ``start`` is 0)."""

    rank: int
    start: int
    stop: int
    end: Tensor  # [n] local subtree ends, cut at the piece: min(end, stop) - start
    segments: Tensor  # [s, 3] the segments meeting the piece, cut to it
    cross: Tensor  # [C, 4] (q_start, q_stop, k_start, k_stop): piece queries x keys before the piece
    sizes: Tensor  # [R] int64 tokens per rank (CPU)

    @property
    def tokens(self) -> int:
        return self.stop - self.start


def shard(end: Tensor, segments: Tensor, offsets: Tensor, rank: int) -> Shard:
    """Rank ``rank``'s :class:`Shard` of the tree (``end`` [N], ``segments`` [S, 3]) cut at ``offsets``.

    A segment ``(a0, a1, e)`` is a chain whose every token's subtree ends at ``e``. Cut to ``[s, t)`` it is
    ``(max(a0, s), min(a1, t), min(e, t)) - s``, and a segment with ``a0 < s < e`` is an ancestor chain of token
    ``s``: its keys ``[a0, min(a1, s))`` lie before the piece and every piece query in ``[s, min(e, t))`` sees all of
    them (``k < s <= q < e``): one cross row."""
    end, segments, offsets = end.cpu(), segments.cpu(), offsets.cpu()
    s, t = int(offsets[rank]), int(offsets[rank + 1])
    a0, a1, e = segments[:, 0], segments[:, 1], segments[:, 2]
    meets = (a1 > s) & (a0 < t)
    local = torch.stack([a0[meets].clamp(min=s), a1[meets].clamp(max=t), e[meets].clamp(max=t)], 1) - s
    above = (a0 < s) & (e > s)
    cross = torch.stack([torch.zeros_like(a0[above]), e[above].clamp(max=t) - s, a0[above], a1[above].clamp(max=s)], 1)
    cross = cross[cross[:, 3] > cross[:, 2]]
    return Shard(rank, s, t, end[s:t].clamp(max=t) - s, local.contiguous(), cross.contiguous(),
                 offsets[1:] - offsets[:-1])


@dataclasses.dataclass(frozen=True)
class Exchange:
    """What one rank receives and sends so that its queries see the earlier tokens they attend, and no others."""

    keys: Tensor  # [m] the global ids of the earlier tokens its queries see (its cross rows' keys), ascending
    cross: Tensor  # [C, 4] its cross rows with key ranges into ``keys`` ([0, m))
    send_index: Tensor  # [sum(send_sizes)] local ids of its tokens other ranks need, rank by rank
    send_sizes: Tensor  # [R] int64: tokens sent to each rank
    recv_sizes: Tensor  # [R] int64: tokens received from each rank (their keys among ``keys``, in rank order)


def needed_keys(sh: Shard) -> Tensor:
    """The earlier tokens piece ``sh``'s queries see, ascending: its cross rows' key ranges (disjoint: each row is
    one ancestor segment's)."""
    rows = sh.cross[sh.cross[:, 2].argsort()].tolist()
    if not rows:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(k0, k1) for _, _, k0, k1 in rows])


def exchange(shards: Sequence[Shard], rank: int) -> Exchange:
    """Rank ``rank``'s :class:`Exchange`, from every rank's shard (each rank computes them all, alike): it receives
    from rank q its needed keys in q's piece, and sends rank r the keys r needs in its own piece (local ids). The
    pieces are contiguous and in rank order, so what arrives rank by rank is ``keys`` in order."""
    keys = [needed_keys(sh) for sh in shards]
    me = shards[rank]
    mine = keys[rank]
    recv = torch.tensor([int(((mine >= sh.start) & (mine < sh.stop)).sum()) for sh in shards], dtype=torch.int64)
    send = [k[(k >= me.start) & (k < me.stop)] - me.start for k in keys]
    cross = me.cross.clone()
    if cross.numel():
        k0 = torch.searchsorted(mine, cross[:, 2].contiguous())
        cross[:, 3] = k0 + cross[:, 3] - cross[:, 2]
        cross[:, 2] = k0
    return Exchange(mine, cross, torch.cat(send) if send else torch.zeros(0, dtype=torch.int64),
                    torch.tensor([len(x) for x in send], dtype=torch.int64), recv)


# --------------------------------------------------------------------------------------------------------------
# the gradient counted once over the group


class _CountOnce(torch.autograd.Function):
    """Identity forward; backward passes the gradient on rank 0 of the group and zeros elsewhere (the same
    structure on every rank, so the ranks' backward passes run the same collectives)."""

    @staticmethod
    def forward(ctx, rank: int, x: Tensor):
        ctx.rank = rank
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return None, grad if ctx.rank == 0 else torch.zeros_like(grad)


class _SumOnRankZero(torch.autograd.Function):
    """Identity forward; backward: the group's sum of the gradient on rank 0, zeros elsewhere (one reduce). An
    activation input of a split graph: its gradient, partial on every rank, whole where its producer reads it."""

    @staticmethod
    def forward(ctx, group: str, x: Tensor):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        pg = _group(ctx.group)
        total = grad.clone(memory_format=torch.contiguous_format)
        dist.reduce(total, dst=dist.get_global_rank(pg, 0), group=pg)
        return None, total if dist.get_rank(pg) == 0 else torch.zeros_like(grad)


def _activation(x: Any) -> bool:
    """A value computed before the graph that needs a gradient (not a leaf)."""
    return isinstance(x, Tensor) and x.requires_grad and x.grad_fn is not None


def count_once(out: Any, group: str) -> Any:
    """``out`` (a tensor, or a tuple / list of them) with every floating tensor that needs a gradient passed through
    :class:`_CountOnce`: a value every rank computes whole gets its gradient summed over the group once."""
    rank, _ = group_rank_size(group)

    def one(x):
        if isinstance(x, Tensor) and x.requires_grad and torch.is_grad_enabled():
            return _CountOnce.apply(rank, x)
        return x

    if isinstance(out, (tuple, list)):
        return type(out)(one(x) for x in out)
    return one(out)


# --------------------------------------------------------------------------------------------------------------
# the trunk on one rank's piece


@dataclasses.dataclass
class LastCut:
    """This rank's view of its last call, for explain(): the cut (offsets, each piece's work), the K/V bytes it
    received (the earlier tokens its queries see, every attention's K and V) against what an all-gather of the other
    pieces would move, and its cross rows."""

    rank: int
    tokens: int  # this rank's packed tokens
    offsets: list
    work: list
    kv_bytes_received: int
    kv_bytes_all_gather: int
    cross_rows: int

    def summary(self) -> dict:
        return dataclasses.asdict(self)


class ContextParallelTrunk(torch.nn.Module):
    """The outer graph's call into the trunk under context parallelism: this rank's piece through the context-parallel
    trunk graph (its attentions receive the K/V of the earlier tokens they see), then the frontier gathered whole."""

    def __init__(self, graph, n_ext: int, frontier_dims: Sequence[int], group: str, alpha: float,
                 kv_bytes_per_token: int, recompute: bool = False):
        super().__init__()
        # (*ext, *local token arrays, cache_valid, cache_all_valid, cross, cache_position, *Exchange's send/recv)
        self.graph = graph
        self.n_ext = n_ext
        self.frontier_dims = tuple(frontier_dims)
        self.group = group
        self.alpha = alpha
        self.kv_bytes_per_token = kv_bytes_per_token  # K and V of every attention, per token
        self.recompute = recompute
        self.last: Optional[LastCut] = None

    @torch._dynamo.disable
    def forward(self, *args):
        ext, tree = args[:self.n_ext], TokenArrays(*args[self.n_ext:])
        rank, ranks = group_rank_size(self.group)
        work = cumulative_work(tree.end, self.alpha)
        offsets = cut_tokens(tree.end, ranks, self.alpha, work)
        shards = [shard(tree.end, tree.segments, offsets, r) for r in range(ranks)]
        sh, ex = shards[rank], exchange(shards, rank)
        dev = tree.end.device
        keys = ex.keys.to(dev)
        s, t = sh.start, sh.stop
        valid = tree.valid[s:t]
        local = TokenArrays(rep_row=tree.rep_row[s:t], position=tree.position[s:t], end=sh.end.to(dev), valid=valid,
                            all_valid=torch.ones_like(valid), segments=sh.segments.to(dev))
        cache_valid = tree.valid.index_select(0, keys)
        inputs = (*ext, *local, cache_valid, torch.ones_like(cache_valid), ex.cross.to(dev),
                  tree.position.index_select(0, keys), ex.send_index, ex.send_sizes, ex.recv_sizes)
        if (self.recompute and torch.is_grad_enabled()
                and any(isinstance(x, Tensor) and x.requires_grad for x in ext)):
            part = torch.utils.checkpoint.checkpoint(self.graph, *inputs, use_reentrant=False)
        else:
            part = self.graph(*inputs)
        at = [float(work[int(o) - 1]) if int(o) else 0.0 for o in offsets]
        self.last = LastCut(rank, t - s, [int(o) for o in offsets], [at[i + 1] - at[i] for i in range(ranks)],
                            int(keys.shape[0]) * self.kv_bytes_per_token,
                            (ranks - 1) * int(sh.sizes.max()) * self.kv_bytes_per_token, int(sh.cross.shape[0]))
        log.debug("context parallel rank %d/%d: tokens [%d, %d) of %d, %d cross rows", rank, ranks, s, t,
                  int(tree.end.shape[0]), int(sh.cross.shape[0]))
        outs, done = [], None
        for o, d in zip(part, self.frontier_dims):
            full, done = gather_tokens(o, tree.valid, sh.sizes, d, self.group, done)
            outs.append(full)
        return tuple(outs)


@dataclasses.dataclass
class ContextParallel:
    """What a rewritten graph needs to run under ``context_parallel`` (module docstring)."""

    group: str  # the process group's name
    outer: Optional[Any]  # the packed graph with its trunk replaced by ``trunk`` (None: refused, ``refusal`` says why)
    trunk: Optional[ContextParallelTrunk]
    refusal: Optional[str] = None  # why every call runs its graph whole on every rank (counted once)

    def why_whole(self, args: Sequence[Any], n_tokens: int, written: Sequence[int] = ()) -> Optional[str]:
        """None to split this call's tokens over the group, else why it runs whole on every rank (``written``: the
        inputs the graph writes in place)."""
        if self.outer is None:
            return self.refusal
        _, ranks = group_rank_size(self.group)
        if n_tokens < ranks:
            return f"{n_tokens} packed tokens for {ranks} ranks"
        if torch.is_grad_enabled():
            acts = [i for i, x in enumerate(args) if _activation(x)]
            if acts and not self.trunk.kv_bytes_per_token:
                return (f"input {acts[0]} is an activation that needs a gradient (a value computed before this graph) "
                        f"and the graph has no attention: reducing its gradient to rank 0 would cost more than "
                        f"running it whole")
            act = next((i for i in acts if i in written), None)
            if act is not None:
                return (f"input {act} is an activation that needs a gradient (a value computed before this graph) "
                        f"and the graph writes it in place")
        return None

    def inputs(self, args: Sequence[Any]) -> tuple:
        """A split call's inputs: each activation that needs a gradient through :class:`_SumOnRankZero`."""
        if not torch.is_grad_enabled():
            return tuple(args)
        return tuple(_SumOnRankZero.apply(self.group, x) if _activation(x) else x for x in args)


class WholeOnEveryRank:
    """A graph's callable (the original graph, routed pairs) run whole on every rank of a context-parallel group,
    its gradient counted once (:func:`count_once`); each call is counted with ``reason``."""

    def __init__(self, runtime: Any, group: str, reason: str):
        self.runtime = runtime
        self.group = group
        self.reason = reason

    def __call__(self, *args):
        from brcompile.runtime.stats import record_whole_call

        record_whole_call(self.reason)
        return count_once(self.runtime(*args), self.group)
