"""`cachet run-local` as a user starts it: every service up, the URL printed, a request served,
every service killed with SIGKILL in turn and back, a clean stop.

run-local listens on its fixed internal ports (README), so this test needs them free.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from service_processes import free_port, start_service

from cachet.config import LOOPBACK
from cachet.engine_layout import EngineLayout
from cachet.models.tiny import write_tiny_model
from cachet.tools.run_local import PlannedService, is_healthy, plan_services

CACHET = str(Path(sys.executable).with_name("cachet"))
START_TIMEOUT_SECONDS = 240
SERVICES = [b"tokenizer", b"usage", b"engine0", b"engine1", b"cache", b"router", b"bridge"]


@pytest.mark.timeout(900)
def test_run_local_announces_its_url_serves_a_chat_survives_kills_and_stops_cleanly(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny-llama")
    port = free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CACHET_")}
    env = clean | {
        "CACHET_PORT": str(port),
        "CACHET_REPLICAS": "2",
        "CACHET_MODEL": str(model),
        "CACHET_DATA_DIR": str(tmp_path / "data"),
        "OMP_NUM_THREADS": "1",
    }
    # run-local's internal ports are fixed; a server of an earlier test, given one of them as a
    # free ephemeral port, may still be shutting down.
    _wait_until_free(
        [s.grpc_port for s in plan_services(port, EngineLayout(2, 1, 1), model) if s.grpc_port is not None]
    )
    log = (tmp_path / "run-local.log").open("w+b")
    process = subprocess.Popen(
        [CACHET, "run-local"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        url = _announced_url(process, log)
        assert url == f"http://127.0.0.1:{port}"
        answer = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 3
        # Every service started once: none crashed at start and was left out.
        started = re.findall(rb"(\w+) +\| started \(pid=", _read(log))
        assert sorted(started) == sorted(SERVICES)
        # Each service killed outright comes back, and a request after it is served.
        planned = {s.name: s for s in plan_services(port, EngineLayout(2, 1, 1), model)}
        for name in SERVICES:
            pids = re.findall(rb"%s +\| started \(pid=(\d+)\)" % name, _read(log))
            os.kill(int(pids[-1]), signal.SIGKILL)
            _wait_restarted(process, log, name, len(pids) + 1, planned[name.decode()])
            answer = httpx.post(
                f"{url}/v1/chat/completions",
                json={
                    "model": "tiny-llama",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                },
                timeout=60,
            )
            assert answer.status_code == 200, (name, answer.text)
            assert f"{name.decode()} exited (rc=-9); restarting it".encode() in _read(log)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            returncode = process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
    assert b"Check failed" not in _read(log), _read(log)[-4000:].decode(errors="replace")
    assert returncode == 0, _read(log)[-4000:].decode(errors="replace")
    # Seven stops at the end, and one for each kill.
    assert _read(log).count(b"| stopped (rc=") == 2 * len(SERVICES)


@pytest.mark.timeout(600)
def test_two_routers_share_one_store_behind_one_bridge(tmp_path: Path, postgres_schemas) -> None:
    store = postgres_schemas.create_now()
    model = write_tiny_model(tmp_path / "tiny-llama")
    port = free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CACHET_")}
    env = clean | {
        "CACHET_PORT": str(port),
        "CACHET_REPLICAS": "1",
        "CACHET_ROUTERS": "2",
        "CACHET_STORE_URL": store,
        "CACHET_MODEL": str(model),
        "CACHET_DATA_DIR": str(tmp_path / "data"),
        "OMP_NUM_THREADS": "1",
    }
    planned = plan_services(port, EngineLayout(1, 1, 1), model, routers=2)
    assert [s.name for s in planned if s.module == "cachet.router"] == ["router0", "router1"]
    _wait_until_free([s.grpc_port for s in planned if s.grpc_port is not None])
    log = (tmp_path / "run-local.log").open("w+b")
    process = subprocess.Popen(
        [CACHET, "run-local"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        url = _announced_url(process, log)
        # The bridge spreads requests over the routers it is connected to, and a router that came
        # up after the bridge's first connection attempt joins once that attempt's backoff ends
        # (the URL can be announced sooner): so requests go on until both have served, or 20 s.
        deadline = time.monotonic() + 20
        served: set[bytes] = set()
        while len(served) < 2 and time.monotonic() < deadline:
            answer = httpx.post(
                f"{url}/v1/chat/completions",
                json={
                    "model": "tiny-llama",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                },
                timeout=60,
            )
            assert answer.status_code == 200, answer.text
            served = {
                r for r in (b"router0", b"router1") if re.search(rb"%s +\| .*request done" % r, _read(log))
            }
        # Both routers served, sharing the store.
        assert served == {b"router0", b"router1"}, served
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
        postgres_schemas.drop_now(store)


def test_several_routers_without_a_shared_store_are_refused(tmp_path: Path) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CACHET_")}
    env = clean | {"CACHET_ROUTERS": "2", "CACHET_DATA_DIR": str(tmp_path)}
    refused = subprocess.run([CACHET, "run-local"], env=env, capture_output=True, timeout=120)
    assert refused.returncode != 0
    assert b"CACHET_ROUTERS=2 needs the routers to share one store" in refused.stderr + refused.stdout


def _wait_restarted(
    process: subprocess.Popen[bytes], log, name: bytes, starts: int, service: PlannedService
) -> None:
    """Until ``name`` has started ``starts`` times and answers its health check again."""
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"run-local exited:\n{_read(log)[-4000:].decode(errors='replace')}")
        restarted = len(re.findall(rb"%s +\| started \(pid=" % name, _read(log))) >= starts
        if restarted and is_healthy(service):
            return
        time.sleep(0.5)
    # What it printed says where it stopped (a CI run once saw only this line).
    tail = _read(log)[-6000:].decode(errors="replace")
    pytest.fail(f"{name.decode()} not back after {START_TIMEOUT_SECONDS} s:\n{tail}")


def _wait_until_free(ports: list[int], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    for port in ports:
        while True:
            with socket.socket() as probe:
                # As the servers bind: connections of an earlier run left in TIME_WAIT do not count.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind((LOOPBACK, port))
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        pytest.fail(f"run-local's port {port} is still taken after {timeout} s")
            time.sleep(0.2)


def _announced_url(process: subprocess.Popen[bytes], log) -> str:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        match = re.search(rb"Cachet REST API on (http://\S+)", _read(log))
        if match:
            return match.group(1).decode()
        if process.poll() is not None:
            pytest.fail(
                f"run-local exited with {process.returncode}:\n{_read(log)[-4000:].decode(errors='replace')}"
            )
        time.sleep(0.5)
    pytest.fail(f"no URL after {START_TIMEOUT_SECONDS} s:\n{_read(log)[-4000:].decode(errors='replace')}")


def _read(log) -> bytes:
    log.flush()
    log.seek(0)
    return log.read()


def test_a_router_that_has_heard_from_no_engine_is_not_ready_to_announce(tmp_path: Path) -> None:
    """Its gRPC health says SERVING (it serves before slow engines report), but a request it
    took now would be refused: run-local must not print the URL yet."""
    nowhere = f"{LOOPBACK}:{free_port()}"
    env = {
        "CACHET_ROUTER_ENGINE_ADDRESSES": f'["{nowhere}"]',
        "CACHET_ROUTER_TOKENIZER_ADDRESS": nowhere,
        "CACHET_ROUTER_USAGE_ADDRESS": nowhere,
        "CACHET_ROUTER_CACHE_ADDRESS": nowhere,
        "CACHET_ROUTER_STARTUP_WAIT_SECONDS": "0",
        "CACHET_DATA_DIR": str(tmp_path),
    }
    router = start_service("router", env, tmp_path)
    try:
        port = int(router.address.rsplit(":", 1)[1])
        planned = PlannedService("router", "cachet.router", grpc_port=port, ready_when_it_lists_a_model=True)
        assert not is_healthy(planned)
    finally:
        assert router.stop() == 0, router.log_tail()
