"""Engine memory: resident size against weights + KV budget, and growth over 1,000 mixed requests.

Runs in a fresh process (``python -m bench.engine_memory``) so nothing else
(transformers, the other benchmarks) is in the resident set it measures.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import psutil
import torch

from cachet.engine.engine_core import EngineCore
from cachet.engine.model_runner import ModelRunner, default_dtype
from cachet.engine.request import Request
from cachet.engine.sampling_params import SamplingParams
from cachet.engine.scheduler import SchedulerConfig
from cachet.models.catalog import ensure_model

_MIB = 1024**2
KV_BUDGET_BYTES = 256 * _MIB


def _rss() -> int:
    return psutil.Process().memory_info().rss


def measure(model: str | None, dtype: str, requests: int) -> dict:
    resolved = ensure_model(model, Path(os.environ.get("CACHET_DATA_DIR", "data")))
    torch_dtype = default_dtype(torch.device("cpu")) if dtype == "auto" else getattr(torch, dtype)
    before = _rss()
    runner = ModelRunner(
        resolved.path, dtype=torch_dtype, device=torch.device("cpu"), kv_cache_bytes=KV_BUDGET_BYTES
    )
    config = SchedulerConfig(max_model_len=runner.max_model_len, max_num_batched_tokens=512, max_num_seqs=32)
    core = EngineCore(runner=runner, model=resolved.model_id, scheduler_config=config)
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    # A second copy of bf16 weights for small batches, where oneDNN packs the first (packed_linear).
    weights += sum(
        panels.nbytes
        for module in runner.model.modules()
        if (panels := getattr(module, "small_batch_panels", None)) is not None
    )
    kv_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
    rng = random.Random(0)

    def run(count: int, tag: str) -> None:
        submitted = reported = 0
        while submitted < count or core.has_unfinished_requests():
            while submitted < count and core.scheduler.num_waiting < 16:
                prompt = [rng.randrange(100, 40000) for _ in range(rng.randrange(8, 200))]
                max_tokens = rng.randrange(1, 8)
                sampling = SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(1000))
                core.add_request(Request(f"{tag}-{submitted}", prompt, sampling, max_tokens=max_tokens))
                submitted += 1
            core.step()
            # Now and then a client goes away mid-flight.
            for request in list(core.scheduler.running):
                if rng.random() < 0.02:
                    core.abort(request.request_id)
            if submitted % 50 == 0 and submitted != reported:
                reported = submitted
                print(f"[bench] memory: {tag} {submitted}/{count} requests", file=sys.stderr, flush=True)

    run(50, "warmup")
    loaded = _rss()
    run(requests, "mixed")
    after = _rss()
    return {
        "weights_mib": weights / _MIB,
        "kv_budget_mib": KV_BUDGET_BYTES / _MIB,
        "kv_pool_mib": kv_bytes / _MIB,
        "rss_before_load_mib": before / _MIB,
        # The whole process (Python, torch, the engine), as an operator's `ps` shows it.
        "rss_over_weights_and_kv_mib": (loaded - weights - kv_bytes) / _MIB,
        "rss_growth_percent": 100 * (after - loaded) / loaded,
        "requests": requests,
    }


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "-" else None
    dtype = sys.argv[2] if len(sys.argv) > 2 else "auto"
    requests = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
    print(json.dumps(measure(model, dtype, requests)))


if __name__ == "__main__":
    main()
