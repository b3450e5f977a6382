"""The facts the passes record on FX nodes (``node.meta``) and on the packed graph module, one named accessor each.

Every fact has one :class:`NodeFact` (a key of ``node.meta``) or :class:`GraphFact` (an attribute of the
rewritten ``GraphModule``) below, with its writer and readers in the docstring; code reads and writes a fact
only through its accessor (``AXES.get(node)``, ``SOFTCAP.set(node, c)``), never by the raw key. The key strings
are part of what a dump shows (``node.meta['br_axes']``) and stay as they are.

Node facts:

* :data:`AXES` — the token-axis fact of a value (passes/analysis/axes.py).
* :data:`REPACK_AXES` — the fact proved for a re-pack node when it was made (passes/analysis/repack.py).
* :data:`CHECKPOINT_REGION` — the activation-checkpoint region an inlined node came from (passes/lower/checkpoint.py).
* :data:`CHECKPOINT_BODY` — the body name of a re-outlined checkpoint call (passes/lower/checkpoint.py).
* :data:`CHECKPOINT_INDEX` — the region's number carried through the ATen export in ``meta["custom"]``
  (passes/lower/aten.py).
* :data:`CANONICAL` — what an attention node was canonicalised from (passes/canonical/attention/).
* :data:`SOFTCAP` — the logit soft-cap of a canonical attention (passes/canonical/attention/).
* :data:`RELBIAS_ZERO` / :data:`RELBIAS_SOURCE` — a relative bias's zero fill and its classified source
  (passes/canonical/attention/, passes/analysis/masks/).
* :data:`FUSED` / :data:`FUSED_COVERS` — a fused log-prob node's description and the nodes it replaces
  (passes/emit/fuse_logprob.py).

Graph facts (attributes of the packed ``GraphModule``, written by passes/emit/pack.py, read by the runtime):
:data:`TOKEN_OUTPUTS`, :data:`SEQUENCES`, :data:`ROWS`, :data:`WRITTEN_INPUTS`.

Provenance is torch.fx's own key, not a fact of ours: ``node.meta["from_node"]`` is a list of
:class:`torch.fx.traceback.NodeSource` (the last one the node it was made from, each holding its source's own
provenance), which torch's tracers and passes copy, extend and read. :func:`record_origin` writes it as torch
does (passes/emit/pack.py, passes/emit/fuse_logprob.py), :func:`origin_name` reads it (brcompile/tools/dump.py).
"""
from __future__ import annotations

import logging
from typing import Any

import torch.fx as fx
from torch.fx.traceback import NodeSource, NodeSourceAction

log = logging.getLogger(__name__)

__all__ = [
    "NodeFact", "GraphFact", "FactMissing", "NODE_FACTS", "GRAPH_FACTS",
    "AXES", "REPACK_AXES", "CHECKPOINT_REGION", "CHECKPOINT_BODY", "CHECKPOINT_INDEX", "CANONICAL", "SOFTCAP",
    "RELBIAS_ZERO", "RELBIAS_SOURCE", "FUSED", "FUSED_COVERS", "example_value",
    "TOKEN_OUTPUTS", "SEQUENCES", "ROWS", "WRITTEN_INPUTS", "FROM_NODE", "record_origin", "has_origin", "origin_name",
]

_MISSING = object()


class FactMissing(KeyError):
    """A fact read with :meth:`NodeFact.require` from a node that does not carry it."""


class NodeFact:
    """One fact stored in ``node.meta[key]`` (or, with ``within``, in the dict ``node.meta[within]`` under
    ``key``: a fact that must ride through a tracer that copies only that dict).

    ``get(node, default)`` reads it (``default`` when absent), ``require(node)`` reads it or raises
    :class:`FactMissing`, ``has(node)`` tells whether it is there, ``set(node, value)`` writes it,
    ``copy(src, dst)`` copies it when ``src`` has it."""

    def __init__(self, key: str, doc: str, within: str | None = None):
        self.key = key
        self.within = within
        self.__doc__ = doc

    def _store(self, node: fx.Node) -> dict:
        """The dict that holds the fact (``node.meta`` or the nested one), read only."""
        if self.within is None:
            return node.meta
        return node.meta.get(self.within) or {}

    def has(self, node: fx.Node) -> bool:
        """Whether ``node`` carries the fact."""
        return self.key in self._store(node)

    def get(self, node: fx.Node, default: Any = None) -> Any:
        """The fact of ``node``; ``default`` when it has none."""
        return self._store(node).get(self.key, default)

    def require(self, node: fx.Node) -> Any:
        """The fact of ``node``; :class:`FactMissing` when it has none."""
        value = self._store(node).get(self.key, _MISSING)
        if value is _MISSING:
            raise FactMissing(f"{node.name} has no {self.key!r} fact")
        return value

    def set(self, node: fx.Node, value: Any) -> None:
        """Record ``value`` as the fact of ``node`` (a nested store is replaced by an updated copy: the
        tracer's own copies of it stay as they were)."""
        if self.within is None:
            node.meta[self.key] = value
        else:
            node.meta[self.within] = {**(node.meta.get(self.within) or {}), self.key: value}

    def copy(self, src: fx.Node, dst: fx.Node) -> None:
        """Give ``dst`` the fact of ``src`` when ``src`` has one."""
        if self.has(src):
            self.set(dst, self.get(src))

    def __repr__(self) -> str:
        return f"NodeFact({self.key!r})" if self.within is None else f"NodeFact({self.within!r}[{self.key!r}])"


class GraphFact:
    """One fact stored as the attribute ``key`` of a ``GraphModule`` (the packed graph's contract with the
    runtime). ``get(gm)`` reads it (its ``default`` when absent), ``set(gm, value)`` writes it."""

    def __init__(self, key: str, default: Any, doc: str):
        self.key = key
        self.default = default
        self.__doc__ = doc

    def get(self, gm: Any) -> Any:
        """The fact of ``gm``; the default when it has none (a graph not made by the rewrite)."""
        return getattr(gm, self.key, self.default)

    def set(self, gm: Any, value: Any) -> None:
        """Record ``value`` as the fact of ``gm``."""
        setattr(gm, self.key, value)

    def __repr__(self) -> str:
        return f"GraphFact({self.key!r})"


# ---------------------------------------------------------------------------------------- node facts

AXES = NodeFact("br_axes", """The :class:`..axes.TokenAxes` fact of a value (CONST / TOKEN / DENSE with its token
dims). Written by the propagation (``axes.set_axes``), read by every rule and emitter (``axes.get_axes``), by the
padding-free check and the packing (passes/emit/pack.py), the log-prob fusion and the dump (brcompile/tools/dump.py).""")

REPACK_AXES = NodeFact("br_repack_axes", """The TOKEN fact proved for a ``packed_again`` node when
passes/analysis/repack.py made it (from the dense value's causal proof); read back by that node's rule.""")

CHECKPOINT_REGION = NodeFact("br_ckpt", """The :class:`..checkpoint.CheckpointRegion` an inlined node came
from. Written by ``checkpoint.inline_checkpoints`` (and by passes/lower/aten.py after the export, from
:data:`CHECKPOINT_INDEX`), copied onto re-pack nodes (passes/analysis/repack.py), read by ``checkpoint.region_of`` to
re-outline the packed bodies.""")

CHECKPOINT_BODY = NodeFact("br_checkpoint", """The name of the original body of a checkpoint call that
``checkpoint.outline_checkpoints`` re-outlined over packed nodes (a record for dumps and logs).""")

CHECKPOINT_INDEX = NodeFact("br_ckpt_region", """The number of the checkpoint region of a node, kept in
``node.meta["custom"]``, which the ATen export copies onto every node it traces from that node. Written by
passes/lower/aten.py before the export, read after it to restore :data:`CHECKPOINT_REGION`.""", within="custom")

CANONICAL = NodeFact("br_canonical", """What an attention node was canonicalised from (``"eager attention"``:
an eager softmax chain rewritten as SDPA). Written by passes/canonical/attention/; read there (a canonical node gets
no further key-bias rewrites) and by ``masks.is_canonical_attention``.""")

SOFTCAP = NodeFact("br_softcap", """The logit soft-cap c > 0 of a canonical attention (scores
``c * tanh(s / c)``, Gemma2's): a float, or the graph node holding it until it is resolved to a float. Written
by passes/canonical/attention/; read there (the canonical attention's evaluation), by the attention rule (refusing
shapes it does not pack) and its emitter (the op's ``softcap`` argument).""")

RELBIAS_ZERO = NodeFact("br_relbias_zero", """Whether a relative bias's table is zero at the distance E
(the clamp's fill), a bool. Written by passes/canonical/attention/ with the ``br_relbias`` keyword; read by the
attention emitter when it packs the table.""")

RELBIAS_SOURCE = NodeFact("br_relbias_source", """Where a relative bias comes from, as
``masks.classify`` found it (the proof that the bias is a function of the query-key distance). Written by
passes/canonical/attention/; read by passes/analysis/masks/.""")

FUSED = NodeFact("br_fused", """A one-line description of a fused log-prob node (passes/emit/fuse_logprob.py);
read by brcompile/backend.py into the explain report.""")

FUSED_COVERS = NodeFact("br_fused_covers", """The names of the original nodes a fused log-prob node replaces
(a tuple of str), extended when the entropy is fused too. Written by passes/emit/fuse_logprob.py, read by
brcompile/backend.py.""")

#: Every node fact, in the order above.
NODE_FACTS = (AXES, REPACK_AXES, CHECKPOINT_REGION, CHECKPOINT_BODY, CHECKPOINT_INDEX, CANONICAL, SOFTCAP,
              RELBIAS_ZERO, RELBIAS_SOURCE, FUSED, FUSED_COVERS)

# --------------------------------------------------------------------------------------- graph facts

TOKEN_OUTPUTS = GraphFact("br_token_outputs", (), """The positions of the packed graph's outputs that are
per-token (packed) values. Written by passes/emit/pack.py, read by brcompile/runtime/packed.py.""")

SEQUENCES = GraphFact("br_sequences", None, """Padding-free batches: the argument position of the position
ids, whose sequences the tree is built over (None: the rows are the sequences). Written by passes/emit/pack.py, read
by brcompile/runtime/packed.py.""")

ROWS = GraphFact("br_rows", False, """Whether the tree inputs are [T, ...] (one token a row), so the runtime's
keys are [T, 1, ...]. Written by passes/emit/pack.py, read by brcompile/runtime/packed.py.""")

WRITTEN_INPUTS = GraphFact("br_written_inputs", (), """The sorted placeholder positions the packed graph writes
into (in-place input updates). Written by passes/emit/pack.py, read by brcompile/runtime/packed.py and
passes/emit/split.py.""")

#: Every graph fact, in the order above.
GRAPH_FACTS = (TOKEN_OUTPUTS, SEQUENCES, ROWS, WRITTEN_INPUTS)


# ----------------------------------------------------------------------------- provenance (torch.fx's key)

#: torch.fx's provenance key (``torch.fx.traceback``): a list of ``NodeSource``, never anything else.
FROM_NODE = "from_node"


def record_origin(new: fx.Node, origin: fx.Node, pass_name: str) -> None:
    """Record that ``new`` was made from ``origin`` by the pass ``pass_name``, as torch.fx does
    (``torch.fx.traceback.set_current_meta``): ``new.meta["from_node"]`` becomes ``[NodeSource(origin,
    pass_name, CREATE)]``, which keeps ``origin``'s own provenance nested inside it."""
    new.meta[FROM_NODE] = [NodeSource(origin, pass_name, NodeSourceAction.CREATE)]


def has_origin(node: fx.Node) -> bool:
    """Whether ``node`` carries torch.fx's provenance key (written by us or by torch)."""
    return FROM_NODE in node.meta


def origin_name(node: fx.Node) -> str | None:
    """The name of the node ``node`` was made from: the last ``NodeSource`` of its provenance; None when it
    records none."""
    sources = node.meta.get(FROM_NODE)
    if not isinstance(sources, (list, tuple)) or not sources:
        return None
    return getattr(sources[-1], "name", None)


def example_value(node: Any) -> Any:
    """The example value of ``node``: Dynamo's ``example_value``, else the export's ``val``, else None; a
    non-node argument is its own value."""
    if not isinstance(node, fx.Node):
        return node
    for key in ("example_value", "val"):
        if key in node.meta:
            return node.meta[key]
    return None
