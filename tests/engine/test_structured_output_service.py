"""Structured output through the real engine process: constrained JSON, and bad grammars refused."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import jsonschema
import pytest
from service_processes import ServiceProcess, start_service
from test_structured_output_schemas import SCHEMAS
from tokenizers import Tokenizer

from cachet.common.v1 import common_pb2
from cachet.engine.v1 import engine_pb2, engine_pb2_grpc
from cachet.models.tiny import write_tiny_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServiceProcess, Tokenizer]]:
    root = tmp_path_factory.mktemp("structured-service")
    model_dir = write_tiny_model(root / "tiny-llama")
    env = {"CACHET_MODEL": str(model_dir), "CACHET_DATA_DIR": str(root), "CACHET_KV_CACHE_GB": "0.01"}
    process = start_service("engine", env, root, timeout=300)
    yield process, Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert process.stop() == 0, process.log_tail()


def _request(request_id: str, response_format: common_pb2.ResponseFormat) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id=request_id,
        model="tiny-llama",
        prompt_token_ids=[1, 504, 3245, 28],
        sampling=common_pb2.SamplingParams(temperature=1.0, seed=7, max_tokens=300),
        response_format=response_format,
    )


def _schema_format(schema: object) -> common_pb2.ResponseFormat:
    return common_pb2.ResponseFormat(
        json_schema=common_pb2.JsonSchemaFormat(name="s", schema_json=json.dumps(schema), strict=True)
    )


async def test_json_schema_output_validates(engine: tuple[ServiceProcess, Tokenizer]) -> None:
    process, tokenizer = engine
    async with grpc.aio.insecure_channel(process.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        responses = [r async for r in stub.Generate(_request("ok", _schema_format(SCHEMAS["person"])))]
    tokens = [t for r in responses for t in r.token_ids if t != 2]
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    jsonschema.validate(json.loads(tokenizer.decode(tokens)), SCHEMAS["person"])


@pytest.mark.parametrize(
    ("response_format", "message"),
    [
        (_schema_format({"type": "object", "properties": {"a": {"type": "strin"}}}), "Invalid type: strin"),
        (_schema_format({"properties": {"a": {"$ref": "#/$defs/gone"}}}), "/$defs/gone"),
        (common_pb2.ResponseFormat(regex="(?<=a)b"), "look-around"),
    ],
)
async def test_invalid_grammar_is_invalid_argument(
    engine: tuple[ServiceProcess, Tokenizer], response_format: common_pb2.ResponseFormat, message: str
) -> None:
    process, _ = engine
    async with grpc.aio.insecure_channel(process.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            _ = [r async for r in stub.Generate(_request("bad", response_format))]
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in bad.value.details()
