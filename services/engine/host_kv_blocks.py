"""The host KV tier, the runner's half: host copies of whole KV blocks, and the copy orders
of ``host_kv_tier.HostTierIndex`` carried out before a step's forward pass.

On CUDA the host blocks are pinned and every copy is queued on the compute stream without
waiting (``non_blocking``): the copies are ordered before the forward that overwrites or
reads the blocks, and the host never waits on them. On a CPU the tier is a second, larger
pool of the same memory, one ``memcpy`` per block.
"""

from __future__ import annotations

import torch

from cachet.engine.step_plan import KvBlockMoves


class HostKvBlocks:
    """Host copies of whole KV blocks: ``[slots, *one block of every layer]``.

    ``block_dim`` is the pool's block axis (``[layers, 2, blocks, ...]`` for K/V per head,
    ``[layers, blocks, ...]`` for MLA's latent)."""

    def __init__(self, kv_cache: torch.Tensor, block_dim: int, num_slots: int) -> None:
        self.kv_cache = kv_cache
        self.block_dim = block_dim
        block_shape = kv_cache.select(block_dim, 0).shape
        on_cuda = kv_cache.device.type == "cuda"
        self.blocks = torch.zeros(num_slots, *block_shape, dtype=kv_cache.dtype, pin_memory=on_cuda)
        self.non_blocking = on_cuda

    def pool_block(self, block_id: int) -> torch.Tensor:
        return self.kv_cache.select(self.block_dim, block_id)

    def copy_out(self, moves: KvBlockMoves) -> None:
        """The demotions: they read pool blocks this step may overwrite, so they go first."""
        for block_id, slot in moves.demote:
            self.blocks[slot].copy_(self.pool_block(block_id), non_blocking=self.non_blocking)

    def copy_in(self, moves: KvBlockMoves) -> None:
        """Blocks loaded from the shared tier, then promotions (``KvBlockMoves``' order: after
        ``copy_out`` and the pool's own duplicates)."""
        for slot, block in moves.fill:
            self.blocks[slot].copy_(block)
        for slot, block_id in moves.promote:
            self.pool_block(block_id).copy_(self.blocks[slot], non_blocking=self.non_blocking)
