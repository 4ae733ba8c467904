"""No import circles among the project's modules, nor among jax_engine's folders: each layer's contract types sit
below what uses them, and a folder (a subpackage) is a layer too.

Imports under `if TYPE_CHECKING:` are left out: they never run, and an annotation may name a type from above.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("reference", "jax_engine", "pallas_kernels")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_statements(tree: ast.AST):
    """Every import statement, at module level or inside a function (a deferred import that only works because
    it runs late is a circle too), except those under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack += node.orelse
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack += ast.iter_child_nodes(node)


def imported_modules(source: str, modules: set[str]) -> set[str]:
    """The modules among `modules` that `source` imports.

    `from package import name` counts as importing the submodule `package.name` when there is one.
    """
    targets = set()
    for node in _import_statements(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & modules
            targets |= submodules or {node.module}
    return targets & modules


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports. A package's own modules importing its `__init__` are not
    counted (Python runs `__init__` first anyway)."""
    paths = {_module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        targets = imported_modules(path.read_text(), paths.keys())
        graph[name] = {t for t in targets if t != name and not name.startswith(t + ".")}
    return graph


def folder_of(module: str) -> str | None:
    """The folder a module lies in, as a layer: a subpackage of jax_engine (jax_engine.server for
    jax_engine.server.app), or another top-level package. None for jax_engine's own top-level modules: the
    engine's core, which every folder builds on and which wires the folders together (circles through them
    are module circles, found by the module check)."""
    parts = module.split(".")
    if parts[0] != "jax_engine":
        return parts[0]
    is_package = (ROOT / pathlib.Path(*parts)).is_dir()
    return ".".join(parts[:2]) if len(parts) > 2 or (len(parts) == 2 and is_package) else None


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """folder -> the other folders its modules import."""
    folders: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = folder_of(module)
        if source is not None:
            folders.setdefault(source, set())
            folders[source] |= {folder_of(t) for t in targets} - {source, None}
    return {folder: {t for t in targets if t in folders} for folder, targets in folders.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_module_imports_itself_through_others():
    assert find_cycle(import_graph()) is None


def test_no_folder_imports_itself_through_others():
    graph = import_graph()
    cycle = find_cycle(folder_graph(graph))
    edges = [] if cycle is None else [(m, t) for a, b in zip(cycle, cycle[1:]) for m in graph if folder_of(m) == a
                                      for t in graph[m] if folder_of(t) == b]
    assert cycle is None, f"folders in a circle: {' -> '.join(cycle)}, through {edges}"


def test_the_checker_sees_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_checker_sees_a_folder_circle_and_not_the_core_between_folders():
    graph = {"jax_engine.server.app": {"jax_engine.llm_engine"}, "jax_engine.llm_engine": {"jax_engine.core.x"},
             "jax_engine.core.x": {"jax_engine.sequence"}, "jax_engine.sequence": set()}
    assert find_cycle(folder_graph(graph)) is None
    graph["jax_engine.core.x"].add("jax_engine.server.app")
    graph["jax_engine.server.app"].add("jax_engine.core.x")
    assert find_cycle(folder_graph(graph)) == ["jax_engine.core", "jax_engine.server", "jax_engine.core"]


def test_imports_for_type_checking_only_are_left_out():
    source = ("from typing import TYPE_CHECKING\nimport a\nif TYPE_CHECKING:\n    import b\nelse:\n    import c\n"
              "def f():\n    from d import e\n")
    assert imported_modules(source, {"a", "b", "c", "d", "d.e"}) == {"a", "c", "d.e"}
