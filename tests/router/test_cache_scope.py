"""Cache scopes: which requests may share cached prefixes, as salts of the block hash."""

from __future__ import annotations

import pytest

from cachet.block_hash import block_hashes
from cachet.errors import InvalidArgument
from cachet.router.cache_scope import MAX_CACHE_SALT_CHARS, CacheScopes, cache_salt, validate_cache_salt

PROMPT = list(range(48))


def test_each_account_gets_its_own_salt_and_so_its_own_hash_chain() -> None:
    scopes = CacheScopes()
    a, b = scopes.salt_for("acct-a"), scopes.salt_for("acct-b")
    assert a and b and a != b
    assert scopes.salt_for("acct-a") == a  # stable: the same account finds its own prefixes
    hashes_a = block_hashes(PROMPT, "m", cache_salt=a)
    hashes_b = block_hashes(PROMPT, "m", cache_salt=b)
    assert len(hashes_a) == 3 and not set(hashes_a) & set(hashes_b)


def test_a_callers_own_salt_separates_requests_of_one_account() -> None:
    scopes = CacheScopes()
    assert scopes.salt_for("acct-a", "run-1") != scopes.salt_for("acct-a")
    assert scopes.salt_for("acct-a", "run-1") != scopes.salt_for("acct-a", "run-2")
    assert scopes.salt_for("acct-a", "run-1") == scopes.salt_for("acct-a", "run-1")


def test_no_request_salt_reaches_another_accounts_scope() -> None:
    scopes = CacheScopes()
    # Joined naively, ("account:a", "b") and ("account:ab", "") could collide; length prefixes keep them apart.
    assert cache_salt("account:a", "b") != cache_salt("account:ab", "")
    assert scopes.salt_for("a", "b") != scopes.salt_for("ab")
    # A group and an account of the same name are different scopes.
    grouped = CacheScopes(groups={"acct-x": "acct-y"})
    assert grouped.salt_for("acct-x") != grouped.salt_for("acct-y")


def test_accounts_of_one_group_share_a_scope() -> None:
    scopes = CacheScopes(groups={"acct-a": "org-1", "acct-b": "org-1", "acct-c": "org-2"})
    assert scopes.salt_for("acct-a") == scopes.salt_for("acct-b")
    assert scopes.salt_for("acct-a") != scopes.salt_for("acct-c")
    assert scopes.salt_for("acct-a") != scopes.salt_for("acct-d")  # not in any group: its own


def test_without_isolation_accounts_share_the_plain_chain_unless_they_salt() -> None:
    shared = CacheScopes(isolate=False)
    assert shared.salt_for("acct-a") == shared.salt_for("acct-b") == ""
    assert block_hashes(PROMPT, "m", cache_salt=shared.salt_for("acct-a")) == block_hashes(PROMPT, "m")
    assert shared.salt_for("acct-a", "mine") == shared.salt_for("acct-b", "mine") != ""


def test_an_overlong_salt_is_invalid_argument() -> None:
    validate_cache_salt("x" * MAX_CACHE_SALT_CHARS)
    with pytest.raises(InvalidArgument) as refused:
        validate_cache_salt("x" * (MAX_CACHE_SALT_CHARS + 1))
    assert refused.value.param == "cache_salt"
