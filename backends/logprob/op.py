"""brcompile::packed_logprob: next-token log-probs (and entropy) straight from packed hidden states.

The loss side of an RL step reads ``log_softmax(lm_head(h))[b, t, target[b, t]]``: B'·L' scalars out
of a [N, V] log-prob matrix (N packed tokens, V up to 152k). This op computes them without ever
building [N, V]: logits are formed a chunk of rows at a time and reduced on the spot.

Math, for packed hidden states ``h [N, D]``, head weight ``W [V, D]``, optional bias ``b [V]``::

    raw[k]   = h[k] @ W^T + b                                        one row per packed token k
    c[k]     = softcap * tanh(raw[k] / softcap)   if softcap > 0, else raw[k]   (Gemma-2 style)
    z[k]     = scale * c[k]                       scale = 1 / temperature (applied after the soft-cap,
                                                  as HF applies the cap in the model and TRL divides by
                                                  the temperature afterwards)
    lse[k]   = logsumexp_v z[k, v]
    logp[r]  = z[index_r, target_r] - lse[index_r]                   one per request r = (b, t)
    H[k]     = -sum_v p[k, v] log p[k, v],   p = exp(z - lse)        entropy[r] = H[index_r]

A request is one dense position: ``index [B', L']`` gives its packed token, ``targets [B', L']`` the
token whose log-prob it reads. lse and H are computed once per packed token that some request reads
(the distinct values of ``index``); at a branch point one packed token serves several requests.
``index_r == -1`` marks a dropped position (padding left out of the tree, brcompile.runtime.tree.drop_padding):
``logp[r] = 0`` and ``entropy[r] = 0`` there, and its gradient must be exactly 0 (a nonzero one raises
brcompile.runtime.tree.DroppedPositionGradError: the loss read padding it should have masked).

Backward (``g`` = grad of logp, ``gH`` = grad of entropy; ``G[k] = sum_{r: index_r = k} g_r`` and
``GH[k]`` likewise)::

    dz[k, v] = sum_{r: index_r = k, target_r = v} g_r  -  p[k, v] G[k]  -  GH[k] p[k, v] (log p[k, v] + H[k])
    draw     = dz * scale * (1 - tanh^2(raw / softcap))       (dz * scale without a soft-cap)
    dh[k] = draw[k] @ W,   dW = sum_k draw[k]^T h[k],   db = sum_k draw[k]

A request whose ``g_r`` and ``gH_r`` are exactly 0 (a loss's masked positions: an RL batch's prompt tokens) adds
exactly 0 to all three, so the backward leaves it out, and recomputes no logits for a token only such requests read.
Nothing of size [N, V] is saved: backward recomputes each chunk's logits. Peak memory is a few
[chunk, V] buffers plus the [V, D] weight gradient.

Ops (registered with ``torch.library``, fake impls, autograd, flop formulas, opcheck-clean)::

    brcompile::packed_logprob(Tensor hidden, Tensor weight, Tensor? bias, Tensor index, Tensor targets,
        float scale, float softcap, bool want_entropy, int chunk, str impl) -> (Tensor logp, Tensor entropy)
    brcompile::packed_logprob_backward(Tensor? grad_logp, Tensor? grad_entropy, Tensor hidden,
        Tensor weight, Tensor? bias, Tensor index, Tensor targets, float scale, float softcap, int chunk,
        str impl) -> (Tensor dhidden, Tensor dweight, Tensor dbias)

``logp`` and ``entropy`` have ``index``'s shape and ``hidden``'s dtype (``entropy`` is empty, shape
[0], unless ``want_entropy``); ``dbias`` is empty when ``bias`` is None. ``chunk`` is the number of
rows per chunk, 0 for automatic (about :data:`CHUNK_BYTES` of float32 logits per chunk). float16 and
bfloat16 inputs: matmuls in the input dtype, the softmax math in float32.

Implementations (``impl``) differ only in the per-row softmax math of one chunk; the chunking and the
matmuls are shared (:func:`logprob_forward`, :func:`logprob_backward`). ``"cpu"`` is plain torch ops
(any device); ``"triton"`` (brcompile.backends.logprob.triton) fuses the row passes into kernels;
``"auto"`` picks triton on CUDA for float32/16/bf16 when triton imports, else cpu.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from brcompile.backends.read_packed.op import check_dropped_grad
from brcompile.backends.common.registry import Impl, Registry

__all__ = [
    "CHUNK_BYTES",
    "LOGPROB_IMPLS",
    "LogprobError",
    "LogprobImpl",
    "count_read_tokens",
    "get_logprob_impl",
    "logprob_backward",
    "logprob_forward",
    "packed_logprob",
    "reference_packed_logprob",
    "register_logprob_impl",
    "registered_logprob_impls",
    "softcap_logits",
]

#: Automatic chunk size: about this many bytes of float32 logits per chunk (two such buffers live at
#: once), but at least MIN_CHUNK_ROWS rows: every chunk streams the whole [V, D] weight through its
#: three matmuls, so small chunks are bandwidth-bound (measured on CPU at V=152k, D=128: 110 rows cost
#: ~20% more CPU time than 256). CUDA gets larger chunks (bigger matmuls).
CHUNK_BYTES = 64 << 20
CHUNK_BYTES_CUDA = 512 << 20
MIN_CHUNK_ROWS = 256

_HALF = (torch.float16, torch.bfloat16)


class LogprobError(ValueError):
    """Inputs of packed_logprob that do not satisfy the op's contract, or an unknown/unusable impl."""


# --------------------------------------------------------------------------------------------------
# implementations


@dataclasses.dataclass(frozen=True)
class LogprobImpl(Impl):
    """The per-row softmax math of one chunk of logits (the chunking and matmuls are shared).

    row_forward(raw [C, V], rows [r], targets [r], scale, softcap, want_entropy, work) -> (logp [r], H [C] or None)
        the log-probs of the r requests of the chunk (request i reads row ``rows[i]`` at column
        ``targets[i]``) and, if asked, the entropy of every row.
    row_grad(raw [C, V], scale, softcap, G [C] or None, GH [C] or None, work) -> draw [C, V]
        the gradient w.r.t. ``raw`` of ``-sum_k G[k] lse[k] + sum_k GH[k] H[k]`` (the softmax part of
        the backward formula in the module docstring; the caller adds the one-hot target part).

    Both may overwrite ``raw`` and ``work`` (a second [>= C, V] buffer of the call, reused by every
    chunk) and return either. ``raw`` is contiguous, in the compute dtype (float32 for half inputs).
    ``device_types`` / ``dtypes`` (keyword): where the impl runs (None: anywhere).
    """

    Error = LogprobError
    op = "packed_logprob"

    row_forward: Callable
    row_grad: Callable


#: The packed_logprob impls: cpu (below) and triton (imported on first use; "auto" picks it on CUDA for
#: the dtypes it takes).
LOGPROB_IMPLS = Registry("packed_logprob", LogprobImpl, builtins={"triton": "brcompile.backends.logprob.triton"})


def register_logprob_impl(impl: LogprobImpl, *, override: bool = False) -> None:
    """Register a packed_logprob implementation under ``impl.name``; a name already registered raises
    unless ``override=True`` (which replaces it)."""
    LOGPROB_IMPLS.register(impl, override=override)


def registered_logprob_impls() -> tuple[str, ...]:
    """Names usable as ``impl`` (registered or importable on demand), without ``"auto"``."""
    return LOGPROB_IMPLS.names()


def get_logprob_impl(name: str, device, dtype: torch.dtype) -> LogprobImpl:
    """The implementation ``name`` for inputs on ``device`` of ``dtype``; ``"auto"`` is triton on CUDA
    (float32/float16/bfloat16, when triton imports), else cpu. Raises LogprobError when it is unknown
    or does not run there."""
    return LOGPROB_IMPLS.get(name, device, dtype)


def softcap_logits(raw: Tensor, scale: float, softcap: float) -> Tensor:
    """``z = scale * softcap * tanh(raw / softcap)`` (``scale * raw`` when softcap == 0); a new tensor."""
    if softcap > 0:
        return torch.tanh(raw / softcap).mul_(softcap * scale)
    return raw * scale


def _dz_draw(raw: Tensor, scale: float, softcap: float) -> Tensor:
    """dz/draw elementwise: ``scale * (1 - tanh^2(raw / softcap))`` (``scale`` without a soft-cap)."""
    if softcap > 0:
        t = torch.tanh(raw / softcap)
        return (1 - t * t) * scale
    return torch.full_like(raw, scale)


def _buffer(work: Optional[Tensor], like: Tensor) -> Tensor:
    """``work`` when given (a [>= C, V] workspace of ``like``'s dtype), else a new tensor like ``like``."""
    return torch.empty_like(like) if work is None else work[: like.shape[0]]


def _cpu_row_forward(raw: Tensor, rows: Tensor, targets: Tensor, scale: float, softcap: float,
                     want_entropy: bool, work: Optional[Tensor] = None):
    """z in place in ``raw``, torch's fused log_softmax into ``work``, read at the requests;
    H = -sum exp(logp) logp (exp into ``raw``). Two [C, V] buffers."""
    if softcap > 0:
        raw.div_(softcap).tanh_().mul_(softcap * scale)
    elif scale != 1.0:
        raw.mul_(scale)
    logp = torch._log_softmax(raw, -1, False, out=_buffer(work, raw))
    out = logp[rows, targets]
    if not want_entropy:
        return out, None
    p = torch.exp(logp, out=raw)
    return out, -torch.linalg.vecdot(p, logp)


def _cpu_row_grad(raw: Tensor, scale: float, softcap: float, G: Optional[Tensor], GH: Optional[Tensor],
                  work: Optional[Tensor] = None):
    """draw = p * (-G - GH (logp + H)) * dz/draw (see the module docstring). Without an entropy
    gradient only p is needed: one fused softmax and one scaling pass. Two [C, V] buffers (three with
    a soft-cap: tanh is kept for dz/draw)."""
    if softcap > 0:
        t = raw.div_(softcap).tanh_()
        z = torch.mul(t, softcap * scale, out=_buffer(work, raw))
        out = torch.empty_like(raw)
    else:
        t, z = None, (raw.mul_(scale) if scale != 1.0 else raw)
        out = _buffer(work, raw)
    if GH is None:
        coef = torch.zeros_like(z[:, 0]) if G is None else G * -scale
        dr = torch._softmax(z, -1, False, out=out).mul_(coef[:, None])
    else:
        logp = torch._log_softmax(z, -1, False, out=out)
        p = torch.exp(logp, out=z)
        H = -torch.linalg.vecdot(p, logp)
        coef = logp.add_(H[:, None]).mul_(GH[:, None] * -scale)
        if G is not None:
            coef.sub_((G * scale)[:, None])
        dr = coef.mul_(p)
    return dr.mul_(t.mul_(t).neg_().add_(1)) if t is not None else dr


register_logprob_impl(LogprobImpl("cpu", row_forward=_cpu_row_forward, row_grad=_cpu_row_grad))


# --------------------------------------------------------------------------------------------------
# the chunked driver (shared by every impl)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _HALF else dtype


def _chunk_rows(chunk: int, V: int, M: int, device: torch.device) -> int:
    """Rows per chunk: ``chunk`` if given, else about CHUNK_BYTES of float32 logits and at least
    MIN_CHUNK_ROWS, never more than the M rows there are (and at least 1)."""
    if chunk > 0:
        return chunk
    budget = CHUNK_BYTES_CUDA if device.type == "cuda" else CHUNK_BYTES
    return max(1, min(max(M, 1), max(MIN_CHUNK_ROWS, budget // (4 * max(V, 1)))))


@dataclasses.dataclass
class _Plan:
    """Which packed tokens are read, and which requests fall in each chunk of them.

    tokens [M]: distinct packed tokens read (sorted, -1 excluded); inv [R]: position in ``tokens`` of
    each request (-1 for a dropped request, index -1); order [R]: requests sorted by ``inv`` (the
    ``dropped`` dropped ones first); chunk c covers tokens[starts[c]:starts[c + 1]] and the requests
    order[bounds[c]:bounds[c + 1]]; ``contiguous``: tokens == arange(N) (no gather needed).
    """

    tokens: Tensor
    inv: Tensor
    inv_sorted: Tensor
    order: Tensor
    starts: list
    bounds: list
    contiguous: bool
    rows: int
    dropped: int

    def kept_requests(self) -> tuple[Tensor, Tensor]:
        """(requests, their positions in ``tokens``) of every request that is not dropped, by token."""
        return self.order[self.dropped:], self.inv_sorted[self.dropped:]

    def chunks(self):
        for c in range(len(self.starts) - 1):
            yield self.starts[c], self.starts[c + 1], self.bounds[c], self.bounds[c + 1]

    def rows_of(self, hidden: Tensor, c0: int, c1: int) -> tuple[Tensor, Tensor]:
        """(packed token ids, hidden rows) of chunk [c0, c1)."""
        tok = self.tokens[c0:c1]
        return tok, (hidden[c0:c1] if self.contiguous else hidden.index_select(0, tok))


def _plan(index: Tensor, N: int, V: int, chunk: int) -> _Plan:
    """The plan of the requests ``index`` (values in [-1, N)); -1 (sorted first by unique) is not a
    token: its requests get inv = -1 and sort before every chunk."""
    flat = index.reshape(-1)
    tokens, inv = torch.unique(flat, sorted=True, return_inverse=True)
    inv_sorted, order = torch.sort(inv, stable=True)
    if bool(tokens[:1].lt(0).any()):  # some request is dropped
        tokens, inv, inv_sorted = tokens[1:], inv - 1, inv_sorted - 1
    M = tokens.numel()
    rows = _chunk_rows(chunk, V, M, index.device)
    starts = list(range(0, M, rows)) + [M]
    bounds = torch.searchsorted(inv_sorted, torch.tensor(starts, device=index.device)).tolist()
    return _Plan(tokens, inv, inv_sorted, order, starts, bounds, contiguous=(M == N), rows=min(rows, M),
                 dropped=bounds[0])


class _Workspace:
    """Two [rows, V] buffers in the compute dtype, reused by every chunk of one call (fresh large
    allocations cost page faults on CPU): ``logits`` writes a chunk's logits into the first (when the
    input dtype is the compute dtype), ``work`` is the second."""

    def __init__(self, rows: int, V: int, dtype: torch.dtype, compute: torch.dtype, device: torch.device):
        self.compute = compute
        self.raw = torch.empty(rows, V, dtype=compute, device=device) if dtype == compute else None
        self.work = torch.empty(rows, V, dtype=compute, device=device)

    def logits(self, hc: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        """``hc @ weight^T + bias`` [C, V] in the compute dtype."""
        if self.raw is None:
            return F.linear(hc, weight, bias).to(self.compute).contiguous()
        raw = torch.mm(hc, weight.t(), out=self.raw[: hc.shape[0]])
        return raw.add_(bias) if bias is not None else raw


def _check_values(index: Tensor, targets: Tensor, N: int, V: int) -> None:
    """Raise LogprobError for an index outside [-1, N) (-1: dropped) or a target outside [0, V) (one
    device sync)."""
    if index.numel() == 0:
        return
    lo_i, hi_i, lo_t, hi_t = torch.stack([index.min(), index.max(), targets.min(), targets.max()]).tolist()
    if lo_i < -1 or hi_i >= N:
        raise LogprobError(f"packed_logprob: index values must be in [0, N={N}) or -1 (a dropped position), "
                           f"got [{lo_i}, {hi_i}]")
    if lo_t < 0 or hi_t >= V:
        raise LogprobError(f"packed_logprob: targets must be in [0, V={V}), got [{lo_t}, {hi_t}]")


def _chunk_logits(plan: _Plan, ws: _Workspace, hidden: Tensor, weight: Tensor, bias: Optional[Tensor]):
    """Per chunk of read tokens: (c0, c1, tok, hc, raw, req, rows) — the chunk's token range and ids, its
    hidden rows, its logits ``raw = hc @ W^T (+ b)`` [rows, V] in the workspace, the requests it serves
    (flat (b, t) indices) and each request's row in ``raw``."""
    for c0, c1, lo, hi in plan.chunks():
        tok, hc = plan.rows_of(hidden, c0, c1)
        yield c0, c1, tok, hc, ws.logits(hc, weight, bias), plan.order[lo:hi], plan.inv_sorted[lo:hi] - c0


def logprob_forward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], index: Tensor, targets: Tensor,
                    scale: float, softcap: float, want_entropy: bool, chunk: int, impl: LogprobImpl):
    """(logp, entropy or None) shaped like ``index``; see the module docstring. No autograd."""
    N, V = hidden.shape[0], weight.shape[0]
    _check_values(index, targets, N, V)
    cdt = _compute_dtype(hidden.dtype)
    R = index.numel()
    logp = torch.zeros(R, dtype=cdt, device=hidden.device)  # stays 0 at dropped requests
    ent = torch.zeros(R, dtype=cdt, device=hidden.device) if want_entropy else None
    if R:
        plan = _plan(index, N, V, chunk)
        tflat = targets.reshape(-1)
        ws = _Workspace(plan.rows, V, hidden.dtype, cdt, hidden.device)
        for _, _, _, _, raw, req, rows in _chunk_logits(plan, ws, hidden, weight, bias):
            lp, h = impl.row_forward(raw, rows, tflat[req], scale, softcap, want_entropy, ws.work)
            logp[req] = lp
            if want_entropy:
                ent[req] = h[rows]
    logp = logp.to(hidden.dtype).reshape(index.shape)
    return logp, (None if ent is None else ent.to(hidden.dtype).reshape(index.shape))


def logprob_backward(grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor], hidden: Tensor, weight: Tensor,
                     bias: Optional[Tensor], index: Tensor, targets: Tensor, scale: float, softcap: float,
                     chunk: int, impl: LogprobImpl):
    """(dhidden [N, D], dweight [V, D], dbias [V] or None); see the module docstring. No autograd."""
    N, V = hidden.shape[0], weight.shape[0]
    cdt = _compute_dtype(hidden.dtype)
    R = index.numel()
    work = R > 0 and (grad_logp is not None or grad_entropy is not None)
    if work:
        if bool((index < 0).any()):
            _check_dropped(grad_logp, grad_entropy, index)
        index = _with_gradient(index, grad_logp, grad_entropy)
        work = bool((index >= 0).any())
    dh = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    # the first chunk writes dW (out=) when no cast is needed
    dW = (torch.empty if work and cdt == hidden.dtype else torch.zeros)(weight.shape, dtype=cdt, device=weight.device)
    db = None if bias is None else torch.zeros(bias.shape, dtype=cdt, device=bias.device)
    if work:
        plan = _plan(index, N, V, chunk)
        M = plan.tokens.numel()
        tflat = targets.reshape(-1)
        g = None if grad_logp is None else grad_logp.reshape(-1).to(cdt)
        G = None if g is None else _per_token_sum(g, plan, M)
        GH = None if grad_entropy is None else _per_token_sum(grad_entropy.reshape(-1).to(cdt), plan, M)
        ws = _Workspace(plan.rows, V, hidden.dtype, cdt, hidden.device)
        for c0, c1, tok, hc, raw, req, rows in _chunk_logits(plan, ws, hidden, weight, bias):
            tg = tflat[req]
            raw_t = raw[rows, tg]  # before row_grad may overwrite raw
            draw = impl.row_grad(raw, scale, softcap, None if G is None else G[c0:c1],
                                 None if GH is None else GH[c0:c1], ws.work)
            if g is not None:
                draw.index_put_((rows, tg), g[req] * _dz_draw(raw_t, scale, softcap), accumulate=True)
            d_in = draw.to(hidden.dtype)
            if plan.contiguous:
                torch.mm(d_in, weight, out=dh[c0:c1])
            else:
                dh.index_copy_(0, tok, d_in @ weight)
            if cdt != hidden.dtype:
                dW += (d_in.t() @ hc).to(cdt)
            elif c0 == 0:
                torch.mm(d_in.t(), hc, out=dW)
            else:
                dW.addmm_(d_in.t(), hc)
            if db is not None:
                db += draw.sum(0)
    return dh, dW.to(weight.dtype), (None if db is None else db.to(bias.dtype))


def _with_gradient(index: Tensor, grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor]) -> Tensor:
    """``index`` with -1 at the requests whose upstream gradients are all exactly 0 (a loss's masked positions, the
    prompt tokens of an RL batch): such a request adds exactly 0 to every gradient (``dz`` is linear in ``g_r`` and
    ``GH``), so the backward leaves it out, and with it every packed token only such requests read (their logits
    are never recomputed); ``index`` itself when there is none."""
    zero = None
    for g in (grad_logp, grad_entropy):
        if g is not None:
            z = g.reshape(index.shape) == 0
            zero = z if zero is None else zero & z
    skip = zero & (index >= 0)
    return index.masked_fill(skip, -1) if bool(skip.any()) else index


def _per_token_sum(grad: Tensor, plan: _Plan, M: int) -> Tensor:
    """[M]: the sum of ``grad`` (one per request) over the kept requests of each read token."""
    req, inv = plan.kept_requests()
    return torch.zeros(M, dtype=grad.dtype, device=grad.device).index_add_(0, inv, grad[req])


def _check_dropped(grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor], index: Tensor) -> None:
    """DroppedPositionGradError unless both gradients are exactly 0 at every request with index -1."""
    dropped = index < 0
    for name, grad in (("log-prob", grad_logp), ("entropy", grad_entropy)):
        if grad is not None:
            check_dropped_grad(grad, dropped, f"packed_logprob backward ({name})")


# --------------------------------------------------------------------------------------------------
# the custom ops


def _check_inputs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], index: Tensor, targets: Tensor,
                  scale: float, softcap: float, chunk: int) -> None:
    """Raise LogprobError unless shapes, dtypes and scalars match the op's contract (fake-tensor safe)."""
    if hidden.dim() != 2 or weight.dim() != 2:
        raise LogprobError(f"packed_logprob expects hidden [N, D] and weight [V, D]; got hidden "
                           f"{tuple(hidden.shape)}, weight {tuple(weight.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise LogprobError(f"packed_logprob: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} "
                           f"disagree on D")
    if not hidden.dtype.is_floating_point or weight.dtype != hidden.dtype:
        raise LogprobError(f"packed_logprob: hidden and weight must share one floating dtype; got "
                           f"{hidden.dtype}, {weight.dtype}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0] or bias.dtype != hidden.dtype):
        raise LogprobError(f"packed_logprob: bias must be [V={weight.shape[0]}] {hidden.dtype}, got "
                           f"{tuple(bias.shape)} {bias.dtype}")
    if index.dtype != torch.int64 or targets.dtype != torch.int64:
        raise LogprobError(f"packed_logprob: index and targets must be int64, got {index.dtype}, {targets.dtype}")
    if index.shape != targets.shape:
        raise LogprobError(f"packed_logprob: index {tuple(index.shape)} and targets {tuple(targets.shape)} "
                           f"differ in shape")
    if not (math.isfinite(scale) and scale != 0):
        raise LogprobError(f"packed_logprob: scale must be finite and nonzero, got {scale}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise LogprobError(f"packed_logprob: softcap must be finite and >= 0 (0 = none), got {softcap}")
    if chunk < 0:
        raise LogprobError(f"packed_logprob: chunk must be >= 0 (0 = automatic), got {chunk}")


@torch.library.custom_op("brcompile::packed_logprob", mutates_args=())
def _packed_logprob_op(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], index: Tensor, targets: Tensor,
                       scale: float, softcap: float, want_entropy: bool, chunk: int,
                       impl: str) -> tuple[Tensor, Tensor]:
    """(logp, entropy) shaped like ``index`` (entropy empty unless ``want_entropy``)."""
    _check_inputs(hidden, weight, bias, index, targets, scale, softcap, chunk)
    chosen = get_logprob_impl(impl, hidden.device, hidden.dtype)
    logp, ent = logprob_forward(hidden, weight, bias, index, targets, scale, softcap, want_entropy, chunk, chosen)
    return logp, (ent if ent is not None else hidden.new_empty(0))


@_packed_logprob_op.register_fake
def _packed_logprob_fake(hidden, weight, bias, index, targets, scale, softcap, want_entropy, chunk, impl):
    """Shapes only: logp like index; entropy like index or [0]."""
    _check_inputs(hidden, weight, bias, index, targets, scale, softcap, chunk)
    LOGPROB_IMPLS.check_name(impl)
    return hidden.new_empty(index.shape), hidden.new_empty(index.shape if want_entropy else (0,))


@torch.library.custom_op("brcompile::packed_logprob_backward", mutates_args=())
def _packed_logprob_backward_op(grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor], hidden: Tensor,
                                weight: Tensor, bias: Optional[Tensor], index: Tensor, targets: Tensor,
                                scale: float, softcap: float, chunk: int,
                                impl: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dhidden, dweight, dbias) for the upstream gradients (any strides; None = zero)."""
    _check_inputs(hidden, weight, bias, index, targets, scale, softcap, chunk)
    chosen = get_logprob_impl(impl, hidden.device, hidden.dtype)
    dh, dW, db = logprob_backward(grad_logp, grad_entropy, hidden, weight, bias, index, targets, scale, softcap,
                                  chunk, chosen)
    return dh, dW, (db if db is not None else hidden.new_empty(0))


@_packed_logprob_backward_op.register_fake
def _packed_logprob_backward_fake(grad_logp, grad_entropy, hidden, weight, bias, index, targets, scale, softcap,
                                  chunk, impl):
    """Shapes only: dhidden like hidden, dweight like weight, dbias like bias or [0]."""
    _check_inputs(hidden, weight, bias, index, targets, scale, softcap, chunk)
    LOGPROB_IMPLS.check_name(impl)
    db = hidden.new_empty(0) if bias is None else bias.new_empty(bias.shape)
    return hidden.new_empty(hidden.shape), weight.new_empty(weight.shape), db


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, index, targets, scale, softcap, want_entropy, chunk, impl = inputs
    ctx.save_for_backward(hidden, weight, bias, index, targets)
    ctx.params = (scale, softcap, want_entropy, chunk, impl)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_logp, grad_entropy):
    """d(logp, entropy)/d(hidden, weight, bias) via packed_logprob_backward; index/targets get none."""
    hidden, weight, bias, index, targets = ctx.saved_tensors
    scale, softcap, want_entropy, chunk, impl = ctx.params
    if not want_entropy:
        grad_entropy = None
    if grad_logp is None and grad_entropy is None:
        return (None,) * 10
    dh, dW, db = torch.ops.brcompile.packed_logprob_backward(
        grad_logp, grad_entropy, hidden, weight, bias, index, targets, scale, softcap, chunk, impl)
    return dh, dW, (db if bias is not None else None), None, None, None, None, None, None, None


torch.library.register_autograd("brcompile::packed_logprob", _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------- flops


def count_read_tokens(index: Tensor, N: int) -> int:
    """Distinct packed tokens ``index`` reads (-1, dropped, is none); N (the bound) for tensors without
    data (tracing)."""
    from torch._subclasses.fake_tensor import is_fake

    if index.device.type == "meta" or is_fake(index):
        return N
    return int(torch.unique(index).ge(0).sum())


@register_flop_formula(torch.ops.brcompile.packed_logprob, get_raw=True)
def _packed_logprob_flop(hidden, weight, bias, index, targets, *args, out_val=None, **kwargs) -> int:
    """Forward: the head matmul over the packed tokens read, 2 * M * D * V (softmax math not counted,
    as for matmul-bound ops elsewhere)."""
    M = count_read_tokens(index, hidden.shape[0])
    return 2 * M * hidden.shape[1] * weight.shape[0]


@register_flop_formula(torch.ops.brcompile.packed_logprob_backward, get_raw=True)
def _packed_logprob_backward_flop(grad_logp, grad_entropy, hidden, weight, bias, index, *args, out_val=None,
                                  **kwargs) -> int:
    """Backward: recompute the logits, then dh = draw @ W and dW = draw^T @ h: 3 * 2 * M * D * V."""
    M = count_read_tokens(index, hidden.shape[0])
    return 6 * M * hidden.shape[1] * weight.shape[0]


# ----------------------------------------------------------------------------------------- wrapper


def packed_logprob(hidden: Tensor, weight: Tensor, index: Tensor, targets: Tensor, bias: Optional[Tensor] = None,
                   *, scale: float = 1.0, softcap: float = 0.0, want_entropy: bool = False, chunk: int = 0,
                   impl: str = "auto") -> tuple[Tensor, Optional[Tensor]]:
    """``(logp, entropy)`` for packed ``hidden [N, D]``, head ``weight [V, D]`` (+ ``bias [V]``),
    ``index``/``targets`` of one shape (see the module docstring); entropy is None unless
    ``want_entropy``. Differentiable in hidden, weight and bias."""
    logp, ent = torch.ops.brcompile.packed_logprob(hidden, weight, bias, index, targets, float(scale),
                                                   float(softcap), bool(want_entropy), int(chunk), impl)
    return logp, (ent if want_entropy else None)


def reference_packed_logprob(hidden: Tensor, weight: Tensor, index: Tensor, targets: Tensor,
                             bias: Optional[Tensor] = None, *, scale: float = 1.0, softcap: float = 0.0,
                             want_entropy: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """The oracle: dense [N, V] logits and ``log_softmax`` with plain torch autograd (O(N * V) memory);
    0 where ``index`` is -1 (no check of the gradient there: that is the op's contract, not math)."""
    raw = F.linear(hidden, weight, bias)
    z = torch.tanh(raw / softcap) * softcap * scale if softcap > 0 else raw * scale
    logp_all = torch.log_softmax(z, dim=-1)
    kept = index >= 0
    rows = index.clamp(min=0)
    logp = torch.where(kept, logp_all[rows, targets], 0.0)
    if not want_entropy:
        return logp, None
    return logp, torch.where(kept, (-(logp_all.exp() * logp_all).sum(-1))[rows], 0.0)
