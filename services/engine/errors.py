"""The engine's domain exceptions.

Each is one of the platform's domain errors (``cachet.errors``), so the shared
server interceptor maps it to its gRPC status code; nothing in the engine
converts errors by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachet.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable


@dataclass
class InvalidRequest(InvalidArgument):
    """The request can never be served as given (INVALID_ARGUMENT)."""


@dataclass
class EngineOverloaded(ResourceExhausted):
    """The waiting queue is full; retry later or elsewhere (RESOURCE_EXHAUSTED)."""


@dataclass
class RequestNotFound(NotFound):
    """No waiting or running request has this id (NOT_FOUND)."""


@dataclass
class EngineUnavailable(Unavailable):
    """The replica cannot run requests (its loop died, it lost a rank): retry elsewhere (UNAVAILABLE)."""
