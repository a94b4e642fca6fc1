"""GEMM ops: rl_kernels.matmul / addmm / gemm and their nn.Modules.

Layers: public function -> torch.library op ``rl_kernels::gemm`` (fake impl + registered autograd,
so torch.compile(fullgraph=True) sees one opaque op) -> ``_C.gemm``. In eager mode, when no graph is
recorded, the public functions call the op's implementation directly (same code, no dispatcher
hop) to keep host overhead low (per-call numbers: docs/perf-notes.md).

Every backend computes out = alpha * a @ b + beta * c with fp32 accumulation and a K order fixed by
K alone, so each output row is bitwise independent of the rows around it. Gradients run on the same
backend's kernels: dA = alpha * g @ B^T, dB = alpha * A^T @ g, dc = beta * g summed over broadcast
rows (a ones-row GEMM, so also deterministic).
"""

from __future__ import annotations

import torch

from ._common import LIBRARY, _C, backend_and_stream, eager_direct, gemm_operand

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

LIBRARY.define(
    "gemm(Tensor a, Tensor b, Tensor? c, float alpha, float beta, ScalarType out_dtype, "
    "str backend) -> Tensor")
LIBRARY.define(
    "gemm_out(Tensor a, Tensor b, Tensor? c, float alpha, float beta, str backend, "
    "Tensor(a!) out) -> ()")


_DTYPE_CODES = {torch.float32: _C.DTYPE_F32, torch.bfloat16: _C.DTYPE_BF16,
                torch.float16: _C.DTYPE_F16, torch.float64: _C.DTYPE_F64}


def _launch(a, b, c, out, alpha, beta, backend, out_dtype=None):
    """out = alpha * a @ b + beta * c on the backend for a's device. a: [M, K] or [B, M, K];
    b: [K, N] or [B, K, N]; c: None or broadcastable rows; out: rows contiguous, or None to have
    _C allocate it (in out_dtype) through torch's DLPack exchange table and return it."""
    name, code, stream = backend_and_stream("gemm", a.device, None if backend == "auto" else backend)
    a = gemm_operand(a, name)
    b = gemm_operand(b, name)
    if c is not None and beta == 0.0:
        c = None  # BLAS semantics: beta == 0 ignores c (NaN in c does not propagate)
    if out is None:
        return _C.gemm(a, b, c, None, float(alpha), float(beta), code, stream,
                       _DTYPE_CODES[out_dtype])
    _C.gemm(a, b, c, out, float(alpha), float(beta), code, stream)
    return out


def _out_shape(a, b):
    return (*a.shape[:-1], b.shape[-1])


def _gemm_impl(a, b, c, alpha, beta, out_dtype, backend):
    return _launch(a, b, c, None, alpha, beta, backend, out_dtype)


def _gemm_out_impl(a, b, c, alpha, beta, backend, out):
    _launch(a, b, c, out, alpha, beta, backend)


for _key in ("CPU", "CUDA"):
    LIBRARY.impl("gemm", _gemm_impl, _key)
    LIBRARY.impl("gemm_out", _gemm_out_impl, _key)


@torch.library.register_fake("rl_kernels::gemm")
def _gemm_fake(a, b, c, alpha, beta, out_dtype, backend):
    return a.new_empty(_out_shape(a, b), dtype=out_dtype)


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
# Public API
# --------------------------------------------------------------------------------------------

def _check_dtypes(op, **tensors):
    dtype = None
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}(): {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}(): {name} has dtype {t.dtype}; expected float32, bfloat16, "
                            f"float16 or float64")
        if dtype is not None and t.dtype != dtype:
            first = next(iter(tensors))
            raise TypeError(f"{op}(): {name} has dtype {t.dtype} but {first} has {dtype}; "
                            f"rl_kernels does not promote dtypes (torch.matmul does not either)")
        dtype = t.dtype


def _check_out(op, out, dtype, shape, *inputs):
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{op}(): out must be a torch.Tensor")
    if out.dtype != dtype:
        raise TypeError(f"{op}(): expected out to have dtype {dtype}, got {out.dtype}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (out, *inputs)):
        raise RuntimeError(f"{op}(): functions with out=... arguments don't support automatic "
                           f"differentiation, but one of the arguments requires grad.")
    if tuple(out.shape) != tuple(shape):
        if out.numel() != 0:
            raise ValueError(f"{op}(): out has shape {tuple(out.shape)}, expected {tuple(shape)}")
        out.resize_(shape)


def _prod(sizes):
    count = 1
    for size in sizes:
        count = count * size
    return count


def _rows_contiguous(t):
    return (t.shape[-1] <= 1 or t.stride(-1) == 1) and (
        t.shape[-2] <= 1 or t.stride(-2) >= t.shape[-1])


def _run(a, b, c, alpha, beta, out_dtype, backend, out=None):
    """One GEMM through the fast eager path or the registered op; a, b are 2-D or 3-D; out, if
    given, has the result's shape."""
    backend = backend or "auto"  # the op schema takes a string
    if out is None:
        if eager_direct(a, b, c):
            return _gemm_impl(a, b, c, alpha, beta, out_dtype, backend)
        return torch.ops.rl_kernels.gemm(a, b, c, alpha, beta, out_dtype, backend)
    if not _rows_contiguous(out):  # the kernels write contiguous rows: compute, then copy in
        return out.copy_(_run(a, b, c, alpha, beta, out_dtype, backend))
    if eager_direct(a, b, c, out):
        _gemm_out_impl(a, b, c, alpha, beta, backend, out)
    else:
        torch.ops.rl_kernels.gemm_out(a, b, c, alpha, beta, backend, out)
    return out


def _matmul(a, b, out, backend, op="matmul"):
    _check_dtypes(op, input=a, other=b)
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
        _check_out(op, out, a.dtype, result_shape, a, b)
    if b2.dim() == 2:  # every row of a, over all batch dims, against one b: one 2-D GEMM
        a_flat, b_flat = a2.reshape(_prod(a2.shape[:-1]), k), b2
        flat_shape = (a_flat.shape[0], n)
    else:
        count = _prod(batch)
        a_flat = a2.expand(*batch, m, k).reshape(count, m, k)
        b_flat = b2.expand(*batch, k, n).reshape(count, k, n)
        flat_shape = (count, m, n)
    if out is not None and out.is_contiguous():
        _run(a_flat, b_flat, None, 1.0, 0.0, a.dtype, backend, out.view(flat_shape))
        return out
    result = _run(a_flat, b_flat, None, 1.0, 0.0, a.dtype, backend).reshape(result_shape)
    return result if out is None else out.copy_(result)


_FLOAT_DTYPE_SET = frozenset(FLOAT_DTYPES)


def matmul(input: torch.Tensor, other: torch.Tensor, *, out: torch.Tensor | None = None,
           backend: str | None = None) -> torch.Tensor:
    """torch.matmul semantics (1-D, 2-D, batched and broadcast inputs), batch-invariant rows."""
    if (out is None and input.dim() == 2 and other.dim() == 2 and input.dtype is other.dtype
            and input.dtype in _FLOAT_DTYPE_SET and input.shape[1] == other.shape[0]
            and eager_direct(input, other)):
        # the common case, kept short: host time per call is what small decode GEMMs pay
        return _launch(input, other, None, None, 1.0, 0.0, backend or "auto", input.dtype)
    return _matmul(input, other, out, backend)


def addmm(input: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *, beta=1, alpha=1,
          out: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """torch.addmm semantics: beta * input + alpha * mat1 @ mat2; input broadcasts to [M, N]
    (a 1-D bias included)."""
    _check_dtypes("addmm", input=input, mat1=mat1, mat2=mat2)
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
    if n > 1 and c.stride(-1) != 1:
        c = c.contiguous()
    if out is not None:
        _check_out("addmm", out, input.dtype, (m, n), input, mat1, mat2)
    return _run(mat1, mat2, c, float(alpha), float(beta), input.dtype, backend, out)


def gemm(alpha, a: torch.Tensor, b: torch.Tensor, beta, c: torch.Tensor | None, *,
         out: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """BLAS GEMM: alpha * a @ b + beta * c for 2-D a [M, K], b [K, N], c [M, N] (or None).
    Returns a new tensor; out= (which may be c itself) is written in place."""
    if c is None:
        _check_dtypes("gemm", a=a, b=b)
    else:
        _check_dtypes("gemm", a=a, b=b, c=c)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"gemm(): a {tuple(a.shape)} and b {tuple(b.shape)} must be 2-D with "
                         f"matching inner dims")
    shape = (a.shape[0], b.shape[1])
    if c is not None and tuple(c.shape) != shape:
        raise ValueError(f"gemm(): c has shape {tuple(c.shape)}, expected {shape}")
    if out is not None:
        _check_out("gemm", out, a.dtype, shape, a, b, c)
        if c is not None and out.data_ptr() == c.data_ptr() and out.stride() != c.stride():
            raise ValueError("gemm(): out aliases c with different strides")
    return _run(a, b, c, float(alpha), float(beta), a.dtype, backend, out)


class _BackendModule(torch.nn.Module):
    """An op bound to a backend choice (None: by device, SM90 -> SM80 -> CPU)."""

    def __init__(self, backend: str | None = None):
        super().__init__()
        self.backend = backend

    def extra_repr(self):
        return f"backend={self.backend or 'auto'}"


class MatmulOp(_BackendModule):
    op_class = "reduction"

    def forward(self, a, b):
        return matmul(a, b, backend=self.backend)


class AddmmOp(_BackendModule):
    op_class = "reduction"

    def forward(self, input, mat1, mat2, beta=1, alpha=1):
        return addmm(input, mat1, mat2, beta=beta, alpha=alpha, backend=self.backend)


class GemmOp(_BackendModule):
    op_class = "reduction"

    def forward(self, alpha, a, b, beta, c):
        return gemm(alpha, a, b, beta, c, backend=self.backend)
