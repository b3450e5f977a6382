"""Context parallelism composed with FSDP2 (brcompile/runtime/context_parallel.py, examples/context_parallel.py
``--fsdp2``): gloo CPU processes over a (dp, cp) mesh, ``fully_shard`` over its flattened dp x cp dimension with
gradients summed over the CP ranks (divide factor dp); the loss and every gathered gradient equal the single-process
eager run (float64, <= 1e-10 relative), and each rank's stats show the calls were split.

- ``model``: ``fully_shard(model)``, the loss function compiled around it: FSDP2's unsharded parameters are leaves,
  so the model's graph splits; the loss graph after it reads the logits (an activation) and, holding no attention,
  runs whole on every rank.
- ``blocks``: ``fully_shard`` on every block and the model: Dynamo compiles each block as a graph whose input, the
  hidden states, is an activation; each block splits, its input's gradient reduced to rank 0."""
import pytest
import torch

from examples.context_parallel import TOL, Case, compare, launch, reference

CASES_2 = (Case(fsdp2="model"), Case(fsdp2="blocks", left_pad_prompts=True, shared_response_prefix=2, seed=1))
N_LAYERS = 2  # examples/context_parallel.py make_model


def _check(case: Case, results: list) -> None:
    ref = reference(case)
    for r in results:
        assert compare(r, ref) <= TOL[case.dtype]
        st = r["stats"]
        assert st["fallback_calls"] == 0
        assert st["context_parallel_calls"] == (1 if case.fsdp2 == "model" else N_LAYERS), st
        # what runs whole holds no attention (the loss over the logits; the mask built before the blocks)
        assert all("no attention" in why or "no scaled_dot_product_attention" in why
                   for why in st["context_parallel_reasons"]), st
    tokens = [r["tokens"] for r in results]
    assert min(tokens) > 0


@pytest.fixture(scope="module")
def two_ranks():
    return launch(CASES_2, world_size=2)


@pytest.mark.parametrize("i", range(len(CASES_2)), ids=[c.fsdp2 for c in CASES_2])
def test_fsdp2_over_the_cp_group_equals_the_single_process_run(two_ranks, i):
    _check(CASES_2[i], two_ranks[i])


@pytest.mark.slow
def test_fsdp2_over_dp_x_cp_equals_the_single_process_run_of_the_dp_batches():
    """4 ranks, a (dp=2, cp=2) mesh: each dp rank its own batch, FSDP2 over the flattened 4 ranks; the gradient is
    that of the mean of the dp batches' losses."""
    case = Case(fsdp2="blocks", dp=2, seed=2)
    results = launch([case], world_size=4)[0]
    _check(case, results)
    assert len({round(r["loss"], 12) for r in results}) == 1  # the dp mean, on every rank
