"""n choices on the real model runner (tiny random Llama, CPU, batch-invariant steps): the other
choices share choice 0's full prompt blocks and copy its last, partial one, so the prompt is
computed once, plus each other choice's last token, whose logits it samples from (issue 28).

Each choice's tokens and log-probabilities are, to the last bit, those of its request run alone
(the router sends choice ``i`` seeded ``seed + i``), in bf16 and in fp32, and still when the
pool is small enough to preempt choices and recompute them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cachet.engine.engine_core import EngineCore
from cachet.engine.model_runner import ModelRunner
from cachet.engine.request import Request
from cachet.engine.sampling_params import SamplingParams
from cachet.engine.scheduler import SchedulerConfig
from cachet.engine.step_plan import KvBlockMoves, StepPlan
from cachet.models.tiny import write_tiny_model

BLOCK = 16
PROMPT_LEN = 2 * BLOCK + 5
CHOICES = 4

Answer = list[tuple[int, float | None]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("choices")
    return write_tiny_model(root / "llama", family="llama", tokenizer_cache_dir=root / "tok")


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def engine(model_dir: Path, dtype: torch.dtype, num_blocks: int = 256, device: str = "cpu") -> EngineCore:
    probe = ModelRunner(model_dir, dtype=dtype, device=torch.device("cpu"), kv_cache_bytes=1 << 20)
    runner = ModelRunner(
        model_dir,
        dtype=dtype,
        device=torch.device(device),
        kv_cache_bytes=num_blocks * probe.kv_block_bytes,
        block_size=BLOCK,
        batch_invariant=True,
    )
    assert runner.decode_in_place or device != "cpu", "the paged decode kernel did not build here"
    config = SchedulerConfig(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8)
    return EngineCore(runner, model="tiny", scheduler_config=config)


def sampling(kind: str, choice: int) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(temperature=0.0, ignore_eos=True, logprobs=True)
    return SamplingParams(temperature=1.0, seed=1000 + choice, ignore_eos=True, logprobs=True)


def collect(core: EngineCore, answers: dict[str, Answer], *, until: str | None = None) -> None:
    """Step until ``until`` has its first token (None: until every request ends)."""
    while core.has_unfinished_requests() and not (until is not None and answers[until]):
        for output in core.step():
            answers[output.request_id] += [(t.token_id, t.logprob) for t in output.logprobs]


def as_choices(core: EngineCore, prompt: list[int], kind: str, max_tokens: int) -> list[Answer]:
    """The choices as the router sends them: choice 0, then the others once it has a token."""
    ids = [f"req/{i}" for i in range(CHOICES)]
    answers: dict[str, Answer] = {rid: [] for rid in ids}
    core.add_request(Request(ids[0], prompt, sampling(kind, 0), max_tokens=max_tokens))
    collect(core, answers, until=ids[0])
    for i, rid in enumerate(ids[1:], start=1):
        core.add_request(Request(rid, prompt, sampling(kind, i), max_tokens=max_tokens))
    collect(core, answers)
    return [answers[rid] for rid in ids]


def alone(core: EngineCore, prompt: list[int], kind: str, max_tokens: int) -> list[Answer]:
    """Each choice's request by itself, cold: a salt of its own shares no KV."""
    answers: list[Answer] = []
    for i in range(CHOICES):
        rid = f"alone/{i}"
        got: dict[str, Answer] = {rid: []}
        core.add_request(Request(rid, prompt, sampling(kind, i), max_tokens=max_tokens, cache_salt=rid))
        collect(core, got)
        answers.append(got[rid])
    return answers


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_choices_compute_the_prompt_once_and_answer_as_alone(
    model_dir: Path, dtype: torch.dtype, kind: str
) -> None:
    core = engine(model_dir, dtype)
    prompt = torch.randint(3, 400, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5)).tolist()
    want = alone(core, prompt, kind, max_tokens=16)
    counts, kv = core.scheduler.counts, core.scheduler.kv
    prefill_before = counts.computed_tokens["interactive", "prefill"]
    got = as_choices(core, prompt, kind, max_tokens=16)
    # Choice 0 computes the prompt; each other choice its last token only (it recomputed the
    # 5 tokens of the partial block before it copied them).
    assert counts.computed_tokens["interactive", "prefill"] - prefill_before == PROMPT_LEN + CHOICES - 1
    assert kv.block_copies["duplicate"] == CHOICES - 1
    assert isinstance(core.runner, ModelRunner)
    assert kv.block_copy_bytes["duplicate"] == (CHOICES - 1) * core.runner.kv_block_bytes
    assert got == want
    if kind == "seeded":
        assert len({tuple(answer) for answer in got}) == CHOICES  # not one answer four times


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_choices_copy_on_the_device_of_the_pool(model_dir: Path, device: str) -> None:
    """The same torch copy on either device. CUDA steps are not batch-invariant (SDPA, and cuBLAS
    picks its kernels by batch: 4 choices decode together, each alone request by itself), so
    logprobs are compared within rounding there; a block copied wrong would be far off."""
    core = engine(model_dir, torch.float32, device=device)
    prompt = torch.randint(3, 400, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7)).tolist()
    want = alone(core, prompt, "greedy", max_tokens=16)
    prefill_before = core.scheduler.counts.computed_tokens["interactive", "prefill"]
    got = as_choices(core, prompt, "greedy", max_tokens=16)
    assert core.scheduler.counts.computed_tokens["interactive", "prefill"] - prefill_before == PROMPT_LEN + 3
    for answer, alone_answer in zip(got, want, strict=True):
        assert [token for token, _ in answer] == [token for token, _ in alone_answer]
        assert [p for _, p in answer] == pytest.approx([p for _, p in alone_answer], abs=1e-4)


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_choices_preempted_and_recomputed_still_answer_as_alone(model_dir: Path, kind: str) -> None:
    # 12 blocks: the 4 choices' 77 tokens need 2 shared blocks and 3 more each at the end.
    core = engine(model_dir, torch.bfloat16, num_blocks=12)
    prompt = torch.randint(3, 400, (PROMPT_LEN,), generator=torch.Generator().manual_seed(6)).tolist()
    want = alone(core, prompt, kind, max_tokens=40)
    preempted_before = core.scheduler.counts.preemptions["kv_cache"]
    got = as_choices(core, prompt, kind, max_tokens=40)
    assert core.scheduler.counts.preemptions["kv_cache"] > preempted_before
    assert got == want
    core.scheduler.check_invariants()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("family", ["llama", "kimi-k2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_runner_copies_a_whole_block_of_every_layer(
    family: str, dtype: torch.dtype, device: str, tmp_path: Path
) -> None:
    """K/V per head (``[layers, 2, blocks, ...]``) and MLA's latent (``[layers, blocks, ...]``)."""
    model = write_tiny_model(tmp_path / family, family=family, tokenizer_cache_dir=tmp_path / "tok")
    runner = ModelRunner(model, dtype=dtype, device=torch.device(device), kv_cache_bytes=4 << 20)
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=torch.Generator().manual_seed(0)))
    before = runner.kv_cache.clone()
    runner.execute(StepPlan(kv_moves=KvBlockMoves(duplicate=[(3, 5), (3, 1)])))
    block = runner.kv_block_dim
    assert block == (1 if family == "kimi-k2" else 2)
    for copy in (5, 1):
        assert torch.equal(runner.kv_cache.select(block, copy), before.select(block, 3))
    untouched = [b for b in range(runner.num_kv_blocks) if b not in (1, 5)]
    kept = torch.tensor(untouched, device=runner.device)
    assert torch.equal(runner.kv_cache.index_select(block, kept), before.index_select(block, kept))
