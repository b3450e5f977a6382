"""Data-parallel GRPO with ``branch_replay``: DDP and FSDP2 on CPU (gloo), prompt groups whole per rank.

Each rank gets whole prompt groups from :class:`brcompile.data.GroupBatchSampler` (a group split over
ranks would compute its prompt once per rank), pads them with :func:`brcompile.data.collate_rollouts`, and
runs one on-policy GRPO step (old log-probs = the current ones, detached: the ratio is 1 and its gradient
is the policy gradient, as in TRL with one iteration per generation); the loss is the mean over the rank's
rows (``examples/grpo.py``).

DDP and FSDP2 average gradients over ranks; every rank holds the same number of rows (equal group sizes,
the same number of groups per rank), so the averaged gradient equals the gradient of the single-process
GRPO loss over the union of the ranks' rows (``brcompile/data.py``). The modes:

- ``ddp`` / ``fsdp2`` (recommended): the policy and its loss in one module, :class:`GRPOObjective`, which
  is wrapped (``DistributedDataParallel(objective)`` / ``fully_shard(objective)``) and compiled
  (``torch.compile(wrapped, backend="branch_replay")``). Dynamo captures the inner module's whole forward,
  model and loss, as one graph: it replays, with the lazy gather of the next-token log-probs.
- ``ddp_model``: ``DistributedDataParallel(model)`` and the loss *function* compiled. Dynamo does not
  trace DDP's forward, so the function splits there: the model's forward replays (its logits come out
  dense, [B, L, V]) and the loss after it is a graph without attention, which runs unchanged (recorded
  as a fallback; exact). FSDP2 hooks split a compiled loss function the same way.
- ``fsdp2_blocks``: ``fully_shard`` on every block and on the objective (the usual FSDP recipe). Dynamo
  breaks the graph at every FSDP unit: each block's graph sees hidden states [B, L, D] (its tree keys,
  hashed once and reused by provenance in the next block) and the [B, 1, L, L] mask the model built
  before the blocks (read off the tensor: causal & key padding); every block replays. The graphs around
  the blocks (embedding, final norm and loss) hold no attention and run unchanged.
- ``ddp_window``: ``ddp`` with gradient accumulation over micro-batches of one row (the rank's rows shuffled),
  ``no_sync()`` on every micro-batch but the last, inside ``brcompile.window(calls=rows)`` (``mode="replay"``):
  each prompt runs once per rank across its micro-batches, and the shared part's backward runs inside the last
  micro-batch's backward, where DDP synchronises the gradients.

Run: ``python examples/ddp.py [--modes ddp fsdp2] [--world-size 2]`` (spawns its own processes, loopback
only, free port picked by the OS), or ``torchrun --standalone --nproc-per-node 2 examples/ddp.py``.
It compares each mode's gradients and updated parameters with the single-process eager run; exit 1 on FAIL.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from brcompile.data import GroupBatchSampler, collate_rollouts  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from examples.grpo import grpo_loss, make_grpo_batch  # noqa: E402

log = logging.getLogger(__name__)

__all__ = ["MODES", "GRPOObjective", "RolloutSpec", "make_model", "make_rollout_rows", "policy_logprobs",
           "grpo_step_loss", "rank_batch", "run_rank", "launch", "reference_step", "compare", "main"]

MODES = ("ddp", "fsdp2", "ddp_model", "fsdp2_blocks", "ddp_window")
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


class RolloutSpec:
    """Sizes of the synthetic rollout data and model (small defaults: the tests run this on 2 CPU cores)."""

    def __init__(self, num_prompts: int = 4, group_size: int = 3, prompt_len=(5, 11), response_len=(2, 6),
                 shared_response_prefix: int = 0, vocab_size: int = 61, dim: int = 32, n_layers: int = 2,
                 dtype: torch.dtype = torch.float64, lr: float = 0.1, seed: int = 1):
        self.num_prompts, self.group_size = num_prompts, group_size
        self.prompt_len, self.response_len = prompt_len, response_len
        self.shared_response_prefix = shared_response_prefix
        self.vocab_size, self.dim, self.n_layers = vocab_size, dim, n_layers
        self.dtype, self.lr, self.seed = dtype, lr, seed


def make_model(spec: RolloutSpec) -> GPT:
    """The policy: the example GPT at ``spec``'s size and dtype, seeded (the same weights on every rank)."""
    cfg = GPTConfig(vocab_size=spec.vocab_size, dim=spec.dim, n_layers=spec.n_layers, n_heads=4, n_kv_heads=2,
                    hidden_dim=48)
    return GPT(cfg, seed=0).to(spec.dtype)


def make_rollout_rows(spec: RolloutSpec) -> tuple[list[dict], torch.Tensor]:
    """Rollout rows ``{"prompt_ids", "completion_ids", "advantages"}`` and their group ids, from a synthetic
    GRPO batch (``examples.grpo.make_grpo_batch``): what a generation phase hands to the trainer."""
    b = make_grpo_batch(num_prompts=spec.num_prompts, group_size=spec.group_size, prompt_len=spec.prompt_len,
                        response_len=spec.response_len, shared_response_prefix=spec.shared_response_prefix,
                        vocab_size=spec.vocab_size, seed=spec.seed, dtype=spec.dtype)
    rows = []
    for ids, am, cm, adv in zip(b["input_ids"], b["attention_mask"], b["completion_mask"], b["advantages"]):
        prompt = ids[(am == 1) & (cm == 0)]
        rows.append({"prompt_ids": prompt, "completion_ids": ids[cm == 1], "advantages": adv})
    group_ids = torch.arange(spec.num_prompts).repeat_interleave(spec.group_size)
    return rows, group_ids


def policy_logprobs(model, input_ids, attention_mask):
    """``log softmax(logits[:, t])[input_ids[:, t + 1]]``: [B, L-1]."""
    logits = model(input_ids, attention_mask)
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def grpo_step_loss(model, batch: dict, logprobs_fn=policy_logprobs, loss_fn=grpo_loss):
    """One GRPO loss on ``batch``: on-policy old log-probs under no_grad, then the clipped surrogate."""
    with torch.no_grad():
        old = logprobs_fn(model, batch["input_ids"], batch["attention_mask"])
    return loss_fn(model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"],
                   batch["advantages"], old)


class GRPOObjective(torch.nn.Module):
    """The policy and its on-policy GRPO loss as one module, so that DDP / FSDP2 wrap, and Dynamo captures,
    the whole objective as one graph.

    ``forward(input_ids, attention_mask, completion_mask, advantages) -> loss``: ``examples.grpo.grpo_loss``
    with ``old_logprobs`` = the current log-probs detached (ratio 1; the gradient is the policy gradient).
    """

    def __init__(self, policy: torch.nn.Module, clip_eps: float = 0.2):
        super().__init__()
        self.policy = policy
        self.clip_eps = clip_eps

    def forward(self, input_ids, attention_mask, completion_mask, advantages):
        logp = policy_logprobs(self.policy, input_ids, attention_mask)
        ratio = torch.exp(logp - logp.detach())
        adv = advantages[:, None]
        surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - self.clip_eps, 1 + self.clip_eps) * adv)
        mask = completion_mask[:, 1:].to(surrogate.dtype)
        per_sequence = (surrogate * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
        return -per_sequence.mean()


def rank_batch(rows: Sequence[dict], group_ids: torch.Tensor, groups_per_rank: int, world_size: int, rank: int,
               step: int = 0) -> dict:
    """Rank ``rank``'s batch of step ``step``: whole groups from :class:`GroupBatchSampler` (no shuffling),
    padded by :func:`collate_rollouts`."""
    sampler = GroupBatchSampler(group_ids, groups_per_rank, num_replicas=world_size, rank=rank, shuffle=False)
    loader = torch.utils.data.DataLoader(rows, batch_sampler=sampler, collate_fn=collate_rollouts)
    for i, batch in enumerate(loader):
        if i == step:
            return batch
    raise IndexError(f"step {step} >= {len(sampler)} steps")


def _wrap(model: GPT, mode: str) -> torch.nn.Module:
    """The distributed wrapper of ``mode`` (module docstring): around :class:`GRPOObjective` (``ddp``,
    ``fsdp2``, ``fsdp2_blocks``) or around the bare model (``ddp_model``)."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if mode == "ddp_model":
        return DistributedDataParallel(model)
    objective = GRPOObjective(model)
    if mode in ("ddp", "ddp_window"):
        return DistributedDataParallel(objective)
    if mode == "fsdp2_blocks":
        for layer in model.layers:
            fully_shard(layer)
    elif mode != "fsdp2":
        raise ValueError(f"mode={mode!r}; choose one of {MODES}")
    return fully_shard(objective)


def accumulate_in_window(ddp, compiled, batch: dict) -> torch.Tensor:
    """Gradient accumulation over micro-batches of one row (shuffled) in one cross-call window: ``no_sync`` but
    for the last, each micro-batch's loss / N backpropagated at once; returns the rank's loss (their sum)."""
    import contextlib

    import brcompile

    order = torch.randperm(batch["input_ids"].shape[0], generator=torch.Generator().manual_seed(0)).tolist()
    total = 0.0
    with brcompile.window(calls=len(order)):
        for i, row in enumerate(order):
            mb = {k: v[row:row + 1] for k, v in batch.items()}
            sync = contextlib.nullcontext() if i == len(order) - 1 else ddp.no_sync()
            with sync:
                loss = compiled(mb["input_ids"], mb["attention_mask"], mb["completion_mask"], mb["advantages"])
                (loss / len(order)).backward()
            total = total + loss.detach() / len(order)
    return total


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2's sharded parameter or gradient) gathered to a full tensor; plain tensors as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run_rank(rank: int, world_size: int, modes: Sequence[str], spec: RolloutSpec, out_path: Optional[str],
             compiler: str = "aot_eager") -> dict:
    """One rank's work (``torch.distributed`` already initialised): for each mode, a fresh model, wrapped;
    one on-policy GRPO step through ``torch.compile(..., backend=branch_replay)``; gradients and SGD-updated parameters
    gathered to full tensors. Rank 0 saves ``{mode: {"loss", "grads", "params", "stats", "records"}}`` to
    ``out_path`` (``stats``/``records``: one entry per rank) and returns it."""
    import brcompile

    rows, group_ids = make_rollout_rows(spec)
    groups_per_rank = spec.num_prompts // world_size
    batch = rank_batch(rows, group_ids, groups_per_rank, world_size, rank)
    results = {}
    for mode in modes:
        torch._dynamo.reset()
        brcompile.reset_stats()
        model = make_model(spec)
        wrapped = _wrap(model, mode)
        backend = brcompile.backend(compiler=compiler, mode="replay" if mode == "ddp_window" else "packed")
        if mode == "ddp_window":
            loss = accumulate_in_window(wrapped, torch.compile(wrapped, backend=backend, dynamic=True), batch)
        elif mode == "ddp_model":
            loss = grpo_step_loss(wrapped, batch, torch.compile(policy_logprobs, backend=backend),
                                  torch.compile(grpo_loss, backend=backend))
        else:
            loss = torch.compile(wrapped, backend=backend)(
                batch["input_ids"], batch["attention_mask"], batch["completion_mask"], batch["advantages"])
        if mode != "ddp_window":
            loss.backward()
        grads = {n: _full(p.grad).detach().clone() for n, p in model.named_parameters()}
        torch.optim.SGD(model.parameters(), lr=spec.lr).step()
        params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        per_rank: list = [None] * world_size
        dist.all_gather_object(per_rank, {
            "stats": brcompile.stats().to_dict(),
            "records": [(r.rewritten, r.reason) for r in backend.records],
            "rows": int(batch["input_ids"].shape[0]),
        })
        results[mode] = {"loss": (mean_loss / world_size).item(), "grads": grads, "params": params,
                         "stats": [p["stats"] for p in per_rank], "records": [p["records"] for p in per_rank],
                         "rows": [p["rows"] for p in per_rank]}
        log.info("rank %d %s: loss %.6g, %s", rank, mode, loss.item(), brcompile.stats())
        del wrapped, model
    if rank == 0 and out_path:
        torch.save(results, out_path)
    return results


def _worker(rank: int, world_size: int, port: int, modes, spec, out_path, compiler) -> None:
    """Entry point of a spawned process: joins the process group through the parent's TCPStore."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's own connections stay on the loopback device
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        run_rank(rank, world_size, modes, spec, out_path, compiler)
    finally:
        dist.destroy_process_group()


def launch(modes: Sequence[str] = MODES, world_size: int = 2, spec: Optional[RolloutSpec] = None,
           compiler: str = "aot_eager") -> dict:
    """Spawns ``world_size`` processes (gloo, loopback) running :func:`run_rank`; returns rank 0's results.

    The parent hosts the rendezvous TCPStore on 127.0.0.1 with port 0, so the OS picks a free port and no
    port is ever guessed."""
    spec = spec or RolloutSpec()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rank0.pt")
        mp.start_processes(_worker, args=(world_size, store.port, tuple(modes), spec, out_path, compiler),
                           nprocs=world_size, join=True, start_method="spawn")
        return torch.load(out_path, weights_only=False)


def reference_step(spec: RolloutSpec, world_size: int = 2) -> dict:
    """The single-process dense eager run over the union of the ranks' rows: ``{"loss", "grads", "params"}``."""
    rows, group_ids = make_rollout_rows(spec)
    groups_per_rank = spec.num_prompts // world_size
    parts = []
    for r in range(world_size):
        sampler = GroupBatchSampler(group_ids, groups_per_rank, num_replicas=world_size, rank=r, shuffle=False)
        parts += next(iter(sampler))
    model = make_model(spec)
    loss = grpo_step_loss(model, collate_rollouts([rows[i] for i in parts]))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=spec.lr).step()
    return {"loss": loss.item(), "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def compare(result: dict, reference: dict) -> float:
    """The largest relative error of every gradient and every updated parameter, and of the loss measured
    against ``max(|loss|, 1)`` (the on-policy GRPO loss is -mean(advantages) = 0 up to rounding, so its own
    size is no scale)."""
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()  # noqa: E731
    errs = [abs(result["loss"] - reference["loss"]) / max(abs(reference["loss"]), 1.0)]
    for key in ("grads", "params"):
        errs += [rel(result[key][n], reference[key][n]) for n in reference[key]]
    return max(errs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4, help="prompt groups in the global batch")
    p.add_argument("--group-size", type=int, default=3)
    p.add_argument("--compiler", choices=["inductor", "aot_eager", "eager"], default="aot_eager")
    a = p.parse_args(argv)
    spec = RolloutSpec(num_prompts=a.prompts, group_size=a.group_size)

    if "RANK" in os.environ:  # under torchrun: this process is one rank
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo")
        try:
            results = run_rank(dist.get_rank(), dist.get_world_size(), a.modes, spec, None, a.compiler)
            if dist.get_rank() != 0:
                return 0
            world_size = dist.get_world_size()
        finally:
            dist.destroy_process_group()
    else:
        world_size = a.world_size
        results = launch(a.modes, world_size, spec, a.compiler)

    ref = reference_step(spec, world_size)
    failed = False
    for mode, res in results.items():
        err = compare(res, ref)
        ok = err <= TOL[spec.dtype]
        failed |= not ok
        replayed = [s["replayed_calls"] for s in res["stats"]]
        print(f"{mode:13s} loss {res['loss']:.12g} (single process {ref['loss']:.12g})  max rel err {err:.2e} "
              f"{'PASS' if ok else 'FAIL'}  rows per rank {res['rows']}  replayed calls per rank {replayed}")
        reasons = {r for recs in res["records"] for rewritten, r in recs if not rewritten}
        for r in sorted(reasons):
            print(f"{'':13s} fallback graph: {r}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
