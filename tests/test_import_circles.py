"""No two files of the package import each other, directly or around a longer loop, and no kernel
file takes another kernel file's private names (docs/architecture.md, "A layout that shows the
flow"). Every import counts: module level, inside functions, and those only for type checkers,
since each one is a dependency a reader must follow. The import-linter contracts
(``test_import_contracts.py``) order the packages; this holds the files inside them."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "deepbatch"


def module_files(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``package``."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imported_names(path: Path, module: str) -> list[tuple[str, str | None]]:
    """``(module, name)`` for each name ``path`` imports (name None for ``import module``), relative
    imports resolved against ``module``."""
    is_package = path.name == "__init__.py"
    base_package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                parts = base_package.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                source = ".".join(parts + ([source] if source else []))
            out += [(source, alias.name) for alias in node.names]
    return out


def dependency_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from pkg import mod`` names ``pkg.mod``; a
    module's own enclosing packages are not edges: importing a module runs them anyway)."""

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for source, name in imported_names(path, module):
            target = owner(f"{source}.{name}" if name else source)
            if target and target != module and not module.startswith(target + "."):
                graph[module].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
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
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_file_of_the_package_is_part_of_an_import_circle():
    found = circles(dependency_graph(module_files(PACKAGE)))
    assert not found, "import circles (each a set of modules that reach each other):\n" + "\n".join(
        ", ".join(c) for c in found)


def test_kernel_files_take_no_private_name_of_another_kernel_file():
    modules = module_files(PACKAGE)
    bad = []
    for module, path in modules.items():
        if not module.startswith("deepbatch.kernels."):
            continue
        for source, name in imported_names(path, module):
            if source.startswith("deepbatch.kernels") and source != module and name and name.startswith("_"):
                bad.append(f"{module} takes {name} from {source}")
    assert not bad, "share it through kernels/common.py or a named helper module:\n" + "\n".join(bad)


def test_the_circle_finder_finds_a_circle_and_nothing_else():
    # The check above is only as good as this: a loop of three is one circle, a chain none.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
