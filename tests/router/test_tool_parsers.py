"""Tool-call and reasoning parsers on hand-written model output.

Every case is parsed whole and streamed split at every character boundary (and
character by character): the streamed deltas must add up to the one-shot parse,
which is what lets the router build a non-streamed answer from its own stream.
Every call must stream as OpenAI's do: a header (index, id, name, arguments "")
first, then argument text only.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from cachet.router.output_parser import OutputDelta, OutputParser, PlainTextParser
from cachet.router.tool_parsers.hermes import HermesToolParser
from cachet.router.tool_parsers.kimi_k2 import KimiK2ToolParser
from cachet.router.tool_parsers.reasoning import ReasoningParser

TOOLS = ("get_weather", "search")


@dataclass
class Answer:
    content: str = ""
    reasoning: str = ""
    # index -> [id, name, arguments]
    calls: dict[int, list[str]] = field(default_factory=dict)
    fragments: dict[int, int] = field(default_factory=dict)  # argument deltas per call

    def add(self, delta: OutputDelta) -> None:
        self.content += delta.content
        self.reasoning += delta.reasoning
        for call in delta.tool_calls:
            entry = self.calls.setdefault(call.index, ["", "", ""])
            if call.id:
                assert not entry[0], "a call's id comes once, on its header"
                assert call.name and call.arguments_delta == "", "the header carries the name, no arguments"
                entry[0] = call.id
                entry[1] = call.name
                self.fragments.setdefault(call.index, 0)
            else:
                assert entry[0], "the header of a call comes before its arguments"
                assert not call.name and call.arguments_delta, "fragments carry argument text only"
                self.fragments[call.index] += 1
            entry[2] += call.arguments_delta

    def named_calls(self) -> list[tuple[str, dict]]:
        return [(name, json.loads(arguments)) for _, name, arguments in self.calls.values()]


def run(make: Callable[[], OutputParser], pieces: list[str]) -> Answer:
    parser, answer = make(), Answer()
    for piece in pieces:
        answer.add(parser.feed(piece))
    answer.add(parser.finish())
    assert sorted(answer.calls) == list(range(len(answer.calls))), "indexes count up from 0"
    return answer


def without_ids(answer: Answer) -> tuple[str, str, list[tuple[str, str]]]:
    return answer.content, answer.reasoning, [(name, args) for _, name, args in answer.calls.values()]


def check_every_split(make: Callable[[], OutputParser], text: str) -> Answer:
    """Parse whole, then at every two-way split and one char at a time: all must agree."""
    whole = run(make, [text])
    expected = without_ids(whole)
    for cut in range(len(text) + 1):
        assert without_ids(run(make, [text[:cut], text[cut:]])) == expected, f"split at {cut}"
    assert without_ids(run(make, list(text))) == expected, "char by char"
    return whole


def hermes() -> HermesToolParser:
    return HermesToolParser(TOOLS)


def kimi() -> KimiK2ToolParser:
    return KimiK2ToolParser(TOOLS)


# ---------------------------------------------------------------- Hermes


def test_hermes_plain_text_is_content() -> None:
    answer = check_every_split(hermes, "Paris is the capital. a < b and <tool not a tag")
    assert answer.content == "Paris is the capital. a < b and <tool not a tag"
    assert answer.calls == {}


def test_hermes_one_call_only() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    answer = check_every_split(hermes, text)
    assert answer.content == ""
    assert answer.named_calls() == [("get_weather", {"city": "Paris"})]
    call_id = answer.calls[0][0]
    assert call_id.startswith("call_") and len(call_id) == 29


def test_hermes_text_then_parallel_calls() -> None:
    text = (
        "Let me check.\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"q": "Lyon weather", "filters": [1, {"a": null}]}}\n'
        "</tool_call>\n"
    )
    answer = check_every_split(hermes, text)
    assert answer.content == "Let me check."
    assert answer.named_calls() == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("search", {"q": "Lyon weather", "filters": [1, {"a": None}]}),
    ]
    assert len({call[0] for call in answer.calls.values()}) == 2, "ids are unique"


def test_hermes_markers_inside_arguments_do_not_end_the_call() -> None:
    query = 'say "</tool_call>" and <tool_call> {"name": "x"} \\" }'
    payload = json.dumps({"name": "search", "arguments": {"q": query}})
    text = f"<tool_call>{payload}</tool_call>after"
    answer = check_every_split(hermes, text)
    assert answer.named_calls() == [("search", {"q": query})]
    assert answer.content == "after"


def test_hermes_arguments_keep_unicode() -> None:
    answer = check_every_split(
        hermes, '<tool_call>{"name": "search", "arguments": {"q": "Zürich 東京 ☃"}}</tool_call>'
    )
    assert answer.calls[0][2] == '{"q": "Zürich 東京 ☃"}'


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>not json</tool_call>",
        '<tool_call>{"name": "get_weather", "arguments": {',  # cut off before the arguments show
        '<tool_call>{"name": "get_weather", "argu',  # cut off
        '<tool_call>{"name": "delete_everything", "arguments": {}}</tool_call>',  # not offered
        '<tool_call>{"name": "search", "arguments": [1, 2]}</tool_call>',  # not an object
        '<tool_call>{"name": "search", "arguments": {not json}}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        "<tool_call>",
        "text <tool_call",
    ],
)
def test_hermes_malformed_output_is_content(text: str) -> None:
    answer = check_every_split(hermes, text)
    assert answer.calls == {}
    assert answer.content == text


@pytest.mark.parametrize(
    ("text", "arguments", "content"),
    [
        # Cut short (max_tokens): the call keeps what was written; finish_reason "length" says so.
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Par', '{"city": "Par', ""),
        ('<tool_call>{"name": "search", "arguments": {}} trailing</tool_call>', "{}", "trailing</tool_call>"),
        ('<tool_call>{"name": "search", "arguments": {"q": 1}, "x": "}"}</tool_call>', '{"q": 1}', ""),
    ],
)
def test_hermes_announced_call_stands(text: str, arguments: str, content: str) -> None:
    answer = check_every_split(hermes, text)
    assert [(name, args) for _, name, args in answer.calls.values()] == [
        ("search" if "search" in text else "get_weather", arguments)
    ]
    assert answer.content == content


def test_hermes_arguments_stream_as_written() -> None:
    """Name first (as soon as the arguments open), then the raw arguments text in fragments."""
    arguments = '{"city": "Paris", "nested": {"days": [1, 2], "note": "a } b"}}'
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
    whole = check_every_split(hermes, text)
    assert whole.calls[0][1:] == ["get_weather", arguments], "the arguments string is the model's own text"
    json.loads(whole.calls[0][2])
    streamed = run(hermes, list(text))
    # One fragment per character fed, but the first: the arguments' "{" waits for the next
    # character to show it opens an object (``{not json}`` stays content).
    assert streamed.fragments[0] == len(arguments) - 1
    # The header goes out on the character that opens the arguments' first key, before any value.
    parser, prefix = hermes(), text[: text.index('"city"') + 1]
    deltas = [call for piece in prefix for call in parser.feed(piece).tool_calls]
    assert [(d.name, d.arguments_delta) for d in deltas] == [("get_weather", ""), ("", '{"')]


def test_hermes_keys_the_other_way_round_go_out_whole() -> None:
    text = '<tool_call>{"arguments": {"q": "a"}, "name": "search"}</tool_call>'
    answer = check_every_split(hermes, text)
    assert answer.named_calls() == [("search", {"q": "a"})]
    assert answer.fragments[0] == 1


def test_hermes_malformed_block_then_a_real_call() -> None:
    text = (
        'oops <tool_call>{bad}</tool_call> <tool_call>{"name": "search", "arguments": {"q": "a"}}</tool_call>'
    )
    answer = check_every_split(hermes, text)
    assert answer.content == "oops <tool_call>{bad}</tool_call>"
    assert answer.named_calls() == [("search", {"q": "a"})]


def test_hermes_arguments_given_as_a_json_string() -> None:
    text = '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"a\\"}"}</tool_call>'
    assert check_every_split(hermes, text).named_calls() == [("search", {"q": "a"})]


def test_hermes_whitespace_between_content_words_is_kept() -> None:
    text = "one  \n two\n\nthree   "
    assert check_every_split(hermes, text).content == text


# ---------------------------------------------------------------- Kimi K2

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def test_kimi_parallel_calls_keep_kimi_ids() -> None:
    text = (
        f"I'll look both up.{SB}{CB}functions.get_weather:0{AB}"
        f'{{"city": "Beijing"}}{CE}{CB}functions.search:1{AB}{{"q": "news"}}{CE}{SE}'
    )
    answer = check_every_split(kimi, text)
    assert answer.content == "I'll look both up."
    assert [(call_id, name) for call_id, name, _ in answer.calls.values()] == [
        ("functions.get_weather:0", "get_weather"),
        ("functions.search:1", "search"),
    ]
    assert answer.named_calls() == [("get_weather", {"city": "Beijing"}), ("search", {"q": "news"})]


def test_kimi_markers_inside_arguments() -> None:
    query = f"{CE}{SE} and {CB}x:0{AB}"
    text = f"{SB}{CB}functions.search:0{AB}{json.dumps({'q': query})}{CE}{SE}"
    answer = check_every_split(kimi, text)
    assert answer.named_calls() == [("search", {"q": query})]
    assert answer.content == ""


def test_kimi_whitespace_between_markers_and_text_after_section() -> None:
    text = f"{SB}\n{CB} functions.search:0 {AB} {{}} {CE}\n{SE}\nDone."
    answer = check_every_split(kimi, text)
    assert answer.named_calls() == [("search", {})]
    assert answer.content == "Done."


@pytest.mark.parametrize(
    "text",
    [
        f"{SB}{CB}functions.search:0{AB}{{not json}}{CE}{SE}",
        f"{SB}{CB}functions.search:0{AB}{{ ",  # cut off before the arguments show
        f"{SB}{CB}no id here{AB}{{}}{CE}{SE}",
        f"{SB}{CB}functions.unknown_tool:0{AB}{{}}{CE}{SE}",
        f"{SB}{CB}functions.search:0{AB}[1]{CE}{SE}",
        f"{SB}{CB}functions.search:0",
    ],
)
def test_kimi_malformed_call_is_content(text: str) -> None:
    answer = check_every_split(kimi, text)
    assert answer.calls == {}
    # The section marker was consumed as a section; everything from the bad call on is content.
    assert answer.content == text.removeprefix(SB)


def test_kimi_arguments_stream_as_written() -> None:
    arguments = '{"q": "a <|tool_call_end|> b", "n": [1, {"x": null}]}'
    text = f"{SB}{CB}functions.search:0{AB}{arguments}{CE}{SE}"
    whole = check_every_split(kimi, text)
    assert whole.calls[0] == ["functions.search:0", "search", arguments]
    assert run(kimi, list(text)).fragments[0] == len(arguments) - 1


def test_kimi_cut_short_call_stands() -> None:
    answer = check_every_split(kimi, f'{SB}{CB}functions.search:0{AB}{{"q": 1')
    assert [(name, args) for _, name, args in answer.calls.values()] == [("search", '{"q": 1')]
    assert answer.content == ""


def test_kimi_good_call_then_malformed_one() -> None:
    bad = f"{CB}functions.search:1{AB}oops{CE}{SE}"
    text = f'{SB}{CB}functions.search:0{AB}{{"q": "a"}}{CE}{bad}'
    answer = check_every_split(kimi, text)
    assert answer.named_calls() == [("search", {"q": "a"})]
    assert answer.content == bad


def test_kimi_text_without_section_is_content() -> None:
    text = "<|tool_calls_section plain <| text"
    assert check_every_split(kimi, text).content == text


# ---------------------------------------------------------------- reasoning


def thinking_hermes() -> ReasoningParser:
    return ReasoningParser(HermesToolParser(TOOLS))


def test_reasoning_apart_from_content() -> None:
    answer = check_every_split(
        lambda: ReasoningParser(PlainTextParser()), "<think>Step 1. <b>2</b></think>\n\nParis."
    )
    assert answer.reasoning == "Step 1. <b>2</b>"
    assert answer.content == "Paris."


def test_reasoning_then_kimi_tool_call() -> None:
    text = f"<think>need weather</think>{SB}{CB}functions.get_weather:0{AB}{{}}{CE}{SE}"
    answer = check_every_split(lambda: ReasoningParser(KimiK2ToolParser(TOOLS)), text)
    assert answer.reasoning == "need weather"
    assert answer.named_calls() == [("get_weather", {})]
    assert answer.content == ""


def test_reasoning_then_hermes_call() -> None:
    text = '<think>x</think><tool_call>{"name": "search", "arguments": {}}</tool_call>'
    answer = check_every_split(thinking_hermes, text)
    assert (answer.reasoning, answer.named_calls()) == ("x", [("search", {})])


def test_unclosed_reasoning_is_all_reasoning() -> None:
    answer = check_every_split(lambda: ReasoningParser(PlainTextParser()), "<think>still thinking </thi")
    assert (answer.reasoning, answer.content) == ("still thinking </thi", "")


def test_think_tag_later_in_the_answer_is_content() -> None:
    text = "Answer first <think>not reasoning</think>"
    answer = check_every_split(lambda: ReasoningParser(PlainTextParser()), text)
    assert (answer.reasoning, answer.content) == ("", text)


def test_prompt_that_opened_the_block() -> None:
    answer = check_every_split(
        lambda: ReasoningParser(PlainTextParser(), starts_in_reasoning=True), "hmm</think>Yes"
    )
    assert (answer.reasoning, answer.content) == ("hmm", "Yes")


def test_prefix_of_think_tag_only() -> None:
    answer = check_every_split(lambda: ReasoningParser(PlainTextParser()), " <thi")
    assert (answer.reasoning, answer.content) == ("", " <thi")
