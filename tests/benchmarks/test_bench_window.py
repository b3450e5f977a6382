"""benchmarks/bench_window.py runs (``--quick``): the window computes the ideal token count, its gradients equal
dense eager accumulation's (float32), and every method is timed."""
import pytest
import torch

import brcompile
from benchmarks import bench_window


@pytest.mark.slow
def test_quick_run_reaches_the_ideal_exactly():
    args = bench_window.parse(["--quick", "--micro-batches", "2", "--repeats", "1"])
    rows = bench_window.run(args)
    assert [r["rows_per_call"] for r in rows] == [2]
    for r in rows:
        assert r["window_tokens"] == r["ideal_tokens"] < r["call_tokens"], r
        assert r["window_replayed"] > 0 and r["window_grad_err"] <= 1e-5, r
        assert {"eager", "br call", "br window", "br one call"} <= set(r["seconds"]), r
    assert "window / one call" in bench_window.table(rows)
    torch._dynamo.reset()
    brcompile.reset_stats()
