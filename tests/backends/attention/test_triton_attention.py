"""Triton tree attention vs the float64 reference, on CPU through TRITON_INTERPRET=1 when no GPU exists.

Trees are packed here by a small, independent trie builder (``pack_rows``) so the kernels are checked
against the layout contract itself (DFS preorder, ``end``, ``valid``, ``segments``).
"""
import os

import torch

if not torch.cuda.is_available():  # must precede the first `import triton` in this process
    os.environ["TRITON_INTERPRET"] = "1"

import importlib
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from brcompile.backends.attention import op as ops
from brcompile.backends.attention.reference import reference_backward, reference_forward
import triton
import triton.language as tl

from brcompile.backends.attention.triton import (
    KernelConfig,
    LaunchConfig,
    build_key_tiles,
    is_interpreter,
    tree_attention,
    tree_attention_backward,
    tree_attention_forward,
    window_tile_starts,
)
from tests.helpers import assert_compiles_for_sm90

# the package re-exports the function `tree_attention`, which shadows the submodule's attribute name
ta_module = importlib.import_module("brcompile.backends.attention.triton.launch")
kernels_module = importlib.import_module("brcompile.backends.attention.triton.kernels")

pytestmark = pytest.mark.triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Tiny tiles so a ~100-token tree spans many blocks in the interpreter; one config with unequal
# forward/dq tiles and wide dK/dV key blocks.
SMALL = LaunchConfig(KernelConfig(16, 16, 1, 1), KernelConfig(16, 16, 1, 1), KernelConfig(16, 16, 1, 1))
MIXED = LaunchConfig(KernelConfig(32, 16, 1, 1), KernelConfig(16, 32, 1, 1), KernelConfig(16, 32, 1, 1))


# ------------------------------------------------------------------------------------------ trees


def pack_rows(rows, mask=None):
    """Prefix tree of token rows -> (end[N] int64, valid[N] bool, segments[S, 3] int64).

    A node is a (row prefix) of (token, mask bit) pairs; nodes are numbered in DFS preorder; ``end`` is
    the exclusive end of each node's subtree; a segment is a maximal chain of single-child nodes.
    """
    children = [{}]  # node 0: virtual root
    bit = [1]
    for b, row in enumerate(rows):
        cur = 0
        for t, tok in enumerate(row):
            key = (tok, 1 if mask is None else int(mask[b][t]))
            if key not in children[cur]:
                children.append({})
                bit.append(key[1])
                children[cur][key] = len(children) - 1
            cur = children[cur][key]
    order, pos, parent_fanout = [], {}, {}
    for c in children[0].values():
        parent_fanout[c] = 0  # roots start segments
    stack = list(reversed(list(children[0].values())))
    while stack:
        node = stack.pop()
        pos[node] = len(order)
        order.append(node)
        for c in children[node].values():
            parent_fanout[c] = len(children[node])
        stack.extend(reversed(list(children[node].values())))
    n = len(order)
    end = list(range(1, n + 1))
    for node in reversed(order):  # children come after parents in preorder
        for c in children[node].values():
            end[pos[node]] = max(end[pos[node]], end[pos[c]])
    segments = []
    for i, node in enumerate(order):
        if parent_fanout[node] == 1:
            segments[-1][1] = i + 1
        else:
            segments.append([i, i + 1, end[i]])
    valid = [bool(bit[node]) for node in order]
    return (torch.tensor(end, dtype=torch.int64), torch.tensor(valid, dtype=torch.bool),
            torch.tensor(segments, dtype=torch.int64).reshape(-1, 3))


def rl_rows(seed, groups=3, rollouts=4, prompt=(3, 20), response=(1, 12), vocab=3):
    """Groups of rollouts sharing a prompt; small vocab so responses share prefixes and nest branches."""
    rng = random.Random(seed)
    rows = []
    for _ in range(groups):
        p = [rng.randrange(100, 104) for _ in range(rng.randint(*prompt))]
        for _ in range(rollouts):
            rows.append(p + [rng.randrange(vocab) for _ in range(rng.randint(*response))])
    return rows


def padded(rows, side):
    """Pad rows to one length with token -1 and mask bit 0 on the given side."""
    length = max(map(len, rows))
    out, mask = [], []
    for r in rows:
        pad = length - len(r)
        if side == "left":
            out.append([-1] * pad + r)
            mask.append([0] * pad + [1] * len(r))
        else:
            out.append(r + [-1] * pad)
            mask.append([1] * len(r) + [0] * pad)
    return out, mask


def make_tree(case):
    """Named tree cases: nesting, padding (incl. queries that see nothing), a forest, tiny trees."""
    if case == "rl":
        return pack_rows(rl_rows(0))
    if case == "left_pad":  # left padding: pad-only prefixes are queries that see no key
        return pack_rows(*padded(rl_rows(1, groups=2, rollouts=3), "left"))
    if case == "right_pad":
        return pack_rows(*padded(rl_rows(2, groups=2, rollouts=3), "right"))
    if case == "deep":  # one token per branch level: many short segments, deep ancestor chains
        rows = [[7] * d + [d % 3, 5, 5] for d in range(0, 40, 3)]
        return pack_rows(rows)
    if case == "holes":  # invalid keys scattered inside shared prefixes
        end, valid, segments = pack_rows(rl_rows(3, groups=2, rollouts=3))
        valid[torch.arange(0, end.numel(), 7)] = False
        return end, valid, segments
    if case == "small_left_pad":  # 38 tokens: three 16-query blocks, the last cut at the edge; pad queries
        return pack_rows(*padded(rl_rows(1, groups=2, rollouts=3, prompt=(3, 9), response=(1, 6)), "left"))
    if case == "tiny":
        return pack_rows([[1, 2, 3], [1, 2, 4, 5]])
    if case == "single":
        return pack_rows([[9]])
    raise KeyError(case)


def visible_keys_brute(end, b0, b1):
    """Keys some query in [b0, b1) may see: k < b1 with end[k] > b0 (validity aside)."""
    return {k for k in range(b1) if int(end[k]) > b0}


# ------------------------------------------------------------------------------------- comparison


def assert_rel_close(actual, expected, rel, what):
    """|a - e| <= rel * (|e| + max(max|e|, 1)): relative to the tensor's scale, with diagnostics.

    Inputs are unit-scale randn, so the floor of 1 only matters for a gradient that is zero in exact
    arithmetic (e.g. dq of a query that sees one key), where float32 leaves ~1e-7 of roundoff.
    """
    expected = expected.to(torch.float64)
    scale = max(expected.abs().max().item() if expected.numel() else 0.0, 1.0)
    torch.testing.assert_close(actual.to(torch.float64), expected, rtol=rel, atol=rel * scale,
                               msg=lambda m: f"{what}: {m}")


def random_qkv(hq, hkv, n, d, dtype, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(hq, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(hkv, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(hkv, n, d, generator=g, dtype=torch.float64)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


def check_against_reference(q, k, v, end, valid, segments, scale, config, rel, grad_out=None, window=0,
                            position=None, softcap=0.0, alibi=None):
    """Forward (out, lse) and backward (dq, dk, dv) of the kernels vs the float64 reference (with the
    window, soft-cap and ALiBi slopes given, if any)."""
    win = dict(window=window, position=position) if window else {}
    if softcap:
        win["softcap"] = softcap
    if alibi:
        win.update(position=position, alibi=alibi)
    out, lse = tree_attention_forward(q, k, v, end, valid, segments, scale, config=config, **win)
    r_out, r_lse = reference_forward(q.double(), k.double(), v.double(), end, valid, segments, scale, **win)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert_rel_close(out, r_out, rel, "out")
    seen = torch.isfinite(r_lse)
    assert torch.equal(torch.isfinite(lse), seen), "lse must be -inf exactly for queries that see no key"
    assert_rel_close(lse[seen], r_lse[seen], rel, "lse")
    assert torch.all(out[~seen] == 0), "a query that sees no key must output 0"
    if grad_out is None:
        grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
        grad_out = grad_out.to(q.device, q.dtype)
    dq, dk, dv = tree_attention_backward(grad_out, q, k, v, out, lse, end, valid, segments, scale,
                                         config=config, **win)
    r_dq, r_dk, r_dv = reference_backward(grad_out.double(), q.double(), k.double(), v.double(), r_out,
                                          r_lse, end, valid, segments, scale, **win)
    assert (dq.dtype, dk.dtype, dv.dtype) == (q.dtype, k.dtype, v.dtype)
    assert_rel_close(dq, r_dq, rel, "dq")
    assert_rel_close(dk, r_dk, rel, "dk")
    assert_rel_close(dv, r_dv, rel, "dv")
    assert torch.all(dq[~seen] == 0), "a query that sees no key must get zero gradient"
    return out, lse


def tree_on(device, tree):
    return tuple(t.to(device) for t in tree)


# ---------------------------------------------------------------------------------------- key tiles


@pytest.mark.parametrize("case", ["rl", "left_pad", "right_pad", "deep", "holes", "tiny", "single"])
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (16, 64)])
def test_key_tiles_cover_exactly_the_visible_keys(case, block_m, block_n):
    """Each query block's tiles are disjoint, within block_n, and cover ancestors(b0) U [b0, b1)."""
    end, valid, segments = make_tree(case)
    n = end.numel()
    kt = build_key_tiles(segments, n, block_m, block_n, end)
    nblocks = math.ceil(n / block_m)
    assert kt.ptr.shape == (nblocks + 1,) and kt.ptr.dtype == torch.int32
    assert kt.tiles.dtype == torch.int32 and kt.tiles.shape[1] == 2
    assert int(kt.ptr[-1]) == kt.num_tiles
    for b in range(nblocks):
        b0, b1 = b * block_m, min(n, (b + 1) * block_m)
        keys = []
        for lo, hi in kt.tiles[kt.ptr[b]:kt.ptr[b + 1]].tolist():
            assert 0 < hi - lo <= block_n
            keys.extend(range(lo, hi))
        assert len(keys) == len(set(keys)), f"block {b}: a key is visited twice"
        assert set(keys) == visible_keys_brute(end, b0, b1), f"block {b}"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    groups=st.integers(1, 4),
    rollouts=st.integers(1, 5),
    vocab=st.integers(1, 3),
    block_m=st.sampled_from([16, 32]),
    block_n=st.sampled_from([16, 32]),
)
def test_key_tiles_property(seed, groups, rollouts, vocab, block_m, block_n):
    """Random forests (shared prompts, nested response branches, equal rows): tiles == brute force."""
    rows = rl_rows(seed, groups=groups, rollouts=rollouts, prompt=(1, 9), response=(1, 9), vocab=vocab)
    end, valid, segments = pack_rows(rows)
    n = end.numel()
    kt = build_key_tiles(segments[torch.randperm(segments.shape[0])], n, block_m, block_n, end)
    for b in range(math.ceil(n / block_m)):
        b0, b1 = b * block_m, min(n, (b + 1) * block_m)
        keys = [k for lo, hi in kt.tiles[kt.ptr[b]:kt.ptr[b + 1]].tolist() for k in range(lo, hi)]
        assert sorted(keys) == sorted(visible_keys_brute(end, b0, b1))


def test_key_tiles_merge_adjacent_ranges():
    """A straight chain is one range per block: [0, b1) cut into ceil(b1 / block_n) tiles."""
    end, valid, segments = pack_rows([list(range(50))])
    kt = build_key_tiles(segments, 50, 16, 16, end)
    assert kt.ptr.tolist() == [0, 1, 3, 6, 10]
    assert kt.tiles[6:10].tolist() == [[0, 16], [16, 32], [32, 48], [48, 50]]


def test_key_tiles_reject_bad_segments():
    end, valid, segments = make_tree("rl")
    n = end.numel()
    gap = segments.clone()
    gap[1, 0] += 1
    with pytest.raises(ValueError, match="stop\\[i\\] == start\\[i\\+1\\]"):
        build_key_tiles(gap, n, 16, 16)
    with pytest.raises(ValueError, match="end\\[t\\] == subtree_end"):
        bad_end = end.clone()
        bad_end[3] = n
        build_key_tiles(segments, n, 16, 16, bad_end)
    with pytest.raises(ValueError, match="\\[S, 3\\]"):
        build_key_tiles(segments[:, :2], n, 16, 16)


def test_key_tile_cache_hits_same_tensor_and_rebuilds_after_inplace_change():
    end, valid, segments = make_tree("tiny")
    cache = ta_module._TensorKeyedCache(build_key_tiles, maxsize=2)
    n = end.numel()

    def get(seg):
        return cache.get(seg, (n, 16, 16), seg, n, 16, 16)

    first = get(segments)
    assert get(segments) is first
    other = segments.clone()
    assert get(other) is not first
    segments.add_(0)  # bumps the version counter
    assert get(segments) is not first


# ------------------------------------------------------------------------------------------ kernels


@pytest.mark.parametrize("case", ["rl", "left_pad", "right_pad", "deep", "holes", "tiny", "single"])
def test_matches_reference_float32(case):
    """fp32, GQA 2/1, head dim 24 (padded to 32): out, lse, dq, dk, dv within 1e-4 of float64. (Every head
    runs the same program on its own slice: one GQA group of 2 exercises the head indexing; head counts and
    dims are test_heads_and_head_dims's.)"""
    end, valid, segments = tree_on(DEVICE, make_tree(case))
    q, k, v = random_qkv(2, 1, end.numel(), 24, torch.float32, seed=1)
    check_against_reference(q, k, v, end, valid, segments, 24 ** -0.5, SMALL, rel=1e-4)


@pytest.mark.parametrize("hq,hkv,d", [(2, 2, 32), (3, 1, 64), (4, 4, 16), (2, 1, 128)])
def test_heads_and_head_dims(hq, hkv, d):
    """MHA and GQA groups of 1..3, head dims 16..128, with wide dK/dV key blocks (MIXED tiles). The 38-token
    left-padded tree still spans several query and key blocks, the last one partial (the trees themselves:
    test_matches_reference_float32)."""
    end, valid, segments = tree_on(DEVICE, make_tree("small_left_pad"))
    q, k, v = random_qkv(hq, hkv, end.numel(), d, torch.float32, seed=d + hq)
    check_against_reference(q, k, v, end, valid, segments, 0.7 / math.sqrt(d), MIXED, rel=1e-4)


@pytest.mark.parametrize(
    "dtype,rel",
    [
        # fp16 operands of both dots (p and dS are rounded to fp16 before P.V and dS.K): ~2^-10 relative
        pytest.param(torch.float16, 4e-3, id="fp16"),
        pytest.param(torch.bfloat16, 3e-2, id="bf16", marks=pytest.mark.skipif(
            DEVICE != "cuda", reason="bf16 tl.dot is wrong in Triton's interpreter (needs a GPU)")),
    ],
)
def test_half_precision(dtype, rel):
    end, valid, segments = tree_on(DEVICE, make_tree("rl"))
    q, k, v = random_qkv(2, 1, end.numel(), 32, dtype, seed=5)  # GQA 2/1: heads are test_heads_and_head_dims's
    check_against_reference(q, k, v, end, valid, segments, 32 ** -0.5, SMALL, rel=rel)


def test_strided_inputs_and_stride0_grad():
    """q/k/v as transposed views of [N, H, D] storage; grad_out from out.sum() (all strides 0)."""
    end, valid, segments = tree_on(DEVICE, make_tree("right_pad"))
    n = end.numel()
    q, k, v = random_qkv(2, 1, n, 32, torch.float32, seed=7)
    qs = q.transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    ks = k.transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    vs = v.transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    assert not qs.is_contiguous()
    out, lse = tree_attention(qs, ks, vs, end, valid, segments, 0.2, config=SMALL)
    out.sum().backward()
    q64, k64, v64 = q.double(), k.double(), v.double()
    r_out, r_lse = reference_forward(q64, k64, v64, end, valid, segments, 0.2)
    r_dq, r_dk, r_dv = reference_backward(torch.ones_like(r_out), q64, k64, v64, r_out, r_lse,
                                          end, valid, segments, 0.2)
    assert_rel_close(out.detach(), r_out, 1e-4, "out")
    assert_rel_close(qs.grad, r_dq, 1e-4, "dq")
    assert_rel_close(ks.grad, r_dk, 1e-4, "dk")
    assert_rel_close(vs.grad, r_dv, 1e-4, "dv")


def test_default_launch_config_runs():
    """The registered impl path uses default_launch_config (interpreter: 16x16 tiles)."""
    end, valid, segments = tree_on(DEVICE, make_tree("holes"))
    q, k, v = random_qkv(2, 1, end.numel(), 32, torch.float32, seed=11)
    check_against_reference(q, k, v, end, valid, segments, 0.3, None, rel=1e-4)


def test_trees_from_build_tree():
    """Layout produced by brcompile.runtime.tree.build_tree (ragged, right-padded, shared response starts)."""
    from brcompile.runtime.tree import build_tree

    rows, mask = padded(rl_rows(4, groups=2, rollouts=4, vocab=2), "right")
    tree = build_tree(torch.tensor(rows), torch.tensor(mask)).to(DEVICE)
    n = tree.num_tokens
    for bm, bn in ((16, 16), (32, 16)):
        kt = build_key_tiles(tree.segments, n, bm, bn, tree.end)
        for b in range(math.ceil(n / bm)):
            keys = [k for lo, hi in kt.tiles[kt.ptr[b]:kt.ptr[b + 1]].tolist() for k in range(lo, hi)]
            assert sorted(keys) == sorted(visible_keys_brute(tree.end.cpu(), b * bm, min(n, (b + 1) * bm)))
    q, k, v = random_qkv(2, 1, n, 32, torch.float32, seed=13)
    check_against_reference(q, k, v, tree.end, tree.valid, tree.segments, 0.3, MIXED, rel=1e-4)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), groups=st.integers(1, 3), rollouts=st.integers(1, 4),
       side=st.sampled_from(["left", "right", None]))
def test_property_random_forests(seed, groups, rollouts, side):
    rows = rl_rows(seed, groups=groups, rollouts=rollouts, prompt=(1, 12), response=(1, 10))
    tree = pack_rows(*padded(rows, side)) if side else pack_rows(rows)
    end, valid, segments = tree_on(DEVICE, tree)
    q, k, v = random_qkv(2, 1, end.numel(), 16, torch.float32, seed=seed)
    check_against_reference(q, k, v, end, valid, segments, 0.25, MIXED, rel=1e-4)


# ------------------------------------------------------------------------------ ops registry, opcheck


def _op_inputs(requires_grad, case="left_pad"):
    end, valid, segments = tree_on(DEVICE, make_tree(case))
    # 2 query heads on 1 KV head (GQA): what the op registration checks need; more heads only add
    # interpreted programs (head counts and dims: test_heads_and_head_dims)
    q, k, v = random_qkv(2, 1, end.numel(), 16, torch.float32, seed=3)
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    return q, k, v, end, valid, segments


def test_registered_as_triton_impl():
    impl = ops.get_attention_impl("triton", DEVICE)
    assert impl.forward is tree_attention_forward and impl.backward is tree_attention_backward


def test_custom_op_matches_reference_impl():
    """torch.ops.brcompile.tree_attention(..., "triton") vs (..., "reference"): output and grads."""
    q, k, v, end, valid, segments = _op_inputs(True)
    out = torch.ops.brcompile.tree_attention(q, k, v, end, valid, segments, 0.25, "triton")
    grads = torch.autograd.grad((out * out).sum(), (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    r_out = torch.ops.brcompile.tree_attention(q64, k64, v64, end, valid, segments, 0.25, "reference")
    r_grads = torch.autograd.grad((r_out * r_out).sum(), (q64, k64, v64))
    assert_rel_close(out.detach(), r_out.detach(), 1e-4, "out")
    for name, g, r in zip("qkv", grads, r_grads):
        assert_rel_close(g, r, 1e-4, f"d{name}")


def test_opcheck_forward_and_backward_ops():
    # opcheck runs each op a dozen times (schema, fake tensors, autograd registration): a 38-token tree
    # (several blocks, a partial last one, pad queries) checks the registration as well as a 104-token one
    q, k, v, end, valid, segments = _op_inputs(True, "small_left_pad")
    torch.library.opcheck(torch.ops.brcompile.tree_attention_forward,
                          (q, k, v, end, valid, segments, 0.25, "triton"))
    with torch.no_grad():
        out, lse = torch.ops.brcompile.tree_attention_forward(q, k, v, end, valid, segments, 0.25, "triton")
    grad_out = torch.ones_like(out).expand(out.shape)
    torch.library.opcheck(torch.ops.brcompile.tree_attention_backward,
                          (grad_out, q.detach(), k.detach(), v.detach(), out, lse, end, valid, segments,
                           0.25, "triton"))


# ------------------------------------------------------------------------------------ input checks


def test_launch_config_out_of_range():
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        KernelConfig(24, 16)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        KernelConfig(16, 512)
    with pytest.raises(ValueError, match="num_warps"):
        KernelConfig(16, 16, num_warps=3)
    with pytest.raises(ValueError, match="num_stages"):
        KernelConfig(16, 16, num_stages=0)


def test_bad_inputs_raise():
    end, valid, segments = tree_on(DEVICE, make_tree("tiny"))
    n = end.numel()
    q, k, v = random_qkv(3, 2, n, 16, torch.float32, seed=0)
    with pytest.raises(ops.TreeAttentionError, match="multiple of Hkv"):  # the op's contract, checked first
        tree_attention_forward(q, k, v, end, valid, segments, 1.0)
    q, k, v = random_qkv(2, 1, n, 300, torch.float32, seed=0)
    with pytest.raises(ValueError, match="head dim"):
        tree_attention_forward(q, k, v, end, valid, segments, 1.0)
    q, k, v = random_qkv(2, 1, n, 16, torch.float64, seed=0)
    with pytest.raises(TypeError, match="dtype"):
        tree_attention_forward(q, k, v, end, valid, segments, 1.0)
    q, k, v = random_qkv(2, 1, n, 16, torch.float32, seed=0)
    with pytest.raises(ops.TreeAttentionError, match="valid must be bool"):
        tree_attention_forward(q, k, v, end, valid.long(), segments, 1.0)


def test_runs_in_interpreter_on_cpu():
    """Guards the module setup: without a GPU the kernels must be the interpreter's."""
    assert is_interpreter() == (DEVICE == "cpu")


# ---------------------------------------------------------------------------------- sliding window


def window_tree(case):
    """PackedTree cases for windows, from brcompile.runtime.tree.build_tree (tree.position = batch column)."""
    from brcompile.runtime.tree import build_tree, drop_padding

    if case == "right_pad":  # right padding: with a small window, late pad queries see only pad keys
        rows, mask = padded(rl_rows(5, groups=2, rollouts=3, prompt=(3, 9), response=(1, 9)), "right")
    elif case == "left_pad":
        rows, mask = padded(rl_rows(6, groups=2, rollouts=3, prompt=(3, 9), response=(1, 9)), "left")
    elif case == "long_prompt":  # one 37-token prompt, nested response branches: many out-of-window tiles
        rows, mask = padded(rl_rows(7, groups=1, rollouts=5, prompt=(37, 37), response=(2, 11), vocab=2),
                            "right")
    elif case == "dropped":  # drop_padding: positions skip the dropped columns (left pads of a group)
        rows, mask = padded(rl_rows(8, groups=2, rollouts=2, prompt=(2, 8), response=(1, 7)), "left")
    else:
        raise KeyError(case)
    tree = build_tree(torch.tensor(rows), torch.tensor(mask))
    if case == "dropped":
        tree = drop_padding(tree)
    return tree.to(DEVICE)


def window_mask(tree, window):
    """Brute-force [N, N] mask of the window contract, from the tree arrays."""
    n = tree.num_tokens
    idx = torch.arange(n, device=tree.end.device)
    m = (idx[None, :] <= idx[:, None]) & (idx[:, None] < tree.end[None, :]) & tree.valid[None, :]
    if window:
        m &= (tree.position[:, None] - tree.position[None, :]) < window
    return m


def max_depth(tree):
    """Largest position difference along an ancestor path: a window above it changes nothing."""
    m = window_mask(tree, 0)
    diff = tree.position[:, None] - tree.position[None, :]
    return int(diff[m].max()) if m.any() else 0


@pytest.mark.parametrize("case", ["right_pad", "left_pad", "long_prompt", "dropped"])
@pytest.mark.parametrize("window", [1, 2, 3, 9])
def test_window_matches_reference_float32(case, window):
    """fp32, GQA 2/1, head dim 24: out, lse, dq, dk, dv vs the window-aware float64 reference."""
    tree = window_tree(case)
    n = tree.num_tokens
    q, k, v = random_qkv(2, 1, n, 24, torch.float32, seed=window + n)
    check_against_reference(q, k, v, tree.end, tree.valid, tree.segments, 24 ** -0.5, SMALL, rel=1e-4,
                            window=window, position=tree.position)


def test_window_masks_whole_rows_of_right_padding():
    """W=2 over right padding: pad queries two columns past the last real token see no key at all
    (only because of the window); they give out 0, lse -inf and zero dq."""
    tree = window_tree("right_pad")
    unseen_w = ~window_mask(tree, 2).any(1)
    unseen = ~window_mask(tree, 0).any(1)
    assert (unseen_w & ~unseen).sum() >= 3, "the case must have rows emptied by the window alone"
    q, k, v = random_qkv(2, 1, tree.num_tokens, 16, torch.float32, seed=21)
    out, lse = check_against_reference(q, k, v, tree.end, tree.valid, tree.segments, 0.3, MIXED, rel=1e-4,
                                       window=2, position=tree.position)
    assert torch.all(lse[:, unseen_w] == float("-inf")) and torch.all(out[:, unseen_w] == 0)


@pytest.mark.parametrize("case", ["right_pad", "long_prompt"])
def test_window_beyond_every_depth_equals_no_window(case):
    """A window wider than every ancestor distance is no window: bit-identical out, lse and grads."""
    tree = window_tree(case)
    window = max_depth(tree) + 1
    q, k, v = random_qkv(2, 1, tree.num_tokens, 16, torch.float32, seed=31)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    args = (tree.end, tree.valid, tree.segments, 0.25)
    plain = tree_attention_forward(q, k, v, *args, config=MIXED)
    wide = tree_attention_forward(q, k, v, *args, window, tree.position, config=MIXED)
    for a, b in zip(plain, wide):
        assert torch.equal(a, b)
    g_plain = tree_attention_backward(grad_out, q, k, v, *plain, *args, config=MIXED)
    g_wide = tree_attention_backward(grad_out, q, k, v, *wide, *args, window, tree.position, config=MIXED)
    for a, b in zip(g_plain, g_wide):
        assert torch.equal(a, b)
    # and one step narrower is a different function (the window is applied at all)
    narrower = tree_attention_forward(q, k, v, *args, window - 1, tree.position, config=MIXED)[0]
    assert not torch.equal(narrower, plain[0])


@pytest.mark.parametrize("hq,hkv,d,window", [(3, 1, 40, 2), (2, 2, 16, 5)])
def test_window_heads_and_mixed_tiles(hq, hkv, d, window):
    """GQA group 3 (head dim padded 40 -> 64) and MHA, unequal forward/dQ tiles, wide dK/dV key blocks."""
    tree = window_tree("long_prompt")
    q, k, v = random_qkv(hq, hkv, tree.num_tokens, d, torch.float32, seed=d)
    check_against_reference(q, k, v, tree.end, tree.valid, tree.segments, 0.7 / math.sqrt(d), MIXED, rel=1e-4,
                            window=window, position=tree.position)


# ------------------------------------------------------------------------------------------------ ALiBi

ALIBI = [0.5, 0.25, 0.125, 0.0625]


@pytest.mark.parametrize("case,window,softcap", [("left_pad", 0, 0.0), ("dropped", 3, 0.6)],
                         ids=["alibi", "alibi_window_softcap"])
def test_alibi_matches_reference_float32(case, window, softcap):
    """fp32, GQA 4/2: out, lse, dq, dk, dv with ``m[h] * (pos[k] - pos[q])`` added after the soft-cap, vs the
    float64 reference; alone and with a window and a soft-cap (positions that skip dropped padding)."""
    tree = window_tree(case)
    q, k, v = random_qkv(4, 2, tree.num_tokens, 16, torch.float32, seed=61)
    out, _ = check_against_reference(q, k, v, tree.end, tree.valid, tree.segments, 0.25, SMALL, rel=1e-4,
                                     window=window, position=tree.position, softcap=softcap, alibi=ALIBI)
    win = dict(window=window, position=tree.position) if window else {}
    plain = tree_attention_forward(q, k, v, tree.end, tree.valid, tree.segments, 0.25, config=SMALL,
                                   softcap=softcap, **win)[0]
    assert (out - plain).abs().max() > 1e-2, "the bias must change the result"


def test_alibi_through_the_registered_impl():
    """``impl="triton"`` takes ALiBi (supports_alibi) and agrees with ``impl="reference"`` through the op."""
    tree = window_tree("right_pad")
    q, k, v = random_qkv(4, 2, tree.num_tokens, 16, torch.float32, seed=62)
    op = torch.ops.brcompile.tree_attention_forward
    args = (tree.end, tree.valid, tree.segments, 0.25)
    got = op(q, k, v, *args, "triton", 0, tree.position, 0.0, ALIBI)
    want = op(q.double(), k.double(), v.double(), *args, "reference", 0, tree.position, 0.0, ALIBI)
    assert_rel_close(got[0], want[0], 1e-4, "out")


@pytest.mark.parametrize("case,window,softcap", [("left_pad", 0, 0.0), ("dropped", 3, 0.6)],
                         ids=["slopes", "slopes_window_softcap"])
def test_trainable_slopes_through_the_registered_impl(case, window, softcap):
    """Trainable ALiBi slopes (``supports_alibi_grad``): out and the gradients of q, k, v and the slopes from
    ``impl="triton"`` (float32; the slopes' from the dQ kernel's per-row sums) agree with ``impl="reference"``
    (float64, ``sum dS (pos[k] - pos[q])``), alone and with a window and a soft-cap."""
    tree = window_tree(case)
    q, k, v = random_qkv(4, 2, tree.num_tokens, 16, torch.float32, seed=63)
    slopes = torch.tensor([0.5, -0.25, 0.125, 0.3], device=q.device)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(q.device)
    got = {}
    for impl, dt in (("triton", torch.float32), ("reference", torch.float64)):
        xs = [t.detach().to(dt).requires_grad_() for t in (q, k, v, slopes)]
        out = ops.tree_attention(*xs[:3], (tree.end, tree.valid, tree.segments), 0.25, impl, window, tree.position,
                                 softcap, slopes=xs[3])
        got[impl] = (out, *torch.autograd.grad((out * w.to(dt)).sum(), xs))
    for name, a, b in zip(["out", "dq", "dk", "dv", "dslopes"], got["triton"], got["reference"]):
        assert_rel_close(a, b, 1e-4, name)
    assert got["reference"][-1].abs().min() > 1e-3  # every slope gets a gradient


# ----------------------------------------------------------------------------------------- relative bias


def relbias_table(hq, n, extent, seed, strided=False):
    """[hq, n, extent] float32 relative-bias table; ``strided``: a permuted view of an [n, hq, extent] tensor (the
    kernels read it through its strides)."""
    g = torch.Generator().manual_seed(seed)
    if strided:
        return (torch.randn(n, hq, extent, generator=g) * 1.5).permute(1, 0, 2).to(DEVICE)
    return (torch.randn(hq, n, extent, generator=g) * 1.5).to(DEVICE)


def relbias_results(impl, dtype, tree, position, q, k, v, rel, w, window=0, softcap=0.0, slopes=None):
    """(out, lse, dq, dk, dv, dR[, dslopes]) of the forward op with a relative bias through ``impl``, inputs cast
    to ``dtype``; the loss is ``sum(out * w)``."""
    xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, rel) + (() if slopes is None else (slopes,))]
    out, lse = torch.ops.brcompile.tree_attention_forward(
        *xs[:3], tree.end, tree.valid, tree.segments, 0.25, impl, window, position, softcap, None, None, xs[3],
        *xs[4:])
    return (out, lse, *torch.autograd.grad((out * w.to(dtype)).sum(), xs))


@pytest.mark.parametrize("case,extent,window,softcap,trainable", [
    ("right_pad", 6, 0, 0.0, False), ("dropped", 3, 3, 0.6, True)], ids=["relbias", "relbias_window_softcap_slopes"])
def test_relbias_matches_reference_float32(case, extent, window, softcap, trainable):
    """fp32, GQA 4/2: out, lse and the gradients of q, k, v and the table ``R[h, q, min(pos[q] - pos[k], E - 1)]``
    (the dQ kernel's per-row sums) from ``impl="triton"`` vs ``impl="reference"`` (float64); alone on a strided
    table, and with a window, a soft-cap and trainable ALiBi slopes (their gradient after dR). Both the far
    column (distances >= E - 1) and the near buckets get gradient."""
    tree = window_tree(case)
    n = tree.num_tokens
    q, k, v = random_qkv(4, 2, n, 16, torch.float32, seed=71)
    rel = relbias_table(4, n, extent, seed=72, strided=not trainable)
    slopes = torch.tensor([0.5, -0.25, 0.125, 0.3], device=q.device) if trainable else None
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(73), dtype=torch.float64).to(q.device)
    got, want = (relbias_results(impl, dt, tree, tree.position, q, k, v, rel, w, window, softcap, slopes)
                 for impl, dt in (("triton", torch.float32), ("reference", torch.float64)))
    names = ["out", "lse", "dq", "dk", "dv", "dR", "dslopes"]
    seen = torch.isfinite(want[1])
    assert torch.equal(torch.isfinite(got[1]), seen)
    for name, a, b in zip(names, got, want):
        a, b = (a[seen], b[seen]) if name == "lse" else (a, b)
        assert a.dtype == torch.float32, name  # the inputs' dtype (dR: the table's)
        assert_rel_close(a, b, 1e-5, name)
    assert len(got) == 6 + trainable
    dR = want[5]
    assert dR[..., -1].abs().max() > 1e-2 and dR[..., :-1].abs().max() > 1e-2
    plain = torch.ops.brcompile.tree_attention_forward(q, k, v, tree.end, tree.valid, tree.segments, 0.25, "triton",
                                                       window, tree.position, softcap)[0]
    assert (got[0] - plain).abs().max() > 1e-2, "the bias must change the result"


def test_relbias_arbitrary_positions():
    """Positions that are not increasing along the tree (``(7 * pos) % 5``): visible keys share near buckets, also
    through negative distances clamped to bucket 0, so the dQ kernel's adds to one dR entry collide within a
    tile; dR (and the rest) still equal the reference's per-bucket sums. GQA 2/1, head dim 8 (padded lanes)."""
    tree = window_tree("right_pad")
    n = tree.num_tokens
    position = (tree.position * 7) % 5
    q, k, v = random_qkv(2, 1, n, 8, torch.float32, seed=74)
    rel = relbias_table(2, n, 4, seed=75)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(76), dtype=torch.float64).to(q.device)
    got, want = (relbias_results(impl, dt, tree, position, q, k, v, rel, w)
                 for impl, dt in (("triton", torch.float32), ("reference", torch.float64)))
    seen = torch.isfinite(want[1])
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv", "dR"], got, want):
        a, b = (a[seen], b[seen]) if name == "lse" else (a, b)
        assert_rel_close(a, b, 1e-5, name)
    assert got[5].dtype == torch.float32 and got[5].shape == rel.shape
    assert ops.get_attention_impl("triton", DEVICE).supports_relbias


def test_relbias_halves_the_gathered_tiles():
    """GPU tiles with a relative bias: the forward's and dQ's key side and dK/dV's query side halved (dK/dV's key
    side where its queries are already 16), never below 16; every tuned config stays a valid KernelConfig."""
    assert ta_module._relbias_tiles((128, 64, 8, 3), (32, 128, 8, 3), (128, 64, 8, 3)) == (
        (128, 32, 8, 3), (16, 128, 8, 3), (128, 32, 8, 3))
    assert ta_module._relbias_tiles((16, 16, 4, 2), (16, 64, 8, 2), (32, 16, 4, 2)) == (
        (16, 16, 4, 2), (16, 32, 8, 2), (32, 16, 4, 2))
    for tiles in ta_module._GPU_CONFIGS.values():
        for cfg in ta_module._relbias_tiles(*tiles):
            KernelConfig(*cfg)


#: Compiles the three kernels with every feature on (window, soft-cap, ALiBi with its gradient, relative bias) for
#: sm_90 in a process without the interpreter, which does not type-check what the compiler does.
COMPILE_SM90 = r"""
import importlib
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ta = importlib.import_module("brcompile.backends.attention.triton.kernels")
POINTERS = {"KEND": "*i32", "POS": "*i64", "SLOPES": "*fp32", "TILE_PTR": "*i32", "TILE_START": "*i32",
            "TILES": "*i32", "LSE": "*fp32", "DELTA": "*fp32", "DSLOPES": "*fp32", "DREL": "*fp32"}
TENSORS = ("Q", "K", "V", "REL", "OUT", "DO", "DK", "DV", "DQ")  # bf16

def build(fn, constexprs):
    sig = {name: "constexpr" if name in constexprs else POINTERS.get(name, "*bf16" if name in TENSORS else
           "fp32" if name in ("qk_scale", "sm_scale", "SOFTCAP") else "i32") for name in fn.arg_names}
    src = ASTSource(fn, sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]

flags = dict(GROUP=2, HEAD_DIM=128, BLOCK_D=128, INPUT_PRECISION=None, HAS_WINDOW=True, HAS_SOFTCAP=True,
             HAS_ALIBI=True, HAS_RELBIAS=True)
build(ta.tree_attn_fwd, dict(BLOCK_M=128, BLOCK_N=32, **flags))
build(ta.tree_attn_bwd_dkdv, dict(BLOCK_M=16, BLOCK_N=128, **flags))
ptx = build(ta.tree_attn_bwd_dq, dict(BLOCK_M=128, BLOCK_N=32, HAS_ALIBI_GRAD=True, **flags))
assert "atom.global" in ptx or "red.global" in ptx  # dR's near buckets
print("compiled")
"""


@pytest.mark.slow  # a fresh process and three CUDA compiles (~40 s)
def test_kernels_compile_for_sm90():
    """The forward, dK/dV and dQ kernels with every feature flag on (bf16, D=128, the relative bias's halved
    tiles) go through Triton's whole CUDA pipeline (ttir, ttgir, llir, ptx, cubin for sm_90), which the
    interpreter skips; dR's atomic adds are in the dQ kernel's PTX."""
    assert_compiles_for_sm90(COMPILE_SM90)


def test_window_float16():
    tree = window_tree("right_pad")
    q, k, v = random_qkv(2, 1, tree.num_tokens, 32, torch.float16, seed=41)
    check_against_reference(q, k, v, tree.end, tree.valid, tree.segments, 32 ** -0.5, SMALL, rel=4e-3,
                            window=3, position=tree.position)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), groups=st.integers(1, 3), rollouts=st.integers(1, 4),
       side=st.sampled_from(["left", "right"]), window=st.integers(1, 8), drop=st.booleans())
def test_window_property_random_forests(seed, groups, rollouts, side, window, drop):
    """Random padded forests from build_tree (optionally drop_padding), random window: kernels == reference."""
    from brcompile.runtime.tree import build_tree, drop_padding

    rows, mask = padded(rl_rows(seed, groups=groups, rollouts=rollouts, prompt=(1, 12), response=(1, 10)), side)
    tree = build_tree(torch.tensor(rows), torch.tensor(mask))
    if drop and bool(tree.valid.any()):
        tree = drop_padding(tree)
    tree = tree.to(DEVICE)
    q, k, v = random_qkv(2, 1, tree.num_tokens, 16, torch.float32, seed=seed)
    check_against_reference(q, k, v, tree.end, tree.valid, tree.segments, 0.25, MIXED, rel=1e-4,
                            window=window, position=tree.position)


@pytest.mark.parametrize("case", ["right_pad", "long_prompt", "dropped"])
@pytest.mark.parametrize("window", [1, 3, 20])
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (16, 32)])
def test_window_tile_starts_skip_only_out_of_window_tiles(case, window, block_m, block_n):
    """Skipped tiles hold no key visible to any query of their block; kept ones are what the mask needs."""
    tree = window_tree(case)
    n = tree.num_tokens
    kt = build_key_tiles(tree.segments, n, block_m, block_n, tree.end)
    starts = window_tile_starts(kt, tree.position, window, n)
    assert starts.dtype == torch.int32 and starts.shape == (kt.ptr.numel() - 1,)
    mask = window_mask(tree, window).cpu()
    tiles, ptr, starts = kt.tiles.cpu().tolist(), kt.ptr.cpu().tolist(), starts.cpu().tolist()
    for b in range(len(starts)):
        assert ptr[b] <= starts[b] <= ptr[b + 1]
        rows = mask[b * block_m:min(n, (b + 1) * block_m)]
        skipped = [key for lo, hi in tiles[ptr[b]:starts[b]] for key in range(lo, hi)]
        assert not rows[:, skipped].any(), f"block {b}: a skipped key is visible"
        kept = {key for lo, hi in tiles[starts[b]:ptr[b + 1]] for key in range(lo, hi)}
        assert set(rows.any(0).nonzero().flatten().tolist()) <= kept


def test_window_tile_starts_make_blocks_window_sized():
    """A 200-token chain, W=5, 16x16 tiles: every block visits at most the tiles overlapping
    [b0 - W + 1, b1), i.e. 2 tiles (window within one tile) instead of up to 13."""
    from brcompile.runtime.tree import build_tree

    tree = build_tree(torch.arange(200).reshape(1, 200))
    kt = build_key_tiles(tree.segments, 200, 16, 16, tree.end)
    starts = window_tile_starts(kt, tree.position, 5, 200)
    visited = kt.ptr[1:] - starts
    assert int(visited.max()) <= 2 and int((kt.ptr[1:] - kt.ptr[:-1]).max()) == 13
    assert int(visited[0]) == 1


def test_window_tile_starts_sound_for_arbitrary_positions():
    """Positions that do not increase along paths (outside the contract): skipping stays sound."""
    end, valid, segments = make_tree("rl")
    n = end.numel()
    position = torch.randperm(n, generator=torch.Generator().manual_seed(3))
    for window in (1, 4, 30):
        kt = build_key_tiles(segments, n, 16, 16, end)
        starts = window_tile_starts(kt, position, window, n).tolist()
        idx = torch.arange(n)
        mask = (idx[None, :] <= idx[:, None]) & (idx[:, None] < end[None, :]) & valid[None, :] \
            & ((position[:, None] - position[None, :]) < window)
        for b in range(len(starts)):
            skipped = [key for lo, hi in kt.tiles[kt.ptr[b]:starts[b]].tolist() for key in range(lo, hi)]
            assert not mask[b * 16:(b + 1) * 16][:, skipped].any()


def test_window_start_cache_hits_same_positions_and_rebuilds_after_inplace_change():
    tree = window_tree("right_pad")
    n = tree.num_tokens
    kt = build_key_tiles(tree.segments, n, 16, 16, tree.end)
    cache = ta_module._TensorKeyedCache(ta_module.window_tile_starts, maxsize=2)

    def get(tiles, pos, w):
        return cache.get(pos, (tiles, w, n), tiles, pos, w, n)

    first = get(kt, tree.position, 2)
    assert get(kt, tree.position, 2) is first
    assert get(kt, tree.position, 3) is not first
    kt2 = build_key_tiles(tree.segments, n, 16, 16, tree.end)  # equal tiles, another object: no hit
    assert get(kt2, tree.position, 2) is not first
    assert get(kt, tree.position.clone(), 2) is not first
    tree.position.add_(0)
    assert get(kt, tree.position, 2) is not first


def test_window_autograd_function():
    """tree_attention(..., window=, position=) through TreeAttentionFunction: grads of a loss vs reference."""
    tree = window_tree("left_pad")
    q, k, v = random_qkv(2, 1, tree.num_tokens, 16, torch.float32, seed=51)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = tree_attention(q, k, v, tree.end, tree.valid, tree.segments, 0.4, config=MIXED, window=3,
                              position=tree.position)
    grads = torch.autograd.grad((out * out).sum(), (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    r_out, _ = reference_forward(q64, k64, v64, tree.end, tree.valid, tree.segments, 0.4, 3, tree.position)
    r_grads = torch.autograd.grad((r_out * r_out).sum(), (q64, k64, v64))
    assert_rel_close(out.detach(), r_out.detach(), 1e-4, "out")
    for name, g, r in zip("qkv", grads, r_grads):
        assert_rel_close(g, r, 1e-4, f"d{name}")


def test_window_through_custom_op_matches_reference_impl():
    """torch.ops.brcompile.tree_attention_forward(..., "triton", W, position) and its autograd vs impl
    "reference"; the public ops.tree_attention wrapper takes the PackedTree's positions."""
    assert ops.get_attention_impl("triton", DEVICE).supports_window
    tree = window_tree("right_pad")
    q, k, v = random_qkv(2, 1, tree.num_tokens, 16, torch.float32, seed=61)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    arrays = (tree.end, tree.valid, tree.segments)
    out, lse = torch.ops.brcompile.tree_attention_forward(q, k, v, *arrays, 0.25, "triton", 2, tree.position)
    grads = torch.autograd.grad((out * out).sum(), (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    r_out, r_lse = torch.ops.brcompile.tree_attention_forward(q64, k64, v64, *arrays, 0.25, "reference", 2,
                                                              tree.position)
    r_grads = torch.autograd.grad((r_out * r_out).sum(), (q64, k64, v64))
    assert_rel_close(out.detach(), r_out.detach(), 1e-4, "out")
    seen = torch.isfinite(r_lse)
    assert torch.equal(torch.isfinite(lse), seen) and not seen.all()
    assert_rel_close(lse[seen], r_lse[seen], 1e-4, "lse")
    for name, g, r in zip("qkv", grads, r_grads):
        assert_rel_close(g, r, 1e-4, f"d{name}")
    wrapped = ops.tree_attention(q.detach(), k.detach(), v.detach(), tree, 0.25, impl="triton", window=2)
    assert_rel_close(wrapped, r_out.detach(), 1e-4, "ops.tree_attention")


@pytest.mark.parametrize("seed,softcap", [(71, ()), (91, (0.6,))], ids=["window", "window_softcap"])
def test_window_opcheck(seed, softcap):
    tree = window_tree("dropped")  # 24 tokens, left padding dropped (positions skip columns): two blocks
    q, k, v = random_qkv(2, 1, tree.num_tokens, 16, torch.float32, seed=seed)
    q.requires_grad_()
    arrays = (tree.end, tree.valid, tree.segments)
    torch.library.opcheck(torch.ops.brcompile.tree_attention_forward,
                          (q, k, v, *arrays, 0.25, "triton", 3, tree.position, *softcap))


def test_window_bad_inputs_raise():
    tree = window_tree("right_pad")
    n = tree.num_tokens
    q, k, v = random_qkv(2, 1, n, 16, torch.float32, seed=0)
    arrays = (tree.end, tree.valid, tree.segments, 1.0)
    with pytest.raises(ValueError, match="window must be >= 0"):
        tree_attention_forward(q, k, v, *arrays, -1, tree.position)
    with pytest.raises(ops.TreeAttentionError, match="window must be an int"):
        tree_attention_forward(q, k, v, *arrays, 2.5, tree.position)
    with pytest.raises(ops.TreeAttentionError, match="needs position"):
        tree_attention_forward(q, k, v, *arrays, 2, None)
    with pytest.raises(ops.TreeAttentionError, match="needs position"):
        tree_attention_forward(q, k, v, *arrays, 2, tree.position[:-1])
    with pytest.raises(ops.TreeAttentionError, match="integer positions"):
        tree_attention_backward(q, q, k, v, q, q[:, :, 0], *arrays, 2, tree.position.float())
    with pytest.raises(ValueError, match="window_tile_starts needs window > 0"):
        window_tile_starts(build_key_tiles(tree.segments, n, 16, 16), tree.position, 0, n)


# ---------------------------------------------------------------------------------- logit soft-cap


@triton.jit
def _tanh_probe(X, T, SLOPE, N, BLOCK: tl.constexpr):
    """T, SLOPE = tanh(X), 1 - tanh(X)^2 through the kernels' helper."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < N
    t, slope = kernels_module._tanh_and_slope(tl.load(X + offs, mask=inside, other=0.0))
    tl.store(T + offs, t, mask=inside)
    tl.store(SLOPE + offs, slope, mask=inside)


def test_softcap_tanh_and_slope_accurate_to_float32():
    """The kernels' tanh: a few float32 ulp relative to float64 tanh, on both sides of the series/exp
    switch at |x| = 1/4, in saturation (|x| up to 40, slope ~1e-35) and at 0; the slope 1 - t^2 to a few
    ulp times its condition number; odd symmetry exact."""
    x = torch.cat([torch.linspace(-40, 40, 2001, dtype=torch.float64),
                   torch.linspace(0.2, 0.3, 101, dtype=torch.float64),
                   torch.tensor([0.0, 1e-30, 1e-7, 1e-3, 0.25, 0.25 - 2**-26, 9.0], dtype=torch.float64)])
    x = torch.cat([x, -x]).to(torch.float32)
    n = x.numel()
    xd = x.to(DEVICE)
    t = torch.empty_like(xd)
    slope = torch.empty_like(xd)
    _tanh_probe[(triton.cdiv(n, 256),)](xd, t, slope, n, BLOCK=256)
    exact = torch.tanh(x.double())
    torch.testing.assert_close(t.cpu().double(), exact, rtol=6e-7, atol=0.0)
    # 1 - tanh^2 = cosh^-2 ~ 4 exp(-2|x|) has condition number ~2|x|: its float32 rounding of the exponent
    # costs ~2|x| eps relative, so the bound is a few ulp times (1 + 2|x|)
    exact_slope = 1.0 / torch.cosh(x.double()) ** 2
    rel_err = (slope.cpu().double() - exact_slope).abs() / exact_slope
    bound = 4e-7 * (1 + 2 * x.double().abs())
    worst = int((rel_err / bound).argmax())
    assert bool((rel_err <= bound).all()), \
        f"slope: rel error {float(rel_err[worst]):.3g} > bound {float(bound[worst]):.3g} at x={float(x[worst])}"
    assert torch.equal(t[: n // 2], -t[n // 2:]) and torch.equal(slope[: n // 2], slope[n // 2:])


@pytest.mark.parametrize("case", ["left_pad", "holes"])
@pytest.mark.parametrize("softcap,scale", [(0.3, 1.0), (5.0, 24 ** -0.5)])
def test_softcap_matches_reference_float32(case, softcap, scale):
    """fp32, GQA 2/1, head dim 24: out, lse, dq, dk, dv vs the soft-capped float64 reference. Cap 0.3 at
    scale 1 saturates most scores (|x| ~ 16, slope ~ 1e-14); cap 5 keeps them in the series range."""
    end, valid, segments = tree_on(DEVICE, make_tree(case))
    q, k, v = random_qkv(2, 1, end.numel(), 24, torch.float32, seed=81)
    check_against_reference(q, k, v, end, valid, segments, scale, SMALL, rel=1e-5, softcap=softcap)


@pytest.mark.parametrize("softcap", [0.3, 5.0])
def test_softcap_with_window_and_mixed_tiles(softcap):
    """Soft-cap and sliding window together (Gemma2): GQA group 3, head dim 40 (padded to 64), W=3 over
    right padding (rows emptied by the window), unequal forward/dQ tiles, wide dK/dV key blocks."""
    tree = window_tree("right_pad")
    q, k, v = random_qkv(3, 1, tree.num_tokens, 40, torch.float32, seed=83)
    check_against_reference(q, k, v, tree.end, tree.valid, tree.segments, 0.5, MIXED, rel=1e-5,
                            window=3, position=tree.position, softcap=softcap)


def test_softcap_float16():
    tree = window_tree("left_pad")
    q, k, v = random_qkv(2, 1, tree.num_tokens, 32, torch.float16, seed=85)
    check_against_reference(q, k, v, tree.end, tree.valid, tree.segments, 32 ** -0.5, SMALL, rel=4e-3,
                            softcap=1.0)


def test_softcap_is_applied_and_huge_cap_is_nearly_none():
    """A cap changes the function; a cap far above every score gives the uncapped kernels' result."""
    end, valid, segments = tree_on(DEVICE, make_tree("tiny"))
    q, k, v = random_qkv(2, 1, end.numel(), 16, torch.float32, seed=87)
    args = (end, valid, segments, 0.25)
    plain = tree_attention_forward(q, k, v, *args, config=SMALL)
    capped = tree_attention_forward(q, k, v, *args, softcap=0.5, config=SMALL)
    huge = tree_attention_forward(q, k, v, *args, softcap=1e6, config=SMALL)
    assert (capped[0] - plain[0]).abs().max() > 1e-2
    for a, b in zip(huge, plain):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_softcap_autograd_and_custom_op_match_reference_impl():
    """tree_attention(..., softcap=) (TreeAttentionFunction) and torch.ops.brcompile.tree_attention_forward
    (..., "triton", W, position, softcap) with autograd vs impl "reference"; ops.tree_attention too."""
    assert ops.get_attention_impl("triton", DEVICE).supports_softcap
    tree = window_tree("left_pad")
    q, k, v = random_qkv(2, 1, tree.num_tokens, 16, torch.float32, seed=89)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    arrays = (tree.end, tree.valid, tree.segments)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    for window in (0, 2):
        out, lse = torch.ops.brcompile.tree_attention_forward(q, k, v, *arrays, 0.4, "triton", window,
                                                              tree.position, 0.7)
        grads = torch.autograd.grad((out * out).sum(), (q, k, v))
        r_out, r_lse = torch.ops.brcompile.tree_attention_forward(q64, k64, v64, *arrays, 0.4, "reference",
                                                                  window, tree.position, 0.7)
        r_grads = torch.autograd.grad((r_out * r_out).sum(), (q64, k64, v64))
        assert_rel_close(out.detach(), r_out.detach(), 1e-5, f"out (W={window})")
        seen = torch.isfinite(r_lse)
        assert torch.equal(torch.isfinite(lse), seen)
        assert_rel_close(lse[seen], r_lse[seen], 1e-5, f"lse (W={window})")
        for name, g, r in zip("qkv", grads, r_grads):
            assert_rel_close(g, r, 1e-5, f"d{name} (W={window})")
    # the last round: W=2; the same through TreeAttentionFunction and the public wrapper
    out, _ = tree_attention(q, k, v, *arrays, 0.4, config=MIXED, window=2, position=tree.position, softcap=0.7)
    grads = torch.autograd.grad((out * out).sum(), (q, k, v))
    assert_rel_close(out.detach(), r_out.detach(), 1e-5, "TreeAttentionFunction out")
    for name, g, r in zip("qkv", grads, r_grads):
        assert_rel_close(g, r, 1e-5, f"TreeAttentionFunction d{name}")
    wrapped = ops.tree_attention(q.detach(), k.detach(), v.detach(), tree, 0.4, impl="triton", window=2,
                                 softcap=0.7)
    assert_rel_close(wrapped, r_out.detach(), 1e-5, "ops.tree_attention")



def test_softcap_bad_values_raise():
    end, valid, segments = tree_on(DEVICE, make_tree("tiny"))
    q, k, v = random_qkv(2, 1, end.numel(), 16, torch.float32, seed=0)
    arrays = (end, valid, segments, 1.0)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softcap must be a finite float >= 0"):
            tree_attention_forward(q, k, v, *arrays, softcap=bad)
    for bad in (True, "5", torch.tensor(5.0)):
        with pytest.raises(ops.TreeAttentionError, match="softcap must be a float"):
            tree_attention_backward(q, q, k, v, q, q[:, :, 0], *arrays, softcap=bad)


def test_gpu_benchmark_check_runs_all_variants():
    """benchmarks/bench_triton_attention.py's pre-timing check (what a GPU session runs first) covers the
    plain, windowed, soft-capped, windowed+capped and relative-bias kernels (dR checked); here on a tiny tree in
    the interpreter."""
    from benchmarks import bench_triton_attention as bench

    variants = ((0, 0.0, 0), (3, 0.0, 0), (0, 2.0, 0), (3, 2.0, 0), (3, 2.0, 4))
    assert len(bench.CHECK_VARIANTS[0]) == len(variants[0])
    lines = bench.check_small_case(DEVICE, length=12, dtypes=((torch.float32, 1e-4),), variants=variants,
                                   flex=False)
    kernel_lines = [line for line in lines if line.startswith("triton ")]
    assert len(kernel_lines) == 5 and all(line.endswith("OK") for line in kernel_lines), lines
    assert "dR=" in kernel_lines[-1], kernel_lines[-1]
    assert not any("FAILED" in line for line in lines), lines
