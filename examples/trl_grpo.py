"""TRL's ``GRPOTrainer``, unmodified, with the policy's transformer compiled by ``branch_replay``.

A tiny random Qwen2 (``transformers.Qwen2Config``), a character-level tokenizer built offline (a
``tokenizers`` BPE model without merges, wrapped in ``PreTrainedTokenizerFast``), an in-memory prompt
dataset and a rule-based reward; a few GRPO steps on CPU. No TRL code is patched.

How to switch it on: one line, the trainer's code unchanged::

    trainer = GRPOTrainer(model=model, args=GRPOConfig(...), ..., callbacks=[brcompile.BranchReplayCallback()])

The callback compiles the policy's decoder in place when training begins (``brcompile.compile_decoder(model)``,
which can also be called by hand before building the trainer: ``model.model.compile(backend="branch_replay")``
plus the hook fix below). ``GRPOConfig(torch_compile=True, torch_compile_backend="branch_replay")`` does not
work: transformers hands the name to accelerate's ``TorchDynamoPlugin``, which accepts only the members of its
``DynamoBackend`` enum (``ValueError: 'BRANCH_REPLAY' is not a valid DynamoBackend``).

Every call of the decoder goes through the backend: the training forward (the group's rollouts share their
prompt; prompts are left-padded, completions right-padded) and the prefill of ``generate`` (each prompt
repeated ``num_generations`` times) replay; the decode steps of ``generate`` (one new token per row against
the KV cache) have nothing to share and run as they are, counted in ``stats().unshared_calls``, not as
fallbacks (passes/analysis/decode.py). ``stats().fallback_calls`` stays 0.

- Gradient checkpointing: TRL's default (``gradient_checkpointing=True``) works, and so does ``False``. The
  decoder layers run inside ``torch.utils.checkpoint``; the backend inlines and rewrites their bodies. TRL
  turns checkpointing off around every generation and on again after it, and transformers registers one more
  forward hook on the input embedding at every ``gradient_checkpointing_enable``: Dynamo guards on the hook
  count, so the decoder would recompile every step and, past ``torch._dynamo.config.recompile_limit``, run
  eagerly without notice. ``compile_decoder`` makes ``enable_input_require_grads`` replace its hook instead
  (``brcompile.integrations.keep_one_input_grad_hook``; the hook only sets ``requires_grad``), so the graphs
  settle after the first step.
- Precision. HF's ``Qwen2RMSNorm`` computes in float32 even in a float64 model, so a float64 run is
  exact to float32 rounding (~1e-7 relative here; 1e-16 with a float64 norm), and the comparison uses the
  float32 tolerance 1e-5.

Run: ``python examples/trl_grpo.py [--steps 3] [--num-iterations 1] [--no-gradient-checkpointing]``: trains
twice from the same seeds (eager, then branch_replay), prints per-step losses and gradient errors, the
parameters' error after training and ``brcompile.stats()``; exit 1 on FAIL (or on any fallback). Needs
``pip install trl`` (1.16 tested).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import tempfile
from typing import Any, Optional

import torch

log = logging.getLogger(__name__)

__all__ = ["ALPHABET", "PROMPTS", "CallInfo", "RunResult", "char_tokenizer", "tiny_qwen2", "prompt_dataset",
           "letter_a_reward", "train", "compare_runs", "main"]

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,"
# prompts of different lengths (TRL left-pads them); 2 per step with per_device_train_batch_size=8 and 4 generations
PROMPTS = ["abc", "hello wor", "the quick brown", "xyz", "once upon a", "to be or", "lorem ipsum d", "a b c d"]
TOL = 1e-5  # float32: HF's RMSNorm computes in float32 (module docstring)


def char_tokenizer(alphabet: str = ALPHABET):
    """A character-level fast tokenizer built offline: ids 0 = ``<pad>``, 1 = ``<eos>``, then one id per
    character of ``alphabet`` (a BPE model with no merges splits text into characters)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def tiny_qwen2(vocab_size: int, *, seed: int = 0, dtype: torch.dtype = torch.float64, hidden_size: int = 32,
               layers: int = 2):
    """A random ``Qwen2ForCausalLM`` (SDPA attention, GQA 4 heads / 2 kv heads), seeded, in ``dtype``."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=48,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=None,
                      attn_implementation="sdpa")
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).to(dtype)


def prompt_dataset(prompts=PROMPTS):
    """An in-memory ``datasets.Dataset`` with a ``prompt`` column (TRL's standard, non-conversational format)."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": list(prompts)})


def letter_a_reward(completions, **kwargs) -> list[float]:
    """Reward: the number of ``a`` characters in the completion."""
    return [float(c.count("a")) for c in completions]


@dataclasses.dataclass(frozen=True)
class CallInfo:
    """One call of a graph the backend rewrote."""

    replayed: bool  # the packed graph ran (else the original, for ``reason``)
    grad: bool  # compiled for grad mode on: the training forward (off: generation, old log-probs)
    rows: int  # rows of the batch (0 when no tree was built)
    reason: Optional[str]
    logical: int = 0  # the call's logical tokens (0 when no tree was built)
    executed: int = 0  # ... and the tokens its tree executes (replayed from a window's earlier call included)


@dataclasses.dataclass
class RunResult:
    """What one training run produced."""

    losses: list[float]  # the logged training loss of every step
    grads: list[dict[str, torch.Tensor]]  # every parameter's gradient at every optimizer step
    params: dict[str, torch.Tensor]  # parameters after training
    stats: Any  # brcompile.stats() after training (None for the eager run)
    calls: list["CallInfo"]  # every call of a rewritten graph, in order per graph (empty for the eager run)

    def training_replays(self) -> int:
        """Replayed calls that ran with gradients: the training forwards."""
        return sum(1 for c in self.calls if c.replayed and c.grad)


def train(backend=None, *, steps: int = 3, seed: int = 0, num_generations: int = 4, prompts_per_step: int = 2,
          max_completion_length: int = 6, num_iterations: int = 1, learning_rate: float = 0.05,
          dtype: torch.dtype = torch.float64, gradient_checkpointing: bool = True,
          per_device_train_batch_size: Optional[int] = None, gradient_accumulation_steps: int = 1,
          windows: bool = True) -> RunResult:
    """Runs ``GRPOTrainer`` for ``steps`` optimizer steps (plain SGD, so parameter changes are gradient
    differences, not Adam's normalised ones) and records losses, gradients (a ``TrainerCallback`` at
    ``on_pre_optimizer_step``), parameters and, per backend call, whether it replayed and whether it ran
    with gradients (the training forward) or without (generation).

    ``backend``: None (eager) or a ``brcompile.BranchReplayBackend`` (``brcompile.backend(...)``), applied
    by ``brcompile.BranchReplayCallback(backend)`` among the trainer's callbacks (the decoder compiled in place
    when training begins). ``gradient_checkpointing``: GRPOConfig's (TRL's default, True, or False).
    ``per_device_train_batch_size`` (default: one step's rows, ``prompts_per_step * num_generations``) and
    ``gradient_accumulation_steps``: GRPOConfig's; a step's micro-batches hold that many shuffled rows each, and
    with ``windows`` they are one cross-call window (``BranchReplayCallback(windows=...)``)."""
    import brcompile
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch._dynamo.reset()
    brcompile.reset_stats()
    tokenizer = char_tokenizer()
    model = tiny_qwen2(len(tokenizer), seed=seed, dtype=dtype)
    grad_modes: list[bool] = []  # grad mode of every graph the backend compiles (Dynamo guards on it)

    def recording_backend(gm, example_inputs):
        grad_modes.append(torch.is_grad_enabled())
        return backend(gm, example_inputs)

    callbacks = [] if backend is None else [brcompile.BranchReplayCallback(recording_backend, windows=windows)]
    grads: list[dict[str, torch.Tensor]] = []

    class GradSnapshot(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, gradient_accumulation_steps=gradient_accumulation_steps,
            per_device_train_batch_size=per_device_train_batch_size or prompts_per_step * num_generations,
            num_generations=num_generations, max_completion_length=max_completion_length, max_steps=steps,
            num_iterations=num_iterations, learning_rate=learning_rate, optim="sgd", lr_scheduler_type="constant",
            gradient_checkpointing=gradient_checkpointing, bf16=False, use_cpu=True, seed=seed, logging_steps=1, report_to=[],
            save_strategy="no", disable_tqdm=True)
        trainer = GRPOTrainer(model=model, reward_funcs=letter_a_reward, args=args, train_dataset=prompt_dataset(),
                              processing_class=tokenizer, callbacks=[*callbacks, GradSnapshot()])
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    calls = []
    if backend is not None:
        for rec, grad in zip(backend.records, grad_modes):
            for c in getattr(rec.runtime, "calls", ()):
                t = c.tree_stats or {}
                calls.append(CallInfo(c.replayed, grad, t.get("rows", 0), c.reason or rec.reason,
                                      t.get("logical_tokens", 0), t.get("executed_tokens", 0)))
    return RunResult(losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()},
                     brcompile.stats() if backend is not None else None, calls)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b|."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def compare_runs(got: RunResult, want: RunResult) -> dict[str, Any]:
    """Errors of ``got`` against ``want``: per-step loss error (relative to max(|loss|, 1): GRPO losses are
    often ~0), per-step largest relative gradient error, and the largest relative parameter error."""
    if len(got.losses) != len(want.losses) or len(got.grads) != len(want.grads):
        raise AssertionError(f"runs differ in length: {len(got.losses)}/{len(want.losses)} losses, "
                             f"{len(got.grads)}/{len(want.grads)} gradient snapshots")
    return {
        "loss": [abs(a - b) / max(abs(b), 1.0) for a, b in zip(got.losses, want.losses)],
        "grads": [max(_rel(g[n], w[n]) for n in w) for g, w in zip(got.grads, want.grads)],
        "params": max(_rel(got.params[n], want.params[n]) for n in want.params),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--num-iterations", type=int, default=1)
    p.add_argument("--compiler", choices=["inductor", "aot_eager", "eager"], default="aot_eager")
    p.add_argument("--no-gradient-checkpointing", action="store_true", help="GRPOConfig(gradient_checkpointing="
                   "False); TRL's default is True")
    a = p.parse_args(argv)
    import brcompile

    gc = not a.no_gradient_checkpointing
    want = train(None, steps=a.steps, num_iterations=a.num_iterations, gradient_checkpointing=gc)
    backend = brcompile.backend(compiler=a.compiler)
    got = train(backend, steps=a.steps, num_iterations=a.num_iterations, gradient_checkpointing=gc)
    err = compare_runs(got, want)
    training = got.training_replays()
    ok = (max(err["loss"] + err["grads"] + [err["params"]]) <= TOL and training == a.steps
          and got.stats.fallback_calls == 0)
    for i, (l0, l1) in enumerate(zip(want.losses, got.losses)):
        print(f"step {i + 1}: loss eager {l0:.12g}  branch_replay {l1:.12g}  max rel grad err {err['grads'][i]:.2e}")
    verdict = "PASS" if ok else "FAIL"
    print(f"parameters after {a.steps} steps: max rel err {err['params']:.2e}  {verdict} (tol {TOL:.0e})")
    print(f"replayed training forwards: {training}; replayed no-grad calls (generation prefill, old log-probs): "
          f"{sum(1 for c in got.calls if c.replayed and not c.grad)}; decode steps (nothing to share): "
          f"{got.stats.unshared_calls}")
    print(got.stats)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
