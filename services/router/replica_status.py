"""The operators' view of the engine replicas: load as the router follows it, KV tiers as the
cache index mirrors them (``ListReplicaStatus``; the bridge's /dashboard renders it).

Who is an operator is one rule, here: the caller's account is in
``CACHET_ROUTER_OPERATOR_ACCOUNTS``. Nothing is computed: each figure is the engine's latest
report or the index's count, read at the moment of the call, so several routers answer alike
(each follows every engine) but for ``in_flight``, which is the answering router's own.
"""

from __future__ import annotations

import time
from collections.abc import Set

import grpc

from cachet.cache.v1 import cache_pb2, cache_pb2_grpc
from cachet.errors import PermissionDenied
from cachet.logs import get_logger
from cachet.router.caller import Caller
from cachet.router.replica_set import Replica, ReplicaSet
from cachet.router.v1 import router_pb2

log = get_logger(__name__)


class ReplicaStatusReader:
    def __init__(
        self,
        replicas: ReplicaSet,
        cache: cache_pb2_grpc.CacheIndexServiceAsyncStub,
        operators: Set[str],
        timeout_seconds: float,
    ) -> None:
        self._replicas = replicas
        self._cache = cache
        self._operators = operators
        self._timeout = timeout_seconds

    async def read(self, caller: Caller) -> router_pb2.ReplicaStatusList:
        """Every configured replica, or PermissionDenied for a caller who is not an operator."""
        if caller.account_id not in self._operators:
            raise PermissionDenied("the replicas' status is for operators (CACHET_ROUTER_OPERATOR_ACCOUNTS)")
        indexed = await self._indexed()
        now = time.monotonic()
        return router_pb2.ReplicaStatusList(
            replicas=[
                _status(self._replicas.get(address), (indexed or {}).get(address), now)
                for address in self._replicas.addresses
            ],
            cache_index_answered=indexed is not None,
        )

    async def _indexed(self) -> dict[str, cache_pb2.ReplicaState] | None:
        try:
            reply = await self._cache.ListReplicas(cache_pb2.ListReplicasRequest(), timeout=self._timeout)
        except grpc.aio.AioRpcError as error:
            # The index is an optimisation the router serves without; its view goes blank, the
            # router's own figures still answer.
            log.warning("cache index did not list its replicas", code=error.code().name)
            return None
        return {state.address: state for state in reply.replicas}


def _status(replica: Replica, indexed: cache_pb2.ReplicaState | None, now: float) -> router_pb2.ReplicaStatus:
    status = router_pb2.ReplicaStatus(
        address=replica.address,
        available=replica.available(now),
        in_flight=replica.in_flight,
        kv_index=indexed,
    )
    if replica.info is not None:
        status.model, status.role = replica.info.model, replica.info.role
    latest = replica.latest_report()
    if latest is not None:
        status.load.CopyFrom(latest)
        status.report_age_ms = int((now - replica.report_received_at()) * 1000)
    return status
