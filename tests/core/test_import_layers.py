"""The house's floors, read from the source with ``ast`` (no module is imported, so this
runs with no framework installed): core < launch < backends < plugins and testing < the
top-level modules (cli, api, compare, plot, ...). A module imports its own floor or lower
ones, never a higher one, and no two modules import each other, directly or through others.
Inside core the groups are floors too: errors and hashing < model and data < spec < run <
admission; every module of core stands in one of them.
Imports inside functions and under ``if TYPE_CHECKING:`` count: a lazy import is still a
dependency, only a later one.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import attrs

SOURCE = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "crosstrain"
FLOORS = {"core": 0, "launch": 1, "backends": 2, "plugins": 3, "testing": 3}
TOP_FLOOR = 4  # crosstrain itself and its top-level modules: cli, api, compare, plot, ...
#: the hook contract (markers and specs, importing pluggy only) that backends implement:
#: as low as core, so that a backend's plugin module may name ``hookimpl``
CONTRACTS = {f"{PACKAGE}.plugins.hookspecs": 0}
#: core's groups, lowest first: the model and the rows share a floor (neither needs the other),
#: the plan describes both, a run reads a plan, and admission checks a run before it starts
CORE_GROUPS = {"errors": 0, "hashing": 0, "model": 1, "data": 1, "spec": 2, "run": 3, "admission": 4}


@attrs.frozen
class Import:
    importer: str
    imported: str
    line: int

    def __str__(self) -> str:
        return f"{self.importer} (line {self.line}) imports {self.imported}"


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package under ``root``."""
    names = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _imported_names(node: ast.AST, package: str) -> Iterator[str]:
    """What one import statement names: for ``from A import b``, ``A.b`` (a module) and ``A``."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parent = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*parent, base] if base else parent)
        yield from (f"{base}.{alias.name}" for alias in node.names)
        yield base


def imports_of(root: Path) -> list[Import]:
    """Every import of a crosstrain module by another, wherever it stands in the file."""
    modules = module_names(root)
    found = set()
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            for imported in _imported_names(node, package):
                while imported and imported not in modules:  # a name inside a module: the module
                    imported = imported.rpartition(".")[0]
                if imported and imported != name:
                    found.add(Import(name, imported, getattr(node, "lineno", 0)))
    return sorted(found, key=lambda edge: (edge.importer, edge.imported, edge.line))


def floor(module: str) -> int:
    if module in CONTRACTS:
        return CONTRACTS[module]
    parts = module.split(".")
    return FLOORS.get(parts[1], TOP_FLOOR) if len(parts) > 1 else TOP_FLOOR


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def core_group(module: str) -> str | None:
    """The group of core a module stands in (``crosstrain.core.run.loop``: ``run``); None
    outside core and for core's own ``__init__``."""
    parts = module.split(".")
    return parts[2] if parts[:2] == [PACKAGE, "core"] and len(parts) > 2 else None


def core_group_problems(edges: list[Import], modules: list[str]) -> list[str]:
    """Modules of core outside every group, and imports of a higher group of core."""
    found = [
        f"ungrouped: {module} stands in none of core's groups ({', '.join(CORE_GROUPS)})"
        for module in modules
        if (group := core_group(module)) is not None and group not in CORE_GROUPS
    ]
    for edge in edges:
        importer, imported = core_group(edge.importer), core_group(edge.imported)
        if (
            importer in CORE_GROUPS
            and imported in CORE_GROUPS
            and CORE_GROUPS[imported] > CORE_GROUPS[importer]
        ):
            found.append(f"upward in core: {edge}")
    return found


def upward_imports(edges: list[Import]) -> list[str]:
    """Imports of a higher floor (a package's ``__init__`` may import its own children)."""
    return [
        f"upward: {edge}"
        for edge in edges
        if floor(edge.imported) > floor(edge.importer) and not _inside(edge.imported, edge.importer)
    ]


def imports_outside(edges: list[Import], package: str, allowed: tuple[str, ...]) -> list[str]:
    """Imports by ``package``'s modules of anything of crosstrain outside ``allowed``."""
    return [
        f"outside: {edge}"
        for edge in edges
        if _inside(edge.importer, package) and not any(_inside(edge.imported, a) for a in allowed)
    ]


def circles(edges: list[Import]) -> list[str]:
    """Modules that import each other, directly or through others (Tarjan's strongly
    connected components). A package's ``__init__`` re-exporting its own children is no circle."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.importer, set()).add(edge.imported)
        graph.setdefault(edge.imported, set())
    found = [component for component in _components(graph) if len(component) > 1]
    return [
        "circle: " + " <-> ".join(component)
        for component in found
        if not all(_inside(module, component[0]) for module in component)
    ]


def _components(graph: Mapping[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            components.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return components


def problems(root: Path) -> list[str]:
    edges = imports_of(root)
    return [
        *imports_outside(edges, f"{PACKAGE}.core", (f"{PACKAGE}.core",)),
        *imports_outside(edges, f"{PACKAGE}.launch", (f"{PACKAGE}.core", f"{PACKAGE}.launch")),
        *upward_imports(edges),
        *core_group_problems(edges, sorted(module_names(root))),
        *circles(edges),
    ]


# --------------------------------------------------------------------------- the source


def test_the_source_has_no_upward_import_and_no_circle() -> None:
    assert problems(SOURCE) == []


def test_the_source_is_read() -> None:
    """A guard for the test itself: it finds the package, its floors and lazy imports."""
    edges = {(edge.importer, edge.imported) for edge in imports_of(SOURCE)}
    assert ("crosstrain.cli", "crosstrain.api") in edges
    # imported inside a method, so that crosstrain imports without torch
    assert ("crosstrain.backends.torch.strategy", "crosstrain.backends.torch.launch") in edges
    assert ("crosstrain.core.run.loop", "crosstrain.core.spec.plan") in edges


# --------------------------------------------------------------------------- the check itself


def _write(root: Path, files: Mapping[str, str]) -> Path:
    for name, text in {"crosstrain/__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


LAYERED = {
    "crosstrain/core/__init__.py": "",
    "crosstrain/core/spec/plan.py": "import attrs\n",
    "crosstrain/launch/__init__.py": "from crosstrain.launch.store import serve\n",
    "crosstrain/launch/store.py": "from crosstrain.core.spec.plan import Plan\n",
    "crosstrain/backends/__init__.py": "",
    "crosstrain/backends/mine.py": "from crosstrain.launch import serve\nfrom ..core import plan\n",
    "crosstrain/plugins/__init__.py": "",
    "crosstrain/plugins/hookspecs.py": "",
    "crosstrain/api.py": "from crosstrain.backends import mine\n",
}


def test_a_layered_tree_passes(tmp_path: Path) -> None:
    assert problems(_write(tmp_path, LAYERED)) == []


def test_an_upward_import_inside_a_function_is_named_with_its_line(tmp_path: Path) -> None:
    lazy = "import attrs\n\ndef run() -> None:\n    from crosstrain.api import fit\n"
    found = problems(_write(tmp_path, {**LAYERED, "crosstrain/core/spec/plan.py": lazy}))
    assert "upward: crosstrain.core.spec.plan (line 4) imports crosstrain.api" in found
    assert "outside: crosstrain.core.spec.plan (line 4) imports crosstrain.api" in found


def test_core_and_launch_import_only_what_lies_below(tmp_path: Path) -> None:
    files = {
        **LAYERED,
        "crosstrain/core/spec/plan.py": "from crosstrain.plugins import hookspecs\n",
        "crosstrain/launch/store.py": "from crosstrain.backends.mine import x\n",
    }
    found = problems(_write(tmp_path, files))
    # the hook contract is as low as core, but core still imports only core
    assert "outside: crosstrain.core.spec.plan (line 1) imports crosstrain.plugins.hookspecs" in found
    assert "upward: crosstrain.launch.store (line 1) imports crosstrain.backends.mine" in found


def test_core_s_groups_are_floors_and_every_module_stands_in_one(tmp_path: Path) -> None:
    files = {
        **LAYERED,
        "crosstrain/core/run/loop.py": "from crosstrain.core.spec.plan import Plan\n",
        "crosstrain/core/model/graph.py": "from crosstrain.core.run.loop import fit\n",
        "crosstrain/core/helpers.py": "",
    }
    assert problems(_write(tmp_path, files)) == [
        "ungrouped: crosstrain.core.helpers stands in none of core's groups "
        "(errors, hashing, model, data, spec, run, admission)",
        "upward in core: crosstrain.core.model.graph (line 1) imports crosstrain.core.run.loop",
    ]


def test_the_package_itself_is_the_top_floor(tmp_path: Path) -> None:
    files = {**LAYERED, "crosstrain/backends/mine.py": "from crosstrain import fit\n"}
    assert problems(_write(tmp_path, files)) == [
        "upward: crosstrain.backends.mine (line 1) imports crosstrain"
    ]


def test_two_modules_importing_each_other_are_a_circle(tmp_path: Path) -> None:
    files = {
        **LAYERED,
        "crosstrain/backends/mine.py": "def go() -> None:\n    from crosstrain.backends.theirs import y\n",
        "crosstrain/backends/theirs.py": "from crosstrain.backends.mine import go\n",
    }
    assert problems(_write(tmp_path, files)) == [
        "circle: crosstrain.backends.mine <-> crosstrain.backends.theirs"
    ]
