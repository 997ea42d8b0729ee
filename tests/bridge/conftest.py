"""Bridge test fixtures: the app in-process (httpx over ASGI); real processes come from service_processes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import pytest
from fastapi import FastAPI

from cachet.bridge.app import create_app
from cachet.bridge.settings import BridgeSettings

# Nothing listens on port 1: calls to it fail UNAVAILABLE at once, which is what an
# app with no reachable router must answer (503), without any fake service.
NOWHERE = "127.0.0.1:1"


def bridge_settings(**overrides: object) -> BridgeSettings:
    values: dict[str, object] = {"router_address": NOWHERE, "usage_address": NOWHERE, "api_keys": {}}
    return BridgeSettings(**(values | overrides))


@asynccontextmanager
async def serve_in_process(app: FastAPI, lifespan: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client talking to ``app`` over ASGI; the lifespan (gRPC channels) runs unless told not to."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://bridge.test") as client:
        if not lifespan:
            yield client
            return
        async with app.router.lifespan_context(app):
            yield client


@pytest.fixture
def make_client() -> Callable[..., object]:
    """``async with make_client(**settings) as client``: a fresh app per test."""

    def make(**overrides: object):
        return serve_in_process(create_app(bridge_settings(**overrides)))

    return make
