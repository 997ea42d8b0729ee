"""Grammars for structured output: what a request asks for, compiled off the step loop and cached.

A request's ``ResponseFormat`` becomes a ``GrammarSpec`` (kind + text). ``GrammarCompiler`` turns a
spec into an llguidance grammar on a small thread pool, validated against the model's tokenizer,
and caches the result by the spec's hash, so the thousandth request with the same schema pays
nothing. Each request then gets its own matcher (``grammar_matcher.RequestGrammar``), built on the
same pool: llguidance builds a matcher's lexer while the GIL is released, so neither compiling nor
matcher construction ever runs on the engine's step loop.

Why llguidance and not xgrammar: see docs/structured_outputs.md (compile ~1 ms vs 2-1,100 ms per
schema on our test set, comparable per-token mask time, and no dependencies at all).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import llguidance
from tokenizers import Tokenizer

from cachet.common.v1 import common_pb2
from cachet.engine.errors import InvalidRequest

if TYPE_CHECKING:  # a TypedDict of the stubs only; llguidance does not export it
    from llguidance._lib import JsonCompileOptions

GrammarKind = Literal["json_object", "json_schema", "regex", "ebnf"]

# Compact separators, no free whitespace: with flexible whitespace a weak (or random) model can
# spend its whole token budget on spaces and newlines inside a perfectly "valid" object.
# oneOf is decoded as anyOf (llguidance cannot express "exactly one"): real-world schemas use it
# where their alternatives rarely overlap. ``lenient``: keywords llguidance does not implement
# (``not``, ``dependencies``, ``uniqueItems``...) are left out of the grammar and unknown
# ``format``s decode as plain strings, each named in a warning instead of failing the compile.
# Either way the router checks the finished answer against the whole schema
# (cachet.router.answer_check), so an answer in the difference is an error the caller sees,
# never passed off as valid. A strict schema is held to more: see ``GrammarCompiler._compile``.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "coerce_one_of": True, "lenient": True}
# The warning llguidance gives for the oneOf approximation: the one a strict schema may carry.
_ONE_OF_WARNING = "oneOf not fully supported"
# "Any JSON object" is the empty object schema: llguidance expands it to the full JSON value grammar.
_ANY_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match. ``strict`` (json_schema only): unsupported keywords are errors."""

    kind: GrammarKind
    text: str
    strict: bool = False

    @property
    def key(self) -> str:
        """The cache key: equal specs compile to equal grammars."""
        digest = hashlib.sha256(f"{self.kind}\0{int(self.strict)}\0{self.text}".encode())
        return digest.hexdigest()

    def __repr__(self) -> str:
        # Schemas can be large and may carry customer text: logs get the kind and hash only.
        return f"GrammarSpec({self.kind}, {self.key[:12]})"


def grammar_spec_from_proto(response_format: common_pb2.ResponseFormat) -> GrammarSpec | None:
    """The proto oneof -> a spec; None for free text. InvalidRequest for what is wrong on its face."""
    which = response_format.WhichOneof("format")
    if which is None or which == "text":
        return None
    if which == "json_object":
        return GrammarSpec("json_object", _ANY_OBJECT_SCHEMA)
    if which == "json_schema":
        schema = response_format.json_schema
        return GrammarSpec("json_schema", _parse_schema(schema.schema_json), strict=schema.strict)
    text = getattr(response_format, which)
    if not text:
        raise InvalidRequest(f"response_format.{which} must not be empty")
    return GrammarSpec(which, text)


def _parse_schema(schema_json: str) -> str:
    """Compact JSON text of a schema (so spacing does not split the cache).

    Key order is kept: llguidance generates object properties in the schema's order (as
    OpenAI's structured outputs do), so sorting keys would change the output, not just the key.
    """
    try:
        schema = json.loads(schema_json)
    except json.JSONDecodeError as error:
        raise InvalidRequest(f"response_format.json_schema.schema is not valid JSON: {error}") from error
    if not isinstance(schema, dict | bool):
        raise InvalidRequest("response_format.json_schema.schema must be a JSON object")
    return json.dumps(schema, separators=(",", ":"))


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated llguidance grammar; immutable, shared by every request with the same spec."""

    spec: GrammarSpec
    grammar: str


class GrammarCompiler:
    """Compiles specs on a thread pool, caches them (LRU by spec hash), and builds per-request matchers.

    Thread-safe: the servicer (asyncio) submits, pool threads compile, the engine loop only polls
    futures. Failed compiles are cached too: the same schema fails the same way every time.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        max_workers: int = 2,
        cache_size: int = 512,
    ) -> None:
        if not eos_token_ids:
            raise ValueError("a grammar needs an end-of-sequence token to finish on")
        # n_vocab is the model's (embedding rows may exceed the tokenizer's vocabulary): masks must
        # cover every logit, and padding ids are simply never allowed.
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        self.vocab_size = vocab_size
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="grammar")
        self._cache: OrderedDict[str, concurrent.futures.Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> concurrent.futures.Future[CompiledGrammar]:
        """The (cached) compile of ``spec``; its exception, if any, is an InvalidRequest."""
        with self._lock:
            future = self._cache.get(spec.key)
            if future is not None:
                self._cache.move_to_end(spec.key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec.key] = future
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def new_matcher(self, spec: GrammarSpec) -> concurrent.futures.Future[llguidance.LLMatcher]:
        """A fresh matcher for one request, built on the pool once the spec has compiled."""
        result: concurrent.futures.Future[llguidance.LLMatcher] = concurrent.futures.Future()

        def on_compiled(compiled: concurrent.futures.Future[CompiledGrammar]) -> None:
            error = compiled.exception()
            if error is not None:
                result.set_exception(error)
                return
            built = self._pool.submit(self._matcher, compiled.result())
            built.add_done_callback(lambda f: _copy_outcome(f, result))

        self.compile(spec).add_done_callback(on_compiled)
        return result

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        grammar = _to_llguidance(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise InvalidRequest(f"invalid {_describe(spec)}: {messages[0]}")
        unsupported = [message for message in messages if not message.startswith(_ONE_OF_WARNING)]
        if spec.strict and unsupported:
            # OpenAI's strict mode promises the whole schema is enforced while decoding: an ignored
            # keyword or format breaks that, so strict refuses them all, by name. Not strict, they
            # are decoded leniently and the router checks the answer (see _JSON_OPTIONS).
            raise InvalidRequest(f"{_describe(spec)} uses unsupported features: {'; '.join(unsupported)}")
        return CompiledGrammar(spec, grammar)

    def _matcher(self, compiled: CompiledGrammar) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, compiled.grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"invalid {_describe(compiled.spec)}: {matcher.get_error()}")
        return matcher


def _to_llguidance(spec: GrammarSpec) -> str:
    try:
        if spec.kind in ("json_schema", "json_object"):
            return llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=_JSON_OPTIONS)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.text)
        # GBNF (llama.cpp's EBNF dialect) or Lark; llguidance converts either to Lark.
        return llguidance.grammar_from("ebnf", spec.text)
    except ValueError as error:
        raise InvalidRequest(f"invalid {_describe(spec)}: {error}") from error


def _describe(spec: GrammarSpec) -> str:
    return {
        "json_object": "response_format json_object",
        "json_schema": "response_format.json_schema.schema",
        "regex": "response_format.regex",
        "ebnf": "response_format.ebnf grammar",
    }[spec.kind]


def _copy_outcome(source: concurrent.futures.Future, target: concurrent.futures.Future) -> None:
    error = source.exception()
    if error is not None:
        target.set_exception(error)
    else:
        target.set_result(source.result())
