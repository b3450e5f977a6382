"""Dense causal regions packed again (passes/analysis/repack.py): an op without a token-axis rule no longer makes
every later attention refuse when what it computes is a row-independent causal function of the tokens;
anything the probes cannot prove (a look-ahead, a mix of rows, a per-batch input that is no tree key, a
random op) stays dense and the graph falls back as before, naming why."""
import pytest
import torch
import torch.nn.functional as F

import brcompile
from brcompile.testing import assert_exact


class Block(torch.nn.Module):
    def __init__(self, D=8, H=2):
        super().__init__()
        self.H = H
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.out = torch.nn.Linear(D, D)
        self.mlp = torch.nn.Linear(D, D)

    def forward(self, h):
        B, L, D = h.shape
        q, k, v = self.qkv(h).view(B, L, 3, self.H, D // self.H).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, D)
        h = h + self.out(a)
        return h + torch.tanh(self.mlp(h))


class MixedModel(torch.nn.Module):
    """Attention blocks around a token mixer that no rule covers (``mixer(h)`` -> a dense region)."""

    def __init__(self, mixer, V=11, D=8):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.proj = torch.nn.Linear(D, D)
        self.b1, self.b2 = Block(D), Block(D)
        self.head = torch.nn.Linear(D, V)
        self.mixer = mixer

    def forward(self, ids, extra=None):
        h = self.b1(self.emb(ids))
        m = self.mixer(self.proj(h)) if extra is None else self.mixer(self.proj(h), extra)
        h = self.b2(h + m)
        return F.log_softmax(self.head(h), -1).square().mean()


def running_max(x):
    """A causal scan with no token-axis rule: the running maximum along the positions."""
    return torch.cummax(x, dim=1).values


def look_ahead(x):
    return x + x.flip(1)


def chunk_look_ahead(x):
    """Each position sees the sum of its chunk of 3 positions (a look-ahead inside chunks only)."""
    B, L, D = x.shape
    return x + x.view(B, L // 3, 3, D).sum(2, keepdim=True).expand(B, L // 3, 3, D).reshape(B, L, D)


def across_rows(x):
    return x - x.mean(0, keepdim=True)


def random_mix(x):
    return x * torch.rand_like(x)


def with_labels(x, extra):
    return x * extra[..., None]


def batch(B=4, L=9):
    torch.manual_seed(0)
    ids = torch.randint(1, 11, (1, L)).repeat(B, 1)
    ids[1:, 6:] = torch.randint(1, 11, (B - 1, L - 6))
    return ids


def run(model, *args):
    torch.manual_seed(0)
    model = model.double()
    params = list(model.parameters())
    want = model(*args)
    gw = torch.autograd.grad(want, params)
    backend = brcompile.backend(compiler="eager")
    got = torch.compile(model, backend=backend)(*args)
    gg = torch.autograd.grad(got, params)
    assert_exact(got, want, torch.float64, "loss")
    for a, b in zip(gg, gw):
        assert_exact(a, b, torch.float64, "grad")
    return backend


def test_causal_region_without_a_rule_is_packed_again():
    backend = run(MixedModel(running_max), batch())
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.executed_tokens < s.logical_tokens, str(s)
    record = backend.records[-1]
    assert record.rewritten and record.repacked, record
    assert "cummax" in str(record.repacked[0]) or record.repacked[0].region_ops >= 1


class _Softplus(torch.autograd.Function):
    """A custom autograd.Function (Dynamo captures it as ``autograd_function_apply`` with its forward and
    backward bodies as submodules of the graph)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.softplus(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.sigmoid(x)


def running_max_of_custom_function(x):
    return torch.cummax(_Softplus.apply(x), dim=1).values


def unrolled_recurrence(x):
    """RecurrentGemma's ``_rnn_scan`` spelling: a Python loop over positions (unrolled by Dynamo) reading
    each position's slice ``x[:, t]``, a window of a token value, written into a fresh buffer."""
    h = torch.zeros_like(x[:, 0])
    out = torch.zeros_like(x)
    for t in range(x.shape[1]):
        h = torch.sigmoid(x[:, t]) * h + x[:, t]
        out[:, t] = h
    return out


def test_region_reading_position_slices_is_packed_again():
    """The slices ``x[:, t]`` are computed inside the region from the whole ``x``: the probes perturb every
    position of ``x`` and see the recurrence is causal."""
    backend = run(MixedModel(unrolled_recurrence), batch())
    assert_replayed_calls(1)
    assert backend.records[-1].repacked, backend.records[-1]


def test_region_with_a_custom_autograd_function_is_packed_again():
    """The probes evaluate the Function's bodies (``get_attr`` inputs of the region) as the graph does."""
    backend = run(MixedModel(running_max_of_custom_function), batch())
    assert_replayed_calls(1)
    assert backend.records[-1].repacked, backend.records[-1]


@pytest.mark.parametrize("mixer, why", [
    (look_ahead, "not packed again: no row dim and position dim"),
    (across_rows, "not packed again: no row dim and position dim"),
    (chunk_look_ahead, "not packed again: no row dim and position dim"),
])
def test_region_the_probes_cannot_prove_stays_dense(mixer, why):
    backend = run(MixedModel(mixer), batch())
    record = backend.records[-1]
    assert not record.rewritten and record.code is brcompile.Code.ATTENTION_UNPACKED, record.reason
    assert why in record.reason, record.reason  # says why the region stays dense


def test_region_with_a_random_op_stays_dense():
    torch.manual_seed(0)
    backend = brcompile.backend(compiler="eager")
    torch.compile(MixedModel(random_mix).double(), backend=backend)(batch())
    record = backend.records[-1]
    assert not record.rewritten and record.code is brcompile.Code.ATTENTION_UNPACKED, record.reason
    assert "not deterministic" in record.reason, record.reason


class LateMixer(MixedModel):
    """The mixer reads a per-batch input after the last attention: it is no tree key."""

    def forward(self, ids, extra):
        h = self.b2(self.b1(self.emb(ids)))
        h = h + self.mixer(self.proj(h), extra)
        return F.log_softmax(self.head(h), -1).square().mean()


def test_region_reading_a_non_key_input_stays_dense():
    ids = batch()
    extra = torch.rand(ids.shape, dtype=torch.float64)
    backend = run(LateMixer(with_labels), ids, extra)
    record = backend.records[-1]
    assert record.rewritten and not record.repacked, record
    assert any("not a tree key" in why for _, why in record.not_repacked), record.not_repacked


def test_repacked_graph_serves_new_shapes_and_streams_packed():
    """One packed graph compiled with dynamic shapes (aot_eager) serves batches of other sizes exactly; the
    streaming split refuses a dense region (it runs on the whole batch) and the packed mode runs."""
    torch.manual_seed(0)
    model = MixedModel(running_max).double()
    params = list(model.parameters())
    backend = brcompile.backend(compiler="aot_eager", mode="replay")
    f = torch.compile(model, backend=backend)
    for B, L in ((4, 9), (6, 13)):
        ids = batch(B, L)
        got, want = f(ids), model(ids)
        assert_exact(got, want, torch.float64, "loss")
        for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(want, params)):
            assert_exact(a, b, torch.float64, "grad")
    assert_replayed_calls(2)
    assert all(r.replay_code is brcompile.Code.STREAMING_CONSTRUCT and "dense region is packed again" in r.replay_reason
               for r in backend.records), backend.records


def assert_replayed_calls(n):
    s = brcompile.stats()
    assert s.replayed_calls == n and s.fallback_calls == 0 and s.executed_tokens < s.logical_tokens, str(s)
