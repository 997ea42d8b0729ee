"""The tokenizer service as a real process (``python -m cachet.tokenizer``), called over gRPC."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cachet.block_hash import block_hashes
from cachet.common.v1 import common_pb2
from cachet.errors import error_info_from_metadata
from cachet.loopback_port import free_loopback_port
from cachet.tokenizer.chat_messages import messages_to_dicts, tools_to_dicts
from cachet.tokenizer.tokenizer_model import TokenizerModel
from cachet.tokenizer.v1 import tokenizer_pb2 as pb
from cachet.tokenizer.v1 import tokenizer_pb2_grpc

MAX_INPUT_CHARS = 2000
REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 90.0


def _wait_until_serving(address: str, process: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(f"tokenizer exited with {process.returncode}:\n{log_path.read_text()}")
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    process.kill()
    pytest.fail(f"tokenizer did not serve within {START_TIMEOUT_S}s:\n{log_path.read_text()}")


@pytest.fixture(scope="module")
def service_address(
    tiny_model_dir: Path, tools_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    port = free_loopback_port()
    work = tmp_path_factory.mktemp("tokenizer-process")
    env = {
        **os.environ,
        # The tools model first, so that CACHET_MODEL (not list order) must pick the default.
        "CACHET_TOKENIZER_MODELS": json.dumps([str(tools_model_dir), str(tiny_model_dir)]),
        "CACHET_MODEL": str(tiny_model_dir),
        "CACHET_TOKENIZER_PORT": str(port),
        "CACHET_TOKENIZER_MAX_INPUT_CHARS": str(MAX_INPUT_CHARS),
        "CACHET_DATA_DIR": str(work / "data"),
        "OTEL_TRACES_EXPORTER": "none",
    }
    log_path = work / "tokenizer.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "cachet.tokenizer"],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_until_serving(f"127.0.0.1:{port}", process, log_path)
        yield f"127.0.0.1:{port}"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            returncode = process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert returncode == 0, f"SIGTERM should drain and exit cleanly:\n{log_path.read_text()}"


@pytest.fixture
async def stub(service_address: str) -> AsyncIterator[tokenizer_pb2_grpc.TokenizerServiceStub]:
    async with grpc.aio.insecure_channel(service_address) as channel:
        yield tokenizer_pb2_grpc.TokenizerServiceStub(channel)


async def test_encode_decode_and_count(stub, tiny_model: TokenizerModel) -> None:
    text = "Streaming 世界 🤗 works,   mostly."
    encoded = await stub.Encode(pb.EncodeRequest(model="tiny-llama", text=text, add_special_tokens=True))
    assert list(encoded.token_ids) == tiny_model.encode(text, add_special_tokens=True)
    decoded = await stub.Decode(pb.DecodeRequest(model="tiny-llama", token_ids=encoded.token_ids))
    assert decoded.text == text
    with_specials = [1, *encoded.token_ids, 2]
    assert (await stub.Decode(pb.DecodeRequest(model="tiny-llama", token_ids=with_specials))).text == (
        f"<|im_start|>{text}<|im_end|>"
    )
    skipped = await stub.Decode(
        pb.DecodeRequest(model="tiny-llama", token_ids=with_specials, skip_special_tokens=True)
    )
    assert skipped.text == text
    count = await stub.CountTokens(pb.CountTokensRequest(model="tiny-llama", text=text))
    assert count.count == len(encoded.token_ids)


async def test_apply_chat_template_renders_like_the_model(stub, tiny_model: TokenizerModel) -> None:
    messages = [
        common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text="Weather in Oslo?")]),
        common_pb2.ChatMessage(
            role="assistant",
            tool_calls=[common_pb2.ToolCall(id="c1", name="get_weather", arguments_json='{"city": "Oslo"}')],
        ),
        common_pb2.ChatMessage(role="tool", tool_call_id="c1", content=[common_pb2.ContentPart(text="-3°C")]),
    ]
    tools = [common_pb2.Tool(name="get_weather", parameters_schema_json='{"type": "object"}')]
    reply = await stub.ApplyChatTemplate(
        pb.ApplyChatTemplateRequest(
            model="tiny-llama", messages=messages, tools=tools, add_generation_prompt=True
        )
    )
    expected = tiny_model.apply_chat_template(
        messages_to_dicts(messages),
        tools_to_dicts(tools),
        add_generation_prompt=True,
        continue_final_message=False,
    )
    assert reply.prompt == expected.prompt
    assert list(reply.token_ids) == expected.token_ids
    assert "<tool_response>\n-3°C\n</tool_response>" in reply.prompt


async def test_detokenize_stream_joins_up_to_the_full_decode(stub, tiny_model: TokenizerModel) -> None:
    prompt = tiny_model.encode("<|im_start|>assistant\n", add_special_tokens=False)
    output = tiny_model.encode(" Hello, 世界! 👨\u200d👩\u200d👧 done", add_special_tokens=False) + [2]
    chunks = [output[:1], output[1:4], output[4:5], output[5:9], [], output[9:]]
    requests = [
        pb.DetokenizeStreamRequest(
            model="tiny-llama" if index == 0 else "",
            prompt_token_ids=prompt if index == 0 else [],
            skip_special_tokens=True,
            token_ids=chunk,
            flush=index == len(chunks) - 1,
        )
        for index, chunk in enumerate(chunks)
    ]

    async def send() -> AsyncIterator[pb.DetokenizeStreamRequest]:
        for request in requests:
            yield request

    replies = [reply async for reply in stub.DetokenizeStream(send())]
    assert len(replies) == len(requests)  # one reply per message
    deltas = [reply.text_delta for reply in replies]
    assert "".join(deltas) == " Hello, 世界! 👨\u200d👩\u200d👧 done"
    assert all("\ufffd" not in delta for delta in deltas)
    consumed = [reply.tokens_consumed for reply in replies]
    assert consumed == sorted(consumed) and consumed[-1] == len(output)


async def test_an_exported_tokenizer_decodes_like_the_service(stub, tiny_model: TokenizerModel) -> None:
    from tokenizers import Tokenizer

    exported = await stub.ExportTokenizer(pb.ExportTokenizerRequest())
    assert exported.model == "tiny-llama" and exported.vocab_size == 49152
    tokenizer = Tokenizer.from_str(exported.tokenizer_json)
    text = " Hello, 世界! 👨\u200d👩\u200d👧 done"
    token_ids = [1, *tiny_model.encode(text, add_special_tokens=False), 2]
    for skip in (True, False):
        served = await stub.Decode(
            pb.DecodeRequest(model="tiny-llama", token_ids=token_ids, skip_special_tokens=skip)
        )
        assert tokenizer.decode(token_ids, skip_special_tokens=skip) == served.text
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await stub.ExportTokenizer(pb.ExportTokenizerRequest(model="no-such-model"))
    assert failure.value.code() == grpc.StatusCode.NOT_FOUND


async def test_block_hashes_use_the_shared_function_and_the_model_id(stub) -> None:
    token_ids = list(range(100, 150))  # three full blocks of 16 and a partial one
    reply = await stub.BlockHashes(pb.BlockHashesRequest(model="tiny-llama", token_ids=token_ids))
    assert reply.block_size == 16
    assert list(reply.block_hashes) == block_hashes(token_ids, "tiny-llama")
    assert len(reply.block_hashes) == 3
    salted = await stub.BlockHashes(
        pb.BlockHashesRequest(model="", token_ids=token_ids, block_size=8, cache_salt="lora-a")
    )
    assert list(salted.block_hashes) == block_hashes(
        token_ids, "tiny-llama", block_size=8, cache_salt="lora-a"
    )
    other_model = await stub.BlockHashes(pb.BlockHashesRequest(model="tiny-tools", token_ids=token_ids))
    assert other_model.block_hashes[0] != reply.block_hashes[0]


async def test_model_info_and_list(stub) -> None:
    default = await stub.GetModelInfo(pb.GetModelInfoRequest())
    assert default.model == "tiny-llama"  # CACHET_MODEL, though listed second
    assert default.context_window == 2048 and default.vocab_size == 49152
    assert list(default.stop_token_ids) == [2, 0]
    assert default.HasField("bos_token_id") and default.bos_token_id == 1
    assert not default.template_supports_tools
    assert {"<|im_start|>", "<|im_end|>"} <= {special.text for special in default.special_tokens}
    tools = await stub.GetModelInfo(pb.GetModelInfoRequest(model="tiny-tools"))
    assert tools.template_supports_tools
    listed = await stub.ListModels(pb.ListModelsRequest())
    assert [model.model for model in listed.models] == ["tiny-tools", "tiny-llama"]


def _user(text: str) -> common_pb2.ChatMessage:
    return common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text=text)])


BAD_REQUESTS = [
    ("Encode", pb.EncodeRequest(model="gpt-9", text="hi"), grpc.StatusCode.NOT_FOUND, "model"),
    ("Decode", pb.DecodeRequest(model="gpt-9", token_ids=[1]), grpc.StatusCode.NOT_FOUND, "model"),
    ("GetModelInfo", pb.GetModelInfoRequest(model="gpt-9"), grpc.StatusCode.NOT_FOUND, "model"),
    ("BlockHashes", pb.BlockHashesRequest(model="gpt-9", token_ids=[1]), grpc.StatusCode.NOT_FOUND, "model"),
    ("Encode", pb.EncodeRequest(model="tiny-llama", text=""), grpc.StatusCode.INVALID_ARGUMENT, "text"),
    (
        "CountTokens",
        pb.CountTokensRequest(model="tiny-llama", text=""),
        grpc.StatusCode.INVALID_ARGUMENT,
        "text",
    ),
    (
        "Encode",
        pb.EncodeRequest(model="tiny-llama", text="x" * (MAX_INPUT_CHARS + 1)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "text",
    ),
    (
        "ApplyChatTemplate",
        pb.ApplyChatTemplateRequest(model="tiny-llama", messages=[_user("x" * (MAX_INPUT_CHARS + 1))]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "messages",
    ),
    (
        "Decode",
        pb.DecodeRequest(model="tiny-llama", token_ids=[5, 49152]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "token_ids[1]",
    ),
    (
        "ApplyChatTemplate",
        pb.ApplyChatTemplateRequest(model="tiny-llama", messages=[common_pb2.ChatMessage(role="robot")]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "messages[0].role",
    ),
    (
        "ApplyChatTemplate",
        pb.ApplyChatTemplateRequest(
            model="tiny-llama", messages=[_user("hi"), common_pb2.ChatMessage(role="tool")]
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "messages[1].tool_call_id",
    ),
    (
        "ApplyChatTemplate",
        pb.ApplyChatTemplateRequest(
            model="tiny-llama",
            messages=[
                common_pb2.ChatMessage(
                    role="assistant", tool_calls=[common_pb2.ToolCall(name="f", arguments_json="{")]
                )
            ],
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "messages[0].tool_calls[0].arguments_json",
    ),
]


@pytest.mark.parametrize(("method", "request_message", "code", "field"), BAD_REQUESTS)
async def test_bad_input_gets_its_status_and_names_the_field(
    stub, method, request_message, code, field
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await getattr(stub, method)(request_message)
    assert raised.value.code() == code
    assert raised.value.details().startswith(f"{field}: ")
    assert error_info_from_metadata(raised.value.trailing_metadata()).param == field


@pytest.mark.parametrize(
    ("requests", "code", "field"),
    [
        ([pb.DetokenizeStreamRequest(model="gpt-9", token_ids=[1])], grpc.StatusCode.NOT_FOUND, "model"),
        (
            [pb.DetokenizeStreamRequest(model="tiny-llama", prompt_token_ids=[70000])],
            grpc.StatusCode.INVALID_ARGUMENT,
            "prompt_token_ids[0]",
        ),
        (
            [
                pb.DetokenizeStreamRequest(model="tiny-llama", token_ids=[19556]),
                pb.DetokenizeStreamRequest(token_ids=[49152]),
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
            "token_ids[0]",
        ),
        (
            [
                pb.DetokenizeStreamRequest(model="tiny-llama"),
                pb.DetokenizeStreamRequest(prompt_token_ids=[1]),
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
            "prompt_token_ids",
        ),
        (
            [
                pb.DetokenizeStreamRequest(model="tiny-llama", flush=True),
                pb.DetokenizeStreamRequest(token_ids=[1]),
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
            "flush",
        ),
    ],
)
async def test_bad_detokenize_streams_fail_with_the_field(stub, requests, code, field) -> None:
    async def send() -> AsyncIterator[pb.DetokenizeStreamRequest]:
        for request in requests:
            yield request

    call = stub.DetokenizeStream(send())
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in call:
            pass
    assert raised.value.code() == code
    assert raised.value.details().startswith(f"{field}: ")
    assert error_info_from_metadata(raised.value.trailing_metadata()).param == field
