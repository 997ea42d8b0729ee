"""run-local under TLS: its probes and its announced URL follow the CACHET_TLS_* its services read."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from tls_certs import TestPki

from cachet.config import ServiceSettings
from cachet.grpc_server import create_server
from cachet.tools.run_local import PlannedService, entry_url, is_healthy, metrics_urls


async def test_probes_reach_tls_services_only_with_the_ca(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pki = TestPki.create(tmp_path)
    running = await create_server(ServiceSettings(port=0, tls=pki.server(client_auth=True)), [], [])
    try:
        planned = PlannedService("usage", "cachet.usage", grpc_port=running.port)
        assert not await asyncio.to_thread(is_healthy, planned)
        for name, value in pki.env(client_auth=True).items():
            monkeypatch.setenv(name, value)
        assert await asyncio.to_thread(is_healthy, planned)
    finally:
        await running.stop(grace=None)
    bridge = PlannedService("bridge", "cachet.bridge", http_port=8080, metrics_port=8080)
    assert entry_url([bridge]) == "Cachet REST API on https://127.0.0.1:8080"
    assert metrics_urls([bridge]).split() == ["bridge", "https://127.0.0.1:8080/metrics"]
    monkeypatch.delenv("CACHET_TLS_CERT_FILE")
    monkeypatch.delenv("CACHET_TLS_KEY_FILE")
    monkeypatch.delenv("CACHET_TLS_CLIENT_AUTH")
    assert entry_url([bridge]) == "Cachet REST API on http://127.0.0.1:8080"
    assert metrics_urls([bridge]).split() == ["bridge", "http://127.0.0.1:8080/metrics"]
