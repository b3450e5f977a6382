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


def test_context_parallel_mode_tiny(tmp_path, capsys):
    """``--context-parallel 2`` on a tiny batch: two gloo ranks, then the 1-rank reference. The pieces cover the packed
    tokens, every rank cut the same way, the loss is the same on every rank and equals the 1-rank run's, and the
    all-reduced gradients agree with it (float32). No timing is asserted."""
    raw = tmp_path / "raw.pt"
    rc = bench_scale.main(["--context-parallel", "2", "--tiny", "--groups", "2", "--group-size", "3", "--prompt-len",
                           "40", "--response-len", "6", "--raw", str(raw)])
    out = capsys.readouterr().out
    assert rc == 0, out
    n = 2 * 40 + 2 * 3 * (6 - 1)  # k*P + k*G*(T - 1): a row's last position predicts nothing and is not read
    assert f"{n} packed tokens" in out and f"Tokens over the ranks: {n} (sum; every rank the same cut: True)" in out, out
    saved = torch.load(raw, weights_only=False)
    results, ref = saved["results"], saved["ref"]
    assert [r["rank"] for r in results] == [0, 1] and len(ref) == 1
    assert sum(r["tokens"] for r in results) == results[0]["offsets"][-1] == ref[0]["tokens"] == n
    assert all(r["tokens"] == r["stats_tokens"] and r["cp_calls"] == 1 and not r["whole_calls"] for r in results)
    assert [r["tokens"] for r in results] == [b - a for a, b in zip(results[0]["offsets"], results[0]["offsets"][1:])]
    s = bench_scale.cp_summary(results, ref)
    assert s["executed"] == n and s["loss_spread"] == 0.0
    assert s["loss_rel_err"] <= 1e-6 and s["max_grad_rel_err"] <= 1e-4, s
    # the rows printed are the raw figures
    for r in results:
        assert f"| {r['rank']} | {r['tokens']:,} | {r['work'][r['rank']]:.4g} |" in out, out
    assert f"rel err {s['loss_rel_err']:.1e}" in out and f"max rel err {s['max_grad_rel_err']:.1e}" in out, out
