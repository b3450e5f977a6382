"""The op-spelling table and the eager-attention canonicalisation by meaning (passes/spellings.py,
passes/canonicalize.py). End-to-end exactness of the spellings is in tests/models/zoo."""
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from brcompile.passes.axes import CannotReplay
from brcompile.passes.canonicalize import canonicalize
from brcompile.passes.rules.attention import SDPA
from brcompile.passes.spellings import FAMILIES, family_of, is_op, spellings


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
    with pytest.raises(CannotReplay, match="not a large negative constant"):
        canonicalize(gm, inputs)


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


def test_3d_softmax_is_refused_by_name():
    gm, inputs = capture(lambda q, b: attn_3d(q, b, softmax_3d=True), Q, torch.randn(4, 1, 5, dtype=torch.float64))
    with pytest.raises(CannotReplay, match=r"softmax of \[B\*H, Lq, Lk\] scores"):
        canonicalize(gm, inputs)
