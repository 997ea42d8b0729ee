"""The host KV tier, the runner's half: host copies of whole KV blocks, and the copy orders
of ``host_kv_tier.HostTierIndex`` carried out before a step's forward pass.

A step's orders of one direction are copied together, not one block at a time: sorted by the
rows they write, a run of consecutive rows is one indexed copy from the rows it reads. The
tier hands out slots in order and takes them back least recently used first, so a step's
demotions mostly fill one run of slots.

On CUDA the host blocks are pinned and every copy is queued on the compute stream without
waiting (``non_blocking``): the copies are ordered before the forward that overwrites or
reads the blocks, and the host never waits on them. Host memory is then only touched by
those queued copies, a run of slots each; the pool's blocks are gathered or scattered by
index on the device. On a CPU the tier is a second, larger pool of the same memory, and
each run is gathered straight into place (``index_select`` into it: one pass over the bytes).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from cachet.engine.step_plan import KvBlockMoves


class HostKvBlocks:
    """Host copies of whole KV blocks: ``[slots, *one block of every layer]``.

    ``block_dim`` is the pool's block axis (``[layers, 2, blocks, ...]`` for K/V per head,
    ``[layers, blocks, ...]`` for MLA's latent)."""

    def __init__(self, kv_cache: torch.Tensor, block_dim: int, num_slots: int) -> None:
        self.kv_cache = kv_cache
        # The pool as [blocks, *one block]: a view, whose rows are whole blocks as the slots are.
        self.pool_blocks = kv_cache.movedim(block_dim, 0)
        self.on_cuda = kv_cache.device.type == "cuda"
        block_shape = self.pool_blocks.shape[1:]
        self.blocks = torch.zeros(num_slots, *block_shape, dtype=kv_cache.dtype, pin_memory=self.on_cuda)

    def copy_out(self, moves: KvBlockMoves) -> None:
        """The demotions: they read pool blocks this step may overwrite, so they go first."""
        if not moves.demote:
            return
        slots, block_ids = _one_order_per_row((slot, block_id) for block_id, slot in moves.demote)
        if not self.on_cuda:
            _copy_rows(self.pool_blocks, block_ids, self.blocks, slots)
            return
        gathered = self.pool_blocks.index_select(0, self._on_device(block_ids))
        for start, stop in _runs(slots):
            rows = self.blocks[slots[start] : slots[start] + stop - start]
            rows.copy_(gathered[start:stop], non_blocking=True)

    def copy_in(self, moves: KvBlockMoves) -> None:
        """Blocks loaded from the shared tier, then promotions (``KvBlockMoves``' order: after
        ``copy_out`` and the pool's own duplicates)."""
        if moves.fill and self.on_cuda:
            # A fill is the host's own write into a pinned slot, outside stream order: a
            # demotion into that slot still queued from an earlier step would land after it.
            torch.cuda.current_stream(self.kv_cache.device).synchronize()
        for slot, loaded in moves.fill:
            if loaded.data is None:
                raise ValueError(f"a fill order's block {loaded.block_hash} was not read on this rank")
            self.blocks[slot].copy_(loaded.data)
        if not moves.promote:
            return
        block_ids, slots = _one_order_per_row((block_id, slot) for slot, block_id in moves.promote)
        if not self.on_cuda:
            _copy_rows(self.blocks, slots, self.pool_blocks, block_ids)
            return
        # Host slots are read only by copies queued behind the demotions that may have written
        # them: runs of slots in order, each its own transfer into a staging tensor.
        by_slot = sorted(range(len(slots)), key=slots.__getitem__)
        slot_order = [slots[i] for i in by_slot]
        staged = torch.empty(
            (len(slots), *self.blocks.shape[1:]), dtype=self.blocks.dtype, device=self.kv_cache.device
        )
        for start, stop in _runs(slot_order):
            first = slot_order[start]
            staged[start:stop].copy_(self.blocks[first : first + stop - start], non_blocking=True)
        self.pool_blocks.index_copy_(0, self._on_device([block_ids[i] for i in by_slot]), staged)

    def _on_device(self, indices: list[int]) -> torch.Tensor:
        # From pinned memory without waiting: a pageable source would make the host wait for
        # the stream (the previous step's forward) before copying.
        pinned = torch.tensor(indices, dtype=torch.long, pin_memory=True)
        return pinned.to(self.kv_cache.device, non_blocking=True)


def _copy_rows(source: torch.Tensor, read: list[int], target: torch.Tensor, written: list[int]) -> None:
    """``target[written[i]] = source[read[i]]`` (``written`` sorted, each row once): each run of
    consecutive rows written is one gather into it, one pass over the bytes; a lone row is one
    ``copy_``, as an index would cost more than it saves."""
    for start, stop in _runs(written):
        first = written[start]
        if stop - start == 1:
            target[first].copy_(source[read[start]])
        else:
            rows = torch.tensor(read[start:stop])
            torch.index_select(source, 0, rows, out=target[first : first + stop - start])


def _one_order_per_row(orders: Iterable[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """(rows written, sorted; the row each reads) of (row written, row read) orders given in
    turn. A row written twice keeps its last order: the earlier copy would be overwritten unread."""
    last = dict(orders)
    written = sorted(last)
    return written, [last[row] for row in written]


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """[start, stop) index ranges of ``rows`` (sorted) over which they rise one by one::

    rows  3 4 5 9 10 12   ->   (0, 3) (3, 5) (5, 6)
    """
    runs = []
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            runs.append((start, i))
            start = i
    return runs
