"""The real default model: GGUF -> fp32 Hugging Face checkpoint (about a minute on 2 cores)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from cachet.models import convert_gguf
from cachet.models.gguf_tokenizer import digit_split_pieces, read_gguf_metadata

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def converted_dir(default_model_dir: Path) -> Path:
    # The conversion every other test uses (tests/conftest.py): converting twice costs CI a minute.
    return default_model_dir


def test_checkpoint_files_and_config(converted_dir: Path) -> None:
    assert sorted(p.name for p in converted_dir.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    # The catalog's lock file stays (it is reused); a staging directory must not.
    leftovers = [p for p in converted_dir.parent.iterdir() if p.name.startswith(".") and p.suffix != ".lock"]
    assert not leftovers, "staging left behind"
    config = json.loads((converted_dir / "config.json").read_text())
    assert config["cachet_model_id"] == "smollm2-135m-instruct"
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (
        9,
        3,
        49152,
    )
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config

    generation = json.loads((converted_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] in (2, [2])  # <|im_end|>
    assert generation["bos_token_id"] == 1
    # The model card's sampling values, which the engine applies to requests that leave them unset.
    assert (generation["do_sample"], generation["temperature"], generation["top_p"]) == (True, 0.2, 0.9)

    with safe_open(str(converted_dir / "model.safetensors"), framework="pt") as weights:
        names = list(weights.keys())
        assert len(names) == 30 * 9 + 2  # 9 tensors per layer, embeddings, final norm (lm_head is tied)
        assert {weights.get_slice(n).get_dtype() for n in names} == {"F32"}
        assert weights.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
    assert oct((converted_dir / "model.safetensors").stat().st_mode & 0o777) == oct(0o644)


def test_refuses_to_overwrite(converted_dir: Path, default_gguf: Path) -> None:
    with pytest.raises(FileExistsError):
        convert_gguf(default_gguf, converted_dir, progress=False)


def test_greedy_chat_answer_names_paris(converted_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted_dir)
    model = AutoModelForCausalLM.from_pretrained(converted_dir, dtype=torch.float32)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_tiny_tokenizer_encodes_like_the_converted_one(
    converted_dir: Path, tiny_model_dir: Path, tokenizer_samples: list[str]
) -> None:
    converted = Tokenizer.from_file(str(converted_dir / "tokenizer.json"))
    tiny = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    for text in tokenizer_samples:
        assert tiny.encode(text).ids == converted.encode(text).ids, text
    assert json.loads((tiny_model_dir / "tokenizer_config.json").read_text()) == json.loads(
        (converted_dir / "tokenizer_config.json").read_text()
    )


def test_tokenizer_matches_transformers_gguf_conversion(
    default_gguf: Path, tiny_model_dir: Path, tokenizer_samples: list[str]
) -> None:
    """Independent check against transformers' own GGUF tokenizer builder.

    Theirs lacks llama.cpp's digit pre-split for "smollm" vocabularies; everything else must be
    identical, and encoding our digit-split pieces one by one with theirs must reproduce ours.
    """
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)
    ours = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    ours_json = json.loads(ours.to_str())
    theirs_json = json.loads(reference.backend_tokenizer.to_str())
    assert [key for key in ours_json if ours_json[key] != theirs_json[key]] == ["pre_tokenizer"]

    samples = tokenizer_samples + ["word " * 50, "x" * 300, "\n".join(f"line {i}: ok" for i in range(40))]
    differs = 0
    for text in samples:
        mine = ours.encode(text).ids
        piecewise = [
            i for piece in digit_split_pieces(text) for i in reference.encode(piece, add_special_tokens=False)
        ]
        assert mine == piecewise, text
        if not any(ch.isdigit() for ch in text):
            assert mine == reference.encode(text, add_special_tokens=False), text
        differs += mine != reference.encode(text, add_special_tokens=False)
    assert differs > 0, "the samples no longer exercise the digit split"


def test_metadata_reader_matches_gguf_package(default_gguf: Path) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(str(default_gguf))
    expected = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    assert read_gguf_metadata(default_gguf) == expected
