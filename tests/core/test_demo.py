"""The README demo end to end through branch_replay (small sizes): exact, and it replayed."""
import brcompile
from examples import grpo_demo


def test_demo_replays_and_passes(capsys):
    rc = grpo_demo.main(["--groups", "2", "--group-size", "3", "--prompt-len", "9:12", "--response-len", "3:5",
                         "--dim", "32", "--layers", "1", "--dtype", "float64", "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "PASS" in out and "speedup" in out
    s = brcompile.stats()
    assert s.replayed_calls >= 1 and s.fallback_calls == 0, str(s)
