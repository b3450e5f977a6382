"""Affine associative scans as tree linear scans (passes/canonical/scans/linear.py, the ``linear_scan`` rule of
passes/analysis/rules/scan.py), and graphs without attention that share work through their scans (passes/emit/pack.py).

A tiny state-space LM without attention: per token a decay ``a = sigmoid(W_a h)`` and an input ``b = W_b h``,
the states ``h_t = a_t h_{t-1} + b_t`` by ``torch._higher_order_ops.associative_scan`` — inlined by Dynamo
(``combine_mode="generic"``, what runs on CPU) or as the higher-order op itself (``associative_scan_op``,
what ``combine_mode="pointwise"`` records on GPUs). Loss and every gradient equal eager's in float64; the
packed graph computes the scan with ``brcompile::tree_linear_scan``. A combine that is not the affine
composition, and graphs without attention whose scans are not tree scans, run the original graph with the
reason.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._higher_order_ops.associative_scan import associative_scan, associative_scan_op, wrap_combine_fn_flat
from torch.utils import _pytree as pytree

import brcompile
from brcompile.backends.scan.op import linear_scan
from brcompile.passes.canonical.scans.linear import canonicalize_linear_scans, is_affine_combine
from brcompile.testing import assert_exact
from tests.helpers import assert_grads_exact, assert_replayed
from tests.passes.analysis.rules.test_scan_rules import grpo_like_batch, packed_code, run_exact, token_loss

F64 = torch.float64


def affine(left, right):
    """HF Mamba's ``combine_fn``: the composition of ``h -> a1 h + b1`` then ``h -> a2 h + b2``."""
    a1, b1 = left
    a2, b2 = right
    return a1 * a2, a2 * b1 + b2


def swapped(left, right):
    """Associative too, but the other order of composition: ``h_t = b_0 + a_0 b_1 + a_0 a_1 b_2 + ...``."""
    a1, b1 = left
    a2, b2 = right
    return a1 * a2, a1 * b2 + b1


def hop_scan(combine, a, b, dim):
    """The higher-order op as ``combine_mode="pointwise"`` records it (leaves moved to dim 0)."""
    leaves = [a.movedim(dim, 0), b.movedim(dim, 0)]
    fn = functools.partial(wrap_combine_fn_flat, combine_fn=combine, spec=pytree.tree_flatten((a, b))[1],
                           num_leaves=2)
    return [x.movedim(0, dim) for x in associative_scan_op(fn, leaves, additional_inputs=())]


class ScanLM(nn.Module):
    """Embedding (times the mask), then ``layers`` blocks of a selective linear recurrence along the tokens
    (a ``[B, D, L, S]`` state like Mamba's, scanned along dim 2), residual, and the LM head."""

    def __init__(self, V=23, D=6, S=2, layers=2, combine=affine, form="generic"):
        super().__init__()
        self.combine, self.form, self.S = combine, form, S
        self.emb = nn.Embedding(V, D)
        self.wa = nn.ModuleList(nn.Linear(D, D * S) for _ in range(layers))
        self.wb = nn.ModuleList(nn.Linear(D, D * S) for _ in range(layers))
        self.head = nn.Linear(D, V)

    def forward(self, ids, am):
        h = self.emb(ids) * am[..., None].to(self.emb.weight.dtype)
        B, L, D = h.shape
        for wa, wb in zip(self.wa, self.wb):
            a = torch.sigmoid(wa(h)).view(B, L, D, self.S).transpose(1, 2)  # [B, D, L, S]
            b = wb(h).view(B, L, D, self.S).transpose(1, 2)
            if self.form == "hop":
                _, states = hop_scan(self.combine, a, b, 2)
            else:
                _, states = associative_scan(self.combine, (a, b), dim=2, combine_mode="generic")
            h = h + states.sum(-1).transpose(1, 2)
        return self.head(h)


def scan_lm(seed=0, **kw):
    torch.manual_seed(seed)
    return ScanLM(**kw).to(F64)


def run_hop_exact(model, args):
    """``run_exact`` for the higher-order-op form, whose reference is the same model with the scan inlined:
    torch's own autograd of ``associative_scan_op`` run eagerly on CPU gets the gradient of the decays wrong
    (``test_eager_hop_gradient_is_not_the_reference``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    model.form = "generic"
    want = token_loss(model, *args)
    gw = torch.autograd.grad(want, params)
    model.form = "hop"
    backend = brcompile.backend(compiler="eager")
    got = torch.compile(functools.partial(token_loss, model), backend=backend)(*args)
    gg = torch.autograd.grad(got, params)
    assert_exact(got, want, F64, "loss")
    assert_grads_exact(gg, gw, names, F64)
    return backend


def test_eager_hop_gradient_is_not_the_reference():
    """Why the HOP form is compared with the inlined one: on torch 2.13 CPU, ``associative_scan_op`` run
    eagerly has the right states but not the right gradient of ``a``; ``linear_scan`` has both (a loop)."""
    a = torch.rand(2, 3, 7, 2, dtype=F64, requires_grad=True)
    b = torch.randn(2, 3, 7, 2, dtype=F64, requires_grad=True)
    w = torch.randn(2, 3, 7, 2, dtype=F64)
    h, out = torch.zeros_like(b[:, :, 0]), []
    for t in range(7):
        h = a[:, :, t] * h + b[:, :, t]
        out.append(h)
    loop = torch.stack(out, 2)
    want = torch.autograd.grad((loop * w).sum(), (a, b))
    got = torch.autograd.grad((linear_scan(a, b, 2) * w).sum(), (a, b))
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    hop = hop_scan(affine, a, b, 2)[1]
    torch.testing.assert_close(hop, loop, rtol=1e-12, atol=1e-12)
    ga, gb = torch.autograd.grad((hop * w).sum(), (a, b))
    torch.testing.assert_close(gb, want[1], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(ga, want[0]), "torch's eager HOP gradient is right now: compare with it directly"


@pytest.mark.parametrize("form", ["generic", "hop"])
def test_affine_associative_scan_replays_as_tree_linear_scan(form):
    """No attention: the tree inputs are the ids and the mask the scans read; every scan runs on the tree (two
    layers of the HOP: the second scans the first's packed output; one inlined layer, slower to trace)."""
    layers = 2 if form == "hop" else 1
    model = scan_lm(form=form, layers=layers)
    if form == "hop":
        backend = run_hop_exact(model, grpo_like_batch())
    else:
        backend = run_exact(model, functools.partial(token_loss, model), grpo_like_batch())
    assert_replayed()
    code = packed_code(backend)
    assert code.count("brcompile.tree_linear_scan") == layers, code
    assert "associative_scan" not in code and "_add_batch_dim" not in code, code
    rec = next(r for r in backend.records if r.rewritten)
    assert len(rec.tree_inputs) == 2, rec.tree_inputs  # the ids and the mask
    assert not any("states" in node for node, *_ in rec.materialisations), rec.materialisations


def test_not_affine_combine_falls_back_naming_it():
    """The higher-order op with another combine has no tree form: dense, and with no attention and no other
    scan nothing is shared — the original graph runs, the reason names the construct."""
    model = scan_lm(form="hop", combine=swapped, layers=1)
    backend = run_exact(model, functools.partial(token_loss, model), grpo_like_batch())
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls == 1, str(s)
    reasons = [r.reason or "" for r in backend.records]
    assert s.fallback_codes == {brcompile.Code.NOTHING_PACKED: 1}, str(s)
    assert any("associative_scan whose combine_fn is not the affine composition" in r for r in reasons), reasons


def test_inlined_scan_of_another_combine_is_left_alone():
    """The inlined region of a combine that is not the affine composition fails the probe and stays as it
    is (its ops go dense): no linear scan; the graph's token-local ops (embedding, norms, head) still replay,
    exactly."""
    model = scan_lm(combine=swapped, layers=1)
    backend = run_exact(model, functools.partial(token_loss, model), grpo_like_batch())
    assert brcompile.stats().replayed_calls == 1
    assert "linear_scan" not in packed_code(backend)


def test_canonicalisation_rewrites_the_region_and_keeps_the_values():
    """On the captured graph itself: the inlined region becomes one ``linear_scan`` (and no vmap bookkeeping
    is left), and the rewritten graph computes what the original did."""
    captured = []

    def grab(gm, example_inputs):
        captured.append((gm, example_inputs))
        return gm

    def f(a, b):
        return associative_scan(affine, (a, b), dim=1, combine_mode="generic")

    a, b = torch.rand(2, 9, 3, dtype=F64), torch.randn(2, 9, 3, dtype=F64)
    torch.compile(f, backend=grab, fullgraph=True)(a, b)
    gm, _ = captured[0]
    want = gm(a, b)
    notes = canonicalize_linear_scans(gm)
    assert len(notes) == 1 and "-> linear_scan" in notes[0], notes
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert linear_scan in targets and torch.cumprod in targets, targets
    assert not any("batch_dim" in getattr(t, "__name__", "") for t in targets), targets
    got = gm(a, b)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_leaves_of_two_dtypes_are_left_alone():
    """The probes run in float64; leaves of two dtypes (the original promotes inside the combine) are not
    ``linear_scan``'s operands: the region stays as it is, the note names the dtypes."""
    captured = []

    def grab(gm, example_inputs):
        captured.append(gm)
        return gm

    def f(a, b):
        return associative_scan(affine, (a, b), dim=1, combine_mode="generic")

    torch.compile(f, backend=grab, fullgraph=True)(torch.rand(2, 5, 3), torch.randn(2, 5, 3, dtype=F64))
    notes = canonicalize_linear_scans(captured[0])
    assert len(notes) == 1 and "left as is" in notes[0] and "dtypes torch.float32 and torch.float64" in notes[0], notes


def test_affine_combine_check():
    """The combine proof: the formula on random inputs, pointwise ops only."""
    def body(fn):
        return torch.fx.symbolic_trace(lambda a1, b1, a2, b2: fn((a1, b1), (a2, b2)))

    assert is_affine_combine(body(affine)) is None
    assert "not the affine composition" in is_affine_combine(body(swapped))
    assert "not pointwise" in is_affine_combine(body(lambda l, r: (l[0] * r[0], torch.cumsum(r[0] * l[1], 0) + r[1])))


# --------------------------------------------------------------------------------------------------
# graphs without attention


class TokenMLP(nn.Module):
    """Per-token ops (no attention), with a conv that is not causal: no scan along the tree."""

    def __init__(self, V=23, D=6, conv=None):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.conv = None if conv is None else nn.Conv1d(D, D, 3, groups=D, padding=1)
        self.head = nn.Linear(D, V)

    def forward(self, ids, am):
        h = torch.tanh(self.emb(ids))
        if self.conv is not None:  # padding 1 on both sides: reads the next token (not causal)
            h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h)


@pytest.mark.parametrize("conv,reason", [("symmetric", "only the causal conv")])
def test_no_attention_and_no_tree_scan_runs_unchanged(conv, reason):
    """Nothing to share without attention and without a scan along the tree: the original graph runs (a
    non-causal conv is named). A graph of token-local ops only replays: tests/passes/analysis/test_token_local.py."""
    torch.manual_seed(0)
    model = TokenMLP(conv=conv).to(F64)
    backend = run_exact(model, functools.partial(token_loss, model), grpo_like_batch())
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls == 1, str(s)
    reasons = [r.reason or "" for r in backend.records]
    assert s.fallback_codes == {brcompile.Code.NOTHING_PACKED: 1}, str(s)
    assert any(reason in r for r in reasons), reasons  # the conv is named


def test_no_attention_without_token_ids_replays_keyed_by_hidden_states():
    """A scan over float ``[B, L, D]`` inputs with no token ids (a layer's graph on hidden states): the rows are
    keyed by their hidden states, as a token-local graph's (passes/emit/pack.py), and the scan runs along those
    rows' paths: rows sharing their first states share that work, loss and gradient exact."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4).double()

    def f(x):
        a = torch.sigmoid(lin(x))
        return associative_scan(affine, (a, x), dim=1, combine_mode="generic")[1].square().sum()

    x = torch.randn(3, 5, 4, dtype=F64)
    x[1, :3] = x[0, :3]  # rows 0 and 1 share their first three states
    want = f(x)
    backend = brcompile.backend(compiler="eager")
    got = torch.compile(f, backend=backend)(x)
    assert_exact(got, want, F64, "loss")
    params = list(lin.parameters())
    for gg, gw in zip(torch.autograd.grad(got, params), torch.autograd.grad(want, params)):
        assert_exact(gg, gw, F64, "grad")
    assert_replayed()
    s = brcompile.stats()
    assert s.executed_tokens == 15 - 3 < s.logical_tokens == 15, str(s)
    assert "brcompile.tree_linear_scan" in backend.records[-1].packed_code


def test_scan_over_float_rows_without_token_ids_is_row_local():
    """A scan over a float ``[B, L]`` input, no token ids and no ``[B, L, D]`` hidden states: the input is read as
    B rows of one token each (a ``[T, D]`` graph over flattened tokens), so the scan along its dim 1 runs within a
    row, and bitwise-equal rows are computed once."""
    def f(x, w):
        a = torch.sigmoid(x * w)
        return associative_scan(affine, (a, x), dim=1, combine_mode="generic")[1].sum()

    x = torch.randn(3, 5, dtype=F64)
    x[2] = x[0]
    w = torch.randn(5, dtype=F64, requires_grad=True)
    want = torch.autograd.grad(f(x, w), w)[0]
    backend = brcompile.backend(compiler="eager")
    got = torch.compile(f, backend=backend)(x, w)
    torch.testing.assert_close(got, f(x, w), rtol=1e-12, atol=0)
    torch.testing.assert_close(torch.autograd.grad(got, w)[0], want, rtol=1e-10, atol=0)
    s = brcompile.stats()
    assert s.replayed_calls == 1 and (s.executed_tokens, s.logical_tokens) == (2, 3), str(s)


def test_conv_only_model_replays():
    """A causal short conv alone (no attention) is a tree scan too: the graph replays."""
    torch.manual_seed(0)

    class ConvLM(TokenMLP):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(6, 6, 3, groups=6, padding=2)

        def forward(self, ids, am):
            h = torch.tanh(self.emb(ids)) * am[..., None].to(self.emb.weight.dtype)
            L = h.shape[1]
            return self.head(h + F.silu(self.conv(h.transpose(1, 2))[..., :L]).transpose(1, 2))

    model = ConvLM().to(F64)
    backend = run_exact(model, functools.partial(token_loss, model), grpo_like_batch())
    assert_replayed()
    assert "brcompile.tree_causal_conv1d" in packed_code(backend)


def test_failed_probe_leaves_no_vmap_level_open():
    """A region whose probe raises between the vmap nesting calls (here an ``_add_batch_dim`` at a level that
    does not exist) is left as it is, with the reason, and the vmap level it opened is closed again."""
    import operator

    from torch._functorch import predispatch

    g = torch.fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    ea, eb = g.call_function(torch.movedim, (a, 1, 0)), g.call_function(torch.movedim, (b, 1, 0))
    for e in (ea, eb):
        e.meta["example_value"] = torch.empty(4, 3, dtype=F64)
    g.call_function(predispatch._vmap_increment_nesting, (4, "error"))
    x = g.call_function(predispatch._add_batch_dim, (ea, 0, 1))
    y = g.call_function(predispatch._add_batch_dim, (eb, 0, 7))
    r = g.call_function(predispatch._remove_batch_dim, (g.call_function(operator.mul, (x, y)), 1, 4, 0))
    g.call_function(predispatch._vmap_decrement_nesting, ())
    g.output(g.call_function(torch.movedim, (r, 0, 1)))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    notes = canonicalize_linear_scans(gm)
    assert len(notes) == 1 and "does not run on probes" in notes[0], notes
    assert torch._C._functorch.maybe_current_level() is None
    assert linear_scan not in [n.target for n in gm.graph.nodes]
