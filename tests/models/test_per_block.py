"""Graphs that never see token ids: per-block compilation and ``inputs_embeds``.

A transformer compiled one block at a time (``torch.compile(block)`` per layer, FSDP2 per block, graph
breaks) gives graphs whose per-token inputs are float hidden states [B, L, D]. Their tree keys are those
inputs, compared bitwise per position (hash, then an exact check). Every test compares the loss and every
parameter gradient with the eager model in float64 and asserts through ``brcompile.stats()`` that the
rewrite ran (or fell back, with the expected reason).
"""
import pytest
import torch

import brcompile
from brcompile.testing import assert_exact
from examples.gpt import GPT, GPTConfig
from examples.grpo import grpo_loss, make_grpo_batch
from tests.helpers import assert_replayed, grpo_args, hf_tiny_model

BACKEND_OPTIONS = dict(compiler="aot_eager")  # AOTAutograd, no Inductor codegen: fast on 2 cores
CFG = dict(vocab_size=61, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=48)


def make_model(dtype=torch.float64):
    return GPT(GPTConfig(**CFG), seed=0).to(dtype)


def equal_length_batch(**kw):
    """A GRPO batch whose rows all have the same length (no padding: plain causal attention is right)."""
    spec = dict(num_prompts=2, group_size=4, prompt_len=9, response_len=5, shared_response_prefix=2,
                vocab_size=CFG["vocab_size"], seed=3, dtype=torch.float64)
    spec.update(kw)
    batch = make_grpo_batch(**spec)
    assert bool(batch["attention_mask"].all())
    return batch


class PerBlock(torch.nn.Module):
    """``model(input_ids, attention_mask)`` with the embedding, norm and head eager and each block a callable
    from ``blocks`` (compiled or not). ``outside_mask``: build the [B, 1, L, L] mask here, outside the blocks."""

    def __init__(self, model, blocks, outside_mask=False):
        super().__init__()
        self.model, self.blocks, self.outside_mask = model, blocks, outside_mask

    def forward(self, input_ids, attention_mask=None):
        m = self.model
        B, L = input_ids.shape
        h = m.tok_emb(input_ids)
        cos, sin = m.rotary_cos_sin(L, input_ids.device, h.dtype)
        mask = None
        if self.outside_mask:
            idx = torch.arange(L)
            mask = (idx[:, None] >= idx[None, :])[None, None] & attention_mask[:, None, None, :].bool()
        for blk in self.blocks:
            h = blk(h, cos, sin) if mask is None else blk(h, cos, sin, mask)
        return m.logits(m.norm(h))


def check_exact(model, run, dtype=torch.float64):
    """run(model) -> loss, eagerly (reference) and through the compiled pieces: loss and every grad."""
    params = list(model.parameters())
    ref = run(eager=True)
    gref = torch.autograd.grad(ref, params, allow_unused=True)
    out = run(eager=False)
    gout = torch.autograd.grad(out, params, allow_unused=True)
    assert_exact(out.detach(), ref.detach(), dtype, "loss")
    for (name, _), a, b in zip(model.named_parameters(), gout, gref):
        assert (a is None) == (b is None), name
        if b is not None:
            assert_exact(a, b, dtype, f"grad of {name}")


# ------------------------------------------------------------------------------------------------ per block


@pytest.mark.parametrize("shared_response_prefix, mode", [(0, "packed"), (2, "packed"), (2, "replay")])
def test_gpt_compiled_per_block_grpo_exact(shared_response_prefix, mode):
    """torch.compile(block) per layer, no mask (is_causal=True): every block call replays; the first builds
    the tree from the embeddings, the others reuse it (their input is the previous block's packed output).
    mode="replay": streaming replay of each block (prefix once, tails in chunks of <= 8 tokens)."""
    model = make_model()
    batch = equal_length_batch(shared_response_prefix=shared_response_prefix)
    backend = brcompile.backend(**BACKEND_OPTIONS, mode=mode, chunk_tokens=8)
    compiled = [torch.compile(layer, backend=backend) for layer in model.layers]

    def run(eager):
        wrapped = PerBlock(model, model.layers if eager else compiled)
        return grpo_loss(wrapped, *grpo_args(batch), use_attention_mask=False)

    check_exact(model, run)
    assert_replayed(CFG["n_layers"])
    assert brcompile.stats().streamed_calls == (CFG["n_layers"] if mode == "replay" else 0)
    calls = [c for r in backend.records for c in r.runtime.calls]
    assert [c.tree_stats["source"] for c in calls] == ["built"] + ["provenance"] * (CFG["n_layers"] - 1)
    B, L = batch["input_ids"].shape
    assert all(c.tree_stats["keys"] == [f"[{B}, {L}, {CFG['dim']}] float64"] for c in calls)
    rec = backend.records[0]
    assert rec.rewritten and len(rec.tree_inputs) == 1  # the hidden states; cos/sin are per-position inputs


def test_per_block_tree_equals_token_tree():
    """The tree a block builds from its hidden states is the tree of the token ids (distinct embeddings)."""
    model = make_model()
    batch = equal_length_batch()
    backend = brcompile.backend(**BACKEND_OPTIONS)
    blk = torch.compile(model.layers[0], backend=backend)
    with torch.no_grad():
        PerBlock(model, [blk])(batch["input_ids"])
    tree = backend.records[0].runtime.last_tree
    want = brcompile.runtime.tree.build_tree(batch["input_ids"])
    assert tree.num_tokens == want.num_tokens and tree.segments.shape == want.segments.shape
    # the same partition of the positions into nodes (node ids may differ: siblings are ordered by code)
    assert torch.equal(tree.rep_row[tree.index], want.rep_row[want.index])


def test_modified_block_output_is_hashed_again():
    """An in-place change of a block's output bumps its version: the next graph builds its tree again."""
    model = make_model()
    batch = equal_length_batch()
    backend = brcompile.backend(**BACKEND_OPTIONS)
    blk = torch.compile(model.layers[0], backend=backend)
    ids = batch["input_ids"]
    with torch.no_grad():
        h = model.tok_emb(ids)
        cos, sin = model.rotary_cos_sin(ids.shape[1], ids.device, h.dtype)
        h1 = blk(h, cos, sin)
        blk(h1, cos, sin)
        h1[0, -1, 0] += 1.0  # row 0 now differs from its group at the last column
        h3 = blk(h1, cos, sin)
        want = model.layers[0](h1, cos, sin)
    sources = [c.tree_stats["source"] for c in backend.records[0].runtime.calls]
    assert sources == ["built", "provenance", "built"]
    assert_exact(h3, want, torch.float64, "block output after the in-place change")


@pytest.mark.parametrize("mode", ["packed", "replay"])
def test_mask_built_outside_the_block_replays(mode):
    """A [B, 1, L, L] causal & key-padding mask made outside the compiled blocks (as FSDP2-per-block and HF
    per-layer setups hand it over) is read off the tensor (passes/analysis/input_masks.py): every block replays with
    its diagonal as the key padding; the mask is checked once, and blocks after the first reuse the tree."""
    model = make_model()
    batch = make_grpo_batch(num_prompts=2, group_size=3, prompt_len=(5, 8), response_len=(2, 5),
                            vocab_size=CFG["vocab_size"], seed=4, dtype=torch.float64)
    assert not bool(batch["attention_mask"].all())
    backend = brcompile.backend(**BACKEND_OPTIONS, mode=mode, chunk_tokens=8)
    compiled = [torch.compile(layer, backend=backend) for layer in model.layers]

    def run(eager):
        wrapped = PerBlock(model, model.layers if eager else compiled, outside_mask=True)
        return grpo_loss(wrapped, *grpo_args(batch))

    check_exact(model, run)
    assert_replayed(CFG["n_layers"])
    rec = backend.records[0]
    assert rec.rewritten and any("causal+keypad(l_mask_)" in m for m in rec.masks), rec.masks
    calls = [c for r in backend.records for c in r.runtime.calls]
    assert [c.tree_stats["source"] for c in calls] == ["built"] + ["provenance"] * (CFG["n_layers"] - 1)


def test_mask_from_outside_checked_per_call():
    """The first call's mask is causal & key padding (the block replays); a later call hands the same block a
    mask that lets a query see a later key: that call runs the original graph, with the reason."""
    model = make_model()
    batch = make_grpo_batch(num_prompts=2, group_size=3, prompt_len=(5, 8), response_len=(2, 5),
                            vocab_size=CFG["vocab_size"], seed=4, dtype=torch.float64)
    B, L = batch["input_ids"].shape
    backend = brcompile.backend(**BACKEND_OPTIONS)
    blk = torch.compile(model.layers[0], backend=backend)
    h = model.tok_emb(batch["input_ids"])
    cos, sin = model.rotary_cos_sin(L, h.device, h.dtype)
    idx = torch.arange(L)
    mask = (idx[:, None] >= idx[None, :])[None, None] & batch["attention_mask"][:, None, None, :].bool()
    peek = mask.clone()
    peek[:, :, 0, 1] = True  # the first query sees the second key
    for m in (mask, peek):
        assert_exact(blk(h, cos, sin, m), model.layers[0](h, cos, sin, m), torch.float64, "block output")
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.fallback_calls == 1, str(s)
    assert s.fallback_codes == {brcompile.Code.GUARD_INPUT_MASK: 1}, str(s)
    (reason,) = s.fallback_reasons
    assert "l_mask_" in reason and "not causal" in reason, reason  # names the input


def test_mask_from_outside_that_is_not_causal_falls_back_with_reason():
    """A bidirectional mask from outside (an encoder's, a prefix-LM's) is not what tree attention computes:
    the original graph runs (exact), with the reason naming the input."""
    model = make_model()
    batch = equal_length_batch()
    B, L = batch["input_ids"].shape
    backend = brcompile.backend(**BACKEND_OPTIONS)
    blk = torch.compile(model.layers[0], backend=backend)
    h = model.tok_emb(batch["input_ids"])
    cos, sin = model.rotary_cos_sin(L, h.device, h.dtype)
    mask = torch.ones(B, 1, L, L, dtype=torch.bool)
    assert_exact(blk(h, cos, sin, mask), model.layers[0](h, cos, sin, mask), torch.float64, "block output")
    assert brcompile.stats().fallback_codes == {brcompile.Code.INPUT_MASK: 1}, str(brcompile.stats())
    (reason,) = brcompile.stats().fallback_reasons
    assert "not causal" in reason, reason


# ------------------------------------------------------------------------------------------------ inputs_embeds


def trunk_from_embeds(model, inputs_embeds, attention_mask=None):
    """GPT.hidden_states with the embedding lookup done by the caller."""
    B, L, _ = inputs_embeds.shape
    cos, sin = model.rotary_cos_sin(L, inputs_embeds.device, inputs_embeds.dtype)
    mask = None
    if attention_mask is not None:
        idx = torch.arange(L, device=inputs_embeds.device)
        mask = (idx[:, None] >= idx[None, :])[None, None] & attention_mask[:, None, None, :].bool()
    h = inputs_embeds
    for layer in model.layers:
        h = layer(h, cos, sin, mask)
    return model.norm(h)


def grpo_from_embeds(model, inputs_embeds, input_ids, attention_mask, completion_mask, advantages,
                     old_logprobs, clip_eps=0.2):
    """examples.grpo.grpo_loss on a model fed ``inputs_embeds`` (ids only pick the log-prob targets)."""
    logits = model.logits(trunk_from_embeds(model, inputs_embeds, attention_mask))
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    ratio = torch.exp(logp - old_logprobs)
    adv = advantages[:, None]
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    mask = completion_mask[:, 1:].to(surrogate.dtype)
    return -((surrogate * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)).mean()


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "right_padded_keypad"])
def test_inputs_embeds_grpo_exact(padded):
    """The compiled function takes [B, L, D] embeddings computed outside (and, padded, the [B, L] mask it
    builds the causal & key-padding mask from): tree keys = the embeddings (+ the mask)."""
    model = make_model()
    if padded:
        batch = make_grpo_batch(num_prompts=2, group_size=4, prompt_len=(6, 9), response_len=(2, 6),
                                vocab_size=CFG["vocab_size"], seed=5, dtype=torch.float64)
    else:
        batch = equal_length_batch()
    backend = brcompile.backend(**BACKEND_OPTIONS)
    compiled = torch.compile(grpo_from_embeds, backend=backend)
    am = batch["attention_mask"] if padded else None

    def run(eager):
        fn = grpo_from_embeds if eager else compiled
        embeds = model.tok_emb(batch["input_ids"])
        return fn(model, embeds, batch["input_ids"], am, batch["completion_mask"], batch["advantages"],
                  batch["old_logprobs"])

    check_exact(model, run)
    assert_replayed(1)
    rec = backend.records[0]
    assert rec.rewritten
    (call,) = rec.runtime.calls
    B, L = batch["input_ids"].shape
    keys = call.tree_stats["keys"]
    assert f"[{B}, {L}, {CFG['dim']}] float64" in keys and len(keys) == (2 if padded else 1), keys
    assert call.tree_stats["source"] == "built"


def test_float_keys_compare_bitwise_not_by_value():
    """-0.0 and 0.0 are different keys (bitwise), so rows differing only there do not share: the packed
    result still equals the dense one."""
    model = make_model()
    backend = brcompile.backend(**BACKEND_OPTIONS)
    blk = torch.compile(model.layers[0], backend=backend)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, 10, CFG["dim"], generator=g, dtype=torch.float64).repeat(4, 1, 1)
    h[:, 6:] = torch.randn(4, 4, CFG["dim"], generator=g, dtype=torch.float64)
    h[:, 3, 0] = 0.0
    h[1, 3, 0] = -0.0  # row 1 leaves the shared prefix at column 3
    cos, sin = model.rotary_cos_sin(10, h.device, h.dtype)
    with torch.no_grad():
        out = blk(h, cos, sin)
        want = model.layers[0](h, cos, sin)
    assert_exact(out, want, torch.float64, "block output")
    tree = backend.records[0].runtime.last_tree
    # columns 0-2 shared by all; row 1 alone from column 3; rows 0, 2, 3 share 3-5, then each alone from 6
    assert tree.num_tokens == 3 + 7 + 3 + 3 * 4
    assert brcompile.stats().replayed_calls == 1


# ------------------------------------------------------------------------------------------------ HF models


def _llama(num_layers=3):
    return hf_tiny_model("llama", "sdpa", torch.float64, num_hidden_layers=num_layers)


def shared_ids(rows=5, prompt=7, response=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(1, 61, (1, prompt), generator=g).expand(rows, prompt)
    r = torch.randint(1, 61, (rows, response), generator=g)
    r[1, :2] = r[0, :2]
    return torch.cat([p, r], 1)


def check_hf(model, fn, dtype=torch.float64):
    """fn() -> logits, eager first (hooks/compilation applied by the caller in between): returns a closure."""
    params = list(model.parameters())
    ref = fn()
    gref = torch.autograd.grad(ref.square().sum(), params)

    def compare(out):
        gout = torch.autograd.grad(out.square().sum(), params)
        assert_exact(out.detach(), ref.detach(), dtype, "logits")
        for (name, _), a, b in zip(model.named_parameters(), gout, gref):
            assert_exact(a, b, dtype, f"grad of {name}")
    return compare


def test_hf_llama_compiled_per_decoder_layer(float64_norms):
    """layer.compile() on every LlamaDecoderLayer, no padding (HF passes no mask: SDPA is_causal): every
    layer replays; the rotary cos/sin [1, L, head_dim] are per-position inputs, the hidden states the key."""
    model = _llama()
    ids = shared_ids()
    compare = check_hf(model, lambda: model(input_ids=ids).logits)
    backend = brcompile.backend(**BACKEND_OPTIONS)
    for layer in model.model.layers:
        layer.compile(backend=backend)
    compare(model(input_ids=ids).logits)
    assert_replayed(3)
    sources = [c.tree_stats["source"] for r in backend.records for c in r.runtime.calls]
    assert sources == ["built", "provenance", "provenance"]


def test_hf_llama_padding_mask_per_layer_replays(float64_norms):
    """With padding HF builds a 4D mask once and hands it to every layer: each layer's graph reads its meaning
    off the tensor (causal & key padding) and replays."""
    model = _llama(num_layers=2)
    batch = make_grpo_batch(num_prompts=2, group_size=3, prompt_len=(4, 7), response_len=(2, 5),
                            vocab_size=61, seed=2)
    ids, am = batch["input_ids"], batch["attention_mask"]
    compare = check_hf(model, lambda: model(input_ids=ids, attention_mask=am).logits)
    backend = brcompile.backend(**BACKEND_OPTIONS)
    for layer in model.model.layers:
        layer.compile(backend=backend)
    compare(model(input_ids=ids, attention_mask=am).logits)
    assert_replayed(2)


def test_hf_llama_graph_break_inside_forward(float64_norms):
    """A graph break inside the model's forward (a pre-hook on a layer calling graph_break) splits the compiled
    model into graphs that see hidden states: those with attention replay, the rest replay on their token-local ops
    or run unchanged."""
    model = _llama()
    ids = shared_ids()
    compare = check_hf(model, lambda: model(input_ids=ids).logits)
    model.model.layers[1].register_forward_pre_hook(lambda *a, **k: torch._dynamo.graph_break(), with_kwargs=True)
    backend = brcompile.backend(**BACKEND_OPTIONS)
    compare(torch.compile(lambda x: model(input_ids=x).logits, backend=backend)(ids))
    s = brcompile.stats()
    assert s.replayed_calls >= 2 and s.rewritten_graphs >= 1, str(s)
    assert s.executed_tokens < s.logical_tokens
    replayed = [r for r in backend.records if r.rewritten]
    assert all(r.tree_inputs for r in replayed)
    for r in backend.records:  # the graphs that fell back have no attention and nothing packed
        assert r.rewritten or r.code in (brcompile.Code.NO_TOKEN_INPUT, brcompile.Code.NOTHING_PACKED, brcompile.Code.NO_PER_TOKEN_WORK), r.reason


def test_per_position_input_used_in_block_and_loss():
    """A per-position [L] input (shared by every row) is read per packed token inside the block and as
    itself by the dense loss."""
    model = make_model()
    batch = equal_length_batch()
    ids = batch["input_ids"]
    L = ids.shape[1]
    w = torch.linspace(0.5, 1.5, L, dtype=torch.float64)

    def f(model, h, w):
        cos, sin = model.rotary_cos_sin(h.shape[1], h.device, h.dtype)
        out = model.layers[0](h * w[:, None], cos, sin)
        return (out.square().sum(-1).sum(0) * w).sum()

    backend = brcompile.backend(**BACKEND_OPTIONS)
    compiled = torch.compile(f, backend=backend)
    check_exact(model, lambda eager: (f if eager else compiled)(model, model.tok_emb(ids), w))
    assert_replayed(1)


def test_per_block_dynamic_shapes_two_batches():
    """dynamic=True: one compiled block serves batches of other B and L (cos/sin [L, head_dim] symbolic)."""
    model = make_model()
    backend = brcompile.backend(**BACKEND_OPTIONS)
    compiled = [torch.compile(layer, backend=backend, dynamic=True) for layer in model.layers]
    for spec in (dict(prompt_len=9, response_len=5), dict(prompt_len=12, response_len=3, group_size=3)):
        batch = equal_length_batch(**spec)

        def run(eager):
            wrapped = PerBlock(model, model.layers if eager else compiled)
            return grpo_loss(wrapped, *grpo_args(batch), use_attention_mask=False)

        check_exact(model, run)
    assert_replayed(2 * CFG["n_layers"])
