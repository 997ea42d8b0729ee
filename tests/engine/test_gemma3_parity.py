"""Gemma 3's model code against transformers' Gemma3ForCausalLM, fp32, on the tiny gemma3 checkpoint.

The tiny model's window is 8 keys, so every prompt here runs past it: the local layers' band
(``sliding_window``) decides the answers. Greedy tokens must be transformers' exactly, alone, from
a cached prefix, in chunks and batched with other requests (decodes read in place and gathered,
and batch-invariant steps); logits to fp32 rounding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deepseek_ep_worker import prefill_logits, prompt
from test_model_parity import SimRequest, drive
from transformers import Gemma3ForCausalLM, GenerationConfig

from cachet.engine import cuda_graphs
from cachet.engine.attention import SequenceSpan, build_attention_metadata
from cachet.engine.model_runner import ModelRunner
from cachet.engine.models.config import ModelConfig
from cachet.engine.models.sliding_window import sliding_window_metadata
from cachet.engine.sampling_params import SamplingParams
from cachet.engine.step_plan import NewRequest, RunningRequestDiff, StepPlan
from cachet.models import write_tiny_model

torch.set_num_threads(1)

NEW_TOKENS = 24
LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gemma3")
    return write_tiny_model(root / "gemma3", family="gemma3", tokenizer_cache_dir=root / "tok")


@pytest.fixture(scope="module")
def hf_model(gemma_dir: Path) -> Gemma3ForCausalLM:
    return Gemma3ForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()


def runner_for(model_dir: Path, block_size: int = 16, **options: bool | int) -> ModelRunner:
    return ModelRunner(
        model_dir, dtype=torch.float32, device=torch.device("cpu"), kv_cache_bytes=4 << 20,
        block_size=block_size, **options,
    )  # fmt: skip


def hf_greedy(model: Gemma3ForCausalLM, ids: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), generation_config=config)
    return out[0, len(ids) :].tolist()


def test_config_reads_gemma3_settings(gemma_dir: Path) -> None:
    config = ModelConfig.from_model_dir(gemma_dir)
    assert config.gemma3 is not None
    assert config.head_dim == 32 and config.hidden_size // config.num_attention_heads == 16
    assert config.gemma3.sliding_window == 8
    assert config.gemma3.sliding_layers == (True, False, True)
    assert (config.rope.theta, config.gemma3.local_rope.theta) == (10000.0, 100.0)
    assert config.gemma3.query_pre_attn_scalar == 24
    assert config.gemma3.final_logit_softcapping == 30.0
    assert config.tie_word_embeddings


def test_older_config_spelling_is_read() -> None:
    raw = {
        "model_type": "gemma3_text", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "sliding_window": 8, "sliding_window_pattern": 3, "rope_theta": 10000.0, "rope_local_base_freq": 100.0,
        "query_pre_attn_scalar": 24,
    }  # fmt: skip
    old = ModelConfig.from_dict(raw)
    assert old.gemma3 is not None
    assert old.gemma3.sliding_layers == (True, True, False, True, True, False)
    assert (old.rope.theta, old.gemma3.local_rope.theta) == (10000.0, 100.0)
    assert old.gemma3.final_logit_softcapping is None


def test_prefill_logits_match_hf(gemma_dir: Path, hf_model: Gemma3ForCausalLM) -> None:
    ids = prompt(1, 40)
    ours = prefill_logits(runner_for(gemma_dir), ids)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=LOGIT_ATOL, rtol=0)
    # The window matters: with it widened past the prompt, the logits move.
    wide = runner_for(gemma_dir)
    for layer in wide.model.model.layers:
        layer.self_attn.sliding = False
    wide.model.model.sliding_window = 1 << 20
    assert not torch.allclose(prefill_logits(wide, ids)[-1], theirs[-1], atol=1e-2)


@pytest.mark.parametrize(("block_size", "chunk"), [(16, 1 << 30), (16, 5), (4, 7)])
def test_greedy_matches_hf_one_shot_and_chunked(
    gemma_dir: Path, hf_model: Gemma3ForCausalLM, block_size: int, chunk: int
) -> None:
    ids = prompt(2, 37)
    reqs = {"a": SimRequest(ids, chunk=chunk)}
    drive(runner_for(gemma_dir, block_size=block_size), reqs, NEW_TOKENS)
    assert reqs["a"].output == hf_greedy(hf_model, ids)


@pytest.mark.parametrize("paged_decode_kernel", [True, False])
def test_batched_and_cached_prefix_match_hf(
    gemma_dir: Path, hf_model: Gemma3ForCausalLM, paged_decode_kernel: bool
) -> None:
    shared = prompt(3, 32)
    reqs = {
        "donor": SimRequest(shared + prompt(4, 9)),
        # Starts from 2 blocks (32 tokens) it never computed, the window reaching into them.
        "reuser": SimRequest(shared + prompt(5, 14), reuse_from="donor", reuse_blocks=2, chunk=6),
        # Shorter than the window at first, then past it: steps mix banded and unbanded groups.
        "short": SimRequest(prompt(6, 3), start_step=1),
        "long": SimRequest(prompt(7, 50), chunk=16, start_step=2),
    }
    drive(runner_for(gemma_dir, paged_decode_kernel=paged_decode_kernel), reqs, NEW_TOKENS)
    assert reqs["reuser"].blocks[:2] == reqs["donor"].blocks[:2]
    for rid, req in reqs.items():
        assert req.output == hf_greedy(hf_model, req.prompt), rid


def test_prompts_read_the_cache_in_place_where_the_kernel_has_register_tiles(gemma_dir: Path) -> None:
    """The fp32 prompt kernel has no tile for Gemma 3's heads; on an AVX2 build the paged decode
    kernel's register tiles take its prompt tokens in every step (sliding layers by their window),
    which the greedy tests above then run through."""
    from cachet.engine.cpu_features import cpu_flags

    runner = runner_for(gemma_dir)
    assert not runner.prefill_kernel
    assert runner.prefill_in_place == ({"avx2", "fma"} <= cpu_flags())


def test_batch_invariant_steps_match_hf(gemma_dir: Path, hf_model: Gemma3ForCausalLM) -> None:
    # Every token read in place by the paged decode kernel, unless the band sends it through SDPA.
    runner = runner_for(gemma_dir, batch_invariant=True)
    reqs = {"a": SimRequest(prompt(8, 30)), "b": SimRequest(prompt(9, 5), chunk=2, start_step=1)}
    drive(runner, reqs, NEW_TOKENS)
    for rid, req in reqs.items():
        assert req.output == hf_greedy(hf_model, req.prompt), rid


def test_fixed_shape_decode_steps_match_hf(
    gemma_dir: Path, hf_model: Gemma3ForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The steps CUDA graphs capture (padded batches and keys), run eagerly on the CPU.
    monkeypatch.setattr(cuda_graphs, "MIN_CAPTURED_KV_LEN", 16)
    runner = runner_for(gemma_dir, block_size=8, cuda_graphs=True, max_decode_batch=4)
    reqs = {"a": SimRequest(prompt(10, 5)), "b": SimRequest(prompt(11, 20), chunk=8, start_step=2)}
    drive(runner, reqs, NEW_TOKENS)
    assert runner.decode_graphs is not None and runner.decode_graphs.runs > 0
    for rid, req in reqs.items():
        assert req.output == hf_greedy(hf_model, req.prompt), rid


def test_preempted_request_resumes_identically(gemma_dir: Path, hf_model: Gemma3ForCausalLM) -> None:
    ids = prompt(12, 12)
    expected = hf_greedy(hf_model, ids, new_tokens=8)
    runner = runner_for(gemma_dir, block_size=4)
    greedy = SamplingParams(temperature=0.0)
    first = runner.execute(StepPlan([NewRequest("a", ids, [], greedy, [0, 1, 2], 0)], [], {"a": 12}))
    out = [first.sampled["a"].token_id]
    for i in range(3):
        step = StepPlan([], [RunningRequestDiff("a", [3] if i == 0 else [], 12 + i)], {"a": 1})
        out.append(runner.execute(step).sampled["a"].token_id)
    runner.execute(StepPlan(finished_request_ids={"a"}))
    resumed = runner.execute(StepPlan([NewRequest("a", ids, out, greedy, [5, 6, 7, 8, 9], 0)], [], {"a": 16}))
    assert out + [resumed.sampled["a"].token_id] == expected[:5]


def test_band_masks_keys_behind_the_window() -> None:
    # One request: 3 cached tokens and 4 new (positions 3..6), window 3, one padded decode of 5 keys.
    spans = [SequenceSpan(3, 4, [0], False), SequenceSpan(4, 1, [1], True)]
    meta = build_attention_metadata(spans, 8, torch.device("cpu"), decode_in_place=True)
    positions = torch.tensor([3, 4, 5, 6, 4])
    banded = sliding_window_metadata(meta, positions, 3)
    # The decode stays with the kernel, which reads its window itself.
    assert banded.decode_in_place
    prefill = next(g for g in banded.groups if g.max_query_len == 4)
    assert prefill.mask is not None
    assert prefill.mask[0, 0].int().tolist() == [
        [0, 1, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 1, 0, 0],
        [0, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 1, 1, 1],
    ]
    decode = next(g for g in banded.groups if g.max_query_len == 1)
    assert decode is next(g for g in meta.groups if g.max_query_len == 1)
    # Nothing past the window: the step's metadata, untouched.
    assert sliding_window_metadata(meta, positions, 7) is meta
