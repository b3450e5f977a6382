"""The compile pipeline: one captured graph, read at one level, through ordered named stages.

``STAGES`` is the whole flow of the backend's compile time, in order (docs/ARCHITECTURE.md §3):

=====================  ==========================================================================================
stage                  what it does to the :class:`PipelineState`
=====================  ==========================================================================================
lower                  the graph read at the level asked: Dynamo's graph as recorded, or its functional ATen graph
functionalise          a copy; checkpoint bodies inlined (tagged), in-place ops and writes into views made pure,
                       splits into one whole piece read as their input
canonicalise attention eager attention as SDPA; sinks, soft-cap, ALiBi, relative biases as op features
computed keys          token ids the graph makes along an axis no input has (a prompt joined to the ids): that
                       axis's keys read from new inputs, computed per call by a key graph
canonicalise scans     affine and chunked state-space scans as ``linear_scan``, gated delta rules as ``matrix_scan``
tree inputs            (B, L), the tree inputs, position inputs; decode steps (nothing to share); graphs without
                       attention finish here (token-local or scan graphs: their own propagation)
masks                  every attention's mask classified (causal, key padding, sequences, windows, ALiBi ...)
token axes             the token-axis fact of every node (rules registry); per-token attentions set aside
guards                 the per-call guards: canonicalisation's, the masks', mask scalars', the rules'
liveness               which positions an output needs (loss weights, slices, key padding)
emit                   the packed graph (tree inputs -> one value per tree node; fused log-probs), with the
                       live-position ladder: within rows, prefix-only, none
check                  the impls the packed graph needs exist on the device; the packed graph runs on the example
=====================  ==========================================================================================

Every stage is a function of the state; it reads what earlier stages left there and adds its own. A stage may
raise :class:`~brcompile.passes.refusals.CannotReplay` (the graph runs unchanged, with the reason) or
``NothingToShare`` (it runs unchanged and is not a fallback). :func:`run_pipeline` times every stage
(``state.times``; ``explain()`` shows them) and logs each one (``TORCH_LOGS=+brcompile``). The streaming
split (passes/emit/split.py) and the routed-pairs rewrite (passes/emit/routed.py) are the backend's two other ways, run
after and instead of this pipeline respectively.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from brcompile.passes import probe
from brcompile.passes.canonical import attention as eager_attention, keys as computed
from brcompile.passes.lower import checkpoint as checkpoints, splits
from brcompile.passes.canonical.scans import delta_rule, linear as linear_scans, ssd as ssd_scans
from brcompile.passes.analysis import input_masks, mask_stage, masks as masks_mod
from brcompile.passes.analysis import tree_inputs as inputs
from brcompile.passes.analysis.axes import AxesContext, example_value, hint, propagate
from brcompile.passes.emit.check import check_packed_graph
from brcompile.passes.analysis.decode import decode_against_cache
from brcompile.passes.lower.functionalize import functionalize
from brcompile.passes.analysis.liveness import analyse_liveness
from brcompile.passes.emit.pack import PackOptions, build_packed_graph
from brcompile.passes.analysis.tree_inputs import Analysis, AttentionSite
from brcompile.passes.refusals import CannotReplay, Code, NothingToShare
from brcompile.passes.analysis.rules import scan as scan_rules
from brcompile.passes.analysis.rules.attention import SDPA, PerTokenAttention
from brcompile.passes.spellings import copy_graph_module

log = logging.getLogger(__name__)

__all__ = ["STAGES", "PipelineConfig", "PipelineState", "Stage", "analyse", "run_pipeline"]


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """What the stages need of the backend's options (brcompile/backend.py: Options)."""

    level: str = "dynamo"  # "dynamo" or "aten"
    training: bool = True  # the graph was captured with grad enabled
    liveness: bool = True
    drop_padding: bool = True
    attention: str = "auto"
    scan: str = "auto"
    fuse_logprob: bool = True


@dataclasses.dataclass
class PipelineState:
    """What the stages know about one graph so far; each stage adds its part."""

    gm: fx.GraphModule  # the graph as the stages have left it (the user's graph is never modified)
    example_inputs: Sequence[Any]
    config: PipelineConfig
    extra_guards: list = dataclasses.field(default_factory=list)  # the lowering's (passes/lower/aten.py)
    canon: Any = None  # eager_attention.Canonical: the canonical graph, its guards and notes
    #: keys the graph computes from its inputs, read from placeholders after its own (passes/canonical/keys.py)
    keys: Optional[computed.ComputedKeys] = None
    scan_notes: list[str] = dataclasses.field(default_factory=list)
    token_ids: Optional[fx.Node] = None
    placeholders: list[fx.Node] = dataclasses.field(default_factory=list)
    values: dict = dataclasses.field(default_factory=dict)  # placeholder -> its example value (SymInts as ints)
    #: every tree attention and its mask (per-token SDPAs leave at "token axes")
    attentions: list[AttentionSite] = dataclasses.field(default_factory=list)
    B: int = 0
    L: int = 0
    tree_inputs: list[fx.Node] = dataclasses.field(default_factory=list)
    position_inputs: dict = dataclasses.field(default_factory=dict)  # per-position input -> its position dim
    outside: dict = dataclasses.field(default_factory=dict)  # attention -> its mask from outside the graph
    input_mask: Optional[input_masks.InputMask] = None  # that mask, classified (one for every such attention)
    masks: Optional[mask_stage.Masks] = None  # the masks stage's: keys, mask-only nodes, meanings, keypad, sequences
    ctx: Optional[AxesContext] = None
    analysis: Optional[Analysis] = None  # set by "guards", or by "tree inputs" for a graph without attention
    packed: Optional[fx.GraphModule] = None
    example_args: Optional[list] = None  # the packed graph's inputs for the example batch
    times: list[tuple[str, float]] = dataclasses.field(default_factory=list)  # (stage, seconds) as run


@dataclasses.dataclass(frozen=True)
class Stage:
    """One named step of the pipeline; ``skip(state)`` True leaves it out for that graph. ``rewrites``: the stage
    turns the graph into another one (the backend's ``dump_dir`` writes the graph after such a stage)."""

    name: str
    run: Callable[[PipelineState], None]
    skip: Callable[[PipelineState], bool] = lambda state: False
    rewrites: bool = False

    @property
    def doc(self) -> str:
        return (self.run.__doc__ or "").strip().split("\n")[0]


# --------------------------------------------------------------------------------------------------
# the stages


def lower(state: PipelineState) -> None:
    """The graph read at ``config.level``: "dynamo", Dynamo's graph as it was recorded; "aten", its functional
    pre-dispatch ATen graph (passes/lower/aten.py), which takes the same inputs, with the guards its lowering
    proved at the example values."""
    if len([n for n in state.gm.graph.nodes if n.op == "placeholder"]) != len(state.example_inputs):
        raise CannotReplay(Code.GRAPH_INPUTS, "example inputs do not match the graph's placeholders")
    if state.config.level == "aten":
        from brcompile.passes.lower.aten import lower_and_respell

        state.gm, state.extra_guards = lower_and_respell(state.gm, state.example_inputs)


def functionalise(state: PipelineState) -> None:
    """A copy of the graph (later stages insert nodes; the user's graph stays as it is), checkpoint bodies
    inlined and tagged (the emitter outlines them again), in-place ops and writes into views made pure, the
    whole piece of a split read as its input (passes/lower/splits.py)."""
    gm = copy_graph_module(state.gm)
    gm = checkpoints.inline_checkpoints(gm)
    state.gm = functionalize(gm)
    splits.drop_identity_splits(state.gm)


def canonicalise_attention(state: PipelineState) -> None:
    """Eager attention (``softmax(q @ k^T * s + mask) @ v`` and its spellings) as SDPA; its scalars as guarded
    constants; sinks, soft-cap, ALiBi and relative biases as features of the attention (passes/canonical/attention/)."""
    state.canon = eager_attention.canonicalize(state.gm, state.example_inputs)
    state.gm = state.canon.gm


def computed_keys(state: PipelineState) -> None:
    """Token ids the graph builds along an axis no input has (CPM-Ant's prompt ids joined to the input ids)
    become inputs: each key of that axis is read from a new placeholder after the graph's own, and the key
    graph that computed it runs per call (passes/canonical/keys.py); the example inputs get its values."""
    keys = computed.lift_computed_keys(state.gm, state.example_inputs)
    if keys is None:
        return
    state.keys = keys
    state.example_inputs = [*state.example_inputs, *keys([hint(a) for a in state.example_inputs])]
    state.canon.notes.append(f"computed tree keys: {keys.describe()}")


def canonicalise_scans(state: PipelineState) -> None:
    """Causal scans along the positions as ops the tree can run: affine associative scans and chunked
    state-space scans as ``linear_scan`` (passes/canonical/scans/linear.py, passes/canonical/scans/ssd.py), chunked gated delta
    rules as ``matrix_scan`` (passes/canonical/scans/delta_rule.py). The token ids are found first: the rewrites keep them."""
    gm = state.gm
    notes = linear_scans.canonicalize_linear_scans(gm)
    state.token_ids = inputs.find_token_ids_or_none(gm)
    shape = hint(tuple(example_value(state.token_ids).shape)) if state.token_ids is not None else None
    notes += ssd_scans.canonicalize_ssd_scans(gm, shape)
    notes += delta_rule.canonicalize_delta_rules(gm)
    state.scan_notes = notes
    state.canon.notes.extend(notes)


def tree_inputs(state: PipelineState) -> None:
    """(B, L) and the tree inputs: the [B, L, ...] inputs the attentions depend on (token ids, attention mask,
    position ids; float embeddings or hidden states in graphs without ids), the per-position inputs beside
    them, and the attention masks that come from outside the graph. A decode step against a KV cache has
    nothing to share (passes/analysis/decode.py). A graph without attention is analysed here to the end: a token-local
    graph or one whose rows share work through causal scans (passes/analysis/tree_inputs.py: analyse_token_local, analyse_scans)."""
    gm = state.gm
    state.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # SymInt inputs (dynamic capture) become their example ints: evaluating the mask subgraph on them
    # must not add guards to the user's graph.
    state.values = {p: hint(v) for p, v in zip(state.placeholders, state.example_inputs)}
    attentions = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in SDPA]
    if not attentions:  # e.g. the loss after a graph break: each row's values are its own, nothing to share
        state.analysis = _without_attention(state)
        return
    token_ids, placeholders = state.token_ids, state.placeholders
    state.attentions = [AttentionSite.of(a) for a in attentions]
    if token_ids is not None:
        B, L = hint(tuple(example_value(token_ids).shape))
    else:
        B, L = inputs.attention_batch_dims(next((a for a in attentions if not inputs.unmasked(a)), attentions[0]))
    state.B, state.L = B, L
    decode = decode_against_cache(attentions, inputs.captured_length(token_ids, attentions), B)
    if decode is not None:  # one token per row against a KV cache (passes/analysis/decode.py)
        raise NothingToShare(Code.DECODE_STEP, decode[1], decode[0])
    needed, needed_qkv = inputs.attention_inputs(state.attentions)
    state.outside = {s.node: s.mask for s in state.attentions if input_masks.input_mask_source(s.mask) is not None}
    outside_sources = {input_masks.input_mask_source(m) for m in state.outside.values()}
    tree = [p for p in placeholders if p in needed and inputs.is_token_shaped(p, B, L) and p not in outside_sources]
    if token_ids is not None and token_ids not in tree:
        raise CannotReplay(Code.NO_TOKEN_INPUT, "the attentions do not depend on the token ids")
    if not tree:
        inputs.refuse_without_tree_inputs(gm, B, L)
    state.tree_inputs = tree
    state.position_inputs = {p: d for p in placeholders if p in needed_qkv and p not in tree
                             for d in [inputs.position_dim(p, B, L)] if d is not None}
    inputs.check_masks_are_computed([s for s in state.attentions if s.node not in state.outside], tree, B, L)
    state.input_mask = mask_stage.outside_input_mask(state.outside, placeholders, state.example_inputs)


def masks(state: PipelineState) -> None:
    """Every attention's mask classified on probes of its [B, L] keys (passes/analysis/masks/): causal, key padding,
    padding-free sequences, windows, ALiBi; one key-padding input for all of them."""
    gm = state.gm
    # the [B, L] keys (ids, attention mask, position ids): what masks are probed and length-guarded with
    mask_keys = [p for p in state.tree_inputs if example_value(p).dim() == 2]
    mask_nodes = masks_mod.mask_only_nodes(gm, [s.mask for s in state.attentions if isinstance(s.mask, fx.Node)])
    classified = mask_stage.classify_masks(state.attentions, mask_nodes, mask_keys, state.values,
                                           state.input_mask, set(state.outside))
    for info in classified.values():  # trainable ALiBi slopes: computed by the packed graph for tree attention
        if info.alibi_node is not None:
            mask_nodes -= set(probe.ancestors(info.alibi_node))
    keypads = {info.keypad for info in classified.values() if info.keypad is not None}
    if len(keypads) > 1:
        raise CannotReplay(Code.KEY_PADDING_INPUTS, "attentions use different key-padding inputs")
    sequences = mask_stage.sequences_input([s.node for s in state.attentions if not inputs.unmasked(s.node)],
                                           classified)
    state.masks = mask_stage.Masks(mask_keys, mask_nodes, classified, next(iter(keypads), None), sequences)


def token_axes(state: PipelineState) -> None:
    """The token-axis fact of every node, propagated by the per-op rules (passes/analysis/axes.py, passes/analysis/rules/): TOKEN
    (one value per position, computed once per tree node), DENSE, or refused. An SDPA whose token dims are its
    batch dims is a per-token op, not a tree attention, and leaves the attention list here."""
    masks = state.masks
    ctx = AxesContext(state.gm, state.B, state.L, state.tree_inputs, masks.nodes, training=state.config.training,
                      position_inputs=state.position_inputs, values=state.values,
                      sequences=masks.sequences is not None)
    for a, info in masks.meanings.items():  # each attention's mask meaning, read by the sdpa rule
        ctx.set_note(a, info)
    propagate(ctx)
    state.ctx = ctx
    state.attentions = [s for s in state.attentions if ctx.note(s.node, PerTokenAttention) is None]
    kept = {s.node for s in state.attentions}
    state.masks = dataclasses.replace(masks, meanings={a: i for a, i in masks.meanings.items() if a in kept})
    if masks.sequences is not None:
        mask_stage.check_column_free(state.gm, masks.nodes, masks.sequences)


def guards(state: PipelineState) -> None:
    """The per-call guards (passes/analysis/guards.py) of what was proven at the example values only: canonicalisation's
    scalars, the masks' classes and lengths, the scalars masks are computed from, the rules', the lowering's;
    and the :class:`~brcompile.passes.analysis.tree_inputs.Analysis` that the emitter reads."""
    if state.analysis is None:  # a graph without attention has its analysis from "tree inputs"
        masks = state.masks
        inside = [s for s in state.attentions if s.node not in state.outside]
        found = state.canon.guards + mask_stage.mask_guards(
            state.canon, state.attentions, masks.meanings, state.outside, state.input_mask,
            masks.sequences, masks.keys, state.placeholders, state.example_inputs)
        found += mask_stage.mask_scalar_guards(inside, state.placeholders, state.values)
        found += state.ctx.guards
        state.analysis = Analysis(state.gm, state.ctx, state.token_ids, state.tree_inputs, masks.keypad,
                                  [s.node for s in state.attentions], masks.meanings, state.placeholders, found,
                                  state.canon.notes, masks.sequences, state.input_mask)
    state.analysis.guards.extend(state.extra_guards)
    state.analysis.keys = state.keys


def liveness(state: PipelineState) -> None:
    """The live-position plan (passes/analysis/liveness.py): which positions an output needs, read per call from the
    loss weights, slices and key padding; None (every position kept) with ``config.liveness`` off."""
    an = state.analysis
    an.liveness = analyse_liveness(an, drop_padding=state.config.drop_padding) if state.config.liveness else None


def emit(state: PipelineState) -> None:
    """The packed graph (passes/emit/pack.py): TOKEN values once per tree node, fused log-probs
    (passes/emit/fuse_logprob.py); positions left out of the tree as the live-position plan allows, narrowed to
    prefix-only, then to none, when an op refuses them (:func:`build_with_liveness`)."""
    import brcompile.backends.attention.op  # noqa: F401  (registers the brcompile ops the packed graph calls)

    state.packed = build_with_liveness(state.analysis, state.config)


def check(state: PipelineState) -> None:
    """The packed graph can run where the inputs are: the attention and scan impls it needs exist and support
    its features on that device (a backward too, for a training graph); then it runs on the example batch
    (passes/emit/check.py), outputs matching the original's shapes."""
    inputs, config = state.example_inputs, state.config
    check_attention_support(state.packed, inputs, config.attention, training=config.training)
    check_scan_support(state.packed, inputs, config.scan)
    state.example_args = packed_example_args(state.analysis, inputs)
    check_packed_graph(state.packed, state.example_args)


def _analysed(state: PipelineState) -> bool:
    return state.analysis is not None


#: the pipeline, in order
STAGES: tuple[Stage, ...] = (
    Stage("lower", lower),
    Stage("functionalise", functionalise, rewrites=True),
    Stage("canonicalise attention", canonicalise_attention, rewrites=True),
    Stage("computed keys", computed_keys, rewrites=True),
    Stage("canonicalise scans", canonicalise_scans, rewrites=True),
    Stage("tree inputs", tree_inputs),
    Stage("masks", masks, skip=_analysed),
    Stage("token axes", token_axes, skip=_analysed),
    Stage("guards", guards),
    Stage("liveness", liveness),
    Stage("emit", emit),
    Stage("check", check),
)
#: the stages that analyse, without emitting (:func:`analyse`)
ANALYSIS_STAGES = STAGES[:[s.name for s in STAGES].index("guards") + 1]


def run_pipeline(gm: fx.GraphModule, example_inputs: Sequence[Any], config: PipelineConfig,
                 stages: Sequence[Stage] = STAGES, on_stage: Optional[Callable[[Stage, PipelineState], None]] = None
                 ) -> PipelineState:
    """Runs ``stages`` in order on ``gm`` read at ``config.level``; the final state (``state.packed``: the packed
    graph). Each stage is timed into ``state.times`` and logged; ``on_stage(stage, state)`` after each one
    that ran (dumps). CannotReplay / NothingToShare propagate to the caller, with ``state.times`` up to there
    in ``exc.stage_times`` and the stage's name in ``exc.stage``."""
    state = PipelineState(gm, example_inputs, config)
    for stage in stages:
        if stage.skip(state):
            continue
        start = time.perf_counter()
        try:
            stage.run(state)
        except Exception as e:
            state.times.append((stage.name, time.perf_counter() - start))
            if isinstance(e, CannotReplay):
                e.stage, e.stage_times = stage.name, tuple(state.times)
            log.debug("stage %s refused (%s level): %s", stage.name, config.level, e)
            raise
        state.times.append((stage.name, time.perf_counter() - start))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("stage %s (%s level): %.1f ms, %d nodes", stage.name, config.level,
                      1e3 * state.times[-1][1], len(state.gm.graph.nodes))
        if on_stage is not None:
            on_stage(stage, state)
    return state


def analyse(gm: fx.GraphModule, example_inputs: Sequence[Any], *, training: bool = True) -> Analysis:
    """The analysis stages only, on the Dynamo graph (no liveness, no emission): what they proved about
    ``gm``; CannotReplay with the reason. ``gm`` itself is not modified."""
    return run_pipeline(gm, example_inputs, PipelineConfig(training=training), ANALYSIS_STAGES).analysis


# --------------------------------------------------------------------------------------------------
# helpers of the stages


def _without_attention(state: PipelineState) -> Analysis:
    """The analysis of a graph without an SDPA: an attention inside a non-checkpoint body is refused by name; a
    graph with causal scans is analysed as a scan graph, one without as a token-local graph (or refused as an
    attention spelling the canonicaliser did not recognise)."""
    gm = state.gm
    hop = checkpoints.body_with_attention(gm, SDPA)
    if hop is not None:
        raise CannotReplay(Code.ATTENTION_IN_BODY, f"attention inside a {getattr(hop.target, '__name__', hop.target)} body (only "
                           f"activation-checkpoint bodies are analysed)", hop)
    scans = scan_rules.scan_candidates(gm)
    left = "".join(f"; {n}" for n in state.scan_notes if linear_scans.LEFT in n)  # scans not rewritten, named
    args = (gm, state.token_ids, state.placeholders, state.values, state.canon, state.config.training, left)
    if scans:
        return inputs.analyse_scans(gm, scans, *args[1:])
    unrecognised = eager_attention.unrecognised_attention(gm)
    if unrecognised is not None:
        raise CannotReplay(Code.UNRECOGNISED_ATTENTION, unrecognised[1], unrecognised[0])
    return inputs.analyse_token_local(*args)


def pack_options(config: PipelineConfig, drop: bool, within: bool = True) -> PackOptions:
    return PackOptions(attention=config.attention, fuse_logprob=config.fuse_logprob, drop_padding=drop,
                       drops_within_rows=within, scan=config.scan)


def build_with_liveness(an: Analysis, config: PipelineConfig) -> fx.GraphModule:
    """The packed graph, leaving out of the tree what ``an.liveness`` allows: with key-padded positions left out
    inside rows; if an op reads those (a scan along the positions, a dense region packed again), only the
    positions after each row's last needed one; if that is refused too, every position (``an.liveness`` None,
    the reason in ``an.liveness_note``, shown by explain())."""
    plan = an.liveness
    if plan is None:
        return build_packed_graph(an, pack_options(config, False))
    try:
        return build_packed_graph(an, pack_options(config, True, plan.keys_hidden))
    except CannotReplay as e:
        why = e
    if plan.keys_hidden:
        an.liveness = dataclasses.replace(plan, keys_hidden=False)
        try:
            packed = build_packed_graph(an, pack_options(config, True, False))
            log.info("branch_replay: key-padded positions kept in the tree: %s", why)
            an.liveness_note = f"key-padded positions kept in the tree: {why}"
            return packed
        except CannotReplay as e:
            why = e
    log.info("branch_replay: every position kept (no live-position plan for this graph): %s", why)
    an.liveness = None
    an.liveness_note = f"every position kept in the tree: {why}"
    return build_packed_graph(an, pack_options(config, False))


def _device_of(example_inputs) -> torch.device:
    return next((a.device for a in example_inputs if isinstance(a, torch.Tensor)), torch.device("cpu"))


def check_attention_support(packed: fx.GraphModule, example_inputs, attention: str, training: bool = False) -> None:
    """CannotReplay when the attention impl that will run on the inputs' device lacks a feature a packed
    attention needs (a sliding window, logit soft-capping, ALiBi, a relative bias), or, for a graph captured with
    grad enabled (``training``), a backward there (``attention="flex"`` on CPU): the original graph runs, with
    the reason. Attention sinks need no support: the op applies them around every impl."""
    from brcompile.backends.attention.features import needs_support
    from brcompile.backends.attention.op import AttentionImplError, attention_features, check_impl_supports, get_attention_impl

    device = _device_of(example_inputs)
    for n in packed.graph.nodes:
        if n.target is not torch.ops.brcompile.tree_attention_forward.default:
            continue
        features = attention_features(n.args)
        if not (needs_support(features) or training):
            continue
        try:
            check_impl_supports(get_attention_impl(attention, device), backward_device=device if training else None,
                                **features)
        except AttentionImplError as e:
            raise CannotReplay(Code.ATTENTION_IMPL, f"{e} (attention={attention!r} on {device.type})") from e


def check_scan_support(packed: fx.GraphModule, example_inputs, scan: str) -> None:
    """CannotReplay when the packed graph has a linear or matrix scan or a causal conv along the tree paths and
    the scan impl ``scan`` does not run on the inputs' device (``scan="triton"`` without triton or a GPU): the
    original graph runs, with the reason."""
    from brcompile.backends.scan.op import get_scan_impl
    from brcompile.backends.scan.paths import ScanError

    ops = (torch.ops.brcompile.tree_linear_scan.default, torch.ops.brcompile.tree_causal_conv1d.default,
           torch.ops.brcompile.tree_matrix_scan.default)
    if not any(n.target in ops for n in packed.graph.nodes):
        return
    device = _device_of(example_inputs)
    try:
        get_scan_impl(scan, device)
    except ScanError as e:
        raise CannotReplay(Code.SCAN_IMPL, f"{e} (scan={scan!r} on {device.type})") from e


def packed_example_args(an: Analysis, example_inputs) -> list:
    """The packed graph's inputs for the example batch: its inputs (SymInts as their hints), then the tree
    arrays of its tree (O(B·L), ``PackedTree.graph_args``)."""
    from brcompile.runtime.tree import build_tree

    args = [hint(a) for a in example_inputs]
    tree = build_tree(an.tree_keys(args), attention_mask=an.key_padding(args))
    return [*args, *tree.graph_args()]
