"""ATen-level spellings of constructs the Dynamo level already replays (found by the HF sweep at
``level="aten"``): each model replays at ``level="aten"``, float64-exact against eager, loss and every
parameter gradient.
"""
import pytest
import torch
import torch.nn.functional as F

from brcompile.passes.lower.aten import lower, lower_and_respell
from brcompile.passes.refusals import CannotReplay, Code
from tests.helpers import assert_replayed
from tests.passes.lower.test_aten import Tiny, _capture, _model, _run
from brcompile.testing import assert_exact


def _check_aten_replay(model):
    be, (ref, gref), (out, gout) = _run(model, level="aten")
    rec = be.records[0]
    assert rec.rewritten and rec.level == "aten", rec.reason
    assert "tree_attention" in rec.packed_code
    assert_replayed()
    assert_exact(out.detach(), ref.detach(), torch.float64, "loss")
    for (name, _), a, b in zip(model.named_parameters(), gout, gref):
        assert_exact(a, b, torch.float64, f"grad of {name}")
    return rec


class TensorMaskValue(Tiny):
    """GPT-Neo's eager attention: ``torch.where(causal, scores, torch.tensor(finfo.min, dtype=...))``."""

    def forward(self, ids, attention_mask=None):
        B, L = ids.shape
        h = self.emb(ids)
        x = self.ln(h)
        q, (k, v) = self.q(x), self.kv(x).chunk(2, -1)
        q, k, v = (t.view(B, L, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        s = q @ k.transpose(-1, -2)
        causal = torch.ones(L, L, dtype=torch.bool, device=ids.device).tril()
        mask_value = torch.tensor(torch.finfo(s.dtype).min, dtype=s.dtype, device=s.device)
        a = torch.softmax(torch.where(causal, s, mask_value), -1) @ v
        return self.head(self.ln(h + self.o(a.transpose(1, 2).reshape(B, L, -1))))


def test_lift_fresh_copy_of_a_scalar_constant_is_respelled_as_torch_tensor():
    """``torch.tensor(v)`` lowers to ``lift_fresh_copy`` of a recorded constant; it is written back as
    ``torch.tensor(v)`` (bit-identical), a 1-d constant stays an identity of the lowering."""
    def f(x):
        return x * torch.tensor(torch.finfo(torch.float64).min, dtype=torch.float64) + torch.tensor([1.0, 2.0],
                                                                                                 dtype=torch.float64)

    x = torch.randn(3, 2, dtype=torch.float64)
    low, _ = lower_and_respell(_capture(f, x))
    made = [n for n in low.graph.nodes if n.target is torch.tensor]
    assert [n.args for n in made] == [(torch.finfo(torch.float64).min,)], low.code
    assert not any("lift_fresh" in str(n.target) for n in low.graph.nodes), low.code
    torch.testing.assert_close(low(x)[0], f(x), rtol=0, atol=0)


def test_tensor_mask_value_replays_at_aten_level():
    """GPT-Neo: the mask value is a constant at the ATen level too (it was refused as 'a value computed in
    the graph')."""
    _check_aten_replay(_model(TensorMaskValue))


class NewZerosStack(Tiny):
    """Inkling2's empty stack of block states: ``x.new_zeros(*x.shape[:-1], 0, D)`` in a token value's shape,
    concatenated with a state on the new dim; and a vector norm over the features."""

    def mix(self, q):
        stack = q.new_zeros(*q.shape[:-1], 0, q.shape[-1])
        stack = torch.cat([stack, q.unsqueeze(-2)], dim=-2)
        q = stack.sum(-2) + q.new_ones(q.shape) * 0.5
        return q / torch.linalg.vector_norm(q, dim=-1, keepdim=True)


def test_new_zeros_is_respelled_as_the_method():
    def f(x):
        return x.new_zeros(x.shape[0], 2) + x.new_full((x.shape[0], 2), 3.0)

    x = torch.randn(3, 2, dtype=torch.float64)
    low, _ = lower_and_respell(_capture(f, x))
    methods = sorted(n.target for n in low.graph.nodes if n.op == "call_method")
    assert "new_zeros" in methods and "new_full" in methods, low.code
    torch.testing.assert_close(low(x)[0], f(x), rtol=0, atol=0)


def test_new_zeros_of_a_token_value_replays_at_aten_level():
    """The fill keeps the token dims of its token operand: the new_zeros rule, as at the Dynamo level (it was
    made dense: no rule for ``aten.new_zeros``); ``aten.linalg_vector_norm`` over the features is the
    reduction rule's (its ``dim`` is the third argument, after ``ord``). Neither materialises its operand."""
    rec = _check_aten_replay(_model(NewZerosStack))
    assert "new_zeros" in rec.packed_code and "vector_norm" in rec.packed_code
    users = [user for _, user, _, _ in rec.materialisations]
    assert not any(u.startswith(("new_", "linalg_vector_norm")) for u in users), rec.materialisations


class NormOverPositions(Tiny):
    """``torch.linalg.vector_norm(q, 2, 1, True)``: ``dim`` given positionally after ``ord``, a token dim."""

    def mix(self, q):
        return q / torch.linalg.vector_norm(q, 2, 1, True)


def test_vector_norm_reads_dim_after_ord():
    """A norm over the positions mixes tokens: it is a reduction over a token dim (its operand is made dense,
    here the attention's input, so the graph falls back), not over the feature dim ``ord`` would name."""
    model = _model(NormOverPositions)
    be, (ref, gref), (out, gout) = _run(model, level="dynamo")
    rec = be.records[0]
    assert not rec.rewritten and rec.code is Code.ATTENTION_UNPACKED, rec.reason
    assert "made dense by linalg_vector_norm (reduction over a token dim" in rec.reason  # names the reduction
    assert_exact(out.detach(), ref.detach(), torch.float64, "loss")
    for (name, _), a, b in zip(model.named_parameters(), gout, gref):
        assert_exact(a, b, torch.float64, f"grad of {name}")


class LogSigmoidAndMask(Tiny):
    """Inkling's router scores ``F.logsigmoid(logits)`` and a mask made with ``&`` / ``|`` of comparisons:
    ``aten.log_sigmoid``, ``aten.__and__`` and ``aten.__or__`` at the ATen level."""

    def mix(self, q):
        keep = ((q > -0.5) & (q < 0.5)) | (q > 1.0)
        return torch.where(keep, F.logsigmoid(q), q)


def test_log_sigmoid_and_bool_ops_replay_at_aten_level():
    """Each is respelled as its Dynamo-level call (the pointwise rule), so no operand is materialised for it
    (they stayed ATen ops without a rule)."""
    rec = _check_aten_replay(_model(LogSigmoidAndMask))
    assert "log_sigmoid" in rec.packed_code
    users = [user for _, user, _, _ in rec.materialisations]
    assert not any(u.startswith(("log_sigmoid", "and", "or", "where")) for u in users), rec.materialisations


def test_vmap_is_refused_at_aten_level_naming_the_function():
    """HF Mamba's ``associative_scan`` (generic mode) runs its ``combine_fn`` under ``torch.vmap``: the pre-dispatch
    export fails on the batched values; the reason names vmap and the function it maps, and the dense graph runs."""
    def combine(a, b):
        return a * b

    def f(x, y):
        return torch.vmap(combine)(x[0::2], y[1::2]).sum()

    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    site = r"torch\.vmap in `combine` \(test_aten_sweep_gaps\.py:\d+\): functorch batching"
    with pytest.raises(CannotReplay, match=site) as e:
        lower(_capture(f, x, y))
    assert e.value.code is Code.ATEN_LOWERING


class ClampedCoefs(torch.nn.Module):
    """Gemma3n's AltUp: ``self.prediction_coefs.weight.data.clamp_(-c, c)`` in training, a write into a
    parameter."""

    def __init__(self):
        super().__init__()
        self.prediction_coefs = torch.nn.Linear(3, 3)

    def forward(self, x):
        self.prediction_coefs.weight.data.clamp_(-1.0, 1.0)
        return self.prediction_coefs(x)


def test_a_written_input_is_named_by_its_graph_input():
    """The write stays refused at the ATen level; the reason names the captured graph's input (the parameter),
    not the export's ``argN_1``."""
    with pytest.raises(CannotReplay, match=r"writes into its input\(s\) \['l_self_modules_prediction_coefs_"
                                           r"parameters_weight_'\]") as e:
        lower(_capture(ClampedCoefs().double(), torch.randn(2, 3, dtype=torch.float64)))
    assert e.value.code is Code.INPUT_WRITE
