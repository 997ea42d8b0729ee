"""A router chunk stream rendered as the Responses API's typed stream events.

A response streams as output items, each added, filled and done in turn, between
``response.created`` + ``response.in_progress`` and ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it):

    response.created, response.in_progress,
    output_item.added(0: reasoning) · content_part.added · reasoning_text.delta… ·
        reasoning_text.done · content_part.done · output_item.done,
    output_item.added(1: message) · content_part.added · output_text.delta… ·
        output_text.done · content_part.done · output_item.done,
    output_item.added(2: function_call) · function_call_arguments.delta… ·
        function_call_arguments.done · output_item.done, …
    response.completed (the whole Response, usage included)

Every event carries a ``sequence_number`` counting from 0. Router chunks carry flat
deltas (reasoning, text, tool-call fragments by index), so the renderer keeps the
one item that is open and closes it when a delta of another kind arrives, as
``anthropic_stream`` does with content blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cachet.bridge import responses_convert as convert
from cachet.bridge.errors import BridgeError
from cachet.common.v1 import common_pb2
from cachet.router.v1 import router_pb2

Json = dict[str, Any]


class ResponseStream:
    """Renders one stream: call it with each router chunk in order; it returns that chunk's events.

    ``on_finished`` receives the whole Response before ``response.completed`` goes out, so a
    client that reads that event and asks ``GET /v1/responses/{id}`` finds it stored.
    """

    def __init__(self, start: Json, on_finished: Callable[[Json], None]) -> None:
        self._start = start
        self._on_finished = on_finished
        self._sequence = 0
        self._started = False
        self._output: list[Json] = []
        # What the last item holds: "reasoning", "message", or the router's tool-call index;
        # None once it is done.
        self._open: str | int | None = None
        self._text = ""

    def __call__(self, chunk: router_pb2.ChatCompletionChunk) -> list[Json]:
        events: list[Json] = []
        if not self._started:
            self._started = True
            events += [self._event("response.created"), self._event("response.in_progress")]
        if chunk.reasoning_delta:
            events += self._into("reasoning", convert.reasoning_item(convert.new_id("rs"), "", "in_progress"))
            events.append(self._delta("response.reasoning_text.delta", chunk.reasoning_delta))
        if chunk.content_delta:
            events += self._into("message", convert.message_item(convert.new_id("msg"), None, "in_progress"))
            events.append(self._delta("response.output_text.delta", chunk.content_delta, logprobs=[]))
        for call in chunk.tool_call_deltas:
            events += self._tool_call(call)
        if chunk.finish_reason:
            cut = chunk.finish_reason == common_pb2.FINISH_REASON_LENGTH
            events += self._close("incomplete" if cut else "completed")
            events.append(self._finish(chunk))
        return events

    def error_event(self, error: BridgeError) -> Json:
        """The ``error`` event that ends a stream that failed after it began."""
        body = error.body()["error"]
        return self._event(
            "error", code=body["code"] or body["type"], message=body["message"], param=body["param"]
        )

    # ---------------------------------------------------------------- items

    def _into(self, kind: str, item: Json) -> list[Json]:
        """Events that make ``kind`` the open item: nothing if it is already."""
        if self._open == kind:
            return []
        events = [*self._close(), self._add(kind, item)]
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else convert.output_text("")
        events.append(self._item_event("response.content_part.added", content_index=0, part=part))
        return events

    def _tool_call(self, call: router_pb2.ToolCallDelta) -> list[Json]:
        events: list[Json] = []
        if call.id:
            # A call's first fragment names it: an item of its own, arguments filled by the deltas.
            item = convert.function_call_item(convert.new_id("fc"), call.id, call.name, "", "in_progress")
            events += [*self._close(), self._add(call.index, item)]
        if call.arguments_delta and self._open == call.index:
            events.append(self._delta("response.function_call_arguments.delta", call.arguments_delta))
        return events

    def _add(self, kind: str | int, item: Json) -> Json:
        self._output.append(item)
        self._open = kind
        self._text = ""
        return self._event("response.output_item.added", output_index=len(self._output) - 1, item=dict(item))

    def _delta(self, kind: str, delta: str, **extra: Any) -> Json:
        self._text += delta
        index: dict[str, Any] = (
            {} if kind == "response.function_call_arguments.delta" else {"content_index": 0}
        )
        return self._item_event(kind, **index, delta=delta, **extra)

    def _close(self, status: str = "completed") -> list[Json]:
        """The events that finish the open item (none is open: none). Only the last item can be
        cut short by max_output_tokens: the others were closed by the next one's start."""
        if self._open is None:
            return []
        item, text = self._output[-1], self._text
        item["status"] = status
        if self._open == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            item["content"] = [part]
            events = [
                self._item_event("response.reasoning_text.done", content_index=0, text=text),
                self._item_event("response.content_part.done", content_index=0, part=part),
            ]
        elif self._open == "message":
            part = convert.output_text(text)
            item["content"] = [part]
            events = [
                self._item_event("response.output_text.done", content_index=0, text=text, logprobs=[]),
                self._item_event("response.content_part.done", content_index=0, part=part),
            ]
        else:
            item["arguments"] = text
            events = [
                self._item_event("response.function_call_arguments.done", name=item["name"], arguments=text)
            ]
        events.append(self._item_event("response.output_item.done", item=dict(item), with_id=False))
        self._open = None
        return events

    def _finish(self, chunk: router_pb2.ChatCompletionChunk) -> Json:
        response = convert.finished(self._start, self._output, chunk.finish_reason, chunk.usage, chunk.model)
        self._on_finished(response)
        kind = (
            "response.incomplete"
            if chunk.finish_reason == common_pb2.FINISH_REASON_LENGTH
            else "response.completed"
        )
        return self._event(kind, response=response)

    # ---------------------------------------------------------------- events

    def _item_event(self, kind: str, with_id: bool = True, **fields: Any) -> Json:
        item_id = {"item_id": self._output[-1]["id"]} if with_id else {}
        return self._event(kind, **item_id, output_index=len(self._output) - 1, **fields)

    def _event(self, kind: str, **fields: Any) -> Json:
        if kind in ("response.created", "response.in_progress"):
            fields["response"] = self._start
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event
