"""`cachet keys` on each store: the command writes the store a router opens, and the router's store
reads back what it wrote (on SQLite under CACHET_DATA_DIR, on PostgreSQL at CACHET_STORE_URL)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from queue_backends import QueueBackend

from cachet.router.api_keys import KeyLimits


def keys(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cachet.tools.cli", "keys", *args],
        env=os.environ | env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def store_env(queue_backend: QueueBackend, request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    if queue_backend.name == "sqlite":
        return {"CACHET_DATA_DIR": str(tmp_path), "CACHET_STORE_URL": ""}
    return {"CACHET_STORE_URL": request.getfixturevalue("postgres_url")}


async def test_create_list_revoke_through_the_command(
    queue_backend: QueueBackend, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    env = store_env(queue_backend, request, tmp_path)
    made = keys(
        env, "create", "--account", "acct-cli", "--name", "deploy", "--rpm", "30", "--tpm", "5000",
        "--monthly-budget-usd", "12.5", "--expires-in-days", "7", "--json",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    created = json.loads(made.stdout)
    key, key_id = created["key"], created["key_id"]
    assert created["monthly_budget_usd"] == "12.5" and created["state"] == "active"

    store = await queue_backend.open(None)
    try:
        record = await store.api_key(key_id)
        assert record is not None and record.matches(key) and record.account_id == "acct-cli"
        assert record.limits == KeyLimits(30, 5000, 12_500_000_000_000)
        assert record.expires_at_ms - record.created_at_ms == 7 * 86_400_000
    finally:
        await store.close()

    listed = keys(env, "list", "--account", "acct-cli", "--json")
    assert listed.returncode == 0, listed.stderr
    [row] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert row["key_id"] == key_id and row["name"] == "deploy" and key not in listed.stdout
    assert "key_hash" not in row
    human = keys(env, "list")
    assert key_id in human.stdout and "rpm 30" in human.stdout

    revoked = keys(env, "revoke", key_id)
    assert revoked.returncode == 0 and revoked.stdout.startswith(f"{key_id} revoked at ")
    assert json.loads(keys(env, "list", "--json").stdout)["state"] == "revoked"
    unknown = keys(env, "revoke", "key_0000000000000000")
    assert unknown.returncode == 1 and "no key" in unknown.stderr


def test_bad_input_is_a_usage_error_naming_the_option(tmp_path: Path) -> None:
    env = {"CACHET_DATA_DIR": str(tmp_path), "CACHET_STORE_URL": ""}
    for args, option in (
        (("--account", ""), "--account"),
        (("--account", "a", "--monthly-budget-usd", "lots"), "--monthly-budget-usd"),
        (("--account", "a", "--rpm", "-1"), "--rpm"),
    ):
        refused = keys(env, "create", *args)
        assert refused.returncode == 2 and option in refused.stderr, refused.stderr
