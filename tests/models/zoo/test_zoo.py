"""The zoo: small decoder LMs in the spelling of well-known public codebases (``tests/models/zoo/models.py``),
compiled unchanged with ``branch_replay``.

Each replaying style must give the eager loss and every parameter gradient to 1e-10 relative error in
float64 on a GRPO batch with shared prompts, with ``brcompile.stats()`` showing that the rewrite ran and
shared tokens (executed < logical); ALiBi (constant or trained slopes) and attention-sink styles among them, whose
packed graph must hold tree attention with the ``alibi`` / ``slopes`` / ``sinks`` feature. Styles that need what
tree attention does not have (a per-head bias that is not ALiBi, a learned relative-position table) must fall back
with a reason that names the construct. Every replaying style also streams (``mode="replay"``) exactly.
"""
import pytest
import torch

import brcompile
from brcompile.testing import assert_exact
from examples.grpo import grpo_loss, make_grpo_batch
from tests.models.zoo import models

BACKEND = brcompile.backend(compiler="eager")
#: style -> what its packed code must show (the feature the rewrite used)
FEATURES = {"alibi": "0.0, [0.25, 0.0625, 0.015625, 0.00390625], None)",  # the slopes, no sinks
            "attention_sinks": "0.0, None, l_model_modules_blocks_modules_0_modules_attn_parameters_sinks_)",
            # trained slopes: no constant alibi, no sinks, no relative bias, the slopes node's [Hq] reshape
            "learned_alibi_slopes": "tree_position, 0.0, None, None, None, reshape",
            "learned_log_alibi_slopes": "tree_position, 0.0, None, None, None, reshape"}
BATCH = dict(num_prompts=2, group_size=3, prompt_len=(6, 9), response_len=(2, 5), vocab_size=models.VOCAB,
             seed=1, dtype=torch.float64)


def grpo_args(model, batch):
    return (batch["input_ids"], batch["attention_mask"], batch["completion_mask"], batch["advantages"],
            batch["old_logprobs"], 0.2, model.uses_mask)


def run(model, backend=BACKEND):
    batch = make_grpo_batch(**BATCH)
    args = grpo_args(model, batch)
    params = [p for p in model.parameters() if p.requires_grad]
    ref = grpo_loss(model, *args)
    gref = torch.autograd.grad(ref, params)
    out = torch.compile(grpo_loss, backend=backend)(model, *args)
    gout = torch.autograd.grad(out, params)
    return ref, gref, out, gout


@pytest.mark.parametrize("style", sorted(models.REPLAY))
def test_zoo_replays_exactly(style):
    model = models.make(models.REPLAY[style])
    ref, gref, out, gout = run(model)
    s = brcompile.stats()
    assert s.replayed_calls >= 1 and s.fallback_calls == 0, f"{style}: {s}"
    assert s.executed_tokens < s.logical_tokens, str(s)
    if style in FEATURES:
        assert FEATURES[style] in BACKEND.records[-1].packed_code, f"{style}: no tree attention with {FEATURES[style]}"
    assert_exact(out.detach(), ref.detach(), torch.float64, "loss")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, a, b in zip(names, gout, gref):
        assert_exact(a, b, torch.float64, f"grad of {name}")


@pytest.mark.parametrize("style", sorted(models.REPLAY))
def test_zoo_replays_exactly_at_the_aten_level(style):
    """The same, analysed at the ATen level (``level="aten"``: the functional pre-dispatch ATen graph,
    passes/lower/aten.py) — every style's spelling reaches the same rewrite through its ATen ops."""
    backend = brcompile.backend(compiler="eager", level="aten")
    model = models.make(models.REPLAY[style])
    ref, gref, out, gout = run(model, backend)
    s = brcompile.stats()
    assert s.replayed_calls >= 1 and s.fallback_calls == 0, f"{style}: {s}"
    assert all(r.level == "aten" for r in backend.records if r.rewritten)
    assert "tree_attention" in backend.records[-1].packed_code
    assert_exact(out.detach(), ref.detach(), torch.float64, "loss")
    for a, b in zip(gout, gref):
        assert_exact(a, b, torch.float64, "grad")


@pytest.mark.parametrize("style", sorted(models.REPLAY))
def test_zoo_streams_exactly(style):
    """Streaming replay (``mode="replay"``, chunks of 3 tail tokens against the cached prompts): every replaying
    style streams — ALiBi (its cross pairs biased over the chunk's and the cache's positions), trained slopes
    (their gradient summed over the prefix and every chunk), sinks, windows — with the eager loss and gradients."""
    backend = brcompile.backend(compiler="eager", mode="replay", chunk_tokens=3)
    model = models.make(models.REPLAY[style])
    ref, gref, out, gout = run(model, backend)
    s = brcompile.stats()
    assert s.streamed_calls >= 1 and s.fallback_calls == 0, f"{style}: {s}"
    rec = backend.records[-1]
    assert rec.replay_reason is None and "tree_attention_cached_forward" in rec.replay["tail_code"], rec.replay_reason
    assert_exact(out.detach(), ref.detach(), torch.float64, "loss")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, a, b in zip(names, gout, gref):
        assert_exact(a, b, torch.float64, f"grad of {name}")


@pytest.mark.parametrize("style", sorted(models.GRAPH_BREAKS))
@pytest.mark.parametrize("mode", ["packed", "replay"])
def test_zoo_with_graph_breaks_replays_exactly(style, mode):
    """A style whose experts loop breaks the graph (HF 4.x Mixtral: ``torch.where`` per expert): every piece
    replays (the attention graph packed or streamed, the experts' pieces on their flattened token rows) or has
    nothing to share; none falls back, and the loss and every gradient are eager's."""
    backend = brcompile.backend(compiler="eager", mode=mode, chunk_tokens=3)
    model = models.make(models.GRAPH_BREAKS[style])
    ref, gref, out, gout = run(model, backend)
    s = brcompile.stats()
    assert len(backend.records) > 2 and s.fallback_calls == 0, f"{style}: {s}"
    assert s.replayed_calls >= 3 and s.executed_tokens < s.logical_tokens, str(s)
    if mode == "replay":
        assert s.streamed_calls >= 1, str(s)
    assert_exact(out.detach(), ref.detach(), torch.float64, "loss")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, a, b in zip(names, gout, gref):
        assert_exact(a, b, torch.float64, f"grad of {name}")


def _counters(model):
    return torch.stack([b.clone() for n, b in model.named_buffers() if n.endswith("tokens_per_expert")])


@pytest.mark.parametrize("verify", [False, True])
def test_zoo_load_counter_written_in_the_forward(verify):
    """torchtitan's MoE load counter (``tokens_per_expert.add_(histc(expert ids))``, a buffer written in the
    forward): the packed graph writes the counts of all B·L tokens (the expert ids materialised for the
    histogram), once per call — also with ``verify=True``, whose two runs start from a snapshot of the buffer
    and compare it too — and the loss and every gradient are eager's. Streaming refuses such a graph with
    the reason (the packed mode runs)."""
    model = models.make(models.CountedGptFastMoE)
    start = _counters(model)
    backend = brcompile.backend(compiler="eager", verify=verify)
    ref, gref, out, gout = run(model, backend)
    both = _counters(model) - start  # eager's counts and the compiled call's
    B, L = backend.records[0].runtime.last_tree.batch_shape
    assert both.sum() == 2 * models.MOE_TOP_K * B * L * models.LAYERS, both  # every token's experts, every layer
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.fallback_calls == 0 and s.executed_tokens < s.logical_tokens, str(s)
    mid = _counters(model)
    grpo_loss(model, *grpo_args(model, make_grpo_batch(**BATCH)))
    one = _counters(model) - mid  # eager's counts alone
    assert torch.equal(both, 2 * one), (both, one)
    assert_exact(out.detach(), ref.detach(), torch.float64, "loss")
    for a, b in zip(gout, gref):
        assert_exact(a, b, torch.float64, "grad")
    torch._dynamo.reset()
    streaming = brcompile.backend(compiler="eager", mode="replay", chunk_tokens=3)
    run(models.make(models.CountedGptFastMoE), streaming)
    assert streaming.records[0].replay_code is brcompile.Code.STREAMING_CONSTRUCT, streaming.records[0].replay_reason
    assert "writes into its input" in streaming.records[0].replay_reason, streaming.records[0].replay_reason


FALLBACK_CODES = {"quadratic_bias": brcompile.Code.ATTENTION_BIAS,
                  "relative_position_table": brcompile.Code.ATTENTION_BIAS,
                  "soft_multiplicative_mask": brcompile.Code.MASK_FLOAT_BIAS,
                  "query_key_bias": brcompile.Code.ATTENTION_BIAS}


@pytest.mark.parametrize("style", sorted(models.FALLBACK))
def test_zoo_falls_back_with_reason(style):
    cls, phrase = models.FALLBACK[style]
    model = models.make(cls)
    ref, gref, out, gout = run(model)
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls >= 1, str(s)
    assert set(s.fallback_codes) == {FALLBACK_CODES[style]}, str(s)
    reasons = " | ".join(s.details(FALLBACK_CODES[style]))
    assert phrase in reasons, reasons
    assert_exact(out.detach(), ref.detach(), torch.float64, "loss")
    for a, b in zip(gout, gref):
        assert_exact(a, b, torch.float64, "grad")
