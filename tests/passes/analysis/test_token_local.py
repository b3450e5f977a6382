"""Graphs without attention and without scans whose ops are token-local (passes/emit/pack.py: _analyse_token_local):
the pieces of a model between graph breaks (norms, MoE routing, the LM head, the loss) and bag-of-tokens
models. A token-local op's value at (b, t) reads the inputs at (b, t) only, so rows whose per-token inputs agree
up to column t share it: the tree comes from the inputs themselves (token ids, or the rows of a [B, L, D] float
input such as hidden states). Loss and every gradient equal eager's in float64, and the call replayed; a graph
whose ops mix the tokens computes nothing packed and runs unchanged with the reason."""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

import brcompile
from brcompile.testing import assert_exact
from tests.passes.analysis.rules.test_scan_rules import grpo_like_batch, run_exact, token_loss

F64 = torch.float64


class TokenMLP(nn.Module):
    """Per-token ops only over the token ids: embedding, tanh, LM head."""

    def __init__(self, V=23, D=6):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.head = nn.Linear(D, V)

    def forward(self, ids, am):
        return self.head(torch.tanh(self.emb(ids)))


def test_bag_of_tokens_model_replays_exactly():
    """Token ids -> embedding -> tanh -> head -> masked NLL: each prefix token's work done once."""
    torch.manual_seed(0)
    model = TokenMLP().to(F64)
    run_exact(model, functools.partial(token_loss, model), grpo_like_batch())
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.fallback_calls == 0 and s.executed_tokens < s.logical_tokens, str(s)


class MoEPiece(nn.Module):
    """What a graph break around an MoE block leaves: RMSNorm of the hidden states, a top-2 softmax router over
    4 experts, the experts' outputs weighted per token (dense experts, the routing weights gathered)."""

    def __init__(self, D=8, E=4):
        super().__init__()
        self.norm = nn.Parameter(torch.rand(D) + 0.5)
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.Parameter(torch.randn(E, D, D) / D ** 0.5)

    def forward(self, h, cm):
        x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        w, idx = self.router(x).softmax(-1).topk(2, dim=-1)
        gates = torch.zeros_like(self.router(x)).scatter(-1, idx, w / w.sum(-1, keepdim=True))
        y = torch.einsum("bld,edf->blef", x, self.experts)
        out = h + (gates.unsqueeze(-1) * y).sum(-2)
        return (out.pow(2).sum(-1) * cm).sum()


def prefix_rows(B=4, L=7, shared=4, V=13):
    """[B, L] token ids whose rows agree on their first ``shared`` columns, and a 0/1 [B, L] float mask."""
    torch.manual_seed(1)
    ids = torch.randint(0, V, (1, L)).repeat(B, 1)
    ids[:, shared:] = torch.randint(0, V, (B, L - shared))
    cm = torch.ones(B, L, dtype=F64)
    cm[:, :2] = 0
    return ids, cm


def run_on_hidden_states(model, ids, cm, V=13, D=8):
    """Eager vs ``model(h, cm)`` compiled alone on hidden states ``h = emb(ids)`` made upstream, eagerly (a graph
    break before the piece): the loss and every gradient, the upstream embedding's included. (The gradient with
    respect to a float tree key is each tree node's sum at its representative position, docs/ARCHITECTURE.md §5:
    the upstream parameters get the dense gradient, positions merged by value being the same function of them.)"""
    torch.manual_seed(2)
    emb = nn.Embedding(V, D).to(F64)
    model = model.to(F64)
    names = ["embedding", *(n for n, _ in model.named_parameters())]
    params = [emb.weight, *model.parameters()]
    want = model(emb(ids), cm)
    gw = torch.autograd.grad(want, params)
    got = torch.compile(model, backend=brcompile.backend(compiler="eager"))(emb(ids), cm)
    gg = torch.autograd.grad(got, params)
    assert_exact(got, want, F64, "loss")
    for name, a, b in zip(names, gg, gw):
        assert_exact(a, b, F64, f"grad of {name}")


def test_hidden_state_graph_without_attention_replays_exactly():
    """The tree comes from the rows of the [B, L, D] float input: rows agreeing up to column t share the routed
    MLP's work there; loss and every gradient (the upstream embedding's too) equal eager's in float64."""
    torch.manual_seed(0)
    run_on_hidden_states(MoEPiece(), *prefix_rows())
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.fallback_calls == 0, str(s)
    assert s.executed_tokens < s.logical_tokens, str(s)


class MixesPositions(nn.Module):
    """A softmax over the positions (dim 1) of the hidden states: each token's value reads every other token."""

    def __init__(self, D=8):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, h, cm):
        return (h.softmax(1) * self.w * cm.unsqueeze(-1)).pow(2).sum()


def test_graph_that_mixes_tokens_runs_unchanged():
    """Without attention, an op that mixes the tokens of a row from the start leaves nothing packed: the
    original graph runs, the reason names the value made dense."""
    run_on_hidden_states(MixesPositions(), *prefix_rows())
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls == 1, str(s)
    assert s.fallback_codes == {brcompile.Code.NOTHING_PACKED: 1}, str(s)
    assert any("made dense" in r for r in s.details(brcompile.Code.NOTHING_PACKED)), str(s)  # names the dense value


class RowMLP(nn.Module):
    """A piece over flattened tokens ``[T, D]`` (what an experts loop's graph breaks leave): RMSNorm, a gated MLP,
    a per-row loss weighted by a ``[T, 1]`` per-row input."""

    def __init__(self, D=8, F=12):
        super().__init__()
        self.norm = nn.Parameter(torch.rand(D) + 0.5)
        self.up = nn.Linear(D, 2 * F)
        self.down = nn.Linear(F, D, bias=False)

    def forward(self, h, w):
        x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        a, b = self.up(x).chunk(2, -1)
        out = h + self.down(F.silu(a) * b)
        return (out.pow(2).sum(-1, keepdim=True) * w).sum()


class ExpertTokens(nn.Module):
    """An expert over its token set ``h[idx]`` (``idx`` a [n] index into the rows, per batch), added back with
    ``index_add``: the gathered rows are no rows of the graph's inputs."""

    def __init__(self, D=8):
        super().__init__()
        self.w = nn.Linear(D, D)

    def forward(self, h, idx):
        y = torch.tanh(self.w(h[idx]))
        return torch.zeros_like(h).index_add(0, idx, y).pow(2).sum()


def flat_rows(B=4, L=7, shared=4, V=13, D=8):
    """``[B·L, D]`` hidden states (an upstream embedding's, made eagerly) of rows that share their first
    ``shared`` tokens, the embedding, and the ids."""
    ids, _ = prefix_rows(B, L, shared, V)
    torch.manual_seed(2)
    emb = nn.Embedding(V, D).to(F64)
    return emb, ids.reshape(-1)


def run_on_rows(model, *extra):
    """Eager vs ``model(emb(ids).view(-1, D), *extra)`` compiled alone: the loss and every gradient, the upstream
    embedding's included (the gradient of a float tree key is summed at each node's representative row)."""
    emb, ids = flat_rows()
    model = model.to(F64)
    names = ["embedding", *(n for n, _ in model.named_parameters())]
    params = [emb.weight, *model.parameters()]
    want = model(emb(ids), *extra)
    gw = torch.autograd.grad(want, params)
    backend = brcompile.backend(compiler="eager", strict=True)
    got = torch.compile(model, backend=backend)(emb(ids), *extra)
    gg = torch.autograd.grad(got, params)
    assert_exact(got, want, F64, "loss")
    for name, a, b in zip(names, gg, gw):
        assert_exact(a, b, F64, f"grad of {name}")
    return backend


def test_flattened_rows_replay_exactly():
    """[T, D] rows (no ids, no [B, L, D] input) are T sequences of one token: the copies of a shared prompt
    token are one tree node; loss and every gradient (the upstream embedding's too) equal eager's."""
    torch.manual_seed(0)
    w = torch.rand(28, 1, dtype=F64)
    w[::3] = 0  # the per-row weight is a tree key too: rows merge only where it agrees
    run_on_rows(RowMLP(), w)
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.fallback_calls == 0, str(s)
    assert s.executed_tokens < s.logical_tokens, str(s)


def test_rows_gathered_by_a_batch_index_stay_dense():
    """``h[idx]`` by a per-batch index mixes the rows: its rule reads h densely (the index is no tree key and
    points into no layout of the rows), so the expert and ``index_add`` run on the original values; loss and
    every gradient equal eager's (only ``zeros_like(h)`` is per row)."""
    torch.manual_seed(0)
    idx = torch.tensor([3, 0, 7, 7, 12, 27, 5])
    backend = run_on_rows(ExpertTokens(), idx)
    (rec,) = backend.records
    made_dense = {m[0]: m[3] for m in rec.materialisations}
    h = rec.tree_inputs[0]
    assert "index made outside the graph" in made_dense.get(h, ""), (rec.tree_inputs, rec.materialisations)
    assert rec.tree_inputs == (h,), rec.tree_inputs  # the [n] index is no tree key


def test_rows_all_equal_replay_as_one_token():
    """Every row the same token (an expert that only received copies of one shared token): a tree of one node,
    which the packed graph's check (every N, sizes 0 and 1 not specialised) accepts; loss and gradients exact."""
    torch.manual_seed(0)
    emb, _ = flat_rows()
    model = RowMLP().to(F64)
    ids = torch.full((6,), 5)
    params = [emb.weight, *model.parameters()]
    want = model(emb(ids), torch.ones(6, 1, dtype=F64))
    gw = torch.autograd.grad(want, params)
    got = torch.compile(model, backend=brcompile.backend(compiler="eager", strict=True))(
        emb(ids), torch.ones(6, 1, dtype=F64))
    gg = torch.autograd.grad(got, params)
    assert_exact(got, want, F64, "loss")
    for a, b in zip(gg, gw):
        assert_exact(a, b, F64, "grad")
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.executed_tokens == 1 and s.logical_tokens == 6, str(s)


def test_graph_that_only_views_its_input_says_so():
    """A graph of ``h.reshape(-1, D)`` alone (the entry of an experts loop before its graph break) has nothing
    to compute: it runs unchanged, and the reason says so."""
    emb, ids = flat_rows()
    h = emb(ids).view(4, 7, -1)
    backend = brcompile.backend(compiler="eager", strict=True)
    out = torch.compile(lambda x: x.reshape(-1, x.shape[-1]), backend=backend)(h)
    assert torch.equal(out, h.reshape(-1, h.shape[-1]))
    (rec,) = backend.records
    assert not rec.rewritten and rec.code is brcompile.Code.NO_PER_TOKEN_WORK and "(reshape)" in rec.reason, rec.reason
    # nothing to share is no fallback: the call is counted apart
    assert rec.unshared and brcompile.stats().unshared_calls == 1 and brcompile.stats().fallback_calls == 0


class Expert(nn.Module):
    """DBRX's expert after its loop's graph break: the routed tokens ``x [n, D]`` and the expert's weights, sliced
    from the parameters before the break, are all graph inputs."""

    def forward(self, x, w1, v1, w2):
        return (F.silu(x @ w1.T) * (x @ v1.T)) @ w2


def test_weights_passed_into_the_graph_are_per_call_constants():
    """The weights are no rows (no dim of the T tokens' extent): the same tensor for every row, CONST to the rules,
    so the expert replays on the packed rows; loss and every gradient (the sliced parameters' too) equal eager's."""
    torch.manual_seed(0)
    emb, ids = flat_rows()
    w = [nn.Parameter(torch.randn(2, 12, 8, dtype=F64) / 3) for _ in range(3)]
    model = Expert()

    def loss(x, w1, w2, w3):
        return model(x, w1[1], w2[1], w3[1]).pow(2).sum()

    params = [emb.weight, *w]
    want = loss(emb(ids), *w)
    gw = torch.autograd.grad(want, params)
    backend = brcompile.backend(compiler="eager", strict=True)
    compiled = torch.compile(model, backend=backend)
    got = compiled(emb(ids), w[0][1], w[1][1], w[2][1]).pow(2).sum()
    gg = torch.autograd.grad(got, params)
    assert_exact(got, want, F64, "loss")
    for name, a, b in zip(["embedding", "w1", "v1", "w2"], gg, gw):
        assert_exact(a, b, F64, f"grad of {name}")
    (rec,) = backend.records
    assert rec.rewritten and len(rec.tree_inputs) == 1, (rec.reason, rec.tree_inputs)
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.fallback_calls == 0 and s.executed_tokens < s.logical_tokens, str(s)


def _routing_order(top_k_indices, top_k_gates):
    """JetMoE's routing bookkeeping between two graph breaks: the flattened top-k picks sorted, each sorted
    entry's token, its gate in that order."""
    _, order = top_k_indices.flatten().sort(0)
    return order, order.div(2, rounding_mode="trunc"), top_k_gates.flatten()[order]


class PositionTables(nn.Module):
    """A rotary embedding's tables from ``[1, L]`` positions (no row dim) between two graph breaks."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.rand(4))

    def forward(self, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq
        return freqs.cos(), freqs.sin()


def test_graphs_with_nothing_per_token_to_compute_are_no_fallback():
    """A graph that computes no floating-point value (a sort of routing keys, integer division, gates moved into
    the sorted order: its outputs name places in the batch) and one that reads no per-token value (position
    tables from [1, L] positions and a buffer) have nothing to share: they run as they are, counted as unshared
    calls, not as fallbacks."""
    torch.manual_seed(0)
    idx, gates = torch.randint(0, 4, (28, 2)), torch.rand(28, 2, dtype=F64)
    backend = brcompile.backend(compiler="eager", strict=True)
    for fn, args in ((_routing_order, (idx, gates)), (PositionTables(), (torch.arange(7)[None],))):
        for a, b in zip(torch.compile(fn, backend=backend)(*args), fn(*args)):
            assert torch.equal(a, b)
    assert [r.unshared for r in backend.records] == [True, True], [r.reason for r in backend.records]
    assert [r.code for r in backend.records] == [brcompile.Code.NO_PER_TOKEN_WORK] * 2
    assert "computes no floating-point value" in backend.records[0].reason
    assert "reads no per-token value" in backend.records[1].reason
    s = brcompile.stats()
    assert s.unshared_codes == {brcompile.Code.NO_PER_TOKEN_WORK: 2}, str(s)
    assert s.unshared_calls == 2 and s.fallback_calls == 0, str(s)


def test_lookup_by_an_integer_input_is_a_fallback():
    """``W[ids]`` then ``tanh``, without an ``embedding`` call: per-token work on whatever the integer input holds,
    so the graph is no graph with nothing to share; it runs unchanged as a fallback that names the lookup."""
    table = nn.Module()
    table.W = nn.Parameter(torch.randn(13, 8, dtype=F64))
    ids = prefix_rows()[0]
    backend = brcompile.backend(compiler="eager", strict=True)
    out = torch.compile(lambda i: torch.tanh(table.W[i]), backend=backend)(ids)
    assert torch.equal(out, torch.tanh(table.W[ids]))
    (rec,) = backend.records
    assert not rec.rewritten and not rec.unshared and rec.code is brcompile.Code.NO_TOKEN_INPUT, rec.reason
    assert "looks a floating-point value up" in rec.reason  # names the lookup
    s = brcompile.stats()
    assert s.fallback_calls == 1 and s.unshared_calls == 0, str(s)


def test_dense_region_reading_a_per_call_constant_is_not_packed_again():
    """A running maximum (no rule: a dense region) scaled by a weight passed into the graph: the repack probes
    would prove the region for this call's weight only, so it stays dense and the graph, with nothing packed,
    runs unchanged, the reason naming the weight; loss and gradients equal eager's."""
    ids, cm = prefix_rows()
    torch.manual_seed(2)
    emb = nn.Embedding(13, 8).to(F64)
    w = torch.rand(8, dtype=F64, requires_grad=True)

    def piece(h, w, cm):
        y = h + torch.cummax(h, dim=1).values * w
        return (y.pow(2).sum(-1) * cm).sum()

    want = piece(emb(ids), w, cm)
    gw = torch.autograd.grad(want, [emb.weight, w])
    backend = brcompile.backend(compiler="eager", strict=True)
    got = torch.compile(piece, backend=backend)(emb(ids), w, cm)
    gg = torch.autograd.grad(got, [emb.weight, w])
    assert_exact(got, want, F64, "loss")
    for name, a, b in zip(["embedding", "w"], gg, gw):
        assert_exact(a, b, F64, f"grad of {name}")
    (rec,) = backend.records
    assert not rec.rewritten and not rec.unshared and rec.code is brcompile.Code.NOTHING_PACKED, rec.reason
    assert "l_w_, a per-call input" in rec.reason  # names the weight


def test_one_row_graph_has_nothing_to_share():
    """An expert's activation graph for the one token it received (LongCat-Flash): Dynamo specialises the size 1,
    so every call is one row, which shares nothing with itself: it runs as it is, no fallback."""
    x = torch.randn(1, 8, dtype=F64)
    backend = brcompile.backend(compiler="eager", strict=True)
    assert torch.equal(torch.compile(F.silu, backend=backend)(x), F.silu(x))
    (rec,) = backend.records
    assert rec.unshared and rec.code is brcompile.Code.ONE_ROW_BATCH, rec.reason
    s = brcompile.stats()
    assert s.unshared_calls == 1 and s.fallback_calls == 0, str(s)
