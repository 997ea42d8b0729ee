"""The step cost fit: the line through the steps' times, and when it is not to be trusted."""

from __future__ import annotations

import random

import pytest

from cachet.engine.step_cost import StepCost, StepCostModel


def test_the_fit_recovers_a_steps_fixed_and_per_token_cost_through_noise():
    model = StepCostModel()
    rng = random.Random(0)
    for _ in range(400):
        tokens = rng.choice([1, 2, 3, 40, 60, 100, 128])
        model.observe(tokens, 0.033 + 0.0021 * tokens + rng.gauss(0, 0.002))
    cost = model.estimate()
    assert cost is not None
    assert cost.fixed_seconds == pytest.approx(0.033, rel=0.1)
    assert cost.seconds_per_token == pytest.approx(0.0021, rel=0.05)
    # 1.5 fixed costs' worth of tokens: ~23.
    assert cost.tokens_within(1.5 * cost.fixed_seconds, most=512) in range(21, 26)


def test_no_estimate_from_few_steps_or_steps_all_of_one_size():
    model = StepCostModel()
    for tokens in (1, 100) * 10:
        model.observe(tokens, 0.03 + 0.002 * tokens)
    assert model.estimate() is None  # 20 steps
    uniform = StepCostModel()
    for _ in range(200):
        uniform.observe(32, 0.09)
    assert uniform.estimate() is None  # no spread of sizes: no slope to speak of


def test_steps_that_do_not_grow_with_their_tokens_leave_batch_work_the_whole_step():
    # A GPU's decode steps: the weights' stream is the step, tokens add nothing measurable.
    model = StepCostModel()
    rng = random.Random(1)
    for _ in range(200):
        model.observe(rng.randrange(1, 200), 0.02 + rng.gauss(0, 0.0005))
    cost = model.estimate()
    assert cost is not None and cost.fixed_seconds == pytest.approx(0.02, rel=0.05)
    # Noise leaves a slope near zero: 1.5 fixed costs hold hundreds of tokens, or all of them.
    assert cost.tokens_within(1.5 * cost.fixed_seconds, most=512) >= 400
    assert StepCost(0.02, 0.0).tokens_within(0.03, most=512) == 512


def test_the_fit_follows_a_machine_that_slows_down():
    model = StepCostModel()
    for i in range(2000):
        tokens = 1 + (i * 37) % 100
        per_token = 0.001 if i < 1000 else 0.004
        model.observe(tokens, 0.02 + per_token * tokens)
    cost = model.estimate()
    assert cost is not None and cost.seconds_per_token == pytest.approx(0.004, rel=0.05)
