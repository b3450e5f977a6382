"""The layers import downwards only (docs/ARCHITECTURE.md §2): the passes and the ops never import the API
(brcompile.backend, brcompile.tools); the runtime imports neither the API nor the passes (it is built from its
frozen plan, and the refusal codes it counts live in brcompile.codes); and no library module imports
brcompile.testing (the contract's numbers live in brcompile.contract, which the runtime reads)."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = {"brcompile": "brcompile", "passes": "brcompile.passes", "backends": "brcompile.backends"}


def _modules():
    for folder, package in LAYERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield package, path


def _imported(path: pathlib.Path) -> set[str]:
    """Every module name an import statement anywhere in the file names (function-local ones included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


MODULES = list(_modules())


@pytest.mark.parametrize("package,path", MODULES, ids=[str(p.relative_to(ROOT)) for _, p in MODULES])
def test_imports_go_downwards(package, path):
    if path.name == "testing.py" and package == "brcompile":
        return
    names = _imported(path)
    assert not [n for n in names if _under(n, "brcompile.testing")], f"{path} imports brcompile.testing"
    if package in ("brcompile.passes", "brcompile.backends"):
        up = [n for n in names if _under(n, "brcompile.backend") or _under(n, "brcompile.tools")]
        assert not up, f"{path} imports the API layer: {up}"
    if package == "brcompile" and path.relative_to(ROOT).parts[:2] == ("brcompile", "runtime"):
        passes = [n for n in names if _under(n, "brcompile.passes")]
        assert not passes, f"{path}: the runtime is built from its plan (runtime/plan.py) and imports no pass: {passes}"
        up = [n for n in names if _under(n, "brcompile.backend") or _under(n, "brcompile.tools")]
        assert not up, f"{path} imports the API layer: {up}"


def test_the_runtime_is_checked():
    """The runtime rule above sees the runtime's modules (a moved folder would make it vacuous)."""
    runtime = [p for package, p in MODULES if p.relative_to(ROOT).parts[:2] == ("brcompile", "runtime")]
    assert len(runtime) >= 6 and any(p.name == "plan.py" for p in runtime)


def _private_imports(path: pathlib.Path) -> list[str]:
    """The leading-underscore names an import from a brcompile module (or a relative one) in the file takes."""
    return [f"{node.module}.{a.name}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("brcompile"))
            for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]


def test_ops_share_helpers_by_public_names():
    """The op modules read each other's helpers through public names (backends/scan/paths.py's ``in_layout_of``
    and ``prefix_rows``, which both scan modules read; backends/attention/cpu.py's kernels, which cached.py
    runs), never a leading-underscore name."""
    found = {str(p.relative_to(ROOT)): _private_imports(p) for pkg, p in MODULES if pkg == "brcompile.backends"}
    assert len(found) >= 20 and {k: v for k, v in found.items() if v} == {}


def test_backends_modules_stay_small():
    """No module of backends/ is over 700 lines (docs/ARCHITECTURE.md §2: one that outgrows it is split by meaning
    inside its op's folder)."""
    long = {str(p.relative_to(ROOT)): n for pkg, p in MODULES if pkg == "brcompile.backends"
            for n in [len(p.read_text().splitlines())] if n > 700}
    assert long == {}
