"""Encode / decode on the tiny model's real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest
from tokenizer_samples import SAMPLES

from cachet.errors import InvalidArgument
from cachet.tokenizer.tokenizer_model import TokenizerModel


@pytest.mark.parametrize("text", SAMPLES)
def test_decode_of_encode_is_the_text(tiny_model: TokenizerModel, text: str) -> None:
    token_ids = tiny_model.encode(text, add_special_tokens=True)
    assert token_ids, "every sample is non-empty"
    assert tiny_model.decode(token_ids, skip_special_tokens=False) == text
    assert tiny_model.count_tokens(text) == len(tiny_model.encode(text, add_special_tokens=False))


def test_special_token_text_becomes_special_ids_and_can_be_skipped(tiny_model: TokenizerModel) -> None:
    token_ids = tiny_model.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert token_ids[0] == 1 and token_ids[-1] == 2
    assert tiny_model.decode(token_ids, skip_special_tokens=True) == "user\nhi"


def test_multibyte_characters_span_several_tokens(tiny_model: TokenizerModel) -> None:
    # The premise of the incremental detokenizer tests: a lone token of "世" is not text.
    token_ids = tiny_model.encode("世", add_special_tokens=False)
    assert len(token_ids) > 1
    assert tiny_model.decode(token_ids[:1], skip_special_tokens=False) == "\ufffd"


def test_token_ids_outside_the_vocabulary_are_named(tiny_model: TokenizerModel) -> None:
    tiny_model.check_token_ids([0, 49151], "token_ids")
    with pytest.raises(InvalidArgument) as raised:
        tiny_model.check_token_ids([5, 49152], "token_ids")
    assert raised.value.message.startswith("token_ids[1]: token id 49152 is not in the vocabulary")
    assert raised.value.param == "token_ids[1]"


def test_model_info_of_the_tiny_model(tiny_model: TokenizerModel) -> None:
    info = tiny_model.info
    assert info.model_id == "tiny-llama"
    assert info.context_window == 2048  # max_position_embeddings, not the tokenizer's 1e30
    assert info.vocab_size == 49152
    assert info.stop_token_ids[0] == 2  # generation_config's eos (<|im_end|>) first
    assert set(info.stop_token_ids) == {2, 0}  # and <|endoftext|>, the base model's end of text
    assert info.bos_token_id == 1
    assert not info.template_supports_tools
    specials = {special.text: special.token_id for special in info.special_tokens}
    assert specials["<|im_start|>"] == 1 and specials["<|im_end|>"] == 2 and len(specials) == 17
