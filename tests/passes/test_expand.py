"""Shape and fill rules: a value without token dims expanded to a token value's shape
(``ones(1, 1, D).expand_as(h)``, HRM's spelling) is dense, not a crash of the rule."""
import torch
import torch.nn.functional as F

from tests.helpers import replay_exact


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
