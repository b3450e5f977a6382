"""Streaming replay, the graph side (docs/ARCHITECTURE.md §7): split a packed graph into trunk (prefix / tail) + outer.

The packed graph (passes/emit/pack.py) computes every TOKEN value on the N packed tokens, then reads them
densely through ``tree_index`` (materialize, the lazy gather, the fused log-prob). The **trunk** is the
token-local part between the two:

    trunk = descendants of the per-token tree arrays (rep_row, position, end, valid, all_valid, segments)
            that do not depend on tree_index

Every trunk value carries the token dim N exactly once (checked on a fake-tensor run with a symbolic N; a
token dim flattened with k entries per token, ``k·N``, counts as one: the analysis's flattened layout,
passes/analysis/axes.py ``TokenAxes.flat``, entry ``n·k + s`` of token n — a gated norm's ``reshape(-1, D)`` of its
heads —; the outer graph reads no such value), and the only ops that mix tokens are tree attention and the
scans along the tree paths (backends/scan/op.py: ``TREE_PATH_OPS``, backends/scan/matrix.py:
``MATRIX_PATH_OPS``), both reading a token's ancestors only; so the trunk can run on any token subset whose
ancestors it can see. :func:`split_for_replay` emits three graphs:

- **prefix**: the trunk on the prefix tokens; outputs the frontier (trunk values the outer graph reads),
  per attention its K and V, and per scan what a tail token reads of its ancestors (a linear or matrix
  scan's state h, a cumsum's path sum — the scan's output, read at the parent —, a causal conv1d's input
  x, read at the last W-1 ancestors): the **cached replay nodes**. None costs memory: each is kept for the
  prefix's own backward anyway;
- **tail**: the trunk on one chunk of tail tokens; each ``tree_attention_forward`` becomes
  ``tree_attention_cached_forward`` that also attends the cached K/V (backends/attention/cached.py); each scan runs
  on the chunk's own paths (``tree_parent`` of the chunk's ``end``) plus the cached values gathered at the
  chunk tokens' prefix ancestors (``cache_ancestors``: ``Chunk.ancestors``, brcompile/runtime/streaming.py),
  by ``tree_linear_scan_cached`` / ``tree_cumsum_cached`` / ``tree_causal_conv1d_cached`` (backends/scan/op.py)
  and ``tree_matrix_scan_cached`` (backends/scan/matrix.py, the gated delta rule's state):
  ordinary differentiable ops around the scan, so the cached values' gradients flow back into the prefix
  as the cached K/V's do. A chunk is made of leaf segments, whose ancestors outside the chunk are all
  prefix tokens (never another chunk's);
- **tail_cache**: the tail that also returns its own tokens' cached replay nodes (what the prefix returns, each
  along its token dim, ``cache_dims``): a cross-call window (brcompile/runtime/window/) keeps them per token
  and runs a later call's new tokens as a chunk against them;
- **outer**: the packed graph with the trunk replaced by one call of ``replay_trunk``, which returns the
  frontier at all N tokens; :meth:`ReplaySplit.build_outer` makes it a module around the trunk the backend built
  from the compiled prefix and tail (brcompile.runtime.streaming.ReplayTrunk).

The trunk graphs also compute what the trunk reads of the parameters through ops of their own (a conv weight's
``unsqueeze``, Mamba's ``-exp(A_log)``: :func:`_parameter_side`), so their inputs are the parameters themselves.

Nothing here changes what is computed: the outer graph sees the same frontier values, the trunk the same
per-token inputs, attention the same keys.
"""
from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any, Optional, Sequence

import sympy
import torch
import torch.fx as fx

from brcompile.backends.attention.features import (
    CACHE_POSITION, CACHED_BLOCKS, CACHED_FEATURES, FORWARD_FEATURES_AT, feature_tail,
)
from brcompile.backends.attention.op import attention_features
from brcompile.backends.gather_tokens import op as _gather_tokens_op  # noqa: F401  (registers exchange_tokens)
from brcompile.backends.scan.matrix import MATRIX_PATH_OPS, tree_matrix_scan_cached
from brcompile.backends.scan.op import (
    TREE_PATH_OPS, tree_causal_conv1d_cached, tree_cumsum_cached, tree_linear_scan_cached,
)
from brcompile.passes.analysis.repack import repack_tokens
from brcompile.passes.spellings import AUTOCAST_REGION, GROUP_COUNT_STEPS, MATMUL_NAMES, family_of, op_name, random_draw
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.passes.emit.check import symbolic_run, token_positions
from brcompile.passes.lower.checkpoint import inline_checkpoints, is_checkpoint
from brcompile.passes.analysis.masks import descendants
from brcompile.passes.meta import WRITTEN_INPUTS
from brcompile.runtime.tree import TOKEN_ARRAYS, tree_placeholders

log = logging.getLogger(__name__)

__all__ = ["ExtSource", "ReplaySplit", "ext_sources", "split_for_replay"]

#: Per-token tree arrays of the packed graph that the trunk reads (in the trunk graphs' order).
_ATTENTION = torch.ops.brcompile.tree_attention_forward.default
_CONV = torch.ops.brcompile.tree_causal_conv1d.default
_LINEAR_SCAN = torch.ops.brcompile.tree_linear_scan.default
_MATRIX_SCAN = torch.ops.brcompile.tree_matrix_scan.default
_PARENT = torch.ops.brcompile.tree_parent.default
_EXCHANGE_TOKENS = torch.ops.brcompile.exchange_tokens.default


@dataclasses.dataclass
class ReplaySplit:
    """The three graphs of a streaming split and what explain() shows about it."""

    outer_graph: fx.Graph  # the packed graph with the trunk replaced by a call of ``replay_trunk``
    outer_attrs: dict[str, Any]  # the packed graph's attributes and submodules the outer graph reads
    prefix: fx.GraphModule
    tail: fx.GraphModule
    ext_inputs: tuple[str, ...]  # outer values passed into the trunk (parameters, tables …)
    frontier: tuple[tuple[str, int], ...]  # (trunk node, its token dim) read by the outer graph
    cached: tuple[str, ...]  # attention nodes whose K/V the prefix caches
    trunk_nodes: int
    bytes_per_token: int  # bytes per packed token of the trunk's non-view values (a bound on what is saved)
    cached_scans: tuple[str, ...] = ()  # tree scans whose prefix values the prefix caches (_scan_cache)
    scan_depth: int = 0  # ancestors a tail token's scans read along its path (the chunks' ``ancestors`` rows)
    cached_positions: tuple[str, ...] = ()  # attention positions other than the tree's, cached (_cached_positions)
    #: the tail that also returns its own tokens' cached values (K/V, scan values, positions: what the prefix
    #: returns) for a window's later calls (None when one of them has no single packed-token dim)
    tail_cache: Optional[fx.GraphModule] = None
    #: the packed-token dim of each cached value, in the prefix's (and ``tail_cache``'s) output order
    cache_dims: tuple[int, ...] = ()
    #: what each of the trunk's outer inputs is computed from (:func:`ext_sources`)
    ext_sources: tuple["ExtSource", ...] = ()
    #: the packed graph checkpointed its layers (passes/lower/checkpoint.py): their bodies are inlined into the
    #: trunk graphs, and the runtime runs the kept prefix under activation checkpointing as a whole
    recompute: bool = False
    #: the trunk on one rank's piece of the packed axis (context parallelism), or None (``cp_refusal`` says why)
    cp: Optional[fx.GraphModule] = None
    cp_refusal: Optional[CannotReplay] = None
    #: a token's token-local FLOPs over one attention pair's: the context-parallel cut's balance (:func:`_work_alpha`)
    work_alpha: float = 0.0
    kv_bytes_per_token: int = 0  # every attention's K and V, bytes per packed token

    def build_outer(self, trunk: torch.nn.Module) -> fx.GraphModule:
        """The outer graph as a module whose ``replay_trunk`` is ``trunk`` (brcompile.runtime.streaming.ReplayTrunk,
        made from the compiled prefix and tail graphs): the graph that runs a streamed call."""
        gm = fx.GraphModule({**self.outer_attrs, "replay_trunk": trunk}, self.outer_graph, class_name="ReplayOuter")
        gm.recompile()
        return gm


def _token_dims(val, n) -> list[int]:
    """The dims of ``val`` whose size is the packed token count (``n`` = (shape env, N's symbol))."""
    return [d for d, k in _token_factors(val, n) if k == 1]


def _token_factors(val, n) -> list[tuple[int, int]]:
    """``(dim, k)`` for each dim of ``val`` whose size is ``k·N`` with a constant integer ``k >= 1``: the
    packed token dim (k = 1) or a token dim flattened with k entries per token (``n`` = (shape env, N's
    symbol))."""
    env, sym = n
    sym = env.simplify(sym)
    out = []
    for d, s in enumerate(val.shape):
        if isinstance(s, torch.SymInt):
            k = sympy.simplify(env.simplify(s.node.expr) / sym)
            if k.is_Integer and int(k) >= 1:
                out.append((d, int(k)))
    return out


def _bytes_per_token(val, n_sym) -> int:
    """Bytes of ``val`` per packed token (its token dim's one entry: the product of its other dims)."""
    dims = _token_factors(val, n_sym)
    if len(dims) != 1:
        return 0
    (dim, per), = dims
    for d, size in enumerate(val.shape):
        if d != dim:
            per *= int(size)
    return per * val.element_size()


def _work_alpha(trunk: Sequence[fx.Node], attentions: Sequence[fx.Node], n_sym) -> float:
    """A token's token-local FLOPs (its matrix products) over the FLOPs of one attention pair (``4 Hq D`` per
    attention: ``q.k`` and ``p.v``), the context-parallel cut's weight of a token against its depth
    (brcompile/runtime/context_parallel.py ``cut_tokens``); 0 for a trunk without attention."""
    pair = 0
    for a in attentions:
        q = a.args[0].meta["val"]
        pair += 4 * int(q.shape[0]) * int(q.shape[-1])
    if not pair:
        return 0.0
    flops = 0
    for n in trunk:
        if (family_of(n) or op_name(n).split(".")[0]) not in MATMUL_NAMES or not isinstance(n.meta.get("val"), torch.Tensor):
            continue
        x = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
        if isinstance(x, torch.Tensor) and isinstance(x.shape[-1], int):
            flops += 2 * int(x.shape[-1]) * _bytes_per_token(n.meta["val"], n_sym) // n.meta["val"].element_size()
    return flops / pair


def split_for_replay(packed: fx.GraphModule, example_args: Sequence[Any],
                     per_token: Sequence[int] = (), context_parallel: Optional[str] = None) -> ReplaySplit:
    """Split a packed graph (see module docstring); ``example_args`` are its inputs for one real batch
    (the original inputs followed by the tree arrays); ``per_token``: the indices of its per-token inputs (the
    tree keys). Raises CannotReplay when the trunk is not a token-local function of the per-token arrays.
    ``context_parallel``: a process group's name; the split then also holds the context-parallel trunk
    (``cp``), or why there is none (``cp_refusal``)."""
    dense = next((n for n in packed.graph.nodes if n.op == "call_function" and n.target is repack_tokens), None)
    if dense is not None:  # the dense region runs on every row and position: there is no per-chunk trunk before it
        raise CannotReplay(Code.STREAMING_CONSTRUCT,
                           "streaming replay: a dense region is packed again (passes/analysis/repack.py): it runs on the "
                           "whole [B, L] batch, not per chunk of tokens (the packed mode runs)", dense)
    written = WRITTEN_INPUTS.get(packed)
    if written:  # the write would have to be placed in one of the prefix / chunk / outer graphs (not done)
        ph = [n for n in packed.graph.nodes if n.op == "placeholder"]
        raise CannotReplay(Code.STREAMING_CONSTRUCT,
                           f"streaming replay: the graph writes into its input {ph[written[0]].name} in place "
                           f"(a buffer; the packed mode runs)", ph[written[0]])
    recompute = any(is_checkpoint(n) for n in packed.graph.nodes)
    if recompute:  # the model checkpoints its layers: the trunk runs them inline, under one checkpoint per piece
        packed = inline_checkpoints(packed)
    tree = tree_placeholders(packed)
    tok_nodes = tree.tokens
    n_sym = symbolic_run(packed, example_args, token_positions(packed))
    outer_side = descendants([tree.index]) | {tree.index}
    token_side = descendants(tok_nodes)
    trunk = [n for n in packed.graph.nodes if n in token_side and n not in outer_side and n.op != "output"]
    trunk_set = set(trunk)
    frontier = [n for n in trunk if any(u not in trunk_set for u in n.users)]
    _check_autocast_regions(packed, trunk, trunk_set, frontier)
    scans = [n for n in trunk if n.target in TREE_PATH_OPS or n.target in MATRIX_PATH_OPS]
    for n in scans:
        _check_scan(n, tok_nodes)
    bytes_per_token = 0
    for n in trunk:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            dims = _token_factors(val, n_sym)
            if not dims and _group_counts(n, n_sym, trunk_set):  # a few numbers per call, none per token
                continue
            if len(dims) != 1:
                raise CannotReplay(Code.STREAMING_FRONTIER,
                                   f"streaming replay: {n.name} has {len(dims)} packed-token dims "
                                   f"(shape {tuple(val.shape)}); the trunk must be token-local", n)
            if val._is_view():  # shares its base's storage: no bytes of its own
                continue
            (dim, per), = dims  # k entries per token along a flattened token dim
            for d, s in enumerate(val.shape):
                if d != dim:
                    per *= int(s)
            bytes_per_token += per * val.element_size()
    for n in frontier:
        if not isinstance(n.meta.get("val"), torch.Tensor):
            raise CannotReplay(Code.STREAMING_FRONTIER,
                               f"streaming replay: the outer graph reads {n.name}, which is not a tensor", n)
        if not _token_dims(n.meta["val"], n_sym):  # the chunks' outputs are written at their tokens' rows
            raise CannotReplay(Code.STREAMING_FRONTIER,
                               f"streaming replay: the outer graph reads {n.name}, whose token dim is flattened "
                               f"(shape {tuple(n.meta['val'].shape)}) (the packed mode runs)", n)
    # what the trunk reads of the parameters through ops of their own (a conv weight's unsqueeze, Mamba's
    # -exp(A_log)) it computes itself, so its inputs are the parameters (a cross-call window needs them as leaves)
    hoisted = _parameter_side(packed, trunk, trunk_set, example_args)
    body = [n for n in packed.graph.nodes if n in trunk_set or n in hoisted]  # the trunk graphs' nodes
    ext = list(dict.fromkeys(a for n in body for a in n.all_input_nodes
                             if a not in trunk_set and a not in hoisted and a not in tok_nodes))
    attentions = [n for n in trunk if n.target is _ATTENTION]
    for a in attentions:
        if a.args[4] not in (tok_nodes.valid, tok_nodes.all_valid):
            raise CannotReplay(Code.STREAMING_ATTENTION,
                               "streaming replay: an attention's key validity is not a tree array", a)
    dims = tuple(_token_dims(n.meta["val"], n_sym)[0] for n in frontier)
    positions = _cached_positions(attentions, tok_nodes, trunk_set)
    prefix = _trunk_graph(packed, body, ext, tok_nodes, frontier, attentions, scans, positions, cached=False)
    tail = _trunk_graph(packed, body, ext, tok_nodes, frontier, attentions, scans, positions, cached=True)
    # a tail that keeps its own tokens' cached values for later calls (cross-call windows: brcompile/runtime/window/
    # stores them per token, along their token dims, and starts a later call's chunk from them)
    cache_dims = _cache_dims(attentions, scans, positions, n_sym)
    tail_cache = None if cache_dims is None else _trunk_graph(packed, body, ext, tok_nodes, frontier, attentions,
                                                              scans, positions, cached=True, emit_cache=True)
    outer, outer_attrs = _outer_graph(packed, trunk_set, ext, tok_nodes, frontier,
                                      _trunk_only(hoisted, trunk_set))
    cp, cp_refusal = None, None
    if context_parallel is not None and scans:  # a scan's state would cross the ranks in DFS order: not done
        cp_refusal = CannotReplay(Code.CP_SCAN,
                                  "context parallelism: a scan along the tree paths carries its state from token to "
                                  "token; passing it across the ranks is not supported (the graph runs whole on every "
                                  "rank)", scans[0])
    elif context_parallel is not None:
        cp = _trunk_graph(packed, body, ext, tok_nodes, frontier, attentions, scans, positions, cached=True,
                          cp_group=context_parallel)
    return ReplaySplit(outer, outer_attrs, prefix, tail, tuple(n.name for n in ext),
                       tuple((n.name, d) for n, d in zip(frontier, dims)), tuple(a.name for a in attentions),
                       len(trunk), bytes_per_token, tuple(n.name for n in scans),
                       max((_scan_depth(n) for n in scans), default=0),
                       cached_positions=tuple(p.name for p in positions), tail_cache=tail_cache,
                       cache_dims=cache_dims or (), recompute=recompute,
                       ext_sources=ext_sources(packed, ext, per_token), cp=cp, cp_refusal=cp_refusal,
                       work_alpha=_work_alpha(body, attentions, n_sym),
                       kv_bytes_per_token=sum(_bytes_per_token(a.args[i].meta["val"], n_sym)
                                              for a in attentions for i in (1, 2)))


@dataclasses.dataclass(frozen=True)
class ExtSource:
    """What one outer value the trunk reads is computed from (:func:`ext_sources`)."""

    name: str
    inputs: tuple[int, ...]  # the packed graph's input indices it reads (itself, when it is an input)
    attrs: tuple[str, ...]  # the graph attributes it reads
    #: a node between a per-token input and this value that is not per-token (a batch or row statistic: a sum, a
    #: max, a length): the value is one of the call, not of each token's key path; None when there is none
    batch_node: Optional[str] = None


def ext_sources(packed: fx.GraphModule, ext: Sequence[fx.Node], per_token: Sequence[int]) -> tuple[ExtSource, ...]:
    """For each outer value the trunk reads, what it is computed from. A cross-call window replays a token an
    earlier call computed, so whatever the trunk reads besides the tree keys must be the same in both calls: the
    runtime compares the inputs named here, call to call (brcompile/runtime/window/), and refuses to share a
    trunk that reads a statistic of the call's batch. ``per_token``: the input indices of the per-token inputs
    (``[B, L, ...]``, matched by key); a value computed from one must keep its ``[B, L]`` leading dims at every
    step (elementwise, casts), else its ``batch_node`` names the step that does not."""
    holders = [n for n in packed.graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(holders)}
    tokens = {holders[i] for i in per_token}
    packed_arrays = set(tree_placeholders(packed).tokens)
    lead: dict[fx.Node, Any] = {}  # per-token-derived node -> its source's [B, L] sizes

    def token_lead(n: fx.Node):
        """The [B, L] sizes of the per-token input ``n`` derives from (None: it derives from none), or raises
        _Batch at a step that drops them."""
        if n in lead:
            return lead[n]
        if n in tokens:
            val = n.meta.get("val")
            lead[n] = tuple(val.shape[:2]) if isinstance(val, torch.Tensor) and val.dim() >= 2 else ("?",)
            return lead[n]
        if n in packed_arrays:
            raise _Batch(n)
        if n.op in ("placeholder", "get_attr"):
            lead[n] = None
            return None
        got = [x for x in (token_lead(a) for a in n.all_input_nodes) if x is not None]
        if not got:
            lead[n] = None
            return None
        val = n.meta.get("val")
        if got[0] == ("?",) or not isinstance(val, torch.Tensor) or tuple(val.shape[:2]) != got[0]:
            raise _Batch(n)
        lead[n] = got[0]
        return got[0]

    out = []
    for e in ext:
        seen, stack, inputs, attrs = set(), [e], set(), set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.op == "placeholder":
                inputs.add(index[n])
            elif n.op == "get_attr":
                attrs.add(str(n.target))
            else:
                stack.extend(n.all_input_nodes)
        try:
            token_lead(e)
            batch = None
        except _Batch as b:
            batch = b.node.name
        out.append(ExtSource(e.name, tuple(sorted(inputs)), tuple(sorted(attrs)), batch))
    return tuple(out)


class _Batch(Exception):
    def __init__(self, node: fx.Node):
        super().__init__(node.name)
        self.node = node


def _parameter_side(packed: fx.GraphModule, trunk: Sequence[fx.Node], trunk_set: set,
                    example_args: Sequence[Any]) -> set[fx.Node]:
    """The outer nodes the trunk reads that are computed from parameters (inputs that require grad, leaves) and
    graph attributes only, by ops that draw no random numbers, with every node between them: the trunk graphs
    compute them themselves (a few ops on parameters per prefix and chunk), so the trunk's inputs are the
    parameters, not per-call tensors derived from them. Nothing (keeping today's inputs) in a graph with an
    autocast region: an op on a parameter there may depend on where it runs."""
    if _autocast_nodes(packed):
        return set()
    holders = [n for n in packed.graph.nodes if n.op == "placeholder"]
    params = {n for n, x in zip(holders, example_args)
              if isinstance(x, torch.Tensor) and x.requires_grad and x.grad_fn is None}
    pure: dict[fx.Node, bool] = {}  # computed from parameters and attributes only (graph order: inputs first)
    for n in packed.graph.nodes:
        if n in params or n.op == "get_attr":
            pure[n] = True
        elif n.op in ("call_function", "call_method") and n not in trunk_set and n.all_input_nodes:
            pure[n] = (all(pure.get(a, False) for a in n.all_input_nodes) and random_draw(n, by_name=True) is None
                       and not n.is_impure())
        else:
            pure[n] = False
    out: set[fx.Node] = set()
    stack = [a for n in trunk for a in n.all_input_nodes if a not in trunk_set]
    while stack:
        n = stack.pop()
        if n in out or not pure.get(n) or n.op not in ("call_function", "call_method"):
            continue
        out.add(n)
        stack.extend(n.all_input_nodes)
    return out


def _trunk_only(hoisted: set, trunk_set: set) -> set[fx.Node]:
    """The nodes of ``hoisted`` (:func:`_parameter_side`) that only the trunk reads (directly or through other
    such nodes): the outer graph drops them."""
    keep: set[fx.Node] = set()  # read by the outer graph
    changed = True
    while changed:
        changed = False
        for n in hoisted - keep:
            if any(u not in trunk_set and (u not in hoisted or u in keep) for u in n.users):
                keep.add(n)
                changed = True
    return hoisted - keep


def _group_counts(node: fx.Node, n_sym, trunk_set) -> bool:
    """Whether ``node`` is the group counts (or offsets) of a MoE block's sort-based dispatch, a token-local
    region (passes/analysis/rules/moe.py): ``histc`` of the flattened sorted expert keys — one count per expert, no
    token dim — then casts and ``cumsum`` into the offsets, read by the grouped matmuls of the same region
    only (no outer-graph user). The analysis accepts a ``histc`` in no other role. Run on a token subset (the
    prefix, one chunk), the region sorts, counts and multiplies that subset's entries: each entry's result is
    the same function of its own token as on all N packed tokens, so the trunk stays token-local."""
    if any(u not in trunk_set for u in node.users):
        return False
    seen = 0
    while isinstance(node, fx.Node) and node.op in ("call_function", "call_method") and seen < 8:
        seen += 1
        name = op_name(node)
        if name == "histc":
            keys = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
            return isinstance(keys, torch.Tensor) and len(_token_factors(keys, n_sym)) == 1
        if name not in GROUP_COUNT_STEPS:
            return False
        node = node.args[0]
    return False


def _cached_positions(attentions: Sequence[fx.Node], tok_nodes, trunk_set) -> list[fx.Node]:
    """The position arguments of the attentions (window, ALiBi, relative bias) that are trunk values other
    than the tree's positions — BLOOM's ALiBi over ``count(attention_mask)`` at each token —, each once: the
    prefix outputs them and a chunk's cross pairs read the cached keys' positions from them (the tree's own
    positions reach the tail as ``cache_position``)."""
    found = {}
    for a in attentions:
        p = attention_features(a.args)["position"]
        if p is None or p is tok_nodes.position:
            continue
        if p not in trunk_set:  # not a per-token value of the trunk: the prefix could not give its cached rows
            raise CannotReplay(Code.STREAMING_ATTENTION,
                               f"streaming replay: the attention's positions {p.name} are not computed per token "
                               f"from the tree arrays (the packed mode runs)", a)
        found[p] = None
    return list(found)


def _autocast_nodes(packed: fx.GraphModule) -> list[fx.Node]:
    """The ``_enter_autocast`` / ``_exit_autocast`` calls of the graph (``with torch.autocast(...)`` inside the
    compiled function), in graph order."""
    return [n for n in packed.graph.nodes if n.op == "call_function" and n.target in AUTOCAST_REGION]


def _check_autocast_regions(packed: fx.GraphModule, trunk: Sequence[fx.Node], trunk_set: set,
                            frontier: Sequence[fx.Node]) -> None:
    """An autocast region inside the compiled function streams when the whole trunk lies in one autocast state:
    no region starts or ends between its first and last node. The outer graph then keeps the ``replay_trunk``
    call at the trunk's place, inside the same regions (:func:`_outer_graph` emits every autocast call after the
    trunk's start after the call, with the frontier's readers), so prefix and chunks run in the region's state,
    and a chunk's re-run in backward restores it (brcompile/runtime/streaming.py ``_autocast_as``). A region
    boundary inside the trunk, or an outer value computed after such a boundary that the call would have to
    precede (it does not read the frontier), is refused: the packed mode runs."""
    marks = _autocast_nodes(packed)
    if not marks or not trunk:
        return
    order = {n: i for i, n in enumerate(packed.graph.nodes)}
    first, last = order[trunk[0]], order[trunk[-1]]
    inside = next((m for m in marks if first < order[m] < last), None)
    if inside is not None:
        raise CannotReplay(Code.STREAMING_AUTOCAST,
                           "streaming replay: an autocast region starts or ends inside the token-local part of the "
                           "graph (its chunks would run in two precisions; the packed mode runs)", inside)
    later = [m for m in marks if order[m] > last]
    if not later:
        return
    after = descendants(frontier) - trunk_set
    stray = next((n for n in packed.graph.nodes if order[n] > order[later[0]]
                  and n.op in ("call_function", "call_method", "call_module")
                  and n not in after and n not in trunk_set and n.target not in AUTOCAST_REGION), None)
    if stray is not None:
        raise CannotReplay(Code.STREAMING_AUTOCAST,
                           f"streaming replay: {stray.name}, after an autocast region's boundary that follows the "
                           f"token-local part, does not read it (the packed mode runs)", stray)


def _scan_depth(scan: fx.Node) -> int:
    """How many ancestors along its path a token's value of ``scan`` reads: the parent (the state or path
    sum there) for a linear or matrix scan or a cumsum, the W-1 previous taps for a causal conv1d of width W."""
    if scan.target is _CONV:
        return int(scan.args[1].meta["val"].shape[2]) - 1
    return 1


def _check_scan(scan: fx.Node, tok_nodes) -> None:
    """A scan the tail graph can run against the cache: its parents are ``tree_parent(end)`` of the tree
    (the chunk's own ``end`` gives the chunk's local paths)."""
    parent = scan.args[{_CONV: 3, _LINEAR_SCAN: 2, _MATRIX_SCAN: 2}.get(scan.target, 1)]
    if not (parent.op == "call_function" and parent.target is _PARENT and parent.args[0] is tok_nodes.end):
        raise CannotReplay(Code.STREAMING_CONSTRUCT,
                           "streaming replay: a scan along the tree paths whose parents are not the tree's "
                           "(the packed mode runs)", scan)


def _cache_dims(attentions: Sequence[fx.Node], scans: Sequence[fx.Node], positions: Sequence[fx.Node],
                n_sym) -> Optional[tuple[int, ...]]:
    """The packed-token dim of each cached value (every attention's K and V, each scan's :func:`_scan_cache`, each
    cached position), in the prefix's output order; None when one has no single unflattened token dim (a window
    could not keep it per token: its calls then share within themselves only)."""
    nodes = [x for a in attentions for x in (a.args[1], a.args[2])] + [_scan_cache(n) for n in scans] + list(positions)
    dims = []
    for x in nodes:
        val = x.meta.get("val")
        found = _token_dims(val, n_sym) if isinstance(val, torch.Tensor) else []
        if len(found) != 1 or len(_token_factors(val, n_sym)) != 1:
            log.debug("streaming replay: the cached value %s has no single token dim; no cross-call window", x.name)
            return None
        dims.append(found[0])
    return tuple(dims)


def _cached_scan(g: fx.Graph, scan: fx.Node, env: dict, cache: fx.Node, ancestors: fx.Node) -> fx.Node:
    """``scan`` on a chunk against its cached prefix values (backends/scan/op.py: ``*_cached``,
    backends/scan/matrix.py: ``tree_matrix_scan_cached``)."""
    args = tuple(env[a] if isinstance(a, fx.Node) else a for a in scan.args)
    if scan.target is _CONV:
        x, w, b, parent = args[:4]
        impl = args[4] if len(args) > 4 else "auto"
        return g.call_function(tree_causal_conv1d_cached, (x, w, b, parent, impl, cache, ancestors))
    if scan.target is _LINEAR_SCAN:
        a, b, parent, dim = args[:4]
        impl = args[4] if len(args) > 4 else "auto"
        return g.call_function(tree_linear_scan_cached, (a, b, parent, dim, impl, cache, ancestors))
    if scan.target is _MATRIX_SCAN:
        M, b, parent, dim = args[:4]
        impl = args[4] if len(args) > 4 else "auto"
        return g.call_function(tree_matrix_scan_cached, (M, b, parent, dim, impl, cache, ancestors))
    x, parent, dim = args
    return g.call_function(tree_cumsum_cached, (x, parent, dim, cache, ancestors))


def _scan_cache(scan: fx.Node) -> fx.Node:
    """The prefix value a scan's tail tokens read: a conv's input x (its taps), a linear or matrix scan's
    state h or a cumsum's path sum (the scan's output at the parent; for the matrix scan ``[.., P, .., d,
    e]``, the delta rule's per-head ``[dk, dv]`` state at every prefix token, of which a chunk reads the rows
    at its roots' parents)."""
    return scan.args[0] if scan.target is _CONV else scan


def _trunk_graph(packed, trunk, ext, tok_nodes, frontier, attentions, scans, positions, *,
                 cached: bool, emit_cache: bool = False, cp_group: Optional[str] = None) -> fx.GraphModule:
    """The trunk as a graph of (*ext, *token arrays[, *cache, cache_valid, cache_all_valid, cross,
    cache_position, cache_ancestors]); the cache is every attention's K and V, then one value per scan, then
    the attentions' ``positions`` that are not the tree's (:func:`_cached_positions`). It returns the frontier,
    then (the prefix, or a tail with ``emit_cache``) its own tokens' cache values in the same order.

    With ``cp_group`` (context parallelism, brcompile/runtime/context_parallel.py), the trunk on one rank's piece
    of the packed axis, (*ext, *token arrays, cache_valid, cache_all_valid, cross, cache_position, send_index,
    send_sizes, recv_sizes): the cache of each attention is its own K/V at the earlier tokens the piece's queries
    see, received from the ranks holding them (``brcompile::exchange_tokens``), and no scan (refused before)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in ext:
        env[n] = g.placeholder(f"ext_{n.name}")
    for n, name in zip(tok_nodes, TOKEN_ARRAYS):
        env[n] = g.placeholder(f"tree_{name}")
    if cp_group is not None:
        return _cp_trunk_graph(packed, g, env, trunk, tok_nodes, frontier, cp_group)
    if cached:
        cache = {a: (g.placeholder(f"cache_k_{a.name}"), g.placeholder(f"cache_v_{a.name}")) for a in attentions}
        scan_cache = {n: g.placeholder(f"cache_{n.name}") for n in scans}
        pos_cache = {p: g.placeholder(f"cache_pos_{p.name}") for p in positions}
        cache_valid = {tok_nodes.valid: g.placeholder("cache_valid"),
                       tok_nodes.all_valid: g.placeholder("cache_all_valid")}
        cross = g.placeholder("cross")
        cache_position = g.placeholder("cache_position")
        ancestors = g.placeholder("cache_ancestors")
    for n in trunk:
        if cached and n in scan_cache:
            new = _cached_scan(g, n, env, scan_cache[n], ancestors)
        elif cached and n.target is _ATTENTION:
            new = _cached_attention(g, n, env, cache[n], cache_valid, cross, _cache_positions(
                n, tok_nodes, cache_position, pos_cache))
        else:
            new = g.node_copy(n, lambda a: env[a])
        new.meta.update(n.meta)
        env[n] = new
    outs = [env[n] for n in frontier]
    if not cached or emit_cache:
        outs += [env[x] for a in attentions for x in (a.args[1], a.args[2])]
        outs += [env[_scan_cache(n)] for n in scans]
        outs += [env[p] for p in positions]
    g.output(tuple(outs))
    g.lint()
    gm = fx.GraphModule(packed, g, class_name=("ReplayTailCache" if emit_cache else "ReplayTail") if cached
                        else "ReplayPrefix")
    gm.recompile()
    return gm


def _cp_trunk_graph(packed, g: fx.Graph, env: dict, trunk, tok_nodes, frontier, group: str) -> fx.GraphModule:
    """The context-parallel trunk (:func:`_trunk_graph` with ``cp_group``), after its ext and token placeholders."""
    cache_valid = g.placeholder("cache_valid")
    valid = {tok_nodes.valid: cache_valid, tok_nodes.all_valid: g.placeholder("cache_all_valid")}
    cross = g.placeholder("cross")
    cache_position = g.placeholder("cache_position")
    send_index, send_sizes, recv_sizes = (g.placeholder(f"cp_{n}") for n in ("send_index", "send_sizes", "recv_sizes"))
    gathered: dict[fx.Node, fx.Node] = {}
    order = [send_sizes]  # the previous exchange's ``done``: the exchanges run in this order on every rank

    def before_piece(x: fx.Node, dim: int) -> fx.Node:
        """Trunk value ``x`` at the earlier tokens this rank's queries see (``cache_valid``'s), from the ranks
        holding them."""
        if x not in gathered:
            both = g.call_function(_EXCHANGE_TOKENS, (env[x], cache_valid, send_index, send_sizes, recv_sizes, dim,
                                                      group, order[-1]))
            gathered[x] = g.call_function(operator.getitem, (both, 0))
            order.append(g.call_function(operator.getitem, (both, 1)))
        return gathered[x]

    for n in trunk:
        if n.target is _ATTENTION:
            position = attention_features(n.args)["position"]
            cpos = None if position is None else (
                cache_position if position is tok_nodes.position else before_piece(position, 0))
            new = _cached_attention(g, n, env, (before_piece(n.args[1], 1), before_piece(n.args[2], 1)), valid, cross,
                                    cpos)
        else:
            new = g.node_copy(n, lambda a: env[a])
        new.meta.update(n.meta)
        env[n] = new
    g.output(tuple(env[n] for n in frontier))
    g.lint()
    gm = fx.GraphModule(packed, g, class_name="ContextParallelTrunk")
    gm.recompile()
    return gm


def _cache_positions(n: fx.Node, tok_nodes, cache_position: fx.Node, pos_cache: dict):
    """The cached keys' positions of the packed attention ``n`` (None without positions): the tree's
    (``cache_position``) when it reads the tree's positions, else the prefix's value of its position node."""
    position = attention_features(n.args)["position"]
    if position is None:
        return None
    return cache_position if position is tok_nodes.position else pos_cache[position]


def _cached_attention(g: fx.Graph, n: fx.Node, env: dict, kv_cache: tuple, cache_valid: dict, cross: fx.Node,
                      cpos) -> fx.Node:
    """The tail's ``tree_attention_cached_forward`` for the packed attention ``n``: the chunk's own arguments,
    the cached K/V ``kv_cache``, its validity and cross rows, then ``n``'s features by name (the graph values
    mapped into the tail) with the cache's positions ``cpos``, in the cached op's blocks."""
    q, k, v, end, valid, segments, scale, impl = n.args[:FORWARD_FEATURES_AT]
    kc, vc = kv_cache
    args = (env[q], env[k], env[v], env[end], env[valid], env[segments], kc, vc, cache_valid[valid], cross,
            scale, impl)
    features = {name: env[x] if isinstance(x, fx.Node) else x for name, x in attention_features(n.args).items()}
    features[CACHE_POSITION.name] = cpos
    return g.call_function(torch.ops.brcompile.tree_attention_cached_forward.default,
                           args + feature_tail(features, CACHED_FEATURES, CACHED_BLOCKS))


def _fetch(mod: torch.nn.Module, target: str):
    for part in target.split("."):
        mod = getattr(mod, part)
    return mod


def _outer_graph(packed, trunk_set, ext, tok_nodes, frontier, dropped=frozenset()) -> tuple[fx.Graph, dict[str, Any]]:
    """The packed graph with the trunk replaced by ``replay_trunk(*ext, *token arrays)``; nodes that
    read the frontier are emitted after the call, all others (ext inputs among them) before it, but ``dropped``
    (parameter-side nodes only the trunk reads, :func:`_trunk_only`). Returns the graph and the attributes it
    reads of ``packed`` (:meth:`ReplaySplit.build_outer` adds the trunk)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    after = descendants(frontier) - trunk_set
    marks = _autocast_nodes(packed)
    if trunk_set and marks:  # autocast boundaries after the trunk's start stay after the call (_check_autocast_regions)
        start = next(n for n in packed.graph.nodes if n in trunk_set)
        order = {n: i for i, n in enumerate(packed.graph.nodes)}
        after |= {m for m in marks if order[m] > order[start]}
    nodes = [n for n in packed.graph.nodes if n not in trunk_set and n not in dropped and n.op != "output"]
    for n in nodes:
        if n not in after:
            env[n] = g.node_copy(n, lambda a: env[a])
    call = g.call_module("replay_trunk", tuple(env[n] for n in ext) + tuple(env[n] for n in tok_nodes))
    for i, n in enumerate(frontier):
        env[n] = g.call_function(operator.getitem, (call, i))
    for n in nodes:
        if n in after:
            env[n] = g.node_copy(n, lambda a: env[a])
    out = next(n for n in packed.graph.nodes if n.op == "output")
    g.output(fx.node.map_arg(out.args[0], lambda a: env[a]))
    g.lint()
    attrs = {n.target: _fetch(packed, n.target) for n in g.nodes
             if n.op in ("get_attr", "call_module") and n.target != "replay_trunk"}
    return g, attrs
