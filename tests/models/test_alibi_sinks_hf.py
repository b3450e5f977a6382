"""HF models with ALiBi biases and attention sinks replay through tree attention's ``alibi`` / ``sinks``.

Tiny models built from configs (no downloads), eager attention, a batch with shared prefixes and key padding.
MPT adds a per-head ALiBi table to the scores and casts them with ``.float()``: float32 (in float64 its softmax
would round to float32, which tree attention does not reproduce), held to the float32 bound. GPT-OSS joins one
learned sink logit per head to the softmax; its mixture-of-experts MLP updates a value in place (refused by
the analysis, not by the attention), so the test swaps it for a dense MLP to check the attention as HF writes
it; its float32 RMSNorm keeps it at the float32 bound. BLOOM computes attention on [B*H, L, D] views
(``alibi.baddbmm(q3, k3^T)``, ``bmm(probs3, v3)``) with its ALiBi counted over the attention mask (``cumsum - 1``)
and a float32 softmax (float32, like MPT); its GELU is a custom autograd Function (no token-axis rule), swapped for
the same math in plain ops.
"""
import pytest
import torch

import brcompile
from brcompile.testing import TOLERANCE
from tests.helpers import shared_prefix_ids

transformers = pytest.importorskip("transformers")
TOL = TOLERANCE[torch.float32]


def _ids():
    ids = shared_prefix_ids(64, 12)
    am = torch.ones_like(ids)
    am[2, -2:] = 0
    return ids, am


def _loss(m, ids, am):
    return m(input_ids=ids, attention_mask=am, use_cache=False).logits.log_softmax(-1).sum()


def _check(m, feature, dynamic=None, mode="packed"):
    """Loss and every parameter gradient vs eager (float32 bound); the call replayed (streamed with
    ``mode="replay"``: chunks of 3 tail tokens against the cached prefix) and its packed attention used
    ``feature``."""
    ids, am = _ids()
    want = torch.compile(_loss, backend="eager")(m, ids, am)
    want.backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    torch._dynamo.reset()
    brcompile.reset_stats()
    be = brcompile.backend(compiler="eager", mode=mode, chunk_tokens=3)
    got = torch.compile(_loss, backend=be, dynamic=dynamic)(m, ids, am)
    got.backward()
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.fallback_calls == 0, str(s)
    assert s.streamed_calls == (mode == "replay"), (str(s), be.records[-1].replay_reason)
    assert s.executed_tokens < s.logical_tokens, str(s)
    assert feature(be.records[-1]), be.records[-1].packed_code
    assert (got - want).abs().item() <= TOL * want.abs().item()
    for n, p in m.named_parameters():
        g = grads[n]
        assert p.grad is not None, n
        err = (p.grad - g).abs().max().item() / max(g.abs().max().item(), 1e-30)
        assert err <= TOL, (n, err)


@pytest.mark.parametrize("mode", ["packed", "replay"])
def test_mpt_alibi_replays(mode):
    cfg = transformers.AutoConfig.for_model("mpt", vocab_size=64, d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
                                            expansion_ratio=2)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    _check(m, lambda r: all("+alibi(" in x for x in r.masks) and "[0.25, 0.0625, 0.015625, 0.00390625]" in r.packed_code,
           mode=mode)


class _DenseMLP(torch.nn.Module):
    """A dense MLP with GPT-OSS's MLP interface (hidden states, router scores)."""

    def __init__(self, d):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 48), torch.nn.Linear(48, d)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x))), None


@pytest.mark.parametrize("mode", ["packed", "replay"])
def test_gpt_oss_sinks_replay(mode):
    cfg = transformers.AutoConfig.for_model(
        "gpt_oss", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=128)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.sinks.normal_()
            layer.mlp = _DenseMLP(32)
    _check(m, lambda r: "sinks_)" in r.packed_code and any("window(4)" in x for x in r.masks), mode=mode)


class _BloomGelu(torch.nn.Module):
    """BLOOM's tanh GELU in plain ops (HF's ``BloomGelu`` wraps the same forward in an autograd Function)."""

    def forward(self, x):
        return transformers.models.bloom.modeling_bloom.bloom_gelu_forward(x)


@pytest.mark.parametrize("dynamic,mode", [(None, "packed"), (True, "packed"), (None, "replay")],
                         ids=["static", "dynamic", "streamed"])
def test_bloom_3d_alibi_replays(dynamic, mode):
    """Under dynamic=True baddbmm's alpha and beta are scalar inputs: specialised under a guard. Streamed, the
    ALiBi positions (the attention mask's running count at each token, not the tree's positions; one count per layer
    as HF computes it) are cached by the prefix graph, and the chunks' cross pairs read the cached keys' counts."""
    cfg = transformers.AutoConfig.for_model("bloom", vocab_size=64, hidden_size=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    for block in m.transformer.h:
        block.mlp.gelu_impl = _BloomGelu()
    _check(m, lambda r: all("+alibi(" in x for x in r.masks) and "count" in " ".join(r.masks)
           and "[0.25, 0.0625, 0.015625, 0.00390625]" in r.packed_code
           and (mode == "packed" or len(r.replay["cached_positions"]) == 2), dynamic, mode)
