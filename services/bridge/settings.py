"""The bridge's settings: the shared ``BridgeSettings`` plus the knobs only the bridge reads.

``cachet.config`` is owned by libs; the bridge extends it here rather than editing
it, and keeps the same ``CACHET_BRIDGE_`` prefix, so ``CACHET_BRIDGE_USAGE_ADDRESS``
and ``CACHET_BRIDGE_MAX_BODY_BYTES`` read like every other bridge variable.
"""

from __future__ import annotations

from pydantic import Field

from cachet.config import LOOPBACK, BridgeSettings

# An OpenAI request carrying a long context plus a few images stays far below this;
# anything above is a mistake or an attack, refused before it is buffered.
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
DEV_ACCOUNT = "anonymous"


class BridgeServiceSettings(BridgeSettings):
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

    @classmethod
    def from_settings(cls, settings: BridgeSettings) -> BridgeServiceSettings:
        """Accept a plain ``BridgeSettings`` (tests, the supervisor); the extras come from the environment."""
        if isinstance(settings, cls):
            return settings
        return cls(**settings.model_dump())
