"""Announcing finished batches: signed webhook calls, retried until delivered or too late.

The event is a small JSON body (``batch.finished``: ids and counts, not results; the
receiver polls for those with its own credentials). It is always signed, like Stripe's
(the key: webhook_secret.py; the scheme for receivers: docs/webhooks.md):

    X-Cachet-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>." + body)>

Signing the timestamp with the body lets a receiver refuse replays older than a few
minutes (``verify``'s tolerance). Each attempt goes only to a checked address
(webhook_targets.py) and never follows a redirect: a 3xx would send the signed event
wherever the receiver points, past the address check. Any 2xx answer is delivery;
anything else (another status, a redirect, a timeout, a refused connection, a host that
does not resolve) is retried after an exponential backoff with jitter
(``backoff_seconds``) until ``webhook_deadline_seconds`` after the batch finished; then,
or at once for a target that is refused, the delivery is dead-lettered: state
``failed``, no more attempts, every attempt with its error still listed. Every attempt
is stored (``QueueStore.webhook_attempts``) and logged.

Deliveries live in the store, not in memory: a batch that finished just before a
restart is announced by the restarted router. Claiming a delivery pushes its due time
past the call's timeout, which keeps two routers from sending the same attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import random
import time

import httpx

from cachet.logs import get_logger
from cachet.router.queue_store import DueWebhook, QueueStore
from cachet.router.v1 import router_pb2
from cachet.router.webhook_targets import TargetRefused, TargetUnresolved, WebhookTargets

log = get_logger(__name__)

SIGNATURE_HEADER = "X-Cachet-Signature"
EVENT_TYPE = "batch.finished"
# Deliveries that finish meanwhile are noticed at once (kick); retries that fall due are
# noticed within this poll.
_POLL_SECONDS = 0.25
# Longest error text kept per attempt.
_ERROR_CHARS = 500


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The signature header value for ``body`` sent at ``timestamp`` (unix seconds)."""
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"


def verify(
    secret: str, header: str, body: bytes, *, tolerance_seconds: float = 300, now: float | None = None
) -> bool:
    """True when ``header`` signs ``body`` with ``secret`` and is no older than the tolerance."""
    fields = dict(part.split("=", 1) for part in header.split(",") if "=" in part)
    try:
        timestamp = int(fields["t"])
    except (KeyError, ValueError):
        return False
    now = time.time() if now is None else now
    if abs(now - timestamp) > tolerance_seconds:
        return False
    expected = sign(secret, timestamp, body).split("v1=", 1)[1]
    return hmac.compare_digest(expected, fields.get("v1", ""))


def backoff_seconds(attempt: int, first: float, maximum: float, rng: random.Random | None = None) -> float:
    """Wait after failed attempt ``attempt`` (1-based): doubling from ``first``, capped, half jittered.

    Half of the wait is fixed and half random, so retries never collapse to "at once"
    and receivers coming back from an outage are not hit by every sender together.
    """
    ceiling = min(maximum, first * 2 ** (attempt - 1))
    return ceiling / 2 + (rng or random).uniform(0, ceiling / 2)


class WebhookSender:
    """Delivers due webhooks in the background; ``kick()`` after a batch finishes."""

    def __init__(
        self,
        store: QueueStore,
        *,
        secret: str,
        timeout_seconds: float,
        first_backoff_seconds: float,
        max_backoff_seconds: float,
        deadline_seconds: float,
        targets: WebhookTargets | None = None,
    ) -> None:
        if not secret:
            raise ValueError("webhooks are always signed: give a secret (see webhook_secret.py)")
        self._store = store
        self._secret = secret
        self._targets = targets or WebhookTargets()
        self._timeout = timeout_seconds
        self._first_backoff = first_backoff_seconds
        self._max_backoff = max_backoff_seconds
        self._deadline = deadline_seconds
        # No environment proxies: a proxy would resolve the name again, past the address check.
        self._client = httpx.AsyncClient(timeout=timeout_seconds, follow_redirects=False, trust_env=False)
        self._wake = asyncio.Event()
        self._sending: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._loop())

    def kick(self, batch_id: str = "") -> None:
        self._wake.set()

    async def stop(self) -> None:
        tasks = [t for t in (self._loop_task, *self._sending) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._client.aclose()

    async def _loop(self) -> None:
        while True:
            try:
                while (due := await self._store.claim_webhook(self._timeout + 5)) is not None:
                    task = asyncio.create_task(self._deliver(due))
                    self._sending.add(task)
                    task.add_done_callback(self._sending.discard)
            except Exception:  # noqa: BLE001 - the sender must outlive a bad moment of the store
                log.exception("webhook claim failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), _POLL_SECONDS)
            self._wake.clear()

    async def _deliver(self, due: DueWebhook) -> None:
        status, error, retryable = await self._post(due.url, await self._event_body(due))
        error = error[:_ERROR_CHARS]
        attempt = due.attempts + 1
        delivered = not error
        retry_at_ms = self._retry_at_ms(due, attempt) if retryable else None
        await self._store.record_webhook_attempt(
            due.batch_id, status, error, delivered=delivered, retry_at_ms=retry_at_ms
        )
        log.info(
            "webhook attempt",
            batch_id=due.batch_id,
            attempt=attempt,
            http_status=status,
            error=error,
            outcome="delivered" if delivered else ("retry" if retry_at_ms else "failed"),
        )

    async def _post(self, url: str, body: bytes) -> tuple[int, str, bool]:
        """(HTTP status or 0, error or '' when delivered, whether another attempt may succeed)."""
        try:
            # Bounded like the call itself: the claim on this delivery lasts only that long.
            target = await asyncio.wait_for(self._targets.resolve(url), self._timeout)
        except TargetRefused as refused:
            return 0, refused.message, False
        except TargetUnresolved as failure:
            return 0, str(failure), True
        except TimeoutError:
            return 0, f"resolving the host took over {self._timeout:g} s", True
        headers = {
            "Content-Type": "application/json",
            SIGNATURE_HEADER: sign(self._secret, int(time.time()), body),
            **target.headers,
        }
        try:
            response = await self._client.post(
                target.pinned_url, content=body, headers=headers, extensions=target.extensions
            )
        except httpx.HTTPError as failure:
            return 0, f"{type(failure).__name__}: {failure}", True
        status = response.status_code
        if 200 <= status < 300:
            return status, "", False
        if response.is_redirect:
            return status, f"HTTP {status}: redirects are not followed", True
        return status, f"HTTP {status}", True

    def _retry_at_ms(self, due: DueWebhook, attempt: int) -> int | None:
        retry_at = time.time() + backoff_seconds(attempt, self._first_backoff, self._max_backoff)
        if retry_at > due.finished_at_ms / 1000 + self._deadline:
            return None
        return int(retry_at * 1000)

    async def _event_body(self, due: DueWebhook) -> bytes:
        batch = await self._store.batch(due.batch_id, due.account_id)
        assert batch is not None  # deliveries exist only for stored batches
        results = [router_pb2.QueuedResult.FromString(r) for r in batch.results if r is not None]
        failed = sum(1 for result in results if result.HasField("error"))
        event = {
            "type": EVENT_TYPE,
            "request_id": due.batch_id,
            "model": batch.model,
            "status": batch.state.value,
            "finished_at": due.finished_at_ms // 1000,
            "requests": len(batch.results),
            "succeeded": len(results) - failed,
            "failed": failed,
        }
        return json.dumps(event, separators=(",", ":")).encode()
