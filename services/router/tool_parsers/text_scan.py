"""Two scanning helpers every incremental parser needs.

- ``partial_marker_length``: how much of a text's tail could be the start of a
  marker, so a parser holds exactly that back instead of showing half a tag.
- ``json_object_end``: where a JSON object that starts a text ends, found by
  tracking strings and nesting only (no parsing), so marker strings *inside*
  JSON strings never end a call early.
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


def json_object_end(text: str) -> int | None:
    """Index just past the object that ``text`` starts with; None while it is still open.

    Raises ``NotAnObject`` when ``text`` does not start with ``{``. The object's
    text is not validated here (``json.loads`` does that on the slice).
    """
    if not text:
        return None
    if text[0] != "{":
        raise NotAnObject(text[:20])
    depth = 0
    in_string = False
    escaped = False
    for index, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return index + 1
    return None
