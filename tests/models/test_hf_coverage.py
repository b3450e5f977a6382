"""Unmodified HuggingFace causal LMs beyond the five families of test_hf.py, each one the witness of a
general rule it used to break (built tiny and random by the sweep's recipe, ``benchmarks/hf_sweep.py``:
hidden 32, 2 layers, vocab 96; the sweep's GRPO batch: 2 prompts x 3 responses, right padding).

Every case compares the masked next-token loss and every parameter gradient with the eager model in
float64 (bound ``TOLERANCE[float64]``, or the float32 bound where the model computes in float32 inside:
HF's RMSNorm, see test_hf.py) and asserts through ``brcompile.stats()`` that the call replayed.
"""
import functools

import pytest
import torch

import brcompile
from brcompile.testing import assert_exact
from tests.helpers import KeepFloat64, assert_replayed

transformers = pytest.importorskip("transformers", minversion="5.0")  # every test here runs an HF model
hf_sweep = pytest.importorskip("benchmarks.hf_sweep")


def replay_arch(arch: str, dtype=torch.float64, grad_dtype=None, keep_float64: bool = False):
    """Build ``arch`` tiny (the sweep's config recipe) in ``dtype``, run the loss eagerly and under the backend
    (the packed FX graph run as is), compare the loss (``dtype``'s bound) and every gradient (``grad_dtype``'s
    bound, default ``dtype``'s), and assert the call replayed. With ``keep_float64`` both runs are inside
    ``KeepFloat64`` (a float64 model's float32 casts inside stay float64). Returns the backend (its records)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model, _, _ = hf_sweep.build_model(arch, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[arch])
    model = model.to(dtype).train()
    batch = hf_sweep.grpo_batch()
    args = (batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    fn = functools.partial(hf_sweep.next_token_loss, model)
    if keep_float64:
        fn = _in_float64(fn)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    want = fn(*args)
    gw = torch.autograd.grad(want, [p for _, p in params], allow_unused=True)
    backend = brcompile.backend(compiler="eager")
    got = torch.compile(fn, backend=backend)(*args)
    gg = torch.autograd.grad(got, [p for _, p in params], allow_unused=True)
    assert_replayed()
    assert_exact(got, want, dtype, "loss")
    for (name, _), a, b in zip(params, gg, gw):
        if b is None:
            assert a is None or not a.abs().max().item(), f"grad of {name}: eager has none"
            continue
        assert_exact(a, b, grad_dtype or dtype, f"grad of {name}")
    return backend


def _in_float64(fn):
    def run(*args):
        with KeepFloat64():
            return fn(*args)
    return run


@pytest.mark.parametrize("arch", ["gpt2", "gpt-sw3"])
def test_addmm_of_flattened_tokens(arch):
    """GPT-2's ``Conv1D``: ``addmm(bias, x.view(-1, D), W).view(B, L, -1)`` — the product keeps the flattened
    token rows (rules/linalg.py: addmm), so no projection is materialised."""
    backend = replay_arch(arch)
    reasons = [reason for *_, reason in backend.records[0].materialisations]
    assert not any("addmm" in r or "flattened" in r for r in reasons), reasons


def test_polar_rotary_of_positions():
    """DeepSeek-V2's complex rotary: ``freqs_cis = polar(ones_like(freqs), freqs)`` of position-only
    frequencies. torch's fake kernel of ``polar`` fixes the packed token count N to the example's, so the
    packed graph builds it as a stacked (real, imaginary) pair (rules/pointwise.py: emit_complex) and holds
    for every N (passes/emit/check.py). The model's grouped-mm experts run in float32 only: float32 bound."""
    backend = replay_arch("deepseek_v2", torch.float32)
    assert "polar" not in backend.records[0].packed_code and "view_as_complex" in backend.records[0].packed_code


def test_setitem_of_a_mask_into_cloned_ids():
    """Gemma3's multimodal LM: ``llm_input_ids = input_ids.clone(); llm_input_ids[image_mask] = 0`` becomes
    ``masked_fill`` (passes/lower/functionalize.py), so the ids stay token values. HF's Gemma RMSNorm computes in
    float32: gradients at the float32 bound (test_hf.py)."""
    backend = replay_arch("gemma3", torch.float64, grad_dtype=torch.float32)
    assert "setitem" not in backend.records[0].packed_code


def test_multi_query_attention_heads():
    """Falcon's multi-query attention: k and v of one head beside 4 query heads, passed to SDPA without
    ``enable_gqa`` (SDPA broadcasts the head dim): tree attention with one kv group (rules/attention.py:
    head_counts_unsupported). The key bias's gradient cancels under softmax: assert_grads_exact."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from tests.helpers import assert_grads_exact

    model, _, _ = hf_sweep.build_model("falcon", MODEL_FOR_CAUSAL_LM_MAPPING_NAMES["falcon"])
    model = model.to(torch.float64).train()
    batch = hf_sweep.grpo_batch()
    args = (batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    fn = functools.partial(hf_sweep.next_token_loss, model)
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    want = fn(*args)
    gw = torch.autograd.grad(want, params, allow_unused=True)
    backend = brcompile.backend(compiler="eager")
    got = torch.compile(fn, backend=backend)(*args)
    gg = torch.autograd.grad(got, params, allow_unused=True)
    assert_replayed()
    assert_exact(got, want, torch.float64, "loss")
    assert_grads_exact(gg, gw, names, torch.float64)
    assert "tree_attention" in backend.records[0].packed_code


def test_gather_of_flattened_tokens():
    """MiniMax-M2's router: ``gather(scores, 1, topk_idx)`` of flattened tokens ``[B·L, E]`` along the experts
    is per entry, so it carries the flattened layout (rules/attention.py: gather, ``local=Local.CARRY``) instead of
    materialising the router scores. Its grouped-mm experts run in float32 only: float32 bound."""
    backend = replay_arch("minimax_m2", torch.float32)
    reasons = [reason for *_, reason in backend.records[0].materialisations]
    assert not any("flattened" in r for r in reasons), reasons


def test_position_only_value_needed_dense():
    """Llama4's rotary table, a position-only value (no row dim), read by an op that needs it dense: its dense
    value is the original's (recomputed from the positions, or pack.py's materialize at each column's kept
    entry) instead of a refusal (axes.py: AxesContext.materialise). Llama4 computes its attention and norms
    in float32 inside: float32 bound."""
    replay_arch("llama4_text", torch.float32)


@pytest.mark.parametrize("arch", ["solar_open", "deepseek_v3"])
def test_scatter_of_flattened_tokens(arch):
    """Group-limited routers (Solar-Open, DeepSeek-V3): ``zeros_like(group_scores).scatter(1, group_idx, 1)``
    over flattened tokens ``[B·L, G]`` and the ``gather`` reading the scores back are per entry, so both carry
    the flattened layout (rules/moe.py: scatter, rules/attention.py: gather) and the router stays packed.
    Grouped-mm experts run in float32 only: float32 bound."""
    backend = replay_arch(arch, torch.float32)
    reasons = [reason for *_, reason in backend.records[0].materialisations]
    assert not any("flattened" in r for r in reasons), reasons


def test_positions_expanded_over_rows():
    """Whisper's decoder: positions ``arange(L)`` broadcast over the batch rows (``[B, L]``) and its learned
    position table read at them: the broadcast dim is the row dim of the position value (rules/shape.py:
    broadcast_row), not a feature dim of extent B that the packed graph would keep (it failed the symbolic-N
    check: passes/emit/check.py)."""
    replay_arch("whisper")


def test_writes_into_views_of_the_rotary_table():
    """Qwen3.5's interleaved MRoPE: ``freqs_thw = freq[0]; freqs_thw[..., k:n:3] = freq[d, ..., k:n:3]``, strided
    writes into a view of a fresh value, become ``slice_scatter`` / ``select_scatter`` of the base read by every
    later reader (passes/lower/functionalize.py: _write_through_views), and its positions ``expand(3, B, -1)`` take
    the row dim. Its gated delta rule computes in float32 inside, where its decay gradients (``A_log``) cancel
    to rounding: run all in float64 (KeepFloat64), float64 bound."""
    backend = replay_arch("qwen3_5_text", keep_float64=True)
    code = backend.records[0].packed_code
    assert "setitem" not in code and "slice_scatter" in code


def _tiny(arch: str, **overrides):
    """``arch`` built tiny by the sweep's recipe (eager attention), with ``overrides`` set on its config, in
    float64, training mode."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[arch])
    cfg = hf_sweep.causal_lm_config(arch, cls.__name__, "eager")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    return cls._from_config(cfg, attn_implementation="eager").to(torch.float64).train()


def _compiled_vs_eager(model, keep_float64: bool = False):
    """(loss, eager loss, grads, eager grads, names, backend) of the sweep's masked next-token loss on its GRPO
    batch, compiled under the backend and eagerly."""
    batch = hf_sweep.grpo_batch()
    args = (batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    fn = functools.partial(hf_sweep.next_token_loss, model)
    if keep_float64:
        fn = _in_float64(fn)
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    want = fn(*args)
    gw = torch.autograd.grad(want, params, allow_unused=True)
    backend = brcompile.backend(compiler="eager")
    got = torch.compile(fn, backend=backend)(*args)
    gg = torch.autograd.grad(got, params, allow_unused=True)
    return got, want, gg, gw, names, backend


def test_mask_computed_through_an_attention_with_sinks():
    """HY-V4: each layer's mask is DeepSeek sparse attention's top-k selection of keys by an indexer over the hidden
    states, so it depends on the previous layer's eager attention with sinks, a canonical SDPA node. The mask
    probes evaluate that node by its meaning (canonicalize.canonical_attention); with ``index_topk`` (2048) above L
    every key is picked and the mask is causal & key padding. Dense MLPs (its experts' grouped mm runs in float32
    only); its hyper-connections, router and norms compute in float32 inside: loss at the float64 bound, gradients
    at the float32 one."""
    from tests.helpers import assert_grads_exact

    got, want, gg, gw, names, backend = _compiled_vs_eager(_tiny("hy_v4", mlp_layer_types=["dense", "dense"]))
    assert_replayed()
    assert all(m.endswith("causal+keypad(l_args_1_)") for m in backend.records[0].masks), backend.records[0].masks
    assert_exact(got, want, torch.float64, "loss")
    assert_grads_exact(gg, gw, names, torch.float32)


def test_mask_selected_by_content_is_refused_by_name():
    """HY-V4 with fewer top-k picks than keys: which keys a query sees follows the tokens; refused as such."""
    got, want, *_ = _compiled_vs_eager(_tiny("hy_v4", mlp_layer_types=["dense", "dense"], index_topk=4))
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls == 1, str(s)
    assert s.fallback_codes == {brcompile.Code.MASK_FROM_VALUES: 1}, str(s)
    assert any("top-k" in r for r in s.details(brcompile.Code.MASK_FROM_VALUES)), str(s)
    assert_exact(got, want, torch.float64, "loss")


def test_scores_shape_read_and_written_in_place():
    """XLM (``causal=True``, its causal-LM configuration): ``mask.expand_as(scores)`` reads only the scores' shape
    before ``scores.masked_fill_(mask, min)`` (functionalize: no alias), the condition broadcasts without the
    expansion (canonicalize), ``dropout(...)`` at p = 0 is written in place (``tensor *= mask``). Its softmax of
    ``scores.float()`` is kept float64 (KeepFloat64): loss and every gradient at the float64 bound. The first graph
    (``lengths.max().item()`` breaks it) holds no attention and runs as it is."""
    from tests.helpers import assert_grads_exact

    got, want, gg, gw, names, backend = _compiled_vs_eager(_tiny("xlm", causal=True), keep_float64=True)
    s = brcompile.stats()
    assert s.replayed_calls == 3 and s.executed_tokens < s.logical_tokens, str(s)
    # the graph without attention
    assert set(s.fallback_codes) <= {brcompile.Code.NOTHING_PACKED, brcompile.Code.NO_TOKEN_INPUT}, str(s)
    assert any("tree_attention" in r.packed_code for r in backend.records if r.packed_code), "no tree attention"
    assert_exact(got, want, torch.float64, "loss")
    assert_grads_exact(gg, gw, names, torch.float64)


def test_bidirectional_masked_lm_is_refused_by_name():
    """XLM as the sweep builds it (``causal=False``, a masked LM): the mask is the key padding alone; refused as
    bidirectional attention."""
    _compiled_vs_eager(_tiny("xlm"), keep_float64=True)
    s = brcompile.stats()
    assert brcompile.Code.MASK_NOT_CAUSAL in s.fallback_codes, str(s)  # (the LM head's graph after
    # the break replays: it needs only the positions the loss reads, fewer than the batch's)


def test_prompt_ids_joined_in_the_graph_are_keys_and_its_bidirectional_attention_is_refused():
    """CPM-Ant prepends its prompt ids to the input ids inside the model (``cat((arange(...).repeat(B, 1), ids),
    1)``) and joins its segments and left-padding mask the same way: those are the tree's keys, computed per call
    (passes/canonical/keys.py), and the analysis reaches the masks. There it stops: HF's CPM-Ant builds every row
    as context (``context = full((B, L'), 1)``), so each query sees every key, later ones included, through its
    relative position bias: bidirectional attention, refused by that name at the mask stage. The original runs."""
    got, want, *_, backend = _compiled_vs_eager(_tiny("cpmant"))
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls == 1, str(s)
    assert s.fallback_codes == {brcompile.Code.MASK_NOT_CAUSAL: 1}, str(s)
    stages = [stage for level, stage, _ in backend.records[0].stage_times if level == "dynamo"]
    assert stages[-1] == "masks" and stages.index("computed keys") < stages.index("tree inputs"), stages
    assert any("see keys after it and adds a bias" in r for r in s.details(brcompile.Code.MASK_NOT_CAUSAL)), str(s)
    assert_exact(got, want, torch.float64, "loss")


@pytest.mark.parametrize("patches", ["one byte each", "of several bytes"])
def test_byte_patches_are_refused_by_name(patches):
    """BLT: an entropy patcher (a small causal LM over the bytes) sets patch boundaries, a ``.item()`` breaks the
    graph, and the model body's graph receives the patch lengths as a per-row ``[B, P]`` input; its
    cross-attentions run between the L bytes and the 2·P patch queries/keys (``cross_attn_k = 2``), masked by the
    patch ids computed from those lengths. The patcher's graph, the hash embeddings', the LM head's and the loss's
    replay; the body's graph is refused naming the other axis (a patch that straddles the end of a shared prefix
    holds different bytes in each row), and runs unchanged. With the sweep's threshold every byte is a patch; a
    threshold between the example's entropies makes patches of several bytes (asserted). Run in float64 throughout
    (KeepFloat64): loss and every gradient at the float64 bound."""
    from tests.helpers import assert_grads_exact

    model = _tiny("blt")
    batch = hf_sweep.grpo_batch()
    ids = batch["input_ids"]
    if patches == "of several bytes":  # a threshold halfway between two middle entropies: boundaries vary per row
        with torch.no_grad(), KeepFloat64():
            entropies = model.model.patcher(ids)[0][:, 1:].flatten().unique()  # sorted
        mid = len(entropies) // 2
        model.config.patching_threshold = float(entropies[mid - 1] + entropies[mid]) / 2
    with torch.no_grad(), KeepFloat64():
        lengths = model.model.patcher(ids, patch_size=model.config.patch_size,
                                      threshold=model.config.patching_threshold)[1]
    assert (lengths.amax() > 1) == (patches == "of several bytes"), lengths
    got, want, gg, gw, names, backend = _compiled_vs_eager(model, keep_float64=True)
    s = brcompile.stats()
    assert s.fallback_calls == 1 and s.replayed_calls == 4 and s.executed_tokens < s.logical_tokens, str(s)
    refused = [r for r in backend.records if not r.rewritten and not r.unshared]
    assert len(refused) == 1, [r.reason for r in refused]
    P, L = lengths.shape[1], ids.shape[1]
    reason = refused[0].reason
    assert refused[0].code is brcompile.Code.MASK_SOURCE, reason
    assert f"a per-row input whose {P} columns are not the L = {L} token positions" in reason, reason
    assert f"runs from {2 * P} query positions to {L} key positions" in reason, reason
    assert any("tree_attention" in r.packed_code for r in backend.records if r.rewritten), "the patcher not packed"
    assert_exact(got, want, torch.float64, "loss")
    assert_grads_exact(gg, gw, names, torch.float64)
