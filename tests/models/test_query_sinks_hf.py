"""HF Inkling2's attention sinks, computed per query token, replay through tree attention's per-query ``sinks``.

Inkling2 (and Inkling2-Loop, the same attention) joins ``sink_proj(hidden_states).transpose(1, 2).unsqueeze(-1)``
— one logit per head and query token, a [B, H, Lq, 1] column — to the scores before the softmax and drops it
after. The tests run HF's own attention modules (the sliding one with its convolved key/value projections, the
full one with its dynamic convolution weights, the gated output projection) in a tiny LM, float64 with their
float32 casts kept in float64 (KeepFloat64): the loss and every parameter gradient (``sink_proj``'s included)
equal eager's within 1e-10, and the packed attention takes the packed sink column.

The module's relative position bias (a per-query table indexed by the distance to the key, tree attention's
relative bias: tests/models/test_relative_bias_hf.py) is swapped for none here, so that these tests check the
sinks alone, as tests/models/test_alibi_sinks_hf.py swaps GPT-OSS's experts.
"""
import re

import pytest
import torch

from tests.helpers import INKLING2_VOCAB, Inkling2AttentionLM, inkling2_streamed, KeepFloat64, replay_exact

transformers = pytest.importorskip("transformers", minversion="5.0")
inkling2 = pytest.importorskip("transformers.models.inkling2.modeling_inkling2")
inkling2_loop = pytest.importorskip("transformers.models.inkling2_loop.modeling_inkling2_loop")

V = INKLING2_VOCAB


def _AttentionLM(cls, model_type, layer_idx):
    """The attention module with its relative position bias swapped out: the per-query sinks alone."""
    return Inkling2AttentionLM(cls, model_type, layer_idx, rel_extent=16, relative_bias=False)


@pytest.mark.parametrize("cls,model_type,layer_idx", [
    (inkling2.Inkling2SlidingAttention, "inkling2_text", 0),
    (inkling2_loop.Inkling2LoopFullAttention, "inkling2_loop_text", 1),
], ids=["inkling2_sliding", "inkling2_loop_full"])
def test_inkling2_per_query_sinks_replay_exactly(cls, model_type, layer_idx):
    """Loss and every parameter gradient as eager in float64; the packed tree attention takes the packed
    per-query sink column (``sink_proj`` of the tokens, not a per-head parameter)."""
    torch._dynamo.reset()
    import brcompile

    brcompile.reset_stats()
    with KeepFloat64():
        backend = replay_exact(_AttentionLM(cls, model_type, layer_idx), vocab=V)
    _assert_packed_sinks(backend.records[0].packed_code, "tree_attention_forward")


def _assert_packed_sinks(code, op):
    """The one ``op`` call of the graph ``code`` takes a sinks argument, a squeeze of a packed value, and the
    graph computes ``sink_proj``."""
    (call,) = [line for line in code.splitlines() if f"{op}.default(" in line]
    sinks = re.search(rf"{op}\.default\((.*)\);", call).group(1).split(", ")[-1]
    assert sinks != "None", call
    assert re.search(rf"{sinks} = .*squeeze", code) and "sink_proj" in code, code


def test_inkling2_per_query_sinks_streamed():
    """Streaming replay: each tail chunk's tree attention takes its own queries' sink column against the cached
    prefix K/V (``tree_attention_cached_forward``); loss and every gradient as eager in float64."""
    import brcompile
    from brcompile.testing import TOLERANCE, rel_err

    torch._dynamo.reset()
    brcompile.reset_stats()
    model = _AttentionLM(inkling2.Inkling2SlidingAttention, "inkling2_text", 0).double()
    want, gw, got, gg, backend = inkling2_streamed(model)
    s = brcompile.stats()
    assert s.streamed_calls == 1 and s.replayed_calls == 1 and s.fallback_calls == 0, str(s)
    rec = backend.records[-1]
    assert rec.runtime.calls[-1].schedule["chunks"] >= 2
    _assert_packed_sinks(rec.replay["tail_code"], "tree_attention_cached_forward")
    assert rel_err(got.detach(), want.detach()) <= TOLERANCE[torch.float64]
    for p, a, b in zip(model.parameters(), gg, gw):
        assert rel_err(a, b) <= TOLERANCE[torch.float64], (tuple(p.shape), rel_err(a, b))
