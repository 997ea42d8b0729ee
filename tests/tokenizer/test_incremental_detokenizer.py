"""Streamed text deltas join up to exactly the full decode, for every prefix of every sample."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from tokenizer_samples import SAMPLES

from cachet.incremental_detokenizer import IncrementalDetokenizer
from cachet.tokenizer.tokenizer_model import TokenizerModel


def _stream(detokenizer: IncrementalDetokenizer, token_ids: Sequence[int]) -> tuple[list[str], str]:
    """Feed one token at a time; return the deltas before flushing and the flushed tail."""
    deltas = [detokenizer.add([token_id]) for token_id in token_ids]
    return deltas, detokenizer.flush()


def _assert_streams_like_full_decode(
    model: TokenizerModel, prompt: list[int], output: list[int], *, skip_special_tokens: bool
) -> None:
    def decode(token_ids: Sequence[int]) -> str:
        return model.decode(token_ids, skip_special_tokens=skip_special_tokens)

    context = prompt[-5:]
    for end in range(len(output) + 1):
        expected_full = decode(context + output[:end])
        assert expected_full.startswith(decode(context))
        expected = expected_full[len(decode(context)) :]
        detokenizer = model.detokenizer(prompt, skip_special_tokens=skip_special_tokens)
        deltas, tail = _stream(detokenizer, output[:end])
        shown = ""
        for delta in deltas:
            shown += delta
            # Never a half character on screen, and never text that a later token rewrites.
            assert not delta.endswith("\ufffd") or "\ufffd" in expected
            assert expected.startswith(shown)
        assert shown + tail == expected, f"prefix of {end} tokens"
        assert detokenizer.tokens_consumed == end


@pytest.mark.parametrize("text", SAMPLES)
def test_every_prefix_streams_to_its_full_decode(tiny_model: TokenizerModel, text: str) -> None:
    output = tiny_model.encode(text, add_special_tokens=False)
    _assert_streams_like_full_decode(tiny_model, [], output, skip_special_tokens=False)


@pytest.mark.parametrize("text", [SAMPLES[3], SAMPLES[4], SAMPLES[13]])
def test_skipping_special_tokens_streams_to_its_full_decode(tiny_model: TokenizerModel, text: str) -> None:
    output = tiny_model.encode(text, add_special_tokens=False) + [2, 0]
    output = [1, *output[:3], 2, *output[3:]]
    _assert_streams_like_full_decode(tiny_model, [], output, skip_special_tokens=True)


@pytest.mark.parametrize("text", [SAMPLES[1], SAMPLES[3], SAMPLES[6]])
def test_prompt_context_streams_to_the_text_after_the_prompt(tiny_model: TokenizerModel, text: str) -> None:
    prompt = tiny_model.encode(
        "<|im_start|>user\nSay 世界 back<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    output = tiny_model.encode(text, add_special_tokens=False) + [2]
    _assert_streams_like_full_decode(tiny_model, prompt, output, skip_special_tokens=False)
    _assert_streams_like_full_decode(tiny_model, prompt, output, skip_special_tokens=True)


def test_emoji_is_held_back_until_complete(tiny_model: TokenizerModel) -> None:
    output = tiny_model.encode("ok 🤗!", add_special_tokens=False)
    detokenizer = tiny_model.detokenizer([], skip_special_tokens=False)
    deltas = [detokenizer.add([token_id]) for token_id in output]
    assert "".join(deltas) == "ok 🤗!"
    assert "" in deltas  # some token was only part of the emoji's four bytes
    assert all("\ufffd" not in delta for delta in deltas)


def test_batches_that_end_inside_a_character_still_emit_the_complete_text(tiny_model: TokenizerModel) -> None:
    output = tiny_model.encode("ab 世界", add_special_tokens=False)
    detokenizer = tiny_model.detokenizer([], skip_special_tokens=False)
    first = detokenizer.add(output[:-1])  # ends one byte short of 界
    assert first == "ab 世"
    assert detokenizer.tokens_consumed < len(output) - 1
    assert detokenizer.add(output[-1:]) == "界"
    assert detokenizer.tokens_consumed == len(output)


def test_invalid_trailing_bytes_are_flushed_as_replacement_characters(tiny_model: TokenizerModel) -> None:
    lead_byte = tiny_model.encode("世", add_special_tokens=False)[:1]
    output = tiny_model.encode("fine", add_special_tokens=False) + lead_byte
    detokenizer = tiny_model.detokenizer([], skip_special_tokens=False)
    assert detokenizer.add(output) == "fine"
    assert detokenizer.flush() == "\ufffd" == tiny_model.decode(lead_byte, skip_special_tokens=False)


class _SentencePieceLike:
    """A decoder that, like SentencePiece's Metaspace, drops the first token's leading space."""

    def __init__(self, pieces: dict[int, str]) -> None:
        self.pieces = pieces

    def __call__(self, token_ids: Sequence[int]) -> str:
        return "".join(self.pieces[token_id] for token_id in token_ids).replace("▁", " ").removeprefix(" ")


def test_leading_spaces_survive_a_decoder_that_strips_the_first_one() -> None:
    decode = _SentencePieceLike({1: "▁Hello", 2: "▁world", 3: "!", 4: "▁how", 5: "▁are"})
    detokenizer = IncrementalDetokenizer(decode, prompt_token_ids=[1])
    deltas = [detokenizer.add([token_id]) for token_id in (2, 3, 4, 5)]
    assert deltas == [" world", "!", " how", " are"]
    # Without the prompt context, the first token's space is dropped exactly as a full decode does.
    alone = IncrementalDetokenizer(decode)
    assert "".join(alone.add([token_id]) for token_id in (2, 3, 4)) == decode([2, 3, 4]) == "world! how"
