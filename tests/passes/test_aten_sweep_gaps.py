"""ATen-level spellings of constructs the Dynamo level already replays (found by the HF sweep at
``level="aten"``): each model replays at ``level="aten"``, float64-exact against eager, loss and every
parameter gradient.
"""
import torch

from brcompile.passes.aten import lower_and_respell
from tests.helpers import assert_replayed
from tests.passes.test_aten import Tiny, _capture, _model, _run
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
