"""Docstrings and comments name paths that import.

Every module of ``src/`` and ``scripts/`` is read, its docstrings through :mod:`ast` and its comments
through :mod:`tokenize`, for two kinds of reference:

* Sphinx roles ``:mod:``, ``:class:``, ``:func:``, ``:meth:``, ``:data:`` and ``:attr:`` (an optional
  leading ``~`` and a trailing ``()`` are ignored);
* double-backticked dotted names that start with a package of the project: ``pipeline_recipes.``,
  ``strategies.``, ``recipe.``, ``planner.``, ``models.``, ``datamodules.``.

How a name resolves (one rule, :func:`resolve`):

1. a name whose first part is one of the project's packages must be spelled from ``pipeline_recipes.``
   (``strategies.engine`` names nothing importable; ``pipeline_recipes.strategies.runtime.engine`` does);
2. a name with leading dots is relative to the package of the module that holds it, as in a relative
   import (``.actions.Schedule`` in ``pipeline_recipes.strategies.schedules.registry``; in a package's
   ``__init__`` the anchor is the package itself);
3. any other name is looked up where it is written: in the class whose body holds it (``:meth:`step```
   in a method's docstring), then in the module's namespace (``Schedule``, ``PipelineEngine.step``,
   ``dist.all_reduce``), then among the builtins (``ValueError``), and last as an absolute path
   (``torch.nn.Linear``).

A name meant as a string rather than a path (an old module path that a checkpoint stores) is quoted
inside the backticks (````"models.build_gpt2"````) and is not a reference.

An absolute path resolves by importing its longest importable module prefix and taking the rest with
``getattr``; a class's annotated attributes (dataclass fields) and the attributes its methods assign on
``self`` count as its attributes. Scripts are imported as top-level modules from ``scripts/``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import re
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
SCRIPTS = ROOT / "scripts"
PACKAGES = ("strategies", "recipe", "planner", "models", "datamodules")
ROLES = ("mod", "class", "func", "meth", "data", "attr")

ROLE_RE = re.compile(r":(?P<role>" + "|".join(ROLES) + r"):`(?P<name>[^`]+)`")
DOTTED_RE = re.compile(r"``(?P<name>(?:pipeline_recipes|" + "|".join(PACKAGES) + r")\.[A-Za-z_][\w.]*)``")


@dataclass(frozen=True)
class Ref:
    """One reference: where it is, the text as written, and the class whose body holds it."""

    path: Path
    line: int
    name: str
    context_class: str | None

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.name}"


def module_name(path: Path) -> str:
    """The import name of a file of ``src/`` (under ``pipeline_recipes``) or of ``scripts/``."""
    if path.is_relative_to(SCRIPTS):
        return path.stem
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] != "pipeline_recipes":
        parts.insert(0, "pipeline_recipes")
    return ".".join(parts)


def source_files() -> list[Path]:
    return sorted(p for d in (SRC, SCRIPTS) for p in d.rglob("*.py") if "__pycache__" not in p.parts)


def clean_name(raw: str) -> str:
    """The target of a role's text: ``~`` and a trailing ``()`` dropped, ``title <target>`` read as target."""
    name = raw.strip()
    if name.endswith(">") and "<" in name:
        name = name[name.rindex("<") + 1:-1]
    return name.lstrip("~").removesuffix("()")


def _class_spans(tree: ast.Module) -> list[tuple[int, int, str]]:
    spans: list[tuple[int, int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                qual = prefix + child.name
                spans.append((child.lineno, child.end_lineno or child.lineno, qual))
                visit(child, qual + ".")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, prefix)  # a class defined in a function: out of reach, resolved by module only
    visit(tree, "")
    return spans


def _innermost(spans: list[tuple[int, int, str]], line: int) -> str | None:
    inside = [s for s in spans if s[0] <= line <= s[1]]
    return max(inside, key=lambda s: s[0])[2] if inside else None


def _texts(source: str, tree: ast.Module) -> list[tuple[int, str]]:
    """(first line, text) of every docstring and comment."""
    texts: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                texts.append((first.lineno, first.value.value))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            texts.append((tok.start[0], tok.string))
    return texts


def references(path: Path) -> list[Ref]:
    """Every reference of the two kinds in ``path``'s docstrings and comments."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    spans = _class_spans(tree)
    refs: list[Ref] = []
    for first_line, text in _texts(source, tree):
        for pattern in (ROLE_RE, DOTTED_RE):
            for m in pattern.finditer(text):
                line = first_line + text.count("\n", 0, m.start())
                refs.append(Ref(path, line, clean_name(m.group("name")), _innermost(spans, line)))
    return sorted(refs, key=lambda r: (r.line, r.name))


def _has_attribute(owner: Any, attr: str) -> bool:
    if hasattr(owner, attr):
        return True
    if not inspect.isclass(owner):
        return False
    for klass in owner.__mro__:
        if attr in getattr(klass, "__annotations__", {}) or attr in getattr(klass, "__dataclass_fields__", {}):
            return True
        try:
            if re.search(rf"\bself\.{re.escape(attr)}\s*(?::[^=\n]+)?=(?!=)", inspect.getsource(klass)):
                return True
        except (OSError, TypeError):
            pass
    return False


def _walk(obj: Any, attrs: list[str]) -> bool:
    for attr in attrs:
        if not _has_attribute(obj, attr):
            return False
        obj = getattr(obj, attr, None)
    return True


def resolve_absolute(name: str) -> bool:
    """Whether ``name`` is a module, or a module's attribute chain: import the longest module prefix."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        except Exception:  # noqa: BLE001 - a module that fails to import names nothing
            return False
        return _walk(module, parts[cut:])
    return False


def _load(module: str) -> ModuleType:
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module(module)


def resolve(ref: Ref) -> bool:
    """The rule of the module docstring."""
    here = module_name(ref.path)
    name = ref.name
    first = name.lstrip(".").split(".")[0]
    if name.startswith("."):
        level = len(name) - len(name.lstrip("."))
        anchor = here.split(".") if ref.path.name == "__init__.py" else here.split(".")[:-1]
        if level - 1 > len(anchor) - 1:
            return False
        base = anchor[: len(anchor) - (level - 1)]
        return resolve_absolute(".".join([*base, name.lstrip(".")]))
    if first == "pipeline_recipes":
        return resolve_absolute(name)
    if first in PACKAGES:
        return False
    module = _load(here)
    if ref.context_class is not None:
        owner: Any = module
        for part in ref.context_class.split("."):
            owner = getattr(owner, part)
        if _walk(owner, name.split(".")):
            return True
    if _walk(module, name.split(".")):
        return True
    return resolve_absolute(f"builtins.{name}") or resolve_absolute(name)


def unresolved(paths: list[Path] | None = None) -> list[Ref]:
    return [r for p in (paths or source_files()) for r in references(p) if not resolve(r)]


def test_rule_examples() -> None:
    """The rule on names whose answer is known without the scanner."""
    registry = SRC / "strategies" / "schedules" / "registry.py"
    planner_init = SRC / "planner" / "__init__.py"
    assert resolve(Ref(registry, 1, "pipeline_recipes.strategies.schedules.actions.Schedule", None))
    assert resolve(Ref(registry, 1, ".actions.Schedule", None))
    assert resolve(Ref(registry, 1, "ScheduleSpec", None))
    assert resolve(Ref(registry, 1, "ScheduleSpec.name", "ScheduleSpec"))
    assert resolve(Ref(registry, 1, "name", "ScheduleSpec"))
    assert resolve(Ref(planner_init, 1, ".costs", None))
    assert resolve(Ref(registry, 1, "torch.nn.Linear", None))
    assert not resolve(Ref(registry, 1, "strategies.schedules.actions.Schedule", None))
    assert not resolve(Ref(registry, 1, "pipeline_recipes.strategies.schedules.actions.NoSuchName", None))
    assert not resolve(Ref(registry, 1, "NoSuchName", None))


def test_scanner_finds_both_kinds() -> None:
    refs = references(SRC / "strategies" / "schedules" / "registry.py")
    assert refs, "the registry's docstring cross-references are found"
    found = {r.name for r in refs}
    assert "ScheduleSpec" in found


@pytest.mark.parametrize("path", source_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_docstring_references_import(path: Path) -> None:
    bad = unresolved([path])
    assert not bad, (f"{len(bad)} docstring/comment reference(s) name nothing importable (rule: "
                     f"tests/repo/test_docstring_refs.py's docstring):\n" + "\n".join(map(str, bad)))


def test_benchmarks_md_stays_one_readable_page_of_results() -> None:
    """BENCHMARKS.md holds the latest results and how to reproduce them (history is git's): at most 32 KB
    (25 KB for the CPU parts, then §7's GPU rows and targets), headline table first."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert len(text.encode()) <= 32_000
    assert text.index("## Headline results") < text.index("## Method") < text.index("## 0.")
