"""The finished answer is checked against a schema that decoding could only approximate."""

from __future__ import annotations

import json

import pytest

from cachet.common.v1 import common_pb2
from cachet.router.answer_check import AnswerCheck, SchemaMismatch

NUMBER = {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}
# ``not`` is left out of the grammar (llguidance's lenient compile): only the check holds it.
NOT_A = {
    "type": "object",
    "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
    "not": {"required": ["a"]},
}


def json_schema(schema: dict) -> common_pb2.ResponseFormat:
    return common_pb2.ResponseFormat(json_schema=common_pb2.JsonSchemaFormat(schema_json=json.dumps(schema)))


def check(schema: dict, *parts: str) -> None:
    answer = AnswerCheck.for_format(json_schema(schema))
    assert answer is not None
    for part in parts:
        answer.feed(part)
    answer.verify()


def test_only_schemas_decoding_approximates_are_checked() -> None:
    assert AnswerCheck.for_format(json_schema({"type": "object"})) is None
    assert AnswerCheck.for_format(common_pb2.ResponseFormat(regex="[a-z]+")) is None
    assert AnswerCheck.for_format(common_pb2.ResponseFormat()) is None
    # llguidance proves these alternatives disjoint: its anyOf is the oneOf, nothing to check.
    assert AnswerCheck.for_format(json_schema({"oneOf": [{"type": "integer"}, {"type": "string"}]})) is None
    nested = {"type": "object", "properties": {"a": {"type": "array", "items": NUMBER}}}
    assert AnswerCheck.for_format(json_schema(nested)) is not None
    assert AnswerCheck.for_format(json_schema(NOT_A)) is not None
    assert AnswerCheck.for_format(json_schema({"type": "array", "uniqueItems": True})) is not None


def test_an_answer_matching_exactly_one_alternative_passes() -> None:
    check(NUMBER, "-", "3")  # an integer below the second's minimum
    check(NUMBER, "2.5")  # a number that is no integer


def test_an_answer_matching_both_alternatives_is_refused_naming_the_schema() -> None:
    with pytest.raises(SchemaMismatch) as refused:
        check(NUMBER, "4")
    assert refused.value.param == "response_format.json_schema.schema"
    assert refused.value.code_name == "answer_schema_mismatch"
    assert "valid under each of" in refused.value.message


def test_the_place_of_the_mismatch_is_named() -> None:
    schema = {"type": "object", "properties": {"pets": {"type": "array", "items": NUMBER}}}
    with pytest.raises(SchemaMismatch, match="at pets/1"):
        check(schema, '{"pets": [', "-1, 7]}")


def test_an_answer_that_is_not_json_is_refused() -> None:
    with pytest.raises(SchemaMismatch, match="not JSON"):
        check(NUMBER, '{"cut')


def test_a_keyword_decoding_left_out_is_checked_and_named() -> None:
    check(NOT_A, '{"b": "x"}')
    with pytest.raises(SchemaMismatch, match="`not` is checked after decoding") as refused:
        check(NOT_A, '{"a": "x"}')
    assert refused.value.code_name == "answer_schema_mismatch"


def test_dependencies_keep_their_draft_7_meaning_in_a_schema_naming_no_draft() -> None:
    schema = {"type": "object", "properties": {"a": {}, "b": {}}, "dependencies": {"a": ["b"]}}
    check(schema, '{"a": 1, "b": 2}')
    check(schema, '{"b": 2}')
    with pytest.raises(SchemaMismatch, match="'b' is a dependency of 'a'"):
        check(schema, '{"a": 1}')
    draft_4 = schema | {"$schema": "http://json-schema.org/draft-04/schema#"}
    with pytest.raises(SchemaMismatch, match="'b' is a dependency of 'a'"):
        check(draft_4, '{"a": 1}')


def test_an_unknown_format_is_no_error_at_check_time() -> None:
    # Decoded as a plain string; jsonschema knows no more about "datetime" than llguidance does.
    when = {"type": "string", "format": "datetime"}
    assert AnswerCheck.for_format(json_schema({"type": "object", "properties": {"t": when}})) is None
    check(NOT_A | {"properties": {"t": when}}, '{"t": "not a date at all"}')


def test_an_answer_the_check_cannot_evaluate_is_refused_not_passed() -> None:
    # llguidance takes the Rust-syntax class; Python's re, which jsonschema uses, does not.
    schema = {"type": "array", "items": {"type": "string", "pattern": "^\\p{L}+$"}, "uniqueItems": True}
    with pytest.raises(SchemaMismatch, match="could not be checked"):
        check(schema, '["ab"]')
