"""Mamba-2's chunked SSD as a tree scan (passes/canonical/scans/ssd.py).

On the graph Dynamo captures from a tiny float64 HF Bamba (one Mamba-2 mixer, one attention layer): the
chunked region (pad to the chunk size, segment sums, chunk einsums) is found, its inputs get their roles by
shape, the probes prove it the recurrence ``h_t = exp(la_t) h_{t-1} + u_t ⊗ B_t, y_t = C_t · h_t + d · x_t``,
and it becomes one ``linear_scan`` whose graph computes the same loss. The same region made non-causal (the
intra-chunk mask dropped) fails the proof and stays as it was, with a note. The reference itself is checked
against the recurrence written as a loop.
"""
from __future__ import annotations

import copy

import pytest
import torch

from brcompile.backends.scan.op import linear_scan
from brcompile.passes.spellings import is_op
from brcompile.passes.canonical.scans.ssd import LEFT, canonicalize_ssd_scans, reference_ssd
from tests.helpers import KeepFloat64, transformers_or_skip
from tests.models.test_hybrids import HYBRIDS, TINY, next_token_loss, tree_batch


@pytest.fixture(scope="module")
def bamba_graph():
    """(graph module, example inputs, (B, L)) of the float64 Bamba loss, as Dynamo captures it."""
    transformers = transformers_or_skip()
    cfg = transformers.AutoConfig.for_model("bamba", **TINY, **HYBRIDS["bamba"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").double()
    got = {}

    def capture(gm, example_inputs):
        got["gm"], got["inputs"] = gm, list(example_inputs)
        return gm.forward

    args = tree_batch()
    with KeepFloat64():
        torch.compile(next_token_loss, backend=capture)(model, *args)
    return got["gm"], got["inputs"], tuple(args[0].shape)


def _count(gm, pred) -> int:
    return sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method") and pred(n))


def _diagonal(n) -> int:
    return n.kwargs.get("diagonal", n.args[1] if len(n.args) > 1 else 0)


def test_reference_is_the_recurrence():
    """``reference_ssd`` (the ops of the rewrite) equals the recurrence as a loop over positions."""
    g = torch.Generator().manual_seed(0)
    B, L, H, P, N = 2, 7, 3, 4, 5
    la = -torch.rand(B, L, H, generator=g, dtype=torch.float64)
    u, x = (torch.randn(B, L, H, P, generator=g, dtype=torch.float64) for _ in range(2))
    Bm, Cm = (torch.randn(B, L, H, N, generator=g, dtype=torch.float64) for _ in range(2))
    d = torch.randn(H, 1, generator=g, dtype=torch.float64)
    h = torch.zeros(B, H, P, N, dtype=torch.float64)
    want = []
    for t in range(L):
        h = la[:, t].exp()[..., None, None] * h + u[:, t, :, :, None] * Bm[:, t, :, None, :]
        want.append((h * Cm[:, t, :, None, :]).sum(-1) + d * x[:, t])
    torch.testing.assert_close(reference_ssd(la, u, Bm, Cm, x, d), torch.stack(want, 1), rtol=1e-12, atol=1e-12)


def test_bamba_region_proved_and_rewritten(bamba_graph):
    gm, inputs, batch = bamba_graph
    with torch.no_grad(), KeepFloat64():
        want = gm(*inputs)
    work = copy.deepcopy(gm)
    assert _count(work, lambda n: is_op(n, "einsum")) >= 5  # the chunked spelling
    notes = canonicalize_ssd_scans(work, batch)
    assert len(notes) == 1 and "-> linear_scan" in notes[0], notes
    for role in ("la=", "u=", "B=", "C=", "x=", "d="):
        assert role in notes[0], notes
    assert _count(work, lambda n: n.target is linear_scan) == 1
    assert _count(work, lambda n: is_op(n, "einsum")) == 0  # the whole region is gone
    with torch.no_grad(), KeepFloat64():
        got = work(*inputs)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=0)


def test_non_causal_region_refused(bamba_graph):
    """Dropping the intra-chunk causal mask (the segment sum's ``tril(ones, 0)``, which sets the decays of later
    positions to ``exp(-inf) = 0``) lets a position read later ones of its chunk: not the recurrence on any
    role assignment, so the region stays (its einsums kept) and the note says why."""
    gm, _, batch = bamba_graph
    work = copy.deepcopy(gm)
    tril = next(n for n in work.graph.nodes if n.target is torch.tril and _diagonal(n) == 0)
    tril.replace_all_uses_with(tril.args[0])
    work.graph.erase_node(tril)
    work.recompile()
    before = _count(work, lambda n: is_op(n, "einsum"))
    notes = canonicalize_ssd_scans(work, batch)
    assert len(notes) == 1 and LEFT in notes[0] and "not the state-space recurrence" in notes[0], notes
    assert _count(work, lambda n: n.target is linear_scan) == 0
    assert _count(work, lambda n: is_op(n, "einsum")) == before


def test_without_token_ids_nothing_is_recognised(bamba_graph):
    gm, _, _ = bamba_graph
    work = copy.deepcopy(gm)
    assert canonicalize_ssd_scans(work, None) == []
    assert _count(work, lambda n: n.target is linear_scan) == 0
