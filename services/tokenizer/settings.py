"""The tokenizer's settings: ``CACHET_TOKENIZER_*``, and ``CACHET_MODEL`` for the default model."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from cachet.config import ServiceSettings, shared_alias


class TokenizerSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="CACHET_TOKENIZER_")

    port: int = Field(default=50051, ge=0, le=65535)
    # Prometheus /metrics over HTTP on this port (docs/ARCHITECTURE.md, "Ports"); 0: none.
    metrics_port: int = Field(default=9051, ge=0, le=65535)
    # Model ids or checkpoint directories to serve; the default model when empty.
    models: list[str] = Field(default_factory=list)
    default_model: str = Field(default="", validation_alias=shared_alias("CACHET_MODEL"))
    # Longest text accepted by Encode, in characters.
    max_input_chars: int = Field(default=4 * 1024 * 1024, ge=1)
