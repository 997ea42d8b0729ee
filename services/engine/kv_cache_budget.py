"""How many bytes the KV pool takes: a fixed size, or a share of the memory left once the weights are in.

A fixed 0.5 GB held SmolLM2-135M's full 8k window for under three requests in fp32; sizing from
free memory, as vLLM does with its memory utilisation share, lets the hardware decide. The share
is capped at every seat holding a full context window: more only keeps more finished prefixes,
and on a CPU every byte is zeroed (``allocate_kv_cache``) and taken from the host at start.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch


@dataclass(frozen=True)
class KvCacheBudget:
    # A share of the memory free after loading (the device's on a GPU, the host's available
    # memory on a CPU), divided between the ranks that share that memory.
    memory_fraction: float
    # Seats a replica runs (``max_num_seqs``): the pool never exceeds this many full windows.
    max_sequences: int
    ranks_sharing_memory: int = 1

    def bytes_for(self, device: torch.device, bytes_per_token: int, context_window: int) -> int:
        share = int(free_memory_bytes(device) * self.memory_fraction / self.ranks_sharing_memory)
        return min(share, self.max_sequences * context_window * bytes_per_token)


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return psutil.virtual_memory().available
