"""Small decoder LMs written the way well-known public codebases write them (a "zoo" of op spellings).

Each class reproduces one codebase's *spelling* of the same math — attention, masks, rotary, norms,
residuals — at toy size (dim 32, 2 layers, 4 heads, vocab 64), unchanged in style, so the tests can
check that ``branch_replay`` accepts the model as written. ``forward(input_ids, attention_mask=None)``
returns logits ``[B, L, V]``; models that only know a causal mask ignore ``attention_mask`` (the test
batches are right-padded, which a causal mask makes harmless).

ALiBi and attention sinks replay through tree attention's ``alibi`` / ``sinks`` features; a per-head bias
that is not ALiBi, and ALiBi slopes that are trained, are here to check that they fall back with a reason
naming them.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, LAYERS, HEADS, MAX_SEQ = 64, 32, 2, 4, 64
HS = DIM // HEADS


class Decoder(nn.Module):
    """Embedding -> blocks -> final norm -> LM head; subclasses set ``blocks``, ``norm`` and the rest."""

    uses_mask = False  # whether forward reads attention_mask

    def __init__(self, block, norm=None, tie=False):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([block() for _ in range(LAYERS)])
        self.norm = norm() if norm is not None else nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight

    def forward(self, input_ids, attention_mask=None):
        x = self.embed(input_ids)
        ctx = self.context(input_ids, attention_mask)
        for block in self.blocks:
            x = block(x, *ctx)
        return self.lm_head(self.norm(x))

    def embed(self, input_ids):
        return self.wte(input_ids)

    def context(self, input_ids, attention_mask):
        return ()


# --------------------------------------------------------------------------------------------------
# nanoGPT (karpathy/nanoGPT model.py): flash and manual attention paths, learned positions, tied head


class NanoGPTAttention(nn.Module):
    def __init__(self, flash: bool):
        super().__init__()
        self.c_attn = nn.Linear(DIM, 3 * DIM, bias=True)
        self.c_proj = nn.Linear(DIM, DIM, bias=True)
        self.attn_dropout = nn.Dropout(0.0)
        self.resid_dropout = nn.Dropout(0.0)
        self.n_head, self.n_embd, self.dropout = HEADS, DIM, 0.0
        self.flash = flash
        if not self.flash:
            self.register_buffer("bias", torch.tril(torch.ones(MAX_SEQ, MAX_SEQ)).view(1, 1, MAX_SEQ, MAX_SEQ))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class NanoGPTMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(DIM, 4 * DIM)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * DIM, DIM)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class NanoGPTBlock(nn.Module):
    def __init__(self, flash):
        super().__init__()
        self.ln_1 = nn.LayerNorm(DIM)
        self.attn = NanoGPTAttention(flash)
        self.ln_2 = nn.LayerNorm(DIM)
        self.mlp = NanoGPTMLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class NanoGPT(Decoder):
    flash = True

    def __init__(self):
        super().__init__(lambda: NanoGPTBlock(self.flash), tie=True)
        self.wpe = nn.Embedding(MAX_SEQ, DIM)
        self.drop = nn.Dropout(0.0)

    def embed(self, idx):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class NanoGPTManual(NanoGPT):
    flash = False


# --------------------------------------------------------------------------------------------------
# minGPT (karpathy/minGPT model.py): NewGELU, masked_fill with a tril buffer, manual attention


class NewGELU(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class MinGPTSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(DIM, 3 * DIM)
        self.c_proj = nn.Linear(DIM, DIM)
        self.attn_dropout = nn.Dropout(0.0)
        self.resid_dropout = nn.Dropout(0.0)
        self.register_buffer("bias", torch.tril(torch.ones(MAX_SEQ, MAX_SEQ)).view(1, 1, MAX_SEQ, MAX_SEQ))
        self.n_head, self.n_embd = HEADS, DIM

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MinGPTBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(DIM)
        self.attn = MinGPTSelfAttention()
        self.ln_2 = nn.LayerNorm(DIM)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(DIM, 4 * DIM), c_proj=nn.Linear(4 * DIM, DIM),
                                      act=NewGELU(), dropout=nn.Dropout(0.0)))
        m = self.mlp
        self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))  # noqa: E731

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlpf(self.ln_2(x))
        return x


class MinGPT(Decoder):
    def __init__(self):
        super().__init__(MinGPTBlock)
        self.pos_emb = nn.Parameter(torch.randn(1, MAX_SEQ, DIM) * 0.02)

    def embed(self, idx):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device).unsqueeze(0)
        return self.wte(idx) + F.embedding(pos, self.pos_emb[0])


# --------------------------------------------------------------------------------------------------
# torchtitan Llama (pytorch/torchtitan models/llama): complex freqs_cis, reshape_for_broadcast, repeat_kv


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].double() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).double()
    return torch.polar(torch.ones_like(freqs), freqs)  # complex128


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    ndim = x.ndim
    seqlen = x.shape[1]
    freqs_cis = freqs_cis[0:seqlen]
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb_complex(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def titan_repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (torch.unsqueeze(x, dim=3).expand(bs, slen, n_kv_heads, n_rep, head_dim)
            .reshape(bs, slen, n_kv_heads * n_rep, head_dim))


class TitanAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = HEADS, 2, HS
        self.n_rep = self.n_heads // self.n_kv_heads
        self.wq = nn.Linear(DIM, HEADS * HS, bias=False)
        self.wk = nn.Linear(DIM, 2 * HS, bias=False)
        self.wv = nn.Linear(DIM, 2 * HS, bias=False)
        self.wo = nn.Linear(HEADS * HS, DIM, bias=False)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb_complex(xq, xk, freqs_cis=freqs_cis)
        keys = titan_repeat_kv(xk, self.n_rep)
        values = titan_repeat_kv(xv, self.n_rep)
        xq = xq.transpose(1, 2)
        xk = keys.transpose(1, 2)
        xv = values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class SwiGLU(nn.Module):
    def __init__(self, hidden=48):
        super().__init__()
        self.w1 = nn.Linear(DIM, hidden, bias=False)
        self.w2 = nn.Linear(hidden, DIM, bias=False)
        self.w3 = nn.Linear(DIM, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanRMSNorm(nn.Module):
    """torchtitan's older hand-written RMSNorm (``x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)``)."""

    def __init__(self, dim=DIM, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        # torchtitan writes x.float(): "at least float32" (float64 here stays float64, as the test needs)
        return self._norm(x.to(torch.promote_types(x.dtype, torch.float32))).type_as(x) * self.weight


class TitanBlock(nn.Module):
    def __init__(self, norm=TitanRMSNorm):
        super().__init__()
        self.attention = TitanAttention()
        self.feed_forward = SwiGLU()
        self.attention_norm = norm()
        self.ffn_norm = norm()

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class TorchTitanLlama(Decoder):
    norm_cls = TitanRMSNorm

    def __init__(self):
        super().__init__(lambda: TitanBlock(self.norm_cls), norm=self.norm_cls)
        self.register_buffer("freqs_cis", precompute_freqs_cis(HS, MAX_SEQ), persistent=False)

    def context(self, input_ids, attention_mask):
        return (self.freqs_cis,)


class NNRMSNormLlama(TorchTitanLlama):
    """torchtitan today: ``nn.RMSNorm``."""

    norm_cls = staticmethod(lambda: nn.RMSNorm(DIM, eps=1e-6))


# --------------------------------------------------------------------------------------------------
# gpt-fast (pytorch-labs/gpt-fast model.py): freqs_cis[input_pos], causal_mask buffer, repeat_interleave


def gptfast_precompute_freqs_cis(seq_len: int, n_elem: int, base: int = 10000) -> torch.Tensor:
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2)[: (n_elem // 2)].double() / n_elem))
    t = torch.arange(seq_len, device=freqs.device)
    freqs = torch.outer(t, freqs)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    return torch.stack([freqs_cis.real, freqs_cis.imag], dim=-1)


def gptfast_apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    xshaped = x.double().reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        -1,
    )
    x_out2 = x_out2.flatten(3)
    return x_out2.type_as(x)


class GptFastAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim = HEADS, 2, HS
        total_head_dim = (self.n_head + 2 * self.n_local_heads) * self.head_dim
        self.wqkv = nn.Linear(DIM, total_head_dim, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([DIM, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seqlen, self.n_head, self.head_dim)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        q = gptfast_apply_rotary_emb(q, freqs_cis)
        k = gptfast_apply_rotary_emb(k, freqs_cis)
        q, k, v = map(lambda x: x.transpose(1, 2), (q, k, v))
        k = k.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        v = v.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        y = y.transpose(1, 2).contiguous().view(bsz, seqlen, DIM)
        return self.wo(y)


class GptFastBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = GptFastAttention()
        self.feed_forward = SwiGLU()
        self.ffn_norm = TitanRMSNorm()
        self.attention_norm = TitanRMSNorm()

    def forward(self, x, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class GptFast(Decoder):
    def __init__(self):
        super().__init__(GptFastBlock, norm=TitanRMSNorm)
        self.register_buffer("freqs_cis", gptfast_precompute_freqs_cis(MAX_SEQ, HS), persistent=False)
        self.register_buffer("causal_mask", torch.tril(torch.ones(MAX_SEQ, MAX_SEQ, dtype=torch.bool)),
                             persistent=False)

    def context(self, idx, attention_mask):
        input_pos = torch.arange(idx.size(1), device=idx.device)
        mask = self.causal_mask[None, None, input_pos][..., : idx.size(1)]
        freqs_cis = self.freqs_cis[input_pos]
        return freqs_cis, mask


# --------------------------------------------------------------------------------------------------
# lit-gpt (Lightning-AI/litgpt model.py): [T, hs] cos/sin cache sliced to T, fused qkv, apply_rope


def build_rope_cache(seq_len: int, n_elem: int, base: int = 10000):
    theta = 1.0 / (base ** (torch.arange(0, n_elem, 2).double() / n_elem))
    seq_idx = torch.arange(seq_len).double()
    idx_theta = torch.outer(seq_idx, theta).repeat(1, 2)
    return torch.cos(idx_theta), torch.sin(idx_theta)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    head_size = x.size(-1)
    x1 = x[..., : head_size // 2]
    x2 = x[..., head_size // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    roped = (x * cos) + (rotated * sin)
    return roped.to(dtype=x.dtype)


class LitRMSNorm(nn.Module):
    def __init__(self, size=DIM, dim=-1, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.dim = eps, dim

    def forward(self, x):
        dtype = x.dtype
        x = x.double()
        norm_x = torch.mean(x * x, dim=self.dim, keepdim=True)
        x_normed = x * torch.rsqrt(norm_x + self.eps)
        return (x_normed * self.weight.double()).to(dtype=dtype)


class LitCausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.size()
        qkv = self.attn(x)
        q_per_kv = 1
        total_qkv = q_per_kv + 2
        qkv = qkv.view(B, T, HEADS, total_qkv, HS)
        qkv = qkv.permute(0, 2, 3, 1, 4)
        q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)
        q = q.reshape(B, -1, T, HS)
        k = k.reshape(B, -1, T, HS)
        v = v.reshape(B, -1, T, HS)
        q_roped = apply_rope(q[..., :HS], cos, sin)
        k_roped = apply_rope(k[..., :HS], cos, sin)
        scale = 1.0 / math.sqrt(HS)
        y = F.scaled_dot_product_attention(q_roped, k_roped, v, attn_mask=None, dropout_p=0.0, scale=scale,
                                           is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, HEADS * HS)
        return self.proj(y)


class LitBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm_1 = LitRMSNorm()
        self.attn = LitCausalSelfAttention()
        self.norm_2 = LitRMSNorm()
        self.mlp = SwiGLU()

    def forward(self, x, cos, sin):
        x = self.attn(self.norm_1(x), cos, sin) + x
        return self.mlp(self.norm_2(x)) + x


class LitGPT(Decoder):
    def __init__(self):
        super().__init__(LitBlock, norm=LitRMSNorm)
        cos, sin = build_rope_cache(MAX_SEQ, HS)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def context(self, idx, attention_mask):
        T = idx.size(1)
        return self.cos[:T], self.sin[:T]


# --------------------------------------------------------------------------------------------------
# OLMo (allenai/OLMo olmo/model.py): non-parametric LayerNorm, einsum rotary tables, unbind rotate_half


class OLMoRotary(nn.Module):
    def forward(self, q, k):
        seq_len = q.shape[-2]
        inv_freq = 1.0 / (10000 ** (torch.arange(0, HS, 2, dtype=torch.float64) / HS))
        seq = torch.arange(seq_len, dtype=torch.float64)
        freqs = torch.einsum("i , j -> i j", seq, inv_freq)
        positions = torch.cat((freqs, freqs), dim=-1)
        pos_sin, pos_cos = positions.sin()[None, None, :, :], positions.cos()[None, None, :, :]
        return self.apply_rotary_pos_emb(pos_sin, pos_cos, q), self.apply_rotary_pos_emb(pos_sin, pos_cos, k)

    def rotate_half(self, x):
        B, nh, T, hs = x.size()
        x = x.view(B, nh, T, 2, hs // 2)
        x1, x2 = x.unbind(dim=-2)
        return torch.cat((-x2, x1), dim=-1)

    def apply_rotary_pos_emb(self, pos_sin, pos_cos, t):
        return ((t * pos_cos) + (self.rotate_half(t) * pos_sin)).to(t.dtype)


class OLMoBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.att_proj = nn.Linear(DIM, 3 * DIM, bias=False)
        self.attn_out = nn.Linear(DIM, DIM, bias=False)
        self.ff_proj = nn.Linear(DIM, 96, bias=False)
        self.ff_out = nn.Linear(48, DIM, bias=False)
        self.rotary_emb = OLMoRotary()

    def attn_norm(self, x):
        return F.layer_norm(x, (DIM,), None, None, eps=1e-5)

    def forward(self, x):
        q, k, v = self.att_proj(self.attn_norm(x)).split((DIM, DIM, DIM), dim=-1)
        B, T, C = q.size()
        q = q.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        k = k.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        v = v.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        q, k = self.rotary_emb(q, k)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        att = att.transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.attn_out(att)
        h = self.ff_proj(self.attn_norm(x))
        h, gate = h.chunk(2, dim=-1)
        return x + self.ff_out(F.silu(gate) * h)


class OLMo(Decoder):
    def __init__(self):
        super().__init__(OLMoBlock)


# --------------------------------------------------------------------------------------------------
# HF transformers 4.x Llama: inv_freq @ position_ids rotary, rotate_half, eager attention with a
# finfo.min additive 4-D mask built from attention_mask


def hf_rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (hf_rotate_half(q) * sin)
    k_embed = (k * cos) + (hf_rotate_half(k) * sin)
    return q_embed, k_embed


class HFRotaryEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, HS, 2, dtype=torch.int64).double() / HS))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].double().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].double()
        freqs = (inv_freq_expanded.double() @ position_ids_expanded.double()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def hf_repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class HFAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim, self.num_key_value_groups = HS, 2
        self.q_proj = nn.Linear(DIM, HEADS * HS, bias=False)
        self.k_proj = nn.Linear(DIM, 2 * HS, bias=False)
        self.v_proj = nn.Linear(DIM, 2 * HS, bias=False)
        self.o_proj = nn.Linear(HEADS * HS, DIM, bias=False)

    def forward(self, hidden_states, cos, sin, attention_mask):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        query_states, key_states = hf_apply_rotary_pos_emb(query_states, key_states, cos, sin)
        key_states = hf_repeat_kv(key_states, self.num_key_value_groups)
        value_states = hf_repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = attn_weights + causal_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_weights = nn.functional.dropout(attn_weights, p=0.0, training=self.training)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)


class HFRMSNorm(nn.Module):
    def __init__(self, hidden_size=DIM, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class HFLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = HFAttention()
        self.mlp = SwiGLU()
        self.input_layernorm = HFRMSNorm()
        self.post_attention_layernorm = HFRMSNorm()

    def forward(self, hidden_states, cos, sin, attention_mask):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), cos, sin, attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class HFLlama(Decoder):
    uses_mask = True

    def __init__(self):
        super().__init__(HFLayer, norm=HFRMSNorm)
        self.rotary_emb = HFRotaryEmbedding()

    def context(self, input_ids, attention_mask):
        bsz, seq_len = input_ids.shape
        dtype = self.wte.weight.dtype
        cache_position = torch.arange(seq_len, device=input_ids.device)
        position_ids = cache_position.unsqueeze(0)
        min_dtype = torch.finfo(dtype).min
        causal_mask = torch.full((seq_len, seq_len), fill_value=min_dtype, dtype=dtype)
        causal_mask = torch.triu(causal_mask, diagonal=1)
        causal_mask = causal_mask[None, None, :, :].expand(bsz, 1, -1, -1)
        if attention_mask is not None:
            padding_mask = causal_mask + attention_mask[:, None, None, :].to(dtype)
            padding_mask = padding_mask == 0
            causal_mask = causal_mask.masked_fill(padding_mask, min_dtype)
        cos, sin = self.rotary_emb(self.wte.weight, position_ids)
        return cos, sin, causal_mask


# --------------------------------------------------------------------------------------------------
# GPT-J (HF modeling_gptj): parallel residual, interleaved rotary (rotate_every_two), embed_positions
# indexed by position_ids, torch.where(bias, scores, finfo.min) then the scale, additive padding mask


def create_sinusoidal_positions(num_pos: int, dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64) / dim))
    sinusoid_inp = torch.einsum("i , j -> i j", torch.arange(num_pos, dtype=torch.int64).double(), inv_freq).double()
    return torch.cat((torch.sin(sinusoid_inp), torch.cos(sinusoid_inp)), dim=1)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


def apply_rotary_pos_emb_gptj(tensor, sin, cos):
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    return (tensor * cos) + (rotate_every_two(tensor) * sin)


class GPTJAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones((MAX_SEQ, MAX_SEQ), dtype=torch.bool)).view(
            1, 1, MAX_SEQ, MAX_SEQ), persistent=False)
        self.num_attention_heads, self.head_dim, self.rotary_dim = HEADS, HS, 4
        self.scale_attn = math.sqrt(self.head_dim)
        self.k_proj = nn.Linear(DIM, DIM, bias=False)
        self.v_proj = nn.Linear(DIM, DIM, bias=False)
        self.q_proj = nn.Linear(DIM, DIM, bias=False)
        self.out_proj = nn.Linear(DIM, DIM, bias=False)
        self.register_buffer("embed_positions", create_sinusoidal_positions(MAX_SEQ, self.rotary_dim),
                             persistent=False)

    def _split_heads(self, tensor, rotary):
        new_shape = tensor.size()[:-1] + (self.num_attention_heads, self.head_dim)
        tensor = tensor.view(new_shape)
        if rotary:
            return tensor
        return tensor.permute(0, 2, 1, 3)

    def _attn(self, query, key, value, attention_mask=None):
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length: key_length, :key_length]
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        mask_value = torch.finfo(attn_weights.dtype).min
        attn_weights = torch.where(causal_mask, attn_weights, mask_value)
        attn_weights = attn_weights / self.scale_attn
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_weights = attn_weights.to(value.dtype)
        return torch.matmul(attn_weights, value)

    def forward(self, hidden_states, attention_mask, position_ids):
        query = self._split_heads(self.q_proj(hidden_states), True)
        key = self._split_heads(self.k_proj(hidden_states), True)
        value = self._split_heads(self.v_proj(hidden_states), False)
        sincos = self.embed_positions[position_ids]
        sin, cos = torch.split(sincos, sincos.shape[-1] // 2, dim=-1)
        k_rot, k_pass = key[:, :, :, : self.rotary_dim], key[:, :, :, self.rotary_dim:]
        q_rot, q_pass = query[:, :, :, : self.rotary_dim], query[:, :, :, self.rotary_dim:]
        k_rot = apply_rotary_pos_emb_gptj(k_rot, sin, cos)
        q_rot = apply_rotary_pos_emb_gptj(q_rot, sin, cos)
        key = torch.cat([k_rot, k_pass], dim=-1)
        query = torch.cat([q_rot, q_pass], dim=-1)
        key, query = key.permute(0, 2, 1, 3), query.permute(0, 2, 1, 3)
        attn_output = self._attn(query, key, value, attention_mask)
        attn_output = attn_output.permute(0, 2, 1, 3).contiguous()
        attn_output = attn_output.view(attn_output.size()[:-2] + (DIM,))
        return self.out_proj(attn_output)


class GPTJBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(DIM)
        self.attn = GPTJAttention()
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(approximate="tanh"), nn.Linear(4 * DIM, DIM))

    def forward(self, hidden_states, attention_mask, position_ids):
        residual = hidden_states
        hidden_states = self.ln_1(hidden_states)
        attn_output = self.attn(hidden_states, attention_mask, position_ids)
        feed_forward_hidden_states = self.mlp(hidden_states)
        return attn_output + feed_forward_hidden_states + residual


class GPTJ(Decoder):
    uses_mask = True

    def __init__(self):
        super().__init__(GPTJBlock)

    def context(self, input_ids, attention_mask):
        position_ids = torch.arange(0, input_ids.shape[-1], dtype=torch.long).unsqueeze(0)
        if attention_mask is not None:
            attention_mask = attention_mask[:, None, None, :]
            attention_mask = attention_mask.to(dtype=self.wte.weight.dtype)
            attention_mask = (1.0 - attention_mask) * torch.finfo(self.wte.weight.dtype).min
        return attention_mask, position_ids


# --------------------------------------------------------------------------------------------------
# einsum attention with an additive -1e9 mask; scale applied to q before the scores


class EinsumAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x, mask):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, HS).permute(2, 0, 3, 1, 4)
        q = q * HS ** -0.5
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k)
        scores = scores + mask
        probs = scores.softmax(dim=-1)
        o = torch.einsum("bhqk,bhkd->bhqd", probs, v)
        return self.out(o.transpose(1, 2).reshape(B, T, DIM))


class EinsumBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = EinsumAttention()
        self.mlp = nn.Sequential(nn.Linear(DIM, 64), nn.GELU(), nn.Linear(64, DIM))

    def forward(self, x, mask):
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class EinsumMinus1e9(Decoder):
    """Einsum scores and output, q scaled before the scores, additive ``-1e9`` causal + padding mask."""

    uses_mask = True

    def __init__(self):
        super().__init__(EinsumBlock)

    def context(self, input_ids, attention_mask):
        T = input_ids.shape[1]
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
        allowed = causal[None, None]
        if attention_mask is not None:
            allowed = allowed & attention_mask[:, None, None, :].bool()
        mask = (1.0 - allowed.to(self.wte.weight.dtype)) * -1e9
        return (mask,)


# --------------------------------------------------------------------------------------------------
# einsum attention over [B, L, H, D] operands (heads in dim 2, no transpose), finfo.min additive mask


class EinsumBLHDAttention(EinsumAttention):
    def forward(self, x, mask):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, HS).unbind(2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(HS)
        scores = scores + mask
        probs = F.softmax(scores, dim=-1)
        o = torch.einsum("bhqk,bkhd->bqhd", probs, v)
        return self.out(o.reshape(B, T, DIM))


class EinsumBLHDBlock(EinsumBlock):
    def __init__(self):
        super().__init__()
        self.attn = EinsumBLHDAttention()


class EinsumBLHD(EinsumMinus1e9):
    """Einsum scores ``bqhd,bkhd->bhqk`` and output ``bhqk,bkhd->bqhd`` on [B, L, H, D] q, k, v; the additive
    causal + padding mask filled with ``finfo.min``."""

    def __init__(self):
        Decoder.__init__(self, EinsumBLHDBlock)

    def context(self, input_ids, attention_mask):
        T = input_ids.shape[1]
        allowed = torch.tril(torch.ones(T, T, dtype=torch.bool))[None, None]
        if attention_mask is not None:
            allowed = allowed & attention_mask[:, None, None, :].bool()
        dtype = self.wte.weight.dtype
        return (torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min),)


# --------------------------------------------------------------------------------------------------
# F.scaled_dot_product_attention with an additive -1e9 float mask as attn_mask


class SdpaAdditiveAttention(EinsumAttention):
    def forward(self, x, mask):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, HS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(B, T, DIM))


class SdpaAdditiveBlock(EinsumBlock):
    def __init__(self):
        super().__init__()
        self.attn = SdpaAdditiveAttention()


class SdpaAdditiveMinus1e9(EinsumMinus1e9):
    """SDPA whose ``attn_mask`` is the float mask ``(1 - causal & padding) * -1e9`` (causal part and padding part
    added)."""

    def __init__(self):
        Decoder.__init__(self, SdpaAdditiveBlock)

    def context(self, input_ids, attention_mask):
        T = input_ids.shape[1]
        dtype = self.wte.weight.dtype
        mask = ((1.0 - torch.tril(torch.ones(T, T, dtype=dtype))) * -1e9)[None, None]
        if attention_mask is not None:
            mask = mask + (1.0 - attention_mask[:, None, None, :].to(dtype)) * -1e9
        return (mask,)


# --------------------------------------------------------------------------------------------------
# LoRA adapters on q and v (peft style: base(x) + lora_B(lora_A(dropout(x))) * scaling)


class LoraLinear(nn.Module):
    def __init__(self, d_in, d_out, r=4, alpha=8):
        super().__init__()
        self.base_layer = nn.Linear(d_in, d_out, bias=False)
        self.lora_A = nn.Linear(d_in, r, bias=False)
        self.lora_B = nn.Linear(r, d_out, bias=False)
        self.lora_dropout = nn.Dropout(0.0)
        self.scaling = alpha / r
        self.base_layer.weight.requires_grad_(False)

    def forward(self, x):
        result = self.base_layer(x)
        return result + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


class LoraAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = LoraLinear(DIM, DIM)
        self.k_proj = nn.Linear(DIM, DIM, bias=False)
        self.v_proj = LoraLinear(DIM, DIM)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x, mask):
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, HEADS, HS).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, DIM))


class LoraBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = LoraAttention()
        self.mlp = SwiGLU()
        self.n1, self.n2 = nn.RMSNorm(DIM), nn.RMSNorm(DIM)

    def forward(self, x, mask):
        x = x + self.attn(self.n1(x), mask)
        return x + self.mlp(self.n2(x))


class LoraLlama(Decoder):
    """LoRA on q/v, nn.RMSNorm, a bool causal & padding mask."""

    uses_mask = True

    def __init__(self):
        super().__init__(LoraBlock, norm=lambda: nn.RMSNorm(DIM))

    def context(self, input_ids, attention_mask):
        T = input_ids.shape[1]
        idx = torch.arange(T)
        mask = (idx[:, None] >= idx[None, :])[None, None]
        if attention_mask is not None:
            mask = mask & attention_mask[:, None, None, :].bool()
        return (mask,)


class TorchRMSNormBlock(nn.Module):
    """torch.rms_norm called directly (with a weight), SDPA is_causal."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.ones(DIM)), nn.Parameter(torch.ones(DIM))
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)
        self.mlp = SwiGLU()

    def forward(self, x):
        B, T, _ = x.shape
        h = torch.rms_norm(x, (DIM,), self.w1, 1e-6)
        q, k, v = self.qkv(h).view(B, T, 3, HEADS, HS).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, DIM))
        return x + self.mlp(torch.rms_norm(x, (DIM,), self.w2, 1e-6))


class TorchRMSNorm(Decoder):
    def __init__(self):
        super().__init__(TorchRMSNormBlock, norm=lambda: nn.RMSNorm(DIM))


# --------------------------------------------------------------------------------------------------
# ALiBi (a per-head linear position bias on the scores) and attention sinks; biases that must fall back


def alibi_slopes(n_heads: int) -> torch.Tensor:
    start = 2 ** (-(2 ** -(math.log2(n_heads) - 3)))
    return torch.tensor([start * start ** i for i in range(n_heads)], dtype=torch.float64)


class AlibiAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out = nn.Linear(DIM, DIM, bias=False)
        self.register_buffer("slopes", alibi_slopes(HEADS), persistent=False)
        self.register_buffer("bias", torch.tril(torch.ones(MAX_SEQ, MAX_SEQ)).view(1, 1, MAX_SEQ, MAX_SEQ))

    def position_bias(self, T):
        pos = torch.arange(T)
        return self.slopes[:, None, None] * (pos[None, :] - pos[:, None])[None]  # [H, T, T]

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, HS).permute(2, 0, 3, 1, 4)
        alibi = self.position_bias(T)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(HS)) + alibi.to(q.dtype)
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v
        return self.out(y.transpose(1, 2).reshape(B, T, DIM))


class AlibiBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = AlibiAttention()
        self.mlp = nn.Sequential(nn.Linear(DIM, 64), nn.GELU(), nn.Linear(64, DIM))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Alibi(Decoder):
    def __init__(self):
        super().__init__(AlibiBlock)


class QuadraticBiasAttention(AlibiAttention):
    """A per-head bias that is not ALiBi: quadratic in the distance."""

    def position_bias(self, T):
        pos = torch.arange(T)
        return self.slopes[:, None, None] * ((pos[None, :] - pos[:, None]) ** 2)[None]


class QuadraticBiasBlock(AlibiBlock):
    def __init__(self):
        super().__init__()
        self.attn = QuadraticBiasAttention()


class QuadraticBias(Decoder):
    def __init__(self):
        super().__init__(QuadraticBiasBlock)


class LearnedSlopeAttention(AlibiAttention):
    """ALiBi whose slopes are trained parameters: tree attention's differentiable ``slopes``."""

    def __init__(self):
        super().__init__()
        del self.slopes
        self.slopes = nn.Parameter(alibi_slopes(HEADS).to(torch.get_default_dtype()))


class LearnedSlopeBlock(AlibiBlock):
    def __init__(self):
        super().__init__()
        self.attn = LearnedSlopeAttention()


class LearnedSlopes(Decoder):
    def __init__(self):
        super().__init__(LearnedSlopeBlock)


class LogSlopeAttention(AlibiAttention):
    """Trained ALiBi slopes parametrised by their logarithm, the bias built as [1, H, 1, 1] slopes times the
    distance (the slope is ``exp(log_slopes)``: its gradient passes through ``exp``)."""

    def __init__(self):
        super().__init__()
        del self.slopes
        self.log_slopes = nn.Parameter(alibi_slopes(HEADS).log().to(torch.get_default_dtype()))

    def position_bias(self, T):
        pos = torch.arange(T)
        return self.log_slopes.exp().view(1, HEADS, 1, 1) * (pos[None, :] - pos[:, None])


class LogSlopeBlock(AlibiBlock):
    def __init__(self):
        super().__init__()
        self.attn = LogSlopeAttention()


class LogSlopes(Decoder):
    def __init__(self):
        super().__init__(LogSlopeBlock)


class RelativeTableAttention(AlibiAttention):
    """A learned relative-position table (T5-like, one bias per head and distance): not ALiBi (refused)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(0.1 * torch.randn(HEADS, MAX_SEQ))

    def position_bias(self, T):
        pos = torch.arange(T)
        return self.table[:, (pos[:, None] - pos[None, :]).clamp(min=0)]


class RelativeTableBlock(AlibiBlock):
    def __init__(self):
        super().__init__()
        self.attn = RelativeTableAttention()


class RelativeTable(Decoder):
    def __init__(self):
        super().__init__(RelativeTableBlock)


class SinkAttention(nn.Module):
    """gpt-oss style learned sink logits: one extra logit per head joins the softmax, then is dropped."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out = nn.Linear(DIM, DIM, bias=False)
        self.sinks = nn.Parameter(torch.randn(HEADS))

    def forward(self, x, mask):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, HS).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(2, 3)) * HS ** -0.5
        scores = scores + mask
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(B, -1, T, -1)
        combined = torch.cat([scores, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined, dim=-1)
        scores = probs[..., :-1]
        y = torch.matmul(scores, v)
        return self.out(y.transpose(1, 2).reshape(B, T, DIM))


class SinkBlock(AlibiBlock):
    def __init__(self):
        super().__init__()
        self.attn = SinkAttention()

    def forward(self, x, mask):
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class AttentionSinks(Decoder):
    def __init__(self):
        super().__init__(SinkBlock)

    def context(self, input_ids, attention_mask):
        T = input_ids.shape[1]
        dtype = self.wte.weight.dtype
        return (torch.triu(torch.full((T, T), torch.finfo(dtype).min, dtype=dtype), diagonal=1)[None, None],)


# --------------------------------------------------------------------------------------------------
# 3-D attention: bmm on [B*H, T, HS] views (the Megatron/BLOOM spelling), scores viewed as [B, H, T, T] for the
# mask and the softmax, probabilities viewed back for the bmm with the values


class Bmm3DAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=True)
        self.proj = nn.Linear(DIM, DIM, bias=True)

    def forward(self, x, causal):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, HEADS, 3, HS).permute(3, 0, 2, 1, 4)
        q3 = q.reshape(B * HEADS, T, HS)
        k3 = k.reshape(B * HEADS, T, HS)
        v3 = v.reshape(B * HEADS, T, HS)
        scores = torch.bmm(q3, k3.transpose(1, 2)).view(B, HEADS, T, T) / math.sqrt(HS)
        scores = scores.masked_fill(~causal[:T, :T], float("-inf"))
        probs = F.softmax(scores, dim=-1)
        ctx = torch.bmm(probs.view(B * HEADS, T, T), v3).view(B, HEADS, T, HS)
        return self.proj(ctx.permute(0, 2, 1, 3).reshape(B, T, DIM))


class Bmm3DBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Bmm3DAttention()
        self.mlp = nn.Sequential(nn.Linear(DIM, 64), nn.GELU(), nn.Linear(64, DIM))

    def forward(self, x, causal):
        x = x + self.attn(self.ln1(x), causal)
        return x + self.mlp(self.ln2(x))


class Bmm3D(Decoder):
    """3-D ``bmm`` attention on merged (batch, head) views, plain causal mask from a ``[T, T]`` buffer."""

    def __init__(self):
        super().__init__(Bmm3DBlock)
        self.register_buffer("causal", torch.tril(torch.ones(MAX_SEQ, MAX_SEQ, dtype=torch.bool)), persistent=False)

    def context(self, input_ids, attention_mask):
        return (self.causal,)


# --------------------------------------------------------------------------------------------------
# HF BART-family attention (BartAttention of transformers 4.x; MVP, TrOCR, XGLM today): q scaled before the
# product, [B*H, T, HS] views, the mask added to the [B, H, T, T] view of the scores, the softmax of the
# [B*H, T, T] view, dropout, bmm with the values


class BartAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.scaling = HS ** -0.5
        # k_proj without its bias here: the softmax does not see a shift shared by all keys, so that bias's exact
        # gradient is 0 and its rounding noise has no scale of its own to be measured against
        self.k_proj = nn.Linear(DIM, DIM, bias=False)
        self.v_proj, self.q_proj = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.out_proj = nn.Linear(DIM, DIM)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, HEADS, HS).transpose(1, 2).contiguous()

    def forward(self, hidden_states, attention_mask):
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
        value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
        proj_shape = (bsz * HEADS, -1, HS)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.reshape(*proj_shape)
        value_states = value_states.reshape(*proj_shape)
        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        attn_weights = attn_weights.view(bsz, HEADS, tgt_len, src_len) + attention_mask
        attn_weights = attn_weights.view(bsz * HEADS, tgt_len, src_len)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_probs = nn.functional.dropout(attn_weights, p=0.0, training=self.training)
        attn_output = torch.bmm(attn_probs, value_states)
        attn_output = attn_output.view(bsz, HEADS, tgt_len, HS).transpose(1, 2)
        return self.out_proj(attn_output.reshape(bsz, tgt_len, DIM))


class BartBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = BartAttention()
        self.self_attn_layer_norm, self.final_layer_norm = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, 64), nn.Linear(64, DIM)

    def forward(self, hidden_states, attention_mask):  # post-norm, as BART
        hidden_states = self.self_attn_layer_norm(hidden_states + self.self_attn(hidden_states, attention_mask))
        return self.final_layer_norm(hidden_states + self.fc2(F.gelu(self.fc1(hidden_states))))


class Bart(Decoder):
    """BART-family decoder: learned positions, the 4-D additive causal + padding mask of HF's
    ``_prepare_4d_causal_attention_mask``."""

    uses_mask = True

    def __init__(self):
        super().__init__(BartBlock)
        self.embed_positions = nn.Embedding(MAX_SEQ, DIM)

    def embed(self, input_ids):
        return self.wte(input_ids) + self.embed_positions(torch.arange(input_ids.shape[1]))

    def context(self, input_ids, attention_mask):
        T = input_ids.shape[1]
        dtype = self.wte.weight.dtype
        mask = torch.full((T, T), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]
        if attention_mask is not None:
            inverted = 1.0 - attention_mask[:, None, None, :].to(dtype)
            mask = mask.masked_fill(inverted.bool(), torch.finfo(dtype).min)
        return (mask,)


# --------------------------------------------------------------------------------------------------
# OpenAI GPT-1 (HF modeling_openai.py): the key split straight into k^T by permute(0, 2, 3, 1), a multiplicative
# causal mask ``w * b + -1e4 * (1 - b)`` with b a [1, 1, T, T] 0/1 tril buffer, post-norm blocks


class OpenAIGPTAttention(nn.Module):
    def __init__(self, fill=-1e4):
        super().__init__()
        self.fill = fill
        self.c_attn = nn.Linear(DIM, 3 * DIM)
        self.c_proj = nn.Linear(DIM, DIM)
        self.register_buffer("bias", torch.tril(torch.ones(MAX_SEQ, MAX_SEQ)).view(1, 1, MAX_SEQ, MAX_SEQ),
                             persistent=False)

    def split_heads(self, x, k=False):
        x = x.view(*x.size()[:-1], HEADS, x.size(-1) // HEADS)
        return x.permute(0, 2, 3, 1) if k else x.permute(0, 2, 1, 3)

    def forward(self, x):
        query, key, value = self.c_attn(x).split(DIM, dim=2)
        q, k, v = self.split_heads(query), self.split_heads(key, k=True), self.split_heads(value)
        w = torch.matmul(q, k)
        w = w / math.sqrt(v.size(-1))
        b = self.bias[:, :, : w.size(-2), : w.size(-1)]
        w = w * b + self.fill * (1 - b)
        w = nn.functional.softmax(w, dim=-1)
        w = nn.functional.dropout(w, p=0.0, training=self.training)
        a = torch.matmul(w, v).permute(0, 2, 1, 3).contiguous()
        return self.c_proj(a.view(*a.size()[:-2], DIM))


class OpenAIGPTBlock(nn.Module):
    def __init__(self, fill=-1e4):
        super().__init__()
        self.attn = OpenAIGPTAttention(fill)
        self.ln_1, self.ln_2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.fc, self.proj = nn.Linear(DIM, 64), nn.Linear(64, DIM)

    def forward(self, x):  # post-norm, as GPT-1
        n = self.ln_1(x + self.attn(x))
        return self.ln_2(n + self.proj(F.gelu(self.fc(n))))


class OpenAIGPT(Decoder):
    """GPT-1: learned positions, the multiplicative causal mask, no final norm."""

    def __init__(self, fill=-1e4):
        super().__init__(lambda: OpenAIGPTBlock(fill), norm=nn.Identity)
        self.positions = nn.Embedding(MAX_SEQ, DIM)

    def embed(self, input_ids):
        return self.wte(input_ids) + self.positions(torch.arange(input_ids.shape[1]))


class SoftMultiplicativeMask(OpenAIGPT):
    """GPT-1's blend ``w * b + c * (1 - b)`` with a fill ``c = -10`` that does not block: a bias, not a mask."""

    def __init__(self):
        super().__init__(fill=-10.0)


# --------------------------------------------------------------------------------------------------
# Per-key bias (HF Doge's "dynamic mask"): the scores get ``u[b, h, k] = exp(A[h] * softplus(dt(v[b, k])))``,
# a projection of the value states of the key token (one per kv head, repeated to the query heads with the
# mask), merged into the causal mask by ``masked_fill``. A bias of the query and the key token stays refused.


class KeyBiasAttention(HFAttention):
    def __init__(self):
        super().__init__()
        self.A = nn.Parameter(0.5 * torch.randn(2))
        self.dt_proj = nn.Linear(2 * HS, 2)

    def forward(self, hidden_states, cos, sin, attention_mask):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        query_states, key_states = hf_apply_rotary_pos_emb(query_states, key_states, cos, sin)
        dt = self.dt_proj(value_states.transpose(1, 2).reshape(bsz, q_len, -1))
        dt = torch.exp(self.A * F.softplus(dt)).transpose(-1, -2)  # [B, Hkv, L]
        mask = self.bias_mask(dt, query_states, attention_mask)
        mask = hf_repeat_kv(mask, self.num_key_value_groups)
        key_states = hf_repeat_kv(key_states, self.num_key_value_groups)
        value_states = hf_repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.head_dim ** -0.5
        attn_weights = attn_weights + mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)

    def bias_mask(self, dt, query_states, attention_mask):
        mask = dt[:, :, None, :].expand(-1, -1, dt.shape[-1], -1)
        return mask.masked_fill(attention_mask != 0, torch.finfo(dt.dtype).min)


class QueryKeyBiasAttention(KeyBiasAttention):
    """The per-key bias times a function of the query token: not constant along the queries."""

    def bias_mask(self, dt, query_states, attention_mask):
        mask = dt[:, :, None, :] * dt[:, :, :, None]
        return mask.masked_fill(attention_mask != 0, torch.finfo(dt.dtype).min)


class KeyBiasLayer(HFLayer):
    attention = KeyBiasAttention

    def __init__(self):
        super().__init__()
        self.self_attn = self.attention()


class QueryKeyBiasLayer(KeyBiasLayer):
    attention = QueryKeyBiasAttention


class KeyBias(HFLlama):
    layer = KeyBiasLayer

    def __init__(self):
        Decoder.__init__(self, self.layer, norm=HFRMSNorm)
        self.rotary_emb = HFRotaryEmbedding()


class QueryKeyBias(KeyBias):
    layer = QueryKeyBiasLayer


# --------------------------------------------------------------------------------------------------
# positions expanded over the rows (HF ModernBERT-decoder and others: ``arange(L)[None].expand(B, -1)``)


class ExpandedPositions(HFLlama):
    """HF Llama whose ``position_ids`` are ``cache_position.unsqueeze(0).expand(bsz, -1)``: a position-only
    value broadcast over the rows, never a row dim of a packed value."""

    def context(self, input_ids, attention_mask):
        bsz, seq_len = input_ids.shape
        position_ids = torch.arange(seq_len, device=input_ids.device).unsqueeze(0).expand(bsz, -1)
        dtype = self.wte.weight.dtype
        min_dtype = torch.finfo(dtype).min
        causal_mask = torch.triu(torch.full((seq_len, seq_len), fill_value=min_dtype, dtype=dtype), diagonal=1)
        causal_mask = causal_mask[None, None, :, :].expand(bsz, 1, -1, -1)
        if attention_mask is not None:
            padding_mask = causal_mask + attention_mask[:, None, None, :].to(dtype)
            causal_mask = causal_mask.masked_fill(padding_mask == 0, min_dtype)
        cos, sin = self.rotary_emb(self.wte.weight, position_ids)
        return cos, sin, causal_mask


# --------------------------------------------------------------------------------------------------
# Mixture of experts, written as public codebases write them, in an HF Llama layer (E experts, top-K)

MOE_EXPERTS, MOE_TOP_K, MOE_FF = 4, 2, 48


class HF4MixtralSparseMoe(nn.Module):
    """HF transformers 4.x ``MixtralSparseMoeBlock``: softmax router, top-k, a one-hot expert mask, per expert
    ``torch.where`` (a graph break: its output size depends on the data), ``hidden_states[None, top_x]`` and
    ``index_add_`` into the output. HF's ``dtype=torch.float`` softmax is spelled with the model's dtype so
    the float64 test stays float64."""

    def __init__(self):
        super().__init__()
        self.hidden_dim, self.num_experts, self.top_k = DIM, MOE_EXPERTS, MOE_TOP_K
        self.gate = nn.Linear(DIM, MOE_EXPERTS, bias=False)
        self.experts = nn.ModuleList([SwiGLU() for _ in range(MOE_EXPERTS)])

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=hidden_states.dtype)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros((batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype,
                                          device=hidden_states.device)
        expert_mask = torch.nn.functional.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)


class GptFastMoEFeedForward(nn.Module):
    """gpt-fast ``mixtral-moe/model.py``: ``MOEFeedForward`` + ``ConditionalFeedForward``, each token's expert
    weights gathered as ``w1[expert_indices]`` ([T, A, FF, D]) and contracted with einsum."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(DIM, MOE_EXPERTS, bias=False)
        self.w1 = nn.Parameter(torch.randn(MOE_EXPERTS, MOE_FF, DIM) * 0.2)
        self.w2 = nn.Parameter(torch.randn(MOE_EXPERTS, DIM, MOE_FF) * 0.2)
        self.w3 = nn.Parameter(torch.randn(MOE_EXPERTS, MOE_FF, DIM) * 0.2)
        self.dim, self.num_activated_experts = DIM, MOE_TOP_K

    def cond_ffn(self, x, expert_indices):
        w1_weights = self.w1[expert_indices]  # [T, A, D, D]
        w3_weights = self.w3[expert_indices]  # [T, A, D, D]
        w2_weights = self.w2[expert_indices]  # [T, A, D, D]
        x1 = F.silu(torch.einsum('ti,taoi -> tao', x, w1_weights))
        x3 = torch.einsum('ti, taoi -> tao', x, w3_weights)
        return torch.einsum('tao, taio -> tai', (x1 * x3), w2_weights)

    def forward(self, x):
        B, L, _ = x.shape
        x = x.view(-1, self.dim)
        scores = self.gate(x)  # [T, E]
        expert_weights = F.softmax(scores, dim=-1)
        expert_weights, expert_indices = torch.topk(expert_weights, self.num_activated_experts, dim=-1)
        expert_weights /= expert_weights.sum(dim=-1, keepdim=True)  # [T, A]
        expert_outs = self.cond_ffn(x, expert_indices)
        return torch.einsum('tai,ta -> ti', expert_outs, expert_weights).view(B, L, -1)


class CountedGptFastMoEFeedForward(GptFastMoEFeedForward):
    """gpt-fast's MoE with torchtitan's load counter: ``tokens_per_expert.add_(histc(expert ids))`` under
    ``no_grad`` in the forward (a buffer the graph writes into; torchtitan balances its experts with it)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("tokens_per_expert", torch.zeros(MOE_EXPERTS), persistent=False)

    def forward(self, x):
        B, L, _ = x.shape
        x = x.view(-1, self.dim)
        expert_weights = F.softmax(self.gate(x), dim=-1)
        expert_weights, expert_indices = torch.topk(expert_weights, self.num_activated_experts, dim=-1)
        num_tokens_per_expert = torch.histc(expert_indices.view(-1).to(x.dtype), bins=MOE_EXPERTS, min=0,
                                            max=MOE_EXPERTS)
        with torch.no_grad():
            self.tokens_per_expert.add_(num_tokens_per_expert)
        expert_weights = expert_weights / expert_weights.sum(dim=-1, keepdim=True)
        expert_outs = self.cond_ffn(x, expert_indices)
        return torch.einsum('tai,ta -> ti', expert_outs, expert_weights).view(B, L, -1)


def moe_llama(moe):
    """An HF Llama (zoo ``HFLlama``) whose MLPs are ``moe()`` blocks."""

    class Layer(HFLayer):
        def __init__(self):
            super().__init__()
            self.mlp = moe()

    class MoELlama(HFLlama):
        def __init__(self):
            Decoder.__init__(self, Layer, norm=HFRMSNorm)
            self.rotary_emb = HFRotaryEmbedding()

    MoELlama.__name__ = MoELlama.__qualname__ = f"{moe.__name__}Llama"
    return MoELlama


HF4MixtralLoop = moe_llama(HF4MixtralSparseMoe)
GptFastMoE = moe_llama(GptFastMoEFeedForward)
CountedGptFastMoE = moe_llama(CountedGptFastMoEFeedForward)


#: style name -> model class (replays: exact and shared)
REPLAY = {
    "nanogpt_flash": NanoGPT,
    "nanogpt_manual": NanoGPTManual,
    "mingpt": MinGPT,
    "torchtitan_llama": TorchTitanLlama,
    "nn_rmsnorm_llama": NNRMSNormLlama,
    "gpt_fast": GptFast,
    "lit_gpt": LitGPT,
    "olmo": OLMo,
    "hf_llama": HFLlama,
    "gptj": GPTJ,
    "einsum_minus_1e9": EinsumMinus1e9,
    "einsum_blhd": EinsumBLHD,
    "sdpa_additive_minus_1e9": SdpaAdditiveMinus1e9,
    "lora_llama": LoraLlama,
    "torch_rms_norm": TorchRMSNorm,
    "alibi": Alibi,
    "learned_alibi_slopes": LearnedSlopes,
    "learned_log_alibi_slopes": LogSlopes,
    "attention_sinks": AttentionSinks,
    "bmm_3d": Bmm3D,
    "hf_bart": Bart,
    "openai_gpt": OpenAIGPT,
    "key_bias": KeyBias,
    "positions_expanded_over_rows": ExpandedPositions,
    "gpt_fast_moe": GptFastMoE,
}

#: styles whose graph breaks (an experts loop on data-dependent sizes): exact and shared, their attention
#: not in the last graph (tested apart from REPLAY)
GRAPH_BREAKS = {
    "hf4_mixtral_loop": HF4MixtralLoop,
}

#: style name -> (model class, a phrase the fallback reason must contain)
FALLBACK = {
    "quadratic_bias": (QuadraticBias, "not ALiBi"),
    "relative_position_table": (RelativeTable, "trainable tensor"),
    "soft_multiplicative_mask": (SoftMultiplicativeMask, "does not block"),
    "query_key_bias": (QueryKeyBias, "per-token bias"),
}


def make(cls, dtype=torch.float64, seed=0):
    """A model of ``cls`` with deterministic random weights (LoRA B not zero), built in ``dtype`` (as the
    default dtype, so complex buffers such as torchtitan's ``freqs_cis`` keep their imaginary part)."""
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = cls()
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.normal_(0, 0.2)
    return model
