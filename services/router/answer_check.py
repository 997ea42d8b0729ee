"""A finished answer checked against the request's whole JSON schema, where decoding approximated it.

The engine's grammar cannot hold every schema exactly. It decodes ``oneOf`` as ``anyOf``
(llguidance's ``coerce_one_of``: a grammar cannot say "exactly one"), and a non-strict schema is
compiled leniently: keywords llguidance does not implement (``not``, ``dependencies``,
``uniqueItems``...) are left out of the grammar. An answer may then break the schema, and it
must not reach the caller as a valid one, so once it is finished the router validates it
(``jsonschema``) and fails the request naming the schema. Streamed, the caller has the text by
then and the stream ends with the error instead of a finish.

Which schemas are checked is llguidance's own verdict, asked here without a tokenizer with the
engine's options (as ``tool_parsers.tool_choice`` does for strict tools): a schema it reports
nothing left out of is enforced exactly and needs no check. Formats are annotations here, as
``jsonschema`` treats them by default: one llguidance knows is enforced by the grammar, an
unknown one (``datetime``, ``jsonpath``...) decodes as a plain string and is no error at check
time either; a schema approximated only by unknown formats is therefore not checked at all.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import jsonschema
import jsonschema.exceptions
import jsonschema.validators
import llguidance

from cachet.common.v1 import common_pb2
from cachet.errors import CachetError

if TYPE_CHECKING:  # a TypedDict of the stubs only; llguidance does not export it
    from llguidance._lib import JsonCompileOptions

_SCHEMA_PARAM = "response_format.json_schema.schema"
# The engine's options that decide what its grammar leaves out (cachet.engine.structured_output);
# whitespace does not. A strict schema with anything but oneOf left out never runs.
_LLGUIDANCE_OPTIONS: JsonCompileOptions = {"coerce_one_of": True, "lenient": True}
# The warning for a format decoded as a plain string: nothing the check could see either.
_UNKNOWN_FORMAT = "Unknown format"
# A schema that names no draft is read as 2020-12, which dropped ``dependencies`` (split into
# dependentRequired and dependentSchemas); llguidance still knows the keyword, and so do real
# schemas, so the default validator keeps draft 7's meaning for it.
_DEFAULT_VALIDATOR = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    {"dependencies": jsonschema.Draft7Validator.VALIDATORS["dependencies"]},
)


@dataclass
class SchemaMismatch(CachetError):
    """The answer breaks the schema where decoding only approximates it; sampling again may not."""

    status: grpc.StatusCode = grpc.StatusCode.FAILED_PRECONDITION
    error_type: str = "invalid_request_error"
    param: str = _SCHEMA_PARAM
    code_name: str = "answer_schema_mismatch"


@dataclass
class AnswerCheck:
    """Collects one choice's answer text, then validates it once the choice has stopped."""

    validator: Any
    parts: list[str] = field(default_factory=list)

    @classmethod
    def for_format(cls, response_format: common_pb2.ResponseFormat) -> AnswerCheck | None:
        """A check for a JSON schema that decoding approximates; None for what it enforces exactly."""
        if response_format.WhichOneof("format") != "json_schema":
            return None
        schema_json = response_format.json_schema.schema_json
        if not approximations(schema_json):
            return None
        schema = json.loads(schema_json)
        validator_class = jsonschema.validators.validator_for(schema, default=_DEFAULT_VALIDATOR)
        return cls(validator_class(schema))

    def feed(self, text: str) -> None:
        if text:
            self.parts.append(text)

    def verify(self) -> None:
        """Raise ``SchemaMismatch`` unless the answer is a JSON document valid for the whole schema."""
        text = "".join(self.parts)
        try:
            document = json.loads(text)
        except json.JSONDecodeError as error:
            raise SchemaMismatch(f"the answer is not JSON ({error.msg} at position {error.pos})") from None
        try:
            problem = jsonschema.exceptions.best_match(self.validator.iter_errors(document))
        except Exception as error:  # noqa: BLE001 - see below
            # jsonschema evaluating a caller's schema can fail in ways llguidance's did not (a
            # pattern in Rust syntax Python's re rejects, a reference it cannot resolve, a
            # recursion limit); whichever, the answer is unverified where decoding was not exact.
            raise SchemaMismatch(
                f"the answer could not be checked against the schema ({type(error).__name__}: {error}); "
                "decoding does not enforce all of this schema, so an unchecked answer is not returned"
            ) from None
        if problem is not None:
            where = "/".join(str(part) for part in problem.absolute_path) or "the top level"
            raise SchemaMismatch(
                f"the answer does not match the schema at {where}: {problem.message} (`{problem.validator}` "
                "is checked after decoding, which does not enforce all of this schema; sampling again "
                "may give a valid answer)"
            )


@functools.lru_cache(maxsize=256)
def approximations(schema_json: str) -> tuple[str, ...]:
    """What decoding leaves out of ``schema_json`` that a check can see, in llguidance's words.

    Empty for a schema enforced exactly, and for one the engine refuses (it names the problem).
    """
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_json, defaults=_LLGUIDANCE_OPTIONS)
    except ValueError:
        return ()
    is_error, warnings = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        return ()
    return tuple(warning for warning in warnings if not warning.startswith(_UNKNOWN_FORMAT))
