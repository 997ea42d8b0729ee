"""Greedy tokens from our ModelRunner equal transformers' generate, token for token (fp32).

The runner is driven with hand-built StepPlans by a tiny simulated scheduler,
so the same model is exercised through one-shot prefill, chunked prefill,
mixed prefill/decode batches and prefix reuse through shared block ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from cachet.engine import cuda_graphs
from cachet.engine.model_runner import ModelRunner
from cachet.engine.piecewise_graphs import captured_token_counts
from cachet.engine.sampling_params import SamplingParams
from cachet.engine.step_plan import NewRequest, RunningRequestDiff, StepPlan

# One thread: on a shared 2-core machine, a second OpenMP thread makes tiny matmuls 100x slower.
torch.set_num_threads(1)

NEW_TOKENS = 32
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=256,
    # Wider than HF's 0.02 default so random logits are far from ties.
    initializer_range=0.2,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)
VARIANTS = {
    "llama-untied": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": False}),
    "llama-tied": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": True}),
    "qwen2-bias": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "rope-linear": (LlamaConfig, LlamaForCausalLM, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "rope-llama3": (
        LlamaConfig,
        LlamaForCausalLM,
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
    "rope-yarn": (
        LlamaConfig,
        LlamaForCausalLM,
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    ),
    # A short trained window, so generation runs past it and the base really changes.
    "rope-dynamic": (
        LlamaConfig,
        LlamaForCausalLM,
        {"max_position_embeddings": 48, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    ),
}


def make_checkpoint(directory: Path, variant: str, seed: int = 0) -> Path:
    config_cls, model_cls, extra = VARIANTS[variant]
    torch.manual_seed(seed)
    config = config_cls(**{**TINY, **extra})
    model = model_cls(config).float().eval()
    if variant == "qwen2-bias":
        # HF initialises biases to zero; make them matter.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {name: make_checkpoint(root / name, name) for name in VARIANTS}


def hf_greedy(model_dir: Path, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    config_cls, model_cls, _ = VARIANTS[model_dir.name]
    model = model_cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt) :].tolist()


@dataclass
class SimRequest:
    prompt: list[int]
    chunk: int = 1 << 30
    start_step: int = 0
    # Prefix reuse: take this many leading blocks of another request (after its prefill).
    reuse_from: str | None = None
    reuse_blocks: int = 0
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    admitted: bool = False


def drive(runner: ModelRunner, requests: dict[str, SimRequest], new_tokens: int = NEW_TOKENS) -> None:
    """A minimal scheduler: admits requests at their start step, chunks prefills, allocates blocks."""
    bs = runner.block_size
    next_block = iter(range(runner.num_kv_blocks))
    finished: set[str] = set()
    step = 0
    while len(finished) < len(requests):
        plan_new, plan_running, scheduled = [], [], {}
        for rid, req in requests.items():
            if rid in finished or step < req.start_step:
                continue
            if not req.admitted and req.reuse_from is not None:
                donor = requests[req.reuse_from]
                if donor.computed < req.reuse_blocks * bs:
                    continue  # wait until the donor's blocks hold the shared prefix
                assert donor.prompt[: req.reuse_blocks * bs] == req.prompt[: req.reuse_blocks * bs]
                req.blocks = donor.blocks[: req.reuse_blocks]
                req.computed = req.reuse_blocks * bs
            known = len(req.prompt) + len(req.output)
            num_new = min(req.chunk, known - req.computed)
            needed = -(-(req.computed + num_new) // bs)
            gained = [next(next_block) for _ in range(needed - len(req.blocks))]
            req.blocks += gained
            if not req.admitted:
                plan_new.append(
                    NewRequest(
                        rid, req.prompt, [], SamplingParams(temperature=0.0), list(req.blocks), req.computed
                    )
                )
                req.admitted = True
            else:
                plan_running.append(RunningRequestDiff(rid, gained, req.computed))
            scheduled[rid] = num_new
        result = runner.execute(StepPlan(plan_new, plan_running, scheduled, finished_request_ids=set()))
        for rid, num_new in scheduled.items():
            req = requests[rid]
            req.computed += num_new
            if rid in result.sampled:
                req.output.append(result.sampled[rid].token_id)
            if len(req.output) == new_tokens:
                finished.add(rid)
        assert set(result.sampled) <= set(scheduled)
        step += 1


def runner_for(
    model_dir: Path, block_size: int = 16, device: str = "cpu", **options: bool | int
) -> ModelRunner:
    # Dynamic NTK is the one variant meant to run past its trained window.
    max_len = 128 if model_dir.name == "rope-dynamic" else None
    return ModelRunner(
        model_dir,
        dtype=torch.float32,
        device=torch.device(device),
        kv_cache_bytes=4 << 20,
        block_size=block_size,
        max_model_len=max_len,
        **options,
    )


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_one_shot_prefill_matches_hf(checkpoints: dict[str, Path], variant: str) -> None:
    p = prompt(1, 21)
    reqs = {"a": SimRequest(p)}
    drive(runner_for(checkpoints[variant]), reqs)
    assert reqs["a"].output == hf_greedy(checkpoints[variant], p)


@pytest.mark.parametrize("variant", ["llama-untied", "qwen2-bias", "rope-dynamic"])
def test_chunked_prefill_matches_hf(checkpoints: dict[str, Path], variant: str) -> None:
    p = prompt(2, 37)
    reqs = {"a": SimRequest(p, chunk=5)}
    drive(runner_for(checkpoints[variant], block_size=4), reqs)
    assert reqs["a"].output == hf_greedy(checkpoints[variant], p)


@pytest.mark.parametrize("variant", ["llama-tied", "qwen2-bias"])
def test_batched_mixed_prefill_and_decode_match_hf(checkpoints: dict[str, Path], variant: str) -> None:
    # Staggered arrivals and chunk sizes: most steps mix prefill chunks with decodes.
    reqs = {
        "a": SimRequest(prompt(3, 19)),
        "b": SimRequest(prompt(4, 50), chunk=7, start_step=2),
        "c": SimRequest(prompt(5, 3), start_step=5),
        "d": SimRequest(prompt(6, 33), chunk=16, start_step=1),
    }
    drive(runner_for(checkpoints[variant], block_size=8), reqs)
    for rid, req in reqs.items():
        assert req.output == hf_greedy(checkpoints[variant], req.prompt), rid


def test_prefix_reuse_through_shared_blocks_matches_hf(checkpoints: dict[str, Path]) -> None:
    model_dir = checkpoints["llama-untied"]
    shared = prompt(7, 32)
    reqs = {
        "donor": SimRequest(shared + prompt(8, 9)),
        # Starts with 2 blocks (32 tokens) it never computed itself.
        "reuser": SimRequest(shared + prompt(9, 14), reuse_from="donor", reuse_blocks=2, chunk=6),
    }
    drive(runner_for(model_dir), reqs)
    assert reqs["reuser"].blocks[:2] == reqs["donor"].blocks[:2]
    for req in reqs.values():
        assert req.output == hf_greedy(model_dir, req.prompt)


def test_preempted_request_resumes_identically(checkpoints: dict[str, Path]) -> None:
    model_dir = checkpoints["llama-untied"]
    p = prompt(10, 12)
    expected = hf_greedy(model_dir, p, new_tokens=20)
    runner = runner_for(model_dir, block_size=4)
    greedy = SamplingParams(temperature=0.0)
    runner.execute(StepPlan([NewRequest("a", p, [], greedy, [0, 1, 2], 0)], [], {"a": 12}))
    out = [
        runner.execute(StepPlan([], [RunningRequestDiff("a", [3] if i == 0 else [], 12 + i)], {"a": 1}))
        .sampled["a"]
        .token_id
        for i in range(4)
    ]
    # Preempted: dropped, then rebuilt with its output recomputed as if it were prompt, in new blocks.
    assert runner.execute(StepPlan(finished_request_ids={"a"})).sampled == {}
    assert runner.num_requests == 0
    first = runner.execute(
        StepPlan([NewRequest("a", p, [expected[0]] + out, greedy, [5, 6, 7, 8, 9], 0)], [], {"a": 17})
    )
    assert [expected[0]] + out + [first.sampled["a"].token_id] == expected[:6]


def test_runner_rejects_inconsistent_plans(checkpoints: dict[str, Path]) -> None:
    runner = runner_for(checkpoints["llama-untied"])
    with pytest.raises(KeyError):
        runner.execute(StepPlan(num_scheduled_tokens={"ghost": 1}))
    p = prompt(11, 10)
    with pytest.raises(ValueError, match="span"):
        # Scheduling past the known tokens would feed the model tokens it has not got.
        runner.execute(StepPlan([NewRequest("a", p, [], SamplingParams(), [0], 0)], [], {"a": 11}))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_runner_matches_hf(checkpoints: dict[str, Path]) -> None:
    model_dir = checkpoints["qwen2-bias"]
    runner = ModelRunner(model_dir, dtype=torch.float32, device=torch.device("cuda"), kv_cache_bytes=4 << 20)
    reqs = {"a": SimRequest(prompt(3, 19)), "b": SimRequest(prompt(4, 40), chunk=9, start_step=1)}
    drive(runner, reqs)
    for req in reqs.values():
        assert req.output == hf_greedy(model_dir, req.prompt)


def test_captured_shapes_cover_whole_blocks() -> None:
    assert cuda_graphs.captured_batch_sizes(1) == [1]
    assert cuda_graphs.captured_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert cuda_graphs.captured_kv_lengths(8192, 16) == [256, 512, 1024, 2048, 4096, 8192]
    # A block size that does not divide the powers of two: every length is whole blocks.
    assert cuda_graphs.captured_kv_lengths(1000, 48) == [288, 528, 1008]
    assert cuda_graphs.captured_kv_lengths(100, 16) == [112]


def staggered_decoders() -> dict[str, SimRequest]:
    """Three requests (a batch padded to 4), admitted apart so decode steps span several
    captured context lengths and mix with prefill chunks, which run eagerly."""
    return {
        "a": SimRequest(prompt(12, 5)),
        "b": SimRequest(prompt(13, 30), chunk=8, start_step=2),
        "c": SimRequest(prompt(14, 17), start_step=4),
    }


@pytest.mark.parametrize(
    ("variant", "block_size"), [("llama-tied", 8), ("qwen2-bias", 8), ("rope-dynamic", 8), ("llama-tied", 12)]
)
def test_fixed_shape_decode_steps_match_hf(
    checkpoints: dict[str, Path], variant: str, block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The steps CUDA graphs capture, run eagerly on the CPU: padded batches, padded keys,
    # padding rows writing into the scratch block (block 0 holds request a's prompt).
    monkeypatch.setattr(cuda_graphs, "MIN_CAPTURED_KV_LEN", 16)
    runner = runner_for(checkpoints[variant], block_size=block_size, cuda_graphs=True, max_decode_batch=4)
    graphs = runner.decode_graphs
    assert graphs is not None
    assert graphs.batch_sizes == [1, 2, 4]
    assert graphs.kv_lengths[:3] == ([16, 32, 64] if block_size == 8 else [24, 36, 72])
    assert runner.kv_cache.shape[2] == runner.num_kv_blocks + 1
    reqs = staggered_decoders()
    drive(runner, reqs)
    assert graphs.runs >= NEW_TOKENS
    for rid, req in reqs.items():
        assert req.output == hf_greedy(checkpoints[variant], req.prompt), rid


def test_decode_steps_outside_the_captured_shapes_run_eagerly(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cuda_graphs, "MIN_CAPTURED_KV_LEN", 16)
    runner = runner_for(checkpoints["llama-tied"], block_size=8, cuda_graphs=True, max_decode_batch=2)
    reqs = staggered_decoders()
    drive(runner, reqs)
    # Three decoders never fit a batch of 2; one or two do.
    assert 0 < runner.decode_graphs.runs < NEW_TOKENS * 3
    for rid, req in reqs.items():
        assert req.output == hf_greedy(checkpoints["llama-tied"], req.prompt), rid


def test_captured_token_counts_double_then_step_by_256() -> None:
    assert captured_token_counts(2048) == [8, 16, 32, 64, 128, 256, *range(512, 2048, 256), 2048]
    assert captured_token_counts(24) == [8, 16, 24]
    assert captured_token_counts(600) == [8, 16, 32, 64, 128, 256, 512, 600]


_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    ("variant", "device"),
    [
        ("llama-untied", "cpu"),
        ("qwen2-bias", "cpu"),
        ("rope-dynamic", "cpu"),
        pytest.param("llama-untied", "cuda", marks=_NEEDS_CUDA),
        pytest.param("rope-dynamic", "cuda", marks=_NEEDS_CUDA),
    ],
)
def test_prompt_steps_padded_and_split_at_attention_match_hf(
    checkpoints: dict[str, Path], variant: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prompt and mixed steps padded to 8, 16 or 24 tokens, attention taken out of each layer and
    # run on the real tokens only: replayed from piecewise graphs on CUDA, run eagerly on the CPU.
    # Request b's 30-token prompt comes in 8-token chunks beside a's and c's decodes; c's whole
    # 17-token prompt fits 24; decode steps of 3 go to the decode graphs' batch of 4.
    monkeypatch.setattr(cuda_graphs, "MIN_CAPTURED_KV_LEN", 16)
    runner = runner_for(
        checkpoints[variant],
        block_size=8,
        device=device,
        cuda_graphs=True,
        max_decode_batch=4,
        max_step_tokens=24,
    )
    graphs = runner.step_graphs
    assert graphs is not None
    assert graphs.token_counts == [8, 16, 24]
    reqs = staggered_decoders()
    reqs["d"] = SimRequest(prompt(15, 40), start_step=6)  # 40 tokens at once: past 24, eager
    drive(runner, reqs)
    assert graphs.runs >= 4
    assert graphs.replays == (graphs.runs if device == "cuda" else 0)
    if device == "cuda":
        # One set of edge tensors for both layers and every count: q (4 heads), k and v (2 each)
        # and the output (4) of 16-wide heads at 24 tokens, fp32, and the logits' 4 rows.
        assert graphs.edge_buffer_bytes == (4 + 2 + 2 + 4) * 16 * 24 * 4 + 4 * 512 * 4
    for rid, req in reqs.items():
        assert req.output == hf_greedy(checkpoints[variant], req.prompt), rid


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant", ["qwen2-bias", "rope-dynamic"])
def test_cuda_graph_decode_matches_hf(
    checkpoints: dict[str, Path], variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cuda_graphs, "MIN_CAPTURED_KV_LEN", 16)
    runner = runner_for(
        checkpoints[variant], block_size=8, device="cuda", cuda_graphs=True, max_decode_batch=4
    )
    reqs = staggered_decoders()
    drive(runner, reqs)
    assert runner.decode_graphs.replays >= NEW_TOKENS
    for rid, req in reqs.items():
        assert req.output == hf_greedy(checkpoints[variant], req.prompt), rid
