"""Stop strings over streamed text: held back while they might match, cut where they do."""

from __future__ import annotations

import pytest

from cachet.router.stop_strings import StopStringFilter


def run(stops: list[str], deltas: list[str]) -> tuple[list[str], str, str | None]:
    stop_filter = StopStringFilter(stops)
    shown = [stop_filter.feed(delta) for delta in deltas]
    return shown, stop_filter.flush(), stop_filter.matched


def test_no_stop_strings_passes_text_through() -> None:
    assert run([], ["Hello", " world"]) == (["Hello", " world"], "", None)


def test_stop_string_split_across_deltas_is_never_shown() -> None:
    shown, tail, matched = run(["END"], ["Hello E", "N", "D and more"])
    assert shown == ["Hello ", "", ""]
    assert (tail, matched) == ("", "END")


def test_text_after_the_stop_in_the_same_delta_is_dropped() -> None:
    assert run(["\n\n"], ["one\n\ntwo"]) == (["one"], "", "\n\n")


def test_partial_match_that_fails_is_released() -> None:
    shown, tail, matched = run(["STOP"], ["ST", "ART", "ing ST"])
    assert shown == ["", "START", "ing "]
    assert (tail, matched) == ("ST", None)  # held at the end, released by flush
    assert "".join(shown) + tail == "STARTing ST"


def test_earliest_of_several_stops_wins() -> None:
    assert run(["world", "lo w"], ["Hello world"]) == (["Hel"], "", "lo w")


def test_everything_after_a_match_is_empty() -> None:
    stop_filter = StopStringFilter(["x"])
    assert stop_filter.feed("abxcd") == "ab"
    assert stop_filter.feed("more") == ""
    assert stop_filter.flush() == ""


@pytest.mark.parametrize("cut", range(1, 12))
def test_any_split_gives_the_same_visible_text(cut: int) -> None:
    text = "Answer: 42<|stop|> ignored"
    shown, tail, matched = run(["<|stop|>"], [text[:cut], text[cut:]])
    assert "".join(shown) + tail == "Answer: 42"
    assert matched == "<|stop|>"
