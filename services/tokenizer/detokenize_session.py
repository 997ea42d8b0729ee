"""One DetokenizeStream call's state: which model, what was shown, whether it is over."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cachet.errors import InvalidArgument
from cachet.tokenizer.tokenizer_model import TokenizerModel


@dataclass(frozen=True)
class Delta:
    """Text that became certain with one request message."""

    text: str
    tokens_consumed: int


class DetokenizeSession:
    """Feeds generated tokens to one incremental detokenizer, until flushed."""

    def __init__(
        self, model: TokenizerModel, prompt_token_ids: Sequence[int], *, skip_special_tokens: bool
    ) -> None:
        model.check_token_ids(prompt_token_ids, "prompt_token_ids")
        self._model = model
        self._detokenizer = model.detokenizer(prompt_token_ids, skip_special_tokens=skip_special_tokens)
        self.flushed = False

    def feed(self, token_ids: Sequence[int], *, flush: bool) -> Delta:
        """Add tokens (and on the last message, flush); return the new text."""
        if self.flushed:
            raise InvalidArgument(
                "flush: the stream was already flushed; no more tokens can follow", param="flush"
            )
        self._model.check_token_ids(token_ids, "token_ids")
        text = self._detokenizer.add(token_ids)
        if flush:
            text += self._detokenizer.flush()
            self.flushed = True
        return Delta(text=text, tokens_consumed=self._detokenizer.tokens_consumed)
