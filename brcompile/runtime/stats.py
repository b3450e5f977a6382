"""Process-wide counters that prove a rewrite ran: ``stats()``, ``reset_stats()``; graph records are logged."""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Optional

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Stats:
    """Process-wide counters (``brcompile.stats()``); tests assert on them so a fallback cannot pass
    for a replay."""

    replayed_calls: int = 0
    streamed_calls: int = 0  # replayed calls that ran in streaming mode (prefix + tail chunks)
    fallback_calls: int = 0
    logical_tokens: int = 0
    executed_tokens: int = 0  # the needed tokens of replayed calls (passes/liveness.py): what ran
    live_tokens: int = 0  # of those, the tokens an output reads (the rest are keys a live query attends)
    dead_tokens: int = 0  # tree tokens no output needs: left out of the tree, computed by nobody
    compiled_graphs: int = 0
    rewritten_graphs: int = 0
    fallback_reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    # calls of graphs with nothing to share (passes/refusals.py: NothingToShare; a decode step against a KV cache,
    # passes/decode.py), run as they are: no fallback, so fallback_calls counts real refusals only
    unshared_calls: int = 0
    unshared_reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def dedup_ratio(self) -> float:
        return self.logical_tokens / self.executed_tokens if self.executed_tokens else 1.0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["fallback_reasons"] = dict(self.fallback_reasons)
        d["unshared_reasons"] = dict(self.unshared_reasons)
        d["dedup_ratio"] = self.dedup_ratio
        return d

    def __str__(self) -> str:
        lines = [f"replayed calls {self.replayed_calls}, fallback calls {self.fallback_calls}",
                 f"tokens: logical {self.logical_tokens}, executed {self.executed_tokens} "
                 f"(dedup {self.dedup_ratio:.2f}x)"]
        if self.dead_tokens or self.live_tokens:
            lines.append(f"  needed {self.executed_tokens} (live {self.live_tokens}), dead {self.dead_tokens} "
                         f"(left out of the tree)")
        for reason, n in self.fallback_reasons.most_common():
            lines.append(f"  fallback x{n}: {reason}")
        if self.unshared_calls:
            lines.append(f"calls with nothing to share (run as they are) {self.unshared_calls}")
        for reason, n in self.unshared_reasons.most_common():
            lines.append(f"  unshared x{n}: {reason}")
        return "\n".join(lines)


_STATS = Stats()
_LOCK = threading.Lock()


def stats() -> Stats:
    """The live counters (a snapshot copy)."""
    with _LOCK:
        s = dataclasses.replace(_STATS)
        s.fallback_reasons = collections.Counter(_STATS.fallback_reasons)
        s.unshared_reasons = collections.Counter(_STATS.unshared_reasons)
        return s


def reset_stats() -> None:
    global _STATS
    with _LOCK:
        _STATS = Stats()


def _record(**kw) -> None:
    with _LOCK:
        for k, v in kw.items():
            if k == "reason":
                _STATS.fallback_reasons[v] += 1
            elif k == "unshared_reason":
                _STATS.unshared_reasons[v] += 1
            else:
                setattr(_STATS, k, getattr(_STATS, k) + v)


def record_graph(rewritten: bool, reason: Optional[str] = None) -> None:
    _record(compiled_graphs=1, rewritten_graphs=int(rewritten))
    if reason is not None:
        log.info("branch_replay: graph falls back: %s", reason)
