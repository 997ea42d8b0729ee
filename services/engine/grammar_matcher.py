"""One request's grammar state, and the step's token masks for every constrained request.

Contract with the engine loop (the only thread that touches a ``RequestGrammar`` after it is built):

- ``ready`` turns true once the pool has compiled the spec and built this request's matcher (or
  failed: then ``error`` says why). The scheduler does not admit a request before that.
- Before each step that samples for the request, ``sync(output_token_ids)`` makes the matcher's
  state the one after exactly those tokens. The engine normally keeps them equal token by token;
  sync is the safety net for anything that rewinds output (it resets and replays).
- ``accept(token)`` after each sampled token; ``is_terminated`` then says the grammar admits no
  further token, which ends the request with FINISH_REASON_STOP.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping, Sequence

import llguidance
import llguidance.torch
import torch

from cachet.engine.structured_output import GrammarCompiler, GrammarSpec


class RequestGrammar:
    """The matcher of one request, from its (pending) construction to its last accepted token."""

    def __init__(self, spec: GrammarSpec, matcher: concurrent.futures.Future[llguidance.LLMatcher]) -> None:
        self.spec = spec
        self._future = matcher
        self._matcher: llguidance.LLMatcher | None = None
        # Tokens consumed since the last reset; compared with the request's output by ``sync``.
        self.num_accepted = 0

    @classmethod
    def create(cls, compiler: GrammarCompiler, spec: GrammarSpec) -> RequestGrammar:
        """Start compiling (or reuse the cached compile) and building this request's matcher."""
        return cls(spec, compiler.new_matcher(spec))

    @property
    def ready(self) -> bool:
        """Compiled and built, or failed; either way nothing is left to wait for."""
        return self._future.done()

    def on_ready(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` (on a pool thread, or now) once ``ready``."""
        self._future.add_done_callback(lambda _: callback())

    @property
    def error(self) -> str | None:
        """Why the grammar could not be built, once ``ready``; None if it was."""
        if not self._future.done():
            return None
        error = self._future.exception()
        return None if error is None else str(error)

    @property
    def matcher(self) -> llguidance.LLMatcher:
        if self._matcher is None:
            self._matcher = self._future.result(timeout=0)
        return self._matcher

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Make the matcher's state the one after ``output_token_ids`` (reset + replay if it is not)."""
        if self.num_accepted == len(output_token_ids):
            return
        self.matcher.reset()
        self.num_accepted = 0
        if output_token_ids:
            self._consume(list(output_token_ids))

    def accept(self, token_id: int) -> None:
        self._consume([token_id])

    @property
    def is_terminated(self) -> bool:
        """No token but end-of-sequence can follow: the output is complete."""
        return self.matcher.is_stopped()

    def _consume(self, token_ids: list[int]) -> None:
        # consume_tokens answers whether every token was accepted (a bool, not a count).
        if not self.matcher.consume_tokens(token_ids) or self.matcher.is_error():
            # Tokens came from masked logits, so this is an engine bug, not a user error.
            raise RuntimeError(f"grammar {self.spec!r} rejected sampled tokens: {self.matcher.get_error()}")
        self.num_accepted += len(token_ids)


class MaskBuilder:
    """Fills every constrained request's token mask for one step, in parallel, as bool [vocab] rows.

    llguidance writes packed int32 bitmasks (bit j of word i = token 32*i + j) from its own threads;
    one vectorised unpack turns the whole batch into the bool rows the runner's mask hook takes.
    """

    def __init__(self, vocab_size: int, num_threads: int = 2) -> None:
        self.vocab_size = vocab_size
        self._executor = llguidance.LLExecutor(num_threads)
        self._shifts = torch.arange(32, dtype=torch.int32)

    def build(self, grammars: Mapping[str, RequestGrammar]) -> dict[str, torch.Tensor]:
        """request id -> bool [vocab], True = allowed; ``grammars`` must be ready and synced."""
        if not grammars:
            return {}
        ids = list(grammars)
        bitmask = llguidance.torch.allocate_token_bitmask(len(ids), self.vocab_size)
        matchers = [(grammars[rid].matcher, row) for row, rid in enumerate(ids)]
        llguidance.torch.fill_next_token_bitmask_par(self._executor, matchers, bitmask)
        allowed = ((bitmask.unsqueeze(-1) >> self._shifts) & 1).view(len(ids), -1)[:, : self.vocab_size]
        allowed = allowed.bool()
        return {rid: allowed[row] for row, rid in enumerate(ids)}
