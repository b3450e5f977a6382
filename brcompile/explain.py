"""Reports: what was rewritten, why something fell back, logical vs executed tokens."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from brcompile import runtime
from brcompile.backend import BranchReplayBackend, GraphRecord


@dataclasses.dataclass
class ExplainReport:
    """The records of every graph captured by one ``explain`` run, plus the per-call tree stats."""

    graphs: list[GraphRecord]
    calls: list[dict]
    stats: runtime.Stats
    result: Any = dataclasses.field(default=None, repr=False)

    @property
    def rewritten(self) -> list[GraphRecord]:
        return [g for g in self.graphs if g.rewritten]

    @property
    def fallbacks(self) -> list[GraphRecord]:
        return [g for g in self.graphs if not g.rewritten]

    def to_dict(self) -> dict:
        return {
            "graphs": [
                {
                    "graph_id": g.graph_id, "rewritten": g.rewritten, "reason": g.reason,
                    "failed_node": g.failed_node, "tree_inputs": list(g.tree_inputs), "masks": list(g.masks),
                    "materialisations": [dict(zip(("node", "user", "numel", "reason"), m))
                                         for m in g.materialisations],
                    "lazy_gathers": list(g.lazy_gathers), "packed_code": g.packed_code,
                }
                for g in self.graphs
            ],
            "calls": self.calls,
            "stats": self.stats.to_dict(),
        }

    def __str__(self) -> str:
        out = [f"branch_replay: {len(self.graphs)} graph(s), {len(self.rewritten)} rewritten, "
               f"{len(self.fallbacks)} fell back"]
        for g in self.graphs:
            out.append("")
            if not g.rewritten:
                out.append(f"graph {g.graph_id}: FELL BACK — {g.reason}")
                continue
            out.append(f"graph {g.graph_id}: REWRITTEN")
            out.append(f"  tree inputs: {', '.join(g.tree_inputs)}")
            for m in g.masks:
                out.append(f"  attention {m}")
            for node, user, numel, reason in g.materialisations:
                out.append(f"  materialised {node} ({numel:,} elements) for {user}: {reason}")
            for n in g.lazy_gathers:
                out.append(f"  lazy gather {n}: packed[index, targets], no dense [B, L, V]")
            out.append("  packed graph:")
            out.extend("    " + line for line in (g.packed_code or "").strip().splitlines())
        for i, c in enumerate(self.calls):
            t = c.get("tree") or {}
            state = "replayed" if c["replayed"] else f"original ({c['reason']})"
            out.append(f"call {i}: {state}; rows {t.get('rows')}, logical {t.get('logical_tokens')}, "
                       f"executed {t.get('executed_tokens')}, dedup {t.get('dedup_ratio', 0):.2f}x, "
                       f"depth {t.get('depth')}, segments {t.get('segments')}")
        out.append(str(self.stats))
        return "\n".join(out)


def explain(fn, *args, backend: Optional[BranchReplayBackend] = None, **kwargs) -> ExplainReport:
    """Compile ``fn`` with a fresh branch_replay backend, call it once on ``args``, and report.

    ``str(report)`` shows each captured graph (rewritten or the fallback reason, the packed graph's code,
    materialisations and lazy gathers) and each call's tree stats; ``report.to_dict()`` is for tools.
    """
    be = backend or BranchReplayBackend()
    before = runtime.stats()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=be)
    result = compiled(*args, **kwargs)
    calls = []
    for g in be.records:
        for c in getattr(g.runtime, "calls", []):
            calls.append({"graph_id": g.graph_id, "replayed": c.replayed, "reason": c.reason,
                          "tree": c.tree_stats})
    for g in be.records:
        if not g.rewritten:
            calls.append({"graph_id": g.graph_id, "replayed": False, "reason": g.reason, "tree": None})
    after = runtime.stats()
    delta = runtime.Stats(
        replayed_calls=after.replayed_calls - before.replayed_calls,
        fallback_calls=after.fallback_calls - before.fallback_calls,
        logical_tokens=after.logical_tokens - before.logical_tokens,
        executed_tokens=after.executed_tokens - before.executed_tokens,
        compiled_graphs=after.compiled_graphs - before.compiled_graphs,
        rewritten_graphs=after.rewritten_graphs - before.rewritten_graphs,
        fallback_reasons=after.fallback_reasons - before.fallback_reasons,
    )
    return ExplainReport(list(be.records), calls, delta, result)
