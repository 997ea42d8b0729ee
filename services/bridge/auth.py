"""Who is calling: API key -> account, and the metadata the router needs about the caller.

A key comes as ``Authorization: Bearer <key>`` (OpenAI's clients) or as
``x-api-key: <key>`` (Anthropic's), on any route; the bearer wins when both are
sent. With keys configured, only they are accepted. With none, the bridge runs in
open development mode: everyone is the account ``anonymous`` (and ``create_app``
refuses to serve that on anything but loopback).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from cachet.bridge.errors import BridgeError
from cachet.bridge.settings import DEV_ACCOUNT

ACCOUNT_METADATA = "x-cachet-account"
SESSION_METADATA = "x-session-affinity"
_MAX_SESSION_CHARS = 256


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


@dataclass(frozen=True)
class Authenticator:
    api_keys: dict[str, str]

    @property
    def dev_mode(self) -> bool:
        return not self.api_keys

    def identify(self, authorization: str | None, session: str | None, api_key: str | None = None) -> Caller:
        """The caller behind these headers, or 401 (bad key) / 400 (unusable session id)."""
        session_id = _session_id(session)
        key = _bearer_key(authorization) or (api_key or "").strip()
        # The router reads the key from a bearer header only (router.proto), whichever header brought it.
        forwarded = f"Bearer {key}" if key else ""
        if self.dev_mode:
            return Caller(DEV_ACCOUNT, forwarded or authorization or "", session_id)
        account = self._account(key)
        if account is None:
            raise BridgeError(
                401,
                "Incorrect API key provided."
                if key
                else "Missing API key: send Authorization: Bearer <key> or x-api-key: <key>.",
                "authentication_error",
                code="invalid_api_key",
            )
        return Caller(account, forwarded, session_id)

    def _account(self, key: str) -> str | None:
        # Compare every key in constant time so response timing does not reveal a key's prefix.
        found = None
        for known, account in self.api_keys.items():
            if hmac.compare_digest(known.encode(), key.encode()):
                found = account
        return found if key else None


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
