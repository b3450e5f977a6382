"""``python -m brcompile bench`` on a tiny grid (JSON schema, PNG, exactness of every method), the
PrefixGrouper adapter, and ``python -m brcompile explain script.py``."""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import brcompile
from brcompile.__main__ import main
from examples.gpt import GPT, GPTConfig
from examples.grpo import grpo_loss, make_grpo_batch

HAS_PG = importlib.util.find_spec("prefix_grouper") is not None
HAS_MPL = importlib.util.find_spec("matplotlib") is not None
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINY = ["--dim", "16", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--vocab", "29", "--dtype", "float64",
        "--repeats", "1", "--compile-backend", "eager", "--compiler", "eager", "--rich", "no"]


def test_bench_cli_tiny_grid(tmp_path, capsys):
    methods = ["eager", "torch.compile", "branch_replay"] + (["prefix_grouper"] if HAS_PG else [])
    rc = main(["bench", "--group-sizes", "2,3", "--prefix-lens", "11", "--tail-lens", "4", "--methods",
               ",".join(methods), "--out", str(tmp_path), *TINY])
    out = capsys.readouterr().out
    assert rc == 0, out
    for title in ("wall-clock", "executed FLOPs", "bytes saved for backward", "exactness"):
        assert title in out
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["schema"] == "brcompile.bench/1" and doc["environment"]["torch"] == torch.__version__
    assert [(r["case"]["group_size"], r["case"]["prefix_len"], r["case"]["tail_len"]) for r in doc["results"]] \
        == [(2, 11, 4), (3, 11, 4)]
    for r in doc["results"]:
        G = r["case"]["group_size"]
        assert (r["B"], r["L"]) == (G, 15) and r["executed_tokens"] == 11 + 4 * G
        assert r["flop_ratio_limit"] == pytest.approx(r["dense_flops"] / r["limit_flops"])
        assert list(r["methods"]) == methods
        for name, m in r["methods"].items():
            assert m["error"] is None, (name, m["error"])
            assert m["exact"] and m["max_rel_grad_err"] <= 1e-10 and m["loss_rel_err"] <= 1e-10, (name, m)
            assert m["seconds"] > 0 and m["speedup"] > 0 and m["saved_bytes"] > 0
        br = r["methods"]["branch_replay"]
        assert br["replayed_calls"] >= 1 and not br["fallback_reasons"]
        assert r["methods"]["torch.compile"]["replayed_calls"] == 0  # the dense method ran the dense graph
        assert r["limit_flops"] <= br["flops"] < r["methods"]["eager"]["flops"]
        if HAS_PG:
            assert r["limit_flops"] <= r["methods"]["prefix_grouper"]["flops"] < r["methods"]["eager"]["flops"]
    if HAS_MPL:
        assert (tmp_path / "bench_speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert doc["plot"] == str(tmp_path / "bench_speedup.png")
    else:
        assert doc["plot"] is None and "matplotlib" in doc["notes"][0]


def test_bench_methods_are_isolated(tmp_path, capsys):
    """The branch_replay method (its explain run included) leaves nothing behind that another method would
    run: torch.compile is the same object, no Dynamo cache entry stays on the loss's code, and the dense
    torch.compile method's calls (the timed ones too) never reach branch_replay."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from brcompile import bench

    real_compile = torch.compile
    rc = main(["bench", "--group-sizes", "3", "--prefix-lens", "9", "--tail-lens", "3", "--methods",
               "eager,branch_replay,torch.compile", "--out", str(tmp_path), "--no-plot", *TINY])
    assert rc == 0, capsys.readouterr().out
    assert torch.compile is real_compile
    assert _debug_get_cache_entry_list(grpo_loss.__code__) == []
    (r,) = json.loads((tmp_path / "bench.json").read_text())["results"]
    calls = {name: m["replayed_calls"] for name, m in r["methods"].items()}
    assert calls["branch_replay"] >= 3 and calls["torch.compile"] == 0 and calls["eager"] == 0, calls
    # the dense method's compiled code is its own backend's (not branch_replay's)
    entries = _debug_get_cache_entry_list(bench._loss_torch_compile.__code__)
    assert entries and all(getattr(e.backend, "compiler_name", None) == "eager" for e in entries)


@pytest.mark.skipif(not HAS_PG, reason="prefix_grouper not installed (pip install brcompile[bench])")
def test_prefix_grouper_adapter_is_exact_on_ragged_groups():
    """Several prompts of different lengths, ragged responses sharing their first tokens: PrefixGrouper's loss
    and gradients through the adapter equal the dense loss's."""
    from brcompile.bench import group_batch, prefix_grouper_grpo_loss

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


def test_explain_cli_runs_a_script_and_reports_at_exit(tmp_path, capsys):
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


def test_python_dash_m_brcompile_entry_point():
    proc = subprocess.run([sys.executable, "-m", "brcompile", "bench", "--help"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--group-sizes" in proc.stdout and "PrefixGrouper" in proc.stdout
