"""How the engine's gRPC side groups a request's outputs into messages."""

from __future__ import annotations

import asyncio

import pytest

from cachet.engine.async_engine import OutputSink
from cachet.engine.request import RequestStatus
from cachet.engine.request_output import RequestOutput
from cachet.engine.step_plan import SampledToken


def _output(token: int, status: RequestStatus = RequestStatus.RUNNING) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        new_token_ids=[token],
        logprobs=[SampledToken(token, -float(token))],
        status=status,
        matched_stop="",
        num_prompt_tokens=7,
        num_cached_tokens=0,
        num_completion_tokens=token,
    )


async def test_a_consumer_behind_gets_what_waits_in_one_output() -> None:
    sink = OutputSink(interactive=True, first_and_final=False)
    sink.put(_output(1))
    assert (await sink.get()).new_token_ids == [1]
    for token in (2, 3, 4):
        sink.put(_output(token))
    behind = await sink.get()
    assert behind.new_token_ids == [2, 3, 4] and [s.token_id for s in behind.logprobs] == [2, 3, 4]
    assert behind.num_completion_tokens == 4 and not behind.finished


async def test_steps_waiting_with_the_final_output_merge_into_it() -> None:
    sink = OutputSink(interactive=True, first_and_final=False)
    sink.put(_output(1))
    sink.put(_output(2, RequestStatus.FINISHED_LENGTH))
    last = await sink.get()
    assert last.new_token_ids == [1, 2] and last.finished


async def test_first_and_final_holds_the_middle_steps() -> None:
    sink = OutputSink(interactive=False, first_and_final=True)
    sink.put(_output(1))
    assert (await sink.get()).new_token_ids == [1]
    for token in (2, 3):
        sink.put(_output(token))
    sink.put(_output(4, RequestStatus.FINISHED_STOPPED))
    last = await sink.get()
    assert last.new_token_ids == [2, 3, 4] and last.status is RequestStatus.FINISHED_STOPPED
    assert last.num_completion_tokens == 4


async def test_a_stream_interval_sends_the_first_token_at_once_then_groups_steps() -> None:
    sink = OutputSink(interactive=True, first_and_final=False, stream_interval=0.2)
    sink.put(_output(1))
    assert (await sink.get()).new_token_ids == [1]
    for token in (2, 3):
        sink.put(_output(token))
    with pytest.raises(TimeoutError):  # well within 0.2 s of the first message: held
        await asyncio.wait_for(sink.get(), 0.05)
    await asyncio.sleep(0.2)
    sink.put(_output(4))
    assert (await sink.get()).new_token_ids == [2, 3, 4]
    sink.put(_output(5))
    sink.put(_output(6, RequestStatus.FINISHED_LENGTH))  # the final output never waits
    last = await sink.get()
    assert last.new_token_ids == [5, 6] and last.finished and [s.token_id for s in last.logprobs] == [5, 6]
