"""Linear weights reordered once, after loading, into oneDNN's blocked layout (CPU only).

A CPU forward pass of a small batch is bound by streaming the weights through the cores,
and ``F.linear`` on a plain row-major weight streams them slowly: on the dev box a
one-token pass of SmolLM2-135M (bf16) spent 38 of its 48 ms in matrix products, some
7 GB/s against the 30 GB/s one core reads a plain tensor at. The same products on
weights reordered for oneDNN take 1.6x less time at one row, 1.5x at 23 and 1.35x at 40
(1.07x at 300), with bit-identical results in bf16.

Inductor's CPU weight freezing does the same reorder; doing it here keeps eager mode
(no compile at start-up).

A packed weight is an opaque tensor of the same shape and size: it cannot be read as a
plain tensor, so a model that reads a linear's weight itself (absorbed MLA attention)
marks that linear ``pack_weight = False``. A tied head gets a packed copy of its own;
the embedding keeps the plain table its lookups need.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


class PackableLinear(nn.Linear):
    """An ``nn.Linear`` whose weight ``pack_linear_weights`` may reorder for oneDNN."""

    # False where a model reads this linear's weight as a plain tensor.
    pack_weight: bool = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)``, on the packed weight when there is one."""
        if self.weight.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")
        return F.linear(x, self.weight, bias)

    def pack_(self) -> bool:
        """Reorder the weight for oneDNN, once (``pack_weight`` allowing); whether it was now."""
        if not self.pack_weight or self.weight.is_mkldnn:
            return False
        # A new parameter, not a write into the old one: a tied head's old one is the
        # embedding's table, which lookups still read plain.
        reordered = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach().contiguous())
        self.weight = nn.Parameter(reordered, requires_grad=False)
        return True


def packs_linear_weights(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linear weights of ``dtype`` on ``device`` can be packed here (a CPU with
    oneDNN; bf16 only where oneDNN has bf16 kernels for this CPU)."""
    if device.type != "cpu" or dtype not in _PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linear_weights(model: nn.Module) -> int:
    """Reorder every packable linear's weight in place; returns how many were packed.

    Call after the weights are loaded (and tied): loading writes plain tensors."""
    return sum(module.pack_() for module in model.modules() if isinstance(module, PackableLinear))
