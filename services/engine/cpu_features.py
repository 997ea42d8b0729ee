"""What the host CPU computes natively, where the fast path depends on it."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 products in hardware. Without them (AVX2 hosts) bf16 math is
    emulated and fp32 is the faster dtype."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
