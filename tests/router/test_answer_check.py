"""The finished answer is checked against a schema whose oneOf decoding could only approximate."""

from __future__ import annotations

import json

import pytest

from cachet.common.v1 import common_pb2
from cachet.router.answer_check import AnswerCheck, SchemaMismatch

NUMBER = {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}


def json_schema(schema: dict) -> common_pb2.ResponseFormat:
    return common_pb2.ResponseFormat(json_schema=common_pb2.JsonSchemaFormat(schema_json=json.dumps(schema)))


def check(schema: dict, *parts: str) -> None:
    answer = AnswerCheck.for_format(json_schema(schema))
    assert answer is not None
    for part in parts:
        answer.feed(part)
    answer.verify()


def test_only_schemas_with_one_of_are_checked() -> None:
    assert AnswerCheck.for_format(json_schema({"type": "object"})) is None
    assert AnswerCheck.for_format(common_pb2.ResponseFormat(regex="[a-z]+")) is None
    assert AnswerCheck.for_format(common_pb2.ResponseFormat()) is None
    nested = {"type": "object", "properties": {"a": {"type": "array", "items": NUMBER}}}
    assert AnswerCheck.for_format(json_schema(nested)) is not None


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
