"""What every part of the attention canonicaliser reads: the op spellings, the records of a match
(:class:`EagerChain`) and of the whole graph's canonicalisation (:class:`Canonical`), small value helpers."""
from __future__ import annotations

import dataclasses
import logging
import numbers
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from brcompile.passes.analysis.axes import example_value, is_inplace
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.passes.analysis.guards import BatchGuard
from brcompile.passes.spellings import CONSTANT_FILLS, OPERATORS_NOT_INPLACE, SAME_VALUE, spellings


#: A float mask value at or below this blocks a key (passes/analysis/masks: ``split_bias``): ``exp(v + s - m)`` underflows to exactly 0
#: for a masked score ``s`` whenever the row maximum ``m`` of the visible scores is above ``s + v + 745`` (float64;
#: ``s + v + 104`` in float32), i.e. for scores within about ``|v| / 2 - 372`` of 0 — 4,600 at ``-1e4``, any score
#: the softmax could take at ``-1e9`` or ``finfo.min``. Large negative constants (``-1e4``, ``-1e9``,
#: ``torch.finfo(dtype).min``) and ``-inf`` are masks; anything above is a bias.
BLOCKING = -1e4

log = logging.getLogger(__name__)

SOFTMAX = spellings("softmax")
MATMUL = spellings("matmul")
TRANSPOSE = spellings("transpose", "permute")
MUL = spellings("mul")
DIV = spellings("div")
ADD = spellings("add")
CAST = spellings("cast")
DROPOUT = spellings("dropout")
MASKED_FILL = spellings("masked_fill")
WHERE = spellings("where")
EINSUM = spellings("einsum")
RESHAPE = spellings("reshape")
BMM = spellings("bmm")
BADDBMM = spellings("baddbmm")
#: How far back from a softmax an unmatched chain is searched for a q @ k^T matmul, to tell an
#: attention that cannot be canonicalised (refuse, with the op named) from an unrelated softmax.
SEARCH_DEPTH = 6


@dataclasses.dataclass
class Canonical:
    """The canonical copy of a graph and what the canonicalisation assumed.

    ``additive``: SDPA nodes built from eager chains with a float mask (they need :func:`mask_guards`).
    ``guards``: per-call guards of specialised scalars. ``notes``: one line per rewrite, for reports.
    """

    gm: fx.GraphModule
    guards: list[BatchGuard] = dataclasses.field(default_factory=list)
    additive: list[fx.Node] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class EagerChain:
    """A matched eager attention: ``out = matmul(probs, v)`` computes ``softmax(scale * q k^T + mask) v``."""

    q: fx.Node
    k: fx.Node
    v: fx.Node
    scale: Any  # number or a scalar node (resolved later)
    masks: list  # mask steps, softmax-side first: ("add", M, post) | ("fill"/"keep", C, value, post) | ("floor", c, post)
    #              | ("blend", B, A, post): s * B + A (:func:`_blended_scores`)
    #              | ("bias", M, H, post): a baddbmm input M of a 3-D attention, [B*H | 1, ...] read as [B, H, ...]
    dropout_p: Any
    dropout_training: Any
    out: fx.Node
    dead: list[fx.Node]  # chain nodes replaced by the SDPA node, output-side first
    softcap: Any = 0.0  # > 0: the scores were soft-capped, tanh(s / softcap) * softcap; or the two scalar
    #                     nodes (divisor, factor) read from inputs under dynamic=True, resolved by canonicalize
    sinks: Optional[fx.Node] = None  # the sink logits joined to the softmax: [H], or a [B, H, Lq, 1] column
    heads: Optional[int] = None  # H of a 3-D attention (bmm / baddbmm on [B*H, ...] views)
    merged_out: bool = False  # ``out`` is the [B*H, Lq, D] product: the SDPA output is flattened for its users
    k_dims: Optional[tuple] = None  # the SDPA key is ``k.permute(k_dims)`` (:func:`_key_of`)
    q_dims: Optional[tuple] = None  # the SDPA query is ``q.permute(q_dims)`` (:func:`einsum_4d`)
    v_dims: Optional[tuple] = None  # the SDPA value is ``v.permute(v_dims)`` (:func:`einsum_4d`)
    out_dims: Optional[tuple] = None  # ``out`` is the SDPA output ``.permute(out_dims)`` (:func:`einsum_4d`)


def mutates(node: fx.Node) -> bool:
    """``axes.is_inplace``, except that ``operator.and_``/``or_``… (named with a trailing ``_`` only to
    avoid Python keywords) do not mutate."""
    return node.target not in OPERATORS_NOT_INPLACE and is_inplace(node)


def tensor(n: Any) -> Optional[torch.Tensor]:
    v = example_value(n)
    return v if isinstance(v, torch.Tensor) else None


def is_scalar(a: Any) -> bool:
    """A Python number or a node producing one (``.item()`` of a scalar input)."""
    if isinstance(a, bool):
        return False
    if isinstance(a, numbers.Number):
        return True
    return isinstance(a, fx.Node) and isinstance(example_value(a), (torch.SymFloat, torch.SymInt, float, int))


def only_user(n: fx.Node) -> Optional[fx.Node]:
    return next(iter(n.users)) if len(n.users) == 1 else None


def same(a: Any, b: Any) -> bool:
    """Whether two sizes (ints or SymInts) are provably equal (adds no guard)."""
    return bool(statically_known_true(a == b))


def refuse(sm: fx.Node, at: fx.Node, why: str):
    """An attention (the softmax ``sm``) whose chain is not exactly the eager math: stop, naming ``at``."""
    raise CannotReplay(Code.EAGER_ATTENTION, f"eager attention: {why}", at)


def number(x: Any) -> Optional[float]:
    """The value of a Python number, or of a one-element constant tensor made in the graph (:func:`constant`)."""
    if isinstance(x, fx.Node):
        return constant(x)
    return float(x) if isinstance(x, numbers.Real) and not isinstance(x, bool) else None


def constant(n: fx.Node) -> Optional[float]:
    """``v`` rounded to the node's dtype when ``n`` makes a one-element tensor of the number ``v``
    (``spellings.CONSTANT_FILLS``), through calls that keep their operand's value (``spellings.SAME_VALUE``),
    else None."""
    while call_in(n, SAME_VALUE) and n.args and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    t = tensor(n)
    if n.op != "call_function" or n.target not in CONSTANT_FILLS or t is None or not t.is_floating_point() \
            or t.numel() != 1:
        return None
    a = list(n.args)
    v = a[1] if n.target is torch.full and len(a) > 1 else (a[0] if n.target is not torch.full and a else None)
    if n.target is torch.full and v is None:
        v = n.kwargs.get("fill_value")
    if not isinstance(v, numbers.Real) or isinstance(v, bool):
        return None
    return float(torch.tensor(float(v), dtype=t.dtype).item())


def call_in(n: Any, targets) -> bool:
    return isinstance(n, fx.Node) and n.op in ("call_function", "call_method") and n.target in targets


def call(graph: fx.Graph, target, args) -> fx.Node:
    """A new node (call_method for a string target) with its example value computed from its inputs'."""
    op = "call_method" if isinstance(target, str) else "call_function"
    node = graph.create_node(op, target, args, {})
    try:
        vals = list(fx.node.map_arg(tuple(args), example_value))
        node.meta["example_value"] = (getattr(vals[0], target)(*vals[1:]) if op == "call_method"
                                      else target(*vals))
    except Exception:  # pragma: no cover - metadata is best effort; the probes evaluate the real thing
        log.debug("no example value for %s", node.name, exc_info=True)
    return node


def set_sdpa_arg(node: fx.Node, name: str, value) -> None:
    names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
    i = names.index(name)
    if i < len(node.args):
        args = list(node.args)
        args[i] = value
        node.args = tuple(args)
    else:
        kwargs = dict(node.kwargs)
        kwargs[name] = value
        node.kwargs = kwargs
