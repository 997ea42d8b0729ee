"""The TokenizerService gRPC servicer: proto in, domain call, proto out.

Tokenizer work (encode, decode, template rendering, hashing) runs in worker
threads via ``asyncio.to_thread`` so that a 100k-token prompt never stalls the
event loop that every other call shares; the Rust tokenizer releases the GIL
for its heavy part. A detokenize step's few tokens are the exception: they are
decoded inline (see ``_INLINE_TOKENS``). Domain errors (``InvalidArgument``, ``NotFound``) are raised
as they are; ``cachet.grpc_server``'s interceptor maps them to status codes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc

from cachet.block_hash import DEFAULT_BLOCK_SIZE, block_hashes
from cachet.errors import InvalidArgument
from cachet.tokenizer.chat_messages import image_parts, messages_to_dicts, tools_to_dicts
from cachet.tokenizer.detokenize_session import DetokenizeSession
from cachet.tokenizer.image_cache import PreparedImageCache
from cachet.tokenizer.image_placeholders import expand_placeholders
from cachet.tokenizer.images import ImageLimits, prompt_images
from cachet.tokenizer.model_info import ModelInfo
from cachet.tokenizer.model_registry import ModelRegistry
from cachet.tokenizer.template_variables import ReasoningControls
from cachet.tokenizer.tokenizer_model import RenderedChat, TokenizerModel
from cachet.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc

_T = TypeVar("_T")

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"].full_name


# A detokenize message carries one engine step's tokens (a handful): decoding them takes
# microseconds, far less than a hop to a worker thread and back, which on a busy box costs
# a millisecond of every streamed chunk. Only messages longer than this go to a thread.
_INLINE_TOKENS = 64


async def _small_work(tokens: int, function: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    if tokens <= _INLINE_TOKENS:
        return function(*args, **kwargs)
    return await asyncio.to_thread(function, *args, **kwargs)


def _check_text(text: str, field: str, max_chars: int) -> None:
    if not text:
        raise InvalidArgument(f"{field}: must not be empty", param=field)
    if len(text) > max_chars:
        raise InvalidArgument(
            f"{field}: {len(text)} characters is over the limit of {max_chars}", param=field
        )


def _model_info_proto(info: ModelInfo) -> tokenizer_pb2.ModelInfo:
    return tokenizer_pb2.ModelInfo(
        model=info.model_id,
        context_window=info.context_window,
        vocab_size=info.vocab_size,
        stop_token_ids=info.stop_token_ids,
        special_tokens=[
            tokenizer_pb2.SpecialToken(text=special.text, token_id=special.token_id)
            for special in info.special_tokens
        ],
        template_supports_tools=info.template_supports_tools,
        bos_token_id=info.bos_token_id,
        added_tokens=[
            tokenizer_pb2.SpecialToken(text=t.text, token_id=t.token_id) for t in info.added_tokens
        ],
    )


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    """Thin adapter over a ``ModelRegistry`` and a ``PreparedImageCache``; holds no per-call state
    of its own."""

    def __init__(
        self,
        registry: ModelRegistry,
        *,
        max_input_chars: int,
        image_limits: ImageLimits | None = None,
        image_cache: PreparedImageCache | None = None,
    ) -> None:
        self._registry = registry
        self._max_input_chars = max_input_chars
        self._image_limits = image_limits or ImageLimits()
        # Shared by every call (the worker threads too): it holds prepared images, not requests.
        self._image_cache = image_cache if image_cache is not None else PreparedImageCache()

    def register(self, server: grpc.aio.Server) -> None:
        tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(self, server)

    async def Encode(
        self, request: tokenizer_pb2.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.EncodeResponse:
        model = self._registry.get(request.model)
        _check_text(request.text, "text", self._max_input_chars)
        token_ids = await asyncio.to_thread(
            model.encode, request.text, add_special_tokens=request.add_special_tokens
        )
        return tokenizer_pb2.EncodeResponse(token_ids=token_ids)

    async def Decode(
        self, request: tokenizer_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.DecodeResponse:
        model = self._registry.get(request.model)
        text = await asyncio.to_thread(self._decode, model, request)
        return tokenizer_pb2.DecodeResponse(text=text)

    @staticmethod
    def _decode(model: TokenizerModel, request: tokenizer_pb2.DecodeRequest) -> str:
        # The vocabulary check walks every id: off the loop too, for long sequences.
        model.check_token_ids(request.token_ids, "token_ids")
        return model.decode(request.token_ids, skip_special_tokens=request.skip_special_tokens)

    async def ApplyChatTemplate(
        self, request: tokenizer_pb2.ApplyChatTemplateRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.ApplyChatTemplateResponse:
        model = self._registry.get(request.model)
        size = sum(len(part.text) for message in request.messages for part in message.content)
        if size > self._max_input_chars:
            raise InvalidArgument(
                f"messages: {size} characters of content is over the limit of {self._max_input_chars}",
                param="messages",
            )
        rendered = await asyncio.to_thread(self._render, model, request)
        return tokenizer_pb2.ApplyChatTemplateResponse(
            prompt=rendered.prompt,
            token_ids=rendered.token_ids,
            prefix_token_counts=rendered.prefix_token_counts,
            images=rendered.images,
        )

    def _render(self, model: TokenizerModel, request: tokenizer_pb2.ApplyChatTemplateRequest) -> RenderedChat:
        # Images (decoding, fetching, resizing) only once the conversation itself is valid.
        vision = model.info.vision
        messages = messages_to_dicts(request.messages, vision.placeholder_text if vision else None)
        tools = tools_to_dicts(request.tools)
        images = (
            prompt_images(
                image_parts(request.messages),
                vision,
                self._image_limits,
                self._image_cache,
                with_pixels=not request.count_only,
            )
            if vision
            else []
        )
        rendered = model.apply_chat_template(
            messages,
            tools,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            reasoning=ReasoningControls.from_proto(request.reasoning),
            prefix_messages=request.prefix_message_counts,
        )
        return expand_placeholders(rendered, vision, images) if vision else rendered

    async def DetokenizeStream(
        self,
        request_iterator: AsyncIterator[tokenizer_pb2.DetokenizeStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[tokenizer_pb2.DetokenizeStreamResponse]:
        # One response per request message, so a caller can pair them up.
        session: DetokenizeSession | None = None
        async for request in request_iterator:
            if session is None:
                model = self._registry.get(request.model)
                session = await _small_work(
                    len(request.prompt_token_ids),
                    DetokenizeSession,
                    model,
                    request.prompt_token_ids,
                    skip_special_tokens=request.skip_special_tokens,
                )
            elif request.model or request.prompt_token_ids:
                field = "model" if request.model else "prompt_token_ids"
                raise InvalidArgument(f"{field}: set on the first message of a stream only", param=field)
            delta = await _small_work(
                len(request.token_ids), session.feed, request.token_ids, flush=request.flush
            )
            yield tokenizer_pb2.DetokenizeStreamResponse(
                text_delta=delta.text, tokens_consumed=delta.tokens_consumed
            )

    async def ExportTokenizer(
        self, request: tokenizer_pb2.ExportTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.ExportTokenizerResponse:
        model = self._registry.get(request.model)
        # A few MB of JSON to serialise: off the loop.
        tokenizer_json = await asyncio.to_thread(model.tokenizer_json)
        return tokenizer_pb2.ExportTokenizerResponse(
            model=model.model_id, tokenizer_json=tokenizer_json, vocab_size=model.info.vocab_size
        )

    async def CountTokens(
        self, request: tokenizer_pb2.CountTokensRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.CountTokensResponse:
        model = self._registry.get(request.model)
        _check_text(request.text, "text", self._max_input_chars)
        count = await asyncio.to_thread(model.count_tokens, request.text)
        return tokenizer_pb2.CountTokensResponse(count=count)

    async def BlockHashes(
        self, request: tokenizer_pb2.BlockHashesRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.BlockHashesResponse:
        # Seed with the id of the model actually used: an empty request id means the default one.
        model = self._registry.get(request.model)
        block_size = request.block_size or DEFAULT_BLOCK_SIZE
        hashes = await asyncio.to_thread(
            block_hashes,
            request.token_ids,
            model.model_id,
            block_size=block_size,
            cache_salt=request.cache_salt,
        )
        return tokenizer_pb2.BlockHashesResponse(block_hashes=hashes, block_size=block_size)

    async def GetModelInfo(
        self, request: tokenizer_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.ModelInfo:
        return _model_info_proto(self._registry.get(request.model).info)

    async def ListModels(
        self, request: tokenizer_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.ListModelsResponse:
        return tokenizer_pb2.ListModelsResponse(
            models=[_model_info_proto(m.info) for m in self._registry.models()]
        )
