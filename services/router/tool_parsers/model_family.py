"""Which output format a model writes, told by its vocabulary (the tokenizer's ModelInfo).

The rule, in order:

1. Kimi K2 tool calls when the vocabulary has ``<|tool_calls_section_begin|>``
   as a special token: the model can only write that section with it, and its
   template (``kimi-k2-thinking.jinja``) renders calls that way.
2. Otherwise Hermes ``<tool_call>`` blocks: what Cachet's generic tool rendering
   teaches templates without tool support (the default model) and what
   Hermes- / Qwen-trained models write on their own.

Reasoning (``<think>...</think>``) is read when the vocabulary has ``</think>`` as
a token of its own (special, or added as text as Kimi and Qwen3 add it), or the
family is Kimi K2 (its thinking models open every answer with a think block).

Markers that are special tokens only reach the parser when detokenization keeps
special tokens; then the end-of-turn token that stopped the generation must be
left out by the caller (``stop_token_ids``), since it is not answer text.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import grpc

from cachet.router.fetched_once import FetchedOnce
from cachet.router.tool_parsers import kimi_k2, reasoning
from cachet.router.upstream_errors import domain_error
from cachet.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc


class ToolFormat(Enum):
    HERMES = "hermes"
    KIMI_K2 = "kimi_k2"


@dataclass(frozen=True)
class ModelFamily:
    tool_format: ToolFormat
    reasoning: bool
    keep_special_tokens: bool  # detokenize with special tokens: the parser's markers are ones
    stop_token_ids: frozenset[int]
    # The id of ``</think>`` where the vocabulary has it as a token: a constraint on the answer
    # of a prompt that opened a think block starts after it.
    think_close_token_id: int | None = None


def family_of(info: tokenizer_pb2.ModelInfo) -> ModelFamily:
    specials = {token.text: token.token_id for token in info.special_tokens}
    whole_tokens = {token.text: token.token_id for token in info.added_tokens} | specials
    kimi = kimi_k2.SECTION_BEGIN in specials
    thinks = kimi or reasoning.THINK_CLOSE in whole_tokens
    return ModelFamily(
        tool_format=ToolFormat.KIMI_K2 if kimi else ToolFormat.HERMES,
        reasoning=thinks,
        keep_special_tokens=kimi or reasoning.THINK_CLOSE in specials,
        stop_token_ids=frozenset(info.stop_token_ids),
        think_close_token_id=whole_tokens.get(reasoning.THINK_CLOSE),
    )


class ModelFamilies:
    """Each model's family, asked of the tokenizer service once."""

    def __init__(
        self, tokenizer: tokenizer_pb2_grpc.TokenizerServiceAsyncStub, timeout_seconds: float
    ) -> None:
        self._tokenizer = tokenizer
        self._timeout = timeout_seconds
        self._families = FetchedOnce(self._fetch)

    async def get(self, model: str) -> ModelFamily:
        return await self._families.get(model)

    async def _fetch(self, model: str) -> ModelFamily:
        try:
            info = await self._tokenizer.GetModelInfo(
                tokenizer_pb2.GetModelInfoRequest(model=model), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as error:
            raise domain_error(error, "tokenizer") from error
        return family_of(info)
