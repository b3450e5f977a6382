"""Process-wide counters that prove a rewrite ran: ``stats()``, ``reset_stats()``; graph records are logged."""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Optional

from brcompile.codes import CONSTRUCTS, Code

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Stats:
    """Process-wide counters (``brcompile.stats()``); tests assert on them so a fallback cannot pass
    for a replay."""

    replayed_calls: int = 0
    streamed_calls: int = 0  # replayed calls that ran in streaming mode (prefix + tail chunks)
    window_calls: int = 0  # streamed grad-mode calls inside a cross-call window (runtime/window/)
    window_no_grad_calls: int = 0  # ... and no-grad ones (forward shared across the window's no-grad calls)
    window_replayed_tokens: int = 0  # packed tokens of those calls replayed from an earlier call, not recomputed
    windows: int = 0  # cross-call windows whose deferred backward ran
    window_recomputed_tokens: int = 0  # window tokens that kept only their outputs and re-ran forward in backward
    #: replayed calls whose tokens this rank split with its context-parallel group (runtime/context_parallel.py) ...
    context_parallel_calls: int = 0
    context_parallel_tokens: int = 0  # ... and the packed tokens this rank ran of them (its pieces)
    #: calls under context_parallel that ran whole on every rank, their gradient counted once (reasons:
    #: ``context_parallel_reasons``; a graph refused at compile time counts here too)
    context_parallel_whole_calls: int = 0
    context_parallel_reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    fallback_calls: int = 0
    logical_tokens: int = 0
    executed_tokens: int = 0  # the needed tokens of replayed calls (passes/analysis/liveness.py): what ran
    live_tokens: int = 0  # of those, the tokens an output reads (the rest are keys a live query attends)
    dead_tokens: int = 0  # tree tokens no output needs: left out of the tree, computed by nobody
    compiled_graphs: int = 0
    rewritten_graphs: int = 0
    fallback_reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    #: fallback calls per refusal code (brcompile/codes.py: the rule broken) ...
    fallback_codes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    #: ... and per (code, reason): the details of each code (:meth:`details`)
    fallback_details: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    # calls of graphs with nothing to share (passes/refusals.py: NothingToShare; a decode step against a KV cache,
    # passes/analysis/decode.py), run as they are: no fallback, so fallback_calls counts real refusals only
    unshared_calls: int = 0
    unshared_reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    unshared_codes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    unshared_details: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def dedup_ratio(self) -> float:
        return self.logical_tokens / self.executed_tokens if self.executed_tokens else 1.0

    @property
    def computed_tokens(self) -> int:
        """Executed tokens less those a cross-call window replayed from an earlier call: what ran forward."""
        return self.executed_tokens - self.window_replayed_tokens

    def details(self, code: Code, unshared: bool = False) -> collections.Counter:
        """The reasons counted under ``code`` (fallback calls, or with ``unshared`` the unshared calls)."""
        per = self.unshared_details if unshared else self.fallback_details
        return collections.Counter({r: n for (c, r), n in per.items() if c is code})

    def to_dict(self) -> dict:
        """Plain JSON types: counters as dicts, codes as their string values, details as {code: {reason: n}}."""
        d = dataclasses.asdict(self)
        d["fallback_reasons"] = dict(self.fallback_reasons)
        d["context_parallel_reasons"] = dict(self.context_parallel_reasons)
        d["unshared_reasons"] = dict(self.unshared_reasons)
        for kind in ("fallback", "unshared"):
            codes = getattr(self, f"{kind}_codes")
            d[f"{kind}_codes"] = {c.value: n for c, n in codes.items()}
            d[f"{kind}_details"] = {c.value: dict(self.details(c, kind == "unshared")) for c in codes}
        d["dedup_ratio"] = self.dedup_ratio
        d["computed_tokens"] = self.computed_tokens
        return d

    def _code_lines(self, kind: str) -> list[str]:
        """One line per code (most calls first, grouped by construct), then one per reason under it."""
        codes = getattr(self, f"{kind}_codes")
        order = sorted(codes.items(), key=lambda cn: (CONSTRUCTS.index(cn[0].construct), -cn[1], cn[0].value))
        lines = []
        for code, n in order:
            lines.append(f"  {kind} x{n}: [{code.construct}] {code.value}: {code.describe()}")
            lines += [f"    x{k}: {reason}" for reason, k in self.details(code, kind == "unshared").most_common()]
        return lines

    def __str__(self) -> str:
        lines = [f"replayed calls {self.replayed_calls}, fallback calls {self.fallback_calls}",
                 f"tokens: logical {self.logical_tokens}, executed {self.executed_tokens} "
                 f"(dedup {self.dedup_ratio:.2f}x)"]
        if self.dead_tokens or self.live_tokens:
            lines.append(f"  needed {self.executed_tokens} (live {self.live_tokens}), dead {self.dead_tokens} "
                         f"(left out of the tree)")
        if self.window_calls or self.window_no_grad_calls:
            dedup = self.logical_tokens / self.computed_tokens if self.computed_tokens else 1.0
            lines.append(f"  cross-call windows {self.windows} ({self.window_calls} calls, "
                         f"{self.window_no_grad_calls} no-grad): "
                         f"{self.window_replayed_tokens} replayed from an earlier call, computed {self.computed_tokens} "
                         f"(dedup {dedup:.2f}x)" + (f", {self.window_recomputed_tokens} recomputed in backward"
                                                    if self.window_recomputed_tokens else ""))
        if self.context_parallel_calls or self.context_parallel_whole_calls:
            lines.append(f"  context parallel: {self.context_parallel_calls} calls split over the group "
                         f"({self.context_parallel_tokens} tokens on this rank), "
                         f"{self.context_parallel_whole_calls} run whole on every rank")
            lines += [f"    x{k}: {reason}" for reason, k in self.context_parallel_reasons.most_common()]
        lines += self._code_lines("fallback")
        if self.unshared_calls:
            lines.append(f"calls with nothing to share (run as they are) {self.unshared_calls}")
        lines += self._code_lines("unshared")
        return "\n".join(lines)


_STATS = Stats()
_LOCK = threading.Lock()


def stats() -> Stats:
    """The live counters (a snapshot copy)."""
    with _LOCK:
        s = dataclasses.replace(_STATS)
        for f in dataclasses.fields(Stats):
            v = getattr(_STATS, f.name)
            if isinstance(v, collections.Counter):
                setattr(s, f.name, collections.Counter(v))
        return s


def reset_stats() -> None:
    global _STATS
    with _LOCK:
        _STATS = Stats()


def _record(**kw) -> None:
    """Add to the numeric counters (``replayed_calls=1``, ...)."""
    with _LOCK:
        for k, v in kw.items():
            setattr(_STATS, k, getattr(_STATS, k) + v)


def record_original_call(code: Code, reason: str, unshared: bool = False) -> None:
    """One call that ran the original graph: a fallback (the rule ``code`` broken, how: ``reason``), or with
    ``unshared`` a call of a graph with nothing to share. Counted per reason, per code and per (code, reason)."""
    if not isinstance(code, Code):
        raise TypeError(f"a fallback needs a refusals.Code, got {code!r}")
    kind = "unshared" if unshared else "fallback"
    with _LOCK:
        setattr(_STATS, f"{kind}_calls", getattr(_STATS, f"{kind}_calls") + 1)
        getattr(_STATS, f"{kind}_reasons")[reason] += 1
        getattr(_STATS, f"{kind}_codes")[code] += 1
        getattr(_STATS, f"{kind}_details")[(code, reason)] += 1


def record_whole_call(reason: str) -> None:
    """One call under context parallelism that ran its graph whole on every rank (``reason``: why not split)."""
    with _LOCK:
        _STATS.context_parallel_whole_calls += 1
        _STATS.context_parallel_reasons[reason] += 1


def record_graph(rewritten: bool, reason: Optional[str] = None, code: Optional[Code] = None) -> None:
    """One captured graph: rewritten, or falling back with ``code`` and ``reason`` (logged)."""
    _record(compiled_graphs=1, rewritten_graphs=int(rewritten))
    if reason is not None:
        log.info("branch_replay: graph falls back [%s]: %s", code, reason)
