"""Content text without the whitespace that only separates tool calls.

Models put newlines around their call blocks; OpenAI's answer for a turn that is
only calls has ``content: null``, not ``"\\n\\n"``. So trailing whitespace of
content is held back until more content follows (then it is shown), and dropped
when a call follows; whitespace right after a call is dropped. The result
depends only on the whole text, not on how it was split into deltas.
"""

from __future__ import annotations


class ContentGate:
    def __init__(self) -> None:
        self._pending = ""  # whitespace that may yet turn out to sit next to a call
        self._after_call = False
        self.calls = 0

    def text(self, text: str) -> str:
        """What of ``text`` to show as content now."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return ""
            self._after_call = False
        stripped = text.rstrip()
        if not stripped:
            self._pending += text
            return ""
        shown = self._pending + stripped
        self._pending = text[len(stripped) :]
        return shown

    def call_made(self) -> None:
        self._pending = ""
        self._after_call = True
        self.calls += 1

    def finish(self) -> str:
        """Held whitespace belongs to the answer only when the turn made no calls."""
        pending, self._pending = self._pending, ""
        return pending if self.calls == 0 else ""
