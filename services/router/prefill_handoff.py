"""Disaggregated prefill, the router's half: long prompts are computed on a prefill replica,
whose KV the decode replica then loads, so they stop stalling the decode replicas' streams.

The decode replica is placed as any request is (session, cached prefix, load). When the part of
the prompt it does not hold is at least ``min_tokens`` (conditional disaggregation, as Dynamo
and vLLM's proxy do: a short or mostly cached prompt costs the decode replica little), the
request first goes to a prefill replica, chosen by its cached prefix and load like any
placement. A shorter prompt, of at least ``idle_min_tokens`` the decode replica does not hold,
goes to a prefill replica too while the decode replica has requests, when the prefill replica
lacks less than ``min_tokens`` of it (a session's long prefix that only the decode replica
holds is not computed again) and holds nothing but such prompts of this router's, under
``min_tokens`` in all with it: computed on the decode replica it would lengthen its streams'
steps (on a CPU a ~95-token prompt is ~120 ms of one core, six ~20 ms decode steps), where the
prefill replica's time between long prompts is free. The prefill goes as a one-token request
that hands its KV off (``hand_off_kv``), naming the decode replica's KV receiver
(``hand_off_to``) when it has one and both have as many tensor-parallel ranks:
the engine pushes the prompt's blocks straight into that replica's memory, and answers once
every full block is there (and in the shared KV tier, where there is one). The decode replica
then gets the request with that first token (``PrefilledElsewhere``): it streams the token at
once, takes the prompt's blocks from what was pushed to it or the shared tier, and decodes on.

What goes wrong costs time, never the request: a prefill replica that refuses, fails, dies or
times out, or whose first token already ends the answer, leaves the request to run whole on the
decode replica (which still loads whatever blocks were written). Usage counts the request once,
from the decode replica's stream, with the prefill replica's cached tokens as the request's
(the hand-off itself is not a hit of the caller's).

Requests that need the sampling state of their first token on the decode replica are never
split: constrained output (the grammar's state), logprobs (the first token's are not carried)
and n > 1 (its choices share one replica's prefill already).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import grpc

from cachet.common.v1 import common_pb2
from cachet.engine.v1 import engine_pb2, engine_pb2_grpc
from cachet.errors import ResourceExhausted, Unavailable
from cachet.logs import get_logger
from cachet.router import metrics
from cachet.router.placement import PlacementPolicy, ReplicaLoad, choose_replica
from cachet.router.replica_set import Replica, ReplicaSet
from cachet.tracing import get_tracer

if TYPE_CHECKING:
    from cachet.router.request_pipeline import GenerationRequest

log = get_logger(__name__)
_tracer = get_tracer(__name__)


class PrefillHandOff:
    """Runs a request's prefill on a prefill replica when that pays."""

    def __init__(
        self,
        replicas: ReplicaSet,
        policy: PlacementPolicy,
        *,
        min_tokens: int,
        idle_min_tokens: int,
        timeout_seconds: float,
    ) -> None:
        self._replicas = replicas
        self._policy = policy
        self._min_tokens = min_tokens
        self._idle_min_tokens = idle_min_tokens
        self._timeout = timeout_seconds
        # Per prefill replica: the prompt tokens it is computing for this router's hand-offs.
        self._prefilling: dict[str, float] = {}

    def candidates(
        self, request: GenerationRequest, cached: Mapping[str, float], decode: Replica
    ) -> list[ReplicaLoad]:
        """The prefill replicas ``request`` may be split onto for the ``decode`` replica; none:
        it runs whole there. A long uncached prompt may go to any; a shorter one (from
        ``idle_min_tokens``) only to one with room for it (``_has_room``), and only while
        ``decode`` has requests to slow down."""
        sampling = request.sampling
        if (
            request.choices != 1
            or request.response_format.WhichOneof("format") not in (None, "text")
            or sampling.logprobs
            or (sampling.HasField("max_tokens") and sampling.max_tokens < 2)
        ):
            return []
        prompt = len(request.prompt_token_ids)
        uncached = prompt - cached.get(decode.address, 0.0)
        long_prompt = uncached >= self._min_tokens
        if not long_prompt and (uncached < self._idle_min_tokens or decode.load().load == 0):
            return []
        loads = [replica.load() for replica in self._replicas.available(request.model, role="prefill")]
        if long_prompt:
            return loads
        return [load for load in loads if self._has_room(load, prompt - cached.get(load.address, 0.0))]

    def _has_room(self, load: ReplicaLoad, tokens: float) -> bool:
        """Whether a prefill replica can take a short prompt that lacks it ``tokens``: nothing
        there but short prompts of ours, which with this one stay under a long prompt's worth.
        (Not only an idle one: streams that started together ask together, and the first
        would take an idle replica from the rest.)"""
        others = load.load - self._replicas.get(load.address).in_flight
        return others <= 0 and self._prefilling.get(load.address, 0.0) + tokens < self._min_tokens

    async def prefill(
        self,
        request: GenerationRequest,
        cached: Mapping[str, float],
        decode: Replica,
        loads: list[ReplicaLoad],
    ) -> engine_pb2.PrefilledElsewhere | None:
        """Prefill ``request`` on one of the prefill replicas ``loads`` (``candidates``) for the
        ``decode`` replica; what the decode replica is to be told, or None when the request should
        run whole on it."""
        try:
            placement = choose_replica(loads, cached, policy=self._policy)
        except (ResourceExhausted, Unavailable):
            metrics.PREFILL_HANDOFFS.labels("busy").inc()
            return None
        replica = self._replicas.get(placement.address)
        hand_off_to = _direct_transfer_address(replica, decode)
        started = time.monotonic()
        with _tracer.start_as_current_span(
            "prefill_handoff",
            attributes={
                "cachet.prefill_replica": replica.address,
                "cachet.prompt_tokens": len(request.prompt_token_ids),
                "cachet.kv_transport": "direct" if hand_off_to else "shared_tier",
            },
        ) as span:
            replica.enter(request.priority)
            computing = len(request.prompt_token_ids) - cached.get(replica.address, 0.0)
            self._prefilling[replica.address] = self._prefilling.get(replica.address, 0.0) + computing
            try:
                answer = await asyncio.wait_for(self._call(request, replica.stub, hand_off_to), self._timeout)
                if answer is None:
                    raise Unavailable("the prefill replica ended its stream without an answer")
            except (grpc.aio.AioRpcError, TimeoutError, Unavailable) as error:
                code = error.code().name if isinstance(error, grpc.aio.AioRpcError) else type(error).__name__
                log.warning(
                    "prefill hand-off failed; the decode replica computes the prompt",
                    request_id=request.request_id,
                    address=replica.address,
                    code=code,
                )
                span.set_attribute("cachet.outcome", "failed")
                metrics.PREFILL_HANDOFFS.labels("failed").inc()
                return None
            finally:
                replica.leave(request.priority)
                self._prefilling[replica.address] -= computing
            seconds = time.monotonic() - started
            metrics.PREFILL_HANDOFF_SECONDS.observe(seconds)
            if answer.finish_reason != common_pb2.FINISH_REASON_LENGTH or len(answer.token_ids) != 1:
                # The first token already ends the answer (end of turn, a stop string): the decode
                # replica runs it whole, from the KV the prefill wrote, and answers the same.
                span.set_attribute("cachet.outcome", "stopped")
                metrics.PREFILL_HANDOFFS.labels("stopped").inc()
                return None
            span.set_attribute("cachet.outcome", "handed_off")
            span.set_attribute("cachet.cached_tokens", answer.usage.cached_tokens)
            metrics.PREFILL_HANDOFFS.labels("handed_off").inc()
            log.info(
                "prefilled on a prefill replica",
                request_id=request.request_id,
                address=replica.address,
                cached_tokens=answer.usage.cached_tokens,
                seconds=round(seconds, 3),
            )
            return engine_pb2.PrefilledElsewhere(
                first_token_id=answer.token_ids[0], cached_tokens=answer.usage.cached_tokens
            )

    @staticmethod
    async def _call(
        request: GenerationRequest, stub: engine_pb2_grpc.EngineServiceAsyncStub, hand_off_to: str
    ) -> engine_pb2.GenerateResponse | None:
        """The prefill replica's last answer (its one token), None if the stream ended without one."""
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling)
        sampling.max_tokens = 1
        call = stub.Generate(
            engine_pb2.GenerateRequest(
                request_id=f"{request.engine_request_id}:prefill",
                model=request.model,
                prompt_token_ids=request.prompt_token_ids,
                sampling=sampling,
                priority=request.priority,
                cache_salt=request.cache_salt,
                output_kind=engine_pb2.OUTPUT_KIND_FIRST_AND_FINAL,
                hand_off_kv=True,
                hand_off_to=hand_off_to,
                images=request.images,
            )
        )
        answer = None
        try:
            # Read to the stream's end (it follows the last answer at once): the call's trace
            # span ends there.
            async for response in call:
                if response.finish_reason:
                    answer = response
        finally:
            call.cancel()  # a no-op once the stream ended; stops the prefill when we were cancelled
        return answer


def _direct_transfer_address(prefill: Replica, decode: Replica) -> str:
    """The decode replica's KV receiver, where the prefill replica can push to it: both with as
    many tensor-parallel ranks, which pair shard to shard (a rank of one replica sharded
    otherwise keeps blocks of another shape)."""
    if prefill.info is None or decode.info is None:
        return ""
    if prefill.info.tensor_parallel_size != decode.info.tensor_parallel_size:
        return ""
    return decode.info.kv_transfer_address
