"""run-local with CACHET_PREFILL_REPLICAS: prefill and decode replicas beside each other, sharing
the KV tier they hand prompts over through, the cores divided between all of them.

That the router then sends long prompts to the prefill replicas is the router's tests' business;
here, what run-local starts and what it refuses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cachet.engine.settings import EngineSettings
from cachet.engine_layout import EngineLayout
from cachet.models.tiny import write_tiny_model
from cachet.tools import run_local
from cachet.tools.run_local import machine_layout, plan_services, prefill_replicas_from_env

CACHET = str(Path(sys.executable).with_name("cachet"))


@pytest.fixture(autouse=True)
def _no_operator_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in list(os.environ):
        if name.startswith("CACHET_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("CACHET_DATA_DIR", str(tmp_path / "data"))


def _engines(prefill_replicas: int, replicas: int = 3) -> list[run_local.PlannedService]:
    plan = plan_services(8080, EngineLayout(replicas, 1, 1), Path("model"), prefill_replicas=prefill_replicas)
    return [s for s in plan if s.module == "cachet.engine"]


def test_without_prefill_replicas_the_engines_are_as_before() -> None:
    engines = _engines(0)
    assert [s.name for s in engines] == ["engine0", "engine1", "engine2"]
    for engine in engines:
        assert not {"CACHET_ENGINE_ROLE", "CACHET_KV_SHARED_DIR", "CACHET_KV_HOST_GB"} & set(engine.env)


def test_prefill_replicas_come_after_the_decode_replicas_and_share_one_tier(tmp_path: Path) -> None:
    plan = plan_services(8080, EngineLayout(3, 1, 1), Path("model"), prefill_replicas=2)
    engines = [s for s in plan if s.module == "cachet.engine"]
    assert [(s.name, s.env["CACHET_ENGINE_ROLE"], s.grpc_port) for s in engines] == [
        ("decode0", "decode", 50061),
        ("prefill1", "prefill", 50062),
        ("prefill2", "prefill", 50063),
    ]
    for engine in engines:
        assert engine.env["CACHET_KV_SHARED_DIR"] == str(tmp_path.resolve() / "data" / "kv-shared")
        assert engine.env["CACHET_KV_HOST_GB"] == run_local.DEFAULT_KV_HOST_GB
        # What the engine's own settings accept: a role with its transport, one rank.
        settings = _engine_settings(engine.env)
        assert settings.role == engine.env["CACHET_ENGINE_ROLE"]
    # The decode replica also takes KV pushed to it, on its own port.
    assert [s.env.get("CACHET_ENGINE_KV_TRANSFER_PORT") for s in engines] == ["50161", None, None]
    # Tensor-parallel decode replicas too: their ranks pair with the prefill replica's, shard to shard.
    tensor_parallel = plan_services(8080, EngineLayout(2, 2, 1), Path("model"), prefill_replicas=1)
    assert [
        s.env.get("CACHET_ENGINE_KV_TRANSFER_PORT") for s in tensor_parallel if s.module == "cachet.engine"
    ] == ["50161", None]
    # The routers and the cache index follow every replica, whatever its role.
    addresses = [f"127.0.0.1:{port}" for port in (50061, 50062, 50063)]
    for service in plan:
        for variable in ("CACHET_ROUTER_ENGINE_ADDRESSES", "CACHET_CACHE_ENGINE_ADDRESSES"):
            if variable in service.env:
                assert json.loads(service.env[variable]) == addresses
    summary = run_local.engine_summary(plan)
    assert "decode0 (decode) on 127.0.0.1:50061" in summary
    assert "prefill2 (prefill) on 127.0.0.1:50063" in summary


def _engine_settings(env: dict[str, str]) -> EngineSettings:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        return EngineSettings()


def test_the_operators_shared_folder_and_host_tier_are_kept(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CACHET_KV_SHARED_DIR", str(tmp_path / "nfs"))
    monkeypatch.setenv("CACHET_KV_HOST_GB", "3.5")
    for engine in _engines(1, replicas=2):
        assert engine.env["CACHET_KV_SHARED_DIR"] == str(tmp_path / "nfs")
        assert engine.env["CACHET_KV_HOST_GB"] == "3.5"


@pytest.mark.parametrize(
    ("cores", "replicas", "prefill", "expected"),
    [
        # Two decode replicas and one prefill on 6 cores: two threads each, not three.
        (6, 2, 1, (3, 2)),
        # Unset CACHET_REPLICAS: the machine's count (64 cores: two) is shared, prefill included.
        (64, None, 1, (2, 32)),
        # ...and leaves at least one decode replica.
        (2, None, 1, (2, 1)),
        (64, None, 0, (2, 32)),
    ],
)
def test_the_cores_are_divided_between_prefill_and_decode_replicas(
    cores: int,
    replicas: int | None,
    prefill: int,
    expected: tuple[int, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(run_local, "available_cores", lambda: cores)
    monkeypatch.setattr(run_local, "_engine_gpus", lambda: 0)
    layout = machine_layout(replicas, prefill)
    assert (layout.replicas, layout.threads_per_rank) == expected
    assert layout.kv_cache_memory_fraction == pytest.approx(0.4 / layout.replicas)


@pytest.mark.parametrize(
    ("environment", "message"),
    [
        ({"CACHET_PREFILL_REPLICAS": "-1"}, "CACHET_PREFILL_REPLICAS=-1 must be a whole number, 0 or more"),
        ({"CACHET_PREFILL_REPLICAS": "1.5"}, "CACHET_PREFILL_REPLICAS=1.5 must be a whole number"),
        ({"CACHET_PREFILL_REPLICAS": "two"}, "CACHET_PREFILL_REPLICAS=two must be a whole number"),
        (
            {"CACHET_PREFILL_REPLICAS": "1", "CACHET_KV_HOST_GB": "0"},
            "CACHET_KV_HOST_GB=0 must be more than 0",
        ),
        ({"CACHET_PREFILL_REPLICAS": "1", "CACHET_KV_HOST_GB": "lots"}, "CACHET_KV_HOST_GB=lots must be"),
    ],
)
def test_refusals(environment: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit, match=message):
        prefill_replicas_from_env()


def test_the_count_is_read_with_or_without_tensor_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    assert prefill_replicas_from_env() == 0
    monkeypatch.setenv("CACHET_PREFILL_REPLICAS", "2")
    assert prefill_replicas_from_env() == 2
    monkeypatch.setenv("CACHET_TP", "2")  # each rank hands over its own shard of the KV
    assert prefill_replicas_from_env() == 2


def test_cachet_run_local_refuses_prefill_replicas_without_a_host_tier_in_one_line(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny-llama", tokenizer_cache_dir=tmp_path / "tok-cache")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CACHET_")}
    env = clean | {
        "CACHET_PREFILL_REPLICAS": "1",
        "CACHET_KV_HOST_GB": "0",
        "CACHET_MODEL": str(model),
        "CACHET_DATA_DIR": str(tmp_path / "data"),
    }
    refused = subprocess.run(
        [CACHET, "run-local"], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert refused.returncode != 0
    assert "CACHET_PREFILL_REPLICAS=1 hands KV over through the shared KV tier" in refused.stderr
    assert "Traceback" not in refused.stderr + refused.stdout
