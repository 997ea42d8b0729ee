"""Direct KV transfer (disaggregated prefill): blocks pushed over a two-rank group (gloo; NCCL
between two GPUs) arrive bit for bit under their hashes, from several senders and from a GPU; a
receiver of another layout, or one that names no device, is refused; a receiver that is gone
fails the send, never hangs it."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from cachet.engine.kv_transfer import KvReceiver, KvSender, LayoutMismatch, ReceivedBlocks, pair_backend
from cachet.loopback_port import free_loopback_port

SHAPE = (2, 2, 4, 1, 3)
CPU = torch.device("cpu")


def blocks(count: int, seed: int) -> torch.Tensor:
    return torch.randn(count, *SHAPE, generator=torch.Generator().manual_seed(seed))


def receiver(key: str = "tiny-float32", budget: int = 1 << 20) -> KvReceiver:
    return KvReceiver(key, SHAPE, torch.float32, CPU, port=free_loopback_port(), budget_bytes=budget)


def test_pushed_blocks_arrive_bit_for_bit_under_their_hashes_from_several_senders() -> None:
    target = receiver()
    first, second = KvSender("tiny-float32", CPU), KvSender("tiny-float32", CPU)
    high = (1 << 64) - 3  # past int64: carried in two's complement
    try:
        first.send_later(target.address, [high, 5], blocks(2, 1)).result(timeout=30)
        second.send_later(target.address, [7], blocks(1, 2)).result(timeout=30)
        first.send_later(target.address, [9], blocks(1, 3)).result(timeout=30)  # the pair is reused
    finally:
        first.close()
        second.close()
        target.close()
    taken = target.blocks.take_run([high, 5, 7, 9, 11])
    assert [h for h, _ in taken] == [high, 5, 7, 9]
    expected = torch.cat([blocks(2, 1), blocks(1, 2), blocks(1, 3)])
    assert all(torch.equal(block, want) for (_, block), want in zip(taken, expected, strict=True))
    assert first.counts == {"sent": 3, "failed": 0} and len(target.blocks) == 0


def test_nccl_pairs_two_different_gpus_and_gloo_every_other_pair() -> None:
    first, second = "cuda:GPU-2b6e", "cuda:GPU-91f0"
    assert pair_backend(first, second) == "nccl"
    assert pair_backend(first, first) == "gloo"  # NCCL refuses two ranks on one GPU
    assert pair_backend(first, "cpu") == pair_backend("cpu", first) == pair_backend("cpu", "cpu") == "gloo"


@pytest.mark.parametrize(
    ("sending", "receiving"),
    [
        pytest.param(
            "cuda:0",
            "cuda:0",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
            id="one-gpu-gloo",
        ),
        pytest.param(
            "cuda:0",
            "cpu",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
            id="gpu-to-cpu-gloo",
        ),
        pytest.param(
            "cuda:0",
            "cuda:1",
            marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
            id="two-gpus-nccl",
        ),
    ],
)
def test_blocks_on_a_gpu_arrive_bit_for_bit_in_the_receivers_host_memory(
    sending: str, receiving: str
) -> None:
    target = KvReceiver(
        "tiny-float32",
        SHAPE,
        torch.float32,
        torch.device(receiving),
        port=free_loopback_port(),
        budget_bytes=1 << 20,
    )
    sender = KvSender("tiny-float32", torch.device(sending))
    try:
        sender.send_later(target.address, [3, 4], blocks(2, 1).to(sending)).result(timeout=60)
        sender.send_later(target.address, [5], blocks(1, 2).to(sending)).result(timeout=60)
    finally:
        sender.close()
        target.close()
    taken = target.blocks.take_run([3, 4, 5])
    expected = torch.cat([blocks(2, 1), blocks(1, 2)])
    assert [h for h, _ in taken] == [3, 4, 5]
    assert all(
        block.device.type == "cpu" and torch.equal(block, want)
        for (_, block), want in zip(taken, expected, strict=True)
    )


@pytest.mark.parametrize(
    ("layout", "names_its_device", "reason"),
    [
        ("other-layout", True, "other-layout"),
        # A receiver of the version before the backend followed the devices: its blocks go
        # through the files rather than a pair the two ends would name differently.
        ("tiny-float32", False, "names no device"),
    ],
)
def test_a_receiver_the_sender_cannot_pair_with_is_refused_by_name(
    layout: str, names_its_device: bool, reason: str
) -> None:
    target = receiver(layout)
    if not names_its_device:
        host, port = target.address.rsplit(":", 1)
        dist.TCPStore(host, int(port), is_master=False).delete_key("device/0")
    sender = KvSender("tiny-float32", CPU)
    try:
        with pytest.raises(LayoutMismatch, match=reason):
            sender.send_later(target.address, [1], blocks(1, 1)).result(timeout=30)
    finally:
        sender.close()
        target.close()
    assert len(target.blocks) == 0


def test_a_send_to_a_receiver_that_is_gone_fails_in_its_timeout() -> None:
    sender = KvSender("tiny-float32", CPU, timeout=datetime.timedelta(seconds=2))
    started = time.monotonic()
    try:
        with pytest.raises(Exception):  # noqa: B017 - the store's own connection error
            sender.send_later(f"127.0.0.1:{free_loopback_port()}", [1], blocks(1, 1)).result(timeout=30)
        # The barrier behind a failed send still completes: a hand-off answers all the same.
        sender.after_queued_work().result(timeout=5)
    finally:
        sender.close()
    assert time.monotonic() - started < 20
    assert sender.counts["failed"] == 1


def test_received_blocks_are_taken_once_and_the_oldest_go_past_the_budget() -> None:
    one_block = blocks(1, 0)[0].numel() * 4
    held = ReceivedBlocks(budget_bytes=3 * one_block)
    held.put([1, 2, 3], blocks(3, 1))
    held.put([4], blocks(1, 2))
    assert 1 not in held and held.counts == {"received": 4, "dropped": 1}
    assert [h for h, _ in held.take_run([2, 3, 5, 4])] == [2, 3]
    assert 2 not in held and 4 in held
    # Taking any of them, not only a leading run (a follower rank's fills).
    held.put([6], blocks(1, 3))
    assert sorted(held.take([5, 6, 4])) == [4, 6] and len(held) == 0


def test_blocks_left_of_a_partly_taken_transfer_stop_holding_the_rest() -> None:
    """A received block is a view of its transfer's tensor: once some of its blocks are taken,
    dropped or already held, the ones kept own their memory, so what the budget counts is what
    is held."""
    held = ReceivedBlocks(budget_bytes=1 << 20)
    transfer = blocks(4, 3)
    held.put([1, 2, 3, 4], transfer)
    kept = dict(held.take_run([1, 2]))
    assert kept[1].untyped_storage().data_ptr() == transfer.untyped_storage().data_ptr()  # taken whole
    rest = dict(held.take_run([3, 4]))
    for block_hash, index in ((3, 2), (4, 3)):
        assert rest[block_hash].untyped_storage().nbytes() == transfer[0].numel() * 4
        assert torch.equal(rest[block_hash], transfer[index])
    # A transfer that repeats a block held already: its new blocks alone are kept, on their own.
    held.put([5], blocks(1, 4))
    again = blocks(2, 5)
    held.put([5, 6], again)
    ((_, sixth),) = held.take_run([6])
    assert sixth.untyped_storage().nbytes() == again[1].numel() * 4 and torch.equal(sixth, again[1])


# ------------------------------------------------------------ tensor-parallel replicas


def ranks_receiving(budget: int = 1 << 20) -> tuple[KvReceiver, KvReceiver]:
    """Rank 0 and rank 1 of one receiving replica (in one process here, threads apart)."""
    port = free_loopback_port()
    first = KvReceiver("tiny-tp2r0", SHAPE, torch.float32, CPU, port=port, budget_bytes=budget, ranks=2)
    second = KvReceiver(
        "tiny-tp2r1", SHAPE, torch.float32, CPU, port=port, budget_bytes=budget, rank=1, ranks=2
    )
    return first, second


def test_tensor_parallel_replicas_pair_rank_to_rank_and_each_rank_takes_its_own_shard() -> None:
    receiving = ranks_receiving()
    sending = [KvSender(f"tiny-tp2r{rank}", CPU, rank=rank, name="prefill0") for rank in (0, 1)]
    address = receiving[0].address
    assert receiving[1].address == address  # a follower is reached through rank 0's store
    try:
        for seed, block_hashes in ((10, [3, 4]), (20, [5])):
            sent = [
                sender.send_later(address, block_hashes, blocks(len(block_hashes), seed + sender.rank))
                for sender in sending
            ]
            for future in sent:
                future.result(timeout=30)
    finally:
        for sender in sending:
            sender.close()
        for end in receiving:
            end.close()
    for rank, end in enumerate(receiving):
        taken = end.blocks.take_run([3, 4, 5])
        want = torch.cat([blocks(2, 10 + rank), blocks(1, 20 + rank)])
        assert [h for h, _ in taken] == [3, 4, 5]
        assert all(torch.equal(block, w) for (_, block), w in zip(taken, want, strict=True)), rank
    # Each follower's share of the budget is larger: it holds, for a step, what rank 0 just took.
    assert receiving[1].blocks.budget_bytes == 2 * receiving[0].blocks.budget_bytes


def test_a_sending_rank_pairs_only_with_the_same_rank_of_the_same_layout() -> None:
    receiving = ranks_receiving()
    single = KvSender("tiny-float32", CPU)  # one rank, the whole block: not rank 0's shard
    third = KvSender("tiny-tp3r2", CPU, rank=2, name="p")  # a rank the receiver does not have
    try:
        with pytest.raises(LayoutMismatch, match="tiny-tp2r0"):
            single.send_later(receiving[0].address, [1], blocks(1, 1)).result(timeout=30)
        with pytest.raises(LayoutMismatch, match="no such rank"):
            third.send_later(receiving[0].address, [1], blocks(1, 1)).result(timeout=30)
    finally:
        single.close()
        third.close()
        for end in receiving:
            end.close()


def test_rank_zero_refuses_a_transfer_another_rank_missed_and_the_pair_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 offers a block only once every rank holds its shard: a transfer whose follower
    shard is late is refused (the decode replica recomputes it), and the next one is kept."""
    from cachet.engine import kv_transfer

    monkeypatch.setattr(kv_transfer, "PEER_SHARDS_WAIT", datetime.timedelta(seconds=1))
    receiving = ranks_receiving()
    leader, follower = (KvSender(f"tiny-tp2r{rank}", CPU, rank=rank, name="p") for rank in (0, 1))
    address = receiving[0].address
    try:
        with pytest.raises(kv_transfer.TransferRefused):
            leader.send_later(address, [7], blocks(1, 1)).result(timeout=30)
        follower.send_later(address, [7], blocks(1, 2)).result(timeout=30)  # too late for rank 0
        kept = [
            leader.send_later(address, [8], blocks(1, 3)),
            follower.send_later(address, [8], blocks(1, 4)),
        ]
        for future in kept:
            future.result(timeout=30)
    finally:
        leader.close()
        follower.close()
        for end in receiving:
            end.close()
    assert 7 not in receiving[0].blocks and 8 in receiving[0].blocks
    assert leader.counts == {"sent": 1, "failed": 1}
