"""benchmarks/hf_sweep.py: the per-architecture function classifies (llama, Doge, ZAYA and Inkling replay exactly,
PhiMoE falls back because its router draws random numbers per token in training) and the summary normalises reasons
into classes. Classifications, not timings."""
import pytest

pytest.importorskip("transformers", minversion="5.0")

from benchmarks import hf_sweep  # noqa: E402


def test_llama_replays_exactly():
    row = hf_sweep.run_arch("llama")
    assert row["status"] == "replayed", row
    assert row["impl"] == "sdpa" and row["dtype"] == "float64"
    assert row["replayed_calls"] >= 1 and row["fallback_calls"] == 0
    assert row["executed_tokens"] < row["logical_tokens"]
    # HF's RMSNorm runs in float32 inside a float64 model: the float32 bound, with the reason recorded
    assert row["bound"] == 1e-5 and "LlamaRMSNorm" in row["bound_reason"]
    assert row["loss_err"] <= row["bound"] and row["grad_err"] <= row["bound"]


def test_doge_replays_exactly():
    # Doge adds exp(A[h]·softplus(dt_proj(v[b, k]))) per key: one more q/k feature (the per-key bias)
    row = hf_sweep.run_arch("doge")
    assert row["status"] == "replayed", row
    assert row["replayed_calls"] >= 1 and row["fallback_calls"] == 0
    assert row["executed_tokens"] < row["logical_tokens"]
    assert row["loss_err"] <= row["bound"] and row["grad_err"] <= row["bound"]


def test_zaya_replays_exactly():
    # ZAYA's router drops its "skip" expert index to 0 (masked_fill): the expert keys stay in [0, E), so the
    # grouped experts' histc counts replay; its tiny config routes each token to one expert
    row = hf_sweep.run_arch("zaya")
    assert row["status"] == "replayed", row
    assert row["replayed_calls"] >= 1 and row["fallback_calls"] == 0
    assert row["executed_tokens"] < row["logical_tokens"]
    assert row["loss_err"] <= row["bound"] and row["grad_err"] <= row["bound"]


def test_inkling_replays_exactly():
    # Inkling's relative-logit bank: each query's bias-vs-distance row projected from its hidden state, gathered
    # by the clamped distance (through its log-scaling factor per query row, inside the sdpa mask): tree
    # attention's relative bias
    row = hf_sweep.run_arch("inkling_text")
    assert row["status"] == "replayed", row
    assert row["replayed_calls"] >= 1 and row["fallback_calls"] == 0
    assert row["executed_tokens"] < row["logical_tokens"]
    assert row["loss_err"] <= row["bound"] and row["grad_err"] <= row["bound"]


def test_phimoe_falls_back_with_reason():
    row = hf_sweep.run_arch("phimoe")
    assert row["status"] == "fell back", row
    assert row["replayed_calls"] == 0 and row["fallback_calls"] >= 1
    # its router's training-mode Gumbel noise: every copy of a shared token would draw its own numbers
    codes = {g["code"] for g in row["graphs"] if not g["unshared"] and not g["rewritten"]}
    assert "random_draw" in codes, hf_sweep.row_reasons(row)
    assert row["loss_err"] <= row["bound"] and row["grad_err"] <= row["bound"]  # the original graph ran


def test_reason_classes_and_table():
    a = "attention inputs are not packed token values: view_3 was made dense by addmm_1 (view [6, 13, 32] -> [78, 32])"
    b = "attention inputs are not packed token values: view_7 was made dense by addmm_4 (view [6, 11, 32] -> [66, 32])"
    assert hf_sweep.reason_class(a) == hf_sweep.reason_class(b)
    rows = [
        dict(arch="x", model_class="X", status="fell back", fallback_reasons={a: 1}, graphs=[], error=None,
             executed_tokens=0, logical_tokens=0),
        dict(arch="y", model_class="Y", status="fell back", fallback_reasons={b: 1}, graphs=[], error=None,
             executed_tokens=0, logical_tokens=0),
        dict(arch="z", model_class="Z", status="replayed", fallback_reasons={}, graphs=[], error=None,
             executed_tokens=5, logical_tokens=9, bound=1e-10, bound_reason="float64", loss_err=0.0, grad_err=0.0),
        dict(arch="w", model_class="W", status="not instantiable", error="build: ValueError: needs a vision config"),
    ]
    summ = hf_sweep.summarize(rows)
    assert summ["counts"]["fell back"] == 2 and summ["counts"]["replayed"] == 1
    assert summ["runnable"] == 3 and round(summ["replay_pct"]) == 33
    assert summ["reason_classes"][0][1] == 2  # one class, two archs
    md = hf_sweep.markdown(dict(rows=rows, summary=summ, transformers="t", torch="t", date="d"))
    assert "| z | Z | replayed exactly |" in md


def test_streaming_sweep_row_and_table(monkeypatch):
    """``--mode replay``: MPT (ALiBi over the columns) streams exactly — its cross pairs against the cached prompt
    carry the bias —; the summary counts streamed architectures and the table lists why a graph stayed packed."""
    monkeypatch.setattr(hf_sweep, "MODE", "replay")
    row = hf_sweep.run_arch("mpt")
    assert row["status"] == "replayed" and row["mode"] == "replay", row
    assert row["streamed_calls"] >= 1 and row["replay_reasons"] == [], row
    packed = dict(row, arch="p", streamed_calls=0, replay_reasons=[
        "streaming replay: a dense region is packed again (passes/analysis/repack.py): it runs on the whole [B, L] batch"])
    summ = hf_sweep.summarize([row, packed])
    assert summ["streamed"] == 1 and summ["streamed_exact"] == 1
    assert summ["streaming_refusals"][0][1] == 1
    md = hf_sweep.markdown(dict(rows=[row, packed], summary=summ, transformers="t", torch="t", date="d"))
    assert "1 architectures streamed at least one call" in md and "a dense region is packed again" in md
