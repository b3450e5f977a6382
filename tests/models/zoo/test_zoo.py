"""The zoo: small decoder LMs in the spelling of well-known public codebases (``tests/models/zoo/models.py``),
compiled unchanged with ``branch_replay``.

Each replaying style must give the eager loss and every parameter gradient to 1e-10 relative error in
float64 on a GRPO batch with shared prompts, with ``brcompile.stats()`` showing that the rewrite ran and
shared tokens (executed < logical). Styles that need tree-attention features that do not exist (ALiBi,
attention sinks) must fall back with a reason that names the construct.
"""
import pytest
import torch

import brcompile
from brcompile.testing import assert_exact
from examples.grpo import grpo_loss, make_grpo_batch
from tests.models.zoo import models

BACKEND = brcompile.backend(compiler="eager")
BATCH = dict(num_prompts=2, group_size=3, prompt_len=(6, 9), response_len=(2, 5), vocab_size=models.VOCAB,
             seed=1, dtype=torch.float64)


def grpo_args(model, batch):
    return (batch["input_ids"], batch["attention_mask"], batch["completion_mask"], batch["advantages"],
            batch["old_logprobs"], 0.2, model.uses_mask)


def run(model):
    batch = make_grpo_batch(**BATCH)
    args = grpo_args(model, batch)
    params = [p for p in model.parameters() if p.requires_grad]
    ref = grpo_loss(model, *args)
    gref = torch.autograd.grad(ref, params)
    out = torch.compile(grpo_loss, backend=BACKEND)(model, *args)
    gout = torch.autograd.grad(out, params)
    return ref, gref, out, gout


@pytest.mark.parametrize("style", sorted(models.REPLAY))
def test_zoo_replays_exactly(style):
    model = models.make(models.REPLAY[style])
    ref, gref, out, gout = run(model)
    s = brcompile.stats()
    assert s.replayed_calls >= 1 and s.fallback_calls == 0, f"{style}: {s}"
    assert s.executed_tokens < s.logical_tokens, str(s)
    assert_exact(out.detach(), ref.detach(), torch.float64, "loss")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, a, b in zip(names, gout, gref):
        assert_exact(a, b, torch.float64, f"grad of {name}")


@pytest.mark.parametrize("style", sorted(models.FALLBACK))
def test_zoo_falls_back_with_reason(style):
    cls, phrase = models.FALLBACK[style]
    model = models.make(cls)
    ref, gref, out, gout = run(model)
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls >= 1, str(s)
    reasons = " | ".join(s.fallback_reasons)
    assert phrase in reasons, reasons
    assert_exact(out.detach(), ref.detach(), torch.float64, "loss")
    for a, b in zip(gout, gref):
        assert_exact(a, b, torch.float64, "grad")
