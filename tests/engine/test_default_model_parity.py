"""The whole engine (scheduler, paged KV cache, runner) on the default model, fp32, greedy:
token for token what transformers' generate produces, alone and batched, cold and cached."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cachet.engine.engine_core import EngineCore
from cachet.engine.model_runner import ModelRunner
from cachet.engine.request import Request
from cachet.engine.sampling_params import SamplingParams
from cachet.engine.scheduler import SchedulerConfig

# Two transformers and three engine runs of the 135M model: minutes on a busy 2-core box.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

NEW_TOKENS = 32
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]


@pytest.fixture(scope="module")
def prompts(default_model_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir), local_files_only=True)
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def expected(default_model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    # No end-of-sequence: both sides run the full length through <|im_end|> (ignore_eos on ours).
    # min_new_tokens would instead forbid EOS, changing the distribution.
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            generated = model.generate(
                torch.tensor([prompt]),
                # Explicit: the prompt holds <|im_end|>, which is also the pad id, and transformers
                # would otherwise infer a mask that hides those tokens.
                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
            )
            outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture(scope="module")
def engine(default_model_dir: Path) -> EngineCore:
    runner = ModelRunner(
        default_model_dir, dtype=torch.float32, device=torch.device("cpu"), kv_cache_bytes=64 * 1024**2
    )
    config = SchedulerConfig(max_model_len=runner.max_model_len, max_num_batched_tokens=64, max_num_seqs=8)
    return EngineCore(runner=runner, model="smollm2-135m-instruct", scheduler_config=config)


def _run(engine: EngineCore, prompts: list[list[int]], tag: str) -> tuple[list[list[int]], list[int]]:
    sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(Request(request_id, list(prompt), sampling, max_tokens=NEW_TOKENS))
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    cached: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
            cached[output.request_id] = output.num_cached_tokens
    return [tokens[i] for i in ids], [cached[i] for i in ids]


def test_alone_then_batched_then_cached_equal_transformers(
    engine: EngineCore, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    for i, prompt in enumerate(prompts):
        alone, _ = _run(engine, [prompt], f"alone{i}")
        assert alone == [expected[i]], QUESTIONS[i]
    # Batched together; the prompts' shared chat-template blocks now come from the cache.
    batched, cached = _run(engine, prompts, "batched")
    assert batched == expected
    assert all(c > 0 for c in cached)
