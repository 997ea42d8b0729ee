"""The JSON Schemas that structured-output tests and ``bench/structured_output_bench.py`` share.

Real-world shapes: nested objects, enums, bounded arrays and strings, anyOf, $ref/$defs, numbers
with bounds, nullable fields, consts and string patterns. Every string and array is bounded so that
a random-weight model (whose only reason to close a string is the grammar) finishes well inside a
test's token budget. No tests live here; pytest collects the module and finds none.
"""

from __future__ import annotations

from typing import Any

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "status": {"enum": ["active", "inactive", "banned"]},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "status", "address"],
        "additionalProperties": False,
    },
    "tool_call": {
        "type": "object",
        "properties": {
            "tool": {"type": "string", "enum": ["get_weather", "search", "send_email"]},
            "arguments": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "maxLength": 16},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 20},
                },
                "required": ["query"],
                "additionalProperties": False,
            },
        },
        "required": ["tool", "arguments"],
        "additionalProperties": False,
    },
    "tags": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "minLength": 1, "maxLength": 8},
                "minItems": 1,
                "maxItems": 3,
            },
            "scores": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
        },
        "required": ["tags", "scores"],
        "additionalProperties": False,
    },
    "result_any_of": {
        "type": "object",
        "properties": {
            "result": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"kind": {"const": "ok"}, "value": {"type": "integer"}},
                        "required": ["kind", "value"],
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "properties": {
                            "kind": {"const": "error"},
                            "message": {"type": "string", "maxLength": 20},
                        },
                        "required": ["kind", "message"],
                        "additionalProperties": False,
                    },
                ]
            }
        },
        "required": ["result"],
        "additionalProperties": False,
    },
    "order_refs": {
        "$defs": {
            "item": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                },
                "required": ["sku", "quantity"],
                "additionalProperties": False,
            },
            "money": {"type": "number", "minimum": 0, "maximum": 10000},
        },
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3},
            "total": {"$ref": "#/$defs/money"},
        },
        "required": ["items", "total"],
        "additionalProperties": False,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "temperature": {"type": "number", "minimum": -50, "maximum": 60},
            "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        },
        "required": ["rating", "temperature", "ratio"],
        "additionalProperties": False,
    },
    "nullable_const": {
        "type": "object",
        "properties": {
            "version": {"const": 2},
            "active": {"type": "boolean"},
            "note": {"type": ["string", "null"], "maxLength": 10},
            "parent": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 1000}, {"type": "null"}]},
        },
        "required": ["version", "active", "note", "parent"],
        "additionalProperties": False,
    },
    "nested_list": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 15},
            "sections": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "heading": {"type": "string", "maxLength": 10},
                        "level": {"enum": [1, 2, 3]},
                        "bullets": {
                            "type": "array",
                            "items": {"type": "string", "maxLength": 6},
                            "maxItems": 2,
                        },
                    },
                    "required": ["heading", "level", "bullets"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["title", "sections"],
        "additionalProperties": False,
    },
}
