"""End-to-end exactness of ``torch.compile(..., backend="branch_replay")`` on the example GPT.

The oracle is the same function run eagerly on the dense batch. Every test compares the loss (or logits)
and every parameter gradient, and asserts through ``brcompile.stats()`` that the rewrite actually ran
(or that it fell back with the expected reason), so a silent fallback cannot pass.
"""
import pytest
import torch
import torch.nn.functional as F

import brcompile
from brcompile.backend import Compiled
from brcompile.testing import TOLERANCE, assert_exact
from examples.gpt import GPT, GPTConfig
from examples.grpo import grpo_loss, make_grpo_batch, masked_nll_loss
from tests.helpers import assert_replayed, grpo_needed_tokens

TOL = TOLERANCE  # the contract's bound per dtype (brcompile.testing)
# AOTAutograd over the packed graph (no Inductor codegen) keeps the suite fast on 2 cores; the default
# compiler (inductor, dynamic shapes) has its own tests below.
BACKEND = brcompile.backend(compiler="aot_eager")






def make_model(dtype=torch.float64, **kw):
    cfg = dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48)
    cfg.update(kw)
    return GPT(GPTConfig(**cfg), seed=0).to(dtype)


def run_both(model, loss_fn, args, *, dynamic=None, backend=BACKEND):
    """(eager loss, eager grads, compiled loss, compiled grads)."""
    params = [p for p in model.parameters()]
    ref = loss_fn(model, *args)
    gref = torch.autograd.grad(ref, params)
    compiled = torch.compile(loss_fn, backend=backend, dynamic=dynamic)
    out = compiled(model, *args)
    gout = torch.autograd.grad(out, params)
    return ref, gref, out, gout


def check_exact(model, loss_fn, args, dtype=torch.float64, **kw):
    ref, gref, out, gout = run_both(model, loss_fn, args, **kw)
    assert_exact(out.detach(), ref.detach(), dtype, "loss")
    for (name, _), a, b in zip(model.named_parameters(), gout, gref):
        assert_exact(a, b, dtype, f"grad of {name}")


def grpo_args(batch, use_mask=True):
    return (batch["input_ids"], batch["attention_mask"], batch["completion_mask"], batch["advantages"],
            batch["old_logprobs"], 0.2, use_mask)


BATCHES = {
    "one_group": dict(num_prompts=1, group_size=6, prompt_len=13, response_len=(3, 7)),
    "many_groups": dict(num_prompts=3, group_size=3, prompt_len=(5, 11), response_len=(2, 6)),
    "shared_response": dict(num_prompts=2, group_size=4, prompt_len=(6, 9), response_len=(4, 7),
                            shared_response_prefix=3),
    "left_padded": dict(num_prompts=2, group_size=3, prompt_len=(4, 9), response_len=(2, 5),
                        left_pad_prompts=True),
}


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_grpo_loss_exact_float64(name):
    model = make_model()
    batch = make_grpo_batch(vocab_size=61, seed=1, dtype=torch.float64, **BATCHES[name])
    check_exact(model, grpo_loss, grpo_args(batch))
    assert_replayed()


def test_grpo_loss_exact_float32_tied_head():
    model = make_model(torch.float32, tie_embeddings=True)
    batch = make_grpo_batch(vocab_size=61, seed=2, dtype=torch.float32, **BATCHES["many_groups"])
    check_exact(model, grpo_loss, grpo_args(batch), dtype=torch.float32)
    assert_replayed()


def test_grpo_causal_only_right_padding():
    """No attention mask: right padding is harmless under a causal mask (pads only follow real tokens)."""
    model = make_model()
    batch = make_grpo_batch(vocab_size=61, seed=3, dtype=torch.float64, **BATCHES["shared_response"])
    check_exact(model, grpo_loss, grpo_args(batch, use_mask=False))
    assert_replayed()


def nested_batch():
    """Rows that branch at several depths: a shared prompt, two sub-groups sharing 3 response tokens,
    inside one of them a further split, plus two identical rows and a row sharing nothing."""
    g = torch.Generator().manual_seed(5)
    tok = lambda n: torch.randint(1, 61, (n,), generator=g)  # noqa: E731
    p, a, b, c = tok(7), tok(3), tok(3), tok(2)
    rows = [
        torch.cat([p, a, c, tok(2)]), torch.cat([p, a, c, tok(2)]), torch.cat([p, a, tok(4)]),
        torch.cat([p, b, tok(4)]), torch.cat([p, b, tok(4)]),
    ]
    rows.append(rows[-1].clone())  # identical rows
    rows.append(tok(14))  # nothing shared
    ids = torch.stack(rows)
    mask = torch.ones_like(ids)
    mask[2, -1] = 0  # one right-padded row
    return ids, mask


def test_nested_identical_and_unshared_rows():
    model = make_model()
    ids, mask = nested_batch()
    check_exact(model, masked_nll_loss, (ids, mask))
    assert_replayed()


def test_model_only_logits_exact():
    """Compile the model alone: logits come out dense, equal at every real position and 0 at the padding that
    left the tree (drop_padding, the default); gradients of a loss over the real positions are exact."""
    model = make_model()
    batch = make_grpo_batch(vocab_size=61, seed=4, **BATCHES["left_padded"])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    ref = model(ids, mask)
    out = torch.compile(model, backend=BACKEND)(ids, mask)
    real = mask.bool()
    assert_exact(out[real], ref[real], torch.float64, "logits")
    assert bool((out[~real] == 0).all())
    assert_replayed()
    w = torch.randn_like(ref) * real[..., None]
    gref = torch.autograd.grad((ref * w).sum(), list(model.parameters()))
    gout = torch.autograd.grad((out * w).sum(), list(model.parameters()))
    for (name, _), a, b in zip(model.named_parameters(), gout, gref):
        assert_exact(a, b, torch.float64, f"grad of {name}")


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_default_backend_two_batch_shapes(dynamic):
    """The entry-point backend with its defaults (packed graph compiled by Inductor with dynamic shapes):
    batches of different B, L and N, each exact and replayed; with dynamic=True one captured graph serves
    both, and the packed graph is compiled once (no recompile per batch)."""
    model = make_model()
    compiled = torch.compile(grpo_loss, backend="branch_replay", dynamic=dynamic)
    params = list(model.parameters())
    for seed, spec in ((6, BATCHES["one_group"]), (7, BATCHES["many_groups"])):
        batch = make_grpo_batch(vocab_size=61, seed=seed, dtype=torch.float64, **spec)
        # clone: `advantages` is a view whose base's shape Dynamo would guard on (duck sizing)
        args = grpo_args({k: v.clone() for k, v in batch.items()})
        ref = grpo_loss(model, *args)
        gref = torch.autograd.grad(ref, params)
        out = compiled(model, *args)
        gout = torch.autograd.grad(out, params)
        assert_exact(out.detach(), ref.detach(), torch.float64, "loss")
        for a, b in zip(gout, gref):
            assert_exact(a, b, torch.float64, "grad")
    s = brcompile.stats()
    assert s.replayed_calls == 2 and s.fallback_calls == 0, str(s)
    assert s.compiled_graphs == (1 if dynamic else 2), str(s)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_packed_graph_runs_compiled(compiler):
    """The packed graph runs through the compiler it was given: after a replayed call, Dynamo holds a compiled
    entry for the packed graph's own code. (The packed graph is built while Dynamo converts the frame, and
    Dynamo marks FX code made then as never to compile: compiled as built, it ran uncompiled without notice,
    and only the functions it calls were compiled, one frame each.)"""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    model = make_model()
    batch = make_grpo_batch(vocab_size=61, seed=6, dtype=torch.float64, **BATCHES["one_group"])
    args = grpo_args(batch)
    backend = brcompile.backend(compiler=compiler)
    loss = torch.compile(grpo_loss, backend=backend)(model, *args)
    loss.backward()
    assert_exact(loss.detach(), grpo_loss(model, *args).detach(), torch.float64, "loss")
    assert_replayed()
    runs = [r.runtime.packed for r in backend.records if r.runtime is not None]
    assert len(runs) == 1 and isinstance(runs[0], Compiled), runs
    assert _debug_get_cache_entry_list(runs[0].gm.forward.__code__), "the packed graph ran uncompiled"


@pytest.mark.parametrize("spec", [dict(num_prompts=3, group_size=1, prompt_len=6, response_len=3),
                                  dict(num_prompts=1, group_size=1, prompt_len=9, response_len=4)],
                         ids=["no_sharing", "G1"])
def test_no_sharing_falls_back_exactly(spec):
    """Rows that share nothing: with every position computed (liveness=False) the batch shares too little and
    the original graph runs, exactly; by default the positions the loss does not read still leave the tree, so
    the call replays, exactly, running only the needed tokens."""
    model = make_model()
    batch = make_grpo_batch(vocab_size=61, seed=8, dtype=torch.float64, **spec)
    # one response per prompt normalises every advantage to 0, and the loss then needs no position at all
    # (tests/passes/analysis/test_liveness.py): nonzero advantages keep the positions this test is about
    batch["advantages"] = torch.linspace(0.5, 1.5, batch["advantages"].numel(), dtype=torch.float64)
    check_exact(model, grpo_loss, grpo_args(batch), backend=brcompile.backend(compiler="aot_eager", liveness=False))
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls == 1, str(s)
    assert s.fallback_codes == {brcompile.Code.SHARES_TOO_LITTLE: 1}, str(s)
    torch._dynamo.reset()
    brcompile.reset_stats()
    check_exact(model, grpo_loss, grpo_args(batch))
    s = brcompile.stats()
    ids, am, cm = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    assert s.replayed_calls == 1 and s.executed_tokens == grpo_needed_tokens(ids, am, cm) < ids.numel(), str(s)


# ------------------------------------------------------------------------------------------------
# graphs that must not be rewritten


class TinyLM(torch.nn.Module):
    """A one-layer causal LM with a switchable defect in the body."""

    def __init__(self, defect=None, V=37, d=16):
        super().__init__()
        self.defect = defect
        self.emb = torch.nn.Embedding(V, d)
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.head = torch.nn.Linear(d, V, bias=False)

    def forward(self, ids):
        B, L = ids.shape
        x = self.emb(ids)
        if self.defect == "dropout":
            x = F.dropout(x, p=0.5, training=True)
        if self.defect == "mix_rows":
            x = x + x.mean(0)
        q, k, v = self.qkv(x).view(B, L, 3, 2, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=self.defect != "bidirectional")
        return self.head(o.transpose(1, 2).reshape(B, L, -1))


def lm_loss(model, ids):
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("defect,code", [
    ("dropout", brcompile.Code.RANDOM_DRAW),
    ("mix_rows", brcompile.Code.ATTENTION_UNPACKED),
    ("bidirectional", brcompile.Code.MASK_NOT_CAUSAL),
])
def test_unsafe_graphs_fall_back_with_reason(defect, code):
    torch.manual_seed(0)
    model = TinyLM(defect).double()
    ids = torch.cat([torch.randint(1, 37, (1, 6)).expand(4, 6), torch.randint(1, 37, (4, 3))], 1)
    if defect == "dropout":  # random: compare with the eager original under the same RNG state
        torch.manual_seed(1)
        ref = lm_loss(model, ids)
        torch.manual_seed(1)
        out = torch.compile(lm_loss, backend=BACKEND)(model, ids)
        assert_exact(out.detach(), ref.detach(), torch.float64, "loss")
    else:
        check_exact(model, lm_loss, (ids,))
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls >= 1, str(s)
    assert code in s.fallback_codes and s.details(code), str(s)


def test_explain_reports_rewrite_and_tree():
    model = make_model()
    batch = make_grpo_batch(vocab_size=61, seed=9, dtype=torch.float64, **BATCHES["one_group"])
    report = brcompile.explain(grpo_loss, model, *grpo_args(batch), backend=brcompile.backend(compiler="eager"))
    text = str(report)
    assert len(report.rewritten) == 1 and not report.fallbacks
    assert "REWRITTEN" in text and "tree_attention" in text and "lazy gather" in text
    assert "causal+keypad" in text
    call = report.to_dict()["calls"][0]
    assert call["replayed"] and call["tree"]["executed_tokens"] < call["tree"]["logical_tokens"]


def test_explain_reports_fallback_reason():
    model = TinyLM("bidirectional").double()
    ids = torch.randint(1, 37, (3, 5))
    report = brcompile.explain(lm_loss, model, ids)
    assert [g.code for g in report.fallbacks] == [brcompile.Code.MASK_NOT_CAUSAL], report.fallbacks
    assert "bidirectional" in str(report)  # the report shows the detail
