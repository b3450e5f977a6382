"""Activation checkpointing inside a captured graph (docs/ARCHITECTURE.md §3.1: inlined; §3.9: outlined again).

``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)`` (and HF's
``gradient_checkpointing_enable``) is captured by Dynamo as

    body = self.wrap_body_0                                    # get_attr: a GraphModule
    out = torch.ops.higher_order.tag_activation_checkpoint(body, *args, use_reentrant=False)
    y = out[0]

The attentions sit inside the bodies. The analysis sees through them and the packed graph keeps them:

1. :func:`inline_checkpoints` (before the analysis): a copy of the graph with every checkpoint body's
   nodes in place of its call, each tagged ``node.meta["br_ckpt"] = CheckpointRegion`` (the body's
   placeholders become the call's arguments, its outputs the ``getitem`` users). Every pass (masks,
   canonicalisation, token-axis facts) then sees one graph: a mask built outside the body and passed in
   is the outer mask node itself.
2. The packed rewrite emits the graph as usual and notes which packed nodes it emitted for each region
   (they are contiguous: the rewrite emits in the original order). :func:`outline_checkpoints` moves each
   region's packed nodes back into a GraphModule body called by ``tag_activation_checkpoint`` with the
   original keyword arguments: the packed body's TOKEN values stay inside the checkpoint (not saved for
   backward, recomputed packed), its inputs are what it reads from outside (tree arrays included).
   Nodes of a region that read only graph inputs (the tree-array reads the rewrite makes on first use:
   ``x[rep_row, position]``, ``index[...]``, ``N``) are left outside, before the call.

Inlining without the outlining would silently drop the user's memory saving; the two always go together.
A checkpoint nested in a checkpoint body, a body with ``get_attr`` nodes, or a call used other than
through ``getitem`` is refused (``CannotReplay``).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional

import torch.fx as fx

from brcompile.passes.refusals import CannotReplay, Code
from brcompile.passes.spellings import CHECKPOINT_HOPS, CHECKPOINT_READS, copy_graph_module
from brcompile.passes.meta import CHECKPOINT_BODY, CHECKPOINT_REGION

__all__ = ["CHECKPOINT_HOPS", "CheckpointRegion", "is_checkpoint", "inline_checkpoints", "outline_checkpoints",
           "body_with_attention", "region_of"]



@dataclasses.dataclass(frozen=True, eq=False)
class CheckpointRegion:
    """One inlined checkpoint call: its number, the body's name, the call's keyword arguments."""

    index: int
    body: str
    kwargs: tuple  # sorted (name, value) pairs


def is_checkpoint(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target in CHECKPOINT_HOPS


def region_of(n: fx.Node) -> Optional[CheckpointRegion]:
    return CHECKPOINT_REGION.get(n)


def _body(gm: fx.GraphModule, hop: fx.Node) -> fx.GraphModule:
    b = hop.args[0] if hop.args else None
    if not (isinstance(b, fx.Node) and b.op == "get_attr"):
        raise CannotReplay(Code.CHECKPOINT_FORM,
                           "activation checkpoint whose body is not a submodule of the graph", hop)
    mod = gm
    for part in b.target.split("."):
        mod = getattr(mod, part)
    if not isinstance(mod, fx.GraphModule):
        raise CannotReplay(Code.CHECKPOINT_FORM, "activation checkpoint whose body is not an FX graph", hop)
    return mod


def inline_checkpoints(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with every ``tag_activation_checkpoint`` body inlined and tagged (module docstring);
    ``gm`` itself when it has none."""
    if not any(is_checkpoint(n) for n in gm.graph.nodes):
        return gm
    new = copy_graph_module(gm)
    graph = new.graph
    for i, hop in enumerate([n for n in graph.nodes if is_checkpoint(n)]):
        body = _body(new, hop)
        if any(n.op == "get_attr" or is_checkpoint(n) for n in body.graph.nodes):
            raise CannotReplay(Code.CHECKPOINT_FORM,
                               "activation checkpoint body with a nested checkpoint or a get_attr (not supported)",
                               hop)
        if any(isinstance(a, fx.Node) for a in fx.node.map_aggregate(hop.kwargs, lambda a: a).values()):
            raise CannotReplay(Code.CHECKPOINT_FORM,
                               "activation checkpoint with a graph value among its keyword arguments", hop)
        bad = [u for u in hop.users if not (u.op == "call_function" and u.target is operator.getitem
                                            and isinstance(u.args[1], int))]
        if bad:
            raise CannotReplay(Code.CHECKPOINT_FORM, "activation checkpoint output used other than by indexing", bad[0])
        region = CheckpointRegion(i, hop.args[0].target, tuple(sorted(hop.kwargs.items())))
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(hop.args) - 1:
            raise CannotReplay(Code.CHECKPOINT_FORM,
                               "activation checkpoint body's inputs do not match the call's arguments", hop)
        env: dict[fx.Node, Any] = dict(zip(placeholders, hop.args[1:]))
        outs: Any = None
        with graph.inserting_before(hop):
            for bn in body.graph.nodes:
                if bn.op == "placeholder":
                    continue
                if bn.op == "output":
                    outs = fx.node.map_arg(bn.args[0], lambda a: env[a])
                    continue
                c = graph.node_copy(bn, lambda a: env[a])
                CHECKPOINT_REGION.set(c, region)
                env[bn] = c
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        for u in list(hop.users):
            u.replace_all_uses_with(outs[u.args[1]])
            graph.erase_node(u)
        get = hop.args[0]
        graph.erase_node(hop)
        if not get.users:
            graph.erase_node(get)
    graph.lint()
    new.recompile()
    return new


def body_with_attention(gm: fx.GraphModule, attention_targets) -> Optional[fx.Node]:
    """The first call of a higher-order op whose submodule body holds an attention (for the refusal reason
    when the graph has no attention of its own); None when there is none."""
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        for a in n.args:
            if isinstance(a, fx.Node) and a.op == "get_attr":
                mod = gm
                try:
                    for part in a.target.split("."):
                        mod = getattr(mod, part)
                except AttributeError:
                    continue
                if isinstance(mod, fx.GraphModule) and any(
                        m.op == "call_function" and m.target in attention_targets for m in mod.graph.nodes):
                    return n
    return None



def _from_inputs(graph: fx.Graph) -> set[fx.Node]:
    """Reads of graph inputs: indexing, ``unsqueeze`` and ``size`` of placeholders (and of such reads) —
    the tree-array reads the rewrite emits on first use, wherever that is."""
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            out.add(n)
        elif n.op in ("call_function", "call_method") and n.target in CHECKPOINT_READS and n.all_input_nodes and all(
                a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def outline_checkpoints(gm: fx.GraphModule, regions: list[tuple[CheckpointRegion, list[fx.Node]]]) -> int:
    """Move each region's packed nodes (those still in ``gm``'s graph, in graph order, contiguous but for
    reads of graph inputs) into a body GraphModule called through ``tag_activation_checkpoint`` with the
    region's keyword arguments (module docstring). Returns the number of checkpoint calls emitted."""
    graph = gm.graph
    emitted = 0
    for region, nodes in regions:
        alive = set(graph.nodes)
        hoist = _from_inputs(graph)
        body_nodes = [n for n in nodes if n in alive and n not in hoist]
        if not body_nodes:
            continue
        inside = set(body_nodes)
        order = {n: i for i, n in enumerate(graph.nodes)}
        first, last = order[body_nodes[0]], order[body_nodes[-1]]
        stray = [n for n in graph.nodes if first < order[n] < last and n not in inside and n not in hoist]
        if stray:  # the region's packed nodes are not contiguous: never expected from the rewrite
            raise CannotReplay(Code.CHECKPOINT_INTERLEAVED,
                               f"the packed nodes of activation checkpoint {region.body} are interleaved with "
                               f"others ({stray[0].name})")
        inputs = list(dict.fromkeys(a for n in body_nodes for a in n.all_input_nodes if a not in inside))
        outputs = [n for n in body_nodes if any(u not in inside for u in n.users)]
        if not outputs:
            continue
        body = fx.Graph()
        env = {a: body.placeholder(a.name) for a in inputs}
        for a in inputs:
            env[a].meta.update(a.meta)
        for n in body_nodes:
            env[n] = body.node_copy(n, lambda a: env[a])
        body.output(tuple(env[o] for o in outputs))
        body.lint()
        name = f"br_checkpoint_body_{region.index}"
        body_gm = fx.GraphModule(gm, body, class_name="PackedCheckpointBody")
        setattr(gm, name, body_gm)
        with graph.inserting_after(body_nodes[-1]):
            get = graph.get_attr(name)
        with graph.inserting_after(get):
            call = graph.call_function(CHECKPOINT_HOPS[0], (get, *inputs), dict(region.kwargs))
        CHECKPOINT_BODY.set(call, region.body)
        prev = call
        for i, o in enumerate(outputs):
            with graph.inserting_after(prev):
                g = graph.call_function(operator.getitem, (call, i))
            o.replace_all_uses_with(g, delete_user_cb=lambda u: u not in inside)
            prev = g
        for n in reversed(body_nodes):
            graph.erase_node(n)
        emitted += 1
    graph.lint()
    gm.recompile()
    return emitted
