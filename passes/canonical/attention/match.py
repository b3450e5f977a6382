"""The eager attention chain: ``softmax(scale · q kᵀ + masks) @ v`` with its casts, scales, dropout and output,
matched from the softmax outwards (:func:`match_eager_attention`)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from brcompile.passes.analysis.axes import normalize_dim
from brcompile.passes.spellings import arg, op_name as _op_name, random_draw, spellings
from brcompile.passes.canonical.attention.common import (
    BMM, CAST, DIV, DROPOUT, EagerChain, MASKED_FILL, MATMUL, MUL, call_in, is_scalar, mutates, number, only_user,
    refuse, tensor,
)
from brcompile.passes.canonical.attention.masks import per_head
from brcompile.passes.canonical.attention.scores import (
    Scores, einsum_4d, key_value, looks_like_attention, merged_heads, permuted_value, query_value, scores_op,
    softmax_args, split_heads,
)
from brcompile.passes.canonical.attention.sinks import drops_last_column, lse_sink_output, match_lse_sink, match_sinks
from brcompile.passes.canonical.attention.steps import (
    check_mask_steps, mask_or_scale_step, match_softcap, path_to_scores,
)


def match_eager_attention(sm: fx.Node, scalar: Optional[Callable[[fx.Node], Optional[float]]] = None
                          ) -> Optional[EagerChain]:
    """The eager chain around softmax ``sm`` (module docstring), None when ``sm`` is not an attention's
    softmax; raises CannotReplay when it is one but the chain is not exactly that math. Walks back from the
    softmax (sinks, mask and scale steps, soft-cap, scale, scores), then forward (probabilities, output).
    ``scalar`` gives the value of a scalar node read from an input (and guards it), for ``baddbmm``'s
    ``alpha`` / ``beta`` under dynamic=True."""
    x, dim, dtype = softmax_args(sm)
    if not isinstance(x, fx.Node) or tensor(x) is None:
        return None
    if not looks_like_attention(x):
        return None
    x, dtype, cast = _softmax_input_cast(x, dtype)
    sinks, x, shift = match_sinks(sm, x, dim)
    if not looks_like_attention(x):
        return None
    dead = [sm, *cast, *shift]
    x, folded = _softmax_frame(sm, x, dim, dead)
    masks, post, cur = _match_mask_steps(sm, x, dead)
    softcap, cur = match_softcap(cur, dead)
    if softcap and post != 1.0:
        refuse(sm, x, "a scale between the soft-capped scores and the softmax")
    scale, cur = _match_scores_scale(cur, dead)
    scale = _with_post_scale(sm, x, scale, post)
    sc = scores_op(cur)
    if sc is None:
        _refuse_scores(sm, cur)
    dead.extend(sc.nodes)
    scale = _fold_scores_op(sm, x, scale, sc, masks, scalar)
    _check_scores(sm, x, cur, sc, masks, dtype)
    _check_mask_precision(sm, x, cur, masks)
    probs, p, training, folded = _match_probabilities(sm, sinks, sc, dead, folded, masks)
    gate = match_lse_sink(sm, x, sinks, dead)
    out, v, merged_out, (v_dims, out_dims) = _match_output(sm, probs, sc, dead, folded,
                                                            gate[2] if gate is not None else None)
    _check_compute_dtype(sm, sc, probs, out)
    if gate is not None:
        sinks, out = lse_sink_output(sm, gate, out, merged_out, dead)
    return EagerChain(sc.q, sc.k, v, scale, masks, p, training, out, dead, softcap, sinks,
                      _heads(sc) if merged_out else sc.heads, merged_out, sc.k_dims, sc.q_dims, v_dims, out_dims)


def _softmax_input_cast(x: fx.Node, dtype: Any) -> tuple[fx.Node, Any, list]:
    """(scores, dtype, [cast]) when the softmax input ``x`` is a float cast of the scores (MPT's and XLM's
    ``softmax(scores.float())``): ``softmax(s.to(d))`` is ``softmax(s, dtype=d)`` (the softmax casts its input
    first), so the cast is the softmax's dtype (the lower precision of the two when the softmax names one too,
    :func:`_check_scores` judges it); (x, dtype, []) otherwise."""
    if not (call_in(x, CAST) and x.op == "call_method" and x.args and isinstance(x.args[0], fx.Node)
            and len(x.users) == 1):
        return x, dtype, []
    src, to = tensor(x.args[0]), tensor(x)
    if src is None or to is None or not (src.is_floating_point() and to.is_floating_point()):
        return x, dtype, []
    if isinstance(dtype, torch.dtype) and dtype.itemsize < to.dtype.itemsize:
        return x.args[0], dtype, [x]
    return x.args[0], to.dtype, [x]


def _softmax_frame(sm: fx.Node, x: fx.Node, dim: Any, dead: list) -> tuple[fx.Node, bool]:
    """(scores, folded): the softmax runs over the key dim of the scores, either 4-D [B, H, Lq, Lk] (dim 3;
    ``folded`` False) or with the heads folded into the batch, [B*H, Lq, Lk] (dim 2; ``folded`` True). A folded
    softmax input is the merged-heads view of 4-D scores (BART: the mask is added to ``s.view(B, H, Lq, Lk)``,
    the sum viewed back as [B*H, Lq, Lk]; row b*H + h of the view is [b, h], so the softmax over its last dim is
    the softmax over the key dim of the 4-D scores: the view joins the chain and the 4-D scores are returned)
    or a chain of numeric scales of the 3-D product itself (:func:`_check_scores` refuses a mask there)."""
    t = tensor(x)
    if t.dim() not in (3, 4) or dim is None or normalize_dim(dim, t.dim()) != t.dim() - 1:
        refuse(sm, sm, f"softmax over dim {dim} of a {t.dim()}-D value, not the key dim")
    if t.dim() == 4:
        return x, False
    x4 = merged_heads(x)
    if x4 is not None:
        dead.append(x)
        return x4, True
    return x, True


def _heads(sc: Scores) -> int:
    """H of the attention (static: a folded output is unflattened by it)."""
    return sc.heads if sc.heads is not None else int(query_value(sc).shape[1])


def _match_mask_steps(sm: fx.Node, x: fx.Node, dead: list) -> tuple[list, float, Any]:
    """(masks, post, node) walking back from the softmax input ``x`` over mask steps (additive masks,
    masked_fill / where with a large negative value) and numeric scales in any order: each mask step with
    the product of the scales between it and the softmax; ``post`` the product of all of them; ``node`` the
    first node that is neither (a soft-cap, the scale, the scores)."""
    masks: list[tuple] = []  # ("add", M, post) | ("fill", C, v, post) | ("keep", C, v, post) | ("blend", B, A, post)
    post = 1.0
    cur = x
    while True:
        step = mask_or_scale_step(sm, cur)
        if step is None:
            return masks, post, cur
        kind, payload, nxt, *inner = step  # inner: a blend's product s * B
        if kind == "scale":
            post *= payload
        else:
            payload = tuple(_implicit_broadcast(a, cur, dead) for a in payload)
            masks.append((kind, *payload, post))
        dead.append(cur)
        dead.extend(inner)
        cur = nxt


EXPAND_AS = spellings("expand_as")


def _implicit_broadcast(a: Any, step: fx.Node, dead: list) -> Any:
    """A mask step's operand without its expansion to the scores' shape: ``M`` for ``M.expand_as(t)`` where ``t``
    has the shape of the step's result (XLM: ``(mask == 0).view(B, 1, 1, Lk).expand_as(scores)``, then
    ``scores.masked_fill_(that, v)``). The step (``masked_fill``, ``where``, ``+``, ``*``) broadcasts ``M`` to
    the scores itself, so ``step(s, M.expand_as(t)) == step(s, M)`` elementwise; the expansion reads only
    ``t``'s shape, and ``t`` is often the scores themselves, a chain value that would otherwise keep a user
    outside the chain. The expansion joins the chain (``dead``); any other user of it refuses the chain
    (:func:`_match_output`)."""
    if not (call_in(a, EXPAND_AS) and len(a.args) == 2 and not a.kwargs and isinstance(a.args[1], fx.Node)):
        return a
    m, t = a.args
    tt, ts = tensor(t), tensor(step)
    if not isinstance(m, fx.Node) or tt is None or ts is None or tt.dim() != ts.dim() \
            or not all(statically_known_true(x == y) for x, y in zip(tt.shape, ts.shape)):
        return a
    dead.append(a)
    return m


def _match_scores_scale(cur: Any, dead: list) -> tuple[Any, Any]:
    """(c, scores) for ``scores * c`` / ``c * scores`` / ``scores / c`` (``("div", c)``) with ``c`` a number
    or a scalar node, directly on the scores; (1.0, cur) without one."""
    if call_in(cur, MUL + DIV) and len(cur.args) == 2 and not cur.kwargs:
        a, b = cur.args
        if scores_op(a) is not None and is_scalar(b):
            dead.append(cur)
            return (("div", b) if cur.target in DIV else b), a
        if cur.target in MUL and scores_op(b) is not None and is_scalar(a):
            dead.append(cur)
            return a, b
    return 1.0, cur


def _with_post_scale(sm: fx.Node, x: fx.Node, scale: Any, post: float) -> Any:
    """The scale of ``q k^T`` with the numeric scales between the masks and the softmax folded in (then a
    number: ``post * c``, or ``post / c``)."""
    if post == 1.0:
        return scale
    if isinstance(scale, fx.Node) or (isinstance(scale, tuple) and isinstance(scale[1], fx.Node)):
        refuse(sm, x, "a scale read from an input combined with another scale of the scores")
    return post * (1.0 / scale[1] if isinstance(scale, tuple) else scale)


def _fold_scores_op(sm: fx.Node, x: fx.Node, scale: Any, sc: Scores, masks: list,
                    scalar: Optional[Callable[[fx.Node], Optional[float]]] = None) -> Any:
    """The SDPA scale once the scores op's own factors are in: ``c * (alpha * q k^T + beta * bias)`` is
    ``(c * alpha) * q k^T`` plus the bias step ``("bias", bias, H, c * beta)`` (a ``baddbmm``'s input, read
    as [B, H, ...] by :func:`canonical_mask`; none at ``beta = 0``, where torch does not read the input).
    ``alpha`` / ``beta`` read from scalar inputs take their values through ``scalar`` (guarded there)."""
    for name in ("alpha", "beta"):
        f = getattr(sc, name)
        if isinstance(f, fx.Node):
            value = scalar(f) if scalar is not None else None
            if value is None:
                refuse(sm, f, f"the baddbmm {name} of the scores is computed in the graph, not a number or a "
                        "scalar input")
            setattr(sc, name, float(value))
    if sc.beta == 0:
        sc.bias = None
    if sc.alpha == 1.0 and sc.bias is None:
        return scale
    if isinstance(scale, fx.Node) or (isinstance(scale, tuple) and isinstance(scale[1], fx.Node)):
        refuse(sm, x, "a scale read from an input on baddbmm scores")
    c = 1.0 / scale[1] if isinstance(scale, tuple) else scale
    if sc.bias is not None:
        masks.append(("bias", sc.bias, sc.heads, c * sc.beta))
    return c * sc.alpha


def _refuse_scores(sm: fx.Node, cur: Any):
    """Refuse a chain whose scores are not a q @ k^T product, naming the ops on the way."""
    path = path_to_scores(cur)
    capped = " (logit soft-capping)" if "tanh" in path else ""
    if any(p in ("cat", "concat", "concatenate") for p in path):
        refuse(sm, cur, f"`{' <- '.join(path)}`: logits concatenated to the scores before the softmax "
                "in a form that is not an attention sink (one [H] logit per head joined on the key dim, "
                "dropped after the softmax)")
    refuse(sm, cur, f"`{' <- '.join(path)}` between the scores matmul and the softmax{capped} "
            "is not supported")


def _check_scores(sm: fx.Node, x: fx.Node, cur: fx.Node, sc: Scores, masks: list, dtype: Any) -> None:
    """Shapes and dtypes: the masks do not enlarge the scores and are float of the scores' dtype, q and k
    have the same heads, and the softmax runs in the scores' precision or higher."""
    tq, tk, ts = query_value(sc), key_value(sc), tensor(cur)
    if tuple(tensor(x).shape) != tuple(ts.shape):
        refuse(sm, x, "the attention mask enlarges the scores")
    if sc.folded and any(m[0] not in ("bias", "floor") for m in masks):
        refuse(sm, x, "a mask on [B*H, Lq, Lk] scores (heads folded into the batch dim): only a mask on their "
                "[B, H, Lq, Lk] view is read per head")
    check_mask_steps(sm, x, masks)
    for m in masks:
        if m[0] in ("add", "blend"):
            tm = tensor(_added(m))
            if tm is None or not tm.is_floating_point():
                refuse(sm, x, "the value added to the scores is not a float tensor (a bool mask added is a bias)")
    if tq.shape[:2] != tk.shape[:2]:
        refuse(sm, cur, "query and key heads differ (no repeat_kv before the scores)")
    sd = ts.dtype
    sm_dtype = dtype if isinstance(dtype, torch.dtype) else sd
    if sm_dtype.itemsize < sd.itemsize:
        refuse(sm, sm, f"the softmax of {sd} scores is computed in {sm_dtype}: the original rounds the "
                f"probabilities to {sm_dtype} (and overflows a lowest-{sd} mask value to -inf), which tree "
                f"attention in {sd} does not reproduce; use {sd} throughout or attn_implementation='sdpa'")


def _check_mask_precision(sm: fx.Node, x: fx.Node, cur: fx.Node, masks: list) -> None:
    """An additive mask of another float dtype than the scores ``cur``. One of lower precision is promoted
    exactly by the sum (``s + M == s + M.to(s.dtype)``; :func:`canonical_mask` casts it) and accepted, unless it
    is a per-head bias, whose rounding tree attention does not reproduce (refused). One of higher precision
    promotes the scores themselves, exactly (a bfloat16 score is a float32 value; autocast's bfloat16 ``q k^T``
    plus HF's float32 mask): the softmax then sees the scores unrounded plus the mask in its precision, as tree
    attention sees them (its scores and bias in its accumulation dtype), so it is accepted, and the canonical
    mask keeps that precision (:func:`_mask_dtype`). A 0/1 blend factor of higher precision likewise. Runs after
    :func:`_check_scores`, so a softmax in lower precision than the scores is named first."""
    ts = tensor(cur)
    for m in masks:
        tm = tensor(_added(m)) if m[0] in ("add", "blend") else None
        if tm is None or torch.promote_types(tm.dtype, ts.dtype) == tm.dtype:  # at least the scores' precision
            continue
        if per_head(_added(m)):
            refuse(sm, x, f"a {tm.dtype} per-head bias (ALiBi) added to {ts.dtype} scores: tree attention "
                    f"does not reproduce its {tm.dtype} rounding (build the bias in {ts.dtype})")


def _check_compute_dtype(sm: fx.Node, sc: Scores, probs: fx.Node, out: fx.Node) -> None:
    """The chain computes in one dtype, the one the canonical SDPA node computes in (its output's, the SDPA
    rule casts q, k, v to it: :func:`..rules.attention.attention_dtype`): the scores product ``q k^T`` and the
    product with the values have one dtype ``d`` (autocast runs both in its dtype whatever q, k, v are), and the
    probabilities reach the second product in the query's dtype or in ``d`` (autocast's product rounds float32
    probabilities to ``d``, as it rounds v). Refused otherwise, with the dtypes named."""
    td, to, tp = tensor(sc.nodes[0]), tensor(out), tensor(probs)
    if td is None or to is None or tp is None:
        refuse(sm, out, "the attention's dtypes are unknown (no traced values)")
    if td.dtype != to.dtype:
        refuse(sm, out, f"the scores q k^T are computed in {td.dtype}, the product with the values in {to.dtype}: "
                "tree attention computes both in one dtype")
    tq = query_value(sc)
    if tp.dtype not in (tq.dtype, to.dtype):
        refuse(sm, probs, f"the probabilities are {tp.dtype}, the query is {tq.dtype} and the attention "
                f"computes in {to.dtype}")


def _added(m: tuple) -> Any:
    """The operand a mask step adds to the scores: M of ``("add", M, post)``, A of ``("blend", B, A, post)``."""
    return m[2] if m[0] == "blend" else m[1]


def _match_probabilities(sm: fx.Node, sinks: Optional[fx.Node], sc: Scores, dead: list, folded: bool,
                         masks: Sequence = ()) -> tuple[fx.Node, Any, Any, bool]:
    """(probs, dropout p, training, folded) walking forward from the softmax: [drop the sink column] -> [cast to
    the query's dtype] and [dropout] in either order, and any views folding the heads into the batch
    ([B, H, Lq, Lk] -> [B*H, Lq, Lk], :func:`merged_heads`) or unfolding them (:func:`split_heads`, into q's
    (B, H)): each keeps the elements, only the frame changes. ``folded`` is the frame of the softmax's output
    on entry and of ``probs`` on return; ``probs`` is the last node of the walk (the product's operand).
    Also once: ``p.masked_fill(C, 0)`` with the condition ``C`` of a blocking ``masked_fill`` step of the scores
    (CPM-Ant; :func:`_zeroes_blocked`)."""
    tq = query_value(sc)
    cur = sm
    nxt = only_user(cur)
    if sinks is not None:
        if not drops_last_column(nxt, cur):
            refuse(sm, nxt or sm, "the softmax over the scores and the sink logits is not followed by dropping the "
                    "sink column (`probs[..., :-1]`)")
        dead.insert(0, nxt)
        cur, nxt = nxt, only_user(nxt)
    p, training = 0.0, False
    seen_cast = seen_dropout = seen_zero = False
    while nxt is not None:
        if not seen_cast and nxt.op == "call_method" and nxt.target in CAST and nxt.args[0] is cur:
            if tensor(nxt) is None or not tensor(nxt).is_floating_point():
                refuse(sm, nxt, "the probabilities are not cast to a float dtype")
            seen_cast = True
        elif not seen_dropout and nxt.target in DROPOUT and nxt.args[0] is cur:
            p = arg(nxt, 1, "p", 0.5)
            training = arg(nxt, 2, "training", True)
            if arg(nxt, 3, "inplace", False):
                refuse(sm, nxt, "in-place dropout of the probabilities")
            seen_dropout = True
        elif not seen_zero and not folded and _zeroes_blocked(nxt, cur, masks):
            seen_zero = True
        elif not folded and merged_heads(nxt) is cur:
            folded = True
        elif folded and split_heads(nxt) is cur and tuple(tensor(nxt).shape[:2]) == tuple(tq.shape[:2]):
            folded = False
        else:
            break
        dead.insert(0, nxt)
        cur, nxt = nxt, only_user(nxt)
    if nxt is None:
        refuse(sm, cur, "the attention probabilities have other users (output_attentions=True?)")
    return cur, p, training, folded


def _zeroes_blocked(n: fx.Node, p: fx.Node, masks: Sequence) -> bool:
    """``n`` is ``p.masked_fill(C, 0)`` where ``C`` computes the same condition as a ``fill`` mask step of the
    scores (:func:`_same_value`; the step blocks with a large negative value, :func:`check_mask_steps`): a
    blocked key's probability is already exactly 0, and a query row with no key left (NaN or uniform in the
    original) becomes 0, as in tree attention. So ``n`` is ``p``."""
    if not call_in(n, MASKED_FILL) or n.kwargs or len(n.args) != 3 or n.args[0] is not p or number(n.args[2]) != 0:
        return False
    return any(m[0] == "fill" and _same_value(m[1], n.args[1]) for m in masks)


def _same_value(a: Any, b: Any, depth: int = 6) -> bool:
    """Whether ``a`` and ``b`` provably hold the same value: the same node or constant, or two calls of the same
    deterministic op on arguments that hold the same values (CPM-Ant builds its mask condition twice:
    ``mask.view(B, 1, Lq, Lk) == torch.tensor(False)``)."""
    if a is b:
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y, depth) for x, y in zip(a, b))
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return not isinstance(a, fx.Node) and not isinstance(b, fx.Node) and type(a) is type(b) and a == b
    if depth == 0 or a.op not in ("call_function", "call_method") or (a.op, a.target) != (b.op, b.target) \
            or a.is_impure() or mutates(a) or set(a.kwargs) != set(b.kwargs) \
            or random_draw(a, by_name=True) is not None:
        return False
    return _same_value(a.args, b.args, depth - 1) and all(_same_value(a.kwargs[k], b.kwargs[k], depth - 1)
                                                          for k in a.kwargs)


def _match_output(sm: fx.Node, probs: fx.Node, sc: Scores, dead: list, folded: bool, gated: Optional[fx.Node] = None
                  ) -> tuple[fx.Node, fx.Node, bool, tuple]:
    """(out, v, merged, (v_dims, out_dims)) for the product of the probabilities with the values: ``matmul(p, v)``
    of a 4-D ``v``, or an einsum over ``p`` and ``v.permute(v_dims)`` whose result is the [B, H, Lq, D] output
    ``.permute(out_dims)`` (``einsum("bhqk,bhkd->bhqd", p, v)``, ``einsum("bhqk,bkhd->bqhd", p, v)`` of a
    [B, L, H, D] ``v``: :func:`einsum_4d`); for ``folded`` [B*H, Lq, Lk] probabilities ``bmm(p3, v3)``
    with ``v3`` the merged-heads view of a 4-D ``v`` of q's (B, H), and ``out`` the view of its result back to [B, H, Lq, D]
    when that is its only user (``merged`` False), else the [B*H, Lq, D] product itself (``merged`` True: the
    SDPA output is flattened for its users). Checks that no chain node has a user outside the chain (``gated``
    included)."""
    tq, tk = query_value(sc), key_value(sc)
    layout = (None, None)
    nxt = only_user(probs)
    if nxt is None:
        refuse(sm, probs, "the attention probabilities have other users (output_attentions=True?)")
    if folded:
        pv = (nxt.args[0], merged_heads(nxt.args[1])) if call_in(nxt, MATMUL + BMM) and len(nxt.args) == 2 \
            and not nxt.kwargs else None
        if pv is None or pv[1] is None:
            refuse(sm, nxt, f"the [B*H, Lq, Lk] probabilities go to `{_op_name(nxt)}`, not to a bmm with "
                    "the merged-heads view [B*H, Lk, D] of the values")
        if not isinstance(tq.shape[1], int):
            refuse(sm, nxt, "a 3-D attention with a symbolic head count")
    else:
        pv = einsum_4d(nxt, "output")
        if pv is None and (nxt.target not in MATMUL or len(nxt.args) != 2 or nxt.kwargs):
            refuse(sm, nxt, f"the probabilities go to `{_op_name(nxt)}`, not to a matmul with the values")
        if pv is not None:
            pv, layout = pv[:2], pv[2:]
        else:
            pv = nxt.args
    p_, v = pv
    if p_ is not probs:
        refuse(sm, nxt, "the probabilities are not the first operand of the matmul with the values")
    tv = permuted_value(v, layout[0])
    if tv is None or tv.dim() != 4 or tv.shape[:2] != tq.shape[:2] or tv.shape[2] != tk.shape[2]:
        refuse(sm, nxt, "the values are not [B, H, Lk, D] like the keys")
    inside = {*dead, nxt, gated}  # gated: the product of the output with a sink gate (match_lse_sink)
    for n in dead:
        if not set(n.users) <= inside:
            refuse(sm, n, f"the intermediate `{n.name}` has other users (attention weights returned?)")
    dead.insert(0, nxt)
    if not folded:
        return nxt, v, False, layout
    user = only_user(nxt)
    if user is not None and split_heads(user) is nxt and tuple(tensor(user).shape[:2]) == tuple(tq.shape[:2]):
        dead.insert(0, user)
        return user, v, False, layout
    return nxt, v, True, layout
