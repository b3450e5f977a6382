"""passes/lower/aten.py: the ATen level — a captured graph lowered to its functional pre-dispatch ATen graph and
respelled in the torch-level calls the analysis reads; and the backend's ``level`` option around it.

Writes the Dynamo-level functionalisation does not make pure (through a transpose or reshape view of a
value read again, through an integer-array index) are refused at the Dynamo level and replay at the ATen
level, float64-exact against eager; the lowering computes what the captured graph computes, with its
symbolic sizes; an ATen op without a respelling stays (no rule: materialised); a graph that writes into its
input is refused with that reason.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import brcompile
from brcompile.passes.lower.aten import ATEN_SPELLINGS, aten_ops, lower, lower_and_respell, respell
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.testing import assert_exact
from examples.grpo import grpo_loss, make_grpo_batch
from tests.helpers import assert_replayed, grpo_args

V, D = 50, 16
BATCH = dict(num_prompts=2, group_size=3, prompt_len=(6, 9), response_len=(2, 5), vocab_size=V, seed=1,
             dtype=torch.float64)


class Tiny(nn.Module):
    """One causal SDPA block; subclasses write into the query in ``mix``."""

    uses_mask = True

    def __init__(self, heads: int = 2):
        super().__init__()
        self.emb, self.ln = nn.Embedding(V, D), nn.LayerNorm(D)
        self.q, self.kv, self.o = nn.Linear(D, D), nn.Linear(D, 2 * D), nn.Linear(D, D)
        self.head, self.heads = nn.Linear(D, V, bias=False), heads

    def mix(self, q):
        return q

    def forward(self, ids, attention_mask=None):
        B, L = ids.shape
        h = self.emb(ids)
        x = self.ln(h)
        q, (k, v) = self.mix(self.q(x)), self.kv(x).chunk(2, -1)
        heads = lambda t: t.view(B, L, self.heads, -1).transpose(1, 2)  # noqa: E731
        a = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        return self.head(self.ln(h + self.o(a.transpose(1, 2).reshape(B, L, -1))))


class TransposeWrite(Tiny):
    def mix(self, q):
        qt = q.transpose(1, 2)  # a view of q, which is read again below
        qt[:, :4] *= 2.0
        return q


class ReshapeWrite(Tiny):
    def mix(self, q):
        r = q.reshape(q.shape[0], q.shape[1], 2, -1)
        r[..., 0, :] += 1.0
        return q


class IndexWrite(Tiny):
    def mix(self, q):
        q = q * 1.0
        q[:, :, torch.arange(0, q.shape[-1], 4, device=q.device)] *= 2.0  # an integer-array index: index_put
        return q


def _run(model, **options):
    torch.manual_seed(0)
    batch = make_grpo_batch(**BATCH)
    args = grpo_args(batch, 0.2, True)
    params = list(model.parameters())
    ref = grpo_loss(model, *args)
    gref = torch.autograd.grad(ref, params)
    torch._dynamo.reset()
    brcompile.reset_stats()
    be = brcompile.backend(compiler="eager", **options)
    out = torch.compile(grpo_loss, backend=be)(model, *args)
    gout = torch.autograd.grad(out, params)
    return be, (ref, gref), (out, gout)


def _model(cls):
    torch.manual_seed(0)
    return cls().double()


@pytest.mark.parametrize("cls", [TransposeWrite, ReshapeWrite, IndexWrite], ids=lambda c: c.__name__)
def test_writes_refused_by_dynamo_level_replay_at_aten_level(cls):
    model = _model(cls)
    be, _, _ = _run(model, level="dynamo")
    assert not be.records[0].rewritten and be.records[0].code is Code.INPLACE_TOKEN_VALUE, be.records[0].reason
    be, (ref, gref), (out, gout) = _run(model)  # level="auto"
    rec = be.records[0]
    assert rec.rewritten and rec.level == "aten", rec.reason
    assert [lv for lv, _ in rec.refusals] == ["dynamo"] and rec.refusal_codes == (Code.INPLACE_TOKEN_VALUE,), rec.refusals
    assert "tree_attention" in rec.packed_code
    assert_replayed()
    assert_exact(out.detach(), ref.detach(), torch.float64, "loss")
    for (name, _), a, b in zip(model.named_parameters(), gout, gref):
        assert_exact(a, b, torch.float64, f"grad of {name}")


def test_auto_keeps_the_dynamo_level_when_it_replays():
    be, (ref, _), (out, _) = _run(_model(Tiny))
    assert be.records[0].rewritten and be.records[0].level == "dynamo" and be.records[0].refusals == ()
    assert_exact(out.detach(), ref.detach(), torch.float64, "loss")


def test_level_aten_on_a_model_the_dynamo_level_replays():
    model = _model(Tiny)
    be, (ref, gref), (out, gout) = _run(model, level="aten")
    assert be.records[0].rewritten and be.records[0].level == "aten"
    assert_replayed()
    assert_exact(out.detach(), ref.detach(), torch.float64, "loss")
    for a, b in zip(gout, gref):
        assert_exact(a, b, torch.float64, "grad")


def _inputs(gm, size=None, **tensors):
    """gm's inputs in its placeholders' order (Dynamo orders them as it first reads them): the tensor named in
    the placeholder (``L_x_`` -> ``x``), ``size`` for a symbolic size."""
    out = []
    for p in gm.graph.nodes:
        if p.op == "placeholder":
            name = p.name.lower().strip("_")[2:]  # l_x_ -> x
            out.append(size if isinstance(p.meta["example_value"], torch.SymInt) else tensors[name])
    return out


def _capture(fn, *args, dynamic_dim=None):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    if dynamic_dim is not None:
        torch._dynamo.mark_dynamic(args[0], dynamic_dim)
    torch._dynamo.reset()
    torch.compile(fn, backend=capture)(*args)
    return graphs[0]


def test_lowering_is_functional_and_keeps_symbolic_sizes():
    def f(x, w):
        h = x @ w
        v = h.view(h.shape[0], h.shape[1], 2, -1)
        v[:, :, 0] *= 2  # a write into a view of a fresh value
        out = torch.zeros_like(h)
        out.index_add_(0, torch.tensor([1, 0]), h)  # no respelling: stays an ATen op
        return (out.relu_() * 3).sum(-1)

    x, w = torch.randn(2, 5, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    gm = _capture(f, x, w, dynamic_dim=1)
    low, _ = lower_and_respell(gm)
    targets = [n.target for n in low.graph.nodes if n.op in ("call_function", "call_method")]
    assert not any(str(t).endswith("_") and str(t) != "aten.index_add.default" for t in targets), targets
    assert aten_ops(low) == ["aten.index_add.default"]
    assert [p.name for p in low.graph.nodes if p.op == "placeholder"] == \
        [p.name for p in gm.graph.nodes if p.op == "placeholder"]
    for L in (5, 7):  # the lowered graph holds for another length: no size was baked in
        x = torch.randn(2, L, 8, dtype=torch.float64)
        torch.testing.assert_close(low(*_inputs(gm, L, x=x, w=w))[0], f(x.clone(), w), rtol=0, atol=0)


def test_respelling_drops_the_identities_of_the_lowering():
    def f(x):
        y = x[:, :]  # a full slice: the identity
        return (y.to(torch.float64) * 2).view(-1)

    gm = _capture(f, torch.randn(3, 4, dtype=torch.float64))
    low, _ = lower_and_respell(gm)
    ops = [n for n in low.graph.nodes if n.op in ("call_function", "call_method")]
    assert [n.target for n in ops][-1] == "reshape", low.code  # aten.view is respelled as a reshape
    assert not any("slice" in str(n.target) or "alias" in str(n.target) or "assert" in str(n.target) for n in ops), low.code


def test_every_respelling_names_an_aten_packet():
    assert all(isinstance(k, torch._ops.OpOverloadPacket) for k in ATEN_SPELLINGS)
    assert torch.ops.aten.scaled_dot_product_attention in ATEN_SPELLINGS
    assert torch.ops.aten.index_add not in ATEN_SPELLINGS  # left to materialise


def test_a_graph_writing_into_its_input_is_refused():
    def f(x, buf):
        buf.add_(1.0)  # a write into a graph input
        return x * buf

    gm = _capture(f, torch.randn(4), torch.zeros(4))
    with pytest.raises(CannotReplay) as e:
        lower(gm)
    assert e.value.code is Code.INPUT_WRITE


def test_respell_keeps_values_on_hf_style_ops():
    def f(x, ids):
        h = F.embedding(ids, x)
        h = F.layer_norm(h, (4,)) + F.gelu(h, approximate="tanh")
        p = F.softmax(h.float(), -1, dtype=torch.float64)
        return F.cross_entropy(p.flatten(0, 1), ids.flatten(), ignore_index=0), F.pad(h, (1, 0)).sum()

    x, ids = torch.randn(7, 4, dtype=torch.float64), torch.randint(0, 4, (2, 3))  # ids < 4: the classes
    gm = _capture(f, x, ids)
    low, _ = lower_and_respell(gm)
    assert aten_ops(low) == [], low.code
    for a, b in zip(low(*_inputs(gm, x=x, ids=ids)), f(x, ids)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_respell_of_lowered_graph_is_idempotent_on_respelled_graph():
    gm = _capture(lambda x: (x.transpose(0, 1) @ x).softmax(-1), torch.randn(3, 4, dtype=torch.float64))
    once, _ = lower_and_respell(gm)
    twice = respell(once)
    assert once.code == twice.code


def test_explain_says_which_level_replayed():
    model = _model(ReshapeWrite)
    batch = make_grpo_batch(**BATCH)
    report = brcompile.explain(grpo_loss, model, *grpo_args(batch, 0.2, True), measure=False,
                               backend=brcompile.backend(compiler="eager"))
    text = report.render_text(code=False)
    assert "REWRITTEN (ATen level)" in text
    assert "was refused at the dynamo level [inplace_token_value]: in-place op" in text
    d = report.to_dict()["graphs"][0]
    assert d["level"] == "aten" and d["refusals"][0]["level"] == "dynamo"


def test_dynamic_shapes_and_scalar_inputs_at_the_aten_level():
    """dynamic=True: Dynamo passes float attributes and arguments (LayerNorm's eps, the loss's clip) as 0-dim
    tensors read with ``.item()``; the ATen level traces them as their values under a per-call guard. Two
    batch shapes replay exactly through one capture; a call with another clip runs the original graph."""
    model = _model(Tiny)
    params = list(model.parameters())
    be = brcompile.backend(compiler="eager", level="aten")
    compiled = torch.compile(grpo_loss, backend=be, dynamic=True)
    for seed, clip in ((1, 0.2), (2, 0.2), (2, 0.3)):
        batch = make_grpo_batch(**{**BATCH, "seed": seed, "prompt_len": (5 + seed, 9)})
        args = grpo_args({k: v.clone() for k, v in batch.items()}, clip, True)
        ref = grpo_loss(model, *args)
        gref = torch.autograd.grad(ref, params)
        out = compiled(model, *args)
        gout = torch.autograd.grad(out, params)
        assert_exact(out.detach(), ref.detach(), torch.float64, "loss")
        for a, b in zip(gout, gref):
            assert_exact(a, b, torch.float64, "grad")
    s = brcompile.stats()
    assert len(be.records) == 1 and be.records[0].level == "aten"
    assert s.replayed_calls == 2 and s.fallback_calls == 1, str(s)
    assert s.fallback_codes == {Code.GUARD_SCALAR: 1}, str(s)
    assert any("scalar input" in r and "read with .item()" in r for r in s.details(Code.GUARD_SCALAR)), str(s)


def test_a_graph_with_vmap_levels_falls_back_and_leaves_functorch_as_it_was():
    """A vmap inside the compiled function puts functorch's nesting calls in the graph; the export cannot trace
    them functionally and stops inside a vmap level. The lowering pops what it left pushed, so Dynamo's guard
    on functorch's stack holds and the call runs the original graph with the reason (it raised before)."""
    def f(x, w):
        return torch.vmap(lambda r: (r @ w).relu())(x).sum()

    x, w = torch.randn(3, 4, 5), torch.randn(5, 2)
    be = brcompile.backend(compiler="eager", level="aten")
    torch.testing.assert_close(torch.compile(f, backend=be)(x, w), f(x, w), rtol=0, atol=0)
    rec, = be.records
    assert not rec.rewritten and rec.code is Code.ATEN_LOWERING, rec.reason
    assert torch._C._functorch.peek_interpreter_stack() is None


def test_respelled_embedding_keeps_its_gradient_flags():
    """``scale_grad_by_freq`` changes the gradient, not the value: the respelled embedding keeps it (the table's
    gradient of the lowered graph equals eager's, the repeated ids' rows scaled by their counts)."""
    def f(w, ids):
        return F.embedding(ids, w, scale_grad_by_freq=True).pow(2).sum()

    w, ids = torch.randn(7, 4, dtype=torch.float64, requires_grad=True), torch.tensor([[1, 1, 2], [1, 3, 3]])
    gm = _capture(f, w, ids)
    low, _ = lower_and_respell(gm)
    got = torch.autograd.grad(low(*_inputs(gm, w=w, ids=ids))[0], w)[0]
    want = torch.autograd.grad(f(w, ids), w)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


class _HalfGradGelu(torch.autograd.Function):
    """gelu forward, half its gradient backward: a backward that is not the forward's derivative."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.gelu(x)

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        cdf, pdf = 0.5 * (1 + torch.erf(x * 0.5 ** 0.5)), torch.exp(-0.5 * x * x) * (2 * torch.pi) ** -0.5
        return 0.5 * g * (cdf + x * pdf)  # gelu'(x) = Φ(x) + x φ(x)


class CustomFunction(Tiny):
    def mix(self, q):
        return _HalfGradGelu.apply(q)


def test_custom_autograd_function_is_kept_out_of_the_aten_level():
    """The export inlines a Function's forward under no_grad and drops its backward: at the ATen level the
    gradient through it would be cut off. The level refuses it by the Function's name, and the run is exact
    (the original graph; under auto the Dynamo level replays with the Function run densely)."""
    model = _model(CustomFunction)
    be, (ref, gref), (out, gout) = _run(model, level="aten")
    rec = be.records[0]
    assert not rec.rewritten and rec.code is Code.CUSTOM_AUTOGRAD_FUNCTION, rec.reason
    assert "(`_HalfGradGelu`)" in rec.reason  # names the function
    for (name, _), a, b in zip(model.named_parameters(), gout, gref):
        assert_exact(a, b, torch.float64, f"grad of {name}")
    be, (ref, gref), (out, gout) = _run(model)  # auto: the Dynamo level replays it
    assert be.records[0].rewritten and be.records[0].level == "dynamo", be.records[0].reason


# --------------------------------------------------------------------------------------------------
# parity: the rewrite's features fire at the ATen level as at the Dynamo level


def _gpt():
    from examples.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48), seed=0).double()


def _padded_grpo():
    """Two groups of 3, left-padded prompts, ragged right-padded responses sharing their first token."""
    return make_grpo_batch(vocab_size=61, seed=2, dtype=torch.float64, num_prompts=2, group_size=3,
                           prompt_len=(4, 9), response_len=(2, 6), left_pad_prompts=True, shared_response_prefix=1)


def _left_out_what_the_loss_does_not_need(rec, batch):
    """Executed = the needed tokens (tests.helpers.grpo_needed_tokens), fewer than the valid ones."""
    from brcompile.runtime.tree import build_tree
    from tests.helpers import grpo_needed_tokens

    ids, am, cm = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    s = brcompile.stats()
    return rec.liveness is not None and s.executed_tokens == grpo_needed_tokens(ids, am, cm) \
        < int(build_tree(ids, am).valid.sum())


def _streamed(rec, batch):
    s = brcompile.stats()
    return s.streamed_calls == 1 and rec.replay is not None and rec.runtime.calls[-1].schedule["chunks"] >= 2


#: feature -> (backend options, what the record and counters must show: the feature fired)
PARITY = {
    "fused_logprob": (dict(), lambda rec, batch: bool(rec.fused) and "packed_logprob" in rec.packed_code
                      and "log_softmax" not in rec.packed_code),
    "liveness": (dict(), _left_out_what_the_loss_does_not_need),
    "streaming": (dict(mode="replay", chunk_tokens=4), _streamed),
}


@pytest.mark.parametrize("feature", sorted(PARITY))
def test_parity_features_fire_at_the_aten_level(feature):
    """The example GPT under grpo_loss at ``level="aten"``: fused log-probs, live positions and streaming
    replay each fire on the ATen graph (the record and the counters say so), with the eager loss and every
    gradient in float64."""
    options, fired = PARITY[feature]
    model, batch = _gpt(), _padded_grpo()
    params = list(model.parameters())
    args = grpo_args(batch, 0.2, True)
    ref = grpo_loss(model, *args)
    gref = torch.autograd.grad(ref, params)
    be = brcompile.backend(compiler="eager", level="aten", **options)
    out = torch.compile(grpo_loss, backend=be)(model, *args)
    gout = torch.autograd.grad(out, params)
    rec, = be.records
    assert rec.rewritten and rec.level == "aten", rec.reason
    assert fired(rec, batch), (feature, brcompile.stats(), rec.fused, rec.replay_reason)
    assert_replayed()
    assert_exact(out.detach(), ref.detach(), torch.float64, "loss")
    for (name, _), a, b in zip(model.named_parameters(), gout, gref):
        assert_exact(a, b, torch.float64, f"grad of {name}")




def test_parity_hf_sliding_window_and_logits_to_keep_at_the_aten_level(float64_norms):
    """HF Mistral with an active sliding window (3) called with ``logits_to_keep``, its completion log-probs
    in the compiled loss: at the ATen level the windows are classified (every mask ``window(3)``), the head
    runs on the kept columns and the log-probs are fused; loss and every gradient equal eager's (float64)."""
    from tests.helpers import hf_tiny_model

    model = hf_tiny_model("mistral", "sdpa", sliding_window=3)
    b = make_grpo_batch(vocab_size=61, seed=4, num_prompts=2, group_size=3, prompt_len=(4, 7), response_len=(2, 5),
                        left_pad_prompts=True, pad_id=0, dtype=torch.float64)
    ids, am, cm = b["input_ids"], b["attention_mask"], b["completion_mask"]
    C = ids.shape[1] - int((cm == 0).all(0).long().cumprod(0).sum())  # the completion columns

    def loss(ids, am, cm):
        logits = model(input_ids=ids, attention_mask=am, logits_to_keep=C + 1).logits[:, :-1]
        lp = logits.log_softmax(-1).gather(-1, ids[:, -C:, None]).squeeze(-1)
        m = cm[:, -C:].to(lp.dtype)
        return -(lp * m).sum() / m.sum()

    params = [p for p in model.parameters() if p.requires_grad]
    ref = loss(ids, am, cm)
    gref = torch.autograd.grad(ref, params)
    be = brcompile.backend(compiler="eager", level="aten")
    out = torch.compile(loss, backend=be)(ids, am, cm)
    gout = torch.autograd.grad(out, params)
    rec, = be.records
    assert rec.rewritten and rec.level == "aten", rec.reason
    assert rec.masks and all("window(3)" in m for m in rec.masks), rec.masks
    assert rec.fused, rec.packed_code
    assert_replayed()
    assert_exact(out.detach(), ref.detach(), torch.float64, "loss")
    for (name, _), a, g in zip(model.named_parameters(), gout, gref):
        assert_exact(a, g, torch.float64, f"grad of {name}")


def test_parity_scan_hybrid_at_the_aten_level():
    """A short-conv + attention hybrid with cumsum positions (tests/passes/analysis/rules/test_scan_rules.py's ScanGPT): at
    the ATen level its conv runs as ``brcompile::tree_causal_conv1d`` along the tree paths; exact in float64."""
    from tests.passes.analysis.rules.test_scan_rules import grpo_like_batch, run_exact, scan_model, token_loss

    model = scan_model()
    be = run_exact(model, lambda *a: token_loss(model, *a), grpo_like_batch(), level="aten")
    rec, = be.records
    assert rec.rewritten and rec.level == "aten", rec.reason
    assert rec.packed_code.count("brcompile.tree_causal_conv1d") == 2, rec.packed_code
    assert_replayed()


def test_respell_covers_aliases_vector_norms_and_new_fills():
    """The aliases torch keeps as ATen ops of their own (``concatenate``, ``swapaxes``, ``multiply``, ``clip``,
    ``__and__``, ...), ``linalg_vector_norm`` (``F.normalize``, ``x.norm(dim=)``), ``new_zeros`` / ``new_ones``
    / ``new_full`` and ``x[mask] = v`` are respelled (no ATen op left), with the values of the captured graph."""
    def f(x, y):
        a = torch.concatenate([x, y], -1) + torch.concat([y, x], -1)
        c = torch.swapaxes(a, 0, 1).sum() + torch.swapdims(a, 0, 1).sum() + torch.moveaxis(a, 0, 1).sum()
        g = torch.multiply(x, y) + torch.divide(x, y) + torch.true_divide(x, y) + torch.subtract(x, y, alpha=2) \
            + torch.negative(x) + torch.absolute(y) + torch.divide(x, y, rounding_mode="floor")
        h = torch.clip(x, -0.5, 0.5) + torch.arctan2(x, y) + torch.fix(x)
        m = (torch.greater(x, y) & torch.greater_equal(x, y)) | (torch.less(x, y) ^ torch.less_equal(x, y)) \
            | torch.not_equal(x, y)
        n = torch.linalg.vector_norm(x, 2, -1, True) + x.norm(dim=-1, keepdim=True) + F.normalize(y, dim=-1)
        z = x.new_zeros(2, 0, 4).sum() + x.new_ones((3, 4)) + x.new_full((3, 4), 2.5)
        w = x.clone()
        w[w > 0] = 0.5  # index_put with a bool mask of w's shape: masked_fill
        return c + (g + h + m + n * z + w).sum()

    x, y = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64) + 2
    gm = _capture(f, x, y)
    low, _ = lower_and_respell(gm)
    assert aten_ops(low) == [], low.code
    torch.testing.assert_close(low(*_inputs(gm, x=x, y=y))[0], f(x, y), rtol=0, atol=0)


def test_inlined_associative_scan_replays_at_the_aten_level():
    """HF Mamba's CPU scan (``associative_scan(combine_mode="generic")``: the combine under ``torch.vmap``, whose
    levels the export cannot trace): proved and written as ``linear_scan`` before the export, traced to the tree
    scan over the chain parent and respelled back, so it runs as ``brcompile::tree_linear_scan`` at the ATen
    level too; loss and every gradient exact (float64)."""
    from tests.passes.canonical.scans.test_linear_scans import scan_lm
    from tests.passes.analysis.rules.test_scan_rules import grpo_like_batch, run_exact, token_loss

    model = scan_lm(layers=1)
    be = run_exact(model, lambda *a: token_loss(model, *a), grpo_like_batch(), level="aten")
    rec, = be.records
    assert rec.rewritten and rec.level == "aten", rec.reason
    assert rec.packed_code.count("brcompile.tree_linear_scan") == 1 and "_add_batch_dim" not in rec.packed_code
    assert_replayed()


def test_writes_filling_an_empty_tensor_are_a_cat():
    """MLA's key (``k = kv.new_empty(...); k[..., :n] = k_nope; k[..., n:] = k_pe``) is, at the ATen level, two
    ``slice_scatter`` into ``new_empty``: writes that cover a dim of the written value are respelled as their
    ``cat`` (what it held is overwritten). Writes that leave a hole stay writes (the hole keeps the old value)."""
    def f(kv, pe):
        k = kv.new_empty(*kv.shape[:-1], 6)
        k[..., :4] = kv
        k[..., 4:] = pe.expand(*kv.shape[:-1], 2)
        e = torch.empty(3, 5, 2, dtype=kv.dtype)
        e[:, :2] = kv[:, :2, :2]
        e[:, 3:] = 2.0  # column 2 is never written
        return k * 2, e[:, :2].sum()

    kv, pe = torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 1, 2, dtype=torch.float64)
    gm = _capture(f, kv, pe)
    low, _ = lower_and_respell(gm)
    cats = [n for n in low.graph.nodes if n.target is torch.cat]
    assert len(cats) == 1 and [a.name for a in cats[0].args[0]][0] == "l_kv_", low.code
    assert sum(n.target is torch.slice_scatter for n in low.graph.nodes) == 2, low.code  # the holed writes
    for a, b in zip(low(*_inputs(gm, kv=kv, pe=pe)), f(kv, pe)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class GumbelNoise(Tiny):
    def mix(self, q):
        return q + torch.empty_like(q).exponential_()  # a router's training-mode noise: each row draws its own


def test_random_draw_over_token_values_is_refused_at_the_aten_level():
    """``empty_like(q).exponential_()`` is the functional ``aten.exponential`` at the ATen level (tagged
    ``nondeterministic_seeded``): refused over token values by name, as the method is at the Dynamo level."""
    torch.manual_seed(0)
    model = _model(GumbelNoise)
    batch = make_grpo_batch(**BATCH)
    be = brcompile.backend(compiler="eager", level="aten")
    torch.compile(grpo_loss, backend=be)(model, *grpo_args(batch, 0.2, True))
    rec, = be.records
    assert not rec.rewritten and rec.code is Code.RANDOM_DRAW, rec.reason
    assert "exponential_ (aten.exponential.default)" in rec.reason  # names the draw


class DropoutThenWrite(Tiny):
    def mix(self, q):
        q = F.dropout(q, p=0.0, training=True)  # returns its input at p = 0
        q *= 2.0  # XLM's ``tensor *= mask`` after its dropout
        return q


def test_a_write_the_export_refuses_is_made_pure_first():
    """The export refuses an in-place op on what a dropout at p = 0 returned ("cannot mutate tensors with frozen
    storage"); the lowering retries with the Dynamo level's proof of pure writes (passes/lower/functionalize.py) and the
    graph replays at the ATen level, exactly."""
    model = _model(DropoutThenWrite)
    model.train()
    be, (ref, gref), (out, gout) = _run(model, level="aten")
    rec = be.records[0]
    assert rec.rewritten and rec.level == "aten", rec.reason
    assert_replayed()
    assert_exact(out.detach(), ref.detach(), torch.float64, "loss")
    for (name, _), a, b in zip(model.named_parameters(), gout, gref):
        assert_exact(a, b, torch.float64, f"grad of {name}")
