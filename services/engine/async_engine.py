"""The asyncio side of an engine: requests in, per-request output streams out.

The engine loop (``core_loop.CoreLoop``) runs on a host: a thread of this process
(``core_thread``), or a process of its own (``core_process``) so that the step loop and
this side's gRPC work do not share one interpreter lock. Either way this side only sends
commands and reads the loop's messages, in order, on the event loop: replies to its
commands, and a report per step (outputs for each request's ``OutputSink``, KV events for
the followers, the scheduler's figures for load reports and metrics).
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Protocol

from cachet.engine.block_pool import KvEvent
from cachet.engine.errors import EngineUnavailable
from cachet.engine.loop_messages import (
    AbortRequest,
    AddRequest,
    Command,
    EngineDescription,
    EngineStats,
    Message,
    Reply,
    StepReport,
    SubscribeKvEvents,
)
from cachet.engine.request import Request, RequestStatus
from cachet.engine.request_output import RequestOutput
from cachet.engine.scheduler import SchedulerConfig
from cachet.engine.structured_output import GrammarSpec
from cachet.logs import get_logger

log = get_logger(__name__)


class CoreHost(Protocol):
    """Where the engine loop runs (``core_thread.ThreadHost``, ``core_process.ProcessHost``)."""

    @property
    def description(self) -> EngineDescription: ...

    def start(self, deliver: Callable[[Message], None], failed: Callable[[BaseException], None]) -> None:
        """Run the loop; ``deliver`` gets its messages in order and ``failed`` its death, both
        called on the running event loop."""

    def send(self, command_id: int, command: Command) -> None:
        """Queue a command for the loop; never blocks the event loop."""

    async def stop(self) -> None:
        """Stop the loop (planned shutdown) and wait for it."""


class ThroughputWindow:
    """Token rates between load reports, from the scheduler's running totals."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats
        self._since = time.monotonic()
        counts = stats().counts
        self._generated = counts.total_generated_tokens
        self._prefill = counts.prefill_tokens

    def rates(self) -> tuple[float, float]:
        """(decode, prefill) tokens per second since the last call; restarts the window."""
        now = time.monotonic()
        elapsed = max(now - self._since, 1e-6)
        counts = self._stats().counts
        generated, prefill = counts.total_generated_tokens, counts.prefill_tokens
        rates = ((generated - self._generated) / elapsed, (prefill - self._prefill) / elapsed)
        self._since, self._generated, self._prefill = now, generated, prefill
        return rates


class OutputSink:
    """Where one request's outputs wait for the gRPC side.

    Each message costs the server's event loop (and, when the step loop runs on a thread,
    the interpreter lock they share), so messages are few. The first output goes
    at once (time to first token). After it, a stream sends at most one message per
    ``stream_interval`` seconds: what came meanwhile is held and goes with the next step's
    output (at most one step late) or the final one. A consumer that fell behind gets
    everything waiting in one message; one that asked for the first and final outputs only
    (a caller that does not stream, such as a queued job) gets two.
    """

    def __init__(self, *, interactive: bool, first_and_final: bool, stream_interval: float = 0.0) -> None:
        self.interactive = interactive
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._hold_until_final = first_and_final
        self._stream_interval = stream_interval
        self._sent_first = False
        self._last_sent = 0.0
        self._held: RequestOutput | None = None

    def put(self, output: RequestOutput) -> None:
        if self._held is not None:
            output = self._held.followed_by(output)
            self._held = None
        now = time.monotonic()
        too_soon = self._hold_until_final or now - self._last_sent < self._stream_interval
        if self._sent_first and not output.finished and too_soon:
            self._held = output
            return
        self._sent_first = True
        self._last_sent = now
        self._queue.put_nowait(output)

    async def get(self) -> RequestOutput:
        output = await self._queue.get()
        while not output.finished and not self._queue.empty():
            output = output.followed_by(self._queue.get_nowait())
        return output


class KvEventSubscriber:
    """One follower's queue of KV event batches, starting with a snapshot."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[list[KvEvent]] = asyncio.Queue()


class AsyncEngine:
    """Talks to the engine loop on its host; every public method is for the asyncio side."""

    def __init__(
        self, host: CoreHost, replica_id: str | None = None, *, stream_interval: float = 0.0
    ) -> None:
        self.host = host
        self.description = host.description
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        # Seconds between a stream's messages after its first (OutputSink).
        self.stream_interval = stream_interval
        # The scheduler's figures after the loop's last report.
        self.stats = host.description.stats
        self.throughput = ThroughputWindow(lambda: self.stats)
        # Called on the event loop with each step's wall time in seconds (metrics).
        self.on_step: Callable[[float], None] | None = None
        self.failure: BaseException | None = None
        self._failed = asyncio.Event()
        self._started = False
        self._command_ids = itertools.count()
        self._replies: dict[int, asyncio.Future[object]] = {}
        # Subscriptions whose snapshot is on its way: registered when it arrives, so no event
        # of a later step can come before it.
        self._subscribing: dict[int, KvEventSubscriber] = {}
        self._outputs: dict[str, OutputSink] = {}
        self._kv_subscribers: list[KvEventSubscriber] = []

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.host.start(self._on_message, self.fail)
        self._started = True

    async def stop(self) -> None:
        await self.host.stop()

    @property
    def healthy(self) -> bool:
        return self.failure is None and self._started

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return self.description.scheduler_config

    @property
    def supports_structured_output(self) -> bool:
        return self.description.structured_output

    # ------------------------------------------------------------- requests

    async def generate(
        self,
        request: Request,
        *,
        grammar_spec: GrammarSpec | None = None,
        grammar_starts_after: int | None = None,
        first_and_final: bool = False,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of one request until its terminal one; leaving early aborts it.

        ``grammar_starts_after``: the grammar holds the output after this token only.
        ``first_and_final``: only the first output and then one with every later token."""
        outputs = OutputSink(
            interactive=request.interactive,
            first_and_final=first_and_final,
            stream_interval=self.stream_interval,
        )
        self._outputs[request.request_id] = outputs
        finished = False
        try:
            await self._call(AddRequest(request, grammar_spec, grammar_starts_after))
            while True:
                output = await outputs.get()
                if output.status is RequestStatus.FINISHED_ERROR and self.failure is not None:
                    # The replica is broken (e.g. it lost a rank): a status the router retries, not a
                    # finish reason it would pass on as an answer.
                    raise EngineUnavailable(f"the engine failed: {self.failure}") from self.failure
                finished = output.finished
                yield output
                if finished:
                    return
        finally:
            # A consumer that stops early (client gone) must not leave the request running.
            # Fire and forget: this may run while the caller's task is being cancelled. Sent
            # after the add (if that went out), so the loop sees them in that order.
            if self._outputs.pop(request.request_id, None) is not None and not finished and self.healthy:
                self.host.send(next(self._command_ids), AbortRequest(request.request_id))

    async def abort(self, request_id: str) -> bool:
        """Abort a live request; False if it already finished or never existed."""
        return bool(await self._call(AbortRequest(request_id)))

    async def subscribe_kv_events(self) -> KvEventSubscriber:
        """A subscriber whose queue starts with every block cached now, then live batches."""
        subscriber = KvEventSubscriber()
        command_id = next(self._command_ids)
        self._subscribing[command_id] = subscriber
        try:
            await self._send(command_id, SubscribeKvEvents())
        finally:
            self._subscribing.pop(command_id, None)
        return subscriber

    def unsubscribe_kv_events(self, subscriber: KvEventSubscriber) -> None:
        if subscriber in self._kv_subscribers:
            self._kv_subscribers.remove(subscriber)

    def fail(self, error: BaseException) -> None:
        """On the event loop, when the replica broke (its loop died, it lost a rank): every
        in-flight request ends with ``error``'s status and new ones are refused."""
        if self.failure is None:
            self.failure = error
        self._failed.set()
        for future in self._replies.values():
            if not future.done():
                future.set_exception(EngineUnavailable(f"the engine failed: {error}"))
        self._replies.clear()
        for request_id, target in list(self._outputs.items()):
            log.error("request failed with the engine loop", request_id=request_id, error=str(error))
            target.put(_failed_output(request_id))
        self._outputs.clear()

    async def wait_failed(self) -> BaseException:
        """Until the replica breaks; what broke it."""
        await self._failed.wait()
        assert self.failure is not None
        return self.failure

    # ------------------------------------------------------- to the loop

    async def _call(self, command: Command) -> object:
        return await self._send(next(self._command_ids), command)

    async def _send(self, command_id: int, command: Command) -> object:
        if not self.healthy:
            raise EngineUnavailable("the engine loop is not running") from self.failure
        reply = asyncio.get_running_loop().create_future()
        self._replies[command_id] = reply
        self.host.send(command_id, command)
        try:
            return await reply
        finally:
            self._replies.pop(command_id, None)

    # ------------------------------------------------- from the loop, in order

    def _on_message(self, message: Message) -> None:
        if isinstance(message, StepReport):
            self._on_report(message)
            return
        assert isinstance(message, Reply), message
        subscriber = self._subscribing.pop(message.command_id, None)
        if subscriber is not None and message.error is None:
            subscriber.queue.put_nowait(message.value)
            self._kv_subscribers.append(subscriber)
        reply = self._replies.get(message.command_id)
        if reply is None or reply.done():
            return  # the caller left (an abort's reply nobody waits for, a cancelled call)
        if message.error is not None:
            reply.set_exception(message.error)
        else:
            reply.set_result(message.value)

    def _on_report(self, report: StepReport) -> None:
        self.stats = report.stats
        if report.step_seconds is not None and self.on_step is not None:
            self.on_step(report.step_seconds)
        if report.outputs:
            self._deliver(report.outputs)
        if report.kv_events:
            for subscriber in self._kv_subscribers:
                subscriber.queue.put_nowait(report.kv_events)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        # Interactive consumers wake first: a new request's first token is last in step order.
        later: list[tuple[OutputSink, RequestOutput]] = []
        for output in outputs:
            target = self._outputs.get(output.request_id)
            if target is None:
                continue
            if target.interactive:
                target.put(output)
            else:
                later.append((target, output))
        for target, output in later:
            target.put(output)


def _failed_output(request_id: str) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[],
        logprobs=[],
        status=RequestStatus.FINISHED_ERROR,
        matched_stop="",
        num_prompt_tokens=0,
        num_cached_tokens=0,
        num_completion_tokens=0,
    )
