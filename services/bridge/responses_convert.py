"""Responses API bodies to router protos, and router completions to Responses JSON.

A response is a chat completion spelled as items, so the conversation (the stored
one of ``previous_response_id``, then this request's ``input``) is rewritten as
the OpenAI chat body (``schemas.ChatCompletionBody``) and converted by the chat
path's own ``convert.chat_request_to_proto``, as ``anthropic_convert`` does: one
conversion to the router's request, whichever API the client speaks. Only the
answer's rendering is the Responses API's: output items (streams:
``responses_stream``), its usage names, its status.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError

from cachet.bridge import convert, schemas
from cachet.bridge import responses_schemas as responses
from cachet.bridge.errors import BridgeError
from cachet.common.v1 import common_pb2
from cachet.router.v1 import router_pb2

Json = dict[str, Any]

_ITEMS: TypeAdapter[list[responses.InputItem]] = TypeAdapter(list[responses.InputItem])


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ================================================================ REST -> proto


def input_items(body: responses.ResponsesBody) -> list[Json]:
    """This request's input as stored items, each with an id (``GET .../input_items`` lists them)."""
    out = []
    for item in body.input:
        data = item.model_dump(exclude_none=True, by_alias=True)
        data.setdefault("id", new_id(_ID_PREFIXES[item.type]))
        out.append(data)
    return out


_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def responses_request_to_proto(
    body: responses.ResponsesBody, conversation: list[Json], response_id: str, session_id: str
) -> router_pb2.ChatCompletionRequest:
    """The router request ``/v1/chat/completions`` would send for ``conversation`` (stored items,
    then this request's), under the response's id (the ledger's key) and session."""
    request = convert.chat_request_to_proto(chat_body(body, conversation))
    request.request_id = response_id
    request.session_id = session_id
    return request


def chat_body(body: responses.ResponsesBody, conversation: list[Json]) -> schemas.ChatCompletionBody:
    """The OpenAI chat body that asks for what ``body`` asks for, over ``conversation``."""
    instructions = (
        [schemas.ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    )
    fields: Json = {
        "model": body.model,
        "messages": [*instructions, *messages(_ITEMS.validate_python(conversation))],
        "tools": [_tool(tool) for tool in body.tools] if body.tools else None,
        "tool_choice": _tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body.text),
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "reasoning_effort": body.reasoning.effort if body.reasoning else None,
        "prompt_cache_retention": body.prompt_cache_retention,
    }
    try:
        return schemas.ChatCompletionBody(**fields)
    except ValidationError as error:
        # The Responses schema checks what the chat body does; a gap between the two (a
        # conversation with no message at all) is still the request's fault, not a 500.
        raise BridgeError(400, f"Invalid request: {error.errors()[0]['msg']}", param="input") from None


def messages(items: list[responses.InputItem]) -> list[schemas.ChatMessage]:
    """Items as chat messages: an assistant turn's reasoning, text and calls, which the
    Responses API keeps as separate items, become one assistant message."""
    out: list[schemas.ChatMessage] = []
    turn = _AssistantTurn()
    for item in items:
        if isinstance(item, responses.ReasoningItem):
            if turn.text or turn.calls:
                turn.flush(out)
            turn.reasoning.append(item.text())
        elif isinstance(item, responses.FunctionCallItem):
            turn.calls.append(
                schemas.ToolCall(
                    id=item.call_id, function=schemas.FunctionCall(name=item.name, arguments=item.arguments)
                )
            )
        elif isinstance(item, responses.MessageItem) and item.role == "assistant":
            if turn.text or turn.calls:
                turn.flush(out)
            parts = _parts(item.content)
            # A plain string is one text part (extending by it would add it character by character).
            turn.text.extend([schemas.TextPart(type="text", text=parts)] if isinstance(parts, str) else parts)
        else:
            turn.flush(out)
            out.append(_message(item))
    turn.flush(out)
    return out


@dataclass
class _AssistantTurn:
    """One assistant message being gathered from consecutive items."""

    reasoning: list[str] = field(default_factory=list)
    text: list[schemas.TextPart | schemas.ImagePart] = field(default_factory=list)
    calls: list[schemas.ToolCall] = field(default_factory=list)

    def flush(self, out: list[schemas.ChatMessage]) -> None:
        if not (self.reasoning or self.text or self.calls):
            return
        out.append(
            schemas.ChatMessage(
                role="assistant",
                # OpenAI's null content is for a turn that is only tool calls.
                content=self.text or (None if self.calls else ""),
                tool_calls=self.calls or None,
                reasoning_content="".join(self.reasoning) or None,
            )
        )
        self.reasoning, self.text, self.calls = [], [], []


def _message(item: responses.MessageItem | responses.FunctionCallOutputItem) -> schemas.ChatMessage:
    if isinstance(item, responses.FunctionCallOutputItem):
        return schemas.ChatMessage(role="tool", tool_call_id=item.call_id, content=_parts(item.output))
    return schemas.ChatMessage(role=item.role, content=_parts(item.content))


def _parts(
    content: str | list[responses.ContentPart],
) -> str | list[schemas.TextPart | schemas.ImagePart]:
    if isinstance(content, str):
        return content
    out: list[schemas.TextPart | schemas.ImagePart] = []
    for part in content:
        if isinstance(part, responses.InputImage):
            out.append(
                schemas.ImagePart(type="image_url", image_url=schemas.ImageURL(url=part.image_url or ""))
            )
        else:
            text = part.refusal if isinstance(part, responses.Refusal) else part.text
            out.append(schemas.TextPart(type="text", text=text))
    return out


def _tool(tool: responses.FunctionTool) -> schemas.Tool:
    return schemas.Tool(
        function=schemas.FunctionDefinition(
            name=tool.name,
            description=tool.description or "",
            parameters=tool.parameters,
            strict=bool(tool.strict),
        )
    )


def _tool_choice(choice: responses.ToolChoice | None) -> schemas.ToolChoice | None:
    if isinstance(choice, responses.NamedFunctionChoice):
        return schemas.NamedToolChoice(function=schemas.NamedFunction(name=choice.name))
    return choice


def _response_format(text: responses.TextConfig | None) -> schemas.ResponseFormat | None:
    fmt = text.format if text is not None else None
    if isinstance(fmt, responses.TextFormatJsonSchema):
        spec = schemas.JsonSchemaSpec(
            name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=bool(fmt.strict)
        )
        return schemas.JsonSchemaFormat(type="json_schema", json_schema=spec)
    if isinstance(fmt, responses.TextFormatJsonObject):
        return schemas.JsonObjectFormat(type="json_object")
    return None


# ================================================================ proto -> JSON


def skeleton(body: responses.ResponsesBody, response_id: str, created_at: int) -> Json:
    """The Response object before any output: what ``response.created`` carries, and what the
    finished one echoes of the request."""
    text_format = body.text.format if body.text is not None and body.text.format is not None else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": body.model,
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
        "store": body.store,
        "temperature": body.temperature,
        "text": {
            "format": text_format.model_dump(exclude_none=True, by_alias=True)
            if text_format
            else {"type": "text"}
        },
        "tool_choice": (
            body.tool_choice.model_dump()
            if isinstance(body.tool_choice, responses.NamedFunctionChoice)
            else body.tool_choice or "auto"
        ),
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
        "top_p": body.top_p,
        "truncation": "disabled",
        "usage": None,
        "metadata": body.metadata or {},
        "user": body.user,
    }


def finished(
    start: Json, output: list[Json], finish_reason: int, usage: common_pb2.Usage, model: str
) -> Json:
    """The Response object once the router's answer is whole."""
    cut = finish_reason == common_pb2.FINISH_REASON_LENGTH
    status = "incomplete" if cut else "completed"
    if output:
        # Only the last item can be cut short; the ones before it were finished.
        output[-1]["status"] = status
    return start | {
        "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "model": model or start["model"],
        "output": output,
        "usage": usage_to_json(usage),
    }


def usage_to_json(usage: common_pb2.Usage) -> Json:
    """OpenAI's meaning: input_tokens includes the cached ones, which are also counted apart."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        # The router does not count reasoning tokens apart from the answer's (docs/responses_api.md).
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def response_to_json(start: Json, completion: router_pb2.ChatCompletion) -> Json:
    output: list[Json] = []
    if completion.reasoning_content:
        output.append(reasoning_item(new_id("rs"), completion.reasoning_content))
    if completion.content:
        output.append(message_item(new_id("msg"), completion.content))
    output.extend(
        function_call_item(new_id("fc"), call.id, call.name, call.arguments_json)
        for call in completion.tool_calls
    )
    return finished(start, output, completion.finish_reason, completion.usage, completion.model)


def reasoning_item(id: str, text: str, status: str = "completed") -> Json:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": id, "summary": [], "content": content, "status": status}


def message_item(id: str, text: str | None, status: str = "completed") -> Json:
    content = [] if text is None else [output_text(text)]
    return {"type": "message", "id": id, "status": status, "role": "assistant", "content": content}


def output_text(text: str) -> Json:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> Json:
    return {
        "type": "function_call",
        "id": id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def deleted_to_json(response_id: str) -> Json:
    return {"id": response_id, "object": "response", "deleted": True}


# ================================================================ stored responses


def stored_to_proto(response: Json, session_id: str, input_items: list[Json]) -> router_pb2.StoredResponse:
    """What the router keeps of a stored response: its JSON, unread there, and the session it ran under."""
    return router_pb2.StoredResponse(
        id=response["id"],
        created_at=int(response["created_at"]),
        session_id=session_id,
        response_json=_json_bytes(response),
        input_items=[
            router_pb2.StoredResponseItem(id=str(item.get("id", "")), item_json=_json_bytes(item))
            for item in input_items
        ],
    )


def stored_response(stored: router_pb2.StoredResponse) -> Json:
    return json.loads(stored.response_json)


def conversation(stored: router_pb2.StoredResponse) -> list[Json]:
    """What a follow-up continues: every input item of the stored response, then its output."""
    return [*(json.loads(item.item_json) for item in stored.input_items), *stored_response(stored)["output"]]


def input_items_to_json(page: router_pb2.StoredResponseItems) -> Json:
    data = [json.loads(item.item_json) for item in page.items]
    return {
        "object": "list",
        "data": data,
        "first_id": page.items[0].id if page.items else None,
        "last_id": page.items[-1].id if page.items else None,
        "has_more": page.has_more,
    }


def _json_bytes(value: Json) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()
