from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from cachet.models import tiny as tiny_module
from cachet.models import write_tiny_model
from cachet.models.gguf_tokenizer import digit_split_pieces, extract_tokenizer

SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CHECKPOINT_FILES = {
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
}


def test_cold_write_is_fast_and_complete(tmp_path: Path) -> None:
    started = time.perf_counter()
    out = write_tiny_model(tmp_path / "m", tokenizer_cache_dir=tmp_path / "fresh-cache")
    elapsed = time.perf_counter() - started
    assert elapsed < 10, f"cold tiny write took {elapsed:.1f}s"
    assert {p.name for p in out.iterdir()} == CHECKPOINT_FILES

    config = json.loads((out / "config.json").read_text())
    assert config["cachet_model_id"] == "tiny-llama"
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (64, 128, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["vocab_size"] == 49152
    assert config["max_position_embeddings"] == 2048
    assert config["tie_word_embeddings"] is True

    started = time.perf_counter()
    write_tiny_model(tmp_path / "again", tokenizer_cache_dir=tmp_path / "fresh-cache")
    assert time.perf_counter() - started < 10


def test_weights_follow_the_seed(tmp_path: Path, tokenizer_cache: Path) -> None:
    a = load_file(
        write_tiny_model(tmp_path / "a", seed=3, tokenizer_cache_dir=tokenizer_cache) / "model.safetensors"
    )
    b = load_file(
        write_tiny_model(tmp_path / "b", seed=3, tokenizer_cache_dir=tokenizer_cache) / "model.safetensors"
    )
    c = load_file(
        write_tiny_model(tmp_path / "c", seed=4, tokenizer_cache_dir=tokenizer_cache) / "model.safetensors"
    )
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert a["model.embed_tokens.weight"].shape == (49152, 64)
    assert all(t.dtype == torch.float32 for t in a.values())


def test_global_rng_is_left_alone(tmp_path: Path, tokenizer_cache: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    write_tiny_model(tmp_path / "m", tokenizer_cache_dir=tokenizer_cache)
    assert torch.equal(torch.rand(3), expected)


def test_transformers_loads_and_generates(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.num_hidden_layers == 2
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    prompt_len = inputs["input_ids"].shape[1]
    assert out.shape[1] == prompt_len + 6
    assert torch.equal(out[0, :prompt_len], inputs["input_ids"][0])
    assert int(out.max()) < 49152

    generation = GenerationConfig.from_pretrained(tiny_model_dir)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end == 2
    assert generation.eos_token_id in (im_end, [im_end])
    assert generation.bos_token_id == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_tokenizer_round_trips(tiny_model_dir: Path, tokenizer_samples: list[str]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    broken = {}
    for text in tokenizer_samples:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if tokenizer.decode(ids) != text:
            broken[text] = tokenizer.decode(ids)
    assert broken == {}
    # Byte-level BPE must not fall back to an unknown token for anything: every byte has an id.
    assert tokenizer.encode("\x00\x7f\U0010ffff", add_special_tokens=False)


def test_special_tokens_stay_whole(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer.encode("<|im_start|>", add_special_tokens=False) == [1]
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert tokenizer.encode("<|endoftext|>", add_special_tokens=False) == [0]
    # No BOS is prepended: the chat template writes its own markers.
    assert tokenizer.encode("hi")[0] != 1
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.bos_token == "<|im_start|>"


def test_digits_are_split_like_llama_cpp(tiny_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    # llama.cpp's "smollm" pre-tokenizer cuts every digit off first, so the two spaces before "1" stay
    # one token; a plain GPT-2 split would give "Ġ", "Ġ", "1".
    assert tokenizer.encode("a  1").tokens == ["a", "ĠĠ", "1"]
    assert tokenizer.encode("12345").tokens == ["1", "2", "3", "4", "5"]
    assert digit_split_pieces("ab 12  c²") == ["ab ", "1", "2", "  c", "²"]


def test_chat_template_renders_smollm_format(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=False
    )
    assert text == (
        f"<|im_start|>system\n{SMOLLM_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
        ],
        tokenize=False,
    )
    assert (
        with_system
        == "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    )
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert "{% for message in messages %}" in config["chat_template"]


def test_vocab_from_an_hf_directory(tmp_path: Path, tiny_model_dir: Path, tokenizer_cache: Path) -> None:
    out = write_tiny_model(tmp_path / "copy", vocab_from=tiny_model_dir, tokenizer_cache_dir=tokenizer_cache)
    assert (out / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    assert json.loads((out / "generation_config.json").read_text()) == json.loads(
        (tiny_model_dir / "generation_config.json").read_text()
    )
    # The source directory is only read, never annotated.
    assert not (tiny_model_dir / "special_tokens.json").exists()


def test_extraction_is_cached(tmp_path: Path, default_gguf: Path) -> None:
    first = extract_tokenizer(default_gguf, cache_dir=tmp_path)
    stamp = (first / "tokenizer.json").stat().st_mtime_ns
    assert extract_tokenizer(default_gguf, cache_dir=tmp_path) == first
    assert (first / "tokenizer.json").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


def test_unknown_family_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny model family 'mamba'"):
        write_tiny_model(tmp_path / "m", family="mamba")
    assert not (tmp_path / "m").exists()


def test_existing_directory_is_not_clobbered(tmp_path: Path, tokenizer_cache: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        write_tiny_model(tmp_path / "m", tokenizer_cache_dir=tokenizer_cache)
    assert (tmp_path / "m" / "keep.txt").read_text() == "mine"
    write_tiny_model(tmp_path / "m", tokenizer_cache_dir=tokenizer_cache, overwrite=True)
    assert not (tmp_path / "m" / "keep.txt").exists()
    assert (tmp_path / "m" / "model.safetensors").is_file()


def test_failed_write_leaves_nothing(
    tmp_path: Path, tokenizer_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def explode(out_dir: Path, **_: object) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(tiny_module, "_write_llama", explode)
    with pytest.raises(RuntimeError, match="disk full"):
        write_tiny_model(tmp_path / "m", tokenizer_cache_dir=tokenizer_cache)
    assert list(tmp_path.iterdir()) == []
