"""End-to-end: the LM head's log-probs fused into brcompile::packed_logprob (passes/emit/fuse_logprob.py).

Every test compiles a loss through ``branch_replay`` (AOTAutograd over the packed graph), compares the
loss and every parameter gradient with the eager dense run (and, where stated, with the unfused packed
graph), and asserts that the batch was replayed and that the fused op is (or is not) in the packed graph.
"""
import pytest
import torch
import torch.nn.functional as F

import brcompile
from brcompile.testing import TOLERANCE, rel_err
from examples.gpt import GPT, GPTConfig
from examples.grpo import grpo_loss, make_grpo_batch, masked_nll_loss
from tests.helpers import grpo_args

TOL = TOLERANCE  # the contract's bound per dtype (brcompile.testing)
V = 61




def make_model(dtype=torch.float64, **kw):
    cfg = dict(vocab_size=V, dim=24, n_layers=1, n_heads=3, n_kv_heads=1, hidden_dim=40)
    cfg.update(kw)
    return GPT(GPTConfig(**cfg), seed=0).to(dtype)


def batch(dtype=torch.float64, seed=1, **kw):
    spec = dict(num_prompts=2, group_size=4, prompt_len=(5, 8), response_len=(2, 5), shared_response_prefix=1)
    spec.update(kw)
    return make_grpo_batch(vocab_size=V, seed=seed, dtype=dtype, **spec)


def compiled_run(fn, model, args, **options):
    """(loss, grads, backend record) of ``fn`` through branch_replay with aot_eager and ``options``."""
    torch._dynamo.reset()
    be = brcompile.backend(compiler="aot_eager", **options)
    out = torch.compile(fn, backend=be)(model, *args)
    grads = torch.autograd.grad(out, list(model.parameters()))
    (rec,) = be.records
    return out.detach(), grads, rec


def assert_same(got, want, dtype, what):
    (loss, grads), (rloss, rgrads) = got, want
    err = rel_err(loss, rloss)
    assert err <= TOL[dtype], f"{what}: loss relative error {err:.2e}"
    for i, (a, b) in enumerate(zip(grads, rgrads)):
        err = rel_err(a, b)
        assert err <= TOL[dtype], f"{what}: grad {i} relative error {err:.2e}"


def check(fn, model, args, dtype=torch.float64, fused=True, calls=1):
    """Fused vs eager dense, and fused vs the unfused packed graph; the rewrite ran and fused as expected."""
    ref = fn(model, *args)
    eager = (ref.detach(), torch.autograd.grad(ref, list(model.parameters())))
    brcompile.reset_stats()
    loss, grads, rec = compiled_run(fn, model, args)
    s = brcompile.stats()
    assert s.replayed_calls == calls and s.fallback_calls == 0, str(s)
    assert rec.rewritten
    if fused:
        assert rec.fused and "brcompile.packed_logprob" in rec.packed_code, rec.packed_code
        assert "log_softmax" not in rec.packed_code and "cross_entropy" not in rec.packed_code
    else:
        assert not rec.fused and "packed_logprob" not in rec.packed_code
    assert_same((loss, grads), eager, dtype, "fused vs eager")
    uloss, ugrads, urec = compiled_run(fn, model, args, fuse_logprob=False)
    assert not urec.fused and "packed_logprob" not in urec.packed_code
    assert_same((loss, grads), (uloss, ugrads), dtype, "fused vs unfused")
    return rec


# ------------------------------------------------------------------------------------------ the examples


@pytest.mark.parametrize("spec", [
    dict(),
    dict(num_prompts=1, group_size=7, prompt_len=9, response_len=(1, 4), shared_response_prefix=0),
    dict(num_prompts=2, group_size=3, prompt_len=(4, 9), response_len=(2, 5), left_pad_prompts=True,
         shared_response_prefix=0),
], ids=["shared_response", "one_branch_point_many_targets", "left_padded"])
def test_grpo_loss_float64(spec):
    model = make_model()
    rec = check(grpo_loss, model, grpo_args(batch(**spec)))
    (line,) = rec.fused
    assert "-> gather" in line and "bytes per packed token" in line
    assert not rec.lazy_gathers


def test_grpo_loss_float32_tied_embeddings():
    model = make_model(torch.float32, tie_embeddings=True)
    check(grpo_loss, model, grpo_args(batch(torch.float32, seed=2)), dtype=torch.float32)


def test_masked_nll_cross_entropy_is_fused():
    """F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1), reduction='none')."""
    model = make_model()
    b = batch(seed=3)
    rec = check(masked_nll_loss, model, (b["input_ids"], b["completion_mask"]))
    assert "-> cross_entropy" in rec.fused[0]
    # only the targets are materialised (B * L ints), not the [B, L - 1, V] logits
    assert all(numel <= b["input_ids"].numel() for _, _, numel, _ in rec.materialisations), rec.materialisations


def identical_rows_batch():
    """Two identical rows (every token read twice with the same target) plus a branching group."""
    b = batch(seed=4, num_prompts=1, group_size=4, prompt_len=6, response_len=(2, 4))
    for k in b:
        if b[k].dim() >= 1 and b[k].shape[0] == 4:
            b[k] = torch.cat([b[k], b[k][:1]])
    return b


def test_identical_rows_and_padding():
    model = make_model()
    check(grpo_loss, model, grpo_args(identical_rows_batch()))


# ------------------------------------------------------------------- temperature, soft-cap, entropy, CE


def temperature_loss(model, ids, attention_mask, completion_mask, advantages, old_logprobs):
    """TRL-style: logits[:, :-1] / T, log_softmax, gather, masked mean of -A * logp."""
    logits = model(ids, attention_mask)
    logits = logits[:, :-1, :] / 0.7
    logp = F.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    mask = completion_mask[:, 1:].to(logp.dtype)
    return -((logp * advantages[:, None] * mask).sum() / mask.sum())


def softcap_entropy_loss(model, ids, attention_mask, completion_mask, advantages, old_logprobs):
    """Gemma-2 soft-cap in the model, temperature and an entropy bonus in the loss (entropy read after
    the gather, p = logp.exp())."""
    logits = model(ids, attention_mask)
    logits = torch.tanh(logits / 3.0) * 3.0
    logp_all = torch.log_softmax(logits[:, :-1] * 1.25, dim=-1)
    logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    mask = completion_mask[:, 1:].to(logp.dtype)
    ratio = torch.exp(logp - old_logprobs)
    return -((ratio * advantages[:, None] + 0.01 * entropy) * mask).sum() / mask.sum()


def softmax_entropy_keepdim_loss(model, ids, attention_mask, completion_mask, advantages, old_logprobs):
    """Entropy via softmax(logits) and keepdim=True, negated before the sum."""
    logits = model(ids, attention_mask)[:, :-1]
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, ids[:, 1:, None])
    entropy = (-(F.softmax(logits, dim=-1) * logp_all)).sum(-1, keepdim=True)
    mask = completion_mask[:, 1:, None].to(logp.dtype)
    return -((logp * advantages[:, None, None] - 0.1 * entropy) * mask).sum() / mask.sum()


def tensor_temperature_loss(model, ids, attention_mask, completion_mask, advantages, old_logprobs, temperature):
    """The temperature as a 0-d tensor input (CONST): folded into the head weight."""
    logits = model(ids, attention_mask)[:, :-1] / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = completion_mask[:, 1:].to(logp.dtype)
    return -((logp * advantages[:, None] * mask).sum() / mask.sum())


def ce_mean_ignore_index_loss(model, ids, attention_mask, completion_mask, advantages, old_logprobs):
    """SFT-style labels: -100 on prompt and padding; mean reduction over the non-ignored targets."""
    logits = model(ids, attention_mask)
    labels = ids.masked_fill(completion_mask == 0, -100)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


@pytest.mark.parametrize("fn", [temperature_loss, softcap_entropy_loss, softmax_entropy_keepdim_loss,
                                ce_mean_ignore_index_loss], ids=lambda f: f.__name__)
def test_loss_variants_float64(fn):
    model = make_model()
    rec = check(fn, model, grpo_args(batch(seed=5)))
    if "entropy" in fn.__name__:
        assert "entropy" in rec.fused[0]
    if fn is softcap_entropy_loss:
        assert "softcap 3" in rec.fused[0] and "scale 1.25" in rec.fused[0]


def test_tensor_temperature_folded_into_weight():
    model = make_model()
    rec = check(tensor_temperature_loss, model, grpo_args(batch(seed=6)) + (torch.tensor(0.6, dtype=torch.float64),))
    assert "folded into the weight" in rec.fused[0]


def test_softcap_entropy_float32_with_bias():
    """A head with a bias, float32."""
    model = make_model(torch.float32)
    model.lm_head = torch.nn.Linear(24, V, bias=True)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
        model.lm_head.bias.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
    check(softcap_entropy_loss, model, grpo_args(batch(torch.float32, seed=7)), dtype=torch.float32)


def logits_to_keep_loss(model, ids, attention_mask, completion_mask, advantages, old_logprobs):
    """HF's logits_to_keep: the head runs on hidden[:, -k - 1:]; then the shift [:, :-1]."""
    h = model.tok_emb(ids)
    B, L = ids.shape
    cos, sin = model.rotary_cos_sin(L, ids.device, h.dtype)
    for layer in model.layers:
        h = layer(h, cos, sin)
    h = model.norm(h)
    k = 6
    logits = model.lm_head(h[:, -k - 1:, :])[:, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, -k:, None]).squeeze(-1)
    return -(logp * advantages[:, None]).mean()


def test_logits_to_keep_window():
    model = make_model()
    check(logits_to_keep_loss, model, grpo_args(batch(seed=8, response_len=(6, 8))))


# ------------------------------------------------------------------------------- not fused, still exact


def logits_reused_loss(model, ids, attention_mask, completion_mask, advantages, old_logprobs):
    """The log-probs are used beyond the gather (a KL to uniform): nothing to save, keep the lazy gather."""
    logp_all = torch.log_softmax(model(ids, attention_mask)[:, :-1], -1)
    logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    kl = -logp_all.mean(-1)
    return -(logp * advantages[:, None]).mean() + 0.1 * kl.mean()


def entropy_read_first_loss(model, ids, attention_mask, completion_mask, advantages, old_logprobs):
    """The entropy's dense use precedes the gather: the fused op would come too late for it."""
    logp_all = torch.log_softmax(model(ids, attention_mask)[:, :-1], -1)
    ent_mean = (-(logp_all.exp() * logp_all).sum(-1) * completion_mask[:, 1:]).mean()
    logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return -(logp * advantages[:, None]).mean() - 0.01 * ent_mean


@pytest.mark.parametrize("fn", [logits_reused_loss, entropy_read_first_loss], ids=lambda f: f.__name__)
def test_other_users_keep_the_unfused_path(fn):
    model = make_model()
    rec = check(fn, model, grpo_args(batch(seed=9)), fused=False)
    assert rec.lazy_gathers


def test_option_off_and_explain():
    model = make_model()
    b = batch(seed=10)
    report = brcompile.explain(grpo_loss, model, *grpo_args(b), backend=brcompile.backend(compiler="eager"))
    (g,) = report.to_dict()["graphs"]
    assert g["fused"] and "brcompile::packed_logprob" in g["fused"][0] and not g["lazy_gathers"]
    assert "packed_logprob" in str(report)
    report = brcompile.explain(grpo_loss, model, *grpo_args(b),
                               backend=brcompile.backend(compiler="eager", fuse_logprob=False))
    (g,) = report.to_dict()["graphs"]
    assert not g["fused"] and g["lazy_gathers"] == ["gather"]


def test_dynamic_two_batches_one_compile():
    """One captured graph and one packed compile serve two batches of different B, L and N."""
    model = make_model()
    be = brcompile.backend(compiler="aot_eager")
    compiled = torch.compile(grpo_loss, backend=be, dynamic=True)
    params = list(model.parameters())
    for seed, spec in ((11, dict()), (12, dict(num_prompts=3, group_size=2, prompt_len=(3, 6)))):
        b = {k: v.clone() for k, v in batch(seed=seed, **spec).items()}
        ref = grpo_loss(model, *grpo_args(b))
        gref = torch.autograd.grad(ref, params)
        out = compiled(model, *grpo_args(b))
        gout = torch.autograd.grad(out, params)
        assert_same((out.detach(), gout), (ref.detach(), gref), torch.float64, f"batch {seed}")
    s = brcompile.stats()
    assert s.replayed_calls == 2 and s.compiled_graphs == 1, str(s)
    assert be.records[0].fused
