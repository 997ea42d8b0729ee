"""run-local gives every service a /metrics port of its own and says where each is."""

from __future__ import annotations

from pathlib import Path

from cachet.engine_layout import EngineLayout
from cachet.tools.run_local import metrics_urls, plan_services


def test_every_service_gets_its_own_metrics_port_and_is_announced(tmp_path: Path) -> None:
    planned = plan_services(8123, EngineLayout(2, 1, 1), tmp_path, routers=1)
    ports = {service.name: service.metrics_port for service in planned}
    assert set(ports) == {"tokenizer", "usage", "engine0", "engine1", "cache", "router", "bridge"}
    assert ports["bridge"] == 8123  # served by the bridge's REST app
    assert len(set(ports.values())) == len(ports)
    for service in planned:
        if service.name != "bridge":
            variable = f"CACHET_{service.module.removeprefix('cachet.').upper()}_METRICS_PORT"
            assert service.env[variable] == str(service.metrics_port)
    lines = metrics_urls(planned).splitlines()
    assert len(lines) == len(planned)
    assert f"http://127.0.0.1:{ports['engine1']}/metrics" in lines[3]
