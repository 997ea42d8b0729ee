"""One trace spans the caller and the tokenizer service, for unary and for streaming calls."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from cachet.grpc_channel import create_channel
from cachet.grpc_server import RunningServer, create_server
from cachet.tokenizer.model_registry import ModelRegistry
from cachet.tokenizer.servicer import SERVICE_NAME, TokenizerServicer
from cachet.tokenizer.settings import TokenizerSettings
from cachet.tokenizer.tokenizer_model import TokenizerModel
from cachet.tokenizer.v1 import tokenizer_pb2 as pb
from cachet.tokenizer.v1 import tokenizer_pb2_grpc
from cachet.tracing import configure_tracing

ENCODE = f"/{SERVICE_NAME}/Encode"
DETOKENIZE_STREAM = f"/{SERVICE_NAME}/DetokenizeStream"


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    processor = SimpleSpanProcessor(exporter)
    configure_tracing("test", extra_processor=processor)
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    with provider.get_tracer("probe").start_as_current_span("probe"):
        pass
    if not exporter.get_finished_spans():
        # configure_tracing installs a provider once per process: another test module got
        # there first and our processor was not added, so attach it to the live provider.
        provider.add_span_processor(processor)
    exporter.clear()
    yield exporter
    exporter.clear()


@pytest.fixture
async def server(tiny_model: TokenizerModel, exporter: InMemorySpanExporter) -> AsyncIterator[RunningServer]:
    servicer = TokenizerServicer(ModelRegistry([tiny_model]), max_input_chars=10_000)
    running = await create_server(TokenizerSettings(port=0, models=[]), [servicer.register], [SERVICE_NAME])
    exporter.clear()
    yield running
    await running.stop(grace=None)


async def _spans_named(exporter: InMemorySpanExporter, name: str, count: int) -> list[ReadableSpan]:
    # The server ends its span a moment after the client has its answer.
    for _ in range(100):
        spans = [span for span in exporter.get_finished_spans() if span.name == name]
        if len(spans) >= count:
            return spans
        await asyncio.sleep(0.02)
    return [span for span in exporter.get_finished_spans() if span.name == name]


def _assert_one_trace(spans: list[ReadableSpan], caller: ReadableSpan) -> None:
    client = [span for span in spans if span.kind == SpanKind.CLIENT]
    served = [span for span in spans if span.kind == SpanKind.SERVER]
    assert len(client) == 1 and len(served) == 1, [(span.name, span.kind) for span in spans]
    trace_id = caller.context.trace_id
    assert client[0].context.trace_id == trace_id == served[0].context.trace_id
    assert client[0].parent is not None and client[0].parent.span_id == caller.context.span_id
    # The server span continues the client span (W3C context carried in gRPC metadata).
    assert served[0].parent is not None and served[0].parent.span_id == client[0].context.span_id
    assert served[0].parent.is_remote


async def test_unary_call_shares_the_callers_trace(
    server: RunningServer, exporter: InMemorySpanExporter
) -> None:
    tracer = trace.get_tracer("router-under-test")
    async with create_channel(server.address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        with tracer.start_as_current_span("route request") as caller:
            reply = await stub.Encode(pb.EncodeRequest(model="tiny-llama", text="trace me"))
    assert reply.token_ids
    _assert_one_trace(await _spans_named(exporter, ENCODE, 2), caller)


async def test_streaming_call_shares_the_callers_trace(
    server: RunningServer, exporter: InMemorySpanExporter
) -> None:
    tracer = trace.get_tracer("router-under-test")

    async def send() -> AsyncIterator[pb.DetokenizeStreamRequest]:
        yield pb.DetokenizeStreamRequest(model="tiny-llama", token_ids=[19556])
        yield pb.DetokenizeStreamRequest(token_ids=[216, 7906], flush=True)

    async with create_channel(server.address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        with tracer.start_as_current_span("route request") as caller:
            deltas = [reply.text_delta async for reply in stub.DetokenizeStream(send())]
    assert "".join(deltas) == "Hello \ufffd"  # 7906 is half of 世: flushed as U+FFFD
    _assert_one_trace(await _spans_named(exporter, DETOKENIZE_STREAM, 2), caller)
