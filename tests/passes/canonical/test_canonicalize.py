"""The op-spelling table and the eager-attention canonicalisation by meaning (passes/spellings.py,
passes/canonical/attention/). End-to-end exactness of the spellings is in tests/models/zoo."""
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import brcompile
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.passes.canonical.attention import canonicalize
from brcompile.passes.analysis.rules.attention import SDPA
from brcompile.passes.spellings import FAMILIES, family_of, is_op, spellings
from tests.helpers import replay_exact


def test_every_spelling_belongs_to_one_family():
    seen = {}
    for fam, targets in FAMILIES.items():
        for t in targets:
            assert seen.setdefault(t, fam) == fam, f"{t} is in {seen[t]} and {fam}"


@pytest.mark.parametrize("target,family", [
    (operator.mul, "mul"), (torch.multiply, "mul"), ("__rmul__", "mul"), (torch.true_divide, "div"),
    ("true_divide", "div"), (torch.divide, "div"), ("__rsub__", "rsub"), (torch.special.softmax, "softmax"),
    (torch.rms_norm, "rms_norm"), (torch._C._nn.linear, "linear"), ("swapdims", "transpose"),
])
def test_family_of(target, family):
    g = fx.Graph()
    x = g.placeholder("x")
    op = "call_method" if isinstance(target, str) else "call_function"
    n = g.create_node(op, target, (x, x), {})
    assert family_of(n) == family and is_op(n, family)
    assert target in spellings(family)


def capture(fn, *args):
    out = {}

    def grab(gm, example_inputs):
        out["gm"], out["inputs"] = gm, list(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=grab, fullgraph=True)(*args)
    return out["gm"], out["inputs"]


Q = torch.randn(2, 2, 5, 4, dtype=torch.float64)
TRIL = torch.tril(torch.ones(8, 8)).view(1, 1, 8, 8)


def attn_masked_fill(q, value):
    T = q.shape[2]
    s = (q @ q.transpose(-2, -1)) * 0.5
    s = s.masked_fill(TRIL[:, :, :T, :T] == 0, value)
    return F.softmax(s, dim=-1) @ q


@pytest.mark.parametrize("value", [float("-inf"), -1e9, torch.finfo(torch.float64).min])
def test_masked_fill_becomes_sdpa(value):
    gm, inputs = capture(lambda q: attn_masked_fill(q, value), Q)
    canon = canonicalize(gm, inputs)
    (sdpa,) = [n for n in canon.gm.graph.nodes if n.op == "call_function" and n.target in SDPA]
    assert sdpa.kwargs["scale"] == 0.5 and sdpa.kwargs["attn_mask"] is not None
    assert canon.additive == [sdpa]


def test_masked_fill_with_a_small_value_is_a_bias():
    gm, inputs = capture(lambda q: attn_masked_fill(q, -10.0), Q)
    with pytest.raises(CannotReplay, match="not a large negative constant") as e:
        canonicalize(gm, inputs)
    assert e.value.code is Code.EAGER_ATTENTION


def test_einsum_scores_and_output():
    def f(q):
        s = torch.einsum("bhqd,bhkd->bhqk", q * 0.5, q)
        return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), q)

    gm, inputs = capture(f, Q)
    canon = canonicalize(gm, inputs)
    (sdpa,) = [n for n in canon.gm.graph.nodes if n.op == "call_function" and n.target in SDPA]
    assert sdpa.kwargs["scale"] == 1.0 and sdpa.kwargs["attn_mask"] is None


def attn_3d(q, bias, out_3d=False, softmax_3d=False):
    """BLOOM's spelling: ``bias.baddbmm(q3, k3^T, beta, alpha)`` on [B*H, L, D] views, viewed as [B, H, L, L] for
    the softmax, back to [B*H, L, L] for ``bmm`` with the values."""
    B, H, L, D = q.shape
    q3, v3 = q.reshape(B * H, L, D), (2 * q).reshape(B * H, L, D)
    k3t = (q + 1).reshape(B * H, L, D).transpose(-1, -2)
    s3 = bias.baddbmm(batch1=q3, batch2=k3t, beta=2.0, alpha=0.5)
    if softmax_3d:
        return torch.bmm(s3.softmax(-1), v3)
    p = F.softmax(s3.view(B, H, L, -1), dim=-1)
    o3 = torch.bmm(p.view(B * H, L, -1), v3)
    return o3 * 3 if out_3d else o3.view(B, H, L, D).transpose(1, 2)


@pytest.mark.parametrize("out_3d", [False, True])
def test_baddbmm_3d_attention_becomes_sdpa(out_3d):
    bias = torch.randn(4, 1, 5, dtype=torch.float64)
    gm, inputs = capture(lambda q, b: attn_3d(q, b, out_3d), Q, bias)
    canon = canonicalize(gm, inputs)
    (sdpa,) = [n for n in canon.gm.graph.nodes if n.op == "call_function" and n.target in SDPA]
    assert sdpa.kwargs["scale"] == 0.5 and sdpa.kwargs["attn_mask"] is not None
    assert not [n for n in canon.gm.graph.nodes if is_op(n, "bmm") or is_op(n, "baddbmm")]
    torch.testing.assert_close(canon.gm(*inputs)[0], gm(*inputs)[0], rtol=1e-12, atol=1e-12)


def test_3d_softmax_of_the_product_becomes_sdpa():
    """The softmax may read the [B*H, Lq, Lk] product itself (heads folded into the batch): the baddbmm input is
    then a bias read per head, as for 4-D scores."""
    bias = torch.randn(4, 1, 5, dtype=torch.float64)
    gm, inputs = capture(lambda q, b: attn_3d(q, b, softmax_3d=True), Q, bias)
    canon = canonicalize(gm, inputs)
    (sdpa,) = [n for n in canon.gm.graph.nodes if n.op == "call_function" and n.target in SDPA]
    assert sdpa.kwargs["scale"] == 0.5 and sdpa.kwargs["attn_mask"] is not None
    torch.testing.assert_close(canon.gm(*inputs)[0], gm(*inputs)[0], rtol=1e-12, atol=1e-12)


def test_mask_on_folded_scores_is_refused_by_name():
    """A mask added to the [B*H, Lq, Lk] scores themselves (not to their [B, H, Lq, Lk] view) is refused."""
    def f(q, m):
        B, H, L, D = q.shape
        q3 = q.reshape(B * H, L, D)
        return torch.bmm((torch.bmm(q3, q3.transpose(1, 2)) + m).softmax(-1), q3)

    gm, inputs = capture(f, Q, torch.zeros(5, 5, dtype=torch.float64))
    with pytest.raises(CannotReplay) as e:
        canonicalize(gm, inputs)
    assert e.value.code is Code.EAGER_ATTENTION and "[B*H, Lq, Lk] scores" in e.value.reason


def test_softmax_of_upcast_scores_becomes_sdpa():
    """``softmax(s.double())`` of float32 scores is ``softmax(s, dtype=float64)`` (MPT's and XLM's
    ``softmax(scores.float())``): the cast joins the chain."""
    def f(q):
        s = (q @ q.transpose(-2, -1)) * 0.5
        return F.softmax(s.double(), dim=-1).float() @ q

    gm, inputs = capture(f, Q.float())
    canon = canonicalize(gm, inputs)
    (sdpa,) = [n for n in canon.gm.graph.nodes if n.op == "call_function" and n.target in SDPA]
    assert sdpa.kwargs["scale"] == 0.5
    assert not [n for n in canon.gm.graph.nodes if n.op == "call_method" and n.target == "double"]


# ------------------------------------------------------------------ eager spellings replayed end to end

V, DM, H, HD = 11, 16, 2, 4


class EagerLM(torch.nn.Module):
    """Embedding -> q, k, v [B, H, L, hd] -> ``attn(q, k, v, causal)`` (an eager attention spelling; ``causal``
    the [L, L] bool lower triangle) -> [B, L, H*hd] -> projection -> sum of squares."""

    def __init__(self, attn):
        super().__init__()
        torch.manual_seed(0)
        self.attn = attn
        self.emb = torch.nn.Embedding(V, DM)
        self.qkv = torch.nn.Linear(DM, 3 * H * HD)
        self.out = torch.nn.Linear(H * HD, DM)
        self.register_buffer("tril", torch.tril(torch.ones(16, 16, dtype=torch.bool)))

    def forward(self, ids):
        B, L = ids.shape
        q, k, v = self.qkv(self.emb(ids)).view(B, L, 3, H, HD).permute(2, 0, 3, 1, 4)
        o = self.attn(q, k, v, self.tril[:L, :L])
        return self.out(o.transpose(1, 2).reshape(B, L, H * HD)).pow(2).sum()


def additive(causal, dtype=torch.float64):
    """The [1, 1, L, L] additive causal mask (0 / finfo.min)."""
    return torch.zeros(causal.shape, dtype=dtype).masked_fill(~causal, torch.finfo(dtype).min)[None, None]


def bart(q, k, v, causal, floor=False, twice=False):
    """HF BART / MVP / TrOCR (and XGLM with ``floor`` and ``twice``): [B*H, L, D] views, ``bmm``, the mask added to
    the [B, H, Lq, Lk] view, the softmax of the [B*H, Lq, Lk] view, ``bmm`` with the values."""
    B, Hh, L, D = q.shape
    q3, k3, v3 = (t.reshape(B * Hh, -1, D) for t in (q * D ** -0.5, k, v))
    w = torch.bmm(q3, k3.transpose(1, 2))
    w = w.view(B, Hh, L, L) + additive(causal)
    if floor:
        w = torch.max(w, torch.full((), torch.finfo(w.dtype).min, dtype=w.dtype))
    w = F.softmax(w.view(B * Hh, L, L), dim=-1)
    if twice:  # XGLM keeps the [B, H, Lq, Lk] weights "so that they keep their gradient"
        w = w.view(B, Hh, L, L).view(B * Hh, L, L)
    o = torch.bmm(F.dropout(w, p=0.0, training=True), v3)
    return o.view(B, Hh, L, D)


def neox_japanese(q, k, v, causal):
    """GPT-NeoX-Japanese: ``baddbmm(zeros, q3, k3^T, alpha=1/norm)`` on [B*H, L, D] views, viewed [B, H, Lq, Lk]
    for the mask and the softmax, then a 4-D ``matmul`` with the values."""
    B, Hh, L, D = q.shape
    q3, k3 = q.reshape(B * Hh, L, D), k.reshape(B * Hh, L, D)
    z = torch.zeros(B * Hh, L, L, dtype=q.dtype)
    s = torch.baddbmm(z, q3, k3.transpose(1, 2), beta=1.0, alpha=0.5).view(B, Hh, L, -1) + additive(causal)
    return torch.matmul(F.softmax(s, dim=-1).to(v.dtype), v)


def folded_bias(q, k, v, causal):
    """The softmax of the [B*H, Lq, Lk] product itself, the causal mask as the baddbmm input [1, Lq, Lk]."""
    B, Hh, L, D = q.shape
    q3, k3, v3 = (t.reshape(B * Hh, L, D) for t in (q, k, v))
    s3 = additive(causal)[0].baddbmm(q3, k3.transpose(-1, -2), alpha=0.5)
    return torch.bmm(s3.softmax(-1), v3).view(B, Hh, L, D)


def row_max_shift(q, k, v, causal):
    """MiMo-V2-Flash's layers without sinks: the masked scores minus their row maximum."""
    s = q @ k.transpose(2, 3) * 0.5 + additive(causal)
    s = s - s.max(dim=-1, keepdim=True).values
    return F.softmax(s, dim=-1, dtype=s.dtype) @ v


def cpmant(q, k, v, causal):
    """CPM-Ant: ``masked_fill`` with ``torch.scalar_tensor(-inf)``, and the probabilities of fully masked rows
    zeroed with the same condition, built a second time."""
    L = q.shape[2]
    s = torch.matmul(q, k.transpose(-1, -2)) / 2.0
    s = torch.masked_fill(s, causal.view(1, 1, L, L) == torch.tensor(False),
                          torch.scalar_tensor(float("-inf"), dtype=s.dtype))
    p = torch.masked_fill(F.softmax(s, dim=-1), causal.view(1, 1, L, L) == torch.tensor(False),
                          torch.scalar_tensor(0, dtype=s.dtype))
    return torch.matmul(p, v)


def xlm(q, k, v, causal):
    """XLM: the condition broadcast to the scores by ``expand_as(scores)`` (a read of their shape only) and written
    into them in place, the softmax of a cast of the scores (XLM's ``.float()``; the model's float64 here) cast back
    by ``type_as(scores)``, dropout at p = 0."""
    L = q.shape[2]
    s = torch.matmul(q / 2.0, k.transpose(2, 3))
    m = (causal == 0).view(1, 1, L, L).expand_as(s)
    s.masked_fill_(m, torch.finfo(s.dtype).min)
    w = F.dropout(F.softmax(s.double(), dim=-1).type_as(s), p=0.0, training=True)
    return torch.matmul(w, v)


def float32_mask(q, k, v, causal):
    """A float32 additive mask on float64 scores: the sum promotes it exactly."""
    return F.softmax(q @ k.transpose(-1, -2) + additive(causal, torch.float32), -1) @ v


def openai_gpt(q, k, v, causal, scale=1.0, fill=-1e4):
    """OpenAI-GPT: k^T made by one permute of the [B, L, H, D] key (``permute(0, 2, 3, 1)``), the multiplicative
    causal mask ``w * b + fill * (1 - b)`` with a 0/1 float ``b`` (times ``scale``), then a padding mask added."""
    w = torch.matmul(q, k.transpose(1, 2).permute(0, 2, 3, 1)) / 2.0
    b = causal.to(q.dtype)[None, None] * scale
    w = w * b + fill * (1 - b)
    w = w + additive(causal)[..., -1:, :]  # a [1, 1, 1, L] additive mask of zeros on top
    return torch.matmul(F.dropout(F.softmax(w, dim=-1), p=0.0, training=False), v)


@pytest.mark.parametrize("attn", [
    bart, lambda *a: bart(*a, floor=True, twice=True), neox_japanese, folded_bias, row_max_shift, cpmant,
    float32_mask, openai_gpt, xlm], ids=["bart", "xglm", "neox_japanese", "folded_bias", "row_max_shift", "cpmant",
                                         "float32_mask", "openai_gpt", "xlm"])
def test_eager_spelling_replays_exactly(attn):
    """Loss and every gradient equal eager's in float64; the call replayed, the attention as tree attention."""
    backend = replay_exact(EagerLM(attn), vocab=V)
    assert "tree_attention" in backend.records[0].packed_code


def float64_mask(q, k, v, causal):
    """A float64 additive mask on float32 scores: the sum promotes the scores exactly, the softmax runs in float64,
    the probabilities return to float32 for the product with the values."""
    return F.softmax(q @ k.transpose(-1, -2) * 0.5 + additive(causal), -1).to(q.dtype) @ v


def test_higher_precision_mask_replays_to_the_float32_bound():
    """A mask of higher precision than the scores (autocast's bfloat16 scores plus HF's float32 mask, here float32
    scores plus a float64 mask) promotes them exactly; tree attention in float32 agrees to the float32 bound."""
    backend = replay_exact(EagerLM(float64_mask), vocab=V, dtype=torch.float32)
    assert "tree_attention" in backend.records[0].packed_code


def scores_in_bfloat16(q, k, v, causal):
    """The scores product in an autocast region, the product with the values outside it (float32)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s = q @ k.transpose(-1, -2)
    return F.softmax(s + additive(causal, torch.float32), -1) @ v


def probabilities_in_float16(q, k, v, causal):
    """Both products in an autocast region (bfloat16), the probabilities rounded to float16 between them."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        p = F.softmax(q @ k.transpose(-1, -2) + additive(causal, torch.float32), -1).half()
        o = p @ v
    return o.float()


@pytest.mark.parametrize("attn,reason", [
    (scores_in_bfloat16, r"scores q k\^T are computed in torch.bfloat16, the product with the values in torch.float32"),
    (probabilities_in_float16, r"the probabilities are torch.float16, the query is torch.float32 and the attention "
     r"computes in torch.bfloat16"),
], ids=["scores_in_bfloat16", "probabilities_in_float16"])
def test_attention_in_two_dtypes_refused(attn, reason):
    """A chain whose steps compute in dtypes tree attention cannot take together (it computes q k^T and p v in one
    dtype, the canonical SDPA node's) falls back with the dtypes named."""
    gm, inputs = capture(EagerLM(attn), torch.randint(1, V, (3, 7)))
    with pytest.raises(CannotReplay, match=reason) as e:  # the wording names the dtypes
        canonicalize(gm, inputs)
    assert e.value.code is Code.EAGER_ATTENTION


class LseSink(torch.nn.Module):
    """GraniteMoE-SWA: a learned per-head sink applied after the attention as ``sigmoid(logsumexp(s) - S)``
    (``cast``: the gate computed in that dtype, as Granite's ``.to(torch.float32)``)."""

    def __init__(self, cast=None):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.randn(H))
        self.cast = cast

    def forward(self, q, k, v, causal):
        s = torch.matmul(q, k.transpose(2, 3)) * 0.5 + additive(causal)
        gate = torch.logsumexp(s, dim=-1) - self.sinks.view(1, -1, 1)
        gate = (gate.to(self.cast) if self.cast is not None else gate).sigmoid()
        o = torch.matmul(F.dropout(F.softmax(s, dim=-1).to(q.dtype), p=0.0, training=False), v)
        return o * gate.unsqueeze(-1).to(o.dtype)


def test_lse_sink_replays_exactly_as_a_sink():
    """The gate ``sigmoid(logsumexp(s) - S)`` on the output is a sink logit S[h]: tree attention with ``sinks``
    gives the loss and every gradient (S's included) as eager does in float64."""
    backend = replay_exact(EagerLM(LseSink()), vocab=V)
    code = backend.records[0].packed_code
    assert "tree_attention" in code and "parameters_sinks_" in code


def returned_weights(q, k, v, causal):
    """BART's attention whose [B, H, Lq, Lk] weights the loss also reads (output_attentions=True)."""
    B, Hh, L, D = q.shape
    q3, k3, v3 = (t.reshape(B * Hh, L, D) for t in (q, k, v))
    w = F.softmax((torch.bmm(q3, k3.transpose(1, 2)).view(B, Hh, L, L) + additive(causal)).view(B * Hh, L, L), -1)
    w4 = w.view(B, Hh, L, L)
    return torch.bmm(w4.view(B * Hh, L, L), v3).view(B, Hh, L, D) + w4.sum(-1, keepdim=True)


@pytest.mark.parametrize("attn,reason", [
    (returned_weights, "other users"),
    (lambda q, k, v, c: F.softmax(q @ k.transpose(-1, -2) + additive(c) + torch.ones(1, H, 1, 1).float(), -1) @ v,
     "torch.float32 per-head bias"),
    (LseSink(torch.float32), "sink gate sigmoid"),
    (lambda q, k, v, c: F.softmax(torch.cat([q @ k.transpose(-1, -2) + additive(c), q[..., :2]], -1),
                                  -1)[..., :-2] @ v, "not one sink logit per query row"),
], ids=["returned_weights", "float32_bias", "float32_lse_sink", "two_sink_columns"])
def test_eager_spelling_refused_with_reason(attn, reason):
    """Attention weights read by the loss, and a lower-precision per-head bias, fall back with the reason."""
    gm, inputs = capture(EagerLM(attn).double(), torch.randint(1, V, (3, 7)))
    with pytest.raises(CannotReplay, match=reason) as e:  # the wording names the construct
        canonicalize(gm, inputs)
    assert e.value.code is Code.EAGER_ATTENTION


def sink_column(q, k, v, causal, sink):
    """Inkling2's attention sinks: a [B, H, Lq, 1] logit column joined to the scores, dropped after the
    softmax."""
    s = torch.cat([q @ k.transpose(-1, -2) * 0.5 + additive(causal), sink], -1)
    return F.softmax(s, -1)[..., :-1] @ v


def test_per_query_sinks_replay_exactly():
    """A sink logit computed per query token (a function of the query's own q) is tree attention's [H, N]
    per-query ``sinks``: loss and every gradient as eager in float64."""
    backend = replay_exact(EagerLM(lambda q, k, v, c: sink_column(q, k, v, c, q.sum(-1, keepdim=True))), vocab=V)
    code = backend.records[0].packed_code
    assert "tree_attention_forward" in code and "squeeze" in code


@pytest.mark.parametrize("sink,reason", [
    (lambda q: q.sum(-1, keepdim=True).mean(0, keepdim=True).expand(q.shape[0], -1, -1, -1), "not a value of the "
     "query token"),
    (lambda q: q.sum(-1, keepdim=True).flip(2), "not a value of the query token"),
    (lambda q: q.sum((-1, -2), keepdim=True).expand(-1, -1, q.shape[2], 1), "not a value of the query token"),
], ids=["mean_over_rows", "later_positions", "all_positions"])
def test_sinks_not_of_the_query_token_fall_back(sink, reason):
    """A sink column that mixes the rows of the batch or reads other positions than the query's is refused."""
    codes, reasons = fallback_reasons(EagerLM(lambda q, k, v, c: sink_column(q, k, v, c, sink(q))))
    assert codes == {Code.ATTENTION_SINKS} and reason in reasons, reasons


def fallback_reasons(model) -> tuple[set, str]:
    """Compile ``model`` (ids -> scalar) in float64 on a batch sharing a prefix: the loss equals eager's and the
    call fell back; returns its codes and reasons."""
    model = model.double()
    ids = torch.randint(1, V, (1, 7)).repeat(3, 1)
    want = model(ids)
    got = torch.compile(model, backend=brcompile.backend(compiler="eager"))(ids)
    assert torch.equal(got, want)
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls == 1, str(s)
    return set(s.fallback_codes), " | ".join(s.fallback_reasons)


@pytest.mark.parametrize("scale,fill,reason", [
    (0.5, -1e4, "B is not 0 or 1"), (1.0, -10.0, "A does not block")], ids=["scaled", "finite_fill"])
def test_multiplicative_mask_that_is_not_a_mask_is_refused(scale, fill, reason):
    """``s * B + A`` is a mask only where B is 0/1 and A blocks where B is 0: a B of 0.5 scales the scores, a fill
    of -10 keeps them a finite bias: both are refused on the probes, naming the blend."""
    codes, reasons = fallback_reasons(EagerLM(lambda q, k, v, c: openai_gpt(q, k, v, c, scale, fill)))
    assert codes == {Code.MASK_FLOAT_BIAS} and reason in reasons, reasons  # the detail names the blend


def single_head_3d(q, k, v, causal, bias=None):
    """A softmax over ``q @ k^T`` (plus ``bias``, when given) of [B, L, D] values (no head dim): no attention
    spelling this backend matches."""
    q3, k3, v3 = (t[:, 0] for t in (q, k, v))
    s = torch.matmul(q3, k3.transpose(1, 2))
    s = (s if bias is None else s + bias).masked_fill(~causal, float("-inf"))
    return (F.softmax(s, dim=-1) @ v3).unsqueeze(1).expand(-1, H, -1, -1)


def test_unrecognised_attention_is_named():
    """A graph with no recognised attention but a softmax over a product of two batch values is refused naming
    that chain, not as a graph without attention."""
    codes, reasons = fallback_reasons(EagerLM(single_head_3d))
    assert codes == {Code.UNRECOGNISED_ATTENTION}, reasons
    assert "softmax <- masked_fill <- matmul" in reasons, reasons  # the detail names the chain


def single_head_3d_with_cumsum(q, k, v, causal):
    """:func:`single_head_3d` with a per-key bias from a ``cumsum`` of the mask (a scan the token ids do not feed,
    as ProphetNet's position buckets)."""
    return single_head_3d(q, k, v, causal, bias=causal.to(q.dtype).cumsum(-1)[None] * 1e-3)


def test_unrecognised_attention_is_named_in_a_graph_with_scans():
    """A scan the token ids do not feed does not hide the unrecognised attention behind "its scans do not
    depend on the token ids"."""
    codes, reasons = fallback_reasons(EagerLM(single_head_3d_with_cumsum))
    assert codes == {Code.UNRECOGNISED_ATTENTION}, reasons
