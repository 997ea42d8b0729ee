"""n choices over the router's own gRPC API (issue 28): sync, streamed and queued, each billed once.

Real processes (tests/service_processes.py): tokenizer, usage, cache index, two tiny-model
engines and the router. The REST side is in tests/bridge/test_request_controls_end_to_end.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import pytest
from metrics_scrape import growth, scrape
from service_processes import TINY_MODEL_ID, CachetStack

from cachet.common.v1 import common_pb2
from cachet.grpc_channel import create_channel
from cachet.router.v1 import router_pb2, router_pb2_grpc
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


def chat(n: int, max_tokens: int = 4, nonce: str = "", **sampling) -> router_pb2.ChatCompletionRequest:
    nonce = nonce or uuid.uuid4().hex
    text = f"[{nonce}] Be brief, and answer in a few words only, as a terse assistant would."
    messages = [
        common_pb2.ChatMessage(role="system", content=[common_pb2.ContentPart(text=text)]),
        common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text="Name a colour.")]),
    ]
    params = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    return router_pb2.ChatCompletionRequest(model=TINY_MODEL_ID, messages=messages, sampling=params, n=n)


async def ledger_rows(usage, session: str, requests: int) -> list[usage_pb2.UsageRow]:
    query = usage_pb2.QueryUsageRequest(session_id=session, group_by=["session"])
    deadline = time.monotonic() + 15
    while True:
        rows = list((await usage.QueryUsage(query, timeout=10)).rows)
        if sum(row.requests for row in rows) >= requests or time.monotonic() > deadline:
            return rows
        await asyncio.sleep(0.1)


async def test_choices_of_a_sync_call_are_billed_as_one_request(inference, usage) -> None:
    session = f"choices-{uuid.uuid4().hex}"
    request = chat(3, temperature=1.0, seed=11)
    request.session_id = session
    answer = await inference.CreateChatCompletion(request, timeout=TIMEOUT)
    alone = router_pb2.ChatCompletionRequest()
    alone.CopyFrom(request)
    alone.n, alone.session_id = 1, ""
    single = await inference.CreateChatCompletion(alone, timeout=TIMEOUT)
    assert [choice.index for choice in answer.choices] == [0, 1, 2]
    assert answer.content == answer.choices[0].content
    assert all(choice.finish_reason == common_pb2.FINISH_REASON_LENGTH for choice in answer.choices)
    assert answer.usage.prompt_tokens == single.usage.prompt_tokens  # counted once, not three times
    assert answer.usage.completion_tokens == 12
    [row] = await ledger_rows(usage, session, 1)
    assert (row.requests, row.prompt_tokens, row.completion_tokens) == (1, answer.usage.prompt_tokens, 12)
    await asyncio.sleep(0.5)  # no second record arrives later (one per choice would be three)
    assert [row.requests for row in await ledger_rows(usage, session, 1)] == [1]


async def test_choices_compute_the_prompt_once_and_answer_as_each_alone(
    inference, stack: CachetStack
) -> None:
    """The other choices copy choice 0's last, partial prompt block on its replica and compute
    only their last prompt token; each choice is what its seed gives alone."""
    engines = [process for name, process in stack.processes.items() if name.startswith("engine")]
    before = [scrape(engine.metrics_port) for engine in engines]
    # A prompt of its own, of a length whose last block is partial (a random nonce could make it
    # end a block: then no choice has anything to copy).
    # Choice 0 must still run when the others arrive (the block is copied from a running
    # request): 4 tokens a choice were all decoded before the router's next requests landed.
    request = chat(3, max_tokens=64, temperature=1.0, seed=31, nonce="copy-on-write")
    answer = await inference.CreateChatCompletion(request, timeout=TIMEOUT)
    prompt_tokens = answer.usage.prompt_tokens
    assert (prompt_tokens - 1) % 16, f"{prompt_tokens} tokens: the last one starts a block"

    def grew(name: str, **labels: str) -> float:
        return sum(
            growth(was, scrape(engine.metrics_port))(name, **labels)
            for was, engine in zip(before, engines, strict=True)
        )

    deadline = time.monotonic() + 15  # the engines' figures come with their next step report
    while grew("cachet_engine_generated_tokens_total", priority="interactive") < 3 * 64:
        assert time.monotonic() < deadline, "the engines never counted the 192 tokens"
        await asyncio.sleep(0.1)
    assert (
        grew("cachet_engine_computed_tokens_total", priority="interactive", phase="prefill")
        == prompt_tokens + 2
    )
    assert grew("cachet_engine_kv_block_copies_total", direction="duplicate") == 2
    alone = router_pb2.ChatCompletionRequest()
    alone.CopyFrom(request)
    alone.n = 1
    for index, choice in enumerate(answer.choices):
        alone.sampling.seed = 31 + index  # the router's seed for choice `index`
        assert (await inference.CreateChatCompletion(alone, timeout=TIMEOUT)).content == choice.content


async def test_streamed_choices_interleave_by_index_with_one_usage(inference) -> None:
    chunks = [chunk async for chunk in inference.StreamChatCompletion(chat(2, max_tokens=5), timeout=TIMEOUT)]
    for index in (0, 1):
        mine = [chunk for chunk in chunks if chunk.index == index]
        assert mine[0].role == "assistant"
        assert [c.finish_reason for c in mine if c.finish_reason] == [common_pb2.FINISH_REASON_LENGTH]
    assert [chunk.HasField("usage") for chunk in chunks].count(True) == 1
    assert chunks[-1].usage.completion_tokens == 10


async def test_each_choice_ends_at_the_stop_string_its_engine_request_matched(inference) -> None:
    # Seeded choices sample the same tokens again (each from its own seed), so the stopped
    # answers are the unstopped ones cut where the stop string first appears, or whole.
    request = chat(2, max_tokens=16, temperature=1.0, seed=23)
    request.session_id = f"choices-stop-{uuid.uuid4().hex}"
    texts = [
        choice.content for choice in (await inference.CreateChatCompletion(request, timeout=TIMEOUT)).choices
    ]
    assert len(texts[1]) >= 4, texts
    stop = texts[1][len(texts[1]) // 2 : len(texts[1]) // 2 + 2]  # in choice 1's answer, maybe not in 0's
    request.sampling.stop.append(stop)
    expected = [
        (text[: text.find(stop)], common_pb2.FINISH_REASON_STOP)
        if stop in text
        else (text, common_pb2.FINISH_REASON_LENGTH)
        for text in texts
    ]
    answer = await inference.CreateChatCompletion(request, timeout=TIMEOUT)
    assert [(choice.content, choice.finish_reason) for choice in answer.choices] == expected
    chunks = [chunk async for chunk in inference.StreamChatCompletion(request, timeout=TIMEOUT)]
    streamed = [
        (
            "".join(chunk.content_delta for chunk in chunks if chunk.index == index),
            next(chunk.finish_reason for chunk in chunks if chunk.index == index and chunk.finish_reason),
        )
        for index in (0, 1)
    ]
    assert streamed == expected


async def test_a_queued_job_with_choices_stores_them_all_and_is_billed_once(inference, usage) -> None:
    session = f"queued-choices-{uuid.uuid4().hex}"
    request = chat(2, max_tokens=3)
    request.session_id = session
    batch = router_pb2.QueueRequestsRequest(
        model=TINY_MODEL_ID, requests=[router_pb2.QueuedRequest(chat=request)]
    )
    queued = await inference.QueueRequests(batch, timeout=10)
    deadline = time.monotonic() + 90
    while True:
        polled = await inference.GetQueuedBatch(
            router_pb2.GetQueuedBatchRequest(request_id=queued.request_id), timeout=10
        )
        if polled.status == router_pb2.BATCH_STATUS_DONE or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    [result] = polled.results
    assert result.WhichOneof("outcome") == "completion", result
    assert [choice.index for choice in result.completion.choices] == [0, 1]
    assert result.completion.usage.completion_tokens == 6
    [row] = await ledger_rows(usage, session, 1)
    assert (row.requests, row.completion_tokens) == (1, 6)


async def test_more_than_sixteen_choices_are_refused_naming_n(inference) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await inference.CreateChatCompletion(chat(17), timeout=TIMEOUT)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "n must be at most 16" in refused.value.details()
