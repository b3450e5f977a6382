"""Computed tree keys: a token axis the graph makes from its inputs, read as inputs (docs/ARCHITECTURE.md §3.4).

A graph may embed token ids that it builds itself along an axis no input has. CPM-Ant prepends its P prompt
ids to the ``[B, L]`` input ids inside the model, ``ids' = cat((arange(a, a + P).repeat(B, 1), ids), 1)``,
builds its segments and its key padding the same way (``cat((zeros(B, P), f(ids)), 1)``,
``cat((ones(B, P), g(ids)), 1)``), and runs every attention over the ``B x (P + L)`` positions of ``ids'``.
Nothing of the graph's per-token work is indexed by the input's positions.

**The rule.** Let ``K(x)`` be an integer value the graph computes from its inputs ``x`` by a deterministic
subgraph (no random draw, no write, no parameter read: the *key graph*). Then the graph is ``G(K(x), x)``,
``G`` the graph with ``K``'s node read from an input instead, and for every call ``G(K(x), x)`` is exactly
the original's value: same ops, same operands. So ``G`` is analysed, packed and run with ``K(x)`` as one of
its inputs, evaluated per call on the call's inputs (:class:`ComputedKeys`; small integer ops over the rows)
and passed after them. ``K`` is then an ordinary tree key: positions ``(b, t)`` and ``(b', t)`` merge only
where rows ``b`` and ``b'`` agree on every key at columns ``0..t`` (docs/ARCHITECTURE.md §4), whatever ``K``
holds, and no gradient is lost, since none flows through integers. With CPM-Ant's constant prompt (the same
P ids in every row) the rows of ``ids'`` share a prefix iff their ids do, so the tree over ``ids'`` is the
ids' tree under one chain of P tokens at its root, computed once; outputs read back at ``[:, P:]`` are
windows of packed values (a slice of the ``[B, P + L]`` index). A prompt computed per row, a join along
another dim or a pad are the same rule: the tree is over what the attentions read.

**Which values become keys** (:func:`find_computed_keys`). The trigger is the token ids themselves: the
first ``embedding`` reads a 2-D integer value computed in the graph from per-call inputs none of which lies
along its axis (its shape is no such input's leading ``[B, L]``; a value like ``ids % V`` on the input's own
axis keeps the input as its key). That shape is the graph's **token axis**. The keys are the *frontier* of
that axis: of the 2-D integer values of the token axis's shape that the key graph can compute and that read a
per-call input (:func:`key_graph_problem`), those read by an op outside that set — the ids, and CPM-Ant's
segments and padding mask. Masks ``[B, L', L']`` and biases built from them stay in the graph, classified on
probes of the keys (§8). A value that only reads sizes (``arange(L').repeat(B, 1)``) is no key: it is
constant for the tree.

**Refused** (:data:`Code.JOINED_TOKEN_IDS`): embedded ids on such an axis whose key graph cannot run apart
from the graph: a random draw (a key graph would draw other numbers than the graph), a write, a module
call, or a read of a parameter or float buffer (a key computed from trainable values is no input-only key).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from brcompile.passes.analysis.axes import example_value, hint, is_inplace, is_static_input
from brcompile.passes.analysis.tree_inputs import find_token_ids_or_none
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.passes.probe import ancestors
from brcompile.passes.spellings import EMBEDDINGS, OPERATORS_NOT_INPLACE, SIZE_READS, op_name, random_draw

log = logging.getLogger(__name__)

__all__ = ["ComputedKeys", "find_computed_keys", "key_graph_problem", "lift_computed_keys", "token_axis_index"]


@dataclasses.dataclass(frozen=True)
class ComputedKeys:
    """The tree keys a graph computes from its inputs (the module docstring), lifted out of it.

    ``gm`` takes the graph's own inputs and returns the keys (a tuple, in order); the analysed graph reads
    them as its last placeholders, ``names``. ``inputs``: how many inputs the graph itself takes (the keys
    follow them in every call of the packed graph). ``sources``: per key, the op that made it (explain, logs).
    """

    gm: fx.GraphModule
    inputs: int
    names: tuple[str, ...]
    sources: tuple[str, ...]

    def __call__(self, args: Sequence[Any]) -> tuple:
        """The keys of one call: the key graph on the call's own inputs (``args[:inputs]``), without grad."""
        with torch.no_grad():
            out = self.gm(*args[:self.inputs])
        return tuple(out)

    def describe(self) -> str:
        return ", ".join(f"{n} = {s}" for n, s in zip(self.names, self.sources))


def _index_operand(emb: fx.Node) -> Any:
    """The indices an embedding reads (``F.embedding(input, weight)``; ``torch.embedding(weight, input)``)."""
    if emb.target is torch.embedding:
        return emb.args[1] if len(emb.args) > 1 else emb.kwargs.get("indices")
    return emb.args[0] if emb.args else emb.kwargs.get("input")


def token_axis_index(gm: fx.GraphModule) -> Optional[fx.Node]:
    """The value the first ``embedding`` reads as its indices, when it is a 2-D integer value computed in the
    graph (not a placeholder, views aside) from a per-call input none of whose leading dims are its shape: the
    token ids on an axis the graph makes (module docstring). None otherwise: the ids are an input read through
    views (``ids[:, :-1]``: the slice is a window of the input's axis, ``tree_inputs.find_token_ids``), or
    computed along an input's own axis (``ids % V``), or read no input."""
    if find_token_ids_or_none(gm) is not None:
        return None
    emb = next((n for n in gm.graph.nodes if n.op == "call_function" and n.target in EMBEDDINGS), None)
    if emb is None:
        return None
    x = _index_operand(emb)
    if not isinstance(x, fx.Node) or x.op == "placeholder" or not _integer_2d(x):
        return None
    shape = hint(tuple(example_value(x).shape))
    sources = [p for p in ancestors(x) if _per_call_input(p)]
    if not sources or any(hint(tuple(example_value(p).shape[:2])) == shape for p in sources):
        return None
    return x


def key_graph_problem(node: fx.Node, memo: Optional[dict] = None) -> Optional[tuple[fx.Node, str]]:
    """Why ``node`` cannot be computed apart from the graph, per call, from the graph's inputs alone: the
    first node of its ancestry that draws random numbers, writes in place, calls a module, or reads a
    parameter or a floating-point buffer, with what it does; None when it can. ``memo`` caches the answer
    per node across calls (one topological walk for a whole graph)."""
    memo = {} if memo is None else memo
    for n in ancestors(node):
        if n in memo:
            continue
        memo[n] = _own_problem(n) or next((memo[a] for a in n.all_input_nodes if memo.get(a) is not None), None)
    return memo[node]


def _own_problem(n: fx.Node) -> Optional[tuple[fx.Node, str]]:
    """What ``n`` itself does that a key graph must not (:func:`key_graph_problem`), or None."""
    if n.op == "call_module":
        return n, f"calls the module {n.target}"
    if n.op == "placeholder":
        v = example_value(n)
        if isinstance(v, torch.Tensor) and (v.requires_grad or (is_static_input(n) and v.is_floating_point())):
            return n, f"reads the parameter or buffer {n.name}"
        return None
    if n.op == "get_attr":
        return None
    draw = random_draw(n, by_name=True)
    if draw is not None:
        return n, f"draws random numbers ({draw}): a key graph run apart would draw others"
    if n.target not in OPERATORS_NOT_INPLACE and is_inplace(n):
        return n, f"writes in place ({op_name(n)})"
    return None


def find_computed_keys(gm: fx.GraphModule) -> list[fx.Node]:
    """The keys of ``gm``'s token axis (module docstring), in graph order; [] when its token ids are an input
    (:func:`token_axis_index` None). CannotReplay(JOINED_TOKEN_IDS) when the embedded ids are on an axis the
    graph makes but cannot be computed apart from it (:func:`key_graph_problem`)."""
    x = token_axis_index(gm)
    if x is None:
        return []
    memo: dict = {}
    problem = key_graph_problem(x, memo)
    if problem is not None:
        bad, what = problem
        raise CannotReplay(Code.JOINED_TOKEN_IDS,
                           f"the embedding reads token ids {x.name} {list(hint(tuple(example_value(x).shape)))} "
                           f"that the graph computes from its inputs along an axis no input has, but not as "
                           f"a function of its inputs alone: {bad.name} {what}; the tree's keys must be "
                           f"evaluated per call apart from the graph", x)
    axis = hint(tuple(example_value(x).shape))
    on_axis = {n for n in gm.graph.nodes
               if n.op != "placeholder" and _integer_2d(n) and hint(tuple(example_value(n).shape)) == axis
               and key_graph_problem(n, memo) is None and any(_per_call_input(p) for p in ancestors(n))}
    return [n for n in gm.graph.nodes if n in on_axis and any(_needs_value(u) and u not in on_axis for u in n.users)]


def lift_computed_keys(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Optional[ComputedKeys]:
    """Rewrites ``gm`` (an analysis copy) so that each key of :func:`find_computed_keys` is read from a new
    placeholder after the existing ones (named ``<node>_key``, its example value the node's) and what only
    computed the keys is gone; returns the key graph (:class:`ComputedKeys`), or None when ``gm`` has no
    computed keys. ``example_inputs`` only gives the graph's own input count."""
    keys = find_computed_keys(gm)
    if not keys:
        return None
    key_gm = _key_graph(gm, keys)
    graph = gm.graph
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    names, sources = [], []
    for k in keys:
        with graph.inserting_after(last):
            p = graph.placeholder(f"{k.name}_key")
        for meta in ("example_value", "val", "tensor_meta"):
            if meta in k.meta:
                p.meta[meta] = k.meta[meta]
        k.replace_all_uses_with(p)
        names.append(p.name)
        sources.append(_source(k))
        last = p
    _erase_unused(graph, set().union(*(ancestors(k) for k in keys)))
    graph.lint()
    gm.recompile()
    lifted = ComputedKeys(key_gm, len(example_inputs), tuple(names), tuple(sources))
    log.debug("computed tree keys: %s", lifted.describe())
    return lifted


# --------------------------------------------------------------------------------------------------
# helpers


def _integer_2d(n: fx.Node) -> bool:
    v = example_value(n)
    return isinstance(v, torch.Tensor) and v.dim() == 2 and not v.is_floating_point() and not v.is_complex()


def _per_call_input(n: fx.Node) -> bool:
    """A placeholder holding per-call data: a tensor of one dim or more that is no parameter or buffer (ids,
    masks, per-row lengths)."""
    v = example_value(n)
    return n.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim() >= 1 and not is_static_input(n)


def _needs_value(user: fx.Node) -> bool:
    """``user`` reads its operand's values, not only its size (``x.size(1)``, ``sym_size``)."""
    name = op_name(user).split(".")[0] if user.op in ("call_method", "call_function") else ""
    return name not in SIZE_READS


def _key_graph(gm: fx.GraphModule, keys: list[fx.Node]) -> fx.GraphModule:
    """A graph taking ``gm``'s inputs and returning ``keys``: the placeholders and the keys' ancestors only
    (no other node, e.g. no grad-mode switch around them)."""
    needed = set().union(*(ancestors(k) for k in keys))
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" or n in needed:
            env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[k] for k in keys))
    return fx.GraphModule(gm, graph, class_name="ComputedKeys")


def _erase_unused(graph: fx.Graph, candidates: set) -> None:
    """Erase the nodes of ``candidates`` that nothing reads any more (the keys' own subgraph), last first."""
    for n in reversed(list(graph.nodes)):
        if n in candidates and n.op not in ("placeholder", "output") and not n.users and not n.is_impure():
            graph.erase_node(n)


def _source(k: fx.Node) -> str:
    """What a key is, for reports: its op, its shape and the graph inputs it is computed from
    (``cat [3, 10] of l_ids_``)."""
    inputs = ", ".join(p.name for p in ancestors(k) if _per_call_input(p))
    return f"{op_name(k)} {list(hint(tuple(example_value(k).shape)))} of {inputs}"
