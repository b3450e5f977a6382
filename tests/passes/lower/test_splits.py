"""passes/lower/splits.py: a split that keeps its input whole (transformers 5.25's scan wrappers,
``torch.tensor_split(x, [seq_len - kept], dim)`` without a cache) reads as its input; other splits stay."""
import operator

import pytest
import torch

from brcompile.passes.lower.splits import drop_identity_splits


def _graph(fn):
    """``fn`` traced by Dynamo on a [2, 6, 4] input (its graph, example values in the meta)."""
    graphs = []

    def grab(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=grab, dynamic=False)(torch.randn(2, 6, 4))
    return graphs[0]


def _splits(gm):
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")
            and getattr(n.target, "__name__", n.target) in ("tensor_split", "split", "chunk")]


@pytest.mark.parametrize("fn", [
    lambda x: torch.tensor_split(x, [x.shape[1] - 0], dim=1)[0].exp(),
    lambda x: x.tensor_split([6, 6], dim=1)[0].exp(),
    lambda x: torch.tensor_split(x, [0], dim=1)[1].exp(),
    lambda x: x.split([0, 6], dim=1)[1].exp(),
    lambda x: x.split(8, dim=1)[0].exp(),
    lambda x: x.chunk(1, dim=1)[0].exp(),
], ids=["tensor_split_at_L", "tensor_split_twice_at_L", "tensor_split_at_0", "split_sizes", "split_size", "chunk_1"])
def test_whole_piece_reads_as_the_input(fn):
    gm = _graph(fn)
    assert drop_identity_splits(gm) == 1
    assert not _splits(gm), gm.code
    x = torch.randn(2, 6, 4)
    torch.testing.assert_close(gm(x)[0], fn(x), rtol=0, atol=0)


@pytest.mark.parametrize("fn", [
    lambda x: torch.tensor_split(x, [3], dim=1)[0].exp(),
    lambda x: x.split(3, dim=1)[0].exp(),
    lambda x: x.chunk(2, dim=1)[1].exp(),
    lambda x: torch.tensor_split(x, [-1], dim=1)[0].exp(),
], ids=["tensor_split_inside", "split_size", "chunk_2", "negative_index"])
def test_other_splits_stay(fn):
    gm = _graph(fn)
    assert drop_identity_splits(gm) == 0
    assert len(_splits(gm)) == 1


def test_a_read_empty_piece_keeps_the_split():
    def fn(x):
        whole, empty = torch.tensor_split(x, [6], dim=1)
        return whole.exp(), empty.sum()

    gm = _graph(fn)
    assert drop_identity_splits(gm) == 1
    (split,) = _splits(gm)
    assert [u.args[1] for u in split.users if u.target is operator.getitem] == [1]
    x = torch.randn(2, 6, 4)
    for a, b in zip(gm(x), fn(x)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
