"""The import graph of ``src/``: packages in layers, no cycles between modules, imports at the top.

The packages form layers (:data:`LAYERS`, bottom first): ``core`` (what every layer shares: errors and their
fixes, the model protocol, the node's probe, signals, exit statuses), then the models and the data, then the
runtime and schedules (``strategies``), then the planner, then the recipe by job (``recipe.report``, ``recipe.check``, ``recipe.worker``, ``recipe.launch``),
then the package
root (its console commands). No import runs upwards, module-level or inside a function, and packages of one
layer do not import each other.

Every module is read with :mod:`ast` (nothing is imported), each import of the project's own modules is resolved to a
module name under ``pipeline_recipes`` (the folders of ``src/`` map onto it as ``pyproject.toml``'s
``[tool.setuptools.package-dir]`` says), and the graph of module-level imports must have no cycle: modules in a cycle
load in one order only. Nor may a function-local import close one (it hides the cycle without removing it). Imports
under ``if TYPE_CHECKING:`` do not run and are not edges. An import from a package (``from pkg import name``) is an
edge to the package's ``__init__``, and also to the submodule when ``name`` is one or when the package's ``_EXPORTS``
table (read by its lazy ``__getattr__``) names the submodule that holds ``name``.

A function-local import of a project module is allowed where it has a reason, at most ``LOCAL_IMPORT_BUDGET`` of them,
each with ``# local: <reason>`` on its line (a measured import cost, a lazy attribute of a package).
"""

from __future__ import annotations

import ast
import functools
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "pipeline_recipes"
LOCAL_IMPORT_BUDGET = 10
REASON = "# local:"
LAYERS: tuple[tuple[str, ...], ...] = (
    ("core",), ("models", "datamodules"),
    ("strategies.schedules",), ("strategies.compute",), ("strategies.runtime", "strategies"),  # strategies/*.py:
    ("strategies.harness", "strategies.lightning"),                                           # checkpoints
    ("planner",),
    ("recipe.report",), ("recipe.check",), ("recipe.worker",), ("recipe.launch", "recipe"),  # recipe/ by job
    ("",))  # "": the package root, pipeline_recipes itself


@dataclass(frozen=True)
class Import:
    """One import statement of a project module: where it is, what it names, and whether it runs at import time."""

    importer: str
    targets: tuple[str, ...]
    path: Path
    line: int
    local: bool
    has_reason: bool


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """Import name of each package folder, from ``pyproject.toml``."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    return {name: root / folder for name, folder in config["tool"]["setuptools"]["package-dir"].items()}


def module_files(dirs: dict[str, Path]) -> dict[str, tuple[Path, bool]]:
    """Every module: its name, its file, and whether it is a package ``__init__``."""
    modules: dict[str, tuple[Path, bool]] = {}
    for package, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            name = ".".join((package, *parts[:-1])) if is_package else ".".join((package, *parts))
            modules[name] = (path, is_package)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Each import statement that runs, with whether it sits inside a function (``if TYPE_CHECKING:`` left out)."""

    def walk(node: ast.AST, local: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, local
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for branch in child.orelse:
                    yield from walk(ast.Module(body=[branch], type_ignores=[]), local)
            else:
                inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                yield from walk(child, inner)

    yield from walk(tree, False)


def lazy_exports(modules: dict[str, tuple[Path, bool]]) -> dict[str, dict[str, str]]:
    """Package -> its ``_EXPORTS`` table (name -> submodule), which its ``__getattr__`` imports on first use."""
    tables = {}
    for name, (path, is_package) in modules.items():
        if not is_package:
            continue
        for node in ast.parse(path.read_text()).body:
            named = isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_EXPORTS"
                                                         for t in node.targets)
            if named:
                tables[name] = {k: f"{name}.{v}" for k, v in ast.literal_eval(node.value).items()}
    return tables


def _resolve(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool,
             modules: dict[str, tuple[Path, bool]], lazy: dict[str, dict[str, str]]) -> tuple[str, ...]:
    """The project modules one import statement loads (the deepest existing module each name refers to; a name of a
    package's ``_EXPORTS`` table also loads the submodule it names)."""

    def deepest(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found: list[str] = []
    if isinstance(node, ast.Import):
        found += [m for alias in node.names if alias.name.startswith(PACKAGE) and (m := deepest(alias.name))]
    else:
        if node.level:
            base = importer if is_package else importer.rpartition(".")[0]
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            source = f"{base}.{node.module}" if node.module else base
        else:
            source = node.module or ""
        if source == PACKAGE or source.startswith(f"{PACKAGE}."):
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    found.append(f"{source}.{alias.name}")
                elif module := deepest(source):
                    found.append(module)
                    if alias.name in lazy.get(module, {}):
                        found.append(lazy[module][alias.name])
    return tuple(dict.fromkeys(m for m in found if m != importer))


@functools.cache
def project_imports(root: Path = ROOT) -> list[Import]:
    """Every import of a project module in ``src/``, module-level and function-local."""
    modules = module_files(package_dirs(root))
    lazy = lazy_exports(modules)
    found = []
    for name, (path, is_package) in modules.items():
        source = path.read_text()
        lines = source.splitlines()
        for node, local in _imports(ast.parse(source, filename=str(path))):
            if targets := _resolve(node, name, is_package, modules, lazy):
                span = lines[node.lineno - 1:node.end_lineno]
                found.append(Import(name, targets, path, node.lineno, local, any(REASON in line for line in span)))
    return found


def import_graph(imports: list[Import], *, local: bool = False) -> dict[str, set[str]]:
    """Module -> the project modules it imports when it is imported (with ``local``: also inside its functions)."""
    graph: dict[str, set[str]] = {}
    for item in imports:
        if local or not item.local:
            graph.setdefault(item.importer, set()).update(item.targets)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle through each module that lies on one, as a path ``[a, b, …, a]``; no duplicates."""
    found: list[list[str]] = []
    seen: set[tuple[str, ...]] = set()
    for start in sorted(graph):
        parents: dict[str, str] = {}
        frontier = [start]
        path = None
        while frontier and path is None:
            following = []
            for node in frontier:
                for target in sorted(graph.get(node, ())):
                    if target == start:
                        path = [start]
                        while node != start:
                            path.append(node)
                            node = parents[node]
                        path = [start, *reversed(path[1:]), start]
                        break
                    if target not in parents:
                        parents[target] = node
                        following.append(target)
                if path is not None:
                    break
            frontier = following
        if path is not None:
            ring = path[:-1]
            turn = ring.index(min(ring))
            key = tuple(ring[turn:] + ring[:turn])
            if key not in seen:
                seen.add(key)
                found.append([*key, key[0]])
    return found


def _short(name: str) -> str:
    return name.removeprefix(f"{PACKAGE}.")


# -- the project --------------------------------------------------------------------------------


def _listed(found: list[list[str]]) -> str:
    return "\n".join(" -> ".join(map(_short, cycle)) for cycle in found)


def test_no_import_cycles_between_modules() -> None:
    found = cycles(import_graph(project_imports()))
    assert not found, f"{len(found)} import cycle(s) between modules (move the shared piece to the lower module, or " \
        f"import a narrower module):\n{_listed(found)}"


def test_no_cycle_is_hidden_by_a_function_local_import() -> None:
    found = cycles(import_graph(project_imports(), local=True))
    assert not found, f"{len(found)} import cycle(s) closed by a function-local import (the local import only hides " \
        f"the cycle; move the shared piece to the lower module):\n{_listed(found)}"


def test_function_local_imports_of_project_modules_have_a_reason_and_stay_few() -> None:
    local = [item for item in project_imports() if item.local]
    where = [f"{item.path.relative_to(ROOT)}:{item.line} -> {', '.join(map(_short, item.targets))}" for item in local]
    unexplained = [line for line, item in zip(where, local) if not item.has_reason]
    assert not unexplained, f"function-local imports of project modules without '{REASON} <reason>' on their line " \
        f"(move them to the top of the module):\n" + "\n".join(unexplained)
    assert len(local) <= LOCAL_IMPORT_BUDGET, \
        f"{len(local)} function-local imports of project modules, at most {LOCAL_IMPORT_BUDGET}:\n" + "\n".join(where)


def package_of(module: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> str:
    """The package of :data:`LAYERS` a module belongs to, the longest that holds it (``strategies.runtime`` for
    ``pipeline_recipes.strategies.runtime.engine``, ``strategies`` for ``…strategies.checkpoint``; "" for the
    package root's own modules)."""
    rest = module.removeprefix(PACKAGE).removeprefix(".")
    listed = sorted((p for layer in layers for p in layer if p), key=len, reverse=True)
    return next((p for p in listed if rest == p or rest.startswith(f"{p}.")), "")


def layer_violations(imports: list[Import], layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """Each import (module-level or local) of a module of a higher layer, or of another package of the same
    layer, as ``path:line importer -> target``."""
    rank = {package: i for i, layer in enumerate(layers) for package in layer}
    found = []
    for item in imports:
        source = package_of(item.importer, layers)
        for target in item.targets:
            other = package_of(target, layers)
            if other != source and rank[other] >= rank[source] and not source.startswith(f"{other}."):
                found.append(f"{item.path.name}:{item.line} {_short(item.importer)} -> {_short(target)}")
    return found


def test_no_import_runs_upwards_between_the_layers() -> None:
    found = layer_violations(project_imports())
    order = " < ".join("/".join(p or "pipeline_recipes" for p in layer) for layer in LAYERS)
    assert not found, f"{len(found)} import(s) against the layers ({order}): move the shared piece down " \
        "(core holds what every layer shares):\n" + "\n".join(found)


# -- the checker itself, on a package written here --------------------------------------------


def test_an_upward_or_sideways_import_is_found_local_ones_too(tmp_path: Path) -> None:
    root = _write(tmp_path, {
        "core/__init__.py": "",
        "core/low.py": "def f():\n    from ..extra import high  # local: reason given, still upwards\n",
        "extra/__init__.py": "",
        "extra/high.py": f"from {PACKAGE}.core import low\n",
        "side/__init__.py": "",
        "side/peer.py": f"from {PACKAGE}.extra import high\n",
    })
    (root / "pyproject.toml").write_text((root / "pyproject.toml").read_text() + f'"{PACKAGE}.side" = "src/side"\n')
    found = layer_violations(project_imports(root), (("core",), ("extra", "side")))
    assert found == ["low.py:2 core.low -> extra.high", "peer.py:1 side.peer -> extra.high"]




def _write(root: Path, files: dict[str, str]) -> Path:
    (root / "pyproject.toml").write_text(f'[tool.setuptools.package-dir]\n{PACKAGE} = "src/top"\n'
                                         f'"{PACKAGE}.core" = "src/core"\n"{PACKAGE}.extra" = "src/extra"\n')
    files = {"top/__init__.py": "", **files}
    for name, text in files.items():
        path = root / "src" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_cycle_through_relative_absolute_and_package_imports_is_found(tmp_path: Path) -> None:
    root = _write(tmp_path, {
        "core/__init__.py": "",
        "extra/__init__.py": "from .low import Thing\n",
        "extra/low.py": f"from {PACKAGE}.core.high import run\nThing = 1\n",
        "core/high.py": "from ..extra import Thing\ndef run(): pass\n",
        "core/alone.py": "import os\n",
    })
    found = cycles(import_graph(project_imports(root)))
    assert found == [[f"{PACKAGE}.core.high", f"{PACKAGE}.extra", f"{PACKAGE}.extra.low", f"{PACKAGE}.core.high"]]


def test_imports_inside_functions_and_type_checking_blocks_are_not_edges(tmp_path: Path) -> None:
    root = _write(tmp_path, {
        "core/__init__.py": "",
        "core/a.py": "from . import b\n",
        "core/b.py": ("from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from .a import x\n"
                      "def f():\n    from .a import y  # local: only for the test\n"
                      "class C:\n    def g(self):\n        from . import a\n"),
    })
    imports = project_imports(root)
    assert cycles(import_graph(imports)) == []
    a, b = f"{PACKAGE}.core.a", f"{PACKAGE}.core.b"
    assert cycles(import_graph(imports, local=True)) == [[a, b, a]]
    local = sorted((item.line, item.has_reason) for item in imports if item.local)
    assert local == [(5, True), (8, False)]


def test_a_submodule_or_a_lazily_exported_name_is_an_edge_to_its_submodule(tmp_path: Path) -> None:
    root = _write(tmp_path, {
        "core/__init__.py": "from .b import thing\n",
        "core/a.py": f"from {PACKAGE}.core import b\nimport {PACKAGE}.core.b\n",
        "core/b.py": "thing = 1\n",
        "extra/__init__.py": "_EXPORTS = {'late': 'slow'}\n",
        "extra/slow.py": "late = 2\n",
        "extra/user.py": f"from {PACKAGE}.extra import late\n",
    })
    graph = import_graph(project_imports(root))
    assert graph == {f"{PACKAGE}.core": {f"{PACKAGE}.core.b"}, f"{PACKAGE}.core.a": {f"{PACKAGE}.core.b"},
                     f"{PACKAGE}.extra.user": {f"{PACKAGE}.extra", f"{PACKAGE}.extra.slow"}}



def test_no_private_hydra_api() -> None:
    """Hydra's public API only (``hydra``, ``hydra.core``, ``hydra.errors``, ...): nothing of ``hydra._internal``, whose
    names change between Hydra releases without notice."""
    files = [ROOT / "train.py", *sorted((ROOT / "src").rglob("*.py")), *sorted((ROOT / "scripts").rglob("*.py"))]
    used = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in files for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.Import, ast.ImportFrom))
            and any(name.startswith("hydra._internal") for name in
                    ([node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]))]
    assert not used, f"hydra._internal imported at {', '.join(used)}"
