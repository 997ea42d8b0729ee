"""The OpenAI Batch API, cancel, default webhooks and webhook attempts, on real processes.

The openai client -> bridge -> router (queue store, dispatcher, webhook sender) ->
tokenizer / one tiny-model engine / usage. Each test has its own account, so the
usage ledger's per-account totals belong to that test alone.
"""

from __future__ import annotations

import io
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx
import openai
import pytest
from service_processes import (
    ENGINE_SERVER_BUILT,
    TINY_MODEL_ID,
    CachetStack,
    ServiceProcess,
)
from webhook_receiver import Receiver

from cachet.common.v1 import common_pb2
from cachet.models.tiny import write_tiny_model
from cachet.router.v1 import router_pb2, router_pb2_grpc
from cachet.router.webhook_secret import SECRET_FILE_NAME
from cachet.router.webhooks import SIGNATURE_HEADER, verify
from cachet.usage.v1 import usage_pb2, usage_pb2_grpc

ACCOUNTS = {f"sk-{name}": f"acct-{name}" for name in ("files", "other", "cancel", "queued", "hooked", "text")}
TIMEOUT = 120.0


@dataclass
class Platform:
    stack: CachetStack
    bridge: ServiceProcess
    receiver: Receiver

    def client(self, account: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://{self.bridge.address}/v1",
            api_key=f"sk-{account}",
            max_retries=0,
            timeout=TIMEOUT,
        )

    def inference(self) -> router_pb2_grpc.InferenceServiceStub:
        return router_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(self.stack.address("router")))

    def ledger(self, account: str) -> list[tuple[int, int, int, int]]:
        """(requests, prompt, cached, completion tokens) recorded for the account."""
        with grpc.insecure_channel(self.stack.address("usage")) as channel:
            reply = usage_pb2_grpc.UsageServiceStub(channel).QueryUsage(
                usage_pb2.QueryUsageRequest(account_id=f"acct-{account}"), timeout=10
            )
        # An account with no record answers one all-zero row.
        rows = [(r.requests, r.prompt_tokens, r.cached_tokens, r.completion_tokens) for r in reply.rows]
        return [row for row in rows if row[0]]


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    if not ENGINE_SERVER_BUILT:
        pytest.skip("the engine server (cachet.engine.main) is not built yet")
    root = tmp_path_factory.mktemp("openai-batches")
    # Answers 500 once, then 200: the default webhook's attempts are both stored.
    receiver = Receiver(statuses=[500])
    router_env = {
        "CACHET_ROUTER_API_KEYS": json.dumps(ACCOUNTS),
        # No CACHET_ROUTER_WEBHOOK_SECRET: the router makes one and keeps it in its data dir.
        "CACHET_ROUTER_WEBHOOK_ALLOWED_NETWORKS": '["127.0.0.1/32"]',
        "CACHET_ROUTER_WEBHOOK_FIRST_BACKOFF_SECONDS": "0.2",
        "CACHET_ROUTER_DEFAULT_WEBHOOKS": json.dumps({"acct-hooked": receiver.url}),
        # A few jobs at a time: a cancel lands while some run and most still wait.
        "CACHET_ROUTER_BATCH_MAX_IN_FLIGHT": "4",
    }
    stack = CachetStack(root, write_tiny_model(root / TINY_MODEL_ID)).start(engines=1, router_env=router_env)
    try:
        yield Platform(stack, stack.start_bridge(CACHET_API_KEYS=json.dumps(ACCOUNTS)), receiver)
    finally:
        stack.stop()
        receiver.close()
        print(stack.logs())


def chat_line(custom_id: str, max_tokens: int = 4, system: str = "") -> dict:
    messages = [{"role": "user", "content": f"[{uuid.uuid4().hex}] Hi"}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    body = {"model": TINY_MODEL_ID, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    body["ignore_eos"] = True
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def upload(client: openai.OpenAI, lines: list[dict | str]) -> str:
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n"
    created = client.files.create(file=("input.jsonl", io.BytesIO(text.encode())), purpose="batch")
    assert created.purpose == "batch" and created.bytes == len(text.encode())
    return created.id


def wait_for(client: openai.OpenAI, batch_id: str, statuses: set[str], timeout: float = 90):
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in statuses:
        assert time.monotonic() < deadline, f"{batch_id} still {batch.status}"
        time.sleep(0.2)
    return batch


def jsonl(client: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_a_batch_file_runs_with_the_openai_client(platform: Platform) -> None:
    client = platform.client("files")
    # A shared system prompt long enough for whole cached blocks: later lines reuse the first's prefix.
    system = f"[{uuid.uuid4().hex}] You are a terse assistant. Answer in one short sentence. " * 3
    good = [chat_line(f"req-{i}", max_tokens=3 + i, system=system) for i in range(3)]
    missing_messages = chat_line("no-messages")
    del missing_messages["body"]["messages"]
    lines = [good[0], "{not json", good[1], missing_messages, good[2]]
    file_id = upload(client, lines)
    batch = client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert batch.status == "in_progress" and batch.metadata == {"job": "nightly"}
    assert batch.request_counts.total == 5
    done = wait_for(client, batch.id, {"completed", "failed"})
    assert done.status == "completed" and done.completed_at
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 2)

    output = jsonl(client, done.output_file_id)
    assert [line["custom_id"] for line in output] == ["req-0", "req-1", "req-2"]
    for index, line in enumerate(output):
        assert line["error"] is None and line["id"].startswith("batch_req_")
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"] == f"{batch.id}-{index}"
        body = response["body"]
        assert body["object"] == "chat.completion" and body["model"] == TINY_MODEL_ID
        assert body["usage"]["completion_tokens"] == 3 + index
        assert isinstance(body["usage"]["prompt_tokens_details"]["cached_tokens"], int)
    usages = [line["response"]["body"]["usage"] for line in output]
    # The batch's usage is the sum of what ran, and the ledger holds exactly that.
    assert done.usage.input_tokens == sum(u["prompt_tokens"] for u in usages)
    assert done.usage.output_tokens == sum(u["completion_tokens"] for u in usages)
    assert done.usage.input_tokens_details.cached_tokens == sum(
        u["prompt_tokens_details"]["cached_tokens"] for u in usages
    )
    assert platform.ledger("files") == [
        (3, done.usage.input_tokens, done.usage.input_tokens_details.cached_tokens, done.usage.output_tokens)
    ]

    errors = jsonl(client, done.error_file_id)
    assert [(e["custom_id"], e["response"], e["error"]["code"], e["error"]["line"]) for e in errors] == [
        ("", None, "invalid_request", 2),
        ("no-messages", None, "invalid_request", 4),
    ]
    assert "messages" in errors[1]["error"]["message"]

    described = client.files.retrieve(done.output_file_id)
    assert described.purpose == "batch_output"
    assert described.bytes == len(client.files.content(done.output_file_id).content)
    assert batch.id in [listed.id for listed in client.batches.list()]
    # An ended batch is not cancelled after the fact; OpenAI answers the same.
    with pytest.raises(openai.BadRequestError) as ended:
        client.batches.cancel(batch.id)
    assert "status 'completed'" in str(ended.value)
    assert client.batches.retrieve(batch.id).status == "completed"


def test_completions_batches_and_list_pagination(platform: Platform) -> None:
    client = platform.client("text")
    ids = []
    for round_ in range(3):
        line = {
            "custom_id": f"text-{round_}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": TINY_MODEL_ID,
                "prompt": "Once upon a time",
                "max_tokens": 2,
                "ignore_eos": True,
            },
        }
        created = client.batches.create(
            input_file_id=upload(client, [line]), endpoint="/v1/completions", completion_window="24h"
        )
        ids.append(created.id)
    done = wait_for(client, ids[0], {"completed"})
    [line] = jsonl(client, done.output_file_id)
    assert line["custom_id"] == "text-0" and line["response"]["body"]["object"] == "text_completion"
    assert line["response"]["body"]["usage"]["completion_tokens"] == 2
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == [ids[2], ids[1]] and first.has_more
    # The client's auto-pagination follows `after` to the last page.
    assert [b.id for b in client.batches.list(limit=2)] == list(reversed(ids))


def test_bad_requests_are_clear_errors(platform: Platform) -> None:
    client = platform.client("files")
    with pytest.raises(openai.BadRequestError) as purpose:
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    assert "purpose" in str(purpose.value)
    file_id = upload(client, [chat_line("a")])
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )
    # A file whose every line is refused makes a failed batch that says why.
    only_bad = client.batches.create(
        input_file_id=upload(client, ["[1, 2]"]), endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert only_bad.status == "failed" and only_bad.failed_at
    assert only_bad.errors is not None and only_bad.errors.data[0].line == 1
    assert (only_bad.request_counts.total, only_bad.request_counts.failed) == (1, 1)
    with pytest.raises(openai.BadRequestError, match="status 'failed'"):
        client.batches.cancel(only_bad.id)


@pytest.mark.parametrize("url", ["http://[::1]:9/hook", "http://0.0.0.0:9/hook"])
def test_a_webhook_to_an_address_not_allowed_is_refused_when_queued(platform: Platform, url: str) -> None:
    # The router allows 127.0.0.1/32 only; other loopback spellings stay refused, as private ranges are.
    client = platform.client("files")
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(
            input_file_id=upload(client, [chat_line("a")]),
            endpoint="/v1/chat/completions",
            completion_window="24h",
            extra_body={"webhook_url": url},
        )
    assert refused.value.param == "webhook_url"
    assert "not a public address" in refused.value.message
    queued = httpx.post(
        f"http://{platform.bridge.address}/ai/run/{TINY_MODEL_ID}?queueRequest=true",
        json={"requests": [{"prompt": "hi", "max_tokens": 1}], "webhook_url": url},
        headers={"Authorization": "Bearer sk-files"},
        timeout=10,
    )
    assert queued.status_code == 400, queued.text
    error = queued.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "webhook_url")


def test_another_account_sees_neither_files_nor_batches(platform: Platform) -> None:
    owner, other = platform.client("files"), platform.client("other")
    file_id = upload(owner, [chat_line("mine")])
    batch = owner.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    for attempt in (
        lambda: other.files.retrieve(file_id),
        lambda: other.files.content(file_id),
        lambda: other.batches.retrieve(batch.id),
        lambda: other.batches.cancel(batch.id),
        lambda: other.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert batch.id not in [b.id for b in other.batches.list()]
    done = wait_for(owner, batch.id, {"completed"})
    with pytest.raises(openai.NotFoundError):
        other.files.content(done.output_file_id)


def test_cancel_stops_queued_lines_and_bills_only_what_ran(platform: Platform) -> None:
    client = platform.client("cancel")
    count = 40
    file_id = upload(client, [chat_line(f"c-{i}", max_tokens=48) for i in range(count)])
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).request_counts.completed < 2:
        assert time.monotonic() < deadline, "the batch never started"
        time.sleep(0.05)
    cancelling = client.batches.cancel(batch.id)
    # Started lines run on (cancelling) unless none was running at that instant.
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = wait_for(client, batch.id, {"cancelled"})
    ran = done.request_counts.completed
    assert 2 <= ran < count and done.request_counts.failed == 0 and done.cancelled_at
    errors = jsonl(client, done.error_file_id)
    assert len(errors) == count - ran and {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    output = jsonl(client, done.output_file_id)
    assert {line["custom_id"] for line in output} | {e["custom_id"] for e in errors} == {
        f"c-{i}" for i in range(count)
    }
    # Only what ran is billed.
    expected = [
        (
            ran,
            done.usage.input_tokens,
            done.usage.input_tokens_details.cached_tokens,
            done.usage.output_tokens,
        )
    ]
    assert platform.ledger("cancel") == expected
    # Cancelling again changes nothing.
    assert client.batches.cancel(batch.id).status == "cancelled"


def test_a_queued_workers_ai_batch_is_cancelled_over_grpc(platform: Platform) -> None:
    inference = platform.inference()
    metadata = (("authorization", "Bearer sk-queued"),)
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    requests = [
        router_pb2.QueuedRequest(
            chat=router_pb2.ChatCompletionRequest(
                model=TINY_MODEL_ID,
                messages=[
                    common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text=f"{i} hi")])
                ],
                sampling=sampling,
            )
        )
        for i in range(40)
    ]
    queued = inference.QueueRequests(
        router_pb2.QueueRequestsRequest(model=TINY_MODEL_ID, requests=requests), metadata=metadata, timeout=10
    )
    cancel = router_pb2.CancelQueuedBatchRequest(request_id=queued.request_id)
    with pytest.raises(grpc.RpcError) as foreign:
        inference.CancelQueuedBatch(cancel, metadata=(("authorization", "Bearer sk-other"),), timeout=10)
    assert foreign.value.code() == grpc.StatusCode.NOT_FOUND
    poll = router_pb2.GetQueuedBatchRequest(request_id=queued.request_id)
    deadline = time.monotonic() + 60
    while (
        inference.GetQueuedBatch(poll, metadata=metadata, timeout=10).status == router_pb2.BATCH_STATUS_QUEUED
    ):
        assert time.monotonic() < deadline, "the batch never started"
        time.sleep(0.05)
    first = inference.CancelQueuedBatch(cancel, metadata=metadata, timeout=10)
    assert first.status in (router_pb2.BATCH_STATUS_CANCELLING, router_pb2.BATCH_STATUS_CANCELLED)
    deadline = time.monotonic() + 60
    while (batch := inference.GetQueuedBatch(poll, metadata=metadata, timeout=10)).status != (
        router_pb2.BATCH_STATUS_CANCELLED
    ):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert len(batch.results) == 40
    completions = [r.completion for r in batch.results if r.HasField("completion")]
    cancelled = [r.error for r in batch.results if r.HasField("error")]
    assert 1 <= len(completions) < 40 and {e.code for e in cancelled} == {"CANCELLED"}
    assert all(c.usage.completion_tokens == 48 for c in completions)
    ledger = platform.ledger("queued")
    assert sum(row[0] for row in ledger) == len(completions)
    # Workers AI's poll over REST says so too.
    polled = httpx.post(
        f"http://{platform.bridge.address}/ai/run/{TINY_MODEL_ID}",
        json={"request_id": queued.request_id},
        headers={"Authorization": "Bearer sk-queued"},
        timeout=10,
    )
    assert polled.status_code == 200 and polled.json()["result"]["status"] == "cancelled"


def test_the_account_default_webhook_is_called_and_its_attempts_are_listed(platform: Platform) -> None:
    inference = platform.inference()
    metadata = (("authorization", "Bearer sk-hooked"),)
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    request = router_pb2.ChatCompletionRequest(
        model=TINY_MODEL_ID,
        messages=[common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text="hi")])],
        sampling=sampling,
    )
    # No webhook_url: the account's default (CACHET_ROUTER_DEFAULT_WEBHOOKS) is used.
    queued = inference.QueueRequests(
        router_pb2.QueueRequestsRequest(
            model=TINY_MODEL_ID, requests=[router_pb2.QueuedRequest(chat=request)]
        ),
        metadata=metadata,
        timeout=10,
    )
    listing = router_pb2.ListWebhookAttemptsRequest(request_id=queued.request_id)
    deadline = time.monotonic() + 60
    while (
        attempts := inference.ListWebhookAttempts(listing, metadata=metadata, timeout=10)
    ).state != "delivered":
        assert time.monotonic() < deadline, attempts
        time.sleep(0.1)
    assert attempts.webhook_url == platform.receiver.url
    assert [(a.attempt, a.http_status, a.error) for a in attempts.attempts] == [
        (1, 500, "HTTP 500"),
        (2, 200, ""),
    ]
    assert attempts.attempts[0].at_ms <= attempts.attempts[1].at_ms
    [(_, headers, body), *_] = [call for call in platform.receiver.calls if call[0] == 200]
    # Signed with the key the router made at its first start and stored in its data dir.
    secret = (platform.stack.log_dir / "router-data" / SECRET_FILE_NAME).read_text().strip()
    assert secret.startswith("whsec_")
    assert verify(secret, headers[SIGNATURE_HEADER], body)
    assert json.loads(body)["request_id"] == queued.request_id
    with pytest.raises(grpc.RpcError) as foreign:
        inference.ListWebhookAttempts(listing, metadata=(("authorization", "Bearer sk-other"),), timeout=10)
    assert foreign.value.code() == grpc.StatusCode.NOT_FOUND
    # The same over REST.
    path = f"http://{platform.bridge.address}/v1/batches/{queued.request_id}/webhook_attempts"
    listed = httpx.get(path, headers={"authorization": "Bearer sk-hooked"}, timeout=10)
    assert listed.status_code == 200, listed.text
    assert listed.json() == {
        "object": "list",
        "webhook_url": platform.receiver.url,
        "state": "delivered",
        "data": [
            {
                "object": "webhook_attempt",
                "attempt": a.attempt,
                "at": a.at_ms,
                "http_status": a.http_status,
                "error": a.error or None,
            }
            for a in attempts.attempts
        ],
    }
    other = httpx.get(path, headers={"authorization": "Bearer sk-other"}, timeout=10)
    assert other.status_code == 404 and other.json()["error"]["type"] == "not_found_error"
