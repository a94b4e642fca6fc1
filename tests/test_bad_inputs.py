"""Unusual and bad calls of the public API: each gets torch's answer, or an exception whose type and
message name the argument (never a crash, never a silently wrong or silently accepted value).

Sections: BLAS alpha/beta = 0 semantics with Inf/NaN; double backward; valid inputs torch accepts;
non-tensor arguments; wrong Python types and values for scalars; backend= and RL_KERNELS_BACKEND;
the _C binding's messages; the self-check command.
"""

import fractions
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import rl_kernels
from rl_kernels import _C, kernel_registry
from conftest import randn, rel_err

CPU = kernel_registry.backend_code("cpu")
REF64 = rl_kernels.NativeLinearLogpOp(torch.float64)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _gemm_problem(dtype=torch.float32, m=5, k=7, n=6, seed=0):
    return (randn(m, k, dtype=dtype, seed=seed), randn(k, n, dtype=dtype, seed=seed + 1),
            randn(m, n, dtype=dtype, seed=seed + 2))


def _logp_problem(n=4, d=16, v=50, seed=0):
    h = randn(n, d, seed=seed)
    w = randn(v, d, seed=seed + 1, scale=d ** -0.5)
    t = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(seed + 2))
    return h, w, t


def _close(x, ref, tol):
    """max |x - ref| <= tol * max |ref| in fp64 (finite at any magnitude, unlike a norm)."""
    x, ref = x.double(), ref.double()
    return ((x - ref).abs().max() <= tol * ref.abs().max()).item()


def _run_python(code, **env):
    full_env = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full_env, timeout=300)


# ------------------------------------------------------------------------------------------------
# alpha == 0 does not read A @ B, beta == 0 does not read C (BLAS and torch semantics)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("poison", ["a_inf", "a_nan", "b_inf"])
def test_alpha_zero_does_not_read_a_times_b(dtype, poison):
    a, b, c = _gemm_problem(dtype)
    (a if poison.startswith("a") else b)[1, 2] = math.inf if poison.endswith("inf") else math.nan
    want = c  # BLAS: exactly beta * c
    if dtype in (torch.float32, torch.float64):  # torch's CPU bf16/fp16 addmm reads A @ B (NaN rows)
        assert torch.equal(torch.addmm(c, a, b, alpha=0), want)
        assert torch.equal(torch.addmm(c, a, b, alpha=0, beta=2), 2 * c)
    assert torch.equal(rl_kernels.gemm(0.0, a, b, 1.0, c), want)
    assert torch.equal(rl_kernels.addmm(c, a, b, alpha=0), want)
    assert torch.equal(rl_kernels.addmm(c, a, b, alpha=0, beta=2), 2 * c)
    bias = c[0].clone()  # an [N] bias broadcast over the rows
    assert torch.equal(rl_kernels.addmm(bias, a, b, alpha=0), bias.expand_as(c))
    out = torch.empty_like(c)
    assert rl_kernels.gemm(0, a, b, 1, c, out=out) is out and torch.equal(out, want)
    in_place = c.clone()
    rl_kernels.gemm(0.0, a, b, 1.0, in_place, out=in_place)
    assert torch.equal(in_place, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_beta_zero_does_not_read_c(dtype):
    a, b, c = _gemm_problem(dtype)
    c[0, 0], c[2, 3] = math.nan, -math.inf
    got = rl_kernels.addmm(c, a, b, beta=0)
    want = torch.addmm(c, a, b, beta=0)
    assert not got.isnan().any() and not want.isnan().any()
    assert torch.equal(got, rl_kernels.matmul(a, b))
    assert rel_err(got, want) <= (1e-12 if dtype == torch.float64 else 1e-2)
    assert torch.equal(rl_kernels.gemm(1.5, a, b, 0.0, c), rl_kernels.gemm(1.5, a, b, 0.0, None))
    both = rl_kernels.gemm(0.0, a, b, 0.0, c)  # neither term is read: zeros, as in torch
    assert torch.equal(both, torch.addmm(c, a, b, alpha=0, beta=0)) and not both.any()


def test_alpha_that_underflows_float32_is_zero_like_torch():
    a, b, c = _gemm_problem()
    a[0, 0] = math.inf
    want = torch.addmm(c, a, b, alpha=1e-50)  # 1e-50 is 0 in fp32: A @ B is not read
    assert torch.equal(rl_kernels.addmm(c, a, b, alpha=1e-50), want)
    assert torch.equal(rl_kernels.gemm(1e-50, a, b, 1.0, c), want)


def test_alpha_that_overflows_float32_raises_like_torch():
    a, b, c = _gemm_problem()
    with pytest.raises(RuntimeError, match="overflow"):
        torch.addmm(c, a, b, alpha=1e300)
    with pytest.raises(ValueError, match=r"addmm\(\): alpha=1e\+300 cannot be converted to float32"):
        rl_kernels.addmm(c, a, b, alpha=1e300)
    with pytest.raises(ValueError, match=r"gemm\(\): beta=-1e\+40 cannot be converted"):
        rl_kernels.gemm(1.0, a, b, -1e40, c)
    a64, b64, c64 = (x.double() for x in (a, b, c))  # fp64 scales in fp64: fine, as in torch
    assert _close(rl_kernels.addmm(c64, a64, b64, alpha=1e300),
                  torch.addmm(c64, a64, b64, alpha=1e300), 1e-13)


@pytest.mark.parametrize("alpha,beta", [(0.1, 0.3), (1.0, 1e-50), (1e300, 0.0), (0.0, 0.7)])
def test_fp64_alpha_and_beta_are_not_rounded_to_float32(alpha, beta):
    a, b, c = _gemm_problem(torch.float64)
    want = torch.addmm(c, a, b, alpha=alpha, beta=beta)
    assert _close(rl_kernels.addmm(c, a, b, alpha=alpha, beta=beta), want, 1e-13)
    assert _close(rl_kernels.gemm(alpha, a, b, beta, c), want, 1e-13)
    out = c.clone()
    rl_kernels.gemm(alpha, a, b, beta, out, out=out)
    assert _close(out, want, 1e-13)
    # the gradients use the same alpha and beta
    a_, b_, c_ = (x.clone().requires_grad_() for x in (a, b, c))
    a2, b2, c2 = (x.clone().requires_grad_() for x in (a, b, c))
    g = randn(*want.shape, dtype=torch.float64, seed=9)
    rl_kernels.addmm(c_, a_, b_, alpha=alpha, beta=beta).backward(g)
    torch.addmm(c2, a2, b2, alpha=alpha, beta=beta).backward(g)
    for got, ref in ((a_.grad, a2.grad), (b_.grad, b2.grad), (c_.grad, c2.grad)):
        assert _close(got, ref, 1e-13)


def test_gradients_with_alpha_or_beta_zero():
    a, b, c = _gemm_problem()
    a[1, 1] = math.inf
    c[0, 0] = math.nan
    a.requires_grad_(), b.requires_grad_(), c.requires_grad_()
    rl_kernels.addmm(c, a, b, alpha=0).sum().backward()
    # alpha == 0: a @ b is not part of the result, so its gradients are exactly 0 (torch multiplies
    # an Inf by 0 in its backward and gives NaN in b's gradient; BLAS semantics give 0)
    assert not a.grad.any() and not b.grad.any()
    assert torch.equal(c.grad, torch.ones_like(c))
    for t in (a, b, c):
        t.grad = None
    rl_kernels.addmm(c, a.detach().nan_to_num(), b, beta=0).sum().backward()
    c_ref = c.detach().clone().requires_grad_()
    torch.addmm(c_ref, a.detach().nan_to_num(), b.detach(), beta=0).sum().backward()
    assert torch.equal(c.grad, c_ref.grad) and not c.grad.any()


# ------------------------------------------------------------------------------------------------
# Double backward: linear_logp raises, the GEMM ops work
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("through", ["logp", "entropy"])
def test_linear_logp_double_backward_raises(through):
    h, w, t = _logp_problem()
    h.requires_grad_(), w.requires_grad_()
    logp, entropy = rl_kernels.linear_logp(h, w, t, return_entropy=True)
    loss = (logp if through == "logp" else entropy).sum()
    grad_h, = torch.autograd.grad(loss, h, create_graph=True)
    # create_graph alone is fine and gives the ordinary first-order gradient
    ref_h, = torch.autograd.grad(
        (rl_kernels.linear_logp(h, w, t, return_entropy=True)[0 if through == "logp" else 1]).sum(), h)
    assert torch.equal(grad_h, ref_h)
    with pytest.raises(RuntimeError, match="linear_logp: second-order gradients"):
        grad_h.square().sum().backward()
    with pytest.raises(RuntimeError, match="linear_logp: second-order gradients"):
        torch.autograd.grad(grad_h.sum(), w)


@pytest.mark.parametrize("op", ["matmul", "det_gemm", "addmm", "gemm"])
def test_gemm_ops_support_double_backward(op):
    a, b, c = (x.double().requires_grad_() for x in _gemm_problem(m=3, k=4, n=5))
    fns = {"matmul": lambda a, b, c: rl_kernels.matmul(a, b),
           "det_gemm": lambda a, b, c: rl_kernels.det_gemm(a, b),
           "addmm": lambda a, b, c: rl_kernels.addmm(c, a, b, alpha=0.5, beta=2.0),
           "gemm": lambda a, b, c: rl_kernels.gemm(0.5, a, b, 2.0, c)}
    assert torch.autograd.gradgradcheck(fns[op], (a, b, c))


# ------------------------------------------------------------------------------------------------
# Valid inputs (torch accepts them): same answer as torch / as the plain form
# ------------------------------------------------------------------------------------------------

def test_gemm_with_column_major_c():
    a, b, c = _gemm_problem()
    c_cm = c.t().contiguous().t()  # same values, column-major
    assert c_cm.stride() == (1, c.shape[0])
    got = rl_kernels.gemm(1.5, a, b, 0.5, c_cm)
    assert torch.equal(got, rl_kernels.gemm(1.5, a, b, 0.5, c))
    assert rel_err(got, torch.addmm(c_cm, a, b, alpha=1.5, beta=0.5)) <= 1e-6
    assert torch.equal(rl_kernels.addmm(c_cm, a, b), rl_kernels.addmm(c, a, b))
    result = rl_kernels.gemm(1.5, a, b, 0.5, c_cm, out=c_cm)  # BLAS in-place update of c
    assert result is c_cm and c_cm.stride() == (1, c.shape[0]) and torch.equal(c_cm, got)


def test_det_gemm_fp64_to_fp32():
    a, b, _ = _gemm_problem(torch.float64)
    got = rl_kernels.det_gemm(a, b, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    assert rel_err(got, a @ b) <= 1e-7
    assert torch.equal(rl_kernels.det_gemm(a[2:3], b, out_dtype=torch.float32), got[2:3])


@pytest.mark.parametrize("temperature", [np.float32(0.5), np.float64(0.5), torch.tensor(0.5),
                                         torch.tensor(0.5, dtype=torch.float64),
                                         fractions.Fraction(1, 2)], ids=type)
def test_linear_logp_temperature_as_numpy_tensor_or_fraction(temperature):
    h, w, t = _logp_problem()
    assert torch.equal(rl_kernels.linear_logp(h, w, t, temperature=temperature),
                       rl_kernels.linear_logp(h, w, t, temperature=0.5))
    assert torch.equal(rl_kernels.linear_logp(h, w, t, temperature=2),  # an int
                       rl_kernels.linear_logp(h, w, t, temperature=2.0))


@pytest.mark.parametrize("ignore_index", [np.int64(3), np.int32(3), torch.tensor(3)], ids=type)
def test_linear_logp_ignore_index_as_numpy_or_tensor(ignore_index):
    h, w, t = _logp_problem()
    t[1] = 3
    got = rl_kernels.linear_logp(h, w, t, ignore_index=ignore_index)
    assert torch.equal(got, rl_kernels.linear_logp(h, w, t, ignore_index=3)) and got[1] == 0


def test_linear_logp_return_entropy_numpy_bool():
    h, w, t = _logp_problem()
    logp, entropy = rl_kernels.linear_logp(h, w, t, return_entropy=np.bool_(True))
    assert torch.equal(logp, rl_kernels.linear_logp(h, w, t))
    assert rl_kernels.linear_logp(h, w, t, return_entropy=np.bool_(False)).shape == t.shape


# expanded (stride-0) inputs, as leaves of the expand: (hidden leaf, how to expand it), (weight ...)
EXPANDED = {
    "hidden_rows": (lambda h: h[:1], lambda x: x.expand(6, 16), None, None),
    "hidden_scalar": (lambda h: h[0, 0], lambda x: x.expand(6, 16), None, None),
    "weight_rows": (None, None, lambda w: w[:1], lambda x: x.expand(50, 16)),
    "both": (lambda h: h[:, :1], lambda x: x.expand(6, 16), lambda w: w[:1], lambda x: x.expand(50, 16)),
}


@pytest.mark.parametrize("which", list(EXPANDED))
def test_linear_logp_expanded_inputs(which):
    """A stride-0 hidden or weight gives the values and gradients of its contiguous copy."""
    h, w, t = _logp_problem(n=6, d=16, v=50)
    pick_h, expand_h, pick_w, expand_w = EXPANDED[which]
    h_leaf = (pick_h(h) if pick_h else h).clone().requires_grad_()
    w_leaf = (pick_w(w) if pick_w else w).clone().requires_grad_()
    h_ref, w_ref = h_leaf.detach().clone().requires_grad_(), w_leaf.detach().clone().requires_grad_()
    h_in = expand_h(h_leaf) if expand_h else h_leaf
    w_in = expand_w(w_leaf) if expand_w else w_leaf
    assert 0 in h_in.stride() + w_in.stride()
    got = rl_kernels.linear_logp(h_in, w_in, t, return_entropy=True)
    want = rl_kernels.linear_logp((expand_h(h_ref) if expand_h else h_ref).contiguous(),
                                  (expand_w(w_ref) if expand_w else w_ref).contiguous(), t,
                                  return_entropy=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert (got[0].double() - REF64(h_in, w_in, t)).abs().max() <= 1e-5
    (got[0].sum() + got[1].sum()).backward()
    (want[0].sum() + want[1].sum()).backward()
    assert torch.equal(h_leaf.grad, h_ref.grad) and torch.equal(w_leaf.grad, w_ref.grad)


def test_gemm_scalars_as_numpy_and_0d_tensors():
    a, b, c = _gemm_problem()
    want = rl_kernels.addmm(c, a, b, alpha=2.0, beta=0.5)
    assert torch.equal(rl_kernels.addmm(c, a, b, alpha=np.float32(2), beta=torch.tensor(0.5)), want)
    assert torch.equal(rl_kernels.gemm(torch.tensor(2), a, b, np.float64(0.5), c), want)
    assert torch.equal(rl_kernels.gemm(2, a, b, fractions.Fraction(1, 2), c), want)


# ------------------------------------------------------------------------------------------------
# Non-tensor arguments: TypeError "<op>(): <name> must be a torch.Tensor, got <type>"
# ------------------------------------------------------------------------------------------------

NOT_TENSORS = [[[1.0, 2.0]], ((1.0, 2.0),), None, np.ones((2, 2), np.float32), 3.0, "x"]
_TYPE = {list: "list", tuple: "tuple", type(None): "NoneType", np.ndarray: r"numpy\.ndarray",
         float: "float", str: "str"}


def _tensor_arg_calls():
    a, b, c = _gemm_problem()
    h, w, t = _logp_problem()
    return [
        ("matmul", "input", lambda x: rl_kernels.matmul(x, b)),
        ("matmul", "other", lambda x: rl_kernels.matmul(a, x)),
        ("matmul", "out", lambda x: rl_kernels.matmul(a, b, out=x) if x is not None else
         rl_kernels.matmul(a, b, out=[1.0])),
        ("det_gemm", "a", lambda x: rl_kernels.det_gemm(x, b)),
        ("det_gemm", "b", lambda x: rl_kernels.det_gemm(a, x)),
        ("addmm", "input", lambda x: rl_kernels.addmm(x, a, b)),
        ("addmm", "mat1", lambda x: rl_kernels.addmm(c, x, b)),
        ("addmm", "mat2", lambda x: rl_kernels.addmm(c, a, x)),
        ("gemm", "a", lambda x: rl_kernels.gemm(1.0, x, b, 1.0, c)),
        ("gemm", "b", lambda x: rl_kernels.gemm(1.0, a, x, 1.0, c)),
        ("gemm", "c", lambda x: rl_kernels.gemm(1.0, a, b, 1.0, x if x is not None else [0.0])),
        ("linear_logp", "hidden", lambda x: rl_kernels.linear_logp(x, w, t)),
        ("linear_logp", "weight", lambda x: rl_kernels.linear_logp(h, x, t)),
        ("linear_logp", "target", lambda x: rl_kernels.linear_logp(h, w, x)),
        ("linear_logp", "bias", lambda x: rl_kernels.linear_logp(h, w, t, x if x is not None else [0.0])),
    ]


_TENSOR_ARGS = [f"{op}-{name}" for op, name, _ in _tensor_arg_calls()]


@pytest.mark.parametrize("bad", NOT_TENSORS, ids=lambda x: type(x).__name__)
@pytest.mark.parametrize("case", range(len(_TENSOR_ARGS)), ids=_TENSOR_ARGS)
def test_non_tensor_arguments_raise_type_error_naming_them(case, bad):
    op, name, call = _tensor_arg_calls()[case]
    type_name = "list" if bad is None and name in ("out", "c", "bias") else _TYPE[type(bad)]
    with pytest.raises(TypeError, match=rf"^{op}\(\): {name} must be a torch\.Tensor, got {type_name}$"):
        call(bad)


@pytest.mark.parametrize("op", ["matmul", "det_gemm", "addmm", "linear_logp"])
def test_sparse_inputs_are_refused_by_name(op):
    a, b, c = _gemm_problem()
    h, w, t = _logp_problem()
    calls = {"matmul": (lambda: rl_kernels.matmul(a, b.to_sparse()), "other"),
             "det_gemm": (lambda: rl_kernels.det_gemm(a, b.to_sparse()), "b"),
             "addmm": (lambda: rl_kernels.addmm(c, a, b.to_sparse()), "mat2"),
             "linear_logp": (lambda: rl_kernels.linear_logp(h.to_sparse(), w, t), "hidden")}
    call, name = calls[op]
    with pytest.raises(TypeError, match=rf"{op}\(\): {name} must be a dense \(strided\) tensor, "
                                        rf"got layout torch\.sparse"):
        call()


# ------------------------------------------------------------------------------------------------
# Scalars of the wrong Python type or value
# ------------------------------------------------------------------------------------------------

BAD_GEMM_SCALARS = [
    ("2", TypeError, "must be a real number, got str"),
    (None, TypeError, "must be a real number, got NoneType"),
    (True, TypeError, "must be a real number, got bool"),
    (1j, TypeError, "must be a real number, got complex"),
    ([1.0], TypeError, "must be a real number, got list"),
    (torch.tensor([1.0, 2.0]), TypeError, "must be a real number or a 0-d real tensor, got a 1-d"),
    (torch.tensor(True), TypeError, "must be a real number or a 0-d real tensor, got a 0-d torch.bool"),
    (torch.tensor(2.0, requires_grad=True), TypeError, "is a tensor that requires grad"),
    (10 ** 400, ValueError, r"\(an int of 1329 bits\) does not fit in a float64"),
]


@pytest.mark.parametrize("value,exc,message", BAD_GEMM_SCALARS, ids=lambda x: repr(x)[:20])
@pytest.mark.parametrize("op,name", [("addmm", "alpha"), ("addmm", "beta"), ("gemm", "alpha"),
                                     ("gemm", "beta")])
def test_bad_alpha_beta(op, name, value, exc, message):
    a, b, c = _gemm_problem()
    if op == "addmm":
        call = lambda: rl_kernels.addmm(c, a, b, **{name: value})  # noqa: E731
    else:
        call = lambda: rl_kernels.gemm(value if name == "alpha" else 1.0, a, b,  # noqa: E731
                                       value if name == "beta" else 1.0, c)
    with pytest.raises(exc, match=rf"^{op}\(\): {name} {message}"):
        call()


BAD_LOGP_ARGS = [
    (dict(temperature=True), TypeError, "temperature must be a real number, got bool"),
    (dict(temperature="0.5"), TypeError, "temperature must be a real number, got str"),
    (dict(temperature=None), TypeError, "temperature must be a real number, got NoneType"),
    (dict(temperature=torch.tensor([0.5])), TypeError, "temperature must be a real number or a 0-d"),
    (dict(temperature=torch.tensor(0.5, requires_grad=True)), TypeError,
     "temperature is a tensor that requires grad"),
    (dict(temperature=0), ValueError, "temperature must be a finite number > 0, got 0.0"),
    (dict(temperature=-1.0), ValueError, "temperature must be a finite number > 0, got -1.0"),
    (dict(temperature=math.inf), ValueError, "temperature must be a finite number > 0, got inf"),
    (dict(temperature=math.nan), ValueError, "temperature must be a finite number > 0, got nan"),
    (dict(temperature=1e-40), ValueError, "temperature 1e-40 is too small: 1 / temperature overflows"),
    (dict(ignore_index=1.7), TypeError, "ignore_index must be an int, got float"),
    (dict(ignore_index=True), TypeError, "ignore_index must be an int, got bool"),
    (dict(ignore_index="-100"), TypeError, "ignore_index must be an int, got str"),
    (dict(ignore_index=None), TypeError, "ignore_index must be an int, got NoneType"),
    (dict(ignore_index=np.float64(3)), TypeError, r"ignore_index must be an int, got numpy\.float64"),
    (dict(ignore_index=torch.tensor(1.0)), TypeError, "ignore_index must be an int or a 0-d integer"),
    (dict(ignore_index=2 ** 70), ValueError, "ignore_index 1180591620717411303424 does not fit in int64"),
    (dict(ignore_index=-2 ** 63 - 1), ValueError, "ignore_index -9223372036854775809 does not fit in"),
    (dict(return_entropy="no"), TypeError, "return_entropy must be a bool, got str"),
    (dict(return_entropy=1), TypeError, "return_entropy must be a bool, got int"),
    (dict(return_entropy=None), TypeError, "return_entropy must be a bool, got NoneType"),
]


@pytest.mark.parametrize("kwargs,exc,message", BAD_LOGP_ARGS, ids=lambda x: repr(x)[:40])
def test_bad_linear_logp_scalars(kwargs, exc, message):
    h, w, t = _logp_problem()
    with pytest.raises(exc, match=rf"^linear_logp\(\): {message}"):
        rl_kernels.linear_logp(h, w, t, **kwargs)


def test_extreme_valid_temperatures_match_the_reference():
    h, w, t = _logp_problem()
    for temperature in (1e-30, 1e30):
        got = rl_kernels.linear_logp(h, w, t, temperature=temperature)
        assert torch.equal(got.isnan(), REF64(h, w, t, temperature=temperature).isnan())
        assert rel_err(got, REF64(h, w, t, temperature=temperature)) <= 1e-6


@pytest.mark.parametrize("temperature", [0, 0.0, -0.5, math.nan, math.inf, torch.tensor(0.0)])
def test_native_reference_refuses_bad_temperature(temperature):
    h, w, t = _logp_problem()
    with pytest.raises(ValueError, match=r"NativeLinearLogpOp\(\): temperature must be a finite "
                                         r"number > 0"):
        REF64(h, w, t, temperature=temperature)


def test_native_reference_keeps_a_tensor_temperature_differentiable():
    h, w, t = _logp_problem()
    temperature = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    REF64(h, w, t, temperature=temperature).sum().backward()
    assert temperature.grad is not None and torch.isfinite(temperature.grad)


@pytest.mark.parametrize("out_dtype,message", [
    ("float32", r"out_dtype must be None or a torch\.dtype, got 'float32' \(str\)"),
    (np.float32, r"out_dtype must be None or a torch\.dtype, got <class 'numpy\.float32'> \(type\)"),
    (torch.float64, r"out_dtype must be None or torch\.float32, got torch\.float64"),
    (torch.int32, r"out_dtype must be None or torch\.float32, got torch\.int32"),
])
def test_det_gemm_bad_out_dtype(out_dtype, message):
    a, b, _ = _gemm_problem()
    with pytest.raises(TypeError, match=rf"^det_gemm\(\): {message}$"):
        rl_kernels.det_gemm(a, b, out_dtype=out_dtype)


def test_det_gemm_out_dtype_message_lists_what_is_allowed():
    a, b, _ = _gemm_problem(torch.bfloat16)
    with pytest.raises(TypeError, match=r"out_dtype must be None, torch\.bfloat16 or torch\.float32, "
                                        r"got torch\.float16$"):
        rl_kernels.det_gemm(a, b, out_dtype=torch.float16)
    a, b, _ = _gemm_problem(torch.float64)
    with pytest.raises(TypeError, match=r"out_dtype must be None, torch\.float64 or torch\.float32, "
                                        r"got torch\.bfloat16$"):
        rl_kernels.det_gemm(a, b, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("bad,exc,message", [
    (True, TypeError, r"^set_num_threads\(\): n must be an int, got bool$"),
    (False, TypeError, r"^set_num_threads\(\): n must be an int, got bool$"),
    ("2", TypeError, r"^set_num_threads\(\): n must be an int, got str$"),
    (2.0, TypeError, r"^set_num_threads\(\): n must be an int, got float$"),
    (None, TypeError, r"^set_num_threads\(\): n must be an int, got NoneType$"),
    (-1, ValueError, r"^set_num_threads\(\): n must be >= 0 \(0: OpenMP's default\), got -1$"),
    (2 ** 40, ValueError, r"^set_num_threads\(\): n must be at most 2147483647, got 1099511627776$"),
])
def test_set_num_threads_bad_values(bad, exc, message):
    rl_kernels.set_num_threads(3)
    with pytest.raises(exc, match=message):
        rl_kernels.set_num_threads(bad)
    assert rl_kernels.get_num_threads() == 3  # a refused call changes nothing


@pytest.mark.parametrize("value", [0, 1, 2, np.int64(2), torch.tensor(2)])
def test_set_num_threads_takes_ints(value):
    rl_kernels.set_num_threads(value)
    if value:
        assert rl_kernels.get_num_threads() == int(value)


# ------------------------------------------------------------------------------------------------
# backend= and RL_KERNELS_BACKEND
# ------------------------------------------------------------------------------------------------

def _backend_calls():
    a, b, c = _gemm_problem()
    h, w, t = _logp_problem()
    return {
        "matmul": lambda be: rl_kernels.matmul(a, b, backend=be),
        "matmul3d": lambda be: rl_kernels.matmul(a[None], b, backend=be),
        "det_gemm": lambda be: rl_kernels.det_gemm(a, b, backend=be),
        "det_gemm3d": lambda be: rl_kernels.det_gemm(a[None], b, backend=be),
        "addmm": lambda be: rl_kernels.addmm(c, a, b, backend=be),
        "gemm": lambda be: rl_kernels.gemm(1.0, a, b, 1.0, c, backend=be),
        "linear_logp": lambda be: rl_kernels.linear_logp(h, w, t, backend=be),
        **_row_and_attention_backend_calls(),
    }


def _row_and_attention_backend_calls():
    x, weight = randn(3, 8), randn(8, seed=1)
    x_grad = randn(3, 8, seed=2).requires_grad_()  # through the registered op (autograd)
    q, k, v = (randn(2, 5, 4, 8, seed=s) for s in (3, 4, 5))
    q_grad = randn(2, 5, 4, 8, seed=6).requires_grad_()
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    k_cache, v_cache = randn(2, 9, 4, 8, seed=7), randn(2, 9, 4, 8, seed=8)
    return {
        "rms_norm": lambda be: rl_kernels.rms_norm(x, weight, backend=be),
        "rms_norm_grad": lambda be: rl_kernels.rms_norm(x_grad, weight, backend=be),
        "softmax": lambda be: rl_kernels.softmax(x, backend=be),
        "softmax_grad": lambda be: rl_kernels.softmax(x_grad, backend=be),
        "log_softmax": lambda be: rl_kernels.log_softmax(x, backend=be),
        "row_sum": lambda be: rl_kernels.row_sum(x, backend=be),
        "row_sum_grad": lambda be: rl_kernels.row_sum(x_grad, backend=be),
        "row_mean": lambda be: rl_kernels.row_mean(x, backend=be),
        "attention": lambda be: rl_kernels.attention(q, k, v, backend=be),
        "attention_grad": lambda be: rl_kernels.attention(q_grad, k, v, backend=be),
        "attention_packed": lambda be: rl_kernels.attention(
            q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, backend=be),
        "attention_with_kvcache": lambda be: rl_kernels.attention_with_kvcache(
            q[:, :1], k_cache, v_cache, 4, backend=be),
    }


def _op_of(call):
    """The public function a _backend_calls entry calls: its name less the variant suffix."""
    for suffix in ("3d", "_grad", "_packed"):
        call = call.removesuffix(suffix)
    return call


@pytest.mark.parametrize("call", list(_backend_calls()))
@pytest.mark.parametrize("backend,exc,message", [
    ("", ValueError, r"unknown backend ''; expected None, 'auto', 'sm90', 'sm80', 'cpu'"),
    ("CPU", ValueError, r"unknown backend 'CPU' \(did you mean 'cpu'\?\)"),
    ("cpu ", ValueError, r"unknown backend 'cpu ' \(did you mean 'cpu'\?\)"),
    ("tpu", ValueError, r"unknown backend 'tpu'; expected"),
    (0, TypeError, r"backend must be a str \(None, 'auto', 'sm90', 'sm80', 'cpu'\), got int"),
    (False, TypeError, r"backend must be a str .*, got bool"),
    (["cpu"], TypeError, r"backend must be a str .*, got list"),
])
def test_bad_backend_argument(call, backend, exc, message):
    op = _op_of(call)
    with pytest.raises(exc, match=rf"^{op}\(\): {message}"):
        _backend_calls()[call](backend)


@pytest.mark.parametrize("call", list(_backend_calls()))
def test_backend_auto_and_cpu_run(call):
    run = _backend_calls()[call]
    assert torch.equal(run("auto"), run(None)) and torch.equal(run("cpu"), run(None))


def test_get_op_backend_arguments():
    assert rl_kernels.get_op("matmul", backend="auto").backend is None
    with pytest.raises(ValueError, match=r"unknown backend 'CPU' \(did you mean 'cpu'\?\)"):
        rl_kernels.get_op("matmul", backend="CPU")
    with pytest.raises(TypeError, match=r"backend must be a str \(one of sm90, sm80, cpu\), got list"):
        rl_kernels.get_op("matmul", backend=["cpu"])
    with pytest.raises(TypeError, match=r"op name must be a str .*, got list"):
        rl_kernels.get_op(["matmul"])


@pytest.mark.parametrize("value", ["bogus", "CPU", "cpu ", " sm80"])
def test_env_var_typo_is_refused_at_import_naming_the_variable(value):
    result = _run_python("import rl_kernels", RL_KERNELS_BACKEND=value)
    assert result.returncode != 0
    assert f"ValueError: RL_KERNELS_BACKEND={value!r} is not a backend" in result.stderr
    if value != "bogus":
        assert f"(did you mean {value.strip().lower()!r}?)" in result.stderr, result.stderr


def test_env_var_typo_fails_the_self_check_command():
    result = subprocess.run([sys.executable, "-m", "rl_kernels"], capture_output=True, text=True,
                            env=dict(os.environ, RL_KERNELS_BACKEND="Cpu"), timeout=300)
    assert result.returncode != 0 and "PASS" not in result.stdout
    assert "RL_KERNELS_BACKEND='Cpu' is not a backend" in result.stderr


def test_env_var_forcing_an_unusable_backend_names_the_variable():
    # CPU tensors with a CUDA backend forced: every call fails, and says the variable did it
    code = ("import torch, rl_kernels\n"
            "h, w, t = torch.ones(1, 2), torch.ones(3, 2), torch.zeros(1, dtype=torch.long)\n"
            "for f in (lambda: rl_kernels.matmul(torch.ones(2, 2), torch.ones(2, 2)),\n"
            "          lambda: rl_kernels.linear_logp(h, w, t)):\n"
            "    try:\n"
            "        f()\n"
            "    except RuntimeError as e:\n"
            "        print('RuntimeError', e)\n"
            "print(rl_kernels.kernel_registry.format_table().splitlines()[-1])\n")
    result = _run_python(code, RL_KERNELS_BACKEND="sm80")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3, result.stdout
    for line in lines[:2]:
        assert "backend 'sm80' (set by RL_KERNELS_BACKEND=sm80) runs on CUDA tensors, got CPU" in line
    assert lines[2].startswith("RL_KERNELS_BACKEND=sm80: every call without backend= runs on sm80")


@pytest.mark.parametrize("value", ["", "auto"])
def test_env_var_empty_or_auto_routes_by_device(value):
    result = _run_python("import torch, rl_kernels; print(rl_kernels.kernel_registry"
                         ".resolve_backend('matmul', torch.device('cpu')))", RL_KERNELS_BACKEND=value)
    assert result.returncode == 0 and result.stdout.strip() == "cpu", result.stderr


# ------------------------------------------------------------------------------------------------
# _C: messages name the argument (dtype, byte order)
# ------------------------------------------------------------------------------------------------

def test_binding_int32_target_names_it():
    h, w, t = _logp_problem()
    n = t.shape[0]
    with pytest.raises(TypeError, match="^target: expected dtype int64, got int32$"):
        _C.linear_logp_fwd(h, w, None, t.int(), torch.empty(n), torch.empty(n), torch.empty(n), 0,
                           1.0, -100, CPU, 0)
    with pytest.raises(TypeError, match=r"^linear_logp\(\): target must be int64, got torch\.int32$"):
        rl_kernels.linear_logp(h, w, t.int())


@pytest.mark.parametrize("which", ["a", "b", "out"])
def test_binding_big_endian_array_names_it(which):
    arrays = {"a": np.ones((4, 3), np.float32), "b": np.ones((3, 2), np.float32),
              "out": np.zeros((4, 2), np.float32)}
    arrays[which] = arrays[which].astype(">f4")
    with pytest.raises(TypeError, match=f"^{which}: cannot be exported through DLPack: .*byte order"):
        _C.gemm(arrays["a"], arrays["b"], None, arrays["out"], 1.0, 0.0, CPU, 0)


# ------------------------------------------------------------------------------------------------
# python -m rl_kernels
# ------------------------------------------------------------------------------------------------

def test_self_check_output_is_accurate_and_explained():
    result = subprocess.run([sys.executable, "-m", "rl_kernels"], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "CUDA support" not in out  # the build and the device are reported separately
    compiled = sorted({backend for _, backend, _ in _C.kernels()})
    assert all(b in out.split("build: backends compiled = ")[1].splitlines()[0] for b in compiled)
    if not torch.cuda.is_available():
        assert "CUDA not available" in out and "device: no CUDA device" in out
    for op in ("matmul", "det_gemm", "addmm", "gemm", "linear_logp"):
        for dtype in ("float32", "bfloat16", "float16"):
            assert any(line.split()[:3] == [op, "cpu", dtype] and line.split()[3] == "PASS"
                       for line in out.splitlines()), (op, dtype)
    assert "err: max |out - fp64| / max |fp64|" in out  # the err column says what it measures
    assert out.rstrip().endswith("self-check: PASS")


def test_self_check_help():
    result = subprocess.run([sys.executable, "-m", "rl_kernels", "--help"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.startswith("usage: python -m rl_kernels")
    assert "self-check" not in result.stdout.splitlines()[-1]  # --help does not run the check
    bad = subprocess.run([sys.executable, "-m", "rl_kernels", "chek"], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "invalid choice: 'chek'" in bad.stderr


@pytest.mark.parametrize("args,env,message", [
    (["--help"], {}, "--tokens TOKENS"),  # the demo's own help, not the self-check's
    (["--tokens", "-5"], {}, "argument --tokens: -5 is not >= 1"),
    (["--tokens", "x"], {}, "argument --tokens: 'x' is not an integer"),
    ([], {"RL_KERNELS_DEMO_DEVICE": "tpu"}, "argument --device: invalid choice: 'tpu'"),
    ([], {"RL_KERNELS_DEMO_DTYPE": "int8"}, "argument --dtype: invalid choice: 'int8'"),
    ([], {"RL_KERNELS_DEMO_TOKENS": "abc"}, "argument --tokens: 'abc' is not an integer"),
])
def test_demo_options_through_the_package_command(args, env, message):
    """python -m rl_kernels demo takes the demo's options, and checks the environment's values as it
    checks them (before building anything)."""
    result = subprocess.run([sys.executable, "-m", "rl_kernels", "demo", *args], capture_output=True,
                            text=True, timeout=300, env={**os.environ, **env})
    assert result.returncode == (0 if args == ["--help"] else 2), result.stderr
    assert message in result.stdout + result.stderr


# ------------------------------------------------------------------------------------------------
# the C sources compile without warnings
# ------------------------------------------------------------------------------------------------

def test_cpu_attention_compiles_without_maybe_uninitialized(tmp_path):
    """csrc/cpu/attention.c with the flags the extension is built with: Python's CFLAGS (whose
    -fwrapv is what let gcc 12 doubt that visible[rows - 1] was set) and setup.py's own."""
    import shlex
    import shutil
    import sysconfig
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    if shutil.which(cc[0]) is None:
        pytest.skip(f"no C compiler ({cc[0]})")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    flags = shlex.split(sysconfig.get_config_var("CFLAGS") or "") + [
        "-std=c11", "-O3", "-fopenmp", "-ffp-contract=off", "-Wall", "-Wextra",
        "-Wno-unused-parameter", "-Werror=maybe-uninitialized", "-Werror=uninitialized", "-fPIC",
        f"-I{os.path.join(root, 'csrc')}", f"-I{sysconfig.get_paths()['include']}"]
    result = subprocess.run([*cc, *flags, "-c", os.path.join(root, "csrc", "cpu", "attention.c"),
                             "-o", str(tmp_path / "attention.o")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "uninitialized" not in result.stderr, result.stderr


@pytest.mark.parametrize("bad, error", [("", ValueError), ("CPU", ValueError), (3, TypeError)])
def test_op_modules_check_backend_when_built(bad, error):
    for cls in rl_kernels.modules.OpModule.registered():
        with pytest.raises(error, match="backend"):
            cls(backend=bad)
        assert cls(backend="cpu").backend == "cpu"


# --------------------------------------------------------------------------------------------
# Cases an API fuzz found (session 39): torch's answer, or an error naming the argument
# --------------------------------------------------------------------------------------------

def _sdpa_ref(q, k, v, **kwargs):
    """torch SDPA on [B, T, H, d] tensors, in fp64."""
    out = torch.nn.functional.scaled_dot_product_attention(
        *(t.double().transpose(1, 2) for t in (q, k, v)), **kwargs)
    return out.transpose(1, 2)


@pytest.mark.parametrize("op", ["attention", "attention_with_kvcache"])
def test_attention_head_dim_zero_is_torchs_empty_answer(op):
    q, k = torch.randn(1, 2, 2, 0), torch.randn(1, 4, 1, 0)
    if op == "attention":
        out = rl_kernels.attention(q, k[:, :2], k[:, :2].clone(), backend="cpu")
    else:
        out = rl_kernels.attention_with_kvcache(q, k, k.clone(), 2, backend="cpu")
    assert out.shape == q.shape


def test_kvcache_append_leaves_the_cache_alone_when_the_call_is_refused():
    k_cache, v_cache = torch.zeros(1, 4, 2, 4), torch.zeros(1, 4, 2, 4)
    new = torch.ones(1, 1, 2, 4)
    for backend in ("sm90", "sm80"):  # CUDA backends on CPU tensors: refused
        with pytest.raises(RuntimeError, match=backend):
            rl_kernels.attention_with_kvcache(torch.randn(1, 1, 2, 4), k_cache, v_cache, 2,
                                              k_new=new, v_new=new, backend=backend)
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("cached,t_new", [(2 ** 31, 0), (2 ** 70, 0), (9, 0), (-1, 0), (4, 1)])
def test_kvcache_int_cache_seqlens_out_of_range_names_it(cached, t_new):
    k_cache, v_cache = torch.zeros(1, 4, 2, 4), torch.zeros(1, 4, 2, 4)
    new = {"k_new": torch.ones(1, t_new, 2, 4), "v_new": torch.ones(1, t_new, 2, 4)} if t_new else {}
    with pytest.raises(ValueError, match="cache_seqlens"):
        rl_kernels.attention_with_kvcache(torch.randn(1, 1, 2, 4), k_cache, v_cache, cached, **new)
    assert not k_cache.any()


def test_kvcache_tensor_cache_seqlens_past_the_cache_names_it():
    k_cache = torch.zeros(2, 4, 2, 4)
    with pytest.raises(ValueError, match="cache_seqlens"):
        rl_kernels.attention_with_kvcache(torch.randn(2, 1, 2, 4), k_cache, k_cache.clone(),
                                          torch.tensor([2, 5], dtype=torch.int32))


@pytest.mark.parametrize("value,exc", [("5", TypeError), (5.9, TypeError), (True, TypeError),
                                       (-1, ValueError), (6, ValueError)])
@pytest.mark.parametrize("name", ["max_seqlen_q", "max_seqlen_k"])
def test_attention_bad_max_seqlen_names_it(name, value, exc):
    q = torch.randn(1, 5, 1, 4)
    with pytest.raises(exc, match=name):
        rl_kernels.attention(q, q.clone(), q.clone(), **{name: value})


def test_attention_packed_bad_max_seqlen_names_it():
    q, cu = torch.randn(5, 1, 4), torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        rl_kernels.attention(q, q.clone(), q.clone(), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6)
    out = rl_kernels.attention(q, q.clone(), q.clone(), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4)
    assert torch.equal(out, rl_kernels.attention(q, q.clone(), q.clone(), cu_seqlens_q=cu, cu_seqlens_k=cu))


def test_attention_fp64_takes_softmax_scale_as_a_double():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 6, 2, 8, dtype=torch.float64) for _ in range(3))
    for scale in (None, 0.1, 1 / 3):
        kwargs = {} if scale is None else {"scale": scale}
        ref = _sdpa_ref(q, k, v, is_causal=True, **kwargs)
        out = rl_kernels.attention(q, k, v, softmax_scale=scale, backend="cpu")
        assert (out - ref).abs().max().item() < 1e-13  # fp32-rounded scale: ~2e-8


def test_attention_q_with_overlapping_rows():
    # a view whose empty_like has a strided head dim (torch orders an overlapping view's dims by
    # stride): out and dq are allocated dense instead
    base = torch.randn(20, dtype=torch.float64, requires_grad=True)
    q = torch.as_strided(base, (1, 3, 1, 4), (12, 1, 4, 1))
    assert torch.empty_like(q).stride()[-1] != 1
    k, v = (torch.randn(1, 3, 1, 4, dtype=torch.float64) for _ in range(2))
    g = torch.randn(1, 3, 1, 4, dtype=torch.float64)
    out = rl_kernels.attention(q, k, v, backend="cpu")
    ref = _sdpa_ref(q.contiguous(), k, v, is_causal=True)  # (torch 2.13's CPU SDPA misreads this q)
    assert (out - ref).abs().max() < 1e-12
    out.backward(g)
    ours = base.grad.clone()
    base.grad = None
    ref.backward(g)
    assert (ours - base.grad).abs().max() < 1e-12


def test_mode_refuses_duplicate_reduction_dims_like_torch():
    x = torch.randn(2, 3, 4)
    for dims in ((1, 1), (-1, 2), (0, -3)):
        with pytest.raises(RuntimeError, match="appears multiple times"):
            x.sum(dims)
        with rl_kernels.batch_invariant(), pytest.raises(RuntimeError, match="appears multiple times"):
            x.sum(dims)
        with rl_kernels.batch_invariant(), pytest.raises(RuntimeError, match="appears multiple times"):
            x.mean(dims)


def test_mode_sdpa_with_a_negative_scale_is_torchs_answer():
    q = torch.randn(1, 1, 3, 4)
    ref = torch.nn.functional.scaled_dot_product_attention(q, q, q, scale=-0.5)
    with rl_kernels.batch_invariant():
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, scale=-0.5)
    assert torch.equal(out, ref)


def test_mode_addmm_scalar_past_float32_raises_like_torch():
    a, b, c = torch.randn(2, 3), torch.randn(3, 2), torch.randn(2, 2)
    with pytest.raises(RuntimeError, match="overflow"):
        torch.addmm(c, a, b, alpha=1e39)
    with rl_kernels.batch_invariant(), pytest.raises(RuntimeError, match="overflow"):
        torch.addmm(c, a, b, alpha=1e39)
    with rl_kernels.batch_invariant(), pytest.raises(RuntimeError, match="overflow"):
        torch.baddbmm(c[None], a[None], b[None], beta=-1e39)


@pytest.mark.parametrize("weight", [torch.randn(8)[::2], torch.tensor(1.5).expand(4)],
                         ids=["stepped", "expanded"])
def test_rms_norm_strided_weight_like_torch(weight):
    x = torch.randn(3, 4)
    ref = torch.nn.functional.rms_norm(x.double(), (4,), weight.double(), 1e-6)
    assert (rl_kernels.rms_norm(x, weight, 1e-6, backend="cpu") - ref).abs().max() < 1e-5
    with rl_kernels.batch_invariant():
        out = torch.nn.functional.rms_norm(x, (4,), weight, 1e-6)
    assert (out - ref).abs().max() < 1e-5
    base = torch.randn(8, dtype=torch.float64, requires_grad=True)  # a strided weight that needs grad
    g = torch.randn(3, 4, dtype=torch.float64)
    rl_kernels.rms_norm(x.double(), base[::2], 1e-6, backend="cpu").backward(g)
    ours = base.grad.clone()
    base.grad = None
    torch.nn.functional.rms_norm(x.double(), (4,), base[::2], 1e-6).backward(g)
    assert (ours - base.grad).abs().max() < 1e-12


def test_row_ops_of_a_0d_tensor_like_torch():
    x = torch.tensor(2.0)
    with pytest.raises(ValueError, match="x"):
        rl_kernels.rms_norm(x, torch.tensor([3.0]))
    with pytest.raises(ValueError, match="x"):
        rl_kernels.rms_norm(x)
    for keepdim in (False, True):
        assert rl_kernels.row_sum(x, keepdim=keepdim).shape == x.sum(-1, keepdim=keepdim).shape
        assert rl_kernels.row_mean(x, keepdim=keepdim).shape == x.mean(-1, keepdim=keepdim).shape
        assert rl_kernels.row_sum(x, keepdim=keepdim).item() == 2.0


@pytest.mark.parametrize("bias_shape", [(1,), (1, 1), (5,), (0, 5), ()])
def test_addmm_no_rows_with_a_broadcast_bias(bias_shape):
    bias, a, b = torch.randn(bias_shape), torch.randn(0, 4), torch.randn(4, 5)
    out = rl_kernels.addmm(bias, a, b, backend="cpu")
    assert out.shape == torch.addmm(bias, a, b).shape == (0, 5)


@pytest.mark.parametrize("logits", ["all -inf", "one +inf"])
def test_linear_logp_rows_without_a_finite_max_are_nan_like_torch(logits):
    hidden, weight = torch.randn(2, 8), torch.randn(10, 8) * 0.3
    target = torch.tensor([1, 2])
    bias = torch.full((10,), -math.inf) if logits == "all -inf" else torch.tensor([math.inf] + [0.0] * 9)
    logp, entropy = rl_kernels.linear_logp(hidden, weight, target, bias, return_entropy=True,
                                           backend="cpu")
    z = hidden @ weight.t() + bias
    want_logp = torch.log_softmax(z, -1).gather(1, target[:, None]).squeeze(1)
    want_entropy = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    assert want_logp.isnan().all() and want_entropy.isnan().all()
    assert logp.isnan().all() and entropy.isnan().all()


def test_meta_operand_error_names_it_without_cpp_frames():
    with pytest.raises(TypeError, match="b: cannot be exported through DLPack") as info:
        rl_kernels.matmul(torch.randn(2, 3), torch.randn(3, 2, device="meta"))
    assert "\n" not in str(info.value) and "frame #" not in str(info.value)


def test_linear_logp_module_checks_backend_when_built():
    with pytest.raises(ValueError, match="unknown backend 'bogus'"):
        rl_kernels.LinearLogp(8, 10, backend="bogus")
