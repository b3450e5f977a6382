"""Unmodified HuggingFace causal LMs under ``torch.compile(..., backend=branch_replay)``.

Tiny configs with random weights (hidden 32, 2 layers, vocab 61), built offline from a config. The oracle
is the same function run eagerly on the dense batch; every test compares the output at every position
(or the loss) and every parameter gradient, and asserts through ``brcompile.stats()`` that the packed
graph ran — or that it fell back with the expected reason.

Precision. SDPA models run in float64: outputs (logits, losses, log-probs) agree to 1e-10. HF computes
two things in float32 whatever the model's dtype, and the bounds follow:

* RMSNorm (``hidden_states.to(torch.float32)``): the forward is per token, so packed and dense agree to
  1e-16; but a shared token's gradient is the sum over its descendants, which the packed backward forms
  *before* the norm's float32 backward and the dense one after it — a reassociation around a float32
  rounding, so parameter gradients agree to the float32 bound (1e-5; measured ~1e-7).
  test_grads_float64_exact_with_float64_norms makes the norms float64 and gets 1e-10 on every gradient.
* eager attention's ``softmax(..., dtype=torch.float32)``: not a reassociation (the original rounds the
  probabilities), so a float64 eager model is refused (test_eager_float64_softmax_is_refused) and eager
  models run in float32 (<= 1e-5). The canonicalisation itself is checked in float64 with a
  float64-faithful eager attention registered in HF's AttentionInterface.
"""
import functools

import pytest
import torch

import brcompile
from brcompile.testing import assert_exact
from examples.grpo import make_grpo_batch
from tests.helpers import assert_replayed, hf_tiny_model

pytest.importorskip("transformers", minversion="5.0")  # every test here runs an HF model

EAGER_ONLY = brcompile.backend(compiler="eager")  # the packed FX graph as is: fast on 2 CPU cores
AOT = brcompile.backend(compiler="aot_eager")

#: eager attention runs in float32 (its softmax does), SDPA in float64
DTYPE = {"sdpa": torch.float64, "eager": torch.float32}


def make_model(family: str, impl: str, dtype=None, **overrides):
    """A tiny ``family`` model (tests.helpers.HF_TINY), float64 for SDPA, float32 for eager attention."""
    return hf_tiny_model(family, impl, dtype or DTYPE.get(impl, torch.float64), **overrides)


def assert_fell_back(code: brcompile.Code, reason: str | None = None):
    """No call replayed; one fell back with ``code``, a detail naming ``reason`` (when given: it tells apart cases
    that share the code)."""
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls >= 1, str(s)
    assert code in s.fallback_codes, f"no fallback with code {code}: {s}"
    if reason is not None:
        assert any(reason in r for r in s.details(code)), f"no {code} fallback reason contains {reason!r}: {s}"


#: HF's RMSNorm runs in float32 even in a float64 model: gradients meet the float32 bound (docstring)
GRAD_TOL = torch.float32


def check_grads(model, out_ref, out, weight=None, dtype=GRAD_TOL):
    """Every parameter gradient of ``sum(out * weight)`` equals the eager one (``dtype``'s bound)."""
    params = [p for p in model.parameters() if p.requires_grad]
    w = weight if weight is not None else torch.ones_like(out_ref)
    gref = torch.autograd.grad((out_ref * w).sum(), params, allow_unused=True)
    gout = torch.autograd.grad((out * w).sum(), params, allow_unused=True)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, a, b in zip(names, gout, gref):
        if b is None:
            assert a is None or not a.abs().max().item(), f"grad of {name}: eager has none"
            continue
        assert_exact(a, b, dtype, f"grad of {name}")


# --------------------------------------------------------------------------------------------------
# batches


def shared_batch(seed=1, rows=5, prompt=7, response=4):
    """No padding: ``rows`` rollouts of one prompt, two of them sharing 2 response tokens."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(1, 61, (1, prompt), generator=g).expand(rows, prompt)
    r = torch.randint(1, 61, (rows, response), generator=g)
    r[1, :2] = r[0, :2]
    ids = torch.cat([p, r], 1)
    return dict(input_ids=ids, attention_mask=None, completion_mask=torch.cat(
        [torch.zeros(rows, prompt, dtype=torch.long), torch.ones(rows, response, dtype=torch.long)], 1))


def padded_batch(seed=1, left=True):
    """Two groups of 3 with ragged prompts (left-padded when ``left``: TRL's layout) and ragged,
    right-padded responses."""
    return make_grpo_batch(vocab_size=61, seed=seed, num_prompts=2, group_size=3, prompt_len=(4, 7),
                           response_len=(2, 5), left_pad_prompts=left, pad_id=0)


def make_batch(padding: str, impl: str, seed=1):
    # a left-padded row has queries that see no key; HF's additive eager mask makes them uniform over
    # the row (non-causal), so eager attention replays right padding only (left: test_eager_left_padding)
    return shared_batch(seed) if padding == "none" else padded_batch(seed, left=impl == "sdpa")


# --------------------------------------------------------------------------------------------------
# the functions that get compiled


def logits_of(model, ids, am):
    if am is None:
        return model(input_ids=ids).logits
    return model(input_ids=ids, attention_mask=am).logits


def next_token_loss(model, ids, am, cm, temperature=0.7):
    """Masked mean negative log-likelihood of the completion tokens: logits[:, :-1] / T -> log_softmax ->
    gather (the lazy gather reads B * L scalars of the packed log-probs)."""
    logits = logits_of(model, ids, am)[:, :-1] / temperature
    lp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = cm[:, 1:].to(lp.dtype)
    return -(lp * m).sum() / m.sum()


def run_cell(model, path, batch, dynamic, backend=EAGER_ONLY, grad_tol=GRAD_TOL):
    """Eager vs compiled (model-only logits, or the whole loss); compares outputs and grads."""
    dtype = next(model.parameters()).dtype
    ids, am, cm = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    if path == "model":
        fn = functools.partial(logits_of, model)
        args = (ids, am)
    else:
        fn = functools.partial(next_token_loss, model)
        args = (ids, am, cm)
    ref = fn(*args)
    out = torch.compile(fn, backend=backend, dynamic=dynamic)(*args)
    weight = None
    if path == "model":
        # a model compiled alone leaves its padding out of the tree (drop_padding, the default): its logits
        # are the eager ones at the real positions (0 at the pads), and a loss reads the real positions only
        real = torch.ones(ids.shape, dtype=torch.bool) if am is None else am.bool()
        assert_exact(out[real], ref[real], dtype, "logits")
        weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3), dtype=dtype) * real[..., None]
    else:
        assert_exact(out, ref, dtype, "loss")
    check_grads(model, ref, out, weight, grad_tol)


# --------------------------------------------------------------------------------------------------
# the families x {sdpa, eager} x {no mask, padded} x {model-only, whole loss} x {static, dynamic}

FIVE = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]
#: (path, dynamic): the compiled function and the shape mode, which change neither the model nor the mask
RUNS = [("model", False), ("loss", True), ("model", True), ("loss", False)]


def _covering_cells():
    """Every (family, impl, padding) — what decides the model's code and its mask — with one (path, dynamic)
    each, rotated so that every family meets all four (path, dynamic) runs and so does every (impl, padding):
    all pairs (and these triples) of the five factors are covered by 20 cells instead of the 80 of the
    full product, whose other cells ran the same code paths again."""
    cells = []
    for f, family in enumerate(FIVE):
        for i, impl in enumerate(["sdpa", "eager"]):
            for p, padding in enumerate(["none", "padded"]):
                path, dynamic = RUNS[(f + i + 2 * p) % len(RUNS)]
                cells.append(pytest.param(family, impl, padding, path, dynamic, id=(
                    f"{family}-{impl}-{padding}-{path}-{'dynamic' if dynamic else 'static'}")))
    return cells


@pytest.mark.slow
@pytest.mark.parametrize("family,impl,padding,path,dynamic", _covering_cells())
def test_hf_exact(family, impl, padding, path, dynamic):
    # one decoder layer: the family's layer code and its mask are what a cell tests (Dynamo traces each
    # layer again: half the trace); the five families' 2-layer models replay in
    # test_grads_float64_exact_with_float64_norms (padded, float64 bound), phi3/gemma3 in test_more_families
    model = make_model(family, impl, num_hidden_layers=1)
    run_cell(model, path, make_batch(padding, impl), dynamic)
    assert_replayed()


@pytest.mark.parametrize("family,path,dynamic", [
    pytest.param(family, *RUNS[f % len(RUNS)], id=f"{family}-{RUNS[f % len(RUNS)][0]}-"
                 f"{'dynamic' if RUNS[f % len(RUNS)][1] else 'static'}") for f, family in enumerate(FIVE)])
def test_grads_float64_exact_with_float64_norms(float64_norms, family, path, dynamic):
    """The five families (SDPA, float64, left+right padding) with the norms in float64 — the only float32
    step of these models under SDPA: every parameter gradient meets the float64 bound (1e-10) too, so the
    ~1e-7 of the unmodified models is HF's float32 norm, not the rewrite. One (path, dynamic) run per
    family, all four runs among them (the norm is per token: the run does not change what it rounds)."""
    model = make_model(family, "sdpa")
    run_cell(model, path, make_batch("padded", "sdpa"), dynamic=dynamic, grad_tol=torch.float64)
    assert_replayed()


@pytest.mark.parametrize("family,impl", [("gemma3", "sdpa"), ("phi3", "sdpa")])
def test_more_families_exact(family, impl):
    """Gemma3 (sliding layers whose window exceeds the batch, q/k norms, scaled embeddings) and Phi3
    (fused qkv / gate_up projections split with chunk). (gemma3, eager) on this padded loss is a cell of
    test_hf_exact."""
    model = make_model(family, impl)
    run_cell(model, "loss", make_batch("padded", impl), dynamic=False)
    assert_replayed()


def test_default_compiler_aot_eager_dynamic_two_shapes():
    """AOTAutograd over the packed graph, dynamic shapes: two batches of different B, L and N through one
    captured graph, both replayed and exact."""
    model = make_model("llama", "sdpa")
    fn = functools.partial(next_token_loss, model)
    compiled = torch.compile(fn, backend=AOT, dynamic=True)
    for seed, batch in ((1, padded_batch(1)), (2, shared_batch(2, rows=4, prompt=9, response=3))):
        args = (batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
        if args[1] is None:
            args = (args[0], torch.ones_like(args[0]), args[2])
        ref = fn(*args)
        out = compiled(*args)
        assert_exact(out, ref, torch.float64, f"loss (batch {seed})")
        check_grads(model, ref, out)
    s = brcompile.stats()
    assert s.replayed_calls == 2 and s.fallback_calls == 0 and s.compiled_graphs == 1, str(s)


# --------------------------------------------------------------------------------------------------
# TRL's per-token log-probs


def selective_log_softmax(logits, index):
    """TRL's ``selective_log_softmax``: log_softmax(logits)[..., index]."""
    return torch.gather(logits.log_softmax(-1), dim=-1, index=index.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("use_cache,position_ids,mode", [  # every pair of the three options (half of 2x2x2)
    pytest.param(None, False, "packed", id="cache_default-no_pos-packed"),
    pytest.param(None, True, "replay", id="cache_default-pos_ids-replay"),
    pytest.param(False, False, "replay", id="no_cache-no_pos-replay"),
    pytest.param(False, True, "packed", id="no_cache-pos_ids-packed"),
])
def test_trl_per_token_logps(use_cache, position_ids, mode):
    """TRL's GRPO layout: left-padded prompts + right-padded completions; the model alone is compiled,
    called with ``logits_to_keep = completion length + 1``; then (eagerly, as TRL does)
    ``logits[:, :-1] / T`` -> last C positions -> selective log-softmax. Log-probs at every completion
    position and all parameter grads of an advantage-weighted sum equal the eager ones — packed, and
    streamed (mode="replay": prompts cached, completions in chunks of 4 tokens)."""
    model = make_model("qwen2", "sdpa")
    b = padded_batch(seed=4)
    ids, am, cm = b["input_ids"], b["attention_mask"], b["completion_mask"]
    P = int((cm == 0).all(0).long().cumprod(0).sum())  # prompt width: columns before any completion token
    completion_ids, C = ids[:, P:], ids.shape[1] - P
    kw = {} if use_cache is None else {"use_cache": use_cache}

    def forward(ids, am, pos):
        extra = {} if pos is None else {"position_ids": pos}
        return model(input_ids=ids, attention_mask=am, logits_to_keep=C + 1, **kw, **extra).logits

    pos = (am.cumsum(-1) - 1).clamp(min=0) if position_ids else None
    backend = EAGER_ONLY if mode == "packed" else brcompile.backend(compiler="eager", mode="replay", chunk_tokens=4)
    compiled = torch.compile(forward, backend=backend)

    def per_token_logps(fn):
        logits = fn(ids, am, pos)[:, :-1, :] / 0.9
        return selective_log_softmax(logits[:, -C:], completion_ids)

    ref, out = per_token_logps(forward), per_token_logps(compiled)
    real = am[:, P:].bool()  # the pads after a completion are left out of the tree (drop_padding, the default)
    assert_exact(out[real], ref[real], torch.float64, "per-token log-probs")
    adv = torch.randn(ids.shape[0], 1, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    check_grads(model, ref, out, adv * cm[:, P:])
    assert_replayed()
    assert brcompile.stats().streamed_calls == (mode == "replay")


def test_logits_to_keep_runs_the_head_on_the_kept_window_only():
    """logits_to_keep = 6 of L ~ 30 columns: the LM head runs on the gathered [B, 6, D] hidden states (the
    original op on the original dense values) instead of all N packed tokens — executed FLOPs within 5% of
    the limit (tree FLOPs), logits exact."""
    model = make_model("qwen2", "sdpa")
    b = make_grpo_batch(vocab_size=61, seed=7, num_prompts=2, group_size=4, prompt_len=(20, 30),
                        response_len=(3, 5), left_pad_prompts=True, pad_id=0)
    ids, am = b["input_ids"], b["attention_mask"]

    def fn(ids, am):
        return model(input_ids=ids, attention_mask=am, logits_to_keep=6).logits

    report = brcompile.explain(fn, ids, am, backend=brcompile.backend(compiler="eager"))
    real = am[:, -6:].bool()  # the padded columns are left out of the tree (drop_padding, the default)
    assert_exact(report.result[real], fn(ids, am)[real], torch.float64, "kept logits")
    assert "torch._C._nn.linear(materialize, " in report.graphs[0].packed_code  # the head on the window
    cost = report.calls[0]["cost"]
    assert cost["packed_flops"] <= 1.05 * cost["limit_flops"], cost


# --------------------------------------------------------------------------------------------------
# eager attention: what replays exactly and what is refused


def _faithful_eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """HF's ``eager_attention_forward`` with the softmax in the query's dtype (HF's own uses float32)."""
    from transformers.models.llama.modeling_llama import repeat_kv

    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1, dtype=query.dtype).to(query.dtype)
    attn_weights = torch.nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


@pytest.fixture(scope="module")
def faithful_eager():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register("br_eager64", _faithful_eager_attention)
    AttentionMaskInterface.register("br_eager64", eager_mask)
    return "br_eager64"


@pytest.mark.parametrize("family,padding", [("llama", "padded"), ("qwen3", "none")])
def test_eager_attention_float64_exact(faithful_eager, float64_norms, family, padding):
    """The eager chain (additive lowest-value mask, repeat_kv, scale, softmax, dropout(p=0), matmul) is
    canonicalised into tree attention exactly: float64, 1e-10, logits at every position and all grads."""
    model = make_model(family, faithful_eager, torch.float64)
    run_cell(model, "model", make_batch(padding, "eager"), dynamic=False, grad_tol=torch.float64)
    assert_replayed()


def test_eager_float64_softmax_is_refused():
    model = make_model("llama", "eager", torch.float64, num_hidden_layers=1)  # refused at the first softmax
    run_cell(model, "loss", shared_batch(), dynamic=False)
    assert_fell_back(brcompile.Code.EAGER_ATTENTION, "softmax of torch.float64 scores is computed in torch.float32")


def test_eager_left_padding_falls_back_per_call():
    """Left padding under HF's additive eager mask: a pad query sees no key and the original averages over
    the whole row (non-causal); the per-call guard runs the original. A batch without left padding through
    the same compiled function replays. (``liveness=False``: the pads are computed; by default the loss needs
    none of them and the guard is moot: tests/passes/canonical/test_additive_mask.py.)"""
    model = make_model("llama", "eager")
    fn = functools.partial(next_token_loss, model)
    compiled = torch.compile(fn, backend=brcompile.backend(compiler="eager", liveness=False))
    for left in (True, False):
        b = padded_batch(seed=6, left=left)
        args = (b["input_ids"], b["attention_mask"], b["completion_mask"])
        ref = fn(*args)
        out = compiled(*args)
        assert_exact(out, ref, torch.float32, f"loss (left padding {left})")
        check_grads(model, ref, out, dtype=torch.float32)
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.fallback_calls == 1, str(s)
    assert s.fallback_codes == {brcompile.Code.GUARD_QUERY_WITHOUT_KEYS: 1}, str(s)


@pytest.mark.parametrize("padding,path,dynamic", [  # every pair of the three factors (half of 2x2x2)
    pytest.param("none", "model", False, id="none-model-static"),
    pytest.param("none", "loss", True, id="none-loss-dynamic"),
    pytest.param("right", "model", True, id="right-model-dynamic"),
    pytest.param("right", "loss", False, id="right-loss-static"),
])
def test_gemma2_softcapping_and_windows_replay(padding, path, dynamic):
    """Gemma2 (eager only in HF, float32 softmax): attention logits soft-capped by tanh (cap 0.5 here, so
    it bites), sliding (window 3) and global layers alternating, and the final-logit soft-capping
    (pointwise): tree attention takes the cap and the window; replayed, float32 bound."""
    model = make_model("gemma2", "eager", attn_logit_softcapping=0.5, sliding_window=3)
    batch = shared_batch() if padding == "none" else padded_batch(seed=12, left=False)
    if padding == "right":  # no 3-column window of pure padding (eager's guard would send it to the original)
        batch["attention_mask"][:, -2:] = torch.where(batch["attention_mask"][:, -3:-2].bool(), 1,
                                                      batch["attention_mask"][:, -2:])
    backend = brcompile.backend(compiler="eager")
    run_cell(model, path, batch, dynamic=dynamic, backend=backend)
    assert_replayed()
    code = backend.records[0].packed_code
    assert code.count("torch.ops.brcompile.tree_attention_forward.default(") == 2, code
    assert code.count(", 0.5)") == 2, code  # the cap reaches both attentions
    assert [("window(3)" in m) for m in backend.records[0].masks] == [True, False]


def test_gemma2_softcapping_streamed():
    """The same soft-capped, windowed attention in streaming mode: the cross pairs against the cached
    prompt apply cap and window too."""
    model = make_model("gemma2", "eager", attn_logit_softcapping=0.5, sliding_window=3)
    run_cell(model, "loss", shared_batch(), dynamic=False,
             backend=brcompile.backend(compiler="eager", mode="replay", chunk_tokens=3))
    assert_replayed()
    assert brcompile.stats().streamed_calls == 1


# --------------------------------------------------------------------------------------------------
# sliding windows, dropout, and the per-call guards


@pytest.mark.parametrize("family,path,dynamic", [  # every pair of the three factors (half of 2x2x2)
    pytest.param("mistral", "model", False, id="mistral-model-static"),
    pytest.param("mistral", "loss", True, id="mistral-loss-dynamic"),
    pytest.param("gemma3", "model", True, id="gemma3-model-dynamic"),
    pytest.param("gemma3", "loss", False, id="gemma3-loss-static"),
])
def test_active_sliding_window_replays(family, path, dynamic, float64_norms):
    """A sliding window (4) shorter than the batch (left-padded prompts, right-padded completions): tree
    attention applies it on the tree positions (= the batch columns); float64 norms, so every gradient meets
    1e-10. Gemma3: both layers are sliding ones at this depth."""
    model = make_model(family, "sdpa", sliding_window=4)
    backend = brcompile.backend(compiler="eager")
    run_cell(model, path, padded_batch(seed=7), dynamic=dynamic, backend=backend, grad_tol=torch.float64)
    assert_replayed()
    assert all("window(4)" in m for m in backend.records[0].masks), backend.records[0].masks


def test_gemma3_alternating_sliding_and_global_layers(float64_norms):
    """Gemma3's layer pattern: sliding (window 3), global, sliding — each attention classified on its own."""
    model = make_model("gemma3", "sdpa", num_hidden_layers=3, sliding_window=3,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    backend = brcompile.backend(compiler="eager")
    run_cell(model, "loss", padded_batch(seed=11), dynamic=False, backend=backend, grad_tol=torch.float64)
    assert_replayed()
    assert [("window(3)" in m) for m in backend.records[0].masks] == [True, False, True], backend.records[0].masks


def test_sliding_window_eager_and_streamed():
    """Eager attention (float32, no padding) with a window of 3 replays; the same model streamed
    (mode="replay": the window also applies to the cross pairs against the cached prompt) too."""
    model = make_model("mistral", "eager", sliding_window=3)
    run_cell(model, "loss", shared_batch(seed=8), dynamic=False)
    assert_replayed()
    brcompile.reset_stats()
    torch._dynamo.reset()
    model64 = make_model("mistral", "sdpa", sliding_window=3)
    run_cell(model64, "model", padded_batch(seed=9), dynamic=False,
             backend=brcompile.backend(compiler="eager", mode="replay", chunk_tokens=4))
    assert_replayed()
    assert brcompile.stats().streamed_calls == 1


def test_eager_window_of_padding_falls_back():
    """Eager attention's additive mask makes a query whose whole window is padding uniform over its row;
    tree attention would give 0, so such a batch runs the original graph (per-call guard), exactly."""
    model = make_model("mistral", "eager", sliding_window=2, num_hidden_layers=1)  # one layer: the guard is per mask
    b = padded_batch(seed=10, left=False)
    assert bool(((b["attention_mask"][:, -2:] == 0).all(1)).any()), "the batch needs a 2-column pad run"
    run_cell(model, "loss", b, dynamic=False, backend=brcompile.backend(compiler="eager", liveness=False))
    assert_fell_back(brcompile.Code.GUARD_QUERY_WITHOUT_KEYS, "a window of 2 columns holds only padding")
    # by default those pad queries are needed by nobody: they leave the tree, the guard is moot, the call replays
    brcompile.reset_stats()
    torch._dynamo.reset()
    run_cell(model, "loss", b, dynamic=False)
    assert_replayed()


def test_sliding_window_longer_than_the_batch_under_dynamic_shapes():
    """A window of 12 is plain causal at L = 9 but not at L = 40. With dynamic shapes one captured graph
    serves both lengths: the window is found at compile time by re-evaluating the mask at longer lengths,
    so both calls replay exactly (and the per-size meaning guard re-checks every new length)."""
    model = make_model("mistral", "sdpa", sliding_window=12)

    def fn(ids, am):
        return model(input_ids=ids, attention_mask=am, use_cache=False).logits

    backend = brcompile.backend(compiler="eager")
    compiled = torch.compile(fn, backend=backend, dynamic=True)
    for L in (9, 40):
        b = shared_batch(seed=L, rows=4, prompt=L - 3, response=3)
        ids = b["input_ids"]
        am = torch.ones_like(ids)
        assert_exact(compiled(ids, am), fn(ids, am), torch.float64, f"logits at L={L}")
    s = brcompile.stats()
    assert s.compiled_graphs == 1 and s.replayed_calls == 2 and s.fallback_calls == 0, str(s)
    assert all("window(12)" in m for m in backend.records[0].masks), backend.records[0].masks


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_attention_dropout_in_training_falls_back(impl):
    """attention_dropout > 0 in train mode draws a random mask per dense element: refused (compared under
    the same RNG state); in eval mode the same model replays."""
    model = make_model("llama", impl, attention_dropout=0.1).train()
    b = shared_batch()
    args = (b["input_ids"], None, b["completion_mask"])
    fn = functools.partial(next_token_loss, model)
    torch.manual_seed(11)
    ref = fn(*args)
    torch.manual_seed(11)
    out = torch.compile(fn, backend=EAGER_ONLY)(*args)
    assert_exact(out, ref, DTYPE[impl], "loss")
    assert_fell_back(brcompile.Code.ATTENTION_DROPOUT)
    brcompile.reset_stats()
    torch._dynamo.reset()
    run_cell(model.eval(), "loss", b, dynamic=False)
    assert_replayed()


def test_hidden_dropout_in_training_falls_back():
    """Phi3's resid_pdrop > 0 in train mode: the dropout rule refuses (same RNG state for both runs)."""
    model = make_model("phi3", "sdpa", resid_pdrop=0.1, num_hidden_layers=1).train()  # refused at the first dropout
    b = shared_batch()
    fn = functools.partial(next_token_loss, model)
    args = (b["input_ids"], None, b["completion_mask"])
    torch.manual_seed(12)
    ref = fn(*args)
    torch.manual_seed(12)
    out = torch.compile(fn, backend=EAGER_ONLY)(*args)
    assert_exact(out, ref, torch.float64, "loss")
    assert_fell_back(brcompile.Code.RANDOM_DRAW, "dropout with p=0.1")


def test_specialised_attention_scalars_are_guarded_per_call():
    """Under dynamic=True Dynamo passes ``attention_dropout`` and ``scaling`` as 0-dim tensor inputs read
    with ``.item()``. The rewrite specialises them to their compile-time values and guards every call
    (Dynamo also guards them for HF's SDPA today; ours does not rely on it): the captured graph called
    with another scale runs the original graph, with the reason; with the same scalars it replays."""
    model = make_model("llama", "sdpa")
    captured = []

    def record(gm, example_inputs):
        captured.append((gm, list(example_inputs)))
        return gm.forward

    b = shared_batch()
    torch.compile(functools.partial(logits_of, model), backend=record, dynamic=True)(b["input_ids"], None)
    (gm, inputs), = captured
    runtime = EAGER_ONLY(gm, inputs)
    inputs = [x.node.hint if isinstance(x, torch.SymInt) else x for x in inputs]  # the call's sizes
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    scaling = [i for i, n in enumerate(names) if n.endswith("self_attn_scaling")]
    assert len(scaling) == 2, names
    assert_exact(runtime(*inputs)[0], gm.forward(*inputs)[0], torch.float64, "logits")
    changed = list(inputs)
    changed[scaling[1]] = torch.tensor(0.3, dtype=inputs[scaling[1]].dtype)
    assert_exact(runtime(*changed)[0], gm.forward(*changed)[0], torch.float64, "logits with scale 0.3")
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.fallback_calls == 1, str(s)
    assert s.fallback_codes == {brcompile.Code.GUARD_SCALAR: 1}, str(s)
    assert any("attention scale" in r and "is 0.3 in this call" in r
               for r in s.details(brcompile.Code.GUARD_SCALAR)), str(s)


# --------------------------------------------------------------------------------------------------
# the eager-attention matcher on a hand-written model: each accepted and refused form


class TinyEagerLM(torch.nn.Module):
    """One causal layer with eager attention written out, and a switchable deviation from the pattern."""

    def __init__(self, variant="ok", V=37, d=16, H=2):
        super().__init__()
        self.variant, self.H = variant, H
        self.emb = torch.nn.Embedding(V, d)
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.head = torch.nn.Linear(d, V, bias=False)
        self.head_scale = torch.nn.Parameter(torch.rand(H, 1, 1) + 0.5)

    def forward(self, ids):
        B, L = ids.shape
        x = self.emb(ids)
        q, k, v = self.qkv(x).view(B, L, 3, self.H, -1).permute(2, 0, 3, 1, 4)
        s = torch.matmul(q, k.transpose(-2, -1))
        if self.variant == "softcap":  # Gemma2's order: scale, then cap
            s = torch.tanh((s / q.shape[-1] ** 0.5) / 0.5) * 0.5
        elif self.variant == "softcap_mismatch":  # not a soft-cap: different divisor and factor
            s = torch.tanh(s / 5.0) * 4.0
        elif self.variant == "tensor_scale":
            s = s * self.head_scale
        else:
            s = s / q.shape[-1] ** 0.5
        causal = torch.full((L, L), float("-inf"), dtype=x.dtype).triu(1)
        if self.variant == "bool_added":
            s = s + torch.ones(L, L, dtype=torch.bool).tril()
        elif self.variant == "alibi":  # slope 0.1 times the key position: ALiBi (a tree-attention feature)
            s = s + (causal + 0.1 * torch.arange(L, dtype=x.dtype))
        elif self.variant == "bias":  # quadratic in the key position: a bias tree attention does not have
            s = s + (causal + 0.1 * torch.arange(L, dtype=x.dtype) ** 2)
        elif self.variant != "no_mask":
            s = s + causal
        p = torch.softmax(s, dim=-2 if self.variant == "query_dim" else -1)
        out = self.head(torch.matmul(p, v).transpose(1, 2).reshape(B, L, -1))
        if self.variant == "probs_used":
            out = out + p.mean()
        return out


def tiny_loss(model, ids):
    logits = model(ids)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("variant,code,reason", [
    ("ok", None, None),
    ("softcap", None, None),
    ("softcap_mismatch", brcompile.Code.EAGER_ATTENTION, "logit soft-capping"),
    ("tensor_scale", brcompile.Code.EAGER_ATTENTION, "`mul <- q @ k^T` between the scores matmul and the softmax"),
    ("bool_added", brcompile.Code.EAGER_ATTENTION, "not a float tensor"),
    ("alibi", None, None),
    ("bias", brcompile.Code.ATTENTION_BIAS, "not ALiBi"),
    ("no_mask", brcompile.Code.MASK_NOT_CAUSAL, "bidirectional"),
    ("query_dim", brcompile.Code.EAGER_ATTENTION, "not the key dim"),
    ("probs_used", brcompile.Code.EAGER_ATTENTION, "other users"),
])
def test_eager_matcher_accepts_the_exact_math_only(variant, code, reason):
    torch.manual_seed(0)
    model = TinyEagerLM(variant).double()
    ids = torch.cat([torch.randint(1, 37, (1, 7)).expand(4, 7), torch.randint(1, 37, (4, 3))], 1)
    fn = functools.partial(tiny_loss, model)
    ref = fn(ids)
    out = torch.compile(fn, backend=EAGER_ONLY)(ids)
    assert_exact(out, ref, torch.float64, "loss")
    check_grads(model, ref, out, dtype=torch.float64)
    if reason is None:
        assert_replayed()
    else:
        assert_fell_back(code, reason)
