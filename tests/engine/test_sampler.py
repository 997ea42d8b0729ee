"""Sampler semantics on hand-made logits, plus the runner's seed and mask plumbing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cachet.engine import sampler
from cachet.engine.model_runner import ModelRunner
from cachet.engine.sampler import (
    SamplingRow,
    apply_penalties,
    apply_top_k_top_p_min_p,
    argmax_rows,
    sample,
    skip_draws,
)
from cachet.engine.sampling_params import SamplingParams
from cachet.engine.step_plan import NewRequest, RunningRequestDiff, StepPlan

torch.set_num_threads(1)

# Probabilities 0.5, 0.3, 0.15, 0.05 (then nothing): exact supports for top_p / min_p.
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def row(**params: object) -> SamplingRow:
    seed = params.pop("seed", None)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(
        SamplingParams(**params), prompt_token_ids=[], output_token_ids=[], generator=generator
    )


def draw_many(logits: torch.Tensor, n: int, **params: object) -> set[int]:
    tokens = sample(logits.expand(n, -1).clone(), [row(**params) for _ in range(n)])
    return {t.token_id for t in tokens}


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, 100)
    tokens = sample(logits, [row(temperature=0.0) for _ in range(5)])
    assert [t.token_id for t in tokens] == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    ("params", "support"),
    [
        ({"top_k": 2}, {0, 1}),
        ({"top_k": 3}, {0, 1, 2}),
        ({"top_p": 0.75}, {0, 1}),
        ({"top_p": 0.85}, {0, 1, 2}),
        ({"min_p": 0.5}, {0, 1}),  # keeps p >= 0.25
        ({"min_p": 0.2}, {0, 1, 2}),  # keeps p >= 0.1
        ({"top_p": 0.1}, {0}),
        ({}, {0, 1, 2, 3}),
    ],
)
def test_filters_restrict_support_exactly(params: dict[str, float], support: set[int]) -> None:
    assert draw_many(LOGITS[None], 3000, temperature=1.0, **params) == support


def test_filter_function_masks_per_row() -> None:
    logits = LOGITS.expand(3, -1)
    out = apply_top_k_top_p_min_p(
        logits, torch.tensor([1, 0, 0]), torch.tensor([1.0, 0.85, 1.0]), torch.tensor([0.0, 0.0, 0.5])
    )
    assert torch.isfinite(out).tolist() == [
        [True, False, False, False],
        [True, True, True, False],
        [True, True, False, False],
    ]


# Peaked: decided by the first candidates; less so: by the second; flat: sorted whole.
@pytest.mark.parametrize("spread", [8.0, 4.0, 0.3])
def test_filters_decided_by_the_most_likely_tokens_match_a_full_sort(
    spread: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    generator = torch.Generator().manual_seed(int(spread * 10))
    logits = torch.randn(6, 49_152, generator=generator) * spread
    top_k = torch.tensor([0, 40, 0, 0, 0, 300])
    top_p = torch.tensor([0.9, 1.0, 0.5, 1.0, 1.0, 0.95])
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.2, 0.0, 0.0])  # row 4: no filter, keeps everything
    filtered = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    monkeypatch.setattr(sampler, "FILTER_CANDIDATES", ())
    sorted_whole = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    assert torch.equal(torch.isfinite(filtered), torch.isfinite(sorted_whole))
    assert torch.isfinite(filtered[4]).all()
    assert torch.equal(filtered[torch.isfinite(filtered)], logits[torch.isfinite(filtered)])


@pytest.mark.parametrize("spread", [8.0, 4.0, 0.3])
@pytest.mark.parametrize("with_unfiltered_row", [False, True])
def test_kept_columns_are_the_full_filter_restricted_to_the_kept_tokens(
    spread: float, with_unfiltered_row: bool
) -> None:
    """What the draw runs over: exactly the columns some row keeps, ascending, each row's
    filtered logits there, whichever way they were found (placed from the candidates, or the
    vocabulary filtered and scanned)."""
    generator = torch.Generator().manual_seed(int(spread * 10))
    logits = torch.randn(6, 49_152, generator=generator) * spread
    top_k = torch.tensor([0, 40, 0, 0, 5, 300])
    top_p = torch.tensor([0.9, 1.0, 0.5, 1.0, 1.0, 0.95])
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.2, 0.0, 0.0])
    if with_unfiltered_row:
        top_k[4] = 0
    full = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    columns, kept = sampler.kept_columns(logits, top_k, top_p, min_p)
    expected_columns = torch.isfinite(full).any(dim=0).nonzero().squeeze(1)
    assert torch.equal(columns, expected_columns)
    assert torch.equal(kept, full[:, expected_columns])


def test_temperature_sampling_follows_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 20000
    tokens = torch.tensor(
        [t.token_id for t in sample(logits.expand(n, -1).clone(), [row(temperature=2.0) for _ in range(n)])]
    )
    freq = torch.bincount(tokens, minlength=4).float() / n
    torch.testing.assert_close(freq, (logits[0] / 2.0).softmax(-1), atol=0.015, rtol=0)


def seeded_stream(seed: int, companions: int, steps: int = 8, **filters: float) -> list[int]:
    logits = torch.randn(steps, 1, 64, generator=torch.Generator().manual_seed(3))
    target = row(temperature=1.0, seed=seed, **filters)
    # Companions: unseeded, differently seeded and greedy rows, in front of the target; with
    # filters, their own (another row's support changes the columns a step draws over).
    others = [
        row(temperature=0.7, seed=100 + i, top_k=3 + i)
        if i % 2
        else row(temperature=1.0, **({"min_p": 0.3} if filters else {}))
        for i in range(companions)
    ]
    out = []
    for step in range(steps):
        step_logits = torch.cat([torch.randn(companions, 64), logits[step]])
        out.append(sample(step_logits, [*others, target])[-1].token_id)
    return out


@pytest.mark.parametrize("filters", [{}, {"top_p": 0.9}, {"top_k": 5, "min_p": 0.05}])
def test_seed_reproduces_and_ignores_batch_companions(filters: dict[str, float]) -> None:
    alone = seeded_stream(seed=7, companions=0, **filters)
    assert seeded_stream(seed=7, companions=3, **filters) == alone
    assert seeded_stream(seed=7, companions=5, **filters) == alone
    assert seeded_stream(seed=8, companions=0, **filters) != alone


def test_skip_draws_replays_the_draws_of_sampling() -> None:
    logits = torch.randn(6, 200)
    g = torch.Generator().manual_seed(5)
    stream = [
        sample(logits[i : i + 1], [SamplingRow(SamplingParams(), [], [], generator=g)])[0].token_id
        for i in range(6)
    ]
    resumed = torch.Generator().manual_seed(5)
    skip_draws(resumed, 4, 200)
    tail = [
        sample(logits[i : i + 1], [SamplingRow(SamplingParams(), [], [], generator=resumed)])[0].token_id
        for i in range(4, 6)
    ]
    assert tail == stream[4:]


def test_repetition_penalty_follows_hf_over_prompt_and_output() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    r = SamplingRow(SamplingParams(repetition_penalty=2.0), prompt_token_ids=[0, 1], output_token_ids=[1, 4])
    out = apply_penalties(logits, [r])
    # Seen positive logits are divided, seen negative ones multiplied; unseen untouched.
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0, 0.5]]


def test_presence_and_frequency_penalties_follow_openai_over_output_only() -> None:
    logits = torch.zeros(1, 5)
    r = SamplingRow(
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        prompt_token_ids=[3, 3, 3],
        output_token_ids=[1, 1, 1, 2],
    )
    out = apply_penalties(logits, [r])
    # token 1: 3 * 0.25 + 0.5; token 2: 0.25 + 0.5; prompt-only token 3 untouched.
    assert out.tolist() == [[0.0, -1.25, -0.75, 0.0, 0.0]]


def test_penalties_are_per_row() -> None:
    logits = torch.ones(2, 3)
    rows = [
        SamplingRow(SamplingParams(frequency_penalty=1.0), [], [0]),
        SamplingRow(SamplingParams(), [], [0]),
    ]
    assert apply_penalties(logits, rows).tolist() == [[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]]


def test_logprobs_are_log_softmax_after_penalties_before_temperature() -> None:
    logits = torch.randn(2, 50)
    rows = [
        SamplingRow(
            SamplingParams(temperature=0.3, logprobs=True, top_logprobs=5, repetition_penalty=1.5),
            [1, 2],
            [3],
            generator=torch.Generator().manual_seed(0),
        ),
        SamplingRow(SamplingParams(temperature=0.0, logprobs=True), [], []),
    ]
    out = sample(logits, rows)
    expected = torch.log_softmax(apply_penalties(logits, rows), -1)
    assert out[0].logprob == pytest.approx(expected[0, out[0].token_id].item(), abs=1e-6)
    top_v, top_i = expected[0].topk(5)
    assert [t for t, _ in out[0].top_logprobs] == top_i.tolist()
    assert [v for _, v in out[0].top_logprobs] == pytest.approx(top_v.tolist(), abs=1e-6)
    assert out[1].logprob == pytest.approx(expected[1].max().item(), abs=1e-6)
    assert out[1].top_logprobs == ()
    plain = sample(logits[:1], [row(temperature=0.0)])[0]
    assert plain.logprob is None and plain.top_logprobs == ()


def test_mask_allows_only_masked_tokens() -> None:
    vocab = 64
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[[3, 17, 40]] = True
    logits = torch.randn(1, vocab)
    logits[0, 5] = 50.0  # the model's clear favourite, forbidden
    for params in ({"temperature": 0.0}, {"temperature": 1.5}, {"temperature": 1.0, "top_k": 2}):
        n = 500
        rows = [SamplingRow(SamplingParams(**params), [], [], allowed=allowed) for _ in range(n)]
        tokens = {t.token_id for t in sample(logits.expand(n, -1).clone(), rows)}
        assert tokens <= {3, 17, 40}, params
    # An unmasked row in the same batch still picks the favourite.
    rows = [SamplingRow(SamplingParams(temperature=0.0), [], [], allowed=allowed), row(temperature=0.0)]
    assert [t.token_id for t in sample(logits.expand(2, -1).clone(), rows)][1] == 5


def test_mask_that_allows_nothing_is_an_error() -> None:
    rows = [SamplingRow(SamplingParams(), [], [], allowed=torch.zeros(8, dtype=torch.bool))]
    with pytest.raises(ValueError, match="allows no token"):
        sample(torch.zeros(1, 8), rows)


# --- Through the model runner -------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        initializer_range=0.2,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def generate(
    runner: ModelRunner,
    prompts: dict[str, tuple[list[int], SamplingParams]],
    steps: int,
    masks: dict[str, torch.Tensor] | None = None,
) -> dict[str, list[int]]:
    """Prefill every prompt in one step, then decode; block i*8.. belongs to request i."""
    new = [
        NewRequest(rid, p, [], params, list(range(i * 8, i * 8 + 8)), 0)
        for i, (rid, (p, params)) in enumerate(prompts.items())
    ]
    out = {rid: [] for rid in prompts}
    plan = StepPlan(new, [], {rid: len(p) for rid, (p, _) in prompts.items()})
    for _ in range(steps):
        for rid, token in runner.execute(plan, masks).sampled.items():
            out[rid].append(token.token_id)
        running = [RunningRequestDiff(rid, [], len(prompts[rid][0]) + len(out[rid]) - 1) for rid in prompts]
        plan = StepPlan([], running, {rid: 1 for rid in prompts})
    return out


def new_runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(model_dir, dtype=torch.float32, device=torch.device("cpu"), kv_cache_bytes=2 << 20)


def test_runner_seeded_requests_ignore_batch_companions(model_dir: Path) -> None:
    seeded = ([5, 6, 7, 8, 9], SamplingParams(temperature=1.0, seed=42))
    alone = generate(new_runner(model_dir), {"s": seeded}, steps=10)["s"]
    crowd = generate(
        new_runner(model_dir),
        {
            "x": ([1, 2, 3], SamplingParams(temperature=1.0)),
            "s": seeded,
            "y": ([9, 9, 9, 9, 9, 9, 9], SamplingParams(temperature=0.8, seed=1, top_p=0.9)),
        },
        steps=10,
    )["s"]
    assert crowd == alone
    other_seed = generate(
        new_runner(model_dir), {"s": (seeded[0], SamplingParams(temperature=1.0, seed=43))}, steps=10
    )["s"]
    assert other_seed != alone


def test_runner_applies_logit_masks(model_dir: Path) -> None:
    allowed = torch.zeros(512, dtype=torch.bool)
    allowed[[10, 20, 30]] = True
    out = generate(
        new_runner(model_dir),
        {
            "masked": ([4, 5, 6], SamplingParams(temperature=1.0)),
            "free": ([4, 5, 6], SamplingParams(temperature=0.0)),
        },
        steps=12,
        masks={"masked": allowed},
    )
    assert set(out["masked"]) <= {10, 20, 30}
    assert not set(out["free"]) <= {10, 20, 30}
    with pytest.raises(ValueError, match="shape"):
        generate(
            new_runner(model_dir),
            {"a": ([1], SamplingParams())},
            steps=1,
            masks={"a": torch.ones(7, dtype=torch.bool)},
        )


def test_runner_records_logprobs(model_dir: Path) -> None:
    runner = new_runner(model_dir)
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)
    token = runner.execute(StepPlan([NewRequest("a", [1, 2, 3], [], params, [0], 0)], [], {"a": 3})).sampled[
        "a"
    ]
    assert token.top_logprobs[0][0] == token.token_id
    assert token.logprob == pytest.approx(token.top_logprobs[0][1])
    assert math.isfinite(token.logprob) and token.logprob <= 0.0


def test_argmax_rows_matches_torch_argmax_with_ties_and_masked_rows() -> None:
    generator = torch.Generator().manual_seed(3)
    values = torch.randn(8, 49_152, generator=generator)
    values[1, 10] = values[1, 20] = values[1].max() + 1  # a tie: the first index wins
    values[2] = float("-inf")  # every token forbidden
    values[3, 7] = float("inf")
    expected = values.argmax(dim=-1)
    assert torch.equal(argmax_rows(values), expected)
    assert argmax_rows(values)[1] == 10 and argmax_rows(values).dtype == torch.int64
    # Non-contiguous input (a column slice) and a non-float32 dtype take the same answer.
    assert torch.equal(argmax_rows(values[:, :1000]), values[:, :1000].argmax(dim=-1))
    assert torch.equal(argmax_rows(values.double()), expected)
