"""kvpoold/server is layered: its modules import each other one way only.

A cycle, even one that only a ``TYPE_CHECKING`` block closes, means two modules
know each other's insides: pass the few values or callables used instead (see
the module map in ``kvpoold/server/__init__.py``).  The packages split into modules by
job (``kvpoold.config``, ``kvpoold.transfer``, ``kvpool.kernels``) are held to the same rule.
"""

import ast
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parents[2] / "kvpoold" / "server"
PACKAGE = "kvpoold.server"


def _imports(path: Path, modules: set[str], package: str = PACKAGE) -> set[str]:
    """The modules of ``modules`` (of ``package``) that ``path`` imports anywhere (functions and TYPE_CHECKING
    blocks too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package if node.level == 1 else (node.module or "")
            if node.level == 1 and node.module:
                base = f"{package}.{node.module}"
            # `from . import convert` and `from kvpoold.server import convert` name modules
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        out |= {name.removeprefix(package + ".") for name in names if name.startswith(package + ".")} & modules
    return out


def import_graph(folder: Path, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module name (without the package) -> the modules of the same folder it imports."""
    modules = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    return {name: _imports(folder / f"{name}.py", modules, package) - {name} for name in sorted(modules)}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done (no cycle through it)
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        path.pop()
        state[name] = 2
        return None

    for name in graph:
        if name not in state:
            found = visit(name)
            if found:
                return found
    return None


def test_the_finder_reports_a_cycle_closed_by_a_type_checking_import(tmp_path):
    """The check itself: a cycle that only a TYPE_CHECKING import closes is found and named."""
    (tmp_path / "a.py").write_text("from .b import B\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n")
    (tmp_path / "c.py").write_text("def f():\n    from kvpoold.server import a\n")
    (tmp_path / "d.py").write_text("from . import a\n")
    graph = import_graph(tmp_path)
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    (tmp_path / "c.py").write_text("import kvpoold.server.d\n")
    assert find_cycle(import_graph(tmp_path)) == ["a", "b", "c", "d", "a"]
    (tmp_path / "c.py").write_text("from kvpoold.core import Geometry\n")
    assert find_cycle(import_graph(tmp_path)) is None


def test_server_modules_import_each_other_one_way():
    graph = import_graph(SERVER)
    assert len(graph) > 10 and graph["servicer"], graph  # the parse found the modules and their imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in kvpoold/server: " + " -> ".join(cycle)


def test_convert_imports_only_the_call_types_of_the_server():
    """The converters sit below the service: they know the call and result types, not who makes them."""
    assert import_graph(SERVER)["convert"] == {"calls"}


@pytest.mark.parametrize("folder, package, module", [
    ("kvpoold/config", "kvpoold.config", "load"),
    ("kvpoold/transfer", "kvpoold.transfer", "engine"),
    ("kernels", "kvpool.kernels", "cuda_attention"),
])
def test_packages_split_by_job_import_each_other_one_way(folder, package, module):
    """The packages whose modules were split by job keep their parts in one direction too."""
    graph = import_graph(SERVER.parents[1] / folder, package)
    assert len(graph[module]) >= 3, graph  # the parse found the parts this module composes
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle in {folder}: " + " -> ".join(cycle)
