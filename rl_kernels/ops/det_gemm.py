"""det_gemm: the batch-invariant deterministic GEMM, forward and backward.

det_gemm(a, b) = a @ b with fp32 accumulation, output in a's dtype or fp32. It is the
``rl_kernels::gemm`` op (ops/gemm.py) with alpha = 1, beta = 0, so it shares that op's kernels,
autograd (dA = g @ B^T, dB = A^T @ g on the same backend) and torch.compile support.
bf16/fp16 inputs are the tensor-core path; fp32 inputs run the fp32 path (CPU reference, or the
FFMA kernel on CUDA -- never TF32). There is no fallback to cuBLAS: it would break invariance.
"""

from __future__ import annotations

import torch

from .common import check_backend, check_float_tensors, eager_direct, prod, type_name
from .gemm import launch_gemm, run_gemm

_IN_DTYPE_SET = frozenset((torch.bfloat16, torch.float16, torch.float32, torch.float64))


def det_gemm(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype | None = None,
             backend: str | None = None) -> torch.Tensor:
    """a [..., M, K] @ b [K, N] -> [..., M, N]; b may be a transposed view of an nn.Linear
    weight (``weight.t()``), used without a copy. out_dtype: None (a's dtype) or torch.float32."""
    if backend is not None:
        check_backend("det_gemm", backend)
    if (out_dtype is None and type(a) is torch.Tensor and type(b) is torch.Tensor and a.dim() == 2
            and b.dim() == 2 and a.dtype is b.dtype and a.dtype in _IN_DTYPE_SET
            and a.shape[1] == b.shape[0] and a.layout is torch.strided
            and b.layout is torch.strided and eager_direct(a, b)):
        return launch_gemm(a, b, None, None, 1.0, 0.0, backend, a.dtype)  # the common case
    check_float_tensors("det_gemm", a=a, b=b)
    if a.dim() < 2 or b.dim() != 2:
        raise ValueError(f"det_gemm(): a must be [..., M, K] and b [K, N]; got {a.dim()}-D and "
                         f"{b.dim()}-D")
    if a.shape[-1] != b.shape[0]:
        raise ValueError(f"det_gemm(): a {tuple(a.shape)} and b {tuple(b.shape)} have different K")
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"det_gemm(): out_dtype must be None or a torch.dtype, got {out_dtype!r} "
                        f"({type_name(out_dtype)})")
    out_dtype = a.dtype if out_dtype is None else out_dtype
    if out_dtype not in (a.dtype, torch.float32):
        raise TypeError(f"det_gemm(): out_dtype must be None, {a.dtype} or torch.float32, "
                        f"got {out_dtype}" if a.dtype != torch.float32 else
                        f"det_gemm(): out_dtype must be None or torch.float32, got {out_dtype}")
    rows = a.reshape(prod(a.shape[:-1]), a.shape[-1])
    result = run_gemm(rows, b, None, 1.0, 0.0, out_dtype, backend)
    return result.reshape(*a.shape[:-1], b.shape[1])
