"""Bitwise batch invariance on the CPU backend: a row's result does not depend on M, its position,
chunking, padding rows, thread count or repetition. (GPU sweeps: test_gpu_gemm.py.)"""

import pytest
import torch

import rl_kernels
from conftest import QWEN3_8B_SHAPES, randn

M_SWEEP = [1, 2, 3, 7, 16, 17, 64, 129, 300]


def _rows(op, a, w):
    return op(a, w.t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,n", [(256, 200), (1000, 96), (4095, 33)])
def test_prefix_rows_equal_full_batch(dtype, k, n):
    a = randn(300, k, dtype=dtype, seed=1)
    w = randn(n, k, dtype=dtype, seed=2)
    full = rl_kernels.matmul(a, w.t())
    for m in M_SWEEP:
        assert torch.equal(rl_kernels.matmul(a[:m], w.t()), full[:m]), f"M={m}"
    for i in (0, 5, 97, 299):  # a row alone, at several positions
        assert torch.equal(rl_kernels.matmul(a[i:i + 1], w.t()), full[i:i + 1])


def test_chunked_prefill_and_padding_rows():
    a = randn(257, 512, dtype=torch.bfloat16, seed=3)
    w = randn(160, 512, dtype=torch.bfloat16, seed=4)
    full = rl_kernels.det_gemm(a, w.t())
    for cuts in ([100], [1, 2, 200], [64, 128, 192, 256]):
        bounds = [0, *cuts, 257]
        chunks = [rl_kernels.det_gemm(a[s:e], w.t()) for s, e in zip(bounds, bounds[1:])]
        assert torch.equal(torch.cat(chunks), full)
    padded = torch.cat([a, randn(63, 512, dtype=torch.bfloat16, seed=5) * 1e3])
    assert torch.equal(rl_kernels.det_gemm(padded, w.t())[:257], full)
    nan_padded = torch.cat([a, torch.full((5, 512), float("nan"), dtype=torch.bfloat16)])
    assert torch.equal(rl_kernels.det_gemm(nan_padded, w.t())[:257], full)


def test_thread_count_and_repeats():
    a = randn(200, 700, seed=6)
    b = randn(700, 300, seed=7)
    rl_kernels.set_num_threads(1)
    one = rl_kernels.matmul(a, b)
    rl_kernels.set_num_threads(2)
    two = rl_kernels.matmul(a, b)
    assert torch.equal(one, two)
    for _ in range(10):
        assert torch.equal(rl_kernels.matmul(a, b), one)


def test_batched_matmul_rows_invariant():
    a = randn(4, 33, 128, seed=8)
    b = randn(4, 128, 40, seed=9)
    full = rl_kernels.matmul(a, b)
    assert torch.equal(rl_kernels.matmul(a[:, 10:11], b), full[:, 10:11])
    assert torch.equal(rl_kernels.matmul(a[2], b[2]), full[2])


def test_addmm_and_gemm_rows_invariant():
    a, w = randn(100, 300, seed=10), randn(50, 300, seed=11)
    bias, c = randn(50, seed=12), randn(100, 50, seed=13)
    full = rl_kernels.addmm(bias, a, w.t(), beta=0.5, alpha=3.0)
    assert torch.equal(rl_kernels.addmm(bias, a[17:18], w.t(), beta=0.5, alpha=3.0), full[17:18])
    full = rl_kernels.gemm(2.0, a, w.t(), -1.0, c)
    assert torch.equal(rl_kernels.gemm(2.0, a[3:9], w.t(), -1.0, c[3:9]), full[3:9])


def test_dA_rows_invariant_and_dB_deterministic():
    a = randn(129, 256, dtype=torch.bfloat16, seed=14).requires_grad_()
    w = randn(64, 256, dtype=torch.bfloat16, seed=15).requires_grad_()
    g = randn(129, 64, dtype=torch.bfloat16, seed=16)
    rl_kernels.det_gemm(a, w.t()).backward(g)
    da, dw = a.grad.clone(), w.grad.clone()
    a_part = a.detach()[:7].clone().requires_grad_()
    rl_kernels.det_gemm(a_part, w.detach().t()).backward(g[:7])
    assert torch.equal(a_part.grad, da[:7])
    a.grad = w.grad = None
    rl_kernels.det_gemm(a, w.t()).backward(g)
    assert torch.equal(w.grad, dw) and torch.equal(a.grad, da)


@pytest.mark.slow
@pytest.mark.parametrize("k,n", QWEN3_8B_SHAPES)
def test_qwen3_shapes_rows_invariant(k, n):
    """Real model shapes (small M on the CPU; the GPU tests sweep M up to 4096)."""
    a = randn(17, k, dtype=torch.bfloat16, seed=17)
    w = randn(n, k, dtype=torch.bfloat16, seed=18)
    full = rl_kernels.det_gemm(a, w.t())
    for m in (1, 2, 3, 7, 16):
        assert torch.equal(rl_kernels.det_gemm(a[:m], w.t()), full[:m]), f"M={m}"
    assert torch.equal(rl_kernels.det_gemm(a[9:10], w.t()), full[9:10])
