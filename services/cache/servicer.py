"""CacheIndexService over gRPC: proto in, index or followers, proto out."""

from __future__ import annotations

import grpc

from cachet.cache.followers import Followers
from cachet.cache.prefix_index import PrefixIndex
from cachet.cache.replica_follower import FollowerStatus
from cachet.cache.v1 import cache_pb2, cache_pb2_grpc
from cachet.errors import InvalidArgument
from cachet.grpc_server import Registrar
from cachet.tls import is_loopback


def parse_loopback_address(address: str) -> str:
    """``host:port`` with a loopback host, or InvalidArgument.

    WatchReplica makes this service open connections on a caller's say-so;
    restricting it to loopback keeps it from being pointed at other hosts.
    Engines on other machines are configured at start (``engine_addresses``).
    """
    host, separator, port = address.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    # An IPv6 host must be bracketed, or "::1:50061" would be ambiguous.
    well_formed = separator and (bracketed or ":" not in host) and port.isascii() and port.isdigit()
    if not well_formed or not 0 < int(port) < 65536:
        raise InvalidArgument(f"engine address must be host:port, got {address!r}", param="address")
    if not is_loopback(host):
        raise InvalidArgument(f"engine address must be on loopback, got {address!r}", param="address")
    return address


class CacheIndexServicer(cache_pb2_grpc.CacheIndexServiceServicer):
    def __init__(self, index: PrefixIndex, followers: Followers) -> None:
        self._index = index
        self._followers = followers

    async def MatchPrefix(
        self, request: cache_pb2.MatchPrefixRequest, context: grpc.aio.ServicerContext
    ) -> cache_pb2.MatchPrefixResponse:
        if not request.model:
            raise InvalidArgument("model is required", param="model")
        if not request.block_hashes:
            raise InvalidArgument("block_hashes must name at least one block", param="block_hashes")
        matches = self._index.match(request.model, request.block_hashes)
        return cache_pb2.MatchPrefixResponse(
            matches=[
                cache_pb2.ReplicaMatch(
                    address=m.address,
                    matched_blocks=m.matched_blocks,
                    engine_blocks=m.engine_blocks,
                    host_blocks=m.host_blocks,
                    shared_blocks=m.shared_blocks,
                )
                for m in matches
            ]
        )

    async def WatchReplica(
        self, request: cache_pb2.WatchReplicaRequest, context: grpc.aio.ServicerContext
    ) -> cache_pb2.WatchReplicaResponse:
        added = self._followers.watch(parse_loopback_address(request.address))
        return cache_pb2.WatchReplicaResponse(added=added)

    async def ListReplicas(
        self, request: cache_pb2.ListReplicasRequest, context: grpc.aio.ServicerContext
    ) -> cache_pb2.ListReplicasResponse:
        return cache_pb2.ListReplicasResponse(
            replicas=[self._state(status) for status in self._followers.statuses()]
        )

    def _state(self, status: FollowerStatus) -> cache_pb2.ReplicaState:
        address = status.address
        counted = self._index.figures.replica(address)
        return cache_pb2.ReplicaState(
            address=address,
            replica_id=status.replica_id,
            connected=status.connected,
            cached_blocks=self._index.replica_blocks(address),
            last_sequence_number=status.last_sequence_number,
            host_blocks=self._index.replica_blocks(address, "host"),
            shared_blocks=self._index.replica_blocks(address, "shared"),
            engine_hit_blocks=counted.hit_blocks["engine"],
            host_hit_blocks=counted.hit_blocks["host"],
            shared_hit_blocks=counted.hit_blocks["shared"],
            queried_blocks=counted.queried_blocks,
        )


def registrar(servicer: CacheIndexServicer) -> Registrar:
    def register(server: grpc.aio.Server) -> None:
        cache_pb2_grpc.add_CacheIndexServiceServicer_to_server(servicer, server)

    return register
