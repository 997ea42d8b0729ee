"""One expert-parallel rank for test_deepseek_v3, importable without transformers.

Spawned ranks re-import the module that holds their target; keeping that module
free of transformers and the parity helpers saves seconds per rank per run.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from cachet.engine.attention import SequenceSpan, build_attention_metadata
from cachet.engine.distributed import TensorParallel, init_distributed, local_group_environment
from cachet.engine.model_runner import ModelRunner
from cachet.engine.sampling_params import SamplingParams
from cachet.engine.step_plan import NewRequest, RunningRequestDiff, StepPlan

BLOCK_SIZE = 4


def runner_for(
    model_dir: Path, block_size: int = BLOCK_SIZE, tp: TensorParallel | None = None
) -> ModelRunner:
    return ModelRunner(
        model_dir,
        dtype=torch.float32,
        device=torch.device("cpu"),
        kv_cache_bytes=1 << 20,
        block_size=block_size,
        tp=tp,
    )


def prompt(seed: int, length: int, vocab: int = 49152) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Logits at every position of a one-shot prefill (the runner itself keeps only the last)."""
    blocks = list(range(-(-len(ids) // runner.block_size)))
    meta = build_attention_metadata(
        [SequenceSpan(0, len(ids), blocks, True)], runner.block_size, runner.device
    )
    meta.sample_indices = torch.arange(len(ids))
    with torch.inference_mode():
        return runner.model(torch.tensor(ids), torch.arange(len(ids)), meta)


def batched_greedy(
    runner: ModelRunner, prompts: dict[str, list[int]], new_tokens: int
) -> dict[str, list[int]]:
    """All prompts prefilled in one step, then decoded together; blocks handed out up front."""
    bs, next_block = runner.block_size, 0
    new, out = [], {rid: [] for rid in prompts}
    for rid, ids in prompts.items():
        needed = -(-(len(ids) + new_tokens) // bs)
        blocks, next_block = list(range(next_block, next_block + needed)), next_block + needed
        new.append(NewRequest(rid, ids, [], SamplingParams(temperature=0.0), blocks, 0))
    plan = StepPlan(new, [], {rid: len(ids) for rid, ids in prompts.items()})
    for _ in range(new_tokens):
        for rid, token in runner.execute(plan).sampled.items():
            out[rid].append(token.token_id)
        diffs = [RunningRequestDiff(rid, [], len(prompts[rid]) + len(out[rid]) - 1) for rid in prompts]
        plan = StepPlan([], diffs, {rid: 1 for rid in prompts})
    return out


def ep_prompts() -> dict[str, list[int]]:
    return {"a": prompt(2, 21), "b": prompt(3, 37), "c": prompt(4, 3)}


def run_rank(rank: int, port: int, model_dir: str, out_dir: str, new_tokens: int) -> None:
    """One rank of a CACHET_TP=2, CACHET_EP=2 replica, started as the engine starts its ranks
    (``loop_builder.run_follower``): DeepSpeed joins the group in ``init_distributed`` and the
    model takes its expert split from the tensor-parallel group. Both ranks run ``execute``
    here (in a replica only rank 0 samples and followers take its tokens): decoding greedily,
    each rank's tokens must equal one whole model's."""
    os.environ.update(local_group_environment(rank, 2, port))
    torch.set_num_threads(1)
    tp = TensorParallel.create(init_distributed(torch.device("cpu")), expert_parallel_size=2)
    runner = runner_for(Path(model_dir), tp=tp)
    ep = runner.model.expert_parallel
    held = sorted(int(k) for k in runner.model.model.layers[1].mlp.experts)
    logits = prefill_logits(runner, prompt(1, 40))
    tokens = batched_greedy(runner_for(Path(model_dir), tp=tp), ep_prompts(), new_tokens)
    result = {"ep": (ep.rank, ep.size), "held": held, "logits": logits, "tokens": tokens}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
