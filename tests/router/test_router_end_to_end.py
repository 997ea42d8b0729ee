"""The request path end to end: real tokenizer, usage, cache index, two tiny-model engines, router.

Every test makes its own prompts and session ids (a nonce leads each system
message), so that tests sharing the module's processes never share a cached prefix.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from metrics_scrape import growth, scrape
from service_processes import TINY_MODEL_ID, CachetStack, free_port

from cachet.block_hash import block_hashes
from cachet.cache.v1 import cache_pb2, cache_pb2_grpc
from cachet.common.v1 import common_pb2
from cachet.engine.v1 import engine_pb2, engine_pb2_grpc
from cachet.grpc_channel import create_channel
from cachet.router.cache_scope import CacheScopes
from cachet.router.caller import ANONYMOUS_ACCOUNT
from cachet.router.placement import rendezvous_order
from cachet.router.readiness import READINESS_SERVICE
from cachet.router.v1 import router_pb2, router_pb2_grpc
from cachet.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from cachet.usage.v1 import usage_pb2, usage_pb2_grpc

TIMEOUT = 120.0


@pytest.fixture
async def inference(stack: CachetStack):
    async with create_channel(stack.address("router")) as channel:
        yield router_pb2_grpc.InferenceServiceStub(channel)


@pytest.fixture
async def usage(stack: CachetStack):
    async with create_channel(stack.address("usage")) as channel:
        yield usage_pb2_grpc.UsageServiceStub(channel)


def chat(
    question: str = "What is the capital of France?", *, max_tokens: int = 8, **sampling
) -> router_pb2.ChatCompletionRequest:
    """A greedy chat request whose prompt starts with a fresh nonce (no prefix shared with other tests)."""
    nonce = uuid.uuid4().hex
    messages = [
        common_pb2.ChatMessage(role="system", content=[common_pb2.ContentPart(text=f"[{nonce}] Be brief.")]),
        common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text=question)]),
    ]
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **sampling)
    return router_pb2.ChatCompletionRequest(model=TINY_MODEL_ID, messages=messages, sampling=params)


def session_homed_on(address: str, addresses: list[str]) -> str:
    prefix = uuid.uuid4().hex[:8]
    return next(
        f"{prefix}-{i}" for i in range(10_000) if rendezvous_order(f"{prefix}-{i}", addresses)[0] == address
    )


async def until(probe: Callable[[], Awaitable], timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (result := await probe()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)
    return result


async def stream(inference, request, metadata=()) -> tuple[list[router_pb2.ChatCompletionChunk], str]:
    call = inference.StreamChatCompletion(request, metadata=metadata, timeout=TIMEOUT)
    chunks = [chunk async for chunk in call]
    replica = dict(await call.initial_metadata()).get("x-cachet-replica", "")
    return chunks, replica


async def test_streamed_chat_completion_carries_role_first_and_usage_last(stack, inference) -> None:
    request = chat(max_tokens=8)
    chunks, replica = await stream(inference, request)
    assert replica in stack.engine_addresses
    assert chunks[0].role == "assistant" and all(not c.role for c in chunks[1:])
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert [bool(c.finish_reason) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    last = chunks[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == 8
    assert last.usage.prompt_tokens > 16
    assert all(not c.HasField("usage") for c in chunks[:-1])
    # The whole completion is the same text, with the replica named.
    whole = await inference.CreateChatCompletion(request, timeout=TIMEOUT)
    assert whole.content == "".join(c.content_delta for c in chunks)
    assert whole.content
    assert (whole.finish_reason, whole.usage.completion_tokens) == (common_pb2.FINISH_REASON_LENGTH, 8)
    assert whole.replica_address in stack.engine_addresses


def text_completion(max_tokens: int) -> router_pb2.CompletionRequest:
    return router_pb2.CompletionRequest(
        model=TINY_MODEL_ID,
        prompt=f"{uuid.uuid4().hex} Once upon a time",
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


@pytest.mark.parametrize("kind", ["chat", "text"])
async def test_a_streams_first_chunk_goes_out_with_its_first_token_before_any_text(inference, kind) -> None:
    if kind == "chat":
        request, role, rpc = chat(max_tokens=8), "assistant", inference.StreamChatCompletion
    else:
        request, role, rpc = text_completion(8), "", inference.StreamCompletion

    async def stream_of(request) -> list[router_pb2.ChatCompletionChunk]:
        return [chunk async for chunk in rpc(request, timeout=TIMEOUT)]

    # Three runs of one prompt, so the two compared both find it cached and compute alike.
    await stream_of(request)
    # With logprobs every token makes a chunk: the first chunk's text is the first token's.
    request.sampling.logprobs = True
    per_token = await stream_of(request)
    answer = "".join(c.content_delta for c in per_token)
    # A stop string that the whole answer begins (and never holds): the router holds all its text
    # back, in case the stop string follows, whichever tokens the engine's first message carries
    # (a reader that falls behind gets the first two in one).
    request.sampling.logprobs = False
    request.sampling.stop.append(answer + "\uffff")
    chunks = await stream_of(request)
    assert (chunks[0].role, chunks[0].content_delta) == (role, "")
    assert all(c.content_delta or c.finish_reason for c in chunks[1:])  # later chunks carry something
    assert "".join(c.content_delta for c in chunks) == answer
    assert chunks[-1].usage.completion_tokens == 8


async def test_second_identical_request_is_placed_on_the_prefix_and_reports_cached_tokens(
    stack, inference
) -> None:
    # The first request goes (by session) to the replica that the load-only tie-break would NOT pick,
    # so that the second, session-less request lands there only if the router scores cached prefixes.
    holder = max(stack.engine_addresses)
    request = chat("Tell me about the history of the Roman empire in three sentences, please.", max_tokens=2)
    first = await inference.CreateChatCompletion(
        request,
        metadata=(("x-session-affinity", session_homed_on(holder, stack.engine_addresses)),),
        timeout=TIMEOUT,
    )
    assert first.replica_address == holder
    assert first.usage.cached_tokens == 0

    # Wait until the cache index has the prompt's blocks from the holder's KV events.
    async with (
        create_channel(stack.address("tokenizer")) as tok_channel,
        create_channel(stack.address("cache")) as cache_channel,
        create_channel(holder) as engine_channel,
    ):
        engine_info = await engine_pb2_grpc.EngineServiceStub(engine_channel).GetEngineInfo(
            engine_pb2.GetEngineInfoRequest()
        )
        kernels = engine_info.reproducible_kernels  # the request is greedy: batch-invariant steps
        rendered = await tokenizer_pb2_grpc.TokenizerServiceStub(tok_channel).ApplyChatTemplate(
            tokenizer_pb2.ApplyChatTemplateRequest(
                model=TINY_MODEL_ID, messages=request.messages, add_generation_prompt=True
            )
        )
        # The engine names blocks with the caller's cache salt, so the index holds the salted chain.
        salt = CacheScopes().salt_for(ANONYMOUS_ACCOUNT)
        hashes = block_hashes(list(rendered.token_ids), TINY_MODEL_ID, cache_salt=salt, reproducible=kernels)
        cache = cache_pb2_grpc.CacheIndexServiceStub(cache_channel)

        async def holders(hashes: list[int]) -> set[str]:
            reply = await cache.MatchPrefix(
                cache_pb2.MatchPrefixRequest(model=TINY_MODEL_ID, block_hashes=hashes)
            )
            return {m.address for m in reply.matches if m.matched_blocks > 0}

        async def indexed() -> bool:
            return holder in await holders(hashes)

        await until(indexed, 10, "the cache index to hold the first prompt")
        # Unsalted, the same prompt names nothing: no other account can find it.
        assert not await holders(block_hashes(list(rendered.token_ids), TINY_MODEL_ID, reproducible=kernels))
    # Let a load report (every 200 ms) show the holder idle again: a busy holder may lose on load.
    await asyncio.sleep(0.6)

    second = await inference.CreateChatCompletion(request, timeout=TIMEOUT)
    assert second.replica_address == holder
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert second.usage.cached_tokens >= 16
    assert second.content == first.content


async def test_a_session_stays_where_it_started_and_new_sessions_spread(stack) -> None:
    # A router of its own: its session directory then holds only these sessions.
    router = stack.start_router("router-sessions")
    homes = []
    try:
        async with create_channel(router.address) as channel:
            inference = router_pb2_grpc.InferenceServiceStub(channel)
            for _ in stack.engine_addresses:
                session = uuid.uuid4().hex
                served = []
                for turn in range(3):
                    # Fresh prompts: no turn finds another's prefix, so only the session keeps it put.
                    request = chat(f"Question number {turn}?", max_tokens=2)
                    # Metadata for one turn, the request field for another: both name the session.
                    if turn % 2:
                        request.session_id = session
                        reply = await inference.CreateChatCompletion(request, timeout=TIMEOUT)
                    else:
                        reply = await inference.CreateChatCompletion(
                            request, metadata=(("x-session-affinity", session),), timeout=TIMEOUT
                        )
                    served.append(reply.replica_address)
                assert len(set(served)) == 1, served
                homes.append(served[0])
    finally:
        router.stop()
    # Each new session went where the live sessions held the least KV: one per replica.
    assert sorted(homes) == sorted(stack.engine_addresses)


async def test_stop_strings_truncate_the_output(inference) -> None:
    session = uuid.uuid4().hex  # one replica for both requests: greedy output is then identical
    request = chat("Count from one to twenty.", max_tokens=24)
    plain = await inference.CreateChatCompletion(
        request, metadata=(("x-session-affinity", session),), timeout=TIMEOUT
    )
    text = plain.content
    assert len(text) >= 8, text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expected = text[: text.find(stop)]

    request.sampling.stop.append(stop)
    stopped = await inference.CreateChatCompletion(
        request, metadata=(("x-session-affinity", session),), timeout=TIMEOUT
    )
    assert stopped.content == expected
    assert stopped.finish_reason == common_pb2.FINISH_REASON_STOP
    assert stopped.usage.completion_tokens < 24  # the engine stopped, not just the router's view

    chunks, _ = await stream(inference, request, metadata=(("x-session-affinity", session),))
    assert "".join(c.content_delta for c in chunks) == expected
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_STOP


async def test_usage_is_recorded_once_with_the_reported_counts(stack, inference, usage) -> None:
    session = uuid.uuid4().hex
    chunks, replica = await stream(inference, chat(max_tokens=5), metadata=(("x-session-affinity", session),))
    reported = chunks[-1].usage

    async def rows() -> list[usage_pb2.UsageRow]:
        query = usage_pb2.QueryUsageRequest(session_id=session, group_by=["account", "session"])
        return list((await usage.QueryUsage(query, timeout=10)).rows)

    [row] = await until(rows, 10, "the usage record")
    assert (row.account_id, row.session_id, row.requests) == ("anonymous", session, 1)
    assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (
        reported.prompt_tokens,
        reported.cached_tokens,
        reported.completion_tokens,
    )
    await asyncio.sleep(0.5)  # nothing else arrives later (a second record would be a second request id)
    assert [r.requests for r in await rows()] == [1]


TENANT_KEYS = {"sk-a": "acct-a", "sk-b": "acct-b", "sk-a2": "acct-a2", "sk-c": "acct-c"}


async def test_each_account_sees_only_its_own_cached_prefixes(stack) -> None:
    # acct-a2 shares acct-a's cache group (an organisation); acct-b and acct-c are on their own.
    router = stack.start_router(
        "router-tenants",
        CACHET_ROUTER_API_KEYS=json.dumps(TENANT_KEYS),
        CACHET_ROUTER_CACHE_GROUPS=json.dumps({"acct-a": "org-1", "acct-a2": "org-1"}),
        # One replica for every request, so a miss is isolation, not placement (each account's
        # session is its own, and a new one goes where the sessions hold the least KV).
        CACHET_ROUTER_ENGINE_ADDRESSES=json.dumps([holder := min(stack.engine_addresses)]),
    )
    session = uuid.uuid4().hex
    request = chat("Summarise the plot of Hamlet in two sentences, please.", max_tokens=1)
    try:
        async with create_channel(router.address) as channel:
            keyed = router_pb2_grpc.InferenceServiceStub(channel)

            async def cached_for(key: str, salt: str = "") -> int:
                request.cache_salt = salt
                metadata = (("authorization", f"Bearer {key}"), ("x-session-affinity", session))
                reply = await keyed.CreateChatCompletion(request, metadata=metadata, timeout=TIMEOUT)
                assert reply.replica_address == holder
                return reply.usage.cached_tokens

            assert await cached_for("sk-a") == 0
            assert await cached_for("sk-b") == 0  # the same prompt, on the same replica, another account
            assert await cached_for("sk-a") >= 16
            assert await cached_for("sk-a2") >= 16  # same group
            assert await cached_for("sk-c") == 0
            assert await cached_for("sk-a", salt="private") == 0  # a caller's own salt
            assert await cached_for("sk-a", salt="private") >= 16
            # An unusable salt is the caller's error, not the server's.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await cached_for("sk-a", salt="x" * 257)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "cache_salt" in (refused.value.details() or "")
    finally:
        router.stop()


async def test_without_isolation_accounts_share_cached_prefixes(stack) -> None:
    router = stack.start_router(
        "router-shared",
        CACHET_ROUTER_API_KEYS=json.dumps(TENANT_KEYS),
        CACHET_ROUTER_CACHE_ISOLATION="false",
        # One replica, as above: only the cache's sharing decides a hit.
        CACHET_ROUTER_ENGINE_ADDRESSES=json.dumps([holder := min(stack.engine_addresses)]),
    )
    session = uuid.uuid4().hex
    request = chat("Name three rivers of Europe.", max_tokens=1)
    try:
        async with create_channel(router.address) as channel:
            keyed = router_pb2_grpc.InferenceServiceStub(channel)
            replies = [
                await keyed.CreateChatCompletion(
                    request,
                    metadata=(("authorization", f"Bearer {key}"), ("x-session-affinity", session)),
                    timeout=TIMEOUT,
                )
                for key in ("sk-a", "sk-b")
            ]
        assert [r.replica_address for r in replies] == [holder, holder]
        assert replies[0].usage.cached_tokens == 0
        assert replies[1].usage.cached_tokens >= 16
    finally:
        router.stop()


async def test_api_keys_map_to_accounts(stack, usage) -> None:
    router = stack.start_router("router-keys", CACHET_ROUTER_API_KEYS=json.dumps({"sk-test": "acct-test"}))
    try:
        async with create_channel(router.address) as channel:
            keyed = router_pb2_grpc.InferenceServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await keyed.CreateChatCompletion(chat(max_tokens=1), timeout=TIMEOUT)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            session = uuid.uuid4().hex
            await keyed.CreateChatCompletion(
                chat(max_tokens=1),
                metadata=(("authorization", "Bearer sk-test"), ("x-session-affinity", session)),
                timeout=TIMEOUT,
            )

        async def accounts() -> list[str]:
            query = usage_pb2.QueryUsageRequest(session_id=session, group_by=["account"])
            return [row.account_id for row in (await usage.QueryUsage(query, timeout=10)).rows]

        assert await until(accounts, 10, "the usage record") == ["acct-test"]
    finally:
        router.stop()


async def test_client_cancel_aborts_the_engine_request_and_still_records_usage(
    stack, inference, usage
) -> None:
    engines = {p.address: p for name, p in stack.processes.items() if name.startswith("engine")}
    before = {address: scrape(engine.metrics_port) for address, engine in engines.items()}
    session, max_tokens = uuid.uuid4().hex, 1900
    call = inference.StreamChatCompletion(
        chat("Write a very long story.", max_tokens=max_tokens),
        metadata=(("x-session-affinity", session),),
        timeout=TIMEOUT,
    )
    streamed = 0
    async for chunk in call:
        streamed += bool(chunk.content_delta)
        if streamed == 10:
            break
    replica = dict(await call.initial_metadata())["x-cachet-replica"]
    call.cancel()

    async with create_channel(replica) as channel:
        engine = engine_pb2_grpc.EngineServiceStub(channel)

        async def idle() -> bool:
            reports = engine.StreamLoadReports(engine_pb2.StreamLoadReportsRequest(interval_ms=50))
            try:
                async for report in reports:
                    return report.running_requests + report.waiting_requests == 0
            finally:
                reports.cancel()
            return False

        await until(idle, 30, "the engine to drop the cancelled request")
    # The engine's own count says how the request ended, so a fast machine that could have
    # generated the rest in the time an abort takes cannot pass (or fail) this by timing.
    grew = growth(before[replica], scrape(engines[replica].metrics_port))
    assert grew("cachet_engine_requests_finished_total", status="finished_aborted") == 1
    assert grew("cachet_engine_requests_finished_total", status="finished_length") == 0
    generated = sum(
        grew("cachet_engine_generated_tokens_total", priority=p) for p in ("interactive", "batch")
    )
    assert 10 <= generated < max_tokens

    async def recorded() -> list[usage_pb2.UsageRow]:
        query = usage_pb2.QueryUsageRequest(session_id=session, group_by=["session"])
        return list((await usage.QueryUsage(query, timeout=10)).rows)

    [row] = await until(recorded, 10, "the usage of the cancelled request")
    assert row.requests == 1
    assert 10 <= row.completion_tokens < max_tokens
    assert row.prompt_tokens > 0


async def test_text_completions_stream_and_aggregate(inference) -> None:
    request = text_completion(6)
    chunks = [chunk async for chunk in inference.StreamCompletion(request, timeout=TIMEOUT)]
    assert chunks[0].id.startswith("cmpl-") and not chunks[0].role
    assert chunks[-1].usage.completion_tokens == 6
    whole = await inference.CreateCompletion(request, timeout=TIMEOUT)
    assert whole.content == "".join(c.content_delta for c in chunks)
    request.sampling.logprobs = True
    with_logprobs = await inference.CreateCompletion(request, timeout=TIMEOUT)
    assert len(with_logprobs.logprobs) == 6
    assert all(entry.logprob <= 0.0 for entry in with_logprobs.logprobs)


async def test_concurrent_requests_without_sessions_spread_over_replicas(stack, inference) -> None:
    # No shared prefix, so only load decides: the router's own in-flight count must spread them.
    replies = await asyncio.gather(
        *[
            inference.CreateChatCompletion(chat(f"Request {i}?", max_tokens=32), timeout=TIMEOUT)
            for i in range(4)
        ]
    )
    # Not an exact 2/2 split: a request may finish before a slow-to-tokenize sibling is placed.
    assert {reply.replica_address for reply in replies} == set(stack.engine_addresses)


async def test_list_models_names_the_served_model(inference, stack: CachetStack) -> None:
    listed = await inference.ListModels(router_pb2.ListModelsRequest(), timeout=TIMEOUT)
    assert [(m.id, m.owned_by) for m in listed.models] == [(TINY_MODEL_ID, "cachet")]
    assert listed.models[0].context_window > 0 and listed.models[0].created > 0
    # A model is served, so the router says it is ready on gRPC health too (within its poll).
    async with create_channel(stack.address("router")) as channel:
        probe = health_pb2_grpc.HealthStub(channel)
        for _ in range(40):
            ready = await probe.Check(health_pb2.HealthCheckRequest(service=READINESS_SERVICE), timeout=10)
            if ready.status == health_pb2.HealthCheckResponse.SERVING:
                break
            await asyncio.sleep(0.05)
    assert ready.status == health_pb2.HealthCheckResponse.SERVING


async def test_prompt_longer_than_the_window_is_invalid(inference) -> None:
    request = router_pb2.CompletionRequest(
        model=TINY_MODEL_ID,
        prompt_token_ids=[1000] * 4096,
        sampling=common_pb2.SamplingParams(max_tokens=1),
    )
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await inference.CreateCompletion(request, timeout=TIMEOUT)
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_cache_index_down_still_serves_by_load(stack) -> None:
    router = stack.start_router("router-no-cache", CACHET_ROUTER_CACHE_ADDRESS=f"127.0.0.1:{free_port()}")
    try:
        async with create_channel(router.address) as channel:
            reply = await router_pb2_grpc.InferenceServiceStub(channel).CreateChatCompletion(
                chat(max_tokens=2), timeout=TIMEOUT
            )
        assert reply.usage.completion_tokens == 2
    finally:
        router.stop()


async def test_metrics_count_requests_first_tokens_and_cached_tokens(stack, inference) -> None:
    port = stack.processes["router"].metrics_port
    before = scrape(port)
    request = chat("Say something about metrics, at some length, to fill two blocks.", max_tokens=2)
    session = (("x-session-affinity", uuid.uuid4().hex),)
    await inference.CreateChatCompletion(request, metadata=session, timeout=TIMEOUT)
    second = await inference.CreateChatCompletion(request, metadata=session, timeout=TIMEOUT)
    # The loop-lag monitor ticks every 50 ms whatever the traffic; two short requests can
    # finish inside one tick (it failed so), so leave it a few.
    await asyncio.sleep(0.25)
    after = scrape(port)
    grew = growth(before, after)

    assert grew("cachet_router_requests_total", outcome="ok") == 2
    assert grew("cachet_router_time_to_first_token_seconds_count") == 2
    assert grew("cachet_router_cached_tokens_total") == second.usage.cached_tokens > 0
    # Sampled all along, requests or not: a loop that stopped being watched would read 0 here.
    assert grew("cachet_router_event_loop_lag_seconds_count") > 0
