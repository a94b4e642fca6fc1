"""rl_kernels: batch-invariant, deterministic kernels for RL training.

Every op's output rows are bitwise independent of the batch around them (M, position, chunking,
padding, threads, streams, runs), so a trainer recomputing a rollout's token log-probs gets the same
bits as the engine that produced them, whatever the batch shapes.
"""

from . import _C
from . import kernel_registry
from .kernel_registry import describe, get_op
from .modules import AddmmOp, AttentionOp, DetGemmOp, GemmOp, LinearLogp, LinearLogpOp, MatmulOp
from .ops.attention import attention, attention_with_kvcache
from .ops.det_gemm import det_gemm
from .ops.gemm import addmm, gemm, matmul
from .ops.linear_logp import linear_logp
from .ops.native import NativeLinearLogpOp, NativeMatmulOp

__version__ = "0.1.0"


def set_num_threads(n: int) -> None:
    """Threads the CPU kernels use (0: OpenMP's default, i.e. OMP_NUM_THREADS or all cores).
    Results are bitwise the same for any count."""
    _C.set_num_threads(n)


def get_num_threads() -> int:
    return _C.get_num_threads()


__all__ = [
    "AddmmOp", "AttentionOp", "DetGemmOp", "GemmOp", "LinearLogp", "LinearLogpOp", "MatmulOp",
    "NativeLinearLogpOp", "NativeMatmulOp", "addmm", "attention", "attention_with_kvcache", "describe", "det_gemm", "gemm",
    "get_num_threads", "get_op", "kernel_registry", "linear_logp", "matmul", "set_num_threads",
]
