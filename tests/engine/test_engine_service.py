"""The engine as a real process over gRPC: streaming, abort, overload, bad input, KV events."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest
from metrics_scrape import growth, scrape
from service_processes import ServiceProcess, free_port, start_service

from cachet.block_hash import block_hashes
from cachet.common.v1 import common_pb2
from cachet.engine.v1 import engine_pb2, engine_pb2_grpc
from cachet.errors import error_info_from_metadata
from cachet.models.tiny import write_tiny_model

MAX_WAITING = 2
MAX_RUNNING = 1


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    root = tmp_path_factory.mktemp("engine-service")
    model_dir = write_tiny_model(root / "tiny-llama")
    env = {
        "CACHET_MODEL": str(model_dir),
        "CACHET_DATA_DIR": str(root),
        "CACHET_KV_CACHE_GB": "0.01",
        "CACHET_ENGINE_MAX_NUM_SEQS": str(MAX_RUNNING),
        "CACHET_ENGINE_MAX_NUM_BATCHED_TOKENS": "64",
        "CACHET_ENGINE_MAX_WAITING": str(MAX_WAITING),
        "CACHET_ENGINE_LOAD_REPORT_INTERVAL_MS": "50",
        "CACHET_ENGINE_METRICS_PORT": str(metrics_port := free_port()),
    }
    process = start_service("engine", env, root, timeout=300)
    process.metrics_port = metrics_port
    yield process
    assert process.stop() == 0, process.log_tail()


def _request(request_id: str, prompt: list[int], **sampling: object) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id=request_id,
        model="tiny-llama",
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(**sampling),
    )


async def _collect(stub: engine_pb2_grpc.EngineServiceStub, request: engine_pb2.GenerateRequest):
    return [response async for response in stub.Generate(request)]


async def test_streams_tokens_with_usage_and_reuses_the_prefix(engine: ServiceProcess) -> None:
    prompt = list(range(100, 150))
    async with grpc.aio.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        first = await _collect(
            stub, _request("stream-1", prompt, temperature=0, max_tokens=12, ignore_eos=True)
        )
        tokens = [t for r in first for t in r.token_ids]
        assert len(tokens) == 12
        assert first[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert first[-1].usage.prompt_tokens == 50 and first[-1].usage.completion_tokens == 12
        assert all(r.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for r in first[:-1])

        again = await _collect(
            stub, _request("stream-2", prompt, temperature=0, max_tokens=12, ignore_eos=True)
        )
        assert [t for r in again for t in r.token_ids] == tokens
        # 50 tokens: three full blocks of 16 are cached, the last prompt token is always computed.
        assert again[-1].usage.cached_tokens == 48


async def test_first_and_final_sends_the_same_tokens_in_two_messages(engine: ServiceProcess) -> None:
    prompt = list(range(500, 530))
    sampling = {"temperature": 0, "max_tokens": 10, "ignore_eos": True, "logprobs": True}
    async with grpc.aio.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        every_step = await _collect(stub, _request("delta-1", prompt, **sampling))
        coalesced_request = _request("first-final-1", prompt, **sampling)
        coalesced_request.output_kind = engine_pb2.OUTPUT_KIND_FIRST_AND_FINAL
        first, last = await _collect(stub, coalesced_request)
        one_token_request = _request("first-final-2", prompt, temperature=0, max_tokens=1)
        one_token_request.output_kind = engine_pb2.OUTPUT_KIND_FIRST_AND_FINAL
        (only,) = await _collect(stub, one_token_request)

    # A message per step, unless the reader fell behind and got waiting steps in one.
    assert sum(len(r.token_ids) for r in every_step) == 10
    assert all(r.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for r in every_step[:-1])
    assert len(first.token_ids) == 1 and first.usage.prompt_tokens == 30
    assert first.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    assert list(first.token_ids) + list(last.token_ids) == [t for r in every_step for t in r.token_ids]
    assert [lp.token_id for lp in (*first.logprobs, *last.logprobs)] == list(first.token_ids) + list(
        last.token_ids
    )
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH and last.usage.completion_tokens == 10
    assert only.finish_reason == common_pb2.FINISH_REASON_LENGTH and len(only.token_ids) == 1


async def test_kv_events_name_the_blocks_the_engine_stored(engine: ServiceProcess) -> None:
    prompt = list(range(300, 340))
    async with grpc.aio.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        await _collect(stub, _request("kv-1", prompt, temperature=0, max_tokens=1))
        events = stub.StreamKvEvents(engine_pb2.StreamKvEventsRequest())
        snapshot = await events.read()
        events.cancel()
        stored = {h for event in snapshot.events for h in event.stored.block_hashes}
        assert snapshot.sequence_number == 0 and snapshot.model == "tiny-llama"
        info = await stub.GetEngineInfo(engine_pb2.GetEngineInfoRequest())
        assert info.reproducible_kernels.startswith("cpu:")  # greedy: batch-invariant steps
        assert set(block_hashes(prompt, "tiny-llama", reproducible=info.reproducible_kernels)) <= stored


async def test_abort_by_cancel_and_by_id(engine: ServiceProcess) -> None:
    async with grpc.aio.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        call = stub.Generate(_request("abort-1", list(range(10, 30)), max_tokens=1000, ignore_eos=True))
        await call.read()
        call.cancel()
        # The engine frees the request on cancel: a load report soon shows nothing running.
        reports = stub.StreamLoadReports(engine_pb2.StreamLoadReportsRequest(interval_ms=50))
        async for report in reports:
            if report.running_requests == 0 and report.waiting_requests == 0:
                break
        reports.cancel()
        assert report.free_kv_blocks == report.total_kv_blocks
        # Batch work's seat limit (three quarters of one seat rounds up to the one).
        assert (report.max_running_requests, report.max_batch_running_requests) == (1, 1)

        call = stub.Generate(_request("abort-2", list(range(10, 30)), max_tokens=1000, ignore_eos=True))
        await call.read()
        assert (await stub.Abort(engine_pb2.AbortRequest(request_id="abort-2"))).aborted
        last = await call.read()
        while last.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
            last = await call.read()
        assert last.finish_reason == common_pb2.FINISH_REASON_ABORT
        assert not (await stub.Abort(engine_pb2.AbortRequest(request_id="abort-2"))).aborted


async def _wait_for_load(stub: engine_pb2_grpc.EngineServiceStub, running: int, waiting: int) -> None:
    reports = stub.StreamLoadReports(engine_pb2.StreamLoadReportsRequest(interval_ms=50))
    async for report in reports:
        if (report.running_requests, report.waiting_requests) == (running, waiting):
            break
    reports.cancel()


async def test_overload_is_refused_at_once(engine: ServiceProcess) -> None:
    def long_run(request_id: str):
        return stub.Generate(_request(request_id, list(range(20, 40)), max_tokens=1500, ignore_eos=True))

    async with grpc.aio.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        # One at a time: the bound is on the waiting queue, and requests arriving within one
        # engine step all count as waiting until the next schedule.
        calls = [long_run("busy-running")]
        await _wait_for_load(stub, running=MAX_RUNNING, waiting=0)
        calls += [long_run(f"busy-waiting-{i}") for i in range(MAX_WAITING)]
        await asyncio.wait_for(_wait_for_load(stub, running=MAX_RUNNING, waiting=MAX_WAITING), timeout=30)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await asyncio.wait_for(_collect(stub, _request("one-too-many", [1, 2, 3])), timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for call in calls:
            call.cancel()
        await asyncio.wait_for(_wait_for_load(stub, running=0, waiting=0), timeout=30)


@pytest.mark.parametrize(
    ("request_kwargs", "message"),
    [
        ({"model": "not-this-one"}, "not served here"),
        ({"prompt_token_ids": list(range(2048))}, "context window"),
        ({"sampling": common_pb2.SamplingParams(max_tokens=4000)}, "max_tokens"),
        ({"sampling": common_pb2.SamplingParams(top_p=0)}, "top_p"),
        ({"prompt_token_ids": []}, "empty"),
        ({"kv_retention": [engine_pb2.KvRetention(seconds=0)]}, "kv_retention[0].seconds"),
        ({"kv_retention": [engine_pb2.KvRetention(seconds=86401)]}, "kv_retention[0].seconds"),
        ({"prompt_token_ids": [1, 2, 10**6]}, "prompt_token_ids[2]=1000000 is not in"),
        ({"prefilled": engine_pb2.PrefilledElsewhere(first_token_id=10**6)}, "first_token_id"),
        ({"hand_off_kv": True}, "CACHET_KV_SHARED_DIR"),
        (
            {"hand_off_to": "127.0.0.1:1"},
            "hand_off_to names where a hand-off's KV goes: it needs hand_off_kv",
        ),
        ({"sampling": common_pb2.SamplingParams(temperature=-1)}, "temperature must be in [0, 2]"),
        ({"sampling": common_pb2.SamplingParams(min_p=float("nan"))}, "min_p must be in [0, 1]"),
    ],
)
async def test_bad_input_is_invalid_argument(
    engine: ServiceProcess, request_kwargs: dict, message: str
) -> None:
    request = _request("bad", [1, 2, 3])
    for field, value in request_kwargs.items():
        request.ClearField(field)
        if isinstance(value, list):
            getattr(request, field).extend(value)
        elif isinstance(value, str | bool):
            setattr(request, field, value)
        else:
            getattr(request, field).CopyFrom(value)
    async with grpc.aio.insecure_channel(engine.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await _collect(engine_pb2_grpc.EngineServiceStub(channel), request)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in bad.value.details()


async def test_a_direct_clients_bad_sampling_value_is_refused_naming_it_and_harms_nothing(
    engine: ServiceProcess,
) -> None:
    # The router validates every request; a client calling the engine itself gets the same rules
    # (cachet.sampling_ranges), and the replica goes on serving.
    async with grpc.aio.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await _collect(stub, _request("bad-temperature", [1, 2, 3], temperature=-1))
        assert error_info_from_metadata(bad.value.trailing_metadata()).param == "temperature"
        good = await _collect(stub, _request("after-bad", [1, 2, 3], max_tokens=2, ignore_eos=True))
        assert [t for r in good for t in r.token_ids] and good[
            -1
        ].finish_reason == common_pb2.FINISH_REASON_LENGTH


async def test_a_retained_request_leaves_its_blocks_under_retention(engine: ServiceProcess) -> None:
    async with grpc.aio.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        before = await asyncio.to_thread(scrape, engine.metrics_port, "cachet_engine_")
        await _collect(stub, _request("unretained", list(range(1000, 1050)), max_tokens=3, ignore_eos=True))
        plain = await asyncio.to_thread(scrape, engine.metrics_port, "cachet_engine_")
        request = _request("retained", list(range(1100, 1150)), max_tokens=3, ignore_eos=True)
        # The first 40 tokens for a day (two whole 16-token blocks), all of it for a minute.
        request.kv_retention.extend(
            [engine_pb2.KvRetention(seconds=86400, num_tokens=40), engine_pb2.KvRetention(seconds=60)]
        )
        await _collect(stub, request)
        after = await asyncio.to_thread(scrape, engine.metrics_port, "cachet_engine_")
    assert growth(before, plain)("cachet_engine_kv_block_retentions_total") == 0
    # 52 tokens computed (the last sampled one never is): three whole blocks.
    assert growth(plain, after)("cachet_engine_kv_block_retentions_total") == 3
    assert growth(plain, after)("cachet_engine_kv_retained_blocks", tier="engine") == 3


async def test_load_reports_carry_token_rates(engine: ServiceProcess) -> None:
    async with grpc.aio.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        reports = stub.StreamLoadReports(engine_pb2.StreamLoadReportsRequest(interval_ms=50))
        call = stub.Generate(_request("rates-1", list(range(900, 964)), max_tokens=1000, ignore_eos=True))
        await call.read()
        decode = prefill = 0.0
        async for report in reports:
            decode, prefill = (
                max(decode, report.decode_tokens_per_second),
                max(prefill, report.prefill_tokens_per_second),
            )
            if decode > 0 and prefill > 0:
                break
        reports.cancel()
        call.cancel()
        await asyncio.wait_for(_wait_for_load(stub, running=0, waiting=0), timeout=30)
    assert decode > 0 and prefill > 0


async def _batch_prompt_ran_again(metrics_port: int, before: dict) -> None:
    while True:
        now = await asyncio.to_thread(scrape, metrics_port, "cachet_engine_")
        if growth(before, now)("cachet_engine_computed_tokens_total", priority="batch", phase="prefill") > 20:
            return
        await asyncio.sleep(0.05)


async def _loop_lag_observed(metrics_port: int, before: dict) -> None:
    while True:
        now = await asyncio.to_thread(scrape, metrics_port, "cachet_engine_")
        if growth(before, now)("cachet_engine_event_loop_lag_seconds_count") > 0:
            return
        await asyncio.sleep(0.02)


async def test_metrics_count_tokens_by_priority_and_seat_preemptions(engine: ServiceProcess) -> None:
    before = await asyncio.to_thread(scrape, engine.metrics_port, "cachet_engine_")
    async with grpc.aio.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        batch_request = _request("metrics-batch", list(range(700, 720)), max_tokens=1000, ignore_eos=True)
        batch_request.priority = common_pb2.PRIORITY_BATCH
        batch = stub.Generate(batch_request)
        await batch.read()  # it holds the only seat
        interactive = await _collect(
            stub, _request("metrics-interactive", list(range(800, 820)), max_tokens=5, ignore_eos=True)
        )
        # Its seat back, the batch request runs its prompt again; cancelling at once raced that
        # step on a busy machine.
        await asyncio.wait_for(_batch_prompt_ran_again(engine.metrics_port, before), timeout=30)
        batch.cancel()
        await asyncio.wait_for(_wait_for_load(stub, running=0, waiting=0), timeout=30)
    # The server's loop is watched all along: a tick every 50 ms, which a fast engine can finish
    # all of the above inside of, so the window is held open until one lands.
    await asyncio.wait_for(_loop_lag_observed(engine.metrics_port, before), timeout=10)
    after = await asyncio.to_thread(scrape, engine.metrics_port, "cachet_engine_")
    grew = growth(before, after)

    assert sum(len(r.token_ids) for r in interactive) == 5
    # The interactive arrival found the one seat taken by batch work and took it.
    assert grew("cachet_engine_preemptions_total", reason="seat") >= 1
    assert grew("cachet_engine_preemptions_total", reason="kv_cache") == 0
    assert grew("cachet_engine_generated_tokens_total", priority="interactive") == 5
    assert grew("cachet_engine_generated_tokens_total", priority="batch") >= 1
    # 20 prompt tokens, then one decode token for each sampled token but the last.
    assert grew("cachet_engine_computed_tokens_total", priority="interactive", phase="prefill") == 20
    assert grew("cachet_engine_computed_tokens_total", priority="interactive", phase="decode") == 4
    # The batch request's prompt ran once, then after it lost its seat again past its cached block.
    assert grew("cachet_engine_computed_tokens_total", priority="batch", phase="prefill") > 20
    assert grew("cachet_engine_requests_finished_total", status="finished_length") == 1
    assert grew("cachet_engine_event_loop_lag_seconds_count") > 0
    assert grew("cachet_engine_requests_finished_total", status="finished_aborted") == 1
    steps = grew("cachet_engine_steps_total")
    assert steps >= 5 and grew("cachet_engine_scheduled_requests_total") >= steps
    assert grew("cachet_engine_step_duration_seconds_count") >= steps
    assert after["cachet_engine_requests_running", (("priority", "batch"),)] == 0
    assert after["cachet_engine_requests_waiting", (("priority", "interactive"),)] == 0
    assert after["cachet_engine_kv_blocks_free", ()] == after["cachet_engine_kv_blocks", ()]
    # What batch work may spend beside interactive work: at least a token, at most a whole step.
    assert 1 <= after["cachet_engine_batch_token_budget", ()] <= 64  # CACHET_ENGINE_MAX_NUM_BATCHED_TOKENS
