"""An SDPA whose token dims are its batch dims (passes/analysis/rules/attention.py ``per_token_attention``) is a per-token op,
on hand-written float64 models.

A "depth attention" in the style of Inkling2's block-attention residual: a learned query expanded over (B, L)
attends over each token's own stack of block outputs ([B, L, 1, D] against [B, L, S, D]: no mask, not causal, the
attention's sequence dim the stack). Beside a causal attention over the tokens it replays exactly, stays one SDPA
in the packed code (on [1, N, ...] operands) and is not a tree attention; an SDPA over the positions without mask
or ``is_causal`` (bidirectional) is still refused.
"""
import re

import pytest
import torch
import torch.nn.functional as F

import brcompile
from tests.helpers import replay_exact

V, D, H = 11, 16, 2


class _DepthLM(torch.nn.Module):
    """Embedding -> causal attention -> an MLP -> depth attention of a learned query over each token's stack of
    (embedding, attention out, MLP out) -> projection -> a scalar. ``kind``: "expand" (the query expanded over
    (B, L), Inkling2's spelling), "token" (a query projected from the token's hidden state), "alone" (the expanded
    query without the causal attention: the graph's only SDPA is the depth attention), "bidirectional" (the depth
    attention replaced by an attention over the positions without a mask)."""

    def __init__(self, kind: str = "expand"):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.emb = torch.nn.Embedding(V, D)
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.mlp = torch.nn.Linear(D, D)
        self.query = torch.nn.Parameter(torch.randn(D)) if kind in ("expand", "alone") else None
        self.qproj = torch.nn.Linear(D, D) if kind == "token" else None
        self.out = torch.nn.Linear(D, V)

    def forward(self, ids):
        B, L = ids.shape
        h0 = self.emb(ids)
        if self.kind == "alone":
            h1 = h0 + torch.sigmoid(self.qkv(h0)[..., :D])
        else:
            q, k, v = self.qkv(h0).view(B, L, 3, H, D // H).permute(2, 0, 3, 1, 4)
            h1 = h0 + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, D)
        h2 = h1 + torch.tanh(self.mlp(h1))
        stack = torch.stack([h0, h1, h2], dim=-2)  # [B, L, S=3, D]: each token's block outputs
        stack = stack * torch.rsqrt(stack.pow(2).mean(-1, keepdim=True) + 1e-6)
        if self.kind == "bidirectional":
            o = F.scaled_dot_product_attention(h2[:, None], h2[:, None], h2[:, None])[:, 0]  # over the positions
        else:
            if self.kind != "token":
                query = self.query.view(-1, D).expand(*stack.shape[:-2], -1, -1)  # [B, L, 1, D]
            else:
                query = self.qproj(h2)[:, :, None, :]
            o = F.scaled_dot_product_attention(query, stack, stack, scale=D ** -0.5)[:, :, 0]
        return self.out(o + h2).log_softmax(-1).pow(2).sum()


def _replayed_code(kind):
    torch._dynamo.reset()
    brcompile.reset_stats()
    backend = replay_exact(_DepthLM(kind), vocab=V)
    (rec,) = [r for r in backend.records if r.rewritten]
    return rec.packed_code


@pytest.mark.parametrize("kind", ["expand", "token", "alone"])
def test_depth_attention_is_a_per_token_sdpa(kind):
    """Loss and every gradient exact; the causal attention is the one tree attention (none when alone), the depth
    attention one SDPA on packed operands (a [1, N, 1, D] query: the learned one expanded to the packed token
    count)."""
    code = _replayed_code(kind)
    assert code.count("tree_attention_forward.default(") == (kind != "alone"), code
    calls = re.findall(r"scaled_dot_product_attention\((\w+), (\w+), (\w+)", code)
    assert len(calls) == 1, code
    query = calls[0][0]
    if kind != "token":
        assert re.search(rf"{query} = \w+\.expand\(1, \w+, 1, {D}\)", code), code


def test_bidirectional_attention_over_positions_is_refused():
    """An SDPA over the positions without mask or is_causal is no per-token op: the original graph runs."""
    torch._dynamo.reset()
    brcompile.reset_stats()
    model = _DepthLM("bidirectional").double()
    ids = torch.randint(1, V, (3, 7))
    backend = brcompile.backend(compiler="eager")
    got = torch.compile(model, backend=backend)(ids)
    torch.testing.assert_close(got, model(ids), rtol=0, atol=0)
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls == 1, str(s)
    assert s.fallback_codes == {brcompile.Code.MASK_NOT_CAUSAL: 1}, str(s)
