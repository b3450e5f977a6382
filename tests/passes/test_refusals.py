"""The refusal codes (brcompile/codes.py; CannotReplay in passes/refusals.py): one per rule, described, stable, and carried by every refusal."""
import collections

import pytest
import torch
import torch.fx as fx

import brcompile
from brcompile.passes.refusals import CONSTRUCTS, CannotReplay, Code, NothingToShare, Refusal, refusal
from brcompile.runtime.stats import record_original_call


def test_every_code_has_a_construct_and_a_one_line_description():
    for code in Code:
        assert code.construct in CONSTRUCTS, code
        assert code.describe() and "\n" not in code.describe(), code
        assert code.describe() == code.description


def test_codes_are_unique_snake_case_and_their_values_are_stable():
    values = [c.value for c in Code]
    assert len(values) == len(set(values))
    for v in values:
        assert v == v.lower() and v.replace("_", "").isalnum(), v
    # values are keys of stats and reports: a few spelled out so that a rename fails here
    assert Code.MASK_NOT_CAUSAL.value == "mask_not_causal"
    assert Code.SHARES_TOO_LITTLE.value == "shares_too_little"
    assert Code.INTERNAL_ERROR.value == "internal_error"
    assert Code.DECODE_STEP.value == "decode_step"
    assert Code("guard_scalar") is Code.GUARD_SCALAR
    assert str(Code.ATTENTION_DROPOUT) == "attention_dropout" and f"{Code.ATTENTION_DROPOUT}" == "attention_dropout"


def test_cannot_replay_formats_the_detail_and_the_node():
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.relu, (x,))
    e = CannotReplay(Code.RANDOM_DRAW, "a draw", y)
    assert e.code is Code.RANDOM_DRAW and e.reason == "a draw" == e.detail and e.node is y
    assert e.node_name == y.name
    assert str(e) == f"a draw at `{y.format_node()}`"
    bare = CannotReplay(Code.NO_TOKEN_INPUT, "no ids")
    assert str(bare) == "no ids" and bare.node is None and bare.node_name is None


def test_nothing_to_share_is_a_cannot_replay_and_every_refusal_needs_a_code():
    e = NothingToShare(Code.NO_PER_TOKEN_WORK, "only views")
    assert isinstance(e, CannotReplay) and e.code is Code.NO_PER_TOKEN_WORK
    with pytest.raises(TypeError, match="refusals.Code"):
        CannotReplay("mask_not_causal", "a string is not a code")
    with pytest.raises(TypeError, match="refusals.Code"):
        refusal("mask_not_causal", "a string is not a code")
    r = refusal(Code.GUARD_SCALAR, "p is 0.2")
    assert isinstance(r, Refusal) and r.code is Code.GUARD_SCALAR and str(r) == "p is 0.2"


def test_stats_count_fallbacks_per_code_with_their_details():
    brcompile.reset_stats()
    record_original_call(Code.SHARES_TOO_LITTLE, "dedup 1.00 < 1.2")
    record_original_call(Code.SHARES_TOO_LITTLE, "dedup 1.10 < 1.2")
    record_original_call(Code.SHARES_TOO_LITTLE, "dedup 1.00 < 1.2")
    record_original_call(Code.NO_PER_TOKEN_WORK, "only views", unshared=True)
    s = brcompile.stats()
    assert s.fallback_calls == 3 and s.unshared_calls == 1
    assert s.fallback_codes == collections.Counter({Code.SHARES_TOO_LITTLE: 3})
    assert s.details(Code.SHARES_TOO_LITTLE) == collections.Counter({"dedup 1.00 < 1.2": 2, "dedup 1.10 < 1.2": 1})
    assert s.fallback_reasons["dedup 1.00 < 1.2"] == 2  # keyed by the detail, as before
    assert s.unshared_codes == collections.Counter({Code.NO_PER_TOKEN_WORK: 1})
    assert s.details(Code.NO_PER_TOKEN_WORK, unshared=True) == collections.Counter({"only views": 1})
    d = s.to_dict()
    assert d["fallback_codes"] == {"shares_too_little": 3}
    assert d["fallback_details"] == {"shares_too_little": {"dedup 1.00 < 1.2": 2, "dedup 1.10 < 1.2": 1}}
    text = str(s)
    assert "fallback x3: [batch] shares_too_little" in text and "x2: dedup 1.00 < 1.2" in text
    with pytest.raises(TypeError):
        record_original_call("shares_too_little", "a string is not a code")
    brcompile.reset_stats()
