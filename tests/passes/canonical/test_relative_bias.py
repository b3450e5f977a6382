"""The canonicalisation's relative bias (passes/canonical/attention/ ``_relative_bias``) and its proof on the mask
probes (passes/analysis/masks/, the table a free random value), on hand-written models in float64.

A bias ``gather(T, -1, idx)`` of a per-query table ``T = linear(h)`` [B, H, L, E] of the query token:

* the clamped distance without a fill (``idx = clamp(i - j, 0, E - 1)``, the last column for every farther key)
  in an eager chain — replays exactly, tree attention's relbias without a zero column;
* Inkling's spelling: a zero fill from distance E on, a factor per query row (``tau``, a function of the
  position), the bias inside a native SDPA ``attn_mask`` as ``where(causal, bias, min)`` — replays exactly;
* a bias of the query *and* the key token (the gathered table times a per-key gate of the key's hidden state) is
  no relative bias: refused as a per-token bias, the original graph runs.
"""
import re

import torch
import torch.nn.functional as F

import brcompile
from tests.helpers import replay_exact

V, D, H, E = 11, 16, 2, 3


class _RelLM(torch.nn.Module):
    """Embedding -> one attention with a per-query relative-bias table -> projection -> a scalar."""

    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.emb = torch.nn.Embedding(V, D)
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.rel = torch.nn.Linear(D, H * E)
        self.gate = torch.nn.Linear(D, H) if kind == "query_and_key" else None
        self.out = torch.nn.Linear(D, V)

    def forward(self, ids):
        B, L = ids.shape
        h = self.emb(ids)
        q, k, v = self.qkv(h).view(B, L, 3, H, D // H).permute(2, 0, 3, 1, 4)
        table = self.rel(h).view(B, L, H, E).transpose(1, 2)  # [B, H, L, E]: the query token's row
        pos = torch.arange(L)
        dist = pos[:, None] - pos[None, :]
        bias = table.gather(-1, dist.clamp(0, E - 1).expand(B, H, L, L))
        causal = dist >= 0
        if self.kind == "inkling":
            bias = bias.masked_fill((dist < 0) | (dist >= E), 0.0)
            tau = (1.0 + 0.3 * torch.log((pos + 1.0).clamp(min=1.0))).view(1, 1, L, 1)
            bias = bias * tau
            mask = torch.where(causal, bias, torch.finfo(bias.dtype).min)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            if self.kind == "query_and_key":
                bias = bias * torch.sigmoid(self.gate(h)).transpose(1, 2)[:, :, None, :]  # [B, H, 1, Lk]
            s = q @ k.transpose(-1, -2) * (D // H) ** -0.5 + bias
            s = s.masked_fill(~causal, float("-inf"))
            o = torch.softmax(s, -1) @ v
        return self.out(o.transpose(1, 2).reshape(B, L, D)).log_softmax(-1).pow(2).sum()


def _replays(kind):
    torch._dynamo.reset()
    brcompile.reset_stats()
    backend = replay_exact(_RelLM(kind), vocab=V)
    (rec,) = [r for r in backend.records if r.rewritten]
    call = next(line for line in rec.packed_code.splitlines() if "tree_attention_forward.default(" in line)
    rel = re.search(r"tree_attention_forward\.default\((.*)\);", call).group(1).split(", ")[-1]
    return rel, rec.packed_code


def test_clamped_distance_without_fill_replays():
    """idx = clamp(i - j, 0, E - 1) on rows of 7 > E: the last column for every farther key, no zero column."""
    rel, code = _replays("clamp")
    assert re.search(rf"{rel} = \w+\.squeeze\(0\)", code), code  # the packed table as it is


def test_inkling_spelling_replays():
    """Zero fill, a per-query-row factor and the native SDPA mask ``where(causal, bias, min)``: the packed table is
    the table times the factor, with the zero column appended."""
    rel, code = _replays("inkling")
    assert re.search(rf"{rel} = torch\.cat\(\(\w+, zeros_like", code), code


def test_bias_of_query_and_key_is_refused():
    """The table gathered by distance times a gate of the key token: not a function of the query's table and
    the distance alone; the original graph runs, the reason names a per-token bias."""
    torch._dynamo.reset()
    brcompile.reset_stats()
    model = _RelLM("query_and_key").double()
    ids = torch.randint(1, V - 2, (1, 7)).repeat(3, 1)  # the probes draw token ids up to the largest + 2
    ids[1:, 5:] = 3
    backend = brcompile.backend(compiler="eager")
    want = model(ids)
    got = torch.compile(model, backend=backend)(ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    s = brcompile.stats()
    assert s.fallback_calls == 1 and s.replayed_calls == 0, str(s)
    assert backend.records[-1].code is brcompile.Code.ATTENTION_BIAS, backend.records[-1].reason
    assert "a per-token bias" in backend.records[-1].reason, backend.records[-1].reason
