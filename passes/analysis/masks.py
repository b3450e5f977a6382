"""What an attention mask means — decided on small probe batches, never on the real batch's B·L².

An attention node's mask is either ``is_causal=True`` with no mask, or a tensor computed inside the
graph from the token inputs (HF builds it from ``arange`` comparisons and ``attention_mask``). We do not
pattern-match that subgraph: we *evaluate* it on probe values of the tree inputs at compile time and
compare with each candidate meaning:

* ``causal``:              visible(b, i, j) = j <= i
* ``causal & keypad(X)``:  visible(b, i, j) = j <= i and X[b, j] != 0, for a [B, L] tree input X
* either of them ``& window(W)``: also i - j < W (HF's sliding window over the batch columns, which are
  the tree positions)
* ``causal+sequences(P)``: visible(b, i, j) = j <= i and no sequence starts in row b at a column in (j, i],
  for a [B, L] integer tree input P (position ids) whose 0s start the sequences packed into a row
  (padding-free batches: HF's mask from ``position_ids`` without an attention mask). It is checked on
  trials whose P is well formed (every sequence counts 0, 1, 2, ...): the runtime replays only batches whose
  P is (a per-call guard, :func:`sequences_guard`), and builds the tree over the sequences.

**Float masks.** An additive float mask (``attn_mask`` of a ``scaled_dot_product_attention`` call, or the canonical
mask of an eager chain) is read as visibility and bias (:func:`split_bias`): a key is blocked where the value is at
most :data:`BLOCKING` (``-1e4``; ``-1e9``, ``finfo(dtype).min`` and ``-inf`` are masks), visible elsewhere, and a
visible value other than 0 is a bias. So ``(1 - causal.float()) * -1e9``, ``zeros(L, L).masked_fill(~causal,
finfo.min)``, ``where(visible, 0, -inf)``, ``triu(full(-inf), 1) + (1 - am) * finfo.min`` and sums of such parts
in either order classify like the boolean masks they spell (causal, causal & key padding, window). A blocked
key's probability is then exactly 0 in the original as in tree attention, provided the visible scores of its query
row lie within the exp underflow range above the blocked ones (the assumption the eager chains make,
:data:`BLOCKING`). A query row whose keys are all blocked differs: ``-inf`` makes it 0 in the original too, but a
finite blocking value makes it a softmax over all its keys; such a mask is ``MaskInfo.finite_blocking`` and, with
key padding, gets the per-call guard that no row starts with padding (``canonicalize.mask_guards``, as for an eager
chain's additive mask). A mask whose blocked values (or the lack of them) leave a query seeing a later key through
a finite nonzero value (``masked_fill(~causal, -5)``) is refused as a float bias, not a mask, by that name; a bias
at visible pairs is ALiBi or refused (below). Anything else (bidirectional prefixes, biases, other windows) stops the
rewrite with the reason, named where a probe shows it: a query that sees a later key (bidirectional attention),
a visibility that changes when only the token ids are reordered (a content-dependent mask: a top-k selection of
keys by a learned index with fewer picks than keys).

The subgraph may read an earlier attention's output (HY-V4's DeepSeek-sparse-attention indexer over the hidden
states): an attention the canonicalisation made, which the ``scaled_dot_product_attention`` call it is spelled
as does not compute (sinks, soft-cap), is evaluated by its meaning (:func:`is_canonical_attention`).

**ALiBi.** One bias is accepted (:func:`alibi_meaning`): a float mask whose finite values, on every trial
and at every visible pair, are ``m[h] * pos[b, k] + c[b, h, q]`` — a per-head slope times the key position
plus anything constant along the query row (softmax is invariant to it: this covers both
``m[h] * (k - q)`` and BLOOM's ``m[h] * k``). The positions are the columns (``pos[b, k] = k``) or the
count of attention-mask tokens up to k (BLOOM's ``cumsum(attention_mask) - 1``, ``count(X)`` for a [B, L]
0/1 tree input X). The slopes are read off a trial without padding and the form is then checked on every
trial (up to the rounding of the mask's dtype); the result is ``MaskInfo.alibi`` (the slopes) and
``MaskInfo.alibi_count`` (X, or None for the columns), tree attention's ``alibi`` feature. A bias on the
packed-sequence layout is refused.

**Trainable ALiBi slopes.** A bias that depends on trainable tensors is ALiBi with trainable slopes when one
value ``P`` of the subgraph, computed from trainable tensors (and parameters, buffers, constants) alone, with one
number per query head (or one for all), carries every trainable tensor into the mask (no path from a trainable
tensor to the mask avoids it: :func:`_slopes_node`), and the bias is ``P[h] * pos[b, k] + c[b, h, q]`` on every
trial (each with its own perturbed trainable values) and on one more trial with ``P`` itself replaced by random
numbers (so the slope is ``P``, not a function of it that agrees at the trainable values). Then
``MaskInfo.alibi_node`` is ``P``: the packed graph computes it (its ancestors are taken out of the mask-only
nodes) and hands it to tree attention as its differentiable ``slopes``, whose gradient reaches the trainable
tensors through ``P``'s own ops. Any other bias of trainable tensors is refused; the refusal says whether the
bias also follows the values of a token input (it changes when only that input is reordered on a probe: a
per-token bias such as a projection of the hidden states) or is a learned position bias (a relative-position
table). The probes evaluate the subgraph with every trainable tensor
perturbed (:func:`_perturbed_parameters`; the example batch keeps the real values), so a learned value cannot hide
behind its initial value; a per-key bias has been moved into the keys by the canonicalisation before (what is left
must be a mask on every probe).

**Relative bias.** An attention whose canonicalisation found a relative bias (``attn.meta["br_relbias_source"]``:
the per-query table T [B, H, Lq, E] its bias is gathered from, :func:`..canonicalize._relative_bias`) has the
mask ``M - G(F)``; its probes give T itself a fresh random value (:func:`free_values`) instead of computing it, so
the mask is 0 at every visible pair only when the bias is ``G(F)`` — a function of the query token's table and
the clamped distance alone — whatever T is; else the bias is refused by that name. (The subgraph upstream of T is
not evaluated: it is the model's, and what it computes is the table's business, packed like any token value.)

**Probe sizes.** A mask is [B, 1, L, L]: evaluating it on the example batch costs B·L² (73 GB at
B = 16, L = 16,896). So the subgraph is evaluated at small synthetic sizes (B', L') instead, with every
size it reads scaled (:class:`Scaling`): a dynamic size (a SymInt placeholder whose example value is the
batch's B or L) is set to B' / L'; a static size baked into the graph as a literal (``arange(16896)``,
``expand(16, -1, 16896, 16896)``) is rewritten to B' / L' (L ± 2 too, for ``L - 1`` style literals) when
it cannot be mistaken for a dim index or for the other size. The probe lengths are a few odd base lengths
plus, for every other integer constant ``c`` of the subgraph (a window, a buffer's size), ``c``, ``c + 1``
and ``c + 2``: a mask built from comparisons of positions, sizes and constants changes meaning only at
lengths where a constant is crossed, and a window ``W`` shows only at L' > W. Two probe row counts (2, 3)
catch a literal that only looked like B (a window equal to the batch size reads as a window that follows
B' and is refused). The example batch itself is one more trial where it is small (rows·L² within
:data:`MAX_PROBE_ELEMENTS`).

**Admitted lengths.** A constant too large to probe (rows·L'² over :data:`MAX_PROBE_ELEMENTS`), or a
probe length at which the subgraph cannot be evaluated (a [T, T] buffer shorter than L'), bounds the
lengths the meaning is proven for: ``MaskInfo.max_length``. A static graph (one L) longer than that is
refused at compile time; a dynamic graph gets an O(1) per-call guard on the length
(:func:`meaning_guard`). Nothing here allocates more than :data:`MAX_PROBE_ELEMENTS` mask elements,
whatever the batch.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.fx as fx

from brcompile.passes import probe
from brcompile.passes.analysis.axes import example_value, is_static_input
from brcompile.passes.probe import ancestors, map_ints, sequence_positions
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.passes.canonical.attention.common import BLOCKING
from brcompile.passes.meta import CANONICAL, RELBIAS_SOURCE

log = logging.getLogger(__name__)

#: Probe lengths every scalable mask is evaluated at (odd sizes, below typical windows).
BASE_LENGTHS = (5, 12, 33)
#: Probe row counts (two, so that a literal that only looked like the batch size is caught).
PROBE_ROWS = (2, 3)
#: Most mask elements (rows · L'²) one evaluation may build: at the example size or at a probe size.
MAX_PROBE_ELEMENTS = 1 << 25
#: Probes with more elements than this use one row and two key-padding patterns (ones, random).
SHORT_PROBE_ELEMENTS = 1 << 16#: Literals within this distance of L are taken for L (``arange(L - 1)``, ``L + 1``).
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


def _int_literals(nodes: Iterable[fx.Node]) -> set[int]:
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


# --------------------------------------------------------------------------------------------------
# probe sizes


def _is_symbolic(s) -> bool:
    return isinstance(s, torch.SymInt) and s.node.maybe_as_int() is None


def _linear_in(expr, symbol):
    """(a, c) with ``expr == a * symbol + c`` for ints a != 0, c; else None."""
    try:
        c = expr.subs(symbol, 0)
        a = expr.subs(symbol, 1) - c
        if not (a.is_Integer and c.is_Integer) or a == 0 or (expr - (a * symbol + c)).expand() != 0:
            return None
        return int(a), int(c)
    except Exception:  # a size expression sympy cannot take apart (FloorDiv, Mod, ...)
        return None


def _size_symbol(size) -> Optional[tuple[object, int, int]]:
    """(symbol s, a, c) when a dynamic size is ``a * s + c`` in one symbol, else None."""
    if not _is_symbolic(size):
        return None
    expr = size.node.expr
    if len(expr.free_symbols) != 1:
        return None
    sym = next(iter(expr.free_symbols))
    lin = _linear_in(expr, sym)
    return None if lin is None else (sym, *lin)


@dataclasses.dataclass(frozen=True)
class Scaling:
    """How the mask subgraph is evaluated at a probe size (B', L') instead of the batch's (B, L).

    A size is *scalable* when every place the subgraph reads it can be set. A dynamic size is ``a * s + c``
    in one symbol ``s`` (Dynamo may lift ``L - 1`` as the symbol); a probe size sets ``s`` and every SymInt
    placeholder of the subgraph takes the value of its expression (``sym_nodes``). A static size is read
    through the int literals equal to it (``b_literal``/``l_literal``: rewritten by :meth:`literal`). An
    unscalable size keeps its value in every probe."""

    B: int
    L: int
    b_symbol: Optional[tuple] = None  # (s, a, c): B = a * s + c
    l_symbol: Optional[tuple] = None
    sym_nodes: tuple = ()  # (placeholder, sympy expression) of the subgraph's SymInt inputs
    b_literal: bool = False
    l_literal: bool = False
    b_scalable: bool = False
    l_scalable: bool = False

    @classmethod
    def of(cls, tree_input: fx.Node, values: dict, anc: Sequence[fx.Node]) -> "Scaling":
        B, L = (int(s) for s in values[tree_input].shape)
        shape = getattr(example_value(tree_input), "shape", (B, L))
        b_dyn, l_dyn = _is_symbolic(shape[0]), _is_symbolic(shape[1])
        b_symbol = _size_symbol(shape[0]) if b_dyn else None
        l_symbol = _size_symbol(shape[1]) if l_dyn else None
        if b_symbol and l_symbol and b_symbol[0] == l_symbol[0]:  # one symbol for both: not independent
            b_symbol = l_symbol = None
        sym_nodes = tuple((n, n.meta["example_value"].node.expr) for n in anc if n.op == "placeholder"
                          and isinstance(n.meta.get("example_value"), torch.SymInt))
        l_lit = not l_dyn and L > SMALL_SIZE and not (not b_dyn and abs(B - L) <= LENGTH_SLACK)
        b_lit = not b_dyn and B > SMALL_SIZE and not (not l_dyn and abs(B - L) <= LENGTH_SLACK)
        return cls(B, L, b_symbol, l_symbol, sym_nodes, b_lit, l_lit,
                   b_scalable=bool(b_symbol) or b_lit, l_scalable=bool(l_symbol) or l_lit)

    def symbol_values(self, Bp: int, Lp: int) -> Optional[dict]:
        """The SymInt placeholders' values at probe size (Bp, Lp) (None: a size is not a whole multiple)."""
        assign = {}
        for size, target in ((self.b_symbol, Bp), (self.l_symbol, Lp)):
            if size is not None:
                sym, a, c = size
                if (target - c) % a:
                    return None
                assign[sym] = (target - c) // a
        out = {}
        for n, expr in self.sym_nodes:
            if expr.free_symbols and expr.free_symbols <= set(assign):
                out[n] = int(expr.subs(assign))
        return out

    def literal(self, Bp: int, Lp: int) -> Optional[Callable[[int], int]]:
        """The literal rewrite for probe size (Bp, Lp), or None when no static size is rewritten."""
        if not ((self.b_literal and Bp != self.B) or (self.l_literal and Lp != self.L)):
            return None
        B, L = self.B, self.L

        def f(c: int) -> int:
            if self.l_literal and abs(c - L) <= LENGTH_SLACK:
                return Lp + (c - L)
            if self.b_literal and c == B:
                return Bp
            if self.b_literal and self.l_literal and c == B * L:
                return Bp * Lp
            return c
        return f

    def images(self) -> set[int]:
        """The literals :meth:`literal` rewrites (they are sizes, not thresholds)."""
        out: set[int] = set()
        if self.l_literal:
            out |= {self.L + k for k in range(-LENGTH_SLACK, LENGTH_SLACK + 1)}
        if self.b_literal:
            out.add(self.B)
            if self.l_literal:
                out.add(self.B * self.L)
        return out


@dataclasses.dataclass
class _Trial:
    """One evaluation of the mask: its placeholder values and literal rewrite."""

    values: dict
    literal: Optional[Callable[[int], int]]
    size: tuple[int, int]
    unpadded: bool  # every 0/1 tree input is all ones: the trial a sliding window is read from
    _visible: Optional[torch.Tensor] = None
    _bias: Optional[torch.Tensor] = None
    _finite_blocking: bool = False

    def visible(self, mask: fx.Node, attn: fx.Node) -> torch.Tensor:
        """The mask's boolean visibility on this trial (:func:`split_bias`), evaluated once."""
        if self._visible is None:
            m = evaluate(mask, self.values, self.literal)
            self._visible, self._bias = split_bias(m, attn)
            self._finite_blocking = finite_blocking(m)
        return self._visible

    def finite_blocking(self, mask: fx.Node, attn: fx.Node) -> bool:
        """Whether the mask blocks a key with a finite value on this trial (:func:`finite_blocking`)."""
        self.visible(mask, attn)
        return self._finite_blocking

    def bias(self, mask: fx.Node, attn: fx.Node) -> Optional[torch.Tensor]:
        """The mask's bias on this trial (None: none), :func:`split_bias`."""
        self.visible(mask, attn)
        return self._bias


def free_nodes(attn: fx.Node) -> list[fx.Node]:
    """The nodes whose probe values are free (random) rather than computed: a relative bias's table source."""
    source = RELBIAS_SOURCE.get(attn)
    return [source] if isinstance(source, fx.Node) else []


def free_values(free: Sequence[fx.Node], Bp: int, Lp: int, gen: torch.Generator) -> dict:
    """Random values of the free [B, H, L, E] nodes at probe size (Bp, Lp) (dims 0 and 2 scaled)."""
    out = {}
    for n in free:
        t = example_value(n)
        shape = (Bp, int(t.shape[1]), Lp, *(int(s) for s in t.shape[3:]))
        out[n] = probe.normal(shape, gen, like=t)
    return out


def _binary(x: torch.Tensor) -> bool:
    return bool(((x == 0) | (x == 1)).all())


def _probe_value(x: torch.Tensor, binary: bool, B: int, L: int, gen: torch.Generator, pattern: int) -> torch.Tensor:
    """A [B, L] value typed like tree input ``x``: for 0/1 inputs the key-padding ``pattern`` of
    :func:`.probe.padding` (0 all ones, 1 left padding of random lengths, 2 right padding, 3 random 0/1); other
    inputs get random values in ``x``'s range (:func:`.probe.in_range`: never past it)."""
    if binary:
        return probe.padding(B, L, pattern, gen).to(device=x.device, dtype=x.dtype)
    return probe.in_range(x, (B, L), gen)


class _Probes:
    """Builds the trials of one mask (see the module docstring)."""

    def __init__(self, inputs: Sequence[fx.Node], values: dict, scaling: Scaling, perturbed: Optional[dict] = None,
                 free: Sequence[fx.Node] = ()):
        self.inputs, self.values, self.sc = list(inputs), values, scaling
        self.perturbed = perturbed or {}  # trainable tensors at generic values, for the probes (not the example)
        self.free = list(free)  # nodes given random values (:func:`free_values`)
        self.binary = {t: _binary(values[t]) for t in self.inputs}
        self.gen = probe.generator(0)

    def trials(self, Bp: int, Lp: int, patterns: Iterable[int]) -> list[_Trial]:
        """Trials at (Bp, Lp), one per key-padding ``pattern`` (:func:`_probe_value`)."""
        sc, out = self.sc, []
        v0 = {**self.values, **self.perturbed}
        syms = sc.symbol_values(Bp, Lp)
        if syms is None:
            raise ValueError(f"no integer size symbol gives the probe size ({Bp}, {Lp})")
        v0.update(syms)
        lit = sc.literal(Bp, Lp)
        for pat in patterns:
            v = dict(v0)
            for t in self.inputs:
                v[t] = _probe_value(self.values[t], self.binary[t], Bp, Lp, self.gen, pat)
            v.update(free_values(self.free, Bp, Lp, self.gen))
            out.append(_Trial(v, lit, (Bp, Lp), pat == 0))
        return out

    def example_trials(self) -> list[_Trial]:
        """The example batch itself and four probes of its shape (only where it is small)."""
        B, L = self.sc.B, self.sc.L
        ones = all(bool((self.values[t] == 1).all()) for t in self.inputs if self.binary[t])
        example = {**self.values, **free_values(self.free, B, L, self.gen)}
        return [_Trial(example, None, (B, L), ones)] + self.trials(B, L, range(4))


def _probe_lengths(sc: Scaling, literals: set[int]) -> tuple[list[int], list[int]]:
    """(lengths to probe, threshold constants too large to probe at one row)."""
    lengths = set(BASE_LENGTHS)
    too_large = []
    for c in sorted({abs(c) for c in literals} - sc.images()):
        if c <= 2:
            continue
        if (c + 2) ** 2 > MAX_PROBE_ELEMENTS:
            too_large.append(c)
        else:
            lengths |= {c, c + 1, c + 2}
    return sorted(lengths), too_large


def _size_constants(anc: Sequence[fx.Node], values: dict, sc: Scaling) -> set[int]:
    """Int literals of the subgraph's ops and the sizes of the static tensors it reads (buffers such as a
    [T, T] tril): the lengths at which its meaning may change."""
    consts = _int_literals(anc)
    for n in anc:
        v = values.get(n) if n.op == "placeholder" else None
        if isinstance(v, torch.Tensor) and is_static_input(n):
            consts |= {int(s) for s in v.shape}
        elif n.op == "placeholder" and isinstance(v, int) and not isinstance(v, bool) \
                and n not in dict(sc.sym_nodes):
            consts.add(int(v))
    return consts


def classify(attn: fx.Node, mask: fx.Node, tree_inputs: Sequence[fx.Node],
             values: dict[fx.Node, object]) -> MaskInfo:
    """Meaning of ``mask`` at attention node ``attn`` (see module docstring). ``values``: the example
    inputs by placeholder (SymInts as their example ints)."""
    free = free_nodes(attn)
    anc = ancestors(mask, lambda a: a not in free)
    anc_set = set(anc)
    inputs = [t for t in tree_inputs if t in anc_set]
    for n in anc:
        if n.op == "placeholder" and n not in tree_inputs and isinstance(values.get(n), torch.Tensor) \
                and values[n].dim() > 0 and not is_static_input(n):  # 0-dim: a lifted scalar, guarded by pack
            raise CannotReplay(Code.MASK_FROM_VALUES, f"attention mask depends on non-token input {n.name}", attn)
    sc = Scaling.of(tree_inputs[0], values, anc)
    dynamic = _is_symbolic_length(tree_inputs[0])
    small = sc.B * sc.L * sc.L <= MAX_PROBE_ELEMENTS
    probes = _Probes(inputs, values, sc, _perturbed_parameters(mask, values, free), free)
    trials = probes.example_trials() if small else []
    limit: Optional[tuple[int, str]] = None
    if dynamic or not small:
        if not sc.l_scalable:
            if not small:
                raise CannotReplay(Code.MASK_UNPROVEN,
                    f"attention mask of a [{sc.B}, {sc.L}] batch cannot be evaluated at small sizes (the batch size "
                    "and the length cannot be told apart in its subgraph) and is too large to evaluate whole", attn)
            limit = (sc.L, "its sizes cannot be scaled for probes")
        else:
            more, limit = _probe_trials(attn, mask, probes, _size_constants(anc, values, sc))
            if sc.b_scalable and limit is not None and limit[0] < BASE_LENGTHS[0] \
                    and sc.B * BASE_LENGTHS[0] ** 2 <= SHORT_PROBE_ELEMENTS:
                # the batch-size literal was not only the batch size: probe with the batch's own row count
                probes.sc = sc = dataclasses.replace(sc, b_symbol=None, b_literal=False, b_scalable=False)
                more, limit = _probe_trials(attn, mask, probes, _size_constants(anc, values, sc))
            trials += more
    if limit is not None and (not dynamic or limit[0] < BASE_LENGTHS[0]) and sc.L > limit[0]:
        raise CannotReplay(Code.MASK_UNPROVEN,
                           f"attention mask's meaning is proven for lengths <= {limit[0]} only ({limit[1]}); "
                           f"the batch has L = {sc.L}", attn)
    if not trials:
        raise CannotReplay(Code.MASK_UNPROVEN, "attention mask could not be evaluated at any probe size", attn)
    info = _meaning(attn, mask, inputs, trials)
    if free and any(t.bias(mask, attn) is not None for t in trials):
        raise CannotReplay(Code.RELATIVE_BIAS,
                           f"attention bias gathered from the per-query table {free[0].name} that is not "
                           f"{free[0].name}[b, h, i, clamp(i - j, 0, E - 1)] at every visible pair (i, j) (optionally 0 "
                           "from distance E on): a relative bias must be a function of the query token's table and "
                           "the clamped query-key distance alone", attn)
    if any(t.bias(mask, attn) is not None for t in trials):
        info = alibi_meaning(attn, mask, info, inputs, trials, values)
    if dynamic and limit is not None:
        info = dataclasses.replace(info, max_length=limit[0])
    if any(t.finite_blocking(mask, attn) for t in trials):
        info = dataclasses.replace(info, finite_blocking=True)
    log.debug("mask of %s: %s (%d trials up to L'=%d)", attn.name, info, len(trials),
              max(t.size[1] for t in trials))
    return info


def _probe_trials(attn: fx.Node, mask: fx.Node, probes: "_Probes",
                  constants: set[int]) -> tuple[list[_Trial], Optional[tuple[int, str]]]:
    """Trials at every probe length (``_probe_lengths``) that the subgraph can be evaluated at, and the
    longest admitted length with why (None: every length)."""
    sc = probes.sc
    lengths, too_large = _probe_lengths(sc, constants)
    limit = (min(too_large) - 1, f"the constant {min(too_large)} of its subgraph is too large to probe") \
        if too_large else None
    trials: list[_Trial] = []
    for Lp in lengths:
        if limit is not None and Lp > limit[0]:
            break
        rows = PROBE_ROWS if sc.b_scalable else (sc.B,)
        if rows[0] * Lp * Lp > SHORT_PROBE_ELEMENTS:
            rows = (1,) if sc.b_scalable else rows[:1]
        if rows[0] * Lp * Lp > MAX_PROBE_ELEMENTS:
            return trials, (Lp - 1, f"a probe of length {Lp} would exceed {MAX_PROBE_ELEMENTS} mask elements")
        short = rows[0] * Lp * Lp <= SHORT_PROBE_ELEMENTS
        try:
            new = [t for r in rows for t in probes.trials(r, Lp, range(4) if short else (0, 3))]
            for t in new:
                m = t.visible(mask, attn)
                if m.dim() < 2 or tuple(m.shape[-2:]) != (Lp, Lp):
                    raise ValueError(f"mask of shape {tuple(getattr(m, 'shape', ()))} at length {Lp}")
        except CannotReplay:
            raise
        except Exception as e:  # the subgraph does not exist at this length (e.g. a [T, T] buffer shorter)
            log.debug("mask of %s: cannot be evaluated at L'=%d", attn.name, Lp, exc_info=True)
            return trials, (Lp - 1, f"its subgraph cannot be evaluated at length {Lp}: {type(e).__name__}: {e}")
        trials += new
    return trials, limit


def _is_symbolic_length(tree_input: fx.Node) -> bool:
    v = example_value(tree_input)
    return isinstance(v, torch.Tensor) and v.dim() == 2 and _is_symbolic(v.shape[1])


def _meaning(attn: fx.Node, mask: fx.Node, inputs: Sequence[fx.Node], trials: Sequence[_Trial]) -> MaskInfo:
    """The one candidate meaning every trial agrees with, else CannotReplay (see :func:`_row_meaning`);
    a mask that is none of the row meanings may still be causal within packed sequences
    (:func:`_sequence_meaning`)."""
    try:
        return _row_meaning(attn, mask, inputs, trials)
    except CannotReplay as refusal:
        info = _sequence_meaning(attn, mask, inputs, trials)
        if info is not None:
            return info
        biased = next((t for t in trials if _biases_later_keys(t.visible(mask, attn), t.bias(mask, attn))), None)
        if biased is not None:
            raise CannotReplay(Code.MASK_FLOAT_BIAS, float_bias_reason(evaluate(mask, biased.values, biased.literal),
                                                 biased.visible(mask, attn), "where a causal mask blocks (through "
                                                 "them a query sees the keys after it)"), attn) from refusal
        if any(_sees_later_keys(t.visible(mask, attn)) for t in trials):
            raise CannotReplay(Code.MASK_NOT_CAUSAL,
                               "attention mask lets a query see keys after it (bidirectional attention: an encoder, "
                               "a masked LM such as XLM with causal=False, or a prefix-LM's prompt); a token's value "
                               "must depend on its prefix only for the prefix tree to share it", attn) from refusal
        x = _followed_input(attn, mask, inputs, trials, _Trial.visible)
        if x is not None:
            raise CannotReplay(Code.MASK_FROM_VALUES,
                               f"attention mask computed from the values of {x.name}: which keys a query sees "
                               "depends on the tokens (a content-dependent sparse mask, e.g. a top-k selection of "
                               "keys by a learned index, DeepSeek sparse attention's indexer, with fewer picks than "
                               "keys); tree attention's keys are the causal ones, by position and padding only",
                               attn) from refusal
        raise refusal


def _biases_later_keys(vis: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether a float mask's finite nonzero values (``bias``, :func:`split_bias`) are what shows some query a key
    after it: a value above :data:`BLOCKING` where a causal mask blocks (``masked_fill(~causal, -5)``)."""
    if bias is None or vis.dim() < 2:
        return False
    L = vis.shape[-1]
    later = torch.ones(L, L, dtype=torch.bool, device=vis.device).triu(1)
    try:
        v, b = torch.broadcast_tensors(vis, bias.to(vis.device))
    except RuntimeError:
        return False
    return v.shape[-2] == L and bool((v & (b != 0) & later).any())


def _sees_later_keys(vis: torch.Tensor) -> bool:
    """Whether a boolean visibility ``[..., Lq | 1, Lk]`` (a query row broadcast over the queries: a key-padding
    mask alone) shows some query ``i`` a key ``j > i``."""
    if vis.dim() < 2:
        return False
    L = vis.shape[-1]
    if vis.shape[-2] == 1:
        vis = vis.expand(*vis.shape[:-2], L, L)
    return vis.shape[-2] == L and bool(torch.triu(vis, diagonal=1).any())


def _row_meaning(attn: fx.Node, mask: fx.Node, inputs: Sequence[fx.Node], trials: Sequence[_Trial]) -> MaskInfo:
    """The one row candidate (causal, key padding, window) every trial agrees with, else CannotReplay. The
    window is read off the trials without key padding (``_Trial.unpadded``); they must all show the same one."""
    evaluated = [(t, t.visible(mask, attn)) for t in trials]
    windows = {w for t, m in evaluated if t.unpadded for w in [sliding_window(m, attn)] if w is not None}
    if len(windows) > 1:
        raise CannotReplay(Code.MASK_UNPROVEN,
                           f"attention mask shows different sliding windows {sorted(windows)} at different probe "
                           "sizes (a window that depends on the batch size or length)", attn)
    for window in sorted(windows) + [0]:
        for cand in [None] + list(inputs):
            if all(_matches(m, cand, t.values, window) for t, m in evaluated):
                return MaskInfo("causal" if cand is None else "causal+keypad", cand, window)
    raise CannotReplay(Code.MASK_NOT_CAUSAL,
                       "attention mask is neither causal nor causal & key padding from a token input, "
                       "optionally with a sliding window (prefix-LM and bias masks are not supported)", attn)


def alibi_meaning(attn: fx.Node, mask: fx.Node, info: MaskInfo, inputs: Sequence[fx.Node],
                  trials: Sequence[_Trial], values: dict) -> MaskInfo:
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
        x = _followed_input(attn, mask, inputs, trials)
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


def _alibi_counts(info: MaskInfo, inputs: Sequence[fx.Node], trials: Sequence[_Trial]) -> list:
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
                     trials: Sequence[_Trial], node: fx.Node, hq: int) -> Optional[MaskInfo]:
    """``info`` with ALiBi slopes ``node`` (module docstring: trainable ALiBi slopes), or None when the bias is not
    ``node[h] * pos[b, k]`` up to a per-query shift on every trial, and on the longest trial without padding with
    ``node``'s value replaced by random numbers."""
    unpadded = [t for t in trials if t.unpadded]
    if not unpadded:
        return None
    t0 = max(unpadded, key=lambda t: t.size[1])
    like = evaluate(node, t0.values, t0.literal)
    fresh = probe.normal(like.shape, probe.generator(1), like=like)
    substituted = _Trial({**t0.values, node: fresh}, t0.literal, t0.size, t0.unpadded)
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


def _followed_input(attn: fx.Node, mask: fx.Node, inputs: Sequence[fx.Node], trials: Sequence[_Trial],
                    read: Callable = _Trial.bias) -> Optional[fx.Node]:
    """The [B, L] tree input, not 0/1 (token ids), whose values the mask's bias (or, with ``read`` =
    ``_Trial.visible``, its visibility) follows, else None: on a trial, that input alone reversed along the
    length (the same values and sizes in another order; the 0/1 inputs, hence the padding and the ALiBi
    positions, stay), the bias re-evaluated and compared. A bias (a visibility) that is a function of the
    positions and the padding alone is unchanged. Both evaluations see the trainable
    tensors perturbed (:func:`_perturbed_parameters`): at its initial values a learned bias may not show what
    it follows (Doge's ``exp(A * ...)`` with ``A = 0`` is 1 everywhere)."""
    params = _perturbed_parameters(mask, trials[0].values) if trials else {}
    for x in inputs:
        for t in trials:
            v = t.values.get(x)
            if not isinstance(v, torch.Tensor) or v.dim() != 2 or _binary(v) or torch.equal(v.flip(-1), v):
                continue
            base = {**t.values, **params}
            a = read(_Trial(base, t.literal, t.size, t.unpadded), mask, attn)
            b = read(_Trial({**base, x: v.flip(-1)}, t.literal, t.size, t.unpadded), mask, attn)
            if (a is None) != (b is None) or (a is not None and (a.shape != b.shape or not torch.equal(a, b))):
                return x
            break
    return None


def _perturbed_parameters(mask: fx.Node, values: dict, free: Sequence[fx.Node] = ()) -> dict:
    """Every trainable floating placeholder of the mask's subgraph (not behind a ``free`` node), plus a fixed
    pseudo-random offset (seeded, 0.25 * N(0, 1)): generic values for the probes of :func:`_followed_input`."""
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
    return isinstance(x, torch.Tensor) and x.dim() == 2 and _binary(x)


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """A mask or bias as [B | 1, H | 1, Lq, Lk]."""
    while t.dim() < 4:
        t = t.unsqueeze(0)
    return t


def _alibi_positions(t: _Trial, count: Optional[fx.Node]) -> torch.Tensor:
    """[B' | 1, Lk] ALiBi key positions on trial ``t``: the columns, or the running count of X != 0."""
    Lp = t.size[1]
    if count is None:
        return torch.arange(Lp, dtype=torch.float64)[None, :]
    return (t.values[count] != 0).cumsum(-1).to(torch.float64).cpu()


def _alibi_slopes(attn: fx.Node, mask: fx.Node, trials: Sequence[_Trial], hq: Optional[int]) -> Optional[list]:
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


#: Start probabilities of the well-formed position-id patterns of :func:`_sequence_meaning` (0: one sequence
#: per row; 1: every token its own sequence).
SEQUENCE_PATTERNS = (0.0, 0.15, 0.4, 1.0)


def _sequence_meaning(attn: fx.Node, mask: fx.Node, inputs: Sequence[fx.Node],
                      trials: Sequence[_Trial]) -> Optional[MaskInfo]:
    """``causal+sequences(P)`` for the first integer tree input P for which the mask is causal within the
    sequences that P's 0s start, on every trial size with P replaced by well-formed position ids
    (:data:`SEQUENCE_PATTERNS`, the other inputs as in the trial: key padding there must not change it);
    None when there is none. Well-formed P is all the runtime replays (:func:`sequences_guard`)."""
    gen = probe.generator(1)
    for P in inputs:
        dtype = getattr(trials[0].values[P], "dtype", None) if trials else None
        if dtype is None or dtype.is_floating_point or dtype == torch.bool:
            continue
        ok = True
        for t in trials:
            Bp, Lp = t.size
            for p_start in SEQUENCE_PATTERNS:
                values = dict(t.values)
                pos = sequence_positions(Bp, Lp, p_start, gen)
                values[P] = pos.to(device=t.values[P].device, dtype=dtype)
                try:
                    vis = split_bias(evaluate(mask, values, t.literal), attn)[0]
                except CannotReplay:
                    raise
                except Exception:  # evaluable on the trial's values, not on these: not this meaning
                    log.debug("mask of %s: cannot be evaluated on packed-sequence positions", attn.name, exc_info=True)
                    ok = False
                    break
                if not _matches_sequences(vis, pos):
                    ok = False
                    break
            if not ok:
                break
        if ok and trials:
            return MaskInfo("causal+sequences", sequences=P)
    return None


def _matches_sequences(vis: torch.Tensor, pos: torch.Tensor) -> bool:
    """``vis`` [.., B, .., L, L] is exactly "j <= i within the sequence of (b, i)", sequences started by
    the 0s of ``pos`` [B, L]."""
    if vis.dim() < 2 or vis.shape[-1] != vis.shape[-2] or vis.shape[-1] != pos.shape[1]:
        return False
    L = pos.shape[1]
    seq = (pos == 0).cumsum(dim=1).to(vis.device)  # [B, L]
    causal = torch.ones(L, L, dtype=torch.bool, device=vis.device).tril()
    expected = causal[None, None] & (seq[:, None, :, None] == seq[:, None, None, :])  # [B, 1, L, L]
    try:
        a, b = torch.broadcast_tensors(vis, expected)
    except RuntimeError:
        return False
    return bool((a == b).all())


def sequences_guard(info: MaskInfo, placeholders: Sequence[fx.Node]):
    """The per-call guard of a ``causal+sequences(P)`` mask: P splits every row into well-formed sequences
    (and their virtual layout is not too uneven): :func:`brcompile.runtime.tree.sequence_layout_problem`."""
    from brcompile.passes.analysis.guards import BatchGuard  # local: guards has no pass dependencies
    from brcompile.runtime.tree import sequence_layout_problem

    pos = placeholders.index(info.sequences)

    def check(args):
        return sequence_layout_problem(args[pos])

    return BatchGuard(f"{info.sequences.name} (input {pos}) splits the rows into packed sequences", check,
                      code=Code.GUARD_SEQUENCES)


def meaning_guard(attn: fx.Node, mask: fx.Node, info: MaskInfo, tree_inputs: Sequence[fx.Node],
                  placeholders: Sequence[fx.Node], values: dict[fx.Node, object]):
    """A per-call guard for a mask of a dynamic-length graph whose meaning is proven only up to
    ``info.max_length``, or None. O(1): it reads the length of a tree input."""
    from brcompile.passes.analysis.guards import BatchGuard  # local: guards has no pass dependencies

    if info.max_length is None:
        return None
    pos = placeholders.index(tree_inputs[0])
    limit = info.max_length

    def check(args):
        L = args[pos].shape[-1]
        if L > limit:
            return (f"the mask of {attn.name} is {info}: a constant of its subgraph is too large to probe, so its "
                    f"meaning at length {L} is not proven")
        return None

    return BatchGuard(f"mask of {attn.name} proven for lengths <= {limit} (input {pos})", check,
                      code=Code.GUARD_MASK_LENGTH)


def _matches(mask: torch.Tensor, cand: Optional[fx.Node], values, window: int = 0) -> bool:
    """``mask`` (bool or additive) is exactly causal [& key padding by ``values[cand]``] [& window]."""
    vis = mask if mask.dtype == torch.bool else (mask == 0)
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


__all__ = ["MaskInfo", "alibi_meaning", "classify", "split_bias", "mask_only_nodes", "ancestors", "evaluate", "visible", "sliding_window",
           "meaning_guard", "sequences_guard", "sequence_positions", "Scaling", "MAX_PROBE_ELEMENTS"]
