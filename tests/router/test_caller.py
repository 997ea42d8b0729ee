"""Who is calling: API key to account, session from metadata or request."""

from __future__ import annotations

import pytest

from cachet.errors import Unauthenticated
from cachet.router.caller import ANONYMOUS_ACCOUNT, AccountDirectory, Caller


def test_no_keys_configured_means_anonymous() -> None:
    caller = AccountDirectory({}).caller([("authorization", "Bearer whatever")], "")
    assert caller == Caller(ANONYMOUS_ACCOUNT, "")


def test_bearer_key_maps_to_its_account() -> None:
    directory = AccountDirectory({"sk-1": "acct-1", "sk-2": "acct-2"})
    assert directory.caller([("authorization", "Bearer sk-2")], "").account_id == "acct-2"


@pytest.mark.parametrize("metadata", [[], [("authorization", "Bearer nope")], [("authorization", "sk-1")]])
def test_missing_or_unknown_key_is_unauthenticated(metadata: list[tuple[str, str]]) -> None:
    with pytest.raises(Unauthenticated):
        AccountDirectory({"sk-1": "acct-1"}).caller(metadata, "")


def test_session_metadata_wins_over_request_field() -> None:
    directory = AccountDirectory({})
    assert directory.caller([("x-session-affinity", "meta")], "field").session_id == "meta"
    assert directory.caller([], "field").session_id == "field"
