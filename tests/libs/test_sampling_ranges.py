"""cachet.sampling_ranges: the one definition of sampling ranges and the context-window rule,
and the proof that the router, the engine and the bridge all take theirs from it."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from cachet.bridge.schemas import ChatCompletionBody
from cachet.common.v1 import common_pb2
from cachet.engine.sampling_params import SamplingParams
from cachet.errors import InvalidArgument
from cachet.router.prompt import validate_chat
from cachet.router.v1 import router_pb2
from cachet.sampling_ranges import (
    MAX_STOP_STRINGS,
    SAMPLING_RANGES,
    Range,
    check_context_window,
    check_sampling,
)

# For every range: values just inside and just outside it.
EDGES = {
    "temperature": ([0.0, 2.0], [-0.01, 2.01]),
    "top_p": ([1e-6, 1.0], [0.0, 1.01]),
    "top_k": ([0, 50], [-1]),
    "min_p": ([0.0, 1.0], [-0.01, 1.01]),
    "repetition_penalty": ([1e-6, 5.0], [0.0, -1.0]),
    "presence_penalty": ([-2.0, 2.0], [-2.01, 2.01]),
    "frequency_penalty": ([-2.0, 2.0], [-2.01, 2.01]),
    "top_logprobs": ([0, 20], [21]),
    "max_tokens": ([1, 10**6], [0]),
}
# Values a proto field cannot hold (uint32), so only the engine's dataclass can carry them.
UNSIGNED_ON_THE_WIRE = {"top_k", "top_logprobs", "max_tokens"}
MESSAGES = {
    "temperature": "temperature must be in [0, 2]",
    "top_p": "top_p must be in (0, 1]",
    "top_k": "top_k must be >= 0",
    "repetition_penalty": "repetition_penalty must be > 0",
    "max_tokens": "max_tokens must be >= 1",
}


def test_every_range_has_its_edges_here() -> None:
    assert set(EDGES) == set(SAMPLING_RANGES)


@pytest.mark.parametrize("name", sorted(EDGES))
def test_a_value_inside_passes_everywhere_and_one_outside_is_refused_naming_it(name: str) -> None:
    inside, outside = EDGES[name]
    for value in inside:
        check_sampling(common_pb2.SamplingParams(**{name: value}))
        SamplingParams(**{name: value})  # type: ignore[arg-type]
    for value in outside:
        refusals = []
        with pytest.raises(InvalidArgument) as engine:
            SamplingParams(**{name: value})  # type: ignore[arg-type]
        refusals.append(engine.value)
        if not (name in UNSIGNED_ON_THE_WIRE and value < 0):
            with pytest.raises(InvalidArgument) as router:
                check_sampling(common_pb2.SamplingParams(**{name: value}))
            refusals.append(router.value)
        for refusal in refusals:
            assert refusal.param == name
            assert refusal.message == MESSAGES.get(name, refusal.message)
            assert refusal.message.startswith(f"{name} must be ")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty"])
def test_nan_and_infinity_are_out_of_every_range(name: str, value: float) -> None:
    with pytest.raises(InvalidArgument, match=name):
        check_sampling(common_pb2.SamplingParams(**{name: value}))
    with pytest.raises(InvalidArgument, match=name):
        SamplingParams(**{name: value})  # type: ignore[arg-type]


def test_unset_optional_fields_mean_the_default_and_are_not_checked() -> None:
    # On the wire an unset top_p reads 0, which is out of its range.
    check_sampling(common_pb2.SamplingParams())
    assert SamplingParams.from_proto(common_pb2.SamplingParams()).top_p == 1.0


def test_a_plain_fields_zero_unset_on_the_wire_is_in_its_range() -> None:
    # check_sampling skips what the wire leaves unset, so such a zero must be valid.
    fields = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    plain = [name for name in SAMPLING_RANGES if not fields[name].has_presence]
    assert plain == ["top_k", "min_p", "presence_penalty", "frequency_penalty", "top_logprobs"]
    assert all(0 in SAMPLING_RANGES[name] for name in plain)


def test_stop_strings() -> None:
    check_sampling(common_pb2.SamplingParams(stop=["x"] * MAX_STOP_STRINGS))
    for stop, message in ([["x"] * (MAX_STOP_STRINGS + 1), "at most 16"], [["x", ""], "must not be empty"]):
        with pytest.raises(InvalidArgument, match=message) as router:
            check_sampling(common_pb2.SamplingParams(stop=stop))
        with pytest.raises(InvalidArgument, match=message) as engine:
            SamplingParams(stop=tuple(stop))
        assert router.value.param == engine.value.param == "stop"


def test_the_router_validates_with_it() -> None:
    request = router_pb2.ChatCompletionRequest(
        model="m",
        messages=[common_pb2.ChatMessage(role="user")],
        sampling=common_pb2.SamplingParams(min_p=1.5),
    )
    with pytest.raises(InvalidArgument, match=r"min_p must be in \[0, 1\]") as refused:
        validate_chat(request)
    assert refused.value.param == "min_p"


def test_the_engine_applies_a_models_defaults_then_the_same_ranges() -> None:
    with pytest.raises(InvalidArgument, match="temperature"):
        SamplingParams.from_proto(common_pb2.SamplingParams(temperature=-1))
    assert SamplingParams.from_proto(common_pb2.SamplingParams(), {"temperature": 0.6}).temperature == 0.6


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "repetition_penalty", "top_logprobs"])
def test_the_bridge_bounds_its_bodies_by_the_same_ranges(name: str) -> None:
    inside, outside = EDGES[name]
    extra = {"logprobs": True} if name == "top_logprobs" else {}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    for value in inside:
        ChatCompletionBody.model_validate(body | {name: value})
    for value in outside:
        with pytest.raises(ValidationError):
            ChatCompletionBody.model_validate(body | {name: value})


def test_range_reads_as_its_message_and_as_pydantic_bounds() -> None:
    assert str(Range(0, 2)) == "in [0, 2]" and (Range(0, 2).ge, Range(0, 2).le) == (0, 2)
    assert str(Range(0, 1, low_open=True)) == "in (0, 1]" and Range(0, 1, low_open=True).gt == 0
    assert str(Range(1)) == ">= 1" and Range(1).le is None


def test_context_window() -> None:
    check_context_window(60, 40, 100, model="tiny")
    check_context_window(99, None, 100, model="tiny")
    with pytest.raises(
        InvalidArgument, match="the prompt is 100 tokens; tiny's context window is 100"
    ) as full:
        check_context_window(100, None, 100, model="tiny", prompt_param="messages")
    assert full.value.param == "messages"
    with pytest.raises(InvalidArgument, match="exceeds tiny's context window of 100") as past:
        check_context_window(60, 41, 100, model="tiny")
    assert past.value.param == "max_tokens"
