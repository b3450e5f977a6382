"""A GRPO training step's loss, written plainly (TRL-like), and a synthetic GRPO batch generator.

A GRPO batch holds ``num_prompts`` groups of ``group_size`` rollouts; every rollout of a group
repeats the group's prompt, and optionally the first ``shared_response_prefix`` response tokens.
That repetition is what ``branch_replay`` removes. The loss is the clipped policy-gradient surrogate

    r_{b,t}  = exp(logp_{b,t} - old_logp_{b,t})
    s_{b,t}  = min(r_{b,t} A_b, clip(r_{b,t}, 1 - eps, 1 + eps) A_b)
    loss     = -mean_b( sum_t m_{b,t} s_{b,t} / max(1, sum_t m_{b,t}) )

with ``logp_{b,t} = log softmax(logits_{b,t})[input_ids_{b,t+1}]`` (the next-token log-probability)
and ``m = completion_mask[:, 1:]``.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

__all__ = ["make_grpo_batch", "grpo_loss", "grpo_surrogate", "masked_nll_loss"]


def _as_range(value, name: str) -> tuple[int, int]:
    """An int ``n`` or an inclusive ``(lo, hi)`` range -> ``(lo, hi)``, validated (lo >= 1, lo <= hi)."""
    if isinstance(value, int):
        lo = hi = value
    else:
        try:
            lo, hi = (int(v) for v in value)
        except (TypeError, ValueError):
            raise TypeError(f"{name} must be an int or an inclusive (lo, hi) pair, got {value!r}") from None
    if lo < 1 or lo > hi:
        raise ValueError(f"{name}={value!r}: need 1 <= lo <= hi")
    return lo, hi


def _randint(gen: torch.Generator, lo_hi: tuple[int, int]) -> int:
    """One integer drawn uniformly from the inclusive range ``lo_hi``."""
    lo, hi = lo_hi
    return int(torch.randint(lo, hi + 1, (), generator=gen))


def _random_tokens(gen: torch.Generator, n: int, vocab_size: int, pad_id: int) -> torch.Tensor:
    """``n`` token ids uniform over ``[0, vocab_size)`` minus ``{pad_id}``: draw from ``vocab_size - 1``
    values and shift those >= pad_id up by one, so no real token equals the pad id."""
    t = torch.randint(0, vocab_size - 1, (n,), generator=gen)
    return t + (t >= pad_id).long()


def make_grpo_batch(*, num_prompts: int = 2, group_size: int = 8, prompt_len=(24, 40), response_len=(8, 16),
                    shared_response_prefix: int = 0, vocab_size: int = 256, pad_id: int = 0,
                    left_pad_prompts: bool = False, seed: int = 0, device="cpu",
                    dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A synthetic GRPO batch of ``B = num_prompts * group_size`` rows.

    Row ``b`` of group ``g = b // group_size`` is ``prompt_g + response_b``: the rows of a group share
    the prompt (length drawn per group from ``prompt_len``) and the first ``shared_response_prefix``
    response tokens; the rest of each response is its own (length drawn per row from
    ``response_len``, so responses are ragged). Rows are right-padded with ``pad_id`` to a common
    length L. With ``left_pad_prompts`` the prompts are left-padded to the longest prompt, so every
    response starts at the same column (TRL's layout). ``prompt_len``/``response_len`` are an int or
    an inclusive ``(lo, hi)`` range. Real tokens never equal ``pad_id``.

    Returns a dict:
      input_ids       [B, L] long
      attention_mask  [B, L] long, 1 on real (prompt or response) tokens
      completion_mask [B, L] long, 1 on real response tokens
      advantages      [B]    ``dtype``, rewards ~ N(0, 1) normalised within each group: (r - mean_g) / (std_g + 1e-4)
      old_logprobs    [B, L-1] ``dtype``, ``-log(V) + 0.3 * N(0, 1)`` where ``completion_mask[:, 1:]``, else 0
    """
    if num_prompts < 1 or group_size < 1:
        raise ValueError(f"num_prompts={num_prompts} and group_size={group_size} must be >= 1")
    if not 0 <= pad_id < vocab_size or vocab_size < 2:
        raise ValueError(f"need vocab_size >= 2 and 0 <= pad_id < vocab_size, got {vocab_size=}, {pad_id=}")
    p_range = _as_range(prompt_len, "prompt_len")
    r_range = _as_range(response_len, "response_len")
    if not 0 <= shared_response_prefix <= r_range[0]:
        raise ValueError(f"shared_response_prefix={shared_response_prefix} must be in [0, min response length "
                         f"{r_range[0]}]")
    gen = torch.Generator(device="cpu").manual_seed(seed)

    prompts, responses = [], []
    for _ in range(num_prompts):
        prompt = _random_tokens(gen, _randint(gen, p_range), vocab_size, pad_id)
        shared = _random_tokens(gen, shared_response_prefix, vocab_size, pad_id)
        for _ in range(group_size):
            own = _random_tokens(gen, _randint(gen, r_range) - shared_response_prefix, vocab_size, pad_id)
            prompts.append(prompt)
            responses.append(torch.cat([shared, own]))

    B = num_prompts * group_size
    max_prompt = max(len(p) for p in prompts)
    if left_pad_prompts:
        starts = [max_prompt - len(p) for p in prompts]       # column of each row's first prompt token
        L = max_prompt + max(len(r) for r in responses)
    else:
        starts = [0] * B
        L = max(len(p) + len(r) for p, r in zip(prompts, responses))

    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    completion_mask = torch.zeros((B, L), dtype=torch.long)
    for b, (s, p, r) in enumerate(zip(starts, prompts, responses)):
        resp_start = s + len(p)
        input_ids[b, s:resp_start] = p
        input_ids[b, resp_start:resp_start + len(r)] = r
        attention_mask[b, s:resp_start + len(r)] = 1
        completion_mask[b, resp_start:resp_start + len(r)] = 1

    rewards = torch.randn(num_prompts, group_size, generator=gen, dtype=torch.float64)
    std = rewards.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(rewards)
    advantages = ((rewards - rewards.mean(dim=1, keepdim=True)) / (std + 1e-4)).reshape(B)
    old_logprobs = -torch.log(torch.tensor(float(vocab_size), dtype=torch.float64)) \
        + 0.3 * torch.randn(B, L - 1, generator=gen, dtype=torch.float64)
    old_logprobs = old_logprobs * completion_mask[:, 1:]

    log.debug("GRPO batch: B=%d L=%d real=%d completion=%d", B, L, int(attention_mask.sum()),
              int(completion_mask.sum()))
    return {
        "input_ids": input_ids.to(device),
        "attention_mask": attention_mask.to(device),
        "completion_mask": completion_mask.to(device),
        "advantages": advantages.to(device=device, dtype=dtype),
        "old_logprobs": old_logprobs.to(device=device, dtype=dtype),
    }


def grpo_loss(model, input_ids, attention_mask, completion_mask, advantages, old_logprobs, clip_eps=0.2,
              use_attention_mask=True):
    """The GRPO clipped surrogate loss (see the module docstring), per-sequence masked mean then mean.

    ``model(input_ids, attention_mask)`` gives logits [B, L, V]; position t predicts token t + 1.
    """
    logits = model(input_ids, attention_mask if use_attention_mask else None)
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return grpo_surrogate(logp, completion_mask, advantages, old_logprobs, clip_eps)


def grpo_surrogate(logp, completion_mask, advantages, old_logprobs, clip_eps=0.2):
    """The loss of :func:`grpo_loss` from the next-token log-probs ``logp`` [B, L-1]:
    ``-mean_b(sum_t m s / max(1, sum_t m))``, ``s = min(r A, clip(r, 1-eps, 1+eps) A)``, ``r = exp(logp - old)``,
    ``m = completion_mask[:, 1:]``."""
    ratio = torch.exp(logp - old_logprobs)
    adv = advantages[:, None]
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    mask = completion_mask[:, 1:].to(surrogate.dtype)
    per_sequence = (surrogate * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
    return -per_sequence.mean()


def masked_nll_loss(model, input_ids, loss_mask):
    """Next-token cross entropy, masked mean: ``sum(m * nll) / max(1, sum(m))`` with ``m = loss_mask[:, 1:]``
    and ``nll_{b,t} = -log softmax(logits_{b,t})[input_ids_{b,t+1}]``."""
    logits = model(input_ids)
    V = logits.shape[-1]
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, V), input_ids[:, 1:].reshape(-1), reduction="none")
    mask = loss_mask[:, 1:].reshape(-1).to(nll.dtype)
    return (nll * mask).sum() / mask.sum().clamp(min=1.0)
