"""Who is calling: API key -> account, and the metadata the router needs about the caller.

A key comes as ``Authorization: Bearer <key>`` (OpenAI's clients) or as
``x-api-key: <key>`` (Anthropic's), on any route; the bearer wins when both are
sent. With keys configured (``CACHET_API_KEYS``: the bootstrap keys), they are
accepted, and so are the managed keys of ``cachet keys create``, which live hashed in
the router's store: the bridge asks the router (its ``Authenticate`` RPC) whose such a
key is and trusts the answer for ``key_cache_seconds``. With no key configured, the
bridge runs in open development mode: everyone is the account ``anonymous`` (and
``create_app`` refuses to serve that on anything but loopback).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from cachet.bridge.errors import BridgeError
from cachet.bridge.settings import DEV_ACCOUNT

ACCOUNT_METADATA = "x-cachet-account"
SESSION_METADATA = "x-session-affinity"
_MAX_SESSION_CHARS = 256
# Managed keys start so (cachet.router.api_keys.KEY_PREFIX): only those are worth a call to
# the router, so a stranger's key is refused here even while the router is away.
MANAGED_KEY_PREFIX = "sk-cachet-"
# Cached answers are dropped wholesale past this many, so a key-guesser cannot grow the cache.
_MAX_CACHED_KEYS = 10_000

# The account a managed key belongs to, by the router; None when it names no one (unknown,
# revoked, expired). Any other failure raises the BridgeError to answer.
KeyLookup = Callable[[str], Awaitable[str | None]]


@dataclass(frozen=True)
class Caller:
    account_id: str
    # Passed through verbatim: the router's public API reads the same header (router.proto).
    authorization: str
    session_id: str

    def metadata(self) -> tuple[tuple[str, str], ...]:
        pairs = [(ACCOUNT_METADATA, self.account_id)]
        if self.authorization:
            pairs.append(("authorization", self.authorization))
        if self.session_id:
            pairs.append((SESSION_METADATA, self.session_id))
        return tuple(pairs)


@dataclass
class Authenticator:
    api_keys: dict[str, str]
    lookup: KeyLookup | None = None
    # How long the router's answer about a managed key is trusted: a revoked key stops
    # working here within this time (and at the router within its own).
    cache_seconds: float = 5.0
    _cache: dict[str, tuple[float, str]] = field(default_factory=dict, repr=False)

    @property
    def dev_mode(self) -> bool:
        return not self.api_keys

    def identify(self, authorization: str | None, session: str | None, api_key: str | None = None) -> Caller:
        """The caller behind these headers by the bootstrap keys alone, or 401 (bad key) / 400
        (unusable session id)."""
        session_id = _session_id(session)
        key = _bearer_key(authorization) or (api_key or "").strip()
        # The router reads the key from a bearer header only (router.proto), whichever header brought it.
        forwarded = f"Bearer {key}" if key else ""
        if self.dev_mode:
            return Caller(DEV_ACCOUNT, forwarded or authorization or "", session_id)
        account = self._account(key)
        if account is None:
            raise _refused(key)
        return Caller(account, forwarded, session_id)

    async def authenticate(
        self, authorization: str | None, session: str | None, api_key: str | None = None
    ) -> Caller:
        """``identify``, and a managed key's account from the router when no bootstrap key matches."""
        try:
            return self.identify(authorization, session, api_key)
        except BridgeError as refused:
            key = _bearer_key(authorization) or (api_key or "").strip()
            if refused.status != 401 or self.lookup is None or not key.startswith(MANAGED_KEY_PREFIX):
                raise
        account = await self._managed_account(key)
        if account is None:
            raise _refused(key)
        return Caller(account, f"Bearer {key}", _session_id(session))

    async def _managed_account(self, key: str) -> str | None:
        assert self.lookup is not None
        digest = hashlib.sha256(key.encode()).hexdigest()
        now = time.monotonic()
        cached = self._cache.get(digest)
        if cached is not None and now < cached[0]:
            return cached[1]
        account = await self.lookup(key)
        if account is not None and self.cache_seconds > 0:
            if len(self._cache) >= _MAX_CACHED_KEYS:
                self._cache.clear()
            self._cache[digest] = (now + self.cache_seconds, account)
        return account

    def _account(self, key: str) -> str | None:
        # Compare every key in constant time so response timing does not reveal a key's prefix.
        found = None
        for known, account in self.api_keys.items():
            if hmac.compare_digest(known.encode(), key.encode()):
                found = account
        return found if key else None


def _refused(key: str) -> BridgeError:
    return BridgeError(
        401,
        "Incorrect API key provided."
        if key
        else "Missing API key: send Authorization: Bearer <key> or x-api-key: <key>.",
        "authentication_error",
        code="invalid_api_key",
    )


def _bearer_key(authorization: str | None) -> str:
    scheme, _, key = (authorization or "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" else ""


def _session_id(session: str | None) -> str:
    # gRPC metadata values must be printable ASCII; refuse here rather than fail the call later.
    if not session:
        return ""
    if len(session) > _MAX_SESSION_CHARS or not session.isascii() or not session.isprintable():
        raise BridgeError(
            400,
            f"x-session-affinity must be printable ASCII of at most {_MAX_SESSION_CHARS} characters.",
            param=SESSION_METADATA,
            code="invalid_session_id",
        )
    return session
