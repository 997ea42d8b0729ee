"""The webhook sender against real receivers on 127.0.0.1 and a real queue store (SQLite, PostgreSQL).

Every target here is on this machine: loopback URLs, or a made-up name that the
resolver seam answers with 127.0.0.1 (which real DNS would not resolve at all).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from ipaddress import ip_network

import pytest
from queue_backends import QueueBackend
from webhook_receiver import Receiver

from cachet.router.queue_store import QueueStore
from cachet.router.v1 import router_pb2
from cachet.router.webhook_targets import WebhookTargets
from cachet.router.webhooks import SIGNATURE_HEADER, WebhookSender, verify

SECRET = "whsec_delivery-test"
LOOPBACK = [ip_network("127.0.0.1/32")]


@pytest.fixture
async def store(queue_backend: QueueBackend) -> AsyncIterator[QueueStore]:
    # Real time, not the settable clock: the sender's backoff and deadlines run on it.
    opened = await queue_backend.open(None)
    yield opened
    await opened.close()


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    running = Receiver()
    yield running
    running.close()


async def finished_batch(store: QueueStore, webhook_url: str) -> str:
    """A one-job batch, run and finished: its webhook is due."""
    batch_id = await store.create_batch("acct-a", "m", [b"job"], webhook_url=webhook_url)
    job = await store.lease("test", lease_seconds=30)
    assert job is not None
    result = router_pb2.QueuedResult(completion=router_pb2.ChatCompletion(id=f"{batch_id}-0"))
    assert (await store.complete(job, result.SerializeToString())).batch_finished
    return batch_id


async def delivered_or_given_up(store: QueueStore, batch_id: str, targets: WebhookTargets, **knobs) -> str:
    """Run a sender until the batch's webhook is delivered or dead-lettered; its final state."""
    settings = {"first_backoff_seconds": 0.05, "max_backoff_seconds": 0.1, "deadline_seconds": 30.0} | knobs
    sender = WebhookSender(store, secret=SECRET, timeout_seconds=5, targets=targets, **settings)
    sender.start()
    sender.kick()
    try:
        deadline = time.monotonic() + 20
        while (view := await store.batch(batch_id, "acct-a")) is not None and view.webhook_state == "pending":
            assert time.monotonic() < deadline, "the webhook was neither delivered nor given up"
            await asyncio.sleep(0.02)
    finally:
        await sender.stop()
    assert view is not None
    return view.webhook_state


async def test_every_call_is_signed_and_goes_to_the_checked_address(
    store: QueueStore, receiver: Receiver
) -> None:
    async def resolve(host: str, port: int) -> list[str]:
        assert host == "hooks.example.test"
        return ["127.0.0.1"]

    url = f"http://hooks.example.test:{receiver.port}/hook"
    batch_id = await finished_batch(store, url)
    state = await delivered_or_given_up(store, batch_id, WebhookTargets(LOOPBACK, resolver=resolve))
    assert state == "delivered"
    [(status, headers, body)] = receiver.calls
    # Connected to the address that was checked, with the URL's own name for the receiver.
    assert headers["Host"] == f"hooks.example.test:{receiver.port}"
    assert verify(SECRET, headers[SIGNATURE_HEADER], body)
    assert not verify("whsec_someone-else", headers[SIGNATURE_HEADER], body)
    event = json.loads(body)
    assert (event["type"], event["request_id"], event["succeeded"], event["failed"]) == (
        "batch.finished",
        batch_id,
        1,
        0,
    )


async def test_a_target_that_is_not_allowed_is_dead_lettered_at_once_and_never_called(
    store: QueueStore, receiver: Receiver
) -> None:
    batch_id = await finished_batch(store, receiver.url)
    assert await delivered_or_given_up(store, batch_id, WebhookTargets()) == "failed"
    assert receiver.calls == []
    [attempt] = await store.webhook_attempts(batch_id)
    assert (attempt.attempt, attempt.http_status) == (1, 0)
    assert "127.0.0.1, which is not a public address" in attempt.error


async def test_a_redirect_is_never_followed_and_the_delivery_ends_dead_lettered(
    store: QueueStore, receiver: Receiver
) -> None:
    redirecting = Receiver(statuses=[302] * 100, location=receiver.url)
    try:
        batch_id = await finished_batch(store, redirecting.url)
        state = await delivered_or_given_up(store, batch_id, WebhookTargets(LOOPBACK), deadline_seconds=0.5)
    finally:
        redirecting.close()
    assert state == "failed"
    assert receiver.calls == []  # where the redirect pointed: never called
    attempts = await store.webhook_attempts(batch_id)
    assert len(attempts) >= 2  # retried with backoff until the deadline passed
    assert {(a.http_status, a.error) for a in attempts} == {(302, "HTTP 302: redirects are not followed")}
    assert len(redirecting.calls) == len(attempts)
    gaps = [later.at_ms - earlier.at_ms for earlier, later in zip(attempts, attempts[1:], strict=False)]
    assert all(gap >= 25 for gap in gaps)  # at least half the first backoff (0.05 s) apart


async def test_a_host_that_does_not_resolve_is_retried(store: QueueStore, receiver: Receiver) -> None:
    answers = [OSError("Temporary failure in name resolution"), ["127.0.0.1"]]

    async def flaky(host: str, port: int) -> list[str]:
        answer = answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return answer

    batch_id = await finished_batch(store, f"http://hooks.example.test:{receiver.port}/hook")
    assert (
        await delivered_or_given_up(store, batch_id, WebhookTargets(LOOPBACK, resolver=flaky)) == "delivered"
    )
    attempts = await store.webhook_attempts(batch_id)
    assert [(a.attempt, a.http_status) for a in attempts] == [(1, 0), (2, 200)]
    assert "did not resolve" in attempts[0].error
    assert len(receiver.calls) == 1


async def test_a_sender_without_a_key_is_refused(store: QueueStore) -> None:
    with pytest.raises(ValueError, match="always signed"):
        WebhookSender(
            store,
            secret="",
            timeout_seconds=1,
            first_backoff_seconds=1,
            max_backoff_seconds=1,
            deadline_seconds=1,
        )
