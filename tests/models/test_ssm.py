"""Pure state-space models (no attention) replay: HF Mamba and FalconMamba, tiny, float64.

With ``config.use_associative_scan=True`` (the configs' default) the selective scan is ``torch._higher_order_ops.associative_scan``
of the affine maps ``(discrete_A, deltaB_u)`` along the positions, which Dynamo inlines on CPU; the analysis
recognises it (passes/canonical/scans/linear.py) and the packed graph computes the states along the tree paths with
``brcompile::tree_linear_scan``, the causal conv with ``tree_causal_conv1d``: the whole model runs on the
tree. With ``use_associative_scan=False`` the scan is a Python loop over the positions, unrolled
by Dynamo (integer indexing of the positions): that part runs densely on the B·L positions, the conv and the
rest on the tree, and the call still replays exactly.

The batch is the hybrid tests' three-level tree with padding on both sides (tests/models/test_hybrids.py);
loss and every parameter gradient are compared with the eager model in float64 (1e-10) inside
``KeepFloat64`` (the mixers upcast to float32).
"""
import pytest
import torch

from tests.helpers import transformers_or_skip
from tests.models.test_hybrids import VOCAB, replay_float64

#: hidden 16, state 4, one layer: the smallest config with every part of the mixer (Dynamo's trace of the
#: inlined associative scan, under torch.vmap, takes most of the test's time)
TINY_SSM = dict(vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2, conv_kernel=3,
                time_step_rank=2, pad_token_id=0, use_mambapy=False)


def run_ssm(family: str, use_associative_scan: bool):
    """Eager vs compiled loss and gradients of a tiny ``family`` model; returns the backend."""
    transformers = transformers_or_skip()
    cfg = transformers.AutoConfig.for_model(family, **TINY_SSM, use_associative_scan=use_associative_scan)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).double()
    return replay_float64(model)


@pytest.mark.parametrize("family", ["mamba", pytest.param("falcon_mamba", marks=pytest.mark.slow)])
def test_associative_scan_ssm_replays_on_the_tree(family):
    backend = run_ssm(family, use_associative_scan=True)
    code = "\n".join(r.packed_code for r in backend.records)
    assert code.count("brcompile.tree_linear_scan") == TINY_SSM["num_hidden_layers"], code
    assert code.count("brcompile.tree_causal_conv1d") == TINY_SSM["num_hidden_layers"], code
    assert "_add_batch_dim" not in code  # no dense scan left
    for r in backend.records:  # nothing of the mixers is read densely
        assert not any(n.startswith(("discrete_A", "deltaB_u", "all_states")) for n, *_ in r.materialisations), \
            r.materialisations


@pytest.mark.slow
def test_loop_scan_ssm_replays_with_the_loop_dense():
    """``use_associative_scan=False``, the Python loop: the conv runs on the tree, the unrolled loop densely (its per-position
    reads are integer indices of the positions), and the call replays exactly."""
    backend = run_ssm("mamba", use_associative_scan=False)
    code = "\n".join(r.packed_code for r in backend.records)
    assert "brcompile.tree_causal_conv1d" in code and "brcompile.tree_linear_scan" not in code, code
    assert any("integer index on a token dim" in why for r in backend.records for *_, why in r.materialisations)


@pytest.mark.slow
def test_ssm_without_attention_streams_exactly():
    """mode="replay" for pure Mamba: nothing but the scans reads a prefix token from a tail token, no K/V is
    cached; loss and every gradient equal eager's and the packed mode's (tests/runtime/test_streaming_scans.py)."""
    from tests.runtime.test_streaming_scans import hf_run

    rec = hf_run("mamba", chunk_tokens=2).records[-1]
    assert rec.replay["cached"] == () and len(rec.replay["cached_scans"]) == 2, rec.replay
