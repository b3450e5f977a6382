"""One op vocabulary: outside ``passes/spellings.py`` (and the op records it reads, ``passes/ops/``, which register
their spellings by call, one record per op) no module binds its own set of op spellings.

The test reads every module under ``passes/``, ``backends/`` and ``brcompile/`` with ``ast`` and looks at each
module-level assignment. A set / frozenset / tuple / list literal (or a dict literal's keys and values) anywhere
in the assigned value is an *op-name collection* when more than half of its plain elements (``*starred`` ones
read a table and are skipped) are op spellings; so an op -> op map is one, an op -> handler dispatch table is not:

- a string literal naming a callable ``torch.Tensor`` attribute (a ``call_method`` target, ``"view"``), an
  ``operator`` function (``"getitem"``), an ``aten`` op (``"index_select"``) or a qualified custom op
  (``"transformers::grouped_mm_fallback"``), but not a device type (``"cpu"``, ``"cuda"`` are Tensor methods too);
- an attribute chain rooted at ``torch``, ``operator``, ``aten``, ``F`` or a name the module imports from torch
  (``_nn``, ``predispatch``) that resolves to a callable (``torch.mul``; ``torch.float16`` is a dtype, not an
  op), or ``getattr(torch, "name", None)``. The project's own ops (``torch.ops.brcompile.*``) are not model
  vocabulary and are left to their module.
"""
from __future__ import annotations

import ast
import importlib
import operator
import pathlib
from typing import Any, Iterator, Optional

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("passes", "backends", "brcompile")
VOCABULARY = ROOT / "passes" / "spellings.py"
_MISSING = object()


def _modules() -> list[pathlib.Path]:
    """Every Python module of the three packages but the vocabulary itself."""
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if p != VOCABULARY)


def _is_device(word: str) -> bool:
    """Whether ``word`` names a device type (``"cpu"``), which is a Tensor method name by coincidence."""
    try:
        torch.device(word)
    except (RuntimeError, ValueError):
        return False
    return True


def _is_op_string(word: str) -> bool:
    """A ``call_method`` target (a callable Tensor attribute), an ``operator`` function's name (``"getitem"``, what
    ``op_name`` gives for ``operator.getitem``), an aten op name, or a qualified custom op name (``"ns::op"``); not
    a device type."""
    namespace, _, name = word.rpartition("::")
    if namespace and namespace.isidentifier() and name.isidentifier():
        return True
    if not word.isidentifier() or _is_device(word):
        return False
    if callable(getattr(torch.Tensor, word, None)) or callable(getattr(operator, word, None)):
        return True
    try:
        getattr(torch.ops.aten, word)
    except (AttributeError, RuntimeError):
        return False
    return True


def _torch_roots(tree: ast.Module) -> dict[str, Any]:
    """Names a module binds to torch / operator objects: ``torch``, ``operator``, ``F``, ``aten`` always, plus its
    own ``import torch.x as y`` / ``from torch.x import y`` bindings (resolved objects)."""
    roots: dict[str, Any] = {"torch": torch, "operator": operator, "F": torch.nn.functional,
                             "aten": torch.ops.aten}
    for stmt in tree.body:
        if isinstance(stmt, ast.Import):
            for a in stmt.names:
                if a.name.split(".")[0] in ("torch", "operator") and a.asname:
                    roots[a.asname] = importlib.import_module(a.name)
        elif isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.module.split(".")[0] == "torch":
            module = importlib.import_module(stmt.module)
            for a in stmt.names:
                roots[a.asname or a.name] = getattr(module, a.name, _MISSING)
        elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            chain = _chain(stmt.value)  # module aliases such as ``_nn = torch._C._nn``
            if chain and chain[0] in roots:
                roots[stmt.targets[0].id] = _resolve(chain, roots)
    return roots


def _chain(expr: ast.AST) -> Optional[list[str]]:
    """``a.b.c`` as ``["a", "b", "c"]`` (None for anything but a dotted name)."""
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    return [expr.id, *reversed(parts)]


def _resolve(chain: list[str], roots: dict[str, Any]) -> Any:
    obj = roots.get(chain[0], _MISSING)
    for part in chain[1:]:
        if obj is _MISSING:
            break
        try:
            obj = getattr(obj, part)
        except (AttributeError, RuntimeError):
            obj = _MISSING
    return obj


def _is_op_callable(expr: ast.AST, roots: dict[str, Any]) -> bool:
    """A dotted name into torch / operator that resolves to a callable op (not a dtype, not a brcompile op)."""
    chain = _chain(expr)
    if not chain or chain[0] not in roots or chain[:3] == ["torch", "ops", "brcompile"]:
        return False
    obj = _resolve(chain, roots)
    return obj is not _MISSING and callable(obj) and not isinstance(obj, type)


def _is_spelling(expr: ast.AST, roots: dict[str, Any]) -> bool:
    """An op string, a dotted name of a torch / operator op, or ``getattr(<torch root>, "<name>", ...)`` (an op
    that only some torch builds have)."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return _is_op_string(expr.value)
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "getattr" \
            and len(expr.args) >= 2 and isinstance(expr.args[1], ast.Constant):
        chain = _chain(expr.args[0])
        return bool(chain) and chain[0] in roots
    return _is_op_callable(expr, roots)


def _collections(value: ast.AST) -> Iterator[list[ast.AST]]:
    """The plain elements of every set / tuple / list literal and the keys and values of every dict literal in
    ``value``."""
    for node in ast.walk(value):
        if isinstance(node, (ast.Set, ast.Tuple, ast.List)):
            yield [e for e in node.elts if not isinstance(e, ast.Starred)]
        elif isinstance(node, ast.Dict):
            yield [k for k in node.keys if k is not None] + list(node.values)


def op_name_collections(source: str, label: str) -> list[str]:
    """``"<label>:<line> <name>"`` for each module-level assignment of ``source`` that binds an op-name
    collection."""
    tree = ast.parse(source, label)
    roots = _torch_roots(tree)
    found = []
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            targets, value = [stmt.target], stmt.value
        else:
            continue
        for elements in _collections(value):
            hits = sum(_is_spelling(e, roots) for e in elements)
            if hits and 2 * hits > len(elements):
                names = ", ".join(ast.unparse(t) for t in targets)
                found.append(f"{label}:{stmt.lineno} {names}")
                break
    return found


def test_no_module_binds_its_own_op_names():
    """Op-name sets live in passes/spellings.py (the records' families and named groups), read through ``spellings`` /
    ``is_op`` / the groups; a module-level set of op spellings anywhere else is a second vocabulary."""
    found = [hit for path in _modules() for hit in op_name_collections(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "op-name collections outside passes/spellings.py:\n" + "\n".join(found)


@pytest.mark.parametrize("source, flagged", [
    ('_CASTS = {"to", "long", "float"}', True),
    ('_MOVES = (torch.flatten, "flatten", operator.getitem)', True),
    ('X = frozenset({F.dropout, torch.dropout})', True),
    ('X = set(BINARY) | {torch.max, "max"}', True),
    ('X = {operator.iadd: operator.add, operator.imul: operator.mul}', True),
    ('FLOPS = {torch.ops.aten.mm: _mm_flop, torch.ops.aten.bmm: _bmm_flop}', False),
    ('_READS = [t for t in (getattr(torch, "a", None), torch.mm, torch.bmm) if t]', True),
    ('_GATHERS = ("getitem", "index_select")', True),
    ('G = [t for t in (getattr(torch, "_grouped_mm", None),) if t] + ["transformers::grouped_mm_fallback"]', True),
    ('_ROLES = ("q", "k", "v", "beta", "g")', False),
    ('DEVICES = frozenset({"cpu", "cuda"})', False),
    ('_HALF = (torch.float16, torch.bfloat16)', False),
    ('_REDUCTION = {0: "none", 1: "mean", 2: "sum"}', False),
    ('OPS = (torch.ops.brcompile.tree_cumsum.default,)', False),
    ('X = set(spellings("cast"))', False),
    ('X = {*spellings("cast"), *COPIES}', False),
])
def test_the_detector(source, flagged):
    """What counts as an op-name collection (module docstring): op strings and torch callables do; words,
    devices, dtypes, the project's own ops and reads of the vocabulary do not."""
    module = "import operator\nimport torch\nimport torch.nn.functional as F\n" + source + "\n"
    assert bool(op_name_collections(module, "probe.py")) is flagged
