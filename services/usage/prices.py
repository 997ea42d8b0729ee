"""Prices per model, in exact integers, and the cost arithmetic that uses them.

A price is micro-USD per million tokens, which is the same number as pico-USD
per token: $0.60 / 1M tokens = 600,000 micro-USD / Mtok = 600,000 pico-USD per
token. So a cost is ``tokens × price`` in pico-USD with no division and no float
anywhere, and sums of costs stay exact.

Overrides come from a JSON file, read once at start-up (a change needs a
restart). The file is ``$CACHET_USAGE_PRICES_FILE`` when that variable is set
(and must then exist), otherwise ``<data_dir>/prices.json`` when present,
otherwise the defaults apply to every model. Format (every key optional; unknown
keys and non-integer prices are rejected so a typo cannot silently bill at the
default)::

    {
      "default": {"input_microusd_per_mtok": 600000,
                  "cached_input_microusd_per_mtok": 100000,
                  "output_microusd_per_mtok": 3000000},
      "models": {"kimi-k2.5": {"input_microusd_per_mtok": 600000, ...}}
    }

A model entry's missing fields take the *default* entry's values.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

PRICES_FILE_ENV = "CACHET_USAGE_PRICES_FILE"
PRICES_FILE_NAME = "prices.json"

# $1,000 per million tokens: far above any real price, and low enough that one
# record (at most 2^32 - 1 tokens of a kind, times three kinds) stays below
# 2^63 pico-USD, the int64 the ledger and the proto carry.
MAX_MICROUSD_PER_MTOK = 1_000_000_000

PriceInt = Annotated[int, Field(strict=True, ge=0, le=MAX_MICROUSD_PER_MTOK)]


class ModelPrice(BaseModel):
    """One model's prices; also what the ledger stores next to each record."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    input_microusd_per_mtok: PriceInt = 600_000
    cached_input_microusd_per_mtok: PriceInt = 100_000
    output_microusd_per_mtok: PriceInt = 3_000_000

    @model_validator(mode="after")
    def _cached_not_dearer(self) -> ModelPrice:
        # A cached token dearer than an uncached one would make "savings" negative
        # and punish users for the cache hits we promise them.
        if self.cached_input_microusd_per_mtok > self.input_microusd_per_mtok:
            raise ValueError("cached_input_microusd_per_mtok must not exceed input_microusd_per_mtok")
        return self

    def cost_picousd(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
        """Exact cost; ``prompt_tokens`` includes the cached ones, billed at their own price."""
        uncached = prompt_tokens - cached_tokens
        return (
            uncached * self.input_microusd_per_mtok
            + cached_tokens * self.cached_input_microusd_per_mtok
            + completion_tokens * self.output_microusd_per_mtok
        )

    def cache_savings_picousd(self, cached_tokens: int) -> int:
        """What the cached tokens would have cost at the input price, minus what they cost."""
        return cached_tokens * (self.input_microusd_per_mtok - self.cached_input_microusd_per_mtok)


class _PricesFile(BaseModel):
    # Strict: "600000" (a string) or 0.6 is a mistake to report, not a value to coerce.
    model_config = ConfigDict(extra="forbid", strict=True)

    default: dict[str, int] = Field(default_factory=dict)
    models: dict[str, dict[str, int]] = Field(default_factory=dict)


class PriceTable:
    """The default price and per-model overrides; immutable once built."""

    def __init__(
        self, default: ModelPrice | None = None, models: dict[str, ModelPrice] | None = None
    ) -> None:
        self.default = default or ModelPrice()
        self._models = dict(models or {})

    def price_for(self, model: str) -> ModelPrice:
        return self._models.get(model, self.default)

    @property
    def models(self) -> dict[str, ModelPrice]:
        """Models with their own price, sorted by id (a copy)."""
        return dict(sorted(self._models.items()))

    @classmethod
    def from_json(cls, text: str) -> PriceTable:
        """Parse the prices file format above; raises ``ValueError`` naming the bad field."""
        raw = _PricesFile.model_validate_json(text)
        default = ModelPrice.model_validate(raw.default, strict=True)
        base = default.model_dump()
        models = {
            model: ModelPrice.model_validate({**base, **fields}, strict=True)
            for model, fields in raw.models.items()
        }
        return cls(default, models)


def prices_file_path(data_dir: Path) -> Path | None:
    """The prices file to read, or None for the built-in defaults."""
    configured = os.environ.get(PRICES_FILE_ENV)
    if configured:
        return Path(configured)
    candidate = data_dir / PRICES_FILE_NAME
    return candidate if candidate.is_file() else None


def load_price_table(data_dir: Path) -> PriceTable:
    """The price table for this process; a bad or missing configured file fails start-up."""
    path = prices_file_path(data_dir)
    if path is None:
        return PriceTable()
    try:
        return PriceTable.from_json(path.read_text(encoding="utf-8"))
    except (OSError, ValidationError) as error:
        raise ValueError(f"cannot load prices from {path}: {error}") from error
