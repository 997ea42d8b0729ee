"""Q4_1 checkpoint weights kept as their blocks (block_q4_weights, csrc/block_q4_linear.cpp): found
exactly or not at all, multiplied by as the fp32 weights are, a row's bits whatever the batch."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cachet.engine.block_q4_weights import (
    Q4_1Blocks,
    Q8_0Blocks,
    block_q4_products,
    pack_blocks,
    pack_fp32_blocks,
    pack_fp32_q8_blocks,
    recover_q4_1,
    recover_q8_0,
    serves_blocks,
)
from cachet.engine.cpu_features import cpu_flags
from cachet.engine.cpu_kernels import load_cpu_kernel
from cachet.engine.engine_core import EngineCore
from cachet.engine.model_runner import ModelRunner
from cachet.engine.packed_linear import PackableLinear, fp32_block_rows, invariant_rows
from cachet.engine.request import Request
from cachet.engine.sampling_params import SamplingParams
from cachet.engine.scheduler import SchedulerConfig
from cachet.engine.settings import BlockQ4Use

CPU = torch.device("cpu")
needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler to build the kernel with"
)


def quantize_q4_1(weight: torch.Tensor) -> Q4_1Blocks:
    """What llama.cpp's Q4_1 quantizer stores for an fp32 weight: per 32 inputs, the minimum as
    m and (max - min) / 15 as d, both fp16, and each value's nearest code from the unrounded pair."""
    rows, columns = weight.shape
    blocks = weight.view(rows, columns // 32, 32)
    low, high = blocks.amin(-1), blocks.amax(-1)
    step = (high - low) / 15
    inverse = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    codes = ((blocks - low[..., None]) * inverse[..., None] + 0.5).floor().clamp(0, 15)
    return Q4_1Blocks(codes.to(torch.uint8).view(rows, columns), step.half(), low.half())


def test_blocks_are_found_exactly_in_dequantized_weights() -> None:
    torch.manual_seed(0)
    quantized = quantize_q4_1(torch.randn(96, 256) * 0.05)
    weight = quantized.dequantize()
    found = recover_q4_1(weight)
    assert found is not None
    assert torch.equal(found.dequantize(), weight)
    # A constant block (d = 0) is a block too.
    weight[3, :32] = weight[3, 0]
    constant = recover_q4_1(weight)
    assert constant is not None and torch.equal(constant.dequantize(), weight)


def test_weights_that_are_not_blocks_stay_as_they_are() -> None:
    torch.manual_seed(1)
    weight = quantize_q4_1(torch.randn(32, 64)).dequantize()
    assert recover_q4_1(torch.randn(32, 64)) is None  # plain fp32 values
    assert recover_q4_1(weight.bfloat16()) is None  # already rounded: not the checkpoint's values
    assert recover_q4_1(weight[:, :48]) is None  # no whole blocks
    one_off = weight.clone()
    one_off[5, 7] = torch.nextafter(one_off[5, 7], torch.tensor(1.0))
    assert recover_q4_1(one_off) is None  # one value off in one block, past the first row
    with_nan = weight.clone()
    with_nan[0, 0] = float("nan")
    assert recover_q4_1(with_nan) is None


def test_packing_refuses_shapes_the_kernel_cannot_take() -> None:
    blocks = quantize_q4_1(torch.randn(24, 64))
    with pytest.raises(ValueError, match="outputs by 16"):
        pack_blocks(blocks)


@pytest.fixture(scope="module")
def kernel():
    built = load_cpu_kernel("block_q4_linear")
    assert built is not None, "see the engine's warning above for the compiler's message"
    return built


def _weight(rows: int, columns: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    blocks = quantize_q4_1(torch.randn(rows, columns, generator=generator) * 0.05)
    return blocks.dequantize(), pack_blocks(blocks)


# Rows: a decode, every remainder of the 12-row tile, products that widen the codes first;
# outputs: 80 is two panel pairs and a lone panel.
@needs_compiler
@pytest.mark.parametrize("rows", [1, 2, 5, 11, 12, 13, 40])
@pytest.mark.parametrize("outputs", [80, 96])
def test_products_are_the_fp32_weights_products(kernel, rows: int, outputs: int) -> None:
    weight, packed = _weight(outputs, 192, seed=rows)
    bias = torch.randn(outputs)
    x = torch.randn(rows, 192).bfloat16()
    expected = x.float() @ weight.T + bias
    got = kernel.linear(x, packed, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, outputs)
    # fp32 sums in another order, then one rounding to bf16: a bf16 step at most.
    torch.testing.assert_close(got.float(), expected, rtol=8e-3, atol=1e-3)


@needs_compiler
def test_a_rows_bits_do_not_depend_on_the_batch(kernel) -> None:
    weight, packed = _weight(96, 320, seed=7)
    x = torch.randn(40, 320).bfloat16()
    alone = torch.cat([kernel.linear(x[i : i + 1], packed, None) for i in range(40)])
    for rows in (5, 12, 13, 40):
        assert torch.equal(kernel.linear(x[:rows], packed, None), alone[:rows])


def quantize_q8_0(weight: torch.Tensor) -> Q8_0Blocks:
    """What llama.cpp's Q8_0 quantizer stores for an fp32 weight: per 32 inputs, d = the largest
    magnitude / 127 (kept as fp16) and each code rounded with the fp32 d."""
    rows, columns = weight.shape
    blocks = weight.view(rows, columns // 32, 32)
    step = blocks.abs().amax(dim=-1) / 127
    codes = torch.where(step[..., None] > 0, torch.round(blocks / step[..., None]), torch.zeros_like(blocks))
    return Q8_0Blocks(codes.to(torch.int8).view(rows, columns), step.half())


def test_q8_0_blocks_are_recovered_exactly_or_not_at_all() -> None:
    generator = torch.Generator().manual_seed(5)
    blocks = quantize_q8_0(torch.randn(48, 96, generator=generator) * 0.1)
    blocks.codes[0, :32] = 0  # a block of zeros: d = 0
    blocks.scales[0, 0] = 0
    found = recover_q8_0(blocks.dequantize())
    assert found is not None
    assert torch.equal(found.codes, blocks.codes) and torch.equal(found.dequantize(), blocks.dequantize())
    assert recover_q8_0(torch.randn(32, 64)) is None  # plain fp32 values
    later_row_off = blocks.dequantize()
    later_row_off[7, 3] = torch.nextafter(later_row_off[7, 3], torch.tensor(1.0))
    assert recover_q8_0(later_row_off) is None  # its first row alone is blocks, the weight is not
    assert recover_q8_0(torch.randn(32, 48)) is None  # no whole blocks
    assert recover_q4_1(blocks.dequantize()) is None  # more than 16 levels a block


@needs_compiler
@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 6, 7, 10, 11, 13, 40, 100])
@pytest.mark.parametrize("block_format", ["q4_1", "q8_0"])
def test_fp32_products_are_the_fp32_panels_bits(kernel, block_format: str, rows: int) -> None:
    """At every row count (one register tile, then the kept weights' tiles of even sizes), none
    included: a tied head's product in a step where no request samples."""
    panel_kernel = load_cpu_kernel("panel_linear")
    assert panel_kernel is not None
    generator = torch.Generator().manual_seed(rows)
    original = torch.randn(80, 192, generator=generator) * 0.05
    if block_format == "q4_1":
        q4 = quantize_q4_1(original)
        weight, packed, product = q4.dequantize(), pack_fp32_blocks(q4), kernel.fp32_linear
    else:
        q8 = quantize_q8_0(original)
        weight, packed, product = q8.dequantize(), pack_fp32_q8_blocks(q8), kernel.fp32_q8_linear
    bias = torch.randn(80, generator=generator)
    x = torch.randn(rows, 192, generator=generator)
    got = product(x, packed, bias)
    assert torch.equal(got, panel_kernel.linear(x, panel_kernel.pack_weight(weight), bias))
    torch.testing.assert_close(got, x @ weight.T + bias, rtol=1e-5, atol=1e-5)


@needs_compiler
def test_bad_inputs_are_refused_with_a_message(kernel) -> None:
    _, packed = _weight(32, 64, seed=3)
    with pytest.raises(RuntimeError, match="bfloat16 activations"):
        kernel.linear(torch.randn(2, 64), packed, None)
    with pytest.raises(RuntimeError, match="x has 96 features, the weight 64"):
        kernel.linear(torch.randn(2, 96).bfloat16(), packed, None)
    with pytest.raises(RuntimeError, match="must come from pack_blocks"):
        kernel.linear(torch.randn(2, 64).bfloat16(), packed.view(-1), None)
    fp32_packed = pack_fp32_blocks(quantize_q4_1(torch.randn(32, 64)))
    with pytest.raises(RuntimeError, match="float32 activations"):
        kernel.fp32_linear(torch.randn(2, 64).bfloat16(), fp32_packed, None)
    with pytest.raises(RuntimeError, match="must come from pack_fp32_blocks"):
        kernel.fp32_linear(torch.randn(2, 64), packed, None)
    with pytest.raises(RuntimeError, match="must come from pack_fp32_q8_blocks"):
        kernel.fp32_q8_linear(torch.randn(2, 64), fp32_packed, None)


def _blocks_checkpoint(source: Path, target: Path) -> Path:
    """The tiny checkpoint with every linear weight replaced by its Q4_1 blocks' values, and the
    embedding (which the head is tied to) by its Q8_0 blocks', as the default model's GGUF has them."""
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    for name, tensor in tensors.items():
        if name.endswith("proj.weight") and tensor.shape[1] % 32 == 0:
            tensors[name] = quantize_q4_1(tensor.float()).dequantize().to(tensor.dtype)
        elif name.endswith("embed_tokens.weight"):
            tensors[name] = quantize_q8_0(tensor.float()).dequantize().to(tensor.dtype)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def _sampled_tokens(runner: ModelRunner) -> dict[str, list[int]]:
    core = EngineCore(runner, model="tiny", scheduler_config=SchedulerConfig(max_model_len=128))
    for index in range(3):
        prompt = [(7 * index + 3 * position) % 200 + 10 for position in range(5 + 9 * index)]
        sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        core.add_request(Request(f"r{index}", prompt, sampling, max_tokens=8))
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return tokens


@pytest.mark.skipif(not serves_blocks(CPU, torch.bfloat16), reason="bf16 replicas keep no blocks on this CPU")
def test_a_replica_multiplies_by_the_blocks_it_found(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    model_dir = _blocks_checkpoint(tiny_checkpoints["llama"], tmp_path / "llama-q4")

    def runner(block_weights: BlockQ4Use) -> ModelRunner:
        return ModelRunner(
            model_dir, dtype=torch.bfloat16, device=CPU, kv_cache_bytes=8 << 20, max_model_len=128,
            block_weights=block_weights,
        )  # fmt: skip

    with_blocks, without = runner("small_batches"), runner("off")
    linears = [module for module in with_blocks.model.modules() if isinstance(module, PackableLinear)]
    held = [module for module in linears if module.block_q4 is not None]
    assert with_blocks.block_q4_linears == len(held) > 0 and without.block_q4_linears == 0
    # The tied head's weight is the embedding's, which is no Q4_1 weight here.
    assert with_blocks.model.lm_head.block_q4 is None
    name = "model.layers.0.self_attn.o_proj"  # stored as it is, not merged with others
    layer = with_blocks.model.get_submodule(name)
    assert layer.block_q4 is not None
    x = torch.randn(3, layer.in_features).bfloat16()
    with torch.inference_mode():
        exact = x.float() @ load_file(str(model_dir / "model.safetensors"))[f"{name}.weight"].float().T
        torch.testing.assert_close(layer(x).float(), exact, rtol=8e-3, atol=1e-3)
        with invariant_rows():  # a batch-invariant step keeps the panels' bits
            assert torch.equal(layer(x), without.model.get_submodule(name)(x))
    assert _sampled_tokens(with_blocks) == _sampled_tokens(without)


def test_blocks_serve_only_on_a_cpu_with_the_kernel() -> None:
    assert not serves_blocks(torch.device("cuda"), torch.bfloat16)
    assert not serves_blocks(CPU, torch.float16)
    assert serves_blocks(CPU, torch.bfloat16) == block_q4_products()  # AVX512-BF16's dot products
    if not {"avx2", "fma"} <= cpu_flags():
        assert not serves_blocks(CPU, torch.float32)


@pytest.mark.skipif(not serves_blocks(CPU, torch.float32), reason="fp32 replicas keep no blocks on this CPU")
def test_an_fp32_replica_on_the_blocks_gives_the_same_bits(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    model_dir = _blocks_checkpoint(tiny_checkpoints["llama"], tmp_path / "llama-q4")
    with_blocks, blocks_core = _invariant_engine(model_dir, torch.float32, "small_batches")
    without, plain_core = _invariant_engine(model_dir, torch.float32, "off")
    assert with_blocks.block_q4_linears > 0 and without.block_q4_linears == 0
    heads = [
        m for m in with_blocks.model.modules() if isinstance(m, PackableLinear) and m.block_q8 is not None
    ]
    assert len(heads) == 1, "the tied head's Q8_0 blocks, found in the embedding's values"
    # Where the blocks take every fp32 product, the fp32 weights they replace are freed (the
    # embedding's table, which lookups read, stays); elsewhere the panels serve the larger batches.
    linears = [m for m in with_blocks.model.modules() if isinstance(m, PackableLinear)]
    held = [m for m in linears if m.block_q4 is not None or m.block_q8 is not None]
    freed = [m for m in linears if m.weight.is_meta]
    assert (
        freed == (held if fp32_block_rows() is None else []) and len(held) == with_blocks.block_q4_linears + 1
    )
    assert not with_blocks.model.model.embed_tokens.weight.is_meta
    # Same bits, so the same reproducible kind: the blocks are a way to read the weights, no more.
    assert with_blocks.reproducible_kernels == without.reproducible_kernels
    generator = torch.Generator().manual_seed(3)
    batch = [
        torch.randint(3, with_blocks.vocab_size, (20 + 9 * i,), generator=generator).tolist()
        for i in range(5)
    ]
    assert _greedy(blocks_core, batch, 0) == _greedy(plain_core, batch, 0)
    # Alone, a long prompt's first chunks sample nothing: the head's product has no rows.
    alone = [torch.randint(3, with_blocks.vocab_size, (150,), generator=generator).tolist()]
    assert _greedy(blocks_core, alone, 10) == _greedy(plain_core, alone, 10)


def _invariant_engine(model_dir: Path, dtype: torch.dtype, use: BlockQ4Use) -> tuple[ModelRunner, EngineCore]:
    """A runner with batch-invariant steps, and 64-token chunks: a long prompt is computed in
    several, others' chunks beside it."""
    runner = ModelRunner(
        model_dir, dtype=dtype, device=CPU, kv_cache_bytes=64 << 20, batch_invariant=True, block_weights=use
    )
    config = SchedulerConfig(max_model_len=512, max_num_batched_tokens=64, max_num_seqs=16)
    return runner, EngineCore(runner, model="tiny", scheduler_config=config)


def _greedy(
    core: EngineCore, batch: list[list[int]], first_id: int
) -> list[tuple[list[tuple[int, float | None]], int]]:
    """Each prompt's (greedy tokens with their logprobs, cached prompt tokens), run together."""
    ids = [f"r{first_id + index}" for index in range(len(batch))]
    for request_id, prompt in zip(ids, batch, strict=True):
        sampling = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=True)
        core.add_request(Request(request_id, prompt, sampling, max_tokens=16))
    tokens: dict[str, list[tuple[int, float | None]]] = {request_id: [] for request_id in ids}
    cached = dict.fromkeys(ids, 0)
    while core.has_unfinished_requests():
        for output in core.step():
            tokens[output.request_id] += [(t.token_id, t.logprob) for t in output.logprobs]
            cached[output.request_id] = max(cached[output.request_id], output.num_cached_tokens)
    return [(tokens[request_id], cached[request_id]) for request_id in ids]


@pytest.mark.skipif(not serves_blocks(CPU, torch.bfloat16), reason="bf16 replicas keep no blocks on this CPU")
def test_all_steps_keeps_greedy_the_same_cold_cached_and_in_a_batch(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    model_dir = _blocks_checkpoint(tiny_checkpoints["llama"], tmp_path / "llama-q4")
    runner, core = _invariant_engine(model_dir, torch.bfloat16, "all_steps")
    panels_runner, panels_core = _invariant_engine(model_dir, torch.bfloat16, "small_batches")
    assert "block_q4=" in runner.reproducible_kernels
    assert runner.reproducible_kernels.startswith(panels_runner.reproducible_kernels)
    generator = torch.Generator().manual_seed(1)
    target = torch.randint(3, runner.vocab_size, (150,), generator=generator).tolist()
    others = [torch.randint(3, runner.vocab_size, (40 + i,), generator=generator).tolist() for i in range(7)]
    ((cold, cached_before),) = _greedy(core, [target], 0)
    ((again, cached_again),) = _greedy(core, [target], 1)
    batched = _greedy(core, others[:3] + [target] + others[3:], 2)
    fresh = _greedy(
        _invariant_engine(model_dir, torch.bfloat16, "all_steps")[1], others[:3] + [target] + others[3:], 0
    )
    assert cached_before == 0 and cached_again >= 144 and batched[3][1] >= 144 and fresh[3][1] == 0
    assert again == cold and batched[3][0] == cold and fresh[3][0] == cold
    # The panels' bf16 weights are not the blocks' exact ones: the steps really ran on the blocks.
    ((on_panels, _),) = _greedy(panels_core, [target], 0)
    assert [logprob for _, logprob in on_panels] != [logprob for _, logprob in cold]
