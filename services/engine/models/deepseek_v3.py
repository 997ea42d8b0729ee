"""DeepSeek-V3 family decoder (DeepSeek-V3, Kimi K2): latent attention + routed/shared experts.

The decoder skeleton is ``decoder.py``'s; this file holds what differs. Parameter
names match Hugging Face checkpoints (per-expert ``mlp.experts.{j}.{gate,up,down}_proj``).

Tensor parallel over N ranks (expert parallelism, when chosen, reuses the same ranks):

    attention   q_a/kv_a projections and their norms replicated (small, and the
                latent must be whole: every rank caches all of it for its heads);
                q_b (or q) and kv_b cut by heads, o_proj by the same heads' columns
    dense MLP   gate/up by channels, down by channels: one all-reduce
    MoE         routed experts split whole across ranks (EP = N) or each cut by
                channels like a dense MLP (EP = 1); shared experts by channels;
                routed and shared partial sums meet in one all-reduce
    embedding / lm_head  vocab-parallel (``tensor_parallel``)
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from cachet.engine.attention import AttentionMetadata
from cachet.engine.expert_parallel import ExpertParallel
from cachet.engine.int4_linear import Int4Linear, int4_kernel_fits
from cachet.engine.mla_attention import PagedLatentAttention
from cachet.engine.models.config import MLAConfig, ModelConfig, MoEConfig, PackedIntQuantization
from cachet.engine.models.decoder import CausalLM, DecoderLayer, DecoderModel, RMSNorm
from cachet.engine.models.kimi_vision import KimiVisionTower
from cachet.engine.models.rotary import apply_rotary
from cachet.engine.tensor_parallel import (
    SINGLE_RANK,
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelRank,
)

# DeepSeek's own code builds q_a_layernorm / kv_a_layernorm with the RMSNorm default,
# not config.rms_norm_eps; checkpoints were trained that way.
_LATENT_NORM_EPS = 1e-6
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT_INDEX = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.")


def softmax_scale(config: ModelConfig) -> float:
    """1/sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim) squared as DeepSeek-V3 does.

    YaRN sharpens long-context attention; DeepSeek applies the "all dims" mscale to
    q and k alike, hence the square, on top of the cos/sin factor the rotary tables carry.
    """
    assert config.mla is not None
    scale = config.mla.qk_head_dim**-0.5
    rope = config.rope
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = _yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale *= m * m
    return scale


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1), (x2, x3)... pairs -> [evens | odds]: the rotate-half layout of the same rotation.

    q and k are permuted alike, so their dot product, and the cached k_rot, stay consistent.
    """
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallelRank = SINGLE_RANK) -> None:
        super().__init__()
        mla: MLAConfig = config.mla  # type: ignore[assignment]
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.mla = mla

        def by_heads(in_features: int, width: int) -> ColumnParallelLinear:
            return ColumnParallelLinear.by_units(in_features, heads, width, tp, what="attention heads")

        if mla.q_lora_rank is None:
            self.q_proj = by_heads(hidden, mla.qk_head_dim)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = by_heads(mla.q_lora_rank, mla.qk_head_dim)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = by_heads(mla.kv_lora_rank, mla.qk_nope_head_dim + mla.v_head_dim)
        # Never called: attention reads its weight as the per-head up-projections.
        self.kv_b_proj.pack_weight = False
        self.o_proj = RowParallelLinear.by_units(heads, mla.v_head_dim, hidden, tp, what="attention heads")
        self.attn = PagedLatentAttention(mla.kv_lora_rank, softmax_scale(config))

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.mla.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        mla, tokens = self.mla, x.shape[0]
        q = self._queries(x)
        # -1 heads: the local head count follows the (possibly head-sharded) weights.
        q_nope, q_rot = q.view(tokens, -1, mla.qk_head_dim).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], -1
        )
        c, k_rot = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], -1)
        c = self.kv_a_layernorm(c)
        k_rot = k_rot[:, None, :]
        if mla.rope_interleave:
            q_rot, k_rot = _deinterleave(q_rot), _deinterleave(k_rot)
        q_rot, k_rot = apply_rotary(q_rot, cos, sin), apply_rotary(k_rot, cos, sin)

        # kv_b_proj rows are [head][nope | v]; split into the per-head up-projections of c.
        w_kv = self.kv_b_proj.weight.view(-1, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        w_uk, w_uv = w_kv[:, : mla.qk_nope_head_dim], w_kv[:, mla.qk_nope_head_dim :]
        q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk)
        latent = torch.cat((c, k_rot[:, 0]), dim=-1)
        out = self.attn(q_latent, q_rot, latent, meta)
        out = torch.einsum("thl,hvl->thv", out, w_uv)
        return self.o_proj(out.reshape(tokens, -1))


class DenseMLP(nn.Module):
    """SwiGLU, its channels cut over ``tp``; ``reduce=False`` returns this rank's partial sum."""

    def __init__(
        self, hidden: int, inner: int, tp: TensorParallelRank = SINGLE_RANK, reduce: bool = True
    ) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear.by_units(hidden, inner, 1, tp, what="MLP channels")
        self.up_proj = ColumnParallelLinear.by_units(hidden, inner, 1, tp, what="MLP channels")
        self.down_proj = RowParallelLinear.by_units(inner, 1, hidden, tp, reduce=reduce, what="MLP channels")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Grouped top-k routing: pick ``topk_group`` expert groups, then ``top_k`` experts inside them.

    Routing runs in fp32 on every rank (the weights are replicated), so all
    expert-parallel ranks agree on every token's experts.
    """

    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.n_routed_experts, hidden))
        if moe.topk_method == "noaux_tc":
            # Load-balancing bias: shifts which experts are chosen, never the weights they get.
            # A parameter (frozen) so the loader fills it; kept fp32 by the model (see keep_fp32_).
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(moe.n_routed_experts), requires_grad=False
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (weights [T, top_k] fp32, expert ids [T, top_k])."""
        moe = self.moe
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if moe.scoring_func == "sigmoid" else logits.softmax(dim=-1)
        choice = scores
        if moe.topk_method == "noaux_tc":
            choice = scores + self.e_score_correction_bias.float()
        if moe.topk_method != "greedy" and moe.n_group > 1:
            choice = self._mask_unselected_groups(choice)
        ids = choice.topk(moe.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        if moe.num_experts_per_tok > 1 and moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling_factor, ids

    def _mask_unselected_groups(self, choice: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        grouped = choice.view(choice.shape[0], moe.n_group, -1)
        if moe.topk_method == "noaux_tc":
            # V3: a group scores the sum of its two best (bias-corrected) experts.
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values  # V2's group_limited_greedy
        keep = group_scores.topk(moe.topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        return grouped.masked_fill(~group_mask[..., None], float("-inf")).view_as(choice)


class MoE(nn.Module):
    """Routed experts (this rank's share) plus shared experts that every token passes through.

    The layer's work is split over the tensor-parallel replica's ranks (or none, on a
    single rank), which expert parallelism reuses. Routed experts go whole
    to the ranks (``expert_parallel.size > 1``) or are each cut by channels (size 1);
    shared experts are cut by channels. Every rank's output is then a partial sum, and
    one all-reduce per layer completes it.
    """

    def __init__(
        self, config: ModelConfig, expert_parallel: ExpertParallel, tp: TensorParallelRank = SINGLE_RANK
    ) -> None:
        super().__init__()
        moe: MoEConfig = config.moe  # type: ignore[assignment]
        if expert_parallel.size not in (1, tp.size):
            raise ValueError(
                f"{expert_parallel.size} expert-parallel ranks inside {tp.size} tensor-parallel "
                "ranks: expert parallelism must span the replica's ranks or none"
            )
        self.top_k = moe.num_experts_per_tok
        self.num_experts = moe.n_routed_experts
        self.expert_parallel = expert_parallel
        self.group = tp
        self.gate = Router(config.hidden_size, moe)
        # The sum over the group is the layer's (forward), so no expert's down_proj reduces.
        expert_split = self.group if expert_parallel.size == 1 else SINGLE_RANK
        # Keyed by global expert id, so parameter names equal checkpoint names on every rank.
        self.experts = nn.ModuleDict(
            {
                str(j): _routed_expert(config, expert_split)
                for j in expert_parallel.local_experts(moe.n_routed_experts)
            }
        )
        self.shared_experts = (
            DenseMLP(
                config.hidden_size,
                moe.moe_intermediate_size * moe.n_shared_experts,
                self.group,
                reduce=False,
            )
            if moe.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self._routed(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.group.all_reduce_(out)

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        flat = ids.flatten()
        # Sort the (token, slot) pairs by expert once, then each expert reads one contiguous run.
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        flat_weights = weights.flatten()
        for key, expert in self.experts.items():
            j = int(key)
            if counts[j] == 0:
                continue
            pairs = order[starts[j] : starts[j + 1]]
            tokens = pairs // self.top_k
            y = expert(x[tokens]) * flat_weights[pairs, None].to(x.dtype)
            out.index_add_(0, tokens, y)
        return out


class Int4MLP(nn.Module):
    """A routed expert kept in its checkpoint's INT4 form (whole on this rank)."""

    def __init__(self, hidden: int, inner: int, group_size: int | None) -> None:
        super().__init__()
        self.gate_proj = Int4Linear(hidden, inner, group_size or hidden)
        self.up_proj = Int4Linear(hidden, inner, group_size or hidden)
        self.down_proj = Int4Linear(inner, hidden, group_size or inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _routed_expert(config: ModelConfig, expert_split: TensorParallelRank) -> nn.Module:
    moe: MoEConfig = config.moe  # type: ignore[assignment]
    hidden, inner = config.hidden_size, moe.moe_intermediate_size
    packed = config.quantization
    if (
        isinstance(packed, PackedIntQuantization)
        and packed.keep_packed
        and packed.num_bits == 4
        # Experts cut by channels would cut packed words and scale groups: those dequantize.
        and expert_split.size == 1
        and int4_kernel_fits(hidden, inner, packed.group_size or hidden)
        and int4_kernel_fits(inner, hidden, packed.group_size or inner)
    ):
        return Int4MLP(hidden, inner, packed.group_size)
    return DenseMLP(hidden, inner, expert_split, reduce=False)


def _mlp(
    config: ModelConfig, layer: int, tp: TensorParallelRank, expert_parallel: ExpertParallel
) -> nn.Module:
    moe: MoEConfig = config.moe  # type: ignore[assignment]
    if moe.is_moe_layer(layer):
        return MoE(config, expert_parallel, tp)
    return DenseMLP(config.hidden_size, config.intermediate_size, tp)


class DeepseekV3ForCausalLM(CausalLM):
    """``expert_parallel`` defaults to what a tensor-parallel replica chose
    (``tp.expert_parallel_size``: whole experts over its ranks, or every expert cut by
    channels), else to one rank holding every expert."""

    # Routing reads each expert's token count on the host (``_routed``), which a CUDA graph
    # cannot record; decode steps run eagerly.
    supports_cuda_graphs = False
    # The MLA cache holds one latent per token, not per-head K and V: the CPU paged decode
    # kernel does not read that layout, so decodes take the gather path.
    supports_paged_decode_kernel = False

    def __init__(
        self,
        config: ModelConfig,
        tp: TensorParallelRank = SINGLE_RANK,
        expert_parallel: ExpertParallel | None = None,
    ) -> None:
        if config.mla is None or config.moe is None:
            raise ValueError(f"model_type {config.model_type!r} has no MLA/MoE settings")
        if expert_parallel is None:
            expert_parallel = ExpertParallel.within(tp) if tp.size > 1 else ExpertParallel()
        layers = (
            DecoderLayer(config, MLAttention(config, tp), _mlp(config, i, tp, expert_parallel))
            for i in range(config.num_hidden_layers)
        )
        # RoPE covers only the shared rotary slice of each head.
        super().__init__(config, DecoderModel(config, layers, config.mla.qk_rope_head_dim, tp), tp)
        # Kimi K2.5's image encoder (None for a text-only checkpoint); the runner calls it per image.
        # Replicated, not sliced, on every tensor-parallel rank: it is small next to the experts.
        self.vision_tower = KimiVisionTower(config.vision) if config.vision is not None else None
        self.expert_parallel = expert_parallel
        self._local_experts = set(expert_parallel.local_experts(config.moe.n_routed_experts))

    def keep_fp32_(self) -> None:
        """Undo the serving-dtype cast where it would change routing: the bias separates experts
        whose scores differ in the third digit, below bf16's resolution."""
        for module in self.modules():
            if isinstance(module, Router) and hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.data = module.e_score_correction_bias.data.float()

    def skip_checkpoint_tensor(self, name: str) -> bool:
        """Checkpoint tensors this rank's model deliberately lacks: other ranks' experts, and
        DeepSeek-V3's multi-token-prediction layers stored past ``num_hidden_layers``."""
        layer = _LAYER_INDEX.match(name)
        if layer is not None and int(layer.group(1)) >= self.config.num_hidden_layers:
            return True
        expert = _EXPERT_INDEX.match(name)
        return expert is not None and int(expert.group(1)) not in self._local_experts

    def kv_cache_shape_per_token(self) -> tuple[int, ...]:
        """One latent per token per layer, shared by all heads (instead of K and V per KV head).
        Whole on every rank: each rank's heads attend over all of it."""
        assert self.config.mla is not None
        return (self.config.mla.latent_dim,)


__all__ = ["DeepseekV3ForCausalLM", "Int4MLP", "MLAttention", "MoE", "Router", "softmax_scale"]
