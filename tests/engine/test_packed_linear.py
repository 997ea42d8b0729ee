"""Linear weights packed for oneDNN: same outputs, same tokens, plain weights where they are read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cachet.engine.engine_core import EngineCore
from cachet.engine.model_runner import ModelRunner
from cachet.engine.packed_linear import pack_linear_weights, packs_linear_weights
from cachet.engine.request import Request
from cachet.engine.sampling_params import SamplingParams
from cachet.engine.scheduler import SchedulerConfig
from cachet.engine.tensor_parallel import SINGLE_RANK, ColumnParallelLinear, ParallelLMHead, RowParallelLinear

CPU = torch.device("cpu")
DTYPES = [torch.float32] + ([torch.bfloat16] if packs_linear_weights(CPU, torch.bfloat16) else [])

pytestmark = pytest.mark.skipif(
    not packs_linear_weights(CPU, torch.float32), reason="this torch build has no oneDNN"
)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_layers_compute_what_plain_ones_do(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        [
            ColumnParallelLinear(64, 96, range(96), bias=True),
            RowParallelLinear(96, range(96), 64, SINGLE_RANK, bias=True),
            ParallelLMHead(64, 300, SINGLE_RANK),
        ]
    ).to(dtype)
    # Rows a step really has: one, a decode batch, a prompt; and a transposed (strided) view.
    inputs = [torch.randn(rows, layer.in_features, dtype=dtype) for layer in layers for rows in (1, 23, 40)]
    inputs.append(torch.randn(64, 5, dtype=dtype).T)
    with torch.inference_mode():
        plain = [layer(x) for layer in layers for x in inputs if x.shape[-1] == layer.in_features]
        # The head's 300 outputs make no whole panels of 16: where only the panel kernel takes
        # this dtype (bf16 without oneDNN's bf16 kernels) it stays plain.
        onednn_takes_any = dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
        assert pack_linear_weights(layers) == (3 if onednn_takes_any else 2)
        assert all(layer.weight.is_mkldnn or layer.panels for layer in layers[:2])
        packed = [layer(x) for layer in layers for x in inputs if x.shape[-1] == layer.in_features]
    # bf16 through our kernel rounds once, from fp32 sums; torch's emulated product may round
    # the other way: one bf16 step apart at most.
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    for expected, got in zip(plain, packed, strict=True):
        assert got.dtype == dtype and got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    assert pack_linear_weights(layers) == 0  # already packed: nothing to do twice


def test_only_a_cpu_with_onednn_packs() -> None:
    assert not packs_linear_weights(torch.device("cuda"), torch.bfloat16)
    assert not packs_linear_weights(CPU, torch.float16)


def _greedy_tokens(model_dir: Path, dtype: torch.dtype, pack_weights: bool) -> tuple[ModelRunner, dict]:
    runner = ModelRunner(
        model_dir,
        dtype=dtype,
        device=CPU,
        kv_cache_bytes=8 << 20,
        max_model_len=128,
        pack_weights=pack_weights,
    )
    core = EngineCore(runner, model="tiny", scheduler_config=SchedulerConfig(max_model_len=128))
    sampling = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for index in range(3):
        prompt = [(7 * index + 3 * position) % 200 + 10 for position in range(5 + 9 * index)]
        core.add_request(Request(f"r{index}", prompt, sampling, max_tokens=10))
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return runner, tokens


@pytest.mark.parametrize("family", ["llama", "kimi-k2"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_packed_runner_samples_the_tokens_a_plain_one_does(
    tiny_checkpoints: dict[str, Path], family: str, dtype: torch.dtype
) -> None:
    packed_runner, packed = _greedy_tokens(tiny_checkpoints[family], dtype, pack_weights=True)
    plain_runner, plain = _greedy_tokens(tiny_checkpoints[family], dtype, pack_weights=False)
    assert packed_runner.packed_linears > 0 and plain_runner.packed_linears == 0
    assert packed == plain and all(len(tokens) == 10 for tokens in plain.values())


def _packed(layer: torch.nn.Module) -> bool:
    """In oneDNN's layout, or the panel kernel's (fp32 on an AVX2 host)."""
    return bool(layer.weight.is_mkldnn or getattr(layer, "panels", False))


def test_weights_read_as_tensors_stay_plain(tiny_checkpoints: dict[str, Path]) -> None:
    llama = ModelRunner(
        tiny_checkpoints["llama"], dtype=torch.float32, device=CPU, kv_cache_bytes=8 << 20
    ).model
    # The tiny llama ties its head: the head packs a copy, the embedding keeps its plain table.
    assert llama.config.tie_word_embeddings
    assert _packed(llama.lm_head)
    assert (
        llama.model.embed_tokens.weight.shape == (49152, 64) and not llama.model.embed_tokens.weight.is_mkldnn
    )
    kimi = ModelRunner(
        tiny_checkpoints["kimi-k2"], dtype=torch.float32, device=CPU, kv_cache_bytes=8 << 20
    ).model
    attention = kimi.model.layers[0].self_attn
    assert not _packed(attention.kv_b_proj)  # absorbed MLA reads it per head
    assert _packed(attention.o_proj)
