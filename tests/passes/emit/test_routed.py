"""Routed pairs (passes/emit/routed.py, brcompile/runtime/routed.py): experts after a routing graph break compute the
(token, expert) pairs of one copy of each shared token; loss and every gradient equal eager's in float64, the
rewrite fired (fewer pairs ran), and what breaks the pair-local shape is refused by name."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import brcompile
from brcompile.testing import assert_exact
from tests.helpers import shared_prefix_ids

F64 = torch.float64
D, H, E, K = 16, 12, 4, 2


class Router(nn.Module):
    """JetMoE's top-k gating: per-expert counts as a Python list (``.tolist()``: a graph break inside this
    call), then the flattened picks sorted by expert, each sorted pair's token and gate."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(D, E, bias=False)

    def forward(self, x):
        top_v, top_i = self.layer(x).topk(K, dim=1)
        gates = torch.softmax(top_v, dim=1)
        counts = torch.zeros(x.shape[0], E, dtype=x.dtype).scatter(1, top_i, 1).long().sum(0).tolist()
        _, order = top_i.flatten().sort(0)
        return order, order.div(K, rounding_mode="trunc"), gates.flatten()[order], counts


class RoutedExperts(nn.Module):
    """JetMoE-style experts: gather each pair's token, one GLU expert per group of the split, gates, then
    ``index_add`` back onto the tokens (``slots``: onto the ``T·K`` (token, slot) entries, summed per token
    after a view, as JetMoE's mixture-of-attention map does)."""

    def __init__(self, slots=False):
        super().__init__()
        self.router = Router()
        self.w_in = nn.Parameter(torch.randn(E, 2 * H, D) * 0.3)
        self.w_out = nn.Parameter(torch.randn(E, D, H) * 0.3)
        self.slots = slots

    def forward(self, h):
        B, L, _ = h.shape
        x = h.reshape(-1, D)
        order, token, gates, counts = self.router(x)
        y = x[token]
        y = torch.cat([F.linear(p, self.w_in[e]) for e, p in enumerate(y.split(counts, dim=0))], dim=0)
        a, b = y.chunk(2, dim=-1)
        y = F.silu(a) * b
        y = torch.cat([F.linear(p, self.w_out[e]) for e, p in enumerate(y.split(counts, dim=0))], dim=0)
        y = y * gates[:, None]
        if self.slots:
            out = torch.zeros(B * L * K, D, dtype=y.dtype).index_add(0, order, y)
            return out.view(B, L, K, D).sum(2)
        return torch.zeros(B * L, D, dtype=y.dtype).index_add(0, token, y).view(B, L, D)


class TinyMoE(nn.Module):
    """Embedding, one causal attention, the routed experts, the LM head."""

    def __init__(self, slots=False):
        super().__init__()
        self.emb = nn.Embedding(32, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.moe = RoutedExperts(slots)
        self.head = nn.Linear(D, 32)

    def forward(self, ids):
        B, L = ids.shape
        h = self.emb(ids)
        q, k, v = self.qkv(h).view(B, L, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        h = h + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, D)
        h = h + self.moe(h)
        return self.head(h).log_softmax(-1).sum()


def _ids():
    return shared_prefix_ids(32, 10, (7, 5, 8))


@pytest.mark.parametrize("slots", [False, True])
def test_routed_experts_replay_exactly(slots):
    """The experts' graph after the routing break runs the representatives' pairs only: loss and every
    gradient equal eager's (1e-10, float64), no call fell back, and fewer pairs ran than the batch has."""
    torch.manual_seed(0)
    m = TinyMoE(slots).double()
    ids = _ids()
    want = m(ids)
    gw = torch.autograd.grad(want, list(m.parameters()))
    torch._dynamo.reset()
    brcompile.reset_stats()
    backend = brcompile.backend(compiler="eager", strict=True)
    got = torch.compile(m, backend=backend)(ids)
    gg = torch.autograd.grad(got, list(m.parameters()))
    assert_exact(got, want, F64, "loss")
    for (name, _), a, b in zip(m.named_parameters(), gg, gw):
        assert_exact(a, b, F64, f"grad of {name}")
    routed = [r for r in backend.records if r.routed is not None]
    assert len(routed) == 1 and routed[0].rewritten, [(r.graph_id, r.reason) for r in backend.records]
    (call,) = routed[0].runtime.calls
    assert call.replayed and call.mode == "routed", call
    st = call.tree_stats
    assert st["executed_pairs"] == K * st["executed_tokens"] < st["pairs"] == K * st["logical_tokens"], st
    s = brcompile.stats()
    assert s.fallback_calls == 0 and s.executed_tokens < s.logical_tokens, str(s)


def test_explain_shows_the_routed_graph():
    """explain() lists the experts' graph as rewritten by routed pairs and its call as a routed-pairs run."""
    torch.manual_seed(0)
    m = TinyMoE().double()
    torch._dynamo.reset()
    brcompile.reset_stats()
    report = brcompile.explain(m, _ids(), backend=brcompile.backend(compiler="eager", strict=True),
                               measure=False)
    (g,) = [g for g in report.to_dict()["graphs"] if g["routed"]]
    assert g["rewritten"] and g["routed"]["experts"] == 4 and g["routed"]["pairs"] == K * 40, g["routed"]
    text = str(report)
    assert "REWRITTEN (routed pairs)" in text and "routed pairs" in text.split("calls: the prefix tree")[1], text


SIZES = [5, 4, 0, 5]  # pairs per expert, a Python list Dynamo bakes into the graph


def _experts(x, token, gates, w):
    """The experts alone: a graph whose routing order, gates and counts come from outside."""
    y = x[token]
    y = torch.cat([p @ w[e] for e, p in enumerate(y.split(SIZES, dim=0))], dim=0).tanh() * gates[:, None]
    return torch.zeros(x.shape[0], x.shape[1], dtype=y.dtype).index_add(0, token, y)


def _copies():
    """7 tokens, rows 4-6 copies of rows 0-2; pairs sorted by expert, copies routed like their originals."""
    torch.manual_seed(0)
    x = torch.randn(7, D, dtype=F64)
    x[4:] = x[:3]
    token = torch.tensor([0, 3, 4, 1, 5, 6, 0, 2, 4, 5, 1, 2, 6, 3])  # experts 0, 1, 3
    gates = torch.rand(14, dtype=F64)
    expert = torch.repeat_interleave(torch.arange(4), torch.tensor(SIZES))
    for p in range(14):  # a copy's gate equals the original's pair with the same expert
        t = int(token[p])
        if t >= 4:
            (q,) = [q for q in range(14) if int(token[q]) == t - 4 and expert[q] == expert[p]]
            gates[p] = gates[q]
    return x, token, gates, torch.randn(4, D, D, dtype=F64)


def _run(fn, *args):
    x, token, gates, w = args
    leaves = [x.clone().requires_grad_(), gates.clone().requires_grad_(), w.clone().requires_grad_()]
    out = fn(leaves[0], token, leaves[1], leaves[2])
    out = out[0] if isinstance(out, tuple) else out
    return out, torch.autograd.grad((out * torch.linspace(-1, 1, out.numel(), dtype=F64).view_as(out)).sum(),
                                    [leaves[2]])[0]


def test_copies_routed_alike_share_their_pairs_and_others_run_the_original():
    """A call whose copies were routed alike runs 8 of its 14 pairs; a call where one copy's gate differs from
    its original's runs the original graph with that reason. Both equal eager (the weights' gradient too)."""
    args = _copies()
    torch._dynamo.reset()
    brcompile.reset_stats()
    backend = brcompile.backend(compiler="eager", strict=True)
    fn = torch.compile(_experts, backend=backend)
    for a in (args, (args[0], args[1], args[2] + torch.eye(14, dtype=F64)[4], args[3])):
        (got, gg), (want, gw) = _run(fn, *a), _run(_experts, *a)
        assert_exact(got, want, F64, "experts' output")
        assert_exact(gg, gw, F64, "grad of the expert weights")
    (rec,) = backend.records
    first, second = rec.runtime.calls
    assert first.replayed and first.tree_stats["executed_pairs"] == 8 and first.tree_stats["pairs"] == 14, first
    assert not second.replayed and second.code is brcompile.Code.ROUTED_CALL, second
    assert "different per-pair inputs" in second.reason, second


@pytest.mark.parametrize("transform, code, reason", [
    (lambda y: y - y.sum(0), brcompile.Code.ROUTED_NOT_PAIR_LOCAL, "sum over the pair dim"),
    (lambda y: y.reshape(sum(SIZES), D, 1).squeeze(-1), brcompile.Code.ROUTED_COUNTS, "baked in"),
    (lambda y: y.cumsum(0), brcompile.Code.ROUTED_NOT_PAIR_LOCAL, "cumsum on values per pair has no pair-local rule"),
])
def test_what_breaks_the_pair_local_shape_is_refused(transform, code, reason):
    """A reduction over the pairs, a view that bakes this batch's pair count in, and an op with no pair-local
    rule: the graph runs unchanged, the reason names the construct."""

    def experts(x, token, gates, w):
        y = x[token]
        y = torch.cat([p @ w[e] for e, p in enumerate(y.split(SIZES, dim=0))], dim=0) * gates[:, None]
        return torch.zeros(x.shape, dtype=y.dtype).index_add(0, token, transform(y))

    args = _copies()
    torch._dynamo.reset()
    backend = brcompile.backend(compiler="eager", strict=True)
    (got, gg), (want, gw) = _run(torch.compile(experts, backend=backend), *args), _run(experts, *args)
    assert_exact(got, want, F64, "output")
    assert_exact(gg, gw, F64, "grad of the expert weights")
    (rec,) = backend.records
    assert not rec.rewritten and rec.code is code, rec.reason
    assert reason in rec.reason, rec.reason  # names the construct
