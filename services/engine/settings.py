"""The engine's settings: ``CACHET_ENGINE_*``, and the shared ``CACHET_MODEL``, ``CACHET_DTYPE``,
``CACHET_TP``, the KV tiers' ``CACHET_KV_*``...

Imports no torch: a single-rank engine's gRPC server reads these and never loads torch
(its step loop runs in a process of its own).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from cachet.config import ServiceSettings, shared_alias

# Which products run on a checkpoint's Q4_1 blocks (EngineSettings.block_q4_weights).
BlockQ4Use = Literal["small_batches", "all_steps", "off"]


class EngineSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="CACHET_ENGINE_")

    port: int = Field(default=50061, ge=0, le=65535)
    model: str = Field(default="", validation_alias=shared_alias("CACHET_MODEL"))
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto", validation_alias=shared_alias("CACHET_DTYPE")
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", validation_alias=shared_alias("CACHET_DEVICE")
    )
    # The KV pool's size; unset: kv_cache_memory_fraction of the memory free once the weights
    # are loaded (capped at max_num_seqs full context windows).
    kv_cache_gb: float | None = Field(default=None, gt=0, validation_alias=shared_alias("CACHET_KV_CACHE_GB"))
    # Unset: cachet.engine_layout's default for the device, divided between the ranks that
    # share the memory (a CPU host's ranks).
    kv_cache_memory_fraction: float | None = Field(default=None, gt=0, le=1)
    # The host KV tier of one replica (cachet.engine.host_kv_tier): blocks evicted from the pool
    # wait there and a prefix hit copies them back. 0: none. Divided between a replica's ranks.
    kv_host_gb: float = Field(default=0, ge=0, validation_alias=shared_alias("CACHET_KV_HOST_GB"))
    # The shared file KV tier (cachet.engine.shared_kv_tier): one file per block under this
    # folder, which replicas on any host that see it share; needs the host tier. Unset: none.
    kv_shared_dir: Path | None = Field(default=None, validation_alias=shared_alias("CACHET_KV_SHARED_DIR"))
    # Its size budget, for this model and layout's folder (least recently used files go first).
    kv_shared_gb: float = Field(default=20, gt=0, validation_alias=shared_alias("CACHET_KV_SHARED_GB"))
    # Disaggregated prefill (docs/ARCHITECTURE.md): "prefill" replicas compute the prompts the
    # router sends them and hand their KV to "decode" replicas, pushed straight into their
    # memory (kv_transfer) or through the shared KV tier; "mixed" serves whole requests.
    role: Literal["mixed", "prefill", "decode"] = "mixed"
    # Take KV that prefill replicas push here on this port (of CACHET_ENGINE_HOST), announced in
    # EngineInfo.kv_transfer_address; 0: none. Rank 0 listens; a tensor-parallel replica's
    # other ranks take their shards through it (kv_transfer); needs the host tier.
    kv_transfer_port: int = Field(default=0, ge=0, le=65535)
    block_size: int = Field(default=16, ge=1)
    max_num_seqs: int = Field(default=64, ge=1)
    # Unset: cachet.engine_layout's default for the device (512 on a CPU, 2,048 on a GPU).
    max_num_batched_tokens: int | None = Field(default=None, ge=16)
    # Most tokens of async-queue work in one step beside interactive work (unset: what
    # batch_step_allowance allows).
    max_batch_tokens_per_step: int | None = Field(default=None, ge=1)
    # Beside interactive work, async-queue work may lengthen a step by at most this many times
    # the step's fixed cost, by the step costs measured (cachet.engine.step_cost): lower keeps
    # interactive first tokens closer to their time without a backlog, higher drains it faster.
    # Unset: the scheduler's default (SchedulerConfig, where its measurements are).
    batch_step_allowance: float | None = Field(default=None, gt=0)
    max_waiting: int = Field(default=256, ge=1)
    # Batch (async queue) work starts only while fewer than this share of max_num_seqs run;
    # the seats above stay open to interactive arrivals. Reported to routers, whose
    # dispatchers keep a few jobs waiting here beyond it (CACHET_ROUTER_BATCH_PREFETCH).
    # 0.875, not 0.75: with the default model the backlog drained 0.90-0.95 of the free
    # capacity (three runs, mean 0.93) against 0.86-0.93 (mean 0.89), first tokens unchanged
    # (docs/async_queue_measurements.md).
    batch_max_running_fraction: float = Field(default=0.875, gt=0, le=1)
    max_model_len: int | None = Field(default=None, ge=16)
    # Ranks of one replica (its TP group). CACHET_EP, for mixture-of-experts models only: 1 cuts
    # every routed expert by channels over those ranks, CACHET_TP puts whole experts on each; any
    # other value, or EP > 1 on a dense model, is refused when the engine starts.
    tensor_parallel_size: int = Field(default=1, ge=1, validation_alias=shared_alias("CACHET_TP"))
    expert_parallel_size: int = Field(default=1, ge=1, validation_alias=shared_alias("CACHET_EP"))
    # How long a tensor-parallel start on a CPU waits on a DeepSpeed op's build lock before it
    # fails naming the file to delete (cachet.engine.deepspeed_ops): a build takes 1-3 minutes on
    # 2 cores, so a lock older than the default was left by a build that died.
    build_lock_timeout_seconds: float = Field(default=300.0, gt=0)
    # Math threads per rank (unset: this host's cores over the replica's ranks on it).
    threads: int | None = Field(default=None, ge=1)
    load_report_interval_ms: int = Field(default=200, ge=10)
    # Least time between two messages of a token stream after its first (0: every step).
    stream_interval_ms: float = Field(default=0.0, ge=0)
    # A single-rank replica runs its step loop in a process of its own, beside the gRPC
    # server's, so the two do not take turns on one interpreter lock; off: a thread of the
    # server's process (as the ranks of a tensor-parallel replica always do).
    core_process: bool = True
    # Reorder linear weights once for oneDNN on a CPU (bit-identical in bf16, 1.3-1.6x faster
    # products at the batch sizes serving runs; see cachet.engine.packed_linear).
    pack_linear_weights: bool = True
    # A bf16 replica on an AVX512-BF16 CPU, or an fp32 one on an AVX2 CPU, multiplies by the
    # checkpoint's own Q4_1 blocks where its weights are exactly such blocks (the default
    # model's are): the few rows of decoding stream a fraction of the bytes
    # (cachet.engine.block_q4_weights). fp32 products on them are the fp32 panels' bits.
    # small_batches: products of a few rows outside batch-invariant steps; all_steps: those, and
    # every product of batch-invariant steps too (greedy decoding of few streams faster, greedy
    # prompts slower: a decode replica's choice, with its prefill replicas'); off.
    block_q4_weights: BlockQ4Use = "small_batches"
    # On a CUDA device, replay decode steps as CUDA graphs (cachet.engine.cuda_graphs), and the
    # work between attention calls of steps holding prompt tokens (cachet.engine.piecewise_graphs);
    # no effect on a CPU, for models that opt out, or in a tensor-parallel replica.
    cuda_graphs: bool = True
    # On a CPU, decodes read the paged KV cache in place through a C++ kernel
    # (cachet.engine.paged_decode_kernel) rather than gathering it for SDPA; false: the
    # gather + SDPA reference path.
    paged_decode_kernel: bool = True
    # Greedy and seeded requests give the same tokens whether their prefix came from the cache
    # or was computed, whatever else shares their steps: a step holding one sums every product
    # and attention in one fixed order (cachet.engine.attention, cachet.engine.packed_linear),
    # and their KV blocks are named apart from other requests'. false: every step runs the
    # faster kernels that pick their order by the step's shape (the cost: docs/benchmarks.md).
    batch_invariant: bool = True
    # Sampling values a request leaves unset come from the model's generation_config.json
    # (temperature, top_p, top_k, min_p, repetition_penalty), as vLLM does; false: the API's
    # own defaults (temperature 1, no top-p/top-k).
    generation_defaults: bool = True
    # Prometheus /metrics over HTTP on this port (docs/ARCHITECTURE.md, "Ports"); 0: none.
    metrics_port: int = Field(default=9061, ge=0, le=65535)

    @model_validator(mode="after")
    def _role_has_its_transport(self) -> EngineSettings:
        if self.kv_transfer_port and not self.kv_host_gb:
            raise ValueError(
                "CACHET_ENGINE_KV_TRANSFER_PORT takes pushed KV into the host KV tier: set CACHET_KV_HOST_GB"
            )
        # A prefill replica can push KV to any decode replica's receiver with no tier of its own;
        # a decode replica takes it into its host tier, from its receiver or the shared folder.
        if self.role != "decode":
            return self
        if (self.kv_shared_dir is None and not self.kv_transfer_port) or not self.kv_host_gb:
            raise ValueError(
                "CACHET_ENGINE_ROLE=decode takes KV into its host KV tier (CACHET_KV_HOST_GB), pushed "
                "to it (CACHET_ENGINE_KV_TRANSFER_PORT) or through the shared KV tier "
                "(CACHET_KV_SHARED_DIR, a folder the prefill replicas see too)"
            )
        return self

    @property
    def max_batch_running(self) -> int:
        """Seats batch work may fill (``batch_max_running_fraction`` of ``max_num_seqs``)."""
        return max(1, math.floor(self.max_num_seqs * self.batch_max_running_fraction))
