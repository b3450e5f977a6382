"""Cross-call windows (brcompile/runtime/window/, docs/ARCHITECTURE.md §7.1): a GRPO batch shuffled into
micro-batches, each its own call and its own ``loss.backward()``, inside ``brcompile.window(calls=N)``.

Oracle: the same micro-batches run eagerly, float64, loss scaled by 1/N and backpropagated per micro-batch, as a
trainer with gradient accumulation does; every parameter gradient within 1e-10. Every test asserts through
``brcompile.stats()`` and the window's own stats that tokens were replayed from an earlier call, and that the
window computed exactly the tokens one call over all of its rows computes (each distinct needed token once)."""
import random

import pytest
import torch

import brcompile
from brcompile.runtime.window import WindowError, plan_window
from examples.gpt import GPT, GPTConfig
from examples.grpo import grpo_loss, make_grpo_batch
from tests.helpers import KeepFloat64, assert_grads_exact, grpo_args, hf_tiny_model

BATCH = dict(num_prompts=2, group_size=4, prompt_len=(7, 10), response_len=(2, 6), shared_response_prefix=2, vocab_size=61)


def gpt():
    cfg = GPTConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48)
    return GPT(cfg, seed=0).double()


def batch(seed=0, **kw):
    b = make_grpo_batch(**{**BATCH, **kw}, seed=seed)
    b["advantages"] = torch.randn(b["advantages"].shape, generator=torch.Generator().manual_seed(seed),
                                  dtype=torch.float64)  # nonzero: every row needed
    return {k: v.double() if v.is_floating_point() else v for k, v in b.items()}


def rows(b, idx):
    return {k: v[idx] for k, v in b.items()}


def micro_batches(b, size, seed=0):
    order = list(range(b["input_ids"].shape[0]))
    random.Random(seed).shuffle(order)
    return [rows(b, order[i:i + size]) for i in range(0, len(order), size)]


def accumulate(model, loss_fn, mbs):
    """Gradient accumulation as a trainer runs it: one call and one backward per micro-batch, losses / N."""
    model.zero_grad(set_to_none=True)
    for mb in mbs:
        (loss_fn(model, *grpo_args(mb)) / len(mbs)).backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def compiled():
    """dynamic=True: micro-batches of different sizes reach one graph (a window shares within each graph)."""
    return torch.compile(grpo_loss, backend=brcompile.backend(mode="replay", compiler="eager"), dynamic=True)


def one_call_tokens(b) -> int:
    """The tokens one call over every row of the window executes: the window's ideal."""
    model, fn = gpt(), compiled()
    brcompile.reset_stats()
    fn(model, *grpo_args(b))
    torch._dynamo.reset()
    return brcompile.stats().executed_tokens


@pytest.mark.parametrize("size", [1, 2, 3])
def test_micro_batches_share_across_calls_exactly(size):
    """Rows of one group split over calls: the window's gradients equal eager gradient accumulation, the shared
    prompts run once (tokens replayed from the store), and the window computes the ideal token count."""
    b = batch()
    mbs = micro_batches(b, size)
    model = gpt()
    want = accumulate(model, grpo_loss, mbs)
    ideal = one_call_tokens(b)
    brcompile.reset_stats()
    fn = compiled()
    with brcompile.window(calls=len(mbs)) as w:
        got = accumulate(model, fn, mbs)
        st = w.stats()
    assert_grads_exact(got, want, [n for n, _ in model.named_parameters()], torch.float64)
    s = brcompile.stats()
    assert s.fallback_calls == 0 and s.window_calls == len(mbs), str(s)
    assert s.window_replayed_tokens > 0 and st["replayed_tokens"] == s.window_replayed_tokens
    assert st["computed_tokens"] == ideal, (st, ideal)
    assert not st["pending"]


def test_without_a_window_calls_share_within_themselves_only():
    """The same loop without a window: exact, and nothing replayed across calls (the behaviour is opt-in)."""
    b = batch()
    mbs = micro_batches(b, 2)
    model = gpt()
    want = accumulate(model, grpo_loss, mbs)
    brcompile.reset_stats()
    got = accumulate(model, compiled(), mbs)
    assert_grads_exact(got, want, [n for n, _ in model.named_parameters()], torch.float64)
    assert brcompile.stats().window_calls == 0


def test_calls_past_the_declared_count_share_within_themselves():
    """A window declared too small: its calls share, the deferred backward runs in the last declared call's
    backward, and the extra calls run alone — every gradient still exact."""
    b = batch()
    mbs = micro_batches(b, 2)
    model = gpt()
    want = accumulate(model, grpo_loss, mbs)
    brcompile.reset_stats()
    with brcompile.window(calls=2):
        got = accumulate(model, compiled(), mbs)
    assert_grads_exact(got, want, [n for n, _ in model.named_parameters()], torch.float64)
    assert brcompile.stats().window_calls == 2 and brcompile.stats().window_replayed_tokens > 0


def test_a_window_ending_early_applies_its_gradients_at_the_end():
    """Fewer calls than declared: the shared prefixes' backward runs when the window closes, into .grad."""
    b = batch()
    mbs = micro_batches(b, 2)
    model = gpt()
    want = accumulate(model, grpo_loss, mbs)
    with brcompile.window(calls=len(mbs) + 2):
        got = accumulate(model, compiled(), mbs)
        assert any(p.grad is None or not torch.equal(p.grad, g) for p, g in zip(model.parameters(), want)), \
            "the shared part's gradient is still pending inside the window"
    got = [p.grad for p in model.parameters()]
    assert_grads_exact(got, want, [n for n, _ in model.named_parameters()], torch.float64)


def test_an_optimizer_step_inside_a_pending_window_raises():
    """optimizer.step() before the window's last backward would step on incomplete gradients: WindowError."""
    b = batch()
    mbs = micro_batches(b, 2)
    model, fn = gpt(), compiled()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(WindowError, match="optimizer.step"):
        with brcompile.window(calls=len(mbs)):
            (fn(model, *grpo_args(mbs[0])) / len(mbs)).backward()
            opt.step()


@pytest.mark.parametrize("name", ["tok_emb.weight", "norm.weight"])
def test_a_parameter_written_mid_window_raises(name):
    """A write to a parameter between two calls of a window (its version counter): WindowError at the next call,
    not a silent mix of two parameter versions — a large one, and one small enough that a number of its size
    would be compared by value."""
    b = batch()
    mbs = micro_batches(b, 2)
    model, fn = gpt(), compiled()
    with pytest.raises(WindowError, match="parameter was written"):
        with brcompile.window(calls=len(mbs)):
            (fn(model, *grpo_args(mbs[0])) / len(mbs)).backward()
            with torch.no_grad():
                dict(model.named_parameters())[name].mul_(1.0)
            fn(model, *grpo_args(mbs[1]))


def test_a_window_closed_before_a_backward_raises():
    """A call's backward never ran inside the window: its shared gradients would be lost, so closing raises."""
    b = batch()
    mbs = micro_batches(b, 2)
    model, fn = gpt(), compiled()
    with pytest.raises(WindowError, match="closed before the backward"):
        with brcompile.window(calls=len(mbs)):
            fn(model, *grpo_args(mbs[0]))


def test_a_second_backward_through_a_window_call_raises():
    """retain_graph=True and a second backward: refused with the reason (the shared part's backward runs once)."""
    b = batch()
    mbs = micro_batches(b, 4)
    model, fn = gpt(), compiled()
    with pytest.raises(WindowError, match="second backward"):
        with brcompile.window(calls=len(mbs)):
            loss = fn(model, *grpo_args(mbs[0]))
            loss.backward(retain_graph=True)
            loss.backward()


def test_autograd_grad_over_a_window_call_raises():
    """torch.autograd.grad over a window call would return its gradients without the shared prefix's (deferred to
    the last call's backward, into .grad): refused with the fix, never a silently partial gradient."""
    b = batch()
    mbs = micro_batches(b, 2)
    model, fn = gpt(), compiled()
    with pytest.raises(WindowError, match="torch.autograd.grad"):
        with brcompile.window(calls=len(mbs)):
            torch.autograd.grad(fn(model, *grpo_args(mbs[0])), list(model.parameters()))


def test_a_window_ended_by_a_predicate_matches_eager():
    """``window(last=...)``: no call count, the window ends at the call during which ``last()`` is true (HF's
    Trainer sets accelerate's ``sync_gradients`` so): the deferred backward runs in that call's backward, exact."""
    b = batch()
    mbs = micro_batches(b, 2)
    model = gpt()
    want = accumulate(model, grpo_loss, mbs)
    fn, state = compiled(), {"i": 0}
    model.zero_grad(set_to_none=True)
    brcompile.reset_stats()
    with brcompile.window(last=lambda: state["i"] == len(mbs) - 1) as w:
        for i, mb in enumerate(mbs):
            state["i"] = i
            (fn(model, *grpo_args(mb)) / len(mbs)).backward()
            assert w.pending == (i < len(mbs) - 1)
    got = [p.grad for p in model.parameters()]
    assert_grads_exact(got, want, [n for n, _ in model.named_parameters()], torch.float64)
    s = brcompile.stats()
    assert s.window_calls == len(mbs) and s.window_replayed_tokens > 0, str(s)


def test_a_memory_bound_recomputes_pieces_exactly():
    """``window(max_bytes=...)``: past the bound a call keeps only its new tokens' outputs and recomputes their
    forward in the deferred backward. With 0 every piece recomputes: gradients still exact, the window keeps
    fewer bytes while pending than without the bound, and the recomputed tokens are reported."""
    b = batch()
    mbs = micro_batches(b, 2)
    model = gpt()
    want = accumulate(model, grpo_loss, mbs)
    kept = {}
    for bound in (None, 0):
        fn = compiled()
        brcompile.reset_stats()
        model.zero_grad(set_to_none=True)
        with brcompile.window(calls=len(mbs), max_bytes=bound) as w:
            for i, mb in enumerate(mbs):
                (fn(model, *grpo_args(mb)) / len(mbs)).backward()
                if i == len(mbs) - 2:
                    kept[bound] = w.stats()["kept_bytes"]
            st = w.stats()
        got = [p.grad for p in model.parameters()]
        assert_grads_exact(got, want, [n for n, _ in model.named_parameters()], torch.float64)
        s = brcompile.stats()
        assert s.window_replayed_tokens > 0 and s.windows == 1, str(s)
        assert st["recomputed_tokens"] == (st["computed_tokens"] if bound == 0 else 0), st
        assert s.window_recomputed_tokens == st["recomputed_tokens"]
        torch._dynamo.reset()
    assert 0 < kept[0] < kept[None], kept


def test_no_grad_calls_share_forward_across_the_window():
    """No-grad calls inside a window (old / reference log-probs computed in micro-batches) share forward across
    calls: outputs equal eager, prompt tokens replayed from an earlier no-grad call, no backward waits; after a
    parameter write the no-grad store starts over (never a stale value)."""
    b = batch()
    mbs = micro_batches(b, 2)
    model = gpt()
    fn = compiled()
    with torch.no_grad():
        want = [grpo_loss(model, *grpo_args(mb)) for mb in mbs]
    brcompile.reset_stats()
    with brcompile.window(calls=1) as w:
        with torch.no_grad():
            got = [fn(model, *grpo_args(mb)) for mb in mbs]
        assert not w.pending and w.stats()["no_grad_calls"] == len(mbs)
        s = brcompile.stats()
        assert s.window_no_grad_calls == len(mbs) and s.window_replayed_tokens > 0 and s.window_calls == 0, str(s)
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
            want2 = grpo_loss(model, *grpo_args(mbs[1]))
            got2 = fn(model, *grpo_args(mbs[1]))
        torch.testing.assert_close(got2, want2, rtol=1e-10, atol=1e-12)
        assert brcompile.stats().window_replayed_tokens == s.window_replayed_tokens  # nothing stale replayed


def test_dpo_chosen_and_rejected_in_separate_calls():
    """DPO with chosen and rejected rows in two calls of one window (one backward of the pair loss) and the frozen
    reference (the same code, other weights) under no_grad in the same window: the rejected call replays the
    prompts the chosen call computed; the reference never replays the policy's tokens (a window compares the
    trunk's inputs: other parameters, another store). Loss and every gradient equal eager."""
    from examples import dpo

    policy = gpt()
    reference = dpo.make_reference(policy, seed=1)
    b = dpo.make_dpo_batch(num_pairs=3, prompt_len=(6, 10), response_len=(2, 5), vocab_size=61, seed=2)
    P = 3
    halves = [{k: v[:P] for k, v in b.items()}, {k: v[P:] for k, v in b.items()}]

    def step(logps_fn):
        args = [(h["input_ids"], h["attention_mask"], h["completion_mask"]) for h in halves]
        pol = [logps_fn(policy, *a) for a in args]
        with torch.no_grad():
            ref = [logps_fn(reference, *a) for a in args]
        return dpo.dpo_loss(pol[0], pol[1], ref[0], ref[1], beta=0.5)

    params = list(policy.parameters())
    want_loss = step(dpo.sequence_logprobs)
    want = torch.autograd.grad(want_loss, params)
    fn = torch.compile(dpo.sequence_logprobs, backend=brcompile.backend(mode="replay", compiler="eager"),
                       dynamic=True)
    brcompile.reset_stats()
    with brcompile.window(calls=2):
        loss = step(fn)
        loss.backward()
    torch.testing.assert_close(loss.detach(), want_loss.detach(), rtol=1e-10, atol=1e-12)
    assert_grads_exact([p.grad for p in params], list(want), [n for n, _ in policy.named_parameters()], torch.float64)
    s = brcompile.stats()
    assert s.window_calls == 2 and s.window_no_grad_calls == 2 and s.windows == 1, str(s)
    assert s.window_replayed_tokens > 0 and s.fallback_calls == 0, str(s)


def test_two_models_of_one_code_never_share_a_store():
    """Two models of the same architecture (other weights) through one compiled function inside one window, both
    with grad: each shares with its own calls only; every gradient of both equals eager."""
    a, c = gpt(), GPT(GPTConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48),
                      seed=5).double()
    b = batch()
    mbs = micro_batches(b, 4)
    want = {id(m): accumulate(m, grpo_loss, mbs) for m in (a, c)}
    fn = compiled()
    for m in (a, c):
        m.zero_grad(set_to_none=True)
    brcompile.reset_stats()
    with brcompile.window(calls=2 * len(mbs)):
        for mb in mbs:
            for m in (a, c):
                (fn(m, *grpo_args(mb)) / len(mbs)).backward()
    for m in (a, c):
        assert_grads_exact([p.grad for p in m.parameters()], want[id(m)], [n for n, _ in m.named_parameters()],
                           torch.float64)
    s = brcompile.stats()
    assert s.window_calls == 2 * len(mbs) and s.window_replayed_tokens > 0, str(s)


def test_plan_window_cuts_segments_at_the_replayed_prefix():
    """One chain 0..5 with two leaves, tokens 0..2 replayed: the new part of the root segment is a chunk segment
    that sees cache keys [0, 3); each leaf sees them too (through the root's cross row)."""
    # tree: 0-1-2-3 then leaves 4 and 5 under 3: segments (0,4,6), (4,5,5), (5,6,6)
    end = torch.tensor([6, 6, 6, 6, 5, 6])
    segments = torch.tensor([[0, 4, 6], [4, 5, 5], [5, 6, 6]])
    cached = torch.tensor([True, True, True, False, False, False])
    slots = torch.tensor([7, 8, 9, -1, -1, -1])
    plan = plan_window(end, segments, cached, slots)
    assert plan.new_ids.tolist() == [3, 4, 5] and plan.slots.tolist() == [7, 8, 9]
    assert plan.segments.tolist() == [[0, 1, 3], [1, 2, 2], [2, 3, 3]]
    assert plan.end.tolist() == [3, 2, 3]
    assert plan.cross.tolist() == [[0, 3, 0, 3]]


def test_hf_qwen2_compiled_alone_shares_across_calls():
    """A HF Qwen2 compiled alone (TRL's way: per-token log-probs from the logits outside the graph), rows of one
    group over calls of one row: exact against eager accumulation, prompt tokens replayed."""
    model = hf_tiny_model("qwen2")
    b = batch(num_prompts=1, group_size=4)
    mbs = micro_batches(b, 1)

    def loss(fwd, mb):
        logits = fwd(mb["input_ids"], mb["attention_mask"])
        lp = logits[:, :-1].log_softmax(-1).gather(-1, mb["input_ids"][:, 1:, None]).squeeze(-1)
        m = mb["completion_mask"][:, 1:].to(lp.dtype)
        return -(lp * m * mb["advantages"][:, None]).sum() / m.sum()

    def run(fwd):
        model.zero_grad(set_to_none=True)
        for mb in mbs:
            (loss(fwd, mb) / len(mbs)).backward()
        return [p.grad.clone() for p in model.parameters()]

    with KeepFloat64():
        want = run(lambda ids, am: model(input_ids=ids, attention_mask=am).logits)
        fwd = torch.compile(lambda ids, am: model(input_ids=ids, attention_mask=am).logits,
                            backend=brcompile.backend(mode="replay", compiler="eager"), dynamic=True)
        brcompile.reset_stats()
        with brcompile.window(calls=len(mbs)):
            got = run(fwd)
    assert_grads_exact(got, want, [n for n, _ in model.named_parameters()], torch.float64)
    s = brcompile.stats()
    assert s.fallback_calls == 0 and s.window_calls == len(mbs) and s.window_replayed_tokens > 0, str(s)


def test_explain_shows_each_window():
    """explain()'s report has one row per window its run closed: calls, rows, tokens replayed and computed, peak
    bytes kept; the streaming table says the graph shares across calls."""
    from brcompile.tools.explain import recording

    b = batch()
    mbs = micro_batches(b, 2)
    model = gpt()
    with recording(brcompile.backend(mode="replay", compiler="eager"), measure=False) as rec:
        fn = torch.compile(grpo_loss, backend="branch_replay", dynamic=True)
        for _ in range(2):
            with brcompile.window(calls=len(mbs)):
                accumulate(model, fn, mbs)
    report = rec.report()
    assert [w["calls"] for w in report.windows] == [len(mbs)] * 2, report.windows
    assert all(w["replayed_tokens"] > 0 and w["computed_tokens"] > 0 and w["peak_bytes"] > 0 and not w["pending"]
               for w in report.windows), report.windows
    text = report.render_text(code=False)
    assert "cross-call windows (brcompile.window" in text and "shares across calls" in text
