"""A decoder layer's per-token elementwise ops, one pass each on a CPU (``csrc/fused_token_ops.cpp``):
RMSNorm, SwiGLU's ``silu(gate) * up`` and rotate-half rotary embeddings.

The torch ops below are the reference and define each result; the kernel rounds where they
round, so it gives their bits but for RMSNorm's sum of squares (its order is fixed per row) and
silu's exponential (a polynomial of expf's accuracy). Each function takes the kernel where it
applies (CPU tensors of fp32 or bf16, operands of one dtype, layouts it reads, nothing that
needs a gradient) and the reference everywhere else: on a GPU, or where the kernel could not
be built (``cpu_kernels`` says so once).

Why: as torch ops these are many passes over their rows, each with a tensor of its own, and
broadcasts that run as slow strided loops. The kernel's numbers are in
``csrc/fused_token_ops.cpp`` and docs/benchmarks.md.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from cachet.engine.cpu_kernels import load_cpu_kernel

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` over the last dimension, Llama's way: normalised in fp32,
    rounded back to x's dtype, then weighed."""
    kernel = _kernel_for(x, weight)
    if kernel is not None and x.is_contiguous() and weight.is_contiguous():
        return kernel.rms_norm(x, weight, eps)
    return reference_rms_norm(x, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` on its last dimension (a merged
    gate/up projection's output)."""
    kernel = _kernel_for(gate_up)
    if kernel is not None and gate_up.dim() == 2 and gate_up.stride(1) == 1:
        return kernel.silu_and_mul(gate_up)
    return reference_silu_and_mul(gate_up)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the rotate-half layout. x: [T, H, D] (D contiguous; T and H may be
    strided, as q and k are in a merged projection's output); cos, sin: [T, D]."""
    kernel = _kernel_for(x, cos, sin)
    if (
        kernel is not None
        and x.dim() == 3
        and x.stride(2) == 1
        and cos.is_contiguous()
        and sin.is_contiguous()
    ):
        return kernel.rotate_half(x, cos, sin)
    return reference_rotate_half(x, cos, sin)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32: bf16 sums of squares lose too much over thousands of channels.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def reference_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def reference_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


def _kernel_for(*tensors: torch.Tensor) -> ModuleType | None:
    """The kernel, where it can compute these operands: else None (the reference runs).

    Called three times a layer, so plain loops over cheap attributes: generators and
    ``Tensor.device`` (a new object per read) made these checks cost more than the kernel's
    call (4.3 us against 2.5 us for a decode's RMSNorm)."""
    first = tensors[0]
    dtype = first.dtype
    if not first.is_cpu or dtype not in _KERNEL_DTYPES:
        return None
    for tensor in tensors:
        if tensor.dtype != dtype or not tensor.is_cpu:
            return None
    if torch.is_grad_enabled():
        for tensor in tensors:
            if tensor.requires_grad:
                return None
    return load_cpu_kernel("fused_token_ops")
