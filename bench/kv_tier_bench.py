"""Time to first token when a prompt's prefix comes back from a lower KV tier, against the
same prompt computed cold and served from the engine's own pool, same process.

The pool holds about one and a half long prompts, so running two other prompts evicts the
first one's blocks into the host tier (``cachet.engine.host_kv_tier``); the first prompt
sent again is then copied back instead of recomputed. Every block is also written to a
shared file tier (``cachet.engine.shared_kv_tier``) in a temporary folder; a second engine
with an empty pool and host tier, as a replica on another host would be, then serves the
first prompt from those files. `python -m bench.kv_tier_bench`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from bench.engine_bench import EngineHarness, one_math_thread
from bench.progress import progress
from cachet.engine.model_runner import default_dtype
from cachet.models.catalog import ensure_model

HOST_KV_GIB = 1.0


def run_kv_tier_bench(
    model: str | None = None, dtype: str = "auto", quick: bool = False, device: str = "cpu"
) -> dict:
    resolved = ensure_model(model, Path(os.environ.get("CACHET_DATA_DIR", "data")))
    torch_dtype = default_dtype(torch.device(device)) if dtype == "auto" else getattr(torch, dtype)
    prompt_len = 500 if quick else 2000
    progress(f"model {resolved.model_id}, {torch_dtype}, {prompt_len}-token prompts, one math thread")
    with one_math_thread():
        probe = EngineHarness(
            resolved.path, resolved.model_id, torch_dtype, 512, kv_cache_gib=0.01, device=device
        )
        bytes_per_token = probe.runner._kv_cache_bytes_per_block() // probe.runner.block_size
        vocab = probe.runner.vocab_size
        del probe
        pool_gib = 1.5 * prompt_len * bytes_per_token / (1 << 30)
        shared = Path(tempfile.mkdtemp(prefix="cachet-shared-kv-"))

        def new_engine() -> EngineHarness:
            return EngineHarness(
                resolved.path,
                resolved.model_id,
                torch_dtype,
                max_batched_tokens=512,
                kv_cache_gib=pool_gib,
                host_kv_gib=HOST_KV_GIB,
                device=device,
                shared_kv_dir=shared,
            )

        engine = new_engine()
        generator = torch.Generator().manual_seed(11)
        first, *others = (
            torch.randint(0, vocab, (prompt_len,), generator=generator).tolist() for _ in range(3)
        )
        progress("cold")
        cold, _ = engine.time_to_first_token(first)
        progress("from the engine's pool")
        pool_hit, pool_cached = engine.time_to_first_token(first)
        progress("two other prompts, which evict the first into the host tier")
        for other in others:
            engine.time_to_first_token(other)
        progress("from the host tier")
        before = dict(engine.core.scheduler.kv.hit_tokens)
        host_hit, host_cached = engine.time_to_first_token(first)
        from_host = engine.core.scheduler.kv.hit_tokens["host"] - before["host"]
        while engine.core.has_work_now():
            engine.core.step()
        engine.runner.shared_kv.drain()
        progress("a second engine, from the shared file tier")
        other = new_engine()
        shared_hit, shared_cached = other.time_to_first_token(first)
        from_shared = other.core.scheduler.kv.hit_tokens["shared"]
    results = {
        "model": resolved.model_id,
        "dtype": str(torch_dtype),
        "device": device,
        "prompt_tokens": prompt_len,
        "ttft_seconds": {
            "cold": cold,
            "engine pool": pool_hit,
            "host tier": host_hit,
            "shared file tier": shared_hit,
        },
        "cached_tokens": {
            "engine pool": pool_cached,
            "host tier": host_cached,
            "shared file tier": shared_cached,
        },
        "tier_tokens": {"host": from_host, "shared": from_shared},
        "ratios": {
            "host tier / cold (target <= 0.1)": host_hit / cold,
            "shared file tier / cold (target <= 0.25)": shared_hit / cold,
            "engine pool / cold": pool_hit / cold,
        },
    }
    _print_table(results)
    return results


def _print_table(results: dict) -> None:
    print(
        f"\nKV tiers: {results['model']}, {results['dtype']} on {results['device']}, "
        f"{results['prompt_tokens']}-token prompt"
    )
    print(f"{'time to first token':<44}{'seconds':>10}{'cached':>10}")
    print("-" * 64)
    for name, seconds in results["ttft_seconds"].items():
        cached = results["cached_tokens"].get(name, 0)
        print(f"{name:<44}{seconds:>10.3f}{cached:>10}")
    tiers = results["tier_tokens"]
    print(f"(tokens served by the host tier: {tiers['host']}, by the shared tier: {tiers['shared']})")
    for name, value in results["ratios"].items():
        print(f"{name:<54}{value:>10.3f}")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    run_kv_tier_bench(args.model, args.dtype, args.quick, args.device)
