"""Live positions (passes/analysis/liveness.py): positions no output needs leave the tree, by default.

Every case compares the loss and every parameter gradient with the eager run in float64, asserts that the call
replayed, and that the executed token count equals the needed count computed here from first principles:
live[b, t] = the loss reads position t of row b with a nonzero weight; needed = live, or a visible key at or
before the row's last live position; the count is the number of distinct tree nodes holding a needed position.
"""
import pytest
import torch

import brcompile
from brcompile.runtime.tree import build_tree
from examples.gpt import GPT, GPTConfig
from examples.grpo import grpo_loss, grpo_surrogate, make_grpo_batch
from tests.helpers import assert_grads_exact

V = 64


def _needed_count(ids, attention_mask, live):
    """(distinct tree nodes holding a needed position, all tree nodes): the oracle of the module docstring."""
    B, L = ids.shape
    cols = torch.arange(L)
    upto = cols[None] <= torch.where(live, cols, -1).amax(dim=1, keepdim=True)
    if attention_mask is not None:
        upto = upto & attention_mask.bool()
    tree = build_tree([ids], attention_mask=attention_mask)
    return int(tree.index[live | upto].unique().numel()), int(tree.num_tokens)


def _grpo_live(completion_mask):
    """GRPO's loss reads position t (which predicts token t + 1) with weight completion_mask[:, t + 1]."""
    live = torch.zeros_like(completion_mask, dtype=torch.bool)
    live[:, :-1] = completion_mask[:, 1:] != 0
    return live


def _run(fn, model, args):
    model.zero_grad()
    loss = fn(model, *args)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _check(fn, model, args, options=None):
    want = _run(fn, model, args)
    brcompile.reset_stats()
    got = _run(torch.compile(fn, backend=brcompile.backend(compiler="eager", **(options or {}))), model, args)
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12)
    assert_grads_exact(got[1], want[1], [n for n, _ in model.named_parameters()], torch.float64)
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.fallback_calls == 0, s
    return s


@pytest.fixture
def model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=V, dim=32)).to(torch.float64)


def _batch(**kw):
    kw.setdefault("vocab_size", V)
    return make_grpo_batch(num_prompts=2, group_size=4, dtype=torch.float64, **kw)


@pytest.mark.parametrize("left_pad", [False, True], ids=["right_pad", "left_pad"])
def test_grpo_ragged_needed_only(model, left_pad):
    """Ragged responses, right padding (and left-padded prompts): only the needed tokens run."""
    b = _batch(response_len=(2, 16), left_pad_prompts=left_pad, seed=3)
    s = _check(grpo_loss, model, list(b.values()))
    needed, nodes = _needed_count(b["input_ids"], b["attention_mask"], _grpo_live(b["completion_mask"]))
    assert s.executed_tokens == needed < nodes
    assert s.dead_tokens == nodes - needed
    assert 0 < s.live_tokens <= needed


def test_no_attention_mask(model):
    """The model gets no attention mask: right pads after the last live position leave, left pads stay keys."""
    b = _batch(response_len=(2, 16), left_pad_prompts=True, seed=4)

    def loss(m, ids, am, cm, adv, old):
        return grpo_loss(m, ids, am, cm, adv, old, use_attention_mask=False)

    s = _check(loss, model, list(b.values()))
    tree = build_tree([b["input_ids"]])
    live = _grpo_live(b["completion_mask"])
    cols = torch.arange(live.shape[1])
    needed = cols[None] <= torch.where(live, cols, -1).amax(dim=1, keepdim=True)
    assert s.executed_tokens == int(tree.index[needed].unique().numel()) < tree.num_tokens


def test_masked_middle_position_stays_a_key(model):
    """A response position with loss weight 0 in the middle is not live but is needed: later live queries
    attend it."""
    b = _batch(response_len=(6, 12), seed=5)
    cm = b["completion_mask"].clone()
    rows, cols = cm.nonzero(as_tuple=True)
    middle = {}
    for r, c in zip(rows.tolist(), cols.tolist()):
        middle.setdefault(r, []).append(c)
    for r, cs in middle.items():
        cm[r, cs[len(cs) // 2]] = 0
    b["completion_mask"] = cm
    s = _check(grpo_loss, model, list(b.values()))
    needed, nodes = _needed_count(b["input_ids"], b["attention_mask"], _grpo_live(cm))
    assert s.executed_tokens == needed < nodes


def test_all_padding_and_zero_weight_rows_cost_nothing(model):
    """A row that is all padding, and a row whose loss weight is all 0, add no token of their own."""
    b = _batch(response_len=(4, 10), seed=6)
    ids, am, cm = b["input_ids"].clone(), b["attention_mask"].clone(), b["completion_mask"].clone()
    ids[1] = 0
    am[1] = 0
    cm[1] = 0
    ids[6, :] = torch.randint(1, V, (ids.shape[1],), generator=torch.Generator().manual_seed(9))
    am[6] = 1
    cm[6] = 0  # a row of real tokens that the loss does not read at all
    b.update(input_ids=ids, attention_mask=am, completion_mask=cm)
    s = _check(grpo_loss, model, list(b.values()))
    needed, nodes = _needed_count(ids, am, _grpo_live(cm))
    assert s.executed_tokens == needed
    tree = build_tree([ids], attention_mask=am)
    assert not set(tree.index[6].tolist()) & set(tree.index[torch.arange(8) != 6].flatten().tolist()), \
        "row 6 shares nothing with the others"
    assert needed <= nodes - ids.shape[1]  # row 6 alone is L nodes, all dead


def test_slice_drops_positions(model):
    """The loss reads only the last K positions' logits (a logits_to_keep-style slice); ragged padding."""
    b = _batch(response_len=(3, 12), seed=7)
    K = 6

    def loss(m, ids, am, cm, adv, old):
        logits = m(ids, am)[:, -K - 1:-1]
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, -K:, None]).squeeze(-1)
        w = cm[:, -K:].to(logp.dtype)
        return -((logp * w).sum(-1) * adv).mean()

    s = _check(loss, model, list(b.values()))
    L = b["input_ids"].shape[1]
    live = torch.zeros_like(b["attention_mask"], dtype=torch.bool)
    live[:, L - K - 1:L - 1] = b["completion_mask"][:, L - K:] != 0
    needed, nodes = _needed_count(b["input_ids"], b["attention_mask"], live)
    assert s.executed_tokens == needed < nodes


def test_labels_where_kill(model):
    """``labels != -100`` through ``where``: positions whose label is ignored are dead."""
    b = _batch(response_len=(2, 14), seed=8)
    labels = torch.where(b["completion_mask"] != 0, b["input_ids"], -100)

    def loss(m, ids, am, labels):
        logp = torch.log_softmax(m(ids, am)[:, :-1], dim=-1)
        tgt = labels[:, 1:]
        valid = tgt != -100
        nll = -logp.gather(-1, tgt.clamp(min=0)[..., None]).squeeze(-1)
        return torch.where(valid, nll, 0.0).sum() / valid.sum()

    s = _check(loss, model, [b["input_ids"], b["attention_mask"], labels])
    live = torch.zeros_like(labels, dtype=torch.bool)
    live[:, :-1] = labels[:, 1:] != -100
    needed, nodes = _needed_count(b["input_ids"], b["attention_mask"], live)
    assert s.executed_tokens == needed < nodes


def test_liveness_off_keeps_every_node(model):
    """``liveness=False``: every tree node runs (the previous behaviour), still exact."""
    b = _batch(response_len=(2, 16), seed=3)
    s = _check(grpo_loss, model, list(b.values()), {"liveness": False})
    tree = build_tree([b["input_ids"]], attention_mask=b["attention_mask"])
    assert s.executed_tokens == tree.num_tokens and s.dead_tokens == 0


def test_streaming_needed_only(model):
    """Streaming replay sees the same smaller tree."""
    b = _batch(response_len=(2, 16), seed=3)
    s = _check(grpo_loss, model, list(b.values()), {"mode": "replay", "chunk_tokens": 8})
    assert s.streamed_calls == 1
    needed, nodes = _needed_count(b["input_ids"], b["attention_mask"], _grpo_live(b["completion_mask"]))
    assert s.executed_tokens == needed < nodes


def test_model_only_drops_padding_by_default(model):
    """A model compiled without its loss (TRL's way): positions whose attention-mask bit is 0 leave the tree,
    outputs there are 0, and the eager loss's gradients are exact."""
    b = _batch(response_len=(2, 16), left_pad_prompts=True, seed=3)
    ids, am, cm, adv, old = b.values()
    compiled = torch.compile(model, backend=brcompile.backend(compiler="eager"))

    def loss_with(m):
        logits = m(ids, am)
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return grpo_surrogate(logp, cm, adv, old), logits

    model.zero_grad()
    want, want_logits = loss_with(model)
    want.backward()
    want_g = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    brcompile.reset_stats()
    got, got_logits = loss_with(compiled)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert_grads_exact([p.grad for p in model.parameters()], want_g, [n for n, _ in model.named_parameters()],
                       torch.float64)
    valid = am.bool()
    torch.testing.assert_close(got_logits[valid], want_logits[valid], rtol=1e-10, atol=1e-12)
    assert bool((got_logits[~valid] == 0).all())
    s = brcompile.stats()
    tree = build_tree([ids], attention_mask=am)
    assert s.replayed_calls == 1 and s.executed_tokens == int(tree.valid.sum()) < tree.num_tokens


def test_model_only_reading_padding_raises(model):
    """A loss that reads the model's outputs at padded positions gets the clear error naming the option."""
    from brcompile.backends.read_packed.op import DroppedPositionGradError

    b = _batch(response_len=(2, 16), seed=3)
    compiled = torch.compile(model, backend=brcompile.backend(compiler="eager"))
    out = compiled(b["input_ids"], b["attention_mask"])
    with pytest.raises(DroppedPositionGradError, match="drop_padding=False"):
        out.sum().backward()
    model.zero_grad()
    torch._dynamo.reset()
    dense = torch.compile(model, backend=brcompile.backend(compiler="eager", drop_padding=False))
    out = dense(b["input_ids"], b["attention_mask"])
    torch.testing.assert_close(out, model(b["input_ids"], b["attention_mask"]), rtol=1e-10, atol=1e-12)


def test_transposed_frame(model):
    """The loss works on [L, B] (position first): the killer mask is read in that frame."""
    b = _batch(response_len=(2, 14), seed=10)

    def loss(m, ids, am, cm, adv, old):
        logp = torch.log_softmax(m(ids, am)[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        w = cm[:, 1:].to(logp.dtype).t()
        return -((logp.t() * w).sum(0) * adv).mean()

    s = _check(loss, model, list(b.values()))
    needed, nodes = _needed_count(b["input_ids"], b["attention_mask"], _grpo_live(b["completion_mask"]))
    assert s.executed_tokens == needed < nodes


def test_nonzero_frames():
    """Nonzero: a per-call value aligned to its frame, any() over the other dims, row first."""
    from brcompile.passes.analysis.liveness import Frame, _nonzero

    m = torch.tensor([[[0, 1], [0, 0], [2, 0]]])  # [1, 3, 2]: read in a frame [P=3, B=2, V] -> pos 0, row 1
    got = _nonzero(m[0][..., None].expand(3, 2, 5), Frame(3, 1, 0), zero=False)
    assert torch.equal(got, torch.tensor([[False, False, True], [True, False, False]]))
    assert torch.equal(_nonzero(torch.tensor([1, 0, 3]), Frame(2, 0, 1), zero=True),
                       torch.tensor([[False, True, False]]))
    assert torch.equal(_nonzero(torch.tensor([[0], [2]]), Frame(2, 0, None), zero=False),
                       torch.tensor([[False], [True]]))
    assert torch.equal(_nonzero(torch.tensor([0, 2]), Frame(2, 0, None), zero=False), torch.tensor([[True]]))


def test_hf_qwen2_trl_way_logits_to_keep(float64_norms):
    """HF Qwen2 compiled alone and called TRL's way (left-padded prompts, right-padded completions,
    ``logits_to_keep`` = completion length + 1, the loss eager on the returned logits): the pads leave the tree,
    the kept window's LM head runs densely, and the loss and every gradient are the eager run's."""
    from tests.helpers import hf_tiny_model

    model = hf_tiny_model("qwen2")
    b = _batch(response_len=(2, 12), left_pad_prompts=True, seed=11, vocab_size=model.config.vocab_size)
    ids, am, cm, adv, old = b.values()
    L = ids.shape[1]
    C = int((cm.cumsum(1) > 0).float().argmax(1).min())  # first completion column of any row
    K = L - C

    def loss_with(m):
        logits = m(input_ids=ids, attention_mask=am, logits_to_keep=K + 1, use_cache=False).logits[:, :-1]
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, C:, None]).squeeze(-1)
        w = cm[:, C:].to(logp.dtype)
        return -((logp * w).sum(-1) / w.sum(-1).clamp(min=1) * adv).mean()

    model.zero_grad()
    want = loss_with(model)
    want.backward()
    want_g = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    brcompile.reset_stats()
    model.model.compile(backend=brcompile.backend(compiler="eager"))
    got = loss_with(model)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert_grads_exact([p.grad for p in model.parameters()], want_g, [n for n, _ in model.named_parameters()],
                       torch.float64)
    s = brcompile.stats()
    assert s.replayed_calls >= 1 and s.fallback_calls == 0, s
    tree = build_tree([ids], attention_mask=am)
    assert s.executed_tokens == int(tree.valid.sum()) < tree.num_tokens
