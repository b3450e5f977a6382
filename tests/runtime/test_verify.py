"""Options.verify: the first replayed call of a graph is compared with the original graph; a packed graph
that disagrees makes that call and every later one run the original, with both values in the reason."""
import dataclasses

import pytest
import torch

import brcompile
from brcompile.backends.attention.op import get_attention_impl, register_attention_impl
from brcompile.testing import assert_exact
from examples.gpt import GPT, GPTConfig
from examples.grpo import grpo_loss, make_grpo_batch

CFG = dict(vocab_size=41, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48)


def setup():
    model = GPT(GPTConfig(**CFG), seed=0).double()
    batch = make_grpo_batch(num_prompts=2, group_size=3, prompt_len=(5, 8), response_len=(2, 5), vocab_size=41,
                            seed=1, dtype=torch.float64)
    return model, batch


def test_verify_passes_and_replays():
    model, batch = setup()
    want = grpo_loss(model, **batch)
    backend = brcompile.backend(compiler="eager", attention="reference", verify=True)
    step = torch.compile(grpo_loss, backend=backend)
    for _ in range(2):
        assert_exact(step(model, **batch), want, torch.float64, "loss")
    s = brcompile.stats()
    assert s.replayed_calls == 2 and s.fallback_calls == 0, str(s)


@pytest.fixture
def reference_off_by_a_little():
    """The "reference" attention impl replaced by one whose output is 1e-6 too large; restored after."""
    real = get_attention_impl("reference", torch.device("cpu"))

    def off(*a, **k):
        out, lse = real.forward(*a, **k)
        return out * (1 + 1e-6), lse

    register_attention_impl(dataclasses.replace(real, forward=off), override=True)
    yield
    register_attention_impl(real, override=True)


def test_verify_catches_a_wrong_packed_graph(reference_off_by_a_little):
    """A tree-attention impl that is off by a little (a stand-in for a rewrite bug): the first call runs the
    original graph, says by how much the losses differ, and so does every later call."""
    model, batch = setup()
    want = grpo_loss(model, **batch)
    backend = brcompile.backend(compiler="eager", attention="reference", verify=True)
    step = torch.compile(grpo_loss, backend=backend)
    for _ in range(2):
        assert_exact(step(model, **batch), want, torch.float64, "loss")  # the original graph ran
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls == 2, str(s)
    assert s.fallback_codes == {brcompile.Code.VERIFY_FAILED: 2}, str(s)
    (reason,) = s.fallback_reasons
    assert "original" in reason and "packed" in reason and "bound 1e-10" in reason, reason  # both values, the bound
