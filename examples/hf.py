"""A small Qwen2-shaped HuggingFace causal LM and the GRPO loss over its logits, the way TRL computes it.

The model is an unmodified ``transformers.Qwen2ForCausalLM`` built offline from a config (random weights,
SDPA attention), sized like the example GPT (:class:`examples.gpt.GPTConfig`: width, layers, heads, KV
heads, SwiGLU width, vocabulary), so the GPT benchmark's FLOP limit applies to it unchanged. Qwen2 differs
from the GPT in its q/k/v biases and in HF's RMSNorm, which computes in float32 whatever the model's dtype.

TRL's layout and call (``GRPOTrainer._get_per_token_logps``): prompts left-padded, completions right-padded,
so every completion starts at the same column P and the last C = L - P columns hold them. Only the
model is compiled; it gets ``logits_to_keep = C + 1`` and returns logits for the last C + 1 positions;
the loss runs eagerly on them:

    logits  = model(input_ids, attention_mask, logits_to_keep=C + 1).logits        [B, C + 1, V]
    logp_t  = log softmax(logits[:, :-1])_t [input_ids[:, P + t]]                    t < C

and the clipped surrogate of :func:`examples.grpo.grpo_loss` over those C positions. Because
``completion_mask`` is 0 before column P (and ``old_logprobs`` 0 there too), this is the same loss as
``grpo_loss`` over all L positions, computed from the last C + 1 logits only.
"""
from __future__ import annotations

import logging

import torch

from examples.gpt import GPTConfig
from examples.grpo import grpo_loss

log = logging.getLogger(__name__)

__all__ = ["qwen2_model", "completion_width", "trl_grpo_loss"]


def qwen2_model(config: GPTConfig, *, max_positions: int = 4096, seed: int = 0,
                dtype: torch.dtype = torch.float64, attn_implementation: str = "sdpa", use_cache: bool = False):
    """A random ``Qwen2ForCausalLM`` with the sizes of ``config`` (hidden = dim, intermediate = hidden_dim,
    untied LM head), ``max_positions`` rotary positions, seeded with ``seed``, in ``dtype``. ``use_cache``
    False, as HF's Trainer sets it for training (``TrainingArguments.use_cache`` defaults to False; TRL's
    trainers are Trainers): a training forward returns no K/V cache. With ``use_cache=True`` the model also
    returns every layer's K and V, which a compiled model then reads out densely on every call."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    if max_positions < 1:
        raise ValueError(f"max_positions={max_positions} must be >= 1")
    hf_config = Qwen2Config(
        vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.hidden_dim,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads, max_position_embeddings=max_positions,
        rope_theta=config.rope_theta, rms_norm_eps=config.norm_eps, tie_word_embeddings=config.tie_embeddings,
        pad_token_id=0, bos_token_id=None, eos_token_id=None, attn_implementation=attn_implementation,
        use_cache=use_cache)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config).to(dtype)
    log.debug("Qwen2 model: %s", hf_config)
    return model


def completion_width(completion_mask: torch.Tensor) -> int:
    """C = L - P, where P is the column at which every row's completion starts (TRL's
    ``completion_ids.size(1)``). Raises ValueError when no row has a completion token, or when the rows'
    completions start at different columns (TRL's layout left-pads the prompts)."""
    mask = completion_mask.bool()
    has = mask.any(dim=1)
    if not bool(has.any()):
        raise ValueError("completion_mask has no completion token")
    starts = mask.long().argmax(dim=1)[has]          # first completion column of each row that has one
    P = int(starts[0])
    if bool((starts != P).any()):
        raise ValueError(f"completions start at columns {sorted(set(starts.tolist()))}, not one column: "
                         "TRL's layout left-pads the prompts (make_grpo_batch(left_pad_prompts=True))")
    return completion_mask.shape[1] - P


def trl_grpo_loss(model, input_ids, attention_mask, completion_mask, advantages, old_logprobs, completion_len: int,
                  clip_eps: float = 0.2):
    """The GRPO loss of an HF causal LM, TRL's way (module docstring): ``model`` (the HF model, compiled or
    not) runs with ``logits_to_keep = completion_len + 1``; the surrogate is :func:`grpo_loss`'s, applied to
    the window of the last C + 1 columns (its shift ``logits[:, :-1]`` then predicts the C completion
    columns, and ``completion_mask[:, 1:]`` of the window is ``completion_mask[:, -C:]``)."""
    C = completion_len
    if not 1 <= C < input_ids.shape[1]:
        raise ValueError(f"completion_len={C} must be in [1, L - 1], L = {input_ids.shape[1]}")
    logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=C + 1).logits
    window = slice(-(C + 1), None)
    return grpo_loss(lambda *_: logits, input_ids[:, window], None, completion_mask[:, window], advantages,
                     old_logprobs[:, -C:], clip_eps=clip_eps, use_attention_mask=False)
