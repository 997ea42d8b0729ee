"""The safetensors loader, config parsing and the runner's cache sizing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from cachet.engine.attention import kv_cache_bytes_per_block
from cachet.engine.kv_cache_budget import KvCacheBudget, free_memory_bytes
from cachet.engine.model_runner import ModelRunner, default_dtype
from cachet.engine.models import ModelConfig, UnsupportedModelError
from cachet.engine.models.config import load_eos_token_ids
from cachet.engine.weights import CheckpointError, checkpoint_files, checkpoint_state, load_model

torch.set_num_threads(1)

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)
CPU = torch.device("cpu")


def save(directory: Path, *, tied: bool, qwen: bool = False, **kwargs: object) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if qwen else (LlamaConfig, LlamaForCausalLM)
    model = model_cls(config_cls(**TINY, tie_word_embeddings=tied))
    model.save_pretrained(directory, **kwargs)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def load(directory: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return load_model(directory, ModelConfig.from_model_dir(directory), dtype=dtype, device=CPU)


def assert_matches(model: torch.nn.Module, reference: dict[str, torch.Tensor]) -> None:
    ours = checkpoint_state(model)
    assert set(ours) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(ours[name], tensor.to(ours[name].dtype)), name


def test_single_file_untied(tmp_path: Path) -> None:
    reference = save(tmp_path, tied=False)
    assert checkpoint_files(tmp_path) == [tmp_path / "model.safetensors"]
    model = load(tmp_path)
    assert_matches(model, reference)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


def test_tied_embeddings_share_storage(tmp_path: Path) -> None:
    reference = save(tmp_path, tied=True)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    model = load(tmp_path)
    assert_matches(model, reference)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_tied_checkpoint_that_only_has_lm_head(tmp_path: Path) -> None:
    reference = save(tmp_path, tied=True)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert_matches(load(tmp_path), reference)


def test_sharded_checkpoint(tmp_path: Path) -> None:
    reference = save(tmp_path, tied=False, qwen=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(checkpoint_files(tmp_path)) > 2
    model = load(tmp_path)
    assert_matches(model, reference)
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    assert model.model.layers[0].self_attn.o_proj.bias is None


def test_cast_to_bfloat16(tmp_path: Path) -> None:
    reference = save(tmp_path, tied=True)
    model = load(tmp_path, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert_matches(model, reference)


def rewrite(directory: Path, edit: callable) -> None:  # type: ignore[valid-type]
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    save(tmp_path, tied=False)
    rewrite(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing 1 \(model.layers.1.mlp.up_proj.weight\)"):
        load(tmp_path)


def test_missing_untied_lm_head_is_an_error(tmp_path: Path) -> None:
    save(tmp_path, tied=False)
    rewrite(tmp_path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load(tmp_path)


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    save(tmp_path, tied=False)
    rewrite(tmp_path, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected 1 \(model.layers.0.extra.weight\)"):
        load(tmp_path)


def test_stale_rope_tables_are_ignored(tmp_path: Path) -> None:
    reference = save(tmp_path, tied=False)
    rewrite(tmp_path, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)}))
    assert_matches(load(tmp_path), reference)


def test_shape_mismatch_is_named(tmp_path: Path) -> None:
    save(tmp_path, tied=False)
    rewrite(tmp_path, lambda t: t.update({"model.norm.weight": torch.ones(63)}))
    with pytest.raises(CheckpointError, match=r"model.norm.weight: checkpoint shape \(63,\)"):
        load(tmp_path)


def test_missing_files_are_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        checkpoint_files(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "shard-1.safetensors"}})
    )
    with pytest.raises(CheckpointError, match="shard-1.safetensors"):
        checkpoint_files(tmp_path)


# --- Config --------------------------------------------------------------------------------------


BASE = dict(
    model_type="llama",
    vocab_size=10,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
)


def test_config_defaults_and_old_style_rope() -> None:
    config = ModelConfig.from_dict(
        {
            **BASE,
            "rope_theta": 500000.0,
            "rope_scaling": {"type": "linear", "factor": 4.0},
            "eos_token_id": [1, 2],
        }
    )
    assert config.num_key_value_heads == 4 and config.head_dim == 16
    assert config.rope.rope_type == "linear" and config.rope.theta == 500000.0 and config.rope.factor == 4.0
    assert config.eos_token_ids == (1, 2)
    assert not config.qkv_bias and not config.tie_word_embeddings


def test_config_new_style_rope_and_biases() -> None:
    config = ModelConfig.from_dict(
        {
            **BASE,
            "model_type": "qwen2",
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0},
        }
    )
    assert config.rope.theta == 1e6 and config.rope.original_max_position_embeddings == 4096
    assert config.qkv_bias and not config.o_proj_bias
    llama = ModelConfig.from_dict({**BASE, "attention_bias": True, "head_dim": 32})
    assert llama.qkv_bias and llama.o_proj_bias and llama.head_dim == 32


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2'"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "longrope"}}, "rope type 'longrope'"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "sliding-window"),
    ],
)
def test_config_rejects_unsupported(extra: dict[str, object], message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_dict({**BASE, **extra})


def test_generation_config_eos_wins(tmp_path: Path) -> None:
    config = ModelConfig.from_dict({**BASE, "eos_token_id": 2})
    assert load_eos_token_ids(tmp_path, config) == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_eos_token_ids(tmp_path, config) == (2, 7)


# --- Runner sizing -------------------------------------------------------------------------------


def test_runner_fits_blocks_to_byte_budget(tmp_path: Path) -> None:
    save(tmp_path, tied=True)
    per_block = kv_cache_bytes_per_block(2, 16, 2, 16, torch.bfloat16)
    assert per_block == 2 * 2 * 16 * 2 * 16 * 2
    runner = ModelRunner(tmp_path, dtype=torch.bfloat16, device=CPU, kv_cache_bytes=per_block * 10 + 5)
    assert runner.num_kv_blocks == 10 and runner.block_size == 16
    assert runner.max_model_len == 160  # capped by the cache, not the model's 2048
    assert runner.kv_cache.shape == (2, 2, 10, 16, 2, 16)
    assert runner.vocab_size == 512 and runner.eos_token_ids == (2,)
    assert runner.config.tie_word_embeddings
    with pytest.raises(ValueError, match="holds no block"):
        ModelRunner(tmp_path, dtype=torch.bfloat16, device=CPU, kv_cache_bytes=per_block - 1)
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        ModelRunner(
            tmp_path, dtype=torch.bfloat16, device=CPU, kv_cache_bytes=per_block * 10, max_model_len=161
        )
    big = ModelRunner(tmp_path, dtype=torch.float32, device=CPU, kv_cache_bytes=64 << 20, max_model_len=1000)
    assert big.max_model_len == 1000
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ModelRunner(tmp_path, dtype=torch.float32, device=CPU, kv_cache_bytes=64 << 20, max_model_len=4096)


def test_a_budget_sizes_the_pool_from_free_memory_up_to_every_seat_at_full_context(tmp_path: Path) -> None:
    save(tmp_path, tied=True)
    per_token = kv_cache_bytes_per_block(2, 16, 2, 16, torch.bfloat16) // 16
    # Two seats of the model's 2048-token window: far less than 40% of any host's memory.
    capped = ModelRunner(
        tmp_path, dtype=torch.bfloat16, device=CPU, kv_cache_bytes=KvCacheBudget(0.4, max_sequences=2)
    )
    assert capped.num_kv_blocks * 16 == 2 * 2048 and capped.max_model_len == 2048
    # A share smaller than the cap: the share decides (free memory moves, so a bound).
    share = KvCacheBudget(1e-6, ranks_sharing_memory=2, max_sequences=64)
    shared = ModelRunner(tmp_path, dtype=torch.bfloat16, device=CPU, kv_cache_bytes=share)
    assert 0 < shared.num_kv_blocks * 16 * per_token <= free_memory_bytes(CPU) * 1e-6 / 2 * 1.5
    assert shared.num_kv_blocks < 64 * 2048 // 16


def test_default_dtype_on_cpu_is_bfloat16_only_with_native_bf16() -> None:
    flags = Path("/proc/cpuinfo").read_text().split()
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    assert default_dtype(CPU) == (torch.bfloat16 if native else torch.float32)
