"""The layers import downwards only (docs/ARCHITECTURE.md §2): the passes and the ops never import the API
(brcompile.backend, brcompile.tools), and no library module imports brcompile.testing (the contract's numbers
live in brcompile.contract, which the runtime reads)."""
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
