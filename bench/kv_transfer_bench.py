"""The direct KV transfer of disaggregated prefill on its own (``kv_transfer``): a prefill
replica's hand-off of a 512-, 1,800- and 7,500-token prompt's blocks, in the default model's
shape (bf16), pushed through a ``KvSender`` into a ``KvReceiver`` on loopback, from the
send's start to the receiver's ack, in GB/s; one pair, reused as a replica's is, median of
several sends after one that pairs. On the CPU (gloo), and on CUDA where there is one (both
ends on one GPU: gloo through host memory, since NCCL refuses two ranks on one GPU). No
model. `python -m bench.kv_transfer_bench [--quick]`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.progress import progress
from cachet.engine.kv_transfer import KvReceiver, KvSender
from cachet.loopback_port import free_loopback_port

# The default model (SmolLM2-135M), 16-token blocks: [layers, K and V, tokens, KV heads, head dim].
BLOCK_SHAPE = (30, 2, 16, 3, 64)
PROMPT_TOKENS = (512, 1_800, 7_500)
LAYOUT = "smollm2-135m-shape/bf16/16"


def run_kv_transfer_bench(quick: bool = False) -> dict:
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    results = {device: _bench_device(torch.device(device), sends=3 if quick else 7) for device in devices}
    _print_table(results)
    return results


def _bench_device(device: torch.device, sends: int) -> dict[str, dict[str, float]]:
    block_bytes = torch.Size(BLOCK_SHAPE).numel() * torch.bfloat16.itemsize
    largest = -(-max(PROMPT_TOKENS) // BLOCK_SHAPE[2])
    receiver = KvReceiver(
        LAYOUT,
        BLOCK_SHAPE,
        torch.bfloat16,
        device,
        port=free_loopback_port(),
        budget_bytes=2 * largest * block_bytes,
    )
    sender = KvSender(LAYOUT, device)
    rows: dict[str, dict[str, float]] = {}
    next_hash = 0
    try:
        for tokens in PROMPT_TOKENS:
            count = tokens // BLOCK_SHAPE[2]  # whole blocks: the partial last one is recomputed
            blocks = torch.randn(count, *BLOCK_SHAPE, device=device).to(torch.bfloat16)
            progress(f"KV transfer on {device.type}: {tokens}-token hand-offs ({count} blocks)")
            seconds = []
            for attempt in range(sends + 1):
                hashes = list(range(next_hash, next_hash + count))
                next_hash += count
                if device.type == "cuda":
                    torch.cuda.synchronize()
                started = time.perf_counter()
                sender.send_later(receiver.address, hashes, blocks).result(timeout=120)
                if attempt:  # the first send also pairs
                    seconds.append(time.perf_counter() - started)
                receiver.blocks.take(hashes)
            median = statistics.median(seconds)
            rows[str(tokens)] = {
                "blocks": count,
                "mb": count * block_bytes / 1e6,
                "ms": median * 1e3,
                "gb_per_s": count * block_bytes / median / 1e9,
            }
    finally:
        sender.close()
        receiver.close()
    return rows


def _print_table(results: dict[str, dict[str, dict[str, float]]]) -> None:
    print("\nDirect KV transfer, one pair on loopback (default model's blocks, bf16; median send to ack)")
    print(f"{'device':<8}{'prompt tokens':>15}{'MB':>10}{'ms':>10}{'GB/s':>8}")
    print("-" * 51)
    for device, rows in results.items():
        for tokens, row in rows.items():
            print(f"{device:<8}{tokens:>15}{row['mb']:>10.1f}{row['ms']:>10.1f}{row['gb_per_s']:>8.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    run_kv_transfer_bench(parser.parse_args().quick)
