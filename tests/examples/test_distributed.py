"""Data parallelism with ``branch_replay``: the group-aware sampler/collator (``brcompile.data``), and DDP /
FSDP2 on 2 CPU processes (gloo, loopback) whose gradients equal the single-process dense run.

The distributed run spawns its processes once (module fixture) and runs every wrapper in them; each test
checks one wrapper: loss, every gradient and every SGD-updated parameter against the single-process eager
run over the union of the ranks' rows (float64, <= 1e-10 relative), and what every rank's backend did.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from brcompile.data import GroupBatchSampler, collate_rollouts, group_ids_by_prompt, group_rows, shard_groups

# ------------------------------------------------------------------------------------------------ data helpers


def test_group_rows_first_appearance_order():
    rows = group_rows([7, 3, 7, 9, 3, 7])
    assert [r.tolist() for r in rows] == [[0, 2, 5], [1, 4], [3]]
    assert group_rows([]) == []
    with pytest.raises(ValueError, match="1-D"):
        group_rows(torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="integers"):
        group_rows(torch.tensor([0.5, 1.0]))


def test_group_ids_by_prompt_lists_and_padded_tensors():
    assert group_ids_by_prompt([[5, 6], [7], [5, 6], [7], [5]]).tolist() == [0, 1, 0, 1, 2]
    # left-padded prompts: the mask decides what the prompt is, so padding never splits a group
    prompts = torch.tensor([[0, 0, 5, 6], [0, 0, 5, 6], [0, 8, 5, 6], [9, 9, 9, 9]])
    mask = (prompts != 0).long()
    assert group_ids_by_prompt(prompts, mask).tolist() == [0, 0, 1, 2]
    shifted = torch.tensor([[5, 6, 0], [0, 5, 6]])
    assert group_ids_by_prompt(shifted, (shifted != 0).long()).tolist() == [0, 0]
    assert group_ids_by_prompt(shifted).tolist() == [0, 1]  # without a mask, the pad ids are compared too
    with pytest.raises(ValueError, match="only meaningful"):
        group_ids_by_prompt([[1]], torch.ones(1, 1))


def _assert_partition(shards, group_ids):
    """Shards are disjoint, cover every row, and hold whole groups."""
    group_ids = torch.as_tensor(group_ids)
    allrows = torch.cat(shards).sort().values
    assert torch.equal(allrows, torch.arange(len(group_ids))), "rows lost or duplicated"
    owner = {}
    for s, rows in enumerate(shards):
        for g in group_ids[rows].tolist():
            assert owner.setdefault(g, s) == s, f"group {g} split over shards {owner[g]} and {s}"


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=12), num_shards=st.integers(1, 4), data=st.data())
def test_shard_groups_partition_and_balance(sizes, num_shards, data):
    ids = torch.cat([torch.full((n,), g) for g, n in enumerate(sizes)])
    ids = ids[torch.tensor(data.draw(st.permutations(range(len(ids)))))]  # rows of a group need not be adjacent
    if len(sizes) < num_shards:
        with pytest.raises(ValueError, match="cannot fill"):
            shard_groups(ids, num_shards)
        return
    shards = shard_groups(ids, num_shards)
    assert len(shards) == num_shards and all(len(s) > 0 for s in shards)
    _assert_partition(shards, ids)
    loads = [len(s) for s in shards]
    assert max(loads) <= -(-len(ids) // num_shards) + max(sizes)  # greedy LPT bound
    assert [s.tolist() for s in shard_groups(ids, num_shards)] == [s.tolist() for s in shards]  # deterministic


def test_shard_groups_equal_rows():
    ids = torch.arange(6).repeat_interleave(3)  # 6 groups of 3 rows
    shards = shard_groups(ids, 2, equal=True)
    assert [len(s) for s in shards] == [9, 9]
    with pytest.raises(ValueError, match="equal row count"):
        shard_groups([0, 0, 0, 1, 2], 2, equal=True)


@pytest.mark.parametrize("num_groups,groups_per_rank,world,drop_last", [
    (8, 2, 2, False), (7, 2, 2, False), (7, 2, 2, True), (5, 1, 3, False), (6, 3, 1, False),
])
def test_group_batch_sampler_over_ranks(num_groups, groups_per_rank, world, drop_last):
    """Every rank: the same number of batches, each of ``groups_per_rank`` whole groups; per step the ranks'
    groups are disjoint; an epoch covers every group (padded steps repeat groups, as DistributedSampler does)."""
    sizes = [2 + (g % 3) for g in range(num_groups)]
    ids = torch.cat([torch.full((n,), g) for g, n in enumerate(sizes)])
    samplers = [GroupBatchSampler(ids, groups_per_rank, num_replicas=world, rank=r, seed=3, drop_last=drop_last)
                for r in range(world)]
    batches = [list(s) for s in samplers]
    assert len({len(b) for b in batches}) == 1 and len(batches[0]) == len(samplers[0])
    seen = set()
    for step in zip(*batches):
        step_groups = []
        for batch in step:
            groups = ids[torch.tensor(batch)]
            distinct = groups.unique().tolist()
            assert len(distinct) == groups_per_rank
            for g in distinct:  # whole group, listed together
                assert (groups == g).sum().item() == sizes[g]
                rows = (groups == g).nonzero().flatten()
                assert rows.tolist() == list(range(rows[0], rows[0] + sizes[g]))
            step_groups += distinct
        assert len(set(step_groups)) == len(step_groups), f"ranks share a group in step {step}"
        seen |= set(step_groups)
    if drop_last:
        assert len(seen) == (num_groups // (groups_per_rank * world)) * groups_per_rank * world
    else:
        assert seen == set(range(num_groups))


def test_group_batch_sampler_epochs_and_validation():
    ids = torch.arange(10).repeat_interleave(2)
    s = GroupBatchSampler(ids, 2, num_replicas=1, rank=0, seed=0)
    e0 = list(s)
    assert list(s) == e0  # deterministic within an epoch
    s.set_epoch(1)
    assert list(s) != e0 and sorted(sum(list(s), [])) == sorted(sum(e0, []))
    assert [b for b in GroupBatchSampler(ids, 5, num_replicas=1, rank=0, shuffle=False)] == \
        [list(range(10)), list(range(10, 20))]
    with pytest.raises(ValueError, match="rank"):
        GroupBatchSampler(ids, 1, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="drop_last"):
        GroupBatchSampler(ids, 6, num_replicas=2, rank=0, drop_last=True)


def test_collate_rollouts():
    rows = [
        {"prompt_ids": [5, 6, 7], "completion_ids": [8, 9], "advantages": 0.5, "group": 0},
        {"prompt_ids": torch.tensor([5, 6, 7]), "completion_ids": torch.tensor([4]), "advantages": -0.5, "group": 0},
        {"prompt_ids": [3], "completion_ids": [2, 2, 2, 2], "advantages": 1.0, "group": 1},
    ]
    b = collate_rollouts(rows, pad_id=0, pad_to_multiple_of=4)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0], [5, 6, 7, 4, 0, 0, 0, 0], [3, 2, 2, 2, 2, 0, 0, 0]]
    assert b["attention_mask"].tolist() == [[1] * 5 + [0] * 3, [1] * 4 + [0] * 4, [1] * 5 + [0] * 3]
    assert b["completion_mask"].tolist() == [[0, 0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 1, 0, 0, 0, 0],
                                             [0, 1, 1, 1, 1, 0, 0, 0]]
    assert b["group"].tolist() == [0, 0, 1]
    torch.testing.assert_close(b["advantages"], torch.tensor([0.5, -0.5, 1.0]))  # Python floats: default dtype
    with pytest.raises(KeyError, match="completion_ids"):
        collate_rollouts([{"prompt_ids": [1]}])
    with pytest.raises(ValueError, match="no rows"):
        collate_rollouts([])


# ------------------------------------------------------------------------------------------------ DDP / FSDP2

@pytest.fixture(scope="module")
def distributed_run():
    """One spawn of 2 gloo processes running every wrapper, and the single-process reference."""
    from examples import ddp

    spec = ddp.RolloutSpec()
    return ddp.launch(ddp.MODES, world_size=2, spec=spec), ddp.reference_step(spec, world_size=2)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2", "ddp_model", "fsdp2_blocks", "ddp_window"])
def test_data_parallel_step_equals_single_process(distributed_run, mode):
    from examples import ddp

    results, reference = distributed_run
    res = results[mode]
    assert res["rows"] == [6, 6]  # 2 whole groups of 3 rows per rank
    for name, want in reference["grads"].items():
        err = ddp.compare({"loss": reference["loss"], "grads": {name: res["grads"][name]}, "params": {}},
                          {"loss": reference["loss"], "grads": {name: want}, "params": {}})
        assert err <= 1e-10, f"{mode}: grad of {name}: relative error {err:.3e}"
    err = ddp.compare(res, reference)
    assert err <= 1e-10, f"{mode}: loss/grads/updated params: relative error {err:.3e}"

    for rank, (stats, records) in enumerate(zip(res["stats"], res["records"])):
        if mode == "ddp_window":  # micro-batches of one row in one window: the prompts replayed across calls
            assert stats["window_calls"] == 6 and stats["window_replayed_tokens"] > 0, (rank, stats)
            assert stats["fallback_calls"] == 0, (rank, stats)
        elif mode in ("ddp", "fsdp2"):  # the wrapped objective is one graph: model and loss replay together
            assert stats["replayed_calls"] == 1 and stats["fallback_calls"] == 0, (rank, stats)
            assert stats["executed_tokens"] < stats["logical_tokens"], (rank, stats)
        elif mode == "ddp_model":
            # the no-grad log-prob forward and the loss's model forward replay, and so do the loss parts after
            # DDP's graph break: no attention, but token-local ops on the per-token logits rows (their tree keys)
            assert stats["replayed_calls"] == 4 and stats["fallback_calls"] == 0, (rank, stats)
            assert stats["executed_tokens"] < stats["logical_tokens"], (rank, stats)
        else:  # FSDP units are graph breaks: each block's graph replays, keyed by its hidden states, with the
            # [B, 1, L, L] mask built outside it read off the tensor; of the graphs without attention, those with
            # token-local work on per-token inputs replay too; the one before the first block reads [B, L] metadata
            # only, no per-token value: nothing to share (no fallback); one call's batch shares too little
            n_layers = ddp.RolloutSpec().n_layers
            assert stats["replayed_calls"] == n_layers + 3 and stats["fallback_calls"] == 1, (rank, stats)
            # the graphs not rewritten: that one (a refused graph's calls would count as fallbacks)
            not_rewritten = [reason for rewritten, reason in records if not rewritten]
            assert stats["unshared_calls"] == 1, (rank, stats)
            assert stats["unshared_codes"] == {"no_per_token_work": 1}, (rank, stats, not_rewritten)
            assert stats["fallback_codes"] == {"shares_too_little": 1}, (rank, stats)
            assert stats["executed_tokens"] < stats["logical_tokens"], (rank, stats)
