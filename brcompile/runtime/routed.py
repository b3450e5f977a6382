"""Per call of a routed graph (passes/emit/routed.py): the representatives' pairs only, or the original graph.

For the call's flattened tokens ``x [T, ...]`` the tree over rows (``build_tree`` of ``[T, 1, ...]`` keys)
names each token's representative ``rep[t]``: the first row bitwise equal to it. A pair ``p`` (of token
``idx[p]`` and expert ``e(p)``, ``e`` from the baked per-expert counts) is *kept* iff its token is a
representative. Before running only those, the call checks that every other pair has a kept twin: the pair of
``rep[idx[p]]`` with the same expert, landing on the same entry of its token (``idx2 % m``) and with bitwise
equal per-pair inputs, and that each token has as many pairs as its representative. Then the sets of pairs of
two copies correspond one to one and the graph's value for every copy's row is its representative's row. A
failed check runs the original graph (a fallback call with the reason).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch

from brcompile.codes import Code, Refusal, refusal
from brcompile.runtime.packed import CallRecord
from brcompile.runtime.stats import _record, record_original_call
from brcompile.runtime.tree import build_tree, row_keys
from brcompile.runtime.tree.build import position_words

log = logging.getLogger(__name__)

__all__ = ["RoutedRuntime"]

def _bits(v: torch.Tensor) -> torch.Tensor:
    """One row of integer words per pair, equal iff the pair's entries of ``v`` are bitwise equal (the tree's own
    per-position words, ``[S, 1, W]`` of a ``[S, …]`` input)."""
    v = torch.view_as_real(v) if v.is_complex() else v
    return position_words(v.reshape(v.shape[0], 1, -1))[:, 0]


class RoutedRuntime:
    """The callable for a routed graph: per call, the representatives' pairs (``plan.gm`` with their per-expert
    counts and ``rep_rows``) when the copies were routed alike, else the original graph."""

    def __init__(self, original: Callable, plan, strict: bool = False, max_calls_logged: int = 64):
        self.original = original
        self.plan = plan
        self.routed = plan.gm.forward
        self.strict = strict
        self.calls: list[CallRecord] = []
        self.max_calls_logged = max_calls_logged

    def _log_call(self, make: Callable[[], CallRecord]) -> None:
        """Keep the record ``make()`` builds, for the first ``max_calls_logged`` calls (built only then)."""
        if len(self.calls) < self.max_calls_logged:
            self.calls.append(make())

    def __call__(self, *args):
        prepared = self.prepare(args)
        if isinstance(prepared, Refusal):
            return self._original(args, prepared.code, prepared.detail)
        routed_args, st = prepared
        try:
            out = self.routed(*routed_args)
        except Exception as e:  # a case the compile-time checks missed: never worse than the original
            if self.strict:
                raise
            log.warning("branch_replay: the routed graph raised; running the original", exc_info=True)
            return self._original(args, Code.INTERNAL_ERROR,
                                  f"internal error running the routed graph: {type(e).__name__}: {e}")
        _record(replayed_calls=1, logical_tokens=st["logical_tokens"], executed_tokens=st["executed_tokens"])
        self._log_call(lambda: CallRecord(True, st, mode="routed"))
        return out

    def _original(self, args: Sequence[Any], code: Code, reason: str):
        """This call runs the original graph; the refusal (``code``, ``reason``) is counted and logged."""
        record_original_call(code, reason)
        self._log_call(lambda: CallRecord(False, None, reason, code=code))
        log.debug("branch_replay routed call falls back [%s]: %s", code, reason)
        return self.original(*args)

    def prepare(self, args: Sequence[Any]):
        """(the routed graph's arguments, call stats), or the :class:`Refusal` to run the original graph (code
        ``ROUTED_CALL``: this call's pairs break the routing the graph assumes)."""
        plan = self.plan
        x = args[plan.tokens_pos]
        idx = args[plan.index_pos]
        sizes_now = [int(args[p]) if p is not None else s for s, p in zip(plan.sizes, plan.size_positions)]
        if not isinstance(x, torch.Tensor) or not plan.row_numel or x.numel() % plan.row_numel \
                or not isinstance(idx, torch.Tensor) or idx.numel() != sum(sizes_now):
            return refusal(Code.ROUTED_CALL, "routed pairs: the call's tokens or pairs do not match the graph's")
        rows = x.detach().reshape(-1, plan.row_numel)
        T = rows.shape[0]
        tree = build_tree(row_keys([rows]))
        node = tree.index.reshape(-1)
        rep = tree.rep_row.index_select(0, node)  # each token's representative row
        E = len(plan.sizes)
        sizes = torch.tensor(sizes_now, device=idx.device)
        group = torch.repeat_interleave(torch.arange(E, device=idx.device), sizes)
        reason = self._check(args, idx, group, rep, node, tree.stats.executed_tokens, E, T)
        if isinstance(reason, str):
            return refusal(Code.ROUTED_CALL, reason)
        keep = reason
        kept_sizes = torch.bincount(group[keep], minlength=E).tolist()
        changed = {plan.index_pos: idx[keep], **{p: args[p][keep] for p in plan.pair_inputs},
                   **{s.index_pos: args[s.index_pos][keep] for s in plan.scatters}}
        routed_args = [changed.get(i, a) for i, a in enumerate(args)]
        routed_args.append(kept_sizes)
        for s in plan.scatters:
            r = torch.arange(T * s.per_token, device=idx.device)
            routed_args.append(rep.index_select(0, r // s.per_token) * s.per_token + r % s.per_token)
        st = dict(logical_tokens=T, executed_tokens=int(tree.stats.executed_tokens), pairs=int(idx.numel()),
                  executed_pairs=int(keep.numel()))
        return routed_args, st

    def _check(self, args, idx: torch.Tensor, group: torch.Tensor, rep: torch.Tensor, node: torch.Tensor,
               nodes: int, E: int, T: int):
        """The kept pairs' positions when every copy was routed like its representative, else the reason."""
        if bool((idx < 0).any()) or bool((idx >= T).any()):
            return "routed pairs: a routing index outside the tokens"
        if int(torch.bincount(idx * E + group, minlength=T * E).max()) > 1:
            return "routed pairs: a token has two pairs with one expert"
        counts = torch.bincount(idx, minlength=T)
        if not torch.equal(counts, counts.index_select(0, rep)):
            return "routed pairs: copies of a shared token have different numbers of pairs"
        keep = torch.nonzero(rep.index_select(0, idx) == idx).reshape(-1)
        key = node.index_select(0, idx) * E + group
        table = torch.full((nodes * E,), -1, dtype=torch.long, device=idx.device)
        table[key[keep]] = keep
        twin = table[key]
        if bool((twin < 0).any()):
            return "routed pairs: copies of a shared token were routed to different experts"
        for s in self.plan.scatters:
            idx2 = args[s.index_pos]
            if not torch.equal(torch.div(idx2, s.per_token, rounding_mode="floor"), idx):
                return "routed pairs: a scatter index does not land on the pair's own token"
            if s.per_token > 1 and not torch.equal(idx2 % s.per_token, (idx2 % s.per_token)[twin]):
                return "routed pairs: copies of a shared token hold an expert in different slots"
        for p in self.plan.pair_inputs:
            b = _bits(args[p])
            if not torch.equal(b, b[twin]):
                return "routed pairs: copies of a shared token have different per-pair inputs (gates)"
        return keep
