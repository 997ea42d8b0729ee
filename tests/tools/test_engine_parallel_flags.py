"""`--tp` / `--ep` and CACHET_TP / CACHET_EP reach the engine, which checks the pair at start.

The refusals run the real `cachet` command: each value seen in the engine's error
came through the flag or variable under test. That a replica then really runs the
chosen layout is tests/engine/test_tensor_parallel.py's business (EngineInfo).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cachet.models.tiny import write_tiny_model
from cachet.tools.run_local import machine_layout, plan_services

CACHET = str(Path(sys.executable).with_name("cachet"))


def _cachet(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("CACHET_TP", "CACHET_EP", "CACHET_MODEL")}
    environment = {**clean, "CACHET_DATA_DIR": str(tmp_path / "data"), **env}
    return subprocess.run(
        [CACHET, *args], env=environment, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize(
    ("environment", "expected"),
    [({}, ("1", "1")), ({"CACHET_TP": "2", "CACHET_EP": "2"}, ("2", "2"))],
)
def test_run_local_gives_every_engine_replica_tp_and_ep(
    environment: dict[str, str],
    expected: tuple[str, str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    for name in ("CACHET_TP", "CACHET_EP"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    engines = [s for s in plan_services(8080, machine_layout(3), tmp_path) if s.module == "cachet.engine"]
    assert len(engines) == 3
    layout = machine_layout(3)
    for engine in engines:
        assert (engine.env["CACHET_TP"], engine.env["CACHET_EP"]) == expected
        # Each rank gets its share of the cores, not all of them.
        assert engine.env["CACHET_ENGINE_THREADS"] == str(layout.threads_per_rank)


def test_serve_engine_refuses_an_ep_other_than_1_or_tp(tmp_path: Path) -> None:
    by_flags = _cachet(["serve", "engine", "--tp", "2", "--ep", "3"], tmp_path)
    assert by_flags.returncode != 0
    assert "CACHET_EP=3 (--ep) must be 1 or equal to CACHET_TP=2" in by_flags.stderr, by_flags.stderr
    # The same rule through the environment alone (what run-local sets): EP=2 needs TP=2.
    by_environment = _cachet(["serve", "engine"], tmp_path, CACHET_EP="2")
    assert by_environment.returncode != 0
    assert "CACHET_EP=2 (--ep) must be 1 or equal to CACHET_TP=1" in by_environment.stderr
    # A launcher's follower rank (deepspeed, torchrun) refuses too, rather than wait at the rendezvous.
    launched = _cachet(["serve", "engine", "--tp", "2", "--ep", "3"], tmp_path, RANK="1", WORLD_SIZE="2")
    assert launched.returncode != 0
    assert "CACHET_EP=3 (--ep) must be 1 or equal to CACHET_TP=2" in launched.stderr, launched.stderr
    # One line, not a traceback.
    assert "Traceback" not in by_flags.stderr + by_environment.stderr + launched.stderr


def test_serve_engine_refuses_expert_parallel_for_a_dense_model(tmp_path: Path) -> None:
    llama = write_tiny_model(tmp_path / "tiny-llama", tokenizer_cache_dir=tmp_path / "tok-cache")
    refused = _cachet(["serve", "engine", "--tp", "2", "--ep", "2"], tmp_path, CACHET_MODEL=str(llama))
    assert refused.returncode != 0
    assert "has no routed experts" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr


def test_ep_is_an_engine_flag(tmp_path: Path) -> None:
    refused = _cachet(["serve", "router", "--ep", "2"], tmp_path)
    assert refused.returncode == 2
    assert "--ep applies to the engine only" in refused.stderr
