"""matmul / addmm / gemm / det_gemm on the CPU backend: accuracy vs fp64, torch semantics, out=,
autograd, torch.compile and opcheck. (Bitwise invariance: test_invariance.py.)"""

import pytest
import torch

import rl_kernels
from conftest import GEMM_TOL, randn, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (7, 33, 5), (64, 256, 96), (129, 300, 257)])
def test_matmul_matches_fp64(dtype, m, k, n):
    a, b = randn(m, k, dtype=dtype, seed=1), randn(k, n, dtype=dtype, seed=2)
    out = rl_kernels.matmul(a, b)
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_err(out, a.double() @ b.double()) <= GEMM_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_det_gemm_fp32_output_and_linear_weight_view(dtype):
    a, w = randn(50, 128, dtype=dtype, seed=3), randn(70, 128, dtype=dtype, seed=4)
    out = rl_kernels.det_gemm(a, w.t(), out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert rel_err(out, a.double() @ w.double().t()) <= 1e-6
    assert torch.equal(rl_kernels.det_gemm(a, w.t()), out.to(dtype))
    batched = rl_kernels.det_gemm(a.view(5, 10, 128), w.t(), out_dtype=torch.float32)
    assert torch.equal(batched.view(50, 70), out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_output_is_the_rounded_fp32_result(dtype):
    a, b = randn(40, 512, dtype=dtype, seed=5), randn(512, 48, dtype=dtype, seed=6)
    a[0] *= 300  # fp16 overflow to inf
    a[1] *= 1e-6  # tiny results: fp16 subnormals
    a[2, 7] = float("nan")
    fp32 = rl_kernels.det_gemm(a, b, out_dtype=torch.float32)
    torch.testing.assert_close(rl_kernels.det_gemm(a, b), fp32.to(dtype), rtol=0, atol=0,
                               equal_nan=True)


@pytest.mark.parametrize("a_t,b_t", [(False, True), (True, False), (True, True)])
def test_transposed_views_need_no_copy_and_match(a_t, b_t):
    a = randn(30, 70, seed=7)
    b = randn(70, 20, seed=8)
    a_in = a.t().contiguous().t() if a_t else a
    b_in = b.t().contiguous().t() if b_t else b
    assert torch.equal(rl_kernels.matmul(a_in, b_in), rl_kernels.matmul(a, b))


def test_strided_and_sliced_operands():
    big = randn(64, 100, seed=9)
    a = big[3:40, 5:65]  # rows with a stride of 100 and an offset
    b = randn(120, 30, seed=10)[::2]  # every other row: not row-major, copied by the wrapper
    assert rel_err(rl_kernels.matmul(a, b), a.double() @ b.double()) <= 1e-6


@pytest.mark.parametrize("shape_a,shape_b", [
    ((5,), (5,)), ((5,), (5, 3)), ((4, 5), (5,)), ((2, 3, 4, 5), (5, 6)),
    ((2, 1, 4, 5), (3, 5, 6)), ((4, 5), (2, 5, 6)), ((7,), (2, 7, 3)), ((2, 3, 4, 7), (7,)),
])
def test_matmul_broadcasting_semantics(shape_a, shape_b):
    a, b = randn(*shape_a, seed=11), randn(*shape_b, seed=12)
    out = rl_kernels.matmul(a, b)
    ref = torch.matmul(a.double(), b.double())
    assert out.shape == ref.shape
    assert rel_err(out, ref) <= 1e-6


@pytest.mark.parametrize("bias_shape", [(6,), (1, 6), (4, 6), (4, 1), ()])
def test_addmm_bias_broadcast(bias_shape):
    bias = randn(*bias_shape, seed=13)
    m1, m2 = randn(4, 9, seed=14), randn(9, 6, seed=15)
    out = rl_kernels.addmm(bias, m1, m2, beta=0.5, alpha=-2.0)
    ref = torch.addmm(bias.double(), m1.double(), m2.double(), beta=0.5, alpha=-2.0)
    assert rel_err(out, ref) <= 1e-6


def test_addmm_beta_zero_ignores_nan_input_like_torch():
    bias = torch.full((3,), float("nan"))
    m1, m2 = randn(2, 4, seed=16), randn(4, 3, seed=17)
    out = rl_kernels.addmm(bias, m1, m2, beta=0)
    assert not torch.isnan(torch.addmm(bias, m1, m2, beta=0)).any()
    assert torch.equal(out, rl_kernels.matmul(m1, m2))


def test_gemm_blas_semantics_and_in_place():
    a, b, c = randn(8, 16, seed=18), randn(16, 4, seed=19), randn(8, 4, seed=20)
    expected = 2.0 * (a.double() @ b.double()) + 3.0 * c.double()
    out = rl_kernels.gemm(2.0, a, b, 3.0, c)
    assert rel_err(out, expected) <= 1e-6
    c_copy = c.clone()
    result = rl_kernels.gemm(2.0, a, b, 3.0, c_copy, out=c_copy)  # C = alpha A B + beta C
    assert result is c_copy and torch.equal(c_copy, out)


def test_out_variants_write_in_place():
    a, b = randn(6, 5, seed=21), randn(5, 7, seed=22)
    out = torch.empty(6, 7)
    assert rl_kernels.matmul(a, b, out=out) is out
    assert torch.equal(out, rl_kernels.matmul(a, b))
    out_t = torch.empty(7, 6).t()  # rows not contiguous: computed, then copied in
    rl_kernels.matmul(a, b, out=out_t)
    assert torch.equal(out_t, out)
    out_empty = torch.empty(0)
    rl_kernels.matmul(a, b, out=out_empty)
    assert out_empty.shape == (6, 7) and torch.equal(out_empty, out)
    bias = randn(7, seed=23)
    out2 = torch.empty(6, 7)
    rl_kernels.addmm(bias, a, b, out=out2)
    assert torch.equal(out2, rl_kernels.addmm(bias, a, b))
    batched = torch.empty(2, 6, 7)
    rl_kernels.matmul(torch.stack([a, a]), b, out=batched)
    assert torch.equal(batched[1], out)


def test_out_with_grad_raises_like_torch():
    a = randn(3, 4, seed=24).requires_grad_()
    b = randn(4, 2, seed=25)
    with pytest.raises(RuntimeError, match="don't support automatic differentiation"):
        rl_kernels.matmul(a, b, out=torch.empty(3, 2))
    with pytest.raises(RuntimeError, match="don't support automatic differentiation"):
        torch.matmul(a, b, out=torch.empty(3, 2))


def test_out_wrong_dtype_or_shape():
    a, b = randn(3, 4), randn(4, 2)
    with pytest.raises(TypeError, match="out"):
        rl_kernels.matmul(a, b, out=torch.empty(3, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="out has shape"):
        rl_kernels.matmul(a, b, out=torch.empty(3, 3))


@pytest.mark.parametrize("m,k,n", [(0, 4, 3), (3, 0, 4), (3, 4, 0), (0, 0, 0)])
def test_empty_dims_match_torch(m, k, n):
    a, b = randn(m, k), randn(k, n)
    out = rl_kernels.matmul(a, b)
    assert torch.equal(out, torch.matmul(a, b))
    bias = randn(n, seed=3)
    assert torch.equal(rl_kernels.addmm(bias, a, b), torch.addmm(bias, a, b))


def test_mismatched_dtypes_raise():
    with pytest.raises(TypeError, match="does not promote"):
        rl_kernels.matmul(randn(2, 3), randn(3, 2, dtype=torch.float64))
    with pytest.raises(TypeError, match="dtype"):
        rl_kernels.matmul(torch.ones(2, 3, dtype=torch.int32), torch.ones(3, 2, dtype=torch.int32))


def test_nan_and_inf_propagate_like_fp64():
    a, b = randn(5, 8, seed=26), randn(8, 6, seed=27)
    a[1, 3] = float("nan")
    a[2, 0] = float("inf")
    b[4, 5] = float("-inf")
    out = rl_kernels.matmul(a, b)
    ref = a.double() @ b.double()
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    finite = torch.isfinite(ref)
    assert rel_err(out[finite], ref[finite]) <= 1e-6


# ------------------------------------------------------------------------------------------------
# autograd
# ------------------------------------------------------------------------------------------------

def test_gradcheck_fp64():
    a = randn(4, 5, dtype=torch.float64, seed=28).requires_grad_()
    b = randn(5, 3, dtype=torch.float64, seed=29).requires_grad_()
    bias = randn(3, dtype=torch.float64, seed=30).requires_grad_()
    c = randn(4, 3, dtype=torch.float64, seed=31).requires_grad_()
    assert torch.autograd.gradcheck(rl_kernels.matmul, (a, b))
    assert torch.autograd.gradcheck(lambda x, y, z: rl_kernels.addmm(z, x, y, beta=0.7, alpha=1.3),
                                    (a, b, bias))
    assert torch.autograd.gradcheck(lambda x, y, z: rl_kernels.gemm(0.5, x, y, 2.0, z), (a, b, c))
    batched = randn(2, 4, 5, dtype=torch.float64, seed=32).requires_grad_()
    b3 = randn(2, 5, 3, dtype=torch.float64, seed=33).requires_grad_()
    assert torch.autograd.gradcheck(rl_kernels.matmul, (batched, b3))
    assert torch.autograd.gradgradcheck(rl_kernels.matmul, (a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gradients_random_cotangent_vs_fp64(dtype):
    a = randn(33, 65, dtype=dtype, seed=34).requires_grad_()
    w = randn(17, 65, dtype=dtype, seed=35).requires_grad_()
    bias = randn(17, dtype=dtype, seed=36).requires_grad_()
    out = rl_kernels.addmm(bias, a, w.t())
    g = randn(33, 17, dtype=dtype, seed=37)
    out.backward(g)
    a64, w64, b64 = (t.detach().double().requires_grad_() for t in (a, w, bias))
    torch.addmm(b64, a64, w64.t()).backward(g.double())
    tol = GEMM_TOL[dtype]
    assert rel_err(a.grad, a64.grad) <= tol
    assert rel_err(w.grad, w64.grad) <= tol
    assert rel_err(bias.grad, b64.grad) <= tol


def test_det_gemm_fp32_output_backward():
    a = randn(9, 32, dtype=torch.bfloat16, seed=38).requires_grad_()
    b = randn(32, 11, dtype=torch.bfloat16, seed=39).requires_grad_()
    out = rl_kernels.det_gemm(a, b, out_dtype=torch.float32)
    g = randn(9, 11, seed=40)
    out.backward(g)
    g16 = g.to(torch.bfloat16).double()  # the cotangent is rounded to the input dtype
    assert rel_err(a.grad, g16 @ b.double().t()) <= GEMM_TOL[torch.bfloat16]
    assert rel_err(b.grad, a.double().t() @ g16) <= GEMM_TOL[torch.bfloat16]


def test_backward_is_deterministic():
    a = randn(300, 64, seed=41).requires_grad_()
    b = randn(64, 40, seed=42).requires_grad_()
    g = randn(300, 40, seed=43)
    grads = []
    for _ in range(3):
        a.grad = b.grad = None
        rl_kernels.matmul(a, b).backward(g)
        grads.append((a.grad.clone(), b.grad.clone()))
    for ga, gb in grads[1:]:
        assert torch.equal(ga, grads[0][0]) and torch.equal(gb, grads[0][1])


# ------------------------------------------------------------------------------------------------
# torch.compile and opcheck
# ------------------------------------------------------------------------------------------------

def test_compile_fullgraph_dynamic_forward_and_backward():
    def f(x, w, bias):
        return rl_kernels.addmm(bias, x, w.t()).relu().sum(-1) + rl_kernels.matmul(x, w.t())[:, 0]

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for m in (3, 8, 17):
        x = randn(m, 16, seed=m).requires_grad_()
        w = randn(12, 16, seed=44).requires_grad_()
        bias = randn(12, seed=45).requires_grad_()
        out = compiled(x, w, bias)
        ref = f(x, w, bias)
        assert torch.equal(out, ref)
        g = randn(m, seed=46)
        grads = torch.autograd.grad(out, (x, w, bias), g)
        ref_grads = torch.autograd.grad(ref, (x, w, bias), g)
        for got, want in zip(grads, ref_grads):
            assert torch.equal(got, want)


def test_compile_inductor_fullgraph():
    compiled = torch.compile(lambda x, w: rl_kernels.det_gemm(x, w.t()) * 2, fullgraph=True,
                             dynamic=True)
    x, w = randn(5, 8, seed=47), randn(6, 8, seed=48)
    assert torch.equal(compiled(x, w), rl_kernels.det_gemm(x, w.t()) * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck(dtype):
    a = randn(5, 7, dtype=dtype, seed=49).requires_grad_()
    b = randn(7, 3, dtype=dtype, seed=50).requires_grad_()
    c = randn(3, dtype=dtype, seed=51).requires_grad_()
    torch.library.opcheck(torch.ops.rl_kernels.gemm.default, (a, b, c, 1.5, 0.5, dtype, "auto"))
    torch.library.opcheck(torch.ops.rl_kernels.gemm.default, (a, b, None, 1.0, 0.0, dtype, "cpu"))
    out = torch.empty(5, 3, dtype=dtype)
    torch.library.opcheck(torch.ops.rl_kernels.gemm_out.default,
                          (a.detach(), b.detach(), None, 1.0, 0.0, "auto", out))
