"""Tensor-parallel replicas (split model code, DeepSpeed's all-reduce on CPU): same numbers, same tokens,
clean failure.

Rank processes are spawned with one torch thread each (the box has two cores); the
first distributed init compiles DeepSpeed's shared-memory all-reduce unless
``make setup`` already did.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from metrics_scrape import scrape
from safetensors.torch import save_file
from service_processes import ServiceProcess, free_port, start_service

from cachet.block_hash import block_hashes
from cachet.engine.distributed import local_group_environment
from cachet.engine.v1 import engine_pb2, engine_pb2_grpc
from cachet.models.tiny import write_tiny_model

PROMPT = [1, 17, 203, 5, 88, 1024, 7, 7, 9, 300, 41, 2, 19, 600, 23, 4, 77, 12, 5]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 query heads over 2 KV heads: splits evenly over 2 ranks."""
    return write_tiny_model(tmp_path_factory.mktemp("tp") / "tiny")


@pytest.fixture(scope="module")
def uneven_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 query heads over 3 KV heads (the default model's 9/3 in small): 2 ranks get 2 and 1 KV heads."""
    from cachet.engine.models import ModelConfig, model_class
    from cachet.engine.weights import checkpoint_state

    out = tmp_path_factory.mktemp("tp") / "uneven"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / name).write_bytes((tiny_model / name).read_bytes())
    config = json.loads((tiny_model / "config.json").read_text())
    config |= {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3}
    (out / "config.json").write_text(json.dumps(config))
    torch.manual_seed(1)
    model = model_class(ModelConfig.from_model_dir(out))(ModelConfig.from_model_dir(out))
    state = {k: v.detach().clone() for k, v in checkpoint_state(model).items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def kimi_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MLA (4 heads) + MoE (8 routed experts, 2 shared) + a dense first layer."""
    root = tmp_path_factory.mktemp("tp")
    return write_tiny_model(root / "tiny-kimi-k2", family="kimi-k2", tokenizer_cache_dir=root / "tok-cache")


# ----------------------------------------------------------------- logits parity


def _steps(model_dir: Path, tp: object | None) -> tuple[list[torch.Tensor], int]:
    """Logits of a 19-token prefill and two decode steps through a runner's (split) model, and
    how many weights this rank holds."""
    from cachet.engine.attention import SequenceSpan, build_attention_metadata
    from cachet.engine.model_runner import ModelRunner

    runner = ModelRunner(
        model_dir, dtype=torch.float32, device=torch.device("cpu"), kv_cache_bytes=1 << 22, tp=tp
    )
    blocks, tokens, out = [3, 1], list(PROMPT), []
    with torch.inference_mode():
        spans = [(0, len(tokens))]
        for _ in range(3):
            start, count = spans[-1]
            meta = build_attention_metadata(
                [SequenceSpan(start, count, blocks, sample=True)], runner.block_size, runner.device
            )
            logits = runner.model(
                torch.tensor(tokens[start : start + count]), torch.arange(start, start + count), meta
            )
            out.append(logits)
            tokens.append(int(logits[-1].argmax()))
            spans.append((start + count, 1))
    return out, sum(p.numel() for p in runner.model.parameters())


def _rank_worker(
    rank: int, world: int, ep: int, port: int, model_dir: str, results: multiprocessing.Queue
) -> None:
    os.environ.update(local_group_environment(rank, world, port))
    torch.set_num_threads(1)
    from cachet.engine.distributed import TensorParallel, init_distributed

    tp = TensorParallel.create(init_distributed(torch.device("cpu")), expert_parallel_size=ep)
    logits, held = _steps(Path(model_dir), tp)
    # Plain lists: a pickled tensor travels as a shared-memory handle that dies with this process.
    results.put((rank, tp.size, held, [t.tolist() for t in logits]))


def _tensor_parallel_logits(
    model_dir: Path, world: int, ep: int = 1
) -> dict[int, tuple[int, list[torch.Tensor]]]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [
        context.Process(target=_rank_worker, args=(rank, world, ep, port, str(model_dir), results))
        for rank in range(world)
    ]
    for process in ranks:
        process.start()
    try:
        collected = {}
        for _ in range(world):
            rank, size, held, logits = results.get(timeout=240)
            assert size == world
            collected[rank] = (held, [torch.tensor(rows) for rows in logits])
    finally:
        for process in ranks:
            process.join(30)
            if process.is_alive():
                process.kill()
    # DeepSpeed never unlinks its shm all-reduce segments; tmpfs is RAM, so each leaked
    # group costs ~69 MB per rank until the machine runs out (it killed a CI run).
    leaked = sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    assert not leaked, f"shm segments outlived their group: {leaked}"
    return collected


@pytest.mark.parametrize(
    ("model_name", "ep"),
    [
        ("tiny_model", 1),
        ("uneven_model", 1),
        # MoE: whole routed experts per rank (EP = TP), and every expert cut by channels (EP = 1).
        ("kimi_model", 2),
        ("kimi_model", 1),
    ],
)
def test_tp2_logits_equal_tp1(model_name: str, ep: int, request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(model_name)
    torch.set_num_threads(1)
    reference, whole = _steps(model_dir, None)
    sharded = _tensor_parallel_logits(model_dir, world=2, ep=ep)
    # Not vacuous: the ranks hold different, smaller parts of the model (replicated parts aside).
    assert sum(held for held, _ in sharded.values()) < 1.2 * whole
    for rank, (held, logits) in sharded.items():
        assert held < 0.6 * whole, f"rank {rank} holds {held} of {whole} weights"
        for step, (want, got) in enumerate(zip(reference, logits, strict=True)):
            assert want.shape == got.shape
            # fp32: the sums differ only in order (partial sums all-reduced).
            diff = (want - got).abs().max().item()
            assert diff < 1e-4, f"rank {rank} step {step}: max |logit difference| {diff}"
    # Not vacuous: the steps produced distinct, non-trivial logits.
    assert reference[0].abs().max() > 1e-2


# --------------------------------------------------------- through the gRPC API


def _engine(
    model_dir: Path, log_dir: Path, tp: int, name: str, ep: int = 1, env: dict[str, str] | None = None
) -> ServiceProcess:
    env = {
        "CACHET_MODEL": str(model_dir),
        "CACHET_TP": str(tp),
        "CACHET_EP": str(ep),
        "CACHET_DTYPE": "float32",
        **(env or {}),
    }
    return start_service("engine", env, log_dir, name=name, timeout=240)


def _generate(stub: engine_pb2_grpc.EngineServiceStub, request_id: str, prompt: list[int], n: int):
    model = stub.GetEngineInfo(engine_pb2.GetEngineInfoRequest()).model
    request = engine_pb2.GenerateRequest(request_id=request_id, model=model, prompt_token_ids=prompt)
    request.sampling.max_tokens = n
    request.sampling.temperature = 0.0  # greedy (the default is 1)
    request.sampling.ignore_eos = True
    tokens, usage = [], None
    for response in stub.Generate(request, timeout=120):
        tokens.extend(response.token_ids)
        if response.HasField("usage"):
            usage = response.usage
    return tokens, usage


def _conversation(address: str) -> tuple[list[list[int]], list[int]]:
    """A prompt, the same prompt again (served from the prefix cache), and one sharing its prefix."""
    long_prompt = [(7 * i + 3) % 5000 + 10 for i in range(40)]
    with grpc.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        outputs, cached = [], []
        for index, prompt in enumerate([long_prompt, long_prompt, long_prompt[:35] + PROMPT]):
            tokens, usage = _generate(stub, f"req-{index}", prompt, 12)
            outputs.append(tokens)
            cached.append(usage.cached_tokens)
    return outputs, cached


def _choices(address: str) -> tuple[list[list[int]], list[int]]:
    """Greedy choices of a prompt of 2 blocks and 5 tokens, sent as the router sends them: choice 0,
    then 3 more once it has its first token, which copy its partial last block (each rank its own
    shard of it). Each choice's first 12 tokens, and how many prompt tokens each did not compute."""
    prompt = [(11 * i + 5) % 5000 + 10 for i in range(37)]
    with grpc.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        model = stub.GetEngineInfo(engine_pb2.GetEngineInfoRequest()).model

        def start(request_id: str, max_tokens: int):
            request = engine_pb2.GenerateRequest(request_id=request_id, model=model, prompt_token_ids=prompt)
            request.sampling.max_tokens = max_tokens
            request.sampling.temperature = 0.0
            request.sampling.ignore_eos = True
            return stub.Generate(request, timeout=120)

        first = start("choice-0", 500)  # still decoding when the others come
        responses = [next(first)]
        others = [start(f"choice-{i}", 12) for i in (1, 2, 3)]
        answers = [[response for response in call] for call in others]
        while sum(len(r.token_ids) for r in responses) < 12:
            responses.append(next(first))
        first.cancel()
    tokens = [[t for r in rs for t in r.token_ids][:12] for rs in [responses, *answers]]
    cached = [next(r.usage.cached_tokens for r in rs if r.HasField("usage")) for rs in [responses, *answers]]
    return tokens, cached


@pytest.mark.parametrize(("model_name", "ep"), [("tiny_model", 1), ("kimi_model", 2), ("kimi_model", 1)])
def test_greedy_tokens_tp2_equal_tp1_over_grpc(
    model_name: str, ep: int, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    tiny_model: Path = request.getfixturevalue(model_name)
    single = _engine(tiny_model, tmp_path, 1, "engine-tp1")
    try:
        want, want_cached = _conversation(single.address)
        want_choices = _choices(single.address)
    finally:
        single.stop()
    sharded = _engine(tiny_model, tmp_path, 2, "engine-tp2", ep=ep)
    try:
        with grpc.insecure_channel(sharded.address) as channel:
            info = engine_pb2_grpc.EngineServiceStub(channel).GetEngineInfo(engine_pb2.GetEngineInfoRequest())
        assert info.tensor_parallel_size == 2
        # What the replica really runs: CACHET_EP=2 puts whole experts on the two ranks,
        # CACHET_EP=1 cuts each expert across them.
        assert info.expert_parallel_size == ep
        got, got_cached = _conversation(sharded.address)
        got_choices = _choices(sharded.address)
    finally:
        assert sharded.stop() == 0, sharded.log_tail()
    assert got == want
    assert got_cached == want_cached
    assert got_cached[1] >= 32, "the repeated prompt should come from the prefix cache"
    assert got_choices == want_choices
    tokens, cached = got_choices
    assert tokens[1:] == [tokens[0]] * 3  # greedy: every choice is choice 0
    assert cached == [0, 36, 36, 36]  # 2 blocks hit, 4 tokens copied: only the last one computed


# --------------------------------------------------------- the shared KV tier


def _generate_at(address: str, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
    with grpc.insecure_channel(address) as channel:
        tokens, usage = _generate(engine_pb2_grpc.EngineServiceStub(channel), request_id, prompt, 12)
    return tokens, usage.cached_tokens


@pytest.mark.parametrize("model_name", ["uneven_model", "kimi_model"])
def test_a_tp2_replica_serves_another_ones_prompt_from_its_ranks_shards_in_the_shared_folder(
    model_name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Each rank writes its own shard of a block and reads it back; a block whose shard of
    another rank is damaged is recomputed, never served (uneven: 2 and 1 KV heads a rank;
    Kimi K2: MLA's latent cache)."""
    model_dir: Path = request.getfixturevalue(model_name)
    shared = tmp_path / "kv-shared"
    env = {"CACHET_KV_CACHE_GB": "0.01", "CACHET_KV_HOST_GB": "0.01", "CACHET_KV_SHARED_DIR": str(shared)}
    whole = [(13 * i + 7) % 5000 + 10 for i in range(50)]  # 3 full blocks
    damaged = [(17 * i + 3) % 5000 + 10 for i in range(50)]
    first = _engine(model_dir, tmp_path, 2, "engine-tp2-a", env=env)
    try:
        with grpc.insecure_channel(first.address) as channel:
            info = engine_pb2_grpc.EngineServiceStub(channel).GetEngineInfo(engine_pb2.GetEngineInfoRequest())
        want = [_generate_at(first.address, f"cold-{i}", prompt) for i, prompt in enumerate([whole, damaged])]
        rank_folders = sorted(
            (f for f in shared.iterdir() if f.is_dir()), key=lambda folder: folder.name[-6:]
        )
        assert [folder.name[-6:] for folder in rank_folders] == ["-tp2r0", "-tp2r1"]
        deadline = time.monotonic() + 30
        while any(len(list(folder.glob("[!.]*.kv"))) < 6 for folder in rank_folders):
            assert time.monotonic() < deadline, "the ranks did not write their shards"
            time.sleep(0.05)
    finally:
        assert first.stop() == 0, first.log_tail()
    assert [cached for _, cached in want] == [0, 0]
    # The damaged prompt's second block (greedy: the batch-invariant chain): one byte of rank
    # 1's shard flipped.
    block_hash = block_hashes(damaged, info.model, block_size=16, reproducible=info.reproducible_kernels)[1]
    shard = rank_folders[1] / f"{block_hash & (2**64 - 1):016x}.kv"
    data = shard.read_bytes()
    broken = data[:-1] + bytes([data[-1] ^ 1])
    shard.write_bytes(broken)

    second = _engine(model_dir, tmp_path, 2, "engine-tp2-b", env=env)
    try:
        got = [
            _generate_at(second.address, f"moved-{i}", prompt) for i, prompt in enumerate([whole, damaged])
        ]
    finally:
        assert second.stop() == 0, second.log_tail()
    assert got[0] == (want[0][0], 48), "every full block from the shared folder"
    assert got[1] == (want[1][0], 16), "the blocks up to the damaged shard, the rest recomputed"
    # Removed as damaged, then written again by the rank that recomputed it.
    assert not shard.exists() or shard.read_bytes() != broken


@pytest.mark.parametrize(
    ("model_name", "transport"),
    [
        ("uneven_model", "shared_folder"),
        ("kimi_model", "shared_folder"),
        ("uneven_model", "direct"),
        ("kimi_model", "direct"),
    ],
)
def test_a_tp2_decode_replica_continues_a_tp2_prefill_replicas_hand_off_as_one_replica_would(
    model_name: str, transport: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Disaggregated prefill between tensor-parallel replicas, shard to shard: through the
    ranks' folders, or pushed by each prefill rank straight to the same decode rank (uneven
    heads: rank 0's shard is twice rank 1's; MLA: each rank's latent cache). The same greedy
    tokens as one single-rank replica computing everything."""
    model_dir: Path = request.getfixturevalue(model_name)
    prompt = [(19 * i + 11) % 5000 + 10 for i in range(70)]  # 4 full blocks and 6 tokens
    single = _engine(model_dir, tmp_path, 1, "engine-tp1")
    try:
        with grpc.insecure_channel(single.address) as channel:
            want, _ = _generate(engine_pb2_grpc.EngineServiceStub(channel), "whole", prompt, 12)
    finally:
        single.stop()
    if transport == "shared_folder":
        tier = "shared"
        prefill_env = {"CACHET_KV_HOST_GB": "0.01", "CACHET_KV_SHARED_DIR": str(tmp_path / "kv-shared")}
        decode_env = prefill_env
    else:
        tier = "transfer"
        prefill_env = {}
        decode_env = {"CACHET_KV_HOST_GB": "0.01", "CACHET_ENGINE_KV_TRANSFER_PORT": str(free_port())}
    prefill = _engine(
        model_dir, tmp_path, 2, "prefill-tp2", env=prefill_env | {"CACHET_ENGINE_ROLE": "prefill"}
    )
    decode = None
    try:
        decode = _engine(
            model_dir, tmp_path, 2, "decode-tp2", env=decode_env | {"CACHET_ENGINE_ROLE": "decode"}
        )
        with grpc.insecure_channel(decode.address) as channel:
            receiver = (
                engine_pb2_grpc.EngineServiceStub(channel)
                .GetEngineInfo(engine_pb2.GetEngineInfoRequest())
                .kv_transfer_address
            )
        with grpc.insecure_channel(prefill.address) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            model = stub.GetEngineInfo(engine_pb2.GetEngineInfoRequest()).model
            handed = engine_pb2.GenerateRequest(
                request_id="p", model=model, prompt_token_ids=prompt, hand_off_kv=True, hand_off_to=receiver
            )
            handed.sampling.max_tokens = 1
            handed.sampling.temperature = 0.0
            handed.sampling.ignore_eos = True
            (first_token,) = [
                t for response in stub.Generate(handed, timeout=120) for t in response.token_ids
            ]
        with grpc.insecure_channel(decode.address) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            continued = engine_pb2.GenerateRequest(
                request_id="d",
                model=model,
                prompt_token_ids=prompt,
                prefilled=engine_pb2.PrefilledElsewhere(first_token_id=first_token),
            )
            continued.sampling.max_tokens = 12
            continued.sampling.temperature = 0.0
            continued.sampling.ignore_eos = True
            got = [t for response in stub.Generate(continued, timeout=120) for t in response.token_ids]
            info = stub.GetEngineInfo(engine_pb2.GetEngineInfoRequest())
        figures = scrape(decode.metrics_port)
    finally:
        assert prefill.stop() == 0, prefill.log_tail()
        if decode is not None:
            assert decode.stop() == 0, decode.log_tail()
    assert info.tensor_parallel_size == 2
    assert bool(receiver) == (transport == "direct")
    assert got == want
    # Every full block reached the decode replica from the prefill replica's ranks.
    assert figures[("cachet_engine_prefix_cache_hit_tokens_total", (("tier", tier),))] == 64


# ------------------------------------------------------------------- failure


def _children(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(child) for child in children]


def _follower_pid(engine: ServiceProcess) -> int:
    for child in _children(engine.process.pid):
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            return child
    raise AssertionError(f"no rank process under {engine.process.pid}")


def test_killing_a_rank_takes_the_replica_down(tiny_model: Path, tmp_path: Path) -> None:
    engine = _engine(tiny_model, tmp_path, 2, "engine-kill")
    try:
        channel = grpc.insecure_channel(engine.address)
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        request = engine_pb2.GenerateRequest(request_id="long", model="tiny-llama", prompt_token_ids=PROMPT)
        request.sampling.max_tokens = 1500
        request.sampling.ignore_eos = True
        stream = stub.Generate(request, timeout=60)
        next(stream)  # in flight: the first token is out
        os.kill(_follower_pid(engine), signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(grpc.RpcError) as failure:
            for _ in stream:
                pass
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
        engine.process.wait(timeout=20)
        assert time.monotonic() - killed_at < 20
        assert engine.process.returncode != 0
        with pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        channel.close()
    finally:
        engine.stop(signal.SIGKILL)
