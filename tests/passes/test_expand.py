"""Shape and fill rules: a value without token dims expanded to a token value's shape
(``ones(1, 1, D).expand_as(h)``, HRM's spelling) is dense, not a crash of the rule."""
import torch
import torch.nn.functional as F

import brcompile
from brcompile.testing import assert_exact


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


def replay_exact(model):
    """Compile ``model`` (eager packed graph) on ids with a shared prefix: loss and every gradient equal the
    eager model's, and the call replayed with fewer executed tokens. Returns the backend."""
    torch.manual_seed(0)
    model = model.double()
    ids = torch.randint(1, 11, (1, 7)).repeat(3, 1)
    ids[1:, 5:] = torch.randint(1, 11, (2, 2))
    params = list(model.parameters())
    want = model(ids)
    gw = torch.autograd.grad(want, params)
    backend = brcompile.backend(compiler="eager")
    got = torch.compile(model, backend=backend)(ids)
    gg = torch.autograd.grad(got, params)
    assert_exact(got, want, torch.float64, "loss")
    for a, b in zip(gg, gw):
        assert_exact(a, b, torch.float64, "grad")
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.executed_tokens < s.logical_tokens, str(s)
    return backend


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
