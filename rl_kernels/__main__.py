"""python -m rl_kernels: build facts, the backend table, and a self-check of every usable backend.

Each op runs on each usable backend, in each dtype it takes there, on a small problem against an
fp64 reference, and a row computed alone is compared bitwise with the same row inside a batch.
Exit status 1 on any FAIL. ``python -m rl_kernels demo`` runs the rollout-vs-trainer demo instead.
"""

from __future__ import annotations

import argparse
import sys

import torch

import rl_kernels
from rl_kernels import _C, kernel_registry

# error = max |out - fp64 reference| / max |reference| (relative to the largest value), except
# linear_logp: max |logp - fp64 logp| in nats (log-probs are already on a common scale)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
LOGP_MAX_ABS_ERR = 1e-4
CHECKED_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16),
                  "cuda": (torch.bfloat16, torch.float16)}


def _max_rel_err(x, ref):
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _randn(gen, *shape, device, dtype, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(device, dtype)


def _check_gemm_like(op_name, backend, device, dtype):
    gen = torch.Generator(device="cpu").manual_seed(0)
    m, k, n = 37, 200, 72
    a = _randn(gen, m, k, device=device, dtype=dtype)
    w = _randn(gen, n, k, device=device, dtype=dtype)
    bias = _randn(gen, n, device=device, dtype=dtype)
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
        c = _randn(gen, m, n, device=device, dtype=dtype)
        full = op(1.5, a, w.t(), -0.5, c)
        ref = 1.5 * (a.double() @ w.double().t()) - 0.5 * c.double()
        alone = op(1.5, a[5:6], w.t(), -0.5, c[5:6])
        return _max_rel_err(full, ref), torch.equal(alone, full[5:6]), TOLERANCE[dtype]
    full = run(a)
    return _max_rel_err(full, ref), torch.equal(run(a[5:6]), full[5:6]), TOLERANCE[dtype]


def _check_linear_logp(backend, device, dtype):
    gen = torch.Generator(device="cpu").manual_seed(0)
    n, d, v = 33, 64, 1000
    h = _randn(gen, n, d, device=device, dtype=dtype)
    w = _randn(gen, v, d, device=device, dtype=dtype, scale=1 / 8)
    t = torch.randint(0, v, (n,), generator=gen).to(device)
    op = kernel_registry.get_op("linear_logp", backend=backend)
    logp = op(h, w, t)
    ref = rl_kernels.NativeLinearLogpOp(torch.float64)(h, w, t)
    err = (logp.double() - ref).abs().max().item()
    return err, torch.equal(op(h[5:6], w, t[5:6]), logp[5:6]), LOGP_MAX_ABS_ERR


def _check_attention(backend, device, dtype):
    gen = torch.Generator(device="cpu").manual_seed(0)
    batch, t, heads_q, heads_kv, d = 2, 70, 4, 2, 64
    q = _randn(gen, batch, t, heads_q, d, device=device, dtype=dtype)
    k = _randn(gen, batch, t, heads_kv, d, device=device, dtype=dtype)
    v = _randn(gen, batch, t, heads_kv, d, device=device, dtype=dtype)
    op = kernel_registry.get_op("attention", backend=backend)
    out = op(q, k, v)
    group = heads_q // heads_kv
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    scores = qd @ kd.repeat_interleave(group, 1).transpose(-1, -2) / d ** 0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=device).triu(1), float("-inf"))
    ref = (scores.softmax(-1) @ vd.repeat_interleave(group, 1)).transpose(1, 2)
    alone = op(q[1:2, :41], k[1:2, :41], v[1:2, :41])  # the same rows in a shorter, single prefill
    return _max_rel_err(out, ref), torch.equal(alone, out[1:2, :41]), TOLERANCE[dtype]


def _check_row_op(op_name, backend, device, dtype):
    """A row op on 33 rows of 1000 against its torch form in fp64; row 5 alone vs in the batch."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = _randn(gen, 33, 1000, device=device, dtype=dtype)
    w = _randn(gen, 1000, device=device, dtype=dtype)
    op = kernel_registry.get_op(op_name, backend=backend)
    xd = x.double()
    run, ref = {
        "rms_norm": (lambda v: op(v, w), torch.nn.functional.rms_norm(xd, (1000,), w.double(), 1e-6)),
        "softmax": (lambda v: op(v), xd.softmax(-1)),
        "log_softmax": (lambda v: op(v), xd.log_softmax(-1)),
        "row_sum": (lambda v: op(v), xd.sum(-1)),
        "row_mean": (lambda v: op(v), xd.mean(-1)),
    }[op_name]
    full = run(x)
    return _max_rel_err(full, ref), torch.equal(run(x[5:6]), full[5:6]), TOLERANCE[dtype]


CHECKS = {"matmul": lambda b, dev, dt: _check_gemm_like("matmul", b, dev, dt),
          "det_gemm": lambda b, dev, dt: _check_gemm_like("det_gemm", b, dev, dt),
          "addmm": lambda b, dev, dt: _check_gemm_like("addmm", b, dev, dt),
          "gemm": lambda b, dev, dt: _check_gemm_like("gemm", b, dev, dt),
          "linear_logp": _check_linear_logp,
          "attention": _check_attention,
          **{op: (lambda b, dev, dt, op=op: _check_row_op(op, b, dev, dt))
             for op in ("rms_norm", "softmax", "log_softmax", "row_sum", "row_mean")}}


def self_check() -> bool:
    rows = []
    for op in kernel_registry.known_ops():
        for backend in kernel_registry.BACKENDS:
            usable, _ = kernel_registry.backend_status(op, backend)
            if not usable:
                continue
            device = "cpu" if backend == "cpu" else "cuda"
            for dtype in CHECKED_DTYPES[device]:
                try:
                    err, invariant, tol = CHECKS[op](backend, device, dtype)
                    ok = err <= tol and invariant
                    detail = f"err {err:.2e} (limit {tol:.0e}), row alone == row in batch: {invariant}"
                except Exception as exc:  # a self-check reports, it does not stop at the first
                    ok, detail = False, f"{type(exc).__name__}: {exc}"
                rows.append((op, backend, str(dtype).replace("torch.", ""), ok, detail))
    print(f"\n{'op':<12} {'backend':<8} {'dtype':<9} {'result':<6} detail")
    print("-" * 90)
    for op, backend, dtype, ok, detail in rows:
        print(f"{op:<12} {backend:<8} {dtype:<9} {'PASS' if ok else 'FAIL':<6} {detail}")
    print("err: max |out - fp64| / max |fp64| (linear_logp: max |logp - fp64 logp|)")
    return all(r[3] for r in rows) and len(rows) > 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:  # the demo's own options (python -m rl_kernels demo --tokens 8, --help)
        from .demo import main as demo_main
        return demo_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m rl_kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", choices=("check", "demo"), default="check",
                        help="check (default): build facts, backends, self-check; demo: rollout vs "
                             "trainer log-probs with and without batch-invariant mode")
    args = parser.parse_args(argv)
    print(f"rl_kernels {rl_kernels.__version__}")
    compiled = sorted({backend for _, backend, _ in _C.kernels()}, key=kernel_registry.BACKENDS.index)
    print(f"build: backends compiled = {', '.join(compiled)}"
          f"{'' if set(kernel_registry.GPU_BACKENDS) & set(compiled) else ' (CPU-only build)'}")
    print(f"torch {torch.__version__} (CUDA {'available' if torch.cuda.is_available() else 'not available'});"
          f" CPU threads {rl_kernels.get_num_threads()}")
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
