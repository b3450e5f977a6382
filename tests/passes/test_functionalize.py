"""passes/functionalize.py: writes into fresh, unaliased values become out-of-place ops; every other write
stays. Graphs are captured by Dynamo; the rewritten graph must compute what the original does."""
import pytest
import torch
import torch.nn.functional as F

from brcompile.passes.axes import is_inplace
from brcompile.passes.functionalize import functionalize


def capture(fn, *args):
    """The Dynamo graph of ``fn(*args)`` and its example inputs."""
    got = []

    def backend(gm, example_inputs):
        got.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    (gm, inputs), = got
    return gm


def writes(gm):
    return [n.format_node() for n in gm.graph.nodes if n.op in ("call_function", "call_method") and is_inplace(n)]


def router(h, w):
    """Mixtral's router: top-k of a softmax, normalised in place."""
    probs = torch.softmax(h @ w, dim=-1)
    top, idx = torch.topk(probs, 2, dim=-1)
    top /= top.sum(dim=-1, keepdim=True)
    return top, idx


def accumulate(h, idx):
    out = torch.zeros_like(h)
    out.index_add_(0, idx, h * 2)
    out += 1
    return F.relu(out, inplace=True)


def mla_keys(h):
    """DeepSeek MLA: a new buffer filled by copies into two slices that tile its last dim."""
    a = h * 2
    b = (h + 1)[..., :3]
    k = a.new_empty(a.shape[0], a.shape[1] + 3)
    k[..., : a.shape[1]].copy_(a)
    k[..., a.shape[1]:].copy_(b)
    return k * 3


def gap_in_tiles(h):
    k = h.new_empty(h.shape[0], h.shape[1] + 3)
    k[..., : h.shape[1]].copy_(h * 2)  # the last 3 columns are never written
    return k[..., : h.shape[1]] + 1


def masked_ids(ids):
    """Gemma3: ``ids = input_ids.clone(); ids[image_mask] = 0`` (a bool mask of the value's shape)."""
    x = ids.clone()
    x[ids == 3] = 0
    return x * 2


def chunk_writes(h):
    """A chunked scan's output buffer: rows written by int and slice indices, then a number into a slice."""
    out = torch.zeros_like(h)
    out[:, 0] = h[:, 1] * 2
    out[:, 2:4] = h[:, :2] + 1
    out[1:3] = 0.5
    return out * 3


def mask_of_rows(h):
    x = h * 2
    x[h[:, 0] > 0] = 1.0  # a mask of the leading dim only
    return x


def negative_index(h):
    x = h * 2
    x[:, -1] = h[:, 0]
    return x


def broadcast_value(h):
    x = h * 2
    x[:, 1] = h[0, 0]  # a 0-d value broadcast over the column
    return x


def into_input(h):
    h.mul_(2)
    return h + 1


def into_view(h):
    x = h * 2
    y = x.transpose(0, 1)
    y.add_(1)
    return x


def aliased_before(h):
    x = h * 2
    v = x.view(-1)
    x.add_(1)
    return v * 3


def promoting(h, s):
    x = h * 2
    x += s  # s [4] float64, x float32: out of place would promote, in place keeps float32
    return x


H = torch.randn(5, 4)


@pytest.mark.parametrize("fn, args", [(router, (H, torch.randn(4, 3))),
                                      (accumulate, (H, torch.tensor([1, 0, 4, 4, 2]))),
                                      (mla_keys, (H,)), (masked_ids, (torch.randint(0, 5, (3, 6)),)),
                                      (chunk_writes, (H,))])
def test_writes_into_fresh_values_become_pure(fn, args):
    gm = capture(fn, *args)
    assert writes(gm)
    new = functionalize(gm)
    assert new is not gm and writes(new) == []
    assert writes(gm)  # the captured graph is not changed
    for a, b in zip(new(*args), fn(*[x.clone() for x in args]) if isinstance(fn(*args), tuple) else [fn(*args)]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("fn, args", [(into_input, (H.clone(),)), (into_view, (H,)), (aliased_before, (H,)),
                                      (gap_in_tiles, (H,)),
                                      (promoting, (H, torch.ones(4, dtype=torch.float64))),
                                      (mask_of_rows, (H,)), (negative_index, (H,)), (broadcast_value, (H,))],
                         ids=["input", "view", "aliased", "gap_in_tiles", "promoting", "mask_of_rows",
                              "negative_index", "broadcast_value"])
def test_other_writes_stay(fn, args):
    gm = capture(fn, *[a.clone() for a in args])
    before = writes(gm)
    assert before
    assert writes(functionalize(gm)) == before
