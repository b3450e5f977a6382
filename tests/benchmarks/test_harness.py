"""The benchmark harness (benchmarks/harness.py, run as ``python benchmarks/bench_grpo.py``) on tiny grids:
JSON schema, PNG, exactness of every method, that branch_replay really replayed, that the methods share no
state, the PrefixGrouper adapter, the command line."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from benchmarks import harness
from brcompile.__main__ import main as brcompile_main
from examples.gpt import GPT, GPTConfig
from examples.grpo import grpo_loss, make_grpo_batch

HAS_PG = importlib.util.find_spec("prefix_grouper") is not None
HAS_MPL = importlib.util.find_spec("matplotlib") is not None
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINY = ["--dim", "16", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--vocab", "29", "--dtype", "float64",
        "--repeats", "1", "--compile-backend", "eager", "--compiler", "eager", "--rich", "no"]


def test_tiny_grid_is_exact_and_replays(tmp_path, capsys):
    methods = ["eager", "torch.compile", "branch_replay"] + (["prefix_grouper"] if HAS_PG else [])
    rc = harness.main(["--group-sizes", "2,3", "--prefix-lens", "11", "--tail-lens", "4", "--methods",
                       ",".join(methods), "--out", str(tmp_path), "--json", str(tmp_path / "copy.json"), *TINY])
    out = capsys.readouterr().out
    assert rc == 0, out
    for title in ("wall-clock", "executed FLOPs", "bytes saved for backward", "exactness"):
        assert title in out
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert json.loads((tmp_path / "copy.json").read_text()) == doc
    assert doc["schema"] == "brcompile.bench/3" and doc["environment"]["torch"] == torch.__version__
    assert [(r["case"]["group_size"], r["case"]["prefix_len"], r["case"]["tail_len"]) for r in doc["results"]] \
        == [(2, 11, 4), (3, 11, 4)]
    for r in doc["results"]:
        G = r["case"]["group_size"]
        assert r["subject"] == "gpt" and (r["B"], r["L"]) == (G, 15) and r["tree_nodes"] == 11 + 4 * G
        # the last token of a row predicts nothing: not needed; the logits of the prompt's last token are read
        assert (r["needed_tokens"], r["live_tokens"], r["padding_fraction"]) == (11 + 3 * G, 1 + 3 * G, 0.0)
        assert r["flop_ratio_limit"] == pytest.approx(r["dense_flops"] / r["limit_flops"])
        assert r["limit_flops"] < r["tree_limit_flops"]
        assert list(r["methods"]) == methods
        for name, m in r["methods"].items():
            assert m["error"] is None, (name, m["error"])
            assert m["exact"] and m["max_rel_grad_err"] <= 1e-10 and m["loss_rel_err"] <= 1e-10, (name, m)
            assert m["seconds"] > 0 and m["speedup"] > 0 and m["saved_bytes"] > 0
        br = r["methods"]["branch_replay"]
        assert br["replayed_calls"] >= 1 and not br["fallback_reasons"] and br["executed_tokens"] == r["needed_tokens"]
        assert br["over_limit"] == pytest.approx(br["flops"] / r["limit_flops"])
        assert r["overhead"]["calls"] >= 1 and r["overhead"]["tree"] > 0
        assert r["methods"]["torch.compile"]["replayed_calls"] == 0  # the dense method ran the dense graph
        assert r["methods"]["torch.compile"]["flops"] == r["methods"]["eager"]["flops"] == r["dense_flops"]
        assert r["limit_flops"] <= br["flops"] < r["methods"]["eager"]["flops"]
        if HAS_PG:
            assert r["limit_flops"] <= r["methods"]["prefix_grouper"]["flops"] < r["methods"]["eager"]["flops"]
            assert r["methods"]["prefix_grouper"]["executed_tokens"] == 11 + 4 * G   # one grouped row
    if HAS_MPL:
        assert (tmp_path / "bench_speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert doc["plot"] == str(tmp_path / "bench_speedup.png")
    else:
        assert doc["plot"] is None and "matplotlib" in doc["notes"][0]


def _global_state() -> dict:
    """What a method could patch or leave active: torch.compile and its relatives, the SDPA entry points,
    the dispatch-mode stack."""
    return {"torch.compile": torch.compile, "Module.compile": torch.nn.Module.compile,
            "Module.__call__": torch.nn.Module.__call__, "dynamo.optimize": torch._dynamo.optimize,
            "F.sdpa": F.scaled_dot_product_attention, "torch.sdpa": torch._C._nn.scaled_dot_product_attention,
            "grpo_loss": grpo_loss, "dispatch modes": torch._C._len_torch_dispatch_stack()}


def test_methods_are_isolated(tmp_path, capsys):
    """The branch_replay method leaves nothing behind that another method would run: torch.compile and every
    attribute a method could patch are what they were, no Dynamo cache entry stays on the loss's own code,
    and the dense torch.compile method (run after branch_replay) compiled and ran the dense graph, with its
    own backend, and never reached branch_replay."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    before = _global_state()
    rc = harness.main(["--group-sizes", "3", "--prefix-lens", "9", "--tail-lens", "3", "--methods",
                       "eager,branch_replay,torch.compile", "--out", str(tmp_path), "--no-plot", *TINY])
    assert rc == 0, capsys.readouterr().out
    assert _global_state() == before
    assert _debug_get_cache_entry_list(grpo_loss.__code__) == []
    (r,) = json.loads((tmp_path / "bench.json").read_text())["results"]
    calls = {name: m["replayed_calls"] for name, m in r["methods"].items()}
    assert calls["branch_replay"] >= 3 and calls["torch.compile"] == 0 and calls["eager"] == 0, calls
    # the dense method's compiled code is its own backend's (not branch_replay's), and its graph is dense:
    # it executed the dense FLOPs, not the packed ones
    entries = _debug_get_cache_entry_list(harness._loss_torch_compile.__code__)
    assert entries and all(getattr(e.backend, "compiler_name", None) == "eager" for e in entries)
    assert r["methods"]["torch.compile"]["flops"] == r["dense_flops"] > r["methods"]["branch_replay"]["flops"]


@pytest.mark.skipif(not HAS_PG, reason="prefix_grouper not installed (pip install prefix-grouper)")
def test_prefix_grouper_adapter_is_exact_on_ragged_groups():
    """Several prompts of different lengths, ragged responses sharing their first tokens: PrefixGrouper's loss
    and gradients through the adapter equal the dense loss's."""
    from benchmarks.peer_prefix_grouper import group_batch, prefix_grouper_grpo_loss, status

    assert status()[0]
    model = GPT(GPTConfig(vocab_size=37, dim=24, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=40)).double()
    batch = make_grpo_batch(num_prompts=3, group_size=3, prompt_len=(4, 9), response_len=(2, 6),
                            shared_response_prefix=2, vocab_size=37, dtype=torch.float64, seed=5)
    params = list(model.parameters())
    ref = grpo_loss(model, **batch)
    gref = torch.autograd.grad(ref, params)
    gb = group_batch(batch, group_size=3)
    assert gb.input_ids.shape[0] == 3
    out = prefix_grouper_grpo_loss(model, gb, batch)
    gout = torch.autograd.grad(out, params)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=0)
    for (name, _), a, b in zip(model.named_parameters(), gout, gref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.skipif(not HAS_PG, reason="prefix_grouper not installed (pip install prefix-grouper)")
def test_prefix_grouper_on_a_micro_batch_of_shuffled_rows():
    """A micro-batch of rows from several groups, out of order (benchmarks/bench_window.py): grouped by prompt,
    PrefixGrouper's loss and gradients equal the dense loss's on those rows."""
    from benchmarks.peer_prefix_grouper import group_by_prompt, prefix_grouper_grpo_loss

    model = GPT(GPTConfig(vocab_size=37, dim=24, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=40)).double()
    full = make_grpo_batch(num_prompts=3, group_size=3, prompt_len=(4, 9), response_len=(2, 6),
                           shared_response_prefix=2, vocab_size=37, dtype=torch.float64, seed=5)
    rows = torch.tensor([7, 1, 4, 0, 8])
    batch = {k: v[rows] for k, v in full.items()}
    params = list(model.parameters())
    ref = grpo_loss(model, **batch)
    gref = torch.autograd.grad(ref, params)
    gb = group_by_prompt(batch)
    assert gb.input_ids.shape[0] == 3  # rows 7 and 8, 1 and 0, and 4 share their prompts
    out = prefix_grouper_grpo_loss(model, gb, batch)
    gout = torch.autograd.grad(out, params)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=0)
    for (name, _), a, b in zip(model.named_parameters(), gout, gref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14, msg=lambda m: f"grad of {name}: {m}")


def test_flags_of_both_earlier_command_lines():
    """The flags of ``python -m brcompile bench`` and of the earlier two-method bench_grpo.py both parse;
    ``--quick`` only sets defaults."""
    args = harness.parse_args(["--group-size", "8", "--prompt-lens", "512,2048", "--response-len", "128",
                               "--backend", "aot_eager", "--mixed-groups"])
    assert (args.group_sizes, args.prefix_lens, args.tail_lens) == ([8], [512, 2048], [128])
    assert args.methods == ["eager", "torch.compile"] and args.compile_backend == "aot_eager"
    assert args.cases == ["grid"]   # a grid flag without --cases means the grid
    assert [c.name for c in harness.make_cases(args)] == [
        "G=8 P=512 T=128", "2 groups G=8 P=256..512 T=32..128 shared 16",
        "G=8 P=2048 T=128", "2 groups G=8 P=1024..2048 T=32..128 shared 16"]
    assert harness.parse_args(["--backend", "branch_replay"]).methods == ["eager", "branch_replay"]
    quick = harness.parse_args(["--quick", "--group-sizes", "3", "--methods", "branch_replay"])
    assert quick.group_sizes == [3] and quick.prefix_lens == [16, 48] and quick.compiler == "eager"
    assert quick.methods == ["eager", "branch_replay"]
    ragged = harness.make_cases(harness.parse_args(["--group-sizes", "4", "--prefix-lens", "9", "--tail-lens",
                                                    "6", "--ragged", "--num-prompts", "2"]))
    assert [c.batch_kwargs()["response_len"] for c in ragged] == [(3, 6)]


def test_brcompile_bench_points_at_the_script(capsys):
    assert brcompile_main(["bench", "--quick"]) == 2
    assert "python benchmarks/bench_grpo.py" in capsys.readouterr().err


def test_bench_grpo_runs_as_a_script_from_the_repo_root(tmp_path):
    """The script from the repository root, PrefixGrouper included when installed."""
    methods = "eager,prefix_grouper" if HAS_PG else "eager"
    proc = subprocess.run([sys.executable, "benchmarks/bench_grpo.py", "--group-sizes", "2", "--prefix-lens", "5",
                           "--tail-lens", "2", "--methods", methods, "--out", str(tmp_path), "--no-plot", *TINY],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (r,) = json.loads((tmp_path / "bench.json").read_text())["results"]
    assert all(m["exact"] and m["error"] is None for m in r["methods"].values()), r["methods"]
    assert "--group-sizes" in harness.build_parser().format_help()


HAS_HF = importlib.util.find_spec("transformers") is not None


def test_case_flags():
    """No flag: the whole suite at the default sizes; --quick: at the quick sizes; --cases picks cases;
    --suite-sizes sets G,GROUPS,P,TMIN,TMAX,SHARED."""
    args = harness.parse_args([])
    assert args.cases == list(harness.SUITE_CASES) and args.suite_sizes == harness.SUITE_SIZES["default"]
    assert harness.parse_args(["--quick"]).suite_sizes == harness.SUITE_SIZES["quick"]
    args = harness.parse_args(["--cases", "ragged,dpo", "--suite-sizes", "4,3,20,2,10,3"])
    ragged, dpo = harness.make_cases(args)
    assert ragged.name == "ragged: 3 groups G=4 P=10..20 T=2..10"
    assert dpo.name == "dpo: 4 pairs P=10..20 T=2..10" and dpo.subject == ("gpt", "dpo")
    assert harness.parse_args(["--cases", "grid"]).cases == ["grid"]
    with pytest.raises(SystemExit):
        harness.parse_args(["--cases", "nope"])
    with pytest.raises(SystemExit):
        harness.parse_args(["--suite-sizes", "1,2,3"])


def test_default_suite_padding():
    """At the default sizes (the bench's default vocabulary) the ragged cases carry 25-60 % padding (right
    padding; TRL's layout left-pads the prompts too), the equal case none; in every case the loss needs fewer
    nodes than the tree has."""
    config = GPTConfig(vocab_size=256, dim=16, n_layers=1, n_heads=2, n_kv_heads=1)
    cases = [harness.suite_case(name, harness.SUITE_SIZES["default"]) for name in harness.SUITE_CASES
             if HAS_HF or name != "qwen2-trl"]
    for case in cases:
        subject = harness.make_subject(case.subject, config, 0, torch.float32, torch.device("cpu"), cases)
        batch = subject.make_batch(case, 0, torch.device("cpu"), torch.float32)
        pad = harness.padding_fraction(batch)
        if case.label == "equal":
            assert pad == 0.0
        else:
            assert 0.25 <= pad <= 0.60, (case.name, pad)
        needed = harness.count_needed(batch["input_ids"], subject.liveness(case, batch), subject.head_window(batch))
        assert needed.nodes < needed.tree_nodes, case.name


def test_quick_suite_is_exact_and_counts_every_method(tmp_path, capsys):
    """Every suite case on a tiny model: each method exact, branch_replay replays every call, every method's
    FLOPs at or above the needed limit, the peer on the GPT's GRPO cases only, the overhead measured (liveness
    reported as n/a while brcompile.runtime has no liveness stage)."""
    cases = [c for c in harness.SUITE_CASES if HAS_HF or c != "qwen2-trl"]
    methods = ["eager", "branch_replay"] + (["prefix_grouper"] if HAS_PG else [])
    rc = harness.main(["--cases", ",".join(cases), "--suite-sizes", "2,2,6,2,8,2", "--methods", ",".join(methods),
                       "--out", str(tmp_path), "--no-plot", *TINY])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "run-time overhead" in out and "tokens: per model call" in out
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert [r["case"]["label"] for r in doc["results"]] == cases
    for r in doc["results"]:
        name = r["name"]
        assert r["needed_tokens"] < r["tree_nodes"] and r["live_tokens"] <= r["needed_tokens"], name
        assert r["limit_flops"] < r["tree_limit_flops"] < r["dense_flops"], name
        for k, m in r["methods"].items():
            if m["skipped"]:
                assert k == "prefix_grouper" and r["subject"] != "gpt", name
                continue
            assert m["error"] is None and m["exact"], (name, k, m)
            assert m["flops"] >= r["limit_flops"] and m["over_limit"] >= 1.0, (name, k)
        br = r["methods"]["branch_replay"]
        assert br["replayed_calls"] >= 1 and not br["fallback_reasons"], name
        o = r["overhead"]
        assert o["calls"] >= 1 and o["tree"] > 0 and o["guards"] >= 0, name
        assert o["liveness"] is not None and o["liveness"] >= 0, name
    padded = {r["case"]["label"]: r["padding_fraction"] for r in doc["results"]}
    assert padded["equal"] == 0.0 and padded["ragged"] > 0.0
