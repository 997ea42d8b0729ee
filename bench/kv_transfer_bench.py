"""The direct KV transfer of disaggregated prefill on its own (``kv_transfer``): a prefill
replica's hand-off of a 512-, 1,800- and 7,500-token prompt's blocks (bf16) pushed through
``KvSender``s into ``KvReceiver``s on loopback, from the sends' start to the receivers' acks,
in GB/s; the pairs reused as a replica's are, median of several hand-offs after one that
pairs. No model.

- The default model's blocks, one pair: on the CPU (gloo), and on CUDA where there is one
  (both ends on one GPU: gloo through host memory, since NCCL refuses two ranks on one GPU).
- Tensor-parallel replicas, on the CPU: blocks of a model with 8 KV heads (Llama 3.2 1B's KV:
  16 layers, 8 KV heads of 64; the default model's 3 do not split in two) from one replica to
  another, one rank each against two ranks each, whose rank pairs send a shard (4 KV heads)
  each at once, rank 0 acking once the other rank holds its shard.

`python -m bench.kv_transfer_bench [--quick]`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.progress import progress
from cachet.engine.kv_transfer import KvReceiver, KvSender
from cachet.loopback_port import free_loopback_port

# [layers, K and V, tokens, KV heads, head dim], 16-token blocks.
DEFAULT_MODEL_BLOCK = (30, 2, 16, 3, 64)
EIGHT_KV_HEADS_BLOCK = (16, 2, 16, 8, 64)
PROMPT_TOKENS = (512, 1_800, 7_500)


def run_kv_transfer_bench(quick: bool = False) -> dict:
    sends = 3 if quick else 7
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    results = {
        f"{device}, default model": _hand_offs(
            DEFAULT_MODEL_BLOCK, torch.device(device), ranks=1, sends=sends
        )
        for device in devices
    }
    for ranks in (1, 2):
        results[f"cpu, 8 KV heads, {ranks} rank(s)"] = _hand_offs(
            EIGHT_KV_HEADS_BLOCK, torch.device("cpu"), ranks=ranks, sends=sends
        )
    _print_table(results)
    return results


def _hand_offs(
    block: tuple[int, ...], device: torch.device, ranks: int, sends: int
) -> dict[str, dict[str, float]]:
    """Each prompt's hand-off timed: ``ranks`` sending ranks, each pushing its shard of every
    block (its share of the KV heads) to the receiving replica's rank of its number."""
    shard = (*block[:3], block[3] // ranks, *block[4:])
    block_bytes = torch.Size(block).numel() * torch.bfloat16.itemsize
    largest = -(-max(PROMPT_TOKENS) // block[2])
    port = free_loopback_port()
    receivers = [
        KvReceiver(
            f"bench-tp{ranks}r{rank}",
            shard,
            torch.bfloat16,
            device,
            port=port,
            budget_bytes=2 * largest * block_bytes,
            rank=rank,
            ranks=ranks,
        )
        for rank in range(ranks)
    ]
    senders = [KvSender(f"bench-tp{ranks}r{rank}", device, rank=rank, name="bench") for rank in range(ranks)]
    address = receivers[0].address
    rows: dict[str, dict[str, float]] = {}
    next_hash = 0
    try:
        for tokens in PROMPT_TOKENS:
            count = tokens // block[2]  # whole blocks: the partial last one is recomputed
            shards = [torch.randn(count, *shard, device=device).to(torch.bfloat16) for _ in range(ranks)]
            progress(
                f"KV transfer on {device.type}, {ranks} rank(s): {tokens}-token hand-offs ({count} blocks)"
            )
            seconds = []
            for attempt in range(sends + 1):
                hashes = list(range(next_hash, next_hash + count))
                next_hash += count
                if device.type == "cuda":
                    torch.cuda.synchronize()
                started = time.perf_counter()
                sent = [
                    sender.send_later(address, hashes, data)
                    for sender, data in zip(senders, shards, strict=True)
                ]
                for future in sent:
                    future.result(timeout=120)
                if attempt:  # the first hand-off also pairs
                    seconds.append(time.perf_counter() - started)
                for receiver in receivers:
                    receiver.blocks.take(hashes)
            median = statistics.median(seconds)
            rows[str(tokens)] = {
                "blocks": count,
                "mb": count * block_bytes / 1e6,
                "ms": median * 1e3,
                "gb_per_s": count * block_bytes / median / 1e9,
            }
    finally:
        for sender in senders:
            sender.close()
        for receiver in receivers:
            receiver.close()
    return rows


def _print_table(results: dict[str, dict[str, dict[str, float]]]) -> None:
    print("\nDirect KV transfer on loopback (bf16 blocks; median hand-off, send to ack)")
    print(f"{'blocks from':<32}{'prompt tokens':>15}{'MB':>10}{'ms':>10}{'GB/s':>8}")
    print("-" * 75)
    for where, rows in results.items():
        for tokens, row in rows.items():
            print(f"{where:<32}{tokens:>15}{row['mb']:>10.1f}{row['ms']:>10.1f}{row['gb_per_s']:>8.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    run_kv_transfer_bench(parser.parse_args().quick)
