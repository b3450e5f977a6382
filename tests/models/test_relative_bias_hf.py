"""HF Inkling2's and Inkling's relative position bias replays through tree attention's ``relbias``.

Inkling2 (and Inkling2-Loop) adds ``position_bias = gather(T, -1, clamp(i - j, 0, E - 1)).masked_fill(i - j >= E,
0)`` to the scores, with ``T = (norm(linear(h)) @ proj).transpose(1, 2)`` — per head and query token a row of E
bias-vs-distance values projected from the query's hidden state. That is a value of the query token indexed by
the clamped distance alone: the canonicalisation takes T as the table (a zero column appended for the fill), the
mask classification proves the form on probes where T is a free random value, and tree attention adds
``R[h, q, min(pos[q] - pos[k], E)]`` with its gradient per distance bucket. Inkling (the first version) is the same
bias through a per-query-row factor (``tau``, its log scaling) and, under ``sdpa``, inside the ``attn_mask``.

The tests run HF's own attention modules in a tiny LM (the sliding one with its convolved key/value projections,
the full one with its dynamic convolution weights), float64 with their float32 casts kept in float64
(KeepFloat64), with a rel_extent (3 for the full layer, the window 4 for the sliding one) shorter than the rows of
7 so that the clamp and the zero fill show: the loss and every parameter gradient (the bias's ``linear``, ``scale`` and ``proj``
included) equal eager's within 1e-10, and the packed attention takes the packed table. A whole tiny
InklingForCausalLM replays the same way. Refused by name: a bias gathered from a per-query table whose index is
not the clamped distance, an attention impl without the feature. Streamed (``mode="replay"``) it is exact too.
The Triton impl replays it in float32 (its kernels add the bias and compute dR).
"""
import re

import pytest
import torch

import brcompile
from tests.helpers import INKLING2_VOCAB, Inkling2AttentionLM, inkling2_streamed, KeepFloat64, assert_grads_exact, replay_exact

transformers = pytest.importorskip("transformers", minversion="5.0")
inkling2 = pytest.importorskip("transformers.models.inkling2.modeling_inkling2")
inkling2_loop = pytest.importorskip("transformers.models.inkling2_loop.modeling_inkling2_loop")

V = INKLING2_VOCAB


def _AttentionLM(cls, model_type, layer_idx):
    return Inkling2AttentionLM(cls, model_type, layer_idx, rel_extent=3)


def _relbias_argument(code, op="tree_attention_forward"):
    """The relbias argument (the last) of the one ``op`` call of the graph ``code``."""
    (call,) = [line for line in code.splitlines() if f"{op}.default(" in line]
    return re.search(rf"{op}\.default\((.*)\);", call).group(1).split(", ")[-1]


@pytest.mark.parametrize("cls,model_type,layer_idx", [
    (inkling2.Inkling2SlidingAttention, "inkling2_text", 0),
    (inkling2_loop.Inkling2LoopFullAttention, "inkling2_loop_text", 1),
], ids=["inkling2_sliding", "inkling2_loop_full"])
def test_inkling2_relative_bias_replays_exactly(cls, model_type, layer_idx):
    """Loss and every parameter gradient as eager in float64 (rows of 7, longer than the table); the packed tree
    attention takes the packed table with the zero column appended, and the canonicalisation says so."""
    torch._dynamo.reset()
    brcompile.reset_stats()
    model = _AttentionLM(cls, model_type, layer_idx)
    with KeepFloat64():
        backend = replay_exact(model, vocab=V)
    code = backend.records[0].packed_code
    rel = _relbias_argument(code)
    assert rel != "None" and re.search(rf"{rel} = torch\.cat\(\(\w+, zeros_like", code), code
    assert "relative_position_bias" in code
    assert model.attn.relative_position_bias.rel_extent < 7  # rows of 7: distances beyond the table show


def test_index_other_than_the_clamped_distance_is_refused():
    """A bias gathered from the per-query table at half the distance is no relative bias of the clamped
    distance: the probes (the table a free random value) refuse it by that name."""
    torch._dynamo.reset()
    brcompile.reset_stats()
    model = _AttentionLM(inkling2.Inkling2SlidingAttention, "inkling2_text", 0).double()
    model.index = lambda d: torch.div(d, 2, rounding_mode="floor")
    ids = torch.randint(1, V, (1, 7)).repeat(3, 1)
    ids[1:, 5:] = 3
    backend = brcompile.backend(compiler="eager")
    with KeepFloat64():
        torch.compile(model, backend=backend)(ids)
    s = brcompile.stats()
    assert s.fallback_calls == 1 and s.replayed_calls == 0, str(s)
    why = backend.records[-1].reason
    assert backend.records[-1].code is brcompile.Code.RELATIVE_BIAS, why
    assert "clamp(i - j, 0, E - 1)" in why, why  # names the form it is not


def test_relative_bias_streams():
    """mode="replay": the prefix graph runs on the shared tokens, each chunk of tail tokens against the cached K/V
    with its own rows of the table, the cross pairs biased by the cached keys' distance; loss and every gradient
    (the table's projections summed over the prefix and the chunks) as eager in float64."""
    from brcompile.testing import TOLERANCE, rel_err

    torch._dynamo.reset()
    brcompile.reset_stats()
    model = _AttentionLM(inkling2.Inkling2SlidingAttention, "inkling2_text", 0).double()
    want, gw, got, gg, backend = inkling2_streamed(model)
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.streamed_calls == 1 and s.fallback_calls == 0, str(s)
    rec = backend.records[-1]
    assert rec.replay_reason is None, rec.replay_reason
    assert _relbias_argument(rec.replay["tail_code"], "tree_attention_cached_forward") != "None"
    assert rel_err(got.detach(), want.detach()) <= TOLERANCE[torch.float64]
    assert_grads_exact(gg, gw, [str(tuple(p.shape)) for p in model.parameters()], torch.float64)


def test_triton_impl_replays_relative_bias():
    """``attention="triton"`` (``supports_relbias``; through Triton's interpreter without a GPU: the conftest sets
    TRITON_INTERPRET=1) replays the sliding layer's relative bias in float32: the loss and every parameter
    gradient (the bias's projection through the kernels' dR included) equal eager's within float32's bound."""
    from brcompile.testing import assert_exact

    torch._dynamo.reset()
    brcompile.reset_stats()
    model = _AttentionLM(inkling2.Inkling2SlidingAttention, "inkling2_text", 0).float()
    ids = torch.randint(1, V, (1, 7), generator=torch.Generator().manual_seed(1)).repeat(3, 1)
    ids[1:, 5:] = 3
    names, params = zip(*model.named_parameters())
    want = model(ids)
    gw = torch.autograd.grad(want, params)
    backend = brcompile.backend(compiler="eager", attention="triton")
    got = torch.compile(model, backend=backend)(ids)
    gg = torch.autograd.grad(got, params)
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.fallback_calls == 0, str(s)
    assert_exact(got, want, torch.float32, "loss")
    assert_grads_exact(gg, gw, names, torch.float32)
    assert any(g.abs().max() > 0 for n, g in zip(names, gg) if "relative_position_bias" in n)


@pytest.fixture
def reference_without_relbias():
    """The "reference" attention impl registered again without ``supports_relbias``; restored after."""
    import dataclasses

    from brcompile.backends.attention.op import get_attention_impl, register_attention_impl

    real = get_attention_impl("reference", torch.device("cpu"))
    register_attention_impl(dataclasses.replace(real, supports_relbias=False), override=True)
    yield
    register_attention_impl(real, override=True)


def test_impl_without_relative_bias_falls_back_naming_it(reference_without_relbias):
    """An attention impl without ``supports_relbias``: the original graph runs, the reason names the feature."""
    torch._dynamo.reset()
    brcompile.reset_stats()
    model = _AttentionLM(inkling2.Inkling2SlidingAttention, "inkling2_text", 0).double()
    ids = torch.randint(1, V, (1, 7)).repeat(3, 1)
    ids[1:, 5:] = 3
    backend = brcompile.backend(compiler="eager", attention="reference")
    with KeepFloat64():
        torch.compile(model, backend=backend)(ids)
    s = brcompile.stats()
    assert s.fallback_calls == 1 and s.replayed_calls == 0, str(s)
    why = backend.records[-1].reason
    assert backend.records[-1].code is brcompile.Code.ATTENTION_IMPL, why
    assert "impl 'reference' does not support relative biases" in why, why  # names the impl
