"""One ``DetokenizeStream`` call: generated token ids in, text deltas out.

The tokenizer service owns incremental decoding (split UTF-8 characters, leading
spaces); the router only feeds it each engine message and reads the text back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from cachet.errors import Unavailable
from cachet.router.upstream_errors import domain_error
from cachet.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc

# The tokenizer needs only the prompt's last few tokens to decode the first output
# token as it reads after them (it keeps 5); sending a whole long prompt is waste.
PROMPT_CONTEXT_TOKENS = 16


class DetokenizeSession:
    """Text for one generation; one ``push`` at a time (each message gets exactly one answer).

    The stream opens as soon as the session is made, with a message that carries only its
    settings: the router makes the session when it sends the request to the engine, so
    opening the stream (a new HTTP/2 stream, the tokenizer's session) overlaps the engine's
    prefill instead of delaying the first chunk.
    """

    def __init__(
        self,
        stub: tokenizer_pb2_grpc.TokenizerServiceStub,
        model: str,
        prompt_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._call = stub.DetokenizeStream()
        settings = tokenizer_pb2.DetokenizeStreamRequest(
            model=model,
            prompt_token_ids=list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]),
            skip_special_tokens=skip_special_tokens,
        )
        self._opening: asyncio.Task[str] | None = asyncio.create_task(self._exchange(settings))

    async def push(self, token_ids: Sequence[int], *, last: bool = False) -> str:
        """Text for ``token_ids``; ``last`` also flushes what was held back and ends the call."""
        if self._opening is not None:
            opening, self._opening = self._opening, None
            await opening  # nothing to show yet (no tokens), but it carries the stream's errors
        return await self._exchange(
            tokenizer_pb2.DetokenizeStreamRequest(token_ids=list(token_ids), flush=last), last=last
        )

    def cancel(self) -> None:
        if self._opening is not None:
            opening, self._opening = self._opening, None
            if not opening.done():
                opening.cancel()
            elif not opening.cancelled():
                opening.exception()  # retrieved: a stream cut short has nothing more to say
        self._call.cancel()

    async def _exchange(self, request: tokenizer_pb2.DetokenizeStreamRequest, *, last: bool = False) -> str:
        try:
            await self._call.write(request)
            if last:
                # Half-close while the tokenizer decodes, not after its answer is read.
                await self._call.done_writing()
            response = await self._call.read()
        except grpc.aio.AioRpcError as error:
            raise domain_error(error, "tokenizer") from error
        if response is grpc.aio.EOF:
            raise Unavailable("the tokenizer service ended a detokenization stream early; retry")
        return response.text_delta
