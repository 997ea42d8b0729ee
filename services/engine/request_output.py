"""What one engine step produced for one request: the unit the loop reports and the server streams.

Plain picklable data with no model code behind it, so the server process (which never
imports torch) reads what the loop process sends.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cachet.common.v1 import common_pb2
from cachet.engine.request import RequestStatus
from cachet.engine.request_timeline import RequestTimeline
from cachet.engine.step_plan import SampledToken


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request; the last one has a terminal status."""

    request_id: str
    new_token_ids: list[int]
    # One per new token, only for requests that asked for logprobs.
    logprobs: list[SampledToken]
    status: RequestStatus
    # The stop string that ended generation, if one did.
    matched_stop: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_completion_tokens: int
    # Why the request was refused after it was queued (its grammar failed to compile): the
    # servicer turns this into INVALID_ARGUMENT. Empty otherwise.
    error: str = ""
    # On the last output: when the request reached each stage (its engine spans).
    timeline: RequestTimeline | None = None

    @property
    def finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> common_pb2.FinishReason.ValueType:
        return self.status.finish_reason

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """One output for this step and ``later`` ones: their tokens in order, ``later``'s state."""
        assert not self.finished and later.request_id == self.request_id, (self, later)
        return dataclasses.replace(
            later,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            logprobs=self.logprobs + later.logprobs,
        )
