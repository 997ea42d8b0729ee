"""The key webhooks are signed with: the operator's, else one made at first start and kept.

Webhooks are always signed: a receiver that cannot tell our calls from anyone's
would act on forged "batch finished" events. When ``CACHET_ROUTER_WEBHOOK_SECRET``
is unset, the first router to start writes a random key to ``<data dir>/webhook_secret``
(owner-only permissions) and every later start, and every router sharing the data
dir, reads the same key, so signatures survive restarts. The operator hands the
key to receivers (docs/webhooks.md).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

SECRET_FILE_NAME = "webhook_secret"
# Stripe-style prefix: a key found in a log or a config says what it is.
_PREFIX = "whsec_"


def webhook_secret(configured: str, data_dir: Path) -> str:
    """``configured`` when set; else the data dir's stored key, created on first use."""
    if configured:
        return configured
    path = data_dir / SECRET_FILE_NAME
    if not path.exists():
        _create(path)
    secret = path.read_text().strip()
    if not secret:
        raise RuntimeError(f"{path} is empty; delete it (a new key is made) or write the key into it")
    return secret


def _create(path: Path) -> None:
    """Write a new key beside ``path``, then link it into place: never a half-written key file,
    and of two routers starting together the first link wins and both read its key."""
    path.parent.mkdir(parents=True, exist_ok=True)
    draft = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    descriptor = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "w") as sink:
            sink.write(_PREFIX + secrets.token_urlsafe(32) + "\n")
            sink.flush()
            os.fsync(sink.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(draft, path)
    finally:
        draft.unlink()
