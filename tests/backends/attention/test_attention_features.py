"""backends/attention/features.py: the one list of tree attention's optional features agrees with the op
schemas, TreeAttentionArgs and the impls' support flags, and its readers and writers read them by name."""
import dataclasses

import pytest
import torch

from brcompile.backends.attention import cached  # noqa: F401  (registers the cached ops)
from brcompile.backends.attention.features import (
    CACHED_BLOCKS, CACHED_FEATURES, CACHED_FEATURES_AT, FEATURES, FORWARD_FEATURES_AT, active, call_features, feature, feature_tail,
    impl_lacks, needs_position, needs_support,
)
from brcompile.backends.attention.op import AttentionImpl, AttentionImplError, TreeAttentionArgs, check_impl_supports


def _schema_tail(op, start: int):
    """(name, default) of an op's arguments from index ``start``."""
    return [(a.name, a.default_value) for a in op.default._schema.arguments[start:]]


@pytest.mark.parametrize("op, start, features", [
    (torch.ops.brcompile.tree_attention_forward, FORWARD_FEATURES_AT, FEATURES),
    (torch.ops.brcompile.tree_attention_backward, FORWARD_FEATURES_AT + 3, FEATURES),
    (torch.ops.brcompile.tree_attention_cached_forward, CACHED_FEATURES_AT, CACHED_FEATURES),
    (torch.ops.brcompile.tree_attention_cached_backward, CACHED_FEATURES_AT + 3, CACHED_FEATURES),
])
def test_op_schemas_end_with_the_features(op, start, features):
    """Each op's arguments after ``impl`` are the features, by name, default and schema type."""
    assert op.default._schema.arguments[start - 1].name == "impl"
    assert _schema_tail(op, start) == [(f.name, f.default) for f in features]
    text = str(op.default._schema)
    spelled = [text.index(f"{f.schema} {f.name}=") for f in features]
    assert spelled == sorted(spelled)


def test_args_fields_after_scale_are_the_features():
    fields = dataclasses.fields(TreeAttentionArgs)
    names = [f.name for f in fields]
    after = fields[names.index("scale") + 1:]
    assert [(f.name, f.default) for f in after] == [(f.name, f.default) for f in FEATURES]


def test_support_flags_are_impl_fields():
    flags = {f.name for f in dataclasses.fields(AttentionImpl)}
    assert {s for f in FEATURES for s in f.support} <= flags
    assert all(f.refusal for f in FEATURES if f.support) and not any(f.refusal for f in FEATURES if not f.support)


def test_call_features_and_tail_round_trip():
    """A call lists its features up to the last one on; reading it back fills in the defaults."""
    pos, sinks = torch.arange(3), torch.zeros(2)
    values = {"window": 0, "position": None, "softcap": 0.0, "alibi": None, "sinks": sinks}
    tail = feature_tail(values)
    assert tail == (0, None, 0.0, None, sinks)
    read = call_features(("q",) * FORWARD_FEATURES_AT + tail)
    assert list(read) == [f.name for f in FEATURES] and read["sinks"] is sinks and read["relbias"] is None
    assert feature_tail({}) == () and feature_tail({"window": 2, "position": pos}) == (2, pos)
    assert feature_tail({"alibi": [0.5], "position": pos}) == (0, pos, 0.0, [0.5], None)  # a block is written whole
    cached = {"window": 2, "position": pos, "cache_position": pos}
    assert feature_tail(cached, CACHED_FEATURES, CACHED_BLOCKS) == (2, pos, pos, 0.0)
    with pytest.raises(ValueError, match="in order"):
        feature_tail({}, CACHED_FEATURES)
    assert active({"window": 2, "position": pos, "alibi": [0.5]}) == ("window", "position", "alibi")
    assert needs_position({"alibi": [0.5]}) and needs_position({"relbias": sinks})
    assert not needs_position({"softcap": 1.0, "sinks": sinks})
    assert needs_support({"softcap": 1.0}) and not needs_support({"sinks": sinks, "position": pos})
    with pytest.raises(KeyError, match="no feature 'nope'"):
        feature("nope")


def test_impl_support_checks_come_from_the_features():
    """An impl without a feature's flags is refused with that feature's reason, in the features' order; one with
    every flag takes them all; sinks need no flag."""
    fwd = lambda *a, **k: None  # noqa: E731
    plain = AttentionImpl(name="plain_features", forward=fwd, backward=fwd)
    check_impl_supports(plain, sinks=torch.zeros(2))
    with pytest.raises(AttentionImplError, match="does not support a sliding window"):
        check_impl_supports(plain, window=2, softcap=1.0)
    with pytest.raises(AttentionImplError, match="does not support logit soft-capping"):
        check_impl_supports(plain, softcap=1.0)
    alibi_only = dataclasses.replace(plain, supports_alibi=True)
    assert plain.features == ("position", "sinks") and alibi_only.features == ("position", "alibi", "sinks")
    check_impl_supports(alibi_only, alibi=[0.5])
    assert impl_lacks(alibi_only, {"slopes": torch.ones(2)}) is feature("slopes")
    full = dataclasses.replace(plain, **{s: True for f in FEATURES for s in f.support})
    assert impl_lacks(full, {f.name: f.default for f in FEATURES}) is None
    check_impl_supports(full, window=2, softcap=1.0, alibi=[0.5], relbias=True, slopes=torch.ones(1))
    with pytest.raises(TypeError, match="no attention feature named typo"):
        check_impl_supports(full, typo=1)


def test_saved_args_round_trip():
    """TreeAttentionArgs saves its tensor features as tensors and the others as constants, and gets them back."""
    class Ctx:
        def save_for_backward(self, *t):
            self.saved_tensors = t

    q = torch.randn(2, 3, 4)
    a = TreeAttentionArgs(q, q, q, torch.arange(1, 4), torch.ones(3, dtype=torch.bool),
                          torch.zeros(1, 3, dtype=torch.long), 0.5, window=2, position=torch.arange(3), softcap=1.5,
                          alibi=[0.1, 0.2], sinks=torch.zeros(2))
    ctx = Ctx()
    out = torch.ones(1)
    a.save_for_backward(ctx, out)
    back, rest = TreeAttentionArgs.saved(ctx)
    assert rest == [out] and back.features.keys() == a.features.keys()
    assert all(back.features[k] is v for k, v in a.features.items())
    assert back.scale == 0.5 and back.q is q
