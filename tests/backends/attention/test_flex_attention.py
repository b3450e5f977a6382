"""The "flex" tree-attention impl (backends/attention/flex.py, torch's FlexAttention) against the reference impl.

Oracle: backends/attention/reference.py (dense masked attention in float64), itself checked against dense per-row math in
test_tree_attention.py. Trees come from brcompile.runtime.tree.build_tree on GRPO-like batches: shared prompts,
a shared response prefix, left padding and mask holes, so the tree has branches, invalid keys and queries that
see no key.

On CPU FlexAttention has a forward only: the forward is compared in float32 (and float64) to tight bounds; a
backward through the op is refused by name (AttentionImplError), and the backend turns the same refusal into a
fallback with the reason for a CPU graph captured with grad enabled. The impl's backward algebra (recompute,
weighted to the given merged out/lse) is checked on CPU with FlexAttention's device check lifted — its unfused
path is device-independent math — and for real on CUDA by the GPU test.
"""
from __future__ import annotations

import pytest
import torch

import brcompile
import brcompile.backends.attention.flex as flex
from brcompile.backends.attention.op import (
    AttentionImplError, TreeAttentionArgs, check_impl_supports, get_attention_impl, sink_merge, tree_attention,
)
from brcompile.backends.attention.reference import reference_backward, reference_forward
from brcompile.runtime.tree import build_tree
from tests.helpers import grouped_rows

HQ, HKV, D = 4, 2, 16
SLOPES = [0.5, 0.25, 0.125, 0.0625]
#: feature name -> extra TreeAttentionArgs fields (tensors built per tree by :func:`_features`)
FEATURES = ["plain", "window", "softcap", "alibi", "slopes", "relbias", "sinks", "window+softcap+alibi"]
#: per dtype: (rtol, atol) of the impl against the float64 reference, atol relative to max(1, max |reference|)
#: (bfloat16's is test_triton_attention.py's bound for the Triton kernels)
BOUNDS = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 3e-2)}


def _tree(seed: int, pad: bool):
    """build_tree of two prompt groups (7 x 3 rows, 5 x 2 rows, responses of 5, the first two of each group
    sharing 2 response tokens); ``pad``: left padding and mask holes (invalid keys, empty rows)."""
    ids, am = grouped_rows(seed, pad, groups=((7, 3), (5, 2)), response=5,
                           holes=((0, slice(-2, None)), (3, slice(4, 5))))
    return build_tree(ids, attention_mask=am)


def _features(name: str, tree, dtype, seed: int = 0) -> dict:
    """The TreeAttentionArgs fields of feature ``name`` for ``tree`` (window 4, soft-cap 2.0, ALiBi slopes,
    trainable slopes, a relative-bias table with 3 buckets, per-head sinks)."""
    g = torch.Generator().manual_seed(seed)
    n = tree.num_tokens
    out = {}
    for part in name.split("+"):
        if part == "window":
            out.update(window=4, position=tree.position)
        elif part == "softcap":
            out.update(softcap=2.0)
        elif part == "alibi":
            out.update(alibi=SLOPES, position=tree.position)
        elif part == "slopes":
            out.update(slopes=torch.tensor(SLOPES, dtype=dtype), position=tree.position)
        elif part == "relbias":
            out.update(relbias=torch.randn(HQ, n, 3, generator=g).to(dtype), position=tree.position)
        elif part == "sinks":
            out.update(sinks=torch.randn(HQ, generator=g).to(dtype))
    return out


def _args(tree, name: str, dtype, seed: int = 0, device="cpu") -> TreeAttentionArgs:
    """Random q [HQ, N, D], k/v [HKV, N, D] over ``tree`` with feature ``name``, checked, on ``device``."""
    g = torch.Generator().manual_seed(seed)
    n = tree.num_tokens
    q, k, v = (torch.randn(h, n, D, generator=g).to(dtype) for h in (HQ, HKV, HKV))
    extra = _features(name, tree, dtype, seed)
    a = TreeAttentionArgs(q, k, v, tree.end, tree.valid, tree.segments, D ** -0.5, **extra)
    moved = {f: getattr(a, f).to(device) for f in ("q", "k", "v", "end", "valid", "segments", "position", "sinks",
                                                   "relbias", "slopes") if getattr(a, f) is not None}
    return a.replace(**moved).check()


def _close(got, want, dtype, what: str) -> None:
    """assert_close within BOUNDS[dtype] (atol scaled by max(1, max |want|)), comparing in float64, with the max
    error in the message."""
    got64, want64 = got.detach().double().cpu(), want.detach().double().cpu()
    scale = max(1.0, want64.abs().max().item()) if want64.numel() else 1.0
    rtol, atol = BOUNDS[dtype][0], BOUNDS[dtype][1] * scale
    err = (got64 - want64).abs().nan_to_num(0.0).max().item() if got64.numel() else 0.0
    torch.testing.assert_close(got64, want64, rtol=rtol, atol=atol, equal_nan=False,
                               msg=lambda m: f"{what} ({dtype}): max abs error {err:.3e}\n{m}")


def _close_lse(got, want, dtype, what: str) -> None:
    """lse: -inf at the same rows (queries that see no key), the finite ones within the bound."""
    assert torch.equal(torch.isneginf(got.cpu()), torch.isneginf(want.cpu())), f"{what}: -inf rows differ"
    seen = torch.isfinite(want.cpu())
    _close(got.cpu()[seen], want.cpu()[seen], dtype, what)


def _reference(a: TreeAttentionArgs):
    """(out, lse) of the reference with the sinks merged in, as the op returns them."""
    out, lse = reference_forward(a.without_sinks())
    return (out, lse) if a.sinks is None else sink_merge(out, lse, a.sinks)


# ------------------------------------------------------------------------------------------- forward


@pytest.mark.parametrize("name", FEATURES)
@pytest.mark.parametrize("pad", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("seed", [0, 1])
def test_forward_matches_reference_float32(name, pad, seed):
    """flex_forward == reference_forward in float32 on CPU, every feature, over random branched (padded) trees."""
    tree = _tree(seed, pad)
    a = _args(tree, name, torch.float32, seed).without_sinks()
    out, lse = flex.flex_forward(a)
    want_out, want_lse = reference_forward(a)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    _close(out, want_out, torch.float32, f"out [{name}]")
    _close_lse(lse, want_lse, torch.float32, f"lse [{name}]")


@pytest.mark.parametrize("name", ["plain", "window+softcap+alibi", "relbias"])
def test_forward_matches_reference_float64(name):
    """In float64 (FlexAttention's unfused path keeps the input dtype) the agreement is float64's."""
    tree = _tree(3, True)
    a = _args(tree, name, torch.float64, 3)
    out, lse = flex.flex_forward(a)
    want_out, want_lse = reference_forward(a)
    _close(out, want_out, torch.float64, f"out [{name}]")
    _close_lse(lse, want_lse, torch.float64, f"lse [{name}]")


def test_padded_tree_has_queries_that_see_nothing():
    """The padded trees exercise empty rows: out = 0 and lse = -inf there, as the op's contract says."""
    tree = _tree(0, True)
    a = _args(tree, "plain", torch.float32)
    out, lse = flex.flex_forward(a)
    empty = torch.isneginf(lse)
    assert empty.any(), "the padded tree should have queries that see no key"
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))


@pytest.mark.parametrize("name", ["plain", "sinks", "window+softcap+alibi"])
def test_registered_impl_through_the_op(name):
    """tree_attention(..., impl="flex") under no_grad equals impl="reference" (sinks merged by the op)."""
    tree = _tree(2, True)
    a = _args(tree, name, torch.float32, 2)
    extra = dict(window=a.window, position=a.position, softcap=a.softcap, alibi=a.alibi, sinks=a.sinks)
    with torch.no_grad():
        got = tree_attention(a.q, a.k, a.v, tree, a.scale, impl="flex", **extra)
        want = tree_attention(a.q, a.k, a.v, tree, a.scale, impl="reference", **extra)
    _close(got, want, torch.float32, f"op out [{name}]")


def test_registered_with_its_capabilities():
    """"flex" is a known name with every score feature and a backward on CUDA only."""
    impl = get_attention_impl("flex", "cpu")
    assert impl.name == "flex" and impl.forward is flex.flex_forward
    assert impl.supports_window and impl.supports_softcap and impl.supports_alibi and impl.supports_relbias
    assert impl.supports_alibi_grad
    assert impl.backward_runs_on("cuda") and not impl.backward_runs_on("cpu")
    with pytest.raises(AttentionImplError, match="does not run on meta"):
        get_attention_impl("flex", "meta")


# ------------------------------------------------------------------------------------------ backward


def test_cpu_backward_is_refused_by_name():
    """FlexAttention has no CPU backward: the capability check names it, the op's backward raises it (the
    forward under grad still runs), and so does the impl's backward called directly."""
    impl = get_attention_impl("flex", "cpu")
    with pytest.raises(AttentionImplError, match="'flex' has no backward on cpu"):
        check_impl_supports(impl, backward_device=torch.device("cpu"))
    check_impl_supports(impl, window=2, softcap=1.0, alibi=SLOPES, relbias=True, backward_device="cuda")
    tree = _tree(0, False)
    a = _args(tree, "plain", torch.float32)
    q = a.q.clone().requires_grad_()
    out = tree_attention(q, a.k, a.v, tree, a.scale, impl="flex")
    with pytest.raises(AttentionImplError, match="'flex' has no backward on cpu"):
        out.sum().backward()
    with pytest.raises(AttentionImplError, match="no backward on cpu .*torch.no_grad"):
        flex.flex_backward(a, torch.ones_like(out), out.detach(), torch.zeros(a.q.shape[:2]))


@pytest.fixture
def cpu_flex_backward(monkeypatch):
    """Lift FlexAttention's CPU-backward device check (its unfused path is device-independent math) and the
    impl's own, for this test only: the impl's backward algebra can then be checked on CPU."""
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *tensors: None)
    monkeypatch.setattr(flex, "FLEX_BACKWARD_DEVICES", frozenset({"cpu", "cuda"}))


@pytest.mark.parametrize("name", FEATURES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_backward_algebra_matches_reference(cpu_flex_backward, name, dtype):
    """flex_backward(a, dout, out, lse) == reference_backward with the MERGED out/lse the op hands it (sinks
    merged in: out/lse are not the impl's own, so the recompute's weights c and g are exercised), every feature;
    dR and dslopes included."""
    tree = _tree(1, True)
    a = _args(tree, name, dtype, 1)
    out, lse = _reference(a)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(dtype)
    got = flex.flex_backward(a.without_sinks(), dout, out, lse)
    want = reference_backward(a.without_sinks(), dout, out, lse)
    assert len(got) == len(want)
    for what, g, w in zip(("dq", "dk", "dv", "d extra"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, what
        _close(g, w, dtype, f"{what} [{name}]")


def test_backward_with_a_foreign_out_and_lse(cpu_flex_backward):
    """The cached-prefix case: out/lse merged with keys the impl never sees (here a made-up extra logit per row
    carrying a value), so c = exp(lse_f - lse) < 1 and delta differs; the gradient is still the reference's."""
    tree = _tree(4, False)
    a = _args(tree, "plain", torch.float64, 4)
    own_out, own_lse = reference_forward(a)
    g = torch.Generator().manual_seed(5)
    extra_lse = torch.randn(own_lse.shape, generator=g, dtype=torch.float64)
    extra_out = torch.randn(own_out.shape, generator=g, dtype=torch.float64)
    lse = torch.logaddexp(own_lse, extra_lse)
    out = own_out * torch.exp(own_lse - lse)[..., None] + extra_out * torch.exp(extra_lse - lse)[..., None]
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for what, got, want in zip(("dq", "dk", "dv"), flex.flex_backward(a, dout, out, lse),
                               reference_backward(a, dout, out, lse)):
        _close(got, want, torch.float64, what)


@pytest.fixture
def compiled_on_cpu(cpu_flex_backward, monkeypatch):
    """The CUDA code path on CPU: the calls go through torch.compile'd FlexAttention and create_block_mask, with
    the aot_eager backend (Inductor's CPU FlexAttention cannot return lse), for this test only."""
    monkeypatch.setattr(flex, "COMPILED_DEVICES", frozenset({"cpu", "cuda"}))
    monkeypatch.setattr(flex, "COMPILE_BACKEND", "aot_eager")


def test_compiled_path_traces_every_feature(compiled_on_cpu):
    """Dynamo and AOTAutograd trace the tree's mask_mod and score_mod (captured tree arrays, window and soft-cap
    tensors, trainable R and slopes) in forward and in the backward's recompute, across two tree sizes (the
    dynamic recompile) and several variants without reaching the recompile limit; the results are the
    reference's. Dynamo's own limit is set to 2 here and a hit raises (instead of running FlexAttention unfused):
    the six or more entries pass only under the impl's FLEX_RECOMPILE_LIMIT."""
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        _compiled_runs_match_reference()


def _compiled_runs_match_reference():
    """Forward and backward of four (feature, tree) variants against the reference."""
    for i, (name, seed) in enumerate([("plain", 0), ("window+softcap+alibi", 1), ("relbias+slopes+sinks", 0),
                                      ("plain", 1)]):
        tree = _tree(seed, True)
        a = _args(tree, name, torch.float32, i)
        out, lse = _reference(a)
        got_out, got_lse = flex.flex_forward(a.without_sinks())
        want_out, want_lse = reference_forward(a.without_sinks())
        _close(got_out, want_out, torch.float32, f"compiled out [{name}]")
        _close_lse(got_lse, want_lse, torch.float32, f"compiled lse [{name}]")
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(i))
        for what, g, w in zip(("dq", "dk", "dv", "d extra", "d extra 2"),
                              flex.flex_backward(a.without_sinks(), dout, out, lse),
                              reference_backward(a.without_sinks(), dout, out, lse)):
            _close(g, w, torch.float32, f"compiled {what} [{name}]")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward needs a CUDA device")
@pytest.mark.parametrize("name", FEATURES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_forward_and_backward_match_reference(name, dtype):
    """On CUDA (compiled FlexAttention kernels): the op's forward and every gradient (q, k, v, sinks, R, slopes)
    against the reference's, through autograd, float32 and bfloat16."""
    tree = _tree(2, True).to("cuda")
    a = _args(tree, name, dtype, 2, device="cuda")
    extra = dict(window=a.window, position=a.position, softcap=a.softcap, alibi=a.alibi)
    leaves = {f: getattr(a, f).clone().requires_grad_() for f in ("q", "k", "v", "sinks", "relbias", "slopes")
              if getattr(a, f) is not None}
    results = {}
    for impl in ("flex", "reference"):
        xs = {f: t.detach().clone().requires_grad_() for f, t in leaves.items()}
        out = tree_attention(xs["q"], xs["k"], xs["v"], tree, a.scale, impl=impl, sinks=xs.get("sinks"),
                             relbias=xs.get("relbias"), slopes=xs.get("slopes"), **extra)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype).cuda()
        grads = torch.autograd.grad(out, list(xs.values()), dout)
        results[impl] = (out, dict(zip(xs, grads)))
    _close(results["flex"][0], results["reference"][0], dtype, f"out [{name}]")
    for f in leaves:
        _close(results["flex"][1][f], results["reference"][1][f], dtype, f"d{f} [{name}]")


# ----------------------------------------------------------------------------------------- end to end


def _rows(pad: bool = True):
    """(ids, mask) of a GRPO-like batch: prompts shared by their responses; ``pad``: prompts of two lengths, left
    padding and a hole, else two prompts of one length (no padding)."""
    if not pad:
        return grouped_rows(0, False, groups=((7, 3), (7, 2)), response=5)
    return grouped_rows(0, True, groups=((7, 3), (5, 2)), response=5, holes=((0, slice(-2, None)),))


@pytest.mark.parametrize("family,impl,overrides", [
    ("qwen2", "sdpa", {}),
    # HF's Gemma2 has no SDPA path; its eager additive mask is refused where a window holds only padding
    ("gemma2", "eager", dict(sliding_window=4, attn_logit_softcapping=5.0)),
], ids=["qwen2", "gemma2-window-softcap"])
def test_compiled_eval_forward_replays_with_flex(family, impl, overrides):
    """torch.compile(model, backend=brcompile.backend(attention="flex")) of a tiny HF model under no_grad: the
    logits at every valid position equal eager's in float32, and the packed graph ran (replayed_calls > 0);
    Qwen2 on a padded batch, Gemma2 (unpadded) brings a sliding window and soft-capped scores through mask_mod and
    score_mod."""
    from tests.helpers import hf_tiny_model

    model = hf_tiny_model(family, impl, dtype=torch.float32, **overrides).eval()
    ids, am = _rows(pad=family != "gemma2")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=am).logits
        compiled = torch.compile(model, backend=brcompile.backend(attention="flex", compiler="eager"))
        got = compiled(input_ids=ids, attention_mask=am).logits
    s = brcompile.stats()
    assert s.replayed_calls > 0 and s.fallback_calls == 0, str(s)
    assert s.executed_tokens < s.logical_tokens, str(s)
    keep = am.bool()
    _close(got[keep], want[keep], torch.float32, f"{family} logits")


def test_compiled_training_on_cpu_falls_back_naming_the_missing_backward():
    """With grad enabled on CPU the backend refuses attention="flex" (FlexAttention has no CPU backward): the
    graph runs as captured, with a reason naming the impl and the missing backward; loss and gradients are
    eager's."""
    from tests.helpers import hf_tiny_model

    model = hf_tiny_model("qwen2", dtype=torch.float32)
    ids, am = _rows()
    backend = brcompile.backend(attention="flex", compiler="eager")
    got = torch.compile(model, backend=backend)(input_ids=ids, attention_mask=am).logits.square().mean()
    got.backward()
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls > 0, str(s)
    reasons = [r.reason for r in backend.records if not r.rewritten]
    assert brcompile.Code.ATTENTION_IMPL in [r.code for r in backend.records if not r.rewritten], reasons
    assert any("'flex' has no backward on cpu" in (r or "") for r in reasons), reasons  # names the impl
    want = model(input_ids=ids, attention_mask=am).logits.square().mean()
    _close(got, want, torch.float32, "loss")


def test_options_accept_flex():
    """Options(attention="flex") is valid; an unknown name lists the choices, flex among them."""
    assert brcompile.Options(attention="flex").attention == "flex"
    with pytest.raises(ValueError, match="flex"):
        brcompile.Options(attention="flax")
