"""The distribution lists every package in the tree (an editable install would hide a gap)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_directory_is_in_the_distribution() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {Path(directory): name for name, directory in setuptools["package-dir"].items()}
    found = set()
    for init in [
        *ROOT.glob("libs/**/__init__.py"),
        *ROOT.glob("services/**/__init__.py"),
        *ROOT.glob("tools/**/__init__.py"),
    ]:
        directory = init.parent.relative_to(ROOT)
        root = max((r for r in roots if directory.is_relative_to(r)), key=lambda r: len(r.parts))
        found.add(".".join([roots[root], *directory.relative_to(root).parts]))
    assert found == set(setuptools["packages"])
