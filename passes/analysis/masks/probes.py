"""Probe sizes and values for a mask: the sizes a mask subgraph scales with (:class:`Scaling`), the probe lengths
and rows, the values of its inputs at those sizes (:class:`Probes`, one evaluation each: :class:`Trial`)."""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.fx as fx

from brcompile.passes import probe
from brcompile.passes.analysis.axes import example_value, is_static_input
from brcompile.passes.meta import RELBIAS_SOURCE
from brcompile.passes.analysis.masks.values import (
    BASE_LENGTHS, LENGTH_SLACK, MAX_PROBE_ELEMENTS, SMALL_SIZE, evaluate, finite_blocking, int_literals, split_bias,
)


def is_symbolic(s) -> bool:
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
    if not is_symbolic(size):
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
        b_dyn, l_dyn = is_symbolic(shape[0]), is_symbolic(shape[1])
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
class Trial:
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


def binary(x: torch.Tensor) -> bool:
    return bool(((x == 0) | (x == 1)).all())


def _probe_value(x: torch.Tensor, binary: bool, B: int, L: int, gen: torch.Generator, pattern: int) -> torch.Tensor:
    """A [B, L] value typed like tree input ``x``: for 0/1 inputs the key-padding ``pattern`` of
    :func:`.probe.padding` (0 all ones, 1 left padding of random lengths, 2 right padding, 3 random 0/1); other
    inputs get random values in ``x``'s range (:func:`.probe.in_range`: never past it)."""
    if binary:
        return probe.padding(B, L, pattern, gen).to(device=x.device, dtype=x.dtype)
    return probe.in_range(x, (B, L), gen)


class Probes:
    """Builds the trials of one mask (see the module docstring)."""

    def __init__(self, inputs: Sequence[fx.Node], values: dict, scaling: Scaling, perturbed: Optional[dict] = None,
                 free: Sequence[fx.Node] = ()):
        self.inputs, self.values, self.sc = list(inputs), values, scaling
        self.perturbed = perturbed or {}  # trainable tensors at generic values, for the probes (not the example)
        self.free = list(free)  # nodes given random values (:func:`free_values`)
        self.binary = {t: binary(values[t]) for t in self.inputs}
        self.gen = probe.generator(0)

    def trials(self, Bp: int, Lp: int, patterns: Iterable[int]) -> list[Trial]:
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
            out.append(Trial(v, lit, (Bp, Lp), pat == 0))
        return out

    def example_trials(self) -> list[Trial]:
        """The example batch itself and four probes of its shape (only where it is small)."""
        B, L = self.sc.B, self.sc.L
        ones = all(bool((self.values[t] == 1).all()) for t in self.inputs if self.binary[t])
        example = {**self.values, **free_values(self.free, B, L, self.gen)}
        return [Trial(example, None, (B, L), ones)] + self.trials(B, L, range(4))


def probe_lengths(sc: Scaling, literals: set[int]) -> tuple[list[int], list[int]]:
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


def size_constants(anc: Sequence[fx.Node], values: dict, sc: Scaling) -> set[int]:
    """Int literals of the subgraph's ops and the sizes of the static tensors it reads (buffers such as a
    [T, T] tril): the lengths at which its meaning may change."""
    consts = int_literals(anc)
    for n in anc:
        v = values.get(n) if n.op == "placeholder" else None
        if isinstance(v, torch.Tensor) and is_static_input(n):
            consts |= {int(s) for s in v.shape}
        elif n.op == "placeholder" and isinstance(v, int) and not isinstance(v, bool) \
                and n not in dict(sc.sym_nodes):
            consts.add(int(v))
    return consts
