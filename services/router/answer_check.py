"""A finished answer checked against the request's whole JSON schema, where decoding approximated it.

The engine decodes a schema's ``oneOf`` as ``anyOf`` (llguidance's ``coerce_one_of``): the
grammar cannot say "exactly one", so an answer may match two alternatives, which the schema
forbids. Such an answer must not reach the caller as a valid one, so once it is finished the
router validates it (``jsonschema``) and fails the request naming the schema. Streamed, the
caller has the text by then and the stream ends with the error instead of a finish. Only
schemas that use ``oneOf`` are checked: every other keyword the grammar enforces exactly (a
strict schema with anything else is refused before it runs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import grpc
import jsonschema
import jsonschema.exceptions
import jsonschema.validators

from cachet.common.v1 import common_pb2
from cachet.errors import CachetError

_SCHEMA_PARAM = "response_format.json_schema.schema"


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
        """A check for a JSON schema that uses oneOf; None for everything decoding enforces exactly."""
        if response_format.WhichOneof("format") != "json_schema":
            return None
        try:
            schema = json.loads(response_format.json_schema.schema_json)
        except json.JSONDecodeError:
            return None  # the engine refuses it, naming the problem
        if not _uses_one_of(schema):
            return None
        validator_class = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
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
        problem = jsonschema.exceptions.best_match(self.validator.iter_errors(document))
        if problem is not None:
            where = "/".join(str(part) for part in problem.absolute_path) or "the top level"
            raise SchemaMismatch(
                f"the answer does not match the schema at {where}: {problem.message} (decoding enforces "
                "oneOf as anyOf, so an answer can fall in the difference; sampling again may give a valid one)"
            )


def _uses_one_of(node: Any) -> bool:
    if isinstance(node, dict):
        return "oneOf" in node or any(_uses_one_of(value) for value in node.values())
    if isinstance(node, list):
        return any(_uses_one_of(value) for value in node)
    return False
