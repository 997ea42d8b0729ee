"""Each tensor-parallel rank reads only its own slices of a safetensors checkpoint.

Loading needs no process group (only the forward pass sums over ranks), so the
ranks' models are built here side by side in one process and checked against
the full tensors of the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cachet.engine.models import ModelConfig
from cachet.engine.tensor_parallel import (
    TensorParallelRank,
    TensorSlice,
    checkpoint_slices,
    stacked_checkpoint_parts,
)
from cachet.engine.weights import CheckpointError, load_model

CPU = torch.device("cpu")


def _load(model_dir: Path, rank: int, size: int, ep: int = 1) -> torch.nn.Module:
    config = ModelConfig.from_model_dir(model_dir)
    tp = TensorParallelRank(rank, size, expert_parallel_size=ep)
    return load_model(model_dir, config, dtype=torch.float32, device=CPU, tp=tp)


def _checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


@pytest.mark.parametrize(("family", "ep"), [("llama", 1), ("kimi-k2", 2), ("kimi-k2", 1)])
def test_each_rank_holds_its_slices_and_together_they_are_the_checkpoint(
    family: str, ep: int, tiny_checkpoints: dict[str, Path]
) -> None:
    model_dir = tiny_checkpoints[family]
    full = _checkpoint(model_dir)
    ranks = [_load(model_dir, rank, 2, ep) for rank in range(2)]
    held = [_held_parts(model) for model in ranks]
    split_names = {name for name, (_, part) in held[0].items() if part.is_part}
    # The split reaches every kind of layer: attention, MLP (dense or shared experts), embedding.
    for part in ("q_", "o_proj", "down_proj", "embed_tokens", "lm_head"):
        assert any(part in name for name in split_names), part

    for name in split_names:
        mine = [parts[name][0] for parts in held]
        dim = held[0][name][1].dim
        source = full.get(name, full.get("model.embed_tokens.weight") if name == "lm_head.weight" else None)
        assert source is not None, name
        for parts in held:
            tensor, own = parts[name]
            assert torch.equal(tensor.detach(), source.narrow(own.dim, own.start, own.stop - own.start)), name
        # Disjoint, in rank order, and nothing left over.
        assert torch.equal(torch.cat([t.detach() for t in mine], dim=dim), source), name

    # What is not split (norms, latent projections, the router; whole experts under EP) is
    # whole on every rank that holds it.
    for name, (tensor, part) in held[1].items():
        if not part.is_part and name in full:
            assert torch.equal(tensor.detach(), full[name]), name
    # Every checkpoint tensor lands somewhere (the loader's own check, seen from outside).
    assert set(full) <= {name for parts in held for name in parts}


def _held_parts(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, TensorSlice]]:
    """Checkpoint tensor name -> what this rank holds of it and which part that is: whole
    parameters, sliced ones, and the rows of merged q/k/v and gate/up."""
    params = dict(model.named_parameters(remove_duplicate=False))
    slices = checkpoint_slices(model)
    held = {
        name: (tensor, slices.get(name) or TensorSlice(tuple(tensor.shape), 0, 0, tensor.shape[0]))
        for name, tensor in params.items()
    }
    for name, (param, offset, part) in stacked_checkpoint_parts(model).items():
        held.pop(param, None)
        held[name] = (params[param].narrow(0, offset, part.stop - part.start), part)
    return held


def test_ep_equal_to_tp_splits_experts_whole_and_shared_experts_by_channels(
    tiny_checkpoints: dict[str, Path],
) -> None:
    model_dir = tiny_checkpoints["kimi-k2"]
    full = _checkpoint(model_dir)
    rank1 = _load(model_dir, 1, 2, ep=2)
    assert rank1.expert_parallel.size == 2
    moe = rank1.model.layers[1].mlp
    assert sorted(int(j) for j in moe.experts) == [4, 5, 6, 7]
    torch.testing.assert_close(
        moe.experts["5"].down_proj.weight,
        full["model.layers.1.mlp.experts.5.down_proj.weight"],
        rtol=0,
        atol=0,
    )
    shared = full["model.layers.1.mlp.shared_experts.gate_proj.weight"]
    assert moe.shared_experts.gate_proj.weight.shape[0] == shared.shape[0] // 2


def test_ep_1_cuts_every_expert_by_channels(tiny_checkpoints: dict[str, Path]) -> None:
    model_dir = tiny_checkpoints["kimi-k2"]
    full = _checkpoint(model_dir)
    rank1 = _load(model_dir, 1, 2, ep=1)
    assert rank1.expert_parallel.size == 1
    moe = rank1.model.layers[1].mlp
    assert sorted(int(j) for j in moe.experts) == list(range(8))
    inner = full["model.layers.1.mlp.experts.5.gate_proj.weight"].shape[0]
    # Rank 1 holds the upper half of expert 5's channels: gate/up rows, down columns.
    torch.testing.assert_close(
        moe.experts["5"].gate_proj.weight,
        full["model.layers.1.mlp.experts.5.gate_proj.weight"][inner // 2 :],
        rtol=0,
        atol=0,
    )
    torch.testing.assert_close(
        moe.experts["5"].down_proj.weight,
        full["model.layers.1.mlp.experts.5.down_proj.weight"][:, inner // 2 :],
        rtol=0,
        atol=0,
    )


def test_an_expert_parallel_size_other_than_1_or_tp_is_refused(tiny_checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="expert_parallel_size=3 must be 1 or the tensor-parallel size"):
        TensorParallelRank(0, 2, expert_parallel_size=3)
    with pytest.raises(ValueError, match="must be 1 or the tensor-parallel size"):
        _load(tiny_checkpoints["kimi-k2"], 0, 4, ep=2)


def test_uneven_heads_and_too_many_ranks(tiny_checkpoints: dict[str, Path]) -> None:
    model_dir = tiny_checkpoints["kimi-k2"]
    # 4 MLA heads over 3 ranks: 2 + 1 + 1.
    heads = [_load(model_dir, rank, 3).model.layers[0].self_attn.o_proj.in_features for rank in range(3)]
    v_head_dim = ModelConfig.from_model_dir(model_dir).mla.v_head_dim  # type: ignore[union-attr]
    assert [h // v_head_dim for h in heads] == [2, 1, 1]
    with pytest.raises(ValueError, match="4 attention heads cannot be split over 8"):
        _load(model_dir, 0, 8)


def test_a_checkpoint_tensor_of_the_wrong_full_shape_is_named(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    model_dir = tiny_checkpoints["llama"]
    tensors = _checkpoint(model_dir)
    # Still long enough to cut a rank's rows from: only the full-shape check can catch it.
    name = "model.layers.0.mlp.gate_proj.weight"
    tensors[name] = torch.cat([tensors[name], tensors[name]])
    copy = tmp_path / "bad"
    copy.mkdir()
    for file in ("config.json", "generation_config.json"):
        (copy / file).write_bytes((model_dir / file).read_bytes())
    save_file(tensors, str(copy / "model.safetensors"))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        _load(copy, 0, 2)
