"""The scanning every incremental parser needs.

- ``partial_marker_length``: how much of a text's tail could be the start of a
  marker, so a parser holds exactly that back instead of showing half a tag.
- ``ObjectScanner`` / ``json_object_end``: where a JSON object ends, found by
  tracking strings and nesting only (no parsing), so marker strings *inside*
  JSON strings never end a call early. The scanner takes the text in pieces, so
  a streamed object is scanned once, not once per delta.
"""

from __future__ import annotations

from collections.abc import Iterable


class NotAnObject(ValueError):
    """The text cannot be the start of a JSON object."""


def partial_marker_length(text: str, markers: Iterable[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``markers``."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


class ObjectScanner:
    """Finds the end of one JSON object whose text arrives in pieces.

    ``depth=1`` starts inside an object whose ``{`` was already read (the rest of
    a call object after its arguments). The object's text is not validated.
    """

    def __init__(self, depth: int = 0) -> None:
        self._depth = depth
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> int | None:
        """Index in ``text`` just past the object's closing brace; None while it stays open."""
        for index, char in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return index + 1
        return None


def json_object_end(text: str) -> int | None:
    """Index just past the object that ``text`` starts with; None while it is still open.

    Raises ``NotAnObject`` when ``text`` does not start with ``{``. The object's
    text is not validated here (``json.loads`` does that on the slice).
    """
    if not text:
        return None
    if text[0] != "{":
        raise NotAnObject(text[:20])
    return ObjectScanner().feed(text)


def object_opened(text: str) -> bool | None:
    """Whether ``text`` opens a JSON object the way a valid one goes on (``{`` then ``"`` or ``}``).

    None while that is not yet known (empty, or ``{`` and whitespace only). A call is
    announced only once its arguments pass this, so ``{not json}`` stays content.
    """
    if not text:
        return None
    if text[0] != "{":
        return False
    after = text[1:].lstrip()
    if not after:
        return None
    return after[0] in '"}'
