"""One request's grammar state, and the step's token masks for every constrained request.

Contract with the engine loop (the only thread that touches a ``RequestGrammar`` after it is built):

- ``ready`` turns true once the pool has compiled the spec and built this request's matcher; the
  scheduler admits only ready requests. A failed build is never ready (``error`` says why), so a
  compile that fails between two looks of the engine cannot slip into a batch.
- Before each step that samples for the request, ``sync(output_token_ids)`` makes the matcher's
  state the one after exactly those tokens. The engine normally keeps them equal token by token;
  sync is the safety net for anything that rewinds output (it resets and replays).
- ``accept(token)`` after each sampled token; ``is_terminated`` then says the grammar admits no
  further token, which ends the request with FINISH_REASON_STOP.
- A grammar that ``starts_after`` a token (the ``</think>`` of a think block the prompt opened)
  is not ``constraining`` until that token is sampled: the model reasons freely, and only the
  answer after the block is held to the grammar (as vLLM does with a reasoning parser).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator, Mapping, Sequence

import llguidance
import llguidance.numpy
import torch

from cachet.engine.structured_output import GrammarCompiler, GrammarSpec


class RequestGrammar:
    """The matcher of one request, from its (pending) construction to its last accepted token."""

    def __init__(
        self,
        spec: GrammarSpec,
        matcher: concurrent.futures.Future[llguidance.LLMatcher],
        *,
        starts_after: int | None = None,
    ) -> None:
        self.spec = spec
        self._future = matcher
        self._matcher: llguidance.LLMatcher | None = None
        self._starts_after = starts_after
        # Output tokens looked at since the last reset (the matcher consumed those after the
        # start); compared with the request's output by ``sync``.
        self.num_accepted = 0
        self.constraining = starts_after is None

    @classmethod
    def create(
        cls, compiler: GrammarCompiler, spec: GrammarSpec, *, starts_after: int | None = None
    ) -> RequestGrammar:
        """Start compiling (or reuse the cached compile) and building this request's matcher."""
        return cls(spec, compiler.new_matcher(spec), starts_after=starts_after)

    @property
    def ready(self) -> bool:
        """Compiled and built: the matcher can be used."""
        return self._future.done() and self._future.exception() is None

    def on_ready(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` (on a pool thread, or now) once built or failed."""
        self._future.add_done_callback(lambda _: callback())

    @property
    def error(self) -> str | None:
        """Why the grammar could not be built, once that is known; None while building or once built."""
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
        self.constraining = self._starts_after is None
        if output_token_ids:
            self._consume(list(output_token_ids))

    def accept(self, token_id: int) -> None:
        self._consume([token_id])

    @property
    def is_terminated(self) -> bool:
        """No token but end-of-sequence can follow: the output is complete."""
        return self.constraining and self.matcher.is_stopped()

    def _consume(self, token_ids: list[int]) -> None:
        if not self.constraining:
            assert self._starts_after is not None  # only a grammar that starts after a token waits
            try:
                start = token_ids.index(self._starts_after) + 1
            except ValueError:
                self.num_accepted += len(token_ids)
                return
            self.num_accepted += start
            self.constraining = True
            token_ids = token_ids[start:]
            if not token_ids:
                return
        # consume_tokens answers whether every token was accepted (a bool, not a count).
        if not self.matcher.consume_tokens(token_ids) or self.matcher.is_error():
            # Tokens came from masked logits, so this is an engine bug, not a user error.
            raise RuntimeError(f"grammar {self.spec!r} rejected sampled tokens: {self.matcher.get_error()}")
        self.num_accepted += len(token_ids)


class StepMasks(Mapping[str, torch.Tensor]):
    """One step's masks, request id -> bool [vocab] (True = allowed), being filled in the background.

    Ids, length and iteration answer at once; reading a mask waits for the fill. The runner reads
    masks only after the model's forward, so the fill (llguidance releases the GIL) overlaps it.
    Until ``wait()`` returns, the matchers belong to the fill: nothing may ``accept`` or ``sync``.
    """

    def __init__(self, rows: dict[str, int], allowed: concurrent.futures.Future[torch.Tensor]) -> None:
        self._rows = rows
        self._allowed = allowed

    def __getitem__(self, request_id: str) -> torch.Tensor:
        return self._allowed.result()[self._rows[request_id]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def wait(self) -> None:
        """Block until the fill is over (successful or not): the matchers are the caller's again."""
        concurrent.futures.wait([self._allowed])


class MaskBuilder:
    """Fills every constrained request's token mask for one step, as bool [vocab] rows.

    llguidance writes packed int32 bitmasks (bit j of word i = token 32*i + j) with its own thread
    pool, one row per request; one vectorised unpack turns the whole batch into bool rows. ``start``
    does this on a background thread, so it runs while the model computes the step's logits.
    """

    def __init__(self, vocab_size: int, num_threads: int = 2) -> None:
        self.vocab_size = vocab_size
        self._executor = llguidance.LLExecutor(num_threads)
        # One fill at a time (steps are sequential), so the packed buffer is reused across steps.
        self._filler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        # llguidance's numpy helpers, not its torch ones: the same fill, and importing
        # llguidance.torch runs a torch.compile decorator that loads dynamo, about 3.5 s of every
        # engine start on a 2-core host. The array is shared with torch without a copy.
        self._packed = torch.from_numpy(llguidance.numpy.allocate_token_bitmask(0, vocab_size))
        self._bits = torch.tensor([1 << bit for bit in range(32)], dtype=torch.int64).to(torch.int32)

    def start(self, grammars: Mapping[str, RequestGrammar]) -> StepMasks:
        """Begin filling the masks of ``grammars`` (ready and synced); read them from the answer."""
        rows = {request_id: row for row, request_id in enumerate(grammars)}
        if not rows:
            nothing: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()
            nothing.set_result(torch.empty(0, self.vocab_size, dtype=torch.bool))
            return StepMasks(rows, nothing)
        matchers = [(grammar.matcher, row) for row, grammar in enumerate(grammars.values())]
        return StepMasks(rows, self._filler.submit(self._fill, matchers))

    def build(self, grammars: Mapping[str, RequestGrammar]) -> dict[str, torch.Tensor]:
        """The same masks, filled now: request id -> bool [vocab]."""
        return dict(self.start(grammars))

    def shutdown(self) -> None:
        self._filler.shutdown(wait=True)

    def _fill(self, matchers: list[tuple[llguidance.LLMatcher, int]]) -> torch.Tensor:
        batch = len(matchers)
        if self._packed.shape[0] < batch:
            self._packed = torch.from_numpy(llguidance.numpy.allocate_token_bitmask(batch, self.vocab_size))
        packed = self._packed[:batch]
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, matchers, packed.numpy())
        # [batch, words, 32] bit tests -> [batch, 32 * words], trimmed to the vocabulary. A fresh
        # tensor each step: callers may keep a step's rows.
        return (packed.unsqueeze(-1) & self._bits).ne(0).view(batch, -1)[:, : self.vocab_size]
