"""The README demo end to end through branch_replay (small sizes): exact, and it replayed; a run that
falls back prints FAIL and exits 1, never PASS."""
import pytest

import brcompile
from examples import grpo_demo

SMALL = ["--groups", "2", "--group-size", "3", "--prompt-len", "9:12", "--response-len", "3:5", "--dim", "32",
         "--layers", "1", "--dtype", "float64", "--repeats", "1"]


def test_demo_replays_and_passes(capsys):
    rc = grpo_demo.main(["--model", "gpt", *SMALL])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "PASS" in out and "speedup" in out
    s = brcompile.stats()
    assert s.replayed_calls >= 1 and s.fallback_calls == 0, str(s)


def test_demo_qwen2_replays_and_passes(capsys):
    """The HF path: Qwen2ForCausalLM compiled alone, left-padded prompts, logits_to_keep = C + 1, the loss
    eager; loss and gradients to the float32 bound (HF's float32 RMSNorm under Inductor) with the reason
    printed."""
    pytest.importorskip("transformers", minversion="5.0")
    rc = grpo_demo.main(["--model", "qwen2", *SMALL])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "== qwen2" in out and "logits_to_keep=" in out and "prompts left-padded" in out
    assert "vs 1e-05)" in out
    assert "loss and gradients against 1e-05, not 1e-10: HF's Qwen2RMSNorm computes in float32" in out
    assert out.count("PASS") == 1 and "FAIL" not in out, out
    s = brcompile.stats()
    assert s.replayed_calls == 3 and s.fallback_calls == 0, str(s)      # checked call, warm-up, 1 timed
    assert s.executed_tokens < s.logical_tokens, str(s)


def test_demo_fallback_is_a_failure(capsys):
    """One rollout per prompt: nothing is shared, the backend runs the original graph (dedup below its
    threshold). The numbers then agree trivially; the demo must still say FAIL and exit 1."""
    pytest.importorskip("transformers", minversion="5.0")
    argv = ["--model", "qwen2", *SMALL]
    argv[argv.index("--group-size") + 1] = "1"
    rc = grpo_demo.main(argv)
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "PASS" not in out and "FAIL: the checked call did not replay (0 replayed, 1 fell back:" in out, out
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls >= 1, str(s)
    assert set(s.fallback_codes) == {brcompile.Code.SHARES_TOO_LITTLE}, str(s)
