"""How many engine replicas one machine runs, and how many math threads each rank gets.

Replicas, ranks and threads share the same cores, so they are sized together: on a CPU
``replicas x ranks x threads <= cores``. Two replicas that each ran every core's worth of
math threads on a 2-core machine served 16 streams at 0.06x of one replica (issue 24):
oversubscribed intra-op threads spin against each other. On a GPU host a replica is one
tensor-parallel group of devices, and the host's threads only feed them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# A CPU replica per this many cores by default. One replica batches every stream into one
# step, which streams the weights once for all of them; two replicas on the same cores stream
# them twice. Large hosts still get several, since a small model's products split over
# dozens of threads leave most of them idle; 32 is a judgement, not measured (the dev box
# has 2 cores).
CPU_CORES_PER_REPLICA = 32

# Share of a host's available memory that a CPU engine's KV pool takes by default (on a GPU,
# 0.9 of the device's: it holds nothing else). The host runs every other service too.
CPU_KV_CACHE_MEMORY_FRACTION = 0.4
GPU_KV_CACHE_MEMORY_FRACTION = 0.9

# Tokens one engine step may compute (prefill chunks and decodes) unless set. On a CPU a step
# is bound by its math: 512 keeps a prefill chunk from stalling the decodes beside it. On a
# GPU an eager step is bound by launching its kernels, so bigger chunks are nearly free:
# measured on an H100 (bf16, the default model's shape), 2,048 against 512 cut a 2,000-token
# prompt's cold TTFT from 215 to 48 ms, an 8,000-token one's from 720 to 331 ms, and doubled
# 16 streams' decode while that prompt prefilled (698 -> 1,362 tok/s); 8,192 was worse on
# both counts (458 ms, 1,043 tok/s): a chunk's attention grows with its length.
CPU_MAX_NUM_BATCHED_TOKENS = 512
GPU_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class EngineLayout:
    replicas: int
    ranks_per_replica: int
    threads_per_rank: int
    # Set when an explicit replica count cannot be given a core per rank.
    warning: str | None = None
    on_gpu: bool = False

    @property
    def kv_cache_memory_fraction(self) -> float:
        """Each replica's share of free memory for its KV pool: CPU replicas share one host's."""
        if self.on_gpu:
            return GPU_KV_CACHE_MEMORY_FRACTION
        return CPU_KV_CACHE_MEMORY_FRACTION / self.replicas

    def replica_devices(self, replica: int) -> dict[str, str]:
        """The environment that gives replica ``replica`` GPUs of its own (its ranks see them as
        ``cuda:0..``); none on a CPU host. Without it every replica would share the first GPU."""
        if not self.on_gpu:
            return {}
        first = replica * self.ranks_per_replica
        devices = range(first, first + self.ranks_per_replica)
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in devices)}


def available_cores() -> int:
    """Cores this process may run on (a container's or taskset's limit, not the host's count)."""
    return len(os.sched_getaffinity(0))


def plan_engine_layout(
    *, cores: int, gpus: int, ranks_per_replica: int, replicas: int | None
) -> EngineLayout:
    """Size replicas and threads together.

    ``gpus``: devices the engines will use (0 on a CPU host). ``replicas``: the operator's
    count (``CACHET_REPLICAS``), honoured as given; None picks one for the machine."""
    if replicas is None:
        replicas = _default_replicas(cores, gpus, ranks_per_replica)
    ranks = replicas * ranks_per_replica
    warning = None
    if gpus == 0 and ranks > cores:
        warning = (
            f"{replicas} replicas x {ranks_per_replica} ranks need {ranks} cores and this machine "
            f"has {cores}: ranks share cores and every replica runs slower than fewer would"
        )
    elif gpus and ranks > gpus:
        warning = (
            f"{replicas} replicas x {ranks_per_replica} ranks need {ranks} GPUs and this machine has {gpus}"
        )
    return EngineLayout(replicas, ranks_per_replica, max(1, cores // ranks), warning, on_gpu=gpus > 0)


def _default_replicas(cores: int, gpus: int, ranks_per_replica: int) -> int:
    if gpus:
        return max(1, gpus // ranks_per_replica)
    return max(1, cores // (ranks_per_replica * CPU_CORES_PER_REPLICA))
