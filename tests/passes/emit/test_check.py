"""The post-rewrite soundness check (passes/emit/check.py): a packed graph that only holds for the example's
packed token count is refused at compile time — the original graph runs, with the reason — instead of
crashing (or worse) at run time."""
import importlib

import torch
import torch.nn as nn
import torch.nn.functional as F

import brcompile
from brcompile.testing import assert_exact


class ExpandedPositions(nn.Module):
    """Learned positions built as ``arange(L)[None].expand(B, -1)`` (HF ModernBERT-decoder's spelling): the
    expanded B dim is the row dim of a position-only value (rules/shape.py), so no packed value keeps it."""

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


def _ids():
    g = torch.Generator().manual_seed(0)
    return torch.cat([torch.randint(1, 37, (1, 12), generator=g).expand(4, -1),
                      torch.randint(1, 37, (4, 3), generator=g)], 1)


def test_positions_expanded_over_rows_replay_for_every_token_count():
    """The packed graph holds for a symbolic N (it used to keep the B dim, refused by this check): two
    batches with different N run one packed graph, exactly."""
    model = ExpandedPositions().double()

    def fn(ids):
        return model(ids).log_softmax(-1).mean()

    backend = brcompile.backend(compiler="eager")
    f = torch.compile(fn, backend=backend, dynamic=False)  # strict suite: nothing may raise
    ids = _ids()
    fewer = ids.clone()
    fewer[1, 12:] = fewer[0, 12:]  # rows 0 and 1 the same: N - 3, same [B, L]
    for batch in (ids, fewer):
        assert_exact(f(batch), fn(batch), torch.float64, "loss")
    s = brcompile.stats()
    assert s.replayed_calls == 2 and s.fallback_calls == 0 and s.executed_tokens < s.logical_tokens, str(s)
    assert len(backend.records) == 1 and backend.records[0].rewritten, backend.records[0].reason


def test_packed_graph_that_fixes_the_token_count_is_refused_at_compile_time(monkeypatch):
    """A rewrite that bakes the example's N into the packed graph (here injected: a view of the position array
    to its example length) is refused before it runs: the original graph runs, the reason names the N."""
    pipeline_mod = importlib.import_module("brcompile.passes.pipeline")  # its "check" stage runs the check
    real = pipeline_mod.check_packed_graph

    def baking(packed, example_args):
        from brcompile.passes.emit.check import token_positions
        at = token_positions(packed)["position"]
        n = example_args[at].shape[0]
        p = [x for x in packed.graph.nodes if x.op == "placeholder"][at]
        with packed.graph.inserting_after(p):
            packed.graph.call_method("view", (p, n))
        packed.recompile()
        return real(packed, example_args)

    monkeypatch.setattr(pipeline_mod, "check_packed_graph", baking)
    model = ExpandedPositions().double()

    def fn(ids):
        return model(ids).log_softmax(-1).mean()

    ids = _ids()
    backend = brcompile.backend(compiler="eager")
    out = torch.compile(fn, backend=backend, dynamic=False)(ids)
    assert_exact(out, fn(ids), torch.float64, "loss (original graph)")
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls == 1, str(s)
    assert not backend.records[0].rewritten
    assert backend.records[0].code is brcompile.Code.PACKED_COUNT, backend.records[0].reason
    assert "only holds for N = " in backend.records[0].reason, backend.records[0].reason
