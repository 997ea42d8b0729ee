"""Sampling parameters as the engine uses them: validated, defaults filled in.

The ranges are ``cachet.sampling_ranges``'s, the same the router validates a request with: a
request through the router is never refused here, and a direct gRPC client's value out of range
is INVALID_ARGUMENT naming the field, where the sampler would take it and sample nonsense.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cachet.common.v1 import common_pb2
from cachet.sampling_ranges import SAMPLING_RANGES, check_stop, check_value


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

    @property
    def reproducible(self) -> bool:
        """Greedy or seeded: the same request must give the same tokens, so it runs in
        batch-invariant steps (``ModelRunner``) and names its KV blocks apart."""
        return self.greedy or self.seed is not None

    def __post_init__(self) -> None:
        """Validated when built, so no SamplingParams out of range exists (the step plan's
        broadcast unpickles without calling this: those were checked on rank 0)."""
        for name in SAMPLING_RANGES:
            value = getattr(self, name)
            if value is not None:
                check_value(name, value)
        check_stop(self.stop)

    @classmethod
    def from_proto(
        cls, proto: common_pb2.SamplingParams, defaults: Mapping[str, float] | None = None
    ) -> SamplingParams:
        """``defaults``: the model's own values for what a request leaves unset
        (``model_sampling_defaults``), as vLLM applies a model's generation_config.json."""
        defaults = defaults or {}
        return cls(
            temperature=proto.temperature
            if proto.HasField("temperature")
            else defaults.get("temperature", 1.0),
            top_p=proto.top_p if proto.HasField("top_p") else defaults.get("top_p", 1.0),
            # Plain fields: 0 is unset (off) on the wire.
            top_k=proto.top_k or int(defaults.get("top_k", 0)),
            min_p=proto.min_p or defaults.get("min_p", 0.0),
            seed=proto.seed if proto.HasField("seed") else None,
            max_tokens=proto.max_tokens if proto.HasField("max_tokens") else None,
            repetition_penalty=proto.repetition_penalty
            if proto.HasField("repetition_penalty")
            else defaults.get("repetition_penalty", 1.0),
            presence_penalty=proto.presence_penalty,
            frequency_penalty=proto.frequency_penalty,
            stop=tuple(proto.stop),
            stop_token_ids=tuple(proto.stop_token_ids),
            ignore_eos=proto.ignore_eos,
            logprobs=proto.logprobs or proto.top_logprobs > 0,
            top_logprobs=proto.top_logprobs,
        )


# generation_config.json keys that set a sampling default (vLLM reads the same ones).
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_sampling_defaults(model_dir: Path) -> dict[str, float]:
    """The sampling values a model's generation_config.json recommends; {} when it names none.

    Only where it asks to sample (``do_sample`` not false): a config that says greedy
    carries transformers' own defaults, not a recommendation."""
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return {}
    config = json.loads(path.read_text())
    if config.get("do_sample") is False:
        return {}
    return {key: float(config[key]) for key in SAMPLING_DEFAULT_KEYS if config.get(key) is not None}
