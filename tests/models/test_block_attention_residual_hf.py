"""HF Inkling2's block-attention residual replays as a per-token SDPA (passes/analysis/rules/attention.py
``per_token_attention``).

Inkling2 (and Inkling2-Loop) feeds each layer's attention and MLP a learned mix of the token's block outputs: a
learned query, expanded over (B, L), attends over each token's own stack of block states ([B, L, S, D], the
stack the attention's sequence dim, no mask, not causal). The token dims are batch dims of that attention: it is a
per-token op and stays one SDPA on the packed operands, beside the tree attentions of the model's own layers.

A whole tiny Inkling2ForCausalLM / Inkling2LoopForCausalLM (2 layers, one block per layer so the stacks grow, 4
experts run by ``batched_mm`` since ``grouped_mm`` has no float64), float64 with HF's float32 casts kept in
float64 (KeepFloat64): the loss and every parameter gradient equal eager's within 1e-10, the call replays, and the
packed code holds the depth attentions as SDPA calls next to the tree attentions.
"""
import re

import pytest
import torch

import brcompile
from brcompile.testing import assert_exact
from tests.helpers import KeepFloat64, assert_grads_exact

transformers = pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("transformers.models.inkling2.modeling_inkling2")
pytest.importorskip("transformers.models.inkling2_loop.modeling_inkling2_loop")

V = 11


def _model(model_type, class_name):
    cfg = transformers.AutoConfig.for_model(
        model_type, vocab_size=V, hidden_size=32, num_hidden_layers=2, layer_types=["hybrid_sliding", "hybrid"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, swa_num_attention_heads=4,
        swa_num_key_value_heads=2, swa_head_dim=8, d_rel=4, rel_extent=3, sliding_window_size=4,
        n_routed_experts=4, num_experts_per_tok=2, n_layers_per_attn_res_block=1)
    torch.manual_seed(0)
    model = getattr(transformers, class_name)._from_config(cfg, attn_implementation="eager",
                                                           experts_implementation="batched_mm")
    for p in model.parameters():  # HF initialises some to 0 (the depth queries, the convolutions)
        torch.nn.init.normal_(p, std=0.3)
    return model.double()


@pytest.mark.parametrize("model_type, class_name", [
    ("inkling2_text", "Inkling2ForCausalLM"),
    ("inkling2_loop_text", "Inkling2LoopForCausalLM"),
], ids=["inkling2", "inkling2_loop"])
def test_block_attention_residual_replays_exactly(model_type, class_name):
    torch._dynamo.reset()
    brcompile.reset_stats()
    model = _model(model_type, class_name)
    ids = torch.randint(1, V, (1, 7)).repeat(3, 1)
    ids[1:, 5:] = torch.randint(1, V, (2, 2))
    names, params = zip(*model.named_parameters())

    def loss(ids):
        return model(input_ids=ids, use_cache=False).logits.log_softmax(-1).pow(2).sum()

    with KeepFloat64():
        want = loss(ids)
        gw = torch.autograd.grad(want, params, allow_unused=True)
        backend = brcompile.backend(compiler="eager")
        got = torch.compile(loss, backend=backend)(ids)
        gg = torch.autograd.grad(got, params, allow_unused=True)
    assert_exact(got, want, torch.float64, "loss")
    assert_grads_exact(gg, gw, names, torch.float64)
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.fallback_calls == 0 and s.executed_tokens < s.logical_tokens, str(s)
    (rec,) = [r for r in backend.records if r.rewritten]
    trees = rec.packed_code.count("tree_attention_forward.default(")
    depth = len(re.findall(r"scaled_dot_product_attention\(", rec.packed_code))
    # the two layers' attentions; the residuals before layer 0's MLP, before layer 1's attention (3 queries) and
    # MLP, and the final one (`final_input`)
    assert (trees, depth) == (2, 4), rec.packed_code
