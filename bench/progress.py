"""What a bench prints while it runs: every long one says where it is."""

from __future__ import annotations


def progress(message: str) -> None:
    print(f"[bench] {message}", flush=True)
