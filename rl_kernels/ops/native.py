"""Ground-truth references in plain torch (no rl_kernels kernels): what tests compare against."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def exact_fp32_matmul():
    """TF32 and reduced-precision reductions off for the duration; previous settings restored."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
             torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
             torch.get_float32_matmul_precision())
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        torch.set_float32_matmul_precision("highest")
        yield
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
         torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction, precision) = saved
        torch.set_float32_matmul_precision(precision)


class NativeMatmulOp(torch.nn.Module):
    """fp32 ground truth: forward_fp32 casts to fp32 and calls torch.matmul once with TF32 and
    reduced-precision reductions disabled; forward returns the input dtype."""

    op_class = "reduction"

    def forward_fp32(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        with exact_fp32_matmul():
            return torch.matmul(a.float(), b.float())

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.forward_fp32(a, b).to(a.dtype)


class NativeLinearLogpOp(torch.nn.Module):
    """The materializing reference for linear_logp: logits [N, V] in fp32 (or fp64), then
    log_softmax, gather and entropy. Rows with target == ignore_index give 0 and 0."""

    op_class = "reduction"

    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        if dtype not in (torch.float32, torch.float64):
            raise TypeError("NativeLinearLogpOp computes in float32 or float64")
        self.dtype = dtype

    def forward(self, hidden, weight, target, bias=None, *, temperature=1.0, ignore_index=-100,
                return_entropy=False):
        # linear_logp's rule (temperature 0 would give NaN); a tensor temperature stays a tensor
        from .linear_logp import check_temperature
        if isinstance(temperature, torch.Tensor):
            check_temperature("NativeLinearLogpOp", temperature.detach())
        else:
            temperature = check_temperature("NativeLinearLogpOp", temperature)
        with exact_fp32_matmul():
            logits = hidden.to(self.dtype) @ weight.to(self.dtype).T
        if bias is not None:
            logits = logits + bias.to(self.dtype)
        logits = logits / temperature
        logprobs = torch.log_softmax(logits, dim=-1)
        valid = target != ignore_index
        safe_target = torch.where(valid, target, torch.zeros_like(target))
        logp = logprobs.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)
        logp = torch.where(valid, logp, torch.zeros_like(logp))
        if not return_entropy:
            return logp
        entropy = -(logprobs.exp() * logprobs).sum(-1)
        entropy = torch.where(valid, entropy, torch.zeros_like(entropy))
        return logp, entropy
