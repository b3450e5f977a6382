"""Group-aware batching for ``branch_replay``: every prompt group stays whole inside one call.

``branch_replay`` shares the prefixes of the rows *of one call*. Rollouts of one prompt (a GRPO group, a
DPO chosen/rejected pair, the samples of a PPO prompt) that a sampler scatters over ranks or
micro-batches each recompute the prompt: results stay exact, the saving is gone. These helpers cut
along group boundaries instead:

- :func:`group_ids_by_prompt` numbers rows by their prompt (equal token sequences -> one group id);
- :func:`shard_groups` splits one rollout batch (say, the global batch after generation) into
  ``num_shards`` row sets made of whole groups, one per rank or per micro-batch;
- :class:`GroupBatchSampler` is a ``torch.utils.data`` batch sampler over a dataset of rollout rows:
  each step takes ``groups_per_rank * num_replicas`` whole groups and gives each rank
  ``groups_per_rank`` of them (``DataLoader(ds, batch_sampler=GroupBatchSampler(...))``);
- :func:`collate_rollouts` pads a list of rows ``{"prompt_ids", "completion_ids", ...}`` into the
  ``input_ids`` / ``attention_mask`` / ``completion_mask`` batch the example losses take.

Exact gradients under DDP / FSDP. Both average gradients over ranks. With a per-rank *mean* loss
(GRPO's mean over sequences, DPO's mean over pairs) the averaged gradient equals the gradient of the
single-process loss over the union of the ranks' rows iff every rank holds the same number of loss
units (rows, pairs):

    (1/R) sum_r (1/n_r) sum_{i in r} g_i  ==  (1/n) sum_i g_i   when n_r = n / R for every r.

``GroupBatchSampler`` gives every rank the same number of groups, so with equal group sizes (GRPO's
``num_generations``) the ranks hold equal row counts; ``shard_groups(..., equal=True)`` raises when the
groups cannot be split into equal row counts. With unequal shards, weight each rank's loss by
``n_r * R / n`` (or use a sum loss divided by the global count) to keep the gradient of the global mean.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor
from torch.utils.data import Sampler

log = logging.getLogger(__name__)

__all__ = ["GroupBatchSampler", "collate_rollouts", "group_ids_by_prompt", "group_rows", "shard_groups"]


def _as_group_tensor(group_ids) -> Tensor:
    """``group_ids`` (a sequence or 1-D tensor of ints) as a 1-D int64 CPU tensor; rejects other shapes."""
    ids = group_ids if isinstance(group_ids, Tensor) else torch.as_tensor(group_ids)
    if ids.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    if ids.dim() != 1:
        raise ValueError(f"group_ids must be 1-D (one id per row), got shape {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"group_ids must be integers, got {ids.dtype}")
    return ids.to(device="cpu", dtype=torch.int64)


def group_rows(group_ids) -> list[Tensor]:
    """The rows of each group, groups in order of first appearance, rows ascending within a group.

    ``group_ids``: one integer per row. Returns a list of 1-D int64 tensors of row indices.
    """
    ids = _as_group_tensor(group_ids)
    if ids.numel() == 0:
        return []
    uniq, inverse = torch.unique(ids, return_inverse=True)
    first = torch.full((len(uniq),), ids.numel(), dtype=torch.int64).scatter_reduce(
        0, inverse, torch.arange(ids.numel()), reduce="amin")
    order = torch.argsort(first)                            # groups by first appearance
    rows = torch.argsort(inverse, stable=True)              # rows grouped, ascending within a group
    counts = torch.bincount(inverse, minlength=len(uniq))
    per_group = list(torch.split(rows, counts.tolist()))
    return [per_group[g] for g in order.tolist()]


def group_ids_by_prompt(prompts: Sequence[Sequence[int]] | Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
    """One group id per row: rows with equal prompts get the same id (0, 1, ... by first appearance).

    ``prompts``: a list of token-id sequences, or a [B, P] tensor (then rows compare on the positions where
    ``attention_mask`` is nonzero, so left- or right-padding does not split a group).
    """
    if isinstance(prompts, Tensor):
        if prompts.dim() != 2:
            raise ValueError(f"prompt tensor must be [B, P], got shape {tuple(prompts.shape)}")
        if attention_mask is None:
            keys = [tuple(r) for r in prompts.tolist()]
        else:
            if attention_mask.shape != prompts.shape:
                raise ValueError(f"attention_mask {tuple(attention_mask.shape)} != prompts {tuple(prompts.shape)}")
            keys = [tuple(t for t, m in zip(r, mr) if m) for r, mr in zip(prompts.tolist(), attention_mask.tolist())]
    else:
        if attention_mask is not None:
            raise ValueError("attention_mask is only meaningful with a [B, P] prompt tensor")
        keys = [tuple(int(t) for t in p) for p in prompts]
    numbering: dict[tuple, int] = {}
    return torch.tensor([numbering.setdefault(k, len(numbering)) for k in keys], dtype=torch.int64)


def shard_groups(group_ids, num_shards: int, *, equal: bool = False) -> list[Tensor]:
    """Splits the rows of a batch into ``num_shards`` sets of whole groups, balanced by row count.

    Greedy longest-processing-time assignment: groups by decreasing size, each to the shard with the fewest
    rows so far (ties: lowest shard index), so no shard exceeds the ideal ``ceil(B / num_shards)`` by more
    than the largest group. Within a shard, rows are returned ascending (groups stay contiguous when the
    batch lists each group's rows together). Deterministic: every rank computes the same split.

    ``equal=True`` raises ``ValueError`` unless every shard gets exactly ``B / num_shards`` rows (what a
    per-rank mean loss needs for DDP's averaged gradient to equal the single-process one; module docstring).
    Raises ``ValueError`` when there are fewer groups than shards (a shard would be empty).
    """
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards} must be >= 1")
    groups = group_rows(group_ids)
    if len(groups) < num_shards:
        raise ValueError(f"{len(groups)} group(s) cannot fill {num_shards} shards with whole groups")
    sizes = [len(g) for g in groups]
    order = sorted(range(len(groups)), key=lambda g: (-sizes[g], g))
    load = [0] * num_shards
    assigned: list[list[Tensor]] = [[] for _ in range(num_shards)]
    for g in order:
        s = min(range(num_shards), key=lambda i: (load[i], i))
        load[s] += sizes[g]
        assigned[s].append(groups[g])
    if equal and len(set(load)) != 1:
        raise ValueError(f"groups of sizes {sizes} cannot be split into {num_shards} shards of equal row count "
                         f"(got {load}); use equal group sizes or weight each rank's loss by its row count")
    shards = [torch.sort(torch.cat(a)).values for a in assigned]
    log.debug("shard_groups: %d groups -> rows per shard %s", len(groups), load)
    return shards


class GroupBatchSampler(Sampler[list[int]]):
    """Batches of dataset indices made of whole groups, sharded over ranks by group.

    ``group_ids[i]`` is the group of dataset row i. Every epoch the groups are shuffled with
    ``torch.Generator().manual_seed(seed + epoch)`` (the same order on every rank), cut into steps of
    ``groups_per_rank * num_replicas`` groups, and rank r takes groups ``r, r + R, r + 2R, ...`` of each
    step. Every rank therefore yields the same number of batches, each of ``groups_per_rank`` whole groups
    (rows of a group listed together, in dataset order). A last incomplete step is dropped when
    ``drop_last``; otherwise its groups are dealt round-robin and ranks short of groups repeat groups from
    the start of the epoch's order (as ``DistributedSampler`` pads), so all ranks run the same number of steps.

    ``num_replicas``/``rank`` default to ``torch.distributed``'s world size and rank when it is initialised,
    else 1 and 0. Call :meth:`set_epoch` at the start of each epoch, as with ``DistributedSampler``.
    """

    def __init__(self, group_ids, groups_per_rank: int, *, num_replicas: Optional[int] = None,
                 rank: Optional[int] = None, shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        if groups_per_rank < 1:
            raise ValueError(f"groups_per_rank={groups_per_rank} must be >= 1")
        if num_replicas is None or rank is None:
            dist_ok = torch.distributed.is_available() and torch.distributed.is_initialized()
            if num_replicas is None:
                num_replicas = torch.distributed.get_world_size() if dist_ok else 1
            if rank is None:
                rank = torch.distributed.get_rank() if dist_ok else 0
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"need num_replicas >= 1 and 0 <= rank < num_replicas, got {num_replicas=}, {rank=}")
        self.groups = group_rows(group_ids)
        if not self.groups:
            raise ValueError("group_ids is empty: nothing to sample")
        self.groups_per_rank = groups_per_rank
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        step = groups_per_rank * num_replicas
        n = len(self.groups)
        self._steps = n // step if drop_last else math.ceil(n / step)
        if self._steps == 0:
            raise ValueError(f"{n} groups < one step of {groups_per_rank} groups x {num_replicas} ranks with drop_last")

    def set_epoch(self, epoch: int) -> None:
        """Reshuffles for ``epoch`` (same order on every rank)."""
        self.epoch = epoch

    def _group_order(self) -> list[int]:
        """The epoch's group order, padded by wrapping around to whole steps (when not ``drop_last``)."""
        n = len(self.groups)
        if self.shuffle:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        else:
            order = list(range(n))
        total = self._steps * self.groups_per_rank * self.num_replicas
        while len(order) < total:
            order += order[: total - len(order)]
        return order[:total]

    def __iter__(self) -> Iterator[list[int]]:
        order = self._group_order()
        step = self.groups_per_rank * self.num_replicas
        for s in range(self._steps):
            mine = order[s * step:(s + 1) * step][self.rank::self.num_replicas]
            yield torch.cat([self.groups[g] for g in mine]).tolist()

    def __len__(self) -> int:
        return self._steps


def _pad_right(seqs: Sequence[Tensor], length: int, value) -> Tensor:
    """Stacks 1-D tensors, each right-padded with ``value`` to ``length``."""
    out = torch.full((len(seqs), length), value, dtype=seqs[0].dtype if seqs else torch.int64)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


def collate_rollouts(rows: Sequence[Mapping[str, Any]], pad_id: int = 0,
                     pad_to_multiple_of: Optional[int] = None) -> dict[str, Tensor]:
    """Pads rollout rows into one right-padded batch.

    Each row holds ``prompt_ids`` and ``completion_ids`` (sequences of ints or 1-D tensors) and any other
    fields (scalars or equal-shape tensors, e.g. ``advantage``, ``group``), which are stacked.
    Row b of ``input_ids`` is ``prompt_b + completion_b`` followed by ``pad_id``; rows sharing a prompt
    share the prefix, which is what ``branch_replay`` needs to find. Returns ``input_ids`` [B, L] long,
    ``attention_mask`` [B, L] long (1 on prompt and completion tokens) and ``completion_mask`` [B, L]
    long (1 on completion tokens), plus the stacked fields. L is the longest row, rounded up to
    ``pad_to_multiple_of``.
    """
    if not rows:
        raise ValueError("collate_rollouts got no rows")
    for key in ("prompt_ids", "completion_ids"):
        missing = [i for i, r in enumerate(rows) if key not in r]
        if missing:
            raise KeyError(f"rows {missing[:5]} have no {key!r}")
    prompts = [torch.as_tensor(r["prompt_ids"], dtype=torch.int64).reshape(-1) for r in rows]
    completions = [torch.as_tensor(r["completion_ids"], dtype=torch.int64).reshape(-1) for r in rows]
    seqs = [torch.cat([p, c]) for p, c in zip(prompts, completions)]
    L = max(len(s) for s in seqs)
    if pad_to_multiple_of:
        L = -(-L // pad_to_multiple_of) * pad_to_multiple_of
    lengths = torch.tensor([len(s) for s in seqs])
    starts = torch.tensor([len(p) for p in prompts])
    col = torch.arange(L)[None, :]
    batch = {
        "input_ids": _pad_right(seqs, L, pad_id),
        "attention_mask": (col < lengths[:, None]).long(),
        "completion_mask": ((col >= starts[:, None]) & (col < lengths[:, None])).long(),
    }
    extra = [k for k in rows[0] if k not in ("prompt_ids", "completion_ids")]
    for key in extra:
        try:
            batch[key] = torch.stack([torch.as_tensor(r[key]) for r in rows])
        except (KeyError, RuntimeError, TypeError) as e:
            raise ValueError(f"field {key!r} cannot be stacked across rows: {e}") from e
    return batch
