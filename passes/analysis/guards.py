"""Per-call guards: conditions a rewrite assumed about the *values* of a call's inputs.

Dynamo guards the shapes and Python constants a graph was captured with; a rewrite can rely on more than
that, and each such assumption becomes a :class:`BatchGuard`. The runtime evaluates the guards of a
graph on every call (before building the prefix tree); when one fails it runs the original graph and
records the guard's reason — a fallback, never a wrong number. Examples:

* a float read by ``.item()`` from a graph input (Dynamo's unspecialised floats under ``dynamic=True``:
  ``attention_dropout``, ``scaling``) was specialised to its compile-time value;
* an additive float mask (HF eager attention) was replaced by tree attention, which agrees with it only
  where every query sees at least one key (a fully masked row is uniform or NaN in the original). Such a
  query is a padded position (a real token sees itself), and padded positions are keys nobody sees, so
  only the outputs at padded positions differ: on a call that leaves every padded position out of the tree
  (passes/analysis/liveness.py: none of them is needed) this guard is skipped (``padding_only``).

A guard reads only the graph's inputs (by placeholder position) and costs O(B * L) at most, or, for a constant
table the graph reads (a buffer), O(table) once per new version of the table.
"""
from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Callable, Optional, Sequence

import torch

from brcompile.passes.refusals import Code, Refusal, refusal

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BatchGuard:
    """``check(args) -> None`` when the packed graph is exact for this call, else the reason it is not.

    ``what`` names the assumption for reports (``explain``); ``code`` is the refusal code of a call that
    fails it (passes/refusals.py)."""

    what: str
    check: Callable[[Sequence[object]], Optional[str]]
    code: Code = dataclasses.field(kw_only=True)
    #: True for an assumption about padded positions only (their outputs): moot on a call whose needed positions
    #: hold no padded one (brcompile.runtime.packed: checked after the call's live positions).
    padding_only: bool = False

    def __call__(self, args: Sequence[object]) -> Optional[str]:
        return self.check(args)

    def __str__(self) -> str:
        return self.what


def scalar_equals(position: int, value: float, what: str) -> BatchGuard:
    """Input ``position`` (a 0-dim tensor or a Python number) must equal ``value`` exactly."""

    def check(args):
        x = args[position]
        got = x.item() if isinstance(x, torch.Tensor) else x
        if got != value:
            return f"{what} is {got} in this call; the packed graph was specialised to {value}"
        return None

    return BatchGuard(f"{what} == {value} (input {position})", check, code=Code.GUARD_SCALAR)


def no_query_without_keys(position: int, what: str, window: int = 0) -> BatchGuard:
    """For a causal & key-padding mask from the [B, L] input at ``position``: every query sees a key iff
    every row's first position is a real token (``X[b, 0] != 0``) — no left padding, no empty row. With a
    sliding window W, iff every window of columns (i - W, i] holds a real token: O(B * L) by a cumsum."""

    def check(args):
        x = args[position]
        if x.shape[-1] == 0:
            return None
        if not window:
            ok = bool((x[:, 0] != 0).all())
        else:
            c = torch.nn.functional.pad((x != 0).long().cumsum(-1), (1, 0))  # c[:, i + 1] = real tokens in 0..i
            i = torch.arange(x.shape[-1], device=x.device)
            ok = bool(((c[:, i + 1] - c[:, (i + 1 - window).clamp(min=0)]) > 0).all())
        if not ok:
            where = "a row starts with padding" if not window else f"a window of {window} columns holds only padding"
            return (f"{what}: {where}, so a query sees no key; the original graph's additive mask makes such a "
                    "row uniform (or NaN), tree attention makes it 0")
        return None

    if window:
        return BatchGuard(f"{what}: every {window}-column window holds a real token (input {position})", check,
                          padding_only=True, code=Code.GUARD_QUERY_WITHOUT_KEYS)
    return BatchGuard(f"{what}: no left padding (input {position}[:, 0] != 0)", check, padding_only=True,
                      code=Code.GUARD_QUERY_WITHOUT_KEYS)


def integers_in_range(position: int, bins: int, what: str) -> BatchGuard:
    """Every entry of the integer input at ``position`` (a table the graph indexes, such as a hash router's
    token-to-expert buffer) lies in ``[0, bins)``. Checked once per version of the tensor (the same tensor
    object, storage, shape and in-place version counter): a buffer that nobody writes is read once, not on every
    call."""
    seen: dict = {}

    def check(args):
        x = args[position]
        key = (x.data_ptr(), tuple(x.shape), x._version)
        ref = seen.get("tensor")
        if ref is not None and ref() is x and seen.get("key") == key:
            return None
        if x.numel() and not bool(((x >= 0) & (x < bins)).all()):
            lo, hi = int(x.min()), int(x.max())
            return (f"{what} holds values in [{lo}, {hi}], not all in [0, {bins}): the group counts would not "
                    "be the runs of equal keys")
        seen.update(tensor=weakref.ref(x), key=key)
        return None

    return BatchGuard(f"{what}: entries in [0, {bins}) (input {position})", check, code=Code.GUARD_TABLE_RANGE)


def first_failure(guards: Sequence[BatchGuard], args: Sequence[object]) -> Optional[Refusal]:
    """The refusal (the guard's code, its reason) of the first failing guard, or None when all hold."""
    for g in guards:
        reason = g(args)
        if reason is not None:
            log.debug("branch_replay guard failed [%s]: %s", g.code, reason)
            return refusal(g.code, reason)
    return None


__all__ = ["BatchGuard", "scalar_equals", "no_query_without_keys", "integers_in_range", "first_failure"]
