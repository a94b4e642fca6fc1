"""rl_kernels: batch-invariant, deterministic kernels for RL training.

Every op's output rows are bitwise independent of the batch around them (M, position, chunking,
padding, threads, streams, runs), so a trainer recomputing a rollout's token log-probs gets the same
bits as the engine that produced them, whatever the batch shapes.
"""

from . import _C
from . import kernel_registry
from .kernel_registry import describe, get_op
from .modules import (AddmmOp, AttentionOp, DetGemmOp, GemmOp, LinearLogp, LinearLogpOp, LogSoftmaxOp,
                      MatmulOp, RmsNormOp, RowMeanOp, RowSumOp, SoftmaxOp)
from .ops.attention import attention, attention_with_kvcache
from .ops.det_gemm import det_gemm
from .ops.gemm import addmm, gemm, matmul
from .ops.linear_logp import linear_logp
from .ops.native import NativeLinearLogpOp, NativeMatmulOp
from .ops.row_ops import log_softmax, rms_norm, row_mean, row_sum, softmax
from .ops.common import integer as _integer
# the mode and the checker; the submodule names stay importable (from rl_kernels.batch_invariant
# import covers), while rl_kernels.batch_invariant / rl_kernels.strict are the functions below
from .batch_invariant import (batch_invariant, disable_batch_invariant, enable_batch_invariant,
                              is_batch_invariant)
from .strict import strict

__version__ = "0.1.0"
_INT_MAX = 2 ** 31 - 1  # _C takes a C int


def set_num_threads(n: int) -> None:
    """Threads the CPU kernels use (0: OpenMP's default, i.e. OMP_NUM_THREADS or all cores).
    Results are bitwise the same for any count. n: an int (a numpy integer or a 0-d integer tensor
    too; not a bool, float or str: TypeError), 0 or more (ValueError otherwise; unlike
    torch.set_num_threads, 0 is allowed and means the default)."""
    n = _integer("set_num_threads", "n", n)
    if n < 0:
        raise ValueError(f"set_num_threads(): n must be >= 0 (0: OpenMP's default), got {n}")
    if n > _INT_MAX:
        raise ValueError(f"set_num_threads(): n must be at most {_INT_MAX}, got {n}")
    _C.set_num_threads(n)


def get_num_threads() -> int:
    return _C.get_num_threads()


__all__ = [
    "AddmmOp", "AttentionOp", "DetGemmOp", "GemmOp", "LinearLogp", "LinearLogpOp", "LogSoftmaxOp",
    "MatmulOp", "NativeLinearLogpOp", "NativeMatmulOp", "RmsNormOp", "RowMeanOp", "RowSumOp",
    "SoftmaxOp", "addmm", "attention", "attention_with_kvcache", "batch_invariant", "describe",
    "det_gemm", "disable_batch_invariant", "enable_batch_invariant", "gemm", "get_num_threads",
    "get_op", "is_batch_invariant", "kernel_registry", "linear_logp", "log_softmax", "matmul",
    "rms_norm", "row_mean", "row_sum", "set_num_threads", "softmax", "strict",
]
