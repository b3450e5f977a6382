"""What an attention mask means.

An attention node's mask is either ``is_causal=True`` with no mask, or a tensor computed inside the
graph from the token inputs (HF builds it from ``arange`` comparisons and ``attention_mask``). We do not
pattern-match that subgraph: we *evaluate* it on probe values of the tree inputs at compile time and
compare with each candidate meaning:

* ``causal``:              visible(b, i, j) = j <= i
* ``causal & keypad(X)``:  visible(b, i, j) = j <= i and X[b, j] != 0, for a [B, L] tree input X
* either of them ``& window(W)``: also i - j < W (HF's sliding window over the batch columns, which are
  the tree positions); W is read off the mask with every key-padding input set to ones — or, for a
  mask built from dynamic sizes whose window is longer than the example batch, off the mask re-evaluated
  at longer lengths (:func:`_window_at_larger_sizes`)

A candidate is accepted only if it matches on the example batch and on several random probes (random
0/1 key-padding patterns, left and right padding). Float masks must be exactly 0 where visible and
``-inf`` (or the dtype's lowest value) elsewhere — any other value is a bias, not a mask. Anything else
(bidirectional prefixes, biases, other windows) stops the rewrite with the reason.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Sequence

import torch
import torch.fx as fx

from brcompile.passes.axes import CannotReplay, is_static_input

log = logging.getLogger(__name__)

NUM_PROBES = 4


@dataclasses.dataclass(frozen=True)
class MaskInfo:
    kind: str  # "causal" | "causal+keypad"
    keypad: Optional[fx.Node] = None
    window: int = 0  # > 0: sliding window, query i sees keys j with i - j < window

    def __str__(self) -> str:
        s = self.kind if self.keypad is None else f"{self.kind}({self.keypad.name})"
        return s + (f"+window({self.window})" if self.window else "")


def ancestors(node: fx.Node) -> list[fx.Node]:
    """All nodes ``node`` depends on (itself included), in graph order."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]


def mask_only_nodes(gm: fx.GraphModule, mask_args: Sequence[fx.Node]) -> set[fx.Node]:
    """Nodes used only to build attention masks (so they need no token-axis rule)."""
    roots = set(mask_args)
    only: set[fx.Node] = set()
    for n in reversed(list(gm.graph.nodes)):
        if n.op in ("placeholder", "output"):
            continue
        users = list(n.users)
        if n in roots and all(_uses_only_as_mask(u, n) for u in users):
            only.add(n)
        elif users and all(u in only for u in users):
            only.add(n)
    return only


def _uses_only_as_mask(user: fx.Node, n: fx.Node) -> bool:
    return user.kwargs.get("attn_mask") is n or (len(user.args) > 3 and user.args[3] is n)


def evaluate(mask: fx.Node, values: dict[fx.Node, object]) -> torch.Tensor:
    """Run the subgraph that computes ``mask`` with the given placeholder values."""
    env: dict[fx.Node, object] = {}
    for n in ancestors(mask):
        if n.op == "placeholder":
            env[n] = values[n]
            continue
        if n.op == "get_attr":
            env[n] = getattr(n.graph.owning_module, n.target)
            continue
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
        if n.op == "call_function":
            env[n] = n.target(*args, **kwargs)
        elif n.op == "call_method":
            env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
        else:
            raise CannotReplay(f"mask subgraph contains a {n.op}", n)
    return env[mask]


def visible(mask: torch.Tensor, node: fx.Node) -> torch.Tensor:
    """Boolean visibility of a bool or additive float mask; refuses float masks that carry a bias."""
    if mask.dtype == torch.bool:
        return mask
    lowest = torch.finfo(mask.dtype).min
    vis = mask == 0
    blocked = (mask == float("-inf")) | (mask <= lowest)
    if not bool((vis | blocked).all()):
        raise CannotReplay("float attention mask holds values other than 0 and -inf (a bias)", node)
    return vis


def _probe(x: torch.Tensor, gen: torch.Generator, i: int) -> torch.Tensor:
    """A random value shaped and typed like tree input ``x`` — 0/1 patterns for 0/1 inputs."""
    B, L = x.shape
    binary = bool(((x == 0) | (x == 1)).all())
    if binary:
        if i == 0:  # left padding of random lengths
            lens = torch.randint(0, L + 1, (B, 1), generator=gen)
            p = torch.arange(L)[None, :] >= (L - lens)
        elif i == 1:  # right padding
            lens = torch.randint(0, L + 1, (B, 1), generator=gen)
            p = torch.arange(L)[None, :] < lens
        else:
            p = torch.rand(B, L, generator=gen) < 0.6
        return p.to(device=x.device, dtype=x.dtype)
    lo, hi = int(x.min()), int(x.max()) + 2
    return torch.randint(lo, max(hi, lo + 2), (B, L), generator=gen).to(device=x.device, dtype=x.dtype)


def _trials(values: dict, inputs: Sequence[fx.Node], num_probes: int = NUM_PROBES) -> list[dict]:
    """The given values, then ``num_probes`` copies with random 0/1 patterns (or ids) for ``inputs``."""
    gen = torch.Generator().manual_seed(0)
    trials = [dict(values)]
    for i in range(num_probes):
        v = dict(values)
        for t in inputs:
            v[t] = _probe(values[t], gen, i)
        trials.append(v)
    return trials


def classify(attn: fx.Node, mask: fx.Node, tree_inputs: Sequence[fx.Node],
             values: dict[fx.Node, object]) -> MaskInfo:
    """Meaning of ``mask`` at attention node ``attn`` (see module docstring)."""
    anc = set(ancestors(mask))
    inputs = [t for t in tree_inputs if t in anc]
    for n in anc:
        if n.op == "placeholder" and n not in tree_inputs and isinstance(values.get(n), torch.Tensor) \
                and not is_static_input(n):
            raise CannotReplay(f"attention mask depends on non-token input {n.name}", attn)
    candidates: list[Optional[fx.Node]] = [None] + inputs
    trials = _trials(values, inputs)
    w = _window_of(mask, inputs, values, attn) or _window_at_larger_sizes(mask, inputs, values, attn)
    for window in ([w] if w else []) + [0]:
        for cand in candidates:
            if all(_matches(evaluate(mask, v), cand, v, attn, window) for v in trials):
                info = MaskInfo("causal" if cand is None else "causal+keypad", cand, window)
                log.debug("mask of %s: %s", attn.name, info)
                return info
    raise CannotReplay("attention mask is neither causal nor causal & key padding from a token input, "
                       "optionally with a sliding window (prefix-LM and bias masks are not supported)", attn)


def _window_of(mask: fx.Node, inputs: Sequence[fx.Node], values: dict, attn: fx.Node) -> Optional[int]:
    """The sliding window the mask shows with every 0/1 tree input set to ones (no key padding), or None."""
    v = dict(values)
    for t in inputs:
        x = values[t]
        if bool(((x == 0) | (x == 1)).all()):
            v[t] = torch.ones_like(x)
    return sliding_window(evaluate(mask, v), attn)


#: Most mask elements a larger-size probe may build (B * L'^2).
PROBE_MAX_ELEMENTS = 1 << 27


def _window_at_larger_sizes(mask: fx.Node, inputs: Sequence[fx.Node], values: dict,
                            attn: fx.Node) -> Optional[int]:
    """For a mask built from dynamic sizes (SymInt inputs): a sliding window that is inactive at the
    example length L (W >= L) shows at a longer one. Re-evaluate the mask subgraph with the sizes equal to
    L scaled to L' = 4L, 16L, ... (tree inputs: ones, or random ids, of shape [B, L']) while B * L'^2 stays
    under PROBE_MAX_ELEMENTS; the first window seen is returned. Any failure to evaluate means None (the
    per-call meaning guard still protects every new size)."""
    syms = symbolic_inputs(mask, values)
    if not syms or not inputs:
        return None
    B, L = values[inputs[0]].shape
    gen = torch.Generator().manual_seed(1)
    Lp = 4 * L
    while L > 0 and B * Lp * Lp <= PROBE_MAX_ELEMENTS:
        v = dict(values)
        for n in syms:
            if int(values[n]) == L:
                v[n] = Lp
        for t in inputs:
            x = values[t]
            binary = bool(((x == 0) | (x == 1)).all())
            v[t] = (torch.ones((B, Lp), dtype=x.dtype, device=x.device) if binary else
                    torch.randint(1, 1 << 15, (B, Lp), generator=gen).to(device=x.device, dtype=x.dtype))
        try:
            w = sliding_window(evaluate(mask, v), attn)
        except Exception:  # the subgraph does not scale this way: no conclusion
            log.debug("mask of %s: no larger-size probe at L'=%d", attn.name, Lp, exc_info=True)
            return None
        if w is not None:
            log.debug("mask of %s: sliding window %d found at L'=%d (inactive at L=%d)", attn.name, w, Lp, L)
            return w
        Lp *= 4
    return None


def sliding_window(mask: torch.Tensor, attn: fx.Node) -> Optional[int]:
    """``w`` when the visible pairs are causal and within ``w`` positions (``i - w < j <= i``) wherever
    the mask shows a key at all, with ``w`` smaller than the length; else None (a diagnosis only)."""
    vis = visible(mask, attn)
    if vis.dim() < 2 or vis.shape[-1] != vis.shape[-2] or not bool(vis.any()):
        return None
    L = vis.shape[-1]
    i = torch.arange(L)[:, None]
    j = torch.arange(L)[None, :]
    if bool((vis & (j > i)).any()):
        return None
    w = int(((i - j).expand_as(vis))[vis].max()) + 1
    return w if w < L else None


def symbolic_inputs(mask: fx.Node, values: dict[fx.Node, object]) -> list[fx.Node]:
    """The SymInt placeholders (dynamic sizes) the mask subgraph reads."""
    return [n for n in ancestors(mask) if n.op == "placeholder" and (
        isinstance(values.get(n), torch.SymInt) or isinstance(n.meta.get("example_value"), torch.SymInt))]


def meaning_guard(attn: fx.Node, mask: fx.Node, info: MaskInfo, tree_inputs: Sequence[fx.Node],
                  placeholders: Sequence[fx.Node], values: dict[fx.Node, object]):
    """A per-call guard for a mask whose subgraph reads dynamic sizes, or None when it reads none.

    ``classify`` ran at the example sizes only. A mask built for symbolic sizes can mean something else
    at other sizes — a sliding window of w is plain causal while L <= w — so for every new value of the
    sizes it reads, the guard re-runs the check on the call's own inputs and two probes of their shape
    (cost: the original's own mask construction, once per distinct size), and caches the verdict."""
    from brcompile.passes.guards import BatchGuard  # local: guards has no pass dependencies

    syms = symbolic_inputs(mask, values)
    if not syms:
        return None
    anc = set(ancestors(mask))
    pos = {n: placeholders.index(n) for n in anc if n.op == "placeholder"}
    inputs = [t for t in tree_inputs if t in anc]
    verdicts: dict[tuple, Optional[str]] = {}

    def check(args):
        key = tuple(int(args[pos[s]]) for s in syms)
        if key not in verdicts:
            vals = {n: args[i] for n, i in pos.items()}
            try:
                ok = all(_matches(evaluate(mask, v), info.keypad, v, attn, info.window)
                         for v in _trials(vals, inputs, 2))
            except CannotReplay:  # a bias at these sizes
                ok = False
            verdicts[key] = None if ok else _size_reason(attn, mask, info, vals, dict(zip(
                (s.name for s in syms), key)))
        return verdicts[key]

    return BatchGuard(f"mask of {attn.name} is {info} at every size ({', '.join(s.name for s in syms)})", check)


def _size_reason(attn, mask, info, vals, sizes) -> str:
    """Why a mask classified at the example sizes is not ``info`` at ``sizes`` (a guard's reason)."""
    try:
        w = sliding_window(evaluate(mask, vals), attn)
    except CannotReplay:
        w = None
    what = f"sliding-window attention (window {w})" if w is not None else f"not {info}"
    return f"the mask of {attn.name} is {what} at sizes {sizes}; it was {info} at the compile-time sizes"


def _matches(mask: torch.Tensor, cand: Optional[fx.Node], values, attn, window: int = 0) -> bool:
    vis = visible(mask, attn)
    if vis.dim() < 2:
        return False
    Lq, Lk = vis.shape[-2:]
    if Lq != Lk:
        return False
    causal = torch.ones(Lq, Lk, dtype=torch.bool, device=vis.device).tril()
    if window:
        causal = causal & ~torch.ones(Lq, Lk, dtype=torch.bool, device=vis.device).tril(-window)
    if cand is None:
        expected = causal
    else:
        kp = (values[cand] != 0).to(vis.device)  # [B, L]
        expected = causal[None, None] & kp[:, None, None, :]
    try:
        a, b = torch.broadcast_tensors(vis, expected)
    except RuntimeError:
        return False
    return bool((a == b).all())


__all__ = ["MaskInfo", "classify", "mask_only_nodes", "ancestors", "evaluate", "visible", "sliding_window",
           "meaning_guard", "symbolic_inputs"]
