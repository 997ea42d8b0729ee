"""Who is calling: API key to account (bootstrap keys and managed keys in a real store), session."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cachet.errors import Unauthenticated
from cachet.router.api_keys import new_api_key
from cachet.router.caller import (
    ANONYMOUS_ACCOUNT,
    AccountDirectory,
    Caller,
    refuse_open_mode_beyond_loopback,
)
from cachet.router.sqlite_queue_store import SqliteQueueStore


async def test_no_keys_configured_means_anonymous() -> None:
    caller = await AccountDirectory({}).caller([("authorization", "Bearer whatever")], "")
    assert caller == Caller(ANONYMOUS_ACCOUNT, "")


async def test_bearer_key_maps_to_its_account() -> None:
    directory = AccountDirectory({"sk-1": "acct-1", "sk-2": "acct-2"})
    assert (await directory.caller([("authorization", "Bearer sk-2")], "")).account_id == "acct-2"


async def test_the_key_may_come_as_x_api_key_as_over_rest() -> None:
    directory = AccountDirectory({"sk-1": "acct-1", "sk-2": "acct-2"})
    assert (await directory.caller([("x-api-key", "sk-1")], "")).account_id == "acct-1"
    # Both sent: authorization wins, as the bridge reads them.
    both = [("x-api-key", "sk-1"), ("authorization", "Bearer sk-2")]
    assert (await directory.caller(both, "")).account_id == "acct-2"


def test_open_development_mode_listens_on_loopback_only() -> None:
    for host in ("0.0.0.0", "10.1.2.3", "router.example"):
        with pytest.raises(ValueError, match="open development mode may only listen on loopback"):
            refuse_open_mode_beyond_loopback({}, host)
        refuse_open_mode_beyond_loopback({"sk-1": "acct-1"}, host)
    for host in ("127.0.0.1", "::1", "localhost"):
        refuse_open_mode_beyond_loopback({}, host)


@pytest.mark.parametrize(
    "metadata",
    [[], [("authorization", "Bearer nope")], [("authorization", "sk-1")], [("x-api-key", "nope")]],
)
async def test_missing_or_unknown_key_is_unauthenticated(metadata: list[tuple[str, str]]) -> None:
    with pytest.raises(Unauthenticated):
        await AccountDirectory({"sk-1": "acct-1"}).caller(metadata, "")


async def test_session_metadata_wins_over_request_field() -> None:
    directory = AccountDirectory({})
    assert (await directory.caller([("x-session-affinity", "meta")], "field")).session_id == "meta"
    assert (await directory.caller([], "field")).session_id == "field"


class Clock:
    def __init__(self) -> None:
        self.now_ms = 1_000_000

    def __call__(self) -> int:
        return self.now_ms


async def test_a_managed_key_names_its_account_until_revoked_or_expired(tmp_path: Path) -> None:
    clock = Clock()
    store = SqliteQueueStore(tmp_path / "queue.sqlite3", clock_ms=clock)
    try:
        key, record = new_api_key("acct-m", "ci", clock.now_ms, expires_at_ms=clock.now_ms + 3_600_000)
        await store.create_api_key(record)
        revoked_key, revoked = new_api_key("acct-m", "old", clock.now_ms)
        await store.create_api_key(revoked)
        await store.revoke_api_key(revoked.key_id)
        directory = AccountDirectory({"sk-boot": "ops"}, store, cache_seconds=1.0, clock_ms=clock)

        caller = await directory.caller([("authorization", f"Bearer {key}")], "s")
        assert (caller.account_id, caller.api_key_id, caller.session_id) == ("acct-m", record.key_id, "s")
        assert (await directory.caller([("authorization", "Bearer sk-boot")], "")).api_key is None
        # The right id with the wrong secret, a revoked key, a key of another shape: all unknown.
        forged = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
        for bad in (forged, revoked_key, "sk-cachet-nothing"):
            with pytest.raises(Unauthenticated):
                await directory.caller([("authorization", f"Bearer {bad}")], "")

        await store.revoke_api_key(record.key_id)
        assert (
            await directory.caller([("authorization", f"Bearer {key}")], "")
        ).account_id == "acct-m"  # cached
        clock.now_ms += 1_000
        with pytest.raises(Unauthenticated):
            await directory.caller([("authorization", f"Bearer {key}")], "")
    finally:
        await store.close()


async def test_an_expired_key_is_refused_and_a_used_one_says_when(tmp_path: Path) -> None:
    clock = Clock()
    store = SqliteQueueStore(tmp_path / "queue.sqlite3", clock_ms=clock)
    try:
        key, record = new_api_key("acct-m", "", clock.now_ms, expires_at_ms=clock.now_ms + 10_000)
        await store.create_api_key(record)
        directory = AccountDirectory({"sk-boot": "ops"}, store, cache_seconds=0, clock_ms=clock)
        await directory.caller([("authorization", f"Bearer {key}")], "")
        for _ in range(100):  # the last-use write runs beside the call
            stored = await store.api_key(record.key_id)
            if stored is not None and stored.last_used_at_ms:
                break
            await asyncio.sleep(0.01)
        assert stored is not None and stored.last_used_at_ms == clock.now_ms
        clock.now_ms += 10_000
        with pytest.raises(Unauthenticated):
            await directory.caller([("authorization", f"Bearer {key}")], "")
    finally:
        await store.close()


async def test_a_queued_job_runs_as_its_key_until_the_key_is_revoked(tmp_path: Path) -> None:
    clock = Clock()
    store = SqliteQueueStore(tmp_path / "queue.sqlite3", clock_ms=clock)
    try:
        _, record = new_api_key("acct-q", "batch", clock.now_ms)
        await store.create_api_key(record)
        keyed = await store.create_batch("acct-q", "m", [b"job"], api_key_id=record.key_id)
        bootstrap = await store.create_batch("acct-q", "m", [b"job"])
        directory = AccountDirectory({"sk-boot": "ops"}, store, cache_seconds=0, clock_ms=clock)
        caller = await directory.batch_caller("acct-q", keyed, "s")
        assert (caller.account_id, caller.api_key_id, caller.session_id) == ("acct-q", record.key_id, "s")
        assert (await directory.batch_caller("acct-q", bootstrap, "")).api_key is None
        await store.revoke_api_key(record.key_id)
        with pytest.raises(Unauthenticated, match="revoked"):
            await directory.batch_caller("acct-q", keyed, "s")
    finally:
        await store.close()
