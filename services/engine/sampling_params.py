"""Sampling parameters as the engine uses them: validated, defaults filled in."""

from __future__ import annotations

from dataclasses import dataclass, field

from cachet.common.v1 import common_pb2

MAX_TOP_LOGPROBS = 20


class InvalidSamplingParams(ValueError):
    """A parameter is out of range; the message names it."""


@dataclass(frozen=True)
class SamplingParams:
    """Picklable (rank 0 broadcasts it inside the step plan) and immutable."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    extra_stop_token_ids: tuple[int, ...] = field(default=(), repr=False)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        checks = [
            (self.temperature >= 0.0, "temperature must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0.0, "repetition_penalty must be > 0"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be >= 1"),
            (all(s for s in self.stop), "stop strings must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidSamplingParams(message)

    @classmethod
    def from_proto(cls, proto: common_pb2.SamplingParams) -> SamplingParams:
        params = cls(
            temperature=proto.temperature if proto.HasField("temperature") else 1.0,
            top_p=proto.top_p if proto.HasField("top_p") else 1.0,
            top_k=proto.top_k,
            min_p=proto.min_p,
            seed=proto.seed if proto.HasField("seed") else None,
            max_tokens=proto.max_tokens if proto.HasField("max_tokens") else None,
            repetition_penalty=proto.repetition_penalty if proto.HasField("repetition_penalty") else 1.0,
            presence_penalty=proto.presence_penalty,
            frequency_penalty=proto.frequency_penalty,
            stop=tuple(proto.stop),
            stop_token_ids=tuple(proto.stop_token_ids),
            ignore_eos=proto.ignore_eos,
            logprobs=proto.logprobs or proto.top_logprobs > 0,
            top_logprobs=proto.top_logprobs,
        )
        params.validate()
        return params
