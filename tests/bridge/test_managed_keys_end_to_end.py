"""Managed API keys and their limits through the whole platform: `cachet keys` writes the router's
store, the bridge and the router accept the key, count it, and refuse it past its limits.

Real processes on the tiny model (one engine), a real SQLite store written by the real
command, the real usage ledger summing each key's spend. The caches that would delay a
revoke or a spend are set to 0 here, so every step is seen at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from service_processes import ENGINE_SERVER_BUILT, TINY_MODEL_ID, CachetStack, ServiceProcess

from cachet.models.tiny import write_tiny_model

BOOTSTRAP = {"sk-boot": "ops"}
TIMEOUT = 120.0


@dataclass
class Platform:
    stack: CachetStack
    bridge: ServiceProcess

    @property
    def url(self) -> str:
        return f"http://{self.bridge.address}"

    def keys(self, *args: str) -> str:
        """Run `cachet keys ...` on the router's store, as an operator would; its stdout."""
        env = os.environ | {"CACHET_DATA_DIR": str(self.stack.log_dir / "router-data")}
        env.pop("CACHET_STORE_URL", None)
        done = subprocess.run(
            [sys.executable, "-m", "cachet.tools.cli", "keys", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def create_key(self, *args: str) -> tuple[str, str]:
        made = json.loads(self.keys("create", "--json", *args))
        return made["key"], made["key_id"]

    def listed(self, key_id: str) -> dict[str, Any]:
        rows = [json.loads(line) for line in self.keys("list", "--json").splitlines()]
        return next(row for row in rows if row["key_id"] == key_id)

    def chat(self, key: str, stream: bool = False) -> httpx.Response:
        body = {
            "model": TINY_MODEL_ID,
            "messages": [{"role": "user", "content": f"[{uuid.uuid4().hex}] Say hi."}],
            "max_tokens": 4,
            "stream": stream,
        }
        headers = {"Authorization": f"Bearer {key}"}
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, headers=headers, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    if not ENGINE_SERVER_BUILT:
        pytest.skip("the engine server (cachet.engine.main) is not built yet")
    root = tmp_path_factory.mktemp("managed-keys")
    router_env = {
        "CACHET_API_KEYS": json.dumps(BOOTSTRAP),
        "CACHET_ROUTER_API_KEY_CACHE_SECONDS": "0",
        "CACHET_ROUTER_BUDGET_CACHE_SECONDS": "0",
        # One queued job at a time: the next starts only once the last one's usage is in the ledger.
        "CACHET_ROUTER_BATCH_MAX_IN_FLIGHT": "1",
    }
    stack = CachetStack(root, write_tiny_model(root / TINY_MODEL_ID)).start(engines=1, router_env=router_env)
    try:
        bridge = stack.start_bridge(
            CACHET_API_KEYS=json.dumps(BOOTSTRAP), CACHET_BRIDGE_KEY_CACHE_SECONDS="0"
        )
        yield Platform(stack, bridge)
    finally:
        stack.stop()
        print(stack.logs())


def refused(response: httpx.Response, status: int, kind: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == kind or error["code"] == kind, error
    return error


def test_a_managed_key_serves_its_account_until_revoked(platform: Platform) -> None:
    key, key_id = platform.create_key("--account", "acct-managed", "--name", "ci")
    assert platform.listed(key_id)["last_used_at"] is None
    answered = platform.chat(key)
    assert answered.status_code == 200, answered.text
    # Billed to the key's account: its usage report is the only one that shows the call.
    usage = httpx.get(f"{platform.url}/v1/usage", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert usage.status_code == 200, usage.text
    deadline = time.monotonic() + 10
    while platform.listed(key_id)["last_used_at"] is None:  # written beside the call
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert platform.listed(key_id)["account"] == "acct-managed"
    assert "sk-cachet" not in platform.keys("list", "--json")

    assert platform.keys("revoke", key_id).startswith(f"{key_id} revoked at ")
    refused(platform.chat(key), 401, "invalid_api_key")
    assert platform.listed(key_id)["state"] == "revoked"
    # The bootstrap key of CACHET_API_KEYS still works, and a forged managed key never did.
    assert platform.chat("sk-boot").status_code == 200
    refused(platform.chat(key[:-6] + "AAAAAA"), 401, "invalid_api_key")


def test_an_expired_key_is_refused(platform: Platform) -> None:
    key, key_id = platform.create_key("--account", "acct-managed", "--expires-in-days", "0.00003")  # 2.6 s
    assert platform.chat(key).status_code == 200
    time.sleep(3)
    refused(platform.chat(key), 401, "invalid_api_key")
    assert platform.listed(key_id)["state"] == "expired"


def test_over_its_requests_a_minute_a_key_gets_429_with_openai_s_headers(platform: Platform) -> None:
    key, _ = platform.create_key("--account", "acct-limited", "--rpm", "2")
    # Every admitted answer says what is left, as OpenAI's do; streamed ones too.
    first, second = platform.chat(key), platform.chat(key, stream=True)
    assert first.status_code == second.status_code == 200
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert second.headers["x-ratelimit-remaining-requests"] == "0"
    assert second.headers["x-ratelimit-reset-requests"].endswith("s")
    assert "x-ratelimit-limit-requests" not in platform.chat("sk-boot").headers  # no limits, no headers
    for stream in (False, True):
        response = platform.chat(key, stream=stream)
        error = refused(response, 429, "requests")
        assert error["code"] == "rate_limit_exceeded"
        headers = response.headers
        assert headers["x-ratelimit-limit-requests"] == "2"
        assert headers["x-ratelimit-remaining-requests"] == "0"
        assert headers["x-ratelimit-reset-requests"].endswith("s")
        assert 1 <= int(headers["retry-after"]) <= 60
        assert "x-ratelimit-limit-tokens" not in headers  # no token limit on this key
    # Another key of the same account has limits of its own.
    other, _ = platform.create_key("--account", "acct-limited")
    assert platform.chat(other).status_code == 200


def test_over_its_tokens_a_minute_a_key_gets_429(platform: Platform) -> None:
    key, _ = platform.create_key("--account", "acct-limited", "--tpm", "10")
    assert platform.chat(key).status_code == 200  # under the limit when admitted; it uses more
    # Its tokens count once its usage reaches the ledger, a few milliseconds after the answer.
    for _ in range(20):
        response = platform.chat(key)
        if response.status_code != 200:
            break
        time.sleep(0.1)
    refused(response, 429, "tokens")
    assert response.headers["x-ratelimit-limit-tokens"] == "10"
    assert response.headers["x-ratelimit-remaining-tokens"] == "0"
    assert response.headers["x-ratelimit-reset-tokens"].endswith("s")
    assert int(response.headers["retry-after"]) >= 1


def test_past_its_monthly_budget_a_key_gets_insufficient_quota(platform: Platform) -> None:
    # A tiny model's request costs tens of micro-dollars at the default prices: one spends it all.
    key, _ = platform.create_key("--account", "acct-budget", "--monthly-budget-usd", "0.000001")
    assert platform.chat(key).status_code == 200
    for _ in range(20):
        response = platform.chat(key)
        if response.status_code != 200:
            break
        time.sleep(0.1)
    error = refused(response, 429, "insufficient_quota")
    assert "budget" in error["message"]
    assert int(response.headers["retry-after"]) >= 1


def test_queued_jobs_count_against_the_budget_when_they_run(platform: Platform) -> None:
    key, _ = platform.create_key("--account", "acct-queue", "--monthly-budget-usd", "0.000001")
    headers = {"Authorization": f"Bearer {key}"}
    body = {"requests": [{"prompt": f"[{uuid.uuid4().hex}] Count: {n}", "max_tokens": 4} for n in range(3)]}
    model_path = f"{platform.url}/ai/run/{TINY_MODEL_ID}"
    # Queueing three is not three requests of the budget: the call is accepted whole.
    queued = httpx.post(f"{model_path}?queueRequest=true", json=body, headers=headers, timeout=10)
    assert queued.status_code == 200, queued.text
    batch_id = queued.json()["result"]["request_id"]
    deadline = time.monotonic() + TIMEOUT
    while True:
        polled = httpx.post(model_path, json={"request_id": batch_id}, headers=headers, timeout=10)
        assert polled.status_code == 200, polled.text
        result = polled.json()["result"]
        if result["status"] == "done":
            break
        assert time.monotonic() < deadline, result
        time.sleep(0.2)
    responses = result["responses"]
    # The first job ran within the budget and spent it; the others, admitted as they started, were refused.
    assert "error" not in responses[0], responses[0]
    for later in responses[1:]:
        assert "budget" in json.dumps(later), later
    # The key itself is now over its budget for interactive calls too.
    refused(platform.chat(key), 429, "insufficient_quota")


def test_a_queued_job_past_its_key_s_minute_waits_while_other_batches_run(platform: Platform) -> None:
    key, _ = platform.create_key("--account", "acct-rpm-queue", "--rpm", "1")
    model_path = f"{platform.url}/ai/run/{TINY_MODEL_ID}"

    def queue(api_key: str) -> str:
        body = {"requests": [{"prompt": f"[{uuid.uuid4().hex}] {n}", "max_tokens": 2} for n in range(2)]}
        queued = httpx.post(
            f"{model_path}?queueRequest=true",
            json=body,
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=10,
        )
        assert queued.status_code == 200, queued.text
        return queued.json()["result"]["request_id"]

    def status(batch_id: str, api_key: str) -> str:
        polled = httpx.post(
            model_path,
            json={"request_id": batch_id},
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=10,
        )
        assert polled.status_code == 200, polled.text
        return polled.json()["result"]["status"]

    limited, other = queue(key), queue("sk-boot")
    deadline = time.monotonic() + TIMEOUT
    while status(other, "sk-boot") != "done":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    # The limited key's first job ran; its second waits for the key's minute, in the queue.
    time.sleep(2)
    assert status(limited, key) == "running"
