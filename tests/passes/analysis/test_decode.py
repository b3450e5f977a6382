"""Decode steps against a KV cache (passes/analysis/decode.py): counted as unshared calls (NothingToShare), not fallbacks.

HF ``generate`` with the decoder compiled by branch_replay: the prefill of prompts repeated per row replays, every
decode step (one token per row, keys from the cache) is a graph with nothing to share, and the generated tokens
equal eager's. Plain modules pin the rule's edges: keys computed here from a per-row context are no cache, and
one token per row without a cache is analysed as any other graph.
"""
import pytest
import torch
import torch.nn.functional as F

import brcompile
from tests.helpers import hf_tiny_model

BACKEND_OPTIONS = dict(compiler="aot_eager")


def _prompts(vocab: int, group: int = 2):
    """(ids, attention mask): three prompts of lengths 5, 3 and 7, each repeated ``group`` times, left-padded."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (n,), generator=g) for n in (5, 3, 7)]
    L = max(len(p) for p in prompts)
    rows = [p for p in prompts for _ in range(group)]
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for b, p in enumerate(rows):
        ids[b, L - len(p):] = p
        mask[b, L - len(p):] = 1
    return ids, mask


def _generate(model, ids, mask, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                          eos_token_id=None, **kw)


@pytest.mark.parametrize("dynamic,cache", [(None, "dynamic"), (True, "dynamic"), (None, "static")],
                         ids=["automatic", "dynamic_shapes", "static_cache"])
def test_generate_decode_steps_are_unshared(dynamic, cache):
    """Greedy ``generate`` on a tiny Qwen2 whose decoder ``brcompile.compile_decoder`` compiled (inside explain's
    ``recording``): the same tokens as eager; the decode steps run as they are, counted as unshared with the
    decode reason, which the explain report shows. With ``dynamic=True`` the position extent 1 is still a
    specialised int. The prefill replays (each prompt is in two rows), except with a static cache (written in
    place instead of concatenated): its prefill's mask spans the cache's length, a real refusal that stays a
    fallback, counted once with its reason."""
    from brcompile.tools.explain import recording

    model = hf_tiny_model("qwen2").eval()
    ids, mask = _prompts(model.config.vocab_size)
    extra = {} if cache == "dynamic" else dict(cache_implementation="static")
    with torch.no_grad():
        want = _generate(model, ids, mask, **extra)
        with recording(brcompile.backend(**BACKEND_OPTIONS), measure=False) as rec:
            brcompile.compile_decoder(model, **({} if dynamic is None else dict(dynamic=dynamic)))
            got = _generate(model, ids, mask, **extra)
    assert torch.equal(got, want), (got, want)
    s = brcompile.stats()
    if cache == "static":
        assert s.fallback_calls == 1 and s.replayed_calls == 0, str(s)
        assert s.fallback_codes == {brcompile.Code.INPUT_MASK: 1}, str(s)
    else:
        assert s.fallback_calls == 0, str(s)
        assert s.replayed_calls >= 1 and s.executed_tokens < s.logical_tokens, str(s)
    assert s.unshared_calls >= 4, str(s)  # 5 new tokens: the prefill makes the first, 4 decode steps the rest
    assert set(s.unshared_codes) == {brcompile.Code.DECODE_STEP}, str(s)
    report = rec.report()
    assert report.unshared and len(report.fallbacks) == (cache == "static"), report.summary()
    text = report.render_text(code=False)
    assert "NOTHING TO SHARE" in text and "a decode step against a cache" in text, text


class CachedStep(torch.nn.Module):
    """One attention over a cache: token ids ``[B, 1]`` embedded, keys and values the cache's concatenated with
    the new token's (``cat``), or, with ``project_context``, keys and values projected here from a per-row
    context ``[B, S, D]`` (cross-attention on encoder states: per-position work on the context)."""

    def __init__(self, vocab: int = 13, dim: int = 16, project_context: bool = False):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.q, self.k, self.v = (torch.nn.Linear(dim, dim) for _ in range(3))
        self.project_context = project_context

    def forward(self, ids, past_k, past_v):
        x = self.emb(ids)  # [B, 1, D]
        q = self.q(x).unsqueeze(1)
        if self.project_context:  # past_k is a context [B, S, D] here
            k, v = self.k(past_k).unsqueeze(1), self.v(past_k).unsqueeze(1)
        else:
            k = torch.cat([past_k, self.k(x).unsqueeze(1)], dim=2)
            v = torch.cat([past_v, self.v(x).unsqueeze(1)], dim=2)
        return F.scaled_dot_product_attention(q, k, v).sum()


def _run(model, *args):
    backend = brcompile.backend(compiler="eager")
    with torch.no_grad():
        want = model(*args)
        got = torch.compile(model, backend=backend)(*args)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    return backend


def test_cat_cache_step_is_unshared():
    """A plain module's decode step: keys are the cache's ``[B, 1, S, D]`` (one head, as an MQA cache) with the new
    token's appended: unshared with the decode reason, no fallback."""
    torch.manual_seed(0)
    model = CachedStep().double()
    B, S = 4, 6
    ids = torch.tensor([[3], [3], [5], [3]])  # rows 0, 1 and 3 hold the same token: their caches differ
    past_k, past_v = (torch.randn(B, 1, S, 16, dtype=torch.float64) for _ in range(2))
    backend = _run(model, ids, past_k, past_v)
    (rec,) = backend.records
    assert rec.unshared and not rec.rewritten and rec.code is brcompile.Code.DECODE_STEP, rec.reason
    s = brcompile.stats()
    assert s.unshared_calls == 1 and s.fallback_calls == 0 and s.replayed_calls == 0, str(s)


def test_projected_context_is_not_a_cache():
    """Keys projected here from a per-row context (cross-attention on encoder states) are computed in the graph:
    not a decode step against a cache. The graph's refusal (today's analysis refuses it) stays a fallback."""
    torch.manual_seed(0)
    model = CachedStep(project_context=True).double()
    ids = torch.tensor([[3], [3], [5], [3]])
    context = torch.randn(4, 6, 16, dtype=torch.float64)
    backend = _run(model, ids, context, context)
    (rec,) = backend.records
    assert not rec.unshared and rec.code is not brcompile.Code.DECODE_STEP, rec.reason
    assert brcompile.stats().unshared_calls == 0


def test_one_token_per_row_without_cache_is_analysed():
    """One token per row and a cache of 0 positions (the keys are the new token's: extent 1): rows with equal
    tokens would be one tree node (a prefix of length 1), so this is no decode step; the graph is analysed as
    any other, and its refusal stays a fallback."""
    torch.manual_seed(0)
    model = CachedStep().double()
    ids = torch.tensor([[3], [3], [5], [3]])
    empty = torch.zeros(4, 1, 0, 16, dtype=torch.float64)  # a cache of 0 positions: the keys are the new token's
    backend = _run(model, ids, empty, empty)
    (rec,) = backend.records
    assert not rec.unshared and rec.code is not brcompile.Code.DECODE_STEP, rec.reason
    assert brcompile.stats().unshared_calls == 0
