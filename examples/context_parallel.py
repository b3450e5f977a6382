"""Context parallelism with ``branch_replay``: one GRPO batch's packed tokens split over the ranks of a group (gloo on
CPU), exact against the single-process run.

Every rank calls the compiled loss with the same batch and ``brcompile.backend(context_parallel=group)``; each runs
the token-local part of the model on its own contiguous piece of the packed tokens (depth-first order), gathering
the K/V before its piece per layer. The loss is the same on every rank; each rank's gradients are partial sums, and
``all_reduce(SUM)`` gives the single-process gradient (docs/ARCHITECTURE.md §7.2)::

    compiled = torch.compile(loss_fn, backend=brcompile.backend(context_parallel=dist.group.WORLD))
    loss = compiled(model, **batch)
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)          # or FSDP2 over a mesh whose shard dimension spans the group (below)

**With FSDP2** (``--fsdp2 model|blocks [--dp D]``): CP over one dimension of a ``(dp, cp)`` mesh, FSDP2 sharding
over the flattened ``dp x cp`` dimension (torchtitan's ``dp_shard_cp``), gradients summed over the CP ranks::

    mesh = init_device_mesh("cuda", (dp, cp), mesh_dim_names=("dp", "cp"))
    fully_shard(model, mesh=mesh["dp", "cp"]._flatten("dp_cp")); model.set_gradient_divide_factor(dp)
    compiled = torch.compile(loss_fn, backend=brcompile.backend(context_parallel=(mesh, "cp")))

The ranks of a CP group call with the same batch, each dp rank with its own (the same number of rows: the
gradient is the mean over dp of the batches' gradients, the sum over cp of the ranks' partial sums). Call
``set_gradient_divide_factor(dp)`` on every ``fully_shard``-ed module (it sets that module's own parameters only;
FSDP2's default divides by dp x cp), on gloo also ``set_force_sum_reduction_for_comms(True)`` (gloo has no
PREMUL_SUM, which FSDP2 uses for the factor in float32 / bfloat16). FSDP2's unsharded parameters are leaves, so
``fully_shard(model)`` with the loss function compiled around it splits the model's graph; ``fully_shard`` per
block splits each block's graph too (Dynamo breaks the graph at every unit), at the cost of one reduce of the
block's input gradient ([tokens, dim]) to rank 0 per block in the backward. A graph without attention that reads an
activation (the loss over the logits after ``fully_shard(model)``, the final norm and loss after the blocks) runs
whole on every rank, its gradient counted once. Exact either way (float64 against the single-process run, gloo on
CPU: tests/runtime/test_context_parallel_fsdp.py).

Run: ``python examples/context_parallel.py [--world-size 2] [--model gpt|qwen2|llama]`` (spawns its own processes,
loopback only), ``... --fsdp2 blocks --dp 2 --world-size 4`` (FSDP2 over dp=2 x cp=2), or
``torchrun --standalone --nproc-per-node 2 examples/context_parallel.py``. It prints each rank's
tokens and the largest relative error of the loss and every gradient against the single-process eager run; exit 1
on FAIL.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
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

import brcompile  # noqa: E402
from examples.grpo import grpo_loss, make_grpo_batch  # noqa: E402

__all__ = ["Case", "compare", "launch", "main", "make_model", "reference", "run_rank"]

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
#: a collective left waiting (a rank that died, or ranks out of step) raises after this, not torch's 30 minutes
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)


@dataclasses.dataclass(frozen=True)
class Case:
    """One batch and model (small defaults: the tests run this on 2 CPU cores)."""

    model: str = "gpt"  # gpt (examples/gpt.py), qwen2, llama (HF from a small config)
    num_prompts: int = 2
    group_size: int = 3
    prompt_len: tuple = (9, 15)
    response_len: tuple = (2, 6)
    shared_response_prefix: int = 0
    left_pad_prompts: bool = False
    dtype: torch.dtype = torch.float64
    compiler: str = "aot_eager"
    seed: int = 0
    explain: bool = False  # also return this rank's brcompile.explain() report of the call (its text)
    device: str = "cpu"  # "cuda": rank r on GPU r over NCCL (gloo on the CPU)
    #: FSDP2 (module docstring): "off"; "model": ``fully_shard(model)``, the loss function compiled around it;
    #: "blocks": ``fully_shard`` on every block and on the model (Dynamo breaks the graph at every unit)
    fsdp2: str = "off"
    dp: int = 1  # with fsdp2: data-parallel ranks (each its own batch); the world is dp x (the CP group's size)


def make_model(case: Case) -> torch.nn.Module:
    """The case's model, the same weights in every process (seeded)."""
    from examples.gpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)
    if case.model == "gpt":
        torch.manual_seed(1234)
        return GPT(config).to(case.dtype).to(_device(case))
    return HFLogits(case.model, config, case.dtype).to(_device(case))


#: a hybrid (Mamba-2 layers, then attention): its scans refuse the split, and the graph runs whole on every rank
HYBRID = {"bamba": dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                        mamba_chunk_size=8)}


class HFLogits(torch.nn.Module):
    """A random HF ``Qwen2ForCausalLM`` / ``LlamaForCausalLM`` of ``config``'s sizes, called as ``model(ids, mask)``
    -> logits. Its RMSNorm computes in the input's dtype (HF's casts through float32 would bound a float64 run's
    agreement by float32's rounding)."""

    def __init__(self, family: str, config, dtype: torch.dtype):
        super().__init__()
        import transformers

        cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig,
               "bamba": transformers.BambaConfig}[family]
        extra = HYBRID.get(family, {})
        hf_config = cls(vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.hidden_dim,
                        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
                        num_key_value_heads=config.n_kv_heads, max_position_embeddings=256, pad_token_id=0,
                        bos_token_id=None, eos_token_id=None, attn_implementation="sdpa", use_cache=False, **extra)
        torch.manual_seed(1234)
        self.model = transformers.AutoModelForCausalLM.from_config(hf_config).to(dtype)
        for m in self.model.modules():
            if type(m).__name__.endswith("RMSNorm"):
                m.forward = _rmsnorm_in_input_dtype.__get__(m)

    def forward(self, input_ids, attention_mask=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


def _rmsnorm_in_input_dtype(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _device(case: Case) -> torch.device:
    return torch.device(f"cuda:{torch.cuda.current_device()}") if case.device == "cuda" else torch.device("cpu")


def make_batch(case: Case, dp_rank: int = 0) -> dict:
    """The case's GRPO batch of data-parallel rank ``dp_rank`` (its own seed), on its device."""
    return make_grpo_batch(num_prompts=case.num_prompts, group_size=case.group_size, prompt_len=case.prompt_len,
                           response_len=case.response_len, shared_response_prefix=case.shared_response_prefix,
                           vocab_size=64, left_pad_prompts=case.left_pad_prompts, seed=case.seed + dp_rank,
                           dtype=case.dtype, device=_device(case))


def reference(case: Case) -> dict:
    """The single-process eager run: ``{"loss", "grads"}``; with ``dp`` data-parallel ranks, of the mean of their
    batches' losses (every batch has the same rows, so the GRPO loss of the union of the batches)."""
    model = make_model(case)
    loss = sum(grpo_loss(model, **make_batch(case, d)) for d in range(case.dp)) / case.dp
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad.detach().cpu() for n, p in model.named_parameters()}}


def shard_model(model: torch.nn.Module, case: Case, mesh) -> None:
    """FSDP2 over the flattened ``dp x cp`` dimension of ``mesh`` (torchtitan's ``dp_shard_cp``): ``fully_shard`` on
    every block (``case.fsdp2 == "blocks"``) and on the model, gradients reduced with SUM over the CP ranks and mean
    over the dp ranks (divide factor ``dp``: the CP ranks' gradients are partial sums, module docstring)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    shard_mesh = mesh["dp", "cp"]._flatten("dp_cp")
    if case.fsdp2 == "blocks":
        for m in list(model.modules()):
            if type(m).__name__ in ("Block", "Qwen2DecoderLayer", "LlamaDecoderLayer"):
                fully_shard(m, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(float(case.dp))
            if case.device == "cpu":  # gloo has no PREMUL_SUM (the divide factor in float32 / bfloat16)
                m.set_force_sum_reduction_for_comms(True)


def run_rank(case: Case, group=None) -> dict:
    """This rank's run: the compiled loss under ``context_parallel``, gradients all-reduced over the group; returns
    ``{"loss", "grads", "stats", "tokens"}``."""
    torch._dynamo.reset()  # each case compiles afresh (no shapes of an earlier case made dynamic)
    brcompile.reset_stats()
    model = make_model(case)
    dp_rank, dp_group = 0, None
    if case.fsdp2 != "off":  # a (dp, cp) mesh: CP over "cp", FSDP2 over the flattened dp x cp
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        mesh = init_device_mesh(_device(case).type, (case.dp, world // case.dp), mesh_dim_names=("dp", "cp"))
        group, dp_group, dp_rank = (mesh, "cp"), mesh.get_group("dp"), mesh.get_local_rank("dp")
        shard_model(model, case, mesh)
    group = group or dist.group.WORLD
    backend = brcompile.backend(context_parallel=group, compiler=case.compiler)
    compiled = torch.compile(grpo_loss, backend=backend)
    loss = compiled(model, **make_batch(case, dp_rank))
    loss.backward()
    if case.fsdp2 == "off":
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
    elif case.dp > 1:  # the loss reported: the mean over the dp ranks' batches
        loss = loss.detach() / case.dp
        dist.all_reduce(loss, group=dp_group)
    st = brcompile.stats()
    report = None
    if case.explain:  # one more forward, on every rank (its gathers are collectives)
        report = brcompile.explain(grpo_loss, model, **make_batch(case, dp_rank), measure=False,
                                   backend=brcompile.backend(context_parallel=group, compiler=case.compiler))
    return {"loss": loss.item(), "grads": {n: _full(p.grad).detach().cpu() for n, p in model.named_parameters()},
            "stats": st.to_dict(), "tokens": st.context_parallel_tokens,
            "explain": None if report is None else report.render_text(code=False)}


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2's sharded gradient) gathered whole; a plain tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def compare(result: dict, ref: dict) -> float:
    """The largest relative error of the loss (against ``max(|loss|, 1)``) and of every gradient."""
    errs = [abs(result["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1.0)]
    for n, g in ref["grads"].items():
        errs.append(((result["grads"][n] - g).abs().max() / g.abs().max().clamp_min(1e-300)).item())
    return max(errs)


def _worker(rank: int, world_size: int, port: int, cases: Sequence[Case], out_dir: str) -> None:
    """A spawned process: joins the group through the parent's TCPStore, runs :func:`run_rank` on each case, saves
    the results."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("BRCOMPILE_STRICT", "1")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    cuda = any(c.device == "cuda" for c in cases)
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT)
    try:
        torch.save([run_rank(case) for case in cases], os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def launch(cases: Sequence[Case], world_size: int = 2) -> list[list[dict]]:
    """Spawns ``world_size`` processes (gloo, loopback) running :func:`run_rank` on each case in turn; returns
    ``results[case][rank]``."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world_size, store.port, tuple(cases), tmp), nprocs=world_size, join=True,
                           start_method="spawn")
        per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
    return [[per_rank[r][c] for r in range(world_size)] for c in range(len(cases))]


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--model", choices=["gpt", "qwen2", "llama", "bamba"], default="gpt")
    p.add_argument("--compiler", choices=["inductor", "aot_eager", "eager"], default="aot_eager")
    p.add_argument("--fsdp2", choices=["off", "model", "blocks"], default="off",
                   help="FSDP2 over the flattened (dp, cp) mesh: fully_shard(model), or on every block and the model")
    p.add_argument("--dp", type=int, default=1, help="with --fsdp2: data-parallel ranks (world = dp x cp)")
    a = p.parse_args(argv)
    case = Case(model=a.model, compiler=a.compiler, fsdp2=a.fsdp2, dp=a.dp)
    if a.dp > 1 and (a.fsdp2 == "off" or a.world_size % a.dp):
        p.error("--dp needs --fsdp2 and a --world-size that dp divides")
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo")
        try:
            results = [run_rank(case)]  # this rank's only
            if dist.get_rank() != 0:
                return 0
        finally:
            dist.destroy_process_group()
    else:
        results = launch([case], a.world_size)[0]
    ref = reference(case)
    err = max(compare(r, ref) for r in results)
    ok = err <= TOL[case.dtype] and all(r["stats"]["context_parallel_calls"] >= 1 for r in results)
    fsdp = "" if a.fsdp2 == "off" else f", FSDP2 ({a.fsdp2}) over dp={a.dp} x cp={len(results) // a.dp}"
    print(f"context parallel, {a.model}{fsdp}, {len(results)} rank(s): split calls per rank "
          f"{[r['stats']['context_parallel_calls'] for r in results]}, tokens per rank "
          f"{[r['tokens'] for r in results]}, max rel err {err:.2e} {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
