"""brcompile.tools.explain: report content (replayed graph, fallback with reason), predicted FLOPs against independent
counts, the recording context, graph dumps and TORCH_LOGS=+brcompile."""
import io
import json
import operator
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import brcompile
from brcompile.tools.dump import COLOURS
from brcompile.tools.explain import ExplainReport, mutating_node, recording
from examples.gpt import GPT, GPTConfig
from examples.grpo import grpo_loss, make_grpo_batch

EAGER = dict(compiler="eager")  # the packed graph as an FX graph: no compile time in these tests
CFG = dict(vocab_size=37, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48)


def tiny_model():
    return GPT(GPTConfig(**CFG), seed=0).double()


def tiny_batch(seed=3):
    return make_grpo_batch(num_prompts=2, group_size=3, prompt_len=(5, 9), response_len=(2, 5), vocab_size=37,
                           shared_response_prefix=1, dtype=torch.float64, seed=seed)


def trie_pairs(ids: torch.Tensor, mask: torch.Tensor) -> tuple[int, int]:
    """(nodes, visible pairs) of the rows' prefix trie, counted in Python: a node is a distinct row prefix of
    (token, mask bit); it sees its ancestors-or-self whose mask bit is 1."""
    root, nodes, pairs = {}, 0, 0
    for row_ids, row_bits in zip(ids.tolist(), mask.bool().tolist()):
        children, valid = root, 0
        for tok, bit in zip(row_ids, row_bits):
            valid += bit
            if (tok, bit) not in children:
                children[(tok, bit)] = {}
                nodes += 1
                pairs += valid
            children = children[(tok, bit)]
    return nodes, pairs


class Bidirectional(torch.nn.Module):
    """A one-layer LM whose attention is not causal: branch_replay must fall back."""

    def __init__(self, V=37, d=16):
        super().__init__()
        self.emb = torch.nn.Embedding(V, d)
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.head = torch.nn.Linear(d, V, bias=False)

    def forward(self, ids):
        B, L = ids.shape
        q, k, v = self.qkv(self.emb(ids)).view(B, L, 3, 2, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v)
        return self.head(o.transpose(1, 2).reshape(B, L, -1))


def lm_loss(model, ids):
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def test_report_of_a_replayed_graph_with_predicted_flops():
    model, batch = tiny_model(), tiny_batch()
    # liveness=False: every trie node runs, the count of the trie oracle below (tests/passes/analysis/test_liveness.py
    # checks the needed ones)
    report = brcompile.explain(grpo_loss, model, **batch, backend=brcompile.backend(**EAGER, liveness=False))

    # it replayed, and the result is the eager loss; measuring left every .grad alone
    assert report.stats.replayed_calls == 1 and report.stats.fallback_calls == 0, str(report.stats)
    torch.testing.assert_close(report.result, grpo_loss(model, **batch), rtol=1e-12, atol=0)
    assert all(p.grad is None for p in model.parameters())

    (g,) = report.rewritten
    assert not report.fallbacks
    text = str(report)
    for needle in ("REWRITTEN", "causal+keypad", "tree_attention_forward x2", "calls: the prefix tree",
                   "predicted cost", "limit = (dense - dense_attention)", "packed graph", "def forward"):
        assert needle in text, needle

    (call,) = report.calls
    B, L = batch["input_ids"].shape
    nodes, pairs = trie_pairs(batch["input_ids"], batch["attention_mask"])
    tree = call["tree"]
    assert call["replayed"] and tree["rows"] == B and tree["logical_tokens"] == B * L
    assert tree["executed_tokens"] == nodes < B * L

    cost = call["cost"]
    D, H, layers = CFG["dim"] // CFG["n_heads"], CFG["n_heads"], CFG["n_layers"]
    per_pair = (4 + 10) * D * H * layers  # fwd q.k and p.v, bwd 5 matmuls; every head and layer
    assert cost["backward"]
    assert cost["dense_attention_flops"] == per_pair * B * L * L  # torch's SDPA formula: the full score matrix
    assert cost["packed_attention_flops"] == per_pair * pairs  # the tree: each visible pair once
    limit = (cost["dense_flops"] - cost["dense_attention_flops"]) * nodes / (B * L) + per_pair * pairs
    assert cost["limit_flops"] == pytest.approx(limit, abs=1)
    # the packed graph runs within 5% of the limit (docs/ARCHITECTURE.md §9) and saves less for backward than dense
    assert cost["limit_flops"] <= cost["packed_flops"] <= 1.05 * cost["limit_flops"], cost
    assert cost["packed_flops"] < cost["dense_flops"]
    assert 0 < cost["packed_saved_bytes"] < cost["dense_saved_bytes"]

    d = json.loads(json.dumps(report.to_dict()))
    assert d["graphs"][0]["rewritten"] and d["graphs"][0]["brcompile_nodes"]["tree_attention_forward"] == 2
    assert d["graphs"][0]["packed_code"] and d["calls"][0]["cost"]["limit_flops"] == cost["limit_flops"]
    assert d["stats"]["replayed_calls"] == 1


class _SnapshotBackend(brcompile.BranchReplayBackend):
    """A branch_replay backend that remembers each runtime's attributes as it returned them."""

    def __init__(self, **options):
        super().__init__(**options)
        self.returned = []

    def __call__(self, gm, example_inputs, options=None):
        rt = super().__call__(gm, example_inputs, options)
        self.returned.append((rt, dict(vars(rt))))
        return rt


def test_explain_leaves_no_global_state():
    """explain patches and installs nothing: torch.compile and every runtime attribute are the objects they
    were, no Dynamo cache entry of the report stays on the loss's code, and torch.compile of the same loss
    afterwards compiles its own (dense) graph: no replayed call."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.testing import CompileCounter

    model, batch = tiny_model(), tiny_batch()
    real_compile, code = torch.compile, grpo_loss.__code__
    dense = CompileCounter()
    torch.compile(grpo_loss, backend=dense)(model, **batch)  # a user's compiled function, compiled before
    before = [(e.backend, e.guard_manager) for e in _debug_get_cache_entry_list(code)]
    assert len(before) == 1 and dense.frame_count == 1

    be = _SnapshotBackend(**EAGER)
    report = brcompile.explain(grpo_loss, model, **batch, backend=be)
    assert report.stats.replayed_calls == 1 and report.calls[0]["cost"]["packed_flops"] > 0
    assert torch.compile is real_compile
    assert be.returned
    for rt, attrs in be.returned:  # nothing of the runtimes was replaced (no spies)
        for name in ("original", "packed", "eager_packed"):
            assert getattr(rt, name) is attrs[name], name
    assert [(e.backend, e.guard_manager) for e in _debug_get_cache_entry_list(code)
            if e.backend is not None] == before  # the user's entry untouched, the report's dropped

    brcompile.reset_stats()
    again = CompileCounter()
    torch.compile(grpo_loss, backend=again)(model, **batch)
    torch.compile(grpo_loss, backend=dense)(model, **batch)  # the user's entry still serves its own backend
    assert again.frame_count == 1 and dense.frame_count == 1
    assert brcompile.stats().replayed_calls == 0 and brcompile.stats().compiled_graphs == 0

    # a function explained twice gets a fresh capture each time (nothing left to hit or to count)
    brcompile.explain(grpo_loss, model, **batch, backend=brcompile.backend(**EAGER), measure=False)
    assert not [e for e in _debug_get_cache_entry_list(code) if e.backend is not None
                and getattr(e.backend, "compiler_fn", None) not in (dense, again)]


def test_report_of_a_fallback_names_node_and_reason():
    torch.manual_seed(0)
    model = Bidirectional().double()
    ids = torch.randint(1, 37, (3, 7))
    report = brcompile.explain(lm_loss, model, ids, backend=brcompile.backend(**EAGER))
    assert not report.rewritten and report.stats.fallback_calls == 1
    (g,) = report.fallbacks
    assert g.code is brcompile.Code.MASK_NOT_CAUSAL and g.failed_node
    text = str(report)
    assert "FELL BACK" in text and g.failed_node in text and "bidirectional" in text  # the detail is shown
    # grouped by construct and code, with the rule's description
    assert "refusals by construct and code" in text and "mask_not_causal" in text
    assert brcompile.Code.MASK_NOT_CAUSAL.describe()[:30] in text.replace("\n", " ")
    assert report.refusals_by_code() == {brcompile.Code.MASK_NOT_CAUSAL: {"graphs": [g.graph_id], "calls": 1}}
    (call,) = report.calls
    assert not call["replayed"] and call["code"] == "mask_not_causal" and "bidirectional" in call["reason"]
    assert call["cost"]["dense_flops"] > 0 and "packed_flops" not in call["cost"]
    assert "ran the original graph" in text
    as_json = json.loads(json.dumps(report.to_dict()))
    assert as_json["graphs"][0]["failed_node"] == g.failed_node and as_json["graphs"][0]["code"] == "mask_not_causal"
    assert as_json["stats"]["fallback_codes"] == {"mask_not_causal": 1}


def test_report_prints_plain_and_rich():
    model, batch = tiny_model(), tiny_batch()
    report = brcompile.explain(grpo_loss, model, **batch, backend=brcompile.backend(**EAGER), measure=False)
    assert "cost" not in report.calls[0]
    plain = io.StringIO()
    report.print(plain, rich=False, code=False)
    assert plain.getvalue() == report.render_text(code=False) + "\n"
    assert "def forward" not in plain.getvalue() and "executed N" in plain.getvalue()
    pytest.importorskip("rich")
    fancy = io.StringIO()
    report.print(fancy, rich=True)
    out = fancy.getvalue()
    assert "REWRITTEN" in out and "executed N" in out and "def forward" in out


def test_recording_takes_over_default_backend_and_leaves_others():
    model = tiny_model()
    real_compile = torch.compile
    with recording(brcompile.backend(**EAGER), measure=False) as rec:
        step = torch.compile(grpo_loss)  # default backend: compiled with branch_replay
        other = torch.compile(lambda x: x.cos() * 2, backend="eager")  # left alone
        for seed in (1, 2):
            step(model, **tiny_batch(seed))
        other(torch.ones(3))
    assert torch.compile is real_compile
    report = rec.report()
    assert len(report.calls) == 2 and all(c["replayed"] for c in report.calls)
    assert report.graphs and all(g.rewritten for g in report.graphs)
    assert [g.graph_id for g in report.graphs] == list(range(len(report.graphs)))
    assert any("backend='eager'" in n for n in report.notes)
    assert isinstance(report, ExplainReport) and report.stats.replayed_calls == 2


def test_mutating_node_detection():
    def mutates(x):
        x.add_(1)
        return x * 2

    def ands(x):
        return operator.and_(x > 0, x < 1) & (x != 0.5)

    def relu_inplace(x):
        return F.relu(x * 2, inplace=True)

    g = fx.Graph()  # y = x * 2; y[0] = 1.0 (operator.setitem, as Dynamo records it)
    x = g.placeholder("x")
    y = g.call_function(operator.mul, (x, 2))
    g.call_function(operator.setitem, (y, 0, 1.0))
    g.output(y)
    setitem = fx.GraphModule(torch.nn.Module(), g)

    assert "add_" in mutating_node(fx.symbolic_trace(mutates))
    assert mutating_node(fx.symbolic_trace(ands)) is None
    assert "inplace" in mutating_node(fx.symbolic_trace(relu_inplace))
    assert "setitem" in mutating_node(setitem)


def test_a_write_into_a_fresh_value_is_measured():
    """A graph whose only write is into a fresh value (HF's chunked loops: ``out[:, :, i] = ...`` into a
    ``zeros_like``) is measured as its functionalized copy: the FLOPs of the matmul forward and backward."""
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def f(x):
        y = torch.zeros_like(x)
        y[:, 0] = x[:, 0] @ w
        return y.sum()

    report = brcompile.explain(f, torch.randn(3, 2, 4, dtype=torch.float64))
    cost = report.calls[0]["cost"]
    assert "skipped" not in cost, cost
    assert cost["dense_flops"] == 2 * 3 * 4 * 4 * 2, cost  # [3, 4] @ [4, 4] forward, and dW backward


def test_explain_cli_runs_a_script_and_reports_at_exit(tmp_path, capsys):
    """``python -m brcompile explain script.py``: the script's torch.compile runs branch_replay, other backends
    are left alone and listed, the report comes at exit (also through sys.exit), nothing stays patched."""
    from brcompile.__main__ import main

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import sys
        import torch
        from examples.gpt import GPT, GPTConfig
        from examples.grpo import grpo_loss, make_grpo_batch

        model = GPT(GPTConfig(vocab_size=37, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=16)).double()
        step = torch.compile(grpo_loss)
        for seed in range(int(sys.argv[1])):
            batch = make_grpo_batch(num_prompts=2, group_size=3, prompt_len=(5, 8), response_len=(2, 4),
                                    vocab_size=37, dtype=torch.float64, seed=seed)
            step(model, **batch).backward()
        torch.compile(torch.sin, backend="eager")(torch.ones(2))
        sys.exit(3)
    """))
    real_compile = torch.compile
    rc = main(["explain", "--compiler", "eager", "--json", str(tmp_path / "r.json"), "--rich", "no", "--no-code",
               str(script), "2"])
    out = capsys.readouterr().out
    assert rc == 3 and torch.compile is real_compile
    assert "brcompile explain" in out and "REWRITTEN" in out and "predicted cost" in out
    assert "backend='eager'" in out and "def forward" not in out
    doc = json.loads((tmp_path / "r.json").read_text())
    assert len(doc["calls"]) == 2 and all(c["replayed"] for c in doc["calls"])
    assert all("limit_flops" in c["cost"] for c in doc["calls"])
    assert brcompile.stats().replayed_calls == 2


def test_dump_dir_writes_python_and_coloured_dot(tmp_path):
    model, batch = tiny_model(), tiny_batch()
    out = torch.compile(grpo_loss, backend=brcompile.backend(dump_dir=str(tmp_path / "ok"), **EAGER))(model, **batch)
    torch.testing.assert_close(out, grpo_loss(model, **batch), rtol=1e-12, atol=0)
    assert brcompile.stats().replayed_calls == 1
    names = {p.name for p in (tmp_path / "ok").iterdir()}
    expected = {"graph_0_before.py", "graph_0_after.py", "graph_0_before.dot", "graph_0_after.dot",
                # the graph as each rewriting stage of the pipeline left it (passes/pipeline.py)
                "graph_0_dynamo_1_functionalise.py", "graph_0_dynamo_2_canonicalise_attention.py",
                "graph_0_dynamo_3_computed_keys.py", "graph_0_dynamo_4_canonicalise_scans.py"}
    if shutil.which("dot"):
        expected |= {"graph_0_before.svg", "graph_0_after.svg"}
    assert names == expected
    before = (tmp_path / "ok" / "graph_0_before.py").read_text()
    after = (tmp_path / "ok" / "graph_0_after.py").read_text()
    stages = [(tmp_path / "ok" / n).read_text() for n in sorted(names) if "_dynamo_" in n]
    for src in (before, after, *stages):
        compile(src, "dump", "exec")  # readable Python, and valid
    assert "after stage 'canonicalise attention'" in stages[1]
    assert "REWRITTEN" in before and "token(row=0, pos=1)" in before and "tree_attention" in after
    dot_after = (tmp_path / "ok" / "graph_0_after.dot").read_text()
    for kind in ("token", "dense", "const", "tree", "brcompile"):
        assert f'fillcolor="{COLOURS[kind][0]}"' in dot_after, kind
    assert dot_after.count("->") > 50 and dot_after.startswith("digraph")

    torch.manual_seed(0)
    torch.compile(lm_loss, backend=brcompile.backend(dump_dir=str(tmp_path / "fb"), **EAGER))(
        Bidirectional().double(), torch.randint(1, 37, (3, 7)))
    assert brcompile.stats().fallback_codes == {brcompile.Code.MASK_NOT_CAUSAL: 1}
    before = (tmp_path / "fb" / "graph_0_before.py").read_text()
    assert "FELL BACK" in before and "bidirectional" in before
    assert not (tmp_path / "fb" / "graph_0_after.py").exists()
    assert "penwidth=4" in (tmp_path / "fb" / "graph_0_before.dot").read_text()  # the node it stopped at


def test_torch_logs_plus_brcompile_logs_before_and_after_graphs():
    code = (
        "import torch, brcompile\n"
        "from examples.gpt import GPT, GPTConfig\n"
        "m = GPT(GPTConfig(vocab_size=31, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=16)).double()\n"
        "ids = torch.randint(1, 31, (3, 7)); ids[1:, :4] = ids[0, :4]\n"
        "torch.compile(m, backend=brcompile.backend(compiler='eager'))(ids)\n"
        "assert brcompile.stats().replayed_calls == 1\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TORCH_LOGS": "+brcompile", "PYTHONPATH": root}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "branch_replay graph 0 before:" in proc.stderr and "branch_replay graph 0 after:" in proc.stderr
    assert "tree_attention" in proc.stderr


def test_measure_counts_cpu_attention_and_leaves_grads_alone():
    """brcompile.tools.measure: CPU SDPA counted with torch's formula (fwd 4 B H L^2 D, bwd 10 B H L^2 D), the
    bytes saved for backward exclude the inputs that require grad, and every ``.grad`` is left as it was."""
    from brcompile.tools.measure import measure_fwd_bwd

    q = torch.randn(2, 3, 7, 8, requires_grad=True)
    q.grad = torch.full_like(q, 5.0)
    cost = measure_fwd_bwd(lambda x: F.scaled_dot_product_attention(x, x, x, is_causal=True).sum(), [q])
    assert cost.backward and cost.attention_flops == cost.flops == 14 * 2 * 3 * 7 * 7 * 8
    assert cost.other_flops == 0 and cost.saved_bytes > 0
    assert torch.equal(q.grad, torch.full_like(q, 5.0))


def test_report_of_per_block_graphs_shows_tree_keys_and_provenance():
    """Blocks compiled one by one: the report's call table says which call hashed its keys (the first
    block's hidden states) and which reused the previous block's tree (provenance), with the keys; the
    cost of each call is measured even though its input (a hidden state) is not a leaf."""
    model = tiny_model()
    batch = tiny_batch()
    ids = batch["input_ids"]
    with recording(brcompile.backend(**EAGER), measure=True) as rec:
        blocks = [torch.compile(layer) for layer in model.layers]
        h = model.tok_emb(ids)
        cos, sin = model.rotary_cos_sin(ids.shape[1], h.device, h.dtype)
        for blk in blocks:
            h = blk(h, cos, sin)
        h.square().sum().backward()
    report = rec.report()
    assert [c["replayed"] for c in report.calls] == [True, True]
    assert [c["tree"]["source"] for c in report.calls] == ["built", "provenance"]
    table = report.call_tables()[0]
    assert table.headers[-2:] == ["tree from", "tree keys"]
    assert [row[-2] for row in table.rows] == ["keys hashed", "provenance"]
    B, L = ids.shape
    assert all(row[-1] == f"[{B}, {L}, {CFG['dim']}] float64" for row in table.rows)
    costs = [c.get("cost") for c in report.calls]
    assert all(c is not None and "skipped" not in c and c["packed_flops"] < c["dense_flops"] for c in costs), costs
