"""Paged attention over a block-structured KV cache, for a whole step at once.

The cache of one layer is one tensor ``[2, num_blocks, block_size, num_kv_heads,
head_dim]`` (K then V). A token at position ``p`` of a request lives in slot
``block_ids[p // block_size] * block_size + p % block_size``; the block table is
owned by the scheduler's KV cache manager, the runner only follows it.

A step mixes prefill chunks (many queries, causal against the request's cached
prefix) and decode tokens (one query each). Requests are attended in groups, one
``scaled_dot_product_attention`` call each: every request's K/V is gathered
through its block table (one ``index_select`` of whole blocks) into a
``[batch, max_kv_len]`` tensor. Decodes and prefill chunks are separate groups:
padding a batch of decodes to a 512-token prefill chunk's query length would
waste ~all of that call's work. Decodes are further cut by context length
(``_decode_buckets``), so a step's attention reads about the context its requests
hold, not ``batch x`` the longest one.

A decode's query heads are laid out by the KV head they share (``[batch,
kv_heads, group, head_dim]``), so grouped-query attention reads each KV head once
rather than repeating it for every query head that uses it.

On a CPU, decodes skip the gather: ``paged_decode_kernel`` reads each request's blocks in
place, all decodes of a step in one call whatever their lengths (``decode_in_place``). In fp32
on an AVX-512 or AVX2 host, and in bf16 on an AMX host, prompt chunks do too, through
``prefill_attention_kernel`` (flash attention's shape: ``prefill_kernel``). The gather + SDPA
path stays as the reference, for the prefill chunks no kernel takes, and for CUDA (whose decode
steps are CUDA graphs).

Batch-invariant steps (``every_token_in_place``) send prefill tokens through the same kernel,
each as a query of its own that sees the keys up to its position: a token's attention is then
one fixed sum over its keys (256-key pieces from position 0, merged in order) whether it is
computed in a prompt chunk, as a decode, or beside other requests, so greedy decoding gives
the same tokens cold, from the prefix cache and in any batch. SDPA's prefill kernel picks its
pieces by the call's lengths, so the same token's sum is ordered differently from call to call.
Where the kernel has AVX512-BF16 dot products for a bf16 cache and the prompt kernel no AMX
path, every step lays its tokens out so (the model runner's ``prefill_in_place``): a prompt
chunk attends there in about half of SDPA's time, before counting SDPA's gather. So does an fp32 cache on an AVX2 build where the fp32 prompt
kernel has no tile for the heads (Gemma 3's 256-dim heads, its sliding layers read by their
window): the paged kernel's prompt tiles take register tiles there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from cachet.engine.cpu_features import cpu_has_native_bf16
from cachet.engine.paged_decode_kernel import paged_decode_attention
from cachet.engine.prefill_attention_kernel import prefill_attention

# A decode joins a group of longer ones only while padding it to their length costs fewer
# keys than this; past it a call of its own is cheaper. A call's fixed cost on a CPU (a
# dozen small operators, ~0.1-0.2 ms) is about what gathering and attending a thousand
# keys costs, and padded keys cost as much as real ones.
DECODE_PADDING_LIMIT_TOKENS = 1024

# cuDNN's SDPA builds an execution plan per shape on the host, and an eager decode's key
# length is new every step: measured 2.5 ms of CPU per call on an H100 (75 ms of a 30-layer
# step, for 7 us of GPU work). Where a step's shapes are fixed (a CUDA graph's: the plan is
# built once, at capture) cuDNN is the fastest kernel for decodes: measured on an H100 in
# graphs, 3 KV heads x 3 queries, bf16: 2048 keys 38 us vs 105 (memory-efficient), batch 64
# x 4096 keys 131 us vs 261.
_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_CUDA_FIXED_SHAPE_SDPA_BACKENDS = [SDPBackend.CUDNN_ATTENTION, *_CUDA_SDPA_BACKENDS]


@dataclass
class AttentionGroup:
    """Requests attended in one SDPA call; tensors live on the model's device."""

    # [n] indices into the step's flat token axis, and where each lands in the
    # group's padded [batch * max_query_len] query layout.
    token_index: torch.Tensor
    padded_index: torch.Tensor
    # [batch, max_kv_len // block_size rounded up] block ids, padded with block 0.
    block_table: torch.Tensor
    # [batch] keys each request attends: its cached tokens and this step's.
    seq_lens: torch.Tensor
    # [batch, 1, max_query_len, max_kv_len]: True where a query may see a key; None where
    # every query sees every key (decodes of one context length), or where the group's decodes
    # read the cache in place (their lengths are ``seq_lens``).
    mask: torch.Tensor | None
    batch_size: int
    max_query_len: int
    max_kv_len: int
    # One request whose every key is this step's (a prompt's first chunk, nothing cached): its
    # mask is the plain causal one, and SDPA told so skips the masked half instead of computing
    # and masking it (73 -> 35 ms a layer for a 1,800-token prompt on two CPU cores).
    causal: bool = False
    # Its rows are the step's tokens 0..n-1 in order (``token_index`` is ``arange(n)``): attention
    # reads q[:n] and writes out[:n] as they are, with no gather or scatter.
    leads_step: bool = False
    # [batch] this step's tokens of each request (its newest ones); None for per-token groups.
    query_lens: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Built once per step by the runner, shared by every layer."""

    # [T] cache slot of each new token.
    slot_mapping: torch.Tensor
    # [T] total length (cached + this step) of the request each token belongs to;
    # dynamic-NTK RoPE scales by it.
    token_seq_lens: torch.Tensor
    groups: list[AttentionGroup]
    # [S] flat token indices whose logits are needed, in request order.
    sample_indices: torch.Tensor
    # True where every shape of the step is fixed in advance (a captured CUDA graph's).
    fixed_shapes: bool = False
    # Decode groups read the KV cache in place (``paged_decode_kernel``), not through a gather.
    decode_in_place: bool = False
    # Prefill groups do, through the fp32 prompt kernel (``prefill_attention_kernel``), in layers
    # without a sliding window.
    prefill_kernel: bool = False
    # A padded step whose work between attention calls runs as graphs (``piecewise_graphs``):
    # each layer's attention hands (itself, q, k, v) here instead of attending, and returns what
    # this gives back. The step runs attention itself, outside the graphs.
    split_at: Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None


@dataclass(frozen=True)
class SequenceSpan:
    """One request's part of a step: ``num_computed`` cached tokens, then ``num_new`` to compute."""

    num_computed: int
    num_new: int
    block_ids: list[int]
    sample: bool


def build_attention_metadata(
    spans: list[SequenceSpan],
    block_size: int,
    device: torch.device,
    *,
    decode_in_place: bool = False,
    every_token_in_place: bool = False,
    prefill_kernel: bool = False,
) -> AttentionMetadata:
    """Lay out the flat token axis in ``spans`` order and group requests for attention.

    ``decode_in_place``: the step's decodes form one group read through the paged decode
    kernel (no padding, so no cut by length and no mask). ``every_token_in_place``: every
    token of the step does, prefill tokens too (batch-invariant steps; needs the kernel).
    ``prefill_kernel``: prefill groups go through the fp32 prompt kernel (``PagedAttention``).

    Index lists are built as Python ints and become one tensor each: a handful of small
    tensor ops per request cost ~70 us apiece, which at 32 decoding requests was a few
    milliseconds of every step, more than the model's own layers on a small model.
    """
    starts: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    sample: list[int] = []
    offset = 0
    for span in spans:
        starts.append(offset)
        end = span.num_computed + span.num_new
        needed = -(-end // block_size)
        if len(span.block_ids) < needed:
            raise ValueError(f"span of {end} tokens needs {needed} blocks, has {len(span.block_ids)}")
        blocks = span.block_ids
        slots.extend(
            blocks[p // block_size] * block_size + p % block_size for p in range(span.num_computed, end)
        )
        seq_lens.extend([end] * span.num_new)
        offset += span.num_new
        if span.sample:
            # The last token of a span is the one whose logits predict the next token.
            sample.append(offset - 1)
    if every_token_in_place:
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            token_seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            groups=[_per_token_group(spans, block_size, device)] if spans else [],
            sample_indices=torch.tensor(sample, dtype=torch.int64, device=device),
            decode_in_place=True,
        )
    decode = [i for i, s in enumerate(spans) if s.num_new == 1]
    prefill = [i for i, s in enumerate(spans) if s.num_new > 1]
    decode_groups = [decode] if decode_in_place else _decode_buckets(spans, decode)
    # (members, needs a mask): decodes read in place take their lengths from seq_lens instead.
    layout = [(members, not decode_in_place) for members in decode_groups] + [(prefill, True)]
    groups = [
        _build_group(
            [spans[i] for i in members], [starts[i] for i in members], block_size, device, masked=masked
        )
        for members, masked in layout
        if members
    ]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        token_seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        groups=groups,
        sample_indices=torch.tensor(sample, dtype=torch.int64, device=device),
        decode_in_place=decode_in_place,
        prefill_kernel=prefill_kernel,
    )


def _decode_buckets(spans: list[SequenceSpan], decode: list[int]) -> list[list[int]]:
    """Decodes cut into groups of similar context length, longest first: a request joins the
    current group while padding it to the group's longest costs at most
    ``DECODE_PADDING_LIMIT_TOKENS`` keys."""
    by_length = sorted(decode, key=lambda i: spans[i].num_computed + 1, reverse=True)
    buckets: list[list[int]] = []
    longest = 0
    for i in by_length:
        length = spans[i].num_computed + 1
        if not buckets or longest - length > DECODE_PADDING_LIMIT_TOKENS:
            buckets.append([])
            longest = length
        buckets[-1].append(i)
    return buckets


def _per_token_group(spans: list[SequenceSpan], block_size: int, device: torch.device) -> AttentionGroup:
    """Every token of the step as a one-query row that sees its request's keys up to its own
    position, read in place by the paged decode kernel."""
    max_blocks = max(-(-(s.num_computed + s.num_new) // block_size) for s in spans)
    # One row per request, repeated for its tokens as a tensor: a chunk's rows as Python lists
    # cost 5.6 ms a step at 1,800 tokens of context and 90 ms at 32,000.
    table: list[list[int]] = []
    seq_lens: list[int] = []
    for span in spans:
        needed = -(-(span.num_computed + span.num_new) // block_size)
        table.append(span.block_ids[:needed] + [0] * (max_blocks - needed))
        seq_lens.extend(range(span.num_computed + 1, span.num_computed + span.num_new + 1))
    tokens = torch.arange(len(seq_lens), dtype=torch.int64, device=device)
    repeats = torch.tensor([span.num_new for span in spans], dtype=torch.int64, device=device)
    return AttentionGroup(
        token_index=tokens,
        padded_index=tokens,
        leads_step=True,
        block_table=torch.tensor(table, dtype=torch.int64, device=device).repeat_interleave(repeats, dim=0),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        mask=None,
        batch_size=len(seq_lens),
        max_query_len=1,
        max_kv_len=max(seq_lens),
    )


def _build_group(
    spans: list[SequenceSpan], starts: list[int], block_size: int, device: torch.device, *, masked: bool
) -> AttentionGroup:
    batch = len(spans)
    max_q = max(s.num_new for s in spans)
    max_kv = max(s.num_computed + s.num_new for s in spans)
    max_blocks = -(-max_kv // block_size)
    table: list[list[int]] = []
    token_index: list[int] = []
    padded_index: list[int] = []
    for row, (start, span) in enumerate(zip(starts, spans, strict=True)):
        needed = -(-(span.num_computed + span.num_new) // block_size)
        table.append(span.block_ids[:needed] + [0] * (max_blocks - needed))
        token_index.extend(range(start, start + span.num_new))
        padded_index.extend(range(row * max_q, row * max_q + span.num_new))
    query_lens = torch.tensor([s.num_new for s in spans])
    computed = torch.tensor([s.num_computed for s in spans])
    # Query row i of a request sits at absolute position computed + i and sees keys 0..that position.
    # Padding rows (i >= query_len) would see past the request's end; capping at seq_len - 1
    # keeps them finite (their output is dropped) and never lets real rows see stale slots.
    q_pos = computed[:, None] + torch.arange(max_q)[None, :]
    q_pos = torch.minimum(q_pos, (computed + query_lens - 1)[:, None])
    mask = None
    if masked and (max_q > 1 or int(computed.min()) + 1 < max_kv):
        mask = (torch.arange(max_kv)[None, None, :] <= q_pos[:, :, None])[:, None].to(device)
    return AttentionGroup(
        token_index=torch.tensor(token_index, dtype=torch.int64, device=device),
        padded_index=torch.tensor(padded_index, dtype=torch.int64, device=device),
        block_table=torch.tensor(table, dtype=torch.int64, device=device),
        seq_lens=(computed + query_lens).to(device),
        mask=mask,
        batch_size=batch,
        max_query_len=max_q,
        max_kv_len=max_kv,
        causal=mask is not None and batch == 1 and max_q == max_kv,
        leads_step=token_index == list(range(len(token_index))),
        query_lens=query_lens.to(device),
    )


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """One tensor for all layers: ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``.

    Zeroed rather than empty: padded gathers read unused slots, and uninitialised
    memory could hold NaNs, which a masked-out score does not neutralise.
    """
    return torch.zeros(
        num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
    )


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize


class PagedAttention(nn.Module):
    """Writes the step's new K/V into the cache, then attends every query of the step.

    ``kv_cache`` is bound by the model runner (a view of this layer's slice of the
    preallocated cache); it is a plain attribute, not a buffer, so it stays out of
    state dicts and out of DeepSpeed's parameter sharding.
    """

    def __init__(self, window: int = 0) -> None:
        super().__init__()
        self._kv_cache: torch.Tensor | None = None
        # The bound cache's views: K's and V's caches, then the same as one row per token slot
        # ([slots, kv_heads, head_dim]), where a step's new K and V land. Taken once, when the
        # cache is bound, rather than in every layer of every step (with casts that changed
        # nothing, they took 23 us of a decode layer's 61-us attention call beside a 25-us
        # kernel, on a Zen 3).
        self._views: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # A sliding-window layer's: the kernel reads a token's last ``window`` keys only; groups
        # attended by SDPA come with the band in their mask (``models.sliding_window``).
        self.window = window

    @property
    def kv_cache(self) -> torch.Tensor | None:
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, kv_cache: torch.Tensor | None) -> None:
        self._kv_cache = kv_cache
        if kv_cache is None:
            self._views = None
            return
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        per_slot = (-1, *k_cache.shape[-2:])
        self._views = (k_cache, v_cache, k_cache.view(per_slot), v_cache.view(per_slot))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]. Returns [T, Hq, D]."""
        if meta.split_at is not None:
            return meta.split_at(self, q, k, v)
        if self._views is None:
            raise RuntimeError("PagedAttention has no KV cache bound; the model runner binds it")
        k_cache, v_cache, k_slots, v_slots = self._views
        k_slots.index_copy_(0, meta.slot_mapping, _as_dtype(k, k_cache.dtype))
        v_slots.index_copy_(0, meta.slot_mapping, _as_dtype(v, v_cache.dtype))
        in_place = [meta.decode_in_place and group.max_query_len == 1 for group in meta.groups]
        if len(meta.groups) == 1 and in_place[0] and meta.groups[0].leads_step:
            # Every token of the step, in order (a decode step, or every token read in place).
            return self._attend_in_place(q, k_cache, v_cache, meta.groups[0])
        in_kernel = [
            meta.prefill_kernel
            and self.window == 0
            and group.query_lens is not None
            and group.max_query_len > 1
            for group in meta.groups
        ]
        if len(meta.groups) == 1 and in_kernel[0] and meta.groups[0].leads_step:
            # A step of prompt chunks only.
            return self._attend_prompts(q, k_cache, v_cache, meta.groups[0])
        out = torch.empty_like(q)
        for group, group_in_place, group_in_kernel in zip(meta.groups, in_place, in_kernel, strict=True):
            if group_in_place:
                out[group.token_index] = self._attend_in_place(q[group.token_index], k_cache, v_cache, group)
            elif group_in_kernel:
                out[group.token_index] = self._attend_prompts(q[group.token_index], k_cache, v_cache, group)
            else:
                out[group.token_index] = _attend_group(q, k_cache, v_cache, group, meta.fixed_shapes)
        return out

    def _attend_in_place(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: AttentionGroup
    ) -> torch.Tensor:
        """The group's queries (``q``: one row each, in the group's order) through the paged
        decode kernel, which reads K and V from their blocks."""
        head_dim = k_cache.shape[-1]
        attended = paged_decode_attention(
            _as_dtype(q, k_cache.dtype),
            k_cache,
            v_cache,
            group.block_table,
            group.seq_lens,
            head_dim**-0.5,
            self.window,
        )
        return _as_dtype(attended, q.dtype)

    def _attend_prompts(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: AttentionGroup
    ) -> torch.Tensor:
        """The group's prompt chunks (``q``: their tokens, in the group's order) through the
        prompt kernel, which reads K and V from their blocks."""
        assert group.query_lens is not None  # prefill groups carry them
        attended = prefill_attention(
            _as_dtype(q, k_cache.dtype),
            k_cache,
            v_cache,
            group.block_table,
            group.seq_lens,
            group.query_lens,
            k_cache.shape[-1] ** -0.5,
        )
        return _as_dtype(attended, q.dtype)


def _as_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # ``Tensor.to`` returns the tensor itself when nothing changes, after a trip through the
    # dispatcher that cost more than the comparison, four times a layer.
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def _attend_group(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: AttentionGroup, fixed_shapes: bool
) -> torch.Tensor:
    keys = _gather(k_cache, group.block_table, group.max_kv_len)
    values = _gather(v_cache, group.block_table, group.max_kv_len)
    grouped = group.max_query_len == 1
    if grouped:
        query = _grouped_decode_queries(q[group.token_index], keys.shape[1])
    else:
        query = _padded_queries(q, group)
    if q.device.type == "cpu" and q.dtype != torch.float32 and not cpu_has_native_bf16():
        # CPUs without native bf16 (AVX2 hosts) run SDPA in bf16 ~3.5x slower than in fp32 for
        # decode (measured: 1 query x 1800 keys, 2.5 ms vs 0.7 ms with the casts) and no faster
        # for prefill; the casts cost less than the difference. With native bf16 the casts are
        # the cost (AVX512-BF16 EPYC, 2 threads: 1 x 7,500 keys 1.43 ms with them, 1.00 without;
        # 16 masked decodes x 3,800 keys 59 ms, 11.6 without).
        query, keys, values = query.float(), keys.float(), values.float()
    out = scaled_dot_product_attention(
        query,
        keys,
        values,
        None if group.causal else group.mask,
        is_causal=group.causal,
        enable_gqa=not grouped,
        fixed_shapes=fixed_shapes,
    )
    num_heads, head_dim = q.shape[1:]
    if grouped:
        return out.reshape(group.batch_size, num_heads, head_dim).to(q.dtype)
    out = out.transpose(1, 2).reshape(group.batch_size * group.max_query_len, num_heads, head_dim)
    return out[group.padded_index].to(q.dtype)


def scaled_dot_product_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    enable_gqa: bool = False,
    fixed_shapes: bool = False,
) -> torch.Tensor:
    """PyTorch's SDPA; on CUDA, cuDNN only where the shapes are fixed (``_CUDA_SDPA_BACKENDS``)."""
    if query.device.type != "cuda":
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=scale, is_causal=is_causal, enable_gqa=enable_gqa
        )
    backends = _CUDA_FIXED_SHAPE_SDPA_BACKENDS if fixed_shapes else _CUDA_SDPA_BACKENDS
    with sdpa_kernel(backends, set_priority=True):
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=scale, is_causal=is_causal, enable_gqa=enable_gqa
        )


def _grouped_decode_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[batch, Hq, D] -> [batch, Hkv, Hq / Hkv, D]: query head h reads KV head h // group, so
    each KV head's queries sit together and attend it as one short query block."""
    batch, num_heads, head_dim = q.shape
    return q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)


def _padded_queries(q: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """The group's queries in a [batch, Hq, max_query_len, D] layout, padded with zeros."""
    num_heads, head_dim = q.shape[1:]
    padded = q.new_zeros(group.batch_size * group.max_query_len, num_heads, head_dim)
    padded[group.padded_index] = q[group.token_index]
    return padded.view(group.batch_size, group.max_query_len, num_heads, head_dim).transpose(1, 2)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, max_kv: int) -> torch.Tensor:
    """[num_blocks, block_size, H, D] through [B, nb] -> [B, H, max_kv, D] (a view of one copy).

    ``index_select`` of whole blocks: advanced indexing (``cache[block_table]``) measured 3-4x
    slower for the same copy on a CPU."""
    batch, num_blocks = block_table.shape
    block_size, num_heads, head_dim = cache.shape[1:]
    gathered = cache.index_select(0, block_table.flatten())
    return gathered.view(batch, num_blocks * block_size, num_heads, head_dim)[:, :max_kv].transpose(1, 2)
