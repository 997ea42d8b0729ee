"""Direct KV transfer between replicas (disaggregated prefill): a prefill replica pushes a
hand-off's blocks straight into the decode replica's memory over torch.distributed
point-to-point, NCCL between two GPUs and gloo otherwise (the same code, chosen by device). The
shared file tier (``shared_kv_tier``) stays the transport where no direct path exists.

Pairing. A replica that takes hand-offs (``CACHET_ENGINE_KV_TRANSFER_PORT``) runs a
``KvReceiver`` on each of its ranks: rank 0's holds a ``TCPStore`` on that port, which it
announces in ``EngineInfo`` (``kv_transfer_address``), and the other ranks' receivers are
clients of the same store. Each receiving rank posts its layout key under ``layout/<rank>``
(model, dtype, block size, its shard's block shape, and for a tensor-parallel replica the
rank and group size: a block of another layout would be garbage). A sender's rank *r* pairs
with the receiver's rank *r* alone, shard to shard: it reads ``layout/<r>`` (missing or
different refuses the pair, and the hand-off falls back to the files), takes a number from
rank *r*'s counter and names a fresh pair id under it, with the pair's backend. Both sides
then open a two-rank process group of their own under that id (sender rank 0, receiver rank
1): no global process group, so a tensor-parallel replica's own group is untouched, and one
receiver serves many senders.

The backend. Each receiving rank also posts ``device/<rank>``, the physical device its pool is
on (a GPU by its UUID). NCCL pairs two different GPUs, device memory to device memory; it
refuses two ranks on one GPU, as a prefill and a decode replica sharing a single-GPU machine
are, so those pairs, and any pair with a CPU end, use gloo, whose tensors are in host memory:
the sender copies its blocks out of the GPU (they go to the receiver's host tier in any case).

A transfer. The sender posts the block count and the transfer's id under
``signal/<pair>/<n>`` in the store, then sends the blocks' hashes (int64) and the blocks
(``[count, *block shape]``, one tensor) over the group; the receiver, waiting on that key,
receives both into its ``ReceivedBlocks`` and answers ``ack/<pair>/<n>``. The sender's future
is done at the ack, so a hand-off's answer, and with it the router's decode request, comes
after the blocks are in the decode replica's memory. Signals go through the store, not the
group, so an idle pair waits on nothing that times out, and a lost peer only ends its pair:
the next send pairs again.

Tensor-parallel replicas. The ranks of a sending replica queue the same transfers in the same
order (their step plans are one plan), so a transfer's id, the sending replica's name and a
count of its transfers to that receiver, is the same on every rank. Rank 0 of the receiving
replica speaks for a block, as in the shared tier: a follower rank posts ``got/<id>/<rank>``
once it holds its shard, and rank 0 keeps its own shard, and acks, only once every rank has
posted; so when the sending replica's rank 0 is acked, every shard is in place, and a block
rank 0 offers a request is one each rank can fill from its own receiver. A transfer some rank
missed is refused (acked ``0``): the decode replica recomputes it (a follower's note of a
transfer rank 0 never got stays in the store, a few bytes). A follower keeps what it
received under twice rank 0's budget, oldest first: it holds rank 0's blocks and, for a step,
those rank 0 has just taken, so it drops what rank 0 dropped or refused before anything rank 0
may still offer.

What fails costs a recompute, never a request: a send that fails or times out completes its
barrier all the same (the hand-off answers; the decode replica computes what it lacks), and
received blocks nobody asks for are dropped oldest first past the receiver's budget.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog
import torch
import torch.distributed as dist

log = structlog.get_logger(__name__)

# How long a pair's setup, a transfer's tensors or its ack may take before the pair is given up.
TRANSFER_TIMEOUT = datetime.timedelta(seconds=30)
# How long rank 0 of a tensor-parallel receiver waits for its other ranks' shards of a transfer
# it holds its own of: they are sent at the same time, so one later than this was lost. Shorter
# than TRANSFER_TIMEOUT, so the sender sees a refusal, not a lost pair.
PEER_SHARDS_WAIT = datetime.timedelta(seconds=10)
# A follower rank's share of the budget, against rank 0's (module docstring).
FOLLOWER_BUDGET_FACTOR = 2
# A receiver's threads wait for the next peer or transfer this long, at most (close() wakes
# them sooner): an idle pair is not a failure.
_IDLE_WAIT = datetime.timedelta(days=365)
# ProcessGroupGloo or ProcessGroupNCCL, used alone (no global group): both send and receive.
PairGroup = Any
# Python's hashes are 64-bit unsigned here; int64 tensors carry them in two's complement.
_HASH_BITS = 64


def _to_signed(block_hash: int) -> int:
    block_hash &= (1 << _HASH_BITS) - 1
    return block_hash - (1 << _HASH_BITS) if block_hash >= 1 << (_HASH_BITS - 1) else block_hash


def device_identity(device: torch.device) -> str:
    """The physical device a rank's pool is on, the same string in every process that sees it."""
    if device.type != "cuda":
        return device.type
    return f"cuda:{torch.cuda.get_device_properties(device).uuid}"


def pair_backend(sender_device: str, receiver_device: str) -> str:
    """NCCL between two different GPUs, else gloo (module docstring)."""
    gpus = sender_device.startswith("cuda:") and receiver_device.startswith("cuda:")
    return "nccl" if gpus and sender_device != receiver_device else "gloo"


def _wire_device(backend: str, device: torch.device) -> torch.device:
    """Where a pair's tensors must be for its backend: gloo's in host memory."""
    return device if backend == "nccl" else torch.device("cpu")


def _on_wire(blocks: torch.Tensor, wire: torch.device) -> torch.Tensor:
    """``blocks`` where the pair sends from. A GPU's go to host memory through pinned memory,
    which the caching host allocator reuses transfer after transfer: on a lent H200, 172 MB came
    out at 55 GB/s into pinned memory against 1.3 GB/s into pageable."""
    if blocks.device.type == "cuda" and wire.type == "cpu":
        return torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True).copy_(blocks)
    return blocks.to(wire).contiguous()


def _pair_group(store: dist.Store, rank: int, backend: str, host: str) -> PairGroup:
    """A two-rank group over ``store``: NCCL, or gloo on ``host``'s interface (this replica's
    own address, not whatever the machine's name resolves to)."""
    if backend == "nccl":
        nccl = dist.ProcessGroupNCCL.Options()
        nccl._timeout = TRANSFER_TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, 2, nccl)
    # The binding's own options, the ones that take devices (torch's new_group builds the same).
    gloo = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    gloo._timeout = TRANSFER_TIMEOUT
    gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, 2, gloo)


def _listening_socket(host: str, port: int) -> socket.socket:
    """The receiver's store listens here only (the store would take every interface)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(128)
    return listener


def _storage_of(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class ReceivedBlocks:
    """Blocks pushed to this replica, by hash, until a request takes them (or the budget drops
    the oldest). Filled by the receiver's threads, read by the engine's loop."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._blocks: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._bytes = 0
        # The held blocks of each transfer's tensor, by its storage's address.
        self._by_storage: dict[int, set[int]] = {}
        self._lock = threading.Lock()
        # Totals since start: the KV cache manager reports them as the copies of direction
        # receive and receive_dropped (metrics).
        self.counts = {"received": 0, "dropped": 0}

    def put(self, block_hashes: Iterable[int], blocks: torch.Tensor) -> None:
        with self._lock:
            partial = False
            for block_hash, block in zip(block_hashes, blocks, strict=True):
                if block_hash in self._blocks:
                    self._blocks.move_to_end(block_hash)
                    partial = True
                    continue
                self._blocks[block_hash] = block
                self._by_storage.setdefault(_storage_of(block), set()).add(block_hash)
                self._bytes += block.numel() * block.element_size()
                self.counts["received"] += 1
            split = {_storage_of(blocks)} if partial else set()
            while self._bytes > self.budget_bytes and self._blocks:
                block_hash, dropped = self._blocks.popitem(last=False)
                split.add(self._forget(block_hash, dropped))
                self.counts["dropped"] += 1
            self._own_memory(split)

    def take_run(self, block_hashes: Iterable[int]) -> list[tuple[int, torch.Tensor]]:
        """The leading run of ``block_hashes`` held here, taken out (each is filled once)."""
        return self._take(block_hashes, whole_run=True)

    def take(self, block_hashes: Iterable[int]) -> dict[int, torch.Tensor]:
        """Those of ``block_hashes`` held here, taken out, in one pass: a transfer's blocks taken
        one call each would give the rest memory of their own at every call."""
        return dict(self._take(block_hashes, whole_run=False))

    def _take(self, block_hashes: Iterable[int], whole_run: bool) -> list[tuple[int, torch.Tensor]]:
        taken = []
        with self._lock:
            split = set()
            for block_hash in block_hashes:
                block = self._blocks.pop(block_hash, None)
                if block is None:
                    if whole_run:
                        break
                    continue
                split.add(self._forget(block_hash, block))
                taken.append((block_hash, block))
            self._own_memory(split)
        return taken

    def _forget(self, block_hash: int, block: torch.Tensor) -> int:
        """Uncount a block gone from here; returns its transfer's storage."""
        self._bytes -= block.numel() * block.element_size()
        storage = _storage_of(block)
        held = self._by_storage[storage]
        held.discard(block_hash)
        if not held:
            del self._by_storage[storage]
        return storage

    def _own_memory(self, storages: set[int]) -> None:
        """A block received is a view of its whole transfer's tensor, which lives while any of its
        blocks does: the budget would count one block and hold them all. So the blocks still here
        of a transfer some of whose blocks are gone (taken, dropped, or held already) get memory
        of their own."""
        for storage in storages:
            for block_hash in self._by_storage.pop(storage, ()):
                own = self._blocks[block_hash].clone()
                self._blocks[block_hash] = own
                self._by_storage[_storage_of(own)] = {block_hash}

    def __contains__(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._blocks

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)


class KvReceiver:
    """Takes blocks other replicas push to this one: this rank's shard of them (module docstring)."""

    def __init__(
        self,
        layout_key: str,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        *,
        port: int,
        budget_bytes: int,
        host: str = "127.0.0.1",
        rank: int = 0,
        ranks: int = 1,
    ) -> None:
        """``rank`` of ``ranks``: a tensor-parallel replica's rank; rank 0 listens on ``port``,
        the others join its store there."""
        self.layout_key = layout_key
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.device = device
        self.rank, self.ranks = rank, ranks
        self.blocks = ReceivedBlocks(budget_bytes if rank == 0 else FOLLOWER_BUDGET_FACTOR * budget_bytes)
        self._host = host
        self._listener: socket.socket | None = None
        if rank == 0:
            self._listener = _listening_socket(host, port)
            self._port = self._listener.getsockname()[1]
            self._store = dist.TCPStore(
                host,
                self._port,
                is_master=True,
                wait_for_workers=False,
                timeout=TRANSFER_TIMEOUT,
                master_listen_fd=self._listener.fileno(),
            )
        else:
            self._port = port
            self._store = self._client()
        # The device before the layout: a sender that finds the layout finds the device.
        self._store.set(f"device/{rank}", device_identity(device))
        self._store.set(f"layout/{rank}", layout_key)
        self.address = f"[{host}]:{self._port}" if ":" in host else f"{host}:{self._port}"
        # Keys each waiting thread waits on next; close() sets them to wake the threads.
        self._lock = threading.Lock()
        self._closed = False
        self._waits: dict[str, str] = {}
        self._threads = [threading.Thread(target=self._accept, name="kv-receiver", daemon=True)]
        self._threads[0].start()
        # A thread still blocked in the store's C++ wait when the interpreter exits aborts the
        # process: a replica's receiver lives as long as it does, and is woken on the way out.
        atexit.register(self.close)

    def close(self, timeout: float = 5.0) -> None:
        """Wake and end the waiting threads (a thread left blocked in the store's C++ wait at
        interpreter exit aborts the process)."""
        atexit.unregister(self.close)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            waits = dict(self._waits)
            threads = list(self._threads)
        for key, closing in waits.items():
            with contextlib.suppress(Exception):  # rank 0's store, gone before a follower's close
                self._store.set(key, closing)
        for thread in threads:
            thread.join(timeout)

    def _client(self) -> dist.TCPStore:
        """A connection of the calling thread's own: a store client serves one call at a time,
        and each thread here blocks in waits of its own."""
        return dist.TCPStore(self._host, self._port, is_master=False, timeout=TRANSFER_TIMEOUT)

    def _wait(
        self, store: dist.TCPStore, keys: list[str], closing: str, timeout: datetime.timedelta = _IDLE_WAIT
    ) -> list[str] | None:
        """``keys``' values once all are set, taken out of the store; None once the receiver is
        closed (``closing`` is what close() sets them to). Raises past ``timeout``."""
        with self._lock:
            if self._closed:
                return None
            self._waits.update(dict.fromkeys(keys, closing))
        try:
            store.wait(keys, timeout)
            values = [store.get(key).decode() for key in keys]
        finally:
            with self._lock:
                for key in keys:
                    self._waits.pop(key, None)
        for key in keys:
            store.delete_key(key)
        return None if self._closed and closing in values else values

    def _accept(self) -> None:
        store = self._client()
        peer = 0
        while (pairing := self._wait(store, [f"peer/{self.rank}/{peer}"], "")) is not None:
            pair_id, backend = pairing[0].split(" ", 1)
            thread = threading.Thread(
                target=self._serve, args=(pair_id, backend), name=f"kv-receiver-{peer}", daemon=True
            )
            with self._lock:
                self._threads.append(thread)
            thread.start()
            peer += 1

    def _serve(self, pair_id: str, backend: str) -> None:
        store = self._client()
        wire = _wire_device(backend, self.device)
        try:
            group = _pair_group(dist.PrefixStore(f"pair/{pair_id}/", store), 1, backend, self._host)
        except Exception as exc:  # a sender that vanished mid-pairing
            log.warning("KV transfer pairing failed", pair=pair_id, error=str(exc))
            return
        transfer = 0
        try:
            while (signal := self._wait(store, [f"signal/{pair_id}/{transfer}"], "0")) not in (None, ["0"]):
                count, transfer_id = signal[0].split(" ", 1)
                hashes = torch.empty(int(count), dtype=torch.int64, device=wire)
                group.recv([hashes], 0, 0).wait()
                blocks = torch.empty(int(count), *self.block_shape, dtype=self.dtype, device=wire)
                group.recv([blocks], 0, 0).wait()
                if blocks.device.type == "cuda":
                    # Held in host memory, the tier they fill: not beside the GPU's KV pool. Not
                    # pinned: they are held until a request takes them, and torch keeps pinned
                    # memory it frees for reuse, never for the rest of the host.
                    blocks = blocks.to("cpu", non_blocking=False)
                kept = self._keep(store, transfer_id, hashes.tolist(), blocks)
                if kept is None:
                    return
                store.set(f"ack/{pair_id}/{transfer}", "1" if kept else "0")
                transfer += 1
        except Exception as exc:  # a sender lost mid-transfer: its pair ends, the others go on
            log.warning("KV transfer from a peer failed", pair=pair_id, error=str(exc))

    def _keep(
        self, store: dist.TCPStore, transfer_id: str, hashes: list[int], blocks: torch.Tensor
    ) -> bool | None:
        """Hold a transfer's blocks: a follower's at once (then it says so to rank 0), rank 0's
        once every other rank holds its shard. False: refused, a shard is missing; None: closed."""
        block_hashes = [h & ((1 << _HASH_BITS) - 1) for h in hashes]
        if self.rank != 0:
            self.blocks.put(block_hashes, blocks)
            store.set(f"got/{transfer_id}/{self.rank}", "1")
            return True
        if self.ranks > 1:
            peers = [f"got/{transfer_id}/{rank}" for rank in range(1, self.ranks)]
            try:
                if self._wait(store, peers, "", PEER_SHARDS_WAIT) is None:
                    return None
            except Exception as exc:  # the store's timeout: some rank's shard never came
                log.warning(
                    "KV transfer refused: a rank's shard is missing", transfer=transfer_id, error=str(exc)
                )
                return False
        self.blocks.put(block_hashes, blocks)
        return True


class LayoutMismatch(ValueError):
    """The receiver keeps blocks of another layout: the hand-off goes through the files."""


class TransferRefused(RuntimeError):
    """A tensor-parallel receiver's rank 0 refused a transfer another of its ranks missed: the
    decode replica recomputes those blocks. The pair stays good."""


@dataclass
class _Pair:
    store: dist.TCPStore
    group: PairGroup
    pair_id: str
    # Where the pair's tensors are sent from (_wire_device).
    wire: torch.device
    next_transfer: int = 0


class KvSender:
    """Pushes blocks to other replicas' receivers, one transfer at a time, on one worker thread."""

    def __init__(
        self,
        layout_key: str,
        device: torch.device,
        *,
        host: str = "127.0.0.1",
        timeout: datetime.timedelta = TRANSFER_TIMEOUT,
        rank: int = 0,
        name: str = "",
    ) -> None:
        """``host``: this replica's address, the interface its gloo pairs use. ``rank``: of a
        tensor-parallel replica, whose ranks share one ``name`` (their transfers' ids)."""
        self.layout_key = layout_key
        self.device = device
        self.host = host
        self.timeout = timeout
        self.rank = rank
        self.name = name or uuid.uuid4().hex
        self._pairs: dict[str, _Pair] = {}
        # Transfers queued for each receiver: with the name, a transfer's id, which every rank
        # of this replica gives the same transfer (they queue them in one order).
        self._queued: dict[str, int] = {}
        # Receivers that could not be reached, until when sends to them fail at once: a hand-off
        # sends after each prompt chunk, and each would otherwise wait out the timeout again.
        self._unreachable: dict[str, float] = {}
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-sender")
        # Totals since start (the engine's metrics count blocks sent at the KV cache manager).
        self.counts = {"sent": 0, "failed": 0}
        self.bytes_sent = 0

    def send_later(
        self,
        address: str,
        block_hashes: list[int],
        blocks: torch.Tensor,
        ready: Callable[[], None] | None = None,
    ) -> Future[None]:
        """Queue ``blocks`` (``[count, *block shape]``, owned by the sender now) for ``address``;
        ``ready`` is waited on first, on the worker (a CUDA event whose copy fills ``blocks``).
        The future is done once the receiver holds them, and fails if it could not."""
        number = self._queued.get(address, 0)
        self._queued[address] = number + 1
        transfer_id = f"{self.name}/{number}"
        return self._worker.submit(self._send, address, transfer_id, block_hashes, blocks, ready)

    def after_queued_work(self) -> Future[None]:
        """Done once every transfer queued so far has ended, delivered or failed."""
        return self._worker.submit(lambda: None)

    def close(self) -> None:
        self._worker.submit(self._close_pairs)
        self._worker.shutdown(wait=True)

    def _send(
        self,
        address: str,
        transfer_id: str,
        block_hashes: list[int],
        blocks: torch.Tensor,
        ready: Callable[[], None] | None,
    ) -> None:
        try:
            if ready is not None:
                ready()
            if time.monotonic() < self._unreachable.get(address, 0.0):
                raise ConnectionError(f"the KV receiver at {address} was unreachable moments ago")
            pair = self._pairs.get(address) or self._pair(address)
            self._pairs[address] = pair
            transfer = pair.next_transfer
            pair.next_transfer += 1
            pair.store.set(f"signal/{pair.pair_id}/{transfer}", f"{len(block_hashes)} {transfer_id}")
            hashes = torch.tensor([_to_signed(h) for h in block_hashes], dtype=torch.int64, device=pair.wire)
            pair.group.send([hashes], 1, 0).wait()
            pair.group.send([_on_wire(blocks, pair.wire)], 1, 0).wait()
            pair.store.wait([f"ack/{pair.pair_id}/{transfer}"], self.timeout)
            kept = pair.store.get(f"ack/{pair.pair_id}/{transfer}") == b"1"
            pair.store.delete_key(f"ack/{pair.pair_id}/{transfer}")
            if not kept:
                raise TransferRefused(
                    f"the KV receiver at {address} lacked another rank's shard of {transfer_id}"
                )
        except (LayoutMismatch, TransferRefused):
            self.counts["failed"] += 1
            raise
        except Exception:
            # The pair may be half-way through a transfer: never reuse it.
            self.counts["failed"] += 1
            if self._pairs.pop(address, None) is None:
                self._unreachable[address] = time.monotonic() + self.timeout.total_seconds()
            raise
        self.counts["sent"] += len(block_hashes)
        self.bytes_sent += blocks.numel() * blocks.element_size()

    def _pair(self, address: str) -> _Pair:
        bracketed, _, port = address.rpartition(":")
        host = bracketed.strip("[]")
        # A plain connect first: a receiver that is gone is refused at once, where the store's
        # client would retry until its timeout and log each try.
        socket.create_connection((host, int(port)), timeout=self.timeout.total_seconds()).close()
        store = dist.TCPStore(host, int(port), is_master=False, timeout=self.timeout)
        own = f"layout/{self.rank}"
        # Checked first: a receiver with fewer ranks has no key to wait for.
        theirs = store.get(own).decode() if store.check([own]) else "no such rank"
        if theirs != self.layout_key:
            raise LayoutMismatch(
                f"the receiver at {address} keeps {theirs!r} blocks at rank {self.rank}, not {self.layout_key!r}"
            )
        device = f"device/{self.rank}"
        if not store.check([device]):
            raise LayoutMismatch(
                f"the receiver at {address} names no device: it predates choosing the backend by device"
            )
        backend = pair_backend(device_identity(self.device), store.get(device).decode())
        peer = store.add(f"peers/{self.rank}", 1) - 1
        pair_id = uuid.uuid4().hex
        store.set(f"peer/{self.rank}/{peer}", f"{pair_id} {backend}")
        group = _pair_group(dist.PrefixStore(f"pair/{pair_id}/", store), 0, backend, self.host)
        return _Pair(store, group, pair_id, _wire_device(backend, self.device))

    def _close_pairs(self) -> None:
        for pair in self._pairs.values():
            try:
                pair.store.set(f"signal/{pair.pair_id}/{pair.next_transfer}", "0")
            except Exception:  # the receiver is gone already
                continue
        self._pairs.clear()
