"""Disaggregated prefill against mixed replicas on the same two cores, under one open-loop mix.

``python -m bench.disagg_bench [--quick] [--rounds N] [--json PATH] [--dtype D]`` (the
``disaggregated_prefill`` section of ``make bench``). Two ``cachet run-local`` setups, one after
the other, each on the machine's cores with one math thread a replica (run-local's split of two
cores; nothing pins a replica to a core):

* **mixed**: ``CACHET_REPLICAS=2``, two mixed replicas, as today;
* **disaggregated**: ``CACHET_REPLICAS=1 CACHET_PREFILL_REPLICAS=1``, one decode and one
  prefill replica, which pushes KV straight into the decode replica's memory (``kv_transfer``;
  the shared file tier, ``<data dir>/kv-shared``, is written too and is the fallback).

Both get the same mix, driven over the REST API (streamed chat completions, greedy,
``ignore_eos``) with prompts of random vocabulary words from a fixed seed (the repo keeps no
public text to build them from): a few streaming clients, each asking for a short prompt's
long answer again as soon as the last one ends, and long unique prompts arriving on a fixed
schedule (open loop: one every few seconds whatever the server does) for a short answer.
The streams start new requests for one interval per long prompt. A round runs both setups;
a full run takes two, the second in the other order, and pools each setup's requests.

Per setup: the streams' time per output token (per request, ``(last token - first token) /
(tokens - 1)`` as vLLM's TPOT; and the gaps between streamed chunks, about one token each),
TTFT of the long and the short prompts apart, and the output tokens of everything over the
time from the first request to the last answer. From the services' /metrics, read before and
after the mix: the router's hand-offs and their mean time, and what the decode replica loaded
from the shared tier. The decode replica sends a hand-off's first token before it loads the
prompt's KV, so the load shows in the long prompts' gap from their first to their second
token, not in their TTFT: bytes over those gaps is a lower bound on the load's GB/s. The
prefill replica's step time per hand-off splits a hand-off into compute and the rest (queue,
the KV write barrier, gRPC). Other work on a shared machine shows in each run's CPU seconds
(its services', the client's, and the machine's busy time less theirs, from /proc/stat).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from bench.progress import progress
from bench.serving_bench import RUN_DIR as SERVING_RUN_DIR
from bench.serving_servers import (
    ServerFailed,
    environment_assignment,
    one_run_at_a_time,
    running_server,
    stopping_servers_on_sigterm,
    tree_cpu_seconds,
)
from cachet.loopback_port import free_loopback_port
from cachet.models.catalog import ensure_model
from cachet.tools.run_local import ENGINE_BASE_PORT, engine_name

DEFAULT_JSON = Path(".bench/disagg.json")
RUN_DIR = Path(".bench/disagg")  # per setup: run-local's log
# run-local's fixed gRPC ports: one lock with the serving bench, which starts run-local too.
SERVER_LOCK = SERVING_RUN_DIR / "lock"
METRICS_ANNOUNCE_SECONDS = 30

Figures = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass(frozen=True)
class Mix:
    """The load both setups get, the same requests at the same times."""

    streams: int
    stream_prompt_words: int
    stream_output_tokens: int
    long_prompts: int
    long_prompt_words: int
    long_output_tokens: int
    long_interval_seconds: float
    seed: int = 26

    @property
    def window_seconds(self) -> float:
        """Long prompts arrive at (i + 0.5) intervals; streams start requests until the window ends."""
        return self.long_prompts * self.long_interval_seconds


def mix(quick: bool) -> Mix:
    """A long prompt every 8 s: one core prefills ~1,600 tokens in ~5.5 s (bf16, 2026-11-27), so
    the prefill replica keeps up (at 5 s they queued, 9-10 s each)."""
    if quick:
        return Mix(4, 64, 128, 4, 1_600, 16, 8.0)
    return Mix(4, 64, 256, 12, 1_800, 16, 8.0)


@dataclass(frozen=True)
class Setup:
    name: str
    replicas: int  # CACHET_REPLICAS: mixed, or decode when there are prefill replicas
    prefill_replicas: int
    # More of run-local's environment (--env), e.g. an engine setting for one setup alone.
    env: tuple[tuple[str, str], ...] = ()


SETUPS = (Setup("mixed", 2, 0), Setup("disaggregated", 1, 1))


# --- prompts ---------------------------------------------------------------------------------


def vocabulary_words(tokenizer: Tokenizer) -> list[str]:
    """Whole lowercase words that are one token after a space, sorted: about one token a word."""
    words = {
        token[1:]
        for token in tokenizer.get_vocab()
        if token.startswith("Ġ") and re.fullmatch(r"Ġ[a-z]{3,}", token)
    }
    return sorted(words)


def prompt_text(rng: random.Random, words: list[str], count: int) -> str:
    return " ".join(rng.choice(words) for _ in range(count))


@dataclass(frozen=True)
class Prompts:
    """Every prompt of one run, drawn once from the mix's seed: both setups get the same."""

    streams: list[list[str]]  # per client, its requests' prompts in order
    long: list[str]

    @classmethod
    def draw(cls, mix: Mix, words: list[str], per_stream: int) -> Prompts:
        rng = random.Random(mix.seed)
        streams = [
            [prompt_text(rng, words, mix.stream_prompt_words) for _ in range(per_stream)]
            for _ in range(mix.streams)
        ]
        return cls(streams, [prompt_text(rng, words, mix.long_prompt_words) for _ in range(mix.long_prompts)])


# --- one streamed request --------------------------------------------------------------------


@dataclass
class Timed:
    """One request as the client saw it: when it was sent and when each chunk with a token came."""

    kind: str  # "stream" or "long"
    sent: float
    chunks: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks else None

    @property
    def tpot(self) -> float | None:
        """vLLM's TPOT: the decode time after the first token over the tokens after it."""
        if len(self.chunks) < 2 or self.completion_tokens < 2:
            return None
        return (self.chunks[-1] - self.chunks[0]) / (self.completion_tokens - 1)

    @property
    def gaps(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.chunks, self.chunks[1:], strict=False)]


def _carries_a_token(event: dict) -> bool:
    """A chunk with a choice's role or text (the first names the role with the first token)."""
    return any(
        choice.get("delta", {}).get("content") or choice.get("delta", {}).get("role")
        for choice in event.get("choices", [])
    )


async def streamed_request(
    client: httpx.AsyncClient, model: str, kind: str, prompt: str, max_tokens: int
) -> Timed:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    timed = Timed(kind, time.monotonic())
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                timed.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return timed
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if _carries_a_token(event):
                    timed.chunks.append(time.monotonic())
                if event.get("usage"):
                    timed.completion_tokens = event["usage"]["completion_tokens"]
    except httpx.HTTPError as error:  # a broken stream is a result to report, not a crash
        timed.error = f"{type(error).__name__}: {error}"
    return timed


# --- the mix ---------------------------------------------------------------------------------


async def _stream_client(
    client: httpx.AsyncClient, model: str, mix: Mix, prompts: list[str], until: float
) -> list[Timed]:
    done = []
    for prompt in prompts:
        if time.monotonic() >= until:
            break
        done.append(await streamed_request(client, model, "stream", prompt, mix.stream_output_tokens))
    return done


async def _long_arrival(client: httpx.AsyncClient, model: str, mix: Mix, prompt: str, at: float) -> Timed:
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    return await streamed_request(client, model, "long", prompt, mix.long_output_tokens)


async def drive(url: str, model: str, mix: Mix, prompts: Prompts) -> tuple[list[Timed], float]:
    """Run the mix once; every request, and the time from the first one's sending to the last answer."""
    limits = httpx.Limits(max_connections=mix.streams + mix.long_prompts + 4)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        start = time.monotonic()
        until = start + mix.window_seconds
        streams = [_stream_client(client, model, mix, own, until) for own in prompts.streams]
        longs = [
            _long_arrival(client, model, mix, prompt, start + (i + 0.5) * mix.long_interval_seconds)
            for i, prompt in enumerate(prompts.long)
        ]
        per_stream, arrivals = await asyncio.gather(asyncio.gather(*streams), asyncio.gather(*longs))
        end = time.monotonic()
    return [t for own in per_stream for t in own] + list(arrivals), end - start


async def warm_up(url: str, model: str, words: list[str], mix: Mix) -> None:
    """Short streams, then two long prompts, all at once: every replica has run both kinds of step
    (placement spreads the long pair over mixed replicas); unmeasured."""
    rng = random.Random(-mix.seed)
    short = [("stream", mix.stream_prompt_words, 8)] * mix.streams
    long = [("long", mix.long_prompt_words, 4)] * 2
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        for batch in (short, long):
            done = await asyncio.gather(
                *(
                    streamed_request(client, model, kind, prompt_text(rng, words, count), tokens)
                    for kind, count, tokens in batch
                )
            )
            failed = [t.error for t in done if t.error]
            if failed:
                raise ServerFailed(f"warm-up request failed: {failed[0]}")


# --- figures ---------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between closest ranks as numpy's default; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(timed: list[Timed], wall_seconds: float) -> dict:
    """The client's figures for one setup (seconds; tok/s over ``wall_seconds``)."""
    ok = [t for t in timed if t.error is None and t.chunks]
    streams = [t for t in ok if t.kind == "stream"]
    longs = [t for t in ok if t.kind == "long"]
    tpots = [t.tpot for t in streams if t.tpot is not None]
    gaps = [gap for t in streams for gap in t.gaps]
    stream_ttfts = [t.ttft for t in streams if t.ttft is not None]
    long_ttfts = [t.ttft for t in longs if t.ttft is not None]
    second_token = [t.gaps[0] for t in longs if t.gaps]
    tokens = sum(t.completion_tokens for t in ok)
    return {
        "requests": {"stream": len(streams), "long": len(longs), "failed": len(timed) - len(ok)},
        "errors": sorted({t.error for t in timed if t.error})[:5],
        "stream_tpot_seconds": {f"p{q}": percentile(tpots, q) for q in (50, 90, 99)},
        "stream_chunk_gap_seconds": {f"p{q}": percentile(gaps, q) for q in (50, 90, 99)},
        "stream_ttft_seconds": {f"p{q}": percentile(stream_ttfts, q) for q in (50, 99)},
        "long_ttft_seconds": {
            **{f"p{q}": percentile(long_ttfts, q) for q in (50, 99)},
            "mean": _mean(long_ttfts),
        },
        "long_second_token_gap_seconds": {"mean": _mean(second_token), "sum": sum(second_token)},
        "output_tokens": tokens,
        "wall_seconds": wall_seconds,
        "output_tok_s": tokens / wall_seconds if wall_seconds > 0 else None,
    }


def scrape(url: str) -> Figures:
    """Every ``cachet_`` sample of one /metrics page: (name, sorted labels) -> value."""
    text = httpx.get(url, timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("cachet_")
        for sample in family.samples
    }


def growth(before: dict[str, Figures], after: dict[str, Figures]) -> dict[str, Figures]:
    """Per service, how much each sample rose between two scrapes."""
    return {
        service: {key: value - before[service].get(key, 0.0) for key, value in figures.items()}
        for service, figures in after.items()
    }


def add_growth(rounds: list[dict[str, Figures]]) -> dict[str, Figures]:
    """The growths of several rounds summed, per service and sample."""
    total: dict[str, Figures] = {}
    for one in rounds:
        for service, figures in one.items():
            mine = total.setdefault(service, {})
            for key, value in figures.items():
                mine[key] = mine.get(key, 0.0) + value
    return total


def _sample(figures: Figures, name: str, **labels: str) -> float:
    return figures.get((name, tuple(sorted(labels.items()))), 0.0)


def metrics_urls(log_text: str) -> dict[str, str]:
    """Service name -> /metrics URL, from the block run-local prints once everything is up."""
    return dict(re.findall(r"^ {2}(\S+)\s+(http://\S+/metrics)\s*$", log_text, flags=re.MULTILINE))


def _is_engine(service: str) -> bool:
    return service.startswith(("engine", "decode", "prefill"))


def transfer_figures(grown: dict[str, Figures], client: dict) -> dict:
    """The hand-offs (router) and the shared tier's traffic (engines) during the mix."""
    router = grown["router"]
    count = _sample(router, "cachet_router_prefill_handoff_seconds_count")
    mean_handoff = _sample(router, "cachet_router_prefill_handoff_seconds_sum") / count if count else None
    engines = [name for name in grown if _is_engine(name)]
    decode = [n for n in engines if not n.startswith("prefill")]
    prefill = [n for n in engines if n.startswith("prefill")]

    def summed(names: list[str], metric: str, **labels: str) -> float:
        return sum(_sample(grown[n], metric, **labels) for n in names)

    loaded = summed(decode, "cachet_engine_kv_block_copy_bytes_total", direction="load")
    gap_sum = client["long_second_token_gap_seconds"]["sum"]
    # The prefill replicas' forward passes during the mix: what the hand-offs cost in compute.
    steps = summed(prefill, "cachet_engine_step_duration_seconds_sum") / count if count else None
    beyond = mean_handoff - steps if mean_handoff is not None and steps is not None else None
    long_ttft = client["long_ttft_seconds"]["mean"]
    return {
        "handoffs": {
            outcome: _sample(router, "cachet_router_prefill_handoffs_total", outcome=outcome)
            for outcome in ("handed_off", "stopped", "failed", "busy")
        },
        "handoff_seconds_mean": mean_handoff,
        "decode_loaded_bytes": loaded,
        "decode_loaded_blocks": summed(decode, "cachet_engine_kv_block_copies_total", direction="load"),
        "decode_shared_hit_tokens": summed(
            decode, "cachet_engine_prefix_cache_hit_tokens_total", tier="shared"
        ),
        "decode_transfer_hit_tokens": summed(
            decode, "cachet_engine_prefix_cache_hit_tokens_total", tier="transfer"
        ),
        "sent_bytes": summed(prefill, "cachet_engine_kv_block_copy_bytes_total", direction="send"),
        "stored_bytes": summed(engines, "cachet_engine_kv_block_copy_bytes_total", direction="store"),
        "load_gb_s_lower_bound": loaded / gap_sum / 1e9 if loaded and gap_sum else None,
        "handoff_share_of_long_ttft": mean_handoff / long_ttft if mean_handoff and long_ttft else None,
        "prefill_step_seconds_per_handoff": steps,
        "handoff_beyond_prefill_steps_seconds": beyond,
        "beyond_steps_share_of_long_ttft": beyond / long_ttft if beyond is not None and long_ttft else None,
    }


def decoding_step_figures(grown: dict[str, Figures]) -> dict:
    """The steps of the replicas that decode the streams (every mixed replica; a setup's decode
    replicas): a stream's time per token less their mean step is time spent between steps."""
    decoding = [name for name in grown if _is_engine(name) and not name.startswith("prefill")]
    count = sum(_sample(grown[n], "cachet_engine_step_duration_seconds_count") for n in decoding)
    seconds = sum(_sample(grown[n], "cachet_engine_step_duration_seconds_sum") for n in decoding)
    return {"steps": count, "step_seconds_mean": seconds / count if count else None}


# --- where the cores went ---------------------------------------------------------------------


def machine_busy_seconds() -> tuple[float, float]:
    """CPU seconds the whole machine spent busy and stolen by the hypervisor, since boot (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


def service_name(process: psutil.Process) -> str:
    """run-local's name for one of its services, from the module it runs and its environment."""
    command = process.cmdline()
    module = command[command.index("-m") + 1] if "-m" in command else process.name()
    if module != "cachet.engine":
        return module.removeprefix("cachet.")
    env = process.environ()
    index = int(env["CACHET_ENGINE_PORT"]) - ENGINE_BASE_PORT
    return engine_name(index, env.get("CACHET_ENGINE_ROLE", "mixed"))


def cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of each run-local service (its processes together), this bench's own
    process (the client) and the machine: others' work is the machine's less ours."""
    figures: dict[str, float] = {}
    for server in psutil.Process().children():
        if "run-local" not in server.cmdline():
            continue
        for service in server.children():
            with suppress(psutil.NoSuchProcess):
                figures[service_name(service)] = tree_cpu_seconds(service.pid)
    own = psutil.Process().cpu_times()
    figures["bench client"] = own.user + own.system
    figures["machine"], figures["stolen"] = machine_busy_seconds()
    return figures


def cpu_during(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds each spent during the mix; ``others``: the machine's busy time not ours."""
    spent = {name: after[name] - before.get(name, 0.0) for name in after}
    ours = sum(v for name, v in spent.items() if name not in ("machine", "stolen"))
    spent["others"] = max(0.0, spent["machine"] - ours)
    return spent


# --- one setup -------------------------------------------------------------------------------


def server_env(setup: Setup, port: int, data_dir: Path, model_dir: Path, dtype: str) -> dict[str, str]:
    # Settings from the caller's shell (API keys, a threshold, another model) would change what is measured.
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHET_")}
    env |= {
        "CACHET_PORT": str(port),
        "CACHET_DATA_DIR": str(data_dir),
        "CACHET_MODEL": str(model_dir),
        "CACHET_REPLICAS": str(setup.replicas),
        "CACHET_PREFILL_REPLICAS": str(setup.prefill_replicas),
    }
    if dtype != "auto":
        env["CACHET_DTYPE"] = dtype
    return env | dict(setup.env)


@contextmanager
def cachet_setup(setup: Setup, model_dir: Path, dtype: str) -> Iterator[tuple[str, dict[str, str]]]:
    """``cachet run-local`` for one setup in a fresh data dir: its REST URL and /metrics URLs."""
    port = free_loopback_port()
    log = (RUN_DIR / setup.name / "server.log").resolve()
    with tempfile.TemporaryDirectory(prefix=f"cachet-disagg-{setup.name}-") as data_dir:
        env = server_env(setup, port, Path(data_dir), model_dir, dtype)
        announced = re.compile(rf"Cachet REST API on http://127\.0\.0\.1:{port}\b")
        cachet = Path(sys.executable).parent / "cachet"

        def ready() -> bool:
            return bool(log.exists() and announced.search(log.read_text(errors="replace")))

        with running_server("cachet", [str(cachet), "run-local"], env, log, ready):
            yield f"http://127.0.0.1:{port}", _announced_metrics(log, setup)


def _announced_metrics(log: Path, setup: Setup) -> dict[str, str]:
    """The /metrics URLs run-local prints right after the REST URL (waited for a moment)."""
    deadline = time.monotonic() + METRICS_ANNOUNCE_SECONDS
    wanted = setup.replicas + setup.prefill_replicas + 1  # the engines and the router
    while True:
        urls = metrics_urls(log.read_text(errors="replace"))
        if sum(name.startswith(("engine", "decode", "prefill", "router")) for name in urls) >= wanted:
            return urls
        if time.monotonic() > deadline:
            raise ServerFailed(f"run-local did not print its /metrics URLs (see {log})")
        time.sleep(0.5)


def _scrape_all(urls: dict[str, str]) -> dict[str, Figures]:
    return {name: scrape(url) for name, url in urls.items() if _is_engine(name) or name == "router"}


@dataclass
class Run:
    """One setup measured once: what the client saw, what the services counted, where the cores went."""

    setup: str
    load_average_before: float
    timed: list[Timed] = field(default_factory=list)
    wall_seconds: float = 0.0
    grown: dict[str, Figures] = field(default_factory=dict)
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    def figures(self) -> dict:
        """The round's figures for the JSON, each request's timings relative to the mix's start."""
        if self.error:
            return {"error": self.error, "load_average_before": self.load_average_before}
        client = summarize(self.timed, self.wall_seconds)
        return {
            "error": None,
            "load_average_before": self.load_average_before,
            "client": client,
            "transfer": transfer_figures(self.grown, client),
            "decoding_steps": decoding_step_figures(self.grown),
            "cpu_seconds": self.cpu_seconds,
        }


def measure_setup(
    setup: Setup, mix: Mix, prompts: Prompts, words: list[str], model_dir: Path, dtype: str
) -> Run:
    run = Run(setup.name, os.getloadavg()[0])
    progress(f"disagg: {setup.name}: starting run-local, load average {run.load_average_before:.1f}")
    started = time.monotonic()
    try:
        with cachet_setup(setup, model_dir, dtype) as (url, metrics):
            progress(f"disagg: {setup.name}: ready after {time.monotonic() - started:.0f} s; warming up")
            model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
            asyncio.run(warm_up(url, model, words, mix))
            before, cpu_before = _scrape_all(metrics), cpu_seconds()
            progress(
                f"disagg: {setup.name}: {mix.streams} streams x {mix.stream_output_tokens} tokens, "
                f"{mix.long_prompts} long prompts every {mix.long_interval_seconds:g} s "
                f"(~{mix.window_seconds:.0f} s and the drain)"
            )
            run.timed, run.wall_seconds = asyncio.run(drive(url, model, mix, prompts))
            run.grown = growth(before, _scrape_all(metrics))
            run.cpu_seconds = cpu_during(cpu_before, cpu_seconds())
    except ServerFailed as failed:
        progress(f"disagg: {setup.name}: {failed}")
        run.error = str(failed)
        return run
    tokens = sum(t.completion_tokens for t in run.timed)
    failed_count = sum(1 for t in run.timed if t.error)
    progress(
        f"disagg: {setup.name}: done in {run.wall_seconds:.0f} s, {tokens} tokens, {failed_count} failed"
    )
    return run


def pooled(runs: list[Run]) -> dict:
    """One setup's rounds together: every request's figures over the summed wall time."""
    done = [run for run in runs if not run.error]
    if not done:
        return {"error": runs[0].error if runs else "not measured"}
    client = summarize([t for run in done for t in run.timed], sum(run.wall_seconds for run in done))
    cpu: dict[str, float] = {}
    for run in done:
        for name, value in run.cpu_seconds.items():
            cpu[name] = cpu.get(name, 0.0) + value
    grown = add_growth([run.grown for run in done])
    return {
        "error": None,
        "load_average_before": max(run.load_average_before for run in done),
        "client": client,
        "transfer": transfer_figures(grown, client),
        "decoding_steps": decoding_step_figures(grown),
        "cpu_seconds": cpu,
    }


def round_order(rounds: int, setups: tuple[Setup, ...] = SETUPS) -> list[list[Setup]]:
    """Each round runs both setups; every other round the other one first (ABBA), so a machine
    that drifts over the run weighs on both alike."""
    return [list(setups) if r % 2 == 0 else list(reversed(setups)) for r in range(rounds)]


# --- the section -----------------------------------------------------------------------------


def _token_counts(tokenizer: Tokenizer, prompts: Prompts) -> dict[str, float]:
    """Prompt lengths in tokens before the chat template (~30 more)."""
    longs = [len(tokenizer.encode(p).ids) for p in prompts.long]
    shorts = [len(tokenizer.encode(p).ids) for p in prompts.streams[0]]
    return {
        "long_mean": sum(longs) / len(longs),
        "long_min": min(longs),
        "stream_mean": sum(shorts) / len(shorts),
    }


def run_disagg_bench(
    quick: bool = False,
    dtype: str = "auto",
    model: str | None = None,
    json_path: Path = DEFAULT_JSON,
    rounds: int | None = None,
    setup_env: dict[str, dict[str, str]] | None = None,
) -> dict:
    """The section `python -m bench` runs: both setups back to back (``rounds`` times, default 1
    quick, 2 full), table printed, JSON written. ``setup_env``: setup name -> more of its
    run-local environment."""
    setups = tuple(
        replace(setup, env=tuple(sorted((setup_env or {}).get(setup.name, {}).items()))) for setup in SETUPS
    )
    resolved = ensure_model(model, Path(os.environ.get("CACHET_DATA_DIR", "data")))
    model_dir = resolved.path.resolve()
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    words = vocabulary_words(tokenizer)
    the_mix = mix(quick)
    rounds = rounds or (1 if quick else 2)
    # As many prompts as a stream could ever ask for in the window (at 20 ms a token).
    per_stream = int(the_mix.window_seconds / (0.02 * the_mix.stream_output_tokens)) + 2
    prompts = Prompts.draw(the_mix, words, per_stream)
    report: dict = {
        "config": {
            "model": resolved.model_id,
            "dtype": dtype,
            "quick": quick,
            "rounds": rounds,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "cores": os.cpu_count(),
            "mix": asdict(the_mix),
            "prompt_tokens": _token_counts(tokenizer, prompts),
            "setups": [asdict(s) for s in setups],
        },
        "rounds": [],
        "setups": {},
    }
    runs: list[Run] = []
    with one_run_at_a_time(SERVER_LOCK) as alone, stopping_servers_on_sigterm():
        if not alone:
            progress(f"disagg: another bench runs run-local (it holds {SERVER_LOCK}): skipped")
            report["error"] = "another run-local bench was running"
        else:
            for number, order in enumerate(round_order(rounds, setups), start=1):
                progress(f"disagg: round {number} of {rounds}: {', then '.join(s.name for s in order)}")
                done = [measure_setup(setup, the_mix, prompts, words, model_dir, dtype) for setup in order]
                report["rounds"].append({run.setup: run.figures() for run in done})
                runs += done
    report["setups"] = {s.name: pooled([run for run in runs if run.setup == s.name]) for s in setups}
    report["table"] = table_rows(report["setups"])
    report["round_ratios"] = [round_ratios(one) for one in report["rounds"]]
    report["last_round_requests"] = {run.setup: _request_records(run.timed) for run in runs[-2:]}
    print_report(report)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2))
    print(f"\ndisaggregated prefill results written to {json_path}")
    return report


def _request_records(timed: list[Timed]) -> list[dict]:
    """A round's requests for the JSON (a plot can be drawn again): kind, when it was sent from
    the first request's sending, its chunks' times from its own sending, tokens, error."""
    first = min((t.sent for t in timed), default=0.0)
    return [
        {
            "kind": t.kind,
            "sent": round(t.sent - first, 4),
            "chunks": [round(c - t.sent, 4) for c in t.chunks],
            "completion_tokens": t.completion_tokens,
            "error": t.error,
        }
        for t in timed
    ]


# --- the table -------------------------------------------------------------------------------

# (label, path into a setup's figures, scale, better)
MEASURES = (
    ("stream TPOT p50 (ms, per request)", ("client", "stream_tpot_seconds", "p50"), 1000, "lower"),
    ("stream TPOT p90 (ms, per request)", ("client", "stream_tpot_seconds", "p90"), 1000, "lower"),
    ("stream TPOT p99 (ms, per request)", ("client", "stream_tpot_seconds", "p99"), 1000, "lower"),
    ("stream token gap p50 (ms, per chunk)", ("client", "stream_chunk_gap_seconds", "p50"), 1000, "lower"),
    ("stream token gap p90 (ms, per chunk)", ("client", "stream_chunk_gap_seconds", "p90"), 1000, "lower"),
    ("stream token gap p99 (ms, per chunk)", ("client", "stream_chunk_gap_seconds", "p99"), 1000, "lower"),
    (
        "streams' replicas: step, mean (ms)",
        ("decoding_steps", "step_seconds_mean"),
        1000,
        "lower",
    ),
    ("short-prompt TTFT p50 (ms)", ("client", "stream_ttft_seconds", "p50"), 1000, "lower"),
    ("short-prompt TTFT p99 (ms)", ("client", "stream_ttft_seconds", "p99"), 1000, "lower"),
    ("long-prompt TTFT p50 (ms)", ("client", "long_ttft_seconds", "p50"), 1000, "lower"),
    ("long-prompt TTFT p99 (ms)", ("client", "long_ttft_seconds", "p99"), 1000, "lower"),
    (
        "long-prompt 1st->2nd token (ms, mean)",
        ("client", "long_second_token_gap_seconds", "mean"),
        1000,
        "lower",
    ),
    ("output tok/s (all requests)", ("client", "output_tok_s"), 1, "higher"),
)


def _dig(figures: dict, path: tuple[str, ...]) -> float | None:
    for key in path:
        if not isinstance(figures, dict) or figures.get(key) is None:
            return None
        figures = figures[key]
    return float(figures)  # type: ignore[arg-type]


def table_rows(setups: dict[str, dict]) -> list[dict]:
    """One row per measure: both setups' values and disaggregated / mixed."""
    rows = []
    for label, path, scale, better in MEASURES:
        values = {name: _dig(setups.get(name, {}), path) for name in ("mixed", "disaggregated")}
        scaled = {name: None if v is None else v * scale for name, v in values.items()}
        mixed, disagg = scaled["mixed"], scaled["disaggregated"]
        rows.append(
            {
                "measure": label,
                **scaled,
                "disagg_over_mixed": disagg / mixed if mixed and disagg is not None else None,
                "better": better,
            }
        )
    return rows


def round_ratios(one_round: dict[str, dict]) -> dict:
    """One round's headline ratios (disaggregated / mixed) and the CPU other work took from each
    setup: how far one round's verdict can be trusted."""
    rows = {row["measure"]: row["disagg_over_mixed"] for row in table_rows(one_round)}
    return {
        "tpot_p90": rows["stream TPOT p90 (ms, per request)"],
        "token_gap_p90": rows["stream token gap p90 (ms, per chunk)"],
        "output_tok_s": rows["output tok/s (all requests)"],
        "others_cpu_seconds": {
            name: entry.get("cpu_seconds", {}).get("others") for name, entry in one_round.items()
        },
    }


def _cell(value: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width},.{digits}f}"


def print_report(report: dict) -> None:
    config = report["config"]
    the_mix = config["mix"]
    print(
        f"\nDisaggregated prefill: {config['model']} ({config['dtype']}), {config['cores']} cores; "
        f"{the_mix['streams']} streams x {the_mix['stream_output_tokens']} tokens, "
        f"{the_mix['long_prompts']} long prompts (~{config['prompt_tokens']['long_mean']:.0f} tokens) "
        f"every {the_mix['long_interval_seconds']:g} s, {the_mix['long_output_tokens']} tokens out"
    )
    rows = report["table"]
    width = max(len(row["measure"]) for row in rows) + 2
    header = f"{'measure':<{width}}{'mixed x2':>12}{'1P + 1D':>12}{'1P1D ÷ mixed':>15}   better"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['measure']:<{width}}{_cell(row['mixed'], 12, 1)}{_cell(row['disaggregated'], 12, 1)}"
            f"{_cell(row['disagg_over_mixed'], 15, 2)}   {row['better']}"
        )
    for number, ratios in enumerate(report["round_ratios"], start=1):
        others = ", ".join(f"{k} {_cell(v, 0, 0)}" for k, v in ratios["others_cpu_seconds"].items())
        print(
            f"round {number}: TPOT p90 ratio {_cell(ratios['tpot_p90'], 0, 2)} (target <= 0.5), "
            f"token gap p90 {_cell(ratios['token_gap_p90'], 0, 2)}, throughput "
            f"{_cell(ratios['output_tok_s'], 0, 2)} (target >= 1); other work's CPU seconds: {others}"
        )
    _print_transfer(report["setups"].get("disaggregated", {}))
    for name, entry in report["setups"].items():
        _print_cpu(name, entry)
    for name, entry in report["setups"].items():
        if entry.get("error") or entry["client"]["requests"]["failed"]:
            print(f"{name}: error {entry.get('error')} / {entry.get('client', {}).get('errors')}")


def _print_transfer(entry: dict) -> None:
    transfer = entry.get("transfer")
    if not transfer:
        return
    outcomes = ", ".join(f"{k} {v:.0f}" for k, v in transfer["handoffs"].items() if v)
    print(f"\nhand-offs: {outcomes or 'none'}")
    print(f"mean hand-off (router histogram): {_cell(transfer['handoff_seconds_mean'], 0, 3)} s")
    share = transfer["handoff_share_of_long_ttft"]
    print(f"hand-off share of the long prompts' mean TTFT: {_cell(share, 0, 2)}")
    print(
        "prefill replica's steps per hand-off: "
        f"{_cell(transfer['prefill_step_seconds_per_handoff'], 0, 3)} s; the rest of a hand-off "
        f"(queue, KV writes, gRPC): {_cell(transfer['handoff_beyond_prefill_steps_seconds'], 0, 3)} s, "
        f"{_cell(transfer['beyond_steps_share_of_long_ttft'], 0, 2)} of the long prompts' mean TTFT"
    )
    print(
        f"decode replica loaded into its host tier: {transfer['decode_loaded_bytes'] / 1e6:,.1f} MB, "
        f"{transfer['decode_loaded_blocks']:.0f} blocks; tokens pushed to it (direct) "
        f"{transfer.get('decode_transfer_hit_tokens', 0):.0f}, from the shared tier "
        f"{transfer['decode_shared_hit_tokens']:.0f} (sent by prefill replicas: "
        f"{transfer.get('sent_bytes', 0) / 1e6:,.1f} MB; written to the tier by all replicas: "
        f"{transfer['stored_bytes'] / 1e6:,.1f} MB)"
    )
    print(
        "load GB/s, lower bound (bytes over the long prompts' 1st->2nd token gaps): "
        f"{_cell(transfer['load_gb_s_lower_bound'], 0, 3)}"
    )


def _print_cpu(name: str, entry: dict) -> None:
    """Where the cores went during one setup's mix: its services, the client, and other work."""
    spent = entry.get("cpu_seconds")
    if not spent:
        return
    cores = entry["client"]["wall_seconds"] * (os.cpu_count() or 1)
    parts = ", ".join(f"{k} {v:.0f}" for k, v in spent.items() if k not in ("machine", "stolen"))
    print(
        f"{name}: CPU seconds during the mix ({cores:.0f} core-seconds there): {parts}; "
        f"stolen {spent['stolen']:.0f}; load average before {entry['load_average_before']:.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one round, 4 long prompts over 32 s, 128-token streams (full: two rounds, 12 over 96 s, 256)",
    )
    parser.add_argument("--rounds", type=int, default=None, help="rounds of both setups (default 1 quick, 2)")
    parser.add_argument(
        "--json", type=Path, default=DEFAULT_JSON, help=f"where to write (default {DEFAULT_JSON})"
    )
    parser.add_argument(
        "--model", default=None, help="model id or checkpoint dir (default: the default model)"
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="SETUP:KEY=VALUE",
        help="more of one setup's run-local environment (mixed or disaggregated), e.g. an engine setting",
    )
    args = parser.parse_args()
    setup_env: dict[str, dict[str, str]] = {}
    for entry in args.env:
        name, _, assignment = entry.partition(":")
        if name not in {setup.name for setup in SETUPS}:
            parser.error(
                f"--env {entry!r}: SETUP:KEY=VALUE with SETUP one of {', '.join(s.name for s in SETUPS)}"
            )
        try:
            key, value = environment_assignment(assignment)
        except ValueError as error:
            parser.error(f"--env {error}")
        setup_env.setdefault(name, {})[key] = value
    report = run_disagg_bench(
        quick=args.quick,
        dtype=args.dtype,
        model=args.model,
        json_path=args.json,
        rounds=args.rounds,
        setup_env=setup_env,
    )
    failed = report.get("error") or any(entry.get("error") for entry in report["setups"].values())
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
