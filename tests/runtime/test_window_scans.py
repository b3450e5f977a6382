"""Cross-call windows over hybrid models (brcompile/runtime/window/, docs/ARCHITECTURE.md §7.1): the trunk's tree
scans carry their state from call to call.

A window's store keeps, per token, every cached value the streaming prefix graph returns (passes/emit/split.py):
each attention's K/V and each scan's values — a linear or matrix scan's state, a cumsum's path sum, a causal conv's
input (its taps). A later call's new tokens run as one chunk whose scans start from the stored states of their
replayed ancestors (``WindowPlan.ancestors``, the streaming chunk's ``ancestors`` with the replayed tokens as the
prefix: the parent for a state, the last W-1 ancestors for a conv's taps).

Oracle: the same micro-batches (1 or 2 rows, shuffled over groups of rows sharing a prompt and, for some rows, a
response prefix) run eagerly in float64, loss scaled by 1/N and backpropagated per micro-batch; every call's loss
and every parameter gradient after the window within 1e-10. Every test asserts through ``brcompile.stats()`` that
the calls ran through the window, tokens were replayed from an earlier call and nothing fell back.
"""
import contextlib
import random

import pytest
import torch

import brcompile
from brcompile.runtime.window import plan_window
from brcompile.testing import assert_exact
from examples.grpo import make_grpo_batch
from tests.helpers import KeepFloat64, assert_grads_exact, transformers_or_skip

F64 = torch.float64


def micro_batches(b, size, seed=0):
    """The rows of ``b`` shuffled into micro-batches of ``size`` rows."""
    order = list(range(b["input_ids"].shape[0]))
    random.Random(seed).shuffle(order)
    return [{k: v[order[i:i + size]] for k, v in b.items()} for i in range(0, len(order), size)]


def window_matches_eager(loss, mbs, model, guard=contextlib.nullcontext, no_grad_first=False, dynamic=True,
                         max_bytes=None):
    """``loss(fn, mb)`` per micro-batch, ``/ len(mbs)`` and backpropagated, eagerly and compiled (``mode="replay"``)
    inside ``brcompile.window(calls=len(mbs))``: every call's loss and every gradient after the window equal
    (float64, 1e-10); the calls ran through the window, replayed tokens an earlier call computed, and nothing fell
    back. ``no_grad_first``: each call is preceded by the same call under ``no_grad`` (old log-probs), which
    shares forward across the window's no-grad store. ``dynamic``: torch.compile's (micro-batches of one shape need
    no dynamic shapes). ``max_bytes``: the window's bound (past it a piece recomputes its forward in the deferred
    backward). Returns (the backend, the window's stats)."""
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])

    def run(fn):
        model.zero_grad(set_to_none=True)
        losses = []
        for mb in mbs:
            if no_grad_first:
                with torch.no_grad():
                    losses.append(loss(fn, mb).detach())
            out = loss(fn, mb) / len(mbs)
            losses.append(out.detach())
            out.backward()
        return losses, [p.grad.clone() for p in params]

    with guard():
        want_losses, want = run(lambda *a: model(*a))
    backend = brcompile.backend(mode="replay", compiler="eager")
    fn = torch.compile(lambda *a: model(*a), backend=backend, dynamic=dynamic)
    torch._dynamo.reset()
    brcompile.reset_stats()
    with guard(), brcompile.window(calls=len(mbs), max_bytes=max_bytes) as w:
        got_losses, got = run(fn)
        st = w.stats()
    for i, (g, e) in enumerate(zip(got_losses, want_losses)):
        assert_exact(g, e, F64, f"loss of call {i}")
    assert_grads_exact(got, want, names, F64)
    s = brcompile.stats()
    assert s.fallback_calls == 0 and s.window_calls == len(mbs), str(s)
    assert s.window_replayed_tokens > 0 and st["replayed_tokens"] == s.window_replayed_tokens, (str(s), st)
    assert not st["pending"] and s.windows == 1, (str(s), st)
    if no_grad_first:
        assert s.window_no_grad_calls == len(mbs), str(s)
    assert all(r.replay is None or r.replay["window"] == "shares across calls" for r in backend.records), \
        [r.replay["window"] for r in backend.records if r.replay]
    return backend, st


def cached_scans(backend) -> tuple:
    return tuple(s for r in backend.records if r.replay for s in r.replay["cached_scans"])


# --------------------------------------------------------------------------------------------- the plan

def test_plan_window_gives_each_new_token_its_replayed_ancestors():
    """One chain 0..5 with two leaves, tokens 0..2 replayed, depth 3 (a width-4 conv): the new tokens' i-th
    ancestors, as cache-local ids where replayed, -1 where new or past the root."""
    # tree: 0-1-2-3 then leaves 4 and 5 under 3: segments (0,4,6), (4,5,5), (5,6,6)
    end = torch.tensor([6, 6, 6, 6, 5, 6])
    segments = torch.tensor([[0, 4, 6], [4, 5, 5], [5, 6, 6]])
    cached = torch.tensor([True, True, True, False, False, False])
    plan = plan_window(end, segments, cached, torch.tensor([7, 8, 9, -1, -1, -1]), 3)
    assert plan.new_ids.tolist() == [3, 4, 5]
    # token 3: ancestors 2, 1, 0 (all replayed); tokens 4 and 5: 3 (new), then 2, 1
    assert plan.ancestors.tolist() == [[2, -1, -1], [1, 2, 2], [0, 1, 1]]
    assert plan_window(end, segments, cached, torch.tensor([7, 8, 9, -1, -1, -1])).ancestors.shape == (0, 3)


# --------------------------------------------------------------------------------------- end to end

def scan_gpt_batch(seed=2):
    return make_grpo_batch(vocab_size=23, seed=seed, num_prompts=2, group_size=4, prompt_len=(4, 7),
                           response_len=(4, 7), shared_response_prefix=2, left_pad_prompts=True, pad_id=0)


@pytest.mark.parametrize("size,no_grad_first,max_bytes", [(1, False, None), (2, False, None), (1, True, None),
                                                           (2, False, 1)])
def test_cumsum_conv_attention_model_shares_across_calls(size, no_grad_first, max_bytes):
    """ScanGPT (tests/passes/analysis/rules/test_scan_rules.py): cumsum positions (an integer path sum), two gated
    short convs of width 4 (three taps read from replayed ancestors) and attention per block; the window computes
    the tokens one call over all of its rows computes (each store: the grad calls', the no-grad calls'). With
    ``max_bytes=1`` every piece keeps only its outputs and recomputes its forward in the deferred backward."""
    from tests.passes.analysis.rules.test_scan_rules import scan_model

    model = scan_model()
    b = scan_gpt_batch()
    backend, st = window_matches_eager(_scan_gpt_loss, micro_batches(b, size), model, no_grad_first=no_grad_first,
                                       max_bytes=max_bytes)
    assert (st["recomputed_tokens"] == st["computed_tokens"]) if max_bytes else st["recomputed_tokens"] == 0, st
    scans = cached_scans(backend)
    assert any("cumsum" in s for s in scans) and any("causal_conv1d" in s for s in scans), scans
    torch._dynamo.reset()
    brcompile.reset_stats()
    torch.compile(lambda *a: model(*a), backend=brcompile.backend(mode="replay", compiler="eager"))(
        b["input_ids"], b["attention_mask"])
    ideal = brcompile.stats().executed_tokens * (2 if no_grad_first else 1)  # the no-grad store computes its own
    assert st["computed_tokens"] == ideal, (st, ideal)


def _scan_gpt_loss(fn, mb):
    """The test_scan_rules suite's ``token_loss`` with the model called through ``fn``."""
    ids, cm = mb["input_ids"], mb["completion_mask"]
    lp = fn(ids, mb["attention_mask"])[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = cm[:, 1:].to(lp.dtype)
    return -(lp * m).sum() / m.sum()


def next_token_loss(fn, mb):
    ids, cm = mb["input_ids"], mb["completion_mask"]
    lp = fn(ids)[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = cm[:, 1:].to(lp.dtype)
    return -(lp * m).sum() / m.sum()


@pytest.mark.parametrize("size", [1, 2])
def test_delta_rule_matrix_scan_shares_across_calls(size):
    """A gated delta rule alone (tests/runtime/test_streaming_scans.py ``DeltaNet``: a matrix scan, no attention, no
    conv): a later call's chunk roots start from the stored ``[dk, dv]`` state of their replayed parents."""
    from tests.runtime.test_streaming_scans import delta_rule_model

    model, b, _, _ = delta_rule_model()
    b = make_grpo_batch(vocab_size=23, seed=2, num_prompts=1, group_size=4, prompt_len=(4, 6), response_len=(3, 6),
                        shared_response_prefix=2, pad_id=0)
    # static shapes: micro-batches of one shape (the delta rule's canonicalisation does not take symbolic shapes)
    backend, _ = window_matches_eager(next_token_loss, micro_batches(b, size), model, guard=KeepFloat64,
                                      dynamic=False)
    assert cached_scans(backend) == ("tree_matrix_scan_default",), cached_scans(backend)


def hf_batch():
    from tests.models.test_hybrids import VOCAB

    return make_grpo_batch(vocab_size=VOCAB, seed=1, num_prompts=1, group_size=4, prompt_len=(5, 8),
                           response_len=(3, 6), shared_response_prefix=2, left_pad_prompts=True, pad_id=0)


def hf_loss(model):
    def loss(fn, mb):
        ids, cm = mb["input_ids"], mb["completion_mask"]
        lp = fn(ids, mb["attention_mask"])[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        m = cm[:, 1:].to(lp.dtype)
        return -(lp * m).sum() / m.sum()
    return loss


class Logits(torch.nn.Module):
    """``model(ids, am).logits`` as a module (what the test compiles)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, am):
        return self.model(input_ids=ids, attention_mask=am, use_cache=False).logits


@pytest.mark.parametrize("family,size", [("lfm2", 1), ("lfm2", 2), ("mamba", 1), ("bamba", 2), ("bamba", 1),
                                         ("qwen3_next", 2)])
def test_hf_hybrid_shares_across_calls(family, size):
    """HF LFM2 (gated short conv + attention), pure Mamba (selective scan + conv, no attention), Bamba (Mamba-2:
    linear scan + conv, and attention) and Qwen3-Next (gated DeltaNet: matrix scan + conv, and attention): one
    group's rows over calls of ``size`` rows. Their mixers read the parameters through ops of their own (a conv
    weight's unsqueeze, ``-exp(A_log)``), which the trunk computes itself (passes/emit/split.py
    ``_parameter_side``): its inputs are the parameters, whose deferred gradients the window returns."""
    from tests.models.test_hybrids import tiny_hybrid

    model = Logits(tiny_hybrid(family))
    # static shapes (micro-batches of one shape): with symbolic ones LFM2's conv stays a dense region, packed again
    backend, _ = window_matches_eager(hf_loss(model), micro_batches(hf_batch(), size), model, guard=KeepFloat64,
                                      dynamic=False)
    scans = cached_scans(backend)
    assert any("causal_conv1d" in s for s in scans), scans
    if family in ("mamba", "bamba"):
        assert any("linear_scan" in s for s in scans), scans
    if family == "qwen3_next":
        assert any("matrix_scan" in s for s in scans), scans


def test_bloom_cached_alibi_positions_share_across_calls():
    """HF BLOOM: its ALiBi positions are the attention mask's running count at each token (a trunk value, not the
    tree's positions), cached per token like K/V (``cached_positions``, tests/models/test_alibi_sinks_hf.py); a
    later call's chunk reads the replayed keys' counts from the store. Float64 with HF's float32 softmax kept in
    float64 (``KeepFloat64``)."""
    transformers = transformers_or_skip()
    from tests.models.test_alibi_sinks_hf import _BloomGelu
    from tests.models.test_hybrids import VOCAB

    cfg = transformers.AutoConfig.for_model("bloom", vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    bloom = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").double()
    for block in bloom.transformer.h:
        block.mlp.gelu_impl = _BloomGelu()
    model = Logits(bloom)
    backend, _ = window_matches_eager(hf_loss(model), micro_batches(hf_batch(), 2), model, guard=KeepFloat64,
                                      dynamic=False)
    assert any(len(r.replay["cached_positions"]) == 2 for r in backend.records if r.replay), \
        [r.replay["cached_positions"] for r in backend.records if r.replay]
