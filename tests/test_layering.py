"""Imports point down only, and no two modules import each other (ARCHITECTURE.md, "Layout").

Every module of the distribution (mmserve/) is parsed and every import in it counts: at module
level, inside functions (the issue: "not even inside functions") and under `if TYPE_CHECKING:`
too, since a type-only import still ties the importer to the module above it and becomes a real
one as soon as it is used at run time. Only the source is read; nothing is imported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# package -> its directory
PACKAGE_DIRS = {"mmserve": ROOT / "mmserve"}

# Top to bottom; a module may import its own layer and any layer below. The data and utility
# modules sit below whoever uses them: request and inputs (what a request carries) are data of
# the engine and the runner; config (ServerConfig checks a --tool-parser name against the
# processors' registry) sits above processors and structured_output, which the engine and the
# front end use; everyone reads params, outputs and a constraint's params (data), errors and the
# settings helpers. `mmserve` itself (the package's lazy LLM / SamplingParams exports) is the top.
LAYERS: list[tuple[str, ...]] = [
    ("mmserve", "mmserve.server", "mmserve.entrypoints", "mmserve.bench"),
    ("mmserve.frontend",),
    ("mmserve.engine",),
    ("mmserve.speculative",),
    ("mmserve.runner",),
    ("mmserve.models",),
    ("mmserve.attention",),
    ("mmserve.kernels",),
    ("mmserve.request", "mmserve.inputs"),
    ("mmserve.config", "mmserve.envs", "mmserve.heap"),
    ("mmserve.processors", "mmserve.structured_output"),
    ("mmserve.params", "mmserve.outputs", "mmserve.structured_output.params"),
    ("mmserve.errors", "mmserve.settings"),
]
# (importer prefix, imported module): allowed upward imports by design. What the scheduler hands
# the runner is data, in its own module, so the runner imports data, not the scheduler.
ALLOWED_UP = {
    ("mmserve.runner", "mmserve.engine.sched_output"),
    ("mmserve.speculative", "mmserve.engine.sched_output"),  # (a draft model's plans: data)
}

# Violations found when this test was written. Each entry is a defect to remove, not a rule:
# fix it and delete the entry (the test fails while a listed entry no longer occurs, so the list
# only shrinks). ("up", importer, imported) is an import from a higher layer; ("cycle", *modules)
# is one strongly connected set of modules (sorted).
KNOWN_VIOLATIONS: set[tuple[str, ...]] = set()


def module_files() -> dict[str, Path]:
    """Dotted module name -> its file, for every module of the distribution."""
    modules: dict[str, Path] = {}
    for package, directory in PACKAGE_DIRS.items():
        for path in directory.rglob("*.py"):
            parts = path.relative_to(directory).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def imported_names(module: str, path: Path) -> Iterator[str]:
    """Every module name an import statement anywhere in the file names, relative ones
    resolved; `from X import Y` names X.Y (the caller falls back to X where Y is no module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the distribution it imports (the deepest known module each
    import names; itself excluded)."""
    modules = module_files()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = set()
        for name in imported_names(module, path):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def layer_of(module: str) -> int:
    """Index in LAYERS of the longest package prefix that contains the module (0 = top)."""
    best, best_len = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best is None or (best_len == len("mmserve") and module != "mmserve"):
        raise AssertionError(f"{module} is in no layer; add its package to LAYERS")
    return best


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    return {
        ("up", importer, imported)
        for importer, targets in graph.items()
        for imported in targets
        if layer_of(imported) < layer_of(importer)
        and not any(importer.startswith(p) and imported == m for p, m in ALLOWED_UP)
    }


def cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected sets of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[tuple[str, ...]] = set()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.add(("cycle", *sorted(members)))
    return found


def violations() -> set[tuple[str, ...]]:
    graph = import_graph()
    return upward_imports(graph) | cycles(graph)


def test_every_module_has_a_layer() -> None:
    for module in import_graph():
        layer_of(module)


def test_no_new_layering_violations() -> None:
    new = violations() - KNOWN_VIOLATIONS
    assert not new, "imports against the layering (ARCHITECTURE.md):\n" + "\n".join(
        map(repr, sorted(new))
    )


def test_known_violations_still_occur() -> None:
    fixed = KNOWN_VIOLATIONS - violations()
    assert not fixed, "fixed; delete from KNOWN_VIOLATIONS:\n" + "\n".join(map(repr, sorted(fixed)))


def test_the_checks_see_violations() -> None:
    graph = {"mmserve.kernels.a": {"mmserve.attention.b"}, "mmserve.attention.b": set()}
    assert upward_imports(graph) == {("up", "mmserve.kernels.a", "mmserve.attention.b")}
    ring = {"mmserve.bench.a": {"mmserve.bench.b"}, "mmserve.bench.b": {"mmserve.bench.a"}}
    assert cycles(ring) == {("cycle", "mmserve.bench.a", "mmserve.bench.b")}
