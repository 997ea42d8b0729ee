"""Requests checked and turned into prompt token ids.

The router is the boundary that validates a request: a model, messages, a prompt, every
sampling value and the context window, each refusal INVALID_ARGUMENT naming its field. The
ranges and the window rule are ``cachet.sampling_ranges``'s, which the engine applies again
to what reaches it directly, so the two cannot disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from cachet import sampling_ranges
from cachet.common.v1 import common_pb2
from cachet.engine.v1 import engine_pb2
from cachet.errors import InvalidArgument
from cachet.router.cache_retention import breakpoint_messages, validate_breakpoints, validate_retention
from cachet.router.cache_scope import validate_cache_salt
from cachet.router.tool_parsers.reasoning import PromptReasoning, prompt_reasoning
from cachet.router.upstream_errors import domain_error
from cachet.router.v1 import router_pb2
from cachet.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def validate_model(model: str) -> None:
    if not model:
        raise InvalidArgument("model is required", param="model")


def validate_chat(request: router_pb2.ChatCompletionRequest) -> None:
    validate_model(request.model)
    if not request.messages:
        raise InvalidArgument("messages must hold at least one message", param="messages")
    for index, message in enumerate(request.messages):
        if message.role not in ROLES:
            raise InvalidArgument(
                f"messages[{index}].role must be one of {', '.join(sorted(ROLES))}; got {message.role!r}",
                param=f"messages[{index}].role",
            )
    sampling_ranges.check_sampling(request.sampling)
    validate_cache_salt(request.cache_salt)
    validate_choices(request.n)
    validate_retention(request.cache_retention)
    validate_breakpoints(request)


def validate_completion(request: router_pb2.CompletionRequest) -> None:
    validate_model(request.model)
    if bool(request.prompt) == bool(request.prompt_token_ids):
        raise InvalidArgument("give exactly one of prompt and prompt_token_ids", param="prompt")
    sampling_ranges.check_sampling(request.sampling)
    validate_cache_salt(request.cache_salt)
    validate_choices(request.n)
    validate_retention(request.cache_retention)


def validate_choices(n: int) -> None:
    if n > sampling_ranges.MAX_CHOICES:
        raise InvalidArgument(f"n must be at most {sampling_ranges.MAX_CHOICES}", param="n")


def check_context_window(
    prompt_tokens: int,
    sampling: common_pb2.SamplingParams,
    engine: engine_pb2.EngineInfo,
    prompt_param: str,
    *,
    clamp_max_tokens: bool,
) -> None:
    """Refuse prompts the model cannot take, before any replica spends time on them.

    A ``max_tokens`` past what the window leaves is cut to fit (``clamp_max_tokens``, and the
    answer ends with finish_reason ``length`` if it gets there), as llama.cpp's server does:
    agents send their own model's output limit (OpenCode: 32,000) whatever model serves them,
    and a refusal fails their very first request. Off, it is OpenAI's 400."""
    window = engine.context_window
    if not window:
        return
    if clamp_max_tokens and sampling.HasField("max_tokens") and prompt_tokens < window:
        sampling.max_tokens = min(sampling.max_tokens, window - prompt_tokens)
    max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else None
    sampling_ranges.check_context_window(
        prompt_tokens, max_tokens, window, model=engine.model, prompt_param=prompt_param
    )


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation's tokens, and where each of its cache breakpoints ends: (prompt
    tokens up to it, its retention), in the request's order; its images, already expanded into
    their placeholder tokens."""

    token_ids: list[int]
    breakpoints: list[tuple[int, router_pb2.CacheRetention.ValueType]]
    images: tuple[common_pb2.ImageInput, ...] = ()
    # Whether the generation prompt opened (or wrote empty) the model's think block.
    reasoning: PromptReasoning = PromptReasoning.UNOPENED


class PromptBuilder:
    """Chat templates and plain prompts, through the tokenizer service."""

    def __init__(
        self, tokenizer: tokenizer_pb2_grpc.TokenizerServiceAsyncStub, timeout_seconds: float
    ) -> None:
        self._tokenizer = tokenizer
        self._timeout = timeout_seconds

    async def chat(
        self, request: router_pb2.ChatCompletionRequest, tools: Sequence[common_pb2.Tool] | None = None
    ) -> ChatPrompt:
        """``tools`` replaces the request's own (``tool_choice: none`` offers none)."""
        counts = breakpoint_messages(request.cache_breakpoints)
        template = tokenizer_pb2.ApplyChatTemplateRequest(
            model=request.model,
            messages=request.messages,
            tools=request.tools if tools is None else tools,
            add_generation_prompt=True,
            reasoning=request.reasoning,
            prefix_message_counts=counts,
        )
        try:
            rendered = await self._tokenizer.ApplyChatTemplate(template, timeout=self._timeout)
        except grpc.aio.AioRpcError as error:
            raise domain_error(error, "tokenizer") from error
        # A tokenizer older than breakpoints answers no counts: then they retain nothing.
        ends = dict(zip(counts, rendered.prefix_token_counts, strict=False))
        breakpoints = [(ends.get(b.messages, 0), b.retention) for b in request.cache_breakpoints]
        return ChatPrompt(
            list(rendered.token_ids), breakpoints, tuple(rendered.images), prompt_reasoning(rendered.prompt)
        )

    async def completion(self, request: router_pb2.CompletionRequest) -> list[int]:
        if request.prompt_token_ids:
            return list(request.prompt_token_ids)
        encode = tokenizer_pb2.EncodeRequest(
            model=request.model, text=request.prompt, add_special_tokens=True
        )
        try:
            encoded = await self._tokenizer.Encode(encode, timeout=self._timeout)
        except grpc.aio.AioRpcError as error:
            raise domain_error(error, "tokenizer") from error
        return list(encoded.token_ids)
