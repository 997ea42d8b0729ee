"""What the service chain costs per request: the engine alone, through the router, through the bridge.

Target: the router adds at most 2 ms per request at p50 over calling the engine directly.

One run starts tokenizer, usage, cache, one engine on the tiny random-weight model
(``cachet.models.tiny``), the router and the bridge, each its own process on
loopback, exactly as ``run-local`` wires them. Then N rounds, each sending the
same short request (a fixed 24-token prompt, ``max_tokens=1``, greedy) three ways,
one after the other, with the order rotated every round so that drift on a
shared machine falls on every path alike:

* **engine**: ``EngineService.Generate`` straight to the engine, stream read to its end;
* **router**: ``InferenceService.CreateCompletion`` with ``prompt_token_ids`` (the
  full pipeline: placement, engine, detokenize stream, usage record sent beside
  the answer; with one replica there is no cache-index lookup to make, so a
  second run with two replicas shows what the lookup adds);
* **bridge**: ``POST /v1/completions`` with the token ids, over one keep-alive
  HTTP connection (JSON, auth, the router path above).

Latency is wall time in this process from sending to having the whole answer,
with sync gRPC / httpx clients. The prompt's first block is served from the
engine's prefix cache after the first round, on every path alike; what differs
between rows is only the hops. The figure that answers the target is the
difference of the p50s (router − engine); p99 differences are shown but are
mostly noise from the other processes sharing the cores.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cachet.common.v1 import common_pb2
from cachet.engine.v1 import engine_pb2, engine_pb2_grpc
from cachet.loopback_port import free_loopback_port
from cachet.models.tiny import write_tiny_model
from cachet.router.v1 import router_pb2, router_pb2_grpc

MODEL_ID = "tiny-llama"
PROMPT = list(range(1000, 1024))  # 24 tokens: one full (cacheable) block and a partial one
ROUTER_OVERHEAD_TARGET_MS = 2.0


class _Services:
    """The processes of one run; stopped (SIGTERM, then kill) when the run ends."""

    def __init__(self, log_dir: Path, trace_file: Path | None = None) -> None:
        self.log_dir = log_dir
        self.processes: list[subprocess.Popen[bytes]] = []
        self.trace_env = {"CACHET_TRACE_FILE": str(trace_file)} if trace_file else {}

    def start(self, service: str, env: dict[str, str], name: str | None = None) -> str:
        port = free_loopback_port()
        base = {k: v for k, v in os.environ.items() if not k.startswith("CACHET_")}
        # One math thread per process, as the tests run them: the box has few cores.
        base |= {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CACHET_DEVICE": "cpu"}
        port_env = (
            {"CACHET_PORT": str(port)}
            if service == "bridge"
            else {f"CACHET_{service.upper()}_PORT": str(port)}
        )
        with (self.log_dir / f"{name or service}.log").open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", f"cachet.{service}"],
                env=base | port_env | self.trace_env | env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.processes.append(process)
        address = f"127.0.0.1:{port}"
        if service == "bridge":
            self._wait_http(process, address)
        else:
            self._wait_grpc(process, address, service)
        return address

    def _wait_grpc(self, process: subprocess.Popen[bytes], address: str, service: str) -> None:
        deadline = time.monotonic() + 300
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if process.poll() is not None:
                    raise RuntimeError(f"{service} exited; see {self.log_dir}")
                try:
                    if (
                        health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                        == health_pb2.HealthCheckResponse.SERVING
                    ):
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise RuntimeError(f"{service} not serving; see {self.log_dir}")

    def _wait_http(self, process: subprocess.Popen[bytes], address: str) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"bridge exited; see {self.log_dir}")
            try:
                if httpx.get(f"http://{address}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"bridge not healthy; see {self.log_dir}")

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.terminate()
        for process in reversed(self.processes):
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()


@contextmanager
def running_platform(root: Path, trace_file: Path | None = None) -> Iterator[dict[str, str]]:
    """Every service on the tiny model (spans to ``trace_file`` if given); yields their addresses."""
    model_dir = write_tiny_model(root / MODEL_ID)
    services = _Services(root, trace_file)
    try:
        addresses = {
            "tokenizer": services.start(
                "tokenizer", {"CACHET_TOKENIZER_MODELS": json.dumps([str(model_dir)])}
            ),
            "usage": services.start("usage", {"CACHET_DATA_DIR": str(root / "usage-data")}),
            "engine": services.start("engine", {"CACHET_MODEL": str(model_dir)}),
        }
        addresses["cache"] = services.start(
            "cache", {"CACHET_CACHE_ENGINE_ADDRESSES": json.dumps([addresses["engine"]])}
        )
        addresses["router"] = services.start(
            "router",
            {
                "CACHET_ROUTER_TOKENIZER_ADDRESS": addresses["tokenizer"],
                "CACHET_ROUTER_USAGE_ADDRESS": addresses["usage"],
                "CACHET_ROUTER_CACHE_ADDRESS": addresses["cache"],
                "CACHET_ROUTER_ENGINE_ADDRESSES": json.dumps([addresses["engine"]]),
            },
        )
        addresses["bridge"] = services.start(
            "bridge",
            {
                "CACHET_BRIDGE_ROUTER_ADDRESS": addresses["router"],
                "CACHET_BRIDGE_USAGE_ADDRESS": addresses["usage"],
            },
        )
        yield addresses
    finally:
        services.stop()


def _sampling() -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def _engine_call(address: str) -> tuple[Callable[[], None], grpc.Channel]:
    channel = grpc.insecure_channel(address)
    stub = engine_pb2_grpc.EngineServiceStub(channel)

    def call() -> None:
        request = engine_pb2.GenerateRequest(
            request_id=f"bench-{uuid.uuid4().hex}",
            model=MODEL_ID,
            prompt_token_ids=PROMPT,
            sampling=_sampling(),
            priority=common_pb2.PRIORITY_INTERACTIVE,
        )
        last = list(stub.Generate(request, timeout=30))[-1]
        assert last.finish_reason, last

    return call, channel


def _router_call(address: str) -> tuple[Callable[[], None], grpc.Channel]:
    channel = grpc.insecure_channel(address)
    stub = router_pb2_grpc.InferenceServiceStub(channel)

    def call() -> None:
        request = router_pb2.CompletionRequest(model=MODEL_ID, prompt_token_ids=PROMPT, sampling=_sampling())
        answer = stub.CreateCompletion(request, timeout=30)
        assert answer.usage.completion_tokens == 1, answer

    return call, channel


def _bridge_call(address: str) -> tuple[Callable[[], None], httpx.Client]:
    client = httpx.Client(base_url=f"http://{address}", timeout=30)
    body = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "ignore_eos": True}

    def call() -> None:
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 1, (
            response.text
        )

    return call, client


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": statistics.median(ordered),
        "p99_ms": ordered[max(0, int(len(ordered) * 0.99) - 1)],
        "mean_ms": statistics.fmean(ordered),
    }


def measure(addresses: dict[str, str], requests: int, warmup: int = 10) -> dict[str, Any]:
    engine, engine_channel = _engine_call(addresses["engine"])
    router, router_channel = _router_call(addresses["router"])
    bridge, bridge_client = _bridge_call(addresses["bridge"])
    paths: list[tuple[str, Callable[[], None]]] = [("engine", engine), ("router", router), ("bridge", bridge)]
    samples: dict[str, list[float]] = {name: [] for name, _ in paths}
    try:
        for round_index in range(warmup + requests):
            rotation = round_index % len(paths)
            for name, call in paths[rotation:] + paths[:rotation]:
                started = time.perf_counter()
                call()
                if round_index >= warmup:
                    samples[name].append((time.perf_counter() - started) * 1000)
    finally:
        engine_channel.close()
        router_channel.close()
        bridge_client.close()
    rows = {name: _percentiles(values) for name, values in samples.items()}
    return {
        "requests_per_path": requests,
        "prompt_tokens": len(PROMPT),
        "max_tokens": 1,
        "paths": rows,
        "router_minus_engine_p50_ms": rows["router"]["p50_ms"] - rows["engine"]["p50_ms"],
        "bridge_minus_engine_p50_ms": rows["bridge"]["p50_ms"] - rows["engine"]["p50_ms"],
        "router_overhead_target_ms": ROUTER_OVERHEAD_TARGET_MS,
    }


def hop_breakdown(trace_file: Path) -> dict[str, float]:
    """Median duration (ms) of each call the router makes inside CreateCompletion, from the spans."""
    spans = [json.loads(line) for line in trace_file.read_text().splitlines()]
    calls = {s["trace_id"] for s in spans if s["name"].endswith("InferenceService/CreateCompletion")}
    durations: dict[str, list[float]] = {}
    for span in spans:
        if span["trace_id"] in calls and span["service"] == "router":
            name = f"{span['kind'].lower()} {span['name'].rsplit('/', 1)[-1]}"
            durations.setdefault(name, []).append((span["end_ns"] - span["start_ns"]) / 1e6)
    return {name: statistics.median(values) for name, values in sorted(durations.items())}


def run_service_chain_bench(quick: bool = False, breakdown: bool = False) -> dict[str, Any]:
    print("[bench] service chain (tokenizer, usage, cache, engine, router, bridge processes)", flush=True)
    with tempfile.TemporaryDirectory(prefix="cachet-chain-bench-") as root:
        # Tracing costs every path a file write per span, so only the breakdown run turns it on.
        trace_file = Path(root) / "spans.jsonl" if breakdown else None
        with running_platform(Path(root), trace_file) as addresses:
            result = measure(addresses, requests=50 if quick else 200)
        if trace_file is not None:
            result["router_hops_p50_ms"] = hop_breakdown(trace_file)
    print(f"\nService chain: {result['requests_per_path']} sequential requests per path, max_tokens=1")
    print(f"{'path':<40}{'p50 ms':>10}{'p99 ms':>10}{'p50 over engine':>18}")
    print("-" * 78)
    engine_p50 = result["paths"]["engine"]["p50_ms"]
    labels = {
        "engine": "engine Generate (direct)",
        "router": "router CreateCompletion (token ids)",
        "bridge": "bridge POST /v1/completions",
    }
    for name, label in labels.items():
        row = result["paths"][name]
        print(f"{label:<40}{row['p50_ms']:>10.2f}{row['p99_ms']:>10.2f}{row['p50_ms'] - engine_p50:>18.2f}")
    print(f"router overhead at p50: {result['router_minus_engine_p50_ms']:.2f} ms (target <= 2)")
    for name, median in result.get("router_hops_p50_ms", {}).items():
        print(f"  router span {name:<46}{median:>8.2f} ms (p50)")
    return result


if __name__ == "__main__":
    # --breakdown: spans to a file (CACHET_TRACE_FILE) and the router's per-hop medians from them.
    figures = run_service_chain_bench(quick="--quick" in sys.argv, breakdown="--breakdown" in sys.argv)
    print(json.dumps(figures, indent=2))
