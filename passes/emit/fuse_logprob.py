"""Fused next-token log-probs: the LM head and the log-softmax become brcompile::packed_logprob.

Patterns (in the Dynamo graph; every value between the head and the read-out is a TOKEN value
``[B, L, ...]`` with row dim 0 and position dim 1)::

    head    raw = linear(h, W[, b])  or  h @ Wt                 h TOKEN [B, L, D]; W [V, D] / Wt [D, V], b CONST
    then    any of: * s, / s (python scalars, or CONST scalar tensors before the tanh), one soft-cap
            (``tanh``, Gemma-2's ``x / cap -> tanh -> * cap``), token-dim slicing (``[:, :-1]``,
            ``[:, -k:]``: a lazy window), dtype casts that keep the dtype, ``contiguous``
    gather  log_softmax(., -1) [-> window] .gather(-1, targets[..., None])   (the lazy gather, DENSE targets)
            optionally with the entropy of the same distribution, ``-(p * logp).sum(-1)`` with
            ``p = softmax(logits, -1)`` or ``logp.exp()``, when everything computed from the entropy
            comes after the gather in the graph: the op returns the entropy of each read position,
            and what the loss computes from it (``coef * entropy``, masks, means) runs on those dense
            [B', L'] values (their facts become DENSE; exact, it is the original computation)
    xent    F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), reduction=...)  (no weight, no
            label smoothing; ignore_index honoured)

Math: the chain of scalars and one tanh between ``raw`` and the log-softmax input is
``z = post * tanh(pre * raw)`` (or ``z = post * raw``), which is the op's
``scale * softcap * tanh(raw / softcap)`` with ``softcap = 1 / |pre|`` and ``scale = post * pre``
(tanh is odd, so a negative ``pre`` moves its sign into ``scale``). Non-literal scalar factors before
the tanh multiply (divide) the weight and bias instead: ``(h @ W^T + b) * s = h @ (s W)^T + s b``.
Everything agrees with the unfused graph up to rounding of the reassociated products.

The fused op reads the packed hidden states and the (windowed) ``[B', L']`` index, so nothing of size
``[N, V]`` is built. Only values with no other users are fused (else the unfused path is kept, exactly as
before); ``PackOptions.fuse_logprob=False`` turns fusion off. The fused op node carries
``meta["br_fused"]`` (a one-line description) and ``meta["br_fused_covers"]`` (the names of the original
nodes it replaces) for the backend's records.
"""
from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from brcompile.passes.analysis.axes import (
    CONST, DENSE, AxesContext, Window, axis_rule, dense_fallback, example_value, get_axes, node_args, normalize_dim,
    set_axes, shape_of,
)
from brcompile.passes.meta import AXES, FUSED, FUSED_COVERS, record_origin
from brcompile.passes.spellings import CASTS_AND_COPIES, FLAT_RESHAPES, arg, spellings

log = logging.getLogger(__name__)

__all__ = ["Head", "LogprobMatch", "emit_fused_gather", "match_cross_entropy", "match_gather", "walk_head"]

LINEAR = set(spellings("linear"))
MATMUL = set(spellings("matmul"))
MUL = set(spellings("mul"))
DIV = set(spellings("div"))
TANH = set(spellings("tanh"))
LOG_SOFTMAX = set(spellings("log_softmax"))
SOFTMAX = set(spellings("softmax"))
EXP = set(spellings("exp"))
NEG = set(spellings("neg"))
SUM = set(spellings("sum"))


def _op():
    """brcompile::packed_logprob (importing the backends module registers it)."""
    import brcompile.backends.logprob.op  # noqa: F401

    return torch.ops.brcompile.packed_logprob.default


# --------------------------------------------------------------------------------------------------
# facts


@dataclasses.dataclass(frozen=True)
class Head:
    """The LM head and the scalar chain up to the log-softmax input (see the module docstring)."""

    hidden: fx.Node
    weight: fx.Node
    transposed: bool  # weight is Wt [D, V] (``h @ Wt``)
    bias: Optional[fx.Node]
    scale: float
    softcap: float
    folded: tuple  # ((op, scalar), ...) applied to weight and bias: op is operator.mul or operator.truediv
    nodes: tuple  # the head op ... the chain's top, in graph order


@dataclasses.dataclass(frozen=True)
class LogprobMatch:
    """A fusable read-out: ``head`` -> log-softmax -> read at ``window`` for ``targets``. The note
    (``AxesContext.note``) of a fusable ``cross_entropy`` (:func:`cross_entropy`, read by :func:`emit_cross_entropy`)."""

    kind: str  # "gather" | "cross_entropy"
    head: Head
    window: Window
    targets: fx.Node
    covers: tuple  # original nodes replaced (intermediates of size [.., V] and the read-out)
    vocab: int
    entropy: Optional[fx.Node] = None  # the entropy value node (gather only)
    entropy_sign: float = 1.0  # -1 when the graph computes sum(p * logp) (the negative entropy)

    def describe(self, out: fx.Node) -> str:
        h = self.head
        dtype = example_value(h.nodes[-1]).dtype
        # [.., V] values the unfused graph allocates (windows and no-op casts are views)
        k = sum(1 for n in self.covers if (shape_of(n) or (0,))[-1] == self.vocab
                and not _is_window(n) and not _is_noop(n))
        extras = [f"scale {h.scale:g}"] if h.scale != 1.0 else []
        if h.softcap:
            extras.append(f"softcap {h.softcap:g}")
        if h.folded:
            extras.append(f"{len(h.folded)} tensor scale(s) folded into the weight")
        if self.entropy is not None:
            extras.append(f"entropy {self.entropy.name}")
        per_token = k * self.vocab * dtype.itemsize
        return (f"{out.name}: brcompile::packed_logprob({h.hidden.name} -> {h.nodes[0].name} -> "
                f"{self.kind}{', ' if extras else ''}{', '.join(extras)}); avoids {k} x [N, {self.vocab}] "
                f"{str(dtype).replace('torch.', '')} ({per_token:,} bytes per packed token)")


# --------------------------------------------------------------------------------------------------
# matching helpers


def _is(n: Any, targets) -> bool:
    return isinstance(n, fx.Node) and n.op in ("call_function", "call_method") and n.target in targets


def _is_token3(n: Any) -> bool:
    """A TOKEN value [B, L, X] with row dim 0 and position dim 1."""
    if not isinstance(n, fx.Node) or not AXES.has(n):
        return False
    ax = get_axes(n)
    return ax.is_token and (ax.ndim, ax.row, ax.pos) == (3, 0, 1)


def _only_user(n: fx.Node, user: fx.Node) -> bool:
    return set(n.users) == {user}


def _same_dtype(a: fx.Node, b: fx.Node) -> bool:
    va, vb = example_value(a), example_value(b)
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype \
        and va.device == vb.device


def _is_window(n: fx.Node) -> bool:
    """A getitem that only slices the token dims (the lazy window) and keeps the last dim whole."""
    if not (_is(n, {operator.getitem}) and _is_token3(n) and _is_token3(n.args[0])):
        return False
    idx = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
    if sum(1 for e in idx if e is Ellipsis) > 1 or any(not isinstance(e, slice) and e is not Ellipsis for e in idx):
        return False
    if Ellipsis in idx:
        k = idx.index(Ellipsis)
        idx = idx[:k] + (slice(None),) * (3 - (len(idx) - 1)) + idx[k + 1:]
    return len(idx) <= 3 and (len(idx) < 3 or idx[2] == slice(None))


def _is_noop(n: fx.Node) -> bool:
    """A cast or copy that keeps dtype and device (``.float()`` of a float32 value, ``contiguous``)."""
    return _is(n, CASTS_AND_COPIES) and isinstance(n.args[0], fx.Node) and _same_dtype(n, n.args[0]) and (
        n.target != "to" or all(isinstance(a, (torch.dtype, torch.device, str)) for a in n.args[1:]))


def _scalar(x: Any) -> Optional[tuple[bool, Any]]:
    """(is_literal, value) for a scalar operand: a python number, or a CONST node holding a scalar
    (0-d or one-element 1-d tensor, SymInt/SymFloat); None otherwise."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return True, float(x)
    if not isinstance(x, fx.Node) or not get_axes(x).is_const:
        return None
    v = example_value(x)
    if isinstance(v, (torch.SymInt, torch.SymFloat, int, float)) and not isinstance(v, bool):
        return False, x
    if isinstance(v, torch.Tensor) and v.dim() <= 1 and v.numel() == 1 and v.dtype.is_floating_point:
        return False, x
    return None


def _scale_step(n: fx.Node):
    """(chain operand, op, (is_literal, value)) of ``x * s``, ``s * x`` or ``x / s``; None otherwise."""
    if _is(n, MUL) and len(n.args) == 2 and not n.kwargs:
        a, b = n.args
        if _is_token3(a) and _scalar(b) is not None:
            return a, operator.mul, _scalar(b)
        if _is_token3(b) and _scalar(a) is not None:
            return b, operator.mul, _scalar(a)
    if _is(n, DIV) and len(n.args) == 2 and not n.kwargs and _is_token3(n.args[0]):
        s = _scalar(n.args[1])
        if s is not None:
            return n.args[0], operator.truediv, s
    return None


def _head_op(n: fx.Node):
    """(hidden, weight, transposed, bias) of ``linear(h, W[, b])`` / ``h @ Wt``; None otherwise."""
    if _is(n, LINEAR):
        h, w, b = n.args[0], arg(n, 1, "weight"), arg(n, 2, "bias")
        transposed = False
    elif _is(n, MATMUL) and len(n.args) == 2:
        (h, w), b, transposed = n.args, None, True
    else:
        return None
    if not _is_token3(h) or not isinstance(w, fx.Node) or not get_axes(w).is_const:
        return None
    ws = shape_of(w)
    if ws is None or len(ws) != 2:
        return None
    if b is not None and (not isinstance(b, fx.Node) or not get_axes(b).is_const or len(shape_of(b) or ()) != 1):
        return None
    if not _same_dtype(n, h) or not _same_dtype(w, h) or (b is not None and not _same_dtype(b, h)):
        return None
    return h, w, transposed, b


def walk_head(top: fx.Node) -> Optional[Head]:
    """The head chain ending at ``top`` (the log-softmax input), or None. Every node strictly inside the
    chain must have exactly one user (the next one); ``top``'s users are the caller's business."""
    nodes = []
    post, pre, folded = 1.0, 1.0, []
    seen_tanh = False
    n = top
    while True:
        if not _is_token3(n) or (nodes and not _only_user(n, nodes[-1])):
            return None
        nodes.append(n)
        head = _head_op(n)
        if head is not None:
            break
        if _is_window(n) or _is_noop(n):
            n = n.args[0]
            continue
        if _is(n, TANH) and len(n.args) == 1 and not n.kwargs:
            if seen_tanh:
                return None
            seen_tanh = True
            n = n.args[0]
            continue
        step = _scale_step(n)
        if step is None:
            return None
        n, op, (literal, value) = step
        if literal:
            f = value if op is operator.mul else 1.0 / value
            if seen_tanh:
                pre *= f
            else:
                post *= f
        elif seen_tanh or not _tanh_below(n):
            folded.append((op, value))
        else:
            return None  # a tensor scale after the soft-cap cannot go into the weight
    h, w, transposed, b = head
    if seen_tanh:
        if pre == 0:
            return None
        softcap, scale = 1.0 / abs(pre), post * pre
    else:
        softcap, scale = 0.0, post * pre
    if not (scale == scale and abs(scale) not in (0.0, float("inf"))):
        return None
    return Head(h, w, transposed, b, scale, softcap, tuple(reversed(folded)), tuple(reversed(nodes)))


def _tanh_below(n: fx.Node) -> bool:
    """Whether a tanh lies between the head op and ``n`` (inclusive), walking down the chain operands."""
    while isinstance(n, fx.Node) and _is_token3(n) and _head_op(n) is None:
        if _is(n, TANH):
            return True
        step = _scale_step(n)
        n = step[0] if step is not None else (n.args[0] if n.args else None)
    return False


def _dim_is_last(d: Any, ndim: int) -> bool:
    return isinstance(d, int) and normalize_dim(d, ndim) == ndim - 1


def _log_softmax_input(n: fx.Node) -> Optional[fx.Node]:
    if not _is(n, LOG_SOFTMAX) or not _dim_is_last(arg(n, 1, "dim"), 3):
        return None
    dt = n.kwargs.get("dtype")
    if dt is not None and dt != example_value(n.args[0]).dtype:
        return None
    return n.args[0]


def _entropy(L: fx.Node, y: fx.Node, others: list) -> Optional[tuple[fx.Node, float, list]]:
    """The entropy of the log-softmax ``L`` (input ``y``) computed by the nodes ``others`` (L's users
    besides the read-out): ``(value node, sign, nodes)`` or None. Forms: ``p * L`` or ``L * p`` with
    ``p = exp(L)`` or ``softmax(y, -1)``, summed over the last dim, negated before or after the sum
    (or not at all: sign -1)."""
    muls = [u for u in others if _is(u, MUL) and len(u.args) == 2 and L in u.args]
    if len(muls) != 1:
        return None
    M = muls[0]
    P = M.args[1] if M.args[0] is L else M.args[0]
    if _is(P, EXP) and P.args[0] is L and set(others) == {P, M} and _only_user(P, M):
        nodes = [P, M]
    elif _is(P, SOFTMAX) and P.args[0] is y and _dim_is_last(arg(P, 1, "dim"), 3) and \
            P.kwargs.get("dtype") is None and set(others) == {M} and _only_user(P, M):
        nodes = [P, M]
    else:
        return None
    sign = 1.0
    cur = M
    if len(cur.users) == 1 and _is(next(iter(cur.users)), NEG):
        cur = next(iter(cur.users))
        nodes.append(cur)
        sign = -sign
    if len(cur.users) != 1:
        return None
    S = next(iter(cur.users))
    dim = arg(S, 1, "dim")
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    if not _is(S, SUM) or not _dim_is_last(dim, 3) or S.kwargs.get("dtype") is not None:
        return None
    nodes.append(S)
    ent = S
    if len(S.users) == 1 and _is(next(iter(S.users)), NEG) and sign > 0:
        ent = next(iter(S.users))
        nodes.append(ent)
        sign = -sign
    # sum(p * logp) = -H: the graph's value is -sign * H
    return ent, -sign, nodes


def _readout_chain(x: fx.Node) -> Optional[tuple[fx.Node, list]]:
    """(log_softmax node, window/no-op nodes between it and ``x``) or None."""
    path = []
    n = x
    while not _is(n, LOG_SOFTMAX):
        if not (_is_window(n) or _is_noop(n)):
            return None
        path.append(n)
        n = n.args[0]
    return n, list(reversed(path))


def match_gather(node: fx.Node) -> Optional[LogprobMatch]:
    """``log_softmax(head(h)) [-> window] .gather(-1, targets)`` with targets [B', L', 1] (see module
    docstring), or None."""
    x, dim, idx = node.args[0], arg(node, 1, "dim"), arg(node, 2, "index")
    if not _is_token3(x) or not _dim_is_last(dim, 3) or not isinstance(idx, fx.Node):
        return None
    xs, iv = example_value(x), example_value(idx)
    if not isinstance(iv, torch.Tensor) or iv.dim() != 3 or iv.dtype != torch.int64 or iv.shape[2] != 1 \
            or not all(_known_equal(a, b) for a, b in zip(iv.shape[:2], xs.shape[:2])):
        return None
    found = _readout_chain(x)
    if found is None:
        return None
    L, path = found
    y = _log_softmax_input(L)
    if y is None or not _is_token3(L):
        return None
    chain_users = path[1:] + [node]
    for n, user in zip(path, chain_users):
        if not _only_user(n, user):
            return None
    first = path[0] if path else node
    others = [u for u in L.users if u is not first]
    entropy, sign, ent_nodes = None, 1.0, []
    if others:
        found_e = _entropy(L, y, others)
        if found_e is None:
            return None
        entropy, sign, ent_nodes = found_e
    y_users = {L} | ({ent_nodes[0]} if ent_nodes and _is(ent_nodes[0], SOFTMAX) else set())
    if set(y.users) != y_users:
        return None
    head = walk_head(y)
    if head is None:
        return None
    V = _vocab(head)
    if V is None or shape_of(x)[-1] != V:
        return None
    covers = tuple(head.nodes) + (L, *path, node, *ent_nodes)
    return LogprobMatch("gather", head, get_axes(x).window, idx, covers, V, entropy, sign)


def _vocab(head: Head) -> Optional[int]:
    ws = shape_of(head.weight)
    hs = shape_of(head.hidden)
    V, D = (ws[1], ws[0]) if head.transposed else (ws[0], ws[1])
    return V if hs[-1] == D else None


def _known_equal(a, b) -> bool:
    """``a == b`` for ints or SymInts, without adding guards (False when not provable)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b))


# --------------------------------------------------------------------------------------------------
# cross entropy


def _ce_args(node: fx.Node) -> dict:
    names = ["input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing"]
    defaults = [None, None, None, None, -100, None, "mean", 0.0]
    bound = dict(zip(names, defaults))
    bound.update(zip(names, node.args))
    bound.update(node.kwargs)
    return bound


def match_cross_entropy(node: fx.Node) -> Optional[LogprobMatch]:
    """``F.cross_entropy(X.reshape(-1, V), T)`` with X = head(h) TOKEN [B', L', V] and T a 1-d integer
    tensor of B'·L' class indices, no weight, no label smoothing, legacy args unset; or None."""
    a = _ce_args(node)
    R, T = a["input"], a["target"]
    if a["weight"] is not None or a["size_average"] is not None or a["reduce"] is not None \
            or a["label_smoothing"] != 0.0 or a["reduction"] not in ("none", "mean", "sum") \
            or not isinstance(a["ignore_index"], int):
        return None
    if not _is(R, FLAT_RESHAPES) or not _only_user(R, node) or not isinstance(T, fx.Node) or get_axes(T).is_token:
        return None
    X = R.args[0]
    rs, tv = shape_of(R), example_value(T)
    if not _is_token3(X) or rs is None or len(rs) != 2 or rs[1] != shape_of(X)[-1]:
        return None
    if not isinstance(tv, torch.Tensor) or tv.dim() != 1 or tv.dtype != torch.int64:
        return None
    if not _only_user(X, R):
        return None
    head = walk_head(X)
    if head is None:
        return None
    V = _vocab(head)
    if V is None or rs[1] != V:
        return None
    return LogprobMatch("cross_entropy", head, get_axes(X).window, T, tuple(head.nodes) + (R, node), V)


# --------------------------------------------------------------------------------------------------
# emission


def _enabled(pk) -> bool:
    return bool(getattr(pk.options, "fuse_logprob", True))


def _emit_op(pk, m: LogprobMatch, index: fx.Node, targets: fx.Node, want_entropy: bool, out_name: fx.Node):
    """Emit brcompile::packed_logprob for ``m`` on the packed graph; returns the op's (logp, entropy) node."""
    g = pk.graph
    h = g.call_method("squeeze", (pk.packed(m.head.hidden), 0))
    w = pk.packed(m.head.weight)
    if m.head.transposed:
        w = g.call_method("t", (w,))
    b = None if m.head.bias is None else pk.packed(m.head.bias)
    for op, s in m.head.folded:
        s = pk.packed(s) if isinstance(s, fx.Node) else s
        w = g.call_function(op, (w, s))
        if b is not None:
            b = g.call_function(op, (b, s))
    res = g.call_function(_op(), (h, w, b, index, targets, float(m.head.scale), float(m.head.softcap),
                                  bool(want_entropy), 0, "auto"))
    FUSED.set(res, m.describe(out_name))
    FUSED_COVERS.set(res, tuple(n.name for n in m.covers))
    record_origin(res, out_name, __name__)
    log.debug("fused %s", FUSED.require(res))
    return res


def _token_closure(root: fx.Node) -> list:
    """The TOKEN values computed from ``root`` through TOKEN values only (``0.01 * entropy`` ...)."""
    out, todo, seen = [], [root], {root}
    while todo:
        for u in todo.pop().users:
            if u not in seen and u.op != "output" and get_axes(u).is_token:
                seen.add(u)
                out.append(u)
                todo.append(u)
    return out


def _entropy_users(pk, m: LogprobMatch) -> Optional[list]:
    """The TOKEN values computed from the entropy (to be computed densely instead, from the fused
    op's dense entropy), or None when the entropy cannot be fused: it must be read at the read-out's
    window, and neither it nor any of those values may have been emitted yet (they come later in the
    graph than the gather)."""
    ent = m.entropy
    if ent in pk._dense or get_axes(ent).window != m.window:
        return None
    closure = _token_closure(ent)
    if any(n in pk.env or pk.has_note(n) for n in closure):
        return None
    return closure


def emit_fused_gather(pk, node: fx.Node) -> Optional[fx.Node]:
    """The fused replacement of the lazy gather ``node`` ([B', L', 1] log-probs), or None to keep the
    lazy gather. Also provides the dense entropy when the graph computes it."""
    if not _enabled(pk):
        return None
    m = match_gather(node)
    if m is None:
        return None
    ent_users = _entropy_users(pk, m) if m.entropy is not None else []
    if ent_users is None:
        return None
    g = pk.graph
    index = pk.index(m.window)
    targets = g.call_method("squeeze", (pk.dense(m.targets), -1))
    res = _emit_op(pk, m, index, targets, m.entropy is not None, node)
    out = g.call_method("unsqueeze", (g.call_function(operator.getitem, (res, 0)), -1))
    if m.entropy is not None:
        ent = g.call_function(operator.getitem, (res, 1))
        if m.entropy_sign < 0:
            ent = g.call_function(operator.neg, (ent,))
        if len(shape_of(m.entropy)) == 3:  # keepdim=True
            ent = g.call_method("unsqueeze", (ent, -1))
        pk._dense[m.entropy] = ent
        # what the loss computes from the entropy runs on the dense [B', L'] values (exact: it is the
        # original op on the original operands), so nothing needs the packed entropy.
        for n in ent_users:
            set_axes(n, DENSE)
        FUSED_COVERS.set(res, FUSED_COVERS.require(res) + tuple(n.name for n in ent_users))
    return out


def emit_cross_entropy(pk, node: fx.Node):
    """cross_entropy over a fused head: ``nll = -logp`` (0 where target == ignore_index), then the
    reduction (``mean`` divides by the number of non-ignored targets, as torch does)."""
    m = pk.note(node, LogprobMatch)
    g = pk.graph
    if m is None or not _enabled(pk):
        args, kwargs = fx.node.map_aggregate((node.args, node.kwargs),
                                             lambda a: pk.dense(a) if isinstance(a, fx.Node) else a)
        return g.create_node(node.op, node.target, tuple(args), dict(kwargs))
    a = _ce_args(node)
    index = g.call_method("reshape", (pk.index(m.window), (1, -1)))
    t = pk.dense(m.targets)
    keep = g.call_function(operator.ne, (t, a["ignore_index"]))
    safe = g.call_function(torch.where, (keep, t, 0))
    res = _emit_op(pk, m, index, g.call_method("reshape", (safe, (1, -1))), False, node)
    logp = g.call_method("reshape", (g.call_function(operator.getitem, (res, 0)), (-1,)))
    nll = g.call_function(torch.where, (keep, g.call_function(operator.neg, (logp,)), 0.0))
    if a["reduction"] == "none":
        return nll
    total = g.call_method("sum", (nll,))
    if a["reduction"] == "sum":
        return total
    return g.call_function(operator.truediv, (total, g.call_method("sum", (keep,))))


@axis_rule(emit=emit_cross_entropy, always=True)
def cross_entropy(ctx: AxesContext, node: fx.Node):
    """F.cross_entropy: on a TOKEN operand -> dense (materialised, as without a rule); on the dense
    ``logits.reshape(-1, V)`` of a fusable head -> noted for :func:`emit_cross_entropy` (DENSE)."""
    facts = [get_axes(a) for a in node_args(node)]
    if any(f.is_token for f in facts):
        return dense_fallback(ctx, node, "cross_entropy of a token value")
    if not any(f.is_dense for f in facts):
        return CONST
    m = match_cross_entropy(node)
    if m is not None:
        ctx.set_note(node, m)
    return DENSE
