"""Engine benchmark: Cachet's engine against Hugging Face transformers, same process.

Same checkpoint, dtype and thread count for both, run back to back (these CPUs
drift 30-40% between runs minutes apart, so only in-run ratios mean anything):

- decode tokens/s at 1, 4 and 16 concurrent streams (continuous batching)
  against transformers ``generate`` at batch 1 and as one static batch of 16;
- time to first token for a ~2,000-token prompt, cold and with 95% of it cached;
- prefill tokens/s (the cold prompt).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tokenizers import Tokenizer

from bench.progress import progress
from cachet.engine.engine_core import EngineCore
from cachet.engine.model_runner import ModelRunner, default_dtype
from cachet.engine.prompt_images import PromptImage
from cachet.engine.request import Request
from cachet.engine.sampling_params import SamplingParams
from cachet.engine.scheduler import SchedulerConfig
from cachet.engine.settings import BlockQ4Use
from cachet.models.catalog import ensure_model

_GIB = 1024**3


@contextmanager
def one_math_thread() -> Iterator[None]:
    """torch on one thread, as the queue bench runs the engine (the other core for the rest),
    then back to what it was: ``python -m bench`` runs later sections in this process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class EngineHarness:
    """An EngineCore driven synchronously: no gRPC, so the numbers are the engine's own."""

    def __init__(
        self,
        model_dir: Path,
        model_id: str,
        dtype: torch.dtype,
        max_batched_tokens: int,
        *,
        max_num_seqs: int = 64,
        max_batch_running: int | None = None,
        pack_weights: bool = True,
        block_weights: BlockQ4Use = "small_batches",
        device: str = "cpu",
        cuda_graphs: bool = False,
        paged_decode_kernel: bool = True,
        kv_cache_gib: float = 1.0,
        host_kv_gib: float = 0.0,
        shared_kv_dir: Path | None = None,
        batch_invariant: bool = False,
    ) -> None:
        self.runner = ModelRunner(
            model_dir,
            dtype=dtype,
            device=torch.device(device),
            kv_cache_bytes=int(kv_cache_gib * _GIB),
            pack_weights=pack_weights,
            block_weights=block_weights,
            cuda_graphs=cuda_graphs,
            paged_decode_kernel=paged_decode_kernel,
            max_decode_batch=max_num_seqs,
            max_step_tokens=max_batched_tokens,
            host_kv_bytes=int(host_kv_gib * _GIB),
            shared_kv_dir=shared_kv_dir,
            shared_kv_bytes=4 * _GIB,
            batch_invariant=batch_invariant,
        )
        self.model_id = model_id
        self.max_batched_tokens = max_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_batch_running = max_batch_running
        self.core = self._new_core()
        self._ids = 0

    def _new_core(self) -> EngineCore:
        config = SchedulerConfig(
            max_model_len=self.runner.max_model_len,
            max_num_batched_tokens=self.max_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            eos_token_ids=tuple(self.runner.eos_token_ids),
            max_batch_running=self.max_batch_running,
        )
        return EngineCore(runner=self.runner, model=self.model_id, scheduler_config=config)

    def reset_cache(self) -> None:
        self.core = self._new_core()

    def submit(self, prompt: list[int], max_tokens: int, images: tuple[PromptImage, ...] = ()) -> str:
        self._ids += 1
        request_id = f"bench-{self._ids}"
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.core.add_request(
            Request(request_id, list(prompt), sampling, max_tokens=max_tokens, images=images)
        )
        return request_id

    def run_until_done(self) -> tuple[int, float]:
        """(tokens generated, seconds) until every request finished."""
        generated, start = 0, time.perf_counter()
        while self.core.has_unfinished_requests():
            generated += sum(len(o.new_token_ids) for o in self._step())
        return generated, time.perf_counter() - start

    def _step(self) -> list:
        """One step, or a short wait while nothing is ready (a prefix still loading from the
        shared KV tier), as the engine's loop waits: spinning would hold the interpreter lock
        its loader thread needs."""
        if not self.core.has_work_now():
            time.sleep(0.0005)
            return []
        return self.core.step()

    def time_to_first_token(
        self, prompt: list[int], images: tuple[PromptImage, ...] = ()
    ) -> tuple[float, int]:
        """(seconds, cached prompt tokens) until the first token of one request."""
        request_id = self.submit(prompt, max_tokens=1, images=images)
        start = time.perf_counter()
        cached = 0
        while self.core.has_unfinished_requests():
            for output in self._step():
                if output.request_id == request_id and output.new_token_ids:
                    cached = output.num_cached_tokens
        return time.perf_counter() - start, cached


def _hf_decode_tokens_per_second(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    elapsed = time.perf_counter() - start
    return (output.shape[1] - width) * len(prompts) / elapsed


def _prompts(tokenizer: Tokenizer, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    words = [w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 3]
    prompts = []
    for _ in range(count):
        text = " ".join(rng.choice(words) for _ in range(length * 2))
        prompts.append(tokenizer.encode(text).ids[:length])
    return prompts


def run_engine_bench(model: str | None = None, dtype: str = "auto", quick: bool = False) -> dict:
    from transformers import AutoModelForCausalLM

    resolved = ensure_model(model, Path(os.environ.get("CACHET_DATA_DIR", "data")))
    torch_dtype = default_dtype(torch.device("cpu")) if dtype == "auto" else getattr(torch, dtype)
    tokenizer = Tokenizer.from_file(str(resolved.path / "tokenizer.json"))
    new_tokens = 16 if quick else 64
    prompt_len = 32
    long_len = 500 if quick else 2000
    threads = torch.get_num_threads()
    progress(f"model {resolved.model_id}, dtype {torch_dtype}, {threads} threads, {new_tokens} new tokens")

    progress("loading transformers model")
    hf = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=torch_dtype).eval()
    progress("loading Cachet engine")
    engine = EngineHarness(resolved.path, resolved.model_id, torch_dtype, max_batched_tokens=2048)

    results: dict = {"model": resolved.model_id, "dtype": str(torch_dtype), "threads": threads}
    rows = []
    warm = _prompts(tokenizer, 1, prompt_len, seed=99)
    engine.submit(warm[0], 4)
    engine.run_until_done()
    _hf_decode_tokens_per_second(hf, warm, 4, pad_id=0)

    for streams in (1, 4, 16):
        progress(f"engine decode, {streams} concurrent streams")
        for prompt in _prompts(tokenizer, streams, prompt_len, seed=streams):
            engine.submit(prompt, new_tokens)
        generated, seconds = engine.run_until_done()
        rows.append((f"cachet decode, {streams} streams", generated / seconds))
    progress("transformers generate, batch 1")
    hf_batch1 = _hf_decode_tokens_per_second(hf, _prompts(tokenizer, 1, prompt_len, seed=1), new_tokens, 0)
    rows.append(("transformers generate, batch 1", hf_batch1))
    progress("transformers generate, static batch 16")
    hf_batch16 = _hf_decode_tokens_per_second(hf, _prompts(tokenizer, 16, prompt_len, seed=16), new_tokens, 0)
    rows.append(("transformers generate, static batch 16", hf_batch16))

    progress(f"time to first token, {long_len}-token prompt, cold")
    engine.reset_cache()
    long_prompt = _prompts(tokenizer, 1, long_len, seed=7)[0]
    cold, _ = engine.time_to_first_token(long_prompt)
    progress("time to first token, 95% cached")
    shared = int(long_len * 0.95)
    warm_prompt = long_prompt[:shared] + _prompts(tokenizer, 1, long_len - shared, seed=8)[0]
    cached_ttft, cached_tokens = engine.time_to_first_token(warm_prompt)

    decode = dict(rows)
    results["decode_tokens_per_second"] = decode
    results["ttft_cold_seconds"] = cold
    results["ttft_cached_seconds"] = cached_ttft
    results["ttft_cached_tokens"] = cached_tokens
    results["prefill_tokens_per_second"] = long_len / cold
    results["ratios"] = {
        "16 streams / transformers batch 1 (target >= 5)": decode["cachet decode, 16 streams"] / hf_batch1,
        "16 streams / transformers static batch 16 (target >= 1)": decode["cachet decode, 16 streams"]
        / hf_batch16,
        "cached TTFT / cold TTFT (target <= 0.15)": cached_ttft / cold,
    }
    _print_table(results, long_len)
    return results


def _print_table(results: dict, long_len: int) -> None:
    print(f"\nEngine benchmark: {results['model']}, {results['dtype']}, {results['threads']} threads")
    print(f"{'measure':<52}{'value':>14}")
    print("-" * 66)
    for name, value in results["decode_tokens_per_second"].items():
        print(f"{name + ' (tok/s)':<52}{value:>14.1f}")
    print(f"{f'TTFT cold, {long_len}-token prompt (s)':<52}{results['ttft_cold_seconds']:>14.3f}")
    cached_label = f"TTFT 95% cached ({results['ttft_cached_tokens']} tokens hit) (s)"
    print(f"{cached_label:<52}{results['ttft_cached_seconds']:>14.3f}")
    print(f"{'prefill (tok/s)':<52}{results['prefill_tokens_per_second']:>14.1f}")
    print("-" * 66)
    for name, value in results["ratios"].items():
        print(f"{name:<58}{value:>8.2f}")
