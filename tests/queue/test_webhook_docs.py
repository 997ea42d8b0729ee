"""docs/webhooks.md's verification snippet, run against the router's own signer: the doc cannot drift."""

from __future__ import annotations

import re
import time
from pathlib import Path

from cachet.router.webhooks import sign

DOC = Path(__file__).resolve().parents[2] / "docs" / "webhooks.md"


def documented_verifier():
    [snippet] = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    namespace: dict = {}
    exec(snippet, namespace)  # noqa: S102 - the doc's own code, which receivers copy
    return namespace["verify_cachet_signature"]


def test_the_documented_snippet_verifies_what_the_router_signs_and_nothing_else() -> None:
    verify = documented_verifier()
    body = b'{"type":"batch.finished","request_id":"batch-1"}'
    now = int(time.time())
    header = sign("whsec_doc", now, body)
    assert verify("whsec_doc", header, body)
    assert not verify("whsec_other", header, body)
    assert not verify("whsec_doc", header, body.replace(b"batch-1", b"batch-2"))
    assert not verify("whsec_doc", sign("whsec_doc", now - 600, body), body)  # a replay, too old
    assert not verify("whsec_doc", "v1=00", body)
