"""Row ops over the last dimension: rms_norm, softmax, log_softmax, row_sum, row_mean.

Reads top-down: public functions -> torch.library ops (fake implementations, autograd) -> ``_C``.
Each row's result depends on that row alone; the reductions run in an order fixed by the row
length (csrc/ops/rms_norm.h, softmax.h, row_sum.h), so rows are bitwise the same whatever the
number of rows, their position, the thread count or the stream. Backward passes run on the same
backend's kernels (rms_norm's dweight sums rows in a fixed order: deterministic).
"""

from __future__ import annotations

import torch

from .. import _C
from .common import (LIBRARY, backend_and_stream, backend_arg, check_tensor, eager_direct,
                     prod, real_number)

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
             round_before_weight: bool = False, backend: str | None = None) -> torch.Tensor:
    """x * rsqrt(mean(x^2, -1) + eps) * weight over the last dimension, statistics in fp32.
    round_before_weight=False is torch.nn.functional.rms_norm (one rounding at the end);
    True is transformers' Llama/Qwen RMSNorm (weight * normalized.to(dtype))."""
    x = _floating("rms_norm", "x", x)
    if x.dim() == 0:
        raise ValueError("rms_norm(): x must have at least 1 dimension (it normalizes the last), got "
                         "a 0-d tensor")
    if weight is not None:
        check_tensor("rms_norm", "weight", weight)
        if weight.dtype != x.dtype or weight.shape != (x.shape[-1],):
            raise ValueError(f"rms_norm(): weight must be [{x.shape[-1]}] of {x.dtype}, got "
                             f"{tuple(weight.shape)} of {weight.dtype}")
        weight = weight.contiguous()  # the kernels read a dense vector (a strided view: a copy)
    eps = real_number("rms_norm", "eps", eps)
    if not isinstance(round_before_weight, bool):
        raise TypeError("rms_norm(): round_before_weight must be a bool")
    backend = backend_arg("rms_norm", backend)
    rows = _rows(x)
    args = (rows, weight, eps, round_before_weight, backend)
    y = (_rms_norm_impl(*args)[0] if eager_direct(rows, weight)
         else torch.ops.rl_kernels.rms_norm(*args)[0])
    return y.view(x.shape)


def softmax(x: torch.Tensor, dim: int = -1, *, dtype: torch.dtype | None = None,
            backend: str | None = None) -> torch.Tensor:
    """torch.softmax over `dim`, each row reduced in an order fixed by its length. dtype: None
    (x's) or torch.float32 for 16-bit x."""
    return _softmax_any("softmax", x, dim, dtype, False, backend)


def log_softmax(x: torch.Tensor, dim: int = -1, *, dtype: torch.dtype | None = None,
                backend: str | None = None) -> torch.Tensor:
    """torch.log_softmax over `dim`, each row reduced in an order fixed by its length."""
    return _softmax_any("log_softmax", x, dim, dtype, True, backend)


def row_sum(x: torch.Tensor, *, keepdim: bool = False, dtype: torch.dtype | None = None,
            backend: str | None = None) -> torch.Tensor:
    """x.sum(-1), each row summed in fp32 in an order fixed by its length."""
    return _row_reduce("row_sum", x, keepdim, dtype, False, backend)


def row_mean(x: torch.Tensor, *, keepdim: bool = False, dtype: torch.dtype | None = None,
             backend: str | None = None) -> torch.Tensor:
    """x.mean(-1), each row summed in fp32 in an order fixed by its length, then divided."""
    return _row_reduce("row_mean", x, keepdim, dtype, True, backend)


def _floating(op, name, x):
    check_tensor(op, name, x)
    if x.dtype not in _FLOATS:
        raise TypeError(f"{op}(): {name} has dtype {x.dtype}; expected a floating dtype")
    return x


def _rows(x):
    """x as [rows, cols] with contiguous rows (a copy only when the last dim is strided)."""
    # (not reshape(-1, cols): -1 is ambiguous when cols == 0, and torch gives such rows an answer)
    rows = x.reshape(prod(x.shape[:-1]), x.shape[-1]) if x.dim() > 0 else x.reshape(1, 1)
    if rows.shape[-1] > 1 and rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]):
        rows = rows.contiguous()
    return rows


def _out_dtype(op, x, dtype):
    if dtype is None or dtype == x.dtype:
        return x.dtype
    if dtype == torch.float32 and x.dtype in (torch.bfloat16, torch.float16):
        return dtype
    raise TypeError(f"{op}(): dtype must be None, {x.dtype} or (for 16-bit x) torch.float32, got {dtype}")


def _softmax_any(op, x, dim, dtype, log, backend):
    x = _floating(op, "x", x)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{op}(): dim must be an int, got {type(dim).__name__}")
    ndim = max(x.dim(), 1)
    if not -ndim <= dim < ndim:
        raise IndexError(f"{op}(): dim {dim} out of range for a {x.dim()}-D tensor")
    out_dtype = _out_dtype(op, x, dtype)
    backend = backend_arg(op, backend)
    moved = x.movedim(dim, -1) if x.dim() > 0 else x
    rows = _rows(moved)
    args = (rows, out_dtype, log, backend)
    y = _softmax_impl(*args) if eager_direct(rows) else torch.ops.rl_kernels.softmax(*args)
    y = y.view(moved.shape)
    return y.movedim(-1, dim).contiguous() if x.dim() > 0 else y  # contiguous, as torch's result


def _row_reduce(op, x, keepdim, dtype, mean, backend):
    x = _floating(op, "x", x)
    if not isinstance(keepdim, bool):
        raise TypeError(f"{op}(): keepdim must be a bool")
    out_dtype = _out_dtype(op, x, dtype)
    backend = backend_arg(op, backend)
    rows = _rows(x)
    args = (rows, out_dtype, mean, backend)
    y = _row_sum_impl(*args) if eager_direct(rows) else torch.ops.rl_kernels.row_sum(*args)
    shape = (*x.shape[:-1], 1) if keepdim and x.dim() > 0 else x.shape[:-1]  # (0-d: 0-d, as torch)
    return y.view(shape)


# --------------------------------------------------------------------------------------------
# torch.library ops and autograd
# --------------------------------------------------------------------------------------------

LIBRARY.define("rms_norm(Tensor x, Tensor? weight, float eps, bool round_before_weight, str backend) "
               "-> (Tensor, Tensor)")
LIBRARY.define("rms_norm_backward(Tensor x, Tensor? weight, Tensor rstd, Tensor dy, float eps, "
               "bool round_before_weight, bool need_dweight, str backend) -> (Tensor, Tensor)")
LIBRARY.define("softmax(Tensor x, ScalarType out_dtype, bool log, str backend) -> Tensor")
LIBRARY.define("softmax_backward(Tensor y, Tensor dy, ScalarType in_dtype, bool log, str backend) "
               "-> Tensor")
LIBRARY.define("row_sum(Tensor x, ScalarType out_dtype, bool mean, str backend) -> Tensor")


def _rms_norm_impl(x, weight, eps, round_before_weight, backend):
    code, stream = backend_and_stream("rms_norm", x.device, backend)
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    _C.rms_norm_fwd(x, weight, y, rstd, eps, round_before_weight, code, stream)
    return y, rstd


def _rms_norm_backward_impl(x, weight, rstd, dy, eps, round_before_weight, need_dweight, backend):
    code, stream = backend_and_stream("rms_norm", x.device, backend)
    dx = torch.empty_like(x)
    dweight = torch.empty(x.shape[1] if need_dweight else 0, dtype=x.dtype, device=x.device)
    _C.rms_norm_bwd(x, weight, rstd, dy, dx, dweight if need_dweight else None, eps,
                    round_before_weight, code, stream)
    return dx, dweight


def _softmax_impl(x, out_dtype, log, backend):
    code, stream = backend_and_stream("softmax", x.device, backend)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    _C.softmax_fwd(x, y, log, code, stream)
    return y


def _softmax_backward_impl(y, dy, in_dtype, log, backend):
    code, stream = backend_and_stream("softmax", y.device, backend)
    dx = torch.empty(y.shape, dtype=in_dtype, device=y.device)
    _C.softmax_bwd(y, dy, dx, log, code, stream)
    return dx


def _row_sum_impl(x, out_dtype, mean, backend):
    code, stream = backend_and_stream("row_sum", x.device, backend)
    y = torch.empty(x.shape[0], dtype=out_dtype, device=x.device)
    _C.row_sum(x, y, mean, code, stream)
    return y


for _key in ("CPU", "CUDA"):
    LIBRARY.impl("rms_norm", _rms_norm_impl, _key)
    LIBRARY.impl("rms_norm_backward", _rms_norm_backward_impl, _key)
    LIBRARY.impl("softmax", _softmax_impl, _key)
    LIBRARY.impl("softmax_backward", _softmax_backward_impl, _key)
    LIBRARY.impl("row_sum", _row_sum_impl, _key)


@torch.library.register_fake("rl_kernels::rms_norm")
def _rms_norm_fake(x, weight, eps, round_before_weight, backend):
    return torch.empty_like(x), x.new_empty(x.shape[0], dtype=torch.float32)


@torch.library.register_fake("rl_kernels::rms_norm_backward")
def _rms_norm_backward_fake(x, weight, rstd, dy, eps, round_before_weight, need_dweight, backend):
    return torch.empty_like(x), x.new_empty(x.shape[1] if need_dweight else 0)


@torch.library.register_fake("rl_kernels::softmax")
def _softmax_fake(x, out_dtype, log, backend):
    return x.new_empty(x.shape, dtype=out_dtype)


@torch.library.register_fake("rl_kernels::softmax_backward")
def _softmax_backward_fake(y, dy, in_dtype, log, backend):
    return y.new_empty(y.shape, dtype=in_dtype)


@torch.library.register_fake("rl_kernels::row_sum")
def _row_sum_fake(x, out_dtype, mean, backend):
    return x.new_empty(x.shape[0], dtype=out_dtype)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps, round_before_weight, backend = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.options = (eps, round_before_weight)
    ctx.backend = backend
    ctx.mark_non_differentiable(output[1])


def _rms_norm_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    need_dweight = weight is not None and ctx.needs_input_grad[1]
    dx, dweight = torch.ops.rl_kernels.rms_norm_backward(
        x, weight, rstd, dy.contiguous(), *ctx.options, need_dweight, ctx.backend)
    return dx, (dweight if need_dweight else None), None, None, None


def _softmax_setup(ctx, inputs, output):
    x, out_dtype, log, backend = inputs
    ctx.save_for_backward(output)
    ctx.in_dtype, ctx.log, ctx.backend = x.dtype, log, backend


def _softmax_backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return (torch.ops.rl_kernels.softmax_backward(y, dy.contiguous(), ctx.in_dtype, ctx.log, ctx.backend),
            None, None, None)


def _row_sum_setup(ctx, inputs, output):
    x, out_dtype, mean, backend = inputs
    ctx.shape, ctx.dtype, ctx.mean = x.shape, x.dtype, mean


def _row_sum_backward(ctx, dy):
    # d sum / dx = 1 per element (d mean / dx = 1 / cols): a broadcast, no reduction, deterministic
    grad = dy.to(ctx.dtype)[:, None].expand(ctx.shape)
    return (grad / ctx.shape[1] if ctx.mean else grad), None, None, None


torch.library.register_autograd("rl_kernels::rms_norm", _rms_norm_backward, setup_context=_rms_norm_setup)
torch.library.register_autograd("rl_kernels::softmax", _softmax_backward, setup_context=_softmax_setup)
torch.library.register_autograd("rl_kernels::row_sum", _row_sum_backward, setup_context=_row_sum_setup)
