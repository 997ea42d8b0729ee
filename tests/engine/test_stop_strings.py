"""Stop strings across token boundaries, with a real byte-level BPE tokenizer built here."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from cachet.engine.stop_strings import StopMatch, StopStringChecker
from cachet.incremental_detokenizer import IncrementalDetokenizer
from cachet.router.stop_strings import StopStringHoldBack

CORPUS = ["the end is near, the end is here. hello world! Stop here.", "STOP. héllo wörld"] * 10


def build_tokenizer() -> Tokenizer:
    """A tiny byte-level BPE (like GPT-2's): any text encodes, characters may split over tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return build_tokenizer()


def feed(checker: StopStringChecker, token_ids: list[int]) -> tuple[int, StopMatch] | None:
    """Index of the token that completed a stop string, and the match."""
    for i, token_id in enumerate(token_ids):
        if (match := checker.append(token_id)) is not None:
            return i, match
    return None


def test_stop_string_spanning_tokens(tokenizer):
    ids = tokenizer.encode("the end is near").ids
    assert [tokenizer.decode([i]) for i in ids] == ["the", " end", " is", " near"]
    checker = StopStringChecker(["end is"], tokenizer.decode)
    # Completed by the third token; "the " (4 chars) is kept, nothing of the delta " is".
    assert feed(checker, ids) == (2, StopMatch("end is", text_end=4, keep_chars=0))


def test_stop_string_inside_one_token_keeps_the_text_before_it(tokenizer):
    ids = tokenizer.encode("the end is near").ids
    checker = StopStringChecker(["ear"], tokenizer.decode)
    # " near" starts at char 10; its " n" is kept.
    assert feed(checker, ids) == (3, StopMatch("ear", text_end=12, keep_chars=2))


def test_no_match_no_report(tokenizer):
    checker = StopStringChecker(["zebra"], tokenizer.decode)
    assert feed(checker, tokenizer.encode("the end is near").ids) is None


def test_split_characters_are_held_back_until_complete(tokenizer):
    ids = tokenizer.encode("héllo 🙂 done").ids
    decoder = IncrementalDetokenizer(tokenizer.decode)
    deltas = [decoder.add([i]) for i in ids]
    assert "".join(deltas) == "héllo 🙂 done"
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some tokens end mid-character
    checker = StopStringChecker(["🙂"], tokenizer.decode)
    index, match = feed(checker, ids)
    assert tokenizer.decode(ids[: index + 1]).endswith("🙂")
    assert match == StopMatch("🙂", text_end=6, keep_chars=0)


def test_earliest_stop_wins_then_list_order(tokenizer):
    ids = tokenizer.encode("hello world").ids
    checker = StopStringChecker(["world", "lo w", "o w"], tokenizer.decode)
    index, match = feed(checker, ids)
    assert match.stop == "lo w" and match.text_end == 3


def test_context_tokens_are_decoded_but_never_matched(tokenizer):
    context = tokenizer.encode("Stop").ids
    checker = StopStringChecker(["Stop"], tokenizer.decode, context_token_ids=context)
    assert feed(checker, tokenizer.encode(" here. Stop").ids) is not None
    checker = StopStringChecker(["Stop"], tokenizer.decode, context_token_ids=context)
    assert feed(checker, tokenizer.encode(" here.").ids) is None


def test_any_decode_function_works():
    vocab = ["a", "b", "<", "/", ">", " "]
    checker = StopStringChecker(["</"], lambda ids: "".join(vocab[i] for i in ids))
    assert feed(checker, [0, 5, 2, 3, 1]) == (3, StopMatch("</", text_end=2, keep_chars=0))


def test_empty_stop_strings_are_refused(tokenizer):
    with pytest.raises(ValueError):
        StopStringChecker([""], tokenizer.decode)


def random_cases(seed: int, count: int = 60) -> Iterator[tuple[str, list[str]]]:
    """Texts and stop strings drawn from a few characters, multi-byte ones among them."""
    rng = random.Random(seed)
    alphabet = "abé 🙂."
    for _ in range(count):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))
        ]
        yield text, stops


@pytest.mark.parametrize("seed", range(5))
def test_incremental_matches_brute_force(tokenizer, seed):
    for text, stops in random_cases(seed):
        ids = tokenizer.encode(text).ids
        got = feed(StopStringChecker(stops, tokenizer.decode), ids)
        # Brute force: the first prefix of tokens whose text holds any stop string.
        expected = None
        for k in range(1, len(ids) + 1):
            prefix = tokenizer.decode(ids[:k])
            found = [(prefix.find(s), i) for i, s in enumerate(stops) if s in prefix]
            if found:
                index, which = min(found)
                expected = (k - 1, stops[which], index, len(tokenizer.decode(ids[: k - 1])))
                break
        if expected is None:
            assert got is None, (text, stops)
            continue
        assert got is not None, (text, stops)
        token_index, match = got
        assert (token_index, match.stop, match.text_end) == expected[:3], (text, stops)
        previous_len = expected[3]
        assert match.keep_chars == max(0, match.text_end - previous_len)


@pytest.mark.parametrize("seed", range(5))
def test_the_router_shows_exactly_the_text_before_the_engines_match(tokenizer, seed):
    """One matcher: the engine stops and names the stop string, the router (which matches none)
    holds back and cuts its own decoding of the same tokens; streamed token by token or sent
    whole, the caller sees the text before the match, and a stream never more than that."""
    for text, stops in random_cases(seed):
        ids = tokenizer.encode(text).ids
        stopped = feed(StopStringChecker(stops, tokenizer.decode), ids)
        # The engine's stream: every token up to the one that matched, which names its stop string.
        sent, matched_stop = (ids[: stopped[0] + 1], stopped[1].stop) if stopped else (ids, "")
        visible = tokenizer.decode(sent)[: stopped[1].text_end] if stopped else tokenizer.decode(sent)
        streamed = [[token] for token in sent]
        first_and_final = [sent[:1], sent[1:]] if len(sent) > 1 else [sent]
        for messages in (streamed, first_and_final):
            decoder, hold_back = IncrementalDetokenizer(tokenizer.decode), StopStringHoldBack(stops)
            shown = [hold_back.feed(decoder.add(tokens)) for tokens in messages[:-1]]
            shown.append(hold_back.finish(decoder.add(messages[-1]) + decoder.flush(), matched_stop))
            assert "".join(shown) == visible, (text, stops, messages)
