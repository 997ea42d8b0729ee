"""Generated token ids to text deltas, decoded in the router's own process.

The decoding is the tokenizer service's all the same: ``ExportTokenizer`` hands
over the model's tokenizer exactly as that service loaded it (special-token flags
included), so the text equals its ``Decode``, and the incremental algorithm is the
shared ``cachet.incremental_detokenizer``. Only where it runs changed: an engine
step's few tokens decode here in about a microsecond, while a ``DetokenizeStream``
exchange with another process cost every request half a millisecond and the
tokenizer's CPU on a shared machine (docs/ARCHITECTURE.md, "Router").
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
from tokenizers import Tokenizer

from cachet.incremental_detokenizer import IncrementalDetokenizer
from cachet.router.fetched_once import FetchedOnce
from cachet.router.upstream_errors import domain_error
from cachet.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc


class Detokenizers:
    """Makes a model's incremental detokenizers from its tokenizer, fetched once."""

    def __init__(
        self, tokenizer: tokenizer_pb2_grpc.TokenizerServiceAsyncStub, timeout_seconds: float
    ) -> None:
        self._stub = tokenizer
        self._timeout = timeout_seconds
        self._tokenizers = FetchedOnce(self._fetch)

    async def new(
        self, model: str, prompt_token_ids: Sequence[int], *, skip_special_tokens: bool
    ) -> IncrementalDetokenizer:
        tokenizer = await self._tokenizers.get(model)

        def decode(token_ids: Sequence[int]) -> str:
            return tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

        return IncrementalDetokenizer(decode, prompt_token_ids)

    async def _fetch(self, model: str) -> Tokenizer:
        try:
            reply = await self._stub.ExportTokenizer(
                tokenizer_pb2.ExportTokenizerRequest(model=model), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as error:
            raise domain_error(error, "tokenizer") from error
        # Parsing a few MB of JSON takes ~0.1 s: off the event loop.
        return await asyncio.to_thread(Tokenizer.from_str, reply.tokenizer_json)
