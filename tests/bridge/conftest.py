"""Bridge test fixtures: the app in-process (httpx over ASGI) and real service processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from fastapi import FastAPI
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cachet.bridge.app import create_app
from cachet.bridge.settings import BridgeServiceSettings

# Nothing listens on port 1: calls to it fail UNAVAILABLE at once, which is what an
# app with no reachable router must answer (503), without any fake service.
NOWHERE = "127.0.0.1:1"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def bridge_settings(**overrides: object) -> BridgeServiceSettings:
    values: dict[str, object] = {"router_address": NOWHERE, "usage_address": NOWHERE, "api_keys": {}}
    return BridgeServiceSettings(**(values | overrides))


@asynccontextmanager
async def serve_in_process(app: FastAPI, lifespan: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client talking to ``app`` over ASGI; the lifespan (gRPC channels) runs unless told not to."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://bridge.test") as client:
        if not lifespan:
            yield client
            return
        async with app.router.lifespan_context(app):
            yield client


@pytest.fixture
def make_client() -> Callable[..., object]:
    """``async with make_client(**settings) as client``: a fresh app per test."""

    def make(**overrides: object):
        return serve_in_process(create_app(bridge_settings(**overrides)))

    return make


@dataclass
class ServiceProcess:
    """A Cachet service started as ``python -m cachet.<name>``."""

    name: str
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, signum: int = signal.SIGTERM) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signum)
        try:
            return self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=5)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def launch(name: str, env: dict[str, str], log_dir: Path, port: int) -> ServiceProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CACHET_")}
    log = log_dir / f"{name}.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", f"cachet.{name}"], env=clean | env, stdout=sink, stderr=sink
        )
    return ServiceProcess(name, process, port, log)


def wait_grpc_serving(service: ServiceProcess, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(service.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if service.process.poll() is not None:
                pytest.fail(f"{service.name} exited with {service.process.returncode}:\n{service.output()}")
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    service.stop(signal.SIGKILL)
    pytest.fail(f"{service.name} not serving after {timeout}s:\n{service.output()}")


def wait_http_healthy(service: ServiceProcess, timeout: float = 30.0) -> None:
    """Until GET /health answers at all (200 or 503): the bridge is up and listening."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if service.process.poll() is not None:
            pytest.fail(f"{service.name} exited with {service.process.returncode}:\n{service.output()}")
        try:
            httpx.get(f"http://{service.address}/health", timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.05)
    service.stop(signal.SIGKILL)
    pytest.fail(f"{service.name} not listening after {timeout}s:\n{service.output()}")
