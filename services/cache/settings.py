"""The cache index's settings: ``CACHET_CACHE_*``."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from cachet.config import ServiceSettings


class CacheSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="CACHET_CACHE_")

    port: int = Field(default=50071, ge=0, le=65535)
    # Prometheus /metrics over HTTP on this port (docs/ARCHITECTURE.md, "Ports"); 0: none.
    metrics_port: int = Field(default=9071, ge=0, le=65535)
    # Engines to follow from the start (more can be added with WatchReplica).
    engine_addresses: list[str] = Field(default_factory=list)
