"""A request's cache retention as the engine's KvRetention spans: the API's names as seconds,
breakpoints as prompt tokens, the operator's default for sessions; bad values refused naming
the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cachet.common.v1 import common_pb2
from cachet.engine.v1 import engine_pb2
from cachet.errors import InvalidArgument
from cachet.router.cache_retention import SETTING_VALUES, engine_retention
from cachet.router.prompt import validate_chat, validate_completion
from cachet.router.settings import RouterSettings
from cachet.router.v1 import router_pb2

IN_MEMORY = router_pb2.CACHE_RETENTION_IN_MEMORY
DAY = router_pb2.CACHE_RETENTION_24H
FIVE_MINUTES = router_pb2.CACHE_RETENTION_5M
HOUR = router_pb2.CACHE_RETENTION_1H
NONE = router_pb2.CACHE_RETENTION_NONE


def span(seconds: int, num_tokens: int = 0) -> engine_pb2.KvRetention:
    return engine_pb2.KvRetention(seconds=seconds, num_tokens=num_tokens)


@pytest.mark.parametrize(
    ("retention", "seconds"), [(IN_MEMORY, 600), (DAY, 86400), (FIVE_MINUTES, 300), (HOUR, 3600)]
)
def test_a_whole_prompt_retention_covers_every_token_for_its_length(retention, seconds) -> None:
    assert engine_retention(retention) == (span(seconds),)


def test_breakpoints_cover_the_tokens_up_to_them_and_one_that_covers_none_retains_nothing() -> None:
    spans = engine_retention(
        router_pb2.CACHE_RETENTION_UNSPECIFIED, [(0, HOUR), (96, HOUR), (250, FIVE_MINUTES)]
    )
    assert spans == (span(3600, 96), span(300, 250))


def test_the_session_default_applies_only_to_a_session_that_asks_nothing() -> None:
    unspecified = router_pb2.CACHE_RETENTION_UNSPECIFIED
    assert engine_retention(unspecified, session_default=IN_MEMORY, has_session=True) == (span(600),)
    assert engine_retention(unspecified, session_default=IN_MEMORY, has_session=False) == ()
    assert engine_retention(DAY, session_default=IN_MEMORY, has_session=True) == (span(86400),)
    # Breakpoints say what to keep: the default does not add the rest of the prompt.
    assert engine_retention(unspecified, [(64, HOUR)], session_default=DAY, has_session=True) == (
        span(3600, 64),
    )
    assert engine_retention(unspecified, session_default=SETTING_VALUES["none"], has_session=True) == ()


def test_none_opts_a_session_out_of_the_default() -> None:
    assert engine_retention(NONE, session_default=IN_MEMORY, has_session=True) == ()
    assert engine_retention(NONE, session_default=DAY, has_session=False) == ()
    validate_chat(chat(cache_retention=NONE))
    validate_completion(router_pb2.CompletionRequest(model="m", prompt="x", cache_retention=NONE))


def test_the_operator_default_is_a_setting_spelled_as_the_apis_spell_it(monkeypatch) -> None:
    assert RouterSettings().session_cache_retention == "in_memory"
    monkeypatch.setenv("CACHET_ROUTER_SESSION_CACHE_RETENTION", "24h")
    assert SETTING_VALUES[RouterSettings().session_cache_retention] == DAY
    monkeypatch.setenv("CACHET_ROUTER_SESSION_CACHE_RETENTION", "forever")
    with pytest.raises(ValidationError, match="session_cache_retention"):
        RouterSettings()


def chat(**fields: object) -> router_pb2.ChatCompletionRequest:
    request = router_pb2.ChatCompletionRequest(
        model="m",
        messages=[
            common_pb2.ChatMessage(role="system", content=[common_pb2.ContentPart(text="Be terse.")]),
            common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text="Hi")]),
        ],
    )
    for name, value in fields.items():
        if name == "cache_breakpoints":
            request.cache_breakpoints.extend(value)  # type: ignore[arg-type]
        else:
            setattr(request, name, value)
    return request


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"cache_retention": 99}, "cache_retention"),
        (
            {"cache_breakpoints": [router_pb2.CacheBreakpoint(messages=3, retention=HOUR)]},
            "cache_breakpoints[0].messages",
        ),
        ({"cache_breakpoints": [router_pb2.CacheBreakpoint(messages=1)]}, "cache_breakpoints[0].retention"),
        (
            {"cache_breakpoints": [router_pb2.CacheBreakpoint(messages=1, retention=NONE)]},
            "cache_breakpoints[0].retention",
        ),
        (
            {"cache_breakpoints": [router_pb2.CacheBreakpoint(messages=1, retention=HOUR)] * 5},
            "cache_breakpoints",
        ),
        (
            {"cache_breakpoints": [router_pb2.CacheBreakpoint(messages=2, retention=77)]},
            "cache_breakpoints[0].retention",
        ),
    ],
)
def test_bad_retention_is_invalid_naming_the_field(fields: dict, param: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        validate_chat(chat(**fields))
    assert refused.value.param == param


def test_good_retention_passes_and_completions_are_checked_too() -> None:
    validate_chat(
        chat(cache_retention=DAY, cache_breakpoints=[router_pb2.CacheBreakpoint(messages=2, retention=HOUR)])
    )
    with pytest.raises(InvalidArgument) as refused:
        validate_completion(router_pb2.CompletionRequest(model="m", prompt="x", cache_retention=42))
    assert refused.value.param == "cache_retention"
