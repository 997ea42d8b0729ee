"""One completion request from validation to its last chunk.

::

    validate → template / encode (tokenizer) → block hashes (cachet.block_hash, local,
      salted by the caller's cache scope: cache_scope.py)
      → MatchPrefix (cache index; down → score by load alone) → choose a replica
      → engine Generate stream → detokenize (in process, the tokenizer's own tokenizer)
      → stop strings (held back, cut where the engine matched one) → output parser → chunks
      → usage recorded once, in the recorder's next RecordUsageBatch (request id is the ledger key)

``RequestPipeline.start_*`` runs everything up to the engine's first message, so
that every refusal (bad request, unknown model, no capacity) is an error status
before any chunk is sent. The returned ``Generation`` then streams chunks; it owns
the engine call, and ``close()`` (called when the stream ends, fails, or the
client goes away) aborts the engine request if it is still running and records
the usage of whatever was produced.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import cast

import grpc

from cachet.block_hash import DEFAULT_BLOCK_SIZE, ImageSpan, block_hashes
from cachet.cache.v1 import cache_pb2, cache_pb2_grpc
from cachet.common.v1 import common_pb2
from cachet.engine.v1 import engine_pb2
from cachet.errors import NotFound, ResourceExhausted, Unavailable
from cachet.incremental_detokenizer import IncrementalDetokenizer
from cachet.logs import get_logger
from cachet.router import metrics
from cachet.router.answer_check import AnswerCheck
from cachet.router.cache_retention import engine_retention
from cachet.router.cache_scope import CacheScopes
from cachet.router.caller import Caller
from cachet.router.choices import ChoiceGroup
from cachet.router.detokenizer import Detokenizers
from cachet.router.output_parser import OutputDelta, merge_deltas
from cachet.router.placement import Placement, PlacementPolicy, choose_replica, prefix_value
from cachet.router.prefill_handoff import PrefillHandOff
from cachet.router.prompt import PromptBuilder, check_context_window, validate_chat, validate_completion
from cachet.router.replica_set import Replica, ReplicaSet
from cachet.router.session_directory import SessionDirectory
from cachet.router.stop_strings import StopStringHoldBack
from cachet.router.tool_parsers.model_family import ModelFamilies
from cachet.router.tool_parsers.reasoning import PromptReasoning
from cachet.router.tool_parsers.selection import PLAIN_TEXT, OutputSetup, output_setup_for
from cachet.router.tool_parsers.tool_choice import plan_tools
from cachet.router.upstream_errors import domain_error
from cachet.router.usage_recorder import UsageRecorder
from cachet.router.v1 import router_pb2
from cachet.tokenizer.v1 import tokenizer_pb2_grpc
from cachet.usage.v1 import usage_pb2

log = get_logger(__name__)

# Engine answers after which the request may go to one other replica: it was never started.
_RETRY_ELSEWHERE = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}
# The engine closes its stream right after the last message; never wait long for that.
_ENGINE_EOF_TIMEOUT_SECONDS = 0.5
# Asked once per model (then kept): how long the tokenizer may take to describe it, or to
# hand over its tokenizer.
_MODEL_INFO_TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class GenerationRequest:
    """A validated, tokenized request: all the pipeline needs, whichever API it came from."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: common_pb2.SamplingParams
    response_format: common_pb2.ResponseFormat
    caller: Caller
    role: str  # announced on the first chunk: "assistant" for chat, "" for text completions
    arrived_at: float  # monotonic seconds
    # Queued (async) work runs as PRIORITY_BATCH: the engine schedules it after, and preempts
    # it before, interactive requests.
    priority: common_pb2.Priority.ValueType = common_pb2.PRIORITY_INTERACTIVE
    output: OutputSetup = field(default=PLAIN_TEXT)  # how the answer is decoded and parsed
    # False when the caller takes the whole answer at once: the engine then sends the first
    # token (the sign it started) and the rest in one message, not a message per step.
    stream: bool = True
    # Seeds the prefix block hashes here and in the engine (cache_scope.py): only requests
    # with the same salt share cached prefixes.
    cache_salt: str = ""
    # Choices asked for (n), and which of them this one is: each choice is an engine request
    # of its own, billed with the others as one (choices.py).
    choices: int = 1
    choice: int = 0
    # Prefixes the engine keeps in preference to other KV once the request ends (cache_retention.py).
    kv_retention: tuple[engine_pb2.KvRetention, ...] = ()
    # The prompt's images (their placeholder tokens are in prompt_token_ids).
    images: tuple[common_pb2.ImageInput, ...] = ()
    # response_format holds only the output after this token (engine.proto).
    constrain_after_token_id: int | None = None

    @property
    def reproducible(self) -> bool:
        """Greedy or seeded, as the engine will see it: its KV blocks are named apart (they come
        from batch-invariant steps). A request that leaves temperature to the model's default is
        taken as sampled; where that default is greedy only placement is the poorer for it."""
        sampling = self.sampling
        return (sampling.HasField("temperature") and sampling.temperature == 0.0) or sampling.HasField("seed")

    @property
    def image_spans(self) -> list[ImageSpan]:
        return [ImageSpan(i.token_offset, i.num_tokens, i.content_hash) for i in self.images]

    @property
    def engine_request_id(self) -> str:
        """The engine's name for this choice: choice 0 keeps the request's own id."""
        return self.request_id if self.choice == 0 else f"{self.request_id}/{self.choice}"

    def for_choice(self, choice: int) -> GenerationRequest:
        """Choice ``choice`` of the same request; a seeded one draws from its own seed (vLLM's seed + i)."""
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(self.sampling)
        if sampling.HasField("seed"):
            sampling.seed = (sampling.seed + choice) % 2**64
        return dataclasses.replace(self, sampling=sampling, choice=choice)


def _session_key(caller: Caller) -> str:
    # Session ids are the callers' own names: two accounts may both call theirs "main".
    return f"{caller.account_id}\0{caller.session_id}"


class _Refused(Exception):
    """An engine turned the request away before starting it; another replica may take it."""

    def __init__(self, error: grpc.aio.AioRpcError) -> None:
        super().__init__(error.details())
        self.error = error


class RequestPipeline:
    """Starts generations; shared by every call of the servicer."""

    def __init__(
        self,
        replicas: ReplicaSet,
        prompts: PromptBuilder,
        tokenizer: tokenizer_pb2_grpc.TokenizerServiceAsyncStub,
        cache: cache_pb2_grpc.CacheIndexServiceAsyncStub,
        usage: UsageRecorder,
        policy: PlacementPolicy,
        cache_timeout_seconds: float,
        cache_scopes: CacheScopes | None = None,
        sessions: SessionDirectory | None = None,
        clamp_max_tokens: bool = True,
        session_retention: router_pb2.CacheRetention.ValueType = router_pb2.CACHE_RETENTION_UNSPECIFIED,
        prefill_handoff: PrefillHandOff | None = None,
    ) -> None:
        self._replicas = replicas
        # Disaggregated prefill: long prompts computed on a prefill replica first.
        self._prefill_handoff = prefill_handoff
        # What a request with a session id and no retention of its own is kept for.
        self._session_retention = session_retention
        self._clamp_max_tokens = clamp_max_tokens
        self._sessions = sessions or SessionDirectory()
        self._cache_scopes = cache_scopes or CacheScopes()
        self._prompts = prompts
        self._cache = cache
        self.usage = usage
        self._policy = policy
        self._cache_timeout = cache_timeout_seconds
        self._families = ModelFamilies(tokenizer, _MODEL_INFO_TIMEOUT_SECONDS)
        self._detokenizers = Detokenizers(tokenizer, _MODEL_INFO_TIMEOUT_SECONDS)
        # Strong references to fire-and-forget work (engine aborts, reading a stream's end).
        self._background: set[asyncio.Task[None]] = set()

    async def start_chat(
        self,
        request: router_pb2.ChatCompletionRequest,
        caller: Caller,
        priority: common_pb2.Priority.ValueType = common_pb2.PRIORITY_INTERACTIVE,
        *,
        stream: bool = True,
    ) -> Generation | ChoiceGroup:
        arrived = time.monotonic()
        with _counting_failures():
            validate_chat(request)
            tools = plan_tools(request)
            engine = self._engine_for(request.model)
            prompt = await self._prompts.chat(request, tools.offered)
            family = await self._families.get(request.model)
            generation = GenerationRequest(
                request.request_id or f"chatcmpl-{uuid.uuid4().hex}",
                request.model,
                prompt.token_ids,
                request.sampling,
                # Forced calls and strict tools under auto are grammars of their own (see tool_choice).
                tools.constraint_for(family, prompt.reasoning) or request.response_format,
                caller,
                "assistant",
                arrived,
                priority,
                output_setup_for(family, tools, prompt.reasoning),
                stream,
                self._cache_scopes.salt_for(caller.account_id, request.cache_salt),
                choices=max(request.n, 1),
                kv_retention=self._retention(request.cache_retention, caller, prompt.breakpoints),
                images=prompt.images,
                # A think block the prompt opened is the model's own: a constraint holds the answer
                # after it.
                constrain_after_token_id=family.think_close_token_id
                if prompt.reasoning is PromptReasoning.OPEN
                else None,
            )
            return await self._start_choices(generation, engine)

    async def start_completion(
        self,
        request: router_pb2.CompletionRequest,
        caller: Caller,
        priority: common_pb2.Priority.ValueType = common_pb2.PRIORITY_INTERACTIVE,
        *,
        stream: bool = True,
    ) -> Generation | ChoiceGroup:
        arrived = time.monotonic()
        with _counting_failures():
            validate_completion(request)
            engine = self._engine_for(request.model)
            prompt = await self._prompts.completion(request)
            generation = GenerationRequest(
                request.request_id or f"cmpl-{uuid.uuid4().hex}",
                request.model,
                prompt,
                request.sampling,
                request.response_format,
                caller,
                "",
                arrived,
                priority,
                stream=stream,
                cache_salt=self._cache_scopes.salt_for(caller.account_id, request.cache_salt),
                choices=max(request.n, 1),
                kv_retention=self._retention(request.cache_retention, caller),
            )
            return await self._start_choices(generation, engine)

    def _retention(
        self,
        retention: router_pb2.CacheRetention.ValueType,
        caller: Caller,
        breakpoints: Sequence[tuple[int, router_pb2.CacheRetention.ValueType]] = (),
    ) -> tuple[engine_pb2.KvRetention, ...]:
        return engine_retention(
            retention,
            breakpoints,
            session_default=self._session_retention,
            has_session=bool(caller.session_id),
        )

    def list_models(self) -> list[router_pb2.ModelCard]:
        return [
            router_pb2.ModelCard(
                id=info.model, context_window=info.context_window, created=int(loaded_at), owned_by="cachet"
            )
            for info, loaded_at in self._replicas.models()
        ]

    def record_usage(
        self, request: GenerationRequest, usage: common_pb2.Usage, replica_address: str
    ) -> asyncio.Future[bool]:
        """Send ``request``'s one usage record (the ledger's key is its id) in the recorder's next batch."""
        metrics.PROMPT_TOKENS.inc(usage.prompt_tokens)
        metrics.CACHED_TOKENS.inc(usage.cached_tokens)
        metrics.COMPLETION_TOKENS.inc(usage.completion_tokens)
        batch = request.priority == common_pb2.PRIORITY_BATCH
        return self.usage.submit(
            usage_pb2.UsageRecord(
                request_id=request.request_id,
                account_id=request.caller.account_id,
                api_key_id=request.caller.api_key_id,
                model=request.model,
                session_id=request.caller.session_id,
                prompt_tokens=usage.prompt_tokens,
                cached_tokens=usage.cached_tokens,
                completion_tokens=usage.completion_tokens,
                finished_at_ms=int(time.time() * 1000),
                replica_address=replica_address,
                priority="batch" if batch else "interactive",
            ),
        )

    def in_background(self, work: Coroutine[None, None, None]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _engine_for(self, model: str) -> engine_pb2.EngineInfo:
        info = self._replicas.engine_info(model)
        if info is not None:
            return info
        if not any(self._replicas.get(a).info for a in self._replicas.addresses):
            raise Unavailable("no engine replica is reachable yet; retry shortly")
        raise NotFound(f"model {model!r} is not served here; see ListModels", param="model")

    async def _start_choices(
        self, request: GenerationRequest, engine: engine_pb2.EngineInfo
    ) -> Generation | ChoiceGroup:
        """One generation, or with n > 1 a group of them sharing the prompt's KV on one replica.

        Choice 0 is placed and started as any request; its first token means its prompt is
        computed, and the engine's prefix cache names every full block of it. The other
        choices then go to that same replica, where the prompt's full blocks are cache hits and
        the block of its last token is copied from choice 0's while that one still runs: the
        prompt is prefilled once, not n times (each other choice computes its last token only).
        """
        first = await self._start(request, engine)
        if request.choices == 1:
            return first
        replica = self._replicas.get(first.replica_address)
        opened = await asyncio.gather(
            *(
                self._open_choice(request.for_choice(i), replica, first.placement)
                for i in range(1, request.choices)
            ),
            return_exceptions=True,
        )
        others = [g for g in opened if isinstance(g, Generation)]
        failure = next((e for e in opened if isinstance(e, BaseException)), None)
        if failure is not None:
            for generation in [first, *others]:
                generation.close(failure)
            if isinstance(failure, _Refused):
                raise self._final_refusal(failure.error) from failure
            raise failure
        return ChoiceGroup(self, [first, *others])

    async def _open_choice(
        self, request: GenerationRequest, replica: Replica, placement: Placement
    ) -> Generation:
        detokenizer = await self._detokenizers.new(
            request.model,
            request.prompt_token_ids,
            skip_special_tokens=not request.output.keep_special_tokens,
        )
        return await self._open(request, replica, placement, detokenizer)

    async def _start(self, request: GenerationRequest, engine: engine_pb2.EngineInfo) -> Generation:
        prompt_param = "messages" if request.role else "prompt"
        check_context_window(
            len(request.prompt_token_ids),
            request.sampling,
            engine,
            prompt_param,
            clamp_max_tokens=self._clamp_max_tokens,
        )
        cached = (
            await self._cached_prefix_tokens(
                engine,
                request.prompt_token_ids,
                request.cache_salt,
                request.image_spans,
                request.reproducible,
            )
            if len(self._replicas.addresses_serving(request.model)) > 1
            else {}  # one replica: where the prefix lives cannot change the choice
        )
        detokenizer = await self._detokenizers.new(
            request.model,
            request.prompt_token_ids,
            skip_special_tokens=not request.output.keep_special_tokens,
        )
        refused: list[str] = []
        last_refusal: _Refused | None = None
        tried_prefill = False
        prefilled: engine_pb2.PrefilledElsewhere | None = None
        while True:
            try:
                placement = self._place(request, cached, refused)
            except Unavailable:
                if last_refusal is None:
                    raise
                # No other replica to try: the caller hears what the one that refused said
                # (a lone replica that is down is a 503, not a 429 "at capacity").
                raise self._final_refusal(last_refusal.error) from last_refusal
            replica = self._replicas.get(placement.address)
            if not tried_prefill and self._prefill_handoff is not None:
                # Once: the prompt's KV waits in the shared tier for whichever replica decodes.
                tried_prefill = True
                prefill_replicas = self._prefill_handoff.candidates(request, cached, replica)
                if prefill_replicas:
                    prefilled = await self._prefill_handoff.prefill(
                        request, cached, replica, prefill_replicas
                    )
            try:
                generation = await self._open(request, replica, placement, detokenizer, prefilled)
            except _Refused as refusal:
                refused.append(placement.address)
                last_refusal = refusal
                log.info(
                    "engine refused request",
                    request_id=request.request_id,
                    address=placement.address,
                    code=refusal.error.code().name,
                    details=refusal.error.details(),
                )
                if len(refused) > 1:
                    raise self._final_refusal(refusal.error) from refusal
                metrics.ENGINE_RETRIES.inc()
                continue
            if request.caller.session_id:
                self._sessions.record(
                    _session_key(request.caller),
                    placement.address,
                    len(request.prompt_token_ids),
                    time.monotonic(),
                )
            return generation

    def _place(
        self, request: GenerationRequest, cached: dict[str, float], refused: Sequence[str]
    ) -> Placement:
        available = [replica.load() for replica in self._replicas.available(request.model)]
        now = time.monotonic()
        session = request.caller.session_id
        try:
            placement = choose_replica(
                available,
                cached,
                session_id=session,
                session_home=self._sessions.home(_session_key(request.caller), now) if session else "",
                footprints=self._sessions.footprints(now) if session else None,
                exclude=refused,
                policy=self._policy,
            )
        except ResourceExhausted:
            # Why a request was turned away is the first question an operator asks of a 429.
            log.info(
                "every replica at capacity",
                request_id=request.request_id,
                # With the queued jobs among them: placement counts only interactive seats.
                replicas=[
                    f"{load.address} running {load.running}/{load.max_running} ({load.batch_running} jobs)"
                    f" waiting {load.waiting}/{load.max_waiting} ({load.batch_waiting} jobs)"
                    for load in available
                ],
                refused_by=list(refused),
            )
            raise
        metrics.PLACEMENTS.labels(placement.reason).inc()
        return placement

    def _final_refusal(self, error: grpc.aio.AioRpcError) -> Exception:
        retry_after = self._policy.retry_after_seconds
        if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return ResourceExhausted(
                f"engine replicas are at capacity ({error.details()}); retry shortly",
                retry_after_seconds=retry_after,
            )
        return Unavailable(
            f"engine replicas are unavailable ({error.details()}); retry shortly",
            retry_after_seconds=retry_after,
        )

    async def _cached_prefix_tokens(
        self,
        engine: engine_pb2.EngineInfo,
        prompt: Sequence[int],
        cache_salt: str,
        images: Sequence[ImageSpan] = (),
        reproducible: bool = False,
    ) -> dict[str, float]:
        # The engine names its blocks with the same salt, images and batch-invariant kernels, so
        # the index holds these very hashes. A greedy prompt's blocks are named by the kernels
        # that computed them: replicas on hosts of other kinds hold other chains, one query each.
        kinds = (
            self._replicas.reproducible_kernels_serving(engine.model) or {engine.reproducible_kernels}
            if reproducible
            else {""}
        )
        matched = await asyncio.gather(
            *(self._match_prefix(engine, prompt, cache_salt, images, kind) for kind in sorted(kinds))
        )
        cached: dict[str, float] = {}
        for by_address in matched:
            for address, value in by_address.items():
                cached[address] = max(value, cached.get(address, 0.0))
        return cached

    async def _match_prefix(
        self,
        engine: engine_pb2.EngineInfo,
        prompt: Sequence[int],
        cache_salt: str,
        images: Sequence[ImageSpan],
        reproducible_kernels: str,
    ) -> dict[str, float]:
        block_size = engine.block_size or DEFAULT_BLOCK_SIZE
        hashes = block_hashes(
            prompt,
            engine.model,
            block_size=block_size,
            cache_salt=cache_salt,
            images=images,
            reproducible=reproducible_kernels,
        )
        if not hashes:
            return {}
        query = cache_pb2.MatchPrefixRequest(model=engine.model, block_hashes=hashes)
        try:
            reply = await self._cache.MatchPrefix(query, timeout=self._cache_timeout)
        except grpc.aio.AioRpcError as error:
            # The index only improves placement: without it, requests are placed by load.
            log.warning("cache index unavailable; placing by load", code=error.code().name)
            return {}
        return {match.address: self._prefix_value(match, block_size) for match in reply.matches}

    def _prefix_value(self, match: cache_pb2.ReplicaMatch, block_size: int) -> float:
        engine, host, shared = match.engine_blocks, match.host_blocks, match.shared_blocks
        if not engine + host + shared:
            # A cache index older than the tiers names only matched_blocks: the pool's.
            engine = match.matched_blocks
        return prefix_value(engine * block_size, host * block_size, shared * block_size, self._policy)

    async def _open(
        self,
        request: GenerationRequest,
        replica: Replica,
        placement: Placement,
        detokenizer: IncrementalDetokenizer,
        prefilled: engine_pb2.PrefilledElsewhere | None = None,
    ) -> Generation:
        """Send the request to ``replica`` and wait for its first message (or its refusal);
        ``prefilled``: a prefill replica computed its prompt (prefill_handoff)."""
        call = replica.stub.Generate(
            engine_pb2.GenerateRequest(
                request_id=request.engine_request_id,
                model=request.model,
                prompt_token_ids=request.prompt_token_ids,
                sampling=request.sampling,
                response_format=request.response_format,
                priority=request.priority,
                cache_salt=request.cache_salt,
                output_kind=engine_pb2.OUTPUT_KIND_DELTA
                if request.stream
                else engine_pb2.OUTPUT_KIND_FIRST_AND_FINAL,
                kv_retention=request.kv_retention,
                prefilled=prefilled,
                images=request.images,
                constrain_after_token_id=request.constrain_after_token_id,
            )
        )
        replica.enter(request.priority)
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as error:
            replica.leave(request.priority)
            if error.code() in _RETRY_ELSEWHERE:
                raise _Refused(error) from error
            raise domain_error(error, "engine") from error
        except BaseException:
            # Cancelled while the engine was prefilling: stop the work we asked for (the engine
            # aborts a request whose call is cancelled).
            replica.leave(request.priority)
            call.cancel()
            raise
        if first is grpc.aio.EOF:
            replica.leave(request.priority)
            raise Unavailable("the engine ended the request without an answer; retry")
        # types-grpcio types read() as EOF's type (object) or the response: `is EOF` cannot narrow it.
        first = cast(engine_pb2.GenerateResponse, first)
        return Generation(self, request, replica, placement, call, first, detokenizer)


class Generation:
    """A started request: streams its chunks, then (or when cut short) closes once."""

    def __init__(
        self,
        pipeline: RequestPipeline,
        request: GenerationRequest,
        replica: Replica,
        placement: Placement,
        call: grpc.aio.UnaryStreamCall,
        first: engine_pb2.GenerateResponse,
        detokenizer: IncrementalDetokenizer,
    ) -> None:
        self.request = request
        self.replica_address = replica.address
        self.placement = placement
        self.created = int(time.time())
        self._pipeline = pipeline
        self._replica = replica
        self._call = call
        self._first = first
        self._detokenizer = detokenizer
        self._stop = StopStringHoldBack(request.sampling.stop)
        self._parser = request.output.new_parser()
        # A schema decoding only approximates (oneOf as anyOf, keywords llguidance leaves out) is
        # checked whole once the answer stops.
        self._answer_check = AnswerCheck.for_format(request.response_format)
        self._made_tool_calls = False
        self._prompt_tokens = len(request.prompt_token_ids)
        self._cached_tokens = first.usage.cached_tokens if first.HasField("usage") else 0
        self._completion_tokens = 0
        self._first_chunk_built = False  # it names the role (chat) and goes with the first token
        self._first_chunk_at: float | None = None
        self._engine_done = False  # the engine sent its last message
        self._finished = False  # the last chunk was built
        self._closed = False
        # Whether the ledger has this request's usage; set when the record is sent.
        self.usage_recorded: asyncio.Future[bool] | None = None

    async def chunks(self) -> AsyncIterator[router_pb2.ChatCompletionChunk]:
        """The stream of chunks; the last carries finish_reason and usage."""
        error: BaseException | None = None
        try:
            async for chunk in self._produce():
                yield chunk
        except BaseException as failure:
            error = failure
            raise
        finally:
            self.close(error)

    async def collect(self) -> router_pb2.ChatCompletion:
        """The whole completion, built from the same chunks a stream would get."""
        result = router_pb2.ChatCompletion(
            id=self.request.request_id,
            model=self.request.model,
            created=self.created,
            replica_address=self.replica_address,
        )
        content: list[str] = []
        reasoning: list[str] = []
        calls: dict[int, common_pb2.ToolCall] = {}
        async for chunk in self.chunks():
            content.append(chunk.content_delta)
            reasoning.append(chunk.reasoning_delta)
            for delta in chunk.tool_call_deltas:
                # The same fragments a stream gets, joined: id and name first, then argument text.
                call = calls.setdefault(delta.index, common_pb2.ToolCall())
                call.id = call.id or delta.id
                call.name = call.name or delta.name
                call.arguments_json += delta.arguments_delta
            result.logprobs.extend(chunk.logprobs)
            if chunk.finish_reason:
                result.finish_reason = chunk.finish_reason
                result.matched_stop = chunk.matched_stop
            if chunk.HasField("usage"):
                result.usage.CopyFrom(chunk.usage)
        result.content, result.reasoning_content = "".join(content), "".join(reasoning)
        result.tool_calls.extend(calls[index] for index in sorted(calls))
        return result

    def close(self, error: BaseException | None = None) -> None:
        """End the request exactly once: abort the engine if it still runs, record usage.

        Safe to call from a gRPC done-callback (it only schedules work): that is how a
        client that goes away while its stream is idle still aborts the engine.
        """
        if self._closed:
            return
        self._closed = True
        self._replica.leave(self.request.priority)
        if not self._engine_done:
            self._call.cancel()  # the engine aborts the request: its stream's generator is closed
        # A queued job cut short runs again under the same id (the ledger key): only the
        # attempt that finishes is billed, so the ledger agrees with the stored result.
        if not self._finished and self.request.priority != common_pb2.PRIORITY_BATCH:
            self._submit_usage()
        outcome = metrics.outcome_of(error) if error is not None or self._finished else "cancelled"
        metrics.REQUESTS.labels(outcome).inc()
        log.info(
            "request done",
            request_id=self.request.request_id,
            choice=self.request.choice,
            outcome=outcome,
            replica=self.replica_address,
            placement=self.placement.reason,
            **_usage_fields(self._usage()),
        )

    async def _produce(self) -> AsyncIterator[router_pb2.ChatCompletionChunk]:
        response = self._first
        while True:
            self._completion_tokens += len(response.token_ids)
            finish = response.finish_reason
            text = self._detokenizer.add(self._answer_tokens(response)) if response.token_ids else ""
            if finish:
                self._engine_done = True
                self._pipeline.in_background(self._read_engine_eof())
                # The engine matched any stop string (stop_strings.py): cut where it says.
                text = self._stop.finish(text + self._detokenizer.flush(), response.matched_stop)
                yield await self._last_chunk(text, finish, response)
                return
            chunk = self._chunk(self._parser.feed(self._stop.feed(text)), response.logprobs)
            if chunk is not None:
                yield chunk
            response = await self._read()

    def _answer_tokens(self, response: engine_pb2.GenerateResponse) -> Sequence[int]:
        """The tokens to decode: when special tokens are decoded, not the end-of-turn token that stopped."""
        ids = response.token_ids
        output = self.request.output
        if (
            output.keep_special_tokens
            and response.finish_reason == common_pb2.FINISH_REASON_STOP
            and ids
            and ids[-1] in output.stop_token_ids
        ):
            return ids[:-1]
        return ids

    async def _read_engine_eof(self) -> None:
        """Read the end of the engine's stream, which follows its last message at once.

        Tracing's client span of the Generate call ends only when the stream is read
        to its end; left unread, it ends whenever the call is garbage-collected, so
        the trace showed the router -> engine hop late or not at all.
        """
        with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
            await asyncio.wait_for(self._call.read(), _ENGINE_EOF_TIMEOUT_SECONDS)

    async def _read(self) -> engine_pb2.GenerateResponse:
        try:
            response = await self._call.read()
        except grpc.aio.AioRpcError as error:
            self._engine_done = True
            raise domain_error(error, "engine") from error
        if response is grpc.aio.EOF:
            self._engine_done = True
            raise Unavailable("the engine ended the stream before the request finished; retry")
        return cast(engine_pb2.GenerateResponse, response)  # see _open: `is EOF` does not narrow

    async def _last_chunk(
        self,
        text: str,
        finish: common_pb2.FinishReason.ValueType,
        last: engine_pb2.GenerateResponse,
    ) -> router_pb2.ChatCompletionChunk:
        delta = merge_deltas(self._parser.feed(text), self._parser.finish())
        if last.HasField("usage"):
            self._cached_tokens = last.usage.cached_tokens
            self._completion_tokens = max(self._completion_tokens, last.usage.completion_tokens)
        self._finished = True
        if self._first_chunk_at is not None and self._completion_tokens > 1:
            spent = time.monotonic() - self._first_chunk_at
            metrics.TIME_PER_OUTPUT_TOKEN.observe(spent / (self._completion_tokens - 1))
        usage = self._usage()
        # The record goes out after the last chunk, in the recorder's next batch, not before
        # it: the ledger is idempotent and the recorder retries on its own, so waiting for the
        # usage service's fsync would only add its latency to every request. Shutdown sends
        # and drains what is still waiting.
        self._submit_usage()
        if finish == common_pb2.FINISH_REASON_STOP and (self._made_tool_calls or delta.tool_calls):
            finish = common_pb2.FINISH_REASON_TOOL_CALLS  # OpenAI's reason for a turn that called tools
        chunk = self._chunk(delta, last.logprobs, finish)
        assert chunk is not None  # a finish reason always makes a chunk
        chunk.usage.CopyFrom(usage)
        if finish == common_pb2.FINISH_REASON_STOP:
            chunk.matched_stop = last.matched_stop
        if self._answer_check is not None and finish == common_pb2.FINISH_REASON_STOP:
            # A cut-short answer (length) says so itself; a stopped one must be what was asked for.
            self._answer_check.verify()
        return chunk

    def _chunk(
        self,
        delta: OutputDelta,
        logprobs: Sequence[common_pb2.TokenLogprob] = (),
        finish: common_pb2.FinishReason.ValueType = common_pb2.FINISH_REASON_UNSPECIFIED,
    ) -> router_pb2.ChatCompletionChunk | None:
        if not delta and not logprobs and not finish and self._first_chunk_built:
            # A stream's first chunk goes out with its first token even when that token shows no
            # text yet (a held-back stop-string prefix, a character split across tokens): it
            # tells the client that the answer has begun, as OpenAI's chat role chunk and
            # vLLM's first chunk do. Later chunks wait for something to carry.
            return None
        self._made_tool_calls |= bool(delta.tool_calls)
        if self._answer_check is not None:
            self._answer_check.feed(delta.content)
        chunk = router_pb2.ChatCompletionChunk(
            id=self.request.request_id,
            model=self.request.model,
            created=self.created,
            content_delta=delta.content,
            reasoning_delta=delta.reasoning,
            tool_call_deltas=delta.tool_calls,
            logprobs=logprobs,
            finish_reason=finish,
            index=self.request.choice,
        )
        if not self._first_chunk_built:
            chunk.role = self.request.role
            self._first_chunk_built = True
            self._first_chunk_at = time.monotonic()
            metrics.TIME_TO_FIRST_TOKEN.observe(self._first_chunk_at - self.request.arrived_at)
        return chunk

    @property
    def finished(self) -> bool:
        """The last chunk was built: the choice ran to its end."""
        return self._finished

    def _usage(self) -> common_pb2.Usage:
        return common_pb2.Usage(
            prompt_tokens=self._prompt_tokens,
            cached_tokens=self._cached_tokens,
            completion_tokens=self._completion_tokens,
        )

    def usage(self) -> common_pb2.Usage:
        """What this choice has cost so far (its prompt, as if alone, and its own tokens)."""
        return self._usage()

    def _submit_usage(self) -> None:
        if self.request.choices > 1:
            return  # one of several choices: the group records the request once (choices.py)
        self.usage_recorded = self._pipeline.record_usage(self.request, self._usage(), self.replica_address)


def _usage_fields(usage: common_pb2.Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": usage.cached_tokens,
        "completion_tokens": usage.completion_tokens,
    }


@contextlib.contextmanager
def _counting_failures() -> Iterator[None]:
    """Count requests refused before they reach an engine under their outcome label."""
    try:
        yield
    except BaseException as error:
        metrics.REQUESTS.labels(metrics.outcome_of(error)).inc()
        raise
