"""A router chunk stream rendered as Anthropic's typed Messages stream events.

Anthropic streams a message as content blocks, each opened, filled by deltas and
closed in turn, between ``message_start`` and ``message_delta`` + ``message_stop``:

    message_start, ping,
    content_block_start(0: thinking) · thinking_delta… · content_block_stop(0),
    content_block_start(1: text)     · text_delta…     · content_block_stop(1),
    content_block_start(2: tool_use) · input_json_delta… · content_block_stop(2), …
    message_delta (stop_reason, usage), message_stop

Router chunks carry flat deltas (reasoning, text, tool-call fragments by index),
so the renderer keeps the one block that is open and closes it when a delta of
another kind arrives. The whole answer (``anthropic_convert.message_to_json``)
is built from the same chunks by the router, so the two agree block for block
whenever reasoning, text and calls come in that order, as they do.
"""

from __future__ import annotations

from typing import Any

from cachet.bridge import anthropic_convert
from cachet.common.v1 import common_pb2
from cachet.router.v1 import router_pb2

Json = dict[str, Any]


class MessageStream:
    """Renders one stream: call it with each router chunk in order; it returns that chunk's events.

    The router's last chunk carries the finish reason and usage; it closes the message.
    """

    def __init__(self) -> None:
        self._started = False
        # Index of the last block opened (-1: none yet) and what it holds: "thinking",
        # "text", or the router's tool-call index; None once closed.
        self._index = -1
        self._open: str | int | None = None

    def __call__(self, chunk: router_pb2.ChatCompletionChunk) -> list[Json]:
        events: list[Json] = []
        if not self._started:
            self._started = True
            events += self._message_start(chunk)
        if chunk.reasoning_delta:
            events += self._into("thinking", anthropic_convert.thinking_block(""))
            events.append(self._delta({"type": "thinking_delta", "thinking": chunk.reasoning_delta}))
        if chunk.content_delta:
            events += self._into("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": chunk.content_delta}))
        for call in chunk.tool_call_deltas:
            events += self._tool_call(call)
        if chunk.finish_reason:
            events += self._close()
            events += self._message_end(chunk)
        return events

    def _message_start(self, chunk: router_pb2.ChatCompletionChunk) -> list[Json]:
        # The counts are not known until the last chunk: message_delta carries them, and
        # clients (the official SDKs) take its totals over these.
        usage = anthropic_convert.usage_to_json(common_pb2.Usage())
        message = anthropic_convert.message_json(chunk.id, chunk.model, [], None, usage)
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _tool_call(self, call: router_pb2.ToolCallDelta) -> list[Json]:
        events: list[Json] = []
        if call.id:
            # A call's first fragment names it: its own block, input filled by the deltas.
            events += self._close()
            events += self._open_block(call.index, anthropic_convert.tool_use_block(call.id, call.name, {}))
        if call.arguments_delta and self._open == call.index:
            events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments_delta}))
        return events

    def _into(self, kind: str, block: Json) -> list[Json]:
        """Events that make ``kind`` the open block: nothing if it is already."""
        if self._open == kind:
            return []
        return [*self._close(), *self._open_block(kind, block)]

    def _open_block(self, kind: str | int, block: Json) -> list[Json]:
        self._index += 1
        self._open = kind
        return [{"type": "content_block_start", "index": self._index, "content_block": block}]

    def _delta(self, delta: Json) -> Json:
        return {"type": "content_block_delta", "index": self._index, "delta": delta}

    def _close(self) -> list[Json]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": self._index}]

    def _message_end(self, chunk: router_pb2.ChatCompletionChunk) -> list[Json]:
        stop_reason, stop_sequence = anthropic_convert.stop_of(chunk.finish_reason, chunk.matched_stop)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        usage = anthropic_convert.usage_to_json(chunk.usage)
        return [{"type": "message_delta", "delta": delta, "usage": usage}, {"type": "message_stop"}]
