"""One ``DetokenizeStream`` call: generated token ids in, text deltas out.

The tokenizer service owns incremental decoding (split UTF-8 characters, leading
spaces); the router only feeds it each engine message and reads the text back.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from cachet.errors import Unavailable
from cachet.router.upstream_errors import domain_error
from cachet.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc

# The tokenizer needs only the prompt's last few tokens to decode the first output
# token as it reads after them (it keeps 5); sending a whole long prompt is waste.
PROMPT_CONTEXT_TOKENS = 16


class DetokenizeSession:
    """Text for one generation; one ``push`` at a time (each message gets exactly one answer)."""

    def __init__(
        self,
        stub: tokenizer_pb2_grpc.TokenizerServiceStub,
        model: str,
        prompt_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._call = stub.DetokenizeStream()
        self._first: tokenizer_pb2.DetokenizeStreamRequest | None = tokenizer_pb2.DetokenizeStreamRequest(
            model=model,
            prompt_token_ids=list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]),
            skip_special_tokens=skip_special_tokens,
        )

    async def push(self, token_ids: Sequence[int], *, last: bool = False) -> str:
        """Text for ``token_ids``; ``last`` also flushes what was held back and ends the call."""
        text = await self._exchange(
            tokenizer_pb2.DetokenizeStreamRequest(token_ids=list(token_ids), flush=last)
        )
        if last:
            await self._call.done_writing()
        return text

    def cancel(self) -> None:
        self._call.cancel()

    async def _exchange(self, request: tokenizer_pb2.DetokenizeStreamRequest) -> str:
        if self._first is not None:
            # The first message carries the stream's settings together with the first tokens.
            self._first.MergeFrom(request)
            request, self._first = self._first, None
        try:
            await self._call.write(request)
            response = await self._call.read()
        except grpc.aio.AioRpcError as error:
            raise domain_error(error, "tokenizer") from error
        if response is grpc.aio.EOF:
            raise Unavailable("the tokenizer service ended a detokenization stream early; retry")
        return response.text_delta
