"""The set of engines the cache service follows, one ``ReplicaFollower`` each."""

from __future__ import annotations

from cachet.cache.backoff import Backoff
from cachet.cache.prefix_index import PrefixIndex
from cachet.cache.replica_follower import FollowerStatus, ReplicaFollower
from cachet.tls import TlsSettings


class Followers:
    """Starts at most one follower per address and stops them all on shutdown."""

    def __init__(
        self,
        index: PrefixIndex,
        backoff_initial: float = 0.05,
        backoff_maximum: float = 2.0,
        *,
        tls: TlsSettings | None = None,
    ) -> None:
        self._index = index
        self._tls = tls
        self._backoff = (backoff_initial, backoff_maximum)
        self._by_address: dict[str, ReplicaFollower] = {}

    def watch(self, address: str) -> bool:
        """Follow ``address``; False when it is already followed (WatchReplica is idempotent)."""
        if address in self._by_address:
            return False
        follower = ReplicaFollower(address, self._index, Backoff(*self._backoff), tls=self._tls)
        self._by_address[address] = follower
        follower.start()
        return True

    def statuses(self) -> list[FollowerStatus]:
        return [self._by_address[address].status for address in sorted(self._by_address)]

    def connected_count(self) -> int:
        return sum(follower.status.connected for follower in self._by_address.values())

    async def stop_all(self) -> None:
        for follower in self._by_address.values():
            await follower.stop()
        self._by_address.clear()
