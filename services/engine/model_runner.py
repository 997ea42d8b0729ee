"""Runs the model for one step plan: flat batch in, one sampled token per finishing span out.

The runner mirrors, per request, what it needs to run without being told twice:
token ids (prompt, then every token it sampled), block table, sampling params
and the seeded generator. The scheduler sends only diffs (see ``step_plan``);
the runner appends its own sampled tokens, so a decode step needs no token ids
from the scheduler at all.

In a tensor-parallel replica every rank holds a runner over its slices of the
model (built split and loaded slice by slice, ``tensor_parallel``) and of
the KV heads; rank 0 calls
``execute``, followers call ``forward_only`` and get rank 0's sampled tokens
through ``accept_sampled`` (see ``distributed``, which owns DeepSpeed).
"""

from __future__ import annotations

import contextlib
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch

from cachet.engine.attention import (
    SequenceSpan,
    allocate_kv_cache,
    build_attention_metadata,
    kv_cache_bytes_per_block,
)
from cachet.engine.block_q4_weights import serves_blocks
from cachet.engine.cpu_features import cpu_has_native_bf16
from cachet.engine.cpu_kernels import instruction_set, kernel_builds
from cachet.engine.cuda_graphs import DecodeGraphs
from cachet.engine.host_kv_blocks import HostKvBlocks
from cachet.engine.image_embeddings import ImageEmbeddings, ImageEncoder, ScheduledSpan
from cachet.engine.kv_cache_budget import KvCacheBudget
from cachet.engine.kv_transfer import KvReceiver, KvSender
from cachet.engine.models.config import ModelConfig, load_eos_token_ids
from cachet.engine.models.kimi_vision import normalized_patches
from cachet.engine.packed_linear import (
    PackableLinear,
    invariant_rows,
    pack_linear_weights,
    packs_linear_weights,
    tile_unit_products,
)
from cachet.engine.paged_decode_kernel import load_paged_decode_kernel, prefill_in_place_is_faster
from cachet.engine.piecewise_graphs import PiecewiseGraphs
from cachet.engine.prefill_attention_kernel import prefill_kernel_fits
from cachet.engine.prompt_images import ImageInputSpec, PromptImage
from cachet.engine.sampler import SamplingRow, sample, skip_draws
from cachet.engine.sampling_params import SamplingParams
from cachet.engine.settings import BlockQ4Use
from cachet.engine.shared_kv_tier import ShardLayout, SharedKvFiles, layout_key
from cachet.engine.step_plan import KvBlockMoves, NewRequest, StepPlan, StepResult
from cachet.engine.tensor_parallel import SINGLE_RANK
from cachet.engine.weights import load_model, return_freed_memory
from cachet.engine_layout import GPU_MAX_NUM_BATCHED_TOKENS

if TYPE_CHECKING:
    from cachet.engine.distributed import TensorParallel

log = structlog.get_logger(__name__)


def default_dtype(device: torch.device) -> torch.dtype:
    """The faster dtype on this device.

    GPUs: bf16 (fp16 before Ampere). CPUs: bf16 only with native bf16 math
    (AVX512-BF16 or AMX); on an AVX2-only CPU, bf16 matmuls are emulated and
    measured 4x slower than fp32 (576x1536 linear, batch 16: 1.8 ms vs 0.44 ms).
    """
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


@dataclass
class _RequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    sampling: SamplingParams
    generator: torch.Generator | None
    num_computed_tokens: int
    images: tuple[PromptImage, ...] = ()


# The CPU kernels a batch-invariant step runs: every token's attention through the paged one
# (never the prompt kernel), products on the panels, the per-token ops.
_INVARIANT_STEP_KERNELS = ("paged_decode_attention", "panel_linear", "fused_token_ops")


def reproducible_kernels(device: torch.device, block_q4: bool = False) -> str:
    """What computes a batch-invariant step's sums on ``device``: a GPU's name, or a CPU's kernel
    builds and whether products run on AMX's tile unit (``packed_linear``), or on a checkpoint's
    Q4_1 blocks in bf16 (``block_q4``: other weights than the panels' bf16, so other bits)."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    if device.type != "cpu":
        return device.type
    kind = f"cpu:{kernel_builds(_INVARIANT_STEP_KERNELS)},tile_unit={int(tile_unit_products())}"
    return kind + (f",block_q4={instruction_set('block_q4_linear')}" if block_q4 else "")


class ModelRunner:
    def __init__(
        self,
        model_dir: Path,
        *,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_bytes: int | KvCacheBudget,
        block_size: int = 16,
        max_model_len: int | None = None,
        tp: TensorParallel | None = None,
        pack_weights: bool = True,
        block_weights: BlockQ4Use = "small_batches",
        cuda_graphs: bool = False,
        paged_decode_kernel: bool = True,
        batch_invariant: bool = False,
        max_decode_batch: int = 64,
        max_step_tokens: int = GPU_MAX_NUM_BATCHED_TOKENS,
        host_kv_bytes: int = 0,
        shared_kv_dir: Path | None = None,
        shared_kv_bytes: int = 0,
        kv_transfer_port: int = 0,
        kv_transfer_host: str = "127.0.0.1",
    ) -> None:
        """``kv_cache_bytes``: the KV pool's size, or a budget it is sized by once the weights
        are loaded. ``pack_weights``: reorder linear weights for oneDNN where this device and
        dtype allow it (``packed_linear``); ``block_weights``: and which products run on the
        checkpoint's Q4_1 blocks where they allow it (``EngineSettings.block_q4_weights``).
        ``cuda_graphs``: replay decode steps of up to ``max_decode_batch`` requests from
        fixed-shape steps (``cuda_graphs``), captured as CUDA graphs on a CUDA device and run eagerly elsewhere, and steps of up to
        ``max_step_tokens`` tokens that hold prompt tokens from padded steps whose work between
        attention calls is captured likewise (``piecewise_graphs``); ignored for models that opt
        out and for tensor-parallel replicas. ``paged_decode_kernel``: on a CPU, decodes read
        the KV cache in place (``paged_decode_kernel``) rather than through a gather, where the
        kernel builds and the model's cache layout allows, and so do fp32 prompt chunks where the
        prompt kernel has a tile for them (``prefill_attention_kernel``), else prompt tokens
        through the decode kernel where it beats SDPA (``prefill_in_place_is_faster``). ``batch_invariant``: a step holding a
        greedy or seeded request runs batch-invariant, so such a request's logits do not depend
        on what shares its steps, nor on whether its prefix was cached: bf16 products on one
        kernel at every row count (``packed_linear.invariant_rows``), and on a CPU every token's
        attention through the paged decode kernel (``attention``); where that kernel cannot
        serve (CUDA, MLA models) the log says greedy is not batch-invariant there.
        ``host_kv_bytes``: this rank's host tier
        (``host_kv_tier``), 0 for none. ``shared_kv_dir``: the shared file tier's root
        (``shared_kv_tier``), kept under ``shared_kv_bytes``; it loads into the host tier,
        so it needs one. Each rank of a tensor-parallel replica keeps its own shard's files.
        ``kv_transfer_port``: take blocks other replicas push here (``kv_transfer``) on this
        port of ``kv_transfer_host``, held in the host tier's budget until a request loads
        them; 0: none. A single-rank runner can also push its blocks to other replicas."""
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        self.config = ModelConfig.from_model_dir(Path(model_dir))
        self.vocab_size = self.config.vocab_size
        self.eos_token_ids = load_eos_token_ids(Path(model_dir), self.config)
        self.model = load_model(
            Path(model_dir),
            self.config,
            dtype=dtype,
            device=self.device,
            tp=tp.model_rank if tp is not None else SINGLE_RANK,
            block_weights=pack_weights and block_weights != "off" and serves_blocks(self.device, dtype),
        )
        block_linears = [
            module
            for module in self.model.modules()
            if isinstance(module, PackableLinear) and module.block_q4 is not None
        ]
        for module in block_linears:
            module.block_q4_in_invariant_steps = block_weights == "all_steps"
        self.block_q4_linears = len(block_linears)
        self.block_q8_linears = sum(
            1
            for module in self.model.modules()
            if isinstance(module, PackableLinear) and module.block_q8 is not None
        )
        self.packed_linears = (
            pack_linear_weights(self.model)
            if pack_weights and packs_linear_weights(self.device, dtype)
            else 0
        )
        # Before the KV budget below reads the free memory.
        return_freed_memory()
        if isinstance(kv_cache_bytes, KvCacheBudget):
            window = max_model_len or self.config.max_position_embeddings
            per_token = self._kv_cache_bytes_per_block() // block_size
            kv_cache_bytes = kv_cache_bytes.bytes_for(self.device, per_token, window)
        self.num_kv_blocks = self._fit_blocks(kv_cache_bytes)
        if tp is not None:
            # Every rank must hold every block id the scheduler (on rank 0) hands out.
            self.num_kv_blocks = tp.min_over_ranks(self.num_kv_blocks)
        self.max_model_len = self._resolve_max_model_len(max_model_len)
        use_graphs = (
            cuda_graphs
            and getattr(self.model, "supports_cuda_graphs", True)
            # Collectives inside a captured step are not wired up (DeepSpeed's all-reduce on CPU,
            # NCCL's capture mode on GPU); a tensor-parallel replica decodes eagerly.
            and (tp is None or tp.size == 1)
        )
        # The cache may be read in place by the CPU kernels (the model's layout allowing).
        reads_cache_in_place = (
            paged_decode_kernel
            and self.device.type == "cpu"
            and getattr(self.model, "supports_paged_decode_kernel", True)
        )
        self.decode_in_place = reads_cache_in_place and load_paged_decode_kernel() is not None
        # fp32 prompt chunks attend through their own kernel outside batch-invariant steps.
        self.prefill_kernel = reads_cache_in_place and prefill_kernel_fits(
            self.dtype,
            self.config.head_dim,
            self.config.num_attention_heads // self.config.num_key_value_heads,
        )
        # Else prompt tokens go through the paged decode kernel, in every step, where it beats
        # SDPA's prefill.
        self.prefill_in_place = (
            self.decode_in_place
            and not self.prefill_kernel
            and prefill_in_place_is_faster(self.dtype, self.config.head_dim)
        )
        self.batch_invariant = batch_invariant
        # Names this replica's batch-invariant KV (block hashes, EngineInfo): a host of another
        # kind sums in other orders, so its blocks must never stand in for these.
        # fp32 products on the blocks are the panels' bits: only bf16 ones in these steps differ.
        invariant_blocks = bool(block_linears) and block_weights == "all_steps" and dtype == torch.bfloat16
        self.reproducible_kernels = (
            reproducible_kernels(self.device, block_q4=invariant_blocks) if batch_invariant else ""
        )
        if batch_invariant and not self.decode_in_place:
            log.warning(
                "greedy decoding is not batch-invariant here: prefill attention runs SDPA, whose "
                "sums are ordered by each call's lengths",
                device=self.device.type,
                paged_decode_kernel=self.decode_in_place,
            )
        # The fixed-shape decode steps write padding rows into one block past those reported.
        self.kv_cache = self._allocate_kv_cache(self.num_kv_blocks + (1 if use_graphs else 0))
        # The pool's block axis: [layers, blocks, ...] for MLA's latent, [layers, 2, blocks, ...] else.
        self.kv_block_dim = 1 if self.model.kv_cache_shape_per_token() is not None else 2
        # What copying one block moves on this rank (the engine's figures of KV copied).
        self.kv_block_bytes = self._kv_cache_bytes_per_block()
        for layer_cache, attention in zip(self.kv_cache, self.model.attention_layers(), strict=True):
            attention.kv_cache = layer_cache
        self._requests: dict[str, _RequestState] = {}
        self.host_kv = self._allocate_host_kv(host_kv_bytes, tp)
        self.num_host_kv_blocks = self.host_kv.blocks.shape[0] if self.host_kv is not None else 0
        self.shared_kv = (
            self._open_shared_kv(Path(shared_kv_dir), shared_kv_bytes, Path(model_dir).name, tp)
            if shared_kv_dir is not None
            else None
        )
        self.kv_sender, self.kv_receiver = self._open_kv_transfer(
            kv_transfer_port, kv_transfer_host, host_kv_bytes, Path(model_dir).name, tp
        )
        self.decode_graphs = self._capture_decode_graphs(max_decode_batch) if use_graphs else None
        self.step_graphs = (
            self._capture_step_graphs(max_step_tokens, max_decode_batch)
            if use_graphs and getattr(self.model, "supports_piecewise_graphs", True)
            else None
        )
        self.image_input, self.image_encoder = self._image_input()

    def _image_input(self) -> tuple[ImageInputSpec | None, ImageEncoder | None]:
        """What images this model reads, and its vision tower behind a cache; (None, None) for a
        text-only model."""
        vision = self.config.vision
        tower = getattr(self.model, "vision_tower", None)
        if vision is None or tower is None or vision.media_placeholder_token_id is None:
            return None, None
        spec = ImageInputSpec(vision.media_placeholder_token_id, vision.patch_size, vision.merge_kernel_size)
        return spec, ImageEncoder(tower, normalized_patches, vision.patch_size, self.device)

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """``[layers, ...]``: K/V per KV head, unless the model caches its own per-token layout."""
        per_token = self.model.kv_cache_shape_per_token()
        if per_token is not None:
            # MLA: one latent per token, ``[layers, num_blocks, block_size, *per_token]``; zeroed for
            # the same reason as allocate_kv_cache (padded gathers read unused slots).
            shape = (num_blocks, self.block_size, *per_token)
            return torch.zeros(self.config.num_hidden_layers, *shape, dtype=self.dtype, device=self.device)
        return allocate_kv_cache(
            self.config.num_hidden_layers,
            num_blocks,
            self.block_size,
            self.model.num_local_kv_heads(),
            self.config.head_dim,
            self.dtype,
            self.device,
        )

    def _allocate_host_kv(self, host_kv_bytes: int, tp: TensorParallel | None) -> HostKvBlocks | None:
        if host_kv_bytes <= 0:
            return None
        num_slots = host_kv_bytes // self._kv_cache_bytes_per_block()
        if tp is not None:
            num_slots = tp.min_over_ranks(num_slots)
        return HostKvBlocks(self.kv_cache, self.kv_block_dim, num_slots) if num_slots > 0 else None

    def _open_shared_kv(
        self, root: Path, budget_bytes: int, model_name: str, tp: TensorParallel | None
    ) -> SharedKvFiles | None:
        if self.host_kv is None:
            raise ValueError(
                "the shared KV tier (CACHET_KV_SHARED_DIR) needs a host tier: set CACHET_KV_HOST_GB"
            )
        block_shape = tuple(self.host_kv.blocks.shape[1:])
        if tp is None or tp.size == 1:
            return SharedKvFiles(
                root,
                layout_key(model_name, self.dtype, self.block_size, block_shape),
                budget_bytes=budget_bytes,
                block_shape=block_shape,
                dtype=self.dtype,
            )
        # One folder per rank; rank 0 learns the others' shapes (heads may split unevenly).
        rank = tp.info.rank
        own = ShardLayout(
            layout_key(model_name, self.dtype, self.block_size, block_shape, shard=(rank, tp.size)),
            block_shape,
        )
        layouts: list[ShardLayout] = tp.gather_from_ranks(own)
        return SharedKvFiles(
            root,
            own.key,
            budget_bytes=budget_bytes,
            block_shape=block_shape,
            dtype=self.dtype,
            peers=layouts[1:] if rank == 0 else (),
            follower=rank != 0,
        )

    def _open_kv_transfer(
        self, port: int, host: str, budget_bytes: int, model_name: str, tp: TensorParallel | None
    ) -> tuple[KvSender | None, KvReceiver | None]:
        """The direct transfer's ends, this rank's: a tensor-parallel replica's ranks each send
        and take their own shard, paired rank to rank (``kv_transfer``)."""
        block_shape = tuple(self._pool_block(0).shape)
        rank, ranks = (tp.info.rank, tp.size) if tp is not None else (0, 1)
        key = layout_key(
            model_name, self.dtype, self.block_size, block_shape, shard=(rank, ranks) if ranks > 1 else None
        )
        # Rank 0's name on every rank: a transfer's id must be the same on all of them.
        name = uuid.uuid4().hex
        if tp is not None and ranks > 1:
            name = tp.gather_from_ranks(name)[0]
        sender = KvSender(key, self.device, host=host, rank=rank, name=name)
        if not port:
            return sender, None
        if self.host_kv is None:
            raise ValueError(
                "taking pushed KV (CACHET_ENGINE_KV_TRANSFER_PORT) loads into the host tier: set CACHET_KV_HOST_GB"
            )
        try:
            receiver = KvReceiver(
                key,
                block_shape,
                self.dtype,
                self.device,
                port=port,
                budget_bytes=budget_bytes,
                host=host,
                rank=rank,
                ranks=ranks,
            )
        except OSError as exc:
            raise ValueError(
                f"CACHET_ENGINE_KV_TRANSFER_PORT={port}: cannot listen on {host}:{port} ({exc})"
            ) from exc
        if tp is not None and ranks > 1:
            # Rank 0 announces the address (EngineInfo) once it serves: by then every rank's
            # layout must be posted, or a sending rank that looks first finds no such rank
            # here and its shard of those hand-offs is refused (the decode side recomputes).
            tp.gather_from_ranks(receiver.address)
        log.info("KV receiver listening", address=receiver.address, rank=rank)
        return sender, receiver

    def _capture_decode_graphs(self, max_decode_batch: int) -> DecodeGraphs:
        graphs = DecodeGraphs(
            self.model,
            vocab_size=self.vocab_size,
            block_size=self.block_size,
            max_batch=max_decode_batch,
            max_model_len=self.max_model_len,
            scratch_block=self.num_kv_blocks,
            kv_bytes_per_key=self._kv_cache_bytes_per_block()
            // (self.config.num_hidden_layers * self.block_size),
            device=self.device,
        )
        graphs.capture()
        return graphs

    def _capture_step_graphs(self, max_step_tokens: int, max_samples: int) -> PiecewiseGraphs:
        graphs = PiecewiseGraphs(
            self.model, max_tokens=max_step_tokens, max_samples=max_samples, device=self.device
        )
        graphs.capture()
        return graphs

    def _kv_cache_bytes_per_block(self) -> int:
        per_token = self.model.kv_cache_shape_per_token()
        if per_token is not None:
            return (
                self.config.num_hidden_layers * self.block_size * math.prod(per_token) * self.dtype.itemsize
            )
        return kv_cache_bytes_per_block(
            self.config.num_hidden_layers,
            self.block_size,
            self.model.num_local_kv_heads(),
            self.config.head_dim,
            self.dtype,
        )

    def _fit_blocks(self, kv_cache_bytes: int) -> int:
        per_block = self._kv_cache_bytes_per_block()
        blocks = kv_cache_bytes // per_block
        if blocks < 1:
            raise ValueError(
                f"kv_cache_bytes={kv_cache_bytes} holds no block (one block needs {per_block} bytes)"
            )
        return blocks

    def _resolve_max_model_len(self, requested: int | None) -> int:
        capacity = self.num_kv_blocks * self.block_size
        if requested is None:
            return min(self.config.max_position_embeddings, capacity)
        if requested > capacity:
            raise ValueError(f"max_model_len={requested} exceeds the KV cache's {capacity} token slots")
        # Dynamic NTK RoPE exists to run past the trained window; every other variant degrades there.
        if requested > self.config.max_position_embeddings and self.config.rope.rope_type != "dynamic":
            raise ValueError(
                f"max_model_len={requested} exceeds the model's max_position_embeddings="
                f"{self.config.max_position_embeddings}"
            )
        return requested

    @property
    def expert_parallel_size(self) -> int:
        """Over how many ranks the routed experts are split (1 for a dense model; the
        tensor-parallel size for an MoE model in a tensor-parallel replica)."""
        expert_parallel = getattr(self.model, "expert_parallel", None)
        return expert_parallel.size if expert_parallel is not None else 1

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def execute(self, plan: StepPlan, logit_masks: Mapping[str, torch.Tensor] | None = None) -> StepResult:
        """Run one step. ``logit_masks`` (request id -> bool [vocab], True = allowed) applies to
        requests that sample this step; masks for requests that do not are ignored."""
        self._apply_diffs(plan)
        self._move_kv_blocks(plan.kv_moves)
        if not plan.num_scheduled_tokens:
            return StepResult()
        logits, samplers = self._forward(plan)
        with torch.inference_mode():
            rows = [self._sampling_row(rid, logit_masks) for rid in samplers]
            tokens = sample(logits, rows) if rows else []
        for rid, token in zip(samplers, tokens, strict=True):
            self._requests[rid].token_ids.append(token.token_id)
        return StepResult(sampled=dict(zip(samplers, tokens, strict=True)))

    def forward_only(self, plan: StepPlan) -> None:
        """A follower rank's step: the same forward as rank 0 (its collectives pair with rank 0's,
        down to the sharded lm_head), no sampling; rank 0's tokens come via ``accept_sampled``."""
        self._apply_diffs(plan)
        self._move_kv_blocks(plan.kv_moves)
        if plan.num_scheduled_tokens:
            self._forward(plan)

    def accept_sampled(self, sampled: Mapping[str, int]) -> None:
        """Append tokens rank 0 sampled (a follower's runner); requests dropped since are skipped."""
        for rid, token_id in sampled.items():
            state = self._requests.get(rid)
            if state is not None:
                state.token_ids.append(token_id)

    def _forward(self, plan: StepPlan) -> tuple[torch.Tensor, list[str]]:
        """Compute the plan's KV and the logits of its sampling positions (ids in ``samplers``)."""
        spans, input_ids, positions, samplers = self._prepare(plan)
        images = self._image_rows(plan)
        invariant = self.batch_invariant and any(
            self._requests[rid].sampling.reproducible for rid in plan.num_scheduled_tokens
        )
        shape = self.decode_graphs.shape_for(spans) if self.decode_graphs is not None else None
        if shape is not None and images is None:
            assert self.decode_graphs is not None  # a shape comes only from the graphs
            logits = self.decode_graphs.run(shape, spans, input_ids)
        else:
            meta = build_attention_metadata(
                spans,
                self.block_size,
                self.device,
                decode_in_place=self.decode_in_place,
                every_token_in_place=self.decode_in_place and (invariant or self.prefill_in_place),
                prefill_kernel=self.prefill_kernel,
            )
            padded = (
                self.step_graphs.tokens_for(len(input_ids), len(samplers))
                if self.step_graphs is not None and images is None and not invariant
                else None
            )
            if padded is not None:
                assert self.step_graphs is not None  # a padded count comes only from the graphs
                logits = self.step_graphs.run(padded, input_ids, torch.cat(positions), meta)
            else:
                products = invariant_rows() if invariant else contextlib.nullcontext()
                with torch.inference_mode(), products:
                    logits = self.model(
                        torch.tensor(input_ids, dtype=torch.int64, device=self.device),
                        torch.cat(positions).to(self.device),
                        meta,
                        images,
                    )
        for rid, num_new in plan.num_scheduled_tokens.items():
            self._requests[rid].num_computed_tokens += num_new
        return logits, samplers

    def _image_rows(self, plan: StepPlan) -> ImageEmbeddings | None:
        """The vision tower's rows for the image tokens this step computes (before the step's
        computed counts move on)."""
        if self.image_encoder is None:
            return None
        scheduled, offset = [], 0
        for rid, num_new in plan.num_scheduled_tokens.items():
            state = self._requests[rid]
            start = state.num_computed_tokens
            # Past its last image (every decode of it), a request has no image rows to look for.
            if state.images and start < state.images[-1].end:
                scheduled.append(ScheduledSpan(offset, start, start + num_new, state.images))
            offset += num_new
        return self.image_encoder.step_rows(scheduled) if scheduled else None

    def _move_kv_blocks(self, moves: KvBlockMoves) -> None:
        """The plan's KV block copies, in ``KvBlockMoves``' order, before its forward pass. Each
        rank of a sharded replica copies its own shard of every block; on CUDA the copies are
        queued on the compute stream, ahead of the forward that reads them."""
        if not moves:
            return
        host_kv = self.host_kv
        if host_kv is None and (moves.store or moves.demote or moves.fill or moves.promote):
            raise ValueError("the plan moves KV blocks to or from a host tier this runner does not have")
        self._send_blocks(moves.send)
        for block_id, block_hash in moves.store:
            self._store_shared(block_id, block_hash)
        if host_kv is not None:
            host_kv.copy_out(moves)
        for source, destination in moves.duplicate:
            self._pool_block(destination).copy_(self._pool_block(source))
        unread = [loaded for _, loaded in moves.fill if loaded.data is None]
        for loaded, shard in zip(unread, self._own_shards([b.block_hash for b in unread]), strict=True):
            loaded.data = shard
        if host_kv is not None:
            host_kv.copy_in(moves)

    def _pool_block(self, block_id: int) -> torch.Tensor:
        """One block of every layer, a view into the pool."""
        return self.kv_cache.select(self.kv_block_dim, block_id)

    def _send_blocks(self, sends: list[tuple[int, int, str]]) -> None:
        """Copy the blocks going to other replicas out of the pool (they may be reused by this
        very step) and queue each receiver's on the sender; on CUDA the sender waits for the
        copy's event, not the host."""
        if not sends:
            return
        if self.kv_sender is None:
            raise ValueError("the plan sends KV blocks, but this runner cannot send")
        by_address: dict[str, list[tuple[int, int]]] = {}
        for block_id, block_hash, address in sends:
            by_address.setdefault(address, []).append((block_id, block_hash))
        for address, blocks in by_address.items():
            ids = torch.tensor([block_id for block_id, _ in blocks], device=self.device)
            copied = (
                self.kv_cache.index_select(self.kv_block_dim, ids).movedim(self.kv_block_dim, 0).contiguous()
            )
            ready = None
            if copied.device.type == "cuda":
                event = torch.cuda.Event()
                event.record()
                ready = event.synchronize
            self.kv_sender.send_later(address, [block_hash for _, block_hash in blocks], copied, ready)

    def _own_shards(self, block_hashes: list[int]) -> list[torch.Tensor]:
        """A follower rank's shards of blocks rank 0 loaded: pushed to this rank's receiver (rank
        0 offers a pushed block only once every rank holds its shard), else from the shared tier,
        where rank 0 checked this rank's file too, a moment ago, and refreshed its time. Should
        neither hold one (a foreign clean-up that reached the newest files), no shard can stand
        in for it: the rank fails, and the replica with it, rather than compute on KV that is not
        the prompt's."""
        if not block_hashes:
            return []
        pushed = self.kv_receiver.blocks.take(block_hashes) if self.kv_receiver is not None else {}
        return [
            pushed[block_hash] if block_hash in pushed else self._read_shared_shard(block_hash)
            for block_hash in block_hashes
        ]

    def _read_shared_shard(self, block_hash: int) -> torch.Tensor:
        if self.shared_kv is None:
            raise RuntimeError(
                f"this rank holds no shard of KV block {block_hash:x}: not pushed, no shared tier"
            )
        block = self.shared_kv.read(block_hash)
        if block is None:
            raise RuntimeError(f"this rank's shard of shared KV block {block_hash:x} is gone or damaged")
        return block

    def _store_shared(self, block_id: int, block_hash: int) -> None:
        """Copy a pool block out for the shared tier's writer; on CUDA into pinned memory without
        waiting, the writer waiting on the copy's event instead."""
        if self.shared_kv is None:
            raise ValueError("the plan stores KV blocks in a shared tier this runner does not have")
        source = self._pool_block(block_id)
        if source.device.type != "cuda":
            self.shared_kv.write_later(block_hash, source.clone())
            return
        staging = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
        staging.copy_(source, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self.shared_kv.write_later(block_hash, staging, copied.synchronize)

    def _apply_diffs(self, plan: StepPlan) -> None:
        # Drop before adding: a preempted request can come back as new in the same plan.
        for rid in plan.finished_request_ids:
            self._requests.pop(rid, None)
        for new in plan.new_requests:
            self._requests[new.request_id] = self._new_state(new)
        for diff in plan.running:
            state = self._requests[diff.request_id]
            state.block_ids.extend(diff.new_block_ids)
            state.num_computed_tokens = diff.num_computed_tokens

    def _new_state(self, new: NewRequest) -> _RequestState:
        generator = None
        if new.sampling.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(new.sampling.seed)
            if not new.sampling.greedy:
                skip_draws(generator, len(new.output_token_ids), self.vocab_size)
        return _RequestState(
            token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
            num_prompt_tokens=len(new.prompt_token_ids),
            block_ids=list(new.block_ids),
            sampling=new.sampling,
            generator=generator,
            num_computed_tokens=new.num_computed_tokens,
            images=new.images,
        )

    def _prepare(self, plan: StepPlan) -> tuple[list[SequenceSpan], list[int], list[torch.Tensor], list[str]]:
        spans, input_ids, positions, samplers = [], [], [], []
        for rid, num_new in plan.num_scheduled_tokens.items():
            state = self._requests.get(rid)
            if state is None:
                raise KeyError(f"request {rid!r} is scheduled but the runner does not hold it")
            start, end = state.num_computed_tokens, state.num_computed_tokens + num_new
            if num_new < 1 or end > len(state.token_ids) or end > self.max_model_len:
                raise ValueError(
                    f"request {rid!r}: span [{start}, {end}) is invalid for {len(state.token_ids)} known "
                    f"tokens and max_model_len={self.max_model_len}"
                )
            reaches_end = end == len(state.token_ids)
            spans.append(SequenceSpan(start, num_new, state.block_ids, sample=reaches_end))
            input_ids.extend(state.token_ids[start:end])
            positions.append(torch.arange(start, end))
            if reaches_end:
                samplers.append(rid)
        return spans, input_ids, positions, samplers

    def _sampling_row(self, rid: str, logit_masks: Mapping[str, torch.Tensor] | None) -> SamplingRow:
        state = self._requests[rid]
        allowed = logit_masks.get(rid) if logit_masks is not None else None
        if allowed is not None and tuple(allowed.shape) != (self.vocab_size,):
            raise ValueError(
                f"logit mask for {rid!r} has shape {tuple(allowed.shape)}, want ({self.vocab_size},)"
            )
        return SamplingRow(
            params=state.sampling,
            prompt_token_ids=state.token_ids[: state.num_prompt_tokens],
            output_token_ids=state.token_ids[state.num_prompt_tokens :],
            generator=state.generator,
            allowed=allowed,
        )
