"""Everything that runs model code on a rank: device, dtype, the model runner, EngineCore and
its loop, and the ranks of a tensor-parallel replica.

Imported by whatever process runs the model: the loop process of a single-rank replica,
rank 0's server when its loop runs on a thread (tensor-parallel, or
``CACHET_ENGINE_CORE_PROCESS=false``), and follower ranks. Not by the server of a
single-rank replica: it relays requests and never imports torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch
from tokenizers import Tokenizer

from cachet.engine import distributed
from cachet.engine.core_loop import CoreLoop
from cachet.engine.engine_core import EngineCore
from cachet.engine.expert_parallel import check_expert_parallel_size, check_model_has_experts
from cachet.engine.kv_cache_budget import KvCacheBudget
from cachet.engine.loop_messages import EngineDescription
from cachet.engine.model_runner import ModelRunner, default_dtype
from cachet.engine.models import ModelConfig
from cachet.engine.rank_environment import externally_launched
from cachet.engine.sampling_params import model_sampling_defaults
from cachet.engine.scheduler import SchedulerConfig
from cachet.engine.settings import EngineSettings
from cachet.engine.structured_output import GrammarCompiler
from cachet.engine_layout import (
    CPU_KV_CACHE_MEMORY_FRACTION,
    CPU_MAX_NUM_BATCHED_TOKENS,
    GPU_KV_CACHE_MEMORY_FRACTION,
    GPU_MAX_NUM_BATCHED_TOKENS,
)
from cachet.logs import configure_logging, get_logger
from cachet.models.catalog import ResolvedModel, ensure_model
from cachet.startup_heap import freeze_startup_heap
from cachet.tokenizer.tiktoken_files import has_tiktoken_files, tiktoken_tokenizer

log = get_logger(__name__)
_GIB = 1024**3


def choose_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def choose_dtype(setting: str, device: torch.device) -> torch.dtype:
    return default_dtype(device) if setting == "auto" else getattr(torch, setting)


@dataclass
class RankGroup:
    """Rank 0's view of a tensor-parallel replica: the group, and the followers it spawned."""

    tp: distributed.TensorParallel
    # Empty when a launcher (deepspeed, torchrun) started the ranks.
    followers: list[BaseProcess] = field(default_factory=list)
    runner: distributed.ShardedRunner | None = None

    def wrap(self, runner: ModelRunner) -> distributed.ShardedRunner:
        self.runner = distributed.ShardedRunner(runner, self.tp)
        return self.runner

    def close(self) -> None:
        """Planned shutdown: followers are told to stop, then waited for."""
        if self.runner is not None:
            self.runner.close()
        distributed.stop_followers(self.followers)

    def watch_followers(self, report: Callable[[str], object]) -> Callable[[], None]:
        """``report`` (from a watcher thread) says why, when a follower dies; returns the disarm."""
        return distributed.watch_followers(self.followers, report)


def check_parallel_layout(settings: EngineSettings) -> None:
    """Refuse CACHET_TP / CACHET_EP a replica cannot have before any rank starts (ValueError)."""
    ep = settings.expert_parallel_size
    check_expert_parallel_size(ep, settings.tensor_parallel_size)
    if ep > 1:
        # Resolved only here: whether the model has experts is the remaining question.
        model = ensure_model(settings.model or None, settings.data_dir)
        config = ModelConfig.from_model_dir(Path(model.path))
        check_model_has_experts(ep, model.model_id, is_moe=config.moe is not None)


def start_rank_group(settings: EngineSettings) -> RankGroup | None:
    """None for a single-rank replica; otherwise spawn (or join) the ranks and the process group."""
    size = settings.tensor_parallel_size
    if size == 1 and not externally_launched():
        return None
    followers: list[BaseProcess] = []
    if not externally_launched():
        distributed.prepare_local_group(size)
        followers = distributed.spawn_followers(size, run_follower, settings)
    info = distributed.init_distributed(choose_device(settings.device), settings.build_lock_timeout_seconds)
    if info.world_size != size:
        raise ValueError(f"tensor_parallel_size={size}, but the launcher started {info.world_size} ranks")
    log.info("rank group up", world_size=info.world_size, spawned=len(followers))
    return RankGroup(distributed.TensorParallel.create(info, settings.expert_parallel_size), followers)


def build_runner(
    settings: EngineSettings, tp: distributed.TensorParallel | None = None
) -> tuple[ModelRunner, ResolvedModel, torch.dtype, torch.device]:
    """The model (this rank's shard of it) and its KV cache; also which model, dtype and device."""
    model = ensure_model(settings.model or None, settings.data_dir)
    device = choose_device(settings.device)
    dtype = choose_dtype(settings.dtype, device)
    log.info(
        "loading model", model=model.model_id, path=str(model.path), device=str(device), dtype=str(dtype)
    )
    runner = ModelRunner(
        Path(model.path),
        dtype=dtype,
        device=device,
        kv_cache_bytes=kv_cache_size(settings, device),
        block_size=settings.block_size,
        max_model_len=settings.max_model_len,
        tp=tp,
        pack_weights=settings.pack_linear_weights,
        block_weights=settings.block_q4_weights,
        cuda_graphs=settings.cuda_graphs and device.type == "cuda",
        paged_decode_kernel=settings.paged_decode_kernel,
        batch_invariant=settings.batch_invariant,
        max_decode_batch=settings.max_num_seqs,
        max_step_tokens=max_step_tokens(settings, device),
        host_kv_bytes=int(settings.kv_host_gb * _GIB / settings.tensor_parallel_size),
        shared_kv_dir=settings.kv_shared_dir,
        shared_kv_bytes=int(settings.kv_shared_gb * _GIB),
        kv_transfer_port=settings.kv_transfer_port,
        kv_transfer_host=settings.host,
    )
    return runner, model, dtype, device


def max_step_tokens(settings: EngineSettings, device: torch.device) -> int:
    """The most tokens one step computes: the scheduler's budget, and what the runner pads to."""
    default = GPU_MAX_NUM_BATCHED_TOKENS if device.type == "cuda" else CPU_MAX_NUM_BATCHED_TOKENS
    return settings.max_num_batched_tokens or default


def kv_cache_size(settings: EngineSettings, device: torch.device) -> int | KvCacheBudget:
    """``CACHET_KV_CACHE_GB`` as given, else a share of free memory (``kv_cache_budget``): a
    GPU's own, or a CPU host's, which its ranks here divide (run-local divides it between
    replicas)."""
    if settings.kv_cache_gb is not None:
        return int(settings.kv_cache_gb * _GIB)
    on_gpu = device.type == "cuda"
    default = GPU_KV_CACHE_MEMORY_FRACTION if on_gpu else CPU_KV_CACHE_MEMORY_FRACTION
    fraction = settings.kv_cache_memory_fraction or default
    ranks_here = 1 if on_gpu else int(os.environ.get("LOCAL_SIZE", settings.tensor_parallel_size))
    return KvCacheBudget(fraction, ranks_sharing_memory=ranks_here, max_sequences=settings.max_num_seqs)


def run_follower(rank: int, settings: EngineSettings) -> None:
    """Rank ``rank`` (> 0) of a replica: load its shard, then run what rank 0 sends until told to stop."""
    configure_logging("engine", settings.log_level)
    torch.set_num_threads(threads_per_rank(settings))
    tp = distributed.TensorParallel.create(
        distributed.init_distributed(choose_device(settings.device), settings.build_lock_timeout_seconds),
        settings.expert_parallel_size,
    )
    runner, *_ = build_runner(settings, tp)
    log.info("follower ready", rank=rank, kv_blocks=runner.num_kv_blocks)
    freeze_startup_heap()
    distributed.follow(runner, tp)
    log.info("follower stopped", rank=rank)


def build_core_loop(
    settings: EngineSettings, group: RankGroup | None = None
) -> tuple[CoreLoop, EngineDescription]:
    """Model, KV pool, scheduler: the engine loop (not running), and what the server needs of it."""
    local_runner, model, dtype, device = build_runner(settings, group.tp if group else None)
    runner: ModelRunner | distributed.ShardedRunner = local_runner
    expert_parallel_size = runner.expert_parallel_size
    if group is not None:
        # Same attributes as the local runner; each step also goes out to the followers.
        runner = group.wrap(local_runner)
    log.info(
        "model loaded",
        kv_blocks=runner.num_kv_blocks,
        host_kv_blocks=runner.num_host_kv_blocks,
        max_model_len=runner.max_model_len,
        packed_linears=runner.packed_linears,
        block_q4_linears=runner.block_q4_linears,
        block_q8_linears=runner.block_q8_linears,
    )
    tokenizer = model_tokenizer(Path(model.path))
    core = EngineCore(
        runner=runner,
        model=model.model_id,
        scheduler_config=SchedulerConfig(
            max_model_len=runner.max_model_len,
            max_num_batched_tokens=max_step_tokens(settings, device),
            max_batch_tokens_per_step=settings.max_batch_tokens_per_step,
            batch_step_allowance=settings.batch_step_allowance or SchedulerConfig.batch_step_allowance,
            max_num_seqs=settings.max_num_seqs,
            max_batch_running=settings.max_batch_running,
            max_waiting=settings.max_waiting,
            eos_token_ids=tuple(runner.eos_token_ids),
        ),
        tokenizer=tokenizer,
        grammar_compiler=(
            GrammarCompiler(tokenizer, runner.vocab_size, runner.eos_token_ids) if tokenizer else None
        ),
    )
    loop = CoreLoop(core)
    sampling_defaults = model_sampling_defaults(Path(model.path)) if settings.generation_defaults else {}
    if sampling_defaults:
        log.info("model sampling defaults", **sampling_defaults)
    description = loop.describe(
        expert_parallel_size=expert_parallel_size,
        dtype=str(dtype).removeprefix("torch."),
        device=device.type,
        sampling_defaults=sampling_defaults,
    )
    return loop, description


def model_tokenizer(model_dir: Path) -> Tokenizer | None:
    """The checkpoint's tokenizer, for stop strings and grammars: its tokenizer.json, else Kimi's
    tiktoken files rebuilt as the tokenizer service rebuilds them (the same ids); None without
    either (requests that need one are refused)."""
    if (model_dir / "tokenizer.json").exists():
        return Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    if has_tiktoken_files(model_dir):
        return tiktoken_tokenizer(model_dir)
    return None


def threads_per_rank(settings: EngineSettings) -> int:
    """``CACHET_ENGINE_THREADS`` where a supervisor divided the cores (run-local does, see
    ``cachet.engine_layout``); else torch's count (the host's cores, or ``OMP_NUM_THREADS``)
    split between the replica's ranks here: more threads than cores only thrash (2 ranks x
    2 threads on 2 cores: 24x slower)."""
    if settings.threads is not None:
        return settings.threads
    ranks_here = int(os.environ.get("LOCAL_SIZE", settings.tensor_parallel_size))
    return max(1, torch.get_num_threads() // ranks_here)
