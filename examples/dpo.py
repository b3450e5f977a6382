"""DPO with ``branch_replay``: the chosen and the rejected response of a pair share their prompt.

A DPO batch holds P pairs; TRL's layout concatenates the chosen rows and then the rejected rows, so row p
and row P + p start with the same prompt. ``branch_replay`` finds that sharing on its own (the row order
does not matter) and computes each prompt once for the policy and once for the frozen reference model.

    logp(y | x)  = sum_t m_t log pi(y_t | x, y_<t)                   (completion tokens only)
    h_p          = (logp_pol(y_c) - logp_ref(y_c)) - (logp_pol(y_r) - logp_ref(y_r))
    loss         = -mean_p log sigmoid(beta h_p)

The per-sequence log-probability function is compiled once and used for both models: the policy's call
runs with gradients, the reference's under ``torch.no_grad()`` (Dynamo compiles one graph per grad mode).

Run: ``python examples/dpo.py [--pairs 4 --prompt-len 24 --response-len 6 12 --dtype float64]``; it prints
the loss eager and compiled, the largest relative gradient error, and ``brcompile.stats()``; exit 1 on FAIL.
"""
from __future__ import annotations

import argparse
import copy
import logging
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.gpt import GPT, GPTConfig  # noqa: E402
from examples.grpo import make_grpo_batch  # noqa: E402

log = logging.getLogger(__name__)

__all__ = ["make_dpo_batch", "sequence_logprobs", "dpo_loss", "dpo_step", "make_reference", "main"]

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def make_dpo_batch(*, num_pairs: int = 4, prompt_len=(24, 40), response_len=(8, 16), shared_response_prefix: int = 0,
                   vocab_size: int = 256, pad_id: int = 0, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """A synthetic DPO batch in TRL's concatenated layout: rows ``[chosen_0 .. chosen_{P-1}, rejected_0 ..
    rejected_{P-1}]``, B = 2P, right-padded with ``pad_id``.

    Pair p is prompt_p + chosen_p and prompt_p + rejected_p (built as a GRPO group of size 2, see
    ``examples.grpo.make_grpo_batch`` for the length arguments). Returns ``input_ids``, ``attention_mask``
    and ``completion_mask``, each [2P, L] long.
    """
    g = make_grpo_batch(num_prompts=num_pairs, group_size=2, prompt_len=prompt_len, response_len=response_len,
                        shared_response_prefix=shared_response_prefix, vocab_size=vocab_size, pad_id=pad_id,
                        seed=seed, device=device)
    order = torch.cat([torch.arange(0, 2 * num_pairs, 2), torch.arange(1, 2 * num_pairs, 2)]).to(device)
    return {k: g[k][order] for k in ("input_ids", "attention_mask", "completion_mask")}


def sequence_logprobs(model, input_ids, attention_mask, completion_mask):
    """Per-row sum of the completion tokens' log-probabilities: ``sum_t m_{b,t} logp_{b,t}`` with
    ``logp_{b,t} = log softmax(logits_{b,t})[input_ids_{b,t+1}]`` and ``m = completion_mask[:, 1:]``. [B]."""
    logits = model(input_ids, attention_mask)
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return (logp * completion_mask[:, 1:].to(logp.dtype)).sum(-1)


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta: float = 0.1):
    """The sigmoid DPO loss ``-mean log sigmoid(beta ((pc - rc) - (pr - rr)))`` over pairs (module docstring)."""
    logits = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    return -F.logsigmoid(beta * logits).mean()


def dpo_step(policy, reference, batch: dict, logps_fn: Callable = sequence_logprobs, beta: float = 0.1):
    """The DPO loss of a batch in the concatenated layout; ``logps_fn`` is :func:`sequence_logprobs` or a
    compiled version of it. The reference runs under ``torch.no_grad()``."""
    args = (batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    P = args[0].shape[0] // 2
    policy_logps = logps_fn(policy, *args)
    with torch.no_grad():
        ref_logps = logps_fn(reference, *args)
    return dpo_loss(policy_logps[:P], policy_logps[P:], ref_logps[:P], ref_logps[P:], beta)


def make_reference(policy: torch.nn.Module, seed: int = 1, perturb: float = 0.01) -> torch.nn.Module:
    """A frozen reference model: a copy of the policy with small seeded perturbations (so the two differ,
    as after some training), ``requires_grad_(False)``, eval mode."""
    ref = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(perturb * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))
    return ref.requires_grad_(False).eval()


def _max_rel_grad_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """max over parameters of max|got - want| / max|want|."""
    errs = [((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item() for a, b in zip(got, want)]
    return max(errs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--prompt-len", type=int, nargs="+", default=[24, 40])
    p.add_argument("--response-len", type=int, nargs="+", default=[6, 12])
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float64")
    p.add_argument("--compiler", choices=["inductor", "aot_eager", "eager"], default="aot_eager",
                   help="how branch_replay runs the packed graph")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    import brcompile

    dtype = getattr(torch, a.dtype)
    span = lambda v: v[0] if len(v) == 1 else tuple(v[:2])  # noqa: E731
    policy = GPT(GPTConfig(vocab_size=256, dim=a.dim, n_layers=a.layers), seed=a.seed).to(dtype)
    reference = make_reference(policy, seed=a.seed + 1)
    batch = make_dpo_batch(num_pairs=a.pairs, prompt_len=span(a.prompt_len), response_len=span(a.response_len),
                           seed=a.seed)
    params = list(policy.parameters())

    ref_loss = dpo_step(policy, reference, batch, beta=a.beta)
    ref_grads = torch.autograd.grad(ref_loss, params)
    brcompile.reset_stats()
    compiled = torch.compile(sequence_logprobs, backend=brcompile.backend(compiler=a.compiler))
    loss = dpo_step(policy, reference, batch, compiled, beta=a.beta)
    grads = torch.autograd.grad(loss, params)

    loss_err = abs(loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-300)
    err = max(loss_err, _max_rel_grad_error(grads, ref_grads))
    ok = err <= TOL[dtype]
    print(f"DPO loss eager {ref_loss.item():.12g}  branch_replay {loss.item():.12g}")
    print(f"max relative error (loss, every policy grad): {err:.3e}  {'PASS' if ok else 'FAIL'} (tol {TOL[dtype]:.0e})")
    print(brcompile.stats())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
