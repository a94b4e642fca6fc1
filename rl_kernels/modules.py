"""nn.Module forms of the ops, one class per registry op (kernel_registry.get_op(name)).

Every class names the registry op it serves (``op``) and the kernel entries of csrc/kernels.def it
needs (``kernels``); the registry reads both from here, so adding an op is one class below. A module
is bound to a backend choice: None picks by device (the best usable backend), or a forced one.
"""

from __future__ import annotations

import torch

from .ops.attention import attention
from .ops.common import check_backend
from .ops.det_gemm import det_gemm
from .ops.gemm import addmm, gemm, matmul
from .ops.linear_logp import linear_logp
from .ops.row_ops import log_softmax, rms_norm, row_mean, row_sum, softmax


class OpModule(torch.nn.Module):
    """An op bound to a backend choice (None: by device, in kernels.def's priority order)."""

    op: str = ""
    kernels: tuple = ()
    op_class = "reduction"  # every op here reduces over a row: what batch invariance is about

    def __init__(self, backend: str | None = None):
        super().__init__()
        check_backend(type(self).__name__, backend)
        self.backend = backend

    def extra_repr(self):
        return f"backend={self.backend or 'auto'}"

    @classmethod
    def registered(cls):
        """Every op class (the subclasses that name an op)."""
        found, todo = [], list(cls.__subclasses__())
        while todo:
            sub = todo.pop()
            todo.extend(sub.__subclasses__())
            if sub.op:
                found.append(sub)
        return found


class MatmulOp(OpModule):
    op, kernels = "matmul", ("gemm",)

    def forward(self, a, b):
        return matmul(a, b, backend=self.backend)


class AddmmOp(OpModule):
    op, kernels = "addmm", ("gemm",)

    def forward(self, input, mat1, mat2, beta=1, alpha=1):
        return addmm(input, mat1, mat2, beta=beta, alpha=alpha, backend=self.backend)


class GemmOp(OpModule):
    op, kernels = "gemm", ("gemm",)

    def forward(self, alpha, a, b, beta, c):
        return gemm(alpha, a, b, beta, c, backend=self.backend)


class DetGemmOp(OpModule):
    op, kernels = "det_gemm", ("gemm",)

    def forward(self, a, b, out_dtype=None):
        return det_gemm(a, b, out_dtype=out_dtype, backend=self.backend)


class LinearLogpOp(OpModule):
    op, kernels = "linear_logp", ("linear_logp_fwd", "linear_logp_dz", "gemm", "convert")

    def forward(self, hidden, weight, target, bias=None, **kwargs):
        return linear_logp(hidden, weight, target, bias, backend=self.backend, **kwargs)


class AttentionOp(OpModule):
    op, kernels = "attention", ("attention_fwd", "attention_bwd")

    def forward(self, q, k, v, **kwargs):
        return attention(q, k, v, backend=self.backend, **kwargs)


class RmsNormOp(OpModule):
    op, kernels = "rms_norm", ("rms_norm_fwd", "rms_norm_bwd")

    def forward(self, x, weight=None, eps=1e-6, **kwargs):
        return rms_norm(x, weight, eps, backend=self.backend, **kwargs)


class SoftmaxOp(OpModule):
    op, kernels = "softmax", ("softmax_fwd", "softmax_bwd")

    def forward(self, x, dim=-1, **kwargs):
        return softmax(x, dim, backend=self.backend, **kwargs)


class LogSoftmaxOp(OpModule):
    op, kernels = "log_softmax", ("softmax_fwd", "softmax_bwd")

    def forward(self, x, dim=-1, **kwargs):
        return log_softmax(x, dim, backend=self.backend, **kwargs)


class RowSumOp(OpModule):
    op, kernels = "row_sum", ("row_sum",)

    def forward(self, x, **kwargs):
        return row_sum(x, backend=self.backend, **kwargs)


class RowMeanOp(OpModule):
    op, kernels = "row_mean", ("row_sum",)

    def forward(self, x, **kwargs):
        return row_mean(x, backend=self.backend, **kwargs)


class LinearLogp(torch.nn.Module):
    """An LM head [vocab_size, hidden_size] whose forward returns per-token log-probs of target
    (and optionally the entropy) without materializing the logits."""

    def __init__(self, hidden_size: int, vocab_size: int, bias: bool = False, *, device=None,
                 dtype=None, backend: str | None = None):
        super().__init__()
        check_backend("LinearLogp", backend)
        self.weight = torch.nn.Parameter(torch.empty(vocab_size, hidden_size, device=device,
                                                     dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(vocab_size, device=device, dtype=dtype)) \
            if bias else None
        self.backend = backend
        torch.nn.init.normal_(self.weight, std=hidden_size ** -0.5)

    def forward(self, hidden, target, *, temperature=1.0, ignore_index=-100,
                return_entropy=False):
        return linear_logp(hidden, self.weight, target, self.bias, temperature=temperature,
                           ignore_index=ignore_index, return_entropy=return_entropy,
                           backend=self.backend)
