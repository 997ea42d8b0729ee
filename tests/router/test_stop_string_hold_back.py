"""Stop strings in the router: text held back while it may become one, cut where the engine says.

The engine is the one matcher (tests/engine/test_stop_strings.py, which also runs the two
together over a real tokenizer); here the router's half, alone and inside a ``Generation``
reading a scripted engine stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Sequence

import grpc
import pytest

from cachet.common.v1 import common_pb2
from cachet.engine.v1 import engine_pb2
from cachet.incremental_detokenizer import IncrementalDetokenizer
from cachet.router.caller import Caller
from cachet.router.placement import Placement
from cachet.router.request_pipeline import Generation, GenerationRequest
from cachet.router.stop_strings import StopStringHoldBack

STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH


def run(stops: list[str], deltas: list[str], last: str = "", matched_stop: str = "") -> tuple[list[str], str]:
    hold_back = StopStringHoldBack(stops)
    return [hold_back.feed(delta) for delta in deltas], hold_back.finish(last, matched_stop)


def test_no_stop_strings_passes_text_through() -> None:
    assert run([], ["Hello", " world"], "!") == (["Hello", " world"], "!")


def test_a_stop_string_split_across_deltas_is_never_shown() -> None:
    assert run(["END"], ["Hello E", "N"], "D and more", "END") == (["Hello ", ""], "")


def test_text_after_the_stop_in_the_same_delta_is_dropped() -> None:
    assert run(["\n\n"], [], "one\n\ntwo", "\n\n") == ([], "one")


def test_a_partial_match_that_fails_is_released() -> None:
    # Held while it may still become "STOP"; released as soon as it cannot, or at the end.
    assert run(["STOP"], ["ST", "ART", "ing ST"]) == (["", "START", "ing "], "ST")


def test_the_cut_is_at_the_stop_string_the_engine_names() -> None:
    # The engine names the one that starts first ("lo w"); the router cuts there.
    assert run(["world", "lo w"], [], "Hello world", "lo w") == ([], "Hel")


def test_the_router_matches_no_stop_string_itself() -> None:
    # The engine did not stop at "END" (it decoded the text apart, say): it is shown.
    assert run(["END"], ["The END"], " of it") == (["The END"], " of it")


def test_a_named_stop_string_the_text_does_not_hold_keeps_the_text() -> None:
    # The engine skipped a special token inside it that the router decoded: nothing to cut.
    assert run(["ab"], ["a<|x|>"], "b", "ab") == (["a<|x|>"], "b")


@pytest.mark.parametrize("cut", range(1, 18))
def test_any_split_gives_the_same_visible_text(cut: int) -> None:
    # Every cut before the stop string's end (the engine stops at the delta that completes it).
    text = "Answer: 42<|stop|> ignored"
    shown, last = run(["<|stop|>"], [text[:cut]], text[cut:], "<|stop|>")
    assert "".join(shown) + last == "Answer: 42"


# ------------------------------------------------- inside a Generation, over a scripted engine

# A toy vocabulary: token i decodes to VOCAB[i].
VOCAB = ["Hel", "lo E", "N", "D and more", "ST", "ART", " ST", "lo END"]


def ids(*pieces: str) -> list[int]:
    return [VOCAB.index(piece) for piece in pieces]


class ScriptedCall:
    """The engine's side of a Generate call: its messages after the first, then the end."""

    def __init__(self, messages: Sequence[engine_pb2.GenerateResponse]) -> None:
        self._messages = list(messages)

    async def read(self) -> engine_pb2.GenerateResponse | object:
        return self._messages.pop(0) if self._messages else grpc.aio.EOF

    def cancel(self) -> bool:
        return False


class Pipeline:
    def in_background(self, work: Coroutine[None, None, None]) -> None:
        work.close()  # reads the stream's end, which a scripted call does not trace

    def record_usage(self, *_: object) -> asyncio.Future[bool]:
        future = asyncio.get_running_loop().create_future()
        future.set_result(True)
        return future


class Replica:
    address = "engine:1"

    def leave(self, priority: int) -> None:
        pass


def message(
    *pieces: str, finish: common_pb2.FinishReason.ValueType = 0, matched_stop: str = ""
) -> engine_pb2.GenerateResponse:
    return engine_pb2.GenerateResponse(
        token_ids=ids(*pieces), finish_reason=finish, matched_stop=matched_stop
    )


async def answer(stops: list[str], messages: list[engine_pb2.GenerateResponse]) -> list[str]:
    """The content of each chunk the router sends for the engine's ``messages``; the last must be STOP."""
    request = GenerationRequest(
        request_id="chatcmpl-1",
        model="m",
        prompt_token_ids=[],
        sampling=common_pb2.SamplingParams(stop=stops),
        response_format=common_pb2.ResponseFormat(),
        caller=Caller("account", "session"),
        role="assistant",
        arrived_at=time.monotonic(),
    )
    generation = Generation(
        Pipeline(),  # type: ignore[arg-type]
        request,
        Replica(),  # type: ignore[arg-type]
        Placement("engine:1", "score"),
        ScriptedCall(messages[1:]),  # type: ignore[arg-type]
        messages[0],
        IncrementalDetokenizer(lambda token_ids: "".join(VOCAB[i] for i in token_ids)),
    )
    chunks = [chunk async for chunk in generation.chunks()]
    assert [chunk.finish_reason for chunk in chunks][-1] == messages[-1].finish_reason
    return [chunk.content_delta for chunk in chunks]


async def test_a_streamed_stop_string_split_across_tokens_is_never_sent() -> None:
    streamed = await answer(
        ["END"],
        [
            message("Hel"),
            message("lo E"),
            message("N"),
            message("D and more", finish=STOP, matched_stop="END"),
        ],
    )
    assert streamed == ["Hel", "lo ", ""]  # "E" and "N" wait: they may begin "END", and do


async def test_an_answer_sent_whole_is_cut_at_the_same_place() -> None:
    # First and final (a caller that does not stream): the first token, then all the rest.
    whole = [message("Hel"), message("lo E", "N", "D and more", finish=STOP, matched_stop="END")]
    assert "".join(await answer(["END"], whole)) == "Hello "


async def test_the_router_cuts_only_where_the_engine_stopped() -> None:
    # The engine named no stop string (max_tokens ended it): the text is the engine's word.
    assert await answer(["END"], [message("Hel"), message("lo END", finish=LENGTH)]) == ["Hel", "lo END"]


async def test_held_back_text_goes_out_once_it_cannot_become_a_stop_string() -> None:
    streamed = await answer(["STOP"], [message("ST"), message("ART"), message(" ST", finish=LENGTH)])
    # The first chunk goes with the first token, its text held; the last releases " ST".
    assert streamed == ["", "START", " ST"]
