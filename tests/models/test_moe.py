"""Mixture-of-experts blocks replay (passes/analysis/rules/moe.py): tiny HF Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE in
float64 with the default experts implementation (sort → grouped matmuls → inverse permutation) and the
batched one (per-token ``bmm`` of gathered expert weights); loss and every parameter gradient against the
same captured graph run without the rewrite, and stats showing the rewrite fired and tokens were shared.

The reference is ``torch.compile(backend="eager")`` rather than the plain module: on CPU, HF's eager
``grouped_mm`` path calls ``F.grouped_mm``, which has no float64 kernel; under Dynamo HF switches to its
``transformers::grouped_mm_fallback`` op, which both runs use. HF computes the RMSNorms and the router
softmax in float32 (``.to(torch.float32)``, ``softmax(..., dtype=torch.float)``, ``router_logits.float()``);
the ``float64_moe`` fixture keeps that math in the model's dtype so the float64 bound (1e-10) applies.
"""
import pytest
import torch
import torch.nn.functional as F

import brcompile
from tests.helpers import KeepFloat64, shared_prefix_ids

transformers = pytest.importorskip("transformers", minversion="5.0")

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=64, num_experts_per_tok=2, max_position_embeddings=64)
FAMILIES = {
    "mixtral": dict(num_local_experts=4),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=48, shared_expert_intermediate_size=40,
                      decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=48, head_dim=8, decoder_sparse_step=1, mlp_only_layers=[]),
    "olmoe": dict(num_experts=4),
    "hy_v3": dict(num_experts=4, moe_intermediate_size=48, num_shared_experts=1, head_dim=8,
                  mlp_layer_types=["sparse", "sparse"]),
    "phimoe": dict(num_local_experts=4),
}
TOL = 1e-10


def _rmsnorm(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _router(self, hidden_states):
    """HF's top-k router (Mixtral, Qwen2/3-MoE, OLMoE) with its softmax in the input dtype."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    router_probs = F.softmax(router_logits, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):
        router_top_value = router_top_value / router_top_value.sum(dim=-1, keepdim=True)
    return router_logits, router_top_value, router_indices


def _load_balancing_loss(gate_logits, num_experts=None, top_k=2, attention_mask=None):
    """HF's load-balancing loss (Switch Transformers' eq. 4-6: fraction of tokens routed to each expert times
    its mean router probability, over all tokens of all layers) in the input dtype."""
    logits = torch.cat(list(gate_logits), dim=0)
    probs = F.softmax(logits, dim=-1)
    _, selected = torch.topk(probs, top_k, dim=-1)
    tokens_per_expert = F.one_hot(selected, num_experts).to(probs.dtype).mean(dim=0)
    return (tokens_per_expert * probs.mean(dim=0).unsqueeze(0)).sum() * num_experts


@pytest.fixture
def float64_moe(monkeypatch):
    from transformers.models.mixtral import modeling_mixtral as mx
    from transformers.models.olmoe import modeling_olmoe as ol
    from transformers.models.qwen2_moe import modeling_qwen2_moe as q2
    from transformers.models.qwen3_moe import modeling_qwen3_moe as q3

    for norm, router in ((mx.MixtralRMSNorm, mx.MixtralTopKRouter), (q2.Qwen2MoeRMSNorm, q2.Qwen2MoeTopKRouter),
                         (q3.Qwen3MoeRMSNorm, q3.Qwen3MoeTopKRouter), (ol.OlmoeRMSNorm, ol.OlmoeTopKRouter)):
        monkeypatch.setattr(norm, "forward", _rmsnorm)
        monkeypatch.setattr(router, "forward", _router)
    monkeypatch.setattr(mx, "load_balancing_loss_func", _load_balancing_loss)


def _model(family, impl="grouped_mm", **extra):
    cfg = transformers.AutoConfig.for_model(family, **TINY, **FAMILIES[family], **extra)
    torch.manual_seed(0)
    kw = {} if impl is None else {"experts_implementation": impl}
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", **kw).double()


def _ids():
    return shared_prefix_ids(64, 12)


def _loss(m, ids):
    return m(input_ids=ids, use_cache=False).logits.log_softmax(-1).sum()


def _aux_loss(m, ids):
    out = m(input_ids=ids, use_cache=False, output_router_logits=True)
    return out.logits.log_softmax(-1).sum() + 10.0 * out.aux_loss


def _check(m, loss_fn, level="auto", reference=None, mode="packed"):
    """``reference``: how the loss runs without the rewrite (default: the captured graphs, Dynamo's eager);
    ``mode="replay"``: streamed (chunks of 3 tail tokens against the cached prefix)."""
    ids = _ids()
    want = (reference or torch.compile(loss_fn, backend="eager"))(m, ids)
    want.backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    torch._dynamo.reset()
    brcompile.reset_stats()
    backend = brcompile.backend(compiler="eager", level=level, mode=mode, chunk_tokens=3)
    got = torch.compile(loss_fn, backend=backend)(m, ids)
    got.backward()
    s = brcompile.stats()
    if mode == "replay":
        assert s.streamed_calls >= 1, [r.replay_reason for r in backend.records]
    if level == "aten":
        assert all(r.level == "aten" for r in backend.records if r.rewritten)
    assert s.replayed_calls >= 1 and s.fallback_calls == 0, str(s)
    assert s.executed_tokens < s.logical_tokens, str(s)
    assert (got - want).abs().item() <= TOL * want.abs().item()
    for n, p in m.named_parameters():
        g = grads[n]
        if g is None:  # a parameter the loss does not reach (eager leaves its grad None too)
            assert p.grad is None, n
            continue
        assert p.grad is not None, n
        err = (p.grad - g).abs().max().item() / max(g.abs().max().item(), 1e-30)
        assert err <= TOL, (n, err)
    return backend


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_moe_replays_exactly(family, float64_moe):
    _check(_model(family), _loss)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_streams_exactly(family, float64_moe):
    """Streaming replay: the sort-based dispatch (sort of the expert keys, ``histc`` group counts, grouped
    matmuls, inverse permutation) runs on the prefix's tokens, then on each chunk's: a token-local region
    whose counts have no token dim — exact on any token subset."""
    _check(_model(family), _loss, mode="replay")


def test_moe_replays_exactly_at_the_aten_level(float64_moe):
    """Mixtral analysed as its functional ATen graph (docs/ARCHITECTURE.md §3.0): the dispatch's inverse
    permutation is a functional ``index_put`` there, the same ``argsort`` proof."""
    _check(_model("mixtral"), _loss, level="aten")


def test_mixtral_batched_mm_experts(float64_moe):
    _check(_model("mixtral", "batched_mm"), _loss)


def test_router_aux_loss_is_dense_and_exact(float64_moe):
    """The load-balancing loss reduces over all B·L tokens: the router logits are materialised densely for it
    (exact), the blocks still replay."""
    _check(_model("mixtral", router_aux_loss_coef=0.01), _aux_loss)


def test_float32_router_within_float32_bound():
    """HF's own float32 router softmax and norms: the replay agrees to the float32 bound (a shared token's
    float32 rounding differs with the batch it is summed in)."""
    global TOL
    old, TOL = TOL, 1e-5
    try:
        _check(_model("mixtral"), _loss)
    finally:
        TOL = old


def test_router_weights_gathered_at_the_chosen_experts():
    """HunYuan-V3's router, as AFMoE's, ERNIE-4.5-MoE's, Kolibri's, Laguna's and MiniMax-M3's: experts chosen by
    ``topk`` of bias-corrected scores, weights read back from the uncorrected ones by ``gather(scores, 1, idx)``.
    The gather is per flattened entry, so the weights stay flattened tokens and the experts' ``weights[perm]``
    reads them in the sort's order. Float64 throughout (the router's float32 casts kept float64)."""
    m = _model("hy_v3")
    g = torch.Generator().manual_seed(2)
    for layer in m.model.layers:
        layer.mlp.e_score_correction_bias.copy_(torch.rand(4, generator=g, dtype=torch.float64) * 0.1)
    with KeepFloat64():
        _check(m, _loss)


def test_phimoe_eval_routing_replays():
    """PhiMoE's sparse mixer in eval mode is deterministic: top-1 by ``max``, the scores above a relative threshold
    masked, the first expert's score ``scatter``-ed to -inf for the second pick, weights ``gather``-ed: all per
    entry of the flattened tokens."""
    m = _model("phimoe").eval()
    with KeepFloat64():
        _check(m, _loss)


def test_phimoe_training_routing_is_random_and_refused():
    """In training mode PhiMoE samples its experts (Gumbel noise: ``empty_like(scores).exponential_()``): each
    row's copy of a shared token draws its own experts, so no packed graph can reproduce the rows. The backend
    runs the original graph and says why."""
    m = _model("phimoe").train()
    brcompile.reset_stats()
    torch.compile(_loss, backend=brcompile.backend(compiler="eager"))(m, _ids()).backward()
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls >= 1, str(s)
    assert brcompile.Code.RANDOM_DRAW in s.fallback_codes, str(s)
    assert any("exponential_" in r for r in s.details(brcompile.Code.RANDOM_DRAW)), str(s)


def _deepseek_v4():
    """A tiny DeepSeek-V4 (one layer) whose MoE layer routes by hash (``tid2eid[input_ids]``), the table filled with
    expert ids in [0, 4) (HF initialises it to zeros: every token to expert 0)."""
    cfg = transformers.AutoConfig.for_model(
        "deepseek_v4", vocab_size=64, hidden_size=32, moe_intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, q_lora_rank=16, num_experts_per_tok=2,
        n_routed_experts=4, max_position_embeddings=64, mlp_layer_types=["hash_moe"],
        layer_types=["heavily_compressed_attention"], pad_token_id=0,
        qk_rope_head_dim=4)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").double()
    g = torch.Generator().manual_seed(3)
    for layer in m.model.layers:
        layer.mlp.gate.tid2eid.copy_(torch.randint(0, 4, layer.mlp.gate.tid2eid.shape, generator=g))
    return m


@pytest.mark.slow
def test_hash_routing_replays_with_its_table_guarded():
    """DeepSeek-V4's hash router picks a token's experts by a table lookup of its id, ``tid2eid[input_ids]``:
    a function of the token, so shared tokens route alike. The sort → ``histc`` → grouped matmuls that follow
    need the keys in [0, E): a table's entries are no static fact, so the rewrite keeps a per-call guard on
    them (checked once per version of the buffer). Float64 throughout."""
    m = _deepseek_v4()
    with KeepFloat64():
        _check(m, _loss)
    # an entry out of range (as a corrupted checkpoint could hold): the guard sends the call to the original
    # graph, with the table named, instead of trusting group counts that would drop that token; the original
    # graph then fails as the model does eagerly (it indexes its expert weights with the id)
    m.model.layers[0].mlp.gate.tid2eid[5, 0] = 7
    brcompile.reset_stats()
    with KeepFloat64(), pytest.raises(RuntimeError, match="out of bounds"):
        torch.compile(_loss, backend=brcompile.backend(compiler="eager"))(m, _ids())
    s = brcompile.stats()
    assert s.fallback_calls == 1 and s.replayed_calls == 0, str(s)
    assert s.fallback_codes == {brcompile.Code.GUARD_TABLE_RANGE: 1}, str(s)
    assert any("tid2eid" in r for r in s.details(brcompile.Code.GUARD_TABLE_RANGE)), str(s)  # names the table


def test_key_range_through_masked_fill():
    """ZAYA's router picks among E experts and one "skip" class (topk over E + 1), then drops the skip index E to
    0: ``masked_fill(idx, idx == E, 0)`` keeps the keys in [0, E), so histc(bins=E) counts their runs; a fill
    with another mask, or with a value >= E, widens the bound."""
    from brcompile.passes.analysis.rules.moe import _key_range

    E = 4

    def route(x):
        _, idx = torch.topk(x, 1, dim=-1)
        a = idx.masked_fill(idx == E, 0)          # the skip class, the top index, dropped
        b = idx.masked_fill(idx == 1, 0)          # another index: E + 1 values remain possible
        c = idx.masked_fill(idx == E, 7)          # the fill value itself is out of range
        return a, b, c

    got = []

    def backend(gm, example_inputs):
        got.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(route, backend=backend, fullgraph=True)(torch.randn(6, E + 1))
    fills = [n for n in got[0].graph.nodes if n.target == "masked_fill" or n.target is torch.masked_fill]
    assert len(fills) == 3, [n.format_node() for n in got[0].graph.nodes]
    assert [_key_range(n) for n in fills] == [E, E + 1, 8]


class SortDispatch(torch.nn.Module):
    """A sort-based MoE over the flattened tokens whose token index is spelled ``P // 2`` or, as JetMoE writes
    it, ``P.div(2, rounding_mode=...)``: the same floor on the non-negative places of the permutation."""

    def __init__(self, spelling, D=8, E=4):
        super().__init__()
        self.router = torch.nn.Linear(D, E, bias=False)
        self.w = torch.nn.Parameter(torch.randn(D, D) / D ** 0.5)
        self.spelling = spelling

    def forward(self, h):
        B, L, D = h.shape
        x = h.reshape(-1, D)
        w, e = self.router(x).softmax(-1).topk(2, dim=-1)
        _, P = e.reshape(-1).sort(0)
        tok = P // 2 if self.spelling == "floordiv" else P.div(2, rounding_mode=self.spelling)
        y = torch.tanh(x[tok] @ self.w) * w.reshape(-1)[P][:, None]  # entry P(i)'s token, in P's order
        return h + y[P.argsort()].view(B, L, 2, D).sum(2)


@pytest.mark.parametrize("spelling", ["floordiv", "trunc", "floor"])
def test_token_index_division_spellings(spelling):
    torch.manual_seed(0)
    m = SortDispatch(spelling).double()
    emb = torch.nn.Embedding(64, 8).double()
    ids = _ids()

    def loss(ids):
        return m(emb(ids)).pow(2).sum()

    params = [emb.weight, *m.parameters()]
    want = loss(ids)
    gw = torch.autograd.grad(want, params)
    brcompile.reset_stats()
    backend = brcompile.backend(compiler="eager")
    got = torch.compile(loss, backend=backend)(ids)
    gg = torch.autograd.grad(got, params)
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.fallback_calls == 0 and s.executed_tokens < s.logical_tokens, str(s)
    (rec,) = backend.records
    # the whole region ran packed: only the loss's sum over the tokens reads a value densely
    assert all(m[3].startswith("reduction over a token dim") for m in rec.materialisations), rec.materialisations
    assert (got - want).abs().item() <= TOL * want.abs().item()
    for a, b in zip(gg, gw):
        assert (a - b).abs().max().item() <= TOL * b.abs().max().item()


def _dbrx():
    cfg = transformers.DbrxConfig(d_model=32, n_heads=4, n_layers=1, max_seq_len=64, vocab_size=64,
                                  attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0),
                                  ffn_config=dict(hidden_size=32, ffn_hidden_size=64, moe_num_experts=3, moe_top_k=2))
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").double()


def test_dbrx_experts_after_graph_breaks_replay():
    """DBRX loops over its experts with a data-dependent graph break per expert: each expert's graph gets the
    tokens routed to it, ``x = hidden[token_idx]`` ``[n, D]``, and that expert's weights sliced from the
    parameter before the break. The weights are per-call constants (the same tensor for every row), x's rows
    the tree's keys: every expert graph replays, sharing the copies of a shared prompt token. The graphs of the
    mask and the rotary tables between the breaks read no per-token value: nothing to share, no fallback."""
    m = _dbrx()
    backend = _check(m, _loss, reference=_loss)  # plain matmul experts: the module itself is the reference
    experts = [r for r in backend.records if "l_expert_w1_" in r.original_code]
    assert experts and all(r.rewritten for r in experts), [(r.graph_id, r.reason) for r in experts]
    assert all(r.rewritten or r.unshared for r in backend.records), [r.reason for r in backend.records]
    s = brcompile.stats()
    assert s.unshared_calls >= 1 and not s.fallback_codes, str(s)


def _jetmoe_gating(self, hidden_states):
    """JetMoE's top-k gating with its router logits in the input dtype (HF: ``.float()``)."""
    logits = self.layer(hidden_states)
    top_k_logits, top_k_indices = logits.topk(self.top_k, dim=1)
    top_k_gates = torch.softmax(top_k_logits, dim=1).type_as(hidden_states)
    zeros = torch.zeros([top_k_gates.size(0), self.num_experts], dtype=top_k_gates.dtype, device=top_k_gates.device)
    expert_size = zeros.scatter(1, top_k_indices, 1).long().sum(0).tolist()
    _, index_sorted_experts = top_k_indices.flatten().sort(0)
    batch_index = index_sorted_experts.div(self.top_k, rounding_mode="trunc")
    batch_gates = top_k_gates.flatten()[index_sorted_experts]
    return index_sorted_experts, batch_index, batch_gates, expert_size, logits


def test_jetmoe_routed_experts_replay(monkeypatch):
    """JetMoE's router ends in ``expert_size.tolist()``: a graph break inside the router, so its experts (the
    MLP's and the mixture-of-attention query/output projections) run in graphs that receive the routing
    order, the gates and the counts from outside. Those graphs run routed pairs (passes/emit/routed.py): each
    shared token's pairs once. Every graph replays or has nothing to share; loss and every gradient exact."""
    from transformers.models.jetmoe import modeling_jetmoe as jm

    monkeypatch.setattr(jm.JetMoeRMSNorm, "forward", _rmsnorm)
    monkeypatch.setattr(jm.JetMoeTopKGating, "forward", _jetmoe_gating)
    cfg = transformers.JetMoeConfig(hidden_size=32, num_hidden_layers=2, num_key_value_heads=2, kv_channels=8,
                                    intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                    vocab_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").double()
    backend = _check(m, _loss)
    routed = [r for r in backend.records if r.routed is not None]
    assert len(routed) == 2 * cfg.num_hidden_layers, [(r.graph_id, r.reason) for r in backend.records]
    for r in routed:
        for c in r.runtime.calls:
            assert c.replayed and c.tree_stats["executed_pairs"] < c.tree_stats["pairs"], c
    assert all(r.rewritten or r.unshared for r in backend.records), [r.reason for r in backend.records]
