"""Additive float masks passed to ``F.scaled_dot_product_attention``'s ``attn_mask`` (passes/analysis/masks/, Float masks).

A [B | 1, 1, L, L] float mask holding 0 where a key is visible and a blocking value (at most ``masks.BLOCKING``:
``-1e9``, ``finfo.min``, ``-inf``) elsewhere, built from a causal pattern and key padding in any order, added or
filled, classifies like the boolean mask it spells. Every end-to-end case compares the loss and every parameter
gradient with the eager original in float64 and asserts through ``brcompile.stats()`` that the rewrite ran and
shared tokens (or fell back, with the reason). A finite blocking value makes a query row without a visible key a
softmax over all its keys in the original (0 in tree attention): left padding then falls back by the per-call
guard, and replays with ``drop_padding=True``. A mask with finite nonzero values above the threshold is a bias:
refused by that name.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import brcompile
from brcompile.passes.analysis import masks
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.testing import assert_exact
from tests.helpers import exact_over_batches, grouped_rows, real_next_token_loss

VOCAB = 41
FILLS = {"minus_1e9": -1e9, "finfo_min": "min", "minus_inf": float("-inf")}


def _fill(value, dtype):
    return torch.finfo(dtype).min if value == "min" else value


class AdditiveMaskLM(nn.Module):
    """Embedding -> one SDPA attention whose float ``attn_mask`` is built by ``spelling`` with blocking ``fill``
    -> projection. Spellings (``vis`` the causal & key-padding visibility):

    * ``scaled``: ``(1 - causal.float()) * fill + (1 - am.float()) * fill`` (finite fills only: ``0 * -inf`` is NaN)
    * ``filled``: ``zeros(L, L).masked_fill(~causal, fill)`` then ``.masked_fill(am == 0, fill)``
    * ``where``: ``torch.where(vis, zero, fill)`` (0-dim tensors of the dtype: a float64 ``finfo.min`` overflows
      the float32 a Python scalar would make)
    * ``pad_first``: ``pad_add + causal_add``, each ``where(part, 0, fill)`` (the padding part first)
    * ``triu``: ``triu(full(L, L, fill), 1) + (1 - am[:, None, None, :]) * finfo.min``
    * ``no_padding``: the causal part alone (``am`` unread)
    """

    def __init__(self, spelling, fill, dim=16, heads=2):
        super().__init__()
        self.spelling, self.fill, self.heads = spelling, fill, heads
        self.emb = nn.Embedding(VOCAB, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, VOCAB)

    def mask(self, am, L, dtype):
        fill = _fill(self.fill, dtype)
        causal = torch.ones(L, L, dtype=torch.bool, device=am.device).tril()
        pad = am[:, None, None, :].bool()
        if self.spelling == "scaled":
            return ((1 - causal.to(dtype)) * fill)[None, None] + (1 - am[:, None, None, :].to(dtype)) * fill
        if self.spelling == "filled":
            m = torch.zeros(L, L, dtype=dtype, device=am.device).masked_fill(~causal, fill)[None, None]
            return m.masked_fill(am[:, None, None, :] == 0, fill)
        zero, block = torch.zeros((), dtype=dtype), torch.full((), fill, dtype=dtype)
        if self.spelling == "where":
            return torch.where(causal[None, None] & pad, zero, block)
        if self.spelling == "pad_first":
            return torch.where(pad, zero, block) + torch.where(causal, zero, block)[None, None]
        if self.spelling == "triu":
            m = torch.triu(torch.full((L, L), fill, dtype=dtype, device=am.device), 1)[None, None]
            return m + (1 - am[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
        if self.spelling == "no_padding":
            return torch.zeros(L, L, dtype=dtype, device=am.device).masked_fill(~causal, fill)[None, None]
        raise ValueError(self.spelling)

    def forward(self, ids, am):
        B, L = ids.shape
        h = self.emb(ids)
        q, k, v = self.qkv(h).view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(am, L, h.dtype))
        return self.out(o.transpose(1, 2).reshape(B, L, -1))


loss_fn = real_next_token_loss  # the mean log-likelihood of the next token at the real positions


def run_exact(model, batches, *, dynamic=False, **options):
    """Compiled vs eager, loss and every parameter gradient, for each batch (float64); returns the backend."""
    return exact_over_batches(model, loss_fn(model), batches,
                              brcompile.backend(compiler="eager", strict=True, **options), dynamic)


def make(spelling, fill):
    torch.manual_seed(0)
    return AdditiveMaskLM(spelling, fill).double()


def assert_shared(calls, backend, kind):
    s = brcompile.stats()
    assert s.replayed_calls == calls and s.fallback_calls == 0, str(s)
    assert s.executed_tokens < s.logical_tokens, str(s)
    assert all(m.endswith(kind) for r in backend.records if r.rewritten for m in r.masks), \
        [r.masks for r in backend.records]


CASES = [(s, f) for s in ("scaled", "filled", "where", "pad_first", "triu") for f in FILLS
         if not (s == "scaled" and f == "minus_inf")]


@pytest.mark.parametrize("spelling, fill", CASES)
def test_right_padded_additive_mask_replays_exactly(spelling, fill):
    """Causal & key padding, right-padded rows (every query sees its row's first token): replays exactly as
    ``causal+keypad`` of the attention mask, whichever spelling and blocking value."""
    backend = run_exact(make(spelling, FILLS[fill]), [grouped_rows(0, pad=False)])
    assert_shared(1, backend, "causal+keypad(l_am_)")


@pytest.mark.parametrize("fill", sorted(FILLS))
def test_causal_additive_mask_replays_exactly(fill):
    """The causal part alone: ``causal``, no padding guard (every query sees itself)."""
    backend = run_exact(make("no_padding", FILLS[fill]), [grouped_rows(1, pad=False)])
    assert_shared(1, backend, ": causal")


@pytest.mark.parametrize("spelling", ["where", "filled", "pad_first"])
def test_left_padded_minus_inf_mask_replays_exactly(spelling):
    """Left padding (and holes) with ``-inf``: a query row with no visible key is 0 in the original (SDPA's softmax
    of an all ``-inf`` row) as in tree attention, so no guard is needed and the call replays."""
    backend = run_exact(make(spelling, float("-inf")), [grouped_rows(2, pad=True)])
    assert_shared(1, backend, "causal+keypad(l_am_)")


@pytest.mark.parametrize("spelling, fill", [("scaled", "minus_1e9"), ("filled", "finfo_min"), ("triu", "minus_inf")])
def test_left_padded_finite_mask_is_guarded(spelling, fill):
    """Left padding with a finite blocking value (``triu``'s padding part is ``finfo.min``): the original makes a
    padded query's row a softmax over all its keys, tree attention 0. The per-call guard sends the call to the
    original graph, saying why; a right-padded call of the same graph replays. (``liveness=False``: every
    position is computed, the padded queries included.)"""
    model = make(spelling, FILLS[fill])
    run_exact(model, [grouped_rows(3, pad=True), grouped_rows(3, pad=False)], liveness=False)
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.fallback_calls == 1, str(s)
    assert s.fallback_codes == {Code.GUARD_QUERY_WITHOUT_KEYS: 1}, str(s)
    assert any("blocks with a finite value" in r and "a row starts with padding" in r
               for r in s.details(Code.GUARD_QUERY_WITHOUT_KEYS)), str(s)  # saying why


def test_left_padded_finite_mask_replays_when_pads_are_left_out():
    """By default the padded positions the loss does not read leave the tree (passes/analysis/liveness.py), so the guard
    (about their outputs only) is moot: the left-padded call replays, its loss and gradients exact."""
    run_exact(make("scaled", -1e9), [grouped_rows(4, pad=True)])
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.fallback_calls == 0 and s.executed_tokens < s.logical_tokens, str(s)


def test_additive_mask_replays_at_two_lengths_dynamic():
    """Dynamic shapes: the mask's meaning is proven on probes, so a second length replays without recompiling."""
    model = make("pad_first", -1e9)
    backend = run_exact(model, [grouped_rows(5, pad=False), grouped_rows(6, pad=False, response=9)], dynamic=True)
    assert_shared(2, backend, "causal+keypad(l_am_)")
    assert brcompile.stats().compiled_graphs == 1


class BiasedMaskLM(AdditiveMaskLM):
    """A float ``attn_mask`` that is not a 0 / blocking mask: ``bias="small"``, ``masked_fill(~causal, -5)`` (a
    finite value where a causal mask blocks); ``bias="threshold"``, the same with ``-5e3`` (above ``BLOCKING``);
    ``bias="random"``, a fixed random [L, L] buffer added at the visible pairs of a ``-inf`` causal mask;
    ``bias="learned"``, a learned [H, L, L] parameter there; ``bias="bidirectional"``, the random buffer added at
    the visible pairs of a key-padding mask alone (every query sees every real key, later ones included)."""

    def __init__(self, bias, L):
        super().__init__("filled", float("-inf"))
        self.bias = bias
        g = torch.Generator().manual_seed(3)
        if bias == "learned":
            self.table = nn.Parameter(torch.randn(self.heads, L, L, generator=g))
        else:
            self.register_buffer("table", torch.randn(L, L, generator=g))

    def mask(self, am, L, dtype):
        causal = torch.ones(L, L, dtype=torch.bool, device=am.device).tril()
        if self.bias == "small":
            return torch.zeros(L, L, dtype=dtype).masked_fill(~causal, -5.0)[None, None]
        if self.bias == "threshold":
            return torch.zeros(L, L, dtype=dtype).masked_fill(~causal, -5e3)[None, None]
        t = self.table[..., :L, :L].to(dtype)
        if self.bias == "bidirectional":
            return t[None, None].masked_fill(am[:, None, None, :] == 0, float("-inf"))
        return t.masked_fill(~causal, float("-inf"))[None] if t.dim() == 3 else \
            t.masked_fill(~causal, float("-inf"))[None, None]


@pytest.mark.parametrize("bias, reason", [
    ("small", "attn_mask is a float bias with finite nonzero values (not a 0 / -inf mask): it holds -5 where a "
              "causal mask blocks"),
    ("threshold", "attn_mask is a float bias with finite nonzero values (not a 0 / -inf mask): it holds -5000 "
                  "where"),
    ("random", "float mask holds finite nonzero values above -10000 at visible pairs: a bias added to the scores, "
               "not a 0 / -inf mask) that is not ALiBi"),
    ("learned", "computed from the trainable tensor"),
])
def test_float_bias_is_refused_by_name(bias, reason):
    """A genuine bias falls back (exactly: the original graph runs) with a reason that says it is a bias."""
    ids, am = grouped_rows(7, pad=False)
    torch.manual_seed(0)
    model = BiasedMaskLM(bias, ids.shape[1]).double()
    run_exact(model, [(ids, am)])
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls == 1, str(s)
    code = {"small": Code.MASK_FLOAT_BIAS, "threshold": Code.MASK_FLOAT_BIAS}.get(bias, Code.ATTENTION_BIAS)
    assert s.fallback_codes == {code: 1}, str(s)
    assert any(reason in r for r in s.details(code)), str(s)  # the reason says which bias


def test_bias_over_a_bidirectional_mask_is_refused_as_not_causal():
    """A bias added at every pair a mask shows, and that mask showing later keys (a relative position bias over
    bidirectional attention, HF CPM-Ant's): refused as not causal, the bias named, not as a block that falls short
    (the bias is nonzero before the diagonal too)."""
    ids, am = grouped_rows(7, pad=False)
    torch.manual_seed(0)
    run_exact(BiasedMaskLM("bidirectional", ids.shape[1]).double(), [(ids, am)])
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_codes == {Code.MASK_NOT_CAUSAL: 1}, str(s)
    assert any("see keys after it and adds a bias" in r for r in s.details(Code.MASK_NOT_CAUSAL)), str(s)


def test_blocking_threshold():
    """``masks.blocked``: values at most ``BLOCKING`` (-1e4) block, ``-inf`` included; ``split_bias`` reads what is
    above as visible with a bias, and ``finite_blocking`` tells a finite blocking value from ``-inf``."""
    m = torch.tensor([[0.0, -1e4, float("-inf")], [-1e9, -9999.0, 0.0]], dtype=torch.float64)
    assert masks.blocked(m).tolist() == [[False, True, True], [True, False, False]]
    vis, bias = masks.split_bias(m, None)
    assert vis.tolist() == [[True, False, False], [False, True, True]]
    assert bias.tolist() == [[0.0, 0.0, 0.0], [0.0, -9999.0, 0.0]]
    assert masks.finite_blocking(m)
    assert not masks.finite_blocking(torch.tensor([0.0, float("-inf")]))
    assert not masks.finite_blocking(torch.tensor([True, False]))
    with pytest.raises(CannotReplay, match="float bias with finite nonzero values") as e:
        masks.visible(m, None)
    assert e.value.code is Code.MASK_FLOAT_BIAS
