"""Where a cache breakpoint ends (ApplyChatTemplate's prefix_message_counts): the leading tokens of
the whole prompt that the tools and the first k messages render to, cut where the template
renders the prefix alone differently from the whole."""

from __future__ import annotations

from typing import Any

import pytest

from cachet.errors import InvalidArgument
from cachet.tokenizer.tokenizer_model import TokenizerModel

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


def whole(model: TokenizerModel, messages: list[dict[str, Any]], tools: list[dict[str, Any]], counts=()):
    return model.apply_chat_template(
        messages, tools, add_generation_prompt=True, continue_final_message=False, prefix_messages=counts
    )


def alone(model: TokenizerModel, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
    """The tokens of the prefix rendered by itself, as the last turn of a conversation."""
    text = model.apply_chat_template(
        messages, tools, add_generation_prompt=False, continue_final_message=False
    ).prompt
    return model.encode(text, add_special_tokens=False)


def test_each_breakpoint_ends_where_its_messages_end_in_the_whole_prompt(tiny_model: TokenizerModel) -> None:
    plain = whole(tiny_model, CONVERSATION, [])
    rendered = whole(tiny_model, CONVERSATION, [], counts=(1, 2, 3, 4))
    # Asking changes nothing about the prompt.
    assert rendered.token_ids == plain.token_ids and rendered.prompt == plain.prompt
    for k, count in zip((1, 2, 3, 4), rendered.prefix_token_counts, strict=True):
        prefix = alone(tiny_model, CONVERSATION[:k], [])
        # Turns end on the template's end-of-turn marker: the prefix is whole tokens of the prompt.
        assert count == len(prefix) and rendered.token_ids[:count] == prefix
    assert rendered.prefix_token_counts == sorted(rendered.prefix_token_counts)
    assert rendered.prefix_token_counts[-1] < len(rendered.token_ids)  # the generation prompt follows


def test_a_tools_breakpoint_covers_the_tools_where_the_template_renders_them_first(
    tiny_model: TokenizerModel,
) -> None:
    # The tiny model's template knows no tools: they become a system turn of their own.
    rendered = whole(tiny_model, CONVERSATION[1:], [TOOL], counts=(0, 1))
    tools_only, first_turn = rendered.prefix_token_counts
    assert tools_only > 0 and rendered.token_ids[:tools_only] == alone(tiny_model, [], [TOOL])
    assert tools_only < first_turn


def test_a_prefix_the_template_renders_otherwise_alone_is_cut_where_they_part(
    tools_model: TokenizerModel,
) -> None:
    # Consecutive tool results share one user turn: alone, the first closes the turn; in the
    # whole conversation the second result follows inside it.
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [call, {**call, "id": "call_2"}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
    ]
    rendered = whole(tools_model, messages, [TOOL], counts=(2, 3))
    through_call, through_first_result = rendered.prefix_token_counts
    assert through_call == len(alone(tools_model, messages[:2], [TOOL]))
    prefix = alone(tools_model, messages[:3], [TOOL])
    assert through_call < through_first_result < len(prefix)
    assert rendered.token_ids[:through_first_result] == prefix[:through_first_result]
    assert rendered.token_ids[through_first_result] != prefix[through_first_result]


def test_a_template_that_cannot_render_the_prefix_alone_gives_no_breakpoint(
    tools_model: TokenizerModel,
) -> None:
    # This template reads messages[0] whenever tools are offered: with no message it fails.
    assert whole(tools_model, CONVERSATION, [TOOL], counts=(0,)).prefix_token_counts == [0]


@pytest.mark.parametrize("counts", [(5,), tuple(range(9))])
def test_too_many_or_too_long_prefixes_are_refused(
    tiny_model: TokenizerModel, counts: tuple[int, ...]
) -> None:
    with pytest.raises(InvalidArgument) as refused:
        whole(tiny_model, CONVERSATION, [], counts=counts)
    assert refused.value.param == "prefix_message_counts"
