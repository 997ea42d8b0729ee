"""deploy/Dockerfile, checked without a Docker engine: it parses (Docker's own parser, through the
`dockerfile` package), its CPU and CUDA targets exist and run as a non-root user, everything it
copies exists and is in the build context, and what it runs is real: `cachet` commands,
modules, and the project's extras."""

from __future__ import annotations

import fnmatch
import importlib
import re
import tomllib
from pathlib import Path

import dockerfile
import pytest
import typer

from cachet.tools.cli import SERVICES, app

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def stages() -> dict[str, list[dockerfile.Command]]:
    """Stage name -> its instructions (ARGs before the first FROM under "")."""
    found: dict[str, list[dockerfile.Command]] = {"": []}
    current = ""
    for command in dockerfile.parse_file(str(DOCKERFILE)):
        if command.cmd == "FROM":
            current = command.value[2] if len(command.value) == 3 else command.value[0]
            found[current] = []
        found[current].append(command)
    return found


def inherited(name: str, all_stages: dict[str, list[dockerfile.Command]]) -> list[dockerfile.Command]:
    """A stage's instructions after those of the stages it is built FROM."""
    own = all_stages[name]
    base = own[0].value[0]
    return (inherited(base, all_stages) if base in all_stages else []) + own


def test_cpu_and_cuda_targets_run_cachet_as_a_non_root_user() -> None:
    all_stages = stages()
    for target in ("cpu", "cuda"):
        commands = inherited(target, all_stages)
        users = [command.value[0] for command in commands if command.cmd == "USER"]
        assert users, target
        uid = users[-1].split(":")[0]
        assert uid not in ("0", "root"), target
        (entrypoint,) = [c for c in commands if c.cmd == "ENTRYPOINT"]
        assert entrypoint.json and entrypoint.value == ("cachet",)


def _cachet_command_is_real(args: tuple[str, ...]) -> None:
    group = typer.main.get_command(app)
    assert args[0] in group.commands, args
    if args[0] == "serve":
        assert args[1] in SERVICES, args
    # Parsing checks the arguments and options as the command would.
    group.commands[args[0]].make_context(args[0], list(args[1:]))


def test_the_default_command_is_a_cachet_subcommand() -> None:
    all_stages = stages()
    for target in ("cpu", "cuda"):
        (cmd,) = [c for c in inherited(target, all_stages) if c.cmd == "CMD"]
        _cachet_command_is_real(cmd.value)


def _ignored(path: str, patterns: list[str]) -> bool:
    # The .dockerignore rules in order, the last match winning ("!" re-includes).
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        pattern = pattern.removeprefix("!").rstrip("/")
        parts = path.split("/")
        if any(fnmatch.fnmatch("/".join(parts[: i + 1]), pattern) for i in range(len(parts))):
            ignored = not negated
    return ignored


def test_every_copy_source_exists_and_is_in_the_build_context() -> None:
    ignore = DOCKERFILE.with_name("Dockerfile.dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in ignore if line.strip() and not line.startswith("#")]
    all_stages = stages()
    copies = [c for commands in all_stages.values() for c in commands if c.cmd in ("COPY", "ADD")]
    assert copies
    for copy in copies:
        sources = copy.value[:-1]
        from_stage = [flag.split("=", 1)[1] for flag in copy.flags if flag.startswith("--from=")]
        if from_stage:
            assert from_stage[0] in all_stages, copy.original
            continue
        for source in sources:
            assert (ROOT / source).exists(), copy.original
            assert not _ignored(source, patterns), copy.original
            if (ROOT / source).is_dir():
                # Nothing the package needs is dropped from a copied folder but caches.
                python = next((ROOT / source).rglob("*.py"))
                assert not _ignored(str(python.relative_to(ROOT)), patterns)


def test_what_it_runs_is_real() -> None:
    runs = " ".join(c.value[0] for commands in stages().values() for c in commands if c.cmd == "RUN")
    # Every `from cachet.x import y` in a RUN names a real module attribute.
    imports = re.findall(r"from (cachet[\w.]*) import (\w+)", runs)
    assert imports
    for module, name in imports:
        assert hasattr(importlib.import_module(module), name), (module, name)
    # Every extra it installs the project with is one the project declares.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for named in re.findall(r"/opt/cachet/src\[(\w+)\]", runs):
        assert named in extras
    # The same torch as `make setup` installs.
    makefile = (ROOT / "Makefile").read_text()
    for pin in set(re.findall(r"torch==[\d.]+", runs)):
        assert pin in makefile


@pytest.mark.parametrize("command", [("serve", "engine"), ("serve", "bridge"), ("report", "--json")])
def test_commands_the_chart_and_docs_name_are_real(command: tuple[str, ...]) -> None:
    _cachet_command_is_real(command)
