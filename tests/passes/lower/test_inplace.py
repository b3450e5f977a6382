"""passes/axes.is_inplace: every spelling of an in-place write Dynamo records is recognised (a write into a
token value is refused or handled, never analysed as a pure op)."""
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from brcompile.passes.analysis.axes import is_inplace
from brcompile.testing import assert_exact

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


# --------------------------------------------------------------------------------------------------
# writes into a graph input (axes.input_write_destination): a buffer written with values of the tokens

class Counter(torch.nn.Module):
    """Embedding -> causal attention -> head; the forward counts each token's argmax class into a buffer
    (``reads``: the forward also reads the buffer, ``into_param``: the count goes into a trainable tensor)."""

    def __init__(self, reads=False):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 4)
        self.register_buffer("counts", torch.zeros(4))
        self.reads = reads

    def forward(self, ids):
        h = self.emb(ids).unsqueeze(1)
        h = F.scaled_dot_product_attention(h, h, h, is_causal=True).squeeze(1)
        logits = self.head(h)
        with torch.no_grad():
            self.counts.add_(torch.histc(logits.argmax(-1).view(-1).to(logits.dtype), bins=4, min=0, max=4))
        out = logits.log_softmax(-1).sum()
        return out + self.counts.sum() if self.reads else out


def _counter_ids():
    ids = torch.randint(0, 16, (3, 6), generator=torch.Generator().manual_seed(0))
    ids[1, :4] = ids[0, :4]
    ids[2, :5] = ids[0, :5]
    return ids


def test_buffer_written_with_token_values_replays_and_counts_every_token():
    import brcompile

    m = Counter().double()
    ids = _counter_ids()
    params = list(m.parameters())
    want = m(ids)
    gwant = torch.autograd.grad(want, params)
    eager_counts = m.counts.clone()
    m.counts.zero_()
    torch._dynamo.reset()
    brcompile.reset_stats()
    backend = brcompile.backend(compiler="eager", strict=True)
    got = torch.compile(m, backend=backend)(ids)
    ggot = torch.autograd.grad(got, params)
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.executed_tokens < s.logical_tokens, str(s)
    assert torch.equal(m.counts, eager_counts) and eager_counts.sum() == ids.numel()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    for (name, _), a, b in zip(m.named_parameters(), ggot, gwant):
        assert_exact(a, b, torch.float64, f"grad of {name}")
    (rec,) = backend.records
    assert rec.rewritten and "materialize" in rec.packed_code and "add_" in rec.packed_code


def test_buffer_written_and_read_is_refused():
    import brcompile

    m = Counter(reads=True).double()
    ids = _counter_ids()
    torch._dynamo.reset()
    backend = brcompile.backend(compiler="eager", strict=False)
    torch.compile(m, backend=backend)(ids)
    (rec,) = backend.records
    assert not rec.rewritten and rec.code is brcompile.Code.INPUT_WRITE, rec.reason
    assert "never reads" in rec.reason, rec.reason  # the axes rule's (the write that is supported), not the rewrite's
