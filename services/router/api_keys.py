"""Managed API keys: made by ``cachet keys create``, stored as a hash, never as the key.

A key reads ``sk-cachet-<16 hex: its id>-<43 url-safe characters: 256 random bits>``.
The store keeps the id, a SHA-256 of the whole key and the key's account, name, times
and limits; the key itself is shown once, when it is made. A presented key is looked up
by the id it carries and then compared by hash in constant time, so neither the lookup
nor the comparison tells a caller how much of a guessed key was right. A plain
SHA-256 (no salt, no slow hash) is enough because the secret is random and long:
there is no dictionary to try against a leaked hash.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass, field

from cachet.errors import InvalidArgument

KEY_PREFIX = "sk-cachet-"
_ID_HEX = 16
_KEY_SHAPE = re.compile(rf"^{KEY_PREFIX}([0-9a-f]{{{_ID_HEX}}})-[A-Za-z0-9_-]{{43}}$")
KEY_ID_PREFIX = "key_"
# Account ids are ledger keys (the usage service's bound); names are labels for people.
MAX_ACCOUNT_CHARS = 512
MAX_NAME_CHARS = 256


@dataclass(frozen=True)
class KeyLimits:
    """What one key may use; 0 means no limit."""

    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    # Spend a calendar month (UTC), in pico-USD as the ledger counts cost.
    monthly_budget_picousd: int = 0

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute", "monthly_budget_picousd"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name} must not be negative", param=name)

    @property
    def any(self) -> bool:
        return bool(self.requests_per_minute or self.tokens_per_minute or self.monthly_budget_picousd)


@dataclass(frozen=True)
class ApiKey:
    """A managed key as stored: everything but the key. Times are Unix milliseconds; 0 is "never"."""

    key_id: str
    account_id: str
    name: str
    key_hash: str
    created_at_ms: int
    expires_at_ms: int = 0
    revoked_at_ms: int = 0
    last_used_at_ms: int = 0
    limits: KeyLimits = field(default_factory=KeyLimits)

    def usable_at(self, now_ms: int) -> bool:
        return not self.revoked_at_ms and not (self.expires_at_ms and now_ms >= self.expires_at_ms)

    def state_at(self, now_ms: int) -> str:
        if self.revoked_at_ms:
            return "revoked"
        return "active" if self.usable_at(now_ms) else "expired"

    def matches(self, key: str) -> bool:
        return hmac.compare_digest(self.key_hash, hash_key(key))


def new_api_key(
    account_id: str, name: str, now_ms: int, *, expires_at_ms: int = 0, limits: KeyLimits | None = None
) -> tuple[str, ApiKey]:
    """A fresh key and its stored record; the key is returned here and nowhere else."""
    if not account_id or len(account_id) > MAX_ACCOUNT_CHARS or not account_id.isprintable():
        raise InvalidArgument(
            f"account must be 1 to {MAX_ACCOUNT_CHARS} printable characters", param="account"
        )
    if len(name) > MAX_NAME_CHARS or not name.isprintable():
        raise InvalidArgument(f"name must be at most {MAX_NAME_CHARS} printable characters", param="name")
    if expires_at_ms and expires_at_ms <= now_ms:
        raise InvalidArgument("the expiry must be in the future", param="expires_at")
    suffix = secrets.token_hex(_ID_HEX // 2)
    key = f"{KEY_PREFIX}{suffix}-{secrets.token_urlsafe(32)}"
    record = ApiKey(
        key_id=KEY_ID_PREFIX + suffix,
        account_id=account_id,
        name=name,
        key_hash=hash_key(key),
        created_at_ms=now_ms,
        expires_at_ms=expires_at_ms,
        limits=limits or KeyLimits(),
    )
    return key, record


def key_id_of(key: str) -> str | None:
    """The id a managed key carries, or None when ``key`` is not shaped like one."""
    shape = _KEY_SHAPE.match(key)
    return KEY_ID_PREFIX + shape.group(1) if shape else None


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


# Both stores' api_keys columns, in the order api_key_row writes and api_key_from_row reads.
API_KEY_COLUMNS = (
    "key_id, account_id, name, key_hash, created_at_ms, expires_at_ms, revoked_at_ms, last_used_at_ms,"
    " requests_per_minute, tokens_per_minute, monthly_budget_picousd"
)


def api_key_row(key: ApiKey) -> tuple:
    return (
        key.key_id,
        key.account_id,
        key.name,
        key.key_hash,
        key.created_at_ms,
        key.expires_at_ms,
        key.revoked_at_ms,
        key.last_used_at_ms,
        key.limits.requests_per_minute,
        key.limits.tokens_per_minute,
        key.limits.monthly_budget_picousd,
    )


def api_key_from_row(row: tuple) -> ApiKey:
    *key, rpm, tpm, budget = row
    # The row holds exactly the fields before limits; mypy cannot count a starred list.
    return ApiKey(*key, limits=KeyLimits(rpm, tpm, budget))  # type: ignore[misc]
