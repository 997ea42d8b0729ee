"""What one engine step costs: a fixed part and a part per token, fitted to the steps run.

The scheduler sizes the batch (async queue) work it puts beside interactive work by it. An
interactive arrival waits for the step in flight and then its own, so how long batch work
makes a step is what it costs interactive latency; and how much a step's time grows with its
tokens is a property of the device, not of the scheduler. On a GPU a decode step barely grows
with its batch (the weights' stream is the step), so batch work beside interactive work is
nearly free; on a CPU each token is a matrix-vector product's worth of arithmetic, and 100
batch tokens can make a step several times as long (the default model on a 2-core Zen 3:
~33 ms fixed, ~2.1 ms a token). A budget in tokens fixed in the code would be right on one of
them only.

The fit is a least-squares line of step seconds against scheduled tokens over the recent steps
(exponentially weighted, so it follows a machine whose speed drifts). It is trusted only once
enough steps of different sizes were seen; until then the caller keeps its default.
"""

from __future__ import annotations

from dataclasses import dataclass

# Steps' weight halves over this many later steps: recent enough to follow a drifting machine,
# long enough to hold both kinds of steps a mixed load runs (decodes, prompt chunks).
_HALF_LIFE_STEPS = 256
# A fit needs at least this weight of steps, and sizes spread by at least this many tokens
# (standard deviation): steps all of one size say nothing about the slope.
_MIN_STEPS = 32
_MIN_TOKEN_SPREAD = 4.0


@dataclass(frozen=True)
class StepCost:
    """A step of ``n`` tokens takes about ``fixed_seconds + n * seconds_per_token``."""

    fixed_seconds: float
    seconds_per_token: float

    def tokens_within(self, seconds: float, most: int) -> int:
        """Tokens that add at most ``seconds`` to a step (``most`` if tokens cost nothing)."""
        if self.seconds_per_token <= 0:
            return most
        return max(0, min(most, int(seconds / self.seconds_per_token)))


class StepCostModel:
    """Weighted running sums of (tokens, seconds) over the engine's steps, and their line."""

    def __init__(self, half_life_steps: float = _HALF_LIFE_STEPS) -> None:
        self._decay = 0.5 ** (1.0 / half_life_steps)
        self._weight = self._tokens = self._seconds = self._tokens_sq = self._tokens_seconds = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        """One step that ran ``tokens`` tokens through the model in ``seconds``."""
        decay = self._decay
        self._weight = self._weight * decay + 1.0
        self._tokens = self._tokens * decay + tokens
        self._seconds = self._seconds * decay + seconds
        self._tokens_sq = self._tokens_sq * decay + tokens * tokens
        self._tokens_seconds = self._tokens_seconds * decay + tokens * seconds

    def estimate(self) -> StepCost | None:
        """The fitted cost, or None while too few steps, or too few sizes, were seen.

        A slope at or below zero (steps that do not grow with their tokens, as on a GPU) is
        reported as zero; an intercept at or below zero (noise on steps that are mostly tokens)
        as no estimate, since a step always has a fixed part."""
        if self._weight < _MIN_STEPS:
            return None
        mean_tokens = self._tokens / self._weight
        mean_seconds = self._seconds / self._weight
        variance = self._tokens_sq / self._weight - mean_tokens * mean_tokens
        if variance < _MIN_TOKEN_SPREAD * _MIN_TOKEN_SPREAD:
            return None
        slope = (self._tokens_seconds / self._weight - mean_tokens * mean_seconds) / variance
        slope = max(slope, 0.0)
        fixed = mean_seconds - slope * mean_tokens
        if fixed <= 0:
            return None
        return StepCost(fixed_seconds=fixed, seconds_per_token=slope)
