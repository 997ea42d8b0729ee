"""The n choices of one request (OpenAI's ``n``), streamed and billed as one.

Each choice is a ``Generation`` of its own (an engine request named ``<id>/<i>``), all on
the replica that computed the prompt for choice 0 (``RequestPipeline._start_choices``).
The group interleaves their chunks as they come, each carrying its choice's ``index``,
and records usage once under the request's id: the prompt once (choice 0's, with its
cached tokens: the other choices' cache hits are the group's own sharing, not the
caller's), the completion tokens of every choice summed. Only the request's very last
chunk carries usage.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from cachet.common.v1 import common_pb2
from cachet.router.v1 import router_pb2

if TYPE_CHECKING:
    from cachet.router.request_pipeline import Generation, GenerationRequest, RequestPipeline


class ChoiceGroup:
    """Started choices of one request: ``chunks()``, ``collect()`` and ``close()`` as a Generation's."""

    def __init__(self, pipeline: RequestPipeline, choices: Sequence[Generation]) -> None:
        self._pipeline = pipeline
        self._choices = list(choices)
        first = self._choices[0]
        self.request: GenerationRequest = first.request
        self.replica_address = first.replica_address
        self.placement = first.placement
        self.created = first.created
        self._closed = False
        # Whether the ledger has this request's usage; set when the record is sent.
        self.usage_recorded: asyncio.Future[bool] | None = None

    async def chunks(self) -> AsyncIterator[router_pb2.ChatCompletionChunk]:
        """Every choice's chunks as they come; the last one of all carries the request's usage."""
        merged: asyncio.Queue[router_pb2.ChatCompletionChunk | BaseException | None] = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(choice, merged)) for choice in self._choices]
        running, unfinished = len(tasks), len(tasks)
        error: BaseException | None = None
        try:
            while running:
                item = await merged.get()
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                item.ClearField("usage")
                if item.finish_reason:
                    unfinished -= 1
                    if not unfinished:
                        item.usage.CopyFrom(self.usage())
                yield item
        except BaseException as failure:
            error = failure
            raise
        finally:
            for task in tasks:
                task.cancel()
            self.close(error)

    async def collect(self) -> router_pb2.ChatCompletion:
        """The whole completion: choice 0 in the top-level fields, every choice in ``choices``."""
        try:
            completions = await asyncio.gather(*(choice.collect() for choice in self._choices))
        except BaseException as failure:
            self.close(failure)
            raise
        result = router_pb2.ChatCompletion()
        result.CopyFrom(completions[0])
        for index, completion in enumerate(completions):
            result.choices.add(
                index=index,
                content=completion.content,
                reasoning_content=completion.reasoning_content,
                tool_calls=completion.tool_calls,
                finish_reason=completion.finish_reason,
                logprobs=completion.logprobs,
            )
        result.usage.CopyFrom(self.usage())
        self.close()
        return result

    def usage(self) -> common_pb2.Usage:
        first = self._choices[0].usage()
        return common_pb2.Usage(
            prompt_tokens=first.prompt_tokens,
            cached_tokens=first.cached_tokens,
            completion_tokens=sum(choice.usage().completion_tokens for choice in self._choices),
        )

    def close(self, error: BaseException | None = None) -> None:
        """End every choice once (aborting those still running) and record the request's usage.

        As a Generation's: a queued job cut short is not billed, as it runs again under the
        same id."""
        if self._closed:
            return
        self._closed = True
        for choice in self._choices:
            choice.close(error)
        finished = all(choice.finished for choice in self._choices)
        if finished or self.request.priority != common_pb2.PRIORITY_BATCH:
            self.usage_recorded = self._pipeline.record_usage(
                self.request, self.usage(), self.replica_address
            )

    @staticmethod
    async def _pump(
        choice: Generation,
        merged: asyncio.Queue[router_pb2.ChatCompletionChunk | BaseException | None],
    ) -> None:
        try:
            async for chunk in choice.chunks():
                merged.put_nowait(chunk)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - handed to the consumer, which raises it
            merged.put_nowait(error)
            return
        merged.put_nowait(None)
