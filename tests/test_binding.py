"""rl_kernels._C directly: DLPack capsules (versioned and legacy), numpy arrays, ownership, and
bad inputs that must raise a clear error naming the argument."""

import gc
import math
import resource

import numpy as np
import pytest
import torch

from rl_kernels import _C, kernel_registry

CPU = kernel_registry.backend_code("cpu")


def np_gemm(a, b, c=None, alpha=1.0, beta=0.0, out_dtype=None):
    out = np.empty((a.shape[0], b.shape[1]), dtype=out_dtype or a.dtype)
    _C.gemm(a, b, c, out, alpha, beta, CPU, 0)
    return out


def test_numpy_arrays_through_dlpack():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((13, 40)).astype(np.float32)
    b = rng.standard_normal((40, 9)).astype(np.float32)
    c = rng.standard_normal((13, 9)).astype(np.float32)
    out = np_gemm(a, b, c, alpha=2.0, beta=-1.0)
    ref = 2.0 * (a.astype(np.float64) @ b.astype(np.float64)) - c
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    # transposed views (Fortran order) and float64
    a64, b64 = np.asfortranarray(a.astype(np.float64)), b.astype(np.float64).T.copy().T
    np.testing.assert_allclose(np_gemm(a64, b64), a64 @ b64, rtol=1e-12)
    # numpy and torch give the same bits for the same values
    torch_out = torch.empty(13, 9)
    _C.gemm(torch.from_numpy(a), torch.from_numpy(b), None, torch_out, 1.0, 0.0, CPU, 0)
    assert np.array_equal(torch_out.numpy(), np_gemm(a, b))


def test_versioned_and_legacy_capsules():
    a, b = torch.randn(4, 6), torch.randn(6, 3)
    expected = torch.empty(4, 3)
    _C.gemm(a, b, None, expected, 1.0, 0.0, CPU, 0)
    out = torch.empty(4, 3)
    _C.gemm(a.__dlpack__(max_version=(1, 0)), torch.utils.dlpack.to_dlpack(b), None,
            out.__dlpack__(max_version=(1, 0)), 1.0, 0.0, CPU, 0)
    assert torch.equal(out, expected)


def test_consumed_capsule_is_refused():
    a, b, out = torch.randn(2, 2), torch.randn(2, 2), torch.empty(2, 2)
    capsule = torch.utils.dlpack.to_dlpack(a)
    _C.gemm(capsule, b, None, out, 1.0, 0.0, CPU, 0)
    with pytest.raises(ValueError, match="a: this DLPack capsule was already consumed"):
        _C.gemm(capsule, b, None, out, 1.0, 0.0, CPU, 0)
    used = torch.utils.dlpack.to_dlpack(b)
    torch.utils.dlpack.from_dlpack(used)  # torch consumes it
    with pytest.raises(ValueError, match="b: this DLPack capsule was already consumed"):
        _C.gemm(a, used, None, out, 1.0, 0.0, CPU, 0)


def test_read_only_output_is_refused():
    a = np.ones((2, 3), np.float32)
    b = np.ones((3, 2), np.float32)
    out = np.empty((2, 2), np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out: is read-only"):
        _C.gemm(a, b, None, out, 1.0, 0.0, CPU, 0)


def _rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_no_leak_over_100k_calls():
    a, b, out = torch.randn(4, 4), torch.randn(4, 4), torch.empty(4, 4)
    an, bn, outn = a.numpy(), b.numpy(), out.numpy()

    def calls(n):
        for i in range(n):
            _C.gemm(a, b, None, out, 1.0, 0.0, CPU, 0)  # exchange-API path
            _C.gemm(torch.utils.dlpack.to_dlpack(a), b, None, out, 1.0, 0.0, CPU, 0)  # capsule
            _C.gemm(an, bn, None, outn, 1.0, 0.0, CPU, 0)  # __dlpack__ path
            _C.gemm(a, b, None, None, 1.0, 0.0, CPU, 0)  # output allocated in C
            try:
                _C.gemm(a, b, None, torch.empty(3, 3), 1.0, 0.0, CPU, 0)  # error path
            except ValueError:
                pass

    calls(5000)  # warm up allocator pools
    gc.collect()
    before = _rss_mb()
    calls(100_000 // 5)
    gc.collect()
    assert _rss_mb() - before < 8, f"RSS grew by {_rss_mb() - before:.1f} MB"


# ------------------------------------------------------------------------------------------------
# bad inputs: each raises TypeError / ValueError whose message names the argument
# ------------------------------------------------------------------------------------------------

f32 = torch.float32


def _gemm_args(**over):
    args = dict(a=torch.randn(4, 5), b=torch.randn(5, 3), c=None, out=torch.empty(4, 3),
                alpha=1.0, beta=0.0, backend=CPU, stream=0)
    args.update(over)
    return tuple(args.values())


BAD_GEMM = [
    ("a is None", dict(a=None), TypeError, "a: expected a tensor"),
    ("a is a list", dict(a=[[1.0]]), TypeError, "a: expected a DLPack capsule"),
    ("a is int32", dict(a=torch.ones(4, 5, dtype=torch.int32)), TypeError,
     "a: expected a floating point tensor, got int32"),
    ("a is uint8", dict(a=torch.ones(4, 5, dtype=torch.uint8)), TypeError, "a: unsupported dtype uint8"),
    ("a is complex", dict(a=torch.ones(4, 5, dtype=torch.complex64)), TypeError, "a: unsupported"),
    ("a is 1-D", dict(a=torch.randn(5)), ValueError, "a: expected a 2-D to 3-D tensor"),
    ("a is 4-D", dict(a=torch.randn(1, 1, 4, 5)), ValueError, "a: expected a 2-D to 3-D tensor, got 4-D"),
    ("a is 5-D", dict(a=torch.randn(1, 1, 1, 4, 5)), ValueError, "a: expected at most 4 dimensions"),
    ("b dtype differs", dict(b=torch.randn(5, 3, dtype=torch.float64)), TypeError,
     "b: expected dtype float32"),
    ("K mismatch", dict(b=torch.randn(6, 3)), ValueError, "b: has 6 rows but a has 5"),
    ("out wrong shape", dict(out=torch.empty(4, 4)), ValueError, "out: shape does not match"),
    ("out wrong dtype", dict(out=torch.empty(4, 3, dtype=torch.float16)), TypeError, "out: dtype"),
    ("out is a transposed view", dict(out=torch.empty(3, 4).t()), ValueError,
     "out: rows must be contiguous"),
    ("a neither row-major nor transposed", dict(a=torch.randn(8, 10)[::2, ::2]), ValueError,
     "a: strides"),
    ("out aliases a", "alias", ValueError, "out: overlaps the memory of input a"),
    ("c wrong length", dict(c=torch.randn(4), beta=1.0), ValueError, "c: expected"),
    ("c wrong dtype", dict(c=torch.randn(3, dtype=torch.float64), beta=1.0), TypeError,
     "c: expected dtype float32"),
    ("c wrong rows", dict(c=torch.randn(2, 3), beta=1.0), ValueError, "c: has 2 rows"),
    ("unknown backend", dict(backend=7), ValueError, "backend: unknown backend code 7"),
    ("GPU backend on CPU tensors", dict(backend=kernel_registry.backend_code("sm80")), ValueError,
     "backend: a CUDA backend cannot run on CPU tensors"),
    ("foreign capsule", dict(a="capsule"), TypeError, "a: capsule named 'not_a_tensor'"),
    ("batched b with 2-D a", dict(b=torch.randn(2, 5, 3)), ValueError, "b: a batched b"),
    ("overflowing strides", "overflow", OverflowError, "overflow"),
]


def _foreign_capsule():
    import ctypes
    make = ctypes.pythonapi.PyCapsule_New
    make.restype = ctypes.py_object
    make.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return make(ctypes.c_void_p(1), b"not_a_tensor", None)


@pytest.mark.parametrize("case", BAD_GEMM, ids=[c[0] for c in BAD_GEMM])
def test_bad_gemm_inputs(case):
    _, over, exc, message = case
    if over == "alias":
        buf = torch.randn(4, 5)
        args = _gemm_args(a=buf, b=torch.randn(5, 5), out=buf)
    elif over == "overflow":
        def strided(shape, strides):
            return np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape, strides)
        # rows 2^58 elements apart: the byte span (2^20 rows) does not fit in 64 bits
        args = (strided((2**20, 2**20), (2**60, 4)), strided((2**20, 1), (4, 4)), None,
                strided((2**20, 1), (4, 4)), 1.0, 0.0, CPU, 0)
    elif over.get("a") == "capsule":
        args = _gemm_args(a=_foreign_capsule())
    else:
        args = _gemm_args(**over)
    with pytest.raises(exc, match=message):
        _C.gemm(*args)


def _logp_args(**over):
    n, d, v = 3, 4, 5
    args = dict(hidden=torch.randn(n, d), weight=torch.randn(v, d), bias=None,
                target=torch.zeros(n, dtype=torch.int64), logp=torch.empty(n),
                entropy=torch.empty(n), lse=torch.empty(n), flag=0,
                inv_t=1.0, ignore=-100, backend=CPU, stream=0)
    args.update(over)
    return tuple(args.values())


BAD_LOGP = [
    ("target float", dict(target=torch.zeros(3)), TypeError, "target: expected dtype int64, got float32"),
    ("target int32", dict(target=torch.zeros(3, dtype=torch.int32)), TypeError,
     "target: expected dtype int64, got int32"),
    ("target wrong length", dict(target=torch.zeros(4, dtype=torch.int64)), ValueError,
     "target: expected shape"),
    ("target out of range", dict(target=torch.tensor([0, 5, 1])), ValueError,
     r"target: a value is outside \[0, 5\)"),
    ("negative target", dict(target=torch.tensor([0, -1, 1])), ValueError, "target: a value"),
    ("weight D mismatch", dict(weight=torch.randn(5, 3)), ValueError, "weight: has 3 columns"),
    ("bias wrong length", dict(bias=torch.randn(4)), ValueError, "bias: expected shape"),
    ("bias wrong dtype", dict(bias=torch.randn(5, dtype=torch.float64)), TypeError, "bias:"),
    ("logp wrong dtype", dict(logp=torch.empty(3, dtype=torch.float64)), TypeError, "logp:"),
    ("lse aliases logp", "alias", ValueError, "overlaps"),
    ("hidden float64", dict(hidden=torch.randn(3, 4, dtype=torch.float64),
                            weight=torch.randn(5, 4, dtype=torch.float64)), TypeError, "hidden:"),
    ("hidden columns strided", dict(hidden=torch.randn(3, 8)[:, ::2]), ValueError,
     "hidden: rows must be contiguous"),
]


@pytest.mark.parametrize("case", BAD_LOGP, ids=[c[0] for c in BAD_LOGP])
def test_bad_linear_logp_inputs(case):
    _, over, exc, message = case
    if over == "alias":
        buf = torch.empty(3)
        args = _logp_args(logp=buf, lse=buf)
    else:
        args = _logp_args(**over)
    with pytest.raises(exc, match=message):
        _C.linear_logp_fwd(*args)


def _dz_args(**over):
    """_C.linear_logp_dz: dz of a chunk from fp32 logits (bias not included)."""
    rows, cols = 3, 5
    args = dict(logits=torch.randn(rows, cols), bias=None, target=torch.tensor([0, 4, -100]),
                lse=torch.randn(rows), entropy=torch.rand(rows), grad_logp=torch.randn(rows),
                grad_entropy=torch.randn(rows), dlogits=torch.empty(rows, cols), v0=0, inv_t=1.0,
                ignore=-100, backend=CPU, stream=0)
    args.update(over)
    return tuple(args.values())


def _fused_args(**over):
    """_C.linear_logp_dlogits: the fused form, z from hidden @ weight^T (+ bias), bf16 operands."""
    rows, cols, d = 3, 5, 4
    args = dict(hidden=torch.randn(rows, d).bfloat16(), weight=torch.randn(cols, d).bfloat16(),
                bias=None, target=torch.tensor([0, 4, -100]), lse=torch.randn(rows),
                entropy=torch.rand(rows), grad_logp=torch.randn(rows), grad_entropy=torch.randn(rows),
                dlogits=torch.empty(rows, cols).bfloat16(), v0=0, inv_t=1.0, ignore=-100,
                backend=CPU, stream=0)
    args.update(over)
    return tuple(args.values())


BAD_DLOGITS = [
    ("logits wrong dtype", _C.linear_logp_dz, _dz_args(logits=torch.randn(3, 5).double()), TypeError,
     "logits:"),
    ("dlogits wrong shape", _C.linear_logp_dz, _dz_args(dlogits=torch.empty(3, 4)), ValueError,
     "dlogits: expected"),
    ("target wrong length", _C.linear_logp_dz, _dz_args(target=torch.zeros(2, dtype=torch.int64)),
     ValueError, "target: expected shape"),
    ("grad_entropy without entropy", _C.linear_logp_dz, _dz_args(entropy=None), ValueError,
     "entropy: required"),
    ("bias wrong length", _C.linear_logp_dz, _dz_args(bias=torch.randn(4)), ValueError, "bias: expected"),
    ("fused without hidden", _C.linear_logp_dlogits, _fused_args(hidden=None), TypeError,
     "hidden: expected a tensor"),
    ("fused weight D mismatch", _C.linear_logp_dlogits, _fused_args(weight=torch.randn(5, 3).bfloat16()),
     ValueError, "weight: has 3 columns"),
    ("fused weight dtype", _C.linear_logp_dlogits, _fused_args(weight=torch.randn(5, 4).half()), TypeError,
     "weight:"),
    ("fused dlogits dtype", _C.linear_logp_dlogits, _fused_args(dlogits=torch.empty(3, 5)), TypeError,
     "dlogits:"),
    ("fused bias length", _C.linear_logp_dlogits, _fused_args(bias=torch.randn(4).bfloat16()), ValueError,
     "bias: expected"),
]


@pytest.mark.parametrize("case", BAD_DLOGITS, ids=[c[0] for c in BAD_DLOGITS])
def test_bad_dlogits_inputs(case):
    _, entry, args, exc, message = case
    with pytest.raises(exc, match=message):
        entry(*args)


def test_dz_forms_on_cpu():
    """The plain form computes dz (with the bias added to the logits); the fused form has no CPU
    kernel: the call says so and leaves dlogits untouched (the backward then takes a GEMM into fp32
    logits and the plain form)."""
    bias = torch.randn(5)
    args = _dz_args(bias=bias)
    _C.linear_logp_dz(*args)
    assert kernel_registry.last_kernel() == "linear_logp_dz_cpu"
    logits, _, target, lse, ent, g_logp, g_ent, dz = args[:8]
    z = logits + bias
    p = torch.exp(z - lse[:, None])
    onehot = torch.nn.functional.one_hot(target.clamp_min(0), 5).float()
    ref = g_logp[:, None] * (onehot - p) - g_ent[:, None] * p * (z - lse[:, None] + ent[:, None])
    ref[2] = 0  # ignore_index row
    torch.testing.assert_close(dz, ref, rtol=1e-5, atol=1e-6)
    fused = _fused_args()
    before = fused[8].clone()
    with pytest.raises(RuntimeError, match="linear_logp_dlogits: no compiled kernel supports"):
        _C.linear_logp_dlogits(*fused)
    assert torch.equal(fused[8].view(torch.int16), before.view(torch.int16))


def test_backends_and_kernels_come_from_the_kernel_list():
    """_C.backends() and _C.kernels() are csrc/kernels.def: every KERNEL row whose backend this
    build compiled, and nothing else."""
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parent.parent / "csrc" / "kernels.def").read_text()
    rows = re.findall(r'^KERNEL\((\w+),\s*(\w+),\s*"([^"]+)"\)', text, re.M)
    backends = [name for name, *_ in _C.backends()]
    assert backends == re.findall(r"^BACKEND\((\w+),", text, re.M)
    compiled = {backend for _, backend, _ in _C.kernels()}
    assert "cpu" in compiled
    assert set(_C.kernels()) == {r for r in rows if r[1] in compiled}


def test_gil_released_during_cpu_kernel():
    import threading
    import time
    a, b = torch.randn(1500, 1500), torch.randn(1500, 1500)
    out = torch.empty(1500, 1500)
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    thread = threading.Thread(target=ticker)
    thread.start()
    start = time.perf_counter()
    _C.gemm(a, b, None, out, 1.0, 0.0, CPU, 0)
    end = time.perf_counter()
    stop.set()
    thread.join()
    during = [t for t in ticks if start < t < end]
    assert end - start < 0.01 or len(during) >= 3, "the Python thread never ran during the kernel"


def test_out_none_allocates_through_the_exchange_table():
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    out = _C.gemm(a, b, None, None, 1.0, 0.0, CPU, 0)
    assert isinstance(out, torch.Tensor) and out.shape == (5, 3) and out.dtype == torch.float32
    expected = torch.empty(5, 3)
    _C.gemm(a, b, None, expected, 1.0, 0.0, CPU, 0)
    assert torch.equal(out, expected)
    wide = _C.gemm(a.bfloat16(), b.bfloat16(), None, None, 1.0, 0.0, CPU, 0, _C.DTYPE_F32)
    assert wide.dtype == torch.float32
    batched = _C.gemm(torch.randn(2, 5, 7), b, None, None, 1.0, 0.0, CPU, 0)
    assert batched.shape == (2, 5, 3)
    with pytest.raises(TypeError, match="out: None needs a to come from a framework"):
        _C.gemm(a.numpy(), b.numpy(), None, None, 1.0, 0.0, CPU, 0)
    with pytest.raises(ValueError, match="out_dtype: unknown dtype code 9"):
        _C.gemm(a, b, None, None, 1.0, 0.0, CPU, 0, 9)


@pytest.mark.parametrize("scale", [-0.5, math.inf, math.nan, 1e39])
def test_attention_binding_refuses_a_negative_or_non_finite_softmax_scale(scale):
    """The C binding checks softmax_scale itself (a caller of _C has no Python wrapper in front):
    forward and backward, before any kernel runs (out stays as it was)."""
    q, k, v = (torch.randn(1, 3, 2, 8) for _ in range(3))
    out, lse = torch.full_like(q, 7.0), torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="softmax_scale: must be finite and >= 0"):
        _C.attention_fwd(q, k, v, out, lse, None, None, None, None, 3, 3, True, scale, 0, CPU, 0)
    assert torch.equal(out, torch.full_like(q, 7.0))
    grads = [torch.zeros_like(x) for x in (q, k, v)]
    with pytest.raises(ValueError, match="softmax_scale: must be finite and >= 0"):
        _C.attention_bwd(q, k, v, out, lse, torch.ones_like(q), *grads, None, None, None, None, 3, 3, True,
                         scale, 0, CPU, 0)
    _C.attention_fwd(q, k, v, out, lse, None, None, None, None, 3, 3, True, 0.0, 0, CPU, 0)  # 0 is fine
    assert torch.allclose(out[0, 2], v[0].mean(0))  # scale 0: the mean of the values it sees
