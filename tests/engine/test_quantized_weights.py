"""Quantized checkpoints as Kimi and DeepSeek publish them, loaded by dequantizing.

The tiny Kimi K2 checkpoint's weights are quantized here, by this file's own packer
(written from the format's description, not from the loader's code): routed experts
to compressed-tensors INT4 (K2 Thinking / K2.5), every projection to DeepSeek-V3's
FP8 128x128 blocks (K2 Instruct). Loaded, each weight equals this file's own
dequantization exactly and the original within the format's rounding error.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from deepseek_ep_worker import prefill_logits, prompt, runner_for
from safetensors.torch import load_file, save_file

from cachet.engine.int4_linear import int4_kernel_available
from cachet.engine.model_runner import ModelRunner
from cachet.engine.models import ModelConfig
from cachet.engine.models.deepseek_v3 import DenseMLP, Int4MLP
from cachet.engine.models.kimi_vision import KimiVisionTower
from cachet.engine.quantized_weights import unpack_int32
from cachet.engine.tensor_parallel import TensorParallelRank
from cachet.engine.weights import CheckpointError, load_model

CPU = torch.device("cpu")
FP8_MAX = 448.0  # largest finite float8 e4m3fn
# The published K2.5 quantization_config (fixtures/kimi_k25/config.json), as its text model has it.
INT4_CONFIG = json.loads((Path(__file__).parent / "fixtures" / "kimi_k25" / "config.json").read_text())[
    "quantization_config"
]


def fp8_config(block: tuple[int, int]) -> dict:
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }


# --- this file's quantizers ---------------------------------------------------------------


def quantize_int4(weight: torch.Tensor, group: int = 32) -> dict[str, torch.Tensor]:
    """Symmetric INT4 with one bf16 scale per ``group`` inputs; values + 8 packed 8 to an int32
    word, the first value in the lowest 4 bits."""
    rows, columns = weight.shape
    groups = weight.float().view(rows, columns // group, group)
    scale = (groups.abs().amax(dim=-1) / 7).clamp(min=1e-8).to(torch.bfloat16)
    values = (groups / scale.float()[..., None]).round().clamp(-8, 7).to(torch.int64).view(rows, columns)
    nibbles = (values + 8).view(rows, columns // 8, 8)
    words = (nibbles << (4 * torch.arange(8))).sum(dim=-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement
    return {
        "weight_packed": words,
        "weight_scale": scale,
        "weight_shape": torch.tensor([rows, columns], dtype=torch.int32),
        # Not stored: what the test compares against.
        "_reference": (values.float().view(rows, -1, group) * scale.float()[..., None]).view(rows, columns),
        "_step": scale.float().repeat_interleave(group, dim=1),
    }


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """float8 e4m3 with one fp32 multiplier per ``block`` tile (edge tiles partial)."""
    rows, columns = weight.shape
    br, bc = block
    scale = torch.empty((rows + br - 1) // br, (columns + bc - 1) // bc)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = weight[i * br : (i + 1) * br, j * bc : (j + 1) * bc]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / FP8_MAX
    full = scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :columns]
    q = (weight.float() / full).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale, "_reference": q.float() * full, "_scale": full}


# --- checkpoints --------------------------------------------------------------------------


def _routed_expert_weight(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith("_proj.weight")


def _projection_weight(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def write_quantized(
    source: Path, target: Path, quantize, selected, quantization_config: dict
) -> dict[str, torch.Tensor]:
    """A copy of ``source`` whose ``selected`` weights are stored by ``quantize``, over two shards
    (a weight's parts alternate between them); returns the reference weights."""
    shutil.copytree(source, target)
    (target / "model.safetensors").unlink()
    original = load_file(str(source / "model.safetensors"))
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    references: dict[str, torch.Tensor] = {}
    for name, tensor in original.items():
        if not selected(name):
            shards[0][name] = tensor
            continue
        parts = quantize(tensor)
        references[name] = parts.pop("_reference")
        references[name + "#bound"] = _bound(tensor, parts)
        base = name.removesuffix("weight")
        for k, (role, part) in enumerate(sorted(parts.items())):
            if not role.startswith("_"):
                shards[k % 2][base + role] = part.contiguous()
    weight_map = {}
    for k, shard in enumerate(shards):
        file = f"model-0000{k + 1}-of-00002.safetensors"
        save_file(shard, str(target / file))
        weight_map.update(dict.fromkeys(shard, file))
    (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (target / "config.json").write_text(json.dumps(config))
    return references


def _bound(original: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    if "_step" in parts:  # INT4: round to the nearest step of the group's scale
        return parts.pop("_step") / 2
    # e4m3 keeps 3 mantissa bits (half an ulp: 2**-4 relative); below 2**-6 it is subnormal,
    # with steps of 2**-9 times the block's multiplier.
    return original.abs().float() * 2**-4 + parts.pop("_scale") * 2**-10


def _load(model_dir: Path, tp: TensorParallelRank | None = None) -> dict[str, torch.Tensor]:
    config = ModelConfig.from_model_dir(model_dir)
    kwargs = {"tp": tp} if tp is not None else {}
    model = load_model(model_dir, config, dtype=torch.float32, device=CPU, **kwargs)
    return {name: p.detach() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def original(tiny_checkpoints: dict[str, Path]) -> dict[str, torch.Tensor]:
    return load_file(str(tiny_checkpoints["kimi-k2"] / "model.safetensors"))


@pytest.fixture(scope="module")
def int4_dir(
    tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict]:
    target = tmp_path_factory.mktemp("int4") / "kimi-int4"
    refs = write_quantized(
        tiny_checkpoints["kimi-k2"], target, quantize_int4, _routed_expert_weight, INT4_CONFIG
    )
    return target, refs


def _check(loaded: dict, original: dict, refs: dict, selected) -> None:
    quantized = [name for name in original if selected(name)]
    assert quantized
    for name in quantized:
        torch.testing.assert_close(loaded[name], refs[name], rtol=0, atol=0, msg=name)
        error = (loaded[name] - original[name].float()).abs()
        assert bool((error <= refs[name + "#bound"] + 1e-7).all()), name
        assert error.max() > 0, name  # it really was quantized
    for name, tensor in original.items():
        if not selected(name):
            assert torch.equal(loaded[name], tensor.float()), name


# --- tests --------------------------------------------------------------------------------


def test_int4_experts_load_as_their_dequantized_values(int4_dir: tuple[Path, dict], original: dict) -> None:
    model_dir, refs = int4_dir
    _check(_load(model_dir), original, refs, _routed_expert_weight)


@pytest.mark.parametrize("block", [(128, 128), (16, 16)])
def test_fp8_block_weights_load_as_their_dequantized_values(
    block: tuple[int, int], tiny_checkpoints: dict[str, Path], original: dict, tmp_path: Path
) -> None:
    """(128, 128) as published (one partial tile per tiny weight); (16, 16) tiles each weight."""
    model_dir = tmp_path / "kimi-fp8"
    refs = write_quantized(
        tiny_checkpoints["kimi-k2"],
        model_dir,
        lambda w: quantize_fp8(w, block),
        _projection_weight,
        fp8_config(block),
    )
    _check(_load(model_dir), original, refs, _projection_weight)


def test_a_tensor_parallel_rank_dequantizes_then_keeps_its_slice(
    int4_dir: tuple[Path, dict], tiny_checkpoints: dict[str, Path]
) -> None:
    model_dir, refs = int4_dir
    # Expert parallelism off: every routed expert is cut by channels over the two ranks.
    halves = [_load(model_dir, TensorParallelRank(rank, 2, expert_parallel_size=1)) for rank in range(2)]
    gate = "model.layers.1.mlp.experts.3.gate_proj.weight"
    down = "model.layers.2.mlp.experts.5.down_proj.weight"
    assert torch.equal(torch.cat([h[gate] for h in halves], dim=0), refs[gate])
    assert torch.equal(torch.cat([h[down] for h in halves], dim=1), refs[down])


def _edit_checkpoint(model_dir: Path, edit) -> None:
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    for file in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(model_dir / file))
        edit(file, tensors)
        save_file(tensors, str(model_dir / file))
        index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != file}
        index["weight_map"].update(dict.fromkeys(tensors, file))
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))


def test_unknown_and_incomplete_quantized_tensors_are_errors_naming_them(
    int4_dir: tuple[Path, dict], tmp_path: Path
) -> None:
    model_dir = tmp_path / "broken"
    shutil.copytree(int4_dir[0], model_dir)
    expert = "model.layers.1.mlp.experts.2.up_proj."
    zero_point = "model.layers.2.mlp.experts.0.gate_proj.weight_zero_point"

    def edit(file: str, tensors: dict) -> None:
        tensors.pop(expert + "weight_scale", None)
        if file.startswith("model-00001"):
            tensors[zero_point] = torch.zeros(32, 2, dtype=torch.int32)

    _edit_checkpoint(model_dir, edit)
    with pytest.raises(CheckpointError) as raised:
        _load(model_dir)
    message = str(raised.value)
    assert f"missing 1 ({expert}weight)" in message
    for name in (zero_point, expert + "weight_packed", expert + "weight_shape"):
        assert name in message


def test_a_scale_of_the_wrong_shape_is_an_error_naming_the_weight(
    int4_dir: tuple[Path, dict], tmp_path: Path
) -> None:
    model_dir = tmp_path / "bad-scale"
    shutil.copytree(int4_dir[0], model_dir)
    name = "model.layers.2.mlp.experts.6.gate_proj.weight_scale"  # [32, 2]: 64 inputs, 2 groups

    def edit(file: str, tensors: dict) -> None:
        if name in tensors:
            tensors[name] = tensors[name][:, :1].contiguous()

    _edit_checkpoint(model_dir, edit)
    with pytest.raises(CheckpointError, match=r"experts\.6\.gate_proj\.weight: weight_scale is \(32, 1\)"):
        _load(model_dir)


def test_quantized_parts_in_a_checkpoint_that_declares_no_quantization_are_unexpected(
    int4_dir: tuple[Path, dict], tmp_path: Path
) -> None:
    model_dir = tmp_path / "undeclared"
    shutil.copytree(int4_dir[0], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    del config["quantization_config"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError, match=r"unexpected \d+ \(model\.layers\.1\.mlp\.experts\.0\.down_proj\.weight_packed"
    ):
        _load(model_dir)


@pytest.mark.parametrize("columns", [8, 13, 64])
def test_unpack_reads_values_low_bits_first(columns: int) -> None:
    values = torch.randint(-8, 8, (3, columns))
    padded = torch.nn.functional.pad(values + 8, (0, -columns % 8)).view(3, -1, 8)
    words = (padded << (4 * torch.arange(8))).sum(dim=-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    assert torch.equal(unpack_int32(words, 4, columns), values.to(torch.int32))


def test_unpack_matches_compressed_tensors_own_packer() -> None:
    """Where the producer's library is installed (it is no dependency of Cachet)."""
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    values = torch.randint(-8, 8, (5, 64), dtype=torch.int8)
    packed = helpers.pack_to_int32(values, 4)
    assert torch.equal(unpack_int32(packed, 4, 64), values.to(torch.int32))


def test_kimi_k25_layout_loads_its_language_model(
    int4_dir: tuple[Path, dict], original: dict, tmp_path: Path
) -> None:
    """The released K2.5 shape in miniature: a kimi_k25 wrapper config, the language model under
    ``language_model.`` with INT4 experts, the vision tower and projector beside it (bf16, loaded
    into the model's ``vision_tower``)."""
    source, refs = int4_dir
    model_dir = tmp_path / "tiny-k25"
    shutil.copytree(source, model_dir)
    text_config = json.loads((source / "config.json").read_text())
    published = json.loads((Path(__file__).parent / "fixtures" / "kimi_k25" / "config.json").read_text())
    vision = {
        **published["vision_config"],
        "vt_hidden_size": 16,
        "vt_num_hidden_layers": 1,
        "vt_num_attention_heads": 2,
    }
    vision["text_hidden_size"] = text_config["hidden_size"]
    wrapper = {
        **{k: published[k] for k in ("architectures", "model_type", "media_placeholder_token_id")},
        "bos_token_id": text_config.get("bos_token_id"),
        "eos_token_id": text_config.get("eos_token_id"),
        "quantization_config": INT4_CONFIG,
        "text_config": text_config,
        "vision_config": vision,
    }
    (model_dir / "config.json").write_text(json.dumps(wrapper))
    # The tower's own random init, under the published names (the projector's stored apart).
    tower = KimiVisionTower(ModelConfig.from_dict(wrapper).vision)
    vision_tensors = {
        ("" if name.startswith("mm_projector.") else "vision_tower.") + name: t.detach().to(torch.bfloat16)
        for name, t in tower.state_dict().items()
    }

    def edit(file: str, tensors: dict) -> None:
        for name in list(tensors):
            tensors["language_model." + name] = tensors.pop(name)
        if file.startswith("model-00002"):
            tensors.update(vision_tensors)

    _edit_checkpoint(model_dir, edit)
    config = ModelConfig.from_model_dir(model_dir)
    assert config.checkpoint_prefix == "language_model." and config.vision is not None
    loaded = _load(model_dir)
    _check(loaded, original, refs, _routed_expert_weight)
    for name, tensor in vision_tensors.items():
        param = name if name.startswith("vision_tower.") else "vision_tower." + name
        assert torch.equal(loaded[param], tensor.float()), name
    # The engine's runner serves it as it serves the same weights in K2 Thinking's layout.
    ids = prompt(1, 24)
    theirs = prefill_logits(runner_for(source), ids)
    torch.testing.assert_close(prefill_logits(runner_for(model_dir), ids), theirs, rtol=0, atol=0)


@pytest.mark.skipif(
    not int4_kernel_available(CPU, torch.bfloat16), reason="this torch has no CPU INT4 kernel"
)
def test_bf16_on_cpu_keeps_int4_experts_packed_and_matches_dequantizing(
    int4_dir: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir, refs = int4_dir
    config = ModelConfig.from_model_dir(model_dir)
    packed = load_model(model_dir, config, dtype=torch.bfloat16, device=CPU)
    expert = packed.model.layers[1].mlp.experts["3"]
    assert isinstance(expert, Int4MLP)
    # Two INT4 values a byte in the kernel's layout, the checkpoint's int32 words freed.
    assert expert.gate_proj.kernel_weight.dtype == torch.uint8
    assert expert.gate_proj.kernel_weight.numel() * 2 == 32 * 64
    assert expert.gate_proj.weight_packed.numel() == 0
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    w = refs["model.layers.1.mlp.experts.3.gate_proj.weight"].to(torch.bfloat16)
    torch.testing.assert_close(expert.gate_proj(x).float(), (x @ w.t()).float(), rtol=2e-2, atol=2e-2)

    ids = prompt(2, 24)
    kept = prefill_logits(runner_for_dtype(model_dir, torch.bfloat16), ids)
    monkeypatch.setattr("cachet.engine.weights.int4_kernel_available", lambda device, dtype: False)
    dequantized_runner = runner_for_dtype(model_dir, torch.bfloat16)
    assert isinstance(dequantized_runner.model.model.layers[1].mlp.experts["3"], DenseMLP)
    dequantized = prefill_logits(dequantized_runner, ids)
    assert (kept.argmax(-1) == dequantized.argmax(-1)).float().mean() > 0.9
    # bf16 either way; the kernel sums in another order (measured: 0.039 at logits of 4).
    torch.testing.assert_close(kept.float(), dequantized.float(), rtol=0.02, atol=0.06)


def runner_for_dtype(model_dir: Path, dtype: torch.dtype) -> ModelRunner:
    return ModelRunner(model_dir, dtype=dtype, device=CPU, kv_cache_bytes=1 << 20, block_size=16)


def test_a_tensor_stored_in_two_shards_is_an_error_naming_it(
    int4_dir: tuple[Path, dict], tmp_path: Path
) -> None:
    model_dir = tmp_path / "twice"
    shutil.copytree(int4_dir[0], model_dir)
    name = "model.norm.weight"
    second = model_dir / "model-00002-of-00002.safetensors"
    tensors = load_file(str(second))
    tensors[name] = load_file(str(model_dir / "model-00001-of-00002.safetensors"))[name]
    save_file(tensors, str(second))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight is stored twice \(again in model-00002"):
        _load(model_dir)
