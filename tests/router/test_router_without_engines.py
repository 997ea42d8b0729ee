"""The router as a real process whose engines are all down: it must refuse cleanly, not hang.

Real tokenizer and usage processes; the engine and cache addresses point at ports
nobody listens on.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from service_processes import TINY_MODEL_ID, ServiceProcess, free_port, start_service

from cachet.common.v1 import common_pb2
from cachet.errors import error_info_from_metadata
from cachet.grpc_channel import create_channel
from cachet.models.tiny import write_tiny_model
from cachet.router.readiness import READINESS_SERVICE
from cachet.router.v1 import router_pb2, router_pb2_grpc


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    root = tmp_path_factory.mktemp("router-no-engines")
    model_dir = write_tiny_model(root / TINY_MODEL_ID)
    tokenizer = start_service("tokenizer", {"CACHET_TOKENIZER_MODELS": json.dumps([str(model_dir)])}, root)
    usage = start_service("usage", {"CACHET_DATA_DIR": str(root / "usage")}, root)
    router = start_service(
        "router",
        {
            "CACHET_ROUTER_TOKENIZER_ADDRESS": tokenizer.address,
            "CACHET_ROUTER_USAGE_ADDRESS": usage.address,
            "CACHET_ROUTER_CACHE_ADDRESS": f"127.0.0.1:{free_port()}",
            "CACHET_ROUTER_ENGINE_ADDRESSES": json.dumps([f"127.0.0.1:{free_port()}"]),
            "CACHET_ROUTER_STARTUP_WAIT_SECONDS": "0.2",
            "CACHET_DATA_DIR": str(root / "router-data"),
            "CACHET_ROUTER_METRICS_PORT": str(metrics_port := free_port()),
        },
        root,
    )
    router.metrics_port = metrics_port
    yield router
    for process in (router, usage, tokenizer):
        process.stop()
    print(router.log_tail())


@pytest.fixture
async def inference(router: ServiceProcess):
    async with create_channel(router.address) as channel:
        yield router_pb2_grpc.InferenceServiceStub(channel)


def chat(**fields) -> router_pb2.ChatCompletionRequest:
    message = common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text="Hi")])
    return router_pb2.ChatCompletionRequest(**({"model": TINY_MODEL_ID, "messages": [message]} | fields))


async def test_no_engine_is_unavailable_with_retry_hint(inference) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await inference.CreateChatCompletion(chat(), timeout=10)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert error_info_from_metadata(failed.value.trailing_metadata()).retry_after_seconds >= 1
    with pytest.raises(grpc.aio.AioRpcError) as streamed:
        async for _ in inference.StreamChatCompletion(chat(), timeout=10):
            pass
    assert streamed.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_refusals_are_counted_by_outcome(router: ServiceProcess, inference) -> None:
    def unavailable_count() -> float:
        url = f"http://127.0.0.1:{router.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "cachet_router_requests_total" and sample.labels == {"outcome": "unavailable"}
        )

    before = unavailable_count()
    with pytest.raises(grpc.aio.AioRpcError):
        await inference.CreateChatCompletion(chat(), timeout=10)
    assert unavailable_count() == before + 1


async def test_invalid_requests_are_refused_before_any_engine_is_needed(inference) -> None:
    cases = [
        (chat(messages=[]), "messages"),
        (chat(model=""), "model"),
        (chat(messages=[common_pb2.ChatMessage(role="robot")]), "messages[0].role"),
        (chat(sampling=common_pb2.SamplingParams(stop=[""])), "stop"),
        (chat(sampling=common_pb2.SamplingParams(temperature=3.0)), "temperature"),
    ]
    for request, param in cases:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await inference.CreateChatCompletion(request, timeout=10)
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, param
        assert error_info_from_metadata(failed.value.trailing_metadata()).param == param
    with pytest.raises(grpc.aio.AioRpcError) as both:
        await inference.CreateCompletion(
            router_pb2.CompletionRequest(model=TINY_MODEL_ID, prompt="x", prompt_token_ids=[1]), timeout=10
        )
    assert both.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_the_queue_accepts_work_while_every_engine_is_down(inference) -> None:
    # The async API never answers "out of capacity": the batch waits for an engine.
    batch = await inference.QueueRequests(
        router_pb2.QueueRequestsRequest(
            model=TINY_MODEL_ID, requests=[router_pb2.QueuedRequest(chat=chat())]
        ),
        timeout=10,
    )
    assert batch.status == router_pb2.BATCH_STATUS_QUEUED and batch.request_id
    polled = await inference.GetQueuedBatch(
        router_pb2.GetQueuedBatchRequest(request_id=batch.request_id), timeout=10
    )
    assert polled.status == router_pb2.BATCH_STATUS_QUEUED and not polled.results
    with pytest.raises(grpc.aio.AioRpcError) as empty:
        await inference.QueueRequests(router_pb2.QueueRequestsRequest(model=TINY_MODEL_ID), timeout=10)
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await inference.GetQueuedBatch(router_pb2.GetQueuedBatchRequest(request_id="batch-nope"), timeout=10)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_webhook_to_a_non_public_address_is_refused_when_queued(inference) -> None:
    # No allow-list here: loopback in any spelling is refused, as private ranges are.
    for url in ("http://127.0.0.1:9/hook", "http://localhost:9/hook", "http://[::1]:9/", "ftp://127.0.0.1/"):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await inference.QueueRequests(
                router_pb2.QueueRequestsRequest(
                    model=TINY_MODEL_ID, requests=[router_pb2.QueuedRequest(chat=chat())], webhook_url=url
                ),
                timeout=10,
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, url
        assert error_info_from_metadata(refused.value.trailing_metadata()).param == "webhook_url"


async def test_a_cache_salt_longer_than_allowed_is_invalid_argument(inference) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await inference.CreateChatCompletion(chat(cache_salt="s" * 257), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info_from_metadata(refused.value.trailing_metadata()).param == "cache_salt"


async def test_list_models_is_empty_while_no_engine_is_up(inference) -> None:
    assert list((await inference.ListModels(router_pb2.ListModelsRequest(), timeout=10)).models) == []


async def test_up_but_not_ready_while_no_engine_is_up(router: ServiceProcess) -> None:
    async with create_channel(router.address) as channel:
        probe = health_pb2_grpc.HealthStub(channel)
        alive = await probe.Check(health_pb2.HealthCheckRequest(), timeout=10)
        ready = await probe.Check(health_pb2.HealthCheckRequest(service=READINESS_SERVICE), timeout=10)
    assert alive.status == health_pb2.HealthCheckResponse.SERVING
    assert ready.status == health_pb2.HealthCheckResponse.NOT_SERVING
