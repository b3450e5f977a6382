"""The op records (passes/ops/): one record per op, found by target, ATen packet and name; a second registration
of a name, target or packet raises unless it says ``override=True``; every rule a record names exists."""
import operator

import pytest
import torch
import torch.fx as fx

from brcompile.passes import ops
from brcompile.passes.analysis import axes
from brcompile.passes.analysis.axes import AXIS_RULES, axis_rule, rule_for
from brcompile.passes.ops import Kill, Liveness, RuleCollision, record_for, record_for_packet, register_op
from brcompile.passes.spellings import FAMILIES


@pytest.fixture
def scratch():
    """Scratch records and rules removed after the test."""
    names: list = []
    rules = dict(AXIS_RULES)
    yield names
    for name in names:
        if ops.record_named(name) is not None:
            ops.unregister_op(name)
    AXIS_RULES.clear()
    AXIS_RULES.update(rules)


def _node(target):
    g = fx.Graph()
    x = g.placeholder("x")
    return g.create_node("call_method" if isinstance(target, str) else "call_function", target, (x,), {})


def test_a_record_holds_every_fact_of_its_op():
    mul = record_for(operator.mul)
    assert mul is record_for("__rmul__") is record_for_packet(torch.ops.aten.mul) is ops.record_named("mul")
    assert (mul.axes, mul.liveness, mul.kill, mul.pair) == ("pointwise", Liveness.POSITIONWISE, Kill.PRODUCT,
                                                            "pointwise")
    assert FAMILIES["mul"] == mul.spellings
    assert rule_for(_node(torch.mul)) is AXIS_RULES["pointwise"]
    assert rule_for(_node(torch.cumprod)) is None  # a record without a token-axis rule: materialised


def test_a_second_record_for_a_target_raises(scratch):
    existing = record_for(torch.exp)
    with pytest.raises(RuleCollision, match=r"torch.exp \(exp\)"):
        register_op("brcompile_test_exp", spellings=(torch.exp, "brcompile_test_fresh_target"), axes="pointwise")
    assert record_for(torch.exp) is existing
    assert record_for("brcompile_test_fresh_target") is None  # nothing of a refused registration is kept
    assert ops.record_named("brcompile_test_exp") is None


def test_a_second_record_for_a_packet_or_a_name_raises(scratch):
    with pytest.raises(RuleCollision, match="aten.exp"):
        register_op("brcompile_test_aten_exp", aten=(torch.ops.aten.exp,))
    with pytest.raises(RuleCollision, match="the name 'exp'"):
        register_op("exp", spellings=("brcompile_test_fresh_target",))


def test_override_replaces_the_record(scratch):
    scratch.append("brcompile_test_exp")
    register_op("brcompile_test_exp", spellings=("brcompile_test_exp_method",), axes="pointwise")
    register_op("brcompile_test_exp", spellings=("brcompile_test_exp_method",), axes="reduction", override=True)
    assert record_for("brcompile_test_exp_method").axes == "reduction"


def test_one_record_may_list_a_target_twice_and_the_decorator_gives_its_respelling(scratch):
    scratch.append("brcompile_test_twice")

    @register_op("brcompile_test_twice", spellings=("brcompile_test_twice", "brcompile_test_twice"))
    def respell(node, args, kwargs):
        return None

    assert record_for("brcompile_test_twice").respell is respell


def test_a_second_axis_rule_of_a_name_raises(scratch):
    def pointwise(ctx, node):
        return axes.DENSE

    with pytest.raises(RuleCollision, match="pointwise"):
        axis_rule()(pointwise)
    assert AXIS_RULES["pointwise"].propagate is not pointwise
    axis_rule(override=True)(pointwise)
    assert AXIS_RULES["pointwise"].propagate is pointwise


def test_routed_pair_rules_collide_the_same_way():
    """passes/emit/routed.py's pair-local rules are a registry built the same way: one rule per name."""
    from brcompile.passes.emit import routed

    def _linear(prop, n, fact):
        return fact

    saved = dict(routed._PAIR_RULES)
    try:
        with pytest.raises(RuleCollision, match="linear"):
            routed._pair_rule()(_linear)
        assert routed._PAIR_RULES["linear"].fn is not _linear
        routed._pair_rule(override=True)(_linear)
        assert routed._pair_rule_for(_node(torch.nn.functional.linear)).fn is _linear
    finally:
        routed._PAIR_RULES.clear()
        routed._PAIR_RULES.update(saved)


def test_every_rule_a_record_names_is_registered():
    from brcompile.passes.emit import routed

    rule_for(_node(torch.exp))  # loads the rule modules
    for r in ops.records():
        assert r.axes is None or r.axes in AXIS_RULES, r.name
        assert r.pair is None or r.pair in routed._PAIR_RULES, r.name
        assert all(isinstance(p, torch._ops.OpOverloadPacket) for p in r.aten), r.name
        assert not r.aten or r.respell is not None, r.name
