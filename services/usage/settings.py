"""The usage ledger's settings: ``CACHET_USAGE_*``; ``CACHET_STORE_URL`` is shared with the router."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from cachet.config import STORE_URL_ALIASES, ServiceSettings, StoreUrl


class UsageSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="CACHET_USAGE_")

    port: int = Field(default=50081, ge=0, le=65535)
    # Prometheus /metrics over HTTP on this port (docs/ARCHITECTURE.md, "Ports"); 0: none.
    metrics_port: int = Field(default=9081, ge=0, le=65535)
    # SQLite file; defaults to <data_dir>/usage.sqlite3. Unused when store_url is set.
    database: Path | None = None
    store_url: StoreUrl = Field(default="", validation_alias=STORE_URL_ALIASES["usage"])
