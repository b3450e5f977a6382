"""Key biases and relative-position biases: a per-key bias folded into the keys, a relative bias table read by
distance, as features of the attention."""
from __future__ import annotations

import logging
import numbers
import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from brcompile.passes.analysis.axes import example_value, hint, normalize_dim
from brcompile.passes.canonical.attention.common import (
    BLOCKING, ADD, CAST, Canonical, DIV, EagerChain, MASKED_FILL, MUL, WHERE, call, call_in, number, same,
    set_sdpa_arg, tensor,
)
from brcompile.passes.probe import ancestors
from brcompile.passes.meta import RELBIAS_SOURCE, RELBIAS_ZERO, SOFTCAP
from brcompile.passes.analysis.rules.attention import sdpa_args
from brcompile.passes.spellings import COPIES, GATHERS

log = logging.getLogger(__name__)

#: How far back from an additive mask operand its per-key bias is searched (:func:`_key_bias_source`).
_KEY_BIAS_DEPTH = 12


def key_bias(graph: fx.Graph, ch: EagerChain, k: fx.Node, scale: Any, values: dict) -> Optional[tuple]:
    """An eager chain's additive mask step with a per-key bias (:func:`_key_feature`), as one more q/k feature:
    ((q', k', v'), the mask steps with that step's operand replaced, D, u), or None. Not for soft-capped
    scores (the bias is added after the cap) or 3-D attention."""
    if ch.softcap or ch.heads is not None or ch.merged_out:
        return None
    for i, step in enumerate(ch.masks):
        if step[0] != "add":
            continue
        found = _key_feature(graph, ch.q, k, ch.v, step[1], scale, step[-1], values)
        if found is not None:
            qkv, rest, width, u = found
            masks = list(ch.masks)
            masks[i] = ("add", rest, step[-1])
            return qkv, masks, width, u
    return None


def key_bias_sdpa(graph: fx.Graph, node: fx.Node, values: dict, canon: Canonical) -> None:
    """The same for an SDPA node whose float ``attn_mask`` carries a per-key bias (HF Doge under ``sdpa``):
    its q, k, v and mask are replaced in place and its users read the output without the extra feature."""
    a = sdpa_args(node)
    M, q, k, v = a["attn_mask"], a["query"], a["key"], a["value"]
    if not isinstance(M, fx.Node) or a["is_causal"] is not False or SOFTCAP.get(node) \
            or any(tensor(x) is None for x in (q, M)) or not tensor(M).is_floating_point():
        return
    scale = a["scale"] if a["scale"] is not None else float(hint(tensor(q).shape[-1])) ** -0.5
    with graph.inserting_before(node):
        found = _key_feature(graph, q, k, v, M, scale, 1.0, values)
    if found is None:
        return
    (q2, k2, v2), rest, width, u = found
    for name, x in (("query", q2), ("key", k2), ("value", v2), ("attn_mask", rest), ("scale", scale)):
        set_sdpa_arg(node, name, x)
    out = example_value(node)
    with graph.inserting_after(node):
        sliced = graph.call_function(operator.getitem, (node, (Ellipsis, slice(None, width))))
    node.replace_all_uses_with(sliced, delete_user_cb=lambda n: n is not sliced)
    sliced.meta["example_value"] = out
    node.meta["example_value"] = torch.cat([out, out[..., :1]], -1) if out is not None else None
    canon.notes.append(f"{node.name}: per-key bias {u.name} as one more q/k feature")


def _key_feature(graph: fx.Graph, q: Any, k: Any, v: Any, M: Any, scale: Any, post: float,
                 values: dict) -> Optional[tuple]:
    """A per-key bias ``u[b, h, k]`` in the additive mask operand ``M`` as one more q/k feature, or None.

    When ``M`` (added to the [B, H, Lq, Lk] scores, times ``post``) is built from a value ``u`` of shape
    [B, Hu, 1, Lk] (constant along the queries: :func:`_key_bias_source`) computed from a trainable tensor (a
    projection of the hidden states, HF Doge's ``exp(A * softplus(dt_proj(v)))``), then, with ``c`` the SDPA
    scale,

        ``c * q k^T + post * M  =  c * q' k'^T + post * (M - T(u))``,
        ``q' = cat(q, 1)``, ``k' = cat(k, post / c * T(u)^T)``, ``v' = cat(v, 0)``

    where ``T`` maps u's heads onto the H query heads (as repeat_kv: query head h reads u head
    ``h // (H / Hu)``). ``M - T(u)`` replaces ``M``: exactly 0 where ``M`` was ``T(u)``, blocking where ``M``
    blocked, so the mask classification proves on its probes (trainable tensors perturbed,
    :func:`..masks.classify`) that the bias was ``T(u)`` wherever a key is visible, and refuses it as a bias
    otherwise. v gets a zero feature so that q, k, v share one head dim (the tree-attention kernels); the output
    drops it. Gradients reach u through k' (exact up to the reassociation of one product). Returns
    ((q', k', v'), ``M - T(u)``, D (v's head dim), u); None when there is no such u, the scale is not a
    number, q, k, v are not 4-D with one head count, Hu does not divide H, or u, M, q, k, v differ in dtype."""
    if not isinstance(scale, numbers.Number) or not scale:
        return None
    tq, tk, tv = (tensor(x) if isinstance(x, fx.Node) else None for x in (q, k, v))
    if tq is None or tk is None or tv is None or tq.dim() != 4 or tk.dim() != 4 or tv.dim() != 4 \
            or not same(tq.shape[1], tk.shape[1]) or not same(tk.shape[1], tv.shape[1]):
        return None
    H = int(hint(tq.shape[1]))
    u = _key_bias_source(M, tq, tk, values)
    if u is None:
        return None
    hu = int(hint(tensor(u).shape[1]))
    if H % hu or len({tensor(x).dtype for x in (u, M, q, k, v)}) != 1:  # one dtype: no rounding to reproduce
        return None
    tu = u if hu in (1, H) else call(graph, "repeat_interleave", (u, H // hu, 1))  # [B, H | 1, 1, Lk]
    rest = call(graph, operator.sub, (M, tu))
    col = call(graph, "transpose", (tu, -1, -2))  # [B, H | 1, Lk, 1]
    col = call(graph, operator.mul, (col, post / scale))
    if hu == 1 and H != 1:
        col = call(graph, "expand", (col, -1, H, -1, -1))
    col = call(graph, "to", (col, tk.dtype))
    q2 = call(graph, torch.cat, ([q, call(graph, torch.ones_like, (call(graph, operator.getitem, (
        q, (Ellipsis, slice(None, 1)))),))], -1))
    k2 = call(graph, torch.cat, ([k, col], -1))
    v2 = call(graph, torch.cat, ([v, call(graph, torch.zeros_like, (call(graph, operator.getitem, (
        v, (Ellipsis, slice(None, 1)))),))], -1))
    log.debug("per-key bias %s of %s: one more q/k feature", u.name, M.name)
    return (q2, k2, v2), rest, int(hint(tv.shape[-1])), u


def _key_bias_source(M: Any, tq: torch.Tensor, tk: torch.Tensor, values: dict) -> Optional[fx.Node]:
    """The value ``u`` of shape [B, Hu, 1, Lk] (B and Lk the key's, Lq > 1) that the additive mask operand
    ``M`` is built from along its first tensor operand (through views, expands, casts, ``masked_fill``,
    ``where``: any op, the probes check the result), when u depends on a trainable tensor; else None."""
    n = M
    for _ in range(_KEY_BIAS_DEPTH):
        if not isinstance(n, fx.Node) or n.op not in ("call_function", "call_method"):
            return None
        t = tensor(n)
        if t is not None and t.dim() == 4 and t.is_floating_point() and same(t.shape[2], 1) \
                and not same(tq.shape[2], 1) and same(t.shape[3], tk.shape[2]) and same(t.shape[0], tk.shape[0]) \
                and _trainable(n, values):
            return n
        n = _carried_operand(n)
    return None


def relative_bias_dense(table: torch.Tensor, like: torch.Tensor, zero_beyond: bool) -> torch.Tensor:
    """``G(F)[b, h, i, j] = F[b, h, i, clamp(i - j, 0, E - 1)]`` for a [B, H, Lq, E] table F over the last two
    dims of ``like`` (the [.., Lq, Lk] operand it is compared with), 0 where ``i - j >= E`` when ``zero_beyond``.
    Only evaluated by the mask classification's probes (the canonical copy is never run)."""
    lq, lk, extent = like.shape[-2], like.shape[-1], table.shape[-1]
    d = torch.arange(lq, device=table.device)[:, None] - torch.arange(lk, device=table.device)[None, :]
    g = table.gather(-1, d.clamp(0, extent - 1).expand(*table.shape[:-2], lq, lk))
    return g.masked_fill(d >= extent, 0.0) if zero_beyond else g


def relative_step(graph: fx.Graph, ch: EagerChain, values: dict) -> Optional[tuple]:
    """An eager chain's additive mask step with a relative bias (:func:`_relative_bias`): (the mask steps with
    that step's operand replaced by ``M - G(F)``, (F, T, zero_beyond)), or None. Not for 3-D attention or a
    step scaled after the sum (``post`` != 1)."""
    if ch.heads is not None or ch.merged_out:
        return None
    for i, step in enumerate(ch.masks):
        if step[0] != "add" or step[-1] != 1.0:
            continue
        found = _relative_bias(graph, ch.q, step[1], values)
        if found is not None:
            rest, relative = found
            masks = list(ch.masks)
            masks[i] = ("add", rest, step[-1])
            return masks, relative
    return None


def relative_bias_sdpa(graph: fx.Graph, node: fx.Node, values: dict, canon: Canonical) -> None:
    """The same for an SDPA node whose float ``attn_mask`` carries a relative bias (HF Inkling under ``sdpa``:
    ``where(mask, position_bias, min)``): its mask is replaced in place."""
    a = sdpa_args(node)
    M, q = a["attn_mask"], a["query"]
    if not isinstance(M, fx.Node) or a["is_causal"] is not False or SOFTCAP.get(node) \
            or tensor(q) is None or tensor(M) is None or not tensor(M).is_floating_point():
        return
    with graph.inserting_before(node):
        found = _relative_bias(graph, q, M, values)
    if found is None:
        return
    rest, relative = found
    set_sdpa_arg(node, "attn_mask", rest)
    node.update_kwarg("br_relbias", relative[0])
    mark_relative(node, relative, canon)


def mark_relative(node: fx.Node, relative: tuple, canon: Canonical) -> None:
    """Record a relative bias on the SDPA node: the zero fill and the table's source T (the probes' free value)."""
    table, source, zero = relative
    RELBIAS_ZERO.set(node, zero)
    RELBIAS_SOURCE.set(node, source)
    canon.notes.append(f"{node.name}: relative bias, the per-query table {table.name} from {source.name} over the "
                       f"clamped distance{' (0 beyond it)' if zero else ''}")


def _relative_bias(graph: fx.Graph, q: Any, M: Any, values: dict) -> Optional[tuple]:
    """A relative bias in the additive operand ``M`` of the [B, H, Lq, Lk] scores: (``M - G(F)``, (F, T,
    zero_beyond)), or None (module docstring).

    ``M`` is walked back along its carried operands (:func:`_carried_operand`) to ``gather(T, -1, idx)`` with T
    a floating [B, H, Lq, E] value (H the query heads) computed from a trainable tensor. The ops on the way are
    each one of: a cast, ``contiguous``/``clone``, a product or quotient with an operand constant along the keys
    (last dim 1: a factor per query row), ``masked_fill(C, 0)`` / ``where(C, 0, x)`` (a zero fill: the bias is 0
    where C holds, read as 0 from distance E on), a ``masked_fill`` / ``where`` with a blocking value or a sum
    (mask parts, which ``M - G(F)`` keeps for the classification); anything else: None. F is T through the casts
    and factors in their order (the same elementwise ops: ``G(F)`` equals the gathered bias bit for bit where
    the bias is what the probes prove). The probes decide the rest: the index, the fill's condition and every
    mask part are only evaluated."""
    tq = tensor(q) if isinstance(q, fx.Node) else None
    if tq is None or tq.dim() != 4:
        return None
    path, n = [], M
    for _ in range(_KEY_BIAS_DEPTH):
        if not isinstance(n, fx.Node) or n.op not in ("call_function", "call_method"):
            return None
        if call_in(n, GATHERS):
            break
        path.append(n)
        n = _carried_operand(n)
    else:
        return None
    T, dim = (n.args[0], n.args[1]) if len(n.args) >= 2 else (n.args[0], n.kwargs.get("dim"))
    t = tensor(T) if isinstance(T, fx.Node) else None
    if t is None or t.dim() != 4 or not t.is_floating_point() or not isinstance(dim, int) \
            or normalize_dim(dim, 4) != 3 or not same(t.shape[1], tq.shape[1]) \
            or not same(t.shape[2], tq.shape[2]) or not same(t.shape[0], tq.shape[0]) or not _trainable(T, values):
        return None
    table, zero = T, False
    for step in reversed(path):  # gather side first
        carried = _carried_operand(step)
        if call_in(step, CAST) or call_in(step, COPIES):
            if call_in(step, CAST):
                table = _copy_on(graph, step, carried, table)
            continue
        if call_in(step, MUL) or call_in(step, DIV):
            other = [a for a in step.args if a is not carried]
            if len(step.args) != 2 or step.kwargs or (call_in(step, DIV) and step.args[0] is not carried) \
                    or not all(number(a) is not None or _row_factor(a) for a in other):
                return None
            table = _copy_on(graph, step, carried, table)
            continue
        fill = _fill_value(step, carried)
        if fill is None:
            if call_in(step, ADD):
                continue
            return None
        if fill == 0.0:
            zero = True
        elif fill > BLOCKING:
            return None
    if tensor(table) is None or tensor(table).dim() != 4:  # a factor that broadcast the table to more dims
        return None
    rest = call(graph, operator.sub, (M, call(graph, relative_bias_dense, (table, M, zero))))
    log.debug("relative bias of %s: table %s from %s", M.name, table.name, T.name)
    return rest, (table, T, zero)


def _row_factor(a: Any) -> bool:
    """Whether ``a`` is a tensor node constant along the keys: at most 4 dims, the last of extent 1."""
    t = tensor(a) if isinstance(a, fx.Node) else None
    return t is not None and 0 < t.dim() <= 4 and same(t.shape[-1], 1)


def _fill_value(step: fx.Node, carried: fx.Node) -> Optional[float]:
    """The number a ``masked_fill(x, C, v)`` / ``where(C, v, x)`` / ``where(C, x, v)`` writes over the carried
    operand ``x``, or None when ``step`` is no such fill."""
    if call_in(step, MASKED_FILL) and len(step.args) >= 3 and step.args[0] is carried:
        return number(step.args[2])
    if call_in(step, WHERE) and step.op == "call_function" and len(step.args) == 3:
        other = step.args[2] if step.args[1] is carried else step.args[1] if step.args[2] is carried else None
        return None if other is None else number(other)
    return None


def _copy_on(graph: fx.Graph, step: fx.Node, old: fx.Node, new: fx.Node) -> fx.Node:
    """A copy of ``step`` reading ``new`` where it read ``old``, with its example value computed."""
    node = graph.node_copy(step, lambda a: new if a is old else a)
    node.meta = {}
    try:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), example_value)
        node.meta["example_value"] = (getattr(args[0], node.target)(*args[1:], **kwargs)
                                      if node.op == "call_method" else node.target(*args, **kwargs))
    except Exception:  # pragma: no cover - metadata is best effort; the probes evaluate the real thing
        log.debug("no example value for %s", node.name, exc_info=True)
    return node


def _carried_operand(n: fx.Node) -> Optional[fx.Node]:
    """The operand an op carries along: ``where``'s first non-bool tensor value, else the first tensor argument."""
    ops = [a for a in n.args if isinstance(a, fx.Node)]
    if call_in(n, WHERE):
        ops = [a for a in ops[1:] if tensor(a) is not None and tensor(a).dtype != torch.bool] \
            if n.op == "call_function" else ops[:1]
    return ops[0] if ops else None


def _trainable(n: fx.Node, values: dict) -> bool:
    """Whether ``n`` depends on a graph input that requires grad (a parameter)."""
    return any(p.op == "placeholder" and isinstance(values.get(p), torch.Tensor) and values[p].requires_grad
               for p in ancestors(n))
