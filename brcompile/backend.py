"""The ``branch_replay`` torch.compile backend: analyse -> rewrite -> runtime callable.

``torch.compile(fn, backend="branch_replay")`` (entry point) or ``torch.compile(fn,
backend=brcompile.backend(min_dedup=1.2))``. Every captured graph gets a frozen :class:`GraphRecord`
(rewritten or not, why not, the packed graph's code, materialisations); ``brcompile.tools.explain`` reads them.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from brcompile import runtime
from brcompile.passes.refusals import CannotReplay, Code, NothingToShare
from brcompile.passes.pipeline import PipelineConfig, run_pipeline
from brcompile.runtime.tree import GRAPH_ARGS
from brcompile.passes.meta import FUSED, FUSED_COVERS, ROWS, SEQUENCES, TOKEN_OUTPUTS, WRITTEN_INPUTS

log = logging.getLogger(__name__)


COMPILERS = ("inductor", "aot_eager", "eager")
ATTENTIONS = ("auto", "cpu", "reference", "triton", "flex")
MODES = ("packed", "replay", "auto")
LEVELS = ("auto", "dynamo", "aten")
STRICT_ENV = "BRCOMPILE_STRICT"
LEVEL_ENV = "BRCOMPILE_LEVEL"


def strict_default() -> bool:
    """``Options.strict``'s default: True iff the environment variable BRCOMPILE_STRICT is set to 1 / true /
    yes / on when the options are made (the test suite sets it in tests/conftest.py)."""
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def level_default() -> str:
    """``Options.level``'s default: the environment variable BRCOMPILE_LEVEL when set (``aten`` runs every
    graph at the ATen level: a parity run of a test suite), else "auto"."""
    return os.environ.get(LEVEL_ENV, "").strip().lower() or "auto"


class Compiled:
    """``torch.compile(gm, backend=compiler, dynamic=True)``, made at the graph's first call.

    Why at the first call: this backend builds its graphs while Dynamo converts the user's frame, and Dynamo
    marks the code of every FX graph generated during a conversion as code never to compile (its guard against
    compiling its own output; ``torch._dynamo.convert_frame`` patches ``torch.fx.graph_module._forward_from_src``
    for the conversion). ``torch.compile`` of such a graph runs it uncompiled, silently. So the first call
    regenerates the graph's code (``gm.recompile()``) — by then the conversion is over and the new code is
    compiled like any other — and compiles it; later calls go straight to the compiled module.

    The compiled graph has torch.compile's AOTAutograd semantics, as a dense ``torch.compile`` of the model
    does: e.g. a first backward with ``retain_graph=True`` raises unless
    ``torch._functorch.config.donated_buffer`` is False (``compiler="eager"`` has no such limit)."""

    def __init__(self, gm: fx.GraphModule, compiler: str):
        self.gm, self.compiler = gm, compiler
        self.fn: Optional[Any] = None

    def __call__(self, *args):
        if self.fn is None:
            self.gm.recompile()
            self.fn = torch.compile(self.gm, backend=self.compiler, dynamic=True)
        return self.fn(*args)


@dataclasses.dataclass(frozen=True)
class Options:
    """Backend options (``torch.compile(..., options={...})`` or ``brcompile.backend(**options)``).

    min_dedup: run the original graph for a batch whose logical/executed token ratio is below this.
    attention: tree-attention implementation: "auto" (triton on CUDA, cpu otherwise), "cpu",
        "reference", "triton", "flex" (torch's FlexAttention, backends/attention/flex.py: CUDA forward and backward; on
        CPU forward only, so a CPU graph captured with grad enabled is refused and runs as captured).
    scan: implementation of the scans along the tree paths (``brcompile::tree_linear_scan``, Mamba's
        selective scan, ``tree_causal_conv1d``, its short conv, and ``tree_matrix_scan``, the gated delta
        rule): "auto" (triton on CUDA, torch
        otherwise), "torch" (pointer doubling and gathers, any device), "triton" (backends/scan/triton.py).
    compiler: how the packed graph runs: "inductor" (compiled once with dynamic shapes: one compile
        serves every batch), "aot_eager" (AOTAutograd, no codegen), or "eager" (the FX graph as is).
    fuse_logprob: compute next-token log-probs (log_softmax -> gather, cross_entropy, and the entropy)
        straight from the packed hidden states with brcompile::packed_logprob, never building [N, V]
        logits (passes/emit/fuse_logprob.py).
    dump_dir: when set, write every captured graph there, before and after the rewrite, as readable
        Python and Graphviz .dot (+ .svg when ``dot`` is installed); see brcompile/tools/dump.py.
    mode: "packed" (every packed token's activations live at once), "replay" (streaming replay,
        docs/ARCHITECTURE.md §7: the shared prefix once, then the tails in chunks of at most ``chunk_tokens`` tokens; peak
        activation memory is the prefix's plus one chunk's, independent of the group size), or "auto"
        (replay for a batch whose packed activations are estimated above ``memory_budget``).
    memory_budget: bytes of activations "auto" allows the packed mode (required for "auto").
    chunk_tokens: most tail tokens per replay chunk (a single longer leaf chain is a chunk of its own).
    liveness: leave the positions no output of the graph needs out of the tree (docs/ARCHITECTURE.md §3.8):
        a position whose loss weight is 0 (a per-call mask multiplies it, a ``where`` replaces it, a slice
        drops it) and that no live query attends is computed by nobody. The loss and every gradient equal
        the dense run's whenever the dense values at those positions are finite.
    drop_padding: for a graph that returns per-token values (a model compiled without its loss), the
        positions whose attention-mask bit is 0 are not needed (docs/ARCHITECTURE.md §4): outputs there are
        zeros, and a gradient reaching one raises DroppedPositionGradError (the loss read padding it should
        mask); ``drop_padding=False`` computes them as the dense run does.
    strict: re-raise an internal error (any exception other than CannotReplay) of the analysis, the
        rewrite or the streaming split instead of running the original graph (or the packed mode) with
        the reason "internal error: ...". CannotReplay, a typed refusal, still falls back. Default False,
        or True when the environment variable BRCOMPILE_STRICT=1 is set (the test suite runs strict).
    verify: on the first call of each rewritten graph that would replay, also run the original graph
        (forward, no grad, same RNG state) and compare every output within the dtype's bound (float64
        1e-10, float32 1e-5, bfloat16 2e-2, float16 2e-3 relative); if they differ, that call and every
        later call of the graph run the original, with both values in the reason. Costs one extra
        forward of each graph, once. Forward values only: gradients are not compared.
    level: which form of the captured graph the analysis reads (docs/ARCHITECTURE.md §3.0): "dynamo" (the
        graph as Dynamo recorded it, the ops the model wrote), "aten" (its functional pre-dispatch ATen graph:
        every in-place op and write into a view made out of place, every spelling one ATen op family;
        passes/lower/aten.py), or "auto" (the Dynamo graph, and its ATen graph when the Dynamo graph is refused).
        Default "auto", or the environment variable BRCOMPILE_LEVEL.
    context_parallel: a ``torch.distributed`` ProcessGroup, a 1-D DeviceMesh or ``(DeviceMesh, dim)``: every rank of
        the group calls the compiled function with the same batch, and each runs the token-local part of the graph
        on its own contiguous piece of the packed tokens (docs/ARCHITECTURE.md §7.2). The loss is the same on every
        rank; each rank's parameter gradients are partial sums, and ``all_reduce(SUM)`` over the group gives the
        single-process gradient (FSDP2 over a mesh whose shard dimension spans the group does that sum, given
        ``set_gradient_divide_factor(dp)``: examples/context_parallel.py). A graph or call that cannot be split runs
        whole on every rank with its gradient counted once (rank 0's), so the same sum is exact; a split call's
        activation inputs (values computed before the graph) get their gradient summed on rank 0.
    """

    min_dedup: float = 1.05
    attention: str = "auto"
    scan: str = "auto"
    compiler: str = "inductor"
    fuse_logprob: bool = True
    dump_dir: Optional[str] = None
    liveness: bool = True
    drop_padding: bool = True
    mode: str = "packed"
    memory_budget: Optional[int] = None
    chunk_tokens: int = 2048
    strict: bool = dataclasses.field(default_factory=strict_default)
    verify: bool = False
    level: str = dataclasses.field(default_factory=level_default)
    context_parallel: Any = None

    def __post_init__(self):
        if self.context_parallel is not None:  # held by the group's name (a ProcessGroup is not copied)
            from brcompile.runtime.context_parallel import group_name

            object.__setattr__(self, "context_parallel", group_name(self.context_parallel))
        if self.compiler not in COMPILERS:
            raise ValueError(f"compiler={self.compiler!r}; choose one of {COMPILERS}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention={self.attention!r}; choose {', '.join(ATTENTIONS[:-1])} or {ATTENTIONS[-1]}")
        if self.scan not in ("auto", "torch", "triton"):
            raise ValueError(f"scan={self.scan!r}; choose auto, torch or triton")
        if self.level not in LEVELS:
            raise ValueError(f"level={self.level!r}; choose one of {LEVELS}")
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}; choose one of {MODES}")
        if self.mode == "auto" and (self.memory_budget is None or self.memory_budget <= 0):
            raise ValueError("mode='auto' needs memory_budget=<bytes of activations the packed mode may use>")
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={self.chunk_tokens} must be >= 1")
        if not self.min_dedup >= 1.0:
            raise ValueError(f"min_dedup={self.min_dedup} must be >= 1")

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "Options":
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise TypeError(f"unknown branch_replay option(s) {sorted(unknown)}; known: {sorted(names)}")
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class GraphRecord:
    """What the backend did with one captured graph."""

    graph_id: int
    rewritten: bool
    reason: Optional[str]
    failed_node: Optional[str]
    original_code: str
    packed_code: Optional[str]
    tree_inputs: tuple[str, ...] = ()
    #: ``name = what`` of each tree key the graph computes from its inputs, evaluated per call
    #: (passes/canonical/keys.py: CPM-Ant's prompt joined to the ids); () when every key is an input
    computed_keys: tuple[str, ...] = ()
    masks: tuple[str, ...] = ()
    materialisations: tuple[tuple[str, str, int, str], ...] = ()  # (node, user, numel, reason)
    lazy_gathers: tuple[str, ...] = ()
    fused: tuple[str, ...] = ()  # one line per fused log-prob read-out (brcompile::packed_logprob)
    repacked: tuple = ()  # dense causal regions packed again (passes/analysis/repack.py: Repacked)
    not_repacked: tuple[tuple[str, str], ...] = ()  # (dense value, why it stays dense)
    replay: Optional[dict] = None  # streaming split (mode replay/auto): trunk, frontier, cached K/V
    replay_reason: Optional[str] = None  # why the streaming split was refused (packed mode is used)
    level: Optional[str] = None  # the level whose graph was rewritten ("dynamo" or "aten"; Options.level)
    refusals: tuple[tuple[str, str], ...] = ()  # (level, reason) of each level tried and refused
    unshared: bool = False  # not rewritten because it has nothing to share (passes/refusals.py: NothingToShare)
    liveness: Optional[str] = None  # what decides the live positions (passes/analysis/liveness.py); None: all kept
    routed: Optional[dict] = None  # routed pairs (passes/emit/routed.py): experts after a routing graph break
    # the refusal codes (passes/refusals.py) of ``reason``, of ``replay_reason`` and of each of ``refusals``
    code: Optional[Code] = None
    replay_code: Optional[Code] = None
    refusal_codes: tuple[Code, ...] = ()
    #: (level, stage, seconds) of every pipeline stage run on this graph (passes/pipeline.py: STAGES), in order
    stage_times: tuple[tuple[str, str, float], ...] = ()
    runtime: Any = dataclasses.field(default=None, compare=False, repr=False)


def _trunk_key(split) -> Optional[str]:
    """The cross-call window key of a streaming split (runtime/window/): a hash of its trunk graphs' code, so
    copies of one graph that Dynamo recompiled on a guard (DDP's no_sync flag, a batch size) share one store."""
    if split.tail_cache is None:
        return None
    import hashlib

    attrs = sorted({a for e in split.ext_sources for a in e.attrs})  # the graph's own tensors: by identity
    code = "\0".join((split.prefix.code, split.tail.code, split.tail_cache.code, repr(split.ext_inputs),
                      repr([(a, id(split.outer_attrs.get(a))) for a in attrs])))
    return hashlib.sha256(code.encode()).hexdigest()


def _window_inputs(split, per_token: Sequence[int]) -> tuple[tuple[int, ...], Optional[str]]:
    """(the graph inputs a cross-call window compares call to call, why the trunk cannot share across calls or
    None). A token replayed from an earlier call is what that call's trunk computed: the trunk's inputs other
    than the per-token ones (matched by key) must be the same — parameters, buffers and tables by identity and
    version, numbers by value (runtime/window/ ``call_identity``). A trunk input computed from a statistic of
    the batch (a length, a sum over tokens) differs from call to call: such a trunk shares within each call."""
    if split.tail_cache is None:
        return (), "shares within each call: a cached value (scan state, position) has no single token dim"
    batch = next((e for e in split.ext_sources if e.batch_node is not None), None)
    if batch is not None:
        return (), (f"shares within each call: the trunk reads {batch.name}, computed from the batch through "
                    f"{batch.batch_node} (a statistic of the call, not of each token's keys)")
    keyed = set(per_token)
    return tuple(sorted({i for e in split.ext_sources for i in e.inputs if i not in keyed})), None


def _per_token(packed: fx.GraphModule, tree_positions: Sequence[int], n_inputs: Optional[int]) -> list[int]:
    """The packed graph's per-token inputs, matched by key across calls: the tree inputs, the computed keys, the
    tree's [B, L] index."""
    n_holders = sum(1 for n in packed.graph.nodes if n.op == "placeholder")
    first_tree = n_holders - len(GRAPH_ARGS)  # computed tree keys sit between the inputs and the tree arrays
    return sorted({*tree_positions, *range(first_tree if n_inputs is None else n_inputs, first_tree), first_tree})


def _plan(an, packed: fx.GraphModule, original, run_packed, streaming, opts: Options,
          cp=None) -> runtime.ReplayPlan:
    """The frozen plan a rewritten graph runs by: what the runtime needs from the analysis ``an``
    (passes/analysis/tree_inputs.py), the packed graph's facts for the runtime (passes/meta.py) and the options,
    read here once, so the runtime holds neither the analysis nor an FX graph."""
    return runtime.ReplayPlan(
        original=original, packed=run_packed, eager_packed=packed.forward,
        tree_positions=tuple(an.tree_input_positions),
        key_padding=an.key_padding if an.keypad is not None else None,
        guards=tuple(an.guards), liveness=an.liveness, keys=an.keys,
        token_outputs=tuple(TOKEN_OUTPUTS.get(packed)), sequences=SEQUENCES.get(packed), rows=bool(ROWS.get(packed)),
        written=tuple(WRITTEN_INPUTS.get(packed)), streaming=streaming, context_parallel=cp,
        min_dedup=opts.min_dedup, strict=opts.strict, verify=opts.verify)


class BranchReplayBackend:
    """A torch.compile backend object that keeps a record per captured graph."""

    def __init__(self, **options):
        self.options = Options.from_dict(options)
        self.records: list[GraphRecord] = []

    def __call__(self, gm: fx.GraphModule, example_inputs, options: Optional[dict] = None):
        opts = self.options
        if options:
            opts = Options.from_dict({**dataclasses.asdict(self.options), **options})
        import brcompile.backends.attention.op  # noqa: F401  (registers brcompile::tree_attention)

        gid = len(self.records)
        original = gm.forward
        refusals: list[tuple[str, str, Optional[str], Code]] = []  # (level, reason, node, code)
        read: dict[str, fx.GraphModule] = {}  # level -> the graph the analysis read there (a refusal's node is in it)
        times: list[tuple[str, str, float]] = []  # (level, stage, seconds)
        for level in _LEVEL_ORDER[opts.level]:
            try:
                an, packed, example_args = self._rewrite(gm, example_inputs, opts, level, read, times)
                break
            except NothingToShare as e:  # no per-token work at any level: the graph runs as it is, not a fallback
                refusals.append((level, str(e), e.node_name, e.code))
                return self._fallback(gid, gm, e.code, str(e), e.node_name, opts, refusals, unshared=True,
                                      dumped=read.get(level, gm), times=times)
            except CannotReplay as e:
                refusals.append((level, str(e), e.node_name, e.code))
            except Exception as e:  # a bug in a pass must never produce a wrong number: run the original
                if opts.strict:
                    raise
                log.warning("branch_replay: internal error while rewriting graph %d (%s level); running it "
                            "unchanged", gid, level, exc_info=True)
                refusals.append((level, f"internal error: {type(e).__name__}: {e}", None, Code.INTERNAL_ERROR))
            if level == "dynamo" and len(_LEVEL_ORDER[opts.level]) > 1:
                log.info("branch_replay: graph %d refused at the Dynamo level [%s] (%s); trying its ATen graph",
                         gid, refusals[-1][3], refusals[-1][1])
        else:
            routed = self._routed(gid, gm, example_inputs, opts, refusals)
            if routed is not None:
                return routed
            level, reason, node, code = refusals[0]
            return self._fallback(gid, gm, code, reason, node, opts, refusals, dumped=read.get(level, gm), times=times)
        run_packed = self._compile(packed, opts)
        streaming, replay_info, replay_reason, replay_code = None, None, None, None
        cp = None
        if opts.context_parallel is not None:  # takes the place of streaming (a window does not compose with it yet)
            cp, replay_info, replay_reason, replay_code = self._context_parallel(
                gid, packed, example_args, opts, an.tree_input_positions, len(an.placeholders))
        elif opts.mode != "packed":
            try:
                streaming, replay_info = self._streaming(packed, example_args, opts, an.tree_input_positions,
                                                         len(an.placeholders))
            except CannotReplay as e:
                replay_reason, replay_code = str(e), e.code
            except Exception as e:  # never worse than the packed mode
                if opts.strict:
                    raise
                log.warning("branch_replay: internal error in the streaming split of graph %d", gid, exc_info=True)
                replay_reason, replay_code = f"internal error: {type(e).__name__}: {e}", Code.INTERNAL_ERROR
            if replay_reason is not None:
                log.info("branch_replay: graph %d runs packed only [%s]: %s", gid, replay_code, replay_reason)
        rt = runtime.PackedRuntime(_plan(an, packed, original, run_packed, streaming, opts, cp))
        fused_nodes = [n for n in packed.graph.nodes if FUSED.has(n)]
        covered = {name for n in fused_nodes for name in FUSED_COVERS.get(n, ())}
        rec = GraphRecord(
            gid, True, None, None, gm.code, packed.code,
            tree_inputs=tuple(p.name for p in an.tree_inputs),
            computed_keys=() if an.keys is None else tuple(f"{n} = {w}"
                                                           for n, w in zip(an.keys.names, an.keys.sources)),
            masks=tuple(f"{a.name}: {info}" for a, info in an.masks.items()),
            materialisations=tuple((m.node.name, m.user.name, m.numel, m.reason)
                                   for m in an.materialisations if m.node.name not in covered),
            lazy_gathers=tuple(n.name for n in an.lazy_gathers if n.name not in covered),
            fused=tuple(FUSED.require(n) for n in fused_nodes),
            repacked=tuple(an.ctx.repacked),
            not_repacked=tuple((n.name, why) for n, why in an.ctx.repack_refused.items()),
            replay=replay_info,
            replay_reason=replay_reason,
            replay_code=replay_code,
            liveness="; ".join(x for x in (None if an.liveness is None else an.liveness.describe(),
                                           an.liveness_note) if x) or None,
            level=level,
            **_refusal_fields(refusals),
            stage_times=tuple(times),
            runtime=rt,
        )
        self.records.append(rec)
        runtime.record_graph(True)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("branch_replay graph %d before:\n%s", gid, gm.code)
            log.debug("branch_replay graph %d after:\n%s", gid, packed.code)
        self._dump(opts, an.gm, packed)  # an.gm: the analysed (canonical) copy, with the token facts
        return rt

    def _routed(self, gid: int, gm: fx.GraphModule, example_inputs, opts: Options, refusals: list):
        """A graph of routed pairs (passes/emit/routed.py: experts after a routing graph break) refused by the
        token-axis analysis: its :class:`~brcompile.runtime.routed.RoutedRuntime`, or None (the graph has no
        such gather, or the routed analysis refused: its reason goes first in ``refusals``)."""
        from brcompile.passes.emit.routed import analyse_routed, find_routed_gather
        from brcompile.runtime.routed import RoutedRuntime

        gather = find_routed_gather(gm)
        if gather is None:
            return None
        try:
            plan = analyse_routed(gm, example_inputs, gather)
        except CannotReplay as e:
            refusals.insert(0, ("dynamo", str(e), e.node_name, e.code))
            return None
        except Exception as e:
            if opts.strict:
                raise
            log.warning("branch_replay: internal error in the routed-pairs rewrite of graph %d", gid, exc_info=True)
            refusals.insert(0, ("dynamo", f"internal error: {type(e).__name__}: {e}", None, Code.INTERNAL_ERROR))
            return None
        rt = RoutedRuntime(gm.forward, plan, strict=opts.strict)
        self.records.append(GraphRecord(gid, True, None, None, gm.code, plan.gm.code, level="dynamo",
                                        **_refusal_fields(refusals), routed=plan.describe(), runtime=rt))
        runtime.record_graph(True)
        log.info("branch_replay: graph %d runs routed pairs (%d experts, %d pairs at capture)", gid,
                 len(plan.sizes), sum(plan.sizes))
        self._dump(opts, gm, plan.gm)
        return _whole_on_every_rank(rt, opts, "routed pairs run whole on every rank")

    @staticmethod
    def _rewrite(gm: fx.GraphModule, example_inputs, opts: Options, level: str, read: Optional[dict] = None,
                 times: Optional[list] = None):
        """(analysis, packed graph, its example inputs) of ``gm`` read at ``level`` through the pipeline
        (passes/pipeline.py: STAGES); CannotReplay when a stage refuses. ``read[level]``: the graph the
        analysis read there, once the lowering made it; ``times``: (level, stage, seconds) appended per stage."""
        config = PipelineConfig(level=level, training=torch.is_grad_enabled(), liveness=opts.liveness,
                                drop_padding=opts.drop_padding, attention=opts.attention, scan=opts.scan,
                                fuse_logprob=opts.fuse_logprob)

        def on_stage(stage, state):
            if stage.name == "lower" and read is not None:
                read[level] = state.gm
            if opts.dump_dir and stage.rewrites:
                _dump_stage(opts.dump_dir, level, stage, state.gm)

        try:
            state = run_pipeline(gm, example_inputs, config, on_stage=on_stage)
        except CannotReplay as e:
            if times is not None:
                times.extend((level, s, t) for s, t in getattr(e, "stage_times", ()))
            raise
        if times is not None:
            times.extend((level, s, t) for s, t in state.times)
        return state.analysis, state.packed, state.example_args

    @staticmethod
    def _compile(gm: fx.GraphModule, opts: Options):
        """The packed (or a replay) graph as it will run: compiled once with dynamic shapes (:class:`Compiled`)."""
        return gm.forward if opts.compiler == "eager" else Compiled(gm, opts.compiler)

    def _context_parallel(self, gid: int, packed: fx.GraphModule, example_args, opts: Options,
                          tree_positions: Sequence[int], n_inputs: int):
        """(ContextParallel, explain dict, refusal reason, refusal code) for ``context_parallel=group``
        (brcompile/runtime/context_parallel.py): the streaming split's trunk on one rank's piece of the tokens, or,
        refused, a ContextParallel that runs every call whole on every rank (counted once)."""
        from brcompile.backends.attention import cached  # noqa: F401  (registers tree_attention_cached_forward)
        from brcompile.passes.emit.split import split_for_replay
        from brcompile.runtime.context_parallel import ContextParallel, ContextParallelTrunk

        group = opts.context_parallel
        try:
            split = split_for_replay(packed, example_args, _per_token(packed, tree_positions, n_inputs), group)
        except CannotReplay as e:
            refusal = CannotReplay(Code.CP_SPLIT, f"context parallelism: no token-local trunk to split: {e}", e.node)
        else:
            refusal = split.cp_refusal
        if refusal is not None:
            log.info("branch_replay: graph %d runs whole on every rank [%s]: %s", gid, refusal.code, refusal)
            return ContextParallel(group, None, None, str(refusal)), None, str(refusal), refusal.code
        dims = tuple(d for _, d in split.frontier)
        trunk = ContextParallelTrunk(self._compile(split.cp, opts), len(split.ext_inputs), dims, group,
                                     split.work_alpha, split.kv_bytes_per_token, split.recompute)
        outer = split.build_outer(trunk)
        info = dict(context_parallel=group, trunk_nodes=split.trunk_nodes, ext_inputs=split.ext_inputs,
                    frontier=tuple(f"{n} (token dim {d})" for n, d in split.frontier), cached=split.cached,
                    work_alpha=round(split.work_alpha, 1), kv_bytes_per_token=split.kv_bytes_per_token,
                    cp_code=split.cp.code, outer_code=outer.code)
        return ContextParallel(group, self._compile(outer, opts), trunk), info, None, None

    def _streaming(self, packed: fx.GraphModule, example_args, opts: Options, tree_positions: Sequence[int] = (),
                   n_inputs: Optional[int] = None):
        """(runtime.StreamingRuntime, explain dict) for mode replay/auto; raises CannotReplay (passes/emit/split.py).
        ``example_args``: the packed graph's inputs for the example batch (passes/pipeline.py: packed_example_args)."""
        from brcompile.backends.attention import cached  # noqa: F401  (registers tree_attention_cached_forward)
        from brcompile.passes.emit.split import split_for_replay
        from brcompile.runtime.streaming import ReplayTrunk, TrunkGraphs

        per_token = _per_token(packed, tree_positions, n_inputs)
        split = split_for_replay(packed, example_args, per_token)
        window_inputs, window_refusal = _window_inputs(split, per_token)
        graphs = TrunkGraphs(self._compile(split.prefix, opts), self._compile(split.tail, opts),
                             tuple(d for _, d in split.frontier),
                             2 * len(split.cached) + len(split.cached_scans) + len(split.cached_positions),
                             split.scan_depth,
                             None if split.tail_cache is None else self._compile(split.tail_cache, opts),
                             _trunk_key(split), split.recompute, split.bytes_per_token, split.cache_dims)
        trunk = ReplayTrunk(graphs, len(split.ext_inputs), opts.chunk_tokens)
        outer = split.build_outer(trunk)
        streaming = runtime.StreamingRuntime(opts.mode, opts.memory_budget, split.bytes_per_token,
                                             self._compile(outer, opts), trunk, window_inputs, window_refusal)
        info = dict(trunk_nodes=split.trunk_nodes, ext_inputs=split.ext_inputs,
                    frontier=tuple(f"{n} (token dim {d})" for n, d in split.frontier), cached=split.cached,
                    cached_scans=split.cached_scans, cached_positions=split.cached_positions,
                    bytes_per_token=split.bytes_per_token, chunk_tokens=opts.chunk_tokens,
                    window=window_refusal or "shares across calls",
                    memory_budget=opts.memory_budget, mode=opts.mode,
                    recompute="the model's activation checkpoints: the kept prefix (a window's pieces) keeps its "
                              "inputs and outputs and recomputes its activations in backward" if split.recompute
                    else None,
                    prefix_code=split.prefix.code, tail_code=split.tail.code, outer_code=outer.code)
        return streaming, info

    def _fallback(self, gid: int, gm: fx.GraphModule, code: Code, reason: str, node: Optional[str],
                  opts: Optional[Options] = None, refusals: Sequence[tuple] = (), unshared: bool = False,
                  dumped: Optional[fx.GraphModule] = None, times: Sequence = ()):
        """Runs ``gm`` as captured, with the refusal (``code``, ``reason``); ``refusals``: (level, reason, node,
        code) of each level tried. The dump draws ``dumped`` (the graph the refusing level read, where ``node``
        is: the ATen graph for an ATen-level refusal), gm by default."""
        rt = runtime.FallbackRuntime(gm.forward, code, reason, unshared=unshared)
        self.records.append(GraphRecord(gid, False, reason, node, gm.code, None, unshared=unshared, code=code,
                                        **_refusal_fields(refusals), stage_times=tuple(times), runtime=rt))
        runtime.record_graph(False, reason, code)
        self._dump(opts or self.options, gm if dumped is None else dumped, None, reason, node)
        return _whole_on_every_rank(rt, opts or self.options, reason)

    @staticmethod
    def _dump(opts: Options, gm: fx.GraphModule, packed: Optional[fx.GraphModule], reason: Optional[str] = None,
              node: Optional[str] = None) -> None:
        """Writes the graph files when ``opts.dump_dir`` is set; a failed dump is logged, never raised."""
        if not opts.dump_dir:
            return
        from brcompile.tools.dump import dump_graphs

        try:
            dump_graphs(opts.dump_dir, gm, packed, reason=reason, failed_node=node)
        except Exception:  # a diagnostic must never break compilation
            log.warning("branch_replay: writing graph dumps to %s failed", opts.dump_dir, exc_info=True)


def _whole_on_every_rank(rt, opts: Options, reason: str):
    """``rt`` as it runs under ``context_parallel``: whole on every rank, its gradient counted once; ``rt`` itself
    without it."""
    if opts.context_parallel is None:
        return rt
    from brcompile.runtime.context_parallel import WholeOnEveryRank

    return WholeOnEveryRank(rt, opts.context_parallel, reason)


def _refusal_fields(refusals: Sequence[tuple]) -> dict:
    """A record's ``refusals`` ((level, reason) each) and ``refusal_codes`` from the backend's (level, reason, node,
    code) tuples of the levels tried."""
    return dict(refusals=tuple((lv, r) for lv, r, _, _ in refusals), refusal_codes=tuple(c for *_, c in refusals))


def _dump_stage(dump_dir: str, level: str, stage, gm: fx.GraphModule) -> None:
    """Writes the graph as ``stage`` left it (brcompile/tools/dump.py: dump_stage); a failed dump is logged."""
    from brcompile.passes.pipeline import STAGES
    from brcompile.tools.dump import dump_stage

    try:
        dump_stage(dump_dir, level, STAGES.index(stage), stage.name, gm)
    except Exception:  # a diagnostic must never break compilation
        log.warning("branch_replay: writing the %s stage's graph to %s failed", stage.name, dump_dir, exc_info=True)


#: the levels Options.level tries, in order (the first that is not refused is rewritten)
_LEVEL_ORDER = {"auto": ("dynamo", "aten"), "dynamo": ("dynamo",), "aten": ("aten",)}

_DEFAULT = BranchReplayBackend()


def branch_replay(gm: fx.GraphModule, example_inputs, options: Optional[dict] = None):
    """The entry-point backend (``backend="branch_replay"``); records go to the default backend."""
    return _DEFAULT(gm, example_inputs, options)


def backend(**options) -> BranchReplayBackend:
    """A backend object with options: ``torch.compile(fn, backend=brcompile.backend(min_dedup=1.5))``."""
    return BranchReplayBackend(**options)


def default_backend() -> BranchReplayBackend:
    return _DEFAULT
