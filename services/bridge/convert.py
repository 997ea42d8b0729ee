"""REST bodies to router protos, and router protos to OpenAI / Workers AI JSON.

One function per body and direction, nothing else: no I/O, no defaults invented
beyond the ones OpenAI documents (those live in ``schemas``). The JSON produced
here is what ``schemas``' response models declare; tests hold the two together.
"""

from __future__ import annotations

import base64
import json
from decimal import Decimal
from typing import Any

from cachet.bridge import schemas
from cachet.common.v1 import common_pb2
from cachet.router.v1 import router_pb2
from cachet.usage.v1 import usage_pb2

Json = dict[str, Any]

# The one finish-reason table (common.proto) rendered as OpenAI strings.
FINISH_REASONS: dict[int, str | None] = {
    common_pb2.FINISH_REASON_UNSPECIFIED: None,
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}

_TOOL_CHOICE_MODES = {
    "none": common_pb2.TOOL_CHOICE_MODE_NONE,
    "auto": common_pb2.TOOL_CHOICE_MODE_AUTO,
    "required": common_pb2.TOOL_CHOICE_MODE_REQUIRED,
}

BATCH_STATUSES = {
    router_pb2.BATCH_STATUS_UNSPECIFIED: "unspecified",
    router_pb2.BATCH_STATUS_QUEUED: "queued",
    router_pb2.BATCH_STATUS_RUNNING: "running",
    router_pb2.BATCH_STATUS_DONE: "done",
    router_pb2.BATCH_STATUS_CANCELLED: "cancelled",
    router_pb2.BATCH_STATUS_CANCELLING: "cancelling",
}

_PICO = Decimal(10) ** -12

# OpenAI's prompt_cache_retention values; unset is the router's to choose (its session default).
CACHE_RETENTIONS: dict[str | None, router_pb2.CacheRetention.ValueType] = {
    None: router_pb2.CACHE_RETENTION_UNSPECIFIED,
    "in_memory": router_pb2.CACHE_RETENTION_IN_MEMORY,
    "24h": router_pb2.CACHE_RETENTION_24H,
    "none": router_pb2.CACHE_RETENTION_NONE,
}


# ================================================================ REST -> proto


def chat_request_to_proto(body: schemas.ChatCompletionBody) -> router_pb2.ChatCompletionRequest:
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    request = router_pb2.ChatCompletionRequest(
        model=body.model,
        messages=[_message(m) for m in body.messages],
        sampling=_sampling(body, max_tokens, body.logprobs, body.top_logprobs or 0),
        tools=[_tool(t.function) for t in body.tools or []],
        cache_salt=body.cache_salt or "",
        # The router takes x-session-affinity metadata over this field (caller.py).
        session_id=body.prompt_cache_key or "",
        # 0 is one choice: a request that asks for one says nothing.
        n=body.n if body.n > 1 else 0,
        cache_retention=CACHE_RETENTIONS[body.prompt_cache_retention],
    )
    reasoning = _reasoning(body)
    if reasoning.ByteSize():
        request.reasoning.CopyFrom(reasoning)
    if body.tool_choice is not None:
        request.tool_choice.CopyFrom(_tool_choice(body.tool_choice))
    if body.response_format is not None:
        request.response_format.CopyFrom(_response_format(body.response_format))
    if body.parallel_tool_calls is not None:
        request.parallel_tool_calls = body.parallel_tool_calls
    return request


def completion_request_to_proto(body: schemas.CompletionBody) -> router_pb2.CompletionRequest:
    # Legacy logprobs=k means "the sampled token plus k alternatives".
    wants_logprobs = body.logprobs is not None
    request = router_pb2.CompletionRequest(
        model=body.model,
        sampling=_sampling(body, body.max_tokens, wants_logprobs, body.logprobs or 0),
        cache_salt=body.cache_salt or "",
        session_id=body.prompt_cache_key or "",
        n=body.n if body.n > 1 else 0,
        cache_retention=CACHE_RETENTIONS[body.prompt_cache_retention],
    )
    prompt = body.prompt
    if isinstance(prompt, str):
        request.prompt = prompt
    elif isinstance(prompt[0], str):
        request.prompt = str(prompt[0])
    else:
        request.prompt_token_ids.extend(int(token) for token in prompt)
    return request


def workers_ai_request_to_proto(
    model: str, body: schemas.WorkersAIRunBody
) -> router_pb2.ChatCompletionRequest | router_pb2.CompletionRequest:
    """``messages`` is a chat; ``prompt`` is one user turn (templated) unless ``raw``."""
    sampling = _sampling(body, body.max_tokens, False, 0)
    response_format = _response_format(body.response_format) if body.response_format is not None else None
    if body.raw:
        request: Any = router_pb2.CompletionRequest(model=model, prompt=body.prompt or "", sampling=sampling)
    else:
        messages = [
            _message(m) for m in body.messages or [schemas.ChatMessage(role="user", content=body.prompt)]
        ]
        if body.image is not None:
            last_user = next(m for m in reversed(messages) if m.role == "user")
            last_user.content.append(_workers_ai_image(body.image))
        request = router_pb2.ChatCompletionRequest(
            model=model,
            messages=messages,
            sampling=sampling,
            tools=[_tool(t.definition()) for t in body.tools or []],
        )
        if body.tool_choice is not None:
            request.tool_choice.CopyFrom(_tool_choice(body.tool_choice))
        if body.parallel_tool_calls is not None:
            request.parallel_tool_calls = body.parallel_tool_calls
    if response_format is not None:
        request.response_format.CopyFrom(response_format)
    return request


def _workers_ai_image(image: list[int] | str) -> common_pb2.ContentPart:
    """Workers AI's ``image`` as a data URL part; the tokenizer service reads the format from the
    bytes themselves, so the media type names none."""
    if isinstance(image, list):
        image = base64.b64encode(bytes(image)).decode()
    url = image if image[:5].lower() == "data:" else f"data:image/*;base64,{image}"
    return common_pb2.ContentPart(image_url=url)


def queue_request_to_proto(model: str, body: schemas.WorkersAIBody) -> router_pb2.QueueRequestsRequest:
    batch = router_pb2.QueueRequestsRequest(model=model, webhook_url=body.webhook_url or "")
    for run in body.requests or []:
        request = workers_ai_request_to_proto(model, run)
        if isinstance(request, router_pb2.ChatCompletionRequest):
            batch.requests.add(chat=request)
        else:
            batch.requests.add(completion=request)
    return batch


def _sampling(
    body: Any, max_tokens: int | None, logprobs: bool, top_logprobs: int
) -> common_pb2.SamplingParams:
    sampling = common_pb2.SamplingParams(
        top_k=body.top_k or 0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        ignore_eos=getattr(body, "ignore_eos", False),
    )
    # Optional proto fields: set only what the client gave, so "unset" keeps meaning "default".
    for name in ("temperature", "top_p", "seed", "repetition_penalty"):
        value = getattr(body, name, None)
        if value is not None:
            setattr(sampling, name, value)
    min_p = getattr(body, "min_p", None)
    if min_p is not None:
        sampling.min_p = min_p
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    return sampling


def _reasoning(body: schemas.ChatCompletionBody) -> common_pb2.ReasoningControls:
    controls = common_pb2.ReasoningControls(
        effort=body.reasoning_effort or "",
        template_kwargs=[
            _template_variable(name, value) for name, value in (body.chat_template_kwargs or {}).items()
        ],
    )
    if body.thinking is not None:
        controls.thinking = body.thinking.on
    return controls


def _template_variable(name: str, value: schemas.TemplateValue) -> common_pb2.TemplateVariable:
    # bool before int: True is an int to Python.
    if isinstance(value, bool):
        return common_pb2.TemplateVariable(name=name, bool_value=value)
    if isinstance(value, int):
        return common_pb2.TemplateVariable(name=name, int_value=value)
    if isinstance(value, float):
        return common_pb2.TemplateVariable(name=name, number_value=value)
    return common_pb2.TemplateVariable(name=name, string_value=value)


def _message(message: schemas.ChatMessage) -> common_pb2.ChatMessage:
    return common_pb2.ChatMessage(
        role=message.role,
        content=_content(message.content),
        name=message.name or "",
        tool_calls=[
            common_pb2.ToolCall(id=call.id, name=call.function.name, arguments_json=call.function.arguments)
            for call in message.tool_calls or []
        ],
        tool_call_id=message.tool_call_id or "",
        reasoning_content=message.reasoning_content or "",
    )


def _content(
    content: str | list[schemas.TextPart | schemas.ImagePart] | None,
) -> list[common_pb2.ContentPart]:
    if content is None:
        return []
    if isinstance(content, str):
        return [common_pb2.ContentPart(text=content)]
    return [
        common_pb2.ContentPart(text=part.text)
        if isinstance(part, schemas.TextPart)
        else common_pb2.ContentPart(image_url=part.image_url.url)
        for part in content
    ]


def _tool(function: schemas.FunctionDefinition) -> common_pb2.Tool:
    # A schema is JSON, so it crosses the wire as JSON text (common.proto says why).
    parameters = (
        function.parameters if function.parameters is not None else {"type": "object", "properties": {}}
    )
    return common_pb2.Tool(
        name=function.name,
        description=function.description,
        parameters_schema_json=json.dumps(parameters, separators=(",", ":")),
        strict=function.strict,
    )


def _tool_choice(choice: str | schemas.NamedToolChoice) -> common_pb2.ToolChoice:
    if isinstance(choice, schemas.NamedToolChoice):
        return common_pb2.ToolChoice(function_name=choice.function.name)
    return common_pb2.ToolChoice(mode=_TOOL_CHOICE_MODES[choice])


def _response_format(fmt: Any) -> common_pb2.ResponseFormat:
    if isinstance(fmt, schemas.JsonSchemaFormat):
        spec = fmt.json_schema
        return common_pb2.ResponseFormat(
            json_schema=common_pb2.JsonSchemaFormat(
                name=spec.name,
                schema_json=json.dumps(spec.schema_, separators=(",", ":")),
                strict=spec.strict,
            )
        )
    if isinstance(fmt, schemas.JsonObjectFormat):
        return common_pb2.ResponseFormat(json_object=common_pb2.JsonObjectFormat())
    if isinstance(fmt, schemas.RegexFormat):
        return common_pb2.ResponseFormat(regex=fmt.regex)
    if isinstance(fmt, schemas.EbnfFormat):
        return common_pb2.ResponseFormat(ebnf=fmt.ebnf)
    return common_pb2.ResponseFormat(text=common_pb2.TextFormat())


# ================================================================ proto -> JSON


def usage_to_json(usage: common_pb2.Usage) -> Json:
    # cached_tokens is always a number (0 when nothing was cached): billing reads it.
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def chat_completion_to_json(completion: router_pb2.ChatCompletion) -> Json:
    return {
        "id": completion.id,
        "object": "chat.completion",
        "created": completion.created,
        "model": completion.model,
        "choices": [_chat_choice(choice) for choice in _choices(completion)],
        "usage": usage_to_json(completion.usage),
    }


def _choices(completion: router_pb2.ChatCompletion) -> list[router_pb2.ChatChoice]:
    """Every choice; a completion of one choice carries it in its own fields only."""
    if completion.choices:
        return list(completion.choices)
    return [
        router_pb2.ChatChoice(
            index=0,
            content=completion.content,
            reasoning_content=completion.reasoning_content,
            tool_calls=completion.tool_calls,
            finish_reason=completion.finish_reason,
            logprobs=completion.logprobs,
        )
    ]


def _chat_choice(choice: router_pb2.ChatChoice) -> Json:
    message: Json = {
        "role": "assistant",
        # OpenAI sends null content for a turn that is only tool calls.
        "content": choice.content if choice.content or not choice.tool_calls else None,
    }
    if choice.reasoning_content:
        message["reasoning_content"] = choice.reasoning_content
    if choice.tool_calls:
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments_json},
            }
            for call in choice.tool_calls
        ]
    return {
        "index": choice.index,
        "message": message,
        "logprobs": _chat_logprobs(choice.logprobs),
        "finish_reason": FINISH_REASONS[choice.finish_reason],
    }


def chat_chunk_to_json(chunk: router_pb2.ChatCompletionChunk, include_usage: bool) -> list[Json]:
    """The SSE events for one router chunk: its choice delta (if any), then usage (if asked and present)."""
    events: list[Json] = []
    head = {"id": chunk.id, "object": "chat.completion.chunk", "created": chunk.created, "model": chunk.model}
    if _has_choice_content(chunk):
        deltas = _choice_deltas(chunk)
        for number, delta in enumerate(deltas):
            last = number == len(deltas) - 1
            choice = {
                "index": chunk.index,
                "delta": delta,
                "logprobs": _chat_logprobs(chunk.logprobs) if number == 0 else None,
                "finish_reason": FINISH_REASONS[chunk.finish_reason] if last else None,
            }
            event: Json = {**head, "choices": [choice]}
            if include_usage:
                event["usage"] = None
            events.append(event)
    if include_usage and chunk.HasField("usage"):
        events.append({**head, "choices": [], "usage": usage_to_json(chunk.usage)})
    return events


def text_completion_to_json(completion: router_pb2.ChatCompletion) -> Json:
    return {
        "id": completion.id,
        "object": "text_completion",
        "created": completion.created,
        "model": completion.model,
        "choices": [
            {
                "index": choice.index,
                "text": choice.content,
                "logprobs": _text_logprobs(choice.logprobs),
                "finish_reason": FINISH_REASONS[choice.finish_reason],
            }
            for choice in _choices(completion)
        ],
        "usage": usage_to_json(completion.usage),
    }


def text_chunk_to_json(chunk: router_pb2.ChatCompletionChunk, include_usage: bool) -> list[Json]:
    """The SSE events for one router chunk of a text completion (OpenAI's legacy stream shape)."""
    events: list[Json] = []
    head = {"id": chunk.id, "object": "text_completion", "created": chunk.created, "model": chunk.model}
    # Every router chunk makes an event, even an empty one: the router sends one only as a
    # stream's first, with its first token, so the client sees the answer begin.
    choice = {
        "index": chunk.index,
        "text": chunk.content_delta,
        "logprobs": _text_logprobs(chunk.logprobs),
        "finish_reason": FINISH_REASONS[chunk.finish_reason],
    }
    event: Json = {**head, "choices": [choice]}
    if include_usage:
        event["usage"] = None
    events.append(event)
    if include_usage and chunk.HasField("usage"):
        events.append({**head, "choices": [], "usage": usage_to_json(chunk.usage)})
    return events


def workers_ai_result_to_json(completion: router_pb2.ChatCompletion) -> Json:
    result: Json = {"response": completion.content, "usage": usage_to_json(completion.usage)}
    if completion.tool_calls:
        result["tool_calls"] = [
            {"name": c.name, "arguments": _arguments_object(c.arguments_json)} for c in completion.tool_calls
        ]
    return _workers_ai_envelope(result)


def _arguments_object(arguments_json: str) -> Json | str:
    """Workers AI answers a call's arguments as an object; text that is none (cut short) stays text."""
    try:
        arguments = json.loads(arguments_json)
    except json.JSONDecodeError:
        return arguments_json
    return arguments if isinstance(arguments, dict) else arguments_json


def workers_ai_chunk_to_json(chunk: router_pb2.ChatCompletionChunk) -> list[Json]:
    """Workers AI streams ``{"response": delta}`` events and puts usage on the last one."""
    event: Json = {"response": chunk.content_delta}
    if chunk.tool_call_deltas:
        # Workers AI has no fragment format: fragments go out as they come, joined by index (the
        # first of a call carries its name).
        event["tool_calls"] = [
            {"index": d.index, "name": d.name, "arguments": d.arguments_delta} for d in chunk.tool_call_deltas
        ]
    if chunk.HasField("usage"):
        event["usage"] = usage_to_json(chunk.usage)
    if len(event) == 1 and not chunk.content_delta:
        return []
    return [event]


def queued_batch_to_json(batch: router_pb2.QueuedBatch, model: str | None = None) -> Json:
    result: Json = {"request_id": batch.request_id, "status": BATCH_STATUSES[batch.status]}
    if model is not None:
        result["model"] = model
    if batch.results:
        result["responses"] = [_batch_item(i, r) for i, r in enumerate(batch.results)]
    return _workers_ai_envelope(result)


def models_to_json(response: router_pb2.ListModelsResponse) -> Json:
    return {
        "object": "list",
        "data": [
            {
                "id": card.id,
                "object": "model",
                "created": card.created,
                "owned_by": card.owned_by or "cachet",
                "context_window": card.context_window,
            }
            for card in response.models
        ],
    }


def usage_report_to_json(response: usage_pb2.QueryUsageResponse) -> Json:
    return {
        "object": "list",
        "data": [
            {
                "account_id": row.account_id or None,
                "model": row.model or None,
                "day": row.day or None,
                "session_id": row.session_id or None,
                "requests": row.requests,
                "prompt_tokens": row.prompt_tokens,
                "cached_tokens": row.cached_tokens,
                "completion_tokens": row.completion_tokens,
                "cost_picousd": row.cost_picousd,
                # Exact: a Decimal built from the integer, never a float.
                "cost_usd": format(Decimal(row.cost_picousd) * _PICO, "f"),
                "cache_savings_picousd": row.cache_savings_picousd,
            }
            for row in response.rows
        ],
    }


def _workers_ai_envelope(result: Json) -> Json:
    return {"result": result, "success": True, "errors": [], "messages": []}


def _batch_item(index: int, outcome: router_pb2.QueuedResult) -> Json:
    if outcome.HasField("error"):
        return {
            "id": index,
            "success": False,
            "errors": [{"code": 0, "message": f"{outcome.error.code}: {outcome.error.message}"}],
        }
    return {
        "id": index,
        "success": True,
        "result": workers_ai_result_to_json(outcome.completion)["result"],
        "errors": [],
    }


def _has_choice_content(chunk: router_pb2.ChatCompletionChunk) -> bool:
    return bool(
        chunk.role
        or chunk.content_delta
        or chunk.reasoning_delta
        or chunk.tool_call_deltas
        or chunk.finish_reason
        or chunk.logprobs
    )


def _choice_deltas(chunk: router_pb2.ChatCompletionChunk) -> list[Json]:
    """The chunk's choice deltas, one SSE event each.

    OpenAI streams one tool-call delta per event (a call's header, then each argument
    fragment), so a router chunk holding several becomes several events; text comes first.
    """
    text: Json = {}
    if chunk.role:
        text["role"] = chunk.role
    if chunk.content_delta or chunk.role:
        # The role chunk carries "" content, as OpenAI's does.
        text["content"] = chunk.content_delta
    if chunk.reasoning_delta:
        text["reasoning_content"] = chunk.reasoning_delta
    calls = [{"tool_calls": [_tool_call_delta(d)]} for d in chunk.tool_call_deltas]
    return [text, *calls] if text or not calls else calls


def _tool_call_delta(delta: router_pb2.ToolCallDelta) -> Json:
    out: Json = {"index": delta.index, "function": {"arguments": delta.arguments_delta}}
    if delta.id:
        out["id"] = delta.id
        out["type"] = "function"
    if delta.name:
        out["function"]["name"] = delta.name
    return out


def _token_name(token_id: int) -> str:
    # TokenLogprob carries ids only (the bridge has no tokenizer): vLLM's "token_id:<id>" rendering.
    return f"token_id:{token_id}"


def _chat_logprobs(logprobs: Any) -> Json | None:
    if not logprobs:
        return None
    return {
        "content": [
            {
                "token": _token_name(lp.token_id),
                "logprob": lp.logprob,
                "bytes": None,
                "top_logprobs": [
                    {"token": _token_name(top.token_id), "logprob": top.logprob, "bytes": None}
                    for top in lp.top
                ],
            }
            for lp in logprobs
        ]
    }


def _text_logprobs(logprobs: Any) -> Json | None:
    if not logprobs:
        return None
    return {
        "tokens": [_token_name(lp.token_id) for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{_token_name(top.token_id): top.logprob for top in lp.top} for lp in logprobs],
    }
