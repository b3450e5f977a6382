"""Attention sinks: a per-head logit joined to the scores before the softmax and dropped after it, or merged
through a log-sum-exp gate."""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from brcompile.passes.analysis.axes import normalize_dim
from brcompile.passes.spellings import LOGSUMEXP, MAX, RESHAPE_VIEWS, arg, op_name as _op_name, spellings
from brcompile.passes.canonical.attention.common import CAST, MUL, call_in, only_user, refuse, tensor
from brcompile.passes.canonical.attention.scores import looks_like_attention


def match_sinks(sm: fx.Node, x: fx.Node, dim: Any) -> tuple[Optional[fx.Node], fx.Node, list]:
    """(S, scores, shift) when the softmax input ``x`` is ``cat([scores, sinks], -1)``, optionally minus its row
    maximum (``c - c.max(-1, keepdim=True).values`` / ``amax``: a per-row shift, the softmax is unchanged;
    stripped also without a concatenation: (None, c, shift); ``shift`` the nodes of the shift and the
    concatenation, output side first, [] without either),
    with ``sinks`` a ``[B, H, Lq, 1]`` column: a view/expand of a 1-D node S of the H heads' logits (head h
    reads S[h]: only reshape/view/unsqueeze/expand, which keep the element order), or else the column itself
    as S, one logit per query row (Inkling2's projection of the hidden states; the SDPA rule requires it to be
    a value of the query token); (None, x) when ``x`` is no concatenation; raises CannotReplay for a
    concatenation onto attention scores that is not that."""
    c, shift = x, []
    if call_in(x, spellings("sub")) and len(x.args) == 2 and not x.kwargs:
        c0, m = x.args
        if isinstance(c0, fx.Node) and _is_row_max(m, c0):
            c = c0
            if set(c.users) != {x, _max_source(m)}:
                refuse(sm, c, "the scores shifted by their row maximum have other users")
            shift = [x] + ([m] if m is not _max_source(m) else []) + [_max_source(m)]
    if not (call_in(c, spellings("cat")) and tensor(c) is not None and tensor(c).dim() == 4):
        return None, c, shift
    ops = c.args[0] if c.args else c.kwargs.get("tensors")
    cdim = arg(c, 1, "dim", 0)
    if not (isinstance(ops, (list, tuple)) and len(ops) == 2 and all(isinstance(o, fx.Node) for o in ops)):
        return None, c, shift
    scores, sink = ops
    if not looks_like_attention(scores):
        return None, c, shift
    ts, te = tensor(scores), tensor(sink)
    if normalize_dim(cdim, 4) != 3 or dim is None or normalize_dim(dim, 4) != 3 or te is None or ts is None:
        refuse(sm, c, "logits concatenated to the scores on a dim other than the key dim")
    H = ts.shape[1]
    if te.dim() != 4 or tuple(te.shape) != (ts.shape[0], H, ts.shape[2], 1):
        refuse(sm, c, "logits concatenated to the scores that are not one sink logit per query row "
                f"(a [B, H, Lq, 1] column; got {list(te.shape)} beside scores {list(ts.shape)})")
    source = _sink_source(sink)
    if source is not None and (tensor(source).numel() != H or sum(int(d) != 1 for d in tensor(source).shape) > 1):
        refuse(sm, c, "logits concatenated to the scores that are a view of neither one logit per head "
                "(an [H] tensor viewed as [1, H, 1, 1] and expanded) nor a [B, H, Lq, 1] value per query row")
    if len(c.users) != 1 and c is x:
        refuse(sm, c, "the scores concatenated with the sink logits have other users")
    # per head: the [H] source; per query row: the [B, H, Lq, 1] column itself (attention.sdpa requires it to be
    # a value of the query token, its token axis the queries')
    return source if source is not None else sink, scores, shift + [c]


SIGMOID = spellings("sigmoid")


def match_lse_sink(sm: fx.Node, x: fx.Node, sinks: Optional[fx.Node], dead: list
                    ) -> Optional[tuple[fx.Node, fx.Node, fx.Node]]:
    """(S, gate, mul) when the scores ``x`` also feed a sink applied after the attention (GraniteMoE-SWA)::

        g = sigmoid(logsumexp(x, -1) - S.view(1, H, 1)).unsqueeze(-1)     # [B, H, Lq, 1]
        o = (softmax(x) @ v) * g

    ``sigmoid(lse - S) = sum_j e^x_j / (sum_j e^x_j + e^S)``, so ``o = sum_j e^x_j v_j / (sum_j e^x_j + e^S)``:
    attention with one value-less sink logit ``S[h]`` per head, like :func:`match_sinks`. Casts on the way
    must keep the dtype (a rounding cast would change the gate). The gate's nodes join ``dead``; ``mul`` is
    checked against the attention output by :func:`lse_sink_output`. None when no user of ``x`` is a
    logsumexp; raises CannotReplay for one that is not this form."""
    lse = next((u for u in x.users if call_in(u, LOGSUMEXP)), None)
    if lse is None:
        return None
    tx = tensor(x)
    d = arg(lse, 1, "dim")
    d = d[0] if isinstance(d, (list, tuple)) and len(d) == 1 else d
    keep = arg(lse, 2, "keepdim", False)
    if sinks is not None or tx.dim() != 4 or not isinstance(d, int) or normalize_dim(d, 4) != 3 or keep:
        refuse(sm, lse, "the scores also go to a logsumexp that is not a sink gate sigmoid(logsumexp(s, -1) - S) "
                "on the attention output")
    H = tx.shape[1]
    chain = [lse]
    sub = only_user(lse)
    if not (call_in(sub, spellings("sub")) and len(sub.args) == 2 and not sub.kwargs and sub.args[0] is lse
            and isinstance(sub.args[1], fx.Node)):
        refuse(sm, sub or lse, "the logsumexp of the scores is not a sink gate (logsumexp - S per head)")
    sv, source = tensor(sub.args[1]), _sink_source(sub.args[1])
    if source is None or sv is None or sv.dim() not in (2, 3) or tuple(sv.shape[-2:]) != (H, 1) \
            or any(int(e) != 1 for e in sv.shape[:-2]) or tensor(source).numel() != H:
        refuse(sm, sub, "the logsumexp of the scores minus something other than one sink logit per head "
                "(an [H] tensor viewed as [1, H, 1])")
    chain.append(sub)
    cur, seen_sigmoid, seen_unsqueeze = sub, False, False
    while True:
        nxt = only_user(cur)
        if nxt is None:
            refuse(sm, cur, "the sink gate of the attention has other users")
        if call_in(nxt, CAST) and nxt.op == "call_method" and nxt.args[0] is cur:
            if tensor(nxt).dtype != tensor(cur).dtype:
                refuse(sm, nxt, f"the sink gate sigmoid(logsumexp(s) - S) is computed in {tensor(nxt).dtype}, "
                        f"the scores are {tensor(cur).dtype}: its rounding is not reproduced")
        elif not seen_sigmoid and call_in(nxt, SIGMOID) and nxt.args[0] is cur:
            seen_sigmoid = True
        elif seen_sigmoid and not seen_unsqueeze and call_in(nxt, ("unsqueeze", torch.unsqueeze)) \
                and nxt.args[0] is cur and tensor(nxt).dim() == 4 and tensor(nxt).shape[-1] == 1:
            seen_unsqueeze = True
        elif seen_unsqueeze and call_in(nxt, MUL) and len(nxt.args) == 2 and not nxt.kwargs:
            dead.extend(reversed(chain))
            return source, cur, nxt
        else:
            refuse(sm, nxt, f"the logsumexp of the scores goes to `{_op_name(nxt)}`, not to a sink gate "
                    "sigmoid(logsumexp(s) - S).unsqueeze(-1) multiplying the attention output")
        chain.append(nxt)
        cur = nxt


def lse_sink_output(sm: fx.Node, gate: tuple, out: fx.Node, merged: bool, dead: list) -> tuple[fx.Node, fx.Node]:
    """(S, mul): the sink gate of :func:`match_lse_sink` multiplies the [B, H, Lq, D] attention output ``out``
    (its only user); ``mul`` is then the chain's output."""
    source, g, mul = gate
    if merged or only_user(out) is not mul or {a for a in mul.args} != {out, g}:
        refuse(sm, mul, "the sink gate sigmoid(logsumexp(s) - S) does not multiply the attention output")
    dead.insert(0, mul)
    return source, mul


def _max_source(m: fx.Node) -> Optional[fx.Node]:
    """The ``max``/``amax`` node whose values ``m`` reads (``m`` itself for ``amax``)."""
    if call_in(m, MAX) and m.target in (torch.amax, "amax"):
        return m
    if isinstance(m, fx.Node) and m.op == "call_function" and m.target in (operator.getitem, getattr) \
            and m.args[1] in (0, "values") and call_in(m.args[0], MAX):
        return m.args[0]
    return None


def _is_row_max(m: Any, c: fx.Node) -> bool:
    """``m`` is ``c.max(dim=-1, keepdim=True).values`` (or ``[0]``, or ``amax(c, -1, keepdim=True)``)."""
    src = _max_source(m) if isinstance(m, fx.Node) else None
    if src is None or src.args[0] is not c:
        return False
    d = arg(src, 1, "dim")
    keep = arg(src, 2, "keepdim", False)
    if isinstance(d, (list, tuple)) and len(d) == 1:
        d = d[0]
    return isinstance(d, int) and normalize_dim(d, 4) == 3 and keep is True


def _sink_source(n: fx.Node) -> Optional[fx.Node]:
    """The 1-D (or one-non-singleton-dim) node that ``n`` is a chain of reshape/view/unsqueeze/expand of, or
    None when another op is on the way."""
    while call_in(n, RESHAPE_VIEWS):
        n = n.args[0]
        t = tensor(n)
        if t is not None and sum(int(d) != 1 for d in t.shape) <= 1 and not call_in(n, RESHAPE_VIEWS):
            return n
    return None


def drops_last_column(n: Optional[fx.Node], probs: fx.Node) -> bool:
    """``n`` is ``probs[..., :-1]`` (the sink column dropped)."""
    if n is None or n.op != "call_function" or n.target is not operator.getitem or n.args[0] is not probs:
        return False
    idx = n.args[1]
    if not isinstance(idx, tuple):
        return False
    if idx and idx[0] is Ellipsis:
        idx = idx[1:]
    else:
        idx = tuple(i for i in idx[3:]) if all(i == slice(None) for i in idx[:3]) and len(idx) == 4 else None
    return idx == (slice(None, -1, None),)
