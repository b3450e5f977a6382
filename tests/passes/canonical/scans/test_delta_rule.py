"""passes/canonical/scans/delta_rule.py on the real HF Qwen3-Next gated DeltaNet layer graph (``torch_chunk_gated_delta_rule``)
and on HF Kimi-Linear's chunked delta attention (``chunk_kimi_delta_attention``: a per-channel gate, the UT
inverse as a forward-substitution loop of writes, the query scaled after its pad).

The Dynamo graph of the layer, float64 throughout (``KeepFloat64``), at lengths that pad the last chunk (12, 70:
two chunks) and that fill it exactly (64): the region is found, proved and rewritten as one ``matrix_scan``, and
the rewritten graph computes the layer's output and its gradient as the original (1e-10). The same for KDA at
chunk size 4 (lengths 10 and 8; float64, and float32 at 1e-5), with the gradients of all its inputs. A region
perturbed so that it is no longer the recurrence fails the proof and stays as it was, named.
"""
from __future__ import annotations

import contextlib
import functools
import operator

import pytest
import torch
import torch.fx as fx

from brcompile.backends.scan.matrix import matrix_scan
from brcompile.passes.canonical.scans import delta_rule
from brcompile.passes.lower.functionalize import functionalize
from brcompile.passes.spellings import copy_graph_module
from brcompile.passes.analysis.rules.scan import scan_candidates
from brcompile.testing import assert_exact
from tests.helpers import KeepFloat64, transformers_or_skip
from tests.models.test_hybrids import HYBRIDS, TINY


@functools.lru_cache(maxsize=1)
def layer():
    """Layer 0 of the tiny float64 Qwen3-Next of tests/models/test_hybrids.py: the gated DeltaNet (2 key heads,
    4 value heads, head dims 8)."""
    transformers = transformers_or_skip()
    cfg = transformers.AutoConfig.for_model("qwen3_next", **TINY, **HYBRIDS["qwen3_next"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").double()
    return model.model.layers[0].linear_attn


@functools.lru_cache(maxsize=None)
def captured(length: int):
    """(the Dynamo graph of the layer on ``[2, length, 32]`` hidden states, its example inputs, those states)."""
    h = torch.randn(2, length, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(length))
    return (*capture(layer(), h), h)


def capture(mod, h):
    """(the Dynamo graph of ``mod(h)`` in float64, its example inputs)."""
    got = []

    def backend(gm, example_inputs):
        got.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    with KeepFloat64():
        torch.compile(lambda x: mod(x), backend=backend, dynamic=False)(h)
    assert len(got) == 1
    return got[0]


def calls(gm, name):
    return [n for n in gm.graph.nodes if getattr(n.target, "__name__", str(n.target)) == name]


def output_and_grad(gm, inputs, h):
    """The graph's output on ``inputs`` (``h`` the hidden states among them) and d(sum(out * w))/dh."""
    h = h.detach().clone().requires_grad_()
    args = [h if x is inputs[0] else x for x in inputs]
    out = gm(*args)
    out = out[0] if isinstance(out, (tuple, list)) else out
    w = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(3))
    return out.detach(), torch.autograd.grad((out * w).sum(), h)[0]


@pytest.mark.parametrize("length", [12, 64, 70])
def test_chunked_delta_rule_becomes_one_matrix_scan(length):
    gm, inputs, h = captured(length)
    assert inputs[0].shape == h.shape
    work = functionalize(copy_graph_module(gm))
    assert calls(work, "linalg_solve_triangular")
    notes = delta_rule.canonicalize_delta_rules(work)
    assert len(notes) == 1 and notes[0].endswith("-> matrix_scan") and "scalar gate" in notes[0], notes
    assert not calls(work, "linalg_solve_triangular")
    scan = [n for n in work.graph.nodes if n.target is matrix_scan]
    assert scan and scan[0] in scan_candidates(work)  # a graph without attention shares through it (passes/emit/pack.py)
    want, gwant = output_and_grad(gm, inputs, h)
    got, ggot = output_and_grad(work, inputs, h)
    assert_exact(got, want, 1e-10, "layer output")
    assert_exact(ggot, gwant, 1e-10, "grad of the hidden states")


def test_a_perturbed_region_fails_the_proof():
    """The intra-chunk decay mask ``triu(1)`` made ``triu(0)`` (the diagonal masked too: each token's own update
    no longer reaches its output): not the recurrence, left as is, the reason named."""
    gm, _, _ = captured(12)
    work = functionalize(copy_graph_module(gm))
    triu = [n for n in work.graph.nodes if n.target == "triu"]
    assert len(triu) == 1
    triu[0].args = (triu[0].args[0], 0)
    work.recompile()
    notes = delta_rule.canonicalize_delta_rules(work)
    assert len(notes) == 1 and delta_rule.LEFT in notes[0] and "does not equal" in notes[0], notes
    assert calls(work, "linalg_solve_triangular")
    assert not [n for n in work.graph.nodes if n.target is matrix_scan]


def test_a_region_read_outside_is_not_closed():
    """An intermediate of the chunked loop (the UT system) read by the graph's output as well: no closed region
    (rewriting would drop a value something else needs), left as is."""
    gm, _, _ = captured(12)
    work = functionalize(copy_graph_module(gm))
    solve = calls(work, "linalg_solve_triangular")[0]
    out = next(n for n in work.graph.nodes if n.op == "output")
    with work.graph.inserting_before(out):
        extra = work.graph.call_function(operator.getitem, (solve, 0))
    out.args = ((*fx.node.map_aggregate(out.args[0], lambda x: x), extra),) \
        if isinstance(out.args[0], (tuple, list)) else ((out.args[0], extra),)
    work.recompile()
    notes = delta_rule.canonicalize_delta_rules(work)
    assert notes and all(delta_rule.LEFT in n and "closed region" in n for n in notes), notes
    assert not [n for n in work.graph.nodes if n.target is matrix_scan]


def kda(q, k, v, g, beta):
    """HF Kimi-Linear's chunked KDA at chunk size 4, q and k l2-normalised inside: the per-channel gated delta
    rule ``S_t = (I - β_t k_t k_tᵀ) diag(exp g_t) S_{t-1} + β_t k_t v_tᵀ``, ``o_t = S_tᵀ q_t / sqrt(dk)``."""
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    return chunk_kimi_delta_attention(q, k, v, g=g, beta=beta, chunk_size=4, use_qk_l2norm_in_kernel=True)[0]


def kda_inputs(length: int) -> dict:
    """q, k, v ``[2, length, 2, 4]`` (HF's ``[B, L, H, d]``), a per-channel g in (-1, 0), β in (0, 1)."""
    gen = torch.Generator().manual_seed(length)
    shape = (2, length, 2, 4)
    q, k, v = (torch.randn(shape, dtype=torch.float64, generator=gen) for _ in range(3))
    return dict(q=q, k=k, v=v, g=-torch.rand(shape, dtype=torch.float64, generator=gen),
                beta=torch.rand(shape[:3], dtype=torch.float64, generator=gen))


@pytest.mark.parametrize("length,dtype", [(8, torch.float64), (10, torch.float64), (10, torch.float32)])
def test_kimi_delta_attention_becomes_one_matrix_scan(length, dtype):
    """No triangular solve: the UT inverse is the forward substitution ``attn[..., i, :i] = row + (row[:, None]
    * sub).sum(-2)`` (select/slice scatters after passes/lower/functionalize.py); the gate is per key channel. A
    float32 graph (its ``decay_mask.exp().float()`` a float32 cast) is proved in float64 all the same."""
    transformers_or_skip()
    x = {name: t.to(dtype) for name, t in kda_inputs(length).items()}
    got = []

    def backend(gm, example_inputs):
        got.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with KeepFloat64() if dtype == torch.float64 else contextlib.nullcontext():
        torch.compile(kda, backend=backend, dynamic=False)(**x)
    gm, = got
    names = [n.target[2:-1] for n in gm.graph.nodes if n.op == "placeholder"]  # Dynamo's L_q_, ...
    work = functionalize(copy_graph_module(gm))
    assert calls(work, "select_scatter")
    notes = delta_rule.canonicalize_delta_rules(work)
    assert len(notes) == 1 and notes[0].endswith("-> matrix_scan") and "channel gate" in notes[0], notes
    assert [n for n in work.graph.nodes if n.target is matrix_scan] and not calls(work, "select_scatter")
    w = torch.randn(2, length, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).to(dtype)
    results = []
    for module in (gm, work):
        args = [x[name].detach().clone().requires_grad_() for name in names]
        with KeepFloat64() if dtype == torch.float64 else contextlib.nullcontext():
            out = module(*args)
        out = out[0] if isinstance(out, (tuple, list)) else out
        results.append((out.detach(), torch.autograd.grad((out * w).sum(), args)))
    (want, gwant), (out, ggot) = results
    assert_exact(out, want, dtype, "KDA output")
    for name, a, b in zip(names, ggot, gwant):
        assert_exact(a, b, dtype, f"grad of {name}")
