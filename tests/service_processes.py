"""Real Cachet processes over loopback, for every end-to-end test.

(A module with a unique name, not conftest.py: every test folder has a conftest, and
with pytest's default import mode only one module named ``conftest`` can be imported.)

``start_service("usage", {...}, log_dir)`` runs ``python -m cachet.usage`` on a free
port and returns once gRPC health says SERVING; ``ServiceProcess.stop()`` ends it.
``CachetStack`` starts the whole request path: tokenizer, usage, two engines on the
tiny model, the cache index following them, and the router.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cachet.loopback_port import free_loopback_port as free_port
from cachet.tls import TlsSettings, blocking_channel

TINY_MODEL_ID = "tiny-llama"
SERVICE_START_TIMEOUT = 120.0
# An engine loads a model and starts its loop process: slower, and slowest beside other starts.
ENGINE_START_TIMEOUT = 300.0
ENGINE_SERVER_BUILT = importlib.util.find_spec("cachet.engine.main") is not None


def child_pids(pid: int) -> list[int]:
    """The live children of ``pid`` (all its threads'): an engine server's loop process."""
    return [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]


@dataclass
class ServiceProcess:
    """One ``python -m cachet.<service>`` process and where it listens."""

    name: str
    process: subprocess.Popen[bytes]
    address: str
    log_path: Path
    # Where its Prometheus /metrics is (the bridge's: its REST port).
    metrics_port: int = 0
    # How a client reaches it: the CA and pair of its CACHET_TLS_* variables; None: plaintext.
    tls: TlsSettings | None = None

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signum)
            try:
                return self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, chars: int = 4000) -> str:
        return self.output()[-chars:]


def launch_service(
    service: str, env: dict[str, str], log_dir: Path, *, name: str | None = None, port: int | None = None
) -> ServiceProcess:
    """Spawn ``python -m cachet.<service>`` with ``env`` on ``port`` (a free one by default); no waiting.

    The inherited environment loses every ``CACHET_*`` variable (the test decides them
    all) and gets one thread per math library: the test box has two shared cores. A gRPC
    service's /metrics goes on a free port too (``env`` may choose another, or 0: none),
    not its default one that a neighbour may hold.
    """
    name = name or service
    port = port or free_port()
    base = {key: value for key, value in os.environ.items() if not key.startswith("CACHET_")}
    base |= {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CACHET_DEVICE": "cpu", "PYTHONUNBUFFERED": "1"}
    own = {f"CACHET_{service.upper()}_PORT": str(port)}
    metrics_variable = f"CACHET_{service.upper()}_METRICS_PORT"
    if service != "bridge":
        own[metrics_variable] = str(free_port())
    full_env = base | own | env
    metrics_port = port if service == "bridge" else int(full_env[metrics_variable])
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", f"cachet.{service}"], env=full_env, stdout=sink, stderr=subprocess.STDOUT
        )
    return ServiceProcess(name, process, f"127.0.0.1:{port}", log_path, metrics_port, _client_tls(full_env))


def _client_tls(env: dict[str, str]) -> TlsSettings | None:
    if "CACHET_TLS_CA_FILE" not in env:
        return None
    return TlsSettings(
        ca_file=env["CACHET_TLS_CA_FILE"],
        client_cert_file=env.get("CACHET_TLS_CERT_FILE"),
        client_key_file=env.get("CACHET_TLS_KEY_FILE"),
    )


def start_service(
    service: str,
    env: dict[str, str],
    log_dir: Path,
    *,
    name: str | None = None,
    port: int | None = None,
    timeout: float = SERVICE_START_TIMEOUT,
) -> ServiceProcess:
    """``launch_service``, then wait until gRPC health says SERVING."""
    running = launch_service(service, env, log_dir, name=name, port=port)
    try:
        wait_serving(running, timeout)
    except BaseException:
        running.stop(signal.SIGKILL)
        raise
    return running


def wait_http_healthy(running: ServiceProcess, timeout: float = 60.0) -> None:
    """Until GET /health answers at all (200 or 503): an HTTP service is up and listening."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if running.process.poll() is not None:
            pytest.fail(f"{running.name} exited with {running.process.returncode}:\n{running.log_tail()}")
        try:
            httpx.get(f"http://{running.address}/health", timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.05)
    running.stop(signal.SIGKILL)
    pytest.fail(f"{running.name} not listening after {timeout} s:\n{running.log_tail()}")


def wait_serving(running: ServiceProcess, timeout: float) -> None:
    """Poll the standard gRPC health service until SERVING, failing fast if the process dies."""
    deadline = time.monotonic() + timeout
    with blocking_channel(running.address, running.tls) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if running.process.poll() is not None:
                pytest.fail(f"{running.name} exited with {running.process.returncode}:\n{running.log_tail()}")
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    pytest.fail(f"{running.name} not serving after {timeout} s:\n{running.log_tail()}")


@dataclass
class CachetStack:
    """Every service of the request path, started in dependency order."""

    log_dir: Path
    model_dir: Path
    processes: dict[str, ServiceProcess] = field(default_factory=dict)

    def start(
        self,
        engines: int = 2,
        engine_env: dict[str, str] | None = None,
        router_env: dict[str, str] | None = None,
        usage_env: dict[str, str] | None = None,
        engine_roles: Sequence[str] = (),
        each_engine_env: Sequence[dict[str, str]] = (),
    ) -> CachetStack:
        """Start everything; ``engine_env`` adds variables to every engine (limits, KV size), ``router_env``
        to the router, ``usage_env`` to the usage service (its store); ``engine_roles``: the first
        engines' CACHET_ENGINE_ROLE (disaggregated prefill), in order; ``each_engine_env``: the
        first engines' own variables, in order."""
        try:
            self._start(
                engines, engine_env or {}, router_env or {}, usage_env or {}, engine_roles, each_engine_env
            )
        except BaseException:
            self.stop()
            raise
        return self

    def _start(
        self,
        engines: int,
        engine_env: dict[str, str],
        router_env: dict[str, str],
        usage_env: dict[str, str],
        engine_roles: Sequence[str],
        each_engine_env: Sequence[dict[str, str]] = (),
    ) -> None:
        roles = [{"CACHET_ENGINE_ROLE": role} for role in engine_roles]
        roles += [{}] * (engines - len(roles))
        for index, own in enumerate(each_engine_env):
            roles[index] = roles[index] | own
        # The tokenizer, usage and the engines need nothing from one another: launched together,
        # one's imports and model load overlap another's, and a stack is up in about half the time
        # (the suite starts some thirty). The cache index follows the engines, the router all of them.
        independent = [
            launch_service(
                "tokenizer", {"CACHET_TOKENIZER_MODELS": json.dumps([str(self.model_dir)])}, self.log_dir
            ),
            launch_service(
                "usage", {"CACHET_DATA_DIR": str(self.log_dir / "usage-data")} | usage_env, self.log_dir
            ),
        ] + [
            launch_service(
                "engine",
                {"CACHET_MODEL": str(self.model_dir)} | engine_env | roles[index],
                self.log_dir,
                name=f"engine{index}",
            )
            for index in range(engines)
        ]
        for running in independent:
            self._add(running)
        for running in independent:
            wait_serving(
                running, ENGINE_START_TIMEOUT if running.name.startswith("engine") else SERVICE_START_TIMEOUT
            )
        self._add(
            start_service(
                "cache", {"CACHET_CACHE_ENGINE_ADDRESSES": json.dumps(self.engine_addresses)}, self.log_dir
            )
        )
        self._add(self.start_router(**router_env))

    def start_router(self, name: str = "router", **overrides: str) -> ServiceProcess:
        """A router wired to this stack; ``overrides`` replace its CACHET_ROUTER_* variables."""
        env = {
            "CACHET_ROUTER_TOKENIZER_ADDRESS": self.processes["tokenizer"].address,
            "CACHET_ROUTER_USAGE_ADDRESS": self.processes["usage"].address,
            "CACHET_ROUTER_CACHE_ADDRESS": self.processes["cache"].address,
            "CACHET_ROUTER_ENGINE_ADDRESSES": json.dumps(self.engine_addresses),
            # The router's durable queue: one file per stack, kept across router restarts.
            "CACHET_DATA_DIR": str(self.log_dir / "router-data"),
        } | overrides
        return start_service("router", env, self.log_dir, name=name)

    def start_bridge(self, name: str = "bridge", **env: str) -> ServiceProcess:
        """The REST bridge in front of this stack's router, returned once the router answers behind it;
        ``env`` adds or replaces its variables (API keys, limits, another router's address)."""
        port = free_port()
        bridge = launch_service(
            "bridge",
            {
                "CACHET_PORT": str(port),
                "CACHET_BRIDGE_ROUTER_ADDRESS": self.address("router"),
                "CACHET_BRIDGE_USAGE_ADDRESS": self.address("usage"),
            }
            | env,
            self.log_dir,
            name=name,
            port=port,
        )
        self._add(bridge)
        wait_http_healthy(bridge)
        deadline = time.monotonic() + 60
        while httpx.get(f"http://{bridge.address}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, f"router never healthy behind the bridge:\n{self.logs()}"
            time.sleep(0.1)
        return bridge

    @property
    def engine_addresses(self) -> list[str]:
        return [p.address for name, p in self.processes.items() if name.startswith("engine")]

    def address(self, name: str) -> str:
        return self.processes[name].address

    def logs(self) -> str:
        return "\n".join(f"--- {name} ---\n{p.log_tail()}" for name, p in self.processes.items())

    def stop(self) -> None:
        # Reverse start order: the router goes before what it depends on.
        for process in reversed(list(self.processes.values())):
            process.stop()

    def _add(self, process: ServiceProcess) -> None:
        self.processes[process.name] = process
