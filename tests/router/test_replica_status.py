"""The operators' view of the replicas: who may read it, and what it says with parts missing."""

from __future__ import annotations

import grpc
import pytest

from cachet.cache.v1 import cache_pb2
from cachet.errors import PermissionDenied
from cachet.router.caller import Caller
from cachet.router.replica_set import ReplicaSet
from cachet.router.replica_status import ReplicaStatusReader

ENGINES = ["127.0.0.1:1", "127.0.0.1:2"]


class _Index:
    """The cache index's ListReplicas: a fixed answer, or down."""

    def __init__(self, states: list[cache_pb2.ReplicaState] | None) -> None:
        self._states = states

    async def ListReplicas(self, request, timeout: float) -> cache_pb2.ListReplicasResponse:  # noqa: N802
        if self._states is None:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down"
            )
        return cache_pb2.ListReplicasResponse(replicas=self._states)


async def test_only_operator_accounts_may_read_it() -> None:
    reader = ReplicaStatusReader(ReplicaSet(ENGINES), _Index([]), frozenset({"ops"}), 1.0)
    with pytest.raises(PermissionDenied):
        await reader.read(Caller("acct-1", ""))
    assert len((await reader.read(Caller("ops", ""))).replicas) == 2


async def test_every_configured_replica_is_listed_with_what_is_known_of_it() -> None:
    indexed = cache_pb2.ReplicaState(
        address=ENGINES[1],
        cached_blocks=7,
        host_blocks=3,
        shared_blocks=11,
        engine_hit_blocks=5,
        host_hit_blocks=2,
        shared_hit_blocks=1,
        queried_blocks=20,
    )
    reader = ReplicaStatusReader(ReplicaSet(ENGINES), _Index([indexed]), frozenset({"ops"}), 1.0)
    listed = await reader.read(Caller("ops", ""))
    assert listed.cache_index_answered
    assert [r.address for r in listed.replicas] == ENGINES
    never_reached, followed = listed.replicas
    # Not yet reached: no facts, no report, not available; the index does not follow it.
    assert (never_reached.available, never_reached.model, never_reached.HasField("load")) == (
        False,
        "",
        False,
    )
    assert not never_reached.HasField("kv_index")
    # The index's answer as it gave it: its tiers' blocks and its prefix hits per tier.
    assert followed.kv_index == indexed


async def test_with_the_cache_index_down_the_routers_own_figures_still_answer() -> None:
    reader = ReplicaStatusReader(ReplicaSet(ENGINES), _Index(None), frozenset({"ops"}), 1.0)
    listed = await reader.read(Caller("ops", ""))
    assert not listed.cache_index_answered
    assert [r.address for r in listed.replicas] == ENGINES
    assert not any(r.HasField("kv_index") for r in listed.replicas)
