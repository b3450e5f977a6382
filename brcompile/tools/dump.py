"""Graph dumps: each captured graph before and after the rewrite, as readable Python and as Graphviz.

``brcompile.backend(dump_dir="dumps")`` (or ``torch.compile(..., options={"dump_dir": "dumps"})`` with the
entry-point backend) writes, per captured graph ``k`` (numbered per process and directory):

* ``graph_k_before.py`` — the graph the analysis read (for a rewritten graph: the captured graph as the
  pipeline's lowering and canonicalising stages left it; for a refused one: the graph of the refusing level), a
  header saying whether it was rewritten or why it fell back, and every node's token fact (``node.meta["br_axes"]``) with its shape;
* ``graph_k_after.py`` — the packed graph's code and, per node, the original node it came from (torch.fx's
  provenance, ``node.meta["from_node"]``: passes/meta.py ``origin_name``) and that node's fact (rewritten graphs
  only);
* ``graph_k_before.dot`` / ``graph_k_after.dot`` — the data-flow graphs for Graphviz, nodes coloured by
  kind: TOKEN values (per tree node: a shared prefix is computed once) green, DENSE values (the loss side,
  per row and position) orange, CONST values (parameters, sizes) grey, tree inputs of the packed graph
  blue, brcompile ops (tree attention, packed gathers, fused read-outs) purple, materialisations
  (``packed[index]``) yellow with a red border, the node a fallback stopped at red; a legend cluster says so;
* ``graph_k_<level>_<i>_<stage>.py`` — the graph as each pipeline stage that rewrites it left it
  (passes/pipeline.py: functionalise, canonicalise attention, computed keys, canonicalise scans), with its token
  facts where they are known: what the analysis read, step by step;
* ``.svg`` renderings of both when the ``dot`` binary is installed (Graphviz, e.g. ``apt-get install
  graphviz``); without it only the ``.dot`` files are written.

``TORCH_LOGS=+brcompile`` logs the before/after code of every graph instead (torch's logging accepts the
package name: it enables the ``brcompile`` logger and its children at DEBUG).
"""
from __future__ import annotations

import logging
import shutil
import subprocess
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

import torch
import torch.fx as fx

from brcompile.passes.meta import AXES, origin_name

log = logging.getLogger(__name__)

#: Fill colour per node kind (Graphviz colour names/hex), and the legend's wording.
COLOURS = {
    "token": ("#a6d96a", "TOKEN: once per tree node (shared prefixes computed once)"),
    "dense": ("#fdae61", "DENSE: per row and position (loss side)"),
    "const": ("#e0e0e0", "CONST: parameters, sizes, batch-independent"),
    "tree": ("#abd9e9", "tree input of the packed graph (index, end, ...)"),
    "brcompile": ("#c2a5cf", "brcompile op (tree attention, packed gather, fused read-out)"),
    "materialise": ("#ffffbf", "materialise: packed[index] -> dense"),
    "unknown": ("#ffffff", "no fact (analysis stopped before it)"),
}
SVG_TIMEOUT_S = 60

_counter_lock = threading.Lock()
_next_index: dict[str, int] = defaultdict(int)


def _next_graph_index(directory: Path) -> int:
    """0, 1, 2 ... per directory within this process (a rerun overwrites the previous run's files)."""
    key = str(directory.resolve())
    with _counter_lock:
        k = _next_index[key]
        _next_index[key] = k + 1
    return k


def _peek_graph_index(directory: Path) -> int:
    """The index the next :func:`dump_graphs` in ``directory`` will take (stage dumps come before it)."""
    with _counter_lock:
        return _next_index[str(directory.resolve())]


def dump_stage(dump_dir: str | Path, level: str, index: int, stage: str, gm: fx.GraphModule) -> Path:
    """Writes ``graph_k_<level>_<index>_<stage>.py``: the graph as pipeline stage ``stage`` (number ``index``
    in passes/pipeline.py: STAGES) left it at ``level``, k being the graph's number in ``dump_dir``."""
    directory = Path(dump_dir)
    directory.mkdir(parents=True, exist_ok=True)
    k = _peek_graph_index(directory)
    path = directory / f"graph_{k}_{level}_{index}_{stage.replace(' ', '_')}.py"
    path.write_text(before_source(gm, f'"""brcompile graph {k}: after stage {stage!r} ({level} level)"""\n'))
    return path


def _fact(node: fx.Node) -> Any:
    return AXES.get(node)


def kind_of(fact: Any) -> str:
    """'token' / 'dense' / 'const' of a TokenAxes fact, 'unknown' for None."""
    if fact is None:
        return "unknown"
    kind = getattr(fact, "kind", None)
    return str(getattr(kind, "value", kind)) if kind is not None else "unknown"


def _shape(node: fx.Node) -> str:
    v = node.meta.get("example_value", node.meta.get("val"))
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).replace('torch.', '')}[{', '.join(str(s) for s in v.shape)}]"
    return ""


def _target_name(node: fx.Node) -> str:
    t = node.target
    if node.op in ("placeholder", "output", "get_attr", "call_module", "call_method"):
        return f"{node.op} {t}" if node.op != "call_method" else f".{t}()"
    if getattr(t, "namespace", None) is not None:  # torch.ops.ns.op.overload
        return str(t)
    return getattr(t, "__name__", str(t))


def _is_brcompile(node: fx.Node) -> bool:
    t = node.target
    return node.op == "call_function" and (getattr(t, "namespace", None) == "brcompile"
                                           or getattr(t, "__module__", "").startswith("brcompile"))


def packed_kind(node: fx.Node, originals: dict[str, fx.Node]) -> str:
    """The colour kind of a packed-graph node (see COLOURS)."""
    if node.op == "placeholder" and node.name.startswith("tree_"):
        return "tree"
    if _is_brcompile(node):
        return "materialise" if getattr(node.target, "__name__", "") == "materialize" else "brcompile"
    origin = originals.get(origin_name(node) or (node.name if node.op == "placeholder" else ""))
    return kind_of(_fact(origin)) if origin is not None else "unknown"


def packed_kinds(packed: fx.GraphModule, originals: dict[str, fx.Node]) -> dict[fx.Node, str]:
    """:func:`packed_kind` of every packed node; a node with no origin (emitted glue: views, getitem of a
    tree array) takes the kind of its inputs: token if any is token or a brcompile op, tree if all are tree
    inputs, else dense if any is dense, else const."""
    kinds: dict[fx.Node, str] = {}
    for n in packed.graph.nodes:
        k = packed_kind(n, originals)
        if k == "unknown" and n.op != "placeholder":
            ins = {kinds.get(a, "unknown") for a in n.all_input_nodes}
            if ins & {"token", "brcompile"}:
                k = "token"
            elif ins and ins <= {"tree"}:
                k = "tree"
            elif "dense" in ins or "materialise" in ins:
                k = "dense"
            elif ins and ins <= {"const", "tree"}:
                k = "const"
        kinds[n] = k
    return kinds


def _dot_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def graph_to_dot(gm: fx.GraphModule, title: str, kinds: dict[fx.Node, str],
                 failed_node: Optional[str] = None) -> str:
    """Graphviz DOT of ``gm``'s data flow: one box per node (name, op, shape, kind), filled by ``kinds``."""
    lines = [f'digraph "{_dot_escape(title)}" {{', "  rankdir=TB;",
             f'  label="{_dot_escape(title)}"; labelloc=t; fontname="Helvetica";',
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
             "  subgraph cluster_legend {", '    label="legend"; style=dashed;']
    used = sorted(set(kinds.values()), key=list(COLOURS).index)
    for k in used:
        colour, words = COLOURS[k]
        lines.append(f'    "legend_{k}" [label="{_dot_escape(words)}", fillcolor="{colour}"];')
    lines.append("  }")
    ids = {n: f"n{i}" for i, n in enumerate(gm.graph.nodes)}
    for n in gm.graph.nodes:
        k = kinds.get(n, "unknown")
        colour = COLOURS[k][0]
        label = "\n".join(x for x in (n.name, _target_name(n), _shape(n), k) if x)
        extra = ""
        if k == "materialise":
            extra = ', color="#d7191c", penwidth=2'
        if failed_node is not None and n.name == failed_node:
            extra = ', color="#d7191c", penwidth=4, fontcolor="#d7191c"'
        lines.append(f'  {ids[n]} [label="{_dot_escape(label)}", fillcolor="{colour}"{extra}];')
    for n in gm.graph.nodes:
        for a in n.all_input_nodes:
            lines.append(f"  {ids[a]} -> {ids[n]};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _comment_block(title: str, rows: list[str]) -> str:
    return "\n".join([f"# {title}"] + [f"#   {r}" for r in rows]) + "\n"


def before_source(gm: fx.GraphModule, header: str) -> str:
    """The captured graph as Python: a header, the code, and every node's token fact and shape."""
    width = max((len(n.name) for n in gm.graph.nodes), default=4)
    facts = [f"{n.name.ljust(width)}  {str(_fact(n) or '-').ljust(22)}  {_shape(n)}".rstrip()
             for n in gm.graph.nodes if n.op != "output"]
    return header + "\n" + gm.code.strip("\n") + "\n\n\n" + _comment_block(
        "token facts (node.meta['br_axes']): token = computed once per tree node, dense = per (row, position)",
        facts)


def after_source(packed: fx.GraphModule, originals: dict[str, fx.Node], header: str) -> str:
    """The packed graph as Python: a header, the code, and per node its origin and that origin's fact."""
    width = max((len(n.name) for n in packed.graph.nodes), default=4)
    rows = []
    kinds = packed_kinds(packed, originals)
    for n in packed.graph.nodes:
        if n.op == "output":
            continue
        origin = origin_name(n)
        kind = kinds[n]
        rows.append(f"{n.name.ljust(width)}  <- {(origin or '-').ljust(width)}  {kind}")
    return header + "\n" + packed.code.strip("\n") + "\n\n\n" + _comment_block(
        "packed node <- original node (meta['from_node']) and its kind", rows)


def render_svg(dot_file: Path) -> Optional[Path]:
    """``dot -Tsvg`` next to ``dot_file`` when Graphviz's ``dot`` is installed; the .svg path or None."""
    exe = shutil.which("dot")
    if exe is None:
        return None
    svg = dot_file.with_suffix(".svg")
    try:
        subprocess.run([exe, "-Tsvg", str(dot_file), "-o", str(svg)], check=True, capture_output=True,
                       timeout=SVG_TIMEOUT_S)
    except (subprocess.SubprocessError, OSError) as e:
        log.warning("brcompile dump: rendering %s with dot failed: %s", dot_file, e)
        return None
    return svg


def dump_graphs(dump_dir: str | Path, before: fx.GraphModule, after: Optional[fx.GraphModule] = None, *,
                reason: Optional[str] = None, failed_node: Optional[str] = None) -> list[Path]:
    """Writes the files of one captured graph (module docstring) under ``dump_dir``; returns their paths.

    ``after`` is the packed graph (None for a graph that fell back, with ``reason``/``failed_node``).
    """
    directory = Path(dump_dir)
    directory.mkdir(parents=True, exist_ok=True)
    k = _next_graph_index(directory)
    stem = f"graph_{k}"
    status = "REWRITTEN" if after is not None else f"FELL BACK at {failed_node or '-'}: {reason}"
    header = f'"""brcompile graph {k}: {status}"""\n'
    originals = {n.name: n for n in before.graph.nodes}
    written: list[Path] = []

    def write(name: str, text: str) -> Path:
        path = directory / name
        path.write_text(text)
        written.append(path)
        return path

    write(f"{stem}_before.py", before_source(before, header))
    dot = write(f"{stem}_before.dot", graph_to_dot(
        before, f"graph {k} before ({'rewritten' if after is not None else 'fell back'})",
        {n: kind_of(_fact(n)) for n in before.graph.nodes}, failed_node))
    dots = [dot]
    if after is not None:
        write(f"{stem}_after.py", after_source(after, originals, header))
        dots.append(write(f"{stem}_after.dot", graph_to_dot(
            after, f"graph {k} after (packed)", packed_kinds(after, originals))))
    for d in dots:
        svg = render_svg(d)
        if svg is not None:
            written.append(svg)
    log.info("brcompile: dumped graph %d to %s", k, directory)
    return written


__all__ = ["COLOURS", "after_source", "before_source", "dump_graphs", "graph_to_dot", "kind_of", "packed_kind",
           "packed_kinds", "render_svg"]
