"""kernel_registry: op lookup, backend priority, forcing, per-call routing by device, describe()."""

import os
import subprocess
import sys

import pytest
import torch

import rl_kernels
from rl_kernels import _C, kernel_registry
from conftest import HAS_CUDA, randn


def test_unknown_op_lists_known_ones():
    with pytest.raises(KeyError, match="known ops: addmm, det_gemm, gemm, linear_logp, matmul"):
        kernel_registry.get_op("softmax")


def test_get_op_returns_modules_that_run():
    a, w = randn(5, 8, seed=1), randn(3, 8, seed=2)
    op = kernel_registry.get_op("matmul")
    assert isinstance(op, torch.nn.Module) and op.op_class == "reduction"
    assert torch.equal(op(a, w.t()), rl_kernels.matmul(a, w.t()))
    det = kernel_registry.get_op("det_gemm", backend="cpu")
    assert torch.equal(det(a, w.t()), rl_kernels.det_gemm(a, w.t()))


def test_describe_table_covers_every_op_and_backend():
    rows = kernel_registry.describe()
    assert {(r["op"], r["backend"]) for r in rows} == {
        (op, b) for op in kernel_registry.known_ops() for b in kernel_registry.BACKENDS}
    for row in rows:
        assert row["usable"] == (row["why_not"] == "")
        if row["backend"] == "cpu":
            assert row["usable"]


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only machine's answers")
def test_forcing_a_gpu_backend_without_cuda_raises_with_reason():
    for backend in ("sm80", "sm90"):
        with pytest.raises(RuntimeError, match=f"backend '{backend}' is not usable"):
            kernel_registry.get_op("matmul", backend=backend)
        with pytest.raises(RuntimeError, match=f"backend '{backend}' runs on CUDA tensors"):
            rl_kernels.matmul(randn(2, 2), randn(2, 2), backend=backend)


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        kernel_registry.get_op("matmul", backend="tpu")


def test_cpu_tensors_route_to_cpu_backend():
    assert kernel_registry.resolve_backend("matmul", torch.device("cpu")) == "cpu"


def test_last_kernel_names_what_ran():
    rl_kernels.matmul(randn(3, 4), randn(4, 5))
    assert kernel_registry.last_kernel() == "gemm_cpu"
    h, w = randn(3, 8), randn(10, 8)
    rl_kernels.linear_logp(h, w, torch.tensor([1, 2, 3]))
    assert kernel_registry.last_kernel() == "linear_logp_fwd_cpu"


def test_describe_lists_the_kernel_chain_of_each_backend():
    rows = {(r["op"], r["backend"]): r for r in kernel_registry.describe()}
    assert rows[("det_gemm", "cpu")]["kernels"] == "gemm_cpu"
    compiled = {(e, b) for e, b, _ in _C.kernels()}
    if ("gemm", "sm90") in compiled:  # sm90 falls back to sm80 for layouts TMA cannot take
        assert rows[("det_gemm", "sm90")]["kernels"] == "gemm_sm90 > gemm_sm80"


def test_sm90_requires_exact_capability_and_compilation():
    usable, why = kernel_registry.backend_status("det_gemm", "sm90")
    if ("gemm", "sm90") not in {(e, b) for e, b, _ in _C.kernels()}:
        assert not usable and "not compiled" in why
    elif not HAS_CUDA:
        assert not usable and why == "no CUDA device"
    elif torch.cuda.get_device_capability() != (9, 0):
        assert not usable and "9.0" in why


def _run_python(code, **env):
    full_env = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full_env, timeout=300)


def test_env_var_forces_backend():
    ok = _run_python("import torch, rl_kernels; "
                     "print(rl_kernels.kernel_registry.resolve_backend('matmul', torch.device('cpu')))",
                     RL_KERNELS_BACKEND="cpu")
    assert ok.returncode == 0 and ok.stdout.strip() == "cpu", ok.stderr
    bad = _run_python("import torch, rl_kernels; "
                      "rl_kernels.matmul(torch.ones(2, 2), torch.ones(2, 2))",
                      RL_KERNELS_BACKEND="sm90")
    assert bad.returncode != 0 and "RuntimeError" in bad.stderr and "sm90" in bad.stderr
    for typo in ("quantum", "CPU", "cpu "):  # refused at import, naming the variable
        unknown = _run_python("import rl_kernels", RL_KERNELS_BACKEND=typo)
        assert unknown.returncode != 0, typo
        assert f"RL_KERNELS_BACKEND={typo!r} is not a backend" in unknown.stderr, unknown.stderr
    self_check = subprocess.run([sys.executable, "-m", "rl_kernels"], capture_output=True, text=True,
                                env=dict(os.environ, RL_KERNELS_BACKEND="bogus"), timeout=300)
    assert self_check.returncode != 0 and "PASS" not in self_check.stdout


def test_self_check_command_passes():
    result = subprocess.run([sys.executable, "-m", "rl_kernels"], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "self-check: PASS" in result.stdout
    assert "FAIL" not in result.stdout.replace("PASS/FAIL", "")
