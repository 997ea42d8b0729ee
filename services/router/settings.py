"""The router's own knobs on top of the shared ``RouterSettings`` (same ``CACHET_ROUTER_`` prefix)."""

from __future__ import annotations

from pydantic import Field

from cachet.config import API_KEYS_ALIASES, RouterSettings


class RouterServiceSettings(RouterSettings):
    """Everything ``RouterSettings`` has, plus placement, health and account knobs."""

    # API key -> account id, e.g. CACHET_API_KEYS='{"sk-test": "acct-1"}' (shared with the bridge).
    # Empty means development mode: every caller is the "anonymous" account.
    api_keys: dict[str, str] = Field(default_factory=dict, validation_alias=API_KEYS_ALIASES["router"])
    # Bounded-load slack of session affinity (see placement.py).
    load_epsilon: float = Field(default=0.25, ge=0)
    # Cached prompt tokens one queued or running request is worth when scoring replicas.
    load_penalty_tokens: float = Field(default=128.0, ge=0)
    # A replica whose last load report is older than this is treated as down. Generous, because
    # a CPU engine busy with a long prefill may report late, and a dropped stream is caught at once.
    report_stale_seconds: float = Field(default=5.0, gt=0)
    # Milliseconds between load reports asked of each engine (0: the engine's default).
    load_report_interval_ms: int = Field(default=0, ge=0)
    # At start, wait at most this long for every engine to report before serving.
    startup_wait_seconds: float = Field(default=10.0, ge=0)
    # Prometheus /metrics HTTP port; 0 turns the endpoint off (metrics still count).
    metrics_port: int = Field(default=0, ge=0, le=65535)
    # Deadline of each call to the tokenizer, cache index and usage services.
    dependency_timeout_seconds: float = Field(default=10.0, gt=0)
    # The cache index is an optimisation: wait for it only this long before scoring by load.
    cache_timeout_seconds: float = Field(default=0.5, gt=0)


def router_service_settings(settings: RouterSettings) -> RouterServiceSettings:
    """The full settings for a plain ``RouterSettings`` (router-only knobs from the environment)."""
    if isinstance(settings, RouterServiceSettings):
        return settings
    return RouterServiceSettings(**settings.model_dump())
