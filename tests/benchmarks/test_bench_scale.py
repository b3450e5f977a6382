"""benchmarks/bench_scale.py on a tiny ladder: the flow the GPU session runs (Qwen2-shaped model, exactness
check on the first rung, stop at the first failing rung), on CPU in seconds."""
import pytest
import torch

from benchmarks import bench_scale


def test_tiny_ladder_streams_every_rung_exactly(capsys):
    """The CPU flow: a subprocess per rung, exactness on the check batch first."""
    rc = bench_scale.main(["--tiny"])
    out = capsys.readouterr().out
    assert rc == 0, out  # every rung replayed in streaming mode, no fallback
    # k*P + k*G*(T - 1): every row's last position predicts no target, and nothing after it is read
    assert "Largest rung that ran: 896 logical positions (312 executed" in out, out
    err = float(out.split("max grad rel err ")[1].split(".\n")[0].rstrip("."))
    assert err <= 1e-5, out  # float32 vs the dense run of the same batch


def test_tiny_ladder_of_the_gpu_flow_on_cpu(capsys):
    """The GPU flow (one process, a Qwen2-shaped HF model, triton -> cpu attention here) on a tiny ladder."""
    pytest.importorskip("transformers")
    rc = bench_scale.main(["--tiny", "--model", "qwen2-tiny", "--in-process"])
    out = capsys.readouterr().out
    assert rc == 0, out
    # k*P + k*G*(T - 1): every row's last position predicts no target, and nothing after it is read
    assert "Largest rung that ran: 896 logical positions (312 executed" in out, out
    err = float(out.split("max grad rel err ")[1].split(".\n")[0].rstrip("."))
    assert err <= 1e-5, out


def _fake_result(rung):
    k, g, p, t = rung
    return dict(rung=list(rung), logical=k * g * (p + t), executed=k * p + k * g * t, first_s=1.0, steady_s=0.5,
                step_peak=2**30, param_bytes=2**20, saved_bytes=2**29, kv_bytes=2**28, chunk_bytes=2**27,
                frontier_bytes=2**26, loss_side_bytes=2**25, tree_bytes=2**24, dense_projected=2**34,
                replayed=2, streamed=2, fallbacks={}, loss_rel_err=0.0, max_grad_rel_err=1e-7)


def test_subprocess_ladder_stops_at_the_first_failing_rung(monkeypatch, capsys):
    """A rung that fails (out of memory) ends the ladder; the table names it and the largest that ran."""
    calls = []

    def fake_rung(args, rung, check, timeout):
        calls.append(rung)
        return {"rung": list(rung), "error": "OOM: can't allocate"} if len(calls) == 2 else _fake_result(rung)

    monkeypatch.setattr(bench_scale, "run_rung", fake_rung)
    rc = bench_scale.main([])
    out = capsys.readouterr().out
    assert rc == 0 and len(calls) == 2, (calls, out)
    assert "failed: OOM: can't allocate" in out and "Largest rung that ran: 139,264 logical" in out, out


def test_in_process_ladder_stops_at_the_first_oom(monkeypatch, capsys):
    """The CUDA ladder: torch.cuda.OutOfMemoryError in a rung ends it (model and compile stubbed out)."""
    class FakeBench:
        warmup_s = 0.0

        def __init__(self, args):
            self.n = 0

        def check(self):
            return {"loss_rel_err": 0.0, "max_grad_rel_err": 1e-7}

        def run(self, rung):
            self.n += 1
            if self.n == 3:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80 GiB")
            return _fake_result(rung)

    monkeypatch.setattr(bench_scale, "Bench", FakeBench)
    rc = bench_scale.main(["--device", "cuda"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "failed: OOM: CUDA out of memory" in out and "Largest rung that ran: 278,528 logical" in out, out
