"""Who is calling: the account billed and the session kept on one replica.

The account comes from ``authorization: Bearer <key>`` metadata mapped through the
configured API keys; with no keys configured (development on loopback) everyone is
``anonymous``. The session comes from ``x-session-affinity`` metadata, which wins
over the request's own ``session_id`` field.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cachet.errors import Unauthenticated

ANONYMOUS_ACCOUNT = "anonymous"
SESSION_METADATA_KEY = "x-session-affinity"
_BEARER = "bearer "


@dataclass(frozen=True)
class Caller:
    account_id: str
    session_id: str


class AccountDirectory:
    """Maps API keys to account ids."""

    def __init__(self, api_keys: Mapping[str, str]) -> None:
        self._accounts = dict(api_keys)

    def caller(self, metadata: Iterable[tuple[str, str | bytes]] | None, request_session_id: str) -> Caller:
        headers = {key.lower(): value for key, value in metadata or () if isinstance(value, str)}
        session = headers.get(SESSION_METADATA_KEY, "").strip() or request_session_id
        return Caller(account_id=self._account(headers.get("authorization", "")), session_id=session)

    def _account(self, authorization: str) -> str:
        if not self._accounts:
            return ANONYMOUS_ACCOUNT
        if not authorization.lower().startswith(_BEARER):
            raise Unauthenticated("missing 'authorization: Bearer <key>' metadata")
        account = self._accounts.get(authorization[len(_BEARER) :].strip())
        if account is None:
            raise Unauthenticated("unknown API key")
        return account
