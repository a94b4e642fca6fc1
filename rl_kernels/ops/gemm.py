"""GEMM ops: rl_kernels.matmul / addmm / gemm, and the GEMM internals det_gemm shares.

Reads top-down: public functions (torch semantics, argument checks, shape plumbing) -> run_gemm
(eager fast path or the registered op) -> the torch.library ops ``rl_kernels::gemm`` /
``rl_kernels::gemm_out`` (fake implementations, autograd) -> launch_gemm -> ``_C.gemm``.
In eager mode, when no graph is recorded, run_gemm calls the op's implementation directly (same
code, no dispatcher hop) to keep host overhead low (per-call numbers: docs/perf-notes.md).

Every backend computes out = alpha * a @ b + beta * c with fp32 accumulation and a K order fixed by
K alone, so each output row is bitwise independent of the rows around it. Gradients run on the same
backend's kernels: dA = alpha * g @ B^T, dB = alpha * A^T @ g, dc = beta * g summed over broadcast
rows (a ones-row GEMM, so also deterministic). BLAS semantics: alpha == 0 does not read a @ b,
beta == 0 does not read c (NaN or Inf there do not propagate), and the gradients follow: with
alpha == 0 they are exactly 0 (torch's are NaN where a or b holds an Inf).

alpha and beta, like torch's, are applied in fp32 for fp32/bf16/fp16 operands (a value that
overflows fp32 raises, one that underflows to 0 is 0) and in fp64 for fp64 operands.
"""

from __future__ import annotations

import math

import torch

from .. import _C
from .common import (DTYPE_CODES, FLOAT_DTYPES, LIBRARY, backend_and_stream, check_backend,
                     check_float_tensors, check_tensor, eager_direct, prod, real_number)

_FLOAT_DTYPE_SET = frozenset(FLOAT_DTYPES)


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------

def matmul(input: torch.Tensor, other: torch.Tensor, *, out: torch.Tensor | None = None,
           backend: str | None = None) -> torch.Tensor:
    """torch.matmul semantics (1-D, 2-D, batched and broadcast inputs), batch-invariant rows."""
    if backend is not None:
        check_backend("matmul", backend)
    if (out is None and type(input) is torch.Tensor and type(other) is torch.Tensor
            and input.dim() == 2 and other.dim() == 2 and input.dtype is other.dtype
            and input.dtype in _FLOAT_DTYPE_SET and input.shape[1] == other.shape[0]
            and input.layout is torch.strided and other.layout is torch.strided
            and eager_direct(input, other)):
        # the common case, kept short: host time per call is what small decode GEMMs pay
        return launch_gemm(input, other, None, None, 1.0, 0.0, backend, input.dtype)
    return matmul_any(input, other, out, backend)


def addmm(input: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *, beta=1, alpha=1,
          out: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """torch.addmm semantics: beta * input + alpha * mat1 @ mat2; input broadcasts to [M, N]
    (a 1-D bias included)."""
    check_float_tensors("addmm", input=input, mat1=mat1, mat2=mat2)
    check_backend("addmm", backend)
    alpha = gemm_scalar("addmm", "alpha", alpha, mat1.dtype)
    beta = gemm_scalar("addmm", "beta", beta, mat1.dtype)
    if mat1.dim() != 2 or mat2.dim() != 2:
        raise ValueError(f"addmm(): mat1 and mat2 must be 2-D, got {mat1.dim()}-D and "
                         f"{mat2.dim()}-D")
    if mat1.shape[1] != mat2.shape[0]:
        raise ValueError(f"addmm(): mat1 {tuple(mat1.shape)} and mat2 {tuple(mat2.shape)} cannot "
                         f"be multiplied")
    m, n = mat1.shape[0], mat2.shape[1]
    try:
        torch.broadcast_shapes(input.shape, (m, n))
    except RuntimeError:
        raise ValueError(f"addmm(): input of shape {tuple(input.shape)} does not broadcast to "
                         f"({m}, {n})") from None
    if input.dim() in (1, 2) and input.shape[-1] == n and input.shape[0] in (1, m, n):
        c = input  # an [N] bias, [1, N] or [M, N]: read in place
    else:
        c = input.expand(m, n)  # a column or a scalar: materialized below
    if c.numel() == 0:
        c = input.new_empty((m, n))  # no rows (M = 0): an expanded view would keep stride 0
    elif n > 1 and c.stride(-1) != 1:
        c = c.contiguous()
    if out is not None:
        check_out("addmm", out, input.dtype, (m, n), input, mat1, mat2)
    return run_gemm(mat1, mat2, c, alpha, beta, input.dtype, backend, out)


def gemm(alpha, a: torch.Tensor, b: torch.Tensor, beta, c: torch.Tensor | None, *,
         out: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """BLAS GEMM: alpha * a @ b + beta * c for 2-D a [M, K], b [K, N], c [M, N] (or None).
    Returns a new tensor; out= (which may be c itself) is written in place."""
    if c is None:
        check_float_tensors("gemm", a=a, b=b)
    else:
        check_float_tensors("gemm", a=a, b=b, c=c)
    check_backend("gemm", backend)
    alpha = gemm_scalar("gemm", "alpha", alpha, a.dtype)
    beta = gemm_scalar("gemm", "beta", beta, a.dtype)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"gemm(): a {tuple(a.shape)} and b {tuple(b.shape)} must be 2-D with "
                         f"matching inner dims")
    shape = (a.shape[0], b.shape[1])
    if c is not None and tuple(c.shape) != shape:
        raise ValueError(f"gemm(): c has shape {tuple(c.shape)}, expected {shape}")
    if out is not None:
        check_out("gemm", out, a.dtype, shape, a, b, c)
        if c is not None and out.data_ptr() == c.data_ptr() and out.stride() != c.stride():
            raise ValueError("gemm(): out aliases c with different strides")
    if c is not None and shape[1] > 1 and c.stride(-1) != 1:
        c = c.contiguous()  # the kernels read C by rows (a column-major c is copied, like addmm's)
    return run_gemm(a, b, c, alpha, beta, a.dtype, backend, out)


def gemm_scalar(op, name, value, dtype):
    """alpha or beta as the kernels apply it: a Python float, rounded to fp32 unless the operands
    are fp64 (torch rounds it so too). A value that overflows fp32 raises, as in torch; one that
    underflows becomes 0 and so takes the alpha == 0 / beta == 0 semantics."""
    kind = type(value)
    if kind is int and -(2 ** 53) <= value <= 2 ** 53:  # the defaults (1, 0), kept cheap
        value = float(value)
    elif kind is not float:
        value = real_number(op, name, value)
    if dtype is torch.float64 or value == 1 or not math.isfinite(value):
        return value
    rounded = _to_f32(value)
    if math.isinf(rounded):
        raise ValueError(f"{op}(): {name}={value!r} cannot be converted to float32 without "
                         f"overflow ({dtype} operands are scaled in float32)")
    return rounded


def _to_f32(value):
    """value rounded to the nearest fp32, ties to even (what C's (float) cast gives), Inf past the
    fp32 range. In plain math so that torch.compile traces it (it cannot trace struct)."""
    if value == 0 or not math.isfinite(value):
        return value
    mantissa, exponent = math.frexp(value)  # value = mantissa * 2**exponent, 0.5 <= |m| < 1
    bits = min(24, exponent + 149)  # fp32: 24 significant bits; subnormals: a quantum of 2**-149
    rounded = math.copysign(math.ldexp(round(math.ldexp(mantissa, bits)), exponent - bits), value)
    return rounded if abs(rounded) < 2.0 ** 128 else math.copysign(math.inf, value)


def matmul_any(a, b, out, backend, op="matmul"):
    """torch.matmul over any ranks: the batch dims broadcast, then one 2-D or batched GEMM."""
    check_float_tensors(op, input=a, other=b)
    if a.dim() == 0 or b.dim() == 0:
        raise ValueError(f"{op}(): both arguments need at least 1 dimension, got "
                         f"{a.dim()}-D and {b.dim()}-D")
    if a.shape[-1] != b.shape[-2 if b.dim() > 1 else 0]:
        raise ValueError(f"{op}(): shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be "
                         f"multiplied (inner dims differ)")
    a2 = a.unsqueeze(0) if a.dim() == 1 else a
    b2 = b.unsqueeze(-1) if b.dim() == 1 else b
    batch = torch.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
    m, k, n = a2.shape[-2], a2.shape[-1], b2.shape[-1]
    result_shape = (*batch, m, n)
    if a.dim() == 1:
        result_shape = (*batch, n)
    if b.dim() == 1:
        result_shape = result_shape[:-1]
    if out is not None:
        check_out(op, out, a.dtype, result_shape, a, b)
    if b2.dim() == 2:  # every row of a, over all batch dims, against one b: one 2-D GEMM
        a_flat, b_flat = a2.reshape(prod(a2.shape[:-1]), k), b2
        flat_shape = (a_flat.shape[0], n)
    else:
        count = prod(batch)
        a_flat = a2.expand(*batch, m, k).reshape(count, m, k)
        b_flat = b2.expand(*batch, k, n).reshape(count, k, n)
        flat_shape = (count, m, n)
    if out is not None and out.is_contiguous():
        run_gemm(a_flat, b_flat, None, 1.0, 0.0, a.dtype, backend, out.view(flat_shape))
        return out
    result = run_gemm(a_flat, b_flat, None, 1.0, 0.0, a.dtype, backend).reshape(result_shape)
    return result if out is None else out.copy_(result)


def check_out(op, out, dtype, shape, *inputs):
    """torch's rules for an out= tensor: its dtype, no autograd, the result's shape (an empty out
    is resized)."""
    check_tensor(op, "out", out)
    if out.dtype != dtype:
        raise TypeError(f"{op}(): expected out to have dtype {dtype}, got {out.dtype}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (out, *inputs)):
        raise RuntimeError(f"{op}(): functions with out=... arguments don't support automatic "
                           f"differentiation, but one of the arguments requires grad.")
    if tuple(out.shape) != tuple(shape):
        if out.numel() != 0:
            raise ValueError(f"{op}(): out has shape {tuple(out.shape)}, expected {tuple(shape)}")
        out.resize_(shape)


def _rows_contiguous(t):
    return (t.shape[-1] <= 1 or t.stride(-1) == 1) and (
        t.shape[-2] <= 1 or t.stride(-2) >= t.shape[-1])


def run_gemm(a, b, c, alpha, beta, out_dtype, backend, out=None):
    """One GEMM, a and b 2-D or 3-D, through the fast eager path or the registered op (autograd,
    torch.compile); out, if given, has the result's shape. backend None: by device."""
    if backend is None:
        backend = "auto"  # the op schema takes a string (callers have checked a given one)
    if out is None:
        if eager_direct(a, b, c):
            return _gemm_impl(a, b, c, alpha, beta, out_dtype, backend)
        return torch.ops.rl_kernels.gemm(a, b, c, alpha, beta, out_dtype, backend)
    if not _rows_contiguous(out):  # the kernels write contiguous rows: compute, then copy in
        return out.copy_(run_gemm(a, b, c, alpha, beta, out_dtype, backend))
    if eager_direct(a, b, c, out):
        _gemm_out_impl(a, b, c, alpha, beta, backend, out)
    else:
        torch.ops.rl_kernels.gemm_out(a, b, c, alpha, beta, backend, out)
    return out


# --------------------------------------------------------------------------------------------
# torch.library ops: rl_kernels::gemm (returns the product) and rl_kernels::gemm_out
# --------------------------------------------------------------------------------------------

LIBRARY.define(
    "gemm(Tensor a, Tensor b, Tensor? c, float alpha, float beta, ScalarType out_dtype, "
    "str backend) -> Tensor")
LIBRARY.define(
    "gemm_out(Tensor a, Tensor b, Tensor? c, float alpha, float beta, str backend, "
    "Tensor(a!) out) -> ()")


def _gemm_impl(a, b, c, alpha, beta, out_dtype, backend):
    return launch_gemm(a, b, c, None, alpha, beta, backend, out_dtype)


def _gemm_out_impl(a, b, c, alpha, beta, backend, out):
    launch_gemm(a, b, c, out, alpha, beta, backend)


for _key in ("CPU", "CUDA"):
    LIBRARY.impl("gemm", _gemm_impl, _key)
    LIBRARY.impl("gemm_out", _gemm_out_impl, _key)


@torch.library.register_fake("rl_kernels::gemm")
def _gemm_fake(a, b, c, alpha, beta, out_dtype, backend):
    return a.new_empty((*a.shape[:-1], b.shape[-1]), dtype=out_dtype)


@torch.library.register_fake("rl_kernels::gemm_out")
def _gemm_out_fake(a, b, c, alpha, beta, backend, out):
    return None


def _setup_context(ctx, inputs, output):
    a, b, c, alpha, beta, out_dtype, backend = inputs
    ctx.save_for_backward(a, b)
    ctx.c_shape = None if c is None else c.shape
    ctx.c_dtype = None if c is None else c.dtype
    ctx.alpha, ctx.beta, ctx.backend = alpha, beta, backend


def _sum_rows_like(g, shape, scale, backend):
    """scale * g reduced to ``shape`` (c's broadcast shape), deterministically."""
    if tuple(shape) == tuple(g.shape):
        return g * scale
    n = g.shape[-1]
    if len(shape) >= 1 and shape[-1] == n and all(s == 1 for s in shape[:-1]):
        rows = g.reshape(-1, n)
        ones = torch.ones(1, rows.shape[0], dtype=g.dtype, device=g.device)
        return torch.ops.rl_kernels.gemm(ones, rows, None, scale, 0.0, g.dtype, backend).reshape(shape)
    return (g * scale).sum_to_size(shape)


def _gemm_backward(ctx, grad):
    a, b = ctx.saved_tensors
    grad_a = grad_b = grad_c = None
    if ctx.needs_input_grad[0]:
        grad_a = torch.ops.rl_kernels.gemm(grad.to(a.dtype), b.mT, None, ctx.alpha, 0.0, a.dtype,
                                           ctx.backend)
    if ctx.needs_input_grad[1]:
        grad_b = torch.ops.rl_kernels.gemm(a.mT, grad.to(b.dtype), None, ctx.alpha, 0.0, b.dtype,
                                           ctx.backend)
    if ctx.needs_input_grad[2]:
        grad_c = _sum_rows_like(grad.to(ctx.c_dtype), ctx.c_shape, ctx.beta, ctx.backend)
    return grad_a, grad_b, grad_c, None, None, None, None


torch.library.register_autograd("rl_kernels::gemm", _gemm_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# _C
# --------------------------------------------------------------------------------------------

def gemm_operand(t: torch.Tensor) -> torch.Tensor:
    """t as _C.gemm takes it: the last two dims row-major or a transposed view (taken without a
    copy); any other stride pattern, or a negative batch stride, is made contiguous (values
    unchanged, so results stay bitwise the same)."""
    if t.is_contiguous():
        return t
    rows, cols = t.shape[-2], t.shape[-1]
    row_stride, col_stride = t.stride(-2), t.stride(-1)
    row_major = (cols <= 1 or col_stride == 1) and (rows <= 1 or row_stride >= cols)
    transposed = (rows <= 1 or row_stride == 1) and (cols <= 1 or col_stride >= rows)
    if (row_major or transposed) and not (t.dim() == 3 and t.stride(0) < 0):
        return t
    return t.contiguous()


def launch_gemm(a, b, c, out, alpha, beta, backend, out_dtype=None):
    """out = alpha * a @ b + beta * c on the backend for a's device (backend None or "auto": the best
    usable one). a: [M, K] or [B, M, K]; b: [K, N] or [B, K, N]; c: None or broadcastable rows;
    out: rows contiguous, or None to have _C allocate it (in out_dtype) and return it."""
    code, stream = backend_and_stream("gemm", a.device, backend)
    a, b = gemm_operand(a), gemm_operand(b)
    if out is None:
        return _C.gemm(a, b, c, None, alpha, beta, code, stream, DTYPE_CODES[out_dtype])
    _C.gemm(a, b, c, out, alpha, beta, code, stream)
    return out
