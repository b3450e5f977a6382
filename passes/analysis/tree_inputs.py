"""The tree-inputs stage's analysis (passes/pipeline.py): (B, L), the token ids, the tree inputs and the
per-position inputs of a graph; graphs without attention analysed to the end (token-local graphs, scan
graphs); what the analysis proved, :class:`Analysis`."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from brcompile.passes import probe
from brcompile.passes.analysis import input_masks, masks as masks_mod
from brcompile.passes.analysis.axes import (
    AxesContext, Materialisation, example_value, get_axes, hint, is_static_input, node_args, propagate,
    rule_for,
)
from brcompile.passes.refusals import CannotReplay, Code, NothingToShare
from brcompile.passes.analysis.guards import BatchGuard
from brcompile.passes.canonical import attention as eager_attention
from brcompile.passes.analysis.rules import scan as scan_rules
from brcompile.passes.analysis.rules.attention import LazyGather
from brcompile.passes.spellings import (
    CHEAP_VIEWS, EMBEDDINGS, MATRIX_RIGHT_OPERAND, VALUE_MOVES, WEIGHT_TRANSPOSES, arg, op_name,
)
from brcompile.runtime.tree import row_keys

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AttentionSite:
    """One attention of the graph (an SDPA node) and its ``attn_mask`` argument: a node (computed in the graph, or
    a mask from outside it), or None without a mask."""

    node: fx.Node
    mask: Optional[fx.Node]

    @staticmethod
    def of(attention: fx.Node) -> "AttentionSite":
        """The site of SDPA node ``attention``, its mask read off its arguments."""
        return AttentionSite(attention, arg(attention, 3, "attn_mask"))


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
    #: the live-position plan (passes/analysis/liveness.py), set by the backend when some positions may be left out
    liveness: Optional[Any] = None
    liveness_note: Optional[str] = None  # why the backend narrowed or dropped the plan (explain)
    #: tree keys the graph computes from its inputs (passes/canonical/keys.py: ComputedKeys), read from its last
    #: placeholders: each call passes their values after its own inputs; None when every key is an input
    keys: Optional[Any] = None

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
        """The gathers read from packed values without their dense input (their ``LazyGather`` notes)."""
        return list(self.ctx.noted(LazyGather))


def _strip_views(n: fx.Node) -> fx.Node:
    while n.op != "placeholder" and (rule_for(n) is not None) and n.args and isinstance(n.args[0], fx.Node) \
            and (n.target in CHEAP_VIEWS):
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
    """CannotReplay for a graph with attention but no tree input: no per-token input at all (token ids the
    graph builds along an axis of its own are inputs by now: passes/canonical/keys.py)."""
    raise CannotReplay(Code.NO_TOKEN_INPUT,
                       f"no [B, L] integer token input feeding an embedding, and the attentions read no per-token "
                       f"[B={B}, L={L}, ...] input (token ids, inputs_embeds or hidden states)")


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
    needed = set().union(*(probe.ancestors(s) for s in scans))
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
    if all(n.target in CHEAP_VIEWS for n in ops):  # hidden.reshape(-1, D) alone between two graph breaks
        what = ", ".join(dict.fromkeys(op_name(n) for n in ops)) or "nothing"
        raise NothingToShare(Code.NO_PER_TOKEN_WORK,
                             f"{nothing}: the graph only views, casts or indexes its inputs ({what}): nothing to "
                             f"compute")
    if not any(_float_arithmetic(n) for n in ops):  # a mask built from [B, L] metadata; a sort of routing keys
        what = ", ".join(dict.fromkeys(op_name(n) for n in ops
                                       if n.target not in CHEAP_VIEWS and n.target not in VALUE_MOVES))
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
    or move of values: :data:`CHEAP_VIEWS`, :data:`VALUE_MOVES`)."""
    if n.op == "call_module":  # a module not inlined: assumed to compute
        return True
    if n.target in CHEAP_VIEWS or n.target in VALUE_MOVES:
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
    no extent > 1 along a token dim); the probes of a dense region never read them (``passes/analysis/repack.py``),
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
    """``n`` computes (not a view, cast or index: :data:`CHEAP_VIEWS`) a TOKEN value: work the packed graph does once
    per tree node."""
    return n.op in ("call_function", "call_method") and n.target not in CHEAP_VIEWS and get_axes(n).is_token


def attention_inputs(sites: Sequence[AttentionSite]) -> tuple[set, set]:
    """(everything the attentions read, masks included; everything their queries, keys and values read)."""
    needed: set[fx.Node] = set()
    needed_qkv: set[fx.Node] = set()
    for site in sites:
        for operand in node_args(site.node):
            anc = probe.ancestors(operand)
            needed.update(anc)
            if operand is not site.mask:
                needed_qkv.update(anc)
    return needed, needed_qkv


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


def check_masks_are_computed(sites: Sequence[AttentionSite], tree_inputs, B: int, L: int) -> None:
    """An attention mask must be computed inside the graph from [B, L] tree inputs (or be absent, with
    ``is_causal``): a mask that is itself a graph input, or is built from one (a [B, 1, L, L] mask made
    before a per-block graph), cannot be classified from inside the graph; nor can one computed from a
    per-row input of another length (:func:`_other_axis_reason`)."""
    for site in sites:
        a, m = site.node, site.mask
        if not isinstance(m, fx.Node):
            continue
        for n in probe.ancestors(m):
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
