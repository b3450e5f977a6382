"""benchmarks/device_check.py without a GPU: the plain run says there is nothing to check and exits 0; ``--quick``
runs every part at tiny sizes on whatever device there is and writes its report."""
import json

import torch

from benchmarks import device_check


def test_without_cuda_it_says_so_and_exits_0(monkeypatch, capsys, tmp_path):
    """No CUDA device and no --quick: the message, exit status 0, and no report file."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "report.json"
    assert device_check.main(["--out", str(out)]) == 0
    assert "no CUDA device: nothing to check" in capsys.readouterr().out
    assert not out.exists()


def test_quick_runs_every_part_and_writes_the_report(tmp_path):
    """--quick: (a) every impl/dtype row is OK or names why it was not checked, (b) a timed row per method that
    runs here, (c) branch_replay's GRPO step replays with eager's loss; the JSON and markdown reports agree."""
    out = tmp_path / "report.json"
    assert device_check.main(["--quick", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["quick"] and not doc["failed"]
    cuda = torch.cuda.is_available()
    assert {r["case"].split()[0] for r in doc["check"]} == {"triton", "flex"}
    for r in doc["check"]:
        assert r["note"].startswith(("OK", "not checked")), r
        if r["note"].startswith("OK"):
            assert max(r["errors"].values()) <= r["bound"], r
            assert ("dq" in r["errors"]) == (cuda or r["case"].startswith("triton")), r
    timed = {r["method"] for r in doc["timing"] if r.get("ms")}
    assert timed == ({"triton", "flex", "sdpa"} if cuda else {"triton", "sdpa"}), doc["timing"]
    eager, replay, flex = doc["grpo"]
    assert eager["method"] == "dense eager"
    bound = 2e-2 * max(1.0, abs(eager["loss"])) if cuda else 1e-5  # the quick GRPO model is bf16 on CUDA
    assert replay["replayed_calls"] > 0 and replay["loss_diff"] <= bound, replay
    if cuda:
        assert flex["replayed_calls"] > 0, flex
    else:
        assert flex["replayed_calls"] == 0 and "'flex' has no backward on cpu" in flex["note"], flex
    text = device_check.markdown(device_check.Report(**doc))
    for heading in ("## (a)", "## (b)", "## (c)"):
        assert heading in text
    assert "branch_replay attention=flex" in text
