"""Hybrid models (attention + state-space / linear-attention / short-conv layers) replay: HF Bamba, Nemotron-H
and Zamba2 (Mamba-2 mixers), Jamba (Mamba-1 selective scan), Qwen3-Next (gated DeltaNet, chunked delta rule),
Kimi-Linear (KDA: the chunked delta rule with a per-channel gate) and LFM2 (gated short convolution), tiny,
float64, one attention layer and one other layer each.

The Mamba-2 mixers' chunked SSD (Bamba, Nemotron-H, Zamba2) is proved on probes to be the per-head recurrence
and rewritten as a ``linear_scan`` (passes/canonical/scans/ssd.py): a tree scan, like Jamba's selective scan (an
associative scan of affine maps, passes/canonical/scans/linear.py) and the causal convs (LFM2's short conv, the mixers').
Qwen3-Next's and Kimi-Linear's chunked gated delta rules are proved to be their matrix recurrences
(passes/canonical/scans/delta_rule.py) and run on the tree as ``brcompile::tree_matrix_scan``. Nothing is left as a dense region packed again (passes/analysis/repack.py
is tested on its own); the attentions, projections and MLPs run on the tree. The batch is a three-level tree with padding on both sides: two
prompts (left-padded) × three responses (right-padded), two responses of the first prompt sharing their
first tokens. Loss and every parameter gradient are compared with the eager model in float64 (1e-10)
inside ``KeepFloat64``, which keeps the mixers' float32 upcasts in float64 (otherwise the bound is
float32's: the rewrite sums a shared token's gradient in another order); a gradient that cancels to almost
nothing (Qwen3-Next's ``dt_bias``) is held to the bound relative to the model's largest
(``tests.helpers.assert_grads_exact``).
"""
import pytest
import torch

import brcompile
from brcompile.testing import assert_exact
from examples.grpo import make_grpo_batch
from tests.helpers import KeepFloat64, assert_grads_exact, assert_replayed, transformers_or_skip

VOCAB = 64
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
#: family -> config overrides of TINY: layer 0 the mixer, layer 1 attention
HYBRIDS = {
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                  mamba_chunk_size=8),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, num_experts=1, mamba_d_state=8, mamba_dt_rank=4,
                  use_mamba_kernels=False),
    "lfm2": dict(layer_types=["conv", "full_attention"], conv_L_cache=3),
    "nemotron_h": dict(layers_block_type=["mamba", "attention"], mamba_num_heads=4, mamba_head_dim=16,
                       ssm_state_size=8, n_groups=1, chunk_size=8, head_dim=8),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"], n_mamba_heads=4, mamba_headdim=16, mamba_d_state=8,
                   mamba_ngroups=1, chunk_size=8, num_mem_blocks=1, use_mamba_kernels=False),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"], head_dim=8, linear_num_value_heads=4,
                       linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=0,
                       mlp_only_layers=[0, 1]),
    "kimi_linear": dict(layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "dense"],
                        linear_num_heads=2, linear_head_dim=8, num_key_value_heads=4, kv_lora_rank=16,
                        q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, bos_token_id=1,
                        eos_token_id=2),
}


def tiny_hybrid(family):
    """A tiny float64 HF ``family`` model (the configs above; pure Mamba: tests/models/test_ssm.py's), seeded."""
    transformers = transformers_or_skip()
    from tests.models.test_ssm import TINY_SSM

    if family == "mamba":
        cfg = transformers.AutoConfig.for_model(family, **TINY_SSM, use_associative_scan=True)
    else:
        cfg = transformers.AutoConfig.for_model(family, **TINY, **HYBRIDS[family])
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).double()


def tree_batch():
    """Two prompts × three responses; left-padded prompts, right-padded responses; rows 0 and 1 share the
    prompt and two response tokens (a three-level tree)."""
    b = make_grpo_batch(vocab_size=VOCAB, seed=1, num_prompts=2, group_size=3, prompt_len=(5, 8),
                        response_len=(4, 6), left_pad_prompts=True, pad_id=0)
    ids, am, cm = b["input_ids"].clone(), b["attention_mask"], b["completion_mask"]
    start = int(cm[0].nonzero()[0])  # the first response column (the same in every row: left-padded prompts)
    ids[1, start:start + 2] = ids[0, start:start + 2]
    return ids, am, cm


def next_token_loss(model, ids, am, cm):
    logits = model(input_ids=ids, attention_mask=am, use_cache=False).logits
    lp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = cm[:, 1:].to(lp.dtype)
    return -(lp * m).sum() / m.sum()


def replay_float64(model):
    """Eager vs compiled loss and every gradient of the float64 HF ``model`` on :func:`tree_batch`, its float32
    casts kept in float64, within 1e-10; every graph rewritten and the calls replayed. Returns the backend."""
    args = tree_batch()
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    with KeepFloat64():
        want = next_token_loss(model, *args)
    gw = torch.autograd.grad(want, params)
    backend = brcompile.backend(compiler="eager")
    with KeepFloat64():
        got = torch.compile(next_token_loss, backend=backend)(model, *args)
    gg = torch.autograd.grad(got, params)
    assert_exact(got, want, torch.float64, "loss")
    assert_grads_exact(gg, gw, names, torch.float64)
    assert_replayed()
    assert all(r.rewritten for r in backend.records), [r.reason for r in backend.records]
    return backend


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(HYBRIDS))
def test_hybrid_replays_exactly(family):
    transformers = transformers_or_skip()
    cfg = transformers.AutoConfig.for_model(family, **{**TINY, **HYBRIDS[family]})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").double()
    backend = replay_float64(model)
    code = "\n".join(r.packed_code or "" for r in backend.records)
    if family in ("jamba", "bamba", "nemotron_h", "zamba2"):  # Mamba-1's selective scan, Mamba-2's chunked SSD
        assert "brcompile.tree_linear_scan" in code and "brcompile.tree_causal_conv1d" in code, code
        assert not any(r.repacked for r in backend.records), backend.records  # nothing left dense to pack again
    elif family in ("qwen3_next", "kimi_linear"):  # the (per-channel) gated delta rule: a matrix recurrence along
        # the tree paths, not repacked
        assert "brcompile.tree_matrix_scan" in code and not any(r.repacked for r in backend.records), code
    else:  # LFM2's short conv: a tree scan
        assert "brcompile.tree_causal_conv1d" in code and not any(r.repacked for r in backend.records), code


@pytest.mark.slow
def test_mamba2_hybrid_streams_exactly():
    """mode="replay" for Bamba on the three-level tree cut into several chunks: the Mamba-2 mixer's linear scan
    and causal conv read the chunk tokens' ancestors from the cached prefix values; loss and every gradient
    equal eager's and the packed mode's (tests/runtime/test_streaming_scans.py)."""
    from tests.runtime.test_streaming_scans import hf_run

    scans = hf_run("bamba", chunk_tokens=8).records[-1].replay["cached_scans"]
    assert any("linear_scan" in s for s in scans) and any("causal_conv1d" in s for s in scans), scans


@pytest.mark.slow
def test_delta_rule_hybrid_streams_exactly():
    """mode="replay" for Qwen3-Next on the three-level tree cut into several chunks: the gated DeltaNet's matrix
    scan starts each chunk root from the prefix's cached state at its parent (``tree_matrix_scan_cached``), its
    conv reads the cached taps; loss and every gradient equal eager's and the packed mode's
    (tests/runtime/test_streaming_scans.py). The gated norm's ``reshape(-1, head_dim)`` flattens the tokens
    with the heads inside the streamed part (passes/emit/split.py)."""
    from tests.runtime.test_streaming_scans import hf_run

    info = hf_run("qwen3_next", chunk_tokens=4).records[-1].replay
    assert any("matrix_scan" in s for s in info["cached_scans"]), info["cached_scans"]
    assert any("causal_conv1d" in s for s in info["cached_scans"]), info["cached_scans"]
    assert "tree_matrix_scan_cached" in info["tail_code"] and "tree_matrix_scan" in info["prefix_code"]
