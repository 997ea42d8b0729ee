"""Reproducible greedy (batch-invariant steps, the engine's default): the same prompt gives the
same greedy tokens computed cold, read from the prefix cache, and decoded beside 15 other
prompts, in bf16 and in fp32, and the tokens are still transformers' in fp32.

The tiny random-weight model's top tokens are far apart, so its tokens alone would not show a
changed rounding: each token's log-probability is compared too, to the last bit (measured: the
steps' faster kernels, ``batch_invariant=False``, change them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cachet.engine.engine_core import EngineCore
from cachet.engine.model_runner import ModelRunner
from cachet.engine.request import Request
from cachet.engine.sampling_params import SamplingParams
from cachet.engine.scheduler import SchedulerConfig
from cachet.models.tiny import write_tiny_model

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("greedy")
    return write_tiny_model(root / "llama", family="llama", tokenizer_cache_dir=root / "tok")


def prompts(count: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length + i,), generator=generator).tolist() for i in range(count)]


class Engine:
    def __init__(self, model_dir: Path, dtype: torch.dtype) -> None:
        self.runner = ModelRunner(
            model_dir, dtype=dtype, device=torch.device("cpu"), kv_cache_bytes=64 << 20, batch_invariant=True
        )
        # 64-token chunks: the target's prompt is computed in several, others' chunks beside it.
        config = SchedulerConfig(max_model_len=512, max_num_batched_tokens=64, max_num_seqs=16)
        self.core = EngineCore(self.runner, model="tiny", scheduler_config=config)
        self._ids = 0

    def greedy(self, batch: list[list[int]]) -> list[tuple[list[tuple[int, float | None]], int]]:
        """Each prompt's (greedy tokens with their logprobs, cached prompt tokens), run together."""
        ids = []
        for prompt in batch:
            self._ids += 1
            ids.append(f"r{self._ids}")
            sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)
            self.core.add_request(Request(ids[-1], prompt, sampling, max_tokens=NEW_TOKENS))
        tokens: dict[str, list[tuple[int, float | None]]] = {rid: [] for rid in ids}
        cached: dict[str, int] = dict.fromkeys(ids, 0)
        while self.core.has_unfinished_requests():
            for output in self.core.step():
                tokens[output.request_id] += [(t.token_id, t.logprob) for t in output.logprobs]
                cached[output.request_id] = max(cached[output.request_id], output.num_cached_tokens)
        return [(tokens[rid], cached[rid]) for rid in ids]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_greedy_is_the_same_cold_cached_and_in_a_batch_of_16(model_dir: Path, dtype: torch.dtype) -> None:
    engine = Engine(model_dir, dtype)
    assert engine.runner.decode_in_place, "the paged decode kernel did not build here"
    vocab = engine.runner.vocab_size
    target = prompts(1, 150, seed=1, vocab=vocab)[0]
    ((cold, cached_tokens),) = engine.greedy([target])
    ((again, cached_again),) = engine.greedy([target])
    assert cached_tokens == 0 and cached_again >= 144
    others = prompts(15, 40, seed=2, vocab=vocab)
    batched = engine.greedy(others[:6] + [target] + others[6:])
    assert batched[6][1] >= 144
    fresh = Engine(model_dir, dtype).greedy(others[:6] + [target] + others[6:])
    assert fresh[6][1] == 0  # cold, and beside 15 others from its first chunk
    assert again == cold
    assert batched[6][0] == cold
    assert fresh[6][0] == cold


def test_batch_invariant_steps_still_give_transformers_tokens(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    engine = Engine(model_dir, torch.float32)
    target = prompts(1, 150, seed=3, vocab=engine.runner.vocab_size)[0]
    ((ours, _),) = engine.greedy([target])
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([target]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
        )
    assert [token for token, _ in ours] == out[0, len(target) :].tolist()


def test_greedy_and_seeded_requests_share_kv_with_each_other_but_not_with_sampled_ones(
    model_dir: Path,
) -> None:
    """A sampled request's steps run the faster kernels, whose KV may differ in its last bits from
    what a cold greedy run computes: the two kinds name their blocks apart."""
    engine = Engine(model_dir, torch.bfloat16)
    prompt = prompts(1, 100, seed=4, vocab=engine.runner.vocab_size)[0]

    def cached_tokens(**sampling: object) -> int:
        engine._ids += 1
        rid = f"s{engine._ids}"
        params = SamplingParams(max_tokens=2, ignore_eos=True, **sampling)  # type: ignore[arg-type]
        engine.core.add_request(Request(rid, prompt, params, max_tokens=2))
        cached = 0
        while engine.core.has_unfinished_requests():
            for output in engine.core.step():
                cached = max(cached, output.num_cached_tokens)
        return cached

    assert cached_tokens(temperature=1.0) == 0
    assert cached_tokens(temperature=0.0) == 0
    assert cached_tokens(temperature=1.0, seed=7) == 96
    assert cached_tokens(temperature=0.7) == 96
