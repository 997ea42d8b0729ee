"""Anthropic Messages bodies to router protos, and router completions to Anthropic JSON.

A Messages request is a chat completion spelled another way, so it is rewritten
as the OpenAI body (``schemas.ChatCompletionBody``) and converted by the chat
path's own ``convert.chat_request_to_proto``: one conversion to the router's
request, whichever API the client speaks. The router's answer is the same too;
only its rendering as content blocks is Anthropic's (streams: ``anthropic_stream``).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import ValidationError

from cachet.bridge import anthropic_schemas as anthropic
from cachet.bridge import convert, schemas
from cachet.bridge.errors import BridgeError
from cachet.common.v1 import common_pb2
from cachet.router.v1 import router_pb2
from cachet.tokenizer.v1 import tokenizer_pb2

Json = dict[str, Any]

# The one finish-reason table (common.proto) rendered as Anthropic's stop reasons. A stop
# string and the end-of-turn token both end as "stop" there, so both are "end_turn" here.
STOP_REASONS: dict[int, str | None] = {
    common_pb2.FINISH_REASON_UNSPECIFIED: None,
    common_pb2.FINISH_REASON_STOP: "end_turn",
    common_pb2.FINISH_REASON_LENGTH: "max_tokens",
    common_pb2.FINISH_REASON_TOOL_CALLS: "tool_use",
    # Neither reaches a reader: an aborted request's client has gone, a failed one ends in an error.
    common_pb2.FINISH_REASON_ABORT: "end_turn",
    common_pb2.FINISH_REASON_ERROR: "end_turn",
}

_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


# ================================================================ REST -> proto


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def messages_request_to_proto(body: anthropic.MessagesBody) -> router_pb2.ChatCompletionRequest:
    """The router request ``/v1/chat/completions`` would send for the same conversation, with
    its cache_control breakpoints."""
    request = convert.chat_request_to_proto(chat_body(body))
    # The ledger's key, and the id the client sees: Anthropic's "msg_" ids.
    request.request_id = new_message_id()
    if body.cache_control is not None:
        request.cache_retention = _retention(body.cache_control)
    request.cache_breakpoints.extend(cache_breakpoints(body))
    return request


# Anthropic's ttl (absent: its default, 5 minutes) as the router's retention.
_TTLS = {
    None: router_pb2.CACHE_RETENTION_5M,
    "5m": router_pb2.CACHE_RETENTION_5M,
    "1h": router_pb2.CACHE_RETENTION_1H,
}


def _retention(control: anthropic.CacheControl) -> router_pb2.CacheRetention.ValueType:
    return _TTLS[control.ttl]


def cache_breakpoints(body: anthropic.MessagesInput) -> list[router_pb2.CacheBreakpoint]:
    """Each block's cache_control as a breakpoint after the chat messages its prefix ends in
    (``chat_body``'s messages): one on a tool covers the tools alone (0 messages), one in the
    system prompt the system message, one in a turn the turn's chat messages up to and including
    the one holding the block (a user turn is split into tool and user messages, see ``_user_layout``);
    the rest of that message's content is kept with it."""
    breakpoints = [
        router_pb2.CacheBreakpoint(messages=0, retention=_retention(tool.cache_control))
        for tool in body.tools or []
        if tool.cache_control is not None
    ]
    done = len(_system(body.system))
    if isinstance(body.system, list):
        breakpoints += [
            router_pb2.CacheBreakpoint(messages=done, retention=_retention(block.cache_control))
            for block in body.system
            if block.cache_control is not None
        ]
    for message in body.messages:
        turn, positions = _turn_layout(message)
        blocks = message.content if isinstance(message.content, list) else []
        for block, position in zip(blocks, positions, strict=True):
            breakpoints += [
                router_pb2.CacheBreakpoint(messages=done + position + 1, retention=_retention(control))
                for control in _controls(block)
            ]
        done += len(turn)
    return breakpoints


def _controls(block: Any) -> list[anthropic.CacheControl]:
    """A block's own cache_control, and those inside a tool result's content."""
    inner = block.list_content() if isinstance(block, anthropic.ToolResultBlock) else []
    return [c for b in [block, *inner] if (c := getattr(b, "cache_control", None)) is not None]


def count_tokens_request_to_proto(
    body: anthropic.CountTokensBody,
) -> tokenizer_pb2.ApplyChatTemplateRequest:
    """The prompt the router would render for this conversation (it offers no tools under
    ``tool_choice: none``), so the count is the one a message would be billed; count only:
    the images' pixels stay in the tokenizer."""
    chat = convert.chat_request_to_proto(chat_body(body))
    offered = chat.tool_choice.mode != common_pb2.TOOL_CHOICE_MODE_NONE
    return tokenizer_pb2.ApplyChatTemplateRequest(
        model=chat.model,
        messages=chat.messages,
        tools=chat.tools if offered else [],
        add_generation_prompt=True,
        reasoning=chat.reasoning,
        count_only=True,
    )


def chat_body(body: anthropic.MessagesInput) -> schemas.ChatCompletionBody:
    """The OpenAI chat body that asks for what ``body`` asks for."""
    fields: Json = {
        "model": body.model,
        "messages": [*_system(body.system), *(m for message in body.messages for m in _turn(message))],
        "tools": [_tool(tool) for tool in body.tools] if body.tools else None,
        "tool_choice": _tool_choice(body.tool_choice),
        "parallel_tool_calls": _parallel_tool_calls(body.tool_choice),
        "response_format": _response_format(body.output_config),
        "thinking": body.thinking,
        "reasoning_effort": body.output_config.effort if body.output_config else None,
    }
    if isinstance(body, anthropic.MessagesBody):
        fields |= {
            "max_tokens": body.max_tokens,
            "stop": body.stop_sequences,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stream": body.stream,
        }
    try:
        return schemas.ChatCompletionBody(**fields)
    except ValidationError as error:
        # The Anthropic schema checks everything the chat body does; a gap between the two
        # is still the request's fault, and must not become a 500.
        raise BridgeError(400, f"Invalid request: {error.errors()[0]['msg']}") from None


def _system(system: str | list[anthropic.TextBlock] | None) -> list[schemas.ChatMessage]:
    if system is None or system == []:
        return []
    content: str | list[schemas.TextPart | schemas.ImagePart] = (
        system if isinstance(system, str) else [_text(block) for block in system]
    )
    return [schemas.ChatMessage(role="system", content=content)]


def _turn(message: anthropic.MessageParam) -> list[schemas.ChatMessage]:
    return _turn_layout(message)[0]


def _turn_layout(message: anthropic.MessageParam) -> tuple[list[schemas.ChatMessage], list[int]]:
    """A turn's chat messages, and for each of its content blocks the index of the one holding it."""
    if isinstance(message.content, str):
        return [schemas.ChatMessage(role=message.role, content=message.content)], []
    if message.role == "assistant":
        return [_assistant(message.content)], [0] * len(message.content)
    return _user_layout(message.content)


def _user_layout(blocks: list[Any]) -> tuple[list[schemas.ChatMessage], list[int]]:
    """One Anthropic user turn is OpenAI's tool messages (one per tool_result) and user
    messages (the other blocks), in the order the blocks come; and for each block, the index
    of the message it went into."""
    out: list[schemas.ChatMessage] = []
    parts: list[schemas.TextPart | schemas.ImagePart] = []
    positions: list[int] = []
    for block in blocks:
        if isinstance(block, anthropic.ToolResultBlock):
            if parts:
                out.append(schemas.ChatMessage(role="user", content=parts))
                parts = []
            positions.append(len(out))
            out.append(
                schemas.ChatMessage(
                    role="tool", tool_call_id=block.tool_use_id, content=_tool_result(block.content)
                )
            )
        else:
            positions.append(len(out))
            parts.append(_part(block))
    if parts:
        out.append(schemas.ChatMessage(role="user", content=parts))
    return out, positions


def _assistant(blocks: list[Any]) -> schemas.ChatMessage:
    parts: list[schemas.TextPart | schemas.ImagePart] = [
        _text(b) for b in blocks if isinstance(b, anthropic.TextBlock)
    ]
    calls = [
        schemas.ToolCall(
            id=block.id,
            function=schemas.FunctionCall(name=block.name, arguments=json.dumps(block.input)),
        )
        for block in blocks
        if isinstance(block, anthropic.ToolUseBlock)
    ]
    reasoning = "".join(b.thinking for b in blocks if isinstance(b, anthropic.ThinkingBlock))
    return schemas.ChatMessage(
        role="assistant",
        # OpenAI's null content is for a turn that is only tool calls; a turn of thinking alone is "".
        content=parts or (None if calls else ""),
        tool_calls=calls or None,
        reasoning_content=reasoning or None,
    )


def _tool_result(
    content: str | list[anthropic.TextBlock | anthropic.ImageBlock] | None,
) -> str | list[schemas.TextPart | schemas.ImagePart]:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return [_part(block) for block in content]


def _part(block: anthropic.TextBlock | anthropic.ImageBlock) -> schemas.TextPart | schemas.ImagePart:
    if isinstance(block, anthropic.TextBlock):
        return _text(block)
    return schemas.ImagePart(type="image_url", image_url=schemas.ImageURL(url=block.url()))


def _text(block: anthropic.TextBlock) -> schemas.TextPart:
    return schemas.TextPart(type="text", text=block.text)


def _tool(tool: anthropic.ToolDefinition) -> schemas.Tool:
    return schemas.Tool(
        function=schemas.FunctionDefinition(
            name=tool.name,
            description=tool.description or "",
            parameters=tool.input_schema,
            strict=tool.strict,
        )
    )


def _tool_choice(choice: anthropic.ToolChoice | None) -> schemas.ToolChoice | None:
    if choice is None:
        return None
    if isinstance(choice, anthropic.ToolChoiceTool):
        return schemas.NamedToolChoice(function=schemas.NamedFunction(name=choice.name))
    return _TOOL_CHOICES[choice.type]  # type: ignore[return-value]


def _parallel_tool_calls(choice: anthropic.ToolChoice | None) -> bool | None:
    if choice is None or isinstance(choice, anthropic.ToolChoiceNone):
        return None
    # Unset keeps the default (parallel calls allowed), as Anthropic's is.
    return False if choice.disable_parallel_tool_use else None


def _response_format(config: anthropic.OutputConfig | None) -> schemas.JsonSchemaFormat | None:
    if config is None or config.format is None:
        return None
    # Anthropic guarantees the schema, which is what strict means to the chat path.
    spec = schemas.JsonSchemaSpec(schema=config.format.schema_, strict=True)
    return schemas.JsonSchemaFormat(type="json_schema", json_schema=spec)


# ================================================================ proto -> JSON


def usage_to_json(usage: common_pb2.Usage) -> Json:
    """Anthropic's usage: input_tokens excludes the cached ones, which are counted apart."""
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": usage.completion_tokens,
    }


def message_to_json(completion: router_pb2.ChatCompletion) -> Json:
    content: list[Json] = []
    if completion.reasoning_content:
        content.append(thinking_block(completion.reasoning_content))
    if completion.content:
        content.append({"type": "text", "text": completion.content})
    content.extend(tool_use_block(c.id, c.name, tool_input(c.arguments_json)) for c in completion.tool_calls)
    stop_reason, stop_sequence = stop_of(completion.finish_reason, completion.matched_stop)
    return message_json(
        completion.id, completion.model, content, stop_reason, usage_to_json(completion.usage), stop_sequence
    )


def stop_of(finish_reason: int, matched_stop: str) -> tuple[str | None, str | None]:
    """Anthropic's stop_reason and stop_sequence: "stop_sequence" names which of the request's
    stop_sequences ended the answer."""
    if matched_stop:
        return "stop_sequence", matched_stop
    return STOP_REASONS[finish_reason], None


def message_json(
    id: str,
    model: str,
    content: list[Json],
    stop_reason: str | None,
    usage: Json,
    stop_sequence: str | None = None,
) -> Json:
    return {
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage,
    }


def thinking_block(thinking: str) -> Json:
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def tool_use_block(id: str, name: str, input: Json) -> Json:
    return {"type": "tool_use", "id": id, "name": name, "input": input}


def tool_input(arguments_json: str) -> Json:
    """A call's arguments as the object Anthropic answers; {} for text that is none (a call cut
    short by max_tokens, whose stop_reason says so)."""
    try:
        arguments = json.loads(arguments_json) if arguments_json.strip() else {}
    except json.JSONDecodeError:
        return {}
    return arguments if isinstance(arguments, dict) else {}


def count_tokens_to_json(rendered: tokenizer_pb2.ApplyChatTemplateResponse) -> Json:
    return {"input_tokens": len(rendered.token_ids)}
