"""linear_logp: per-token log-prob (and entropy) of an LM head without materializing logits.

    s = (hidden @ weight^T + bias) / temperature,  lse = logsumexp(s)
    logp = s[target] - lse,  entropy = lse - sum_v p_v s_v       (p = softmax(s))

Reads top-down: the public function -> the torch.library ops ``rl_kernels::linear_logp`` and
``rl_kernels::linear_logp_backward`` (fake implementations, autograd) -> ``_C``.

Forward: one fused kernel per backend (C reference on CPU, tensor cores on CUDA) with an online
softmax over a vocabulary order fixed by V; extra memory O(N).

Backward (docs/operators/linear_logp.md has the math): one ``_C.linear_logp_bwd`` call walks the
rows in blocks whose scratch memory fits BACKWARD_BYTES and, inside a block, the vocabulary in
chunks of VOCAB_CHUNK columns (a constant, so a row's dH sums the same chunks in the same order for
every N); per chunk dz = d loss / d z, then dH += dz @ W_chunk, dW_chunk (+)= dz^T @ H_rows,
db_chunk += 1^T dz, all on rl_kernels' batch-invariant GEMMs (csrc/bind/linear_logp.c). dH rows
are batch-invariant; dW and db deterministic (fixed order, no atomics). dW is exact up to one
rounding to its dtype per row block: one block up to N = 5120 at D = 4096 on SM90 (four at the
benchmark's N = 16384).

Out-of-range targets: the CPU path raises ValueError at once. The CUDA path must not synchronize,
so its kernel writes NaN into that row and sets a flag in pinned host memory; the flag is read (no
sync) at the start of the next linear_logp call or backward, which then raises ValueError.
"""

from __future__ import annotations

import math

import torch

from .. import _C
from .common import (LIBRARY, DeviceErrorFlag, backend_and_stream, boolean, check_backend,
                     check_tensor, eager_direct, integer, real_number)

VOCAB_CHUNK = 16384  # why this size: docs/operators/linear_logp.md
BACKWARD_BYTES = 240 << 20  # the budget is 256 MB of extra memory in all
BAD_TARGET = DeviceErrorFlag("target: an earlier linear_logp call on CUDA saw a target outside "
                             "[0, V) that is not ignore_index; its rows hold NaN")
_IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT64_RANGE = (-(2 ** 63), 2 ** 63 - 1)
_F32_MAX = 3.4028234663852886e38  # the kernels scale logits by 1 / temperature in fp32


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------

def linear_logp(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None, *, temperature: float = 1.0,
                ignore_index: int = -100, return_entropy: bool = False,
                backend: str | None = None):
    """log_softmax((hidden @ weight^T + bias) / temperature)[target] in fp32, shaped like target;
    with return_entropy, also the entropy of that distribution. hidden [..., D] (bf16, fp16 or
    fp32), weight [V, D], bias [V] or None, target int64 [...]. Rows whose target is ignore_index
    give logp = 0 and entropy = 0 and receive no gradient."""
    for name, t in (("hidden", hidden), ("weight", weight), ("target", target)):
        check_tensor("linear_logp", name, t)
    if bias is not None:
        check_tensor("linear_logp", "bias", bias)
    if hidden.dtype not in _IN_DTYPES:
        raise TypeError(f"linear_logp(): hidden has dtype {hidden.dtype}; expected bfloat16, "
                        f"float16 or float32")
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise TypeError(f"linear_logp(): weight and bias must have hidden's dtype {hidden.dtype}")
    if target.dtype != torch.int64:
        raise TypeError(f"linear_logp(): target must be int64, got {target.dtype}")
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_logp(): hidden [..., D] and weight [V, D] disagree: "
                         f"{tuple(hidden.shape)} vs {tuple(weight.shape)}")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"linear_logp(): target shape {tuple(target.shape)} must equal hidden's "
                         f"leading shape {tuple(hidden.shape[:-1])}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"linear_logp(): bias must have shape ({weight.shape[0]},)")
    if weight.shape[0] == 0 or hidden.shape[-1] == 0:
        raise ValueError("linear_logp(): V and D must be >= 1")
    temperature = check_temperature("linear_logp", temperature)
    if not 1.0 / temperature <= _F32_MAX:
        raise ValueError(f"linear_logp(): temperature {temperature!r} is too small: "
                         f"1 / temperature overflows float32, which the kernels scale logits in")
    ignore_index = integer("linear_logp", "ignore_index", ignore_index)
    if not _INT64_RANGE[0] <= ignore_index <= _INT64_RANGE[1]:
        raise ValueError(f"linear_logp(): ignore_index {ignore_index} does not fit in int64")
    return_entropy = boolean("linear_logp", "return_entropy", return_entropy)
    check_backend("linear_logp", backend)
    h = _rows(hidden.reshape(-1, hidden.shape[-1]))
    t = target.reshape(-1).contiguous()
    w = _rows(weight)
    b = None if bias is None else bias.contiguous()
    args = (h, w, b, t, temperature, ignore_index, "auto" if backend is None else backend)
    if eager_direct(h, w, b):
        logp, entropy, _ = _forward_impl(*args)
    else:
        logp, entropy, _ = torch.ops.rl_kernels.linear_logp(*args)
    logp = logp.view(target.shape)
    return (logp, entropy.view(target.shape)) if return_entropy else logp


def check_temperature(op: str, temperature) -> float:
    """temperature as a float: a real number (or 0-d tensor), finite and > 0."""
    temperature = real_number(op, "temperature", temperature)
    if not 0 < temperature < math.inf:  # NaN fails too
        raise ValueError(f"{op}(): temperature must be a finite number > 0, got {temperature!r}")
    return temperature


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with unit column stride and non-overlapping rows (an expanded row is materialized)."""
    rows_ok = t.shape[-1] <= 1 or t.stride(-1) == 1
    if t.dim() == 2 and t.shape[0] > 1 and t.stride(0) < t.shape[1]:
        rows_ok = False  # stride-0 (expanded) or overlapping rows
    return t if rows_ok else t.contiguous()


# --------------------------------------------------------------------------------------------
# torch.library ops and autograd
# --------------------------------------------------------------------------------------------

LIBRARY.define(
    "linear_logp(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, float temperature, "
    "int ignore_index, str backend) -> (Tensor, Tensor, Tensor)")
LIBRARY.define(
    "linear_logp_backward(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, Tensor lse, "
    "Tensor entropy, Tensor? grad_logp, Tensor? grad_entropy, float temperature, "
    "int ignore_index, str backend) -> (Tensor, Tensor, Tensor)")


def _forward_impl(hidden, weight, bias, target, temperature, ignore_index, backend):
    BAD_TARGET.raise_if_set()
    n = hidden.shape[0]
    code, stream = backend_and_stream("linear_logp", hidden.device, backend)
    logp, entropy, lse = (torch.empty(n, dtype=torch.float32, device=hidden.device)
                          for _ in range(3))
    _C.linear_logp_fwd(hidden, weight, bias, target, logp, entropy, lse, BAD_TARGET.address(hidden.device),
                       1.0 / temperature, ignore_index, code, stream)
    return logp, entropy, lse


def _backward_impl(hidden, weight, bias, target, lse, entropy, grad_logp, grad_entropy,
                   temperature, ignore_index, backend):
    BAD_TARGET.raise_if_set()
    n, d = hidden.shape
    v = weight.shape[0]
    device, dtype = hidden.device, hidden.dtype
    code, stream = backend_and_stream("linear_logp", device, backend)
    grad_hidden = torch.empty(n, d, dtype=dtype, device=device)
    # written by the first row block's dW GEMMs; with no rows there is none, and the gradient is 0
    grad_weight = (torch.empty if n > 0 else torch.zeros)(v, d, dtype=dtype, device=device)
    grad_bias = None if bias is None else torch.zeros(v, dtype=torch.float32, device=device)
    ones = None if bias is None else torch.ones(n, dtype=dtype, device=device)  # db = 1^T dz
    _C.linear_logp_bwd(hidden, weight, bias, target, lse, entropy, grad_logp, grad_entropy,
                       grad_hidden, grad_weight, grad_bias, ones, 1.0 / temperature, ignore_index,
                       VOCAB_CHUNK, BACKWARD_BYTES, code, stream)
    grad_bias = torch.empty(0, dtype=dtype, device=device) if grad_bias is None \
        else grad_bias.to(dtype)
    return grad_hidden, grad_weight, grad_bias


for _key in ("CPU", "CUDA"):
    LIBRARY.impl("linear_logp", _forward_impl, _key)
    LIBRARY.impl("linear_logp_backward", _backward_impl, _key)


@torch.library.register_fake("rl_kernels::linear_logp")
def _forward_fake(hidden, weight, bias, target, temperature, ignore_index, backend):
    n = hidden.shape[0]
    return tuple(hidden.new_empty(n, dtype=torch.float32) for _ in range(3))


@torch.library.register_fake("rl_kernels::linear_logp_backward")
def _backward_fake(hidden, weight, bias, target, lse, entropy, grad_logp, grad_entropy,
                   temperature, ignore_index, backend):
    return (torch.empty_like(hidden), torch.empty_like(weight),
            weight.new_empty(weight.shape[0] if bias is not None else 0))


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, target, temperature, ignore_index, backend = inputs
    _, entropy, lse = output
    ctx.save_for_backward(hidden, weight, bias, target, lse, entropy)
    ctx.temperature, ctx.ignore_index, ctx.backend = temperature, ignore_index, backend
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_logp, grad_entropy, _grad_lse):
    hidden, weight, bias, target, lse, entropy = ctx.saved_tensors
    grad_hidden, grad_weight, grad_bias = torch.ops.rl_kernels.linear_logp_backward(
        hidden, weight, bias, target, lse, entropy,
        None if grad_logp is None else grad_logp.float().contiguous(),
        None if grad_entropy is None else grad_entropy.float().contiguous(),
        ctx.temperature, ctx.ignore_index, ctx.backend)
    return (grad_hidden if ctx.needs_input_grad[0] else None,
            grad_weight if ctx.needs_input_grad[1] else None,
            grad_bias if bias is not None and ctx.needs_input_grad[2] else None,
            None, None, None, None)


torch.library.register_autograd("rl_kernels::linear_logp", _backward,
                                setup_context=_setup_context)


def _double_backward(ctx, *grads):
    raise RuntimeError("linear_logp: second-order gradients (a backward through its gradient, "
                       "create_graph=True) are not implemented")


torch.library.register_autograd("rl_kernels::linear_logp_backward", _double_backward,
                                setup_context=lambda ctx, inputs, output: None)
