"""OpenAI batch input lines -> protos, and batches / result files -> JSON matching the declared models."""

from __future__ import annotations

import json

from cachet.bridge import batch_convert
from cachet.bridge.batch_schemas import BatchList, BatchObject, BatchOutputLine, FileObject
from cachet.common.v1 import common_pb2
from cachet.router.v1 import router_pb2

CHAT = "/v1/chat/completions"


def line(custom_id: str, url: str = CHAT, **body: object) -> bytes:
    payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3} | body
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": payload}).encode()


def test_good_lines_become_typed_requests_and_bad_ones_are_reported_by_line() -> None:
    content = b"\n".join(
        [
            line("a", temperature=0),
            b"",  # blank lines are skipped, but still counted
            b"{oops",
            b"[1]",
            line("b", url="/v1/completions", prompt="x"),
            line("c", temperature=7),
            line("d", stream=True),
            json.dumps({"custom_id": "e", "method": "GET", "url": CHAT, "body": {}}).encode(),
            line("f"),
        ]
    )
    lines, rejected = batch_convert.parse_input_file(content, CHAT)
    assert [(good.custom_id, good.line) for good in lines] == [("a", 1), ("f", 9)]
    first = lines[0].request.chat
    assert (first.model, first.sampling.max_tokens, first.sampling.temperature) == ("m", 3, 0)
    assert first.messages[0].role == "user"
    refused = [(r.custom_id, r.error.line, r.error.code) for r in rejected]
    assert refused == [
        ("", 3, "invalid_request"),
        ("", 4, "invalid_request"),
        ("b", 5, "invalid_request"),
        ("c", 6, "invalid_request"),
        ("d", 7, "invalid_request"),
        ("e", 8, "invalid_request"),
    ]
    messages = [r.error.message for r in rejected]
    assert messages[0] == "line 3: not valid JSON"
    assert "batch's endpoint" in messages[2]
    assert messages[3].startswith("line 6: body.temperature")
    assert "stream" in messages[4]
    assert "method" in messages[5]


def test_batch_json_matches_openai_s_batch_object() -> None:
    batch = router_pb2.Batch(
        id="batch-1",
        endpoint=CHAT,
        input_file_id="file-1",
        completion_window="24h",
        status=router_pb2.OPEN_AI_BATCH_STATUS_COMPLETED,
        output_file_id="file-output-batch-1",
        created_at=100,
        in_progress_at=100,
        expires_at=100 + 86400,
        finalizing_at=120,
        completed_at=120,
        total=3,
        completed=2,
        failed=1,
        metadata={"k": "v"},
        model="m",
        usage=common_pb2.Usage(prompt_tokens=10, cached_tokens=4, completion_tokens=6),
    )
    rendered = batch_convert.batch_to_json(batch)
    BatchObject.model_validate(rendered)
    assert rendered["status"] == "completed" and rendered["error_file_id"] is None
    assert rendered["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert rendered["usage"]["input_tokens_details"] == {"cached_tokens": 4}
    assert rendered["usage"]["total_tokens"] == 16
    listed = batch_convert.batch_list_to_json(router_pb2.ListBatchesResponse(batches=[batch], has_more=True))
    BatchList.model_validate(listed)
    assert (listed["first_id"], listed["last_id"], listed["has_more"]) == ("batch-1", "batch-1", True)
    failed = router_pb2.Batch(
        id="batch-2",
        status=router_pb2.OPEN_AI_BATCH_STATUS_FAILED,
        errors=[router_pb2.BatchLineError(code="invalid_request", message="line 1: bad", line=1)],
    )
    rendered = batch_convert.batch_to_json(failed)
    BatchObject.model_validate(rendered)
    assert rendered["errors"]["data"] == [
        {"code": "invalid_request", "message": "line 1: bad", "param": None, "line": 1}
    ]
    stored = router_pb2.File(id="file-1", bytes=5, created_at=1, filename="in.jsonl", purpose="batch")
    FileObject.model_validate(batch_convert.file_to_json(stored))


def test_result_files_are_openai_s_output_lines() -> None:
    completion = router_pb2.ChatCompletion(
        id="batch-1-0",
        model="m",
        created=5,
        content="hello",
        finish_reason=common_pb2.FINISH_REASON_LENGTH,
        usage=common_pb2.Usage(prompt_tokens=7, cached_tokens=3, completion_tokens=2),
    )
    results = router_pb2.BatchResults(
        batch_id="batch-1",
        lines=[
            router_pb2.BatchResultLine(
                custom_id="a", request_id="batch-1-0", completion=completion, endpoint=CHAT
            ),
            router_pb2.BatchResultLine(
                custom_id="b",
                request_id="batch-1-1",
                error=router_pb2.RequestError(code="INVALID_ARGUMENT", message="prompt too long"),
                endpoint=CHAT,
            ),
            router_pb2.BatchResultLine(
                custom_id="c",
                line_error=router_pb2.BatchLineError(code="batch_cancelled", message="cancelled"),
                endpoint=CHAT,
            ),
            router_pb2.BatchResultLine(
                line_error=router_pb2.BatchLineError(code="invalid_request", message="bad", line=4),
                endpoint=CHAT,
            ),
        ],
    )
    parsed = [json.loads(text) for text in batch_convert.results_to_jsonl(results).splitlines()]
    for rendered in parsed:
        BatchOutputLine.model_validate(rendered)
    ok, failed, cancelled, refused = parsed
    assert ok["id"] == "batch_req_batch-1-0" and ok["error"] is None
    assert ok["response"]["status_code"] == 200 and ok["response"]["request_id"] == "batch-1-0"
    assert ok["response"]["body"]["choices"][0]["message"]["content"] == "hello"
    assert ok["response"]["body"]["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    assert failed["response"]["status_code"] == 400
    assert failed["response"]["body"]["error"]["message"] == "prompt too long"
    assert cancelled["response"] is None and cancelled["error"]["code"] == "batch_cancelled"
    assert cancelled["id"] == "batch_req_batch-1-c"
    assert refused["id"] == "batch_req_batch-1-4" and refused["error"]["line"] == 4
