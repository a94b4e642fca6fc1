"""Pieces every op module shares: the torch.library namespace, backend + stream lookup, and the
eager fast-path test."""

from __future__ import annotations

import torch

from .. import _C
from ..kernel_registry import BACKEND_CODES, resolve_backend

LIBRARY = torch.library.Library("rl_kernels", "DEF")


_resolved: dict = {}  # (op, device, backend) -> (name, code): routing never changes in a process
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def backend_and_stream(op: str, device: torch.device, backend: str | None) -> tuple[str, int, int]:
    """(backend name, backend code for _C, raw CUDA stream handle or 0 on CPU)."""
    key = (op, device, backend)
    found = _resolved.get(key)
    if found is None:
        name = resolve_backend(op, device, backend)
        found = _resolved[key] = (name, BACKEND_CODES[name])
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        # torch.cuda.current_stream().cuda_stream costs ~5 us; the raw getter well under 1 us.
        return found[0], found[1], _raw_stream(index)
    return found[0], found[1], 0


def eager_direct(a, b, c=None, d=None) -> bool:
    """True when a call can skip the torch.library dispatcher: eager mode, plain tensors, and no
    autograd graph to record. Otherwise the call goes through the registered op (compile, grad).
    Written out for two to four tensors: it runs on every call."""
    if _is_compiling() or type(a) is not torch.Tensor or type(b) is not torch.Tensor:
        return False
    if (c is not None and type(c) is not torch.Tensor) or (d is not None and type(d) is not torch.Tensor):
        return False
    if not _grad_enabled():
        return True
    return not (a.requires_grad or b.requires_grad or (c is not None and c.requires_grad)
                or (d is not None and d.requires_grad))


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
