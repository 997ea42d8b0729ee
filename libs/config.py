"""What every service's settings share: the base class that reads ``CACHET_*`` variables.

Each service has one frozen, typed settings class of its own, in its own
``settings.py`` (``cachet.engine.settings.EngineSettings``...), built on
``ServiceSettings``. Shared knobs keep their documented names (``CACHET_DATA_DIR``,
``CACHET_MODEL``, ``CACHET_DTYPE``...: ``shared_alias``); a service's own knobs carry
its name (``CACHET_TOKENIZER_PORT``). Settings are validated when built, so a typo in
a value fails at start-up with the variable's name, not in the middle of a request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from cachet.tls import TlsSettings, check_listener

LOOPBACK = "127.0.0.1"


def shared_alias(name: str) -> AliasChoices:
    """A knob read under one name (``CACHET_MODEL``) by every service that has it, whatever its prefix."""
    return AliasChoices(name, name.removeprefix("CACHET_").lower())


# Bridge and router must agree on who a key belongs to: CACHET_API_KEYS sets both
# (a JSON object, key -> account id); a service-specific variable wins over it.
API_KEYS_ALIASES = {
    service: AliasChoices(f"CACHET_{service.upper()}_API_KEYS", "CACHET_API_KEYS", "api_keys")
    for service in ("bridge", "router")
}


def _store_url(url: str) -> str:
    if url and urlsplit(url).scheme not in ("postgresql", "postgres"):
        raise ValueError(f"must be empty (SQLite files) or a postgresql:// URL, not {urlsplit(url).scheme!r}")
    return url


# Where the queue and the usage ledger live (libs/durable_postgres.py): empty for the SQLite
# files under the data directory; postgresql://user@host:port/database for one database that
# several routers and usage processes share. CACHET_STORE_URL sets both services; a
# service-specific variable wins over it.
StoreUrl = Annotated[str, AfterValidator(_store_url)]
STORE_URL_ALIASES = {
    service: AliasChoices(f"CACHET_{service.upper()}_STORE_URL", "CACHET_STORE_URL", "store_url")
    for service in ("usage", "router")
}


class ServiceSettings(BaseSettings):
    """Fields every service has."""

    model_config = SettingsConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    host: str = LOOPBACK
    port: int = Field(default=0, ge=0, le=65535)
    data_dir: Path = Field(default=Path("data"), validation_alias=shared_alias("CACHET_DATA_DIR"))
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", validation_alias=shared_alias("CACHET_LOG_LEVEL")
    )
    # Bounded so one bad client cannot make a service buffer gigabytes.
    max_message_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    # Seconds a SIGTERM'd server lets in-flight calls finish before cancelling them.
    drain_seconds: float = Field(default=10.0, ge=0)
    # The listener's and the outgoing calls' TLS (cachet.tls): CACHET_TLS_*, one set per process,
    # with the service's own pair where CACHET_<SERVICE>_TLS_CERT_FILE / _KEY_FILE name one.
    tls: TlsSettings = Field(default_factory=TlsSettings)

    @model_validator(mode="before")
    @classmethod
    def _own_identity(cls, data: Any) -> Any:
        prefix = str(cls.model_config.get("env_prefix", ""))
        if prefix and isinstance(data, dict) and "tls" not in data:
            return {**data, "tls": TlsSettings.for_service(prefix)}
        return data

    @model_validator(mode="after")
    def _no_plaintext_beyond_loopback(self) -> ServiceSettings:
        # Here, not only where the server binds: an engine would load its model first.
        service = str(self.model_config.get("env_prefix", "")).removeprefix("CACHET_").rstrip("_").lower()
        check_listener(self.host, self.tls, service or "service")
        return self

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
