"""The follower against a scripted KV event stream: order, resync, disconnects, reconnects."""

from __future__ import annotations

import time

import pytest
from scripted_kv_events import MODEL, batch, cleared, eventually, removed, start_scripted, stored

from cachet.block_hash import block_hashes
from cachet.cache.backoff import Backoff
from cachet.cache.prefix_index import PrefixIndex
from cachet.cache.replica_follower import ReplicaFollower

CHAIN = block_hashes(list(range(6 * 16)), MODEL)


@pytest.fixture
async def follow(scripted):
    servicer, running = scripted
    index = PrefixIndex()
    follower = ReplicaFollower(running.address, index, Backoff(initial=0.02, maximum=0.1))
    follower.start()
    await eventually(lambda: servicer.subscriptions == 1, what="first subscription")
    yield servicer, running, index, follower
    await follower.stop()


def matched(index: PrefixIndex, chain: list[int] = CHAIN) -> list[tuple[str, int]]:
    return [(m.address, m.matched_blocks) for m in index.match(MODEL, chain)]


async def test_snapshot_then_live_events_are_mirrored_in_order(follow) -> None:
    servicer, running, index, follower = follow
    servicer.send(batch(0, stored(CHAIN[:2]), stored(CHAIN[2:4], parent=CHAIN[1])))
    await eventually(lambda: follower.status.connected)
    await eventually(lambda: matched(index) == [(running.address, 4)])
    assert (follower.status.replica_id, follower.status.block_size) == ("replica-1", 16)

    # Within one batch, events apply in order: store then remove leaves the block gone.
    servicer.send(batch(1, stored(CHAIN[4:6], parent=CHAIN[3]), removed([CHAIN[2]])))
    await eventually(lambda: follower.status.last_sequence_number == 1)
    assert matched(index) == [(running.address, 2)]
    assert index.replica_blocks(running.address) == 5

    servicer.send(batch(2, cleared()), batch(3, stored(CHAIN[:1])))
    await eventually(lambda: follower.status.last_sequence_number == 3)
    assert matched(index) == [(running.address, 1)]
    assert index.replica_blocks(running.address) == 1
    assert servicer.subscriptions == 1
    index.check_invariants()


def tiers(index: PrefixIndex, chain: list[int] = CHAIN) -> list[tuple[int, int, int]]:
    return [(m.engine_blocks, m.host_blocks, m.shared_blocks) for m in index.match(MODEL, chain)]


async def test_each_tiers_events_are_mirrored_in_that_tier(follow) -> None:
    """The engine's sequences (test_kv_tier_events) as the follower sees them."""
    servicer, running, index, follower = follow
    # Snapshot: the pool holds blocks 0-3, the host tier 2-5 (inclusive of promoted ones).
    servicer.send(batch(0, stored(CHAIN[:4]), stored(CHAIN[2:6], tier="host")))
    await eventually(lambda: tiers(index) == [(4, 2, 0)])
    # The pool evicts its tail (blocks 2, 3) and the host tier keeps them: still 6 blocks, 4 by copy.
    servicer.send(batch(1, removed([CHAIN[3], CHAIN[2]]), stored([CHAIN[3], CHAIN[2]], tier="host")))
    await eventually(lambda: follower.status.last_sequence_number == 1)
    assert tiers(index) == [(2, 4, 0)]
    # The host tier evicts block 4; the shared tier has it (written when it was named).
    servicer.send(batch(2, removed([CHAIN[4]], tier="host"), stored(CHAIN[4:], tier="shared")))
    await eventually(lambda: follower.status.last_sequence_number == 2)
    assert tiers(index) == [(2, 2, 2)]
    assert [index.replica_blocks(running.address, t) for t in ("engine", "host", "shared")] == [2, 3, 2]
    # A host-tier clear leaves the pool and the shared tier; a tier the follower does not know is
    # skipped rather than mirrored into another tier.
    unknown = stored(CHAIN[2:4])
    unknown.tier = 7
    servicer.send(batch(3, cleared(tier="host"), unknown))
    await eventually(lambda: follower.status.last_sequence_number == 3)
    assert tiers(index) == [(2, 0, 0)]
    assert index.replica_blocks(running.address, "shared") == 2
    assert index.holds(running.address, CHAIN[5], "shared") and not index.holds(running.address, CHAIN[5])
    index.check_invariants()


async def test_a_gap_forgets_the_replica_and_resubscribes(follow) -> None:
    servicer, running, index, follower = follow
    servicer.send(batch(0, stored(CHAIN)))
    await eventually(lambda: matched(index) == [(running.address, 6)])
    servicer.send(batch(2, removed([CHAIN[5]])))  # batch 1 is missing
    await eventually(lambda: servicer.subscriptions == 2, what="resubscription")
    assert index.replica_blocks(running.address) == 0
    assert not follower.status.connected
    # The new subscription's snapshot rebuilds the mirror from scratch.
    servicer.send(batch(0, stored(CHAIN[:3])))
    await eventually(lambda: matched(index) == [(running.address, 3)])
    assert index.replica_blocks(running.address) == 3


async def test_a_new_replica_id_mid_stream_forgets_and_resubscribes(follow) -> None:
    servicer, running, index, follower = follow
    servicer.send(batch(0, stored(CHAIN)))
    await eventually(lambda: follower.status.connected)
    servicer.send(batch(1, stored([123]), replica_id="replica-2"))
    await eventually(lambda: servicer.subscriptions == 2, what="resubscription")
    assert index.replica_blocks(running.address) == 0
    assert not index.holds(running.address, 123)
    servicer.send(batch(0, stored(CHAIN[:2]), replica_id="replica-2"))
    await eventually(lambda: follower.status.replica_id == "replica-2")
    assert matched(index) == [(running.address, 2)]


async def test_a_subscription_must_start_at_batch_zero(follow) -> None:
    servicer, running, index, follower = follow
    servicer.send(batch(5, stored(CHAIN)))
    await eventually(lambda: servicer.subscriptions == 2, what="resubscription")
    assert index.replica_blocks(running.address) == 0
    assert not follower.status.connected


async def test_a_changed_model_mid_stream_resubscribes(follow) -> None:
    servicer, running, index, follower = follow
    servicer.send(batch(0, stored(CHAIN)))
    await eventually(lambda: follower.status.connected)
    servicer.send(batch(1, stored([7]), model="other-model"))
    await eventually(lambda: servicer.subscriptions == 2, what="resubscription")
    assert index.replicas() == []


async def test_an_ended_stream_forgets_the_replica_and_reconnects(follow) -> None:
    servicer, running, index, follower = follow
    servicer.send(batch(0, stored(CHAIN)))
    await eventually(lambda: matched(index) == [(running.address, 6)])
    servicer.end_stream()
    await eventually(lambda: servicer.subscriptions == 2, what="resubscription")
    assert index.replicas() == []
    servicer.send(batch(0, stored(CHAIN[:4])))
    await eventually(lambda: matched(index) == [(running.address, 4)])


async def test_engine_death_forgets_at_once_and_a_restart_is_followed_again(follow) -> None:
    servicer, running, index, follower = follow
    servicer.send(batch(0, stored(CHAIN)))
    await eventually(lambda: matched(index) == [(running.address, 6)])

    await running.server.stop(grace=None)
    started = time.monotonic()
    await eventually(lambda: index.replicas() == [], timeout=2.0, what="replica forgotten")
    assert time.monotonic() - started < 1.0
    assert not follower.status.connected and follower.status.replica_id == ""

    # Reconnect attempts while the engine is down keep the replica forgotten...
    await eventually(lambda: follower.status.subscriptions >= 3, what="reconnect attempts")
    assert index.replicas() == []
    # ...and a new engine on the same address is followed from its own snapshot.
    restarted, restarted_server = await start_scripted(running.port)
    try:
        await eventually(lambda: restarted.subscriptions == 1, what="subscription to the restarted engine")
        restarted.send(batch(0, stored(CHAIN[:5]), replica_id="replica-restarted"))
        await eventually(lambda: matched(index) == [(running.address, 5)])
        assert follower.status.replica_id == "replica-restarted"
    finally:
        await restarted_server.stop(grace=None)


async def test_stop_forgets_the_replica(follow) -> None:
    servicer, running, index, follower = follow
    servicer.send(batch(0, stored(CHAIN)))
    await eventually(lambda: follower.status.connected)
    await follower.stop()
    assert index.replicas() == []
    assert not follower.status.connected


async def test_an_unreachable_engine_is_retried_with_backoff() -> None:
    index = PrefixIndex()
    # Port 1 on loopback: nothing listens there, every attempt fails fast.
    follower = ReplicaFollower("127.0.0.1:1", index, Backoff(initial=0.01, maximum=0.05))
    follower.start()
    try:
        await eventually(lambda: follower.status.subscriptions >= 3, what="retries")
        assert not follower.status.connected
        assert index.replicas() == []
    finally:
        await follower.stop()


def test_backoff_doubles_up_to_its_maximum_and_resets() -> None:
    backoff = Backoff(initial=0.1, maximum=0.5, jitter=0.0)
    assert [backoff.next_delay() for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    backoff.reset()
    assert backoff.next_delay() == 0.1
    for _ in range(5000):  # an engine down for hours must not overflow the delay
        backoff.next_delay()
    assert backoff.next_delay() == 0.5
