"""linear_logp: per-token log-prob (and entropy) of an LM head without materializing logits.

    s = (hidden @ weight^T + bias) / temperature,  lse = logsumexp(s)
    logp = s[target] - lse,  entropy = lse - sum_v p_v s_v       (p = softmax(s))

Layers: public function -> torch.library ops ``rl_kernels::linear_logp`` and
``rl_kernels::linear_logp_backward`` (fake impls + registered autograd) -> rl_kernels._C.

Forward: one fused kernel per backend (C reference on CPU, tensor cores on CUDA) with an online
softmax over a vocabulary order fixed by V; extra memory O(N).

Backward (docs/operators/linear_logp.md has the math): the rows are walked in blocks that fit
BACKWARD_BYTES and, inside a block, the vocabulary in chunks of VOCAB_CHUNK columns (a constant, so
a row's dH sums the same chunks in the same order for every N). Per (row block, vocab chunk):
    dz  = d loss / d z of z = H_rows @ W_chunk^T + b_chunk   (input dtype)
    dH_rows  += dz @ W_chunk                            (GEMM, fp32 accumulator of the block)
    dW_chunk += dz^T @ H_rows,  db_chunk += 1^T dz      (GEMM; dW in its own dtype, db in fp32)
dz comes from one fused kernel on SM90 (z stays in registers, _C.linear_logp_dlogits with
logits=None), elsewhere from a GEMM into fp32 logits followed by the elementwise
_C.linear_logp_dlogits. Every product runs on rl_kernels' own batch-invariant GEMMs, so dH rows are
batch-invariant and dW, db are deterministic (fixed order, no atomics). Extra memory: at most
BACKWARD_BYTES (the block's fp32 dH and dz; fp32 logits too off SM90) plus O(V) for db.
dW is exact up to one rounding to its dtype per row block: one block up to N = 10240 at D = 4096 on
SM90 (two at the benchmark's N = 16384).

Out-of-range targets: the CPU path raises ValueError at once. The CUDA path must not synchronize,
so its kernel writes NaN into that row and sets a flag in pinned host memory; the flag is read (no
sync) at the start of the next linear_logp call or backward, which then raises ValueError.
"""

from __future__ import annotations

import math

import torch

from ..kernel_registry import resolve_backend
from ._common import LIBRARY, _C, backend_and_stream, eager_direct
from .gemm import _DTYPE_CODES, _gemm_out_impl

VOCAB_CHUNK = 4096
BACKWARD_BYTES = 240 << 20  # the budget is 256 MB of extra memory in all
_IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

LIBRARY.define(
    "linear_logp(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, float temperature, "
    "int ignore_index, str backend) -> (Tensor, Tensor, Tensor)")
LIBRARY.define(
    "linear_logp_backward(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, Tensor lse, "
    "Tensor entropy, Tensor? grad_logp, Tensor? grad_entropy, float temperature, "
    "int ignore_index, str backend) -> (Tensor, Tensor, Tensor)")

_bad_target_flags: dict[int, torch.Tensor] = {}


def _bad_target_flag(device: torch.device) -> torch.Tensor:
    """A pinned host int32 the CUDA kernel can store to (mapped memory, no sync)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _bad_target_flags:
        _bad_target_flags[index] = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    return _bad_target_flags[index]


def _raise_if_bad_target_seen():
    for flag in _bad_target_flags.values():
        if flag[0].item() != 0:
            flag.zero_()
            raise ValueError("target: an earlier linear_logp call on CUDA saw a target outside "
                             "[0, V) that is not ignore_index; its rows hold NaN")


def _forward_impl(hidden, weight, bias, target, temperature, ignore_index, backend):
    _raise_if_bad_target_seen()
    n = hidden.shape[0]
    _, code, stream = backend_and_stream("linear_logp", hidden.device,
                                         None if backend == "auto" else backend)
    logp, entropy, lse = (torch.empty(n, dtype=torch.float32, device=hidden.device)
                          for _ in range(3))
    workspace, flag_address = None, 0
    if hidden.device.type == "cuda":
        nbytes = _C.linear_logp_fwd_workspace_bytes(n, weight.shape[0], _DTYPE_CODES[hidden.dtype])
        workspace = torch.empty((nbytes + 3) // 4, dtype=torch.float32, device=hidden.device)
        flag_address = _bad_target_flag(hidden.device).data_ptr()
    _C.linear_logp_fwd(hidden, weight, bias, target, logp, entropy, lse, workspace, flag_address,
                       1.0 / temperature, ignore_index, code, stream)
    return logp, entropy, lse


def _fused_dlogits(hidden, weight, gemm_backend) -> bool:
    """Whether dz can come from the fused SM90 kernel: rlk_linear_logp_dlogits_sm90 takes bf16/fp16
    operands whose rows are 16-byte aligned (its call still answers False otherwise, and the chunk
    then goes through fp32 logits)."""
    rows_aligned = all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
                       for t in (hidden, weight))
    return gemm_backend == "sm90" and hidden.dtype != torch.float32 and rows_aligned


def _backward_impl(hidden, weight, bias, target, lse, entropy, grad_logp, grad_entropy,
                   temperature, ignore_index, backend):
    _raise_if_bad_target_seen()
    n, d = hidden.shape
    v = weight.shape[0]
    device, dtype = hidden.device, hidden.dtype
    _, _, stream = backend_and_stream("linear_logp", device, None if backend == "auto" else backend)
    gemm_backend = resolve_backend("gemm", device, None if backend == "auto" else backend)
    fused = _fused_dlogits(hidden, weight, gemm_backend)
    # per row of a block: the fp32 dH accumulator, dz, and the fp32 logits when materialized
    bytes_per_row = 4 * d + VOCAB_CHUNK * (hidden.element_size() + (0 if fused else 4))
    block = max(1, min(n, BACKWARD_BYTES // bytes_per_row))
    grad_hidden = torch.empty(n, d, dtype=dtype, device=device)
    # written by the first row block's dW GEMMs; with no rows there is none, and the gradient is 0
    grad_weight = (torch.empty if n > 0 else torch.zeros)(v, d, dtype=dtype, device=device)
    grad_bias = None if bias is None else torch.zeros(1, v, dtype=torch.float32, device=device)
    dh_buf = torch.empty(block, d, dtype=torch.float32, device=device)
    dz_buf = torch.empty(block * VOCAB_CHUNK, dtype=dtype, device=device)
    logits_buf = None
    ones = None if bias is None else torch.ones(1, block, dtype=dtype, device=device)  # for db
    inv_t = 1.0 / temperature
    for r0 in range(0, n, block):
        r1 = min(n, r0 + block)
        rows = r1 - r0
        h_rows = hidden[r0:r1]
        dh = dh_buf[:rows]
        row_args = (target[r0:r1], lse[r0:r1], entropy[r0:r1],
                    None if grad_logp is None else grad_logp[r0:r1],
                    None if grad_entropy is None else grad_entropy[r0:r1])
        for v0 in range(0, v, VOCAB_CHUNK):
            v1 = min(v, v0 + VOCAB_CHUNK)
            cols = v1 - v0
            w_chunk = weight[v0:v1]
            dz = dz_buf[: rows * cols].view(rows, cols)
            if not (fused and _C.linear_logp_dlogits(
                    None, *row_args, dz, v0, inv_t, ignore_index, stream, h_rows, w_chunk,
                    None if bias is None else bias[v0:v1])):
                if logits_buf is None:
                    logits_buf = torch.empty(block * VOCAB_CHUNK, dtype=torch.float32,
                                             device=device)
                logits = logits_buf[: rows * cols].view(rows, cols)
                _gemm_out_impl(h_rows, w_chunk.t(), None if bias is None else bias[v0:v1].float(),
                               1.0, 1.0, gemm_backend, logits)
                _C.linear_logp_dlogits(logits, *row_args, dz, v0, inv_t, ignore_index, stream)
            first_chunk, first_block = v0 == 0, r0 == 0
            _gemm_out_impl(dz, w_chunk, None if first_chunk else dh, 1.0,
                           0.0 if first_chunk else 1.0, gemm_backend, dh)
            dw = grad_weight[v0:v1]
            _gemm_out_impl(dz.t(), h_rows, None if first_block else dw, 1.0,
                           0.0 if first_block else 1.0, gemm_backend, dw)
            if grad_bias is not None:
                db = grad_bias[:, v0:v1]
                _gemm_out_impl(ones[:, :rows], dz, db, 1.0, 1.0, gemm_backend, db)
        grad_hidden[r0:r1].copy_(dh)
    grad_bias = torch.empty(0, dtype=dtype, device=device) if grad_bias is None \
        else grad_bias.view(-1).to(dtype)
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


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def linear_logp(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None, *, temperature: float = 1.0,
                ignore_index: int = -100, return_entropy: bool = False,
                backend: str | None = None):
    """log_softmax((hidden @ weight^T + bias) / temperature)[target] in fp32, shaped like target;
    with return_entropy, also the entropy of that distribution. hidden [..., D] (bf16, fp16 or
    fp32), weight [V, D], bias [V] or None, target int64 [...]. Rows whose target is ignore_index
    give logp = 0 and entropy = 0 and receive no gradient."""
    for name, t in (("hidden", hidden), ("weight", weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"linear_logp(): {name} must be a torch.Tensor")
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
    if not (isinstance(temperature, (int, float)) and 0 < temperature < math.inf):  # NaN fails
        raise ValueError(f"linear_logp(): temperature must be a finite number > 0, "
                         f"got {temperature!r}")
    h = _rows(hidden.reshape(-1, hidden.shape[-1]))
    t = target.reshape(-1).contiguous()
    w = _rows(weight)
    b = None if bias is None else bias.contiguous()
    args = (h, w, b, t, float(temperature), int(ignore_index), backend or "auto")
    if eager_direct(h, w, b):
        logp, entropy, _ = _forward_impl(*args)
    else:
        logp, entropy, _ = torch.ops.rl_kernels.linear_logp(*args)
    logp = logp.view(target.shape)
    return (logp, entropy.view(target.shape)) if return_entropy else logp


class LinearLogpOp(torch.nn.Module):
    """linear_logp as a registry op bound to a backend choice."""

    op_class = "reduction"

    def __init__(self, backend: str | None = None):
        super().__init__()
        self.backend = backend

    def forward(self, hidden, weight, target, bias=None, **kwargs):
        return linear_logp(hidden, weight, target, bias, backend=self.backend, **kwargs)


class LinearLogp(torch.nn.Module):
    """An LM head [vocab_size, hidden_size] whose forward returns per-token log-probs of target
    (and optionally the entropy) without materializing the logits."""

    def __init__(self, hidden_size: int, vocab_size: int, bias: bool = False, *, device=None,
                 dtype=None, backend: str | None = None):
        super().__init__()
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
