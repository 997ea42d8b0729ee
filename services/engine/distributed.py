"""A replica as a group of ranks: process launch, torch.distributed, the all-reduce, the step channel.

This is the one engine module that owns DeepSpeed and the process group (the
expert-parallel split in ``expert_parallel`` joins the group made here). The
model code is built already split (``tensor_parallel``: each rank reads
only its slices of the checkpoint) and sums partial results with the
DeepSpeed all-reduce this module hands it.

Shape of a tensor-parallel replica of N ranks::

    rank 0 (python -m cachet.engine)                 rank 1..N-1 (spawned, or started by a launcher)
    gRPC, AsyncEngine, Scheduler                     no server, no scheduler
    ShardedRunner.execute(plan):                     follow():
      broadcast StepMessage(plan, last sampled) ──>    receive StepMessage
      ModelRunner.execute(plan)  <── all-reduce ──>    ModelRunner.forward_only(plan)
      sample (rank 0 only)

Only rank 0 samples: grammar masks, unseeded random draws and penalties live
there, and N samplers agreeing bit for bit would be a promise nobody checks.
Followers still need every sampled token (the next decode step's input id), so
each step's message carries the tokens rank 0 sampled in the step before: one
message per step, never one per token.

Launch: ``CACHET_TP=N python -m cachet.engine`` spawns ranks 1..N-1 itself with
``multiprocessing``'s *spawn* context (fork next to gRPC's threads is unsafe)
and the environment DeepSpeed's launcher would set. A process that already has
``RANK`` / ``WORLD_SIZE`` (``deepspeed --hostfile``, ``torchrun``) is one rank
of an externally launched group and spawns nothing: that is the multi-node path.

Failure: no rank may wait forever. The plan channel is gloo with a timeout and
an idle heartbeat; DeepSpeed's shared-memory all-reduce has no timeout at all,
so watchdogs end the process instead: rank 0 watches its children's process
sentinels, a child watches its parent's.
"""

from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.connection
import os
import pathlib
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from cachet.engine.deepspeed_ops import (
    BUILD_LOCK_TIMEOUT_SECONDS,
    use_own_extensions_dir,
    wait_for_build_locks,
)
from cachet.engine.step_plan import StepPlan, StepResult
from cachet.engine.tensor_parallel import TensorParallelRank
from cachet.logs import get_logger
from cachet.loopback_port import free_loopback_port

if TYPE_CHECKING:
    from cachet.engine.model_runner import ModelRunner

log = get_logger(__name__)

# Long enough for a slow model load on one rank while the others wait at the next
# collective; short enough that a lost peer on the gloo channel is noticed.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
# An idle rank 0 sends this often so a follower's receive never nears the timeout.
HEARTBEAT_SECONDS = 2.0
# Followers exit with this when their parent (rank 0) is gone.
EXIT_PARENT_LOST = 3
# How long the rank watchdog waits for a dead follower's exit status before calling it lost.
EXIT_STATUS_WAIT_SECONDS = 5.0
# DeepSpeed's name for a rank's shm all-reduce segment (csrc/cpu/comm/shm.cpp), followed
# by _<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>.
SHM_ALL_REDUCE_PREFIX = "deepspeed_allreduce_buffer"


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in its replica's group."""

    rank: int
    world_size: int
    local_rank: int

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


def _set_rank_environment(rank: int, world_size: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))


def local_group_environment(rank: int, world_size: int, master_port: int) -> dict[str, str]:
    """What DeepSpeed's launcher would set for one rank of a group that lives on this host.

    LOCAL_SIZE: DeepSpeed's CPU accelerator crashes without it (no traceback). A free
    port rather than 29500, which every other job on the host defaults to. Loopback for
    gloo, whose interface guess can pick one that peers on this host cannot reach.
    """
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "GLOO_SOCKET_IFNAME": "lo",
    }


def prepare_local_group(world_size: int) -> None:
    """Rank 0's environment for a local group; spawned children inherit it (and set their rank)."""
    os.environ.update(local_group_environment(0, world_size, free_loopback_port()))


def spawn_followers(world_size: int, target: Callable[..., None], *args: Any) -> list[BaseProcess]:
    """Start ranks 1..world_size-1 as ``target(rank, *args)`` in spawned processes."""
    context = multiprocessing.get_context("spawn")
    followers: list[BaseProcess] = []
    for rank in range(1, world_size):
        process = context.Process(
            target=_follower_bootstrap,
            args=(rank, world_size, target, *args),
            name=f"engine-rank{rank}",
            # Daemonic: if rank 0 exits, even by an exception at start-up, multiprocessing ends them.
            daemon=True,
        )
        process.start()
        followers.append(process)
    return followers


def _follower_bootstrap(rank: int, world_size: int, target: Callable[..., None], *args: Any) -> None:
    _set_rank_environment(rank, world_size)
    exit_with_parent()
    target(rank, *args)


def exit_with_parent() -> None:
    """A spawned rank ends when rank 0 does, even mid-collective (the shm all-reduce never times out)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def wait() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(EXIT_PARENT_LOST)

    threading.Thread(target=wait, name="parent-watchdog", daemon=True).start()


def init_distributed(
    device: torch.device, build_lock_timeout: float = BUILD_LOCK_TIMEOUT_SECONDS
) -> RankInfo:
    """Join the process group (env:// from the launcher or ``prepare_local_group``) through DeepSpeed.

    gloo on CPU, NCCL on CUDA; DeepSpeed picks its accelerator by itself. On CPU it also
    loads its shared-memory all-reduce (compiled on first use into this environment's own
    folder, ``deepspeed_ops``; ``make setup`` builds it ahead), after waiting at most
    ``build_lock_timeout`` seconds on a build lock (StaleBuildLock past it).
    """
    import deepspeed

    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        wait_for_build_locks(use_own_extensions_dir(), build_lock_timeout)
    backend = "nccl" if device.type == "cuda" else "gloo"
    deepspeed.init_distributed(dist_backend=backend, timeout=COLLECTIVE_TIMEOUT, verbose=False)
    if backend == "gloo":
        release_shared_memory_name()
    return RankInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )


def release_shared_memory_name() -> None:
    """Unlink this rank's DeepSpeed all-reduce segment in /dev/shm, keeping its mapping.

    DeepSpeed's CPU all-reduce gives each rank a ~69 MB shm segment that it never
    unlinks, and tmpfs is RAM: every group started on a machine left 69 MB per rank
    behind, and a test run's groups added up until the kernel killed the run. Once
    every rank has mapped every peer's segment (they all have when this barrier
    opens, as DeepSpeed maps them while the group starts) the names are no longer
    needed; the memory goes when the last rank exits, however it exits.
    """
    if not dist.is_initialized():
        return
    dist.barrier()
    name = (
        f"{SHM_ALL_REDUCE_PREFIX}_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}"
        f"_{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}"
    )
    pathlib.Path("/dev/shm", name).unlink(missing_ok=True)


def _inference_all_reduce_(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over the replica's ranks in place: DeepSpeed's shared-memory op on CPU (~7 us for a
    small tensor where gloo takes ~2 ms), NCCL on GPU. It spans the whole world: a replica's
    process group is its tensor-parallel group."""
    import deepspeed.comm as ds_comm

    ds_comm.inference_all_reduce(tensor)
    return tensor


@dataclass
class TensorParallel:
    """The tensor-parallel group of a replica: how to shard a model, how ranks agree.

    ``control`` is a separate gloo group for step messages: picklable CPU objects, and
    with NCCL as the model's backend they could not travel on the default group.
    """

    info: RankInfo
    control: Any = field(default=None, repr=False)
    # CACHET_EP: 1 or the group's size (``TensorParallelRank.expert_parallel_size``).
    expert_parallel_size: int = 1

    @classmethod
    def create(cls, info: RankInfo, expert_parallel_size: int = 1) -> TensorParallel:
        control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
        return cls(info, control, expert_parallel_size)

    @property
    def size(self) -> int:
        return self.info.world_size

    @property
    def model_rank(self) -> TensorParallelRank:
        """What the model code needs to build this rank's slices and sum partial results."""
        return TensorParallelRank(
            self.info.rank, self.info.world_size, _inference_all_reduce_, self.expert_parallel_size
        )

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` of any rank: KV heads can split unevenly (9 over 2 ranks),
        and the scheduler on rank 0 must not hand out blocks some rank lacks."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.control)
        return int(tensor.item())

    def gather_from_ranks(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order, on every rank."""
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, value, group=self.control)
        return gathered

    def send(self, message: StepMessage) -> None:
        dist.broadcast_object_list([message], src=0, group=self.control)

    def receive(self) -> StepMessage:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]


@dataclass(frozen=True)
class StepMessage:
    """What rank 0 tells the followers once per step (or per heartbeat)."""

    # None: a heartbeat, nothing to run.
    plan: StepPlan | None
    # Tokens rank 0 sampled in the previous step: request id -> token id.
    sampled: dict[str, int] = field(default_factory=dict)
    stop: bool = False


class ShardedRunner:
    """Rank 0's runner: broadcasts each plan, then runs its own shard and samples.

    Satisfies ``engine_core.Runner``. One lock serialises step messages and
    heartbeats: both use the control group, whose collectives must come in the
    same order on every rank.
    """

    def __init__(self, runner: ModelRunner, tp: TensorParallel) -> None:
        self.runner = runner
        self.tp = tp
        self.num_kv_blocks = runner.num_kv_blocks
        self.block_size = runner.block_size
        self._lock = threading.Lock()
        self._pending_sampled: dict[str, int] = {}
        self._last_send = time.monotonic()
        self._closed = threading.Event()
        # Seconds spent in the step broadcast, for the benchmark's collective share.
        self.broadcast_seconds = 0.0
        threading.Thread(target=self._heartbeat, name="tp-heartbeat", daemon=True).start()

    def __getattr__(self, name: str) -> Any:
        # Everything but stepping is the local runner's: max_model_len, vocab_size, eos ids...
        return getattr(self.runner, name)

    def execute(self, plan: StepPlan, logit_masks: Mapping[str, torch.Tensor] | None = None) -> StepResult:
        with self._lock:
            self._send(StepMessage(plan, self._pending_sampled))
            result = self.runner.execute(plan, logit_masks)
            self._pending_sampled = {rid: token.token_id for rid, token in result.sampled.items()}
            return result

    def close(self, timeout: float = 10.0) -> None:
        """Tell the followers to exit; further steps are refused.

        Gives up after ``timeout`` if a step holds the lock that long: a step stuck in a
        collective with a dead peer never ends, and shutdown must not wait on it.
        """
        if not self._lock.acquire(timeout=timeout):
            log.warning("a step is stuck; followers are not told to stop")
            return
        try:
            if not self._closed.is_set():
                self._closed.set()
                self._send(StepMessage(None, stop=True))
        finally:
            self._lock.release()

    def _send(self, message: StepMessage) -> None:
        if self._closed.is_set() and not message.stop:
            raise RuntimeError("the replica's rank group is closed")
        start = time.perf_counter()
        self.tp.send(message)
        self.broadcast_seconds += time.perf_counter() - start
        self._last_send = time.monotonic()

    def _heartbeat(self) -> None:
        while not self._closed.wait(HEARTBEAT_SECONDS / 2):
            if time.monotonic() - self._last_send < HEARTBEAT_SECONDS:
                continue
            with self._lock:
                if self._closed.is_set():
                    return
                try:
                    self._send(StepMessage(None))
                except RuntimeError:
                    # A lost peer; the watchdog takes the replica down, nothing to add here.
                    log.exception("heartbeat to the followers failed")
                    return


def follow(runner: ModelRunner, tp: TensorParallel) -> None:
    """A follower's whole life after loading: run every plan rank 0 sends, until told to stop."""
    while True:
        message = tp.receive()
        runner.accept_sampled(message.sampled)
        if message.stop:
            return
        if message.plan is not None:
            runner.forward_only(message.plan)


def watch_followers(followers: list[BaseProcess], on_lost: Callable[[str], object]) -> Callable[[], None]:
    """Call ``on_lost(reason)`` (on a watchdog thread) when any follower exits unplanned.

    Returns a disarm function for a planned shutdown, when followers exit on purpose.
    A follower that exits 0 was told to stop (``follow`` returns only on rank 0's stop
    message, a lost parent exits with ``EXIT_PARENT_LOST``), so that is no loss either:
    rank 0's own shutdown tells them before it disarms.
    """
    disarmed = threading.Event()

    def wait() -> None:
        ready = multiprocessing.connection.wait([p.sentinel for p in followers])
        dead = next(p for p in followers if p.sentinel in ready)
        # The sentinel can fire a while before the exit status is in (the kernel is still
        # freeing a large KV cache); the status decides whether this was planned.
        deadline = time.monotonic() + EXIT_STATUS_WAIT_SECONDS
        while dead.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if disarmed.is_set() or dead.exitcode == 0:
            return
        on_lost(f"rank process {dead.name} (pid {dead.pid}) exited with {dead.exitcode}")

    threading.Thread(target=wait, name="rank-watchdog", daemon=True).start()
    return disarmed.set


def stop_followers(followers: list[BaseProcess], timeout: float = 10.0) -> None:
    """Wait for followers told to stop; terminate any that do not go."""
    deadline = time.monotonic() + timeout
    for process in followers:
        process.join(max(deadline - time.monotonic(), 0.1))
        if process.is_alive():
            process.terminate()
            process.join(2)
