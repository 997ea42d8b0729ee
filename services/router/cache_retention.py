"""Cache retention: what a request asks for (OpenAI's ``prompt_cache_retention``, Anthropic's
``cache_control`` breakpoints) or, when it asks nothing and has a session id, the operator's
default (``CACHET_ROUTER_SESSION_CACHE_RETENTION``), as the engine's ``KvRetention`` spans.

The API's values are names; the engine takes seconds and token counts, so this table is the one
place where a name becomes a length:

=================  ==================================  =========
value              from                                seconds
=================  ==================================  =========
``in_memory``      OpenAI's ``prompt_cache_retention``   600
``24h``            OpenAI's ``prompt_cache_retention``  86400
``5m``             Anthropic's ``cache_control.ttl``     300
``1h``             Anthropic's ``cache_control.ttl``    3600
=================  ==================================  =========

A whole-prompt retention covers every token of the request, its answer too (an agent's next turn
starts with it). A breakpoint covers the tokens the tools and the messages before it render to
(the tokenizer's ``prefix_token_counts``). Any retention the request gives replaces the
session default; none is refused for lack of room (``kv_retention`` in the engine).

``CACHE_RETENTION_NONE`` (``prompt_cache_retention: "none"``, Cachet's own value: OpenAI has
no opt-out) asks for no retention at all: a request with a session id so opts out of the
operator's default, its blocks left to plain LRU.
"""

from __future__ import annotations

from collections.abc import Sequence

from cachet.engine.v1 import engine_pb2
from cachet.errors import InvalidArgument
from cachet.router.v1 import router_pb2

RETENTION_SECONDS: dict[router_pb2.CacheRetention.ValueType, int] = {
    router_pb2.CACHE_RETENTION_IN_MEMORY: 600,
    router_pb2.CACHE_RETENTION_24H: 86400,
    router_pb2.CACHE_RETENTION_5M: 300,
    router_pb2.CACHE_RETENTION_1H: 3600,
}
# The operator's setting, spelled as the APIs spell them ("none": no default).
SETTING_VALUES: dict[str, router_pb2.CacheRetention.ValueType] = {
    "none": router_pb2.CACHE_RETENTION_UNSPECIFIED,
    "in_memory": router_pb2.CACHE_RETENTION_IN_MEMORY,
    "24h": router_pb2.CACHE_RETENTION_24H,
    "5m": router_pb2.CACHE_RETENTION_5M,
    "1h": router_pb2.CACHE_RETENTION_1H,
}
# Anthropic's limit on cache_control blocks in one request.
MAX_BREAKPOINTS = 4


# Whole-prompt values that name no length: nothing asked, or "none" asked.
_NO_LENGTH = (router_pb2.CACHE_RETENTION_UNSPECIFIED, router_pb2.CACHE_RETENTION_NONE)


def validate_retention(
    retention: router_pb2.CacheRetention.ValueType, param: str = "cache_retention"
) -> None:
    if retention not in _NO_LENGTH and retention not in RETENTION_SECONDS:
        raise InvalidArgument(f"{param}: unknown cache retention {retention}", param=param)


def validate_breakpoints(request: router_pb2.ChatCompletionRequest) -> None:
    breakpoints = request.cache_breakpoints
    if len(breakpoints) > MAX_BREAKPOINTS:
        raise InvalidArgument(
            f"cache_breakpoints: at most {MAX_BREAKPOINTS}, got {len(breakpoints)}", param="cache_breakpoints"
        )
    for index, breakpoint in enumerate(breakpoints):
        param = f"cache_breakpoints[{index}]"
        if breakpoint.messages > len(request.messages):
            raise InvalidArgument(
                f"{param}.messages: {breakpoint.messages} is past the {len(request.messages)} messages",
                param=f"{param}.messages",
            )
        if breakpoint.retention in _NO_LENGTH:
            raise InvalidArgument(f"{param}.retention: a length is required", param=f"{param}.retention")
        validate_retention(breakpoint.retention, f"{param}.retention")


def breakpoint_messages(breakpoints: Sequence[router_pb2.CacheBreakpoint]) -> list[int]:
    """The message counts to ask the tokenizer about, once each, in order."""
    return sorted({breakpoint.messages for breakpoint in breakpoints})


def engine_retention(
    retention: router_pb2.CacheRetention.ValueType,
    breakpoints: Sequence[tuple[int, router_pb2.CacheRetention.ValueType]] = (),
    *,
    session_default: router_pb2.CacheRetention.ValueType = router_pb2.CACHE_RETENTION_UNSPECIFIED,
    has_session: bool = False,
) -> tuple[engine_pb2.KvRetention, ...]:
    """The engine's spans for a whole-prompt ``retention`` and ``breakpoints`` given as (prompt
    tokens up to the breakpoint, retention); a breakpoint that covers no token retains nothing,
    and ``CACHE_RETENTION_NONE`` asks for no whole-prompt span, the session default's included."""
    if retention == router_pb2.CACHE_RETENTION_UNSPECIFIED and not breakpoints and has_session:
        retention = session_default
    spans = [
        engine_pb2.KvRetention(seconds=RETENTION_SECONDS[kept], num_tokens=tokens)
        for tokens, kept in breakpoints
        if tokens > 0
    ]
    if retention not in _NO_LENGTH:
        spans.append(engine_pb2.KvRetention(seconds=RETENTION_SECONDS[retention]))
    return tuple(spans)
