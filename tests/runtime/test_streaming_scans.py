"""Streaming replay of graphs with tree scans (docs/ARCHITECTURE.md §7; passes/emit/split.py, backends/scan/op.py's
``*_cached`` functions, ``Chunk.ancestors``).

A tail chunk's scans read their tokens' ancestors outside the chunk from the prefix: a linear scan's state and
a cumsum's path sum at the parent, a causal conv's x at the last W-1 ancestors. Checked three ways:

- ``plan_replay``'s ancestor table against the preorder definition (``j`` is an ancestor of ``k`` iff
  ``j <= k < end[j]``);
- each cached scan (the matrix scan's too) on every chunk of a multi-level tree against the full scan,
  values and the gradients of every input (the cached prefix values' gradients included), float64;
- end to end, float64, loss and every parameter gradient against the eager model AND the packed mode (1e-10),
  on multi-level trees cut into several chunks: a model with cumsum positions, short convs and attention,
  the hybrid LFM2 (short conv) and a gated delta rule without attention or conv (a matrix scan only, on token
  ids and on hidden states) here, Bamba (Mamba-2: linear scan + conv), Qwen3-Next (gated DeltaNet: matrix scan
  + conv) and pure Mamba (no attention) in tests/models/test_hybrids.py and test_ssm.py;
  every run asserts that the call streamed (stats, the call's schedule) and what was cached.
"""
import contextlib
import functools

import pytest
import torch

import brcompile
from brcompile.backends.scan.matrix import tree_matrix_scan, tree_matrix_scan_cached
from brcompile.backends.scan.op import (
    tree_causal_conv1d, tree_causal_conv1d_cached, tree_cumsum, tree_cumsum_cached, tree_linear_scan,
    tree_linear_scan_cached,
)
from brcompile.backends.scan.paths import parent_from_end
from brcompile.runtime.streaming import plan_replay
from brcompile.runtime.tree import build_tree
from brcompile.testing import TOLERANCE, assert_exact, rel_err
from examples.grpo import make_grpo_batch
from tests.helpers import KeepFloat64, assert_grads_exact, transformers_or_skip

F64 = torch.float64
TOL = TOLERANCE[F64]


def nested_tree(seed=1):
    """Two prompts x four responses, three of each group sharing a response prefix: a three-level tree
    (prompt segment, shared response segment, leaves) with ragged rows."""
    b = make_grpo_batch(vocab_size=23, seed=seed, num_prompts=2, group_size=4, prompt_len=(3, 6),
                        response_len=(4, 7), shared_response_prefix=2, pad_id=0)
    return build_tree([b["input_ids"]], attention_mask=b["attention_mask"])


def ancestors_by_definition(end):
    """``paths[k]``: the ancestors-or-self of k, root first (``j <= k < end[j]``)."""
    n = end.shape[0]
    return [[j for j in range(k + 1) if int(end[j]) > k] for k in range(n)]


@pytest.mark.parametrize("chunk_tokens", [1, 7, 100])
def test_chunk_ancestors_are_the_prefix_tokens_on_the_path(chunk_tokens):
    tree = nested_tree()
    depth = 4
    sch = plan_replay(tree.end, tree.segments, chunk_tokens, depth)
    assert sch.prefix_tokens > 0 and len(sch.chunks) >= (2 if chunk_tokens < 100 else 1)
    local = {int(g): i for i, g in enumerate(sch.prefix_ids)}
    paths = ancestors_by_definition(tree.end)
    seen = 0
    for c in sch.chunks:
        assert tuple(c.ancestors.shape) == (depth, c.tokens)
        for col, k in enumerate(c.ids.tolist()):
            path = paths[k][::-1]  # self first
            for i in range(1, depth + 1):
                want = local.get(path[i], -1) if i < len(path) else -1
                assert int(c.ancestors[i - 1, col]) == want, (k, i)
                seen += want >= 0
    assert seen > 0
    assert plan_replay(tree.end, tree.segments, chunk_tokens).chunks[0].ancestors.shape[0] == 0


def _take(x, ids, dim):
    return x.index_select(dim, ids)


@pytest.mark.parametrize("chunk_tokens", [1, 9])
def test_cached_scans_equal_the_full_scans_values_and_gradients(chunk_tokens):
    """Prefix scan + each chunk's cached scan == the full scan on the whole tree; the gradients of the
    chunk inputs and of the prefix inputs (through the cached values) == the full scan's."""
    tree = nested_tree()
    end, n = tree.end, int(tree.end.shape[0])
    g = torch.Generator().manual_seed(0)
    W, C = 4, 3
    a = torch.rand(2, n, 5, generator=g, dtype=F64).requires_grad_()
    b = torch.randn(2, n, 5, generator=g, dtype=F64).requires_grad_()
    x = torch.randn(2, C, n, generator=g, dtype=F64).requires_grad_()
    w = torch.randn(C, 1, W, generator=g, dtype=F64).requires_grad_()
    bias = torch.randn(C, generator=g, dtype=F64).requires_grad_()
    y = torch.randn(n, 4, generator=g, dtype=F64).requires_grad_()
    leaves = (a, b, x, w, bias, y)
    parent = parent_from_end(end)
    full = (tree_linear_scan(a, b, parent, 1, "torch"), tree_causal_conv1d(x, w, bias, parent, "torch"),
            tree_cumsum(y, parent, 0))
    up = [torch.randn(f.shape, generator=g, dtype=F64) for f in full]
    want = torch.autograd.grad(full, leaves, up)

    sch = plan_replay(end, tree.segments, chunk_tokens, W - 1)
    assert len(sch.chunks) >= 2
    pid = sch.prefix_ids
    pparent = parent_from_end(sch.prefix_end)
    pre = (tree_linear_scan(_take(a, pid, 1), _take(b, pid, 1), pparent, 1, "torch"),
           tree_causal_conv1d(_take(x, pid, 2), w, bias, pparent, "torch"),
           tree_cumsum(_take(y, pid, 0), pparent, 0))
    outs, grads = list(pre), [_take(up[0], pid, 1), _take(up[1], pid, 2), _take(up[2], pid, 0)]
    got = [torch.empty_like(f) for f in full]
    for f, p, dim in zip(got, pre, (1, 2, 0)):
        f.index_copy_(dim, pid, p.detach())
    for c in sch.chunks:
        cparent = parent_from_end(c.end)
        parts = (tree_linear_scan_cached(_take(a, c.ids, 1), _take(b, c.ids, 1), cparent, 1, "torch", pre[0],
                                         c.ancestors),
                 tree_causal_conv1d_cached(_take(x, c.ids, 2), w, bias, cparent, "torch", _take(x, pid, 2),
                                           c.ancestors),
                 tree_cumsum_cached(_take(y, c.ids, 0), cparent, 0, pre[2], c.ancestors))
        for f, p, u, dim in zip(got, parts, up, (1, 2, 0)):
            f.index_copy_(dim, c.ids, p.detach())
            outs.append(p)
            grads.append(_take(u, c.ids, dim))
    for f, ref, name in zip(got, full, ("linear scan", "causal conv1d", "cumsum")):
        assert_exact(f, ref.detach(), F64, name)
    for gg, gw, name in zip(torch.autograd.grad(outs, leaves, grads), want, ("a", "b", "x", "weight", "bias", "y")):
        assert_exact(gg, gw, F64, f"grad of {name}")


@pytest.mark.parametrize("chunk_tokens", [1, 9])
def test_cached_matrix_scan_equals_the_full_scan_values_and_gradients(chunk_tokens):
    """The prefix's ``tree_matrix_scan`` + each chunk's ``tree_matrix_scan_cached`` (its roots start from the
    cached prefix state at their parents) == the full scan on the whole tree; the gradients of M and b, at the
    chunk tokens and at the prefix tokens (through the cached state), == the full scan's. Token dim 1 of
    ``M [2, N, H, d, d]``, ``b [2, N, H, d, e]``."""
    tree = nested_tree()
    end, n = tree.end, int(tree.end.shape[0])
    g = torch.Generator().manual_seed(3)
    d, e = 4, 3
    M = (0.5 * torch.randn(2, n, 2, d, d, generator=g, dtype=F64) / d ** 0.5).requires_grad_()
    b = torch.randn(2, n, 2, d, e, generator=g, dtype=F64).requires_grad_()
    full = tree_matrix_scan(M, b, parent_from_end(end), 1, "torch")
    up = torch.randn(full.shape, generator=g, dtype=F64)
    want = torch.autograd.grad(full, (M, b), up)

    sch = plan_replay(end, tree.segments, chunk_tokens, 1)
    assert len(sch.chunks) >= 2
    pid = sch.prefix_ids
    pre = tree_matrix_scan(_take(M, pid, 1), _take(b, pid, 1), parent_from_end(sch.prefix_end), 1, "torch")
    outs, grads = [pre], [_take(up, pid, 1)]
    got = torch.empty_like(full)
    got.index_copy_(1, pid, pre.detach())
    roots = 0
    for c in sch.chunks:
        part = tree_matrix_scan_cached(_take(M, c.ids, 1), _take(b, c.ids, 1), parent_from_end(c.end), 1, "torch",
                                       pre, c.ancestors)
        got.index_copy_(1, c.ids, part.detach())
        outs.append(part)
        grads.append(_take(up, c.ids, 1))
        roots += int((c.ancestors[0] >= 0).sum())
    assert roots >= len(sch.chunks)  # every chunk continues the prefix's state somewhere
    assert_exact(got, full.detach(), F64, "matrix scan")
    for gg, gw, name in zip(torch.autograd.grad(outs, (M, b), grads), want, ("M", "b")):
        assert_exact(gg, gw, F64, f"grad of {name}")


# ------------------------------------------------------------------------------------------ end to end


def run_modes(fn, args, params, names, chunk_tokens, guard=contextlib.nullcontext, compiler="eager"):
    """Eager, packed and streaming (each inside ``guard()``): loss and every gradient of the compiled runs
    against eager, and the streaming run against the packed one (1e-10); returns the streaming backend after
    asserting it streamed in at least two chunks."""
    with guard():
        want = fn(*args)
    gw = torch.autograd.grad(want, params)
    runs = {}
    for mode in ("packed", "replay"):
        torch._dynamo.reset()
        brcompile.reset_stats()
        backend = brcompile.backend(compiler=compiler, mode=mode, chunk_tokens=chunk_tokens)
        with guard():
            got = torch.compile(fn, backend=backend)(*args)
        gg = torch.autograd.grad(got, params)
        assert_exact(got, want, F64, f"{mode} loss")
        assert_grads_exact(gg, gw, names, F64)
        runs[mode] = (got, gg, backend)
    (lp, gp, _), (lr, gr, backend) = runs["packed"], runs["replay"]
    assert rel_err(lr.detach(), lp.detach()) <= TOL
    for name, x, y in zip(names, gr, gp):
        assert rel_err(x, y) <= TOL or (x - y).abs().max().item() <= TOL * max(t.abs().max().item() for t in gp), name
    s = brcompile.stats()
    assert s.streamed_calls == 1 and s.replayed_calls == 1 and s.fallback_calls == 0, str(s)
    rec = backend.records[-1]
    assert rec.replay is not None and rec.replay_reason is None, rec.replay_reason
    call = rec.runtime.calls[-1]
    assert call.mode == "replay" and call.schedule["chunks"] >= 2 and 0 < call.schedule["prefix_tokens"]
    return backend


@pytest.mark.parametrize("chunk_tokens,compiler", [(1, "eager"), (8, "eager"),
                                                   pytest.param(8, "inductor", marks=pytest.mark.slow)])
def test_cumsum_conv_attention_model_streams_exactly(chunk_tokens, compiler):
    """ScanGPT: cumsum positions (an integer scan), two gated short convs (width 4) and attention per block;
    compiled by inductor too (the tail graph's scans on strided chunk values)."""
    from tests.passes.analysis.rules.test_scan_rules import scan_model, token_loss

    model = scan_model()
    b = make_grpo_batch(vocab_size=23, seed=2, num_prompts=2, group_size=4, prompt_len=(4, 7),
                        response_len=(4, 7), shared_response_prefix=2, left_pad_prompts=True, pad_id=0)
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    backend = run_modes(functools.partial(token_loss, model), (b["input_ids"], b["attention_mask"],
                        b["completion_mask"]), params, names, chunk_tokens, compiler=compiler)
    rec = backend.records[-1]
    scans = rec.replay["cached_scans"]
    assert sum("cumsum" in s for s in scans) == 1 and sum("causal_conv1d" in s for s in scans) == 2, scans
    assert len(rec.replay["cached"]) == 2  # and both attentions' K/V
    assert rec.runtime.calls[-1].schedule["largest_chunk"] <= max(chunk_tokens, 7)


def hf_run(family, chunk_tokens, **extra):
    """A tiny float64 HF ``family`` model (tests/models/test_hybrids.py's configs) streamed on its three-level
    tree batch; returns the streaming backend."""
    from tests.models.test_hybrids import next_token_loss, tiny_hybrid, tree_batch

    model = tiny_hybrid(family)
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    return run_modes(functools.partial(next_token_loss, model), tree_batch(), params, names, chunk_tokens,
                     guard=KeepFloat64)


def test_hf_lfm2_short_conv_streams_exactly():
    """LFM2's gated short conv (width 3) and attention; Bamba (Mamba-2) and pure Mamba are in
    tests/models/test_hybrids.py and test_ssm.py (slow)."""
    backend = hf_run("lfm2", chunk_tokens=2)
    assert any("causal_conv1d" in s for s in backend.records[-1].replay["cached_scans"])


class DeltaNet(torch.nn.Module):
    """A gated delta rule without attention or short conv (HF Qwen3-Next's chunked ``torch_chunk_gated_delta_rule``,
    chunks of 4), its output RMS-normed per head over the tokens flattened with the heads (Qwen3-Next's gated
    norm: ``reshape(-1, dv)``, a ``[h·N, dv]`` value inside the streamed part): rows share work only through the
    matrix scan passes/canonical/scans/delta_rule.py makes of it."""

    def __init__(self, vocab=23, dim=16, heads=2, dk=4, dv=4):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, heads * (2 * dk + dv))
        self.gb = torch.nn.Linear(dim, 2 * heads)
        self.out = torch.nn.Linear(heads * dv, vocab)
        self.sizes = heads, dk, dv

    def mixer(self, x):
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

        (B, L, _), (h, dk, dv) = x.shape, self.sizes
        q, k, v = self.qkv(x).split([h * dk, h * dk, h * dv], -1)
        g, beta = self.gb(x).chunk(2, -1)
        o, _ = torch_chunk_gated_delta_rule(q.view(B, L, h, dk), k.view(B, L, h, dk), v.view(B, L, h, dv),
                                            -torch.nn.functional.softplus(g), beta.sigmoid(), chunk_size=4,
                                            use_qk_l2norm_in_kernel=True)
        o = o.reshape(-1, dv)
        return (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6)).reshape(B, L, h * dv)

    def forward(self, ids):
        return self.out(self.mixer(self.emb(ids)))


def delta_rule_model():
    transformers_or_skip()
    torch.manual_seed(0)
    model = DeltaNet().double()
    b = make_grpo_batch(vocab_size=23, seed=2, num_prompts=2, group_size=3, prompt_len=(4, 6),
                        response_len=(3, 6), shared_response_prefix=2, pad_id=0)
    names, params = zip(*model.named_parameters())
    return model, b, names, params


def test_delta_rule_without_attention_streams_exactly():
    """No attention, no conv: the matrix scan is the graph's only scan (passes/analysis/rules/scan.py's
    ``scan_candidates``); its tail chunks start from the prefix's cached state."""
    model, b, names, params = delta_rule_model()

    def loss(ids, cm):
        lp = model(ids)[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        m = cm[:, 1:].to(lp.dtype)
        return -(lp * m).sum() / m.sum()

    backend = run_modes(loss, (b["input_ids"], b["completion_mask"]), params, names, 3, guard=KeepFloat64)
    info = backend.records[-1].replay
    assert info["cached_scans"] == ("tree_matrix_scan_default",), info["cached_scans"]
    assert "tree_matrix_scan_cached" in info["tail_code"] and "tree_matrix_scan" in info["prefix_code"]


def test_delta_rule_layer_on_hidden_states_streams_exactly():
    """The mixer's graph on hidden states (no token ids: a layer's graph between graph breaks): the rows are
    keyed by their hidden states, the matrix scan runs along those paths and streams as with token ids."""
    model, b, names, params = delta_rule_model()
    x = model.emb(b["input_ids"]).detach()
    backend = run_modes(lambda x: model.mixer(x).square().sum(), (x,), params[1:5], names[1:5], 3,
                        guard=KeepFloat64)
    assert backend.records[-1].replay["cached_scans"] == ("tree_matrix_scan_default",)


def test_token_local_graph_streams_without_a_cache():
    """Token-local all through (a bag-of-tokens model, or a per-expert graph between graph breaks): nothing
    reads a prefix token from a tail token, so nothing is cached; the trunk still streams — the prefix once,
    the tails chunk by chunk, each re-run in backward — exactly."""
    torch.manual_seed(0)
    emb, mlp = torch.nn.Embedding(23, 8).double(), torch.nn.Linear(8, 23).double()

    def loss(ids, cm):
        lp = mlp(torch.tanh(emb(ids))).log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)
        return -(lp * cm).sum() / cm.sum()

    b = make_grpo_batch(vocab_size=23, seed=1, num_prompts=2, group_size=3, prompt_len=5, response_len=(2, 4),
                        pad_id=0)
    args = (b["input_ids"], b["completion_mask"].to(F64))
    params = [*emb.parameters(), *mlp.parameters()]
    want = loss(*args)
    gw = torch.autograd.grad(want, params)
    backend = brcompile.backend(compiler="eager", mode="replay", chunk_tokens=2)
    got = torch.compile(loss, backend=backend)(*args)
    assert_exact(got, want, F64, "loss")
    for gg, ww in zip(torch.autograd.grad(got, params), gw):
        assert_exact(gg, ww, F64, "grad")
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.streamed_calls == 1, str(s)
    rec = backend.records[-1]
    assert rec.replay_reason is None and rec.replay["cached"] == () and rec.replay["cached_scans"] == (), rec.replay
    assert rec.runtime.calls[-1].schedule["chunks"] >= 2
