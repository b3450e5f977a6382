"""passes/axes.is_inplace: every spelling of an in-place write Dynamo records is recognised (a write into a
token value is refused or handled, never analysed as a pure op)."""
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from brcompile.passes.axes import is_inplace

CASES = [
    ("relu inplace=True", F.relu, (True,), {"inplace": True}, True),
    ("relu positional inplace", F.relu, (True,), {}, True),
    ("relu", F.relu, (), {}, False),
    ("dropout positional inplace", F.dropout, (0.1, True, True), {}, True),
    ("dropout", F.dropout, (0.1, True), {}, False),
    ("x %= 2", operator.imod, (2,), {}, True),
    ("x @= w", operator.imatmul, ("w",), {}, True),
    ("x[i] = v", operator.setitem, (0, 1.0), {}, True),
    ("aten.add_", torch.ops.aten.add_.Tensor, ("x",), {}, True),
    ("torch.add out=", torch.add, ("x",), {"out": "x"}, True),
    ("torch.add", torch.add, ("x",), {}, False),
    ("operator.and_", operator.and_, ("x",), {}, False),
    ("torch.sigmoid", torch.sigmoid, (), {}, False),
]


@pytest.mark.parametrize("what, target, rest, kwargs, want", CASES, ids=[c[0] for c in CASES])
def test_is_inplace_call_function(what, target, rest, kwargs, want):
    g = fx.Graph()
    x = g.placeholder("x")
    sub = lambda a: x if a == "x" or a == "w" else a
    n = g.call_function(target, (x, *map(sub, rest)), {k: sub(v) for k, v in kwargs.items()})
    assert is_inplace(n) is want


@pytest.mark.parametrize("method, want", [("add_", True), ("mul_", True), ("requires_grad_", False),
                                          ("__add__", False), ("add", False)])
def test_is_inplace_call_method(method, want):
    g = fx.Graph()
    x = g.placeholder("x")
    assert is_inplace(g.call_method(method, (x, x))) is want
