"""docs/structure.md against the code: one bullet per module of `vegas_spec`, in an order that
keeps the layering rule (at import time a module imports only modules listed above it), and
each bullet's *Imports:* naming every package module the module imports.

Pure Python over the source files (`ast`); nothing of the package is imported."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "vegas_spec"
DOC = ROOT / "docs" / "structure.md"

BULLET = re.compile(r"^- \*\*`(vegas_spec(?:\.\w+)*)`\*\* — ")
BACKTICKED = re.compile(r"`([^`]+)`")

# The three kinds of import statement, by when they run.
AT_IMPORT = "import time"  # module level (a class body and a try block included)
AT_RUN = "run time"  # inside a function
FOR_TYPES = "types"  # under `if TYPE_CHECKING:`

# Run-time imports that point upwards (to a module listed below the importer): each looks up
# what is registered below it, as the doc's intro says. A new one belongs here and there.
UPWARD_AT_RUN_TIME = {
    ("vegas_spec.config", "vegas_spec.models.registry"),
    ("vegas_spec.parallel", "vegas_spec.models.registry"),
    ("vegas_spec.attention.backend", "vegas_spec.attention.torch_backend"),
    ("vegas_spec.attention.backend", "vegas_spec.attention.triton_backend"),
    ("vegas_spec.compute.base", "vegas_spec.compute.torch_ops"),
    ("vegas_spec.compute.base", "vegas_spec.compute.triton_ops"),
}

# Import-time imports allowed to point upwards: none. The package has no import cycle, so an
# order exists in which every import-time import points upwards; a true cycle would have to be
# listed here as (importer, imported), with the reason.
UPWARD_AT_IMPORT: set[tuple[str, str]] = set()


def module_files(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's `__init__`) for every file of the package."""
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found[".".join(parts)] = (path, is_package)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.Import | ast.ImportFrom, name: str, is_package: bool,
             known: set[str]) -> list[str]:
    """The package modules one import statement names (a name that is not a module, such as
    a function imported from a module, counts as its module; a package's as the package)."""
    if isinstance(node, ast.Import):
        candidates = [alias.name for alias in node.names]
    else:
        if node.level:
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        candidates = [f"{module}.{alias.name}" for alias in node.names]
    targets = []
    for candidate in candidates:
        if candidate.split(".")[0] != PACKAGE:
            continue
        while candidate and candidate not in known:  # a name inside a module
            candidate = candidate.rpartition(".")[0]
        if candidate and candidate != name:
            targets.append(candidate)
    return targets


def imports_in(source: str, name: str, is_package: bool,
               known: set[str]) -> dict[str, set[str]]:
    """Kind of import (AT_IMPORT, AT_RUN, FOR_TYPES) -> the package modules that module `name`
    imports that way."""
    found: dict[str, set[str]] = {AT_IMPORT: set(), AT_RUN: set(), FOR_TYPES: set()}

    def visit(node: ast.AST, kind: str) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found[kind].update(_targets(node, name, is_package, known))
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, FOR_TYPES)
            for child in node.orelse:
                visit(child, kind)
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) \
                and kind == AT_IMPORT:
            kind = AT_RUN
        for child in ast.iter_child_nodes(node):
            visit(child, kind)

    visit(ast.parse(source), AT_IMPORT)
    return found


def package_imports(root: Path = ROOT) -> dict[str, dict[str, set[str]]]:
    files = module_files(root)
    known = set(files)
    return {name: imports_in(path.read_text(encoding="utf-8"), name, is_package, known)
            for name, (path, is_package) in files.items()}


def bullets(text: str) -> list[tuple[str, str]]:
    """(module, bullet text) of every module bullet of the doc, in order; a bullet runs on
    over its indented lines, joined by spaces."""
    found: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        match = BULLET.match(line)
        if match:
            current = [line]
            found.append((match.group(1), current))
        elif current is not None and line.startswith("  ") and line.strip():
            current.append(line.strip())
        else:
            current = None
    return [(name, " ".join(lines)) for name, lines in found]


def documented_imports(bullet: str, known: set[str]) -> set[str]:
    """The package modules that a bullet's *Imports:* part names in backticks (short names,
    `models.loader`, or full ones)."""
    _, marker, rest = bullet.partition("*Imports:*")
    assert marker, f"no *Imports:* in: {bullet[:80]}"
    named = set()
    for token in BACKTICKED.findall(rest):
        full = token if token.split(".")[0] == PACKAGE else f"{PACKAGE}.{token}"
        if full in known:
            named.add(full)
    return named


def upward(order: list[str], imports: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) for every import of a module not listed above its importer."""
    place = {name: i for i, name in enumerate(order)}
    unlisted = len(order)  # a module without a bullet counts as listed below every other
    return {(name, target) for name, targets in imports.items() for target in targets
            if place.get(target, unlisted) >= place.get(name, unlisted)}


@pytest.fixture(scope="module")
def doc() -> list[tuple[str, str]]:
    return bullets(DOC.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def order(doc: list[tuple[str, str]]) -> list[str]:
    return [name for name, _ in doc]


@pytest.fixture(scope="module")
def code() -> dict[str, dict[str, set[str]]]:
    return package_imports()


def test_every_module_has_exactly_one_bullet(order: list[str],
                                              code: dict[str, dict[str, set[str]]]) -> None:
    twice = sorted({name for name in order if order.count(name) > 1})
    assert not twice, f"modules with more than one bullet: {twice}"
    assert sorted(set(code) - set(order)) == [], "modules of vegas_spec without a bullet"
    assert sorted(set(order) - set(code)) == [], "bullets naming no module of vegas_spec"


def test_a_package_comes_before_its_modules(order: list[str]) -> None:
    place = {name: i for i, name in enumerate(order)}
    late = [(name, name.rpartition(".")[0]) for name in order
            if "." in name and place[name.rpartition(".")[0]] > place[name]]
    assert late == [], "(module, its package listed after it)"


def test_import_time_imports_point_upwards(order: list[str],
                                           code: dict[str, dict[str, set[str]]]) -> None:
    found = upward(order, {name: kinds[AT_IMPORT] for name, kinds in code.items()})
    assert sorted(found - UPWARD_AT_IMPORT) == [], \
        "(module, a module it imports at import time that is not listed above it)"


def test_upward_run_time_imports_are_the_named_exceptions(
        order: list[str], code: dict[str, dict[str, set[str]]]) -> None:
    found = upward(order, {name: kinds[AT_RUN] for name, kinds in code.items()})
    assert sorted(found - UPWARD_AT_RUN_TIME) == []


def test_each_bullet_names_every_import(doc: list[tuple[str, str]],
                                        code: dict[str, dict[str, set[str]]]) -> None:
    known = set(code)
    missing = {}
    for name, bullet in doc:
        if name not in code:
            continue
        imported = set().union(*code[name].values())
        unnamed = imported - documented_imports(bullet, known)
        if unnamed:
            missing[name] = sorted(unnamed)
    assert missing == {}, "module -> the package modules it imports that its bullet leaves out"


# Self-checks: the helpers above on small synthetic inputs, so that a wrong order, a missing
# bullet or an import of the wrong kind would be caught.

SYNTHETIC_DOC = """# Layers

- **`vegas_spec`** — the package. *Imports:* none.
- **`vegas_spec.low`** — the bottom,
  on two lines. *Imports:* none.
- **`vegas_spec.high`** — on top. *Imports:* `low`;
  at run time `vegas_spec.top`.

Not a bullet: - **`vegas_spec.nothing`** — here.
"""

SYNTHETIC_SOURCE = """
from typing import TYPE_CHECKING
from vegas_spec import low
from vegas_spec.low import helper
if TYPE_CHECKING:
    from vegas_spec.top import Thing
class Kept:
    import vegas_spec.low
def later():
    from vegas_spec.top import Other
    return Other
"""


def test_bullets_are_read_in_order_with_their_lines() -> None:
    found = bullets(SYNTHETIC_DOC)
    assert [name for name, _ in found] == ["vegas_spec", "vegas_spec.low", "vegas_spec.high"]
    assert found[1][1].endswith("on two lines. *Imports:* none.")
    known = {"vegas_spec", "vegas_spec.low", "vegas_spec.high", "vegas_spec.top"}
    assert documented_imports(found[2][1], known) == {"vegas_spec.low", "vegas_spec.top"}
    assert documented_imports(found[1][1], known) == set()


def test_imports_are_sorted_by_when_they_run() -> None:
    known = {"vegas_spec", "vegas_spec.low", "vegas_spec.top", "vegas_spec.mid"}
    found = imports_in(SYNTHETIC_SOURCE, "vegas_spec.mid", False, known)
    assert found == {AT_IMPORT: {"vegas_spec.low"}, AT_RUN: {"vegas_spec.top"},
                     FOR_TYPES: {"vegas_spec.top"}}
    relative = imports_in("from . import low\nfrom .top import x\n", "vegas_spec.mid", False,
                          known)
    assert relative[AT_IMPORT] == {"vegas_spec.low", "vegas_spec.top"}


@pytest.mark.parametrize(("order", "expected"), [
    (["vegas_spec.low", "vegas_spec.high"], set()),
    (["vegas_spec.high", "vegas_spec.low"], {("vegas_spec.high", "vegas_spec.low")}),
])
def test_an_import_of_a_module_listed_below_is_caught(order: list[str],
                                                      expected: set[tuple[str, str]]) -> None:
    imports = {"vegas_spec.high": {"vegas_spec.low"}, "vegas_spec.low": set()}
    assert upward(order, imports) == expected


def test_a_cycle_has_no_order() -> None:
    imports = {"vegas_spec.a": {"vegas_spec.b"}, "vegas_spec.b": {"vegas_spec.a"}}
    for order in (["vegas_spec.a", "vegas_spec.b"], ["vegas_spec.b", "vegas_spec.a"]):
        assert len(upward(order, imports)) == 1
