"""Pieces every op module shares: the torch.library namespace, backend + stream lookup, and the
eager fast-path test."""

from __future__ import annotations

import torch

from .. import _C
from ..kernel_registry import BACKEND_CODES, resolve_backend

LIBRARY = torch.library.Library("rl_kernels", "DEF")


def backend_and_stream(op: str, device: torch.device, backend: str | None) -> tuple[str, int, int]:
    """(backend name, backend code for _C, raw CUDA stream handle or 0 on CPU)."""
    name = resolve_backend(op, device, backend)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        # torch.cuda.current_stream().cuda_stream costs ~5 us; the raw getter well under 1 us.
        return name, BACKEND_CODES[name], torch._C._cuda_getCurrentRawStream(index)
    return name, BACKEND_CODES[name], 0


def eager_direct(*tensors) -> bool:
    """True when a call can skip the torch.library dispatcher: eager mode, plain tensors, and no
    autograd graph to record. Otherwise the call goes through the registered op (compile, grad)."""
    if torch.compiler.is_compiling():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) is not torch.Tensor or (grad and t.requires_grad)):
            return False
    return True


def is_gemm_operand(t: torch.Tensor) -> bool:
    """The last two dims are row-major or a transposed view (what _C.gemm takes without a copy)."""
    if t.is_contiguous():
        return True
    rows, cols = t.shape[-2], t.shape[-1]
    row_stride, col_stride = t.stride(-2), t.stride(-1)
    return ((cols <= 1 or col_stride == 1) and (rows <= 1 or row_stride >= cols)) or (
        (rows <= 1 or row_stride == 1) and (cols <= 1 or col_stride >= rows))


def gemm_operand(t: torch.Tensor, backend: str) -> torch.Tensor:
    """t as _C.gemm takes it. The copies change no values, so results stay bitwise the same:
    any other stride pattern becomes contiguous, and on sm90 a base that is not 16-byte aligned
    (TMA needs it) is copied to fresh memory, so the kernel chosen never depends on where a slice
    starts."""
    if t.dim() == 3 and t.stride(0) < 0:
        t = t.contiguous()
    if not is_gemm_operand(t):
        t = t.contiguous()
    if backend == "sm90" and t.data_ptr() % 16:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


__all__ = ["LIBRARY", "backend_and_stream", "eager_direct", "gemm_operand", "_C"]
