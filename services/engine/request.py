"""A request's life inside the engine, and the one table of finish reasons."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cachet.common.v1 import common_pb2
from cachet.engine.kv_retention import KvRetention
from cachet.engine.prompt_images import PromptImage
from cachet.engine.request_timeline import RequestTimeline
from cachet.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from concurrent.futures import Future

    from cachet.engine.grammar_matcher import RequestGrammar


class RequestStatus(enum.IntEnum):
    """Ordered: every status after RUNNING... is terminal (see ``is_finished``)."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> common_pb2.FinishReason.ValueType:
        return _FINISH_REASONS.get(self, common_pb2.FINISH_REASON_UNSPECIFIED)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: common_pb2.FINISH_REASON_STOP,
    RequestStatus.FINISHED_LENGTH: common_pb2.FINISH_REASON_LENGTH,
    RequestStatus.FINISHED_ABORTED: common_pb2.FINISH_REASON_ABORT,
    RequestStatus.FINISHED_ERROR: common_pb2.FINISH_REASON_ERROR,
}


@dataclass(eq=False)
class Request:
    """One generation as the scheduler and KV cache manager see it.

    ``num_computed_tokens`` counts leading tokens whose KV is in the cache
    (cached prefix included); ``num_cached_tokens`` is fixed when the request is
    first scheduled and is what usage reports as cached.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    interactive: bool = True
    cache_salt: str = ""
    arrival_time: float = 0.0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    block_hashes: list[int] = field(default_factory=list)
    stop_reason: str = ""
    # Structured output: the grammar every output token must follow (None: free text).
    grammar: RequestGrammar | None = None
    # Blocks of its prefix being loaded from the shared KV tier ((hash, block) pairs).
    kv_prefetch: Future[list[tuple[int, Any]]] | None = None
    # Where they come from: "shared" (the file tier) or "transfer" (pushed by a prefill replica).
    kv_prefetch_source: str = "shared"
    # How long its KV is kept in preference to other KV once it leaves the pool (kv_retention).
    retention: tuple[KvRetention, ...] = ()
    # Disaggregated prefill. On a prefill replica: its last answer waits until its prompt's KV
    # is in the shared tier (kv_handoff). On a decode replica: another replica computed its
    # prompt and sampled ``output_token_ids[0]``; its KV comes from the shared tier.
    hand_off_kv: bool = False
    # A hand-off's blocks also go straight to this decode replica's KV receiver (kv_transfer),
    # and its answer waits until they are there.
    hand_off_to: str = ""
    prefilled_elsewhere: bool = False
    # When it reached each stage, for its trace (request_spans).
    timeline: RequestTimeline = field(default_factory=RequestTimeline)
    # Its prompt's images, in token order (prompt_images).
    images: tuple[PromptImage, ...] = ()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_ready(self) -> bool:
        """False while its grammar is still compiling or its prefix is still loading from the
        shared KV tier: the scheduler leaves it waiting."""
        return (self.grammar is None or self.grammar.ready) and (
            self.kv_prefetch is None or self.kv_prefetch.done()
        )

    def __repr__(self) -> str:
        # Prompts stay out of logs.
        return (
            f"Request(id={self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens} tok, "
            f"output={len(self.output_token_ids)} tok, computed={self.num_computed_tokens})"
        )
