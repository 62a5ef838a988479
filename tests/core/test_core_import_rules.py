"""The rooms' import rules, read from the package's own source (every import statement: module level, inside
functions, under TYPE_CHECKING), so that the architecture stays what the layout says:

- the core (converters/, without converters/apps/) imports no format and no application;
- kernels import nothing above them (only kernels);
- a format imports the core, the kernels, formats/common and itself: no other format, no application;
- formats/common imports no format;
- no import circle anywhere in the package;
- and each format registers when it is imported alone (its checker families and scheme tables do not lean on
  another format having been imported first).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("converters", "formats", "kernels")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["qconvert", *parts])


def _modules() -> dict[str, Path]:
    found = {"qconvert": REPO / "__init__.py"}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            if "__pycache__" not in path.parts:
                found[_module_name(path)] = path
    return found


MODULES = _modules()


def _edges() -> dict[str, set[tuple[str, int]]]:
    """module -> {(imported qconvert module, line)}: `from X import a` counts as importing X.a where X.a is a
    module, else X; relative imports resolved against the module's package."""
    edges: dict[str, set[tuple[str, int]]] = {}
    for name, path in MODULES.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out = edges.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module for a in node.names]
            else:
                continue
            for target in targets:
                if target == "qconvert" or target.startswith("qconvert."):
                    while target not in MODULES and "." in target:  # `import qconvert.x.y.attr` forms
                        target = target.rpartition(".")[0]
                    out.add((target, node.lineno))
    return edges


EDGES = _edges()


def _room(module: str) -> str:
    if module.startswith("qconvert.converters.apps"):
        return "apps"
    if module.startswith("qconvert.converters"):
        return "core"
    if module.startswith("qconvert.formats.common"):
        return "formats.common"
    if module.startswith("qconvert.formats."):
        return "format:" + module.split(".")[2]
    if module == "qconvert.formats":
        return "formats"
    if module.startswith("qconvert.kernels"):
        return "kernels"
    return "root"


def _allowed(src: str, dst: str) -> bool:
    a, b = _room(src), _room(dst)
    if a == "core":
        return b in ("core", "kernels", "root")
    if a == "kernels":
        return b == "kernels"
    if a == "formats.common":
        return b in ("core", "kernels", "formats.common", "root")
    if a.startswith("format:"):
        return b in ("core", "kernels", "formats.common", "root", a)
    return True  # apps, the root package, formats/__init__: anything below them


def test_every_module_is_found():
    assert "qconvert.converters.run" in MODULES and "qconvert.formats.gguf.writer" in MODULES
    assert len(MODULES) > 100  # the walk found the package, not an empty folder


def test_imports_go_only_where_the_rooms_allow():
    bad = [f"{MODULES[src].relative_to(REPO)}:{line} imports {dst} ({_room(src)} -> {_room(dst)})"
           for src, targets in EDGES.items() for dst, line in sorted(targets) if not _allowed(src, dst)]
    assert not bad, "imports across the rooms' walls:\n" + "\n".join(bad)


def test_no_import_circle():
    graph = {m: {t for t, _ in EDGES[m] if t != m} for m in EDGES}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                cycles.append(path[path.index(t):] + [t] if t in path else [m, t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


_IMPORT_ALONE = r"""
import importlib, os, sys
import qconvert.converters.registry  # the core, as every format imports it
failed = []
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:  # a child that has imported no format yet
        try:
            importlib.import_module(name)
        except Exception as e:
            print(f"{name}: {type(e).__name__}: {e}", flush=True)
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status:
        failed.append(name)
sys.exit(1 if failed else 0)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork to import each format in a fresh child")
def test_each_format_imports_alone():
    formats = sorted(m for m in MODULES if m.count(".") == 2 and m.startswith("qconvert.formats.")
                     and MODULES[m].name == "__init__.py")
    assert "qconvert.formats.gguf" in formats and "qconvert.formats.common" in formats
    proc = subprocess.run([sys.executable, "-c", _IMPORT_ALONE, *formats], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
