"""Streaming replay (``mode="replay"`` / ``"auto"``, docs/ARCHITECTURE.md §7) end to end.

Oracle: the same function run eagerly on the dense batch (float64: loss and every parameter gradient
<= 1e-10 relative). Every test asserts through ``brcompile.stats().streamed_calls`` and the call record's
chunk schedule that the batch really ran as prefix + several tail chunks.
"""
import functools

import pytest
import torch

import brcompile
from brcompile.testing import TOLERANCE, rel_err
from examples.gpt import GPT, GPTConfig
from examples.grpo import grpo_loss, make_grpo_batch
from tests.helpers import hf_tiny_model

TOL = TOLERANCE[torch.float64]




def gpt(**kw):
    cfg = dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48)
    cfg.update(kw)
    return GPT(GPTConfig(**cfg), seed=0).double()


def grpo_args(batch):
    return (batch["input_ids"], batch["attention_mask"], batch["completion_mask"], batch["advantages"],
            batch["old_logprobs"], 0.2, True)


def check(fn, args, params, backend, tol=TOL, dynamic=None, grad_tol=None):
    """Eager vs compiled: output and every gradient; returns the compiled call's record."""
    ref = fn(*args)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3), dtype=ref.dtype)
    gref = torch.autograd.grad((ref * w).sum(), params)
    out = torch.compile(fn, backend=backend, dynamic=dynamic)(*args)
    gout = torch.autograd.grad((out * w).sum(), params)
    assert rel_err(out.detach(), ref.detach()) <= tol, f"output: {rel_err(out.detach(), ref.detach()):.3e}"
    for i, (a, b) in enumerate(zip(gout, gref)):
        err = rel_err(a, b)
        assert err <= (grad_tol or tol), f"grad {i} {tuple(b.shape)}: relative error {err:.3e}"
    return backend.records[-1].runtime.calls[-1]


def assert_streamed(rec, min_chunks=2):
    s = brcompile.stats()
    assert s.streamed_calls == 1 and s.replayed_calls == 1 and s.fallback_calls == 0, str(s)
    assert rec.mode == "replay" and rec.schedule["chunks"] >= min_chunks, rec
    assert 0 < rec.schedule["prefix_tokens"] < rec.schedule["tokens"]


BATCHES = {
    "g32": dict(num_prompts=1, group_size=32, prompt_len=11, response_len=(2, 5)),
    "nested": dict(num_prompts=2, group_size=5, prompt_len=(6, 9), response_len=(4, 7), shared_response_prefix=3),
    "padded": dict(num_prompts=2, group_size=4, prompt_len=(4, 9), response_len=(2, 6), left_pad_prompts=True),
}


@pytest.mark.parametrize("chunk_tokens", [1, 9, 64])
@pytest.mark.parametrize("name", sorted(BATCHES))
def test_grpo_streamed_exact(name, chunk_tokens):
    model = gpt()
    batch = make_grpo_batch(vocab_size=61, seed=1, dtype=torch.float64, **BATCHES[name])
    backend = brcompile.backend(compiler="eager", mode="replay", chunk_tokens=chunk_tokens)
    rec = check(functools.partial(grpo_loss, model), grpo_args(batch), list(model.parameters()), backend)
    assert_streamed(rec, min_chunks=2 if chunk_tokens < 64 or name == "g32" else 1)
    assert rec.schedule["largest_chunk"] <= max(chunk_tokens, 7)  # a leaf chain longer than a chunk is alone


@pytest.mark.parametrize("attention,dtype,tol", [("reference", torch.float64, TOL), ("triton", torch.float32, 1e-5)])
def test_attention_impls(attention, dtype, tol):
    """The tail chunks' own-tree part runs on the chosen impl (triton: the interpreter on CPU, float32)."""
    if attention == "triton":
        pytest.importorskip("triton")
    model = gpt().to(dtype)
    batch = make_grpo_batch(vocab_size=61, seed=8, dtype=dtype, **BATCHES["nested"])
    backend = brcompile.backend(compiler="eager", mode="replay", chunk_tokens=9, attention=attention)
    rec = check(functools.partial(grpo_loss, model), grpo_args(batch), list(model.parameters()), backend, tol=tol)
    assert_streamed(rec)
    assert f"'{attention}'" in backend.records[0].replay["tail_code"]


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compilers_and_dynamic(compiler):
    """The three graphs compiled (AOTAutograd / Inductor, dynamic shapes): two batch shapes, one capture."""
    model = gpt()
    backend = brcompile.backend(compiler=compiler, mode="replay", chunk_tokens=6)
    fn = functools.partial(grpo_loss, model)
    compiled = torch.compile(fn, backend=backend, dynamic=True)
    params = list(model.parameters())
    for seed, kw in ((1, BATCHES["nested"]), (2, BATCHES["padded"])):
        args = grpo_args(make_grpo_batch(vocab_size=61, seed=seed, dtype=torch.float64, **kw))
        ref = fn(*args)
        gref = torch.autograd.grad(ref, params)
        out = compiled(*args)
        gout = torch.autograd.grad(out, params)
        assert rel_err(out.detach(), ref.detach()) <= TOL
        assert max(rel_err(a, b) for a, b in zip(gout, gref)) <= TOL
    s = brcompile.stats()
    assert s.streamed_calls == 2 and len(backend.records) == 1, str(s)


def test_model_only_logits_and_backward_accumulates():
    """Model-only compile (the frontier is the [N, V] logits): logits equal everywhere; ``.backward()``
    fills ``.grad`` like the dense run, also for a tied head (one parameter used in and out of the trunk)."""
    model = gpt(tie_embeddings=True)
    batch = make_grpo_batch(vocab_size=61, seed=4, dtype=torch.float64, **BATCHES["nested"])
    ids, am = batch["input_ids"], batch["attention_mask"]
    w = torch.randn(*ids.shape, 61, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ref = model(ids, am)
    (ref * w).sum().backward()
    gref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    # drop_padding=False: the logits are compared, and weighted, at every position, the pads included
    compiled = torch.compile(model, backend=brcompile.backend(compiler="eager", mode="replay", chunk_tokens=5,
                                                              drop_padding=False))
    out = compiled(ids, am)
    (out * w).sum().backward()
    assert rel_err(out.detach(), ref.detach()) <= TOL
    for n, p in model.named_parameters():
        assert rel_err(p.grad, gref[n]) <= TOL, n
    assert brcompile.stats().streamed_calls == 1


def test_second_backward_is_refused_clearly():
    model = gpt()
    args = grpo_args(make_grpo_batch(vocab_size=61, seed=5, dtype=torch.float64, **BATCHES["nested"]))
    loss = torch.compile(functools.partial(grpo_loss, model),
                         backend=brcompile.backend(compiler="eager", mode="replay", chunk_tokens=8))(*args)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_no_grad_call():
    """Under no_grad (evaluation) streaming keeps no prefix graph and gives the same loss."""
    model = gpt()
    args = grpo_args(make_grpo_batch(vocab_size=61, seed=5, dtype=torch.float64, **BATCHES["g32"]))
    fn = functools.partial(grpo_loss, model)
    with torch.no_grad():
        ref = fn(*args)
        out = torch.compile(fn, backend=brcompile.backend(compiler="eager", mode="replay", chunk_tokens=8))(*args)
    assert rel_err(out, ref) <= TOL and not out.requires_grad
    assert brcompile.stats().streamed_calls == 1


def test_auto_mode_follows_the_memory_budget():
    model = gpt()
    args = grpo_args(make_grpo_batch(vocab_size=61, seed=6, dtype=torch.float64, **BATCHES["g32"]))
    fn = functools.partial(grpo_loss, model)
    small = brcompile.backend(compiler="eager", mode="auto", memory_budget=1, chunk_tokens=8)
    torch.compile(fn, backend=small)(*args).backward()
    assert brcompile.stats().streamed_calls == 1
    torch._dynamo.reset()
    brcompile.reset_stats()
    big = brcompile.backend(compiler="eager", mode="auto", memory_budget=2**40)
    torch.compile(fn, backend=big)(*args).backward()
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.streamed_calls == 0, str(s)
    assert big.records[0].replay["bytes_per_token"] > 0


def test_options_are_checked():
    with pytest.raises(ValueError, match="memory_budget"):
        brcompile.backend(mode="auto")
    with pytest.raises(ValueError, match="mode="):
        brcompile.backend(mode="stream")
    with pytest.raises(ValueError, match="chunk_tokens"):
        brcompile.backend(mode="replay", chunk_tokens=0)


def test_explain_shows_the_split_and_schedule():
    model = gpt()
    args = grpo_args(make_grpo_batch(vocab_size=61, seed=7, dtype=torch.float64, **BATCHES["nested"]))
    backend = brcompile.backend(compiler="eager", mode="replay", chunk_tokens=6)
    report = brcompile.explain(functools.partial(grpo_loss, model), *args, backend=backend, measure=False)
    text = report.render_text()
    assert "streaming replay" in text and "K/V of tree_attention_forward" in text, text
    assert "streamed calls: the chunk schedule" in text and "streaming tail graph" in text, text
    g = report.to_dict()["graphs"][0]
    assert len(g["replay"]["cached"]) == 2  # one attention per layer
    call = report.to_dict()["calls"][0]
    assert call["mode"] == "replay" and call["schedule"]["chunks"] >= 2


# ------------------------------------------------------------------------------------------------- HF
# Only these tests need transformers: hf_tiny_model skips per test, so the GPT tests above still run without it.


@pytest.mark.parametrize("norms", ["hf", "float64"])
def test_hf_qwen2_streamed(norms, request):
    """An unmodified Qwen2 (SDPA, float64) model-only compile on a left-padded prompt + right-padded
    completion batch. HF's RMSNorm rounds to float32, so gradients meet the float32 bound (as in packed
    mode, tests/models/test_hf.py); with the norms in float64 every gradient meets 1e-10."""
    if norms == "float64":
        request.getfixturevalue("float64_norms")
    model = hf_tiny_model("qwen2", "sdpa", torch.float64)
    batch = make_grpo_batch(vocab_size=61, seed=2, num_prompts=2, group_size=6, prompt_len=(4, 8),
                            response_len=(2, 5), left_pad_prompts=True)

    def logits(ids, am):
        return model(input_ids=ids, attention_mask=am).logits

    # drop_padding=False: check() weights the logits at every position, the pads included
    backend = brcompile.backend(compiler="eager", mode="replay", chunk_tokens=7, drop_padding=False)
    rec = check(logits, (batch["input_ids"], batch["attention_mask"]), list(model.parameters()), backend,
                grad_tol=TOLERANCE[torch.float64 if norms == "float64" else torch.float32])
    assert_streamed(rec)


def test_memory_benchmark_worker_and_table():
    """benchmarks/bench_replay.py: one in-process worker per mode on a tiny grid; the table reports them."""
    from benchmarks import bench_replay

    args = bench_replay.build_parser().parse_args(
        ["--prompt-len", "40", "--response-len", "6", "--dim", "32", "--layers", "1", "--heads", "4",
         "--kv-heads", "2", "--vocab", "64", "--chunk-tokens", "12", "--compiler", "eager", "--repeats", "1",
         "--threads", "1"])
    results = []
    for mode in bench_replay.MODES:
        args.mode, args.group = mode, 6
        brcompile.reset_stats()
        torch._dynamo.reset()
        results.append(bench_replay.worker(args))
    by = {r["mode"]: r for r in results}
    assert by["replay"]["streamed"] == 3 and by["packed"]["streamed"] == 0  # warm-up, measured, timed
    assert by["replay"]["max_grad_rel_err"] < 1e-4 and by["packed"]["max_grad_rel_err"] < 1e-4
    assert by["replay"]["saved"] < by["packed"]["saved"] < by["dense"]["saved"]
    table = bench_replay.markdown(results, args)
    assert table.count("\n| 6 |") == 1 and "replay grad err" in table


@pytest.mark.parametrize("model", ["mixtral", "mpt"])
def test_memory_benchmark_hf_models(model):
    """``bench_replay.py --model mixtral|mpt``: the HF model of the benchmark's sizes streams (a MoE block's sort-based
    dispatch, ALiBi against the cached prompt) in every call of the worker, within float32's bound of the dense run."""
    pytest.importorskip("transformers")
    from benchmarks import bench_replay

    args = bench_replay.build_parser().parse_args(
        ["--prompt-len", "40", "--response-len", "6", "--dim", "32", "--layers", "1", "--heads", "4",
         "--kv-heads", "2", "--vocab", "64", "--chunk-tokens", "12", "--compiler", "eager", "--repeats", "1",
         "--threads", "1", "--model", model])
    args.mode, args.group = "replay", 6
    brcompile.reset_stats()
    torch._dynamo.reset()
    r = bench_replay.worker(args)
    assert r["streamed"] == 3 and r["replayed"] == 3, r  # warm-up, measured, timed
    assert r["max_grad_rel_err"] < 1e-4, r

