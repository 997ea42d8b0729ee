"""EngineCore: one step = schedule -> run -> postprocess, outputs, stop strings, KV events."""

from __future__ import annotations

import pytest
from test_block_pool import replay
from test_scheduler import SimulatedRunner, reference_output
from test_stop_strings import build_tokenizer

from cachet.engine.block_pool import KvEvent
from cachet.engine.core_loop import CoreLoop
from cachet.engine.engine_core import EngineCore
from cachet.engine.errors import EngineOverloaded, InvalidRequest, RequestNotFound
from cachet.engine.request import Request, RequestStatus
from cachet.engine.request_output import RequestOutput
from cachet.engine.sampling_params import SamplingParams
from cachet.engine.scheduler import SchedulerConfig
from cachet.engine.step_plan import SampledToken, StepPlan, StepResult
from cachet.errors import InvalidArgument


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def make_engine(num_blocks: int = 32, tokenizer=None, **config) -> tuple[EngineCore, list[KvEvent]]:
    config.setdefault("max_model_len", 128)
    config.setdefault("max_num_batched_tokens", 16)
    config.setdefault("max_num_seqs", 4)
    events: list[KvEvent] = []
    engine = EngineCore(
        SimulatedRunner(num_blocks),
        model="tiny",
        scheduler_config=SchedulerConfig(**config),
        tokenizer=tokenizer,
        kv_event_sink=events.extend,
    )
    return engine, events


def make_request(request_id: str, prompt: list[int], max_tokens: int = 6, **sampling) -> Request:
    return Request(request_id, list(prompt), SamplingParams(**sampling), max_tokens)


def run(engine: EngineCore, max_steps: int = 5000) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outputs
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    raise AssertionError("engine made no progress")


PROMPT = list(range(1, 19))  # 18 tokens: 4 full blocks of 4


def test_only_steps_that_ran_the_model_report_a_step_time():
    # The step-time histogram (and the bench's steps/s) would count empty steps as 0 s ones.
    engine, _ = make_engine()
    loop = CoreLoop(engine)
    assert loop.step().step_seconds is None
    engine.add_request(make_request("a", PROMPT))
    assert loop.step().step_seconds is not None


def test_an_interactive_request_beside_a_backlog_is_served_first_within_the_budget():
    # 16 tokens a step; batch work may spend 4 of them while interactive work is about.
    engine, _ = make_engine(num_blocks=64)
    backlog = {"batch0": list(range(1, 41)), "batch1": list(range(41, 81))}
    for request_id, prompt in backlog.items():
        engine.add_request(Request(request_id, prompt, SamplingParams(), 4, interactive=False))
    tokens: dict[str, list[int]] = {}

    def step() -> dict[str, int]:
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        return engine.runner.plans[-1].num_scheduled_tokens

    assert step() == {"batch0": 16}  # alone, batch work takes whole steps
    chat = list(range(100, 112))
    engine.add_request(make_request("chat", chat, max_tokens=3))
    # The chat's whole prompt, and its first token, in the next step; the backlog's prompts wait.
    assert step() == {"chat": 12}
    assert tokens["chat"] == reference_output(chat, 1)
    assert step() == {"chat": 1, "batch0": 4}
    while engine.has_unfinished_requests():
        step()
    assert tokens == {"chat": reference_output(chat, 3)} | {
        request_id: reference_output(prompt, 4) for request_id, prompt in backlog.items()
    }


def test_outputs_stream_tokens_and_report_usage():
    engine, _ = make_engine()
    engine.add_request(make_request("a", PROMPT, max_tokens=5))
    outputs = run(engine)["a"]
    expected = reference_output(PROMPT, 5)
    assert [t for o in outputs for t in o.new_token_ids] == expected
    assert all(len(o.new_token_ids) == 1 for o in outputs)
    assert [o.finished for o in outputs] == [False] * 4 + [True]
    last = outputs[-1]
    assert last.status == RequestStatus.FINISHED_LENGTH
    assert (last.num_prompt_tokens, last.num_cached_tokens, last.num_completion_tokens) == (18, 0, 5)
    assert last.logprobs == []  # not asked for


def test_second_request_reports_cached_tokens():
    engine, _ = make_engine()
    engine.add_request(make_request("a", PROMPT, max_tokens=1))
    run(engine)
    engine.add_request(make_request("b", PROMPT, max_tokens=1))
    assert run(engine)["b"][-1].num_cached_tokens == 16


def test_logprobs_pass_through_when_asked():
    class LogprobRunner(SimulatedRunner):
        def execute(self, plan: StepPlan) -> StepResult:
            result = super().execute(plan)
            return StepResult(
                {r: SampledToken(s.token_id, -0.5, ((s.token_id, -0.5),)) for r, s in result.sampled.items()}
            )

    engine = EngineCore(LogprobRunner(16), model="tiny", scheduler_config=SchedulerConfig(max_model_len=64))
    engine.add_request(make_request("a", [1, 2, 3], max_tokens=2, logprobs=True))
    outputs = run(engine)["a"]
    assert [o.logprobs[0].logprob for o in outputs] == [-0.5, -0.5]


def test_stop_string_across_tokens_finishes_the_request(tokenizer):
    expected = reference_output(PROMPT, 12)
    text = [tokenizer.decode([t]) for t in expected]
    # A stop string made of the end of the 4th token's text and the start of the 5th.
    stop = text[3][-1:] + text[4][:1]
    assert stop not in tokenizer.decode(expected[:4])
    engine, _ = make_engine(tokenizer=tokenizer)
    engine.add_request(make_request("a", PROMPT, max_tokens=12, stop=(stop,)))
    outputs = run(engine)["a"]
    completion = [t for o in outputs for t in o.new_token_ids]
    first_hit = next(k for k in range(1, 13) if stop in tokenizer.decode(expected[:k]))
    assert completion == expected[:first_hit]
    assert outputs[-1].status == RequestStatus.FINISHED_STOPPED
    assert outputs[-1].matched_stop == stop


def test_stop_strings_need_a_tokenizer():
    engine, _ = make_engine()
    with pytest.raises(InvalidRequest, match="tokenizer"):
        engine.add_request(make_request("a", PROMPT, stop=("x",)))
    # Out of range, SamplingParams cannot even be built (cachet.sampling_ranges).
    with pytest.raises(InvalidArgument, match="temperature"):
        engine.add_request(make_request("b", PROMPT, temperature=-1.0))
    assert not engine.has_unfinished_requests()


def test_overload_is_raised_to_the_caller():
    engine, _ = make_engine(max_waiting=1)
    engine.add_request(make_request("a", PROMPT))
    with pytest.raises(EngineOverloaded):
        engine.add_request(make_request("b", PROMPT))


def test_abort_frees_blocks_and_reports_on_the_next_step():
    engine, _ = make_engine(num_blocks=16)
    engine.add_request(make_request("a", PROMPT, max_tokens=30))
    engine.step()  # a 16-token chunk: nothing sampled yet
    assert [o.new_token_ids for o in engine.step()] == [reference_output(PROMPT, 1)]
    engine.abort("a")
    assert engine.scheduler.kv.num_free_blocks == 16
    [output] = engine.step()
    assert (output.request_id, output.status, output.new_token_ids) == (
        "a",
        RequestStatus.FINISHED_ABORTED,
        [],
    )
    assert output.num_completion_tokens == 1
    with pytest.raises(RequestNotFound):
        engine.abort("a")
    # The runner learns of the abort with the next plan that has work.
    assert "a" in engine.runner.seqs
    engine.add_request(make_request("b", [1, 2], max_tokens=1))
    engine.step()
    assert "a" not in engine.runner.seqs


def test_kv_events_reach_the_sink_and_mirror_the_cache():
    engine, events = make_engine(num_blocks=12)
    for i in range(6):
        engine.add_request(make_request(f"r{i}", PROMPT[: 6 + 2 * i] + [40 + i] * 5, max_tokens=8))
    run(engine)
    known: set[int] = set()
    replay(events, known)
    assert known and known == engine.scheduler.kv.pool.cached_hashes()
    events.clear()
    assert engine.reset_prefix_cache()
    replay(events, known)
    assert known == set()


def test_invariants_are_checked_when_the_engine_goes_idle():
    engine, _ = make_engine()
    engine.add_request(make_request("a", [1, 2, 3], max_tokens=2))
    engine.step()
    engine.scheduler.kv.pool.touch([30])  # a leaked reference
    with pytest.raises(AssertionError, match="block 30"):
        run(engine)


def test_real_model_runner_gives_the_same_greedy_tokens_under_preemption(tmp_path):
    """EngineCore on the real ModelRunner (tiny random Llama, fp32): a pool small enough
    to force preemptions and prefix-cache hits yields the tokens of an unconstrained run."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    from cachet.engine.attention import kv_cache_bytes_per_block
    from cachet.engine.model_runner import ModelRunner

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    per_block = kv_cache_bytes_per_block(2, 4, 2, 16, torch.float32)

    def generate(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        runner = ModelRunner(
            tmp_path,
            dtype=torch.float32,
            device=torch.device("cpu"),
            kv_cache_bytes=per_block * num_blocks,
            block_size=4,
            max_model_len=32,
        )
        engine = EngineCore(runner, model="tiny-llama", scheduler_config=SchedulerConfig(max_model_len=32))
        stem = [7, 99, 23, 311, 5, 42, 17, 260, 88]
        for i in range(4):
            sampling = {"temperature": 0.0, "ignore_eos": True}
            engine.add_request(make_request(f"r{i}", stem + [100 + i] * (i + 1), max_tokens=12, **sampling))
        preemptions = 0
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            before = {r.request_id for r in engine.scheduler.running}
            for output in engine.step():
                tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            preempted = [r for r in engine.scheduler.waiting if r.status == RequestStatus.PREEMPTED]
            preemptions += sum(1 for r in preempted if r.request_id in before)
        return tokens, preemptions

    roomy, roomy_preemptions = generate(64)
    tight, tight_preemptions = generate(12)
    assert roomy_preemptions == 0 and tight_preemptions > 0
    assert tight == roomy
    assert all(len(t) == 12 for t in roomy.values())
