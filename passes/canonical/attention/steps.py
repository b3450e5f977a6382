"""The steps between the scores and the softmax: masks added or filled, scales, floors, logit soft-capping
(``cap · tanh(x / cap)``)."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

from brcompile.passes.refusals import CannotReplay, Code
from brcompile.passes.analysis.guards import scalar_equals
from brcompile.passes.canonical.attention.common import (
    BLOCKING, ADD, CAST, Canonical, DIV, MASKED_FILL, MUL, SEARCH_DEPTH, WHERE, call_in, constant, is_scalar,
    number, refuse, tensor,
)
from brcompile.passes.meta import SOFTCAP
from brcompile.passes.spellings import FLOORS, op_name as _op_name, spellings
from brcompile.passes.canonical.attention.scalars import scalar_value
from brcompile.passes.canonical.attention.scores import looks_like_attention, scores_op


TANH = spellings("tanh")


def _blended_scores(n: Any) -> Optional[tuple[fx.Node, fx.Node]]:
    """(s, B) when ``n`` is ``s * B`` (either order) with ``s`` from the scores and ``B`` a tensor that is not: the
    scores side of a blend ``s * B + A`` (OpenAI-GPT's ``w * b + -1e4 * (1 - b)``). Where B is 1 that is ``s + A``,
    where B is 0 it is ``A``, which drops the score: a mask with fill ``A`` there when A blocks
    (:func:`canonical_mask` marks every other entry for the classification to refuse). B must vary along the key
    dim (its last dim not broadcast): a factor constant over the keys (a per-head or per-query scale such as a
    learned ``[H, 1, 1]`` temperature) scales the scores, it does not mask them, and is refused as a scale."""
    if not (call_in(n, MUL) and len(n.args) == 2 and not n.kwargs):
        return None
    x, y = n.args
    for s, B in ((x, y), (y, x)):
        tb = tensor(B) if isinstance(B, fx.Node) else None
        if isinstance(s, fx.Node) and tb is not None and tb.dim() >= 1 and tb.shape[-1] != 1 \
                and looks_like_attention(s) and not looks_like_attention(B):
            return s, B
    return None


def mask_or_scale_step(sm: fx.Node, cur: Any):
    """One step between the scores and the softmax, walking towards the scores: ``("scale", c, s)`` for
    ``s * c`` / ``c * s`` / ``s / c`` with a number ``c``; ``("add", (M,), s)`` for ``s + M``;
    ``("fill", (C, v), s)`` for ``s.masked_fill(C, v)`` / ``where(C, v, s)``; ``("keep", (C, v), s)`` for
    ``where(C, s, v)`` / ``s.where(C, v)``; ``("blend", (B, A), s, s * B)`` for ``s * B + A``
    (:func:`_blended_scores`); None for anything else. ``s`` is the operand that comes from
    the scores; the mask values are checked by the caller."""
    if not isinstance(cur, fx.Node) or cur.op not in ("call_function", "call_method"):
        return None
    a = list(cur.args)
    if cur.op == "call_method" and cur.target in CAST and a and isinstance(a[0], fx.Node) \
            and tensor(cur) is not None and tensor(a[0]) is not None and tensor(cur).dtype == tensor(a[0]).dtype \
            and looks_like_attention(a[0]):
        return "scale", 1.0, a[0]  # a cast to the scores' own dtype (MPT's .float() of float32 scores)
    if call_in(cur, ADD) and len(a) == 2 and not cur.kwargs:
        side = [o for o in a if isinstance(o, fx.Node) and looks_like_attention(o)]
        if len(side) == 2:
            refuse(sm, cur, "an addition to the scores where the mask operand cannot be told apart "
                    "(both operands come from q @ k^T)")
        if len(side) == 1:
            M = a[1] if side[0] is a[0] else a[0]
            blend = _blended_scores(side[0])
            if blend is not None:
                return "blend", (blend[1], M), blend[0], side[0]
            return "add", (M,), side[0]
        return None
    if call_in(cur, MUL + DIV) and len(a) == 2 and not cur.kwargs:
        s, c = a
        if cur.target in MUL and number(s) is not None:
            s, c = c, s
        if number(c) is None or not looks_like_attention(s) or scores_op(s) is not None \
                or call_in(s, TANH):
            return None  # a scale directly on the scores (or a soft-cap's factor) is matched by the caller
        return "scale", (1.0 / number(c) if cur.target in DIV else number(c)), s
    floor = _floor_step(cur)
    if floor is not None:
        return floor
    if call_in(cur, MASKED_FILL):
        s = a[0] if a else cur.kwargs.get("input")
        C = a[1] if len(a) > 1 else cur.kwargs.get("mask")
        v = a[2] if len(a) > 2 else cur.kwargs.get("value")
        if isinstance(s, fx.Node) and looks_like_attention(s):
            return "fill", (C, v), s
        return None
    if call_in(cur, WHERE) and not cur.kwargs:
        if cur.op == "call_method" and len(a) == 3:  # s.where(C, v)
            s, C, v = a
            kind = "keep"
        elif len(a) == 3:
            C, x, y = a
            kind, s, v = ("keep", x, y) if isinstance(x, fx.Node) and looks_like_attention(x) else ("fill", y, x)
        else:
            return None
        if isinstance(s, fx.Node) and looks_like_attention(s):
            return kind, (C, v), s
    return None


def _floor_step(cur: fx.Node):
    """``("floor", (c,), s)`` for ``max(s, c)`` / ``maximum(s, c)`` with a constant one-element tensor ``c``
    (XGLM's ``torch.max(s + M, torch.full((), finfo.min))``) or ``s.clamp(min=c)`` / ``clamp_min(s, c)`` with a
    number ``c``, ``s`` from the scores; None otherwise. It raises only scores below ``c``, and ``c`` must be a
    blocking value (:func:`check_mask_steps`): a visible score lies above it (the assumption of every mask
    value, ``BLOCKING``) and a masked one stays at or below it, so its probability stays exactly 0."""
    if not call_in(cur, FLOORS):
        return None
    a, kw = list(cur.args), cur.kwargs
    if cur.target in (torch.maximum, "maximum", torch.max, "max"):
        if len(a) != 2 or kw or not isinstance(a[1], fx.Node):  # max(s, 3) is a reduction over dim 3
            return None
        s, c = a
        if constant(s) is not None:
            s, c = c, s
        value = constant(c)
    else:
        s = a[0] if a else None
        if cur.target in (torch.clamp_min, "clamp_min"):
            c, hi = (a[1] if len(a) > 1 else kw.get("min")), None
        else:
            c, hi = (a[1] if len(a) > 1 else kw.get("min")), (a[2] if len(a) > 2 else kw.get("max"))
        value = number(c) if hi is None else None
    if value is None or not isinstance(s, fx.Node) or not looks_like_attention(s):
        return None
    return "floor", (value,), s


def check_mask_steps(sm: fx.Node, x: fx.Node, masks: list) -> None:
    """Each mask step must block with a large negative value (``BLOCKING``), as seen by the softmax (after
    the scales between it and the softmax, which must be positive), on a bool condition."""
    for m in masks:
        kind, post = m[0], m[-1]
        if post <= 0:
            refuse(sm, x, f"an attention mask followed by a non-positive scale {post}")
        if kind in ("add", "bias", "blend"):
            continue
        if kind == "floor":
            if not m[1] * post <= BLOCKING:
                refuse(sm, x, f"the scores are raised to at least {m[1]} before the softmax (max / clamp): not a "
                        f"blocking value (<= {BLOCKING:g}, finfo.min), so visible scores may change")
            continue
        C, v = m[1], m[2]
        tc = tensor(C)
        if tc is None or tc.dtype != torch.bool:
            refuse(sm, x, "masked_fill / where on the scores with a condition that is not a bool tensor")
        value = number(v)
        if value is None or not value * post <= BLOCKING:
            what = "a value computed in the graph" if value is None else f"{value}"
            refuse(sm, x, f"masked_fill / where on the scores with {what}: not a large negative constant "
                    f"(<= {BLOCKING:g}, -inf, finfo.min), so it is a bias, not a mask")


def match_softcap(cur: Any, dead: list) -> tuple[Any, Any]:
    """(cap, scores) for ``mul(tanh(div(scores, cap)), cap)`` (either operand order of the mul): one
    positive number ``cap`` on both sides, or two scalar nodes (``.item()`` of inputs under dynamic=True:
    returned as a pair, resolved and guarded by :func:`resolve_softcaps`); (0.0, cur) for anything else."""
    if not (call_in(cur, MUL) and len(cur.args) == 2 and not cur.kwargs):
        return 0.0, cur
    a, b = cur.args
    th, factor = (a, b) if call_in(a, TANH) else (b, a)
    if not call_in(th, TANH) or not is_scalar(factor) or len(th.args) != 1 or th.kwargs:
        return 0.0, cur
    d = th.args[0]
    if not (call_in(d, DIV) and len(d.args) == 2 and not d.kwargs and is_scalar(d.args[1])):
        return 0.0, cur
    divisor = d.args[1]
    if isinstance(divisor, fx.Node) or isinstance(factor, fx.Node):
        cap: Any = (divisor, factor)
    elif number(divisor) == number(factor) and number(factor) > 0:
        cap = number(factor)
    else:
        return 0.0, cur
    dead.extend([cur, th, d])
    return cap, d.args[0]


def resolve_softcaps(graph: fx.Graph, placeholders: list, values: dict, canon: "Canonical") -> None:
    """Soft-caps read from scalar inputs: both sides must hold one positive value; it is specialised,
    with a per-call guard on each input (like the attention scale)."""
    for node in graph.nodes:
        src = SOFTCAP.get(node)
        if not isinstance(src, tuple):
            continue
        got = []
        for side in src:
            if isinstance(side, fx.Node):
                value, guard_src = scalar_value(side, placeholders, values)
                if value is None:
                    raise CannotReplay(Code.ATTENTION_SCALAR,
                                       "eager attention: the soft-cap is computed in the graph, not read from a "
                                       "scalar input", node)
                pos, transform = guard_src
                canon.guards.append(scalar_equals(pos, value, f"attention soft-cap of {node.name} "
                                                              f"(input {placeholders[pos].name})"))
                got.append(float(transform(value)))
            else:
                got.append(float(side))
        if got[0] != got[1] or got[0] <= 0:
            raise CannotReplay(Code.EAGER_ATTENTION,
                               f"eager attention: tanh soft-capping divides by {got[0]} and multiplies by "
                               f"{got[1]}", node)
        SOFTCAP.set(node, got[0])
        canon.notes.append(f"{node.name}: soft-cap specialised to {got[0]}")


def path_to_scores(n: fx.Node) -> list[str]:
    """Op names from ``n`` back to the scores matmul, following the input that leads there."""
    names = []
    while isinstance(n, fx.Node) and scores_op(n) is None and len(names) < SEARCH_DEPTH:
        names.append(_op_name(n))
        n = next((a for a in n.all_input_nodes if looks_like_attention(a)), None)
    return names + ["q @ k^T"]
