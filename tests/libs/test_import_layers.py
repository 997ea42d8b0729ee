"""libs/ is the ground floor: it imports no service and no tool (DESIGN.md, "Layers").

Read from the source, not from an import graph: libs/ is the `cachet` package and each
service is mapped into it from another folder (pyproject's package-dir), so a graph built
from `cachet` (import-linter's grimp) sees only libs/ and silently drops the imports of
`cachet.router` and the rest, which are exactly the ones this must catch. `make lint` runs
this file.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBS = ROOT / "libs"


def layers_above_libs() -> set[str]:
    """Every package pyproject maps from outside libs/: the services and tools. A service
    added there is covered without touching this test."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name for name, folder in package_dir.items() if folder != "libs"}


def imported_modules(source: str) -> Iterator[tuple[int, str]]:
    """(line, module) for every import in ``source``, at any depth (a lazy import inside a
    function counts), and every ``import_module("...")`` or ``__import__("...")`` of a
    literal name, the way around a static import."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # Qualified by each name: `from cachet import tools` imports the package cachet.tools.
            yield from ((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value


def upward_imports(source: str, above: set[str]) -> list[tuple[int, str]]:
    """The imports in ``source`` of a module in (or under) one of the packages ``above``,
    their generated stubs included (``cachet.router.v1``): a stub is the service's own."""
    return sorted(
        (line, module)
        for line, module in imported_modules(source)
        if any(module == package or module.startswith(f"{package}.") for package in above)
    )


def test_libs_imports_no_service_and_no_tool() -> None:
    above = layers_above_libs()
    # Generated stubs under libs/ (cachet.common.v1) are checked too: a shared message that
    # used a service's type would drag that service's stubs into libs.
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted(LIBS.rglob("*.py"))
        for line, module in upward_imports(path.read_text(), above)
    ]
    assert not found, "libs/ must not import a service or tools (DESIGN.md, Layers):\n" + "\n".join(found)


def test_every_way_of_importing_a_service_is_caught() -> None:
    above = {"cachet.router", "cachet.tools", "cachet.engine"}
    source = """
import cachet.errors
from cachet.common.v1 import common_pb2
from cachet.router.v1 import router_pb2
from cachet import tools, logs
import importlib

def later():
    import cachet.engine.model_runner
    return importlib.import_module("cachet.router.keys_command")
"""
    assert upward_imports(source, above) == [
        (4, "cachet.router.v1.router_pb2"),
        (5, "cachet.tools"),
        (9, "cachet.engine.model_runner"),
        (10, "cachet.router.keys_command"),
    ]
