"""brcompile::tree_attention: reference and cpu impls against dense per-row SDPA, opcheck, flops. The "cpu" impl
runs both ways (the ``cpu_path`` fixture): its compiled kernel (backends/attention/cpu_kernel.py) and the
segment-pair schedule.

The end-to-end truth: for a dense batch of rows gathered from packed tokens through ``index``,
packed_out[:, index[b, t]] == dense_out[b, :, t] where the dense run is F.scaled_dot_product_attention
with a causal & key-padding mask, and the gradients of the dense run w.r.t. the packed inputs (through the
gather, so shared tokens sum their rows' gradients) equal the op's gradients.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from brcompile.backends.attention import op as ops
from brcompile.testing import TOLERANCE
from brcompile.backends.attention.op import (
    AttentionImpl,
    AttentionImplError,
    TreeAttentionArgs,
    TreeAttentionError,
    count_visible_pairs,
    get_attention_impl,
    register_attention_impl,
    registered_attention_impls,
    tree_attention,
)
from brcompile.backends.attention.reference import dense_tree_mask
from brcompile.backends.attention.cpu import segment_schedule

PAD = 0


@pytest.fixture(params=["kernel", "schedule"])
def cpu_path(request, monkeypatch):
    """The "cpu" impl's way: its compiled kernel (a failed build raises; skipped without a C++ compiler) or the
    segment-pair schedule over torch's flash kernel."""
    if request.param == "kernel" and shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on PATH: the cpu kernel cannot be built")
    monkeypatch.setenv("BRCOMPILE_CPU_KERNELS", "1" if request.param == "kernel" else "0")
    return request.param

# --------------------------------------------------------------------------------------- tree helper


@dataclass
class ToyTree:
    """Tree arrays of a batch, built independently of brcompile.runtime.tree (a plain trie walk)."""

    index: torch.Tensor  # [B, L] -> packed token
    parent: torch.Tensor  # [N], -1 for roots
    end: torch.Tensor  # [N] exclusive subtree end
    valid: torch.Tensor  # [N]
    segments: torch.Tensor  # [S, 3]

    @property
    def arrays(self):
        return self.end, self.valid, self.segments


def toy_tree(tokens: torch.Tensor, mask: torch.Tensor) -> ToyTree:
    """Trie of rows keyed by (token, mask bit) per position, numbered in DFS preorder (children in order
    of first appearance); segments are the maximal chains of single-child nodes."""
    b, l = tokens.shape
    children: dict[int, dict] = {-1: {}}
    node_of = torch.empty(b, l, dtype=torch.int64)
    valid_of = []
    for r in range(b):
        cur = -1
        for t in range(l):
            key = (int(tokens[r, t]), bool(mask[r, t]))
            nxt = children[cur].get(key)
            if nxt is None:
                nxt = len(valid_of)
                valid_of.append(key[1])
                children[cur][key] = nxt
                children[nxt] = {}
            node_of[r, t] = nxt
            cur = nxt
    n = len(valid_of)
    order, parent_raw = [], {}
    stack = [(c, -1) for c in reversed(list(children[-1].values()))]
    while stack:
        node, par = stack.pop()
        order.append(node)
        parent_raw[node] = par
        stack.extend((c, node) for c in reversed(list(children[node].values())))
    new_id = {old: i for i, old in enumerate(order)}
    parent = torch.tensor([new_id[parent_raw[o]] if parent_raw[o] >= 0 else -1 for o in order], dtype=torch.int64)
    valid = torch.tensor([valid_of[o] for o in order], dtype=torch.bool)
    n_children = [len(children[o]) for o in order]
    end = torch.arange(1, n + 1, dtype=torch.int64)
    for i in reversed(range(n)):  # a node's subtree ends where its last descendant's ends
        if parent[i] >= 0:
            end[parent[i]] = max(int(end[parent[i]]), int(end[i]))
    segments, start = [], 0
    for i in range(n):
        last_of_chain = n_children[i] != 1
        if last_of_chain:
            segments.append((start, i + 1, int(end[start])))
            start = i + 1
    index = node_of.clone().apply_(lambda o: new_id[o])
    return ToyTree(index, parent, end, valid, torch.tensor(segments, dtype=torch.int64).reshape(-1, 3))


def rollout_batch(seed: int, groups, tail_len: int, branch_depth: int = 0, vocab: int = 50):
    """Rows for `groups` = [(prompt_len, G), ...]: each group repeats one prompt, then G tails; the first
    `branch_depth` tail tokens are shared by pairs of rows (a nested branch). Right-aligned prompts
    (left padding) when prompt lengths differ; rows padded on the right to a common length."""
    g = torch.Generator().manual_seed(seed)
    p_max = max(p for p, _ in groups)
    rows, masks = [], []
    for p, n_rows in groups:
        prompt = torch.randint(1, vocab, (p,), generator=g)
        shared = torch.randint(1, vocab, (n_rows // 2 + 1, branch_depth), generator=g)
        for r in range(n_rows):
            tail_n = int(torch.randint(1, tail_len + 1, (1,), generator=g))
            tail = torch.randint(1, vocab, (tail_n,), generator=g)
            body = torch.cat([prompt, shared[r // 2], tail])
            left = p_max - p
            right = p_max + branch_depth + tail_len - left - body.numel()
            rows.append(torch.cat([torch.full((left,), PAD), body, torch.full((right,), PAD)]))
            masks.append(torch.cat([torch.zeros(left), torch.ones(body.numel()), torch.zeros(right)]).bool())
    return torch.stack(rows), torch.stack(masks)


def _with_holes(tokens, mask, positions):
    """A copy of the batch with keys (row, pos) masked out (padding holes in the middle of rows)."""
    tokens, mask = tokens.clone(), mask.clone()
    for row, pos in positions:
        tokens[row, pos] = PAD
        mask[row, pos] = False
    return tokens, mask


def _random_holes(tokens, mask, seed, p=0.15):
    """Mask out each valid position with probability p (holes anywhere, some rows fully masked)."""
    drop = (torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed)) < p) & mask
    return tokens.masked_fill(drop, PAD), mask & ~drop


def _cases():
    """Named batches: shared prefix, nested branches, left/right padding, holes, no sharing, duplicates."""
    cases = {
        "one_prompt": rollout_batch(0, [(13, 4)], tail_len=7),
        "nested": rollout_batch(1, [(9, 5)], tail_len=6, branch_depth=3),
        "two_groups_padded": rollout_batch(2, [(11, 3), (6, 3)], tail_len=5, branch_depth=2),
    }
    t, m = rollout_batch(3, [(10, 4)], tail_len=6)
    t[2, 10:16] = torch.arange(11, 17)  # row 2: a tail of 6 valid tokens, then a hole inside it
    m[2, 10:16] = True
    cases["holes"] = _with_holes(t, m, [(r, 4) for r in range(4)] + [(2, 12)])
    t = torch.randint(1, 40, (3, 9), generator=torch.Generator().manual_seed(4))
    cases["no_sharing_and_duplicate"] = (torch.cat([t, t[1:2]]), torch.ones(4, 9, dtype=torch.bool))
    return cases


CASES = _cases()

# ----------------------------------------------------------------------------------------- dense truth


def _dense_sdpa(q, k, v, tree: ToyTree, mask, scale):
    """Dense per-row SDPA over the batch gathered from packed q/k/v: [B, Hq, L, D]."""
    hq, hkv = q.shape[0], k.shape[0]
    qd = q[:, tree.index].transpose(0, 1)
    kd = k[:, tree.index].transpose(0, 1).repeat_interleave(hq // hkv, dim=1)
    vd = v[:, tree.index].transpose(0, 1).repeat_interleave(hq // hkv, dim=1)
    l = mask.shape[1]
    causal = torch.ones(l, l, dtype=torch.bool).tril()
    attn_mask = (causal[None] & mask[:, None, :])[:, None]
    return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=attn_mask, scale=scale)


def _inputs(n, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(hq, n, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    k = torch.randn(hkv, n, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    v = torch.randn(hkv, n, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return q, k, v


def assert_rel_close(actual, expected, tol, what="", floor: float = 0.0):
    """Elementwise |a - e| <= tol * (|e| + max(max|e|, floor)): relative to the tensor's scale (or ``floor`` when
    the tensor is a sum of terms that cancel to below it), with diagnostics."""
    scale = max(expected.detach().abs().max().item(), floor)
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * max(scale, 1e-30), msg=lambda m: f"{what}: {m}")


TOL = TOLERANCE  # the contract's bound per dtype (brcompile.testing)


def _run_packed_and_dense(case, hq, hkv, d, dtype, impl, seed=0):
    tokens, mask = CASES[case]
    tree = toy_tree(tokens, mask)
    n = tree.end.numel()
    q, k, v = _inputs(n, hq, hkv, d, dtype, seed)
    scale = d**-0.5
    w = torch.randn(tokens.shape[0], hq, tokens.shape[1], d, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(seed + 1)).to(dtype)

    out_p = tree_attention(q, k, v, tree.arrays, impl=impl)
    dense_from_packed = out_p[:, tree.index].transpose(0, 1)
    grads_p = torch.autograd.grad((dense_from_packed * w).sum(), (q, k, v))

    out_d = _dense_sdpa(q, k, v, tree, mask, scale)
    grads_d = torch.autograd.grad((out_d * w).sum(), (q, k, v))
    return tree, dense_from_packed, out_d, grads_p, grads_d


# -------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("impl", ["cpu", "reference"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "case,hq,hkv,d",
    [
        ("one_prompt", 2, 2, 32),
        ("nested", 6, 2, 48),
        ("two_groups_padded", 3, 1, 64),
        ("holes", 4, 2, 32),
        ("no_sharing_and_duplicate", 6, 3, 48),
    ],
)
def test_matches_dense_sdpa(case, hq, hkv, d, dtype, impl, cpu_path):
    """Packed output gathered through index and all three grads equal dense per-row SDPA."""
    tree, out_p, out_d, grads_p, grads_d = _run_packed_and_dense(case, hq, hkv, d, dtype, impl)
    tol = TOL[dtype]
    assert tree.end.numel() < tree.index.numel()  # something is shared: the packing did real work
    assert_rel_close(out_p, out_d, tol, f"{case} out")
    for name, gp, gd in zip("qkv", grads_p, grads_d):
        assert_rel_close(gp, gd, tol, f"{case} d{name}")


def test_fully_masked_queries_are_zero_with_zero_grad(cpu_path):
    """Left-padding queries see no key: out 0, lse -inf, no gradient into their q."""
    tokens, mask = CASES["two_groups_padded"]
    tree = toy_tree(tokens, mask)
    blind = dense_tree_mask(tree.end, tree.valid).sum(1) == 0
    assert blind.any()
    q, k, v = _inputs(tree.end.numel(), 4, 2, 32, torch.float64)
    out, lse = torch.ops.brcompile.tree_attention_forward(q, k, v, *tree.arrays, 32**-0.5, "cpu")
    assert torch.isneginf(lse[:, blind]).all() and torch.isfinite(lse[:, ~blind]).all()
    assert (out[:, blind] == 0).all()
    (dq,) = torch.autograd.grad(out.pow(2).sum() + out.sum(), (q,))
    assert (dq[:, blind] == 0).all() and torch.isfinite(dq).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cpu_matches_reference_including_lse(dtype, cpu_path):
    """cpu forward (out, lse) and backward equal the float64 oracle, with a stride-0 grad_out."""
    tokens, mask = CASES["nested"]
    tree = toy_tree(tokens, mask)
    q, k, v = _inputs(tree.end.numel(), 6, 3, 48, dtype, seed=5)
    res = {}
    for impl in ("cpu", "reference"):
        out, lse = torch.ops.brcompile.tree_attention_forward(q, k, v, *tree.arrays, 0.37, impl)
        grads = torch.autograd.grad(out.sum(), (q, k, v))  # grad_out is expanded: stride 0
        res[impl] = (out, lse, grads)
    tol = TOL[dtype]
    assert_rel_close(res["cpu"][0], res["reference"][0], tol, "out")
    assert_rel_close(res["cpu"][1], res["reference"][1], tol, "lse")
    for name, a, b in zip("qkv", res["cpu"][2], res["reference"][2]):
        assert_rel_close(a, b, tol, f"d{name}")


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_cpu_half_precision(dtype, tol):
    """bf16/fp16 inputs: out in the input dtype, lse in float32, close to the float64 oracle."""
    tokens, mask = CASES["one_prompt"]
    tree = toy_tree(tokens, mask)
    q, k, v = _inputs(tree.end.numel(), 4, 2, 32, dtype, seed=7)
    out, lse = torch.ops.brcompile.tree_attention_forward(q, k, v, *tree.arrays, 32**-0.5, "cpu")
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref_out, ref_lse = torch.ops.brcompile.tree_attention_forward(
        q.double(), k.double(), v.double(), *tree.arrays, 32**-0.5, "reference"
    )
    assert_rel_close(out.double(), ref_out, tol, "out")
    assert_rel_close(lse.double(), ref_lse, tol, "lse")
    grads = torch.autograd.grad(out.float().pow(2).sum(), (q, k, v))
    assert all(gr.dtype == dtype and torch.isfinite(gr).all() for gr in grads)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    groups=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 4)), min_size=1, max_size=3),
    tail_len=st.integers(1, 6),
    branch_depth=st.integers(0, 3),
    kv_heads=st.sampled_from([(2, 2), (4, 1), (6, 3)]),
    holes=st.sampled_from([0.0, 0.2]),
    seed=st.integers(0, 10_000),
)
def test_property_random_forests(groups, tail_len, branch_depth, kv_heads, holes, seed, cpu_path):
    """Random forests (groups, nested branches, padding, holes, single rows): cpu == oracle == dense."""
    hq, hkv = kv_heads
    tokens, mask = _random_holes(*rollout_batch(seed, groups, tail_len, branch_depth, vocab=4), seed, holes)
    tree = toy_tree(tokens, mask)
    q, k, v = _inputs(tree.end.numel(), hq, hkv, 32, torch.float64, seed)
    outs = {}
    for impl in ("cpu", "reference"):
        out = tree_attention(q, k, v, tree.arrays, impl=impl)
        outs[impl] = (out, torch.autograd.grad((out * out).sum(), (q, k, v)))
    dense = _dense_sdpa(q, k, v, tree, mask, 32**-0.5)
    assert_rel_close(outs["cpu"][0][:, tree.index].transpose(0, 1), dense, 1e-10, "cpu vs dense")
    assert_rel_close(outs["cpu"][0], outs["reference"][0], 1e-10, "cpu vs reference")
    # a gradient that cancels analytically (dq of a query with one visible key: its softmax is 1 whatever the
    # score) is the rounding of its terms, whose size is the other gradients': measured against the largest one
    largest = max(b.abs().max().item() for b in outs["reference"][1])
    for name, a, b in zip("qkv", outs["cpu"][1], outs["reference"][1]):
        assert_rel_close(a, b, 1e-10, f"d{name}", floor=largest)


def test_schedule_covers_exactly_the_visible_pairs():
    """The calls of the segment-pair schedule evaluate the mask's pairs once each (holes aside)."""
    for case, (tokens, mask) in CASES.items():
        tree = toy_tree(tokens, mask)
        n = tree.end.numel()
        covered = torch.zeros(n, n, dtype=torch.int64)
        for c in segment_schedule(*tree.arrays):
            block = torch.ones(c.q_stop - c.q_start, c.k_stop - c.k_start, dtype=torch.int64)
            covered[c.q_start : c.q_stop, c.k_start : c.k_stop] += block.tril() if c.causal else block
        visible = dense_tree_mask(tree.end, tree.valid)
        assert covered.max() <= 1, case
        assert (covered.bool() | ~visible).all(), f"{case}: a visible pair is not evaluated"
        assert (visible | ~covered.bool() | ~tree.valid[None, :]).all(), f"{case}: an invisible valid pair"


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_opcheck(impl, cpu_path):
    """torch.library.opcheck: schema, fake impl, autograd registration, AOT dispatch (static+dynamic)."""
    tokens, mask = CASES["two_groups_padded"]
    tree = toy_tree(tokens, mask)
    q, k, v = _inputs(tree.end.numel(), 4, 2, 32, torch.float64)
    args = (q, k, v, *tree.arrays, 0.25, impl)
    torch.library.opcheck(torch.ops.brcompile.tree_attention_forward.default, args)
    torch.library.opcheck(torch.ops.brcompile.tree_attention.default, args)
    with torch.no_grad():
        out, lse = torch.ops.brcompile.tree_attention_forward(*args)
    grad_out = torch.randn_like(out)
    torch.library.opcheck(
        torch.ops.brcompile.tree_attention_backward.default,
        (grad_out, q.detach(), k.detach(), v.detach(), out, lse, *tree.arrays, 0.25, impl),
    )


def test_flop_formula_counts_visible_pairs():
    """FlopCounterMode total == (4 + 10) * D * Hq * visible pairs, far below dense for a shared prompt."""
    tokens, mask = rollout_batch(9, [(60, 8)], tail_len=3)
    tree = toy_tree(tokens, mask)
    hq, hkv, d = 4, 2, 32
    q, k, v = _inputs(tree.end.numel(), hq, hkv, d, torch.float32)
    pairs = int(dense_tree_mask(tree.end, tree.valid).sum())
    assert count_visible_pairs(tree.end, tree.valid) == pairs
    with FlopCounterMode(display=False) as counter:
        tree_attention(q, k, v, tree.arrays, impl="cpu").sum().backward()
    assert counter.get_total_flops() == pairs * hq * (4 * d + 10 * d)
    b, l = tokens.shape
    dense_causal_pairs = b * l * (l + 1) // 2
    assert pairs * 3 < dense_causal_pairs


def test_flop_formula_without_data_uses_the_causal_bound():
    """Under fake tensors the pair count cannot be read: the dense causal bound over N is used."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        end = torch.empty(7, dtype=torch.int64)
        valid = torch.empty(7, dtype=torch.bool)
        assert count_visible_pairs(end, valid) == 28


def test_errors_are_typed_and_clear(cpu_path):
    tokens, mask = CASES["one_prompt"]
    tree = toy_tree(tokens, mask)
    n = tree.end.numel()
    q, k, v = _inputs(n, 4, 2, 32, torch.float64)
    with pytest.raises(AttentionImplError, match="unknown tree_attention impl 'nope'"):
        tree_attention(q, k, v, tree.arrays, impl="nope")
    with pytest.raises(TreeAttentionError, match="multiple of Hkv"):
        tree_attention(q[:3], k, v, tree.arrays, impl="cpu")
    with pytest.raises(TreeAttentionError, match="end must be int64"):
        tree_attention(q, k, v, (tree.end.int(), tree.valid, tree.segments), impl="cpu")
    bad = tree.segments.clone()
    bad[0, 2] += 1  # subtree end of the root chain no longer matches end[]
    with pytest.raises(TreeAttentionError, match="disagrees with segments|do not partition"):
        tree_attention(q, k, v, (tree.end, tree.valid, bad), impl="cpu")
    with pytest.raises(AttentionImplError, match="runs on"):
        get_attention_impl("cpu", "meta")
    assert get_attention_impl("auto", "cpu").name == "cpu"


def test_registry_accepts_new_impls(monkeypatch):
    """A registered impl is dispatched to by name with one TreeAttentionArgs and must return correctly
    shaped results."""
    registry = ops.ATTENTION_IMPLS
    monkeypatch.setattr(registry, "_impls", dict(registry._impls))  # registrations below do not outlive the test
    calls = []

    def fwd(a):
        assert isinstance(a, TreeAttentionArgs) and a.scale == 0.5 and not a.window and a.position is None
        calls.append("fwd")
        return get_attention_impl("reference", a.q.device).forward(a)

    def bwd(a, grad_out, out, lse):
        calls.append("bwd")
        return get_attention_impl("reference", a.q.device).backward(a, grad_out, out, lse)

    register_attention_impl(AttentionImpl("test_spy", fwd, bwd))
    assert "test_spy" in registered_attention_impls()
    tokens, mask = CASES["one_prompt"]
    tree = toy_tree(tokens, mask)
    q, k, v = _inputs(tree.end.numel(), 2, 1, 32, torch.float64)
    tree_attention(q, k, v, tree.arrays, 0.5, impl="test_spy").sum().backward()
    assert calls == ["fwd", "bwd"]
    with pytest.raises(AttentionImplError, match="does not support a sliding window"):
        tree_attention(q, k, v, tree.arrays, 0.5, impl="test_spy", window=2, position=torch.arange(q.shape[1]))

    register_attention_impl(AttentionImpl("test_bad", lambda a: (a.q[:, :1], a.q[:, 0]), bwd))
    with pytest.raises(AttentionImplError, match="returned out"):
        tree_attention(q, k, v, tree.arrays, impl="test_bad")
    with pytest.raises(AttentionImplError, match="invalid tree_attention impl name"):
        AttentionImpl("auto", fwd, bwd)
    with pytest.raises(AttentionImplError, match="register expects AttentionImpl"):
        register_attention_impl(object())


def test_impls_take_args_or_the_ops_positional_arguments():
    """reference/cpu forward and backward: one TreeAttentionArgs, or (standalone) the op's positional
    arguments, which are checked first; both give the same numbers."""
    from brcompile.backends.attention.cpu import cpu_backward, cpu_forward
    from brcompile.backends.attention.reference import reference_backward, reference_forward

    tokens, mask = CASES["one_prompt"]
    tree = toy_tree(tokens, mask)
    q, k, v = _inputs(tree.end.numel(), 4, 2, 32, torch.float64)
    a = TreeAttentionArgs(q, k, v, *tree.arrays, 0.3).check()
    go = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(4))
    for forward, backward in ((reference_forward, reference_backward), (cpu_forward, cpu_backward)):
        out, lse = forward(a)
        out2, lse2 = forward(q, k, v, *tree.arrays, 0.3)
        assert torch.equal(out, out2) and torch.equal(lse, lse2)
        grads = backward(a, go, out, lse)
        for g, g2 in zip(grads, backward(go, q, k, v, out, lse, *tree.arrays, 0.3)):
            assert torch.equal(g, g2)
        with pytest.raises(TreeAttentionError, match="multiple of Hkv"):
            forward(q[:3], k, v, *tree.arrays, 0.3)
    with pytest.raises(TreeAttentionError, match="window must be an int"):
        a.replace(window=2.5, position=torch.arange(q.shape[1])).check()
    with pytest.raises(TreeAttentionError, match="softcap must be a finite float"):
        a.replace(softcap=float("nan")).check()


def test_one_registry_for_every_op():
    """tree_attention and packed_logprob impls live in two instances of one Registry: lazy built-ins,
    typed errors, "auto" resolved per device."""
    from brcompile.backends.logprob import op as logprob
    from brcompile.backends.common.registry import Registry

    assert isinstance(ops.ATTENTION_IMPLS, Registry) and isinstance(logprob.LOGPROB_IMPLS, Registry)
    assert {"cpu", "reference", "triton"} <= set(registered_attention_impls())
    assert {"cpu", "triton"} <= set(logprob.registered_logprob_impls())
    ops.ATTENTION_IMPLS.check_name("auto")
    with pytest.raises(AttentionImplError, match="unknown tree_attention impl"):
        ops.ATTENTION_IMPLS.check_name("nope")
    with pytest.raises(logprob.LogprobError, match="unknown packed_logprob impl"):
        logprob.LOGPROB_IMPLS.check_name("nope")
    with pytest.raises(AttentionImplError, match="does not run on meta"):
        get_attention_impl("cpu", "meta")
    assert logprob.get_logprob_impl("auto", "meta", torch.float32).name == "cpu"  # cpu runs anywhere


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_with_packed_tree_from_build_tree(dtype):
    """The wrapper takes a brcompile.runtime.tree.PackedTree; its segments pass the cpu impl's consistency check
    and the result equals dense SDPA on the padded, branched batch."""
    from brcompile.runtime.tree import build_tree

    tokens, mask = CASES["two_groups_padded"]
    tree = build_tree(tokens, mask)
    q, k, v = _inputs(tree.end.numel(), 6, 2, 48, dtype, seed=11)
    out = tree_attention(q, k, v, tree)  # impl "auto" -> "cpu" on CPU
    grads = torch.autograd.grad(out[:, tree.index].pow(2).sum(), (q, k, v))
    dense = _dense_sdpa(q, k, v, tree, mask, 48**-0.5)
    dense_grads = torch.autograd.grad(dense.pow(2).sum(), (q, k, v))
    assert_rel_close(out[:, tree.index].transpose(0, 1), dense, TOL[dtype], "out")
    for name, a, b in zip("qkv", grads, dense_grads):
        assert_rel_close(a, b, TOL[dtype], f"d{name}")


def test_cpu_plan_is_reused_per_tree_and_never_across_trees():
    """The cpu impl plans its kernel calls once per tree and reuses the plan while the tree arrays are equal
    (each layer's forward and backward); two trees of the same sizes but other arrays (one more hole) each get
    their own plan and match the float64 oracle."""
    from brcompile.backends.attention import cpu

    tree = toy_tree(*CASES["nested"])
    valid = tree.valid.clone()
    valid[int(tree.segments[0, 0]) + 2] = False  # a hole inside the first chain: same N and S, other valid[]
    trees = [tree.arrays, (tree.end, valid, tree.segments)]
    plans = []
    for arrays in trees:
        q, k, v = _inputs(arrays[0].numel(), 4, 2, 16, torch.float64, seed=3)
        res = {}
        for impl in ("cpu", "reference"):
            out, lse = torch.ops.brcompile.tree_attention_forward(q, k, v, *arrays, 0.3, impl)
            res[impl] = (out, lse, *torch.autograd.grad((out * out).sum(), (q, k, v)))
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), res["cpu"], res["reference"]):
            assert_rel_close(a, b, TOL[torch.float64], name)
        plans.append(cpu._plan(ops.TreeAttentionArgs(q, k, v, *arrays, 0.3)))
        assert cpu._plan(ops.TreeAttentionArgs(q, k, v, *(x.clone() for x in arrays), 0.3)) is plans[-1]
    assert plans[0] is not plans[1]
