"""The ranges of sampling values and the context-window rule, written once for every service.

The router is the boundary that checks a request and names what is wrong (INVALID_ARGUMENT
with the field as ``param``; the bridge turns that into the API's 400). The engine runs the
same checks on what reaches it directly over gRPC, because its sampler would not refuse a value
out of range, only sample nonsense with it (temperature -1 draws the least likely tokens, a NaN
temperature token 0); the bridge takes its REST bodies' bounds from
``SAMPLING_RANGES``, so a body's 400 and the router's agree.

The ranges are what the engine can sample with (temperature 0 is greedy, top_p in (0, 1], a
repetition penalty above 0), narrowed to OpenAI's where those are narrower (temperature at most
2, penalties in [-2, 2], 20 top logprobs). An API whose own range is narrower still (Anthropic's
temperature in [0, 1]) keeps that in its schema.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType

from cachet.common.v1 import common_pb2
from cachet.errors import InvalidArgument

# Most stop strings a request may carry: the engine matches each against every new token's text.
MAX_STOP_STRINGS = 16
# Most choices (n) one request may ask for: each holds a seat of the one replica that serves them all.
MAX_CHOICES = 16


@dataclass(frozen=True)
class Range:
    """An interval of finite numbers: ``low`` excluded when ``low_open``; no upper end when
    ``high`` is None."""

    low: int
    high: int | None = None
    low_open: bool = False

    def __contains__(self, value: float) -> bool:
        if not math.isfinite(value):  # NaN compares false both ways; inf breaks softmax
            return False
        above = value > self.low if self.low_open else value >= self.low
        return above and (self.high is None or value <= self.high)

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low}"
        return f"in {'(' if self.low_open else '['}{self.low}, {self.high}]"

    # The same range as pydantic Field bounds: Field(gt=r.gt, ge=r.ge, le=r.le).
    @property
    def gt(self) -> int | None:
        return self.low if self.low_open else None

    @property
    def ge(self) -> int | None:
        return None if self.low_open else self.low

    @property
    def le(self) -> int | None:
        return self.high


SAMPLING_RANGES = MappingProxyType(
    {
        "temperature": Range(0, 2),
        "top_p": Range(0, 1, low_open=True),
        "top_k": Range(0),
        "min_p": Range(0, 1),
        "repetition_penalty": Range(0, low_open=True),
        "presence_penalty": Range(-2, 2),
        "frequency_penalty": Range(-2, 2),
        "top_logprobs": Range(0, 20),
        "max_tokens": Range(1),
    }
)


def check_value(name: str, value: float) -> None:
    """InvalidArgument naming ``name`` unless ``value`` is in its range."""
    allowed = SAMPLING_RANGES[name]
    if value not in allowed:
        raise InvalidArgument(f"{name} must be {allowed}", param=name)


def check_stop(stop: Sequence[str]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
    if not all(stop):
        raise InvalidArgument("stop strings must not be empty", param="stop")


def check_sampling(sampling: common_pb2.SamplingParams) -> None:
    """A request's sampling values as sent. Only the fields it sets: an unset optional one is the
    model's default, and a plain field's zero (top_k, min_p, the penalties...) is in range."""
    for field, value in sampling.ListFields():
        if field.name in SAMPLING_RANGES:
            check_value(field.name, value)
    check_stop(sampling.stop)


def check_context_window(
    prompt_tokens: int,
    max_tokens: int | None,
    window: int,
    *,
    model: str,
    prompt_param: str = "prompt_token_ids",
) -> None:
    """The prompt must leave room for at least one token, and the prompt plus ``max_tokens``
    (None: up to the window) must fit the window."""
    if prompt_tokens >= window:
        raise InvalidArgument(
            f"the prompt is {prompt_tokens} tokens; {model}'s context window is {window}",
            param=prompt_param,
        )
    if max_tokens is not None and prompt_tokens + max_tokens > window:
        raise InvalidArgument(
            f"prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds "
            f"{model}'s context window of {window}",
            param="max_tokens",
        )
