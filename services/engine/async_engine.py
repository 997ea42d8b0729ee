"""The engine loop on its own thread, and the asyncio side that talks to it.

EngineCore is not thread-safe and its ``step()`` blocks for a whole forward
pass, so it lives on one dedicated thread that alone touches it. The gRPC
side (asyncio) sends commands through a queue and gets results back through
``call_soon_threadsafe``: per-request output queues, KV event batches, and
counters for load reports. Commands run between steps, so a request joins or
leaves the batch at a step boundary, never in the middle of one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from cachet.engine.block_pool import BlocksStored, KvEvent
from cachet.engine.engine_core import EngineCore, RequestOutput
from cachet.engine.errors import EngineUnavailable, RequestNotFound
from cachet.engine.request import Request, RequestStatus
from cachet.engine.scheduler import SchedulerCounts
from cachet.logs import get_logger

log = get_logger(__name__)

# How long the idle loop sleeps waiting for a command before re-checking for work.
_IDLE_WAIT_SECONDS = 0.05


@dataclass
class _Command:
    action: Callable[[], object]
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class ThroughputWindow:
    """Token rates between load reports, from the scheduler's running totals."""

    def __init__(self, counts: SchedulerCounts) -> None:
        self._counts = counts
        self._since = time.monotonic()
        self._generated = counts.total_generated_tokens
        self._prefill = counts.prefill_tokens

    def rates(self) -> tuple[float, float]:
        """(decode, prefill) tokens per second since the last call; restarts the window."""
        now = time.monotonic()
        elapsed = max(now - self._since, 1e-6)
        generated, prefill = self._counts.total_generated_tokens, self._counts.prefill_tokens
        rates = ((generated - self._generated) / elapsed, (prefill - self._prefill) / elapsed)
        self._since, self._generated, self._prefill = now, generated, prefill
        return rates


class OutputSink:
    """Where one request's outputs wait for the gRPC side.

    Each message costs this process's event loop, which shares the interpreter lock with the
    step loop, so fewer messages mean shorter steps on a busy replica. The first output goes
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
    """Runs an EngineCore on a thread; every public method is for the asyncio side."""

    def __init__(
        self, core: EngineCore, replica_id: str | None = None, *, stream_interval: float = 0.0
    ) -> None:
        self.core = core
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        # Seconds between a stream's messages after its first (OutputSink).
        self.stream_interval = stream_interval
        self.throughput = ThroughputWindow(core.scheduler.counts)
        # Called on the engine thread with each step's wall time in seconds (metrics).
        self.on_step: Callable[[float], None] | None = None
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._outputs: dict[str, OutputSink] = {}
        self._kv_subscribers: list[KvEventSubscriber] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.failure: BaseException | None = None
        core.kv_event_sink = self._on_kv_events
        # A grammar finishing on a compiler thread wakes an idle loop (an empty command does it).
        core.wake = lambda: self._commands.put(_Command(lambda: None))

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    @property
    def healthy(self) -> bool:
        return self.failure is None and self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------- requests

    async def generate(
        self, request: Request, *, first_and_final: bool = False
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until its terminal one; leaving early aborts it.

        ``first_and_final``: only the first output and then one with every later token."""
        outputs = OutputSink(
            interactive=request.interactive,
            first_and_final=first_and_final,
            stream_interval=self.stream_interval,
        )
        self._outputs[request.request_id] = outputs
        try:
            await self._call(lambda: self.core.add_request(request))
            while True:
                output = await outputs.get()
                if output.status is RequestStatus.FINISHED_ERROR and self.failure is not None:
                    # The replica is broken (e.g. it lost a rank): a status the router retries, not a
                    # finish reason it would pass on as an answer.
                    raise EngineUnavailable(f"the engine failed: {self.failure}") from self.failure
                yield output
                if output.finished:
                    return
        finally:
            # A consumer that stops early (client gone) must not leave the request running.
            # Fire and forget: this may run while the caller's task is being cancelled.
            if self._outputs.pop(request.request_id, None) is not None and not request.is_finished:
                self._commands.put(_Command(lambda: self._abort_if_live(request.request_id)))

    async def abort(self, request_id: str) -> bool:
        """Abort a live request; False if it already finished or never existed."""
        try:
            await self._call(lambda: self.core.abort(request_id))
        except RequestNotFound:
            return False
        return True

    def _abort_if_live(self, request_id: str) -> None:
        if self.core.scheduler.get_request(request_id) is not None:
            self.core.abort(request_id)

    async def subscribe_kv_events(self) -> KvEventSubscriber:
        """A subscriber whose queue starts with every block cached now, then live batches."""
        subscriber = KvEventSubscriber()

        def register() -> None:
            # On the engine thread, so no step can slip between snapshot and registration.
            snapshot = sorted(self.core.scheduler.kv.cached_block_hashes())
            # Batch 0 always comes, empty or not, so a follower knows it is connected.
            subscriber.queue.put_nowait([BlocksStored(tuple(snapshot), None)] if snapshot else [])
            self._kv_subscribers.append(subscriber)

        await self._call(register)
        return subscriber

    def unsubscribe_kv_events(self, subscriber: KvEventSubscriber) -> None:
        if subscriber in self._kv_subscribers:
            self._kv_subscribers.remove(subscriber)

    def fail(self, error: BaseException) -> None:
        """On the event loop, when the replica broke outside the loop thread (a rank died): every
        in-flight request ends with ``error``'s status and new ones are refused."""
        self.failure = error
        self._fail_all(error)

    # ---------------------------------------------------------------- stats

    @property
    def num_running(self) -> int:
        return self.core.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.core.scheduler.num_waiting

    @property
    def num_waiting_interactive(self) -> int:
        return self.core.scheduler.num_interactive_left_waiting

    @property
    def num_free_blocks(self) -> int:
        return self.core.scheduler.kv.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.core.scheduler.kv.num_blocks

    # ------------------------------------------------------ the engine thread

    async def _call(self, action: Callable[[], object]) -> object:
        if not self.healthy:
            raise EngineUnavailable("the engine loop is not running") from self.failure
        command = _Command(action)
        self._commands.put(command)
        return await asyncio.wrap_future(command.done)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                # Requests that only wait for their grammar leave nothing to step: block until a
                # command (or the grammar's wake-up) arrives rather than spin on empty steps.
                self._run_commands(block=not self.core.has_work_now())
                if self.core.has_work_now():
                    self._step()
        except BaseException as error:  # noqa: BLE001 - a dead loop must be visible, not silent
            self.failure = error
            log.exception("engine loop died")
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._fail_all, error)

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_SECONDS) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            # A caller cancelled while waiting (client gone) no longer wants the action done.
            if command.done.set_running_or_notify_cancel():
                try:
                    command.done.set_result(command.action())
                except Exception as error:  # noqa: BLE001 - handed to the awaiting caller
                    command.done.set_exception(error)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        started = time.perf_counter()
        outputs = self.core.step()
        if self.on_step is not None:
            self.on_step(time.perf_counter() - started)
        if outputs:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    # ------------------------------------------------- back on the event loop

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

    def _on_kv_events(self, events: list[KvEvent]) -> None:
        # Called on the engine thread inside step(); fan out on the event loop, in order.
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._fan_out_kv_events, list(events))

    def _fan_out_kv_events(self, events: list[KvEvent]) -> None:
        for subscriber in self._kv_subscribers:
            subscriber.queue.put_nowait(events)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, target in list(self._outputs.items()):
            log.error("request failed with the engine loop", request_id=request_id, error=str(error))
            target.put(_failed_output(request_id))
        self._outputs.clear()


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
