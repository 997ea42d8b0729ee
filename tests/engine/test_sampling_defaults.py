"""A model's generation_config.json sampling values fill what a request leaves unset, as vLLM
does; what a request sets wins; and over gRPC a request with no sampling values follows them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from service_processes import ServiceProcess, start_service

from cachet.common.v1 import common_pb2
from cachet.engine.sampling_params import SamplingParams, model_sampling_defaults
from cachet.engine.v1 import engine_pb2, engine_pb2_grpc
from cachet.models.tiny import write_tiny_model

CARD = {"temperature": 0.2, "top_p": 0.9, "top_k": 40.0, "min_p": 0.05, "repetition_penalty": 1.1}


def test_unset_values_come_from_the_model_and_set_ones_win() -> None:
    unset = SamplingParams.from_proto(common_pb2.SamplingParams(), CARD)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p, unset.repetition_penalty) == (
        0.2,
        0.9,
        40,
        0.05,
        1.1,
    )
    chosen = SamplingParams.from_proto(
        common_pb2.SamplingParams(temperature=0.0, top_p=1.0, top_k=5, repetition_penalty=1.0), CARD
    )
    assert (chosen.temperature, chosen.top_p, chosen.top_k, chosen.repetition_penalty) == (0.0, 1.0, 5, 1.0)
    assert chosen.greedy
    # Without a model's values: the API's own defaults.
    plain = SamplingParams.from_proto(common_pb2.SamplingParams())
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)


def test_a_generation_config_names_its_sampling_values(tmp_path: Path) -> None:
    assert model_sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 2, "do_sample": True, "temperature": 0.2, "top_p": 0.9, "top_k": None})
    )
    assert model_sampling_defaults(tmp_path) == {"temperature": 0.2, "top_p": 0.9}
    # A config that says greedy carries transformers' defaults, not a recommendation.
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.7}))
    assert model_sampling_defaults(tmp_path) == {}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    root = tmp_path_factory.mktemp("sampling-defaults")
    model_dir = write_tiny_model(root / "tiny-llama")
    generation = json.loads((model_dir / "generation_config.json").read_text())
    # top_k 1: a model whose own default is to take the likeliest token.
    (model_dir / "generation_config.json").write_text(
        json.dumps(generation | {"do_sample": True, "top_k": 1})
    )
    env = {"CACHET_MODEL": str(model_dir), "CACHET_DATA_DIR": str(root), "CACHET_KV_CACHE_GB": "0.01"}
    process = start_service("engine", env, root, timeout=300)
    yield process
    assert process.stop() == 0, process.log_tail()


async def _tokens(address: str, request_id: str, sampling: common_pb2.SamplingParams) -> list[int]:
    request = engine_pb2.GenerateRequest(
        request_id=request_id, model="tiny-llama", prompt_token_ids=list(range(200, 230)), sampling=sampling
    )
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        return [t for r in [r async for r in stub.Generate(request)] for t in r.token_ids]


async def test_a_request_that_sets_nothing_follows_the_models_values(engine: ServiceProcess) -> None:
    greedy = await _tokens(
        engine.address, "greedy", common_pb2.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    defaults = [
        await _tokens(
            engine.address, f"default-{i}", common_pb2.SamplingParams(max_tokens=12, ignore_eos=True)
        )
        for i in range(3)
    ]
    # Sampling at temperature 1 over a random model's 49k tokens would not repeat 12 tokens.
    assert defaults == [greedy] * 3
