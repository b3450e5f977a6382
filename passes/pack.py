"""The packed rewrite: dense [B, L, …] graph -> packed [1, N, …] graph (docs/ARCHITECTURE.md §3).

The analysis stages of the pipeline (passes/pipeline.py) read this module's helpers and leave an
:class:`Analysis`:

- (B, L) from the token ids (the integer [B, L] input of an ``embedding``) or else from an attention's
  query; the tree inputs (the [B, L, ...] inputs the attentions depend on: token ids, attention mask, position
  ids, and float embeddings or hidden states in graphs without ids: per-block graphs, ``inputs_embeds``; in a
  graph without attention, the inputs its causal scans along the positions read, or every per-token input of
  a token-local graph: :func:`analyse_scans`, :func:`analyse_token_local`); the per-position inputs shared by
  all rows ([L, ...] or [1, L, ...]: rotary tables made outside); the masks' classes (:mod:`.masks`) and their
  guards.

The emit stage calls :func:`build_packed_graph`: a new graph that takes the original inputs plus the tree
arrays (``runtime.tree.TreeArgs``, placeholders ``tree_<name>``) and computes TOKEN values once per tree node,
DENSE values as before; a TOKEN value needed dense is materialised as ``packed[index]`` (:func:`materialize`)
or, for values derived from the inputs by cheap ops only, recomputed from the dense inputs. Transactional: the
user's graph is never modified.
"""
from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from brcompile.passes import checkpoint as checkpoints, input_masks, masks as masks_mod
from brcompile.passes.axes import (
    AxesContext, Materialisation, Window, example_value, get_axes, hint,
    is_static_input, node_args, normalize_dim, propagate, rule_for, shape_of,
)
from brcompile.passes.refusals import CannotReplay, Code, NothingToShare
from brcompile.passes.guards import BatchGuard, scalar_equals
from brcompile.passes.liveness import safe_operand
from brcompile.passes.meta import AXES, ROWS, SEQUENCES, TOKEN_OUTPUTS, WRITTEN_INPUTS
from brcompile.passes import canonicalize as eager_attention
from brcompile.passes.rules import scan as scan_rules
from brcompile.passes.spellings import (
    CHEAP_VIEWS, EMBEDDINGS, MATRIX_RIGHT_OPERAND, VALUE_MOVES, WEIGHT_TRANSPOSES, arg, is_op, op_name,
)
from brcompile.runtime.tree import GRAPH_ARGS, row_keys
from brcompile.backends.read_packed import read_packed

log = logging.getLogger(__name__)

#: Extra inputs of the packed graph, in this order, after the original ones.

#: A TOKEN value read through a window covering at most this fraction of the B·L positions is computed
#: densely from its inputs' dense values when they share the window (Packer._sinks_window).
WINDOW_SINK_FRACTION = 0.5
_CHEAP = CHEAP_VIEWS


@dataclasses.dataclass
class PackOptions:
    attention: str = "auto"
    fuse_logprob: bool = True  # LM head -> log_softmax -> gather/cross_entropy as brcompile::packed_logprob
    drop_padding: bool = False  # the index may hold -1 (positions left out of the tree): reads check it
    #: with drop_padding: positions may be left out before a kept one of the same row (key-padded ones); False
    #: when only positions after a row's last needed one are (every kept token's row prefix is kept)
    drops_within_rows: bool = True
    scan: str = "auto"  # the impl of brcompile::tree_linear_scan (backends/scan.py: SCAN_IMPLS)


@dataclasses.dataclass
class Analysis:
    """What :func:`analyse` proved about a graph."""

    gm: fx.GraphModule
    ctx: AxesContext
    token_ids: fx.Node
    tree_inputs: list[fx.Node]
    keypad: Optional[fx.Node]
    attentions: list[fx.Node]
    masks: dict[fx.Node, masks_mod.MaskInfo]
    placeholders: list[fx.Node]
    guards: list[BatchGuard] = dataclasses.field(default_factory=list)  # per-call (passes.guards)
    canonical: list[str] = dataclasses.field(default_factory=list)  # what canonicalisation rewrote
    #: padding-free batches: the position-id input whose 0s start the sequences packed into each row (every
    #: attention is causal within them); the runtime builds the tree over the sequences
    sequences: Optional[fx.Node] = None
    #: the attention mask when it comes from outside the graph (``keypad`` is then its graph input): its
    #: per-call check is among the guards, and the tree's key padding is its diagonal
    input_mask: Optional[input_masks.InputMask] = None
    #: the live-position plan (passes/liveness.py), set by the backend when some positions may be left out
    liveness: Optional[Any] = None
    liveness_note: Optional[str] = None  # why the backend narrowed or dropped the plan (explain)

    @property
    def tree_input_positions(self) -> list[int]:
        return [self.placeholders.index(p) for p in self.tree_inputs]

    def tree_keys(self, args: Sequence[Any]) -> list:
        """The call's tree keys: the tree inputs, ``[T, ...]`` rows as ``[T, 1, ...]`` (``tree.row_keys``)."""
        keys = [args[i] for i in self.tree_input_positions]
        return row_keys(keys) if self.ctx.rows else keys

    @property
    def keypad_position(self) -> Optional[int]:
        return None if self.keypad is None else self.placeholders.index(self.keypad)

    def key_padding(self, args: Sequence[Any]) -> Optional[torch.Tensor]:
        """The tree's ``[B, L]`` key padding for a call: the key-padding input, or the diagonal of a mask from
        outside the graph (broadcast over the rows when the mask is); None without key padding."""
        if self.keypad is None:
            return None
        if self.input_mask is None:
            return args[self.keypad_position]
        valid = self.input_mask.key_padding(args)
        return valid.expand(args[self.tree_input_positions[0]].shape[0], valid.shape[1])

    @property
    def sequences_position(self) -> Optional[int]:
        return None if self.sequences is None else self.placeholders.index(self.sequences)

    @property
    def materialisations(self) -> list[Materialisation]:
        return list(self.ctx.materialised.values())

    @property
    def lazy_gathers(self) -> list[fx.Node]:
        return [n for n, v in self.ctx.notes.items() if v == "lazy_gather"]


def _strip_views(n: fx.Node) -> fx.Node:
    while n.op != "placeholder" and (rule_for(n) is not None) and n.args and isinstance(n.args[0], fx.Node) \
            and (n.target in _CHEAP):
        n = n.args[0]
    return n


def find_token_ids(gm: fx.GraphModule) -> fx.Node:
    """The placeholder of the token ids: the integer [B, L] input of the first ``embedding``."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in EMBEDDINGS:
            src = _strip_views(n.args[0])
            v = example_value(src)
            if src.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim() == 2 \
                    and not v.is_floating_point():
                return src
    raise CannotReplay(Code.NO_TOKEN_INPUT,
                       "no [B, L] integer token input feeding an embedding (inputs_embeds models and "
                       "graphs without the embedding are not supported)")


def refuse_without_tree_inputs(gm: fx.GraphModule, B: int, L: int) -> None:
    """CannotReplay for a graph with attention but no tree input: its ids are joined in the graph to constant
    tokens (:func:`ids_joined_to_constants`, named), or it has no per-token input at all."""
    built = ids_joined_to_constants(gm)
    if built is not None:
        emb, ids, extra = built
        raise CannotReplay(Code.JOINED_TOKEN_IDS, f"the embedding reads token ids joined in the graph: {extra} constant token(s) (a "
                           f"prompt every row shares, CPM-Ant's) concatenated with the [B, L] input {ids.name} "
                           "along the length; the prefix tree is built over the rows of the graph's inputs, and "
                           "the attentions run over positions that are not theirs", emb)
    raise CannotReplay(Code.NO_TOKEN_INPUT, f"no [B, L] integer token input feeding an embedding, and the attentions read no "
                       f"per-token [B={B}, L={L}, ...] input (token ids, inputs_embeds or hidden states)")


def analyse_scans(gm: fx.GraphModule, scans: list[fx.Node], token_ids: Optional[fx.Node], placeholders: list,
                   values: dict, canon, training: bool, left: str = "") -> Analysis:
    """A graph without attention whose rows share work through causal scans along the positions (a pure
    state-space model: Mamba's causal conv and selective scan; a gated delta rule's matrix scan). The tree
    inputs are the per-token inputs the scans read (token ids, attention mask), the ids among them; (B, L) the
    ids'. Each row's tokens before column t are its path in the tree, so a scan along the positions is a tree
    scan. When propagation makes none of them one (each went dense, for its reason), nothing is shared:
    CannotReplay with that reason. Without token ids (a layer's graph on hidden states) the tree inputs are
    every per-token input, as for a token-local graph (:func:`analyse_token_local`, whose propagation makes
    the scans tree scans the same way: a row's hidden states before column t are its path's)."""
    if token_ids is None:
        return analyse_token_local(gm, token_ids, placeholders, values, canon, training, left)
    B, L = hint(tuple(example_value(token_ids).shape))
    needed = set().union(*(masks_mod.ancestors(s) for s in scans))
    tree_inputs = [p for p in placeholders if p in needed and is_token_shaped(p, B, L)]
    if token_ids not in tree_inputs:
        unrecognised = eager_attention.unrecognised_attention(gm)  # the tokens' mixing is an attention we missed
        if unrecognised is not None:
            raise CannotReplay(Code.UNRECOGNISED_ATTENTION, unrecognised[1], unrecognised[0])
        raise CannotReplay(Code.NO_TOKEN_INPUT,
                           "no scaled_dot_product_attention in the graph, and its scans do not depend on the "
                           "token ids (nothing packed; it runs unchanged)")
    position_inputs = {p: d for p in placeholders if p in needed and p not in tree_inputs
                       for d in [position_dim(p, B, L)] if d is not None}
    ctx = AxesContext(gm, B, L, tree_inputs, set(), training=training, position_inputs=position_inputs,
                      values=values, sequences=False)
    propagate(ctx)
    if not any(scan_rules.is_tree_scan(ctx, s) for s in scans):
        why = ctx.first_materialisation() or "no scan runs along the positions of the tokens"
        raise CannotReplay(Code.NOTHING_PACKED,
                           f"no scaled_dot_product_attention in the graph and no scan along the tree (nothing to "
                           f"share; it runs unchanged): {why}{left}")
    return Analysis(gm, ctx, token_ids, tree_inputs, None, [], {}, placeholders, list(canon.guards) + ctx.guards,
                    canon.notes)


def analyse_token_local(gm: fx.GraphModule, token_ids: Optional[fx.Node], placeholders: list, values: dict, canon,
                         training: bool, left: str = "") -> Analysis:
    """A graph without attention and without scans (a piece of a model between graph breaks: norms, MLPs, MoE
    routing, the LM head, the loss; a bag-of-tokens model). (B, L) are the token ids' or else those of the first
    [B, L, D] float input that is not a parameter (hidden states); the tree inputs are every per-token [B, L, ...]
    input. The facts are propagated as for any graph: a token-local op of TOKEN values is TOKEN (its value at
    (b, t) reads the inputs at (b, t) only, so rows whose keys agree up to column t share it), an op that mixes
    tokens is dense or refused by its rule. Rows sharing a prefix then share the work of its tokens. When no op
    computes on packed values (everything went dense), nothing is shared: CannotReplay with the first reason.

    Without either, the tokens may come flattened: the first 2-D float input that is not a parameter, ``[T, D]``
    (``hidden.view(-1, D)`` made before a graph break), is T rows of one token each — (B, L) = (T, 1), the
    tree inputs every ``[T, ...]`` input (:func:`_row_inputs`) with the flattened layout's fact (``flat=1``).
    Rows whose inputs agree bitwise are one tree node (a prefix of length 1), whatever their place in the
    batch: a token-local op's value at row i reads row i of the inputs only. Ops that mix rows (a reduction or
    cumsum over dim 0, an index ``x[idx]`` by a per-batch index) are dense by their rules, as for
    ``[B·L, D]`` values in a graph over ``[B, L, D]`` inputs."""
    nothing = f"no scaled_dot_product_attention in the graph (nothing to share; it runs as it is){left}"
    unpacked = f"no scaled_dot_product_attention in the graph and nothing packed (it runs unchanged){left}"
    ops = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    if all(n.target in _CHEAP for n in ops):  # hidden.reshape(-1, D) alone between two graph breaks
        what = ", ".join(dict.fromkeys(op_name(n) for n in ops)) or "nothing"
        raise NothingToShare(Code.NO_PER_TOKEN_WORK,
                             f"{nothing}: the graph only views, casts or indexes its inputs ({what}): nothing to "
                             f"compute")
    if not any(_float_arithmetic(n) for n in ops):  # a mask built from [B, L] metadata; a sort of routing keys
        what = ", ".join(dict.fromkeys(op_name(n) for n in ops
                                       if n.target not in _CHEAP and n.target not in VALUE_MOVES))
        raise NothingToShare(Code.NO_PER_TOKEN_WORK,
                             f"{nothing}: the graph computes no floating-point value (integer and boolean "
                             f"bookkeeping only: {what}; floating-point values are only viewed, cast or indexed): "
                             f"nothing to compute per token")
    rows = False
    first = token_ids  # the input (B, L) come from
    if token_ids is not None:
        B, L = hint(tuple(example_value(token_ids).shape))
    else:
        floats = [p for p in placeholders if _free_float(p, 3)]
        if floats:
            first = floats[0]
            B, L = hint(tuple(example_value(first).shape[:2]))
        else:
            flat = [p for p in placeholders if _free_float(p, 2)]
            flat = [p for p in flat if not _read_as_weight(p)] or flat
            if not flat:
                why = ("no token ids, no [B, L, D] float input (hidden states) and no [T, D] float input "
                       "(flattened hidden states)")
                lookup = _lookup_by_integer_input(gm, placeholders)
                if lookup is not None:
                    raise CannotReplay(Code.NO_TOKEN_INPUT,
                                       f"{unpacked}: {why}, but {lookup.name} looks a floating-point value up by an "
                                       f"integer input (per-token work on what it holds)", lookup)
                if not any(_free_float(p, n) for p in placeholders for n in range(1, 9)):
                    raise NothingToShare(Code.NO_PER_TOKEN_WORK,
                                         f"{nothing}: {why}: it reads no per-token value (masks and position "
                                         f"tables built from integer inputs and parameters)")
                raise CannotReplay(Code.NO_TOKEN_INPUT, f"{unpacked}: {why}")
            first = flat[0]
            B, L, rows = hint(example_value(first).shape[0]), 1, True
    if _one_row(first):  # an expert that received one token, Dynamo's graph for that size
        raise NothingToShare(Code.ONE_ROW_BATCH,
                             f"{nothing}: its batch is one row at every call ({first.name}: a size specialised "
                             f"to 1): a row shares nothing with itself")
    tree_inputs = _row_inputs(placeholders, B) if rows else [p for p in placeholders if is_token_shaped(p, B, L)]
    position_inputs = {} if rows else {p: d for p in placeholders if p not in tree_inputs
                                       for d in [position_dim(p, B, L)] if d is not None}
    call_constants = _call_constants(placeholders, set(tree_inputs) | set(position_inputs),
                                     (B,) if rows else (B, L))
    ctx = AxesContext(gm, B, L, tree_inputs, set(), training=training, position_inputs=position_inputs,
                      values=values, sequences=False, rows=rows, call_constants=call_constants)
    propagate(ctx)
    if not any(_computes_packed(n) for n in gm.graph.nodes):
        why = ctx.first_materialisation() or "no op computes on the per-token inputs"
        raise CannotReplay(Code.NOTHING_PACKED, f"{unpacked}: {why}")
    log.debug("token-local graph: tree inputs %s, (B, L) = (%d, %d)", [p.name for p in tree_inputs], B, L)
    return Analysis(gm, ctx, token_ids, tree_inputs, None, [], {}, placeholders, list(canon.guards) + ctx.guards,
                    canon.notes)




def _read_as_weight(p: fx.Node, depth: int = 0) -> bool:
    """Every use of ``p`` is as the right operand of a matrix product (``x @ W``, ``F.linear(x, W)``), directly or
    through a transpose (``x @ W.T``): a weight passed into the graph (DBRX's expert weights sliced before a graph
    break), not the flattened tokens, whose rows are the product's rows (its left operand)."""
    if not p.users or depth > 2:
        return False
    for u in p.users:
        if u.target in MATRIX_RIGHT_OPERAND and len(u.args) > 1 and u.args[1] is p and u.args[0] is not p:
            continue
        if (u.target in WEIGHT_TRANSPOSES
                or (u.target is getattr and len(u.args) > 1 and u.args[1] in WEIGHT_TRANSPOSES)) \
                and u.args[0] is p and _read_as_weight(u, depth + 1):
            continue
        return False
    return True




def _float_arithmetic(n: fx.Node) -> bool:
    """``n`` computes a floating-point value (one of its outputs is floating and it is no view, cast, index
    or move of values: :data:`_CHEAP`, :data:`VALUE_MOVES`)."""
    if n.op == "call_module":  # a module not inlined: assumed to compute
        return True
    if n.target in _CHEAP or n.target in VALUE_MOVES:
        return False
    v = example_value(n)
    vals = v if isinstance(v, (tuple, list)) else (v,)
    return any(isinstance(x, torch.Tensor) and x.is_floating_point() for x in vals) or v is None


def _lookup_by_integer_input(gm: fx.GraphModule, placeholders: list) -> Optional[fx.Node]:
    """The first node that reads a floating-point value at places an integer graph input (or a value computed
    from one) names — ``W[ids]``, ``index_select(W, 0, ids)``, ``gather``, ``embedding`` — or None. Such a
    lookup is per-token work on whatever the integer input holds (token ids under another spelling), so a
    graph with one is not a graph with nothing to share."""
    ints = {p for p in placeholders for v in [example_value(p)]
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and not v.is_floating_point() and v.dtype != torch.bool}
    derived: set[fx.Node] = set(ints)
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method"):
            continue
        reads = [a for a in n.all_input_nodes if a in derived]
        if not reads:
            continue
        v = example_value(n)
        floats = [a for a in n.all_input_nodes for av in [example_value(a)]
                  if isinstance(av, torch.Tensor) and av.is_floating_point()]
        if floats and isinstance(v, torch.Tensor) and v.is_floating_point() and _indexes_by(n, reads):
            return n
        if isinstance(v, torch.Tensor) and not v.is_floating_point():
            derived.add(n)
    return None


def _indexes_by(n: fx.Node, index_args: list) -> bool:
    """``n`` reads its data at the places one of ``index_args`` names (an embedding, an index, a gather)."""
    if n.target in EMBEDDINGS:
        return True
    name = getattr(n.target, "__name__", n.target)
    if name in ("getitem", "__getitem__", "index_select", "gather", "take", "take_along_dim", "index"):
        return any(a is not (n.args[0] if n.args else None) for a in index_args)
    return False


def _call_constants(placeholders: list, keyed: set, extents: tuple) -> set[fx.Node]:
    """The floating-point graph inputs of a token-local graph that are no tree key, no position input and no
    parameter, and have no dim of a token extent (``extents``: B and L, or T for flattened rows; expert weights
    sliced from a parameter before a graph break: DBRX's ``w1[expert]``): *per-call constants*, the same tensor
    for every row. A packed row computes the same function of (its own tree inputs, these tensors) as each
    dense row it stands for, whatever they hold, so they are CONST to the rules (which, as for parameters, admit
    no extent > 1 along a token dim); the probes of a dense region never read them (``passes/repack.py``),
    since their values differ from call to call."""
    out = set()
    for p in placeholders:
        v = example_value(p)
        if p in keyed or is_static_input(p) or not isinstance(v, torch.Tensor) or not v.is_floating_point() \
                or v.dim() == 0:
            continue
        if any(hint(s) in extents for s in v.shape):
            continue
        out.add(p)
    return out


def _one_row(p: fx.Node) -> bool:
    """The graph input ``p`` has one row at every call: dim 0 of its example value is the int 1, a size Dynamo
    specialised (guarded), not a symbol."""
    v = example_value(p)
    return isinstance(v, torch.Tensor) and v.dim() >= 1 and type(v.shape[0]) is int and v.shape[0] == 1


def _free_float(p: fx.Node, ndim: int) -> bool:
    """A floating ``ndim``-D graph input that is not a parameter or buffer."""
    v = example_value(p)
    return isinstance(v, torch.Tensor) and v.dim() == ndim and v.is_floating_point() and not is_static_input(p)


def _row_inputs(placeholders: list, T: int) -> list[fx.Node]:
    """The per-row inputs of a graph over T flattened tokens: every input ``[T, ...]`` of 2 dims or more that
    is not a parameter or buffer. Each is a tree key (rows merge when all of them agree at the row), so the
    forward is exact whatever they hold; a 1-D input (``[n]`` expert token indices, even when n == T) is
    dense."""
    return [p for p in placeholders for v in [example_value(p)]
            if isinstance(v, torch.Tensor) and v.dim() >= 2 and hint(v.shape[0]) == T
            and not isinstance(v, torch.nn.Parameter) and not is_static_input(p)]


def _computes_packed(n: fx.Node) -> bool:
    """``n`` computes (not a view, cast or index: :data:`_CHEAP`) a TOKEN value: work the packed graph does once
    per tree node."""
    return n.op in ("call_function", "call_method") and n.target not in _CHEAP and get_axes(n).is_token


def attention_inputs(attentions: list, mask_args: list) -> tuple[set, set]:
    """(everything the attentions read, masks included; everything their queries, keys and values read)."""
    needed: set[fx.Node] = set()
    needed_qkv: set[fx.Node] = set()
    for a, m in zip(attentions, mask_args):
        for operand in node_args(a):
            anc = masks_mod.ancestors(operand)
            needed.update(anc)
            if operand is not m:
                needed_qkv.update(anc)
    return needed, needed_qkv


def classify_masks(attentions, mask_args, mask_nodes, mask_keys, values, input_mask, outside: set) -> dict:
    """Every causal attention's :class:`.masks.MaskInfo`: ``is_causal`` alone is causal; a mask from outside the
    graph means what :mod:`.input_masks` read off it; any other mask is probed (:func:`.masks.classify`).
    Attentions without a mask and without ``is_causal`` are left out (the sdpa rule names them)."""
    classified: dict[fx.Node, masks_mod.MaskInfo] = {}
    for a, m in zip(attentions, mask_args):
        is_causal = arg(a, 5, "is_causal", False)
        if m is None:
            if is_causal:
                classified[a] = masks_mod.MaskInfo("causal")
            continue
        if is_causal:
            raise CannotReplay(Code.MASK_USE, "attention with both a mask and is_causal=True", a)
        if a in outside:
            classified[a] = masks_mod.MaskInfo("causal+keypad", keypad=input_mask.source, window=input_mask.window)
            continue
        if m not in mask_nodes:
            raise CannotReplay(Code.MASK_USE, "attention mask is also used outside attention masks", a)
        if not mask_keys:
            raise CannotReplay(Code.MASK_SOURCE,
                               "the attention mask is built in the graph without any [B, L] input (token ids, "
                               "attention mask): its meaning cannot be probed; use is_causal=True", a)
        classified[a] = masks_mod.classify(a, m, mask_keys, values)
    return classified


def mask_guards(canon, attentions, mask_args, classified, outside, input_mask, sequences, mask_keys,
                 placeholders, example_inputs) -> list[BatchGuard]:
    """The per-call guards of what the mask classification assumed: no query without keys (eager additive
    masks), the mask from outside the graph still causal & key padding, well-formed packed sequences, the
    length a probed meaning is proven for."""
    guards = eager_attention.mask_guards(canon, {a: i for a, i in classified.items() if a not in outside},
                                         placeholders)
    if input_mask is not None:
        guards.append(input_mask.guard())
    if sequences is not None:
        guards.append(masks_mod.sequences_guard(classified[attentions[0]], placeholders))
    raw = dict(zip(placeholders, example_inputs))
    for m in dict.fromkeys(m for a, m in zip(attentions, mask_args)
                           if a in classified and a not in outside and isinstance(m, fx.Node)):
        a = next(a for a, mm in zip(attentions, mask_args) if mm is m)
        g = masks_mod.meaning_guard(a, m, classified[a], mask_keys, placeholders, raw)
        if g is not None:  # a dynamic-length graph whose mask is proven up to a length only: O(1) length guard
            guards.append(g)
    return guards


def outside_input_mask(outside: dict, placeholders: list, example_inputs: Sequence[Any]) -> Optional[input_masks.InputMask]:
    """The one mask from outside the graph that the attentions in ``outside`` use, classified
    (:mod:`.input_masks`); None when there is none. Attentions with different such masks: CannotReplay (the
    tree has one key padding)."""
    if not outside:
        return None
    masks = list(dict.fromkeys(outside.values()))
    if len(masks) > 1:
        raise CannotReplay(Code.INPUT_MASK, f"the attentions use {len(masks)} different masks from outside the graph "
                           f"({', '.join(m.name for m in masks)}); one is supported", next(iter(outside)))
    a = next(iter(outside))
    return input_masks.classify_input_mask(a, masks[0], placeholders, example_inputs)


def sequences_input(attentions: list[fx.Node], classified: dict) -> Optional[fx.Node]:
    """The position-id input of a padding-free graph (every attention ``causal+sequences`` of the same
    input), None when no attention is; CannotReplay when only some are (the tree is over sequences or over
    rows, not both)."""
    seqs = {classified[a].sequences if a in classified else None for a in attentions}
    if seqs <= {None}:
        return None
    if len(seqs) > 1:
        names = sorted(str(classified[a]) if a in classified else "bidirectional" for a in attentions)
        raise CannotReplay(Code.PACKED_SEQUENCES,
                           f"attentions disagree on packed sequences ({', '.join(dict.fromkeys(names))}): some "
                           f"are causal within the sequences of a padding-free row, others are not")
    return next(iter(seqs))


def check_column_free(gm: fx.GraphModule, mask_nodes: set, sequences: fx.Node) -> None:
    """In a padding-free graph a token's value may depend on its sequence only, not on its column in the
    row: a packed token stands for tokens at different columns. A TOKEN value without a row dim is a
    function of the column alone (``arange(L)`` outside the masks, a per-position table made outside the
    graph): CannotReplay."""
    for n in gm.graph.nodes:
        if n.op == "output" or n in mask_nodes:
            continue
        ax = AXES.get(n)
        if ax is not None and ax.is_token and ax.row is None and not ax.local:  # flattened tokens keep their rows
            what = "a per-position input" if n.op == "placeholder" else "a value computed from the column"
            raise CannotReplay(Code.PACKED_SEQUENCES,
                f"padding-free batch (the attentions are causal within the sequences that {sequences.name} "
                f"starts): {what} ({n.name}) depends on the column in the row, not on the position in the "
                f"sequence; pass position ids instead", n)


def is_token_shaped(p: fx.Node, B: int, L: int) -> bool:
    """A per-token input: [B, L] (ids, position ids, masks) or [B, L, ...] (embeddings, hidden states,
    rotary tables per row), not a parameter or buffer. Its leading dims are the row and the position."""
    v = example_value(p)
    return isinstance(v, torch.Tensor) and v.dim() >= 2 and hint(tuple(v.shape[:2])) == (B, L) \
        and not isinstance(v, torch.nn.Parameter) and not is_static_input(p)


def position_dim(p: fx.Node, B: int, L: int) -> Optional[int]:
    """The position dim of a per-position input shared by every row: [L, ...] (dim 0) or [1, L, ...] (dim 1),
    e.g. rotary cos/sin tables computed outside the graph; None for anything else. Such an input is the
    same in every row, so it is no tree key: the packed graph reads it at each packed token's column."""
    v = example_value(p)
    if not isinstance(v, torch.Tensor) or isinstance(v, torch.nn.Parameter) or is_static_input(p) or v.dim() < 1:
        return None
    shape = hint(tuple(v.shape))
    if shape[0] == L and not (B == L and v.dim() == 1):
        return 0
    if v.dim() >= 2 and shape[0] == 1 and shape[1] == L:
        return 1
    return None


def find_token_ids_or_none(gm: fx.GraphModule) -> Optional[fx.Node]:
    try:
        return find_token_ids(gm)
    except CannotReplay:
        return None


def ids_joined_to_constants(gm: fx.GraphModule) -> Optional[tuple[fx.Node, fx.Node, int]]:
    """(embedding, ids, P) when an ``embedding`` reads integer ids the graph concatenates along the length from
    a [B, L] integer input ``ids`` (views and casts aside) and P tokens no input's values reach (a constant
    prefix or suffix: CPM-Ant's ``cat((arange(a, b).repeat(B, 1), input_ids), 1)``); None otherwise. Only a
    diagnosis: such ids are not a tree input (:func:`find_token_ids`)."""
    for n in gm.graph.nodes:
        if not (n.op == "call_function" and n.target in EMBEDDINGS):
            continue
        src = _strip_views(n.args[0])
        v = example_value(src)
        if not (is_op(src, "cat") and isinstance(v, torch.Tensor) and v.dim() == 2 and not v.is_floating_point()):
            continue
        parts = src.args[0] if src.args else src.kwargs.get("tensors")
        dim = arg(src, 1, "dim", 0)
        if not isinstance(parts, (list, tuple)) or not isinstance(dim, int) or normalize_dim(dim, 2) != 1:
            continue
        ids = [p for p in parts if isinstance(p, fx.Node) and _is_int_input(_strip_views(p))]
        rest = [p for p in parts if p not in ids]
        if len(ids) == 1 and rest and all(_reads_no_input_values(p) for p in rest):
            extra = sum(hint(example_value(p).shape[1]) for p in rest)
            return n, _strip_views(ids[0]), extra
    return None


def _is_int_input(n: fx.Node) -> bool:
    v = example_value(n)
    return n.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim() == 2 and not v.is_floating_point()


def _reads_no_input_values(n: Any) -> bool:
    """A 2-D tensor computed without the values of any tensor input (sizes read with ``size()`` aside)."""
    if not isinstance(n, fx.Node) or not isinstance(example_value(n), torch.Tensor) or example_value(n).dim() != 2:
        return False
    outside = masks_mod.ancestors(n, lambda a: not (a.op == "call_method" and a.target == "size"))
    return not any(a.op == "placeholder" and isinstance(example_value(a), torch.Tensor) for a in outside)


def unmasked(attn: fx.Node) -> bool:
    """An SDPA without a mask and without ``is_causal``: never a tree attention (the sdpa rule makes it a per-token
    op when its token dims are batch dims, else refuses it as bidirectional)."""
    mask = arg(attn, 3, "attn_mask")
    return mask is None and not arg(attn, 5, "is_causal", False)


def captured_length(token_ids: Optional[fx.Node], attentions: list[fx.Node]) -> Any:
    """The batch's position extent L as captured (an int, or a SymInt under dynamic shapes, unlike the hinted
    ints the analysis uses): the token ids' dim 1, or without them the query length of the attention
    :func:`attention_batch_dims` reads."""
    if token_ids is not None:
        return example_value(token_ids).shape[1]
    attn = next((a for a in attentions if not unmasked(a)), attentions[0])
    return example_value(attn.args[0] if attn.args else attn.kwargs.get("query")).shape[-2]


def attention_batch_dims(attn: fx.Node) -> tuple[int, int]:
    """(B, L) of a graph without token ids: the batch and query-length dims of an attention's query
    [B, H, L, head_dim]."""
    q = example_value(attn.args[0] if attn.args else attn.kwargs.get("query"))
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise CannotReplay(Code.ATTENTION_LAYOUT, "attention query is not a [B, H, L, head_dim] tensor", attn)
    return hint(q.shape[0]), hint(q.shape[-2])


def mask_scalar_guards(mask_args, placeholders: list, values: dict) -> list:
    """A per-call ``scalar_equals`` guard for every 0-dim tensor input a mask is computed from (a float module
    attribute Dynamo lifts under ``dynamic=True``, e.g. an embedding's ``norm_type`` on the way to a per-key
    bias projected from the hidden states): the mask's meaning is proven at its example value only."""
    seen, guards = set(), []
    for m in mask_args:
        if not isinstance(m, fx.Node):
            continue
        for n in masks_mod.ancestors(m):
            v = values.get(n) if n.op == "placeholder" else None
            if n in seen or not isinstance(v, torch.Tensor) or v.dim() != 0 or is_static_input(n):
                continue
            seen.add(n)
            guards.append(scalar_equals(placeholders.index(n), v.item(), f"mask scalar {n.name}"))
    return guards


def check_masks_are_computed(attentions, mask_args, tree_inputs, B: int, L: int) -> None:
    """An attention mask must be computed inside the graph from [B, L] tree inputs (or be absent, with
    ``is_causal``): a mask that is itself a graph input, or is built from one (a [B, 1, L, L] mask made
    before a per-block graph), cannot be classified from inside the graph; nor can one computed from a
    per-row input of another length (:func:`_other_axis_reason`)."""
    for a, m in zip(attentions, mask_args):
        if not isinstance(m, fx.Node):
            continue
        for n in masks_mod.ancestors(m):
            if n.op != "placeholder" or is_static_input(n):
                continue
            v = example_value(n)
            if not isinstance(v, torch.Tensor) or v.dim() == 0:  # a lifted scalar: guarded (mask_scalar_guards)
                continue
            if n not in tree_inputs:
                shape = list(hint(tuple(v.shape)))
                if len(shape) == 2 and shape[0] == B and shape[1] != L:
                    raise CannotReplay(Code.MASK_SOURCE, _other_axis_reason(a, n, shape, L), a)
                raise CannotReplay(Code.INPUT_MASK,
                    f"the attention mask comes from graph input {n.name} {shape} (a mask "
                    f"built outside the compiled graph, e.g. a [B, 1, L, L] mask passed to a per-block graph): "
                    f"its meaning cannot be checked inside the graph; compile the mask's construction with the "
                    f"graph, or call the block without a mask (is_causal=True)", a)
            if v.dim() != 2:
                raise CannotReplay(Code.MASK_FROM_VALUES,
                                   f"the attention mask is computed from the [B, L, ...] input {n.name} "
                                   f"(only [B, L] inputs can be probed)", a)


def _other_axis_reason(attention: fx.Node, source: fx.Node, shape: list, L: int) -> str:
    """Why a mask computed from a per-row ``[B, P]`` input with ``P != L`` is refused: its columns are
    not the token positions, so it describes another axis of the row — BLT's byte patches, whose P lengths
    are computed before the graph; the patch id of byte t is ``#{p : start_p <= t} - 1`` with ``start =
    cumsum(lengths) - lengths``, and the cross-attentions run between the bytes and the patches.

    A value of such a group of tokens is not a value of one token's prefix: a group that straddles the end
    of the prefix two rows share holds different tokens in each row (its pooled value differs), and the
    rows' input itself is no tree key (rows sharing a prefix may differ in it). The prefix tree shares
    tokens only, so nothing can be proven per token; the attention's query and key lengths are named when
    one of them is not L (the other axis)."""
    lengths = ""
    q = example_value(attention.args[0] if attention.args else attention.kwargs.get("query"))
    k = example_value(attention.args[1] if len(attention.args) > 1 else attention.kwargs.get("key"))
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() >= 2 and k.dim() >= 2:
        lq, lk = hint(q.shape[-2]), hint(k.shape[-2])
        if lq != L or lk != L:
            lengths = f"; the attention runs from {lq} query positions to {lk} key positions"
    return (f"the attention mask is computed from {source.name} {shape}, a per-row input whose {shape[1]} "
            f"columns are not the L = {L} token positions: another axis of the row (e.g. groups of tokens such "
            f"as BLT's byte patches, whose lengths such an input gives, computed before this graph){lengths}. "
            f"A value of a group is not a value of one token's prefix (a group that straddles the end of a "
            f"prefix two rows share holds different tokens in each row), and that input is no per-token key "
            f"(rows that share a prefix may differ in it); the prefix tree shares tokens, not groups, so the "
            f"graph runs unchanged")


# --------------------------------------------------------------------------------------------------
# emission


def materialize(data: torch.Tensor, index: torch.Tensor, row: Optional[int], pos: int, dropped: bool = False,
                flat: int = 0) -> torch.Tensor:
    """Dense value of a packed one: ``dense[.., b, .., t, ..] = data[.., 0, .., index[b, t], ..]``, and 0
    where ``index[b, t] == -1`` (a padded position that ``drop_padding=True`` left out of the tree). A
    position-only value (``row`` None, dense ``[.., L', ..]`` or ``[.., 1, .., L', ..]``: the original's
    shape, row-free) reads ``data[.., column_index(index)[t], ..]``.

    ``data`` has extent 1 at ``row`` and N at ``pos``; ``index`` is the (windowed) [B', L'] index.
    Its backward is a scatter-add: a packed token used by several (b, t) sums their gradients; a nonzero
    gradient at a dropped position raises brcompile.runtime.tree.DroppedPositionGradError (the loss read padding).

    ``dropped`` (option drop_padding): the index may hold -1, read through brcompile::read_packed (opaque to
    Inductor, so the backward check runs compiled); otherwise a plain gather Inductor can fuse.
    """
    if flat:  # a flattened value: [.., N·k, ..] -> [.., B·L·k, ..] (entry (b·L + t)·k + s = packed n·k + s)
        x = data.movedim(pos, 0).unflatten(0, (-1, flat))  # [N, k, ...]
        x = read_packed(x, index) if dropped else x[index]  # [B, L, k, ...]
        return x.flatten(0, 2).movedim(0, pos)
    if row is None:  # a position-only value: [.., N, ..] -> [.., L', ..], the original's shape
        x = data.movedim(pos, 0)  # [N, ...]
        col = column_index(index)
        x = read_packed(x, col) if dropped else x[col]  # [L', ...]
        return x.movedim(0, pos)
    x = data.movedim((row, pos), (0, 1))[0]  # [N, ...]
    x = read_packed(x, index) if dropped else x[index]  # [B', L', ...]
    return x.movedim((0, 1), (row, pos))


def column_index(index: torch.Tensor) -> torch.Tensor:
    """[B', L'] index -> [L']: for each column t the packed entry of some row's (b, t) that the tree kept.

    A position-only value's dense value at t is the same in every row (it has no row dim), and by the
    invariant its packed entry k equals it at every (b, t) with ``index[b, t] == k``: any kept entry of
    column t holds it. ``index.amax(0)`` is such an entry, or -1 only where every row's (b, t) was dropped
    (drop_padding) — then nothing defines it and it reads as a dropped position (0, gradient checked).
    The gradient of ``dense[t]`` lands on that one entry: the entries of column t are the same function of
    the position (same Jacobian), so the parameters' gradients are the dense ones."""
    return index.amax(0)


class Packer:
    """Builds the packed graph from an :class:`Analysis` (see module docstring)."""

    def __init__(self, an: Analysis, options: PackOptions):
        self.an = an
        self.options = options
        self.notes = an.ctx.notes
        self.graph = fx.Graph()
        self.env: dict[fx.Node, Any] = {}  # CONST/DENSE value, or packed data for TOKEN
        self._dense: dict[fx.Node, Any] = {}
        self._index: dict[Window, fx.Node] = {}
        self._tree: dict[str, fx.Node] = {}
        self._N: Optional[fx.Node] = None

    # --- helpers used by rule emitters -----------------------------------------------------------
    def tree(self, name: str) -> fx.Node:
        return self._tree[name]

    def N(self) -> fx.Node:
        if self._N is None:
            self._N = self.graph.call_method("size", (self._tree["position"], 0))
        return self._N

    def index(self, window: Window) -> fx.Node:
        """The [B', L'] index of a window: the tree index with the window's slices applied."""
        if window not in self._index:
            idx = self._tree["index"]
            for which, s in window.steps:
                s = slice(*(self._map_scalar(v) for v in s))
                key = (slice(None), s) if which == "pos" else (s,)
                idx = self.graph.call_function(operator.getitem, (idx, key))
            self._index[window] = idx
        return self._index[window]

    def _map_scalar(self, v):
        return self.value(v) if isinstance(v, fx.Node) else v

    def static_shape(self, node: fx.Node) -> list[int]:
        return list(shape_of(node))

    def static_sizes(self, node: fx.Node) -> list[int]:
        """The dense output shape as ints; refuses symbolic non-token dims (they would be baked)."""
        ax = get_axes(node)
        v = example_value(node)
        sizes = []
        for d, s in enumerate(v.shape):
            if isinstance(s, torch.SymInt) and d not in ax.token_dims() and s.node.maybe_as_int() is None:
                raise CannotReplay(Code.SYMBOLIC_SIZE, "a non-token dim of a packed value has a symbolic size", node)
            sizes.append(hint(s))
        return sizes

    def packed(self, arg: Any) -> Any:
        """An argument as the packed graph sees it inside a TOKEN computation."""
        if not isinstance(arg, fx.Node):
            return arg
        if arg in self.an.tree_inputs and arg not in self.env and self.an.ctx.rows:
            # [T, ...] rows (L = 1) -> the flattened layout [N, ...]: node k is row rep_row[k]
            self.env[arg] = self.graph.call_function(operator.getitem, (self._placeholders[arg],
                                                                        self._tree["rep_row"]))
        elif arg in self.an.tree_inputs and arg not in self.env:
            x = self._placeholders[arg]  # [B, L, ...] -> [1, N, ...]
            g = self.graph.call_function(operator.getitem, (x, (self._tree["rep_row"], self._tree["position"])))
            self.env[arg] = self.graph.call_method("unsqueeze", (g, 0))
        elif arg in self.an.ctx.position_inputs and arg not in self.env:
            x = self._placeholders[arg]  # [L, ...] -> [N, ...], or [1, L, ...] -> [1, N, ...]
            key = self._tree["position"] if self.an.ctx.position_inputs[arg] == 0 else \
                (slice(None), self._tree["position"])
            self.env[arg] = self.graph.call_function(operator.getitem, (x, key))
        return self.env[arg]

    def value(self, arg: Any) -> Any:
        return self.packed(arg) if not get_axes(arg).is_token else self.dense(arg)

    def dense(self, arg: Any) -> Any:
        """An argument's dense value: a TOKEN value is materialised (once)."""
        if not isinstance(arg, fx.Node):
            return arg
        ax = get_axes(arg)
        if not ax.is_token:
            return self.packed(arg)
        if arg not in self._dense:
            if arg.op == "placeholder":
                self._dense[arg] = self._placeholders[arg]
            elif self._input_derived(arg) or self._sinks_window(arg):
                self._dense[arg] = self._emit_copy(arg, self.dense)
            else:
                self._dense[arg] = self.graph.call_function(
                    materialize, (self.packed(arg), self.index(ax.window), ax.row, ax.pos,
                                  self.options.drop_padding, ax.flat))
        return self._dense[arg]

    def _sinks_window(self, n: fx.Node) -> bool:
        """True when ``n``'s dense value is cheaper recomputed from its inputs' dense values than gathered.

        For a value read through a small window (``logits_to_keep``: the LM head on the last C + 1 columns
        only) the packed graph would run ``n`` on all N packed tokens and then gather B'·L' rows; when every
        token input of ``n`` has the same window and that window holds at most WINDOW_SINK_FRACTION of the
        B·L positions, ``n`` runs instead on the dense inputs — the original graph's own op on the original
        dense values, so exact — and the packed ``n`` becomes dead code unless something else needs it."""
        # with positions left out (drop_padding) the inputs read 0 there, so n's dense value there is n of zeros
        # (0 for a bias-free LM head); a gradient reaching them is still checked where the inputs are read
        if n.op not in ("call_function", "call_method") or n in self.notes:
            return False
        ax = get_axes(n)
        if ax.window is None or ax.window.is_whole:
            return False
        toks = [a for a in node_args(n) if get_axes(a).is_token]
        if not toks or any(get_axes(a).window != ax.window for a in toks):
            return False
        shape = shape_of(n)
        kept = (1 if ax.row is None else hint(shape[ax.row])) * hint(shape[ax.pos])  # row None: position-only
        return kept <= WINDOW_SINK_FRACTION * self.an.ctx.B * self.an.ctx.L

    def _input_derived(self, n: fx.Node) -> bool:
        """True when ``n`` is a cheap function of the dense inputs (recompute it rather than gather)."""
        if n.op == "placeholder":
            return True
        if n.target not in _CHEAP:
            return False
        return all(self._input_derived(a) if get_axes(a).is_token else not get_axes(a).is_dense
                   for a in node_args(n))

    def copy(self, node: fx.Node) -> fx.Node:
        return self._emit_copy(node, self.packed)

    def _emit_copy(self, node: fx.Node, mapper) -> fx.Node:
        args, kwargs = fx.node.map_aggregate((node.args, node.kwargs),
                                             lambda a: mapper(a) if isinstance(a, fx.Node) else a)
        new = self.graph.create_node(node.op, node.target, tuple(args), dict(kwargs))
        new.meta["from_node"] = node.name
        return new

    def _emit_killer(self, node: fx.Node, operand: fx.Node, mask: fx.Node) -> fx.Node:
        """A multiplication by a per-call mask that kills positions (passes/liveness.py): its operand read as
        ``where(mask != 0, x, 0)`` (liveness.safe_operand), so a left-out position's zero-filled value cannot
        make the product ``0 * inf``."""
        safe = self.graph.call_function(safe_operand, (self.dense(operand), self.dense(mask)))
        args = tuple(safe if a is operand else self.dense(a) if isinstance(a, fx.Node) else a for a in node.args)
        kwargs = {k: self.dense(v) if isinstance(v, fx.Node) else v for k, v in node.kwargs.items()}
        new = self.graph.create_node(node.op, node.target, args, kwargs)
        new.meta["from_node"] = node.name
        return new

    # --- driver -------------------------------------------------------------------------------
    def build(self) -> fx.GraphModule:
        gm = self.an.gm
        plan = self.an.liveness if self.options.drop_padding else None
        self._killers = {u: (a, m) for u, a, m in (plan.killers if plan is not None else ())}
        self._placeholders: dict[fx.Node, fx.Node] = {}
        for p in self.an.placeholders:
            new = self.graph.placeholder(p.name)
            new.meta.update({k: v for k, v in p.meta.items() if k != AXES.key})
            self._placeholders[p] = new
            if not get_axes(p).is_token:
                self.env[p] = new
        for name in GRAPH_ARGS:
            self._tree[name] = self.graph.placeholder(f"tree_{name}")
        spans = _checkpoint_spans(gm)
        regions: list[tuple[checkpoints.CheckpointRegion, list[fx.Node]]] = []  # packed nodes per checkpoint
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output") or node in self.an.ctx.mask_nodes:
                continue
            if node in spans:
                if not regions or regions[-1][0] is not spans[node]:
                    regions.append((spans[node], []))
                last = next(iter(reversed(self.graph.nodes)))
            ax = get_axes(node)
            rule = rule_for(node)
            if node in self._killers and node not in self.notes:
                self.env[node] = self._emit_killer(node, *self._killers[node])
            elif ax.is_dense:
                if rule is not None and rule.emit is not None and node in self.notes:
                    self.env[node] = rule.emit(self, node)
                else:
                    self.env[node] = self._emit_copy(node, self.dense)
            elif rule is not None and rule.emit is not None and (
                    ax.is_token or any(get_axes(a).is_token for a in node_args(node))):
                self.env[node] = rule.emit(self, node)
            elif ax.is_const and any(get_axes(a).is_token for a in node_args(node)):
                self.env[node] = self._emit_copy(node, self.value)
            else:
                self.env[node] = self.copy(node)
            if isinstance(self.env[node], fx.Node):
                self.env[node].meta.setdefault("from_node", node.name)
            if node in spans:
                made = regions[-1][1]
                n = last.next
                while n.op != "root":
                    made.append(n)
                    n = n.next
        out = next(n for n in gm.graph.nodes if n.op == "output")
        outs = fx.node.map_aggregate(out.args[0], lambda a: self.dense(a) if isinstance(a, fx.Node) else a)
        self.graph.output(outs)
        writes = {self.env[n] for n in self.an.ctx.input_writes if n in self.env}  # unused results, kept
        self.graph.eliminate_dead_code(is_impure_node=lambda n: n in writes or n.is_impure())
        self.graph.lint()
        new_gm = fx.GraphModule(gm, self.graph, class_name="PackedGraph")
        if regions:  # the packed nodes of each activation checkpoint back into a checkpoint call
            checkpoints.outline_checkpoints(new_gm, regions)
        new_gm.recompile()
        TOKEN_OUTPUTS.set(new_gm, self._token_outputs(out))
        SEQUENCES.set(new_gm, self.an.sequences_position)  # padding-free: the tree is over sequences (runtime)
        ROWS.set(new_gm, self.an.ctx.rows)  # [T, ...] tree inputs: the runtime's keys are row_keys, [T, 1, ...]
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        kept = set(new_gm.graph.nodes)
        written = [n for n in self.an.ctx.input_writes if self.env.get(n) in kept]
        if len(written) != len(self.an.ctx.input_writes):  # a write the rewrite dropped would lose its effect
            raise CannotReplay(Code.INPUT_WRITE, "an in-place write into a graph input was dropped by the rewrite",
                               next(iter(self.an.ctx.input_writes)))
        # inputs the graph writes into (axes.input_write_destination): the runtime snapshots them
        WRITTEN_INPUTS.set(new_gm, tuple(sorted({placeholders.index(d) for d in self.an.ctx.input_writes.values()})))
        return new_gm

    def _token_outputs(self, out: fx.Node) -> tuple[int, ...]:
        """Positions of the graph's outputs that are whole [B, L, ...] TOKEN values read densely through the
        tree's index (row 0, position 1, no window): the runtime tags them with the call's tree, so a next
        graph that receives one reuses that tree (brcompile.runtime provenance). None under drop_padding."""
        outs = out.args[0]
        if self.options.drop_padding or not isinstance(outs, (tuple, list)):
            return ()
        B, L = self.an.ctx.B, self.an.ctx.L
        found = []
        for i, a in enumerate(outs):
            if not isinstance(a, fx.Node):
                continue
            ax = get_axes(a)
            shape = shape_of(a)
            if ax.is_token and ax.row == 0 and ax.pos == 1 and ax.window is not None and ax.window.is_whole \
                    and shape is not None and len(shape) >= 2 and tuple(shape[:2]) == (B, L):
                found.append(i)
        return tuple(found)


def _checkpoint_spans(gm: fx.GraphModule) -> dict[fx.Node, "checkpoints.CheckpointRegion"]:
    """Node -> its activation-checkpoint region (passes/checkpoint.py): every node from a region's first to
    its last tagged node (canonicalisation's new nodes included). Regions that overlap: CannotReplay."""
    order = list(gm.graph.nodes)
    bounds: dict = {}
    for i, n in enumerate(order):
        r = checkpoints.region_of(n)
        if r is not None:
            bounds[r] = (bounds.get(r, (i, i))[0], i)
    spans: dict = {}
    for r, (lo, hi) in bounds.items():
        for n in order[lo:hi + 1]:
            if n in spans or checkpoints.region_of(n) not in (None, r):
                raise CannotReplay(Code.CHECKPOINT_INTERLEAVED,
                                   f"activation checkpoint {r.body}: its nodes are interleaved with others", n)
            spans[n] = r
    return spans


def build_packed_graph(an: Analysis, options: Optional[PackOptions] = None) -> fx.GraphModule:
    """Emit the packed graph of an analysed graph (transactional: ``an.gm`` is not modified)."""
    return Packer(an, options or PackOptions()).build()


__all__ = ["Analysis", "PackOptions", "build_packed_graph", "materialize", "find_token_ids"]
