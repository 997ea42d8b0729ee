"""The shared file KV tier: whole files or none, anything torn, corrupted or foreign ignored,
a size budget kept by least recent use; and two engines sharing one folder, the second
serving the first's prompt from it exactly as the prompt computed cold."""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

import pytest
import torch
from test_host_kv_tier import greedy

from cachet.engine.block_pool import BlocksStored
from cachet.engine.engine_core import EngineCore
from cachet.engine.model_runner import ModelRunner
from cachet.engine.scheduler import SchedulerConfig
from cachet.engine.shared_kv_tier import ShardLayout, SharedKvFiles, layout_key
from cachet.engine.step_plan import KvBlockMoves, LoadedBlock

SHAPE = (2, 2, 4, 1, 3)  # one block of a 2-layer pool: [layers, K/V, block_size, heads, dim]


def files(root: Path, key: str = "tiny", budget: int = 1 << 20) -> SharedKvFiles:
    return SharedKvFiles(root, key, budget_bytes=budget, block_shape=SHAPE, dtype=torch.float32)


def block(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def test_a_written_block_reads_back_bit_for_bit(tmp_path: Path) -> None:
    tier = files(tmp_path)
    tier.write_later(123, block(1))
    tier.drain()
    assert tier.contains(123) and not tier.contains(124)
    assert torch.equal(tier.read(123), block(1))
    # Negative hashes (Python ints) name files too.
    tier.write_later(-5, block(2))
    tier.drain()
    assert torch.equal(tier.read(-5), block(2))


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "empty", "not a block file"])
def test_a_damaged_file_is_never_served_and_is_removed(tmp_path: Path, damage: str) -> None:
    tier = files(tmp_path)
    tier.write_later(7, block(1))
    tier.drain()
    path = tier.path(7)
    data = path.read_bytes()
    damaged = {
        "truncated": data[: len(data) - 5],
        "flipped byte": data[:-1] + bytes([data[-1] ^ 1]),
        "empty": b"",
        "not a block file": b"hello world" * 10,
    }[damage]
    path.write_bytes(damaged)
    assert tier.read(7) is None
    assert not path.exists()
    assert tier.counts["rejected"] == 1


def test_another_layout_or_hash_is_foreign(tmp_path: Path) -> None:
    writer = files(tmp_path, key="model-a")
    writer.write_later(7, block(1))
    writer.drain()
    # The same bytes under another layout's folder, or under another hash's name: refused.
    other = files(tmp_path, key="model-b")
    other.path(7).write_bytes(writer.path(7).read_bytes())
    assert other.read(7) is None
    os.replace(writer.path(7), writer.path(8))
    assert writer.read(8) is None


def test_a_writer_killed_mid_file_leaves_nothing_that_loads(tmp_path: Path) -> None:
    tier = files(tmp_path)
    tier.write_later(9, block(1))
    tier.drain()
    # What a killed writer leaves: its temporary file, never under a block's name.
    partial = tier.folder / f".{tier.path(10).name}.deadbeef.tmp"
    partial.write_bytes(tier.path(9).read_bytes()[:40])
    assert not tier.contains(10) and tier.read(10) is None
    assert [p.name for p in tier.folder.iterdir() if not p.name.startswith(".")] == [tier.path(9).name]


def test_the_folder_keeps_its_budget_by_least_recent_use(tmp_path: Path) -> None:
    probe = files(tmp_path)
    probe.write_later(0, block(0))
    probe.drain()
    file_size = probe.path(0).stat().st_size
    probe.path(0).unlink()
    tier = files(tmp_path, budget=int(3.5 * file_size))
    for h in range(3):
        tier.write_later(h, block(h))
        tier.drain()
        past = time.time() - 100 + h
        os.utime(tier.path(h), (past, past))
    assert tier.read(0) is not None  # 0 is now the most recently used
    tier.write_later(3, block(3))
    tier.drain()
    tier.clean_up()
    assert [tier.contains(h) for h in range(4)] == [True, False, True, True]


def test_layout_keys_name_safe_folders() -> None:
    key = layout_key("org/model name", torch.bfloat16, 16, (30, 2, 16, 3, 64))
    assert key == "org_model_name-bfloat16-bs16-30x2x16x3x64"
    assert layout_key("m", torch.float32, 16, (2, 3), shard=(1, 2)) == "m-float32-bs16-2x3-tp2r1"


RANK_SHAPES = [(2, 2, 4, 2, 3), (2, 2, 4, 1, 3)]  # 3 KV heads over 2 ranks: 2 and 1


def sharded(root: Path, budget: int = 1 << 20) -> tuple[SharedKvFiles, SharedKvFiles]:
    """Rank 0's and rank 1's tiers of one tensor-parallel replica's layout."""
    layouts = [ShardLayout(f"tiny-tp2r{rank}", shape) for rank, shape in enumerate(RANK_SHAPES)]
    leader = SharedKvFiles(
        root,
        layouts[0].key,
        budget_bytes=budget,
        block_shape=RANK_SHAPES[0],
        dtype=torch.float32,
        peers=layouts[1:],
    )
    follower = SharedKvFiles(
        root,
        layouts[1].key,
        budget_bytes=budget,
        block_shape=RANK_SHAPES[1],
        dtype=torch.float32,
        follower=True,
    )
    return leader, follower


def shard(rank: int, seed: int) -> torch.Tensor:
    return torch.randn(RANK_SHAPES[rank], generator=torch.Generator().manual_seed(100 * rank + seed))


def test_a_sharded_block_is_there_only_with_every_ranks_shard_and_each_rank_reads_its_own(
    tmp_path: Path,
) -> None:
    leader, follower = sharded(tmp_path)
    follower.write_later(9, shard(1, 1))
    follower.drain()
    assert not leader.contains(9), "rank 0's shard is not written yet"
    assert leader.read(9) is None
    leader.write_later(9, shard(0, 1))
    leader.drain()
    assert leader.contains(9)
    assert torch.equal(leader.read(9), shard(0, 1))
    assert torch.equal(follower.read(9), shard(1, 1))
    # Rank 0 announces the block; the other rank never does.
    assert [e.block_hashes for e in leader.take_events() if isinstance(e, BlocksStored)] == [(9,)]
    assert follower.take_events() == [] and not follower.has_events


def test_a_damaged_shard_of_another_rank_is_never_served_and_is_removed(tmp_path: Path) -> None:
    leader, follower = sharded(tmp_path)
    leader.write_later(4, shard(0, 2))
    follower.write_later(4, shard(1, 2))
    leader.drain()
    follower.drain()
    path = follower.path(4)
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert leader.read(4) is None
    assert not path.exists() and not leader.contains(4)
    assert leader.counts["rejected"] == 1
    assert leader.path(4).exists(), "rank 0's own shard is sound: only the damaged one goes"


def test_a_sharded_block_is_cleaned_up_whole_by_rank_0s_time(tmp_path: Path) -> None:
    leader, follower = sharded(tmp_path)
    for block_hash in range(4):
        leader.write_later(block_hash, shard(0, block_hash))
        follower.write_later(block_hash, shard(1, block_hash))
    leader.drain()
    follower.drain()
    now = time.time()
    for block_hash in range(4):
        # Rank 1's times are the reverse of rank 0's: only rank 0's may decide.
        os.utime(leader.path(block_hash), (now, now - 100 + block_hash))
        os.utime(follower.path(block_hash), (now, now - block_hash))
    os.utime(leader.path(1), (now, now - 200))
    block_bytes = leader.path(0).stat().st_size + follower.path(0).stat().st_size
    leader.budget_bytes = int(3.5 * block_bytes)  # every rank's shards counted against it
    leader.clean_up()
    assert [leader.contains(h) for h in range(4)] == [True, False, True, True]
    assert not follower.path(1).exists() and follower.path(0).exists()


def test_rank_0s_barrier_waits_for_the_other_ranks_shards(tmp_path: Path) -> None:
    leader, follower = sharded(tmp_path)
    leader.write_later(5, shard(0, 5))
    barrier = leader.after_queued_work([5])
    time.sleep(0.2)
    assert not barrier.done(), "rank 1 has not written its shard"
    follower.write_later(5, shard(1, 5))
    follower.drain()
    barrier.result(timeout=5)
    assert leader.contains(5)


def test_a_fill_order_sent_to_the_other_ranks_carries_only_its_hash() -> None:
    loaded = LoadedBlock(-77, torch.ones(1000))
    sent = pickle.loads(pickle.dumps(KvBlockMoves(fill=[(3, loaded)])))
    assert [(slot, block.block_hash, block.data) for slot, block in sent.fill] == [(3, -77, None)]
    assert len(pickle.dumps(loaded)) < 100


def engine_with_shared_tier(model_dir: Path, shared: Path, per_block: int, device: str) -> EngineCore:
    runner = ModelRunner(
        model_dir,
        dtype=torch.float32,
        device=torch.device(device),
        kv_cache_bytes=32 * per_block,
        block_size=16,
        host_kv_bytes=32 * per_block,
        shared_kv_dir=shared,
        shared_kv_bytes=1 << 30,
    )
    return engine_core(runner)


def engine_core(runner: ModelRunner) -> EngineCore:
    """The tiers' tests' engine: 64-token steps (a 150-token prompt takes three), 4 seats."""
    return EngineCore(
        runner=runner,
        model="tiny",
        scheduler_config=SchedulerConfig(
            max_model_len=runner.max_model_len,
            max_num_batched_tokens=64,
            max_num_seqs=4,
            eos_token_ids=tuple(runner.eos_token_ids),
        ),
    )


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    ("family", "device"),
    [("llama", "cpu"), ("kimi-k2", "cpu"), pytest.param("llama", "cuda", marks=CUDA)],
)
def test_a_second_engine_serves_the_first_ones_prompt_from_the_shared_folder(
    tiny_checkpoints: dict[str, Path], tmp_path: Path, family: str, device: str
) -> None:
    model_dir = tiny_checkpoints[family]
    per_block = ModelRunner(
        model_dir, dtype=torch.float32, device=torch.device("cpu"), kv_cache_bytes=64 << 20
    )._kv_cache_bytes_per_block()
    first = engine_with_shared_tier(model_dir, tmp_path, per_block, device)
    prompt = torch.randint(5, 200, (150,), generator=torch.Generator().manual_seed(5)).tolist()
    cold_tokens, cold_logprobs, cached = greedy(first, "a", prompt, 8)
    assert cached == 0
    while first.has_work_now():  # the blocks named by the last step go out too
        first.step()
    first.runner.shared_kv.drain()
    assert first.scheduler.kv.block_copies["store"] == 9  # the prompt's full blocks

    second = engine_with_shared_tier(model_dir, tmp_path, per_block, device)
    tokens, logprobs, cached = greedy(second, "b", prompt, 8)
    assert cached == 144
    assert second.scheduler.kv.hit_tokens == {"engine": 0, "host": 0, "shared": 144, "transfer": 0}
    assert tokens == cold_tokens
    assert logprobs == pytest.approx(cold_logprobs, abs=1e-5)


def test_the_shared_tier_needs_a_host_tier(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="CACHET_KV_HOST_GB"):
        ModelRunner(
            tiny_checkpoints["llama"],
            dtype=torch.float32,
            device=torch.device("cpu"),
            kv_cache_bytes=4 << 20,
            shared_kv_dir=tmp_path,
        )
