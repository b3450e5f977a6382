"""A small Llama-style causal language model, written the way people write it.

This is the model the examples, tests and benchmarks run through ``branch_replay``. It is plain
PyTorch in the style of HuggingFace's Llama: token embedding, pre-norm blocks of RMSNorm ->
grouped-query attention with rotary position embeddings -> residual, RMSNorm -> SwiGLU MLP ->
residual, a final RMSNorm and an LM head. Nothing here is shaped for the compiler: the backend
has to understand ordinary code.

    x_0       = E[input_ids]                                   [B, L, dim]
    x_{l+1/2} = x_l + Attn(RMSNorm(x_l))
    x_{l+1}   = x_{l+1/2} + MLP(RMSNorm(x_{l+1/2}))
    logits    = RMSNorm(x_n) @ W_out^T                         [B, L, vocab]

Runs in float32 and float64 (``model.double()``); float16/bfloat16 norms compute in float32.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

__all__ = ["GPTConfig", "GPT", "RMSNorm", "Attention", "MLP", "Block", "rotate_half",
           "apply_rotary_pos_emb", "repeat_kv"]


@dataclass
class GPTConfig:
    """Sizes of the example model.

    ``hidden_dim`` is the SwiGLU width; ``None`` means ~8/3 * dim rounded up to a multiple of 16
    (resolved in ``__post_init__``). ``n_kv_heads < n_heads`` is grouped-query attention: each
    key/value head serves ``n_heads // n_kv_heads`` query heads.
    """

    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden_dim: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.hidden_dim is None:
            self.hidden_dim = 16 * math.ceil(8 * self.dim / 3 / 16)
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head_dim={self.dim // self.n_heads} must be even for rotary embeddings")
        for name in ("vocab_size", "n_layers", "hidden_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

    @property
    def head_dim(self) -> int:
        """Width of one attention head: dim / n_heads."""
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    """RMSNorm, HF style: ``y = x * rsqrt(mean(x^2, -1) + eps) * w``.

    Half-precision inputs are normalised in float32 and cast back; float32/float64 stay as they are.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        if input_dtype in (torch.float16, torch.bfloat16):
            x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(input_dtype) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotates half the hidden dims: ``[x1, x2] -> [-x2, x1]`` (HF's rotate_half)."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """RoPE: ``q' = q * cos + rotate_half(q) * sin`` (and the same for k); cos/sin are [L, head_dim]."""
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """GQA: [B, Hkv, L, D] -> [B, Hkv * n_rep, L, D], each kv head repeated n_rep times (HF's repeat_kv)."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE.

    ``softmax(q k^T / sqrt(D) + mask) v`` per head; ``mask`` is None (plain causal) or a bool
    [B, 1, L, L] mask (True = may attend) built once in ``GPT.forward``.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.n_rep = config.n_heads // config.n_kv_heads
        self.q_proj = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x, cos, sin, mask=None):
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = repeat_kv(k, self.n_rep)
        v = repeat_kv(v, self.n_rep)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).reshape(B, L, -1)
        return self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.up_proj = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.down_proj = nn.Linear(config.hidden_dim, config.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class GPT(nn.Module):
    """The example causal LM: ``forward(input_ids [B, L] long, attention_mask [B, L] | None) -> logits [B, L, V]``.

    ``attention_mask`` (1 = real token, 0 = padding) is combined with the causal mask into one bool
    [B, 1, L, L] mask, built once here as HF does; without it attention is plain causal. Weights are
    initialised from ``torch.Generator().manual_seed(seed)``, so the same seed gives the same model.
    """

    def __init__(self, config: GPTConfig, seed: int = 0):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        # theta_i = rope_theta^(-2i/D); computed in float64, stored at the default dtype. Not persistent:
        # it is a function of the config, and .double() turns it into float64 with the model.
        D = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_dtype()), persistent=False)
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Normal(0, 0.02) weights from a seeded generator; residual outputs (o_proj, down_proj) scaled by
        1/sqrt(2 n_layers) as in GPT-2, norms at 1. Small weights keep float64 runs well conditioned."""
        g = torch.Generator(device="cpu").manual_seed(seed)
        std = 0.02
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
                continue
            s = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).mul_(s).to(p.dtype))

    def rotary_cos_sin(self, L: int, device, dtype):
        """cos/sin of ``positions[:, None] * inv_freq[None, :]`` for positions 0..L-1, each [L, head_dim].

        Frequencies are computed in float32, or in float64 when the model is float64.
        """
        inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float64 else self.inv_freq.float()
        positions = torch.arange(L, device=device)
        freqs = positions[:, None].float() * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The trunk: embeddings -> blocks -> final norm, [B, L, dim] (heads read it: LM head, value head)."""
        B, L = input_ids.shape
        h = self.tok_emb(input_ids)
        cos, sin = self.rotary_cos_sin(L, input_ids.device, h.dtype)
        mask = None
        if attention_mask is not None:
            idx = torch.arange(L, device=input_ids.device)
            causal = idx[:, None] >= idx[None, :]
            mask = causal[None, None] & attention_mask[:, None, None, :].bool()
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.norm(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head on trunk outputs (tied to the embedding when ``lm_head`` is None)."""
        if self.lm_head is None:
            return F.linear(h, self.tok_emb.weight)
        return self.lm_head(h)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.logits(self.hidden_states(input_ids, attention_mask))
