"""Per-call guards (passes/analysis/guards.py) on their own: what each accepts, what it refuses and says."""
import torch

from brcompile.passes.analysis.guards import first_failure, integers_in_range, scalar_equals
from brcompile.passes.refusals import Code


def test_integers_in_range_checks_each_version_of_the_table():
    """A table's entries in [0, bins): accepted; an in-place write bumps the tensor's version, so the next call
    reads the table again and names the range it found; another tensor object is read anew too."""
    table = torch.tensor([[0, 3], [2, 1]])
    guard = integers_in_range(0, 4, "the key table t")
    assert guard.code is Code.GUARD_TABLE_RANGE
    assert guard([table]) is None
    assert guard([table]) is None  # same version: not read again (and still accepted)
    table[1, 0] = 4
    reason = guard([table])
    assert reason is not None and "[0, 4]" in reason and "not all in [0, 4)" in reason
    table[1, 0] = -1
    assert "[-1, 3]" in guard([table])
    assert guard([torch.tensor([1, 2])]) is None
    assert guard([torch.tensor([1, 9])]) is not None


def test_first_failure_is_the_first_guard_that_fails():
    guards = [scalar_equals(0, 0.5, "p"), integers_in_range(1, 2, "table")]
    assert first_failure(guards, [0.5, torch.tensor([0, 1])]) is None
    first = first_failure(guards, [0.25, torch.tensor([5])])
    assert first.code is Code.GUARD_SCALAR and "p is 0.25" in first.detail
    second = first_failure(guards, [0.5, torch.tensor([5])])
    assert second.code is Code.GUARD_TABLE_RANGE and "table holds values in [5, 5]" in second.detail
