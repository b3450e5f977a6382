"""ALiBi biases: a per-head slope times the key-query distance, fitted on the probes (:func:`alibi_meaning`), with
constant or trainable slopes."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx

from brcompile.passes import probe
from brcompile.passes.analysis.axes import example_value, is_static_input
from brcompile.passes.probe import ancestors
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.passes.canonical.attention.common import BLOCKING
from brcompile.passes.analysis.masks.probes import Trial, binary
from brcompile.passes.analysis.masks.values import MaskInfo, evaluate


def alibi_meaning(attn: fx.Node, mask: fx.Node, info: MaskInfo, inputs: Sequence[fx.Node],
                  trials: Sequence[Trial], values: dict) -> MaskInfo:
    """``info`` with the ALiBi slopes of the mask's bias (module docstring), else CannotReplay naming the bias."""
    what = "attention bias"
    if info.kind == "causal+sequences":
        raise CannotReplay(Code.ATTENTION_BIAS,
                           f"{what} on packed sequences (ALiBi positions restart per sequence)", attn)
    hq = _query_heads(attn)
    trainable = [n for n in ancestors(mask) if n.op == "placeholder"
                 for v in [values.get(n)] if isinstance(v, torch.Tensor) and v.requires_grad]
    if trainable:
        n = trainable[0]
        x = followed_input(attn, mask, inputs, trials)
        if x is not None:
            raise CannotReplay(Code.ATTENTION_BIAS,
                               f"{what} computed from the values of {x.name} through the trainable tensor "
                               f"{n.name} (a per-token bias, e.g. a projection of the hidden states: tree "
                               "attention's biases are ALiBi, a per-head slope times the position distance, and a "
                               "relative bias gathered from a table of the query token by the clamped distance)",
                               attn)
        node = _slopes_node(mask, trainable, values, hq)
        found = None if node is None else _trainable_alibi(attn, mask, info, inputs, trials, node, hq)
        if found is None:
            raise CannotReplay(Code.ATTENTION_BIAS,
                               f"{what} computed from the trainable tensor {n.name} that is not ALiBi with trainable "
                               "slopes (a learned position bias, e.g. a relative-position table: its gradient is "
                               "not supported)", attn)
        return found
    slopes = _alibi_slopes(attn, mask, trials, hq)
    what = (f"attention bias (the float mask holds finite nonzero values above {BLOCKING:g} at visible pairs: a bias "
            "added to the scores, not a 0 / -inf mask)")
    if slopes is None:
        raise CannotReplay(Code.ATTENTION_BIAS,
                           f"{what} that is not ALiBi: no per-head slope can be read off a probe without padding",
                           attn)
    for count in _alibi_counts(info, inputs, trials):
        if all(_fits_alibi(t.visible(mask, attn), t.bias(mask, attn), slopes, _alibi_positions(t, count))
               for t in trials):
            if not any(slopes):
                return info  # a bias constant along every query row: the softmax ignores it
            if count is not None and info.window:
                raise CannotReplay(Code.ATTENTION_BIAS,
                                   f"{what}: ALiBi over attention-mask counts with a sliding window", attn)
            return dataclasses.replace(info, alibi=tuple(slopes), alibi_count=count)
    raise CannotReplay(Code.ATTENTION_BIAS,
                       f"{what} that is not ALiBi (a per-head slope times the key position minus the query "
                       "position, over the columns or the count of attention-mask tokens)", attn)


def _alibi_counts(info: MaskInfo, inputs: Sequence[fx.Node], trials: Sequence[Trial]) -> list:
    """The candidate ALiBi position sources: None (the columns), the key-padding input, every other 0/1 input."""
    counts = [info.keypad] if info.keypad is not None else []
    return [None] + counts + [x for x in inputs if x not in counts and _is_binary(trials[0].values.get(x))]


def _slopes_node(mask: fx.Node, trainable: Sequence[fx.Node], values: dict, hq: Optional[int]) -> Optional[fx.Node]:
    """The latest node ``P`` of the mask's subgraph that is computed from trainable tensors, parameters, buffers
    and constants alone (no token input, no size), holds a float per query head (``hq`` numbers, or one), and
    that every path from a trainable tensor to the mask passes through; None when there is none."""
    if hq is None:
        return None
    anc = ancestors(mask)
    tset = set(trainable)
    reached: set[fx.Node] = set()
    for n in anc:
        if n in tset or any(a in reached for a in n.all_input_nodes):
            reached.add(n)
    for n in reversed(anc):
        if n not in reached or n is mask:
            continue
        v = values.get(n) if n.op == "placeholder" else example_value(n)
        if not (isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() in (1, hq)):
            continue
        if any(p.op == "placeholder" and p not in tset and not is_static_input(p) for p in ancestors(n)):
            continue
        if not any(p in tset for p in ancestors(mask, inside=lambda a, n=n: a is not n)):
            return n
    return None


def _trainable_alibi(attn: fx.Node, mask: fx.Node, info: MaskInfo, inputs: Sequence[fx.Node],
                     trials: Sequence[Trial], node: fx.Node, hq: int) -> Optional[MaskInfo]:
    """``info`` with ALiBi slopes ``node`` (module docstring: trainable ALiBi slopes), or None when the bias is not
    ``node[h] * pos[b, k]`` up to a per-query shift on every trial, and on the longest trial without padding with
    ``node``'s value replaced by random numbers."""
    unpadded = [t for t in trials if t.unpadded]
    if not unpadded:
        return None
    t0 = max(unpadded, key=lambda t: t.size[1])
    like = evaluate(node, t0.values, t0.literal)
    fresh = probe.normal(like.shape, probe.generator(1), like=like)
    substituted = Trial({**t0.values, node: fresh}, t0.literal, t0.size, t0.unpadded)
    checks = [(t, _per_head(evaluate(node, t.values, t.literal), hq)) for t in trials]
    checks.append((substituted, _per_head(fresh, hq)))
    for count in _alibi_counts(info, inputs, trials):
        if all(_fits_alibi(t.visible(mask, attn), t.bias(mask, attn), slopes, _alibi_positions(t, count))
               for t, slopes in checks):
            if count is not None and info.window:
                raise CannotReplay(Code.ATTENTION_BIAS,
                                   "attention bias: ALiBi over attention-mask counts with a sliding window", attn)
            return dataclasses.replace(info, alibi=tuple(checks[0][1]), alibi_count=count, alibi_node=node)
    return None


def _per_head(value: torch.Tensor, hq: int) -> list[float]:
    """The ``hq`` slopes of a value of one number per query head, or of one number for all."""
    flat = value.detach().to(torch.float64).cpu().flatten().tolist()
    return flat * hq if len(flat) == 1 else flat


def followed_input(attn: fx.Node, mask: fx.Node, inputs: Sequence[fx.Node], trials: Sequence[Trial],
                    read: Callable = Trial.bias) -> Optional[fx.Node]:
    """The [B, L] tree input, not 0/1 (token ids), whose values the mask's bias (or, with ``read`` =
    ``Trial.visible``, its visibility) follows, else None: on a trial, that input alone reversed along the
    length (the same values and sizes in another order; the 0/1 inputs, hence the padding and the ALiBi
    positions, stay), the bias re-evaluated and compared. A bias (a visibility) that is a function of the
    positions and the padding alone is unchanged. Both evaluations see the trainable
    tensors perturbed (:func:`perturbed_parameters`): at its initial values a learned bias may not show what
    it follows (Doge's ``exp(A * ...)`` with ``A = 0`` is 1 everywhere)."""
    params = perturbed_parameters(mask, trials[0].values) if trials else {}
    for x in inputs:
        for t in trials:
            v = t.values.get(x)
            if not isinstance(v, torch.Tensor) or v.dim() != 2 or binary(v) or torch.equal(v.flip(-1), v):
                continue
            base = {**t.values, **params}
            a = read(Trial(base, t.literal, t.size, t.unpadded), mask, attn)
            b = read(Trial({**base, x: v.flip(-1)}, t.literal, t.size, t.unpadded), mask, attn)
            if (a is None) != (b is None) or (a is not None and (a.shape != b.shape or not torch.equal(a, b))):
                return x
            break
    return None


def perturbed_parameters(mask: fx.Node, values: dict, free: Sequence[fx.Node] = ()) -> dict:
    """Every trainable floating placeholder of the mask's subgraph (not behind a ``free`` node), plus a fixed
    pseudo-random offset (seeded, 0.25 * N(0, 1)): generic values for the probes of :func:`followed_input`."""
    gen, out = probe.generator(0), {}
    for n in ancestors(mask, lambda a: a not in free):
        v = values.get(n) if n.op == "placeholder" else None
        if isinstance(v, torch.Tensor) and v.requires_grad and v.is_floating_point():
            noise = probe.normal(v.shape, gen, like=v)
            out[n] = v.detach() + 0.25 * noise
    return out


def _query_heads(attn: fx.Node) -> Optional[int]:
    """Hq of an attention node's query [B, Hq, L, D] (None when unknown)."""
    q = attn.args[0] if attn.args else attn.kwargs.get("query")
    v = example_value(q) if isinstance(q, fx.Node) else None
    return int(v.shape[1]) if isinstance(v, torch.Tensor) and v.dim() == 4 else None


def _is_binary(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 2 and binary(x)


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """A mask or bias as [B | 1, H | 1, Lq, Lk]."""
    while t.dim() < 4:
        t = t.unsqueeze(0)
    return t


def _alibi_positions(t: Trial, count: Optional[fx.Node]) -> torch.Tensor:
    """[B' | 1, Lk] ALiBi key positions on trial ``t``: the columns, or the running count of X != 0."""
    Lp = t.size[1]
    if count is None:
        return torch.arange(Lp, dtype=torch.float64)[None, :]
    return (t.values[count] != 0).cumsum(-1).to(torch.float64).cpu()


def _alibi_slopes(attn: fx.Node, mask: fx.Node, trials: Sequence[Trial], hq: Optional[int]) -> Optional[list]:
    """Per-query-head slopes read off the longest trial without padding: (bias at the last query's last key
    minus at its first visible key) / (their column distance), in float64; None when there is no such trial,
    the bias has a head extent other than 1 and Hq, or the row shows fewer than two keys."""
    unpadded = [t for t in trials if t.unpadded]
    if not unpadded or hq is None:
        return None
    t = max(unpadded, key=lambda t: t.size[1])
    vis, bias = _as_4d(t.visible(mask, attn)), t.bias(mask, attn)
    if bias is None:
        return [0.0] * hq
    bias = _as_4d(bias).to(torch.float64).cpu()
    if bias.shape[1] not in (1, hq):
        return None
    vis = vis.expand(*vis.shape[:1], bias.shape[1], *vis.shape[2:]).cpu()
    row = vis[0, :, -1]  # [H', Lk]: the last query row of the first batch row
    if not bool(row[:, -1].all()):
        return None
    first = row.to(torch.uint8).argmax(-1)  # [H']
    if bool((first == row.shape[-1] - 1).any()):
        return None
    last = bias[0, :, -1, -1]
    at_first = bias[0, :, -1].gather(-1, first[:, None])[:, 0]
    slopes = ((last - at_first) / (row.shape[-1] - 1 - first).to(torch.float64)).tolist()
    return slopes * hq if len(slopes) == 1 else slopes


def _fits_alibi(vis: torch.Tensor, bias: Optional[torch.Tensor], slopes: Sequence[float],
                pos: torch.Tensor) -> bool:
    """Whether ``bias - m[h] * pos[b, k]`` is constant along every query row over its visible keys, up to
    the rounding of the bias's dtype (:data:`.probe.ROUNDING` of ``max |bias| + max |m[h] * pos| + 1``)."""
    vis = _as_4d(vis).cpu()
    hq = len(slopes)
    if bias is None:
        if not any(slopes):
            return True
        bias = torch.zeros(vis.shape, dtype=torch.float64)
    dtype = bias.dtype
    b = _as_4d(bias).detach().to(torch.float64).cpu()  # detached: a trainable bias's probe carries a graph
    if b.shape[1] not in (1, hq) or vis.shape[1] not in (1, hq):
        return False
    m = torch.tensor(list(slopes), dtype=torch.float64)[None, :, None, None]
    expected = m * pos[:, None, None, :]  # [B' | 1, Hq, 1, Lk]
    try:
        r, v = torch.broadcast_tensors(b - expected, vis)
    except RuntimeError:
        return False
    hi = r.masked_fill(~v, float("-inf")).amax(-1)
    lo = r.masked_fill(~v, float("inf")).amin(-1)
    seen = v.any(-1)
    tol = probe.ROUNDING.bound(dtype, float(b.abs().max()) + float(expected.abs().max()) + 1.0)
    return bool(((hi - lo)[seen] <= tol).all())
