"""Turn a stream of generated token ids into text deltas that are safe to show.

Decoding token by token and concatenating breaks in two ways:

- a byte-level BPE token may hold only part of a UTF-8 character (an emoji is often
  three or four tokens), so a lone token decodes to U+FFFD;
- SentencePiece-style decoders drop the leading space of the *first* token of a
  sequence, so "▁world" alone decodes to "world", not " world".

Both are solved by decoding a short sliding window instead of single tokens::

    tokens:  [ ... already shown ... | prefix_offset ... read_offset | new ... ]
                                      `---- prefix_text ------------'
                                      `---- window_text -----------------------'

``prefix_text`` is text that was already emitted, decoded from ``prefix_offset``;
``window_text`` decodes the same start plus the new tokens. Because both decodes
start at the same token, whatever the decoder does to a sequence's first token
happens to both, and the delta is ``window_text[len(prefix_text):]``. When the
window ends in U+FFFD, the last character is still incomplete: nothing is emitted
and the tokens are kept until more bytes arrive (or until ``flush``, which emits
whatever is there, so that an invalid byte sequence at the very end still shows
as U+FFFD exactly as a full decode would).

The window starts with a few prompt tokens, so that the first generated token is
decoded as it would be after the prompt (its leading space survives).

Contract: after ``flush()``, the concatenation of every delta equals
``decode(context + output)[len(decode(context)):]``, where ``context`` is the kept
tail of the prompt; with no prompt that is ``decode(output)``. Before ``flush()``
it is a prefix of that text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHARACTER = "\ufffd"

# Prompt tokens kept in front of the output. One would do for the leading-space
# rule; a few more make sure the window starts past any multi-token character.
PROMPT_CONTEXT_TOKENS = 5

Decode = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    """Incremental decoding of one output sequence; not thread-safe (one per stream)."""

    def __init__(self, decode: Decode, prompt_token_ids: Sequence[int] = ()) -> None:
        context = (
            list(prompt_token_ids[len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS :])
            if prompt_token_ids
            else []
        )
        self._decode = decode
        self._tokens: list[int] = context
        self._context_len = len(context)
        # Invariant: _prefix_text == decode(_tokens[_prefix_offset:_read_offset]), and
        # every token before _read_offset has had its text emitted.
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = decode(context) if context else ""

    @property
    def tokens_consumed(self) -> int:
        """Output tokens whose text has been emitted in full."""
        return self._read_offset - self._context_len

    @property
    def output_token_count(self) -> int:
        return len(self._tokens) - self._context_len

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated tokens; return the text that is now certain."""
        # One step per token rather than one per batch: a batch ending in half a
        # character must not hold back the complete characters before it.
        deltas = []
        for token_id in token_ids:
            self._tokens.append(token_id)
            deltas.append(self._step(final=False))
        return "".join(deltas)

    def flush(self) -> str:
        """Emit whatever is held back, invalid trailing bytes included (as U+FFFD)."""
        return self._step(final=True)

    def _step(self, *, final: bool) -> str:
        if self._read_offset == len(self._tokens):
            return ""
        window_text = self._decode(self._tokens[self._prefix_offset :])
        if not final and window_text.endswith(REPLACEMENT_CHARACTER):
            return ""  # an incomplete character: wait for its remaining bytes
        if len(window_text) <= len(self._prefix_text):
            # The new tokens added no text (special tokens skipped, or an empty
            # piece). Mark them read without moving the window start: the window
            # still decodes to the prefix text, so the invariant holds.
            if window_text == self._prefix_text:
                self._read_offset = len(self._tokens)
            return ""
        delta = window_text[len(self._prefix_text) :]
        # Slide the window: it now starts at the first token not yet in a
        # previous window's prefix, which is a clean character boundary.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self._prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        return delta
