"""Routed pairs: experts that run after a routing graph break compute each shared token's (token, expert) pairs once.

A sort-based MoE dispatch that calls ``.tolist()`` on its per-expert counts (JetMoE's ``expert_size``) breaks
the Dynamo graph there. The graph after the break receives the flattened tokens ``x [T, ...]``, the routing
order as an integer input ``idx [S]`` (the token of each (token, expert) *pair*, sorted by expert), per-pair
inputs such as the gates ``g [S]``, and the per-expert counts baked in as constants::

    y   = x[idx]                                   # the pairs' rows, grouped by expert
    y_e = split(y, sizes)[e] @ W_e ...             # each expert on its group
    out = zeros(T·m, ...).index_add(0, idx2, cat(y_e) * g[:, None])   # back to the tokens (m entries each)

Nothing here can be packed by the token-axis analysis: the rows of ``y`` are named by a per-batch index, and
the group sizes are those of this batch. But every pair row is a function of its own row alone: of
``x[idx[p]]``, of the per-pair inputs at ``p`` and of its group ``e(p)`` (the ops between the gather and the
scatter are *pair-local*: :func:`analyse_routed` checks each one). Tokens whose rows of ``x`` agree bitwise
— copies of a shared prefix token, routed alike — therefore have pairs with equal values, and the sum that
``index_add`` forms for one copy is the sum it forms for every other. So the graph may run on the pairs of one
representative token per group of copies, with the group sizes of those pairs, and every other token's row of
``out`` is read from its representative's (``out[rep_rows]``). The rewritten graph takes the sizes and
``rep_rows`` as inputs; the run time (``brcompile/runtime/routed.py``) checks per call that the copies were
routed alike (same experts, same slots, bitwise equal per-pair inputs) and otherwise runs the original graph.

Gradients follow the packed graphs' convention: the representative's row of ``x`` (and its pairs' per-pair
inputs) receives the sum of its copies' gradients, the copies none; upstream parameters receive the original
gradient because the copies are the same function of them.

:func:`analyse_routed` raises ``CannotReplay`` naming the node when the graph leaves this shape: an op on the
pairs without a pair-local rule, a pair value that leaves the graph, a scatter into anything but fresh
zeros, or a size of this batch's pairs baked in elsewhere (found by running the rewritten graph on fake
tensors with other group sizes).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from brcompile.passes.analysis.axes import example_value, hint, node_args
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.passes.ops import RuleCollision, record_for
from brcompile.passes.spellings import GATHER_NAMES, arg, copy_graph_module, family_of, op_name

log = logging.getLogger(__name__)

__all__ = ["RoutedPlan", "analyse_routed", "find_routed_gather"]


@dataclasses.dataclass(frozen=True)
class Pair:
    """The fact of a value laid out along the pairs at dim 0: all of them (``group`` None, sorted by
    expert) or one expert's group of them (``group`` e: ``split(y, sizes)[e]``)."""

    group: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class PairTuple:
    """A tuple of pair values (``split``/``chunk`` of a pair value): the fact of each item."""

    items: tuple


@dataclasses.dataclass(frozen=True)
class Scatter:
    """One ``zeros(T·m, ...).index_add(0, idx2, pairs)``: the pairs back onto ``m`` entries per token."""

    node: str
    index_pos: int  # argument position of idx2 (the entry each pair lands on)
    per_token: int  # m: entry r belongs to token r // m


@dataclasses.dataclass
class RoutedPlan:
    """What the run time needs to run a routed graph on the representatives' pairs."""

    gm: fx.GraphModule  # the rewritten graph: the original inputs, then ``sizes`` and one ``rep_rows`` per scatter
    tokens_pos: int  # argument position of the flattened tokens the pairs gather (x)
    tokens: int  # T: rows of x
    index_pos: int  # argument position of the routing order idx [S] (each pair's token)
    sizes: tuple  # the example's pairs per expert (the split sizes Dynamo baked in or made inputs)
    size_positions: tuple  # per expert: the argument position of its count when it is a graph input, else None
    row_numel: int  # elements per token row of x (x is args[tokens_pos] viewed [T, row_numel])
    pair_inputs: tuple  # argument positions of the per-pair inputs ([S, ...], such as the gates)
    scatters: tuple  # Scatter per index_add back onto the tokens
    pair_nodes: int  # how many nodes compute on pairs (explain)

    def describe(self) -> dict:
        return dict(tokens=self.tokens, pairs=int(sum(self.sizes)), experts=len(self.sizes),
                    counts_as_inputs=sum(p is not None for p in self.size_positions),
                    pair_inputs=list(self.pair_inputs), scatters=[s.node for s in self.scatters],
                    pair_nodes=self.pair_nodes, routed_code=self.gm.code)


# --------------------------------------------------------------------------------------------------
# finding the pattern

def _is_int_placeholder(n: Any) -> bool:
    v = example_value(n)
    return isinstance(n, fx.Node) and n.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim() == 1 \
        and not v.is_floating_point() and not v.is_complex() and v.dtype != torch.bool


def _gathered(n: fx.Node) -> Optional[tuple]:
    """(x, idx) when ``n`` gathers rows of a float value by a 1-D integer graph input: ``x[idx]`` or
    ``x.index_select(0, idx)``; else None."""
    if n.op not in ("call_function", "call_method") or op_name(n) not in GATHER_NAMES or len(n.args) < 2:
        return None
    if op_name(n) == "getitem":
        x, idx = n.args[0], n.args[1]
    else:
        if len(n.args) < 3 or n.args[1] != 0:
            return None
        x, idx = n.args[0], n.args[2]
    v = example_value(x)
    if not _is_int_placeholder(idx) or not isinstance(v, torch.Tensor) or not v.is_floating_point():
        return None
    return x, idx


def find_routed_gather(gm: fx.GraphModule) -> Optional[fx.Node]:
    """The node gathering flattened tokens by a routing order made outside the graph, when the graph also
    scatters back with ``index_add`` (the shape of a MoE after a routing graph break); else None."""
    nodes = list(gm.graph.nodes)
    if not any(n.op in ("call_function", "call_method") and op_name(n) == "index_add" for n in nodes):
        return None
    return next((n for n in nodes if _gathered(n) is not None), None)


def _token_source(x: fx.Node) -> fx.Node:
    """The graph input whose rows ``x`` is: x itself, or a chain of reshapes of it (``h.reshape(-1, D)``)."""
    n = x
    while n.op != "placeholder":
        if family_of(n) != "reshape" or not isinstance(n.args[0], fx.Node):
            raise CannotReplay(Code.ROUTED_SHAPE,
                               "routed pairs gather rows of a value computed in the graph (only graph inputs "
                               "and reshapes of them are supported)", x)
        n = n.args[0]
    return n


# --------------------------------------------------------------------------------------------------
# pair-local rules

def _name(n: fx.Node) -> str:
    return family_of(n) or op_name(n)


@dataclasses.dataclass(frozen=True)
class _PairRule:
    """How one op propagates the pair fact. ``fn(prop, n)``, or with ``shared=True`` ``fn(prop, n, fact)`` where
    ``fact`` is the one :class:`Pair` fact of ``n``'s pair operands (checked first: an op on pairs of different
    groups is refused before any rule reads it). ``scatter``: the rule may read a scatter index (index_add)."""

    name: str
    fn: Any
    shared: bool = True
    scatter: bool = False


#: the pair-local rules by name (a method ``_<name>`` of :class:`_Propagation`); an op's record (passes/ops/,
#: ``register_op(..., pair=name)``) says which rule its spellings use
_PAIR_RULES: dict[str, _PairRule] = {}


def _pair_rule(*, shared: bool = True, scatter: bool = False, override: bool = False):
    """Decorator: register a :class:`_Propagation` method ``_<name>`` as the pair-local rule ``name``. A name has
    one rule: a second one raises :class:`RuleCollision` unless ``override=True``."""

    def deco(fn):
        rule = _PairRule(fn.__name__.lstrip("_"), fn, shared, scatter)
        if rule.name in _PAIR_RULES and not override:
            raise RuleCollision(f"a pair rule named {rule.name!r} is already registered; pass override=True to "
                                f"replace it")
        _PAIR_RULES[rule.name] = rule
        return fn

    return deco


def _pair_rule_for(n: fx.Node) -> Optional[_PairRule]:
    """The pair rule of ``n``: the one its op record names (None: not pair-local)."""
    record = record_for(n.target)
    return None if record is None or record.pair is None else _PAIR_RULES[record.pair]


def _norm_dim(d: Any, ndim: int) -> Optional[int]:
    return d % ndim if isinstance(d, int) and ndim > 0 else None


def _dims_arg(n: fx.Node) -> Any:
    if "dim" in n.kwargs:
        return n.kwargs["dim"]
    return n.args[1] if len(n.args) > 1 else None


class _Propagation:
    """Forward walk over a routed graph: the pair fact of every value computed from the gathered pairs."""

    def __init__(self, gm: fx.GraphModule, gather: fx.Node):
        self.gm = gm
        self.gather = gather
        x, idx = _gathered(gather)
        self.x, self.idx = x, idx
        self.S = hint(example_value(gather).shape[0])
        self.facts: dict[fx.Node, Any] = {gather: Pair()}
        self.sizes: Optional[tuple] = None
        self.splits: list[fx.Node] = []
        self.scatters: list[tuple[fx.Node, fx.Node, int]] = []  # (index_add node, idx2 placeholder, m)
        self.pair_inputs: list[fx.Node] = []
        self.index_uses: set = set()  # int placeholders used as scatter indices (idx2)

    def fail(self, n: fx.Node, why: str):
        raise CannotReplay(Code.ROUTED_NOT_PAIR_LOCAL, f"routed pairs: {why}", n)

    def run(self) -> None:
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        for p in placeholders:
            v = example_value(p)
            if p in (self.x, self.idx) or isinstance(v, torch.nn.Parameter) or not isinstance(v, torch.Tensor):
                continue
            if v.dim() >= 1 and hint(v.shape[0]) == self.S:
                self.facts[p] = Pair()
                self.pair_inputs.append(p)
        for n in self.gm.graph.nodes:
            if n.op in ("placeholder", "get_attr") or n is self.gather:
                continue
            if n.op == "output":
                for a in _flat_nodes(n.args):
                    if a in self.facts:
                        self.fail(a, "a value per pair is an output of the graph (its rows are this batch's pairs)")
                continue
            operands = node_args(n)
            if self.idx in operands and not self._scatter_index_use(n, self.idx):
                self.fail(n, "the routing order is used otherwise than to gather and scatter the pairs")
            if not any(a in self.facts for a in operands):
                continue
            if n.op not in ("call_function", "call_method"):
                self.fail(n, f"a {n.op} reads values per pair")
            fact = self._rule(n)
            if fact is not None:
                self.facts[n] = fact
        if not self.scatters:
            raise CannotReplay(Code.ROUTED_SHAPE,
                               "routed pairs: the pairs are never scattered back onto the tokens (index_add)",
                               self.gather)
        if self.sizes is None:
            raise CannotReplay(Code.ROUTED_SHAPE,
                               "routed pairs: the pairs are not split into groups (no split by the per-expert "
                               "counts)", self.gather)

    def _scatter_index_use(self, n: fx.Node, idx: fx.Node) -> bool:
        return n is self.gather or (op_name(n) == "index_add" and len(n.args) > 2 and n.args[2] is idx
                                    and sum(a is idx for a in node_args(n)) == 1)

    def _rule(self, n: fx.Node) -> Any:
        """The pair fact of ``n`` by its pair rule (:data:`_PAIR_RULES`, by the op's record);
        an op without one is refused."""
        rule = _pair_rule_for(n)
        if not (rule is not None and rule.scatter) and any(a in self.index_uses for a in node_args(n)):
            self.fail(n, "a scatter index is used otherwise than by its index_add")
        if rule is not None and not rule.shared:
            return rule.fn(self, n)
        fact = self._same_fact(n)
        if rule is None:
            self.fail(n, f"{_name(n)} on values per pair has no pair-local rule")
        return rule.fn(self, n, fact)

    @_pair_rule(shared=False)
    def _getitem(self, n: fx.Node) -> Any:
        """An item of a tuple of pair groups (a split's output), else an index into a pair value (a view)."""
        if isinstance(self.facts.get(n.args[0]), PairTuple):
            items = self.facts[n.args[0]].items
            return items[n.args[1]] if isinstance(n.args[1], int) else self.fail(n, "slicing a tuple of pairs")
        return self._layout(n, self._same_fact(n))

    @_pair_rule()
    def _pointwise(self, n: fx.Node, fact: Any) -> Any:
        """Elementwise: each pair's row of the output reads that pair's rows and values the same for all pairs."""
        self._check_broadcast(n, example_value(n))
        return fact

    @_pair_rule()
    def _linear(self, n: fx.Node, fact: Any) -> Any:
        """``linear(x, W, b)`` acts on each row of x alone, when W and b are no pair values."""
        if n.args[0] not in self.facts or any(a in self.facts for a in _flat_nodes((n.args[1:], n.kwargs))):
            self.fail(n, "linear with a weight that is a value per pair")
        return fact

    @_pair_rule()
    def _matmul(self, n: fx.Node, fact: Any) -> Any:
        """``x @ W`` with x's pairs at dim 0 (at least 2-D) and W a matrix that is no pair value: row by row."""
        w = example_value(n.args[1])
        if n.args[0] not in self.facts or n.args[1] in self.facts or not isinstance(w, torch.Tensor) \
                or w.dim() > 2 or example_value(n.args[0]).dim() < 2:
            self.fail(n, "a matrix product that mixes pairs")
        return fact

    @_pair_rule()
    def _norm(self, n: fx.Node, fact: Any) -> Any:
        """A normalisation over trailing dims only (not the pair dim), its weights no pair values."""
        shape = n.args[1] if len(n.args) > 1 else n.kwargs.get("normalized_shape")
        if n.args[0] not in self.facts or len(shape) >= example_value(n.args[0]).dim() or \
                any(a in self.facts for a in _flat_nodes((n.args[1:], n.kwargs))):
            self.fail(n, f"{_name(n)} over the pair dim")
        return fact

    def _same_fact(self, n: fx.Node) -> Any:
        facts = {self.facts[a] for a in node_args(n) if a in self.facts}
        if len(facts) != 1 or not isinstance(next(iter(facts)), Pair):
            self.fail(n, "an op mixes different groups of pairs")
        return next(iter(facts))

    def _check_broadcast(self, n: fx.Node, out: Any) -> None:
        """Every operand that is no pair value must be the same for every pair: no dim of its own at dim 0."""
        if not isinstance(out, torch.Tensor):
            self.fail(n, "an op on pairs that returns no tensor")
        for a in node_args(n):
            v = example_value(a)
            if a in self.facts or not isinstance(v, torch.Tensor):
                continue
            if v.dim() == out.dim() and hint(v.shape[0]) != 1:
                self.fail(n, f"{a.name} has a dim of its own along the pairs but is no pair value")

    @_pair_rule()
    def _along_dims(self, n: fx.Node, fact: Any) -> Any:
        x = example_value(n.args[0])
        dims = _dims_arg(n)
        dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
        if n.args[0] not in self.facts or any(d is None for d in dims) or \
                any(_norm_dim(d, x.dim()) in (None, 0) for d in dims):
            self.fail(n, f"{_name(n)} over the pair dim (it would mix pairs)")
        return fact

    @_pair_rule()
    def _layout(self, n: fx.Node, fact: Any) -> Any:
        if n.args[0] not in self.facts:
            self.fail(n, "a pair value used as an index")
        x, out = example_value(n.args[0]), example_value(n)
        if not isinstance(out, torch.Tensor) or out.dim() == 0 or hint(out.shape[0]) != hint(x.shape[0]):
            self.fail(n, "a view that does not keep the pairs at dim 0")
        name = _name(n)
        if name == "getitem":
            idx = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
            used = [e for e in idx if e is not None and e is not Ellipsis]
            keeps = idx[0] == slice(None) or (idx[0] is Ellipsis and len(used) < x.dim())
            if not idx or not keeps or _flat_nodes(idx):
                self.fail(n, "indexing along the pairs")
        if name == "transpose" and 0 in (_norm_dim(n.args[1], x.dim()), _norm_dim(n.args[2], x.dim())):
            self.fail(n, "a transpose of the pair dim")
        if name == "permute":
            perm = n.args[1] if isinstance(n.args[1], (list, tuple)) else n.args[1:]
            if _norm_dim(perm[0], x.dim()) != 0:
                self.fail(n, "a permute of the pair dim")
        if name in ("unsqueeze", "squeeze") and len(n.args) > 1 and _norm_dim(n.args[1], out.dim() if name ==
                                                                               "unsqueeze" else x.dim()) == 0:
            self.fail(n, f"{name} at the pair dim")
        if name == "reshape" and x.dim() >= 1:
            rest_in = x[0].numel() if hint(x.shape[0]) else None
            rest_out = out[0].numel() if hint(out.shape[0]) else None
            if rest_in != rest_out:
                self.fail(n, "a reshape that moves elements between pairs")
        return fact

    @_pair_rule()
    def _split(self, n: fx.Node, fact: Any) -> Any:
        x = example_value(n.args[0])
        name = _name(n)
        dim = arg(n, 2, "dim", 0)
        if name == "unbind":
            dim = arg(n, 1, "dim", 0)
        outs = example_value(n)
        if n.args[0] not in self.facts or not isinstance(outs, (tuple, list)):
            self.fail(n, f"{name} with values per pair as sizes")
        if _norm_dim(dim, x.dim()) != 0:
            return PairTuple(tuple(fact for _ in outs))
        sizes = n.args[1] if len(n.args) > 1 else n.kwargs.get("split_size", n.kwargs.get("split_size_or_sections"))
        if name != "split" and name != "split_with_sizes" or not isinstance(sizes, (list, tuple)) or \
                not all(isinstance(s, int) or self._size_input(s) for s in sizes) or fact != Pair():
            self.fail(n, f"{name} along the pairs other than into the groups of a per-expert count list")
        if self.sizes is None:
            self.sizes = tuple(sizes)
        if tuple(sizes) != self.sizes or sum(hint(example_value(s)) for s in sizes) != self.S:
            self.fail(n, "splits of the pairs into different groups")
        self.splits.append(n)
        return PairTuple(tuple(Pair(e) for e in range(len(sizes))))

    def _size_input(self, s: Any) -> bool:
        """A per-expert count that Dynamo made a graph input (an int it saw change between calls); it may
        feed the splits only."""
        if not (isinstance(s, fx.Node) and s.op == "placeholder" and isinstance(example_value(s), (int, torch.SymInt))):
            return False
        if any(u not in self.splits and op_name(u) not in ("split", "split_with_sizes") for u in s.users):
            self.fail(s, "a per-expert count is used otherwise than to split the pairs")
        return True

    @_pair_rule(shared=False)
    def _cat(self, n: fx.Node) -> Any:
        items = n.args[0] if n.args else n.kwargs.get("tensors")
        dim = arg(n, 1, "dim", 0)
        facts = [self.facts.get(a) for a in items]
        x = example_value(items[0])
        if _norm_dim(dim, x.dim()) != 0:
            if len(set(facts)) != 1 or facts[0] is None:
                self.fail(n, "cat of pair values with other values")
            return facts[0]
        if self.sizes is None or facts != [Pair(e) for e in range(len(self.sizes))]:
            self.fail(n, "cat along the pairs of anything but every group in order")
        return Pair()

    @_pair_rule(shared=False, scatter=True)
    def _index_add(self, n: fx.Node) -> Any:
        target, dim, index, src = (list(n.args) + [None] * 4)[:4]
        if dim != 0 or n.kwargs or self.facts.get(src) != Pair() or target in self.facts or \
                not _is_int_placeholder(index) or hint(example_value(index).shape[0]) != self.S:
            self.fail(n, "index_add of pair values other than all pairs onto dim 0 by a routing index")
        if not (isinstance(target, fx.Node) and op_name(target) in ("zeros", "new_zeros", "zeros_like")
                and len(target.users) == 1):
            self.fail(n, "pairs scattered onto a value that is not fresh zeros")
        tokens = hint(example_value(self.x).shape[0])
        rows = hint(example_value(n).shape[0])
        if rows % tokens:
            self.fail(n, f"pairs scattered onto {rows} rows, not a multiple of the {tokens} tokens")
        if index is not self.idx:
            if index in self.pair_inputs:
                self.pair_inputs.remove(index)
                del self.facts[index]
            self.index_uses.add(index)
        self.scatters.append((n, index, rows // tokens))
        return None


def _flat_nodes(x: Any) -> list:
    out: list = []
    fx.node.map_arg(x, lambda a: out.append(a))
    return out


# --------------------------------------------------------------------------------------------------
# the rewrite


def analyse_routed(gm: fx.GraphModule, example_inputs: Sequence[Any],
                   gather: Optional[fx.Node] = None) -> RoutedPlan:
    """The routed plan of ``gm`` (module docstring), or ``CannotReplay`` naming the construct; ``gather``:
    :func:`find_routed_gather`'s node when the caller has it."""
    gather = gather or find_routed_gather(gm)
    if gather is None:
        raise CannotReplay(Code.ROUTED_SHAPE,
                           "routed pairs: no gather of flattened tokens by a routing index with an index_add back")
    prop = _Propagation(gm, gather)
    prop.run()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    at = {p: i for i, p in enumerate(placeholders)}
    source = _token_source(prop.x)
    tokens = hint(example_value(prop.x).shape[0])
    env: dict = {}
    new = copy_graph_module(gm, env)
    g = new.graph
    last = env[placeholders[-1]]
    with g.inserting_after(last):
        sizes_ph = g.placeholder("br_route_sizes")
    rows_phs = []
    prev = sizes_ph
    for i, _ in enumerate(prop.scatters):
        with g.inserting_after(prev):
            prev = g.placeholder(f"br_route_rows_{i}")
        rows_phs.append(prev)
    for s in prop.splits:
        ns = env[s]
        if len(ns.args) > 1:
            ns.args = (ns.args[0], sizes_ph, *ns.args[2:])
        else:
            kw = dict(ns.kwargs)
            kw["split_size" if "split_size" in kw else "split_size_or_sections"] = sizes_ph
            ns.kwargs = kw
    scatters = []
    for (n, index, m), rows in zip(prop.scatters, rows_phs):
        nn_ = env[n]
        with g.inserting_after(nn_):
            read = g.call_function(torch.index_select, (nn_, 0, rows))
        nn_.replace_all_uses_with(read, delete_user_cb=lambda u: u is not read)
        scatters.append(Scatter(n.name, at[index], m))
    g.lint()
    new.recompile()
    x = example_value(prop.x)
    plan = RoutedPlan(new, at[source], tokens, at[prop.idx],
                      tuple(hint(example_value(s)) for s in prop.sizes),
                      tuple(at[s] if isinstance(s, fx.Node) else None for s in prop.sizes),
                      hint(x[0].numel()) if hint(x.shape[0]) else 0,
                      tuple(at[p] for p in prop.pair_inputs), tuple(scatters), len(prop.facts))
    _check_other_sizes(gm, plan, example_inputs)
    log.debug("routed pairs: graph rewritten:\n%s", new.code)
    return plan


def _check_other_sizes(gm: fx.GraphModule, plan: RoutedPlan, example_inputs: Sequence[Any]) -> None:
    """Runs the rewritten graph on fake tensors whose pairs number one more per expert: it must run and return
    outputs of the original's shapes (a size of this batch's pairs baked in elsewhere fails here)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    sizes = [s + 1 for s in plan.sizes]
    S = sum(sizes)
    changed = {plan.index_pos, *plan.pair_inputs, *(s.index_pos for s in plan.scatters)}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with mode:
            args = []
            for i, a in enumerate(example_inputs):
                a = hint(a)
                if isinstance(a, torch.Tensor):
                    shape = (S, *a.shape[1:]) if i in changed else a.shape
                    args.append(torch.zeros(shape, dtype=a.dtype, device=a.device)
                                if i in changed else mode.from_tensor(a))
                else:
                    args.append(a)
            rows = [torch.zeros(plan.tokens * s.per_token, dtype=torch.long) for s in plan.scatters]
            with torch.no_grad():
                got = plan.gm(*args, sizes, *rows)
                want = gm(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                            for a in map(hint, example_inputs)])
    except Exception as e:
        raise CannotReplay(Code.ROUTED_COUNTS,
                           f"routed pairs: the graph does not run for other per-expert counts (a size of this "
                           f"batch's pairs is baked in): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    got_l, want_l = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
    if [tuple(t.shape) for t in got_l if isinstance(t, torch.Tensor)] != \
            [tuple(t.shape) for t in want_l if isinstance(t, torch.Tensor)]:
        raise CannotReplay(Code.ROUTED_COUNTS, "routed pairs: an output's shape depends on the per-expert counts")
