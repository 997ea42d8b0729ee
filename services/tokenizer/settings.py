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
    # Image parts (models with a vision encoder; docs/ARCHITECTURE.md, "Images"). An encoded image
    # (a data URL's decoded bytes or a fetched body) over this many bytes is refused.
    image_max_bytes: int = Field(default=20 * 1024 * 1024, ge=1)
    # Width times height of a decoded image, before it is scaled down to the model's patch budget.
    image_max_pixels: int = Field(default=50_000_000, ge=1)
    max_images_per_request: int = Field(default=16, ge=0)
    # Hosts whose http(s) image URLs are fetched (exact names, e.g. ["images.example.com"]);
    # empty: only data: URLs. Fetches follow no redirects and are capped by image_max_bytes.
    image_url_hosts: list[str] = Field(default_factory=list)
    image_fetch_timeout_seconds: float = Field(default=10.0, gt=0)
    # Prepared images (decoded and resized) kept by the SHA-256 of their bytes, so that a picture
    # sent again (agents resend the whole conversation every turn) is not decoded again: at most
    # this many bytes of pixels, least recently used out first; 0 keeps none. A 1280x800
    # screenshot at Kimi K2.5's resolution is 3.1 MB.
    image_cache_bytes: int = Field(default=256 * 1024 * 1024, ge=0)
