"""The post-rewrite soundness check (passes/check.py): a packed graph that only holds for the example's
packed token count is refused at compile time — the original graph runs, with the reason — instead of
crashing (or worse) at run time."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import brcompile
from brcompile.testing import assert_exact


class ExpandedPositions(nn.Module):
    """Learned positions built as ``arange(L)[None].expand(B, -1)`` (HF ModernBERT-decoder's spelling):
    the rewrite keeps the expanded B dim on a packed value, which only fits the example batch."""

    def __init__(self, vocab=37, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.emb, self.pos = nn.Embedding(vocab, dim), nn.Embedding(64, dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, vocab)

    def forward(self, ids):
        B, L = ids.shape
        h = self.emb(ids) + self.pos(torch.arange(L, device=ids.device)[None].expand(B, -1))
        q, k, v = self.qkv(h).view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(B, L, -1))


def test_batch_dim_left_on_a_packed_value_is_refused_at_compile_time():
    model = ExpandedPositions().double()
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.randint(1, 37, (1, 12), generator=g).expand(4, -1),
                     torch.randint(1, 37, (4, 3), generator=g)], 1)

    def fn(ids):
        return model(ids).log_softmax(-1).mean()

    backend = brcompile.backend(compiler="eager")
    out = torch.compile(fn, backend=backend, dynamic=False)(ids)  # strict suite: nothing may raise
    assert_exact(out, fn(ids), torch.float64, "loss (original graph)")
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls == 1, str(s)
    assert not backend.records[0].rewritten
    assert "does not hold for every packed token count N" in backend.records[0].reason, backend.records[0].reason
