"""Expert parallelism: which routed experts this rank holds, and how their outputs meet.

An engine replica's ranks all see the same tokens (attention is replicated or
tensor-parallel), so expert parallelism here needs no token exchange: rank r
holds a contiguous run of about ``E / ep`` experts, runs only those on the tokens
routed to them, and one sum over the expert-parallel group adds the partial
outputs. That is vLLM's expert-parallel layout without data-parallel attention.

DeepSpeed's ``deepspeed.moe`` MOELayer is the other shape: GShard dispatch with
a fixed per-expert capacity (``[tokens, experts, capacity]`` dispatch tensors)
and an all-to-all, built for training where each rank owns different tokens.
With replicated tokens it would compute every expert twice over, drop tokens
past capacity, and its dense dispatch grows with tokens squared; so the only
collective here is the replica's tensor-parallel all-reduce (DeepSpeed's inference
all-reduce, reached through ``TensorParallelRank.all_reduce_``).

Inside a tensor-parallel replica the same ranks serve both splits, and
``CACHET_EP`` chooses how routed experts are spread over them (the rule lives in
``check_expert_parallel_size``)::

    EP = TP   whole experts per rank (E / TP each); a token's expert runs on one rank
    EP = 1    every expert on every rank, cut by channels (gate/up column-parallel,
              down row-parallel), as shared experts and dense MLPs are

Either way each rank's routed and shared outputs are partial sums that meet in
the layer's one all-reduce over the replica.

This module talks to neither DeepSpeed nor torch.distributed: the process group and
DeepSpeed are started once, by ``distributed.init_distributed``, and a replica's split
reaches the model through ``ExpertParallel.within`` its tensor-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachet.engine.tensor_parallel import TensorParallelRank


@dataclass(frozen=True)
class ExpertParallel:
    """This rank's place in the expert-parallel group; the default is a single rank."""

    rank: int = 0
    size: int = 1

    @classmethod
    def within(cls, tp: TensorParallelRank) -> ExpertParallel:
        """The expert split of a tensor-parallel replica: its ranks when it chose whole experts
        (``expert_parallel_size == size``), a single holder of every expert otherwise."""
        if tp.expert_parallel_size == 1:
            return cls()
        return cls(rank=tp.rank, size=tp.size)

    def local_experts(self, num_experts: int) -> range:
        """Global ids of the experts this rank holds: a contiguous run (so loading is a name filter),
        as even as tensor-parallel splits are (8 experts over 3 ranks: 3 + 3 + 2)."""
        return TensorParallelRank(self.rank, self.size).split(num_experts, "routed experts")


def check_expert_parallel_size(expert_parallel_size: int, tensor_parallel_size: int) -> None:
    """Refuse, with the settings' names, an expert-parallel size a replica cannot have.

    A replica's ranks are its tensor-parallel group and expert parallelism reuses them,
    so EP is 1 (every expert cut by channels) or TP (whole experts per rank).
    """
    ep, tp = expert_parallel_size, tensor_parallel_size
    if ep not in (1, tp):
        raise ValueError(
            f"CACHET_EP={ep} (--ep) must be 1 or equal to CACHET_TP={tp} (--tp): a replica's "
            f"ranks are its tensor-parallel group; EP=TP puts whole routed experts on each rank, "
            f"EP=1 cuts every expert by channels across them"
        )


def check_model_has_experts(expert_parallel_size: int, model: str, is_moe: bool) -> None:
    """EP > 1 on a dense model is refused rather than ignored: it asks for a layout the model
    cannot have, and quietly serving EP=1 would hide a mistaken deployment."""
    if expert_parallel_size > 1 and not is_moe:
        raise ValueError(
            f"CACHET_EP={expert_parallel_size} (--ep): model {model} has no routed experts "
            f"(it is not a mixture-of-experts model); leave CACHET_EP at 1"
        )
