"""The shared file KV tier: one file per block under ``CACHET_KV_SHARED_DIR``, so a block one
replica computed can be loaded by any replica that sees the directory (a local SSD, or a
shared filesystem across hosts, as llm-d's file-system offload does).

Files live in a folder named by everything that makes two replicas' blocks interchangeable
(model, dtype, block size, the block's shape: the sharding layout) and are named by the
chained block hash. Each file is a small JSON header (that key, the hash, shape, dtype,
payload size and its SHA-256) and the block's bytes. A file is written under a temporary
name and renamed into place, so a reader sees a whole file or none; a torn, truncated,
corrupted or foreign file fails the header or checksum test, is removed, and its tokens
are recomputed: never served.

Writes and reads run on one worker thread; the engine's step only queues them. The folder
is kept under a size budget by removing the least recently used files (a read refreshes a
file's modification time); several replicas may clean the same folder, and a file that
vanishes under a reader is simply a miss.

Retention (``kv_retention``; OpenAI's "24h" is the one that matters here) lives in the files
themselves, so that every replica's clean-up honours what any replica promised: a retained
file's modification time is set forward to the end of its retention (never back: a read
makes it ``max(now, mtime)``). A file whose time is in the future is retained, and the
clean-up leaves it until the folder cannot be brought within its budget any other way (see
``clean_up``). Clocks of replicas on different hosts are trusted to agree to well within a
retention's length.

The tier's KV events (tier ``"shared"``) name the files this replica knows of: those it
wrote, found already written, or read, less those it removed. The folder may be common to
many replicas, but each announces only what it saw, so the cache index holds the shared tier
per replica: a file another replica wrote is not credited to this one until it reads it,
and a file another replica's clean-up removed stays credited until this one misses it (a
miss costs a recompute, never a wrong answer).

A tensor-parallel replica's block is one file per rank, each in its rank's own folder (the
layout key names the rank and the group's size: ``tp2r0``, ``tp2r1``), so every rank writes
and reads only its own shard, a rank on another host included. Rank 0 speaks for the block:
it is present only when every rank's file is (``contains``), loaded only when every file
passes its checks (rank 0 reads its own shard and checks the others' in the same worker
pass: ``read``), and cleaned up whole, by rank 0's file's time, which carries the retention.
The other ranks (``follower=True``) write their shards as their plans say, read a shard back
when a plan fills a host slot with it, and neither clean up nor announce anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from cachet.engine.block_pool import KvEvent
from cachet.engine.tier_events import TierEvents, snapshot

log = structlog.get_logger(__name__)

_MAGIC = b"CKV1"
# In the shared root, beside the layouts' folders.
_FOLDER_ID_FILE = ".cachet-folder-id"
_HEADER_LENGTH = struct.Struct("<I")
# Clean up at most this often (in writes): listing a large folder is not free.
_CLEAN_UP_EVERY_WRITES = 64
# A clean-up goes down to this share of the budget, so it does not run again at once.
_CLEAN_UP_TARGET = 0.9
# How long rank 0's barrier (``after_queued_work``) waits for the other ranks' shards of the
# blocks it wrote: they write in the same step, so a shard later than this failed (a full disk),
# and the reader recomputes that block.
_PEER_SHARD_WAIT_SECONDS = 10.0


def layout_key(
    model: str,
    dtype: torch.dtype,
    block_size: int,
    block_shape: tuple[int, ...],
    shard: tuple[int, int] | None = None,
) -> str:
    """The folder name: replicas whose keys match can load each other's blocks. ``shard``:
    (rank, ranks) of a tensor-parallel replica, whose ranks each keep their own folder (two
    ranks' shards can have one shape and different heads)."""
    shape = "x".join(map(str, block_shape))
    raw = f"{model}-{str(dtype).removeprefix('torch.')}-bs{block_size}-{shape}"
    if shard is not None:
        rank, ranks = shard
        raw += f"-tp{ranks}r{rank}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", raw)


@dataclass(frozen=True)
class ShardLayout:
    """One rank's part of a layout: its folder's key and its shard of a block's shape."""

    key: str
    block_shape: tuple[int, ...]


class _ShardFolder:
    """One rank's folder of a layout: file names and the checks a file must pass."""

    def __init__(self, root: Path, layout: ShardLayout, dtype: torch.dtype) -> None:
        self.key = layout.key
        self.block_shape = tuple(layout.block_shape)
        self.dtype = dtype
        self.folder = Path(root) / layout.key
        self.folder.mkdir(parents=True, exist_ok=True)

    def path(self, block_hash: int) -> Path:
        return self.folder / f"{block_hash & (2**64 - 1):016x}.kv"

    def decode(self, data: bytearray, block_hash: int) -> torch.Tensor | None:
        """The block, a view of ``data`` (no copy: a hand-off loads tens of MB a prompt)."""
        start = len(_MAGIC) + _HEADER_LENGTH.size
        if len(data) < start or not data.startswith(_MAGIC):
            return None
        (header_length,) = _HEADER_LENGTH.unpack_from(data, len(_MAGIC))
        try:
            header = json.loads(data[start : start + header_length])
        except ValueError:
            return None
        payload_start = start + header_length
        payload = memoryview(data)[payload_start:]
        expected = {
            "key": self.key,
            "hash": block_hash,
            "shape": list(self.block_shape),
            "dtype": str(self.dtype),
            "nbytes": len(payload),
        }
        if not isinstance(header, dict) or any(header.get(k) != v for k, v in expected.items()):
            return None
        if header.get("sha256") != hashlib.sha256(payload).hexdigest():
            return None
        block = torch.frombuffer(data, dtype=torch.uint8, offset=payload_start, count=len(payload))
        return block.view(self.dtype).view(self.block_shape)


class SharedKvFiles:
    """One layout's folder of block files, and the worker thread that reads and writes it."""

    def __init__(
        self,
        root: Path,
        key: str,
        *,
        budget_bytes: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        clock: Callable[[], float] = time.time,
        peers: Sequence[ShardLayout] = (),
        follower: bool = False,
    ) -> None:
        """``peers``: the other ranks' shards of a tensor-parallel replica, on rank 0, whose tier
        speaks for whole blocks; ``follower``: a rank other than 0, which keeps its own shard's
        files only (module docstring). ``budget_bytes`` is the whole tier's, every shard counted."""
        self._own = _ShardFolder(root, ShardLayout(key, tuple(block_shape)), dtype)
        # What the cache index groups replicas by: those naming the same id see the same files.
        self.tier_id = f"{folder_id(Path(root))}/{key}"
        self._peers = [_ShardFolder(root, peer, dtype) for peer in peers]
        self.follower = follower
        self.key = key
        self.folder = self._own.folder
        self.budget_bytes = budget_bytes
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shared-kv")
        self._lock = threading.Lock()
        self._writes_since_clean_up = 0
        self.clock = clock
        # Retentions asked for blocks whose files may not be written yet (a block's write is
        # queued a step after it is named, and its request may end in between): hash -> until.
        self._retain_lock = threading.Lock()
        self._pending_retention: dict[int, float] = {}
        # Totals since start, for metrics (fixed keys: read from other threads).
        self.counts = {"written": 0, "loaded": 0, "rejected": 0, "removed": 0}
        # Bytes of block files written and read (payload and header), for metrics.
        self.bytes = {"written": 0, "loaded": 0}
        # Known files and their events: changed on the worker, taken on the engine's loop.
        self._events_lock = threading.Lock()
        self._known: set[int] = set()
        self._events = TierEvents("shared")
        # Called (on the worker) when events start pending: the engine's loop may be idle, and a
        # block written after its last step must still reach the index.
        self.on_events: Callable[[], None] | None = None

    def path(self, block_hash: int) -> Path:
        return self._own.path(block_hash)

    def contains(self, block_hash: int) -> bool:
        """Every rank's file of the block is there (only rank 0's tier asks)."""
        return self._own.path(block_hash).exists() and all(
            peer.path(block_hash).exists() for peer in self._peers
        )

    def take_events(self) -> list[KvEvent]:
        """KV events of the files this replica came to know of or removed since the last call."""
        with self._events_lock:
            return self._events.take()

    def snapshot_events(self) -> list[KvEvent]:
        """Every file this replica knows of as one stored event, for a new follower. Events still
        pending may repeat what it holds: a follower applies them with set semantics."""
        with self._events_lock:
            return snapshot("shared", self._known)

    @property
    def has_events(self) -> bool:
        with self._events_lock:
            return bool(self._events)

    def _knew(self, block_hash: int, present: bool) -> None:
        if self.follower:
            return  # rank 0 announces the replica's blocks
        with self._events_lock:
            was_pending = bool(self._events)
            if present and block_hash not in self._known:
                self._known.add(block_hash)
                self._events.stored(block_hash)
            elif not present and block_hash in self._known:
                self._known.discard(block_hash)
                self._events.removed(block_hash)
            wake = self.on_events if self._events and not was_pending else None
        if wake is not None:
            wake()

    # ------------------------------------------------------------------- writes

    def write_later(
        self, block_hash: int, block: torch.Tensor, ready: Callable[[], None] | None = None
    ) -> None:
        """Queue ``block`` (a CPU tensor this tier now owns) for writing; ``ready`` is waited on
        first, on the worker (a CUDA event whose copy fills ``block``)."""
        self._worker.submit(self._write, block_hash, block, ready)

    def _write(self, block_hash: int, block: torch.Tensor, ready: Callable[[], None] | None) -> None:
        try:
            if ready is not None:
                ready()
            final = self.path(block_hash)
            if final.exists():
                self._knew(block_hash, True)
                self._apply_retention(block_hash)
                return
            payload = block.contiguous().view(torch.uint8).numpy().tobytes()
            header = json.dumps(
                {
                    "key": self.key,
                    "hash": block_hash,
                    "shape": list(block.shape),
                    "dtype": str(block.dtype),
                    "nbytes": len(payload),
                    "sha256": hashlib.sha256(payload).hexdigest(),
                }
            ).encode()
            temporary = self.folder / f".{final.name}.{uuid.uuid4().hex}.tmp"
            with open(temporary, "wb") as file:
                file.write(_MAGIC + _HEADER_LENGTH.pack(len(header)) + header + payload)
            os.replace(temporary, final)
            self._apply_retention(block_hash)
            self._knew(block_hash, True)
            self.counts["written"] += 1
            self.bytes["written"] += len(payload) + len(header) + len(_MAGIC) + _HEADER_LENGTH.size
            self._writes_since_clean_up += 1
            if not self.follower and self._writes_since_clean_up >= _CLEAN_UP_EVERY_WRITES:
                self.clean_up()
        except OSError as exc:
            # A full or read-only disk costs the tier its blocks, never a request.
            log.warning("shared KV block not written", error=str(exc))

    # ---------------------------------------------------------------- retention

    def retain(self, block_hashes: Iterable[int], until: float) -> None:
        """Keep these blocks' files until ``until`` (wall-clock seconds) at least: set on the
        worker, on files written already now and on the others once written."""
        hashes = list(block_hashes)
        with self._retain_lock:
            for block_hash in hashes:
                self._pending_retention[block_hash] = max(until, self._pending_retention.get(block_hash, 0.0))
        self._worker.submit(self._retain_written, hashes)

    def _retain_written(self, block_hashes: list[int]) -> None:
        for block_hash in block_hashes:
            if self.path(block_hash).exists():
                self._apply_retention(block_hash)

    def _apply_retention(self, block_hash: int) -> None:
        with self._retain_lock:
            until = self._pending_retention.pop(block_hash, None)
        if until is not None:
            try:
                self._hold_until(self.path(block_hash), until)
            except OSError as exc:
                log.warning("shared KV block retention not set", error=str(exc))

    @staticmethod
    def _hold_until(path: Path, until: float) -> None:
        """Move the file's modification time forward to ``until``, never back."""
        stat = path.stat()
        if stat.st_mtime < until:
            os.utime(path, (stat.st_atime, until))

    # -------------------------------------------------------------------- reads

    def read_later(self, block_hashes: list[int]) -> Future[list[tuple[int, torch.Tensor]]]:
        """Load the leading run of ``block_hashes`` whose files are sound, on the worker."""
        return self._worker.submit(self._read_run, block_hashes)

    def _read_run(self, block_hashes: list[int]) -> list[tuple[int, torch.Tensor]]:
        loaded = []
        for block_hash in block_hashes:
            block = self.read(block_hash)
            if block is None:
                break
            loaded.append((block_hash, block))
        return loaded

    def read(self, block_hash: int) -> torch.Tensor | None:
        """The block's tensor (this rank's shard), or None when its file, or on rank 0 another
        rank's file of it, is missing or fails a check (a file that fails is removed)."""
        loaded = self._load(self._own, block_hash)
        if loaded is None:
            self._knew(block_hash, False)
            return None
        if any(self._load(peer, block_hash) is None for peer in self._peers):
            return None  # a shard not written yet, or gone: the block is recomputed
        block, file_bytes = loaded
        self._knew(block_hash, True)
        self.counts["loaded"] += 1
        self.bytes["loaded"] += file_bytes
        return block

    def _load(self, shard: _ShardFolder, block_hash: int) -> tuple[torch.Tensor, int] | None:
        """A shard's block and its file's size; None when missing or failing a check (removed)."""
        path = shard.path(block_hash)
        try:
            data = _read_whole(path)
        except OSError:
            return None
        block = shard.decode(data, block_hash)
        if block is None:
            self.counts["rejected"] += 1
            log.warning("shared KV block file rejected", path=str(path))
            path.unlink(missing_ok=True)
            return None
        with contextlib.suppress(OSError):
            self._hold_until(path, self.clock())  # least recently used goes first
        return block, len(data)

    # ----------------------------------------------------------------- clean-up

    def clean_up(self) -> None:
        """Remove least recently used files until the folder is within its budget.

        Files go by modification time, oldest first, down to a share of the budget
        (``_CLEAN_UP_TARGET``), so that the next clean-up is some writes away. Retained files
        (a time in the future, see the module docstring) sort after every other and are removed
        only while the folder is still over the budget itself once every unretained file is
        gone: then the one whose retention ends first goes first, and no more of them than it
        takes to be within the budget. A retention is a preference, not a reservation: a folder
        whose budget retained blocks alone exceed keeps the latest promises it can hold.
        """
        now = self.clock()
        with self._retain_lock:
            # A retention whose file was never written (its block was evicted before the write,
            # or the write failed) would otherwise stay pending for good.
            self._pending_retention = {h: u for h, u in self._pending_retention.items() if u > now}
        with self._lock:
            self._writes_since_clean_up = 0
            blocks = self._block_files()
            total = sum(size for _, size, _ in blocks)
            if total <= self.budget_bytes:
                return
            target = self.budget_bytes * _CLEAN_UP_TARGET
            for mtime, size, paths in sorted(blocks):
                if total <= (self.budget_bytes if mtime > now else target):
                    break
                removed = False
                for path in paths:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                        removed = True
                if not removed:
                    continue
                total -= size
                self.counts["removed"] += 1
                if (block_hash := _block_hash_of(paths[0])) is not None:
                    self._knew(block_hash, False)

    def _block_files(self) -> list[tuple[float, int, list[str]]]:
        """(time, bytes, paths) of every block in the folders: a block's files are its ranks'
        shards of one name, and its time is rank 0's file's (which reads refresh and retention
        sets), or for shards whose rank-0 file is not written yet (or gone) their newest."""
        own: dict[str, float] = {}
        others: dict[str, float] = {}
        sizes: dict[str, int] = {}
        paths: dict[str, list[str]] = {}
        for index, shard in enumerate([self._own, *self._peers]):
            for entry in os.scandir(shard.folder):
                try:
                    stat = entry.stat()
                except OSError:
                    continue
                if index == 0:
                    own[entry.name] = stat.st_mtime
                else:
                    others[entry.name] = max(stat.st_mtime, others.get(entry.name, 0.0))
                sizes[entry.name] = sizes.get(entry.name, 0) + stat.st_size
                paths.setdefault(entry.name, []).append(entry.path)
        return [(own.get(name, others.get(name, 0.0)), sizes[name], paths[name]) for name in paths]

    def after_queued_work(self, block_hashes: Sequence[int] = ()) -> Future[None]:
        """Done once every read and write queued so far is (the worker runs them in order), and
        on rank 0 of a tensor-parallel replica once the other ranks' shards of ``block_hashes``
        (a hand-off's blocks) are there too (or ``_PEER_SHARD_WAIT_SECONDS`` passed: those are
        recomputed)."""
        return self._worker.submit(self._wait_for_peer_shards, list(block_hashes) if self._peers else [])

    def _wait_for_peer_shards(self, block_hashes: list[int]) -> None:
        deadline = time.monotonic() + _PEER_SHARD_WAIT_SECONDS
        for block_hash in block_hashes:
            for peer in self._peers:
                while not peer.path(block_hash).exists():
                    if time.monotonic() > deadline:
                        log.warning("a rank's shard of a shared KV block was not written in time")
                        return
                    time.sleep(0.002)

    def drain(self) -> None:
        """Wait for every queued read and write (tests, shutdown)."""
        self.after_queued_work().result()

    def close(self) -> None:
        self._worker.shutdown(wait=True)


def folder_id(root: Path) -> str:
    """The shared root's own id, made by the first replica that opens it (a file linked into
    place, so two replicas racing agree): replicas reading the same id see the same files, on
    one host or on a shared filesystem, whatever path each mounts it at."""
    path = root / _FOLDER_ID_FILE
    root.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        temporary = root / f".{_FOLDER_ID_FILE}.{uuid.uuid4().hex}.tmp"
        temporary.write_text(uuid.uuid4().hex)
        try:
            os.link(temporary, path)
        except FileExistsError:
            pass  # another replica made it first: its id is the folder's
        finally:
            temporary.unlink(missing_ok=True)
    return path.read_text().strip()


def _read_whole(path: Path) -> bytearray:
    """The file's bytes, read once into a buffer a tensor can view."""
    with open(path, "rb") as file:
        data = bytearray(os.fstat(file.fileno()).st_size)
        read = file.readinto(data)
    return data[:read] if read < len(data) else data


def _block_hash_of(path: str) -> int | None:
    """The hash a block file is named by; None for a temporary file (``.<name>.<id>.tmp``)."""
    name = os.path.basename(path)
    if name.startswith(".") or not name.endswith(".kv"):
        return None
    try:
        return int(name.removesuffix(".kv"), 16)
    except ValueError:
        return None
