"""Disaggregated prefill inside the engine: a prefill replica's answer waits for its KV to be in
the shared tier; a decode replica starts from the prefill's first token and the shared tier's
blocks, and decodes exactly what one replica computing everything would (fp32, greedy)."""

from __future__ import annotations

import datetime
import socket
import time
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from test_host_kv_tier import greedy
from test_shared_kv_tier import engine_core, engine_with_shared_tier

from cachet.engine.engine_core import EngineCore
from cachet.engine.errors import InvalidRequest
from cachet.engine.model_runner import ModelRunner
from cachet.engine.request import Request
from cachet.engine.sampling_params import SamplingParams
from cachet.engine.scheduler import SchedulerConfig
from cachet.engine.settings import EngineSettings
from cachet.loopback_port import free_loopback_port

PROMPT = torch.randint(5, 200, (150,), generator=torch.Generator().manual_seed(7)).tolist()
FULL_BLOCKS = len(PROMPT) // 16  # 9: the blocks a hand-off writes (the last, partial one is recomputed)


def _bytes_per_block(model_dir: Path) -> int:
    return ModelRunner(
        model_dir, dtype=torch.float32, device=torch.device("cpu"), kv_cache_bytes=64 << 20
    )._kv_cache_bytes_per_block()


def _block_files(engine: EngineCore) -> int:
    return len(list(engine.runner.shared_kv.folder.glob("*.kv")))


def _greedy_sampling(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _run(engine: EngineCore, request: Request) -> tuple[list[list[int]], int]:
    """Every output's new tokens in order, and the cached tokens reported."""
    engine.add_request(request)
    outputs: list[list[int]] = []
    cached = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs.append(list(output.new_token_ids))
            cached = max(cached, output.num_cached_tokens)
    return outputs, cached


def _prefill(engine: EngineCore, request_id: str) -> int:
    """Run a hand-off; return its token, checking its answer came only once its blocks were written."""
    engine.add_request(Request(request_id, PROMPT, _greedy_sampling(1), max_tokens=1, hand_off_kv=True))
    while True:
        outputs = engine.step()
        if outputs:
            (output,) = outputs
            assert output.status.is_finished
            assert _block_files(engine) == FULL_BLOCKS
            return output.new_token_ids[0]


# Each family on a CPU, the dense one on a GPU too (with both replicas on one GPU, a pushed
# hand-off's pair is gloo through host memory: NCCL refuses two ranks on one GPU).
FAMILIES_AND_DEVICES = [
    ("llama", "cpu"),
    ("kimi-k2", "cpu"),
    pytest.param("llama", "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


@pytest.mark.parametrize(("family", "device"), FAMILIES_AND_DEVICES)
def test_a_decode_replica_continues_a_prefill_replicas_hand_off_as_one_replica_would(
    tiny_checkpoints: dict[str, Path], tmp_path: Path, family: str, device: str
) -> None:
    model_dir = tiny_checkpoints[family]
    per_block = _bytes_per_block(model_dir)
    mixed = engine_with_shared_tier(model_dir, tmp_path / "mixed", per_block, device)
    expected, _, _ = greedy(mixed, "whole", PROMPT, 8)

    prefill = engine_with_shared_tier(model_dir, tmp_path / "shared", per_block, device)
    first_token = _prefill(prefill, "p")
    assert first_token == expected[0]

    decode = engine_with_shared_tier(model_dir, tmp_path / "shared", per_block, device)
    request = Request(
        "d",
        PROMPT,
        _greedy_sampling(8),
        max_tokens=8,
        output_token_ids=[first_token],
        num_cached_tokens=0,
        prefilled_elsewhere=True,
    )
    outputs, cached = _run(decode, request)
    # The first message is the prefill's token alone, sent before any step computed anything.
    assert outputs[0] == [first_token]
    assert [t for new in outputs for t in new] == expected
    assert cached == 0  # the caller's cached tokens are the prefill replica's hits, not the hand-off
    assert decode.scheduler.kv.hit_tokens == {
        "engine": 0,
        "host": 0,
        "shared": FULL_BLOCKS * 16,
        "transfer": 0,
    }
    # Its trace's stages (request_spans): the hand-off loaded while it waited for its seat.
    timeline = request.timeline
    assert timeline.kv_loaded_blocks == FULL_BLOCKS
    assert 0 < timeline.kv_loaded_ns <= timeline.admitted_ns <= timeline.first_token_ns
    assert timeline.prefill_chunks == 1  # the partial block and the first token, in one step


@pytest.mark.parametrize(("family", "device"), FAMILIES_AND_DEVICES)
def test_a_hand_off_pushed_straight_to_the_decode_replica_decodes_as_one_replica_would(
    tiny_checkpoints: dict[str, Path], tmp_path: Path, family: str, device: str
) -> None:
    """No shared folder: the prefill replica sends its blocks over a pair of its own into the
    decode replica's memory (kv_transfer), and answers only once they are there."""
    model_dir = tiny_checkpoints[family]
    per_block = _bytes_per_block(model_dir)
    expected, _, _ = greedy(
        engine_with_shared_tier(model_dir, tmp_path / "mixed", per_block, device), "w", PROMPT, 8
    )

    def runner(**tiers: int) -> ModelRunner:
        return ModelRunner(
            model_dir,
            dtype=torch.float32,
            device=torch.device(device),
            kv_cache_bytes=32 * per_block,
            **tiers,
        )

    decode = engine_core(runner(host_kv_bytes=32 * per_block, kv_transfer_port=free_loopback_port()))
    prefill = engine_core(runner())  # no tier at all: it sends what it computed
    receiver = decode.runner.kv_receiver
    try:
        address = receiver.address
        prefill.add_request(
            Request("p", PROMPT, _greedy_sampling(1), max_tokens=1, hand_off_kv=True, hand_off_to=address)
        )
        while not (outputs := prefill.step()):
            pass
        (answer,) = outputs
        assert answer.new_token_ids == [expected[0]]
        assert len(receiver.blocks) == FULL_BLOCKS, "the answer left before its blocks were there"
        # Its trace's hand-off span (request_spans): every full block, after the first token.
        handed = answer.timeline
        assert (handed.kv_handed_off_blocks, handed.kv_handed_off_bytes) == (
            FULL_BLOCKS,
            FULL_BLOCKS * per_block,
        )
        assert 0 < handed.first_token_ns <= handed.kv_handed_off_ns
        assert prefill.runner.kv_sender.counts == {"sent": FULL_BLOCKS, "failed": 0}

        request = Request(
            "d",
            PROMPT,
            _greedy_sampling(8),
            max_tokens=8,
            output_token_ids=[expected[0]],
            num_cached_tokens=0,
            prefilled_elsewhere=True,
        )
        outputs, cached = _run(decode, request)
    finally:
        prefill.runner.kv_sender.close()
        receiver.close()
    assert [t for new in outputs for t in new] == expected
    assert cached == 0
    assert decode.scheduler.kv.hit_tokens == {
        "engine": 0,
        "host": 0,
        "shared": 0,
        "transfer": FULL_BLOCKS * 16,
    }
    assert len(receiver.blocks) == 0, "each pushed block is taken once"
    # What the decode replica's metrics report (cachet_engine_kv_block_copies{direction=...}).
    copies = decode.scheduler.kv.copies_by_direction
    assert (copies["receive"], copies["receive_dropped"]) == (FULL_BLOCKS, 0)
    assert decode.scheduler.kv.block_copy_bytes["receive"] == FULL_BLOCKS * per_block
    assert "receive" not in prefill.scheduler.kv.copies_by_direction


def test_a_hand_off_to_a_receiver_that_is_gone_still_answers(tiny_checkpoints: dict[str, Path]) -> None:
    """A lost decode replica costs the hand-off nothing but the blocks: its answer goes out."""
    model_dir = tiny_checkpoints["llama"]
    per_block = _bytes_per_block(model_dir)
    prefill = engine_core(
        ModelRunner(model_dir, dtype=torch.float32, device=torch.device("cpu"), kv_cache_bytes=32 * per_block)
    )
    prefill.runner.kv_sender.timeout = datetime.timedelta(seconds=2)
    gone = f"127.0.0.1:{free_loopback_port()}"
    try:
        prefill.add_request(
            Request("p", PROMPT, _greedy_sampling(1), max_tokens=1, hand_off_kv=True, hand_off_to=gone)
        )
        deadline = time.monotonic() + 60
        while not (outputs := prefill.step()):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        prefill.runner.kv_sender.close()
    assert outputs[0].status.is_finished and len(outputs[0].new_token_ids) == 1
    # One send a prompt chunk (150 tokens in chunks of 64), each failed.
    assert prefill.runner.kv_sender.counts == {"sent": 0, "failed": 3}


def test_a_plain_request_answers_before_its_blocks_are_written(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """The control for the hold: without hand_off_kv the answer leaves with the step that sampled
    it, a step before the writes of that step's blocks are even queued (the earlier chunks'
    blocks may be written already)."""
    model_dir = tiny_checkpoints["llama"]
    engine = engine_with_shared_tier(model_dir, tmp_path, _bytes_per_block(model_dir), "cpu")
    engine.add_request(Request("plain", PROMPT, _greedy_sampling(1), max_tokens=1))
    while not (outputs := engine.step()):
        pass
    assert outputs[0].status.is_finished
    assert _block_files(engine) < FULL_BLOCKS


def test_a_lost_hand_off_is_recomputed_on_the_decode_replica(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """The prefill replica died before writing anything: the decode replica computes the whole
    prompt itself and still answers the same tokens."""
    model_dir = tiny_checkpoints["llama"]
    per_block = _bytes_per_block(model_dir)
    expected, _, _ = greedy(
        engine_with_shared_tier(model_dir, tmp_path / "a", per_block, "cpu"), "w", PROMPT, 6
    )
    decode = engine_with_shared_tier(model_dir, tmp_path / "empty", per_block, "cpu")
    request = Request(
        "d",
        PROMPT,
        _greedy_sampling(6),
        max_tokens=6,
        output_token_ids=[expected[0]],
        prefilled_elsewhere=True,
    )
    outputs, _ = _run(decode, request)
    assert [t for new in outputs for t in new] == expected
    assert decode.scheduler.kv.hit_tokens["shared"] == 0


def test_hand_offs_are_refused_where_they_cannot_work(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    model_dir = tiny_checkpoints["llama"]
    per_block = _bytes_per_block(model_dir)
    plain = ModelRunner(
        model_dir, dtype=torch.float32, device=torch.device("cpu"), kv_cache_bytes=32 * per_block
    )
    without_tier = EngineCore(
        runner=plain,
        model="tiny",
        scheduler_config=SchedulerConfig(max_model_len=plain.max_model_len, max_num_batched_tokens=64),
    )
    with pytest.raises(InvalidRequest, match="CACHET_KV_SHARED_DIR"):
        without_tier.add_request(Request("h", PROMPT, _greedy_sampling(1), max_tokens=1, hand_off_kv=True))
    engine = engine_with_shared_tier(model_dir, tmp_path, per_block, "cpu")
    logprobs = SamplingParams(temperature=0.0, max_tokens=4, logprobs=True)
    for request, reason in [
        (
            Request("l", PROMPT, logprobs, max_tokens=4, output_token_ids=[9], prefilled_elsewhere=True),
            "logprobs",
        ),
        (
            Request(
                "m", PROMPT, _greedy_sampling(1), max_tokens=1, output_token_ids=[9], prefilled_elsewhere=True
            ),
            "max_tokens",
        ),
        (
            Request(
                "t",
                PROMPT,
                _greedy_sampling(4),
                max_tokens=4,
                output_token_ids=[9, 9],
                prefilled_elsewhere=True,
            ),
            "first token",
        ),
    ]:
        with pytest.raises(InvalidRequest, match=reason):
            engine.add_request(request)


def test_a_decode_replica_needs_a_host_tier_and_a_way_in(tmp_path: Path) -> None:
    for missing in [{}, {"kv_host_gb": 1}, {"kv_shared_dir": tmp_path}, {"kv_transfer_port": 5}]:
        with pytest.raises(ValidationError, match="CACHET_KV_HOST_GB"):
            EngineSettings(role="decode", **missing)
    for ways_in in [{"kv_shared_dir": tmp_path}, {"kv_transfer_port": 5}]:
        assert EngineSettings(role="decode", kv_host_gb=1, **ways_in).role == "decode"
    assert (
        EngineSettings(role="decode", kv_shared_dir=tmp_path, kv_host_gb=1, tensor_parallel_size=2).role
        == "decode"
    )
    # A prefill replica can push to decode replicas' receivers with no tier of its own.
    assert EngineSettings(role="prefill").role == "prefill"


def test_a_receiver_port_in_use_is_refused_by_name(tiny_checkpoints: dict[str, Path]) -> None:
    model_dir = tiny_checkpoints["llama"]
    per_block = _bytes_per_block(model_dir)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"CACHET_ENGINE_KV_TRANSFER_PORT={port}: cannot listen"):
            ModelRunner(
                model_dir,
                dtype=torch.float32,
                device=torch.device("cpu"),
                kv_cache_bytes=32 * per_block,
                host_kv_bytes=32 * per_block,
                kv_transfer_port=port,
            )
