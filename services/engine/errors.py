"""The engine's domain exceptions; the servicer maps each to one gRPC status code."""

from __future__ import annotations


class EngineError(Exception):
    """Base of the engine's domain errors."""


class InvalidRequest(EngineError):
    """The request can never be served as given (maps to INVALID_ARGUMENT)."""


class EngineOverloaded(EngineError):
    """The waiting queue is full; retry later or elsewhere (maps to RESOURCE_EXHAUSTED)."""


class RequestNotFound(EngineError):
    """No waiting or running request has this id (maps to NOT_FOUND)."""
