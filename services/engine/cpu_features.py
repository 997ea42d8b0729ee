"""What the host CPU computes natively, where the fast path depends on it."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The host's CPU flags as /proc/cpuinfo names them; empty where it cannot be read."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 products in hardware. Without them (AVX2 hosts) bf16 math is
    emulated and fp32 is the faster dtype."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags
