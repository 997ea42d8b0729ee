"""EngineService over gRPC: proto -> domain -> proto, nothing else."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from cachet.common.v1 import common_pb2
from cachet.engine.async_engine import AsyncEngine
from cachet.engine.block_pool import AllBlocksCleared, BlocksRemoved, BlocksStored, KvEvent
from cachet.engine.errors import InvalidRequest
from cachet.engine.kv_retention import MAX_RETENTION_SECONDS, KvRetention
from cachet.engine.prompt_images import prompt_images
from cachet.engine.request import Request
from cachet.engine.request_output import RequestOutput
from cachet.engine.request_spans import record_request_spans
from cachet.engine.request_timeline import RequestTimeline
from cachet.engine.sampling_params import SamplingParams
from cachet.engine.structured_output import grammar_spec_from_proto
from cachet.engine.v1 import engine_pb2, engine_pb2_grpc
from cachet.sampling_ranges import check_context_window

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, engine: AsyncEngine, info: engine_pb2.EngineInfo, default_report_ms: int) -> None:
        self._engine = engine
        self._info = info
        self._default_report_ms = default_report_ms
        self._sampling_defaults = engine.description.sampling_defaults
        self._vocab_size = engine.description.vocab_size
        self._image_input = engine.description.image_input

    async def Generate(
        self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        domain = self._to_request(request)
        grammar_spec = grammar_spec_from_proto(request.response_format)
        starts_after = self._constrain_after(request)
        first = True
        # aclosing: when the client goes away this generator is closed, and the engine's
        # must close at once too (that is what aborts the request), not whenever GC runs.
        first_and_final = request.output_kind == engine_pb2.OUTPUT_KIND_FIRST_AND_FINAL
        async with contextlib.aclosing(
            self._engine.generate(
                domain,
                grammar_spec=grammar_spec,
                grammar_starts_after=starts_after,
                first_and_final=first_and_final,
            )
        ) as outputs:
            async for output in outputs:
                if output.error:
                    # Only a request refused before it produced anything carries an error.
                    raise InvalidRequest(output.error)
                if output.finished:
                    record_request_spans(output)
                yield _to_response(output, include_usage=first or output.finished)
                first = False

    async def Abort(
        self, request: engine_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.AbortResponse:
        return engine_pb2.AbortResponse(aborted=await self._engine.abort(request.request_id))

    async def StreamLoadReports(
        self, request: engine_pb2.StreamLoadReportsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.LoadReport]:
        interval = (request.interval_ms or self._default_report_ms) / 1000
        while True:
            yield self._load_report()
            await asyncio.sleep(interval)

    async def StreamKvEvents(
        self, request: engine_pb2.StreamKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.KvEventBatch]:
        subscriber = await self._engine.subscribe_kv_events()
        try:
            sequence = 0
            while True:
                events = await subscriber.queue.get()
                yield engine_pb2.KvEventBatch(
                    replica_id=self._engine.replica_id,
                    sequence_number=sequence,
                    events=[_to_kv_event(event) for event in events],
                    model=self._info.model,
                    block_size=self._info.block_size,
                    shared_tier_id=self._engine.description.shared_tier_id,
                )
                sequence += 1
        finally:
            self._engine.unsubscribe_kv_events(subscriber)

    async def GetEngineInfo(
        self, request: engine_pb2.GetEngineInfoRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EngineInfo:
        return self._info

    # ------------------------------------------------------------- converting

    def _to_request(self, request: engine_pb2.GenerateRequest) -> Request:
        if not request.request_id:
            raise InvalidRequest("request_id must not be empty")
        if request.model != self._info.model:
            raise InvalidRequest(
                f"model {request.model!r} is not served here; this replica serves {self._info.model!r}"
            )
        # The router checked all of this already; a direct client's mistakes are refused here
        # with the same rules (cachet.sampling_ranges), naming the field.
        sampling = SamplingParams.from_proto(request.sampling, self._sampling_defaults)
        window = self._info.context_window
        prompt_token_ids = list(request.prompt_token_ids)
        check_context_window(len(prompt_token_ids), sampling.max_tokens, window, model=self._info.model)
        self._check_token_ids(request, prompt_token_ids)
        images = prompt_images(request.images, prompt_token_ids, self._image_input)
        room = window - len(prompt_token_ids)
        return Request(
            request_id=request.request_id,
            prompt_token_ids=prompt_token_ids,
            sampling=sampling,
            max_tokens=sampling.max_tokens or room,
            interactive=request.priority != common_pb2.PRIORITY_BATCH,
            cache_salt=request.cache_salt,
            arrival_time=time.monotonic(),
            retention=_retention(request.kv_retention),
            hand_off_kv=request.hand_off_kv,
            hand_off_to=request.hand_off_to,
            timeline=RequestTimeline(arrived_ns=time.time_ns()),
            images=images,
            **_prefilled(request),
        )

    def _check_token_ids(self, request: engine_pb2.GenerateRequest, ids: list[int]) -> None:
        """An id past the vocabulary would fail the whole step (the embedding lookup) for every
        request in it: refuse it here, with its place."""
        if not self._vocab_size:
            return
        if ids and max(ids) >= self._vocab_size:
            index = next(i for i, token in enumerate(ids) if token >= self._vocab_size)
            raise InvalidRequest(
                f"prompt_token_ids[{index}]={ids[index]} is not in this model's {self._vocab_size}-token vocabulary"
            )
        if request.HasField("prefilled") and request.prefilled.first_token_id >= self._vocab_size:
            raise InvalidRequest(
                f"prefilled.first_token_id={request.prefilled.first_token_id} is not in this model's "
                f"{self._vocab_size}-token vocabulary"
            )

    def _constrain_after(self, request: engine_pb2.GenerateRequest) -> int | None:
        if not request.HasField("constrain_after_token_id"):
            return None
        token = request.constrain_after_token_id
        if self._vocab_size and token >= self._vocab_size:
            raise InvalidRequest(
                f"constrain_after_token_id={token} is not in this model's {self._vocab_size}-token vocabulary"
            )
        return token

    def _load_report(self) -> engine_pb2.LoadReport:
        decode_rate, prefill_rate = self._engine.throughput.rates()
        config = self._engine.scheduler_config
        stats = self._engine.stats
        return engine_pb2.LoadReport(
            replica_id=self._engine.replica_id,
            running_requests=stats.num_running,
            waiting_requests=stats.num_waiting,
            running_batch_requests=stats.running["batch"],
            waiting_batch_requests=stats.waiting["batch"],
            waiting_interactive_requests=stats.interactive_left_waiting,
            free_kv_blocks=stats.free_kv_blocks,
            total_kv_blocks=stats.total_kv_blocks,
            max_running_requests=config.max_num_seqs,
            max_batch_running_requests=config.max_batch_running or 0,
            max_waiting_requests=config.max_waiting,
            decode_tokens_per_second=decode_rate,
            prefill_tokens_per_second=prefill_rate,
            timestamp_ms=int(time.time() * 1000),
            role=self._info.role,
        )


def _prefilled(request: engine_pb2.GenerateRequest) -> dict[str, Any]:
    """A decode replica's start on a prompt another replica prefilled: its first token, and the
    cached tokens that replica reused (what usage bills as cached)."""
    if not request.HasField("prefilled"):
        return {}
    if request.hand_off_kv:
        raise InvalidRequest("a request is either prefilled elsewhere or hands its KV off, not both")
    prefilled = request.prefilled
    return {
        "output_token_ids": [prefilled.first_token_id],
        "num_cached_tokens": min(prefilled.cached_tokens, len(request.prompt_token_ids)),
        "prefilled_elsewhere": True,
    }


def _retention(spans: Sequence[engine_pb2.KvRetention]) -> tuple[KvRetention, ...]:
    for index, span in enumerate(spans):
        if not 0 < span.seconds <= MAX_RETENTION_SECONDS:
            raise InvalidRequest(
                f"kv_retention[{index}].seconds must be in [1, {MAX_RETENTION_SECONDS}], got {span.seconds}"
            )
    return tuple(KvRetention(span.seconds, span.num_tokens) for span in spans)


def _to_response(output: RequestOutput, include_usage: bool) -> engine_pb2.GenerateResponse:
    response = engine_pb2.GenerateResponse(
        request_id=output.request_id,
        token_ids=output.new_token_ids,
        logprobs=[
            common_pb2.TokenLogprob(
                token_id=s.token_id,
                logprob=s.logprob or 0.0,
                top=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in s.top_logprobs],
            )
            for s in output.logprobs
        ],
        finish_reason=output.finish_reason,
        matched_stop=output.matched_stop,
    )
    if include_usage:
        response.usage.CopyFrom(
            common_pb2.Usage(
                prompt_tokens=output.num_prompt_tokens,
                cached_tokens=output.num_cached_tokens,
                completion_tokens=output.num_completion_tokens,
            )
        )
    return response


_TIERS = {
    "engine": engine_pb2.KV_TIER_ENGINE,
    "host": engine_pb2.KV_TIER_HOST,
    "shared": engine_pb2.KV_TIER_SHARED,
}


def _to_kv_event(event: KvEvent) -> engine_pb2.KvEvent:
    tier = _TIERS[event.tier]
    if isinstance(event, BlocksStored):
        stored = engine_pb2.BlocksStored(block_hashes=event.block_hashes)
        if event.parent_block_hash is not None:
            stored.parent_block_hash = event.parent_block_hash
        return engine_pb2.KvEvent(stored=stored, tier=tier)
    if isinstance(event, BlocksRemoved):
        return engine_pb2.KvEvent(
            removed=engine_pb2.BlocksRemoved(block_hashes=event.block_hashes), tier=tier
        )
    assert isinstance(event, AllBlocksCleared), event
    return engine_pb2.KvEvent(cleared=engine_pb2.AllBlocksCleared(), tier=tier)
