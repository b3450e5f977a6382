"""``F.hardswish`` (``x · relu6(x + 3) / 6``, MobileNetV3's activation) is elementwise: packed, not materialised,
at the Dynamo and the ATen level (its record in passes/ops/pointwise.py), exact in float64 with the call replayed."""
import pytest
import torch
import torch.nn.functional as F

from brcompile.passes.ops import Liveness, record_for, record_for_packet
from tests.helpers import replay_exact

V, D, H = 11, 8, 2


class HardswishBlock(torch.nn.Module):
    """Embedding -> linear -> hardswish -> causal attention over 2 heads -> sum of squares."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(V, D)
        self.up = torch.nn.Linear(D, 3 * D)

    def forward(self, ids):
        B, L = ids.shape
        qkv = F.hardswish(self.up(self.emb(ids)) * 4)  # scaled so that values fall in each of its three pieces
        q, k, v = qkv.view(B, L, 3, H, D // H).transpose(1, 3).unbind(2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o.square().sum()


def test_the_record():
    record = record_for(F.hardswish)
    assert record is record_for_packet(torch.ops.aten.hardswish)
    assert (record.axes, record.liveness, record.pair) == ("pointwise", Liveness.POSITIONWISE, "pointwise")


@pytest.mark.parametrize("level", ["dynamo", "aten"])
def test_hardswish_is_packed(level, monkeypatch):
    monkeypatch.setenv("BRCOMPILE_LEVEL", level)
    backend = replay_exact(HardswishBlock())
    (rec,) = [r for r in backend.records if r.rewritten]
    assert rec.level == level
    assert not rec.repacked  # the attention reads token values: nothing dense packed again
    assert all("hardswish" not in user for _, user, _, _ in rec.materialisations), rec.materialisations
    assert "hardswish" in rec.packed_code and "aten.hardswish" not in rec.packed_code
