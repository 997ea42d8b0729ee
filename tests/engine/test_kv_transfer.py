"""Direct KV transfer (disaggregated prefill): blocks pushed over a two-rank gloo group arrive
bit for bit under their hashes, from several senders; a receiver of another layout is refused;
a receiver that is gone fails the send, never hangs it."""

from __future__ import annotations

import datetime
import time

import pytest
import torch

from cachet.engine.kv_transfer import KvReceiver, KvSender, LayoutMismatch, ReceivedBlocks
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


def test_a_receiver_of_another_layout_is_refused() -> None:
    target = receiver("other-layout")
    sender = KvSender("tiny-float32", CPU)
    try:
        with pytest.raises(LayoutMismatch, match="other-layout"):
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
