"""What a mask's values say: blocked and visible pairs, float biases split from visibility, windows; the mask-only
subgraph of an attention and its evaluation on probe values (:func:`evaluate`); :class:`MaskInfo`, a mask's class."""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.fx as fx

from brcompile.passes import probe
from brcompile.passes.probe import map_ints
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.passes.canonical.attention.common import BLOCKING
from brcompile.passes.meta import CANONICAL

log = logging.getLogger(__name__)

#: Probe lengths every scalable mask is evaluated at (odd sizes, below typical windows).
BASE_LENGTHS = (5, 12, 33)
#: Probe row counts (two, so that a literal that only looked like the batch size is caught).
PROBE_ROWS = (2, 3)
#: Most mask elements (rows · L'²) one evaluation may build: at the example size or at a probe size.
MAX_PROBE_ELEMENTS = 1 << 25
#: Probes with more elements than this use one row and two key-padding patterns (ones, random).
SHORT_PROBE_ELEMENTS = 1 << 16
#: Literals within this distance of L are taken for L (``arange(L - 1)``, ``L + 1``).
LENGTH_SLACK = 2
#: A size at most this small is never rewritten (it cannot be told from a dim index).
SMALL_SIZE = 4


@dataclasses.dataclass(frozen=True)
class MaskInfo:
    kind: str  # "causal" | "causal+keypad" | "causal+sequences"
    keypad: Optional[fx.Node] = None
    window: int = 0  # > 0: sliding window, query i sees keys j with i - j < window
    #: Longest length the meaning is proven for (None: every length); see the module docstring.
    max_length: Optional[int] = None
    #: The position-id input whose 0s start the sequences packed into each row ("causal+sequences").
    sequences: Optional[fx.Node] = None
    #: ALiBi slopes, one per query head (None: no bias); see :func:`alibi_meaning`.
    alibi: Optional[tuple[float, ...]] = None
    #: The 0/1 input X whose running count gives the ALiBi positions (None: the columns).
    alibi_count: Optional[fx.Node] = None
    #: Trainable ALiBi: the node whose value is the slopes (``alibi`` then holds the example's values); see
    #: :func:`_trainable_alibi`.
    alibi_node: Optional[fx.Node] = None
    #: The float mask blocks some key with a finite value (``-1e9``, ``finfo.min``), not ``-inf``: a query row whose
    #: keys are all blocked is a softmax over all of them in the original, 0 in tree attention (module docstring).
    finite_blocking: bool = False

    def __str__(self) -> str:
        arg = self.keypad if self.keypad is not None else self.sequences
        s = self.kind if arg is None else f"{self.kind}({arg.name})"
        s += f"+window({self.window})" if self.window else ""
        if self.alibi is not None:
            over = "" if self.alibi_count is None else f" over count({self.alibi_count.name})"
            learned = "" if self.alibi_node is None else f" trainable {self.alibi_node.name}"
            s += f"+alibi({', '.join(f'{m:.4g}' for m in self.alibi)}{over}{learned})"
        return s + (f" for L <= {self.max_length}" if self.max_length is not None else "")


def descendants(roots: Sequence[fx.Node]) -> set[fx.Node]:
    """All nodes that depend on one of ``roots`` (the roots themselves only when another root reaches them)."""
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        for u in stack.pop().users:
            if u not in seen:
                seen.add(u)
                stack.append(u)
    return seen


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


def int_literals(nodes: Iterable[fx.Node]) -> set[int]:
    """Every int literal in the args of ``nodes``."""
    found: set[int] = set()

    def see(c: int) -> int:
        found.add(c)
        return c

    for n in nodes:
        if n.op in ("call_function", "call_method"):
            map_ints((n.args, n.kwargs), see)
    return found


def evaluate(mask: fx.Node, values: dict[fx.Node, object],
             literal: Optional[Callable[[int], int]] = None) -> torch.Tensor:
    """Run the subgraph that computes ``mask`` with the given placeholder values (:func:`.probe.evaluate`);
    ``literal`` rewrites the int literals of its ops (a static size, for an evaluation at a probe size). A node of
    ``values`` that is no placeholder (a relative bias's table, :func:`free_values`) takes that value: its own
    inputs are not evaluated. An attention the canonicalisation made is run by its meaning
    (:func:`is_canonical_attention`); a node that is no op (a ``call_module``) is refused."""
    try:
        return probe.evaluate(mask, values, literal=literal, call=_by_meaning)
    except probe.UnsupportedNode as e:
        raise CannotReplay(Code.MASK_UNPROVEN, f"mask subgraph contains a {e.node.op}", e.node) from e


def _by_meaning(n: fx.Node, args: tuple, kwargs: dict):
    """An attention of the canonicalisation evaluated by its meaning (sinks, soft-cap: not runnable as spelled);
    ``NotImplemented`` for every other node (run as spelled)."""
    if not is_canonical_attention(n):
        return NotImplemented
    from brcompile.passes.canonical.attention import canonical_attention
    return canonical_attention(n, args, kwargs)


def is_canonical_attention(n: fx.Node) -> bool:
    """Whether ``n`` is an attention the canonicalisation made (an eager chain, sinks and soft-cap on the node):
    :func:`evaluate` runs it by :func:`..canonicalize.canonical_attention`, not as the call it is spelled as."""
    return CANONICAL.get(n) is not None or any(k.startswith("br_") for k in n.kwargs)


def blocked(mask: torch.Tensor) -> torch.Tensor:
    """Where an additive float mask blocks a key: its value is at most :data:`BLOCKING` (``-inf`` included)."""
    return mask <= BLOCKING


def finite_blocking(mask: torch.Tensor) -> bool:
    """Whether an additive float mask blocks some key with a finite value (a fully blocked query row is then a
    softmax over all its keys in the original, not 0)."""
    return mask.dtype != torch.bool and bool((blocked(mask) & torch.isfinite(mask)).any())


def visible(mask: torch.Tensor, node: fx.Node) -> torch.Tensor:
    """Boolean visibility of a bool or additive float mask (blocked at most :data:`BLOCKING`); refuses float
    masks that carry a bias."""
    vis, bias = split_bias(mask, node)
    if bias is not None:
        raise CannotReplay(Code.MASK_FLOAT_BIAS, float_bias_reason(mask, vis), node)
    return vis


def float_bias_reason(mask: torch.Tensor, vis: torch.Tensor, where: str = "at pairs it does not block") -> str:
    """Why a float mask with finite nonzero values at pairs it does not block is not a mask: the values named
    (at most three), and ``where`` they are."""
    found = mask.masked_fill(~vis, 0.0).detach()
    found = found[found != 0].unique()
    shown = ", ".join(f"{v:.4g}" for v in found[:3].tolist()) + (", ..." if found.numel() > 3 else "")
    return (f"attn_mask is a float bias with finite nonzero values (not a 0 / -inf mask): it holds {shown} {where} "
            f"(a key is blocked by a value <= {BLOCKING:g}, such as -1e9, finfo(dtype).min or -inf; a value above "
            "that is added to the scores)")


def split_bias(mask: torch.Tensor, node: fx.Node) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(visibility, bias) of a bool or additive float mask: visible where the value is above :data:`BLOCKING`
    (:func:`blocked`); the bias is the mask's value there (0 elsewhere), None when it is 0 everywhere.
    NaN or ``+inf`` values are refused."""
    if mask.dtype == torch.bool:
        return mask, None
    vis = ~blocked(mask)
    if not bool(torch.isfinite(mask.masked_fill(~vis, 0.0)).all()):
        raise CannotReplay(Code.MASK_FLOAT_BIAS,
                           "float attention mask holds NaN or +inf (NaN also marks a blend s * B + A of the scores "
                           "where B is not 0 or 1, or where B is 0 and A does not block: the scores are scaled "
                           "or replaced by a finite value, not masked)", node)
    bias = mask.masked_fill(~vis, 0.0)
    return vis, (bias if bool((bias != 0).any()) else None)


def sliding_window(mask: torch.Tensor, attn: fx.Node) -> Optional[int]:
    """``w`` when the visible pairs are causal and within ``w`` positions (``i - w < j <= i``) wherever
    the mask shows a key at all, with ``w`` smaller than the length; else None (a diagnosis only).

    ``w - 1`` is the largest ``i - j`` over visible pairs: per query row, ``i`` minus its first visible
    key. Memory: the mask's own elements as bool, no index grids."""
    vis = visible(mask, attn)
    if vis.dim() < 2 or vis.shape[-1] != vis.shape[-2] or not bool(vis.any()):
        return None
    L = vis.shape[-1]
    if bool(torch.triu(vis, diagonal=1).any()):  # a key after its query
        return None
    rows = vis.reshape(-1, L, L)
    seen = rows.any(-1)  # [R, L]: query rows with a visible key
    first = rows.to(torch.uint8).argmax(-1)  # [R, L]: first visible key of each query row
    i = torch.arange(L, device=vis.device)
    w = int((i - first)[seen].max()) + 1
    return w if w < L else None
