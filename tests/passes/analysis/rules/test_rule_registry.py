"""The rule registry: one rule per target; a second registration raises unless it says ``override=True``."""
import pytest
import torch

from brcompile.passes.analysis import axes
from brcompile.passes.analysis.axes import RULES, RuleCollision, register_rule


@pytest.fixture
def scratch_rules():
    """RULES restored after the test (it registers rules for targets no real rule uses, and for ``exp``)."""
    saved = dict(RULES)
    yield
    RULES.clear()
    RULES.update(saved)


def test_a_second_rule_for_a_target_raises(scratch_rules):
    existing = RULES[torch.exp]

    def other(ctx, node):
        return axes.DENSE

    with pytest.raises(RuleCollision, match=r"torch.exp \(" + existing.name):
        register_rule([torch.exp, "brcompile_test_fresh_target"])(other)
    assert RULES[torch.exp] is existing
    assert "brcompile_test_fresh_target" not in RULES  # nothing of a refused registration is kept


def test_override_replaces_the_rule(scratch_rules):
    def other(ctx, node):
        return axes.DENSE

    register_rule(torch.exp, override=True)(other)
    assert RULES[torch.exp].propagate is other


def test_one_registration_may_list_a_target_twice(scratch_rules):
    def twice(ctx, node):
        return axes.DENSE

    register_rule(["brcompile_test_twice", "brcompile_test_twice"])(twice)
    assert RULES["brcompile_test_twice"].propagate is twice
    with pytest.raises(RuleCollision, match="brcompile_test_twice"):
        register_rule("brcompile_test_twice")(twice)


def test_routed_pair_rules_collide_the_same_way():
    """passes/emit/routed.py's pair-local rules are a registry built the same way: one rule per op name / target."""
    from brcompile.passes.emit import routed

    def again(prop, n, fact):
        return fact

    saved = dict(routed._PAIR_RULES_BY_NAME)
    try:
        with pytest.raises(RuleCollision, match="linear already have a pair rule"):
            routed._pair_rule("linear")(again)
        assert routed._PAIR_RULES_BY_NAME["linear"].name == "_linear"
        routed._pair_rule("linear", override=True)(again)
        assert routed._PAIR_RULES_BY_NAME["linear"].fn is again
    finally:
        routed._PAIR_RULES_BY_NAME.clear()
        routed._PAIR_RULES_BY_NAME.update(saved)
