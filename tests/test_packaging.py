"""Packaging and layering rules that keep the project's shape."""

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    mapping = {"kvpoold": "kvpoold", "client": "kvpool", "kernels": "kvpool.kernels"}
    found = set()
    for top, name in mapping.items():
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    assert found == listed


def _imported_modules(tree: ast.AST, package: str):
    """Every module an AST imports, anywhere (module level, functions, methods), absolute names."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                yield node.lineno, ".".join(base + ([node.module] if node.module else []))
            else:
                yield node.lineno, node.module or ""


def test_client_and_kernels_never_import_the_daemon():
    """kvpool (client/) and kvpool.kernels (kernels/) stand alone: the daemon imports them, never the reverse."""
    offenders = []
    checked = 0
    for top, name in {"client": "kvpool", "kernels": "kvpool.kernels"}.items():
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT / top)
            package = ".".join([name, *rel.parent.parts])
            tree = ast.parse(path.read_text(), str(path))
            checked += 1
            for lineno, module in _imported_modules(tree, package):
                if module == "kvpoold" or module.startswith("kvpoold."):
                    offenders.append(f"{path.relative_to(ROOT)}:{lineno} imports {module}")
    assert checked > 10
    assert not offenders, "\n".join(offenders)


def test_core_imports_nothing_heavy():
    banned = {"torch", "cupy", "numba", "grpc", "os", "io", "socket", "pathlib", "mmap"}
    for path in (ROOT / "kvpoold" / "core").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [(node.module or "").split(".")[0]]
            assert not banned & set(names), f"{path.name} imports {banned & set(names)}"
    # and what it imports (the shared figures of kvpool.protocol) pulls none of them in either
    code = (
        "import sys, kvpoold.core; heavy = {'grpc', 'torch', 'numba', 'cupy'} & set(sys.modules);"
        "assert not heavy, f'importing kvpoold.core imported {heavy}'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def _protocol_sources():
    """The hand-written modules of kvpool.protocol (the generated ``*_pb2*`` ones are gRPC's by design)."""
    return [p for p in sorted((ROOT / "client" / "protocol").glob("*.py")) if "_pb2" not in p.name]


def test_protocol_imports_neither_side_nor_grpc_nor_numba():
    """kvpool.protocol is the vocabulary both sides import: it imports neither of them, nor gRPC or Numba."""
    offenders = []
    sources = _protocol_sources()
    for path in sources:
        tree = ast.parse(path.read_text(), str(path))
        for lineno, module in _imported_modules(tree, "kvpool.protocol"):
            top = module.split(".")[0]
            other_client_module = top == "kvpool" and not (module + ".").startswith("kvpool.protocol.")
            if top in {"grpc", "kvpoold", "numba"} or other_client_module:
                offenders.append(f"{path.relative_to(ROOT)}:{lineno} imports {module}")
    assert {"errors.py", "layout.py", "sizes.py"} <= {p.name for p in sources}
    assert not offenders, "\n".join(offenders)
    modules = ", ".join(f"kvpool.protocol.{p.stem}" for p in sources if p.stem != "__init__")
    code = (
        f"import sys, {modules}; pulled = {{m.split('.')[0] for m in sys.modules}} & {{'grpc', 'kvpoold', 'numba'}};"
        "assert not pulled, f'importing kvpool.protocol imported {pulled}'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_core_imports_only_the_protocol_from_the_client():
    """The daemon's core shares the protocol's vocabulary and nothing else of the client package."""
    offenders = []
    for path in (ROOT / "kvpoold" / "core").glob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for lineno, module in _imported_modules(tree, "kvpoold.core"):
            if module.split(".")[0] == "kvpool" and not (module + ".").startswith("kvpool.protocol."):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno} imports {module}")
    assert not offenders, "\n".join(offenders)


def test_cpu_path_never_imports_cupy():
    code = (
        "import sys, kvpool, kvpoold.server.app, kvpool.kernels, kvpoold.memory.cpu_shm;"
        "assert 'cupy' not in sys.modules, 'cupy imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def _run_in_checkout(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_kernels_folder_gives_the_top_level_name_to_the_installed_kernels_package():
    """From the checkout's root, kernels/ is also importable as top-level ``kernels``, the import
    name of Hugging Face's ``kernels`` (a dependency of transformers from 5.25, which imports it):
    that import gets the installed package, and transformers imports from here."""
    import importlib.metadata

    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("no `kernels` distribution installed here")
    got = _run_in_checkout("-c", "import kernels; print(kernels.__file__)")
    assert got.returncode == 0, got.stderr
    assert not Path(got.stdout.strip()).resolve().is_relative_to(ROOT)
    pytest.importorskip("transformers")
    got = _run_in_checkout("-c", "from transformers.integrations import hub_kernels; import kvpool.kernels as k; "
                                 "print(k.paged_decode_attention.__module__)")  # fmt: skip
    assert got.returncode == 0 and got.stdout.strip() == "kvpool.kernels.attention", got.stderr


def test_without_a_kernels_package_the_top_level_import_is_an_empty_package():
    """-S: no site-packages, so no installed ``kernels``; the checkout's root first on the path.
    The folder imports as an empty package with no version (what transformers takes for an
    absent ``kernels``), and kvpool's kernels never load under that name."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); import kernels; "
            "print(hasattr(kernels, '__version__'), hasattr(kernels, 'paged_decode_attention'), "
            "any(m.startswith('kernels.') and m != 'kernels._top_level' for m in sys.modules))")  # fmt: skip
    got = _run_in_checkout("-S", "-c", code)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["False", "False", "False"]
