"""A kernel's build lock left by a process killed while loading it does not hang the next
start: loads take an flock first, so a lock file found under it is a leftover."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cachet.engine.cpu_kernels import _isa_flags, load_cpu_kernel
from cachet.engine.deepspeed_ops import extensions_dir


def test_a_baton_left_by_a_killed_loader_is_removed_and_the_kernel_loads() -> None:
    if load_cpu_kernel("paged_decode_attention") is None:
        pytest.skip("no compiler here: the kernel does not build")
    folder = extensions_dir() / f"cachet_paged_decode_attention_{_isa_flags('paged_decode_attention')[0]}"
    baton = folder / "lock"
    baton.touch()  # what torch's builder leaves when its process is killed mid-load
    try:
        loaded = subprocess.run(
            [
                sys.executable,
                "-c",
                "from cachet.engine.cpu_kernels import load_cpu_kernel; "
                "assert load_cpu_kernel('paged_decode_attention') is not None",
            ],
            capture_output=True,
            text=True,
            timeout=120,  # without the fix it waits on the baton forever
        )
        assert loaded.returncode == 0, loaded.stderr[-2000:]
        assert "removing a kernel build lock left by a killed process" in loaded.stdout + loaded.stderr
        assert not baton.exists()
    finally:
        baton.unlink(missing_ok=True)


def test_each_kernel_is_built_for_the_widest_instruction_set_it_has_a_path_for(monkeypatch) -> None:
    """An AMX host builds the prompt kernel with the tiles, the others as on an AVX512-BF16 host;
    a build's name says its set, so a copied environment never loads one the CPU lacks."""
    from cachet.engine import cpu_kernels

    monkeypatch.delenv("CACHET_KERNEL_ISA", raising=False)
    avx512_bf16 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"}
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset(avx512_bf16 | {"amx_tile", "amx_bf16"}))
    assert _isa_flags("prefill_attention")[0] == "amx"
    assert "-mamx-bf16" in _isa_flags("prefill_attention")[1]
    assert _isa_flags("paged_decode_attention")[0] == "avx512bf16"
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset(avx512_bf16))
    assert _isa_flags("prefill_attention")[0] == "avx512"
    assert _isa_flags("paged_decode_attention")[0] == "avx512bf16"


def test_a_named_instruction_set_builds_each_kernel_for_it_or_the_widest_below_it(monkeypatch) -> None:
    """``CACHET_KERNEL_ISA`` (``make test-kernel-builds``): every set this host runs, in turn; a
    kernel with no path for the named set takes the next one down."""
    from cachet.engine import cpu_kernels

    avx512_bf16 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"}
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset(avx512_bf16))
    assert [isa for isa, _ in cpu_kernels.host_instruction_sets("panel_linear")] == [
        "avx512bf16",
        "avx512",
        "avx2",
        "base",
    ]
    monkeypatch.setenv("CACHET_KERNEL_ISA", "avx512")
    assert _isa_flags("panel_linear") == ("avx512", ["-mavx2", "-mfma", "-mf16c", "-mavx512f"])
    assert _isa_flags("fused_token_ops")[0] == "avx2"  # no AVX-512 path without bf16
    assert cpu_kernels.instruction_set("fused_token_ops") == "avx2"
    # The sets `make test-kernel-builds` goes through: any kernel's, widest first.
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset(avx512_bf16 | {"amx_tile", "amx_bf16"}))
    assert cpu_kernels.every_host_instruction_set() == ["amx", "avx512bf16", "avx512", "avx2", "base"]
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert cpu_kernels.every_host_instruction_set() == ["avx2", "base"]
    monkeypatch.setenv("CACHET_KERNEL_ISA", "base")
    assert _isa_flags("panel_linear") == ("base", [])
    monkeypatch.setenv("CACHET_KERNEL_ISA", "sse9")
    with pytest.raises(ValueError, match="CACHET_KERNEL_ISA"):
        _isa_flags("panel_linear")
