"""PPO with an actor-critic through ``branch_replay``: one trunk, an LM head and a scalar value head.

The model is the example GPT's trunk with two heads on the final hidden state h_t: the LM head (the actor,
logits over the vocabulary) and a linear value head (the critic, V_t = w_v . h_t + b_v). Rollouts of a
prompt share its tokens, so both heads' work on the prompt is done once.

Per row b, the action at position t (t = 0 .. L-2) is token t + 1, chosen in state x_{<=t}; the action
mask m_t = completion_mask[t + 1]. The rollout phase (no gradients) records

    logp_old_t = log pi_old(x_{t+1} | x_{<=t}),   V_old_t,   r_t = reward at the row's last action, else 0
    delta_t    = r_t + gamma m_{t+1} V_old_{t+1} - V_old_t
    A_t        = delta_t + gamma lam m_{t+1} A_{t+1}                    (GAE, backwards over t)
    R_t        = A_t + V_old_t                                          (value targets)

and the loss, with masked means M[x] = sum_{b,t} m x / sum m over all actions of the batch, is

    ratio = exp(logp - logp_old)
    L_pi  = M[ max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps)) ]
    L_V   = 0.5 M[ max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2) ]
    L_H   = M[ H(pi(. | x_{<=t})) ]                                     (entropy)
    loss  = L_pi + c_v L_V - c_e L_H

(TRL's PPOTrainer and OpenRLHF compute the same quantities). The rollout's forward runs through the
compiled model under ``torch.no_grad()``, the loss through the compiled loss function: both replay.

Run: ``python examples/ppo.py [--prompts 2 --samples 4 --dtype float64]``; it prints the loss eager and
compiled, the largest relative gradient error, and ``brcompile.stats()``; exit 1 on FAIL.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
from torch import nn

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.gpt import GPT, GPTConfig  # noqa: E402
from examples.grpo import make_grpo_batch  # noqa: E402

log = logging.getLogger(__name__)

__all__ = ["ActorCritic", "rollout", "terminal_rewards", "gae", "ppo_loss", "ppo_args", "main"]

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


class ActorCritic(nn.Module):
    """The example GPT's trunk with an LM head and a scalar value head on the same final hidden state.

    ``forward(input_ids [B, L], attention_mask [B, L] | None) -> (logits [B, L, V], values [B, L])``.
    """

    def __init__(self, config: GPTConfig, seed: int = 0):
        super().__init__()
        self.lm = GPT(config, seed=seed)
        self.value_head = nn.Linear(config.dim, 1)
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            w = self.value_head.weight
            w.copy_(0.02 * torch.randn(w.shape, generator=g, dtype=torch.float64))
            self.value_head.bias.zero_()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        h = self.lm.hidden_states(input_ids, attention_mask)
        return self.lm.logits(h), self.value_head(h).squeeze(-1)


def _action_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits[:, t])[input_ids[:, t + 1]]`` for t = 0 .. L-2: [B, L-1]."""
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


@torch.no_grad()
def rollout(model, input_ids, attention_mask, completion_mask):
    """Rollout-time quantities, without gradients: ``(logp_old [B, L-1], values_old [B, L-1])``.

    ``model`` is the actor-critic or a compiled version of it."""
    logits, values = model(input_ids, attention_mask)
    return _action_logprobs(logits, input_ids), values[:, :-1]


def terminal_rewards(completion_mask: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """[B, L-1] rewards: ``scores[b]`` at row b's last action (its last completion token), 0 elsewhere."""
    m = completion_mask[:, 1:]
    T = m.shape[1]
    last = T - 1 - torch.flip(m, dims=[1]).argmax(dim=1)          # last index with m = 1
    r = torch.zeros(m.shape, dtype=scores.dtype, device=scores.device)
    has_action = m.any(dim=1)
    r[has_action, last[has_action]] = scores[has_action]
    return r


def gae(rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the action positions (module docstring): ``(A, R)``, each [B, T],
    zero where ``action_mask`` is 0. The recursion runs backwards over t; actions of a row are contiguous
    (right-padded responses), so ``m_{t+1} = 0`` ends the row's trajectory."""
    m = action_mask.to(values.dtype)
    B, T = values.shape
    adv = torch.zeros_like(values)
    next_adv = torch.zeros(B, dtype=values.dtype, device=values.device)
    next_value = torch.zeros_like(next_adv)
    next_m = torch.zeros_like(next_adv)
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_m * next_value - values[:, t]
        next_adv = delta + gamma * lam * next_m * next_adv
        adv[:, t] = next_adv * m[:, t]
        next_value, next_m = values[:, t], m[:, t]
    return adv, (adv + values) * m


def ppo_loss(model, input_ids, attention_mask, completion_mask, old_logprobs, old_values, advantages, returns,
             clip_eps: float = 0.2, value_clip: float = 0.2, value_coef: float = 0.5, entropy_coef: float = 0.01):
    """The PPO actor-critic loss of the module docstring; ``model(ids, mask) -> (logits, values)``."""
    logits, values = model(input_ids, attention_mask)
    logp_all = torch.log_softmax(logits[:, :-1], dim=-1)
    logp = logp_all.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    m = completion_mask[:, 1:].to(logp.dtype)
    denom = m.sum().clamp(min=1.0)
    ratio = torch.exp(logp - old_logprobs)
    pg = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps))
    v = values[:, :-1]
    v_clipped = old_values + torch.clamp(v - old_values, -value_clip, value_clip)
    vf = 0.5 * torch.max((v - returns) ** 2, (v_clipped - returns) ** 2)
    return ((pg + value_coef * vf - entropy_coef * entropy) * m).sum() / denom


def ppo_args(model, batch: dict, scores: torch.Tensor, gamma: float = 1.0, lam: float = 0.95) -> tuple:
    """The rollout phase for ``batch``: runs ``model`` (eager or compiled) without gradients, forms the
    rewards from ``scores`` [B] and GAE; returns the positional arguments of :func:`ppo_loss` after ``model``."""
    ids, am, cm = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    old_logprobs, old_values = rollout(model, ids, am, cm)
    adv, ret = gae(terminal_rewards(cm, scores.to(old_values.dtype)), old_values, cm[:, 1:], gamma, lam)
    return ids, am, cm, old_logprobs, old_values, adv, ret


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--samples", type=int, default=4, help="responses per prompt")
    p.add_argument("--prompt-len", type=int, nargs="+", default=[24, 40])
    p.add_argument("--response-len", type=int, nargs="+", default=[6, 12])
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float64")
    p.add_argument("--compiler", choices=["inductor", "aot_eager", "eager"], default="aot_eager",
                   help="how branch_replay runs the packed graph")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    import brcompile

    dtype = getattr(torch, a.dtype)
    span = lambda v: v[0] if len(v) == 1 else tuple(v[:2])  # noqa: E731
    model = ActorCritic(GPTConfig(vocab_size=256, dim=a.dim, n_layers=a.layers), seed=a.seed).to(dtype)
    batch = make_grpo_batch(num_prompts=a.prompts, group_size=a.samples, prompt_len=span(a.prompt_len),
                            response_len=span(a.response_len), seed=a.seed, dtype=dtype)
    B = batch["input_ids"].shape[0]
    scores = torch.randn(B, generator=torch.Generator().manual_seed(a.seed), dtype=torch.float64)
    params = list(model.parameters())

    ref_args = ppo_args(model, batch, scores)
    ref_loss = ppo_loss(model, *ref_args)
    ref_grads = torch.autograd.grad(ref_loss, params)

    brcompile.reset_stats()
    backend = brcompile.backend(compiler=a.compiler)
    args = ppo_args(torch.compile(model, backend=backend), batch, scores)
    loss = torch.compile(ppo_loss, backend=backend)(model, *args)
    grads = torch.autograd.grad(loss, params)

    rel = lambda x, y: ((x - y).abs().max() / y.abs().max().clamp_min(1e-300)).item()  # noqa: E731
    # the rollout's log-probs and values at the real positions: the compiled model leaves the padding out of the
    # tree (drop_padding, the default: 0 there), which GAE and the loss never read
    real = batch["attention_mask"][:, :-1].bool()
    rollout_pairs = [(x[real], y[real]) for x, y in zip(args[3:5], ref_args[3:5])] + list(zip(args[5:], ref_args[5:]))
    err = max([rel(x, y) for x, y in rollout_pairs] + [rel(loss, ref_loss)]
              + [rel(x, y) for x, y in zip(grads, ref_grads)])
    ok = err <= TOL[dtype]
    print(f"PPO loss eager {ref_loss.item():.12g}  branch_replay {loss.item():.12g}")
    print(f"max relative error (rollout logp/values/GAE, loss, every grad): {err:.3e}  "
          f"{'PASS' if ok else 'FAIL'} (tol {TOL[dtype]:.0e})")
    print(brcompile.stats())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
