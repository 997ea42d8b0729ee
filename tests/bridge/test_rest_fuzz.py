"""Every REST route fuzzed from the bridge's own OpenAPI document (schemathesis), on real processes.

One stack on the tiny random-weight model (tests/service_processes.py): bridge ->
router -> tokenizer / one engine / usage, with two accounts' keys. Schemathesis
draws each operation's requests from ``/openapi.json``, valid ones and broken
ones, and sends them three ways: with account A's key, with no key or a wrong one,
and with account B's key aimed at the files, batches, responses and queued
requests that A made first. Whatever comes back holds to:

- never a 5xx;
- every 4xx is OpenAI's ``{"error": {"message", "type", ...}}``, or Anthropic's
  ``{"type": "error", "error": {"type", "message"}}`` under /v1/messages;
- no key, or a wrong one, never gets past authentication on a secured route;
- B never sees A's data: A's ids only where B sent them, A's nonce never.

Hypothesis runs derandomized with schemathesis' seed fixed and no example database,
so every run sends the same requests; the example counts keep the module near a
minute on two shared cores.
"""

from __future__ import annotations

import io
import json
import os
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import schemathesis
from service_processes import ENGINE_SERVER_BUILT, TINY_MODEL_ID, CachetStack, ServiceProcess

from cachet.bridge.app import create_app
from cachet.bridge.errors import is_anthropic_path
from cachet.bridge.settings import BridgeSettings
from cachet.models.tiny import write_tiny_model

KEY_A, KEY_B = "sk-fuzz-a", "sk-fuzz-b"
ACCOUNTS = {KEY_A: "acct-fuzz-a", KEY_B: "acct-fuzz-b"}
# In everything account A stores; account B must never read it back.
NONCE_A = "nonce-a-" + uuid.UUID(int=31).hex
TIMEOUT = 30.0
# Token counts a drawn request may ask for, at most: enough to run the model, not to wait on it.
_LIMIT_FIELDS = {"max_tokens", "max_completion_tokens", "max_output_tokens", "max_new_tokens"}
_TOKEN_FIELDS = _LIMIT_FIELDS | {"n", "best_of"}
_MAX_TOKENS = 4

# The document the bridge serves (test_the_bridge_serves_this_document holds the running one to it).
DOCUMENT = create_app(BridgeSettings(api_keys=ACCOUNTS)).openapi()


def _config(max_examples: int) -> schemathesis.Config:
    return schemathesis.Config.from_dict(
        {
            "seed": 31,
            # Hypothesis' health checks time the drawing: on a busy box "too slow" would flake.
            "suppress-health-check": ["all"],
            "generation": {
                "max-examples": max_examples,
                "deterministic": True,
                "database": "none",
                "mode": "all",
                # The keys are the test's to choose, not drawn from the security schemes.
                "with-security-parameters": False,
            },
            # Coverage's exhaustive boundary cases would be hundreds a route: fuzzing alone, bounded.
            "phases": {"coverage": {"enabled": False}, "stateful": {"enabled": False}},
        }
    )


# Examples per operation with a valid key; a longer hunt: CACHET_FUZZ_EXAMPLES=200 pytest <this file>.
EXAMPLES = int(os.environ.get("CACHET_FUZZ_EXAMPLES", "12"))
WITH_KEY = schemathesis.openapi.from_dict(DOCUMENT, config=_config(EXAMPLES))
# Authentication comes first, whatever the request: a couple of examples a route show it.
WITHOUT_KEY = schemathesis.openapi.from_dict(DOCUMENT, config=_config(max(2, EXAMPLES // 6))).include(
    func=lambda ctx: "security" in ctx.operation.definition.raw
)
# The routes that name a stored thing (or continue one), list the caller's things, or report on them.
AS_OTHER = schemathesis.openapi.from_dict(DOCUMENT, config=_config(max(4, EXAMPLES // 3))).include(
    path_regex=r"\{(file_id|batch_id|response_id)\}|^/v1/(batches|responses|usage)$|/ai/run/"
)


@dataclass
class Owned:
    """What account A made before the fuzzing: B must reach none of it."""

    file_id: str
    batch_id: str
    response_id: str
    queued_id: str

    @property
    def ids(self) -> list[str]:
        return [self.file_id, self.batch_id, self.response_id, self.queued_id]


@dataclass
class Platform:
    stack: CachetStack
    bridge: ServiceProcess
    owned: Owned

    @property
    def url(self) -> str:
        return f"http://{self.bridge.address}"


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    if not ENGINE_SERVER_BUILT:
        pytest.skip("the engine server (cachet.engine.main) is not built yet")
    root = tmp_path_factory.mktemp("rest-fuzz")
    router_env = {"CACHET_ROUTER_API_KEYS": json.dumps(ACCOUNTS)}
    stack = CachetStack(root, write_tiny_model(root / TINY_MODEL_ID)).start(engines=1, router_env=router_env)
    try:
        bridge = stack.start_bridge(
            CACHET_API_KEYS=json.dumps(ACCOUNTS), CACHET_BRIDGE_TOKENIZER_ADDRESS=stack.address("tokenizer")
        )
        url = f"http://{bridge.address}"
        yield Platform(stack, bridge, _make_owned(url))
    finally:
        stack.stop()
        print(stack.logs())


def _make_owned(url: str) -> Owned:
    """A's file, batch, stored response and queued request, each carrying A's nonce."""
    headers = {"Authorization": f"Bearer {KEY_A}"}
    body = {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": NONCE_A}], "max_tokens": 2}
    line = {"custom_id": NONCE_A, "method": "POST", "url": "/v1/chat/completions", "body": body}
    with httpx.Client(base_url=url, headers=headers, timeout=TIMEOUT) as client:
        upload = client.post(
            "/v1/files",
            files={"file": ("input.jsonl", io.BytesIO(json.dumps(line).encode() + b"\n"))},
            data={"purpose": "batch"},
        )
        file_id = _ok(upload)["id"]
        batch = client.post(
            "/v1/batches",
            json={
                "input_file_id": file_id,
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
                "metadata": {"owner": NONCE_A},
            },
        )
        response = client.post(
            "/v1/responses",
            json={"model": TINY_MODEL_ID, "input": NONCE_A, "max_output_tokens": 2, "store": True},
        )
        queued = client.post(
            f"/ai/run/{TINY_MODEL_ID}",
            params={"queueRequest": "true"},
            json={"requests": [{"prompt": NONCE_A, "max_tokens": 2}]},
        )
        return Owned(file_id, _ok(batch)["id"], _ok(response)["id"], _ok(queued)["result"]["request_id"])


def _ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return response.json()


# ---------------------------------------------------------------- what every answer holds to


def check_answer(response: Any, path: str) -> None:
    """Never a 5xx; a 4xx in the error shape of the API that ``path`` belongs to."""
    request = f"{response.request.method} {response.request.url}\n{(response.request.body or b'')[:2000]!r}"
    assert response.status_code < 500, f"{response.status_code} for {request}\n{response.text[:2000]}"
    if response.status_code < 400:
        return
    try:
        body = response.json()
    except ValueError:
        pytest.fail(f"{response.status_code} without a JSON body for {request}\n{response.text[:2000]}")
    if is_anthropic_path(path):
        shaped = body.get("type") == "error" and _has_strings(body.get("error"), "type", "message")
    else:
        shaped = _has_strings(body.get("error"), "message", "type")
    assert shaped, f"{response.status_code} mis-shaped for {request}\n{body}"


def _has_strings(error: Any, *names: str) -> bool:
    return isinstance(error, dict) and all(isinstance(error.get(name), str) for name in names)


def _runnable(case: schemathesis.Case) -> None:
    """Most drawn requests name the tiny model (a quarter keep their made-up one) and ask for a
    few tokens at most, so that valid ones run the model quickly rather than stop at 404, and
    queued ones do not keep the cores busy after their test."""
    if isinstance(case.path_parameters, dict) and isinstance(case.path_parameters.get("model"), str):
        case.path_parameters["model"] = _model(case.path_parameters["model"])
    _cap(case.body)


def _model(drawn: str) -> str:
    return drawn if zlib.crc32(drawn.encode()) % 4 == 0 else TINY_MODEL_ID


def _half(drawn: Any) -> bool:
    return zlib.crc32(json.dumps(drawn, sort_keys=True, default=str).encode()) % 2 == 0


def _cap(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _cap(item)
    elif isinstance(node, dict):
        for name, value in node.items():
            if name == "model" and isinstance(value, str):
                node[name] = _model(value)
            elif name == "messages" and isinstance(value, list) and _half(value):
                # Drawn conversations rarely hold together (a tool turn with no call before it):
                # half get one plain turn, so the options beside them reach the router.
                node[name] = [{"role": "user", "content": "Say something."}]
            elif name in _TOKEN_FIELDS and type(value) in (int, float) and value > _MAX_TOKENS:
                # (1155.0 is a valid count too.)
                node[name] = _MAX_TOKENS
            else:
                _cap(value)
        # A request that leaves its limit out (or null) would run to the model's window.
        if "input" in node and node.get("max_output_tokens") is None:
            node["max_output_tokens"] = _MAX_TOKENS
        elif ("messages" in node or "prompt" in node) and all(node.get(f) is None for f in _LIMIT_FIELDS):
            node["max_tokens"] = _MAX_TOKENS


# ---------------------------------------------------------------- the tests


def test_the_bridge_serves_this_document(platform: Platform) -> None:
    served = httpx.get(f"{platform.url}/openapi.json", timeout=TIMEOUT)
    assert served.status_code == 200
    assert served.json() == DOCUMENT


def test_the_dashboard_shows_only_the_callers_own(platform: Platform) -> None:
    """The dashboard is HTML, outside the document: B's counts none of A's batch; no key is 401."""
    mine, theirs = (
        httpx.get(f"{platform.url}/dashboard", headers={"Authorization": f"Bearer {key}"}, timeout=TIMEOUT)
        for key in (KEY_A, KEY_B)
    )
    assert mine.status_code == theirs.status_code == 200
    assert ACCOUNTS[KEY_A] in mine.text and ACCOUNTS[KEY_A] not in theirs.text
    assert "Batch requests: 0 completed,\n0 failed, 0 pending." in theirs.text
    anonymous = httpx.get(f"{platform.url}/dashboard", timeout=TIMEOUT)
    assert anonymous.status_code == 401 and anonymous.json()["error"]["type"] == "authentication_error"


# Parametrized by the key even where there is one: the item's id then names the operation too
# (schemathesis' own ids lose it under pytest 9).
@pytest.mark.parametrize("key", [KEY_A], ids=["account-a"])
@WITH_KEY.parametrize()
def test_fuzz_with_a_key(case: schemathesis.Case, platform: Platform, key: str) -> None:
    _runnable(case)
    header = {"x-api-key": key} if is_anthropic_path(case.path) else {"Authorization": f"Bearer {key}"}
    check_answer(case.call(base_url=platform.url, headers=header, timeout=TIMEOUT), case.path)


@pytest.mark.parametrize(
    "header",
    [{}, {"Authorization": "Bearer sk-wrong"}, {"x-api-key": "sk-wrong"}, {"Authorization": KEY_A}],
    ids=["none", "wrong-bearer", "wrong-x-api-key", "not-bearer"],
)
@WITHOUT_KEY.parametrize()
def test_fuzz_without_a_valid_key(
    case: schemathesis.Case, platform: Platform, header: dict[str, str]
) -> None:
    response = case.call(base_url=platform.url, headers=header, timeout=TIMEOUT)
    check_answer(response, case.path)
    assert response.status_code >= 400, (
        f"{case.method} {case.path} answered {response.status_code} unauthenticated"
    )


# Body fields that name a stored thing -> which of A's things B names there.
_OWNED_IN_BODY = {
    "request_id": "queued_id",
    "input_file_id": "file_id",
    "previous_response_id": "response_id",
}


@pytest.mark.parametrize("key", [KEY_B], ids=["account-b"])
@AS_OTHER.parametrize()
def test_fuzz_as_another_account(case: schemathesis.Case, platform: Platform, key: str) -> None:
    """B's requests name A's ids wherever an id goes: never 2xx for those, A's nonce never seen."""
    owned = platform.owned
    _runnable(case)
    for name in ("file_id", "batch_id", "response_id"):
        if name in (case.path_parameters or {}):
            drawn = str(case.path_parameters[name])
            case.path_parameters[name] = owned.ids[zlib.crc32(drawn.encode()) % len(owned.ids)]
    if isinstance(case.body, dict):
        for name, owned_id in _OWNED_IN_BODY.items():
            if name in case.body:
                case.body[name] = getattr(owned, owned_id)
    response = case.call(base_url=platform.url, headers={"Authorization": f"Bearer {key}"}, timeout=TIMEOUT)
    check_answer(response, case.path)
    sent = f"{response.request.url} {response.request.body!r}"
    assert NONCE_A not in response.text, f"B read A's data: {sent}\n{response.text[:2000]}"
    for owned_id in owned.ids:
        if owned_id in sent:
            assert response.status_code >= 400, f"B reached A's {owned_id}: {sent}\n{response.text[:2000]}"
        else:
            assert owned_id not in response.text, (
                f"B was shown A's {owned_id}: {sent}\n{response.text[:2000]}"
            )
