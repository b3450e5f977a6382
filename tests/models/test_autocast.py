"""Autocast and bfloat16 models: ``torch.autocast("cpu", dtype=torch.bfloat16)`` around float32 weights,
and bfloat16 weights without autocast.

Under autocast the original SDPA call sees mixed dtypes (HF's and the example GPT's rotary embeddings run
in float32, so q/k are float32 beside a bfloat16 v) and autocast casts them to bfloat16 (SDPA is on its
lower-precision list). Tree attention follows the same
policy: the packed graph casts q/k/v to the dtype the original attention computed in, and the brcompile
attention ops carry SDPA's autocast rule (backends/attention/op.py: register_lower_precision_autocast).

Bound. Packed and dense runs round differently in bfloat16 (different kernels, different reduction
orders, a shared token's gradient summed before rather than after a rounding), so they cannot be
compared to each other at a bfloat16 tolerance meaningfully. Instead both are compared with a float64
reference of the same weights on the same inputs (``model.double()``, no autocast): the replayed run's
global relative L2 error (``||x - ref|| / ||ref||``, of the loss and of all parameter gradients
concatenated; for a compiled model call also of its logits) must be at most 1.5x the dense eager run's
error in the same precision. One absolute floor, for the scalar loss only: its error is a sum of rounding
errors of random sign, so the dense run's can cancel by chance far below one bfloat16 rounding (measured:
7e-6 for a float32 loss over bfloat16 logits); below LOSS_FLOOR = 1e-4 (1/20 of bfloat16's unit roundoff)
a scalar's error counts as LOSS_FLOOR. Vectors (gradients, logits) get no floor.
"""
import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

import brcompile
from examples.gpt import GPT, GPTConfig
from examples.grpo import grpo_loss, make_grpo_batch

from tests.helpers import hf_tiny_model

RATIO = 1.5
LOSS_FLOOR = 1e-4
PRECISIONS = ("autocast", "bf16")


def backend(mode, **options):
    return brcompile.backend(compiler="eager", mode=mode, **({"chunk_tokens": 8} if mode == "replay" else {}),
                             **options)


def hf_model(family="llama", impl="sdpa"):
    """A tiny float32 HF model (skips without transformers)."""
    return hf_tiny_model(family, impl, dtype=None)


def gpt_model():
    return GPT(GPTConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2))


def precision_ctx(precision):
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "autocast" else contextlib.nullcontext()


def prepare(model, precision):
    """(the model run in ``precision``, its float64 copy: the reference of the same weights)."""
    run = model.float() if precision == "autocast" else model.to(torch.bfloat16)
    return run, copy.deepcopy(run).double()


def batch(seed=1, left=True):
    """Two groups of 3 rollouts: left-padded ragged prompts, right-padded ragged responses (TRL's layout); with
    ``left=False`` right-padded rows."""
    return make_grpo_batch(vocab_size=61, seed=seed, num_prompts=2, group_size=3, prompt_len=(4, 7),
                           response_len=(2, 5), left_pad_prompts=left, pad_id=0, dtype=torch.float64)


def hf_loss(model, ids, am, cm, temperature=0.7):
    """Masked mean negative log-likelihood of the completion tokens."""
    logits = model(input_ids=ids, attention_mask=am).logits[:, :-1] / temperature
    lp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = cm[:, 1:].to(lp.dtype)
    return -(lp * m).sum() / m.sum()


def run_step(fn, model, args, precision):
    """{"loss", "gradients" (all parameters', concatenated)[, "logits"]}, float64, of ``fn(model, *args)`` in
    ``precision``; ``fn`` returns the loss or (loss, logits)."""
    params = [p for p in model.parameters() if p.requires_grad]
    with precision_ctx(precision):
        res = fn(model, *args)
    loss, logits = res if isinstance(res, tuple) else (res, None)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    flat = torch.cat([(torch.zeros_like(p) if g is None else g).double().flatten() for p, g in zip(params, grads)])
    out = {"loss": loss.detach().double(), "gradients": flat}
    if logits is not None:
        out["logits"] = logits.detach().double()
    return out


def rel(x, ref):
    return ((x - ref).norm() / ref.norm()).item()


def check_against_float64(fn_eager, fn_compiled, model, args_of, precision, inside=False):
    """Replayed (fired, no fallback) and within RATIO of the dense run's error against float64. ``inside``:
    the functions enter autocast themselves (the reference runs without it)."""
    run, ref_model = prepare(model, precision)
    dt = next(run.parameters()).dtype
    args = args_of(dt)
    ref = run_step(fn_eager.__wrapped__ if inside else fn_eager, ref_model, args_of(torch.float64, like=args), None)
    ctx = None if inside else precision
    dense = run_step(fn_eager, run, args, ctx)
    brcompile.reset_stats()
    got = run_step(fn_compiled, run, args, ctx)
    s = brcompile.stats()
    assert s.replayed_calls > 0 and s.fallback_calls == 0, str(s)
    assert s.executed_tokens < s.logical_tokens, str(s)
    for what in ref:
        e_dense, e_got = rel(dense[what], ref[what]), rel(got[what], ref[what])
        print(f"{precision} {what}: dense {e_dense:.3e} replayed {e_got:.3e} ratio {e_got / e_dense:.2f}")
        bound = RATIO * (max(e_dense, LOSS_FLOOR) if what == "loss" else e_dense)
        assert e_got <= bound, f"{what}: replayed error {e_got:.3e} > {RATIO} x dense {e_dense:.3e}"


def hf_args(b):
    """args_of(dtype, like=None): the HF loss inputs (no float inputs: dtype-free)."""
    def args_of(dtype, like=None):
        return (b["input_ids"], b["attention_mask"], b["completion_mask"])
    return args_of


def grpo_args(b):
    """args_of(dtype, like=None): GRPO inputs, advantages and old log-probs in float32 (as a trainer keeps
    them) or float64 for the reference: with ``like`` (the run's args) the same values, widened."""
    def args_of(dtype, like=None):
        if like is not None:
            return (*like[:3], like[3].double(), like[4].double())
        return (b["input_ids"], b["attention_mask"], b["completion_mask"], b["advantages"].float(),
                b["old_logprobs"].float())
    return args_of


# --------------------------------------------------------------------------------------------------
# end to end


# The two HF tests split the (precision, mode) product between them: each meets both precisions and both
# modes, and every (precision, mode) pair runs on an HF model once (the GPT test below runs all four).
@pytest.mark.parametrize("precision,mode", [("autocast", "packed"), ("bf16", "replay")])
def test_hf_llama_whole_loss(precision, mode):
    check_against_float64(hf_loss, torch.compile(hf_loss, backend=backend(mode)), hf_model("llama"),
                          hf_args(batch()), precision)


@pytest.mark.parametrize("precision,mode", [("autocast", "replay"), ("bf16", "packed")])
def test_hf_model_call(precision, mode):
    """The model call compiled alone (the loss outside the compiled region); Qwen2 (q/k/v biases)."""
    model = hf_model("qwen2")
    compiled = {}

    def fn(m, ids, am, cm):
        if m not in compiled:  # one compiled closure per model object, as a trainer compiles its model
            # drop_padding=False: the logits are compared at every position, the pads included
            compiled[m] = torch.compile(lambda i, a: m(input_ids=i, attention_mask=a).logits,
                                        backend=backend(mode, drop_padding=False))
        logits = compiled[m](ids, am)
        return head_loss(logits, ids, cm), logits

    def eager(m, ids, am, cm):
        logits = m(input_ids=ids, attention_mask=am).logits
        return head_loss(logits, ids, cm), logits

    check_against_float64(eager, fn, model, hf_args(batch()), precision)


@pytest.mark.parametrize("family,precision,mode", [
    ("llama", "autocast", "packed"), ("llama", "bf16", "replay"), ("qwen2", "autocast", "replay"),
])
def test_hf_eager_attention(family, precision, mode):
    """HF's eager attention (``matmul(q, k^T) * c + mask``, a float32 softmax cast back to q's dtype, ``matmul``
    with v), canonicalised to one SDPA node (passes/canonical/attention/). Under autocast both products run in
    bfloat16 while the mask (float32, as the weights) promotes the scores to float32 and q/k stay float32 after
    the rotary: tree attention computes in bfloat16, as both products did. Right-padded rows: a left-padded row's
    pad queries see no key, which eager attention makes uniform or NaN (the float64 reference's too)."""
    be = backend(mode)
    check_against_float64(hf_loss, torch.compile(hf_loss, backend=be), hf_model(family, "eager"),
                          hf_args(batch(left=False)), precision)
    rec = next(r for r in be.records if r.packed_code is not None)
    assert "softmax" in rec.original_code and "tree_attention" in rec.packed_code, rec.packed_code


def head_loss(logits, ids, cm):
    lp = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return -(lp * cm[:, 1:]).sum() / cm[:, 1:].sum()


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("mode", ["packed", "replay"])
def test_gpt_grpo(precision, mode):
    check_against_float64(grpo_loss, torch.compile(grpo_loss, backend=backend(mode)), gpt_model(),
                          grpo_args(batch()), precision)


@pytest.mark.parametrize("mode", ["packed", "replay"])
def test_autocast_inside_compiled_function(mode, monkeypatch):
    """``with torch.autocast(...)`` inside the compiled function: Dynamo records the region in the graph and
    the packed graph keeps it. Streamed, the outer graph calls the trunk inside the same region (the region's
    end stays after the call, with the loss side), so the prefix and every chunk run in bfloat16 as the packed
    graph does, and a chunk's re-run in backward restores that state."""
    def loss(*a):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return grpo_loss(*a)

    loss.__wrapped__ = grpo_loss
    from brcompile.runtime import streaming

    states, run_tail = [], streaming._run_tail

    def recording_run_tail(*args, **kwargs):  # the autocast state each chunk runs in (forward and re-run)
        states.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return run_tail(*args, **kwargs)

    monkeypatch.setattr(streaming, "_run_tail", recording_run_tail)
    be = backend(mode)
    check_against_float64(loss, torch.compile(loss, backend=be), gpt_model(), grpo_args(batch()), "autocast",
                          inside=True)
    if mode == "replay":
        rec = be.records[-1]
        assert rec.replay_reason is None and brcompile.stats().streamed_calls == 1, rec.replay_reason
        outer = rec.replay["outer_code"].splitlines()
        call = next(i for i, line in enumerate(outer) if "replay_trunk" in line)
        enter = next(i for i, line in enumerate(outer) if "_enter_autocast" in line)
        exit_ = next(i for i, line in enumerate(outer) if "_exit_autocast" in line)
        assert enter < call < exit_, rec.replay["outer_code"]
        assert states and all(st == (True, torch.bfloat16) for st in states), states


def test_autocast_region_inside_the_trunk_runs_packed():
    """An autocast region that covers one block only (its start and end fall inside the token-local part):
    streaming would run the chunks' trunk in two precisions around a boundary it cannot place; the split
    refuses it by name and the packed mode runs, replayed."""
    model = gpt_model()
    block = model.layers[1]
    plain = block.forward

    def autocast_block(*args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return plain(*args, **kwargs)

    block.forward = autocast_block
    be = backend("replay")
    b = batch()
    args = grpo_args(b)(torch.float32)
    brcompile.reset_stats()
    torch.compile(grpo_loss, backend=be)(model, *args).backward()
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.streamed_calls == 0 and s.fallback_calls == 0, str(s)
    why = be.records[-1].replay_reason or ""
    assert be.records[-1].replay_code is brcompile.Code.STREAMING_AUTOCAST, why


# --------------------------------------------------------------------------------------------------
# the ops and the rule


def _tree(n):
    return (torch.full((n,), n, dtype=torch.long), torch.ones(n, dtype=torch.bool), torch.tensor([[0, n, n]]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tree_attention_follows_sdpa_autocast(dtype):
    """Mixed q/k/v dtypes inside autocast: cast like SDPA (to the region's dtype), same output and dtype;
    gradients reach the inputs in their own dtypes."""
    from brcompile.backends.attention.op import tree_attention

    torch.manual_seed(0)
    n = 6
    q = torch.randn(4, n, 8, requires_grad=True)
    k = torch.randn(2, n, 8, requires_grad=True)
    v = torch.randn(2, n, 8).bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        out = tree_attention(q, k, v, _tree(n), impl="cpu")
        want = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)[0]
    assert out.dtype == want.dtype == dtype
    torch.testing.assert_close(out, want, atol=1e-2, rtol=1e-2)
    out.float().sum().backward()
    assert (q.grad.dtype, k.grad.dtype, v.grad.dtype) == (torch.float32, torch.float32, torch.bfloat16)
    x64 = torch.randn(4, n, 8, dtype=torch.float64)
    with torch.autocast("cpu", dtype=dtype):  # float64 is never cast (autocast's policy)
        assert tree_attention(x64, x64[:2], x64[:2], _tree(n), impl="reference").dtype == torch.float64


def test_cached_attention_follows_sdpa_autocast():
    from brcompile.backends.attention.cached import tree_attention_cached

    torch.manual_seed(0)
    n, p = 3, 4
    q, k, v = torch.randn(4, n, 8), torch.randn(2, n, 8), torch.randn(2, n, 8).bfloat16()
    kc, vc = torch.randn(2, p, 8), torch.randn(2, p, 8).bfloat16()
    cross = torch.tensor([[0, n, 0, p]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = tree_attention_cached(q, k, v, _tree(n), kc, vc, torch.ones(p, dtype=torch.bool), cross, 8 ** -0.5)
    assert out.dtype == torch.bfloat16
    kk, vv = torch.cat([kc, k], 1).bfloat16(), torch.cat([vc, v], 1).bfloat16()
    mask = torch.ones(n, p + n, dtype=torch.bool)
    mask[:, p:] = torch.ones(n, n, dtype=torch.bool).tril()
    want = F.scaled_dot_product_attention(q.bfloat16()[None], kk[None], vv[None], attn_mask=mask, enable_gqa=True)[0]
    torch.testing.assert_close(out, want, atol=1e-2, rtol=1e-2)


def test_unresolvable_attention_dtypes_fall_back():
    """q/k/v dtypes that autocast does not produce (a float64 among them, here planted in the traced
    metadata): CannotReplay at compile time (passes/analysis/rules/attention.py) with the reason; the original
    graph runs. (At the Dynamo level: the ATen level traces the graph again and would not see the planted
    metadata.)"""
    from brcompile.passes.analysis.axes import example_value
    from brcompile.passes.analysis.rules.attention import SDPA, attention_dtype

    inner = brcompile.backend(compiler="eager", level="dynamo")
    seen = []

    def planting(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in SDPA:
                q = node.args[0]
                q.meta["example_value"] = example_value(q).to(torch.float64)
                seen.append(attention_dtype(node))
        return inner(gm, example_inputs)

    model = gpt_model()
    b = batch()
    args = (b["input_ids"], b["attention_mask"], b["completion_mask"], b["advantages"].float(),
            b["old_logprobs"].float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.compile(grpo_loss, backend=planting)(model, *args)
        want = grpo_loss(model, *args)
    assert seen and all(d is None and "not autocast's casts" in why for d, why in seen)
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls >= 1, str(s)
    assert brcompile.Code.ATTENTION_DTYPE in s.fallback_codes, str(s)
    assert any("not autocast's casts" in r for r in s.details(brcompile.Code.ATTENTION_DTYPE)), str(s)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
