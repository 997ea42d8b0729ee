"""Paged attention against a dense per-request reference, with scattered block tables."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cachet.engine import attention
from cachet.engine.attention import (
    PagedAttention,
    SequenceSpan,
    allocate_kv_cache,
    build_attention_metadata,
    kv_cache_bytes_per_block,
)
from cachet.engine.models.config import ModelConfig
from cachet.engine.models.llama import Attention, RotaryEmbedding
from cachet.engine.tensor_parallel import TensorParallelRank

torch.set_num_threads(1)

HQ, HKV, D, BS = 4, 2, 8, 4


def test_slot_mapping_follows_block_table() -> None:
    spans = [
        SequenceSpan(num_computed=0, num_new=6, block_ids=[7, 2], sample=True),
        SequenceSpan(num_computed=5, num_new=1, block_ids=[3, 9], sample=True),
        SequenceSpan(num_computed=2, num_new=3, block_ids=[4, 1, 8], sample=False),
    ]
    meta = build_attention_metadata(spans, BS, torch.device("cpu"))
    # Request 0: positions 0..5 -> block 7 slots 28..31, block 2 slots 8, 9.
    # Request 1: position 5 -> block 9, offset 1. Request 2: positions 2..4 -> block 4 (18, 19), block 1 (4).
    assert meta.slot_mapping.tolist() == [28, 29, 30, 31, 8, 9, 37, 18, 19, 4]
    assert meta.sample_indices.tolist() == [5, 6]
    assert meta.token_seq_lens.tolist() == [6] * 6 + [6] + [5] * 3
    decode, prefill = meta.groups
    assert decode.token_index.tolist() == [6] and decode.max_kv_len == 6
    assert prefill.token_index.tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 9]
    assert prefill.max_query_len == 6 and prefill.max_kv_len == 6
    assert prefill.block_table.tolist() == [[7, 2], [4, 1]]


def test_span_without_enough_blocks_is_rejected() -> None:
    with pytest.raises(ValueError, match="needs 2 blocks"):
        build_attention_metadata([SequenceSpan(3, 2, [0], sample=True)], BS, torch.device("cpu"))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_computed: int) -> torch.Tensor:
    """q: [n, HQ, D] for positions num_computed.., k/v: [num_computed + n, HKV, D]: plain causal GQA."""
    n, total = q.shape[0], k.shape[0]
    mask = (torch.arange(total)[None, :] <= (num_computed + torch.arange(n))[:, None]).to(q.device)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(HQ // HKV, 1).transpose(0, 1),
        v.repeat_interleave(HQ // HKV, 1).transpose(0, 1),
        attn_mask=mask,
    )
    return out.transpose(0, 1)


# (cached prefix length, new tokens, block ids): a fresh prefill, a chunk over a cached
# prefix, two decodes, one of them right at a block boundary; block ids deliberately scattered.
MIXED_STEP = [(0, 7, [5, 11]), (6, 5, [20, 3, 14]), (9, 1, [1, 30, 8]), (4, 1, [16, 9])]


def run_step(
    device: torch.device,
    dtype: torch.dtype,
    atol: float,
    layout: list[tuple[int, int, list[int]]] = MIXED_STEP,
    decode_in_place: bool = False,
) -> None:
    torch.manual_seed(0)
    num_blocks = 32
    cache = allocate_kv_cache(1, num_blocks, BS, HKV, D, dtype, device)[0]
    attn = PagedAttention()
    attn.kv_cache = cache
    full_k = [torch.randn(c + n, HKV, D, device=device, dtype=dtype) for c, n, _ in layout]
    full_v = [torch.randn(c + n, HKV, D, device=device, dtype=dtype) for c, n, _ in layout]
    # Write each cached prefix as an earlier step would have.
    flat_k, flat_v = cache[0].view(-1, HKV, D), cache[1].view(-1, HKV, D)
    for (c, _, blocks), k, v in zip(layout, full_k, full_v, strict=True):
        for pos in range(c):
            slot = blocks[pos // BS] * BS + pos % BS
            flat_k[slot], flat_v[slot] = k[pos], v[pos]
    spans = [SequenceSpan(c, n, blocks, sample=True) for c, n, blocks in layout]
    meta = build_attention_metadata(spans, BS, device, decode_in_place=decode_in_place)
    q = [torch.randn(n, HQ, D, device=device, dtype=dtype) for _, n, _ in layout]
    new_k = torch.cat([k[c:] for (c, _, _), k in zip(layout, full_k, strict=True)])
    new_v = torch.cat([v[c:] for (c, _, _), v in zip(layout, full_v, strict=True)])
    out = attn(torch.cat(q), new_k, new_v, meta)
    expected = torch.cat(
        [
            reference(qi.float(), k.float(), v.float(), c)
            for (c, _, _), qi, k, v in zip(layout, q, full_k, full_v, strict=True)
        ]
    )
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=0)
    # New K/V landed in their slots.
    for (c, n, blocks), k in zip(layout, full_k, strict=True):
        for pos in range(c, c + n):
            assert torch.equal(flat_k[blocks[pos // BS] * BS + pos % BS], k[pos])


@pytest.mark.parametrize("decode_in_place", [False, True], ids=["gather", "in-place"])
def test_paged_attention_matches_dense_reference_cpu(decode_in_place: bool) -> None:
    run_step(torch.device("cpu"), torch.float32, atol=1e-5, decode_in_place=decode_in_place)


@pytest.mark.parametrize("decode_in_place", [False, True], ids=["gather", "in-place"])
def test_paged_attention_bf16_cpu(decode_in_place: bool) -> None:
    run_step(torch.device("cpu"), torch.bfloat16, atol=3e-2, decode_in_place=decode_in_place)


def test_decodes_read_in_place_form_one_unmasked_group() -> None:
    """Read in place, decodes of any lengths share one call: no padding, so no mask."""
    layout = [(12, 1, [2, 7, 9, 4]), (0, 3, [5]), (4, 1, [16, 0]), (9, 1, [1, 30, 8])]
    spans = [SequenceSpan(c, n, b, sample=True) for c, n, b in layout]
    decode, prefill = build_attention_metadata(spans, BS, torch.device("cpu"), decode_in_place=True).groups
    assert decode.token_index.tolist() == [0, 4, 5] and decode.mask is None
    assert decode.seq_lens.tolist() == [13, 5, 10]
    assert prefill.token_index.tolist() == [1, 2, 3] and prefill.mask is not None
    run_step(torch.device("cpu"), torch.float32, atol=1e-5, layout=layout, decode_in_place=True)


def test_decodes_are_grouped_by_context_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decodes far apart in length get calls of their own; equal lengths share one without a mask."""
    monkeypatch.setattr(attention, "DECODE_PADDING_LIMIT_TOKENS", 2)
    layout = [
        (12, 1, [2, 7, 9, 4]),
        (4, 1, [16, 0]),
        (9, 1, [1, 30, 8]),
        (4, 1, [6, 5]),
        (10, 1, [3, 10, 11]),
    ]
    meta = build_attention_metadata(
        [SequenceSpan(c, n, b, sample=True) for c, n, b in layout], BS, torch.device("cpu")
    )
    # Longest first: 13 and 11 keys share a call (2 padded keys), 10 its own, the two 5s one unmasked.
    assert [g.token_index.tolist() for g in meta.groups] == [[0, 4], [2], [1, 3]]
    assert [g.max_kv_len for g in meta.groups] == [13, 10, 5]
    assert meta.groups[0].mask is not None and meta.groups[2].mask is None
    run_step(torch.device("cpu"), torch.float32, atol=1e-5, layout=layout)
    run_step(torch.device("cpu"), torch.float32, atol=1e-5, layout=[(4, 1, [12, 13]), *MIXED_STEP])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_dense_reference_cuda(dtype: torch.dtype) -> None:
    run_step(torch.device("cuda"), dtype, atol=1e-4 if dtype == torch.float32 else 3e-2)


def test_unbound_cache_is_an_error() -> None:
    meta = build_attention_metadata([SequenceSpan(0, 1, [0], sample=True)], BS, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="no KV cache"):
        PagedAttention()(torch.zeros(1, HQ, D), torch.zeros(1, HKV, D), torch.zeros(1, HKV, D), meta)


def test_cache_size_accounting() -> None:
    cache = allocate_kv_cache(3, 5, BS, HKV, D, torch.bfloat16, torch.device("cpu"))
    assert cache.shape == (3, 2, 5, BS, HKV, D)
    per_block = kv_cache_bytes_per_block(3, BS, HKV, D, torch.bfloat16)
    assert per_block * 5 == cache.numel() * cache.element_size()


def test_attention_infers_local_heads_from_sharded_weights() -> None:
    """Split heads over two 'ranks' the way the tensor-parallel layers do; the partial outputs sum to the whole."""
    config = ModelConfig.from_dict(
        dict(
            model_type="llama",
            vocab_size=8,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    torch.manual_seed(0)
    full = Attention(config)
    spans = [SequenceSpan(0, 5, [0, 1], sample=True), SequenceSpan(0, 3, [2], sample=True)]
    meta = build_attention_metadata(spans, BS, torch.device("cpu"))
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    cos, sin = RotaryEmbedding(16, config.rope, 64)(positions, meta.token_seq_lens)
    x = torch.randn(8, 64)

    def bound(module: Attention, kv_heads: int) -> Attention:
        module.attn.kv_cache = allocate_kv_cache(1, 4, BS, kv_heads, 16, torch.float32, torch.device("cpu"))[
            0
        ]
        return module

    # As the runner calls the model: the cache's in-place writes stay out of autograd.
    with torch.inference_mode():
        expected = bound(full, 2)(x, cos, sin, meta)
    total = torch.zeros_like(expected)
    full_q, full_k, full_v = full.qkv_proj.weight.split(full.qkv_proj.output_sizes)
    for rank in range(2):
        shard = Attention(config, TensorParallelRank(rank=rank, size=2))
        q_rows, kv_rows = slice(rank * 32, rank * 32 + 32), slice(rank * 16, rank * 16 + 16)
        rows = torch.cat([full_q[q_rows], full_k[kv_rows], full_v[kv_rows]])
        shard.qkv_proj.weight = torch.nn.Parameter(rows.detach().clone())
        shard.o_proj = torch.nn.Linear(32, 64, bias=False)
        shard.o_proj.weight = torch.nn.Parameter(full.o_proj.weight[:, q_rows].detach().clone())
        assert shard.num_local_kv_heads == 1
        with torch.inference_mode():
            total += bound(shard, 1)(x, cos, sin, meta)
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=0)
