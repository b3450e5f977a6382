"""SDPA head counts without ``enable_gqa`` (passes/analysis/rules/attention.py: head_counts_unsupported): SDPA
broadcasts the head dim like a batch dim, so a one-head k and/or v beside Hq query heads (multi-query
attention: Falcon) is accepted and becomes tree attention with GQA grouping (or a one-head k/v expanded);
head counts SDPA itself rejects are not reached, a one-head query against H kv heads is refused. A value head
dim other than the query/key one (MLA) is zero-padded to one head dim, the output sliced back."""
import pytest
import torch
import torch.nn.functional as F

from brcompile.passes.analysis.rules.attention import head_counts_unsupported
from tests.helpers import replay_exact

V, D, H, HD = 11, 8, 4, 4


class MQA(torch.nn.Module):
    """Embedding -> q [B, H, L, hd], k [B, hk, L, hd], v [B, hv, L, hd] -> causal SDPA -> sum of squares."""

    def __init__(self, hk, hv):
        super().__init__()
        torch.manual_seed(0)
        self.hk, self.hv = hk, hv
        self.emb = torch.nn.Embedding(V, D)
        self.q = torch.nn.Linear(D, H * HD)
        self.k = torch.nn.Linear(D, hk * HD)
        self.v = torch.nn.Linear(D, hv * HD)

    def forward(self, ids):
        B, L = ids.shape
        x = self.emb(ids)
        q = self.q(x).view(B, L, H, HD).transpose(1, 2)
        k = self.k(x).view(B, L, self.hk, HD).transpose(1, 2)
        v = self.v(x).view(B, L, self.hv, HD).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).pow(2).sum()


@pytest.mark.parametrize("hk,hv", [(1, 1), (1, H), (H, 1)])
def test_broadcast_kv_heads(hk, hv):
    """Loss and every gradient equal eager's (float64 bound); the call replayed with fewer executed tokens and
    the attention ran as tree attention."""
    backend = replay_exact(MQA(hk, hv))  # k's bias gradient cancels: assert_grads_exact
    assert "tree_attention" in backend.records[0].packed_code


def test_head_counts_mirror_sdpa():
    """Accepted exactly where SDPA broadcasts (each of k, v with 1 or Hq heads) and, with enable_gqa, where
    Hk == Hv divides Hq; a one-head query against 4 kv heads (SDPA's output then has 4 heads) is refused."""
    assert head_counts_unsupported(4, 4, 4, False) is None
    assert head_counts_unsupported(4, 1, 1, False) is None
    assert head_counts_unsupported(4, 1, 4, False) is None
    assert head_counts_unsupported(4, 2, 2, False) is not None  # SDPA raises: 4 vs 2 do not broadcast
    assert head_counts_unsupported(1, 4, 4, False) is not None
    assert head_counts_unsupported(4, 2, 2, True) is None
    assert head_counts_unsupported(4, 3, 3, True) is not None


class HeadDims(torch.nn.Module):
    """Embedding -> q, k [B, H, L, dqk], v [B, H/2, L, dv] (GQA) -> causal SDPA (default scale dqk^-1/2, or an
    explicit one) -> [B, L, H*dv] -> a projection -> sum of squares."""

    def __init__(self, dqk, dv, scale=None):
        super().__init__()
        torch.manual_seed(0)
        self.dqk, self.dv, self.scale = dqk, dv, scale
        self.emb = torch.nn.Embedding(V, D)
        self.q = torch.nn.Linear(D, H * dqk)
        self.k = torch.nn.Linear(D, H // 2 * dqk)
        self.v = torch.nn.Linear(D, H // 2 * dv)
        self.o = torch.nn.Linear(H * dv, D)

    def forward(self, ids):
        B, L = ids.shape
        x = self.emb(ids)
        q = self.q(x).view(B, L, H, self.dqk).transpose(1, 2)
        k = self.k(x).view(B, L, H // 2, self.dqk).transpose(1, 2)
        v = self.v(x).view(B, L, H // 2, self.dv).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(B, L, H * self.dv)).pow(2).sum()


@pytest.mark.parametrize("dqk,dv,scale", [(6, 4, None), (4, 6, None), (6, 4, 0.3), (3, 7, 0.7)])
def test_value_head_dim_differs(dqk, dv, scale):
    """MLA-style value head dims (smaller and larger than q/k's): loss and every gradient equal eager's in
    float64, the call replayed as tree attention on zero-padded head dims."""
    backend = replay_exact(HeadDims(dqk, dv, scale))
    code = backend.records[0].packed_code
    assert "tree_attention" in code and "zeros_like" in code
