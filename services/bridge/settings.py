"""The bridge's settings: ``CACHET_BRIDGE_*``; ``CACHET_PORT`` is its port and ``CACHET_API_KEYS``
is shared with the router."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from cachet.config import API_KEYS_ALIASES, LOOPBACK, ServiceSettings, shared_alias

# An OpenAI request carrying a long context plus a few images stays far below this;
# anything above is a mistake or an attack, refused before it is buffered.
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
DEV_ACCOUNT = "anonymous"


class BridgeSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="CACHET_BRIDGE_")

    port: int = Field(default=8080, ge=0, le=65535, validation_alias=shared_alias("CACHET_PORT"))
    # One router's host:port, or several spread round robin: ``ipv4:a:port,b:port`` (run-local)
    # or ``dns:///name:port``, every address a name resolves to (the Helm chart's headless Service).
    router_address: str = f"{LOOPBACK}:50091"
    # API key -> account id; none configured means open development mode on loopback.
    api_keys: dict[str, str] = Field(default_factory=dict, validation_alias=API_KEYS_ALIASES["bridge"])
    # The usage service answers GET /v1/usage (same default port as UsageSettings).
    usage_address: str = f"{LOOPBACK}:50081"
    # The tokenizer answers POST /v1/messages/count_tokens (same default port as run-local's).
    tokenizer_address: str = f"{LOOPBACK}:50051"
    # Request bodies above this are answered 413 without being read whole.
    max_body_bytes: int = Field(default=DEFAULT_MAX_BODY_BYTES, ge=1024)
    # Seconds GET /health waits for the router's gRPC health answer.
    health_timeout_seconds: float = Field(default=1.0, gt=0)
    # How long the router's answer about a managed API key is trusted (auth.py): a key revoked
    # with `cachet keys revoke` stops passing the bridge within this time.
    key_cache_seconds: float = Field(default=5.0, ge=0)

    @property
    def dev_mode(self) -> bool:
        """No API keys: every caller is the one development account."""
        return not self.api_keys
