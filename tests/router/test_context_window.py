"""The router's context-window check: a prompt past the window is refused; a max_tokens past
what it leaves is cut to fit, or refused with OpenAI's 400 when the operator asks for that."""

from __future__ import annotations

import pytest

from cachet.common.v1 import common_pb2
from cachet.engine.v1 import engine_pb2
from cachet.errors import InvalidArgument
from cachet.router.prompt import check_context_window

ENGINE = engine_pb2.EngineInfo(model="tiny", context_window=100)


def test_a_max_tokens_past_the_window_is_cut_to_what_it_leaves() -> None:
    sampling = common_pb2.SamplingParams(max_tokens=32_000)
    check_context_window(60, sampling, ENGINE, "messages", clamp_max_tokens=True)
    assert sampling.max_tokens == 40
    fits = common_pb2.SamplingParams(max_tokens=40)
    check_context_window(60, fits, ENGINE, "messages", clamp_max_tokens=True)
    assert fits.max_tokens == 40
    unset = common_pb2.SamplingParams()
    check_context_window(60, unset, ENGINE, "messages", clamp_max_tokens=True)
    assert not unset.HasField("max_tokens")


def test_strict_mode_refuses_it_naming_max_tokens() -> None:
    sampling = common_pb2.SamplingParams(max_tokens=41)
    with pytest.raises(InvalidArgument, match="exceeds tiny's context window of 100") as refused:
        check_context_window(60, sampling, ENGINE, "messages", clamp_max_tokens=False)
    assert refused.value.param == "max_tokens"
    assert sampling.max_tokens == 41


@pytest.mark.parametrize("clamp", [True, False])
def test_a_prompt_that_fills_the_window_is_refused_either_way(clamp: bool) -> None:
    with pytest.raises(InvalidArgument, match="the prompt is 100 tokens") as refused:
        check_context_window(100, common_pb2.SamplingParams(), ENGINE, "prompt", clamp_max_tokens=clamp)
    assert refused.value.param == "prompt"
