"""Trainers on ``branch_replay`` unchanged: DPO (policy + frozen reference), PPO (actor-critic with a value head,
GAE), and TRL's ``GRPOTrainer`` on a tiny random Qwen2.

The oracle is the same code run eagerly. Each test compares the loss and every parameter gradient (and for
PPO the rollout quantities), and asserts through ``brcompile.stats()`` or the backend's call records that the
rewrite actually ran, so a silent fallback cannot pass.
"""
import copy

import pytest
import torch

import brcompile
from brcompile.testing import TOLERANCE, assert_exact, rel_err
from examples import dpo, ppo
from examples.gpt import GPTConfig, GPT
from tests.helpers import assert_replayed

TOL = TOLERANCE  # the contract's bound per dtype (brcompile.testing)
BACKEND_OPTIONS = dict(compiler="aot_eager")  # no Inductor codegen: fast on 2 CPU cores






def tiny_config(**kw) -> GPTConfig:
    cfg = dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48)
    cfg.update(kw)
    return GPTConfig(**cfg)


# ------------------------------------------------------------------------------------------------ DPO


DPO_BATCHES = {
    "ragged": dict(num_pairs=3, prompt_len=(5, 11), response_len=(2, 6)),
    "shared_response": dict(num_pairs=2, prompt_len=(4, 8), response_len=(4, 7), shared_response_prefix=2),
}


@pytest.mark.parametrize("compiled_part,batch_name", [("logprobs_fn", "ragged"), ("whole_step", "shared_response")])
def test_dpo_exact_float64(compiled_part, batch_name):
    """Policy and frozen reference both through branch_replay: the per-sequence log-prob function compiled
    (one call per model; the reference's under no_grad), or the whole DPO step as one graph holding both."""
    policy = GPT(tiny_config(), seed=0).double()
    reference = dpo.make_reference(policy, seed=1)
    batch = dpo.make_dpo_batch(vocab_size=61, seed=2, **DPO_BATCHES[batch_name])
    params = list(policy.parameters())
    ref_loss = dpo.dpo_step(policy, reference, batch, beta=0.5)
    ref_grads = torch.autograd.grad(ref_loss, params)

    backend = brcompile.backend(**BACKEND_OPTIONS)
    if compiled_part == "logprobs_fn":
        loss = dpo.dpo_step(policy, reference, batch, torch.compile(dpo.sequence_logprobs, backend=backend), beta=0.5)
    else:
        loss = torch.compile(dpo.dpo_step, backend=backend)(policy, reference, batch, beta=0.5)
    grads = torch.autograd.grad(loss, params)

    assert_exact(loss.detach(), ref_loss.detach(), torch.float64, "DPO loss")
    for (name, _), a, b in zip(policy.named_parameters(), grads, ref_grads):
        assert_exact(a, b, torch.float64, f"grad of {name}")
    assert all(p.grad is None for p in reference.parameters())
    assert_replayed(2 if compiled_part == "logprobs_fn" else 1)


def test_dpo_batch_layout():
    """Chosen rows first, then rejected; row p and row P + p share their prompt and nothing after it."""
    batch = dpo.make_dpo_batch(num_pairs=3, prompt_len=(4, 7), response_len=(3, 5), vocab_size=61, seed=3)
    ids, am, cm = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    P = 3
    for p in range(P):
        c, r = p, P + p
        prompt_c = ids[c][(am[c] == 1) & (cm[c] == 0)]
        prompt_r = ids[r][(am[r] == 1) & (cm[r] == 0)]
        torch.testing.assert_close(prompt_c, prompt_r)
        assert not torch.equal(ids[c][cm[c] == 1], ids[r][cm[r] == 1])


def test_dpo_loss_formula():
    """``dpo_loss`` is -mean log sigmoid(beta ((pc - rc) - (pr - rr))), checked at hand-picked values."""
    pc, pr = torch.tensor([-3.0, -5.0], dtype=torch.float64), torch.tensor([-4.0, -2.0], dtype=torch.float64)
    rc, rr = torch.tensor([-3.5, -5.0], dtype=torch.float64), torch.tensor([-3.5, -2.5], dtype=torch.float64)
    h = torch.tensor([1.0, -0.5], dtype=torch.float64)
    want = -torch.log(torch.sigmoid(0.2 * h)).mean()
    torch.testing.assert_close(dpo.dpo_loss(pc, pr, rc, rr, beta=0.2), want)


# ------------------------------------------------------------------------------------------------ PPO


def gae_per_row(rewards, values, mask, gamma, lam):
    """The textbook GAE, one row at a time over that row's action positions (the oracle for ``ppo.gae``)."""
    adv = torch.zeros_like(values)
    for b in range(values.shape[0]):
        ts = mask[b].nonzero().flatten().tolist()
        running = 0.0
        for i in reversed(range(len(ts))):
            t = ts[i]
            next_v = values[b, ts[i + 1]] if i + 1 < len(ts) else 0.0
            delta = rewards[b, t] + gamma * next_v - values[b, t]
            running = delta + gamma * lam * running
            adv[b, t] = running
    return adv, (adv + values) * mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.7)])
def test_gae_matches_per_row_recursion(gamma, lam):
    g = torch.Generator().manual_seed(4)
    lengths, starts = [3, 1, 5, 4], [2, 6, 0, 3]
    T = 9
    mask = torch.zeros(4, T, dtype=torch.long)
    for b, (s, n) in enumerate(zip(starts, lengths)):
        mask[b, s:s + n] = 1
    values = torch.randn(4, T, generator=g, dtype=torch.float64)
    cm = torch.cat([torch.zeros(4, 1, dtype=torch.long), mask], dim=1)  # completion mask: actions are cm[:, 1:]
    rewards = ppo.terminal_rewards(cm, torch.randn(4, generator=g, dtype=torch.float64))
    assert (rewards != 0).sum(1).tolist() == [1, 1, 1, 1]
    adv, ret = ppo.gae(rewards, values, mask, gamma, lam)
    want_adv, want_ret = gae_per_row(rewards, values, mask.to(values.dtype), gamma, lam)
    torch.testing.assert_close(adv, want_adv)
    torch.testing.assert_close(ret, want_ret)


@pytest.mark.parametrize("dtype,tie", [(torch.float64, False), (torch.float32, True)], ids=["float64", "float32_tied"])
def test_ppo_actor_critic_exact(dtype, tie):
    """Rollout by the old policy (compiled model, no_grad) and the PPO loss of a moved policy (compiled: both
    heads, ratio and value clipping live, entropy) equal the eager run; both calls replay."""
    from examples.grpo import make_grpo_batch

    old = ppo.ActorCritic(tiny_config(tie_embeddings=tie), seed=0).to(dtype).requires_grad_(False)
    model = copy.deepcopy(old).requires_grad_(True)
    with torch.no_grad():  # the policy after some updates: ratios away from 1, values away from the rollout's
        g = torch.Generator().manual_seed(7)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype))
    batch = make_grpo_batch(num_prompts=2, group_size=3, prompt_len=(5, 9), response_len=(3, 6),
                            shared_response_prefix=1, vocab_size=61, seed=5, dtype=dtype)
    scores = torch.randn(6, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    params = list(model.parameters())
    ref_args = ppo.ppo_args(old, batch, scores, gamma=0.99, lam=0.9)
    ref_loss = ppo.ppo_loss(model, *ref_args, clip_eps=0.1, value_clip=0.05)
    ref_grads = torch.autograd.grad(ref_loss, params)

    backend = brcompile.backend(**BACKEND_OPTIONS)
    args = ppo.ppo_args(torch.compile(old, backend=backend), batch, scores, gamma=0.99, lam=0.9)
    real = batch["attention_mask"][:, :-1].bool()  # the rollout's padding left the tree (drop_padding): 0 there
    for name, a, b in zip(("old_logprobs", "old_values", "advantages", "returns"), args[3:], ref_args[3:]):
        if name.startswith("old_"):
            a, b = a[real], b[real]
        assert_exact(a, b, dtype, name)
    loss = torch.compile(ppo.ppo_loss, backend=backend)(model, *args, clip_eps=0.1, value_clip=0.05)
    grads = torch.autograd.grad(loss, params)
    assert_exact(loss.detach(), ref_loss.detach(), dtype, "PPO loss")
    for (name, _), a, b in zip(model.named_parameters(), grads, ref_grads):
        assert_exact(a, b, dtype, f"grad of {name}")
    assert_replayed(2)


def test_examples_run_as_scripts(capsys):
    """``examples/dpo.py`` and ``examples/ppo.py`` end to end at small sizes: PASS and exit code 0."""
    small = ["--dim", "32", "--layers", "1", "--prompt-len", "6", "10", "--response-len", "2", "5",
             "--compiler", "eager"]
    assert dpo.main(["--pairs", "2", *small]) == 0
    assert "PASS" in capsys.readouterr().out
    torch._dynamo.reset()
    assert ppo.main(["--prompts", "2", "--samples", "3", *small]) == 0
    assert "PASS" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ TRL


@pytest.mark.parametrize("gradient_checkpointing", [True, False], ids=["checkpointing", "no_checkpointing"])
def test_trl_grpo_trainer_one_line(gradient_checkpointing):
    """TRL's GRPOTrainer, unpatched, switched on by one line: ``callbacks=[brcompile.BranchReplayCallback(...)]``
    (the decoder compiled when training begins), with TRL's default gradient checkpointing on, and off. Three
    steps, each generating (prefill and decode steps) and training: every training forward and generation
    prefill replays, the decode steps are unshared calls (one token per row against the KV cache), and nothing
    falls back. With checkpointing, TRL toggles it around every generation; the training forward of every step
    still replays (no recompile per step runs into Dynamo's recompile limit, which would run the decoder
    eagerly)."""
    from examples import trl_grpo  # needs trl (the `trainers` extra): a missing install fails, never skips

    steps = 3
    got = trl_grpo.train(brcompile.backend(**BACKEND_OPTIONS), steps=steps,
                         gradient_checkpointing=gradient_checkpointing)
    s = got.stats
    assert s.fallback_calls == 0 and s.replayed_calls > 0 and s.unshared_calls > 0, str(s)
    assert set(s.unshared_codes) == {brcompile.Code.DECODE_STEP}, str(s)
    training = [c for c in got.calls if c.grad]
    assert len(training) == steps and all(c.replayed for c in training), got.calls
    prefills = [c for c in got.calls if c.replayed and not c.grad]
    assert len(prefills) == steps, got.calls  # one generation per step (num_iterations=1)
    assert s.replayed_calls == 2 * steps and s.executed_tokens < s.logical_tokens, str(s)


@pytest.mark.slow
@pytest.mark.parametrize("gradient_checkpointing", [True, False], ids=["checkpointing", "no_checkpointing"])
def test_trl_grpo_trainer_matches_eager(gradient_checkpointing):
    """TRL's GRPOTrainer, unpatched, on a tiny random Qwen2 with a character tokenizer: the decoder compiled by
    branch_replay (``BranchReplayCallback``), gradient checkpointing on (TRL's default) and off. Three SGD steps
    with two policy iterations per generation (the second iteration's ratio differs from 1, so clipping is
    live): every step's loss and gradients, and the final parameters, equal the eager run's; every training
    forward replayed; nothing fell back.

    Tolerance: HF's Qwen2RMSNorm computes in float32 even in a float64 model, so the float64 run is exact to
    float32 rounding only (measured ~3e-7); the contract's float32 bound 1e-5 applies."""
    from examples import trl_grpo  # needs trl (the `trainers` extra): a missing install fails, never skips

    steps = 3
    want = trl_grpo.train(None, steps=steps, num_iterations=2, gradient_checkpointing=gradient_checkpointing)
    got = trl_grpo.train(brcompile.backend(**BACKEND_OPTIONS), steps=steps, num_iterations=2,
                         gradient_checkpointing=gradient_checkpointing)
    err = trl_grpo.compare_runs(got, want)
    assert len(got.grads) == steps
    assert max(err["loss"]) <= trl_grpo.TOL, err
    assert max(err["grads"]) <= trl_grpo.TOL, err
    assert err["params"] <= trl_grpo.TOL, err
    # the parameters moved: the comparison is not between two untrained models
    initial = trl_grpo.tiny_qwen2(len(trl_grpo.char_tokenizer()), seed=0).state_dict()
    assert max(rel_err(got.params[n], initial[n]) for n in got.params) > 1e-4

    training = [c for c in got.calls if c.grad]
    assert len(training) == steps and all(c.replayed for c in training), training
    no_grad_replays = [c for c in got.calls if c.replayed and not c.grad]
    assert len(no_grad_replays) >= 2, got.calls  # generation prefills (and old log-probs) replay too
    s = got.stats
    assert s.replayed_calls == len(training) + len(no_grad_replays), str(s)
    assert s.fallback_calls == 0 and s.unshared_calls > 0, str(s)
    assert s.executed_tokens < s.logical_tokens, str(s)


@pytest.mark.parametrize("per_device,accumulation,gradient_checkpointing", [
    (2, 4, True), pytest.param(1, 8, False, marks=pytest.mark.slow)], ids=["2x4_checkpointing", "1x8"])
def test_trl_grpo_gradient_accumulation_is_one_window_per_step(per_device, accumulation, gradient_checkpointing):
    """TRL's GRPOTrainer with gradient accumulation: each step's generation batch (2 prompts x 4 completions)
    shuffled into micro-batches of ``per_device`` rows. ``BranchReplayCallback`` makes each optimizer step a
    cross-call window (ended by accelerate's ``sync_gradients``): every training call runs through it, prompt
    tokens are replayed from earlier micro-batches, and the losses, every step's gradients and the final
    parameters equal the eager run's (float32 bound: HF's RMSNorm computes in float32). With TRL's default
    gradient checkpointing the training graph's trunk recomputes its pieces in backward (its record says so)."""
    from examples import trl_grpo

    steps = 2
    kw = dict(steps=steps, per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
              gradient_checkpointing=gradient_checkpointing)
    want = trl_grpo.train(None, **kw)
    backend = brcompile.backend(mode="replay", **BACKEND_OPTIONS)
    got = trl_grpo.train(backend, **kw)
    err = trl_grpo.compare_runs(got, want)
    assert max(err["loss"] + err["grads"] + [err["params"]]) <= trl_grpo.TOL, err
    s = got.stats
    assert s.fallback_calls == 0, str(s)
    assert s.windows == steps and s.window_calls == steps * accumulation, str(s)
    assert s.window_replayed_tokens > 0 and s.computed_tokens < s.executed_tokens, str(s)
    replays = [r.replay for r in backend.records if r.replay is not None]
    assert replays and all(r["window"] == "shares across calls" for r in replays)
    # TRL turns checkpointing off around generation: only the training graph's trunk recomputes
    assert any(r["recompute"] is not None for r in replays) == gradient_checkpointing, replays
