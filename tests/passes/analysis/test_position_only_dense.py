"""A position-only TOKEN value (row None: a table computed from the positions) needed dense is materialised
(passes/emit/pack.py: materialize, column_index) in the original's shape instead of being refused:
``dense[t] = packed[index[b, t]]`` for any row b that kept column t."""
import pytest
import torch
import torch.nn.functional as F

from brcompile.passes.emit.pack import materialize
from tests.helpers import replay_exact

V, D, H = 11, 8, 2


def test_materialize_position_only_shapes_and_dropped_columns():
    """[L, D] (pos 0) and [1, L, D] (pos 1) come back in their own shape; with drop_padding a column dropped
    in row 0 but kept in another row reads the kept entry; a column dropped in every row reads 0."""
    # tree of 2 rows, L = 4: row 0 = nodes 0, 1, -1, -1 (right-padded); row 1 = nodes 0, 2, 3, -1
    index = torch.tensor([[0, 1, -1, -1], [0, 2, 3, -1]])
    position = torch.tensor([0, 1, 1, 2])
    table = torch.randn(4, D, dtype=torch.float64)  # dense value at columns 0..3
    packed = table[position]  # [N, D]: each entry holds its position's row
    want = table.clone()
    want[3] = 0  # no row kept column 3
    got = materialize(packed, index, None, 0, True)
    assert got.shape == (4, D) and torch.equal(got, want)
    got = materialize(packed[None], index, None, 1, True)
    assert got.shape == (1, 4, D) and torch.equal(got, want[None])
    full = torch.tensor([[0, 1, 2, 3], [0, 1, 4, 5]])
    packed = table[torch.tensor([0, 1, 2, 3, 2, 3])]
    assert torch.equal(materialize(packed, full, None, 0, False), table)


class Table(torch.nn.Module):
    """Causal attention over ids plus a rotary-like table ``sin(pos ⊗ w)`` (position-only, a parameter
    gradient through w) that the loss reads sliced (``table[..., :-1, :]``: no rule, needed dense)."""

    def __init__(self, batched):
        super().__init__()
        torch.manual_seed(0)
        self.batched = batched
        self.emb = torch.nn.Embedding(V, D)
        self.w = torch.nn.Parameter(torch.randn(D))
        self.proj = torch.nn.Linear(D, 3 * D)

    def forward(self, ids):
        B, L = ids.shape
        table = torch.sin(torch.arange(L, dtype=self.w.dtype)[:, None] * self.w)  # [L, D]
        if self.batched:
            table = table[None]  # [1, L, D]
        x = self.emb(ids) + table
        q, k, v = self.proj(x).view(B, L, 3, H, D // H).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.pow(2).sum() + table[..., :-1, :].exp().sum()


@pytest.mark.parametrize("batched", [False, True])
def test_position_only_table_needed_dense(batched):
    """[L, D] and [1, L, D] tables: loss and every gradient equal eager's (float64), the call replayed, and the
    table was materialised from its packed value (row None), not refused."""
    backend = replay_exact(Table(batched))
    code = backend.records[0].packed_code
    assert any("pack_materialize(" in line and ", None, " in line for line in code.splitlines()), code
