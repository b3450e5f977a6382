"""The compile pipeline as data (passes/pipeline.py): its stages run in order, are timed, say where a graph was
refused, and are what the backend, explain() and the dumps iterate."""
import os

import pytest
import torch
import torch.nn.functional as F

import brcompile
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.passes.pipeline import ANALYSIS_STAGES, STAGES, PipelineConfig, run_pipeline
from brcompile.tools.explain import explain
from examples.gpt import GPT, GPTConfig
from tests.helpers import assert_grads_exact, capture

ORDER = ("lower", "functionalise", "canonicalise attention", "computed keys", "canonicalise scans", "tree inputs",
         "masks", "token axes", "guards", "liveness", "emit", "check")


def _model_and_batch():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1)).double()
    ids = torch.randint(0, 64, (4, 20))
    ids[:, :12] = ids[0, :12]
    return model, ids


def _loss(model):
    def loss(ids):
        logp = F.log_softmax(model(ids)[:, :-1], -1)
        return -logp.gather(-1, ids[:, 1:, None]).mean()
    return loss


def test_stages_are_named_in_order_and_documented():
    assert tuple(s.name for s in STAGES) == ORDER
    assert all(s.doc for s in STAGES), [s.name for s in STAGES if not s.doc]
    assert ANALYSIS_STAGES[-1].name == "guards"


def test_run_pipeline_times_every_stage_and_emits_the_packed_graph():
    model, ids = _model_and_batch()
    gm, inputs = capture(_loss(model), ids)
    state = run_pipeline(gm, inputs, PipelineConfig(training=True))
    assert [name for name, _ in state.times] == list(ORDER)
    assert all(t >= 0 for _, t in state.times)
    assert state.packed is not None and state.example_args is not None
    targets = {n.target for n in state.packed.graph.nodes}
    assert torch.ops.brcompile.tree_attention_forward.default in targets
    assert any(n.op == "placeholder" for n in gm.graph.nodes)  # the captured graph itself is left as it was
    assert torch.ops.brcompile.tree_attention_forward.default not in {n.target for n in gm.graph.nodes}


def test_a_graph_without_attention_is_analysed_at_tree_inputs():
    """A token-local graph (an MLP on hidden states) has no masks to classify: its analysis is finished by the
    tree-input stage, and the mask and token-axis stages do not run for it."""
    torch.manual_seed(0)
    w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)

    def mlp(h):
        return torch.tanh(h @ w).sum()

    h = torch.randn(3, 5, 8, dtype=torch.float64)
    gm, inputs = capture(mlp, h)
    state = run_pipeline(gm, inputs, PipelineConfig(training=True))
    ran = [name for name, _ in state.times]
    assert "masks" not in ran and "token axes" not in ran
    assert ran[:6] == list(ORDER[:6]) and ran[-4:] == ["guards", "liveness", "emit", "check"]


def test_a_refusal_names_its_stage():
    model, ids = _model_and_batch()
    gm, inputs = capture(_loss(model), ids)
    with pytest.raises(CannotReplay) as info:
        run_pipeline(gm, inputs[:-1], PipelineConfig())  # fewer inputs than placeholders
    assert info.value.stage == "lower" and info.value.code is Code.GRAPH_INPUTS
    assert [name for name, _ in info.value.stage_times] == ["lower"]


def test_backend_records_stage_times_explains_them_and_dumps_stages(tmp_path):
    model, ids = _model_and_batch()
    loss = _loss(model)
    be = brcompile.backend(compiler="eager", dump_dir=str(tmp_path))
    report = explain(loss, ids, backend=be)
    (g,) = report.graphs
    assert g.rewritten
    assert [(lv, st) for lv, st, _ in g.stage_times] == [("dynamo", s) for s in ORDER]
    text = report.render_text(code=False)
    assert "compile time per pipeline stage" in text and "canonicalise attention" in text
    assert {d["stage"] for d in report.to_dict()["graphs"][0]["stage_times"]} == set(ORDER)
    files = set(os.listdir(tmp_path))
    assert {"graph_0_dynamo_1_functionalise.py", "graph_0_dynamo_2_canonicalise_attention.py",
            "graph_0_before.py", "graph_0_after.py"} <= files
    # exact through the pipeline, and the rewrite fired
    brcompile.reset_stats()
    model.zero_grad()
    got = torch.compile(loss, backend=brcompile.backend(compiler="eager"))(ids)
    got.backward()
    got_grads = [p.grad.clone() for p in model.parameters()]
    assert brcompile.stats().replayed_calls == 1 and brcompile.stats().fallback_calls == 0
    model.zero_grad()
    want = loss(ids)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    assert_grads_exact(got_grads, [p.grad for p in model.parameters()], [n for n, _ in model.named_parameters()],
                       torch.float64)


def test_explain_counts_each_refused_level_at_the_stage_it_stopped():
    """A bidirectional attention (no mask, not causal) is refused at every level tried: the stage table counts
    each level once, at the last stage that ran there, and nothing where the pipeline went on."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(16, 8).double()

    def bidirectional(ids):
        h = emb(ids)[:, None]  # [B, 1, L, 8]
        return F.scaled_dot_product_attention(h, h, h).sum()

    ids = torch.randint(0, 16, (3, 6))
    ids[:, :4] = ids[0, :4]
    report = explain(bidirectional, ids, backend=brcompile.backend(compiler="eager"))
    (g,) = report.graphs
    assert not g.rewritten and g.code is not None
    last = {}
    for lv, st, _ in g.stage_times:
        last[lv] = st
    assert set(last) == {lv for lv, _ in g.refusals}
    table = report.stage_table()
    refused = {row[0]: int(row[4]) for row in table.rows}
    want = {st: list(last.values()).count(st) for st in last.values()}
    assert sum(want.values()) == len(g.refusals) >= 1
    assert {st: n for st, n in refused.items() if n} == want
