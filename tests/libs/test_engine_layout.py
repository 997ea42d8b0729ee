"""Replicas, ranks and math threads are sized together, so threads never exceed the cores."""

from __future__ import annotations

import pytest

from cachet.engine_layout import (
    CPU_CORES_PER_REPLICA,
    CPU_KV_CACHE_MEMORY_FRACTION,
    EngineLayout,
    plan_engine_layout,
)


@pytest.mark.parametrize(
    ("cores", "ranks", "expected"),
    [
        (2, 1, EngineLayout(1, 1, 2)),
        (2, 2, EngineLayout(1, 2, 1)),
        (16, 1, EngineLayout(1, 1, 16)),
        (2 * CPU_CORES_PER_REPLICA, 1, EngineLayout(2, 1, CPU_CORES_PER_REPLICA)),
        (2 * CPU_CORES_PER_REPLICA, 2, EngineLayout(1, 2, CPU_CORES_PER_REPLICA)),
    ],
)
def test_a_cpu_default_never_runs_more_threads_than_cores(
    cores: int, ranks: int, expected: EngineLayout
) -> None:
    layout = plan_engine_layout(cores=cores, gpus=0, ranks_per_replica=ranks, replicas=None)
    assert layout == expected
    assert layout.replicas * layout.ranks_per_replica * layout.threads_per_rank <= cores


def test_an_explicit_replica_count_divides_the_cores_and_the_kv_memory() -> None:
    layout = plan_engine_layout(cores=8, gpus=0, ranks_per_replica=1, replicas=2)
    assert layout == EngineLayout(2, 1, 4)
    assert layout.kv_cache_memory_fraction == CPU_KV_CACHE_MEMORY_FRACTION / 2


def test_more_ranks_than_cores_get_one_thread_each_and_a_warning() -> None:
    layout = plan_engine_layout(cores=2, gpus=0, ranks_per_replica=2, replicas=2)
    assert (layout.replicas, layout.threads_per_rank) == (2, 1)
    assert layout.warning is not None and "need 4 cores" in layout.warning and "has 2" in layout.warning


def test_a_gpu_host_runs_a_replica_per_tensor_parallel_group() -> None:
    assert plan_engine_layout(cores=16, gpus=8, ranks_per_replica=2, replicas=None) == EngineLayout(
        4, 2, 2, on_gpu=True
    )
    layout = plan_engine_layout(cores=16, gpus=8, ranks_per_replica=2, replicas=None)
    # Each replica's ranks get GPUs of their own; a CPU replica gets none.
    assert [layout.replica_devices(i) for i in (0, 3)] == [
        {"CUDA_VISIBLE_DEVICES": "0,1"},
        {"CUDA_VISIBLE_DEVICES": "6,7"},
    ]
    assert plan_engine_layout(cores=2, gpus=0, ranks_per_replica=1, replicas=None).replica_devices(0) == {}
    crowded = plan_engine_layout(cores=16, gpus=2, ranks_per_replica=2, replicas=2)
    assert crowded.warning is not None and "GPUs" in crowded.warning
