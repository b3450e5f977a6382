"""Shape and fill rules: a value without token dims expanded to a token value's shape
(``ones(1, 1, D).expand_as(h)``, HRM's spelling) is dense, not a crash of the rule; positions broadcast over
the rows take that dim as their row dim."""
import pytest
import torch
import torch.nn.functional as F

import brcompile
from brcompile.testing import assert_exact
from tests.helpers import assert_grads_exact, replay_exact


class ConstExpandedToTokens(torch.nn.Module):
    def __init__(self, V=11, D=8):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, D))

    def forward(self, ids):
        h = self.emb(ids)
        s = self.scale.view(1, 1, -1).expand_as(h)  # no token dims, a token value's shape
        q = h.unsqueeze(1)
        o = F.scaled_dot_product_attention(q, q, q, is_causal=True).squeeze(1)
        return (o * s).square().sum()


def test_expand_of_a_constant_to_token_shape():
    torch.manual_seed(0)
    replay_exact(ConstExpandedToTokens())


class FilledLike(torch.nn.Module):
    """``ones_like`` / ``full_like`` of token values (a rotary magnitude, a gate) inside the body."""

    def __init__(self, V=11, D=8):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)

    def forward(self, ids):
        h = self.emb(ids)
        g = torch.full_like(h, 0.5) + torch.ones_like(h) * h
        q = g.unsqueeze(1)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).square().sum()


def test_ones_like_and_full_like_of_token_values_stay_packed():
    torch.manual_seed(0)
    backend = replay_exact(FilledLike())
    mats = backend.records[0].materialisations  # only the loss's sum reads dense values
    assert all("like" not in node for node, *_ in mats), mats


class PositionsOverRows(torch.nn.Module):
    """HF's ``position_ids = arange(L).unsqueeze(0).expand(B, -1)`` (or ``.repeat(B, 1)``), a rotary table made
    from it (``[B, L, D]``, the same in every row) applied to a token value and concatenated with it."""

    def __init__(self, V=11, D=8, repeat=False):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.inv_freq = torch.nn.Parameter(torch.linspace(0.1, 1.0, D // 2))
        self.repeat = repeat

    def forward(self, ids):
        B, L = ids.shape
        h = self.emb(ids)
        pos = torch.arange(L).unsqueeze(0)
        pos = pos.repeat(B, 1) if self.repeat else pos.expand(B, -1)
        ang = pos[..., None].to(h.dtype) * self.inv_freq
        cos = torch.cat((ang.cos(), ang.sin()), dim=-1)
        q = torch.cat((h * cos, h), dim=-1).unsqueeze(1)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).square().sum()


@pytest.mark.parametrize("repeat", [False, True], ids=["expand", "repeat"])
def test_positions_broadcast_over_rows_take_the_row_dim(repeat):
    """The broadcast dim of extent B is the table's row dim (packed extent 1), not a feature dim of extent B
    that the packed graph would keep (it failed the symbolic-N check: ``cat`` of [B, N, ..] and [1, N, ..])."""
    backend = replay_exact(PositionsOverRows(repeat=repeat))
    assert backend.records[0].rewritten, backend.records[0].reason


class RowScaledPositions(torch.nn.Module):
    """A position value times a per-row constant (``arange(L)[None] * s[:B, None]``): a value with an extent-B dim
    that differs from row to row but no row dim of its own (no token input in it)."""

    def __init__(self, V=11, D=8):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.row_scale = torch.nn.Parameter(torch.tensor([0.5, 1.0, 2.0]))

    def forward(self, ids):
        B, L = ids.shape
        h = self.emb(ids)
        p = torch.arange(L)[None, :].to(h.dtype) * self.row_scale[:B, None]  # [B, L], rows differ
        q = (h * p[..., None].cos()).unsqueeze(1)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).square().sum()


def test_a_per_row_feature_dim_is_not_taken_for_the_row_dim():
    """Meeting a value with a row dim, the extent-B dim of a position-only value is not its row dim (its rows
    differ): the product is not packed with that dim collapsed, nor packed again (passes/analysis/repack.py: rows that
    share a prefix differ). The call is exact: loss and every gradient equal eager's in float64."""
    torch.manual_seed(0)
    model = RowScaledPositions().double()
    ids = torch.randint(1, 11, (1, 7)).repeat(3, 1)
    ids[1:, 5:] = torch.randint(1, 11, (2, 2))
    names, params = zip(*model.named_parameters())
    want = model(ids)
    gw = torch.autograd.grad(want, params)
    backend = brcompile.backend(compiler="eager")
    got = torch.compile(model, backend=backend)(ids)
    gg = torch.autograd.grad(got, params)
    assert_exact(got, want, torch.float64, "loss")
    assert_grads_exact(gg, gw, names, torch.float64)
    # the product is dense; packing it again is refused by the repack probe that rolls the rows
    reason = backend.records[0].reason or ""
    assert backend.records[0].code is brcompile.Code.ATTENTION_UNPACKED, reason
    assert "not the same function of every row's inputs" in reason, reason
