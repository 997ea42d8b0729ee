"""The CPU decode-attention kernel that reads the paged KV cache in place (``csrc/``).

The reference path (``attention._attend_group``) gathers each request's blocks into a dense
copy and runs SDPA over it; at long contexts that copy was 40% of a decode step. The kernel
is C++ built by torch's extension builder once per environment (``make setup`` does it, into
the environment's own extensions folder as DeepSpeed's ops are) and loaded at a replica's
start. Where it cannot be built (no compiler), the engine says so once and decodes through
the reference path.

The build targets an instruction set the host has (AVX2 with FMA, or the compiler's
baseline) rather than ``-march=native``, and names the build by it: an environment copied to
an older CPU (a container image) then builds its own instead of loading one that faults.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import structlog
import torch

from cachet.engine.cpu_features import cpu_flags
from cachet.engine.deepspeed_ops import extensions_dir, wait_for_build_locks

log = structlog.get_logger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"


def _isa_flags() -> tuple[str, list[str]]:
    flags = cpu_flags()
    if "avx2" in flags and "fma" in flags:
        return "avx2", ["-mavx2", "-mfma", "-mf16c"]
    return "base", []


@functools.cache
def load_paged_decode_kernel() -> ModuleType | None:
    """The built kernel (building it first if this environment has none), or None where the
    build fails; the failure is logged once, with the compiler's message."""
    isa, isa_flags = _isa_flags()
    name = f"cachet_paged_decode_{isa}"
    folder = extensions_dir() / name
    folder.mkdir(parents=True, exist_ok=True)
    wait_for_build_locks(folder)
    from torch.utils.cpp_extension import load

    try:
        return load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-fopenmp", "-fno-math-errno", *isa_flags],
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as exc:
        log.warning(
            "paged decode kernel unavailable; decoding through the gather + SDPA path",
            error=str(exc)[-2000:],
        )
        return None


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [batch, heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim];
    block_table: [batch, blocks] int64; seq_lens: [batch] int64 keys per request (its cached
    tokens and this step's one). Query head h reads KV head h // (heads / kv_heads)."""
    kernel = load_paged_decode_kernel()
    if kernel is None:
        raise RuntimeError("the paged decode kernel is not built; see the engine's start-up log")
    return kernel.paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale)
