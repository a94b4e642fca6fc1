"""python -m rl_kernels: build facts, the backend table, and a self-check of every usable backend.

Each op runs on each usable backend on a small problem against an fp64 reference, and a row computed
alone is compared bitwise with the same row inside a batch. Exit status 1 on any FAIL.
"""

from __future__ import annotations

import sys

import torch

import rl_kernels
from rl_kernels import _C, kernel_registry

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # relative error
LOGP_MAX_ABS_ERR = 1e-4


def _rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _check_gemm_like(op_name, backend, device, dtype):
    gen = torch.Generator(device="cpu").manual_seed(0)
    m, k, n = 37, 200, 72
    a = torch.randn(m, k, generator=gen).to(device, dtype)
    w = torch.randn(n, k, generator=gen).to(device, dtype)
    bias = torch.randn(n, generator=gen).to(device, dtype)
    op = kernel_registry.get_op(op_name, backend=backend)
    if op_name == "matmul":
        run = lambda x: op(x, w.t())  # noqa: E731
        ref = a.double() @ w.double().t()
    elif op_name == "det_gemm":
        run = lambda x: op(x, w.t(), out_dtype=torch.float32)  # noqa: E731
        ref = a.double() @ w.double().t()
    elif op_name == "addmm":
        run = lambda x: op(bias, x, w.t(), beta=0.5, alpha=2.0)  # noqa: E731
        ref = 0.5 * bias.double() + 2.0 * (a.double() @ w.double().t())
    else:  # gemm: c has one row per row of a, so slice it with a
        c = torch.randn(m, n, generator=gen).to(device, dtype)
        full = op(1.5, a, w.t(), -0.5, c)
        ref = 1.5 * (a.double() @ w.double().t()) - 0.5 * c.double()
        alone = op(1.5, a[5:6], w.t(), -0.5, c[5:6])
        return _rel_err(full, ref), torch.equal(alone, full[5:6])
    full = run(a)
    alone = run(a[5:6])
    return _rel_err(full, ref), torch.equal(alone, full[5:6])


def _check_linear_logp(backend, device, dtype):
    gen = torch.Generator(device="cpu").manual_seed(0)
    n, d, v = 33, 64, 1000
    h = torch.randn(n, d, generator=gen).to(device, dtype)
    w = (torch.randn(v, d, generator=gen) / 8).to(device, dtype)
    t = torch.randint(0, v, (n,), generator=gen).to(device)
    op = kernel_registry.get_op("linear_logp", backend=backend)
    logp = op(h, w, t)
    ref = rl_kernels.NativeLinearLogpOp(torch.float64)(h, w, t)
    err = (logp.double() - ref).abs().max().item()  # max abs error of log-probs
    alone = op(h[5:6], w, t[5:6])
    return err, torch.equal(alone, logp[5:6])


def self_check() -> bool:
    rows = []
    for op in kernel_registry.known_ops():
        for backend in kernel_registry.BACKENDS:
            usable, _ = kernel_registry.backend_status(op, backend)
            if not usable:
                continue
            device = "cpu" if backend == "cpu" else "cuda"
            dtypes = (torch.float32, torch.bfloat16) if backend == "cpu" else (torch.bfloat16,)
            for dtype in dtypes:
                try:
                    if op == "linear_logp":
                        err, invariant = _check_linear_logp(backend, device, dtype)
                        ok = err <= LOGP_MAX_ABS_ERR and invariant
                    else:
                        err, invariant = _check_gemm_like(op, backend, device, dtype)
                        ok = err <= TOLERANCE[dtype] and invariant
                    detail = f"err {err:.2e}, row-invariant {invariant}"
                except Exception as exc:  # a self-check reports, it does not stop at the first
                    ok, detail = False, f"{type(exc).__name__}: {exc}"
                rows.append((op, backend, str(dtype).replace("torch.", ""), ok, detail))
    print(f"\n{'op':<12} {'backend':<8} {'dtype':<9} {'result':<6} detail")
    print("-" * 72)
    for op, backend, dtype, ok, detail in rows:
        print(f"{op:<12} {backend:<8} {dtype:<9} {'PASS' if ok else 'FAIL':<6} {detail}")
    return all(r[3] for r in rows) and len(rows) > 0


def main() -> int:
    print(f"rl_kernels {rl_kernels.__version__}")
    compiled = sorted({backend for _, backend, _ in _C.kernels()},
                      key=kernel_registry.BACKENDS.index)
    print(f"build: backends compiled = {', '.join(compiled)}"
          f"{'' if kernel_registry.GPU_BACKENDS[0] in compiled else ' (CPU-only build)'}")
    print(f"torch {torch.__version__}; CPU threads {rl_kernels.get_num_threads()}")
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        print(f"device: {torch.cuda.get_device_name()} (compute capability {major}.{minor})")
    else:
        print("device: no CUDA device (CPU backend only)")
    print()
    print(kernel_registry.format_table())
    ok = self_check()
    print("\nself-check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
