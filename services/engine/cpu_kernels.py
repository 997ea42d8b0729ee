"""Building and loading the engine's C++ CPU kernels (``csrc/<name>.cpp``).

Each kernel is built by torch's extension builder once per environment (``make setup`` does
it, into the environment's own extensions folder as DeepSpeed's ops are) and loaded at a
replica's start. Where one cannot be built (no compiler), the engine says so once and runs the
reference path that kernel replaces.

A build targets an instruction set the host has (AVX2 with FMA; AMX's bf16 tiles, AVX512-BF16,
or AVX-512 without it, for a kernel with a path for them; or the compiler's baseline)
rather than ``-march=native``, and is named by it: an environment copied to an older CPU (a
container image) then builds its own instead of loading one that faults.

torch's builder guards a build folder with a lock *file* (its ``FileBaton``), taken at every
load, even one with nothing to rebuild; a process killed while holding it leaves the file, and
every later load waits on it forever. Processes here take an ``flock`` on the folder first
(the kernel releases one whatever kills its holder), so a baton found while holding it is
one a killed loader left behind, and is removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType

import structlog

from cachet.engine.cpu_features import cpu_flags
from cachet.engine.deepspeed_ops import extensions_dir

log = structlog.get_logger(__name__)

_SOURCES = Path(__file__).parent / "csrc"
# The kernels `make setup` builds, and what the engine does where one is missing.
KERNELS = {
    "paged_decode_attention": "decoding through the gather + SDPA path",
    "panel_linear": "linears run through oneDNN (bfloat16 ones through torch's emulated products where it has none)",
    "fused_token_ops": "RMSNorm, SwiGLU and rotary run as plain torch ops",
    "prefill_attention": "prompt chunks attend through SDPA over a gathered copy",
    "block_q4_linear": "Q4_1 checkpoint weights are read whole, in the serving dtype, at every row count",
}


# Kernels with a path for AVX512-BF16 (dot products, or rounding to bf16), built with it where
# the host has it (all but the prompt kernel, whose tiles are fp32 only).
_AVX512_BF16_KERNELS = frozenset(
    {"panel_linear", "paged_decode_attention", "fused_token_ops", "block_q4_linear"}
)
# Kernels with a path for AVX-512 alone (the panels' 16-wide fp32 tile, fp32 prefill attention, the
# paged kernel's 16-key register tiles),
# built with it on an AVX-512 host (one without bf16 instructions, for a kernel of both lists).
_AVX512_KERNELS = frozenset({"panel_linear", "prefill_attention", "paged_decode_attention"})
# Kernels with a path for AMX's bf16 tiles (bf16 prompt attention), built with it where the host
# has it (with AVX512-BF16 and AVX512BW, which the path's softmax and layouts use).
_AMX_KERNELS = frozenset({"prefill_attention"})
_AMX_HOST_FLAGS = frozenset({"avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"})
# Every instruction set a build may target, widest first (host_instruction_sets' order).
_INSTRUCTION_SETS = ("amx", "avx512bf16", "avx512", "avx2", "base")
# Flags a kernel needs beyond its instruction set's: the fused ops round where torch's ops round,
# so an fp32 product and the sum after it must stay two roundings, never one fused multiply-add;
# the paged attention kernel's fixed orders are the same code on both of its paths only when the
# compiler fuses nothing the source does not (the multiply-adds it wants are written as such).
_KERNEL_FLAGS = {"fused_token_ops": ["-ffp-contract=off"], "paged_decode_attention": ["-ffp-contract=off"]}
# AVX512 extensions a kernel's AVX512-BF16 path uses beyond AVX512F (the fused ops: masked 16-bit
# loads and stores of 256 bits), by their /proc/cpuinfo name and their compiler flag.
_KERNEL_AVX512_EXTENSIONS = {"fused_token_ops": {"avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl"}}


def host_instruction_sets(name: str) -> list[tuple[str, list[str]]]:
    """The instruction sets kernel ``name`` has a path for that this host runs, each with its
    compiler flags, widest first: a replica loads the first. ``make test-kernel-builds`` tests
    every one, since a path only some hosts take would otherwise be built on those hosts alone."""
    flags = cpu_flags()
    if "avx2" not in flags or "fma" not in flags:
        return [("base", [])]
    avx2 = ["-mavx2", "-mfma", "-mf16c"]
    extensions = _KERNEL_AVX512_EXTENSIONS.get(name, {})
    sets: list[tuple[str, list[str]]] = []
    if name in _AMX_KERNELS and flags >= _AMX_HOST_FLAGS:
        sets.append(("amx", [*avx2, "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"]))
    if name in _AVX512_BF16_KERNELS and {"avx512f", "avx512_bf16", *extensions} <= flags:
        sets.append(("avx512bf16", [*avx2, "-mavx512f", "-mavx512bf16", *extensions.values()]))
    if name in _AVX512_KERNELS and "avx512f" in flags:
        sets.append(("avx512", [*avx2, "-mavx512f"]))
    return [*sets, ("avx2", avx2), ("base", [])]


def every_host_instruction_set() -> list[str]:
    """Every instruction set some kernel of ``KERNELS`` has a build for on this host, widest
    first: what ``make test-kernel-builds`` sets ``CACHET_KERNEL_ISA`` to in turn."""
    sets = {isa for name in KERNELS for isa, _ in host_instruction_sets(name)}
    return sorted(sets, key=_INSTRUCTION_SETS.index)


def instruction_set(name: str) -> str:
    """The instruction set kernel ``name`` is built for here (``_INSTRUCTION_SETS``): what its
    paths are, which the host's flags alone do not say under ``CACHET_KERNEL_ISA``."""
    return _isa_flags(name)[0]


def _isa_flags(name: str) -> tuple[str, list[str]]:
    """The instruction set kernel ``name`` is built for here: the widest the host runs, or the
    one ``CACHET_KERNEL_ISA`` names (``make test-kernel-builds``: each in turn)."""
    sets = host_instruction_sets(name)
    wanted = os.environ.get("CACHET_KERNEL_ISA")
    if not wanted:
        return sets[0]
    if wanted not in _INSTRUCTION_SETS:
        raise ValueError(f"CACHET_KERNEL_ISA={wanted!r}: one of {', '.join(_INSTRUCTION_SETS)}")
    # The named set, or where this kernel has no path for it, the widest one below it that it has.
    rank = _INSTRUCTION_SETS.index
    return next((isa, flags) for isa, flags in sets if rank(isa) >= rank(wanted))


def kernel_builds(names: Iterable[str]) -> str:
    """Kernels ``names`` as this host runs them (``name=isa``, or ``name=torch`` where one did
    not build and torch's ops serve) and the instruction set torch's own vector ops dispatch to:
    what fixes the order of a step's sums here, so what names KV from batch-invariant steps."""
    import torch

    builds = [f"{name}={instruction_set(name) if load_cpu_kernel(name) else 'torch'}" for name in names]
    return ",".join([*builds, f"aten={torch.backends.cpu.get_cpu_capability()}"])


@functools.cache
def load_cpu_kernel(name: str) -> ModuleType | None:
    """Kernel ``name`` of ``KERNELS`` (built first if this environment has none), or None where
    the build fails; the failure is logged once, with the compiler's message."""
    isa, isa_flags = _isa_flags(name)
    module = f"cachet_{name}_{isa}"
    folder = extensions_dir() / module
    folder.mkdir(parents=True, exist_ok=True)
    from torch.utils.cpp_extension import load

    try:
        with _only_loader(folder):
            return load(
                name=module,
                sources=[str(_SOURCES / f"{name}.cpp")],
                extra_cflags=[
                    "-O3",
                    "-fopenmp",
                    "-fno-math-errno",
                    *isa_flags,
                    *_KERNEL_FLAGS.get(name, []),
                    f"-DCACHET_HEADERS={_headers_digest()}",
                ],
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
                verbose=False,
            )
    except (RuntimeError, OSError, ImportError) as exc:
        log.warning(f"{name} kernel unavailable; {KERNELS[name]}", error=str(exc)[-2000:])
        return None


@functools.cache
def _headers_digest() -> str:
    """The shared headers' contents, as a define: torch's builder rebuilds a kernel when its
    source or flags change, and cannot see a header's."""
    digest = hashlib.sha256()
    for header in sorted(_SOURCES.glob("*.h")):
        digest.update(header.read_bytes())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def _only_loader(folder: Path) -> Iterator[None]:
    """While held, no other process of ours loads or builds into ``folder``; torch's baton
    found then was left by a loader that was killed, and is removed."""
    with open(folder / "cachet-loader.flock", "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            baton = folder / "lock"
            if baton.exists():
                log.warning("removing a kernel build lock left by a killed process", path=str(baton))
                baton.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def build_all() -> None:
    """Build every kernel (``make setup``), saying which, since each takes a minute."""
    for name in KERNELS:
        print(f"building the {name} kernel (once, ~1 min)", flush=True)
        load_cpu_kernel(name)
