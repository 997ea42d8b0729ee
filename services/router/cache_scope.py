"""Whose cached prefixes a request may reuse: the salt of its prefix block hashes.

A shared prefix cache is a side channel: a request whose prompt begins like another
tenant's answers sooner and reports cached tokens, which tells the caller what
someone else sent. So the router salts every request's block hashes with its
*scope* (the account, or the cache group an operator put the account in) and the
caller's own ``cache_salt``, and sends that salt to the engine
(``GenerateRequest.cache_salt``). The engine names KV blocks with it, its KV events
carry the salted hashes to the cache index, and the router asks the index with the
same salted hashes: all three see one name per (scope, salt, prefix), and no block
is ever found across scopes.

With isolation off every account shares one scope (a single-tenant deployment,
where cross-account hits are wanted); a caller's own salt still separates its
requests.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from cachet.errors import InvalidArgument

MAX_CACHE_SALT_CHARS = 256
# The one scope of a deployment that shares its cache between accounts.
SHARED_SCOPE = ""


def cache_salt(scope: str, request_salt: str = "") -> str:
    """The engine's cache salt for ``scope`` plus a caller's own salt ('' when both are empty).

    A digest, not the two joined: no choice of salt can name another scope's blocks
    (each part is length-prefixed), and account ids stay out of the engines.
    """
    if not scope and not request_salt:
        return ""  # shared and unsalted: the model's plain hash chain, as before isolation
    hasher = hashlib.blake2b(b"cachet-cache-scope-v1", digest_size=16)
    for part in (scope, request_salt):
        encoded = part.encode()
        hasher.update(len(encoded).to_bytes(4, "little"))
        hasher.update(encoded)
    return hasher.hexdigest()


def validate_cache_salt(request_salt: str) -> None:
    if len(request_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidArgument(
            f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters", param="cache_salt"
        )


@dataclass(frozen=True)
class CacheScopes:
    """The operator's sharing rule: isolated per account (default), per cache group, or off."""

    isolate: bool = True
    # Account id -> group id: accounts of one group (an organisation) share cached prefixes.
    groups: Mapping[str, str] = field(default_factory=dict)

    def scope_of(self, account_id: str) -> str:
        if not self.isolate:
            return SHARED_SCOPE
        group = self.groups.get(account_id)
        # Prefixed so that a group and an account of the same name stay apart.
        return f"group:{group}" if group is not None else f"account:{account_id}"

    def salt_for(self, account_id: str, request_salt: str = "") -> str:
        return cache_salt(self.scope_of(account_id), request_salt)
