"""Per-token rules end to end (float64, loss and every gradient vs eager, the call replayed with fewer
executed tokens): ``polar`` of position-only frequencies (a complex rotary table), one constant array index
on a feature dim (Falcon's fused ``qkv[..., [-2], :]``), ``scatter`` along a non-token dim (a router's
per-token mask), ``max``/``min`` over the features and elementwise, GPT-2's ``addmm`` and RecurrentGemma's
per-head ``baddbmm`` over flattened tokens, ``x[mask] = 0`` / ``x[..., a:b] = v`` into fresh values
(passes/lower/functionalize.py), ``new_zeros`` / ``new_full`` in a token value's shape (Inkling2's empty stack of
block states), and ``torch.linalg.vector_norm`` with its dim as the third positional argument."""
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import replay_exact

V, D, H = 11, 8, 2


class Block(torch.nn.Module):
    """Embedding -> a per-token ``mix`` -> causal attention over 2 heads -> sum of squares."""

    def __init__(self, variant):
        super().__init__()
        torch.manual_seed(0)
        self.variant = variant
        self.emb = torch.nn.Embedding(V, D)
        self.qkv = torch.nn.Parameter(torch.randn(D, 3 * D) / D ** 0.5)
        self.bias = torch.nn.Parameter(torch.randn(3 * D))
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, D // H, 2).double() / (D // H)))

    def rotate(self, x):  # x [B, H, L, hd]: complex rotary from polar(ones_like(freqs), freqs)
        L = x.shape[2]
        freqs = torch.arange(L, dtype=x.dtype)[:, None] * self.inv_freq
        cis = torch.polar(torch.ones_like(freqs), freqs)
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(z * cis).flatten(3)

    def forward(self, ids):
        B, L = ids.shape
        if self.variant == "setitem":  # Gemma3's ids = input_ids.clone(); ids[image_mask] = 0
            ids = ids.clone()
            ids[ids == 3] = 0
        h = self.emb(ids)
        if self.variant == "addmm":  # GPT-2's Conv1D
            qkv = torch.addmm(self.bias, h.view(-1, D), self.qkv).view(B, L, 3 * D)
        elif self.variant == "baddbmm":  # RecurrentGemma's block-diagonal linear: one [D/H, 3D/H] block per head
            blocks = self.qkv.view(H, D // H, H, 3 * D // H).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
            x = h.reshape(B * L, H, D // H).permute(1, 0, 2)  # [H, B*L, D/H]: the flattened tokens are the rows
            qkv = torch.baddbmm(self.bias.view(H, 1, 3 * D // H), x, blocks, alpha=0.5)
            qkv = qkv.transpose(0, 1).reshape(B, L, 3 * D)
        else:
            qkv = h @ self.qkv + self.bias
        q, k, v = qkv.view(B, L, 3, H, D // H).transpose(1, 3).unbind(2)  # [B, H, L, hd] each
        if self.variant == "array_index":  # one head of keys and values, Falcon's qkv[..., [-2], :]
            fused = qkv.view(B, L, 3 * H, D // H)
            k = fused[..., [-2], :].transpose(1, 2).expand(B, H, L, D // H)
            v = fused[..., [-1], :].transpose(1, 2).expand(B, H, L, D // H)
        if self.variant == "polar":
            q, k = self.rotate(q), self.rotate(k)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, D)
        if self.variant == "scatter":  # keep each token's top-2 features (a router's per-token mask)
            keep = torch.zeros_like(o).scatter(-1, o.topk(2, dim=-1)[1], 1.0)
            o = o * keep
        if self.variant == "max":  # a per-token max over the features (values and indices), an elementwise max
            top, idx = o.max(dim=-1, keepdim=True)
            o = torch.max(o - top, 0.5 * o) * (idx + 1) + torch.min(o, dim=-1).values[..., None]
        if self.variant == "setitem":  # a buffer written by slices (functionalised to cat)
            out = torch.zeros_like(o)
            out[..., : D // 2] = o[..., D // 2:] * 2
            out[..., D // 2:] = o[..., : D // 2]
            o = out
        if self.variant == "new_zeros":  # Inkling2's stack of block states, started empty in a token value's shape
            stack = o.new_zeros(*o.shape[:-1], 0, D)
            stack = torch.cat([stack, o.unsqueeze(-2), h.unsqueeze(-2)], -2)
            o = stack.softmax(-2).mul(stack).sum(-2) + h.new_full((*h.shape[:-1], 1), 0.5)
        if self.variant == "vector_norm":  # torch.linalg.vector_norm(x, ord, dim, keepdim): its dim is the third
            o = o / torch.linalg.vector_norm(o, 2, -1, True)  # per token (over the features)
            o = o * torch.linalg.vector_norm(o, 2, 1, True)  # over the positions: mixes tokens, computed dense
        return o.square().sum()


@pytest.mark.parametrize("variant,dynamic", [("polar", False), ("polar", True), ("array_index", False),
                                             ("scatter", False), ("addmm", True), ("baddbmm", True),
                                             ("setitem", False), ("max", False), ("new_zeros", False),
                                             ("new_zeros", True), ("vector_norm", False)])
def test_per_token_rule_replays_exactly(variant, dynamic):
    backend = replay_exact(Block(variant), dynamic=dynamic)
    rec = backend.records[0]
    assert rec.rewritten, rec.reason
    if variant == "polar":  # the packed graph builds the table as a (real, imaginary) pair (rules/pointwise.py)
        assert "polar" not in rec.packed_code and "view_as_complex" in rec.packed_code
    assert not rec.repacked, rec.repacked  # every value has a per-token rule: no dense region packed again
    mats = [f"{node} (for {user})" for node, user, *_ in rec.materialisations]
    assert all(("getitem" not in m and "scatter" not in m and "addmm" not in m and "cat" not in m
                and "max" not in m and "min" not in m and "new_" not in m) for m in mats), mats
