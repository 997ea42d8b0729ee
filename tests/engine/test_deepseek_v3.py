"""DeepSeek-V3 / Kimi K2 model code against transformers' DeepseekV3ForCausalLM (fp32, tiny kimi-k2).

Our MLA runs in the "absorbed" form (W_UK folded into the query, W_UV into the
output, attention over the cached latent), transformers expands K and V per head:
the same math in a different summation order, so logits agree to ~1e-5, not
bit for bit, and greedy tokens agree exactly on this checkpoint.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import deepseek_ep_worker as ep_worker
import pytest
import torch
from deepseek_ep_worker import prefill_logits, prompt
from test_model_parity import SimRequest, drive
from transformers import DeepseekV3ForCausalLM, GenerationConfig

from cachet.engine.expert_parallel import ExpertParallel
from cachet.engine.model_runner import ModelRunner
from cachet.engine.models.config import ModelConfig, MoEConfig
from cachet.engine.models.deepseek_v3 import MoE, Router
from cachet.engine.weights import CheckpointError, load_model
from cachet.loopback_port import free_loopback_port
from cachet.models import write_tiny_model

torch.set_num_threads(1)

NEW_TOKENS = 16
LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("kimi")
    return write_tiny_model(root / "tiny-kimi-k2", family="kimi-k2", tokenizer_cache_dir=root / "tok-cache")


@pytest.fixture(scope="module")
def hf_model(kimi_dir: Path) -> DeepseekV3ForCausalLM:
    return DeepseekV3ForCausalLM.from_pretrained(kimi_dir, dtype=torch.float32).eval()


def runner_for(model_dir: Path, block_size: int = 16) -> ModelRunner:
    return ep_worker.runner_for(model_dir, block_size)


def hf_greedy(model: DeepseekV3ForCausalLM, ids: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), generation_config=config)
    return out[0, len(ids) :].tolist()


def test_runner_caches_one_latent_per_token(kimi_dir: Path) -> None:
    runner = runner_for(kimi_dir)
    config = ModelConfig.from_model_dir(kimi_dir)
    assert config.mla is not None and config.moe is not None
    assert (config.mla.kv_lora_rank, config.mla.qk_rope_head_dim) == (32, 8)
    # [layers, blocks, block_size, kv_lora_rank + rope]: 40 floats per token per layer, not 2 x heads x dims.
    assert runner.kv_cache.shape == (3, runner.num_kv_blocks, 16, 40)
    assert runner.num_kv_blocks == (1 << 20) // (3 * 16 * 40 * 4)
    # Routing biases stay fp32 whatever the serving dtype: they decide which experts run.
    bf16 = load_model(kimi_dir, config, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert bf16.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert bf16.model.layers[1].mlp.gate.weight.dtype == torch.bfloat16


def test_prefill_logits_match_hf(kimi_dir: Path, hf_model: DeepseekV3ForCausalLM) -> None:
    ids = prompt(1, 40)
    ours = prefill_logits(runner_for(kimi_dir), ids)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids])).logits[0].float()
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=LOGIT_ATOL, rtol=1e-4)


def test_greedy_tokens_match_hf_one_shot_and_chunked(kimi_dir: Path, hf_model: DeepseekV3ForCausalLM) -> None:
    reqs = {
        "a": SimRequest(prompt(2, 21)),
        # Chunked prefill in small blocks, batched with the other request's decodes.
        "b": SimRequest(prompt(3, 37), chunk=5, start_step=1),
    }
    drive(runner_for(kimi_dir, block_size=4), reqs, new_tokens=NEW_TOKENS)
    for rid, req in reqs.items():
        assert req.output == hf_greedy(hf_model, req.prompt), rid


def test_cached_latent_prefix_gives_uncached_tokens(kimi_dir: Path, hf_model: DeepseekV3ForCausalLM) -> None:
    shared = prompt(4, 32)
    reqs = {
        "donor": SimRequest(shared + prompt(5, 9)),
        # Starts with 2 blocks (32 tokens) of latents it never computed itself.
        "reuser": SimRequest(shared + prompt(6, 14), reuse_from="donor", reuse_blocks=2, chunk=6),
    }
    drive(runner_for(kimi_dir), reqs, new_tokens=NEW_TOKENS)
    assert reqs["reuser"].blocks[:2] == reqs["donor"].blocks[:2]
    uncached = {"alone": SimRequest(reqs["reuser"].prompt)}
    drive(runner_for(kimi_dir), uncached, new_tokens=NEW_TOKENS)
    assert reqs["reuser"].output == uncached["alone"].output == hf_greedy(hf_model, reqs["reuser"].prompt)


def _moe_config(**overrides: object) -> MoEConfig:
    base = dict(
        n_routed_experts=8,
        n_shared_experts=0,
        moe_intermediate_size=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        scoring_func="softmax",
        topk_method="group_limited_greedy",
        routed_scaling_factor=1.5,
        norm_topk_prob=False,
        first_k_dense_replace=0,
        moe_layer_freq=1,
    )
    return MoEConfig(**{**base, **overrides})  # type: ignore[arg-type]


def test_softmax_group_limited_routing_picks_from_best_groups() -> None:
    router = Router(4, _moe_config())
    with torch.no_grad():
        router.weight.zero_()
    # x = e_0, so expert e's logit is its weight's first column.
    logits = torch.tensor([[0.0, 5.0, 1.0, 1.0, 4.9, 0.0, 3.0, 2.9]])
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    with torch.no_grad():
        router.weight[:, 0] = logits[0]
    weights, ids = router(x)
    # Groups {0,1} {2,3} {4,5} {6,7}: best experts 5.0, 1.0, 4.9, 3.0 -> groups 0 and 2 survive,
    # so expert 6 (3.0) loses to 4 (4.9) and 1 (5.0); softmax over all 8, unnormalised, times 1.5.
    assert sorted(ids[0].tolist()) == [1, 4]
    probs = logits.softmax(-1)[0]
    expected = torch.stack([probs[i] for i in ids[0].tolist()]) * 1.5
    torch.testing.assert_close(weights[0], expected)


def test_moe_routes_each_token_to_its_experts() -> None:
    config = ModelConfig.from_dict(
        {
            "model_type": "deepseek_v3",
            "vocab_size": 16,
            "hidden_size": 4,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 1,
            "kv_lora_rank": 4,
            "qk_nope_head_dim": 2,
            "qk_rope_head_dim": 2,
            "v_head_dim": 2,
            "n_routed_experts": 8,
            "moe_intermediate_size": 8,
            "num_experts_per_tok": 2,
            "n_group": 2,
            "topk_group": 1,
            "n_shared_experts": 1,
        }
    )
    torch.manual_seed(0)
    moe = MoE(config, ExpertParallel())
    for p in moe.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(5, 4)
    weights, ids = moe.gate(x)
    expected = torch.zeros_like(x)
    for t in range(5):
        for k in range(2):
            expected[t] += weights[t, k] * moe.experts[str(int(ids[t, k]))](x[t : t + 1])[0]
    torch.testing.assert_close(moe(x), expected + moe.shared_experts(x), atol=1e-5, rtol=1e-5)
    # Only one of the two groups may contribute per token.
    assert ((ids // 4)[:, 0] == (ids // 4)[:, 1]).all()


def test_loader_skips_mtp_layers_but_not_strangers(kimi_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    config = ModelConfig.from_model_dir(kimi_dir)
    tensors = load_file(str(kimi_dir / "model.safetensors"))
    copy = tmp_path / "ckpt"
    copy.mkdir()
    (copy / "config.json").write_text((kimi_dir / "config.json").read_text())
    # DeepSeek-V3 ships its multi-token-prediction module as one extra layer past num_hidden_layers.
    save_file(
        {**tensors, "model.layers.3.eh_proj.weight": torch.zeros(2, 2)}, str(copy / "model.safetensors")
    )
    load_model(copy, config, dtype=torch.float32, device=torch.device("cpu"))
    save_file({**tensors, "model.layers.1.mlp.stray.weight": torch.zeros(2)}, str(copy / "model.safetensors"))
    with pytest.raises(CheckpointError, match="stray"):
        load_model(copy, config, dtype=torch.float32, device=torch.device("cpu"))


# ---------------------------------------------------------------- expert parallel (2 CPU ranks, gloo)


def test_expert_parallel_two_ranks_equal_one(kimi_dir: Path, tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")  # never fork a process that may hold gRPC / OpenMP threads
    port = free_loopback_port()
    procs = [
        ctx.Process(target=ep_worker.run_rank, args=(r, port, str(kimi_dir), str(tmp_path), NEW_TOKENS))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert [p.exitcode for p in procs] == [0, 0]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [r["ep"] for r in ranks] == [(0, 2), (1, 2)]
    assert [r["held"] for r in ranks] == [[0, 1, 2, 3], [4, 5, 6, 7]]

    expected_logits = ep_worker.prefill_logits(ep_worker.runner_for(kimi_dir), ep_worker.prompt(1, 40))
    expected_tokens = ep_worker.batched_greedy(
        ep_worker.runner_for(kimi_dir), ep_worker.ep_prompts(), NEW_TOKENS
    )
    assert all(len(t) == NEW_TOKENS for t in expected_tokens.values())
    for r in ranks:
        # Partial sums meet in a different order than one rank's loop: equal to rounding, not bits.
        torch.testing.assert_close(r["logits"], expected_logits, atol=1e-5, rtol=1e-5)
        assert r["tokens"] == expected_tokens
