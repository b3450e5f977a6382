"""The explain report: :class:`ExplainReport` (the backend's records and the recorded calls as tables) and its
renderers (plain text, rich); :mod:`.explain` records the calls and builds it."""
from __future__ import annotations

import collections
import dataclasses
import importlib.util
import sys
import textwrap
from typing import Any, Optional, Sequence

import torch.fx as fx

from brcompile import runtime
from brcompile.backend import GraphRecord
from brcompile.passes.refusals import CONSTRUCTS, Code as RefusalCode


LIMIT_FORMULA = "limit = (dense - dense_attention) * N / (B*L) + tree_attention (each visible pair once)"


MAX_CALL_ROWS = 20  # calls shown in the tables; to_dict() has all of them


@dataclasses.dataclass
class Table:
    """A titled table: ``headers``, ``rows`` of str cells (a cell may hold newlines), ``notes`` below it."""

    title: str
    headers: list[str]
    rows: list[list[str]]
    notes: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        for r in self.rows:
            if len(r) != len(self.headers):
                raise ValueError(f"table {self.title!r}: row {r!r} has {len(r)} cells for {len(self.headers)} "
                                 f"headers")

    def numeric_columns(self) -> list[bool]:
        """Columns whose non-empty cells all start with a number (right-aligned)."""
        out = []
        for i in range(len(self.headers)):
            cells = [r[i] for r in self.rows if r[i] not in ("", "-")]
            out.append(bool(cells) and all(_starts_with_number(c) for c in cells))
        return out


@dataclasses.dataclass
class Code:
    """A titled block of Python code."""

    title: str
    text: str


def _starts_with_number(cell: str) -> bool:
    head = cell.split()[0].rstrip("x%").replace(",", "") if cell.split() else ""
    try:
        float(head)
    except ValueError:
        return False
    return True


def text_table(t: Table, width: int = 110) -> str:
    """A table as aligned plain text: title, header, rule, rows (multi-line cells), notes wrapped at ``width``."""
    grid = [[c.splitlines() or [""] for c in row] for row in [t.headers] + t.rows]
    widths = [max(len(line) for row in grid for line in row[i]) for i in range(len(t.headers))]
    numeric = t.numeric_columns()

    def lines_of(row, header=False):
        out = []
        for k in range(max(len(c) for c in row)):
            parts = []
            for i, cell in enumerate(row):
                s = cell[k] if k < len(cell) else ""
                parts.append(s.rjust(widths[i]) if numeric[i] and not header else s.ljust(widths[i]))
            out.append("  ".join(parts).rstrip())
        return out

    out = [t.title, *lines_of(grid[0], header=True), "  ".join("-" * w for w in widths)]
    for row in grid[1:]:
        out += lines_of(row)
    out += [textwrap.fill(n, width, subsequent_indent="    ") for n in t.notes]
    return "\n".join(out)


def render_text(blocks: Sequence[Any], width: int = 110) -> str:
    """Plain text of a list of blocks (str lines, :class:`Table`, :class:`Code`), blank line between blocks."""
    out = []
    for b in blocks:
        if isinstance(b, Table):
            out.append(text_table(b, width))
        elif isinstance(b, Code):
            out.append(b.title + "\n" + textwrap.indent(b.text.strip("\n"), "    "))
        else:
            out.append(str(b))
    return "\n\n".join(out)


def rich_available() -> bool:
    """Whether the optional ``rich`` package is installed."""
    return importlib.util.find_spec("rich") is not None


def render_rich(blocks: Sequence[Any], file=None) -> None:
    """Prints blocks with rich: tables as rich tables, code highlighted in a panel (cells are not markup)."""
    from rich.console import Console
    from rich.panel import Panel
    from rich.syntax import Syntax
    from rich.table import Table as RichTable
    from rich.text import Text

    from rich import box

    console = Console(file=file)
    if not console.is_terminal:  # a file or a pipe: no terminal width to respect
        console = Console(file=file, width=200)
    for b in blocks:
        if isinstance(b, Table):
            rt = RichTable(title=Text(b.title, style="bold"), title_justify="left", header_style="bold",
                           box=box.SIMPLE_HEAD)
            for h, num in zip(b.headers, b.numeric_columns()):
                rt.add_column(Text(h), justify="right" if num else "left", overflow="fold", no_wrap=num)
            for row in b.rows:
                rt.add_row(*(Text(c) for c in row))
            console.print(rt)
            for n in b.notes:
                console.print(Text(n, style="dim"))
        elif isinstance(b, Code):
            console.print(Panel(Syntax(b.text.strip("\n"), "python", word_wrap=True), title=Text(b.title)))
        else:
            console.print(Text(str(b)))


def print_blocks(blocks: Sequence[Any], file=None, rich: Optional[bool] = None) -> None:
    """Prints blocks with rich when ``rich`` is True or (None) installed, else as plain text."""
    if rich is None:
        rich = rich_available()
    if rich:
        render_rich(blocks, file)
    else:
        print(render_text(blocks), file=file if file is not None else sys.stdout)


def fmt_count(n: Optional[float], unit: str = "", base: int = 1000) -> str:
    """``1234567`` -> ``"1.23 M"`` + unit; '-' for None."""
    if n is None:
        return "-"
    prefixes = ("", "k", "M", "G", "T", "P") if base == 1000 else ("", "Ki", "Mi", "Gi", "Ti", "Pi")
    v, i = float(n), 0
    while abs(v) >= base and i < len(prefixes) - 1:
        v, i = v / base, i + 1
    num = f"{v:.0f}" if i == 0 else f"{v:.3g}"
    return f"{num} {prefixes[i]}{unit}".rstrip()


def fmt_flops(n: Optional[float]) -> str:
    return fmt_count(n, "FLOP")


def fmt_bytes(n: Optional[float]) -> str:
    return fmt_count(n, "B", base=1024)


def fmt_int(n: Optional[int]) -> str:
    """``12345`` -> ``"12,345"``; '-' for None."""
    return "-" if n is None else f"{n:,}"


def fmt_ratio(num: Optional[float], den: Optional[float]) -> str:
    """``num / den`` as ``"1.23x"``; '-' when either is missing or den is 0."""
    return "-" if num is None or not den else f"{num / den:.2f}x"


def _wrap(text: Optional[str], width: int = 64) -> str:
    return "-" if not text else "\n".join(textwrap.wrap(text, width, break_long_words=True)) or "-"


def packed_module(g: GraphRecord) -> Optional[fx.GraphModule]:
    """The packed GraphModule of a rewritten graph: the owner of its runtime's eager packed callable."""
    fn = getattr(g.runtime, "eager_packed", None)
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, fx.GraphModule) else None


def brcompile_nodes(gm: Optional[fx.GraphModule]) -> dict[str, int]:
    """Calls of brcompile ops (``torch.ops.brcompile.*``) and brcompile functions (materialize, packed
    gathers ...) in a graph, by name, with counts."""
    counts: collections.Counter = collections.Counter()
    if gm is None:
        return {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        t = n.target
        if getattr(t, "namespace", None) == "brcompile":
            counts[str(t).split(".")[1]] += 1
        elif getattr(t, "__module__", "").startswith("brcompile"):
            counts[getattr(t, "__name__", str(t))] += 1
    return dict(counts)


#: How a call's tree was obtained (``CallRecord.tree_stats["source"]``).
_TREE_SOURCE = {"built": "keys hashed", "provenance": "provenance"}


def _mask_summary(masks: Sequence[str]) -> str:
    """``("out: causal", "out_2: causal")`` -> ``"causal x2"`` (one line per distinct mask kind)."""
    kinds = collections.Counter(m.split(": ", 1)[-1] for m in masks)
    return "\n".join(f"{k} x{n}" if n > 1 else k for k, n in kinds.items()) or "-"


@dataclasses.dataclass
class ExplainReport:
    """The records of every graph captured by an ``explain`` run (or a :func:`recording` block) and one
    entry per call: ``{"graph_id", "replayed", "reason", "tree": TreeStats dict, "cost": dict}``.

    ``cost`` (when measured; see the module docstring): ``backward``, ``dense_flops``,
    ``dense_attention_flops``, ``dense_saved_bytes``, and for a replayed call ``packed_flops``,
    ``packed_attention_flops``, ``packed_saved_bytes``, ``limit_flops``; or ``{"skipped": reason}``.
    """

    graphs: list[GraphRecord]
    calls: list[dict]
    stats: runtime.Stats
    result: Any = dataclasses.field(default=None, repr=False)
    notes: list[str] = dataclasses.field(default_factory=list)
    #: the cross-call windows closed during the run (``Window.summary()``, brcompile/runtime/window/)
    windows: list[dict] = dataclasses.field(default_factory=list)

    @property
    def rewritten(self) -> list[GraphRecord]:
        return [g for g in self.graphs if g.rewritten]

    @property
    def fallbacks(self) -> list[GraphRecord]:
        return [g for g in self.graphs if not g.rewritten and not getattr(g, "unshared", False)]

    @property
    def unshared(self) -> list[GraphRecord]:
        """Graphs with nothing to share (passes/refusals.py: NothingToShare), run as they are: no fallback."""
        return [g for g in self.graphs if not g.rewritten and getattr(g, "unshared", False)]

    @staticmethod
    def graph_dict(g: GraphRecord) -> dict:
        """One graph record as a JSON-serialisable dict."""
        return {
            "graph_id": g.graph_id, "rewritten": g.rewritten, "reason": g.reason, "code": code_value(g.code),
            "failed_node": g.failed_node, "tree_inputs": list(g.tree_inputs),
            "computed_keys": list(getattr(g, "computed_keys", ())), "masks": list(g.masks),
            "materialisations": [dict(zip(("node", "user", "numel", "reason"), (n, u, int(k), r)))
                                 for n, u, k, r in g.materialisations],
            "lazy_gathers": list(g.lazy_gathers), "fused": [str(f) for f in getattr(g, "fused", ())],
            "repacked": [str(r) for r in getattr(g, "repacked", ())],
            "not_repacked": [dict(node=n, reason=r) for n, r in getattr(g, "not_repacked", ())],
            "brcompile_nodes": brcompile_nodes(packed_module(g)),
            "original_code": g.original_code, "packed_code": g.packed_code,
            "replay": getattr(g, "replay", None), "replay_reason": getattr(g, "replay_reason", None),
            "replay_code": code_value(getattr(g, "replay_code", None)),
            "level": getattr(g, "level", None), "unshared": getattr(g, "unshared", False),
            "refusals": [dict(level=lv, reason=r, code=code_value(c))
                         for (lv, r), c in zip(getattr(g, "refusals", ()), _refusal_codes(g))],
            "routed": getattr(g, "routed", None),
            "liveness": getattr(g, "liveness", None),
            "stage_times": [dict(level=lv, stage=st, seconds=t) for lv, st, t in getattr(g, "stage_times", ())],
        }

    def to_dict(self) -> dict:
        """Everything in the report as plain JSON types (``json.dumps`` works on it)."""
        return {
            "graphs": [self.graph_dict(g) for g in self.graphs],
            "calls": self.calls,
            "stats": self.stats.to_dict(),
            "windows": list(self.windows),
            "notes": list(self.notes),
            "limit_formula": LIMIT_FORMULA,
        }

    # --- tables ----------------------------------------------------------------------------------------
    def summary(self) -> str:
        replayed = sum(1 for c in self.calls if c["replayed"])
        return (f"branch_replay: {len(self.graphs)} graph(s), {len(self.rewritten)} rewritten, "
                f"{len(self.fallbacks)} fell back" + (f", {len(self.unshared)} with nothing to share (run as they are)"
                                                      if self.unshared else "") +
                f"; {len(self.calls)} call(s), {replayed} replayed, "
                f"{len(self.calls) - replayed} ran the original graph")

    def graph_table(self) -> Table:
        has_fused = any(getattr(g, "fused", ()) for g in self.graphs)
        headers = ["graph", "status", "tree inputs", "attention masks", "materialised", "lazy gathers",
                   "brcompile nodes"] + (["fused read-outs"] if has_fused else [])
        rows = []
        for g in self.graphs:
            if not g.rewritten:
                status = "NOTHING TO SHARE" if getattr(g, "unshared", False) else "FELL BACK"
                row = [str(g.graph_id), status] + ["-"] * (len(headers) - 2)
            else:
                mats = g.materialisations
                mat = f"{len(mats)} ({sum(int(m[2]) for m in mats):,} elements)" if mats else "0"
                special = brcompile_nodes(packed_module(g))
                status = "REWRITTEN" + (" (routed pairs)" if getattr(g, "routed", None)
                                        else " (ATen level)" if getattr(g, "level", None) == "aten" else "")
                keys = [*g.tree_inputs, *(f"({k}, computed per call)" for k in getattr(g, "computed_keys", ()))]
                row = [str(g.graph_id), status, "\n".join(keys) or "-", _mask_summary(g.masks), mat,
                       "\n".join(g.lazy_gathers) or "-",
                       "\n".join(f"{k} x{n}" for k, n in special.items()) or "-"]
                if has_fused:
                    row.append("\n".join(_wrap(str(f), 48) for f in getattr(g, "fused", ())) or "-")
            rows.append(row)
        return Table("graphs", headers, rows)

    def fallback_table(self) -> Table:
        rows = [[str(g.graph_id), g.failed_node or "-", code_value(g.code) or "-", _wrap(g.reason, 80)]
                for g in self.fallbacks]
        notes = [f"graph {g.graph_id}: also refused at the {lv} level [{c}]: {r}" for g in self.fallbacks
                 for (lv, r), c in list(zip(getattr(g, "refusals", ()), _refusal_codes(g)))[1:]]
        notes += [f"graph {g.graph_id} (rewritten at the {g.level} level) was refused at the {lv} level [{c}]: {r}"
                  for g in self.rewritten for (lv, r), c in zip(getattr(g, "refusals", ()), _refusal_codes(g))]
        return Table("graphs that FELL BACK (the original graph runs unchanged)",
                     ["graph", "failed at node", "code", "reason"], rows, notes)

    def refusals_by_code(self) -> dict[RefusalCode, dict]:
        """Every refusal of the report grouped by code: ``{code: {"graphs": [ids], "calls": n}}`` — graphs that
        fell back or have nothing to share, and calls that ran the original graph (their own code: a failed
        guard, a batch sharing too little, ... or their graph's)."""
        out: dict[RefusalCode, dict] = {}
        for g in self.graphs:
            if not g.rewritten and g.code is not None:
                out.setdefault(g.code, {"graphs": [], "calls": 0})["graphs"].append(g.graph_id)
        for c in self.calls:
            code = c.get("code")
            if not c["replayed"] and code is not None:
                out.setdefault(RefusalCode(code), {"graphs": [], "calls": 0})["calls"] += 1
        return out

    def code_table(self) -> Table:
        """The refusals grouped by construct and code, each with its one-line description."""
        groups = self.refusals_by_code()
        order = sorted(groups, key=lambda c: (CONSTRUCTS.index(c.construct), c.value))
        rows = [[c.construct, c.value, _wrap(c.describe(), 60),
                 ", ".join(map(str, groups[c]["graphs"])) or "-", str(groups[c]["calls"])] for c in order]
        return Table("refusals by construct and code (the rule each graph or call broke)",
                     ["construct", "code", "rule", "graphs", "calls"], rows)

    def stage_table(self) -> Table:
        """Compile time per pipeline stage (passes/pipeline.py: STAGES), over every graph and level it ran on:
        where a slow compile spends its time, and at which stage each refusal came."""
        from brcompile.passes.pipeline import STAGES

        runs: dict[str, list[tuple[float, int]]] = {s.name: [] for s in STAGES}
        refused: collections.Counter = collections.Counter()  # stage -> levels whose pipeline stopped there
        for g in self.graphs:
            last: dict[str, str] = {}  # level -> the last stage run there
            for lv, st, t in getattr(g, "stage_times", ()):
                runs.setdefault(st, []).append((t, g.graph_id))
                last[lv] = st
            refused.update(st for lv, st in last.items() if not (g.rewritten and g.level == lv))
        rows = [[name, str(len(ts)), f"{1e3 * sum(t for t, _ in ts):.1f}",
                 f"{1e3 * max(ts)[0]:.1f} (graph {max(ts)[1]})", str(refused.get(name, 0))]
                for name, ts in runs.items() if ts]
        return Table("compile time per pipeline stage", ["stage", "runs", "total ms", "slowest ms", "refused here"],
                     rows)

    def materialisation_table(self) -> Table:
        rows = [[str(g.graph_id), node, user, f"{int(numel):,}", _wrap(reason, 60)]
                for g in self.rewritten for node, user, numel, reason in g.materialisations]
        return Table("materialisations (a packed value gathered to dense [B, L, ...]; elements at capture)",
                     ["graph", "value", "used by", "elements", "why"], rows)

    def repack_table(self) -> Table:
        rows = [[str(g.graph_id), "packed again", str(r)] for g in self.rewritten for r in getattr(g, "repacked", ())]
        rows += [[str(g.graph_id), f"{node}: stays dense", _wrap(why, 70)]
                 for g in self.graphs for node, why in getattr(g, "not_repacked", ())]
        return Table("dense regions (an op without a token-axis rule computed densely; packed again when the "
                     "probes prove it causal and row-independent)", ["graph", "value", "region"], rows)

    def streaming_tables(self, max_calls: int = MAX_CALL_ROWS) -> list[Table]:
        """The streaming split of each graph (mode replay/auto) and the chunk schedule of each streamed call."""
        graphs = [g for g in self.rewritten if (getattr(g, "replay", None) or getattr(g, "replay_reason", None))
                  and not _context_parallel(g)]
        if not graphs:
            return []
        rows, notes = [], _refused(graphs, "streaming refused, packed mode only")
        for g in graphs:
            r = g.replay
            if r is None:
                continue
            budget = "-" if r["memory_budget"] is None else fmt_bytes(r["memory_budget"])
            rows.append([str(g.graph_id), r["mode"], str(r["trunk_nodes"]),
                         "\n".join([f"K/V of {a}" for a in r["cached"]]
                                   + [f"prefix values of {s}" for s in r.get("cached_scans", ())]
                                   + [f"positions {p}" for p in r.get("cached_positions", ())]),
                         "\n".join(r["frontier"]),
                         fmt_bytes(r["bytes_per_token"]), str(r["chunk_tokens"]), budget,
                         _wrap(r.get("window") or "-", 40)])
        tables = [Table("streaming replay: prefix graph (shared segments, records the cached K/V and scan values) + tail graph "
                        "(one chunk of leaf chains against the cache)",
                        ["graph", "mode", "trunk nodes", "cached K/V, scan values (replay nodes)", "frontier (read by the loss)",
                         "activations/token", "chunk_tokens", "memory_budget", "cross-call windows"], rows, notes)]
        srows = []
        for i, c in list(enumerate(self.calls))[:max_calls]:
            sch = c.get("schedule")
            if c.get("mode") != "replay" or not sch:
                continue
            sizes = sch["chunk_tokens"]
            shown = ", ".join(map(str, sizes[:8])) + (f" ... ({len(sizes)} in all)" if len(sizes) > 8 else "")
            srows.append([str(i), str(c["graph_id"]), fmt_int(sch["tokens"]), fmt_int(sch["prefix_tokens"]),
                          str(sch["prefix_segments"]), str(sch["chunks"]), shown, str(sch["cross_calls"])])
        if srows:
            tables.append(Table("streamed calls: the chunk schedule (prefix once, then the chunks in order; "
                                "backward re-runs each chunk, then the prefix once)",
                                ["call", "graph", "tokens N", "prefix tokens", "prefix segments", "chunks",
                                 "chunk sizes", "cross calls"], srows))
        return tables

    def context_parallel_tables(self, max_calls: int = MAX_CALL_ROWS) -> list[Table]:
        """Each graph under ``context_parallel`` (its split trunk, or why it runs whole on every rank) and each split
        call as this rank saw it: the cut, each piece's work, the K/V bytes it received against an all-gather's."""
        graphs = [g for g in self.rewritten if _context_parallel(g)]
        if not graphs:
            return []
        rows, notes = [], _refused(graphs, "runs whole on every rank, its gradient counted once")
        for g in graphs:
            r = g.replay
            if r is None:
                continue
            rows.append([str(g.graph_id), r["context_parallel"], str(r["trunk_nodes"]),
                         "\n".join(f"K/V of {a}" for a in r["cached"]), "\n".join(r["frontier"]),
                         fmt_bytes(r["kv_bytes_per_token"]), str(r["work_alpha"])])
        tables = [Table("context parallelism: each rank runs the trunk on its piece of the packed tokens, gathering "
                        "the K/V of the earlier tokens its queries see per layer; the frontier is gathered whole for the replicated loss",
                        ["graph", "group", "trunk nodes", "gathered per layer", "frontier (gathered)",
                         "K/V bytes/token", "token work (attention pairs)"], rows, notes)]
        crows = []
        for i, c in list(enumerate(self.calls))[:max_calls]:
            cut = c.get("schedule")
            if c.get("mode") != "context_parallel" or not cut:
                continue
            work = cut["work"]
            crows.append([str(i), str(c["graph_id"]), str(cut["rank"]), fmt_int(cut["tokens"]),
                          ", ".join(map(str, cut["offsets"])), ", ".join(f"{w:.3g}" for w in work),
                          fmt_ratio(max(work), min(work)), fmt_bytes(cut["kv_bytes_received"]),
                          fmt_bytes(cut["kv_bytes_all_gather"]), str(cut["cross_rows"])])
        if crows:
            tables.append(Table("context-parallel calls (this rank): the cut, and the K/V it received (the earlier "
                                "tokens its queries see) against an all-gather of the other pieces",
                                ["call", "graph", "rank", "its tokens", "offsets", "work per rank", "max/min work",
                                 "K/V received", "K/V all-gather", "cross rows"], crows))
        return tables

    def window_table(self) -> Table:
        """One row per cross-call window closed during the run: where it ended, its calls and rows, the tokens it
        replayed from an earlier call, computed and recomputed, and the most bytes it kept for its backward."""
        rows = [[str(w["closed"]), w["ends"], str(w["calls"]), str(w["no_grad_calls"]), str(w["rows"]),
                 fmt_int(w["replayed_tokens"]), fmt_int(w["computed_tokens"]), fmt_int(w["recomputed_tokens"]),
                 fmt_bytes(w["peak_bytes"]), "yes" if w["pending"] else "no"] for w in self.windows]
        return Table("cross-call windows (brcompile.window / BranchReplayCallback): each distinct token of the "
                     "window's rows computed once", ["window", "ends", "calls", "no-grad calls", "rows",
                                                     "replayed", "computed", "recomputed in backward",
                                                     "peak kept", "pending at close"], rows)

    def call_tables(self, max_calls: int = MAX_CALL_ROWS) -> list[Table]:
        shown = list(enumerate(self.calls))[:max_calls]
        tree_rows, cost_rows, notes, cost_notes = [], [], [], []
        for i, c in shown:
            t = c.get("tree") or {}
            ran = {"replay": "streamed", "routed": "routed pairs",
                   "context_parallel": "context parallel"}.get(c.get("mode"), "packed") \
                if c["replayed"] else "original"
            tree_rows.append([str(i), str(c["graph_id"]), ran,
                              *(fmt_int(t.get(k)) for k in ("rows", "logical_tokens", "valid_tokens",
                                                            "live_tokens", "executed_tokens", "dead_tokens")),
                              fmt_ratio(t.get("logical_tokens"), t.get("executed_tokens")),
                              fmt_int(t.get("depth")), fmt_int(t.get("segments")),
                              _TREE_SOURCE.get(t.get("source"), "-"), "\n".join(t.get("keys", ())) or "-"])
            if not c["replayed"]:
                notes.append(f"call {i} (graph {c['graph_id']}) ran the original graph [{c.get('code') or '-'}]: "
                             f"{c.get('reason')}")
            cost = c.get("cost")
            if cost is None:
                continue
            if "skipped" in cost:
                cost_notes.append(f"call {i}: not measured: {cost['skipped']}")
                continue
            d, p, lim = cost.get("dense_flops"), cost.get("packed_flops"), cost.get("limit_flops")
            ds, ps = cost.get("dense_saved_bytes"), cost.get("packed_saved_bytes")
            cost_rows.append([str(i), "fwd+bwd" if cost.get("backward") else "fwd", fmt_flops(d), fmt_flops(p),
                              fmt_flops(lim), fmt_ratio(d, p), fmt_ratio(p, lim), fmt_ratio(d, lim),
                              fmt_bytes(ds), fmt_bytes(ps), fmt_bytes(None if ps is None else ds - ps)])
        if len(self.calls) > max_calls:
            notes.append(f"... {len(self.calls) - max_calls} more call(s) (all of them in to_dict())")
        notes += [f"graph {g.graph_id}: {g.liveness}; live = tree tokens an output reads, executed = the needed "
                  f"ones (live, or a key a live query attends), dead = left out of the tree"
                  for g in self.rewritten if getattr(g, "liveness", None)]
        tables = [Table("calls: the prefix tree of each batch",
                        ["call", "graph", "ran", "rows", "logical B*L", "valid", "live", "executed N (needed)",
                         "dead", "dedup", "depth",
                         "segments", "tree from", "tree keys"], tree_rows, notes)]
        if cost_rows or cost_notes:
            cost_notes = ["FLOPs of one run of the eager graphs on the call's inputs (matmuls and attention, "
                          "as torch's flop counter counts); " + LIMIT_FORMULA + "; dense attention counts the "
                          "full score matrix.", *cost_notes]
            tables.append(Table("calls: predicted cost (dense = original graph, packed = rewritten graph)",
                                ["call", "run", "dense", "packed", "limit", "dense/packed", "packed/limit",
                                 "dense/limit", "saved for bwd: dense", "packed", "saving"], cost_rows, cost_notes))
        return tables

    def blocks(self, code: bool = True, max_calls: int = MAX_CALL_ROWS) -> list:
        """The report as a list of blocks (str, :class:`Table`, :class:`Code`) for the renderers."""
        out: list = [self.summary(), self.graph_table()]
        if self.fallbacks or any(getattr(g, "refusals", ()) for g in self.rewritten):
            out.append(self.fallback_table())
        if self.unshared:
            out.append(Table("graphs with NOTHING TO SHARE (no per-token work, or a decode step against a cache: "
                             "they run as they are, no fallback)",
                             ["graph", "code", "why"],
                             [[str(g.graph_id), code_value(g.code) or "-", _wrap(g.reason, 80)]
                              for g in self.unshared]))
        if self.refusals_by_code():
            out.append(self.code_table())
        if any(getattr(g, "stage_times", ()) for g in self.graphs):
            out.append(self.stage_table())
        if any(g.materialisations for g in self.rewritten):
            out.append(self.materialisation_table())
        if any(getattr(g, "repacked", ()) or getattr(g, "not_repacked", ()) for g in self.graphs):
            out.append(self.repack_table())
        out += self.call_tables(max_calls)
        out += self.streaming_tables(max_calls)
        out += self.context_parallel_tables(max_calls)
        if self.windows:
            out.append(self.window_table())
        if code:
            out += [Code(f"graph {g.graph_id}: packed graph", g.packed_code or "") for g in self.rewritten]
            for g in self.rewritten:
                r = getattr(g, "replay", None)
                if r and _context_parallel(g):
                    out += [Code(f"graph {g.graph_id}: context-parallel {part} graph", r[f"{part}_code"])
                            for part in ("cp", "outer")]
                elif r:
                    out += [Code(f"graph {g.graph_id}: streaming {part} graph", r[f"{part}_code"])
                            for part in ("prefix", "tail", "outer")]
        out.append(str(self.stats))
        out += list(self.notes)
        return out

    def render_text(self, code: bool = True, max_calls: int = MAX_CALL_ROWS) -> str:
        """The report as plain-text tables."""
        return render_text(self.blocks(code, max_calls))

    def print(self, file=None, *, code: bool = True, rich: Optional[bool] = None,
              max_calls: int = MAX_CALL_ROWS) -> None:
        """Prints the report: rich tables when rich is installed (or ``rich=True``), else plain text."""
        print_blocks(self.blocks(code, max_calls), file=file, rich=rich)

    def __str__(self) -> str:
        return self.render_text()


def _refused(graphs, what: str) -> list[str]:
    """A note per graph whose split (streaming, context parallel) was refused: ``what`` then, with its code, why."""
    return [f"graph {g.graph_id}: {what} [{code_value(getattr(g, 'replay_code', None)) or '-'}]: {g.replay_reason}"
            for g in graphs if g.replay is None]


def _context_parallel(g) -> bool:
    """Whether graph record ``g`` ran under ``context_parallel`` (split, or refused: whole on every rank)."""
    r, code = getattr(g, "replay", None), getattr(g, "replay_code", None)
    return bool(r and "context_parallel" in r) or (code is not None and RefusalCode(code).construct == "context parallel")


def code_value(code: Optional[RefusalCode]) -> Optional[str]:
    """A refusal code as its stable string value (JSON and tables), None for none."""
    return None if code is None else RefusalCode(code).value


def _refusal_codes(g: GraphRecord) -> tuple:
    """The code of each of ``g.refusals`` (None where a record has none)."""
    codes = tuple(getattr(g, "refusal_codes", ()))
    return codes + (None,) * (len(getattr(g, "refusals", ())) - len(codes))
