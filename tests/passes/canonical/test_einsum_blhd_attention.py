"""Eager attention written with einsum over [B, L, H, D] operands, heads in dim 2 (passes/canonical/attention/,
``_einsum_4d``): ``einsum("bqhd,bkhd->bhqk", q, k)`` scores and ``einsum("bhqk,bkhd->bqhd", p, v)`` output, any
letters, any mix with the [B, H, L, D] spellings. The chain becomes one SDPA node on q, k, v permuted to
[B, H, L, D], its output permuted back to the einsum's layout. Every end-to-end case compares the loss and every
parameter gradient with the eager original in float64 and asserts through ``brcompile.stats()`` that the rewrite
ran and shared tokens; a scores layout that is not [B, H, Lq, Lk] is refused by name.
"""
import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import brcompile
from brcompile.passes.canonical.attention import scores
from brcompile.testing import assert_exact
from tests.helpers import grouped_rows, real_next_token_loss

VOCAB = 41


def _layout(x: torch.Tensor, term: str, head: str) -> torch.Tensor:
    """``x`` [B, L, H, D] in the layout the einsum term names: as it is when the head letter is third, else
    [B, H, L, D]."""
    return x if term.index(head) == 2 else x.transpose(1, 2)


class EinsumLM(nn.Module):
    """Embedding -> one eager attention whose scores and output are the einsums ``scores`` and ``output`` over
    q, k, v laid out as their terms name ([B, L, H, D] or [B, H, L, D]) -> projection. ``mask="additive"``: the
    scores plus ``(1 - causal & am) * -1e9``; ``mask="causal"``: ``masked_fill(~causal, -inf)``."""

    def __init__(self, scores, output, mask="additive", dim=16, heads=2):
        super().__init__()
        self.scores, self.output, self.maskkind, self.heads = scores, output, mask, heads
        self.emb = nn.Embedding(VOCAB, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, VOCAB)

    def forward(self, ids, am):
        B, L = ids.shape
        q, k, v = self.qkv(self.emb(ids)).view(B, L, 3, self.heads, -1).unbind(2)  # [B, L, H, D] each
        (qt, kt), st = self.scores.split("->")[0].split(","), self.scores.split("->")[1]
        s = torch.einsum(self.scores, _layout(q, qt, st[1]), _layout(k, kt, st[1])) * q.shape[-1] ** -0.5
        causal = torch.ones(L, L, dtype=torch.bool, device=ids.device).tril()
        if self.maskkind == "additive":
            allowed = causal[None, None] & am[:, None, None, :].bool()
            s = s + (1.0 - allowed.to(s.dtype)) * -1e9
        else:
            s = s.masked_fill(~causal, float("-inf"))
        p = s.softmax(dim=-1)
        (pt, vt), ot = self.output.split("->")[0].split(","), self.output.split("->")[1]
        o = torch.einsum(self.output, p, _layout(v, vt, pt[1]))
        o = o if ot.index(pt[1]) == 2 else o.transpose(1, 2)  # [B, L, H, D]
        return self.out(o.reshape(B, L, -1))


loss_fn = real_next_token_loss  # the mean log-likelihood of the next token at the real positions


def run(model, batch, backend):
    """(eager loss, its gradients, compiled loss, its gradients) in float64."""
    fn = loss_fn(model)
    params = list(model.parameters())
    ref = fn(*batch)
    gref = torch.autograd.grad(ref, params)
    out = torch.compile(fn, backend=backend)(*batch)
    gout = torch.autograd.grad(out, params)
    return ref, gref, out, gout


def assert_exact_run(model, ref, gref, out, gout):
    assert_exact(out, ref, torch.float64, "loss")
    for (name, _), a, b in zip(model.named_parameters(), gout, gref):
        assert_exact(a, b, torch.float64, f"grad of {name}")


CASES = [
    ("bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd"),  # all [B, L, H, D]
    ("bihd,bjhd->bhij", "bhij,bjhd->bihd"),  # letters renamed
    ("bnhd,bmhd->bhnm", "bhnm,bmhd->bnhd"),
    ("bqhd,bkhd->bhqk", "bhqk,bhkd->bhqd"),  # [B, L, H, D] scores, [B, H, L, D] values and output
    ("bhqd,bhkd->bhqk", "bhqk,bkhd->bqhd"),  # [B, H, L, D] scores, [B, L, H, D] values and output
    ("bqhd,bhkd->bhqk", "bhqk,bkhd->bhqd"),  # the query alone in [B, L, H, D]; the values in [B, L, H, D]
]


@pytest.mark.parametrize("mask", ["additive", "causal"])
@pytest.mark.parametrize("scores, output", CASES)
def test_einsum_blhd_attention_replays_exactly(scores, output, mask):
    """Causal & key padding through a -1e9 additive mask (right padding), or causal by a -inf fill: the chain is
    an SDPA node and replays with the eager loss and gradients."""
    torch.manual_seed(0)
    model = EinsumLM(scores, output, mask).double()
    backend = brcompile.backend(compiler="eager", strict=True)
    assert_exact_run(model, *run(model, grouped_rows(0, pad=False), backend))
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.fallback_calls == 0 and s.executed_tokens < s.logical_tokens, str(s)
    want = "causal+keypad(l_am_)" if mask == "additive" else ": causal"
    assert backend.records[0].masks and all(m.endswith(want) for m in backend.records[0].masks), \
        backend.records[0].masks
    assert "tree_attention" in backend.records[0].packed_code


def test_einsum_blhd_attention_streams_exactly():
    """Streaming replay (``mode="replay"``): the canonical SDPA node of the [B, L, H, D] einsums is streamed over
    the cached prompts like any attention."""
    torch.manual_seed(0)
    model = EinsumLM(*CASES[0]).double()
    backend = brcompile.backend(compiler="eager", mode="replay", chunk_tokens=3, strict=True)
    assert_exact_run(model, *run(model, grouped_rows(1, pad=False), backend))
    s = brcompile.stats()
    assert s.streamed_calls == 1 and s.fallback_calls == 0, str(s)


def test_scores_not_in_heads_first_layout_are_refused_by_name():
    """``einsum("bqhd,bkhd->bqhk")``: scores [B, Lq, H, Lk] (the softmax still over the keys) are not the
    [B, H, Lq, Lk] scores an SDPA node computes: refused, naming the einsum and the spellings recognised."""

    class QueryMajor(EinsumLM):
        def forward(self, ids, am):
            B, L = ids.shape
            q, k, v = self.qkv(self.emb(ids)).view(B, L, 3, self.heads, -1).unbind(2)
            s = torch.einsum("bqhd,bkhd->bqhk", q, k) * q.shape[-1] ** -0.5
            causal = torch.ones(L, L, dtype=torch.bool, device=ids.device).tril()
            s = s.masked_fill(~causal[None, :, None, :], float("-inf"))
            o = torch.einsum("bqhk,bkhd->bqhd", s.softmax(-1), v)
            return self.out(o.reshape(B, L, -1))

    torch.manual_seed(0)
    model = QueryMajor(*CASES[0]).double()
    assert_exact_run(model, *run(model, grouped_rows(2, pad=False), brcompile.backend(compiler="eager")))
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls == 1, str(s)
    assert s.fallback_codes == {brcompile.Code.UNRECOGNISED_ATTENTION: 1}, str(s)
    assert any("'bqhd,bkhd->bhqk'" in r and "bqhd,bkhd->bqhk" in r  # names both spellings
               for r in s.details(brcompile.Code.UNRECOGNISED_ATTENTION)), str(s)


def _einsum_node(eq: str) -> fx.Node:
    gm = fx.symbolic_trace(lambda a, b: torch.einsum(eq, a, b))
    return next(n for n in gm.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("eq, kind, dims", [
    ("bhqd,bhkd->bhqk", "scores", (None, None)),
    ("bqhd,bkhd->bhqk", "scores", ((0, 2, 1, 3), (0, 2, 1, 3))),
    ("bqhd,bhkd->bhqk", "scores", ((0, 2, 1, 3), None)),
    ("qbhd,kbhd->bhqk", "scores", ((1, 2, 0, 3), (1, 2, 0, 3))),
    ("bhqk,bhkd->bhqd", "output", (None, None)),
    ("bhqk,bkhd->bqhd", "output", ((0, 2, 1, 3), (0, 2, 1, 3))),
    ("bhij,bjhd->bhid", "output", ((0, 2, 1, 3), None)),
    ("bhqk,bhkd->bqhd", "output", (None, (0, 2, 1, 3))),
    ("bhqk,bhdk->bhqd", "output", ((0, 1, 3, 2), None)),  # the values stored transposed: v' = v^T
])
def test_einsum_layouts(eq, kind, dims):
    """``_einsum_4d`` reads the permutes into the [b, h, l, d] layout (None: none) off the equation:
    ``x.permute(dims)`` for an operand, and the output as the [B, H, Lq, D] product ``.permute(out_dims)``."""
    found = scores.einsum_4d(_einsum_node(eq), kind)
    assert found is not None and tuple(found[2:]) == dims, found


@pytest.mark.parametrize("eq, kind", [
    ("bqhd,bkhd->bqhk", "scores"),  # scores not [B, H, Lq, Lk]
    ("bhqd,bhkd->bhqd", "scores"),  # no key position in the output
    ("bhqk,bkhd->bqhk", "output"),  # the keys not contracted
    ("bhqk,bhqd->bhkd", "output"),  # the queries contracted, not the keys
])
def test_einsum_that_is_not_an_attention_product(eq, kind):
    assert scores.einsum_4d(_einsum_node(eq), kind) is None
