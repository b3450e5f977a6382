"""The example GPT, GRPO batch/loss and demo plumbing, in eager mode (no brcompile backend).

These pin down the oracle side of every end-to-end test: the model is causal and row-independent,
masks mean what they say, the batch generator builds the prefix structure it claims, and the losses
are the plain formulas.
"""
import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples import grpo_demo  # noqa: E402
from examples.gpt import GPT, GPTConfig, repeat_kv  # noqa: E402
from examples.grpo import grpo_loss, make_grpo_batch, masked_nll_loss  # noqa: E402

F64 = dict(atol=1e-12, rtol=1e-10)


def small_config(**kw) -> GPTConfig:
    """A tiny model with odd-ish sizes: vocab 53, dim 24 (3 heads of 8, GQA 3 -> 1), hidden 40."""
    base = dict(vocab_size=53, dim=24, n_layers=2, n_heads=3, n_kv_heads=1, hidden_dim=40)
    base.update(kw)
    return GPTConfig(**base)


def model64(seed=0, **kw) -> GPT:
    """The tiny model in float64."""
    return GPT(small_config(**kw), seed=seed).double()


def random_ids(B, L, vocab=53, seed=0) -> torch.Tensor:
    """Token ids in [1, vocab) (0 is the pad id)."""
    return torch.randint(1, vocab, (B, L), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------------
# GPT

def test_config_defaults_and_validation():
    c = GPTConfig()
    assert c.hidden_dim == 352 and c.hidden_dim % 16 == 0 and c.hidden_dim >= 8 * c.dim / 3
    assert c.head_dim == 32
    assert GPTConfig(dim=96, n_heads=3, n_kv_heads=1).hidden_dim == 256
    with pytest.raises(ValueError, match="n_heads"):
        GPTConfig(dim=100, n_heads=3)
    with pytest.raises(ValueError, match="n_kv_heads"):
        GPTConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="even"):
        GPTConfig(dim=12, n_heads=4, n_kv_heads=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("B,L", [(1, 1), (3, 13)])
def test_gpt_shapes_dtypes_and_grads(dtype, tie, B, L):
    model = GPT(small_config(tie_embeddings=tie)).to(dtype)
    assert model.inv_freq.dtype == dtype
    assert (model.lm_head is None) == tie
    ids = random_ids(B, L)
    logits = model(ids)
    assert logits.shape == (B, L, 53) and logits.dtype == dtype
    assert torch.isfinite(logits).all()
    logits.square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_init_is_seeded_and_small():
    a, b, c = GPT(small_config(), seed=3), GPT(small_config(), seed=3), GPT(small_config(), seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
            assert pa.abs().max() < 0.2, name


def test_repeat_kv_matches_repeat_interleave():
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    assert torch.equal(repeat_kv(x, 3), x.repeat_interleave(3, dim=1))
    assert repeat_kv(x, 1) is x


@pytest.mark.parametrize("use_mask", [False, True])
def test_gpt_is_causal(use_mask):
    """Changing token t0 leaves logits before t0 unchanged and changes logits at t0."""
    model = model64()
    ids = random_ids(2, 17)
    mask = torch.ones_like(ids) if use_mask else None
    t0 = 9
    changed = ids.clone()
    changed[:, t0:] = (changed[:, t0:] % 52) + 1
    with torch.no_grad():
        a, b = model(ids, mask), model(changed, mask)
    assert_close(a[:, :t0], b[:, :t0], **F64)
    assert (a[:, t0] - b[:, t0]).abs().max() > 1e-6


def test_all_ones_attention_mask_equals_no_mask():
    model = model64()
    ids = random_ids(3, 19)
    with torch.no_grad():
        assert_close(model(ids, torch.ones_like(ids)), model(ids, None), **F64)


def test_rows_are_independent():
    model = model64()
    ids = random_ids(4, 11)
    with torch.no_grad():
        full = model(ids)
        for b in range(4):
            assert_close(full[b:b + 1], model(ids[b:b + 1]), **F64)


def test_right_and_left_padding_do_not_change_real_logits():
    """A row padded on either side, with its attention mask, gives the unpadded row's logits at its real
    positions (left padding shifts RoPE positions, and RoPE scores depend only on relative positions).
    Fully masked pad queries (left padding) stay finite."""
    model = model64()
    row = random_ids(1, 10)
    pad = torch.zeros(1, 5, dtype=torch.long)
    right = torch.cat([row, pad], 1)
    left = torch.cat([pad, row], 1)
    m_right = torch.cat([torch.ones_like(row), pad], 1)
    m_left = torch.cat([pad, torch.ones_like(row)], 1)
    with torch.no_grad():
        ref = model(row)
        out_right = model(right, m_right)
        out_left = model(left, m_left)
    assert_close(out_right[:, :10], ref, **F64)
    assert_close(out_left[:, 5:], ref, atol=1e-10, rtol=1e-9)
    assert torch.isfinite(out_left).all() and torch.isfinite(out_right).all()


def test_float32_model_matches_float64_model():
    m64 = model64()
    m32 = GPT(small_config())
    ids = random_ids(2, 9)
    with torch.no_grad():
        assert_close(m32(ids).double(), m64(ids), atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------------------------------
# make_grpo_batch

def check_batch_invariants(batch, *, num_prompts, group_size, p_range, r_range, shared, pad_id, left_pad):
    """Every structural claim of make_grpo_batch's docstring."""
    ids, am, cm = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    B, L = ids.shape
    assert B == num_prompts * group_size
    assert am.shape == cm.shape == (B, L) and batch["advantages"].shape == (B,)
    assert batch["old_logprobs"].shape == (B, L - 1)
    assert ids.dtype == am.dtype == cm.dtype == torch.long
    assert torch.equal(am.bool(), ids != pad_id)                   # real tokens never equal pad_id
    assert not (cm.bool() & ~am.bool()).any()                        # completion tokens are real tokens
    resp_starts = []
    for b in range(B):
        real = am[b].nonzero().flatten()
        comp = cm[b].nonzero().flatten()
        start, end = int(real[0]), int(real[-1]) + 1
        assert int(am[b].sum()) == end - start                      # one contiguous block of real tokens
        assert int(comp[-1]) + 1 == end and int(cm[b].sum()) == len(comp) == int(comp[-1]) - int(comp[0]) + 1
        p, r = int(comp[0]) - start, len(comp)
        assert p_range[0] <= p <= p_range[1] and r_range[0] <= r <= r_range[1]
        if not left_pad:
            assert start == 0                                        # right padding only
        resp_starts.append(int(comp[0]))
        prompt, shared_part = ids[b, start:int(comp[0])], ids[b, int(comp[0]):int(comp[0]) + shared]
        g = b // group_size
        if b % group_size == 0:
            group_prompt, group_shared = prompt, shared_part
        assert torch.equal(prompt, group_prompt), (b, g)              # rows of a group share the prompt
        assert torch.equal(shared_part, group_shared), (b, g)         # ... and the shared response prefix
    if left_pad:
        assert len(set(resp_starts)) == 1                            # responses aligned (TRL)
    assert (am[:, -1] == 1).any() and (am[:, 0] == 1).any()          # no all-pad column at either end
    assert_close(batch["advantages"].view(num_prompts, group_size).double().mean(1),
                 torch.zeros(num_prompts, dtype=torch.float64), atol=1e-6, rtol=0)
    assert torch.equal(batch["old_logprobs"] != 0, cm[:, 1:].bool())


@pytest.mark.parametrize("left_pad", [False, True])
def test_make_grpo_batch_invariants(left_pad):
    kw = dict(num_prompts=3, group_size=5, prompt_len=(7, 19), response_len=(3, 11), shared_response_prefix=2,
              vocab_size=31, pad_id=4, left_pad_prompts=left_pad, seed=7)
    batch = make_grpo_batch(**kw)
    check_batch_invariants(batch, num_prompts=3, group_size=5, p_range=(7, 19), r_range=(3, 11), shared=2,
                           pad_id=4, left_pad=left_pad)
    again = make_grpo_batch(**kw)
    for k in batch:
        assert torch.equal(batch[k], again[k]), k
    other = make_grpo_batch(**{**kw, "seed": 8})
    assert not torch.equal(batch["input_ids"][:, :7], other["input_ids"][:, :7])


@settings(max_examples=40, deadline=None)
@given(num_prompts=st.integers(1, 4), group_size=st.integers(1, 5), p=st.tuples(st.integers(1, 9), st.integers(0, 9)),
       r=st.tuples(st.integers(1, 7), st.integers(0, 7)), shared=st.integers(0, 7), pad_id=st.integers(0, 6),
       left_pad=st.booleans(), seed=st.integers(0, 2**16))
def test_make_grpo_batch_invariants_property(num_prompts, group_size, p, r, shared, pad_id, left_pad, seed):
    p_range, r_range = (p[0], p[0] + p[1]), (r[0], r[0] + r[1])
    shared = min(shared, r_range[0])
    batch = make_grpo_batch(num_prompts=num_prompts, group_size=group_size, prompt_len=p_range, response_len=r_range,
                            shared_response_prefix=shared, vocab_size=7, pad_id=pad_id, left_pad_prompts=left_pad,
                            seed=seed)
    check_batch_invariants(batch, num_prompts=num_prompts, group_size=group_size, p_range=p_range, r_range=r_range,
                           shared=shared, pad_id=pad_id, left_pad=left_pad)


def test_make_grpo_batch_fixed_lengths_and_dtype():
    batch = make_grpo_batch(num_prompts=2, group_size=3, prompt_len=6, response_len=4, dtype=torch.float64)
    assert batch["input_ids"].shape == (6, 10)
    assert batch["attention_mask"].all()
    assert torch.equal(batch["completion_mask"][:, 6:], torch.ones(6, 4, dtype=torch.long))
    assert batch["advantages"].dtype == batch["old_logprobs"].dtype == torch.float64


@pytest.mark.parametrize("kw,err", [
    (dict(shared_response_prefix=9), ValueError),
    (dict(prompt_len=(5, 3)), ValueError),
    (dict(response_len=0), ValueError),
    (dict(prompt_len="long"), TypeError),
    (dict(pad_id=256), ValueError),
    (dict(group_size=0), ValueError),
])
def test_make_grpo_batch_rejects_bad_arguments(kw, err):
    with pytest.raises(err):
        make_grpo_batch(**kw)


# ----------------------------------------------------------------------------------------------------
# Losses

def batch64(**kw):
    """A small float64 GRPO batch for the tiny model (vocab 53)."""
    base = dict(num_prompts=2, group_size=3, prompt_len=(5, 9), response_len=(2, 6), shared_response_prefix=1,
                vocab_size=53, seed=1, dtype=torch.float64)
    base.update(kw)
    return make_grpo_batch(**base)


@pytest.mark.parametrize("left_pad", [False, True])
def test_grpo_loss_finite_with_all_grads(left_pad):
    model = model64()
    loss = grpo_loss(model, **batch64(left_pad_prompts=left_pad))
    assert loss.dim() == 0 and loss.dtype == torch.float64 and torch.isfinite(loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, name


def test_grpo_loss_at_ratio_one_is_minus_mean_advantage():
    """With old_logprobs = logp (ratio 1, nothing clipped) the surrogate of each row is A_b, so the loss is
    -mean(A) and its gradient is -mean_b A_b * mean_t grad logp_{b,t} over the row's completion tokens."""
    model = model64()
    batch = batch64()
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["attention_mask"])
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    batch["old_logprobs"] = logp
    loss = grpo_loss(model, **batch)
    assert_close(loss, -batch["advantages"].mean(), **F64)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model(batch["input_ids"], batch["attention_mask"])
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    m = batch["completion_mask"][:, 1:].double()
    (-(batch["advantages"] * (logp * m).sum(1) / m.sum(1)).mean()).backward()
    for n, p in model.named_parameters():
        assert_close(grads[n], p.grad, **F64, msg=n)


def test_grpo_loss_clips():
    """A ratio far above 1 + eps with A > 0 is clipped: that token contributes (1 + eps) A and no gradient."""
    model = model64()
    batch = batch64(num_prompts=1, group_size=2)
    batch["advantages"] = torch.tensor([1.0, -1.0], dtype=torch.float64)
    batch["old_logprobs"] = torch.full_like(batch["old_logprobs"], -100.0)  # ratio = e^(logp + 100) >> 1.2
    loss = grpo_loss(model, **batch, clip_eps=0.2)
    # row 0: min(r A, 1.2 A) = 1.2; row 1: min(-r, -1.2) = -r (huge): the loss is dominated by row 1
    loss.backward()
    assert loss > 1e30
    batch["advantages"] = torch.tensor([1.0, 2.0], dtype=torch.float64)
    model.zero_grad()
    loss = grpo_loss(model, **batch, clip_eps=0.2)
    assert_close(loss, torch.tensor(-1.2 * 1.5, dtype=torch.float64), **F64)
    loss.backward()
    assert all(p.grad is None or p.grad.abs().max() == 0 for p in model.parameters())


def test_grpo_loss_without_mask_equals_with_mask_on_right_padding():
    """Right padding only follows the real tokens, so causal attention alone gives the same loss."""
    model = model64()
    batch = batch64()
    assert_close(grpo_loss(model, **batch, use_attention_mask=False), grpo_loss(model, **batch), **F64)


def test_masked_nll_loss_matches_per_token_loop():
    model = model64()
    batch = batch64()
    ids, mask = batch["input_ids"], batch["completion_mask"]
    loss = masked_nll_loss(model, ids, mask)
    with torch.no_grad():
        logits = model(ids)
    terms = [-torch.log_softmax(logits[b, t], -1)[ids[b, t + 1]]
             for b in range(ids.shape[0]) for t in range(ids.shape[1] - 1) if mask[b, t + 1]]
    assert_close(loss.detach(), torch.stack(terms).mean(), **F64)
    assert math.isclose(float(loss.detach()), math.log(53), rel_tol=0.05)     # small init: near-uniform predictions
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


# ----------------------------------------------------------------------------------------------------
# Demo and benchmark plumbing (eager backends; branch_replay is tested with the backend)

def test_demo_runs_with_eager_backend(capsys):
    status = grpo_demo.main(["--backend", "eager", "--groups", "2", "--group-size", "3", "--prompt-len", "5:9",
                             "--response-len", "3:6", "--shared-response", "2", "--dim", "32", "--layers", "1",
                             "--repeats", "1", "--device", "cpu"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "PASS" in out and "speedup" in out


def test_demo_parse_len():
    assert grpo_demo.parse_len("7") == 7
    assert grpo_demo.parse_len("3:9") == (3, 9) == grpo_demo.parse_len("3,9")


# ----------------------------------------------------------------------------------------------------
# The HF (Qwen2) side of the demo: TRL's layout and loss, and the replay check (eager, no brcompile backend)

def test_completion_width_by_hand():
    """Completions starting at column 3 of L = 7 -> C = 4; a row without a completion is ignored."""
    from examples.hf import completion_width
    cm = torch.tensor([[0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]])
    assert completion_width(cm) == 4
    with pytest.raises(ValueError, match="not one column"):
        completion_width(torch.tensor([[0, 1, 1], [0, 0, 1]]))
    with pytest.raises(ValueError, match="no completion token"):
        completion_width(torch.zeros(2, 5, dtype=torch.long))


def test_trl_grpo_loss_equals_grpo_loss_over_all_logits():
    """The loss from the last C + 1 logits (logits_to_keep) equals grpo_loss over all L positions, and so
    do its gradients: completion_mask and old_logprobs are 0 before the completion columns. A Qwen2 of
    odd sizes (dim 24: 3 heads of 8, 1 KV head, SwiGLU 40, vocab 53), float64, eager."""
    pytest.importorskip("transformers", minversion="5.0")
    from examples.hf import completion_width, qwen2_model, trl_grpo_loss
    config = small_config(n_layers=1)
    model = qwen2_model(config, max_positions=64, seed=3, dtype=torch.float64)
    assert model.config.hidden_size == 24 and model.config.intermediate_size == 40
    assert model.model.layers[0].self_attn.q_proj.bias is not None      # Qwen2's q/k/v biases
    batch = make_grpo_batch(num_prompts=2, group_size=3, prompt_len=(5, 9), response_len=(2, 5), vocab_size=53,
                            left_pad_prompts=True, seed=4, dtype=torch.float64)
    C = completion_width(batch["completion_mask"])
    assert C == int(batch["completion_mask"].sum(1).max())               # the longest completion

    def full_loss():
        return grpo_loss(lambda ids, am: model(input_ids=ids, attention_mask=am).logits, **batch)

    def window_loss():
        return trl_grpo_loss(model, **batch, completion_len=C)

    params = list(model.parameters())
    want = full_loss()
    g_want = torch.autograd.grad(want, params)
    got = window_loss()
    g_got = torch.autograd.grad(got, params)
    assert_close(got, want, **F64)
    for a, b in zip(g_got, g_want):
        assert_close(a, b, **F64)
    with pytest.raises(ValueError, match="completion_len"):
        trl_grpo_loss(model, **batch, completion_len=batch["input_ids"].shape[1])


def test_demo_replay_failure():
    """A run is a replay only with >= 1 replayed call and no fallback; other backends check nothing."""
    import collections
    from brcompile.runtime import Stats
    assert grpo_demo.replay_failure(None) is None
    assert grpo_demo.replay_failure(Stats(replayed_calls=2)) is None
    mixed = Stats(replayed_calls=1, fallback_calls=1, fallback_reasons=collections.Counter({"too small": 1}))
    assert "1 fell back: too small" in grpo_demo.replay_failure(mixed)
    assert "no call reached" in grpo_demo.replay_failure(Stats())


def test_demo_without_transformers(capsys, monkeypatch):
    """--model both skips qwen2 with a note (the GPT run still decides the status); --model qwen2 stops."""
    monkeypatch.setattr(grpo_demo, "transformers_available", lambda: False)
    argv = ["--backend", "eager", "--groups", "2", "--group-size", "3", "--prompt-len", "5:9", "--response-len", "3:6",
            "--dim", "32", "--layers", "1", "--repeats", "1", "--device", "cpu"]
    assert grpo_demo.main(argv) == 0
    out = capsys.readouterr().out
    assert "== qwen2: skipped, transformers is not installed" in out and out.count("PASS") == 1, out
    with pytest.raises(SystemExit, match="needs transformers"):
        grpo_demo.main(["--model", "qwen2", *argv])
