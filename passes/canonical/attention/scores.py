"""The scores ``q · kᵀ`` in their spellings (matmul, bmm, baddbmm, einsum over ``[B, H, L, D]`` or ``[B, L, H, D]``
operands, heads merged or split), and the diagnosis of an attention that was not recognised."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

from brcompile.passes.analysis.axes import is_static_input, normalize_dim
from brcompile.passes.probe import ancestors
from brcompile.passes.spellings import is_op, op_name as _op_name
from brcompile.passes.canonical.attention.common import (
    BADDBMM, BMM, EINSUM, MATMUL, RESHAPE, SEARCH_DEPTH, SOFTMAX, TRANSPOSE, call_in, is_scalar, same, tensor,
)


def is_softmax(n: fx.Node) -> bool:
    return n.op in ("call_function", "call_method") and n.target in SOFTMAX


def softmax_args(sm: fx.Node) -> tuple[fx.Node, Any, Any]:
    """(input, dim, dtype) of a softmax call (``F.softmax(x, dim, _stacklevel, dtype)``,
    ``torch.softmax(x, dim, dtype)``, ``x.softmax(dim, dtype)``)."""
    a = list(sm.args)
    dim = sm.kwargs.get("dim", a[1] if len(a) > 1 else None)
    dtype_pos = 3 if sm.target is F.softmax else 2
    dtype = sm.kwargs.get("dtype", a[dtype_pos] if len(a) > dtype_pos else None)
    return a[0], dim, dtype


def _transposed_last_two(n: Any, ndim: int = 4) -> Optional[fx.Node]:
    """``k`` if ``n`` is ``k.transpose(-2, -1)`` (any spelling) of an ``ndim``-D ``k``, else None."""
    if not isinstance(n, fx.Node) or n.op not in ("call_function", "call_method") or n.target not in TRANSPOSE:
        return None
    k = n.args[0]
    t = tensor(k)
    if t is None or t.dim() != ndim:
        return None
    if is_op(n, "permute"):
        dims = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else n.args[1:]
        if not dims:
            dims = n.kwargs.get("dims", ())
        return k if [normalize_dim(d, ndim) for d in dims] == [*range(ndim - 2), ndim - 1, ndim - 2] else None
    d = list(n.args[1:3]) or [n.kwargs.get("dim0"), n.kwargs.get("dim1")]
    if None in d or {normalize_dim(x, ndim) for x in d} != {ndim - 2, ndim - 1}:
        return None
    return k


def einsum_4d(n: Any, kind: str) -> Optional[tuple[fx.Node, fx.Node, Optional[tuple], Optional[tuple]]]:
    """An einsum of two 4-D operands that is an attention product, any letters and operand layouts, else None.

    ``kind="scores"``: ``s = einsum(A,B->bhij, q, k)`` with ``s[b, h, i, j] = sum_d q[..] k[..]`` — the output
    names the two batch dims (b, h, in both operands), the query position i (first operand only) and the key
    position j (second operand only); the one other letter d, in both operands, is contracted. Then
    ``s = q' k'^T`` for ``q' = q.permute(q_dims)``, ``k' = k.permute(k_dims)`` in the [b, h, i | j, d] layout:
    ``einsum("bhqd,bhkd->bhqk")`` (identity dims) and ``einsum("bqhd,bkhd->bhqk")`` over [B, L, H, D] operands
    (dims (0, 2, 1, 3)). Returns (q, k, q_dims, k_dims).

    ``kind="output"``: ``o = einsum(bhij,C->O, p, v)`` of the probabilities p [b, h, i, j] (their own layout)
    and the values, contracting j: the value holds b, h, j and the head feature d, the output b, h, i, d in any
    order. Then ``o = (p v').permute(out_dims)`` for ``v' = v.permute(v_dims)`` in the [b, h, j, d] layout and
    ``p v'`` in [b, h, i, d]: ``einsum("bhqk,bhkd->bhqd")`` (identity) and ``einsum("bhqk,bkhd->bqhd")`` (the
    output [B, L, H, D]: out_dims (0, 2, 1, 3)). Returns (p, v, v_dims, out_dims).

    Identity dims are None (no permute)."""
    if not call_in(n, EINSUM) or n.kwargs:
        return None
    eq, ops = n.args[0], list(n.args[1:])
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    if not isinstance(eq, str) or "->" not in eq or len(ops) != 2:
        return None
    lhs, out = eq.replace(" ", "").split("->")
    terms = lhs.split(",")
    if len(terms) != 2 or any(len(t) != 4 or len(set(t)) != 4 for t in (*terms, out)) \
            or len(set(terms[0] + terms[1] + out)) != 5:
        return None
    a, b = terms
    if kind == "scores":
        bh, i, j = out[:2], out[2], out[3]
        d = _only((set(a) & set(b)) - set(out))
        if d is None or set(a) != {*bh, i, d} or set(b) != {*bh, j, d}:
            return None
        return ops[0], ops[1], _layout(a, (*bh, i, d)), _layout(b, (*bh, j, d))
    if kind == "output":
        bh, i, j = a[:2], a[2], a[3]
        d = _only((set(b) & set(out)) - set(a))
        if d is None or set(b) != {*bh, j, d} or set(out) != {*bh, i, d}:
            return None
        return ops[0], ops[1], _layout(b, (*bh, j, d)), _layout((*bh, i, d), out)
    return None


def _only(letters: set) -> Optional[str]:
    """The one element of ``letters``, else None."""
    return next(iter(letters)) if len(letters) == 1 else None


def _layout(term: Sequence[str], canonical: Sequence[str]) -> Optional[tuple]:
    """The dims ``p`` with ``x.permute(p)`` in the ``canonical`` letter order for an ``x`` laid out as ``term``
    (``p[k] = term.index(canonical[k])``); None for the identity."""
    dims = tuple(list(term).index(c) for c in canonical)
    return None if dims == (0, 1, 2, 3) else dims


@dataclasses.dataclass
class Scores:
    """The attention scores ``s = alpha * q k^T + beta * bias`` ([B, H, Lq, Lk]) as one op computes them.

    ``q`` [B, H, Lq, D] and ``k`` [B, H, Lk, D] are 4-D; ``nodes`` compute ``s`` from them (output side first,
    replaced with the chain). ``heads`` is H when the product runs on [B*H, ...] views (``bmm`` / ``baddbmm``,
    :func:`_scores_3d`): ``bias`` (the ``baddbmm`` input, [B*H | 1, Lq | 1, Lk] or fewer dims) is then read as
    [B, H, ...] (:func:`_split_heads_operand`)."""

    q: fx.Node
    k: fx.Node
    nodes: list
    alpha: Any = 1.0  # a number, or a scalar node until _fold_scores_op resolves it
    bias: Any = None
    beta: Any = 1.0
    heads: Optional[int] = None
    folded: bool = False  # the scores are the [B*H, Lq, Lk] product itself, not its [B, H, Lq, Lk] view
    k_dims: Optional[tuple] = None  # the key is ``k.permute(k_dims)`` (k^T was another permute of k: :func:`_key_of`)
    q_dims: Optional[tuple] = None  # the query is ``q.permute(q_dims)`` (an einsum over [B, L, H, D]: :func:`einsum_4d`)


def scores_op(n: Any) -> Optional[Scores]:
    """The scores ``n`` computes: ``matmul(q, k^T)`` (any spelling) or ``einsum("bhqd,bhkd->bhqk", q, k)`` of
    two 4-D values, or a 3-D product of merged heads viewed back as [B, H, Lq, Lk] (:func:`_scores_3d`)."""
    qk = einsum_4d(n, "scores")
    if qk is not None:
        q, k, q_dims, k_dims = qk
        tq, tk = tensor(q), tensor(k)
        ok = tq is not None and tk is not None and tq.dim() == tk.dim() == 4
        return Scores(q, k, [n], k_dims=k_dims, q_dims=q_dims) if ok else None
    if not isinstance(n, fx.Node) or n.op not in ("call_function", "call_method"):
        return None
    if n.target in RESHAPE:
        return _scores_3d(n)
    prod = _product_3d(n)
    if prod is not None:
        return _scores_folded(n, *prod)
    if n.target not in MATMUL or len(n.args) != 2 or n.kwargs:
        return None
    q, kt = n.args
    key = _key_of(kt)
    tq = tensor(q)
    if key is None or tq is None or tq.dim() != 4:
        return None
    return Scores(q, key[0], [n], k_dims=key[1])


def _key_of(kt: Any) -> Optional[tuple[fx.Node, Optional[tuple]]]:
    """(k, dims) when ``kt`` is k^T for a key ``k.permute(dims)`` (dims None: ``k`` itself): ``k.transpose(-2, -1)``
    (any spelling), or any permute / transpose of a 4-D value ``x`` (OpenAI-GPT splits the key heads straight into
    k^T, ``x.permute(0, 2, 3, 1)`` of x [B, L, H, D]): ``x.permute(p)`` with its last two dims swapped back is the
    key, ``x.permute(p[0], p[1], p[3], p[2])``. Whether its dim 2 is the tokens is the attention rule's to check."""
    k = _transposed_last_two(kt)
    if k is not None:
        return k, None
    p = _permutation(kt)
    if p is None:
        return None
    return kt.args[0], (p[0], p[1], p[3], p[2])


def _permutation(n: Any) -> Optional[list[int]]:
    """The dims ``p`` when ``n`` is ``x.permute(p)`` or ``x.transpose(a, b)`` (any spelling) of a 4-D ``x``, else
    None."""
    if not call_in(n, TRANSPOSE) or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    t = tensor(n.args[0])
    if t is None or t.dim() != 4:
        return None
    if is_op(n, "permute"):
        dims = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else n.args[1:]
        dims = dims or n.kwargs.get("dims", ())
    else:
        ab = list(n.args[1:3]) or [n.kwargs.get("dim0"), n.kwargs.get("dim1")]
        if len(ab) != 2 or not all(isinstance(d, int) for d in ab):
            return None
        dims = list(range(4))
        a, b = (normalize_dim(d, 4) for d in ab)
        dims[a], dims[b] = dims[b], dims[a]
    if len(dims) != 4 or not all(isinstance(d, int) for d in dims):
        return None
    dims = [normalize_dim(d, 4) for d in dims]
    return dims if sorted(dims) == [0, 1, 2, 3] else None


def key_value(sc: "Scores") -> Optional[torch.Tensor]:
    """The example value of the [B, H, Lk, D] key of ``sc`` (``k.permute(k_dims)`` where the dims are given)."""
    return permuted_value(sc.k, sc.k_dims)


def query_value(sc: "Scores") -> Optional[torch.Tensor]:
    """The example value of the [B, H, Lq, D] query of ``sc`` (``q.permute(q_dims)`` where the dims are given)."""
    return permuted_value(sc.q, sc.q_dims)


def permuted_value(n: Any, dims: Optional[tuple]) -> Optional[torch.Tensor]:
    """The example value of ``n.permute(dims)`` (of ``n`` for None)."""
    t = tensor(n)
    return t.permute(dims) if t is not None and dims is not None else t


def _scores_folded(n: fx.Node, q: fx.Node, k: fx.Node, bias: Any, beta: Any, alpha: Any) -> Optional[Scores]:
    """The scores of a 3-D attention whose softmax reads the [B*H, Lq, Lk] product ``n`` itself (BART without
    a mask): ``n[b*H + h] = alpha * q[b, h] k[b, h]^T + beta * bias[b*H + h]``, the 4-D scores with the heads
    folded into the batch (``folded``; :func:`_softmax_frame`). H static, alpha and beta numbers or scalar nodes."""
    tq = tensor(q)
    if not (is_scalar(beta) and is_scalar(alpha)) or not isinstance(tq.shape[1], int):
        return None
    return Scores(q, k, [n], alpha, bias, beta, int(tq.shape[1]), folded=True)


def _reshape_of(n: Any, src_dim: int, dst_dim: int) -> Optional[tuple[fx.Node, Any, Any]]:
    """(x, shape of x, shape of n) when ``n`` is a reshape (any spelling of the family: view, reshape,
    flatten, unflatten, view_as ...; all keep the row-major element order) of an ``src_dim``-D ``x`` to
    ``dst_dim`` dims."""
    if not call_in(n, RESHAPE) or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    x = n.args[0]
    tx, tn = tensor(x), tensor(n)
    if tx is None or tn is None or tx.dim() != src_dim or tn.dim() != dst_dim:
        return None
    return x, tx.shape, tn.shape


def _merges_dims_01(four: Any, three: Any) -> bool:
    """Whether the 3-D shape ``three`` is the 4-D shape ``four`` [B, H, L, D] with dims 0 and 1 merged,
    [B*H, L, D] (in row-major order a reshape between them moves no element: [b, h, l, d] <-> [b*H + h, l, d])."""
    return same(three[0], four[0] * four[1]) and same(three[1], four[2]) and same(three[2], four[3])


def merged_heads(n: Any) -> Optional[fx.Node]:
    """``x`` when ``n`` is a reshape of a 4-D ``x`` [B, H, L, D] to [B*H, L, D]. In row-major order that
    shape merges exactly dims 0 and 1: element [b, h, l, d] lands at [b*H + h, l, d]."""
    r = _reshape_of(n, 4, 3)
    return r[0] if r is not None and _merges_dims_01(r[1], r[2]) else None


def split_heads(n: Any) -> Optional[fx.Node]:
    """``x`` when ``n`` is a reshape of a 3-D ``x`` [B*H, L, D] to [B, H, L, D], which splits exactly dim 0:
    element [i, l, d] lands at [i // H, i % H, l, d] (the inverse of :func:`merged_heads`)."""
    r = _reshape_of(n, 3, 4)
    return r[0] if r is not None and _merges_dims_01(r[2], r[1]) else None


def _merged_key(kt: Any) -> Optional[fx.Node]:
    """``k`` [B, H, Lk, D] when ``kt`` is ``k^T`` on merged heads: ``merge(k).transpose(-2, -1)`` or
    ``merge(k.transpose(-2, -1))`` (both [B*H, D, Lk] with ``kt[b*H + h] = k[b, h]^T``)."""
    k3 = _transposed_last_two(kt, 3)
    if k3 is not None:
        return merged_heads(k3)
    return _transposed_last_two(merged_heads(kt), 4)


def _product_3d(n: Any) -> Optional[tuple[fx.Node, fx.Node, Any, Any, Any]]:
    """(q, k, bias, beta, alpha) when ``n`` is ``bmm(q3, k3^T)`` (or ``matmul`` of the 3-D values) or
    ``baddbmm(bias, q3, k3^T, beta=beta, alpha=alpha)`` with q3, k3 the merged-head views of 4-D q, k of the
    same (B, H): ``n[b*H + h] = alpha * q[b, h] k[b, h]^T + beta * bias``. beta and alpha as written (numbers
    or nodes); bias None for a bmm."""
    if not call_in(n, MATMUL + BMM + BADDBMM):
        return None
    a, kw = list(n.args), n.kwargs
    if n.target in BADDBMM:
        names = ("input", "batch1", "batch2")
        ops = [a[i] if i < len(a) else kw.get(names[i]) for i in range(3)]
        if len(a) > 3 or set(kw) - {*names, "beta", "alpha"}:
            return None
        bias, q3, kt3 = ops
        beta, alpha = kw.get("beta", 1), kw.get("alpha", 1)
    elif len(a) == 2 and not kw:
        (q3, kt3), bias, beta, alpha = a, None, 1, 1
    else:
        return None
    q, k = merged_heads(q3), _merged_key(kt3)
    tq, tk = tensor(q), tensor(k)
    if q is None or k is None or tq is None or tk is None or not (same(tq.shape[0], tk.shape[0])
                                                                 and same(tq.shape[1], tk.shape[1])):
        return None
    return q, k, bias, beta, alpha


def _scores_3d(n: fx.Node) -> Optional[Scores]:
    """The scores of a 3-D attention (HF BLOOM): ``n`` = ``s3.view(B, H, Lq, Lk)`` splitting dim 0 of
    ``s3 = _product_3d(...)`` into the (B, H) of q and k, with a number ``alpha`` and ``beta`` and a static head
    count H; then ``n[b, h] = s3[b*H + h] = alpha * q[b, h] k[b, h]^T + beta * bias[b*H + h]``. ``alpha`` and
    ``beta`` are numbers or scalar nodes (``.item()`` of inputs under dynamic=True), resolved by
    :func:`_fold_scores_op`."""
    s3 = split_heads(n)
    prod = _product_3d(s3)
    if prod is None:
        return None
    q, k, bias, beta, alpha = prod
    tq, tn = tensor(q), tensor(n)
    if not (is_scalar(beta) and is_scalar(alpha)) or not isinstance(tq.shape[1], int) \
            or not (same(tn.shape[0], tq.shape[0]) and same(tn.shape[1], tq.shape[1])):
        return None
    return Scores(q, k, [n, s3], alpha, bias, beta, int(tq.shape[1]))


def looks_like_attention(start: Any) -> bool:
    """A q @ k^T matmul (4-D, or a 3-D product of merged heads) within a few nodes upstream of ``start`` (so an unmatched softmax is an attention
    we cannot canonicalise, not an unrelated softmax such as a router's)."""
    frontier = [start]
    for _ in range(SEARCH_DEPTH):
        nxt = []
        for n in frontier:
            if not isinstance(n, fx.Node):
                continue
            if scores_op(n) is not None or _product_3d(n) is not None:
                return True
            nxt.extend(n.all_input_nodes)
        frontier = nxt
    return False


CONTRACTIONS = MATMUL + BMM + BADDBMM + EINSUM


def unrecognised_attention(gm: fx.GraphModule) -> Optional[tuple[fx.Node, str]]:
    """(contraction, reason) for a graph in which no attention was recognised but a softmax reads, within a few
    nodes, a contraction (matmul, bmm, baddbmm, einsum) of two values computed from the batch (not parameters
    alone): the shape of an attention whose scores are not one this module matches (:func:`scores_op`). The reason
    names the chain and the operands' shapes; None when there is no such softmax (a router's softmax reads a
    product with a weight)."""
    for sm in (n for n in gm.graph.nodes if is_softmax(n)):
        x = softmax_args(sm)[0]
        found = _contraction_path(x) if isinstance(x, fx.Node) else None
        if found is None:
            continue
        c, path = found
        shapes = " and ".join(f"[{', '.join(str(d) for d in tensor(o).shape)}]" for o in _batch_operands(c))
        chain = " <- ".join([_op_name(sm), *path])
        return c, (f"a softmax over a contraction of two batch values (`{chain}`, operands {shapes}) is not "
                   "recognised as an attention: its scores are not q @ k^T of 4-D [B, H, Lq, D] and [B, H, Lk, D] "
                   "values (k^T a transpose or permute of a 4-D value; einsum 'bhqd,bhkd->bhqk' or over [B, L, H, D] "
                   "operands 'bqhd,bkhd->bhqk'; bmm / baddbmm of merged-head [B*H, L, D] views)")
    return None


def _contraction_path(start: fx.Node) -> Optional[tuple[fx.Node, list[str]]]:
    """(contraction, op names from ``start`` to it) for the nearest contraction of two batch values within
    ``SEARCH_DEPTH`` nodes upstream of ``start``."""
    frontier = [(start, [])]
    for _ in range(SEARCH_DEPTH):
        nxt = []
        for n, path in frontier:
            if call_in(n, CONTRACTIONS) and len(_batch_operands(n)) >= 2:
                return n, path + [_op_name(n)]
            nxt.extend((a, path + [_op_name(n)]) for a in n.all_input_nodes)
        frontier = nxt
    return None


def _batch_operands(c: fx.Node) -> list[fx.Node]:
    """The tensor operands of ``c`` computed from a graph input that is not a parameter or a buffer."""
    out = []
    for a in c.all_input_nodes:
        t = tensor(a)
        if t is not None and t.dim() >= 2 and any(
                p.op == "placeholder" and not is_static_input(p) and isinstance(tensor(p), torch.Tensor)
                for p in ancestors(a)):
            out.append(a)
    return out
