"""The package's import graph: no circles (imports inside functions count too), vLLM only in vllm_plugin/, and
no environment reads under kernels/. Parsed from the source, so it fails on the line that breaks a rule."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "anychip"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported name, line) for every import in the file, at any depth: `from a.b import c` yields a.b.c (when
    c is a module, that is the dependency) and a.b (when c is a name defined in a.b)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = _module(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append((base, node.lineno))
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        names = {target for target, _ in _imports(path)}
        for target in names:
            # `from pkg import mod` depends on pkg.mod, not on what pkg/__init__ does
            if target in files and target != module and not any(n.startswith(target + ".") and n in files
                                                                   for n in names):
                graph[module].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles() -> None:
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_vllm_is_imported_only_in_the_plugin() -> None:
    offenders = [f"{p.relative_to(PACKAGE.parent)}:{line}" for p in PACKAGE.rglob("*.py")
                 if "vllm_plugin" not in p.parts
                 for target, line in _imports(p) if target == "vllm" or target.startswith("vllm.")]
    assert offenders == []


def test_kernels_read_no_environment() -> None:
    offenders = []
    for path in (PACKAGE / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                name = node.attr
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                    "forced_isa", "fallback_allowed", "build_dir", "kernel_policy", "coverage_path"):
                name = node.func.attr
            if name:
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} ({name})")
    assert offenders == []
