#!/usr/bin/env python3
"""GPU probe of the sm80 row-op kernels (rms_norm, softmax / log_softmax, row sum / mean).

Self-contained: compiles csrc/cuda/sm80/{rms_norm,softmax,row_sum}.cu with nvcc into a shared
library, loads it with ctypes (the structs mirror csrc/rlk.h and csrc/ops/*.h) and runs, on CUDA
tensors:
  1. accuracy against fp64 torch references (forward, and backward with random cotangents);
  2. torch's semantics on edge cases (-inf / +inf / NaN entries, all -inf rows, 0 columns,
     both rms_norm weight conventions against F.rms_norm and the HF Python RMSNorm);
  3. bitwise batch invariance: rows computed in calls of 1, 2, 3, 7, 17, 129, 1000 rows and at
     shifted positions equal the full call; strided / misaligned layouts (element loads) equal the
     aligned ones (16-byte loads); a side stream and repeats give the same bits; the rms_norm
     dweight is bitwise equal run to run;
  4. timing against torch (CUDA events, medians after warm-up, each call on inputs not read for
     >= 120 MB, which flushes the 50 MB L2; the GPU is kept busy while calls are queued, so launch
     overhead is not timed), printed as a table of microseconds, GB/s and ours / torch.
Exit status 0 when every check passes. On a failure it prints where the values differ.

Usage (repository root, on the GPU machine):
    python3 scripts/rowops_sm80_probe.py              # build, check, bench (~1-2 minutes on an H100)
    python3 scripts/rowops_sm80_probe.py --no-bench   # checks only
    python3 scripts/rowops_sm80_probe.py --lib L.so   # use an already built library
The same checks run against the CPU reference kernels with --cpu-lib /tmp/librowops.so (built by
gcc -O3 -std=c11 -fopenmp -ffp-contract=off -fPIC -shared -I csrc csrc/cpu/rms_norm.c
csrc/cpu/softmax.c csrc/cpu/row_sum.c -o /tmp/librowops.so); .scratch/rowops_cpu_harness.py does
that and adds the CPU-only checks (thread counts, fp64).
"""

import argparse
import ctypes
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["rms_norm", "softmax", "row_sum"]

# ------------------------------------------------------------------------------------------------
# ctypes mirrors of csrc/rlk.h and csrc/ops/{rms_norm,softmax,row_sum}.h
# ------------------------------------------------------------------------------------------------

DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}


class Context(ctypes.Structure):
    _fields_ = [("stream", ctypes.c_void_p), ("num_threads", ctypes.c_int), ("plan_only", ctypes.c_int),
                ("kernel", ctypes.c_char_p), ("workspace_bytes", ctypes.c_int64)]


class SoftmaxArgs(ctypes.Structure):
    _fields_ = [("rows", ctypes.c_int64), ("cols", ctypes.c_int64), ("in_dtype", ctypes.c_int),
                ("out_dtype", ctypes.c_int), ("log", ctypes.c_int), ("x", ctypes.c_void_p),
                ("ldx", ctypes.c_int64), ("y", ctypes.c_void_p), ("ldy", ctypes.c_int64),
                ("dy", ctypes.c_void_p), ("lddy", ctypes.c_int64), ("dx", ctypes.c_void_p),
                ("lddx", ctypes.c_int64)]


class RmsNormArgs(ctypes.Structure):
    _fields_ = [("rows", ctypes.c_int64), ("cols", ctypes.c_int64), ("dtype", ctypes.c_int),
                ("eps", ctypes.c_double), ("round_before_weight", ctypes.c_int), ("x", ctypes.c_void_p),
                ("ldx", ctypes.c_int64), ("weight", ctypes.c_void_p), ("y", ctypes.c_void_p),
                ("ldy", ctypes.c_int64), ("rstd", ctypes.c_void_p), ("dy", ctypes.c_void_p),
                ("lddy", ctypes.c_int64), ("dx", ctypes.c_void_p), ("lddx", ctypes.c_int64),
                ("dweight", ctypes.c_void_p), ("workspace", ctypes.c_void_p)]


class RowSumArgs(ctypes.Structure):
    _fields_ = [("rows", ctypes.c_int64), ("cols", ctypes.c_int64), ("in_dtype", ctypes.c_int),
                ("out_dtype", ctypes.c_int), ("mean", ctypes.c_int), ("x", ctypes.c_void_p),
                ("ldx", ctypes.c_int64), ("y", ctypes.c_void_p)]


def _ptr(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _ld(t):
    if t is None:
        return 0
    assert t.dim() == 2 and (t.shape[1] <= 1 or t.stride(1) == 1), "rows must be contiguous"
    return t.stride(0)


class RowOps:
    """The launchers of one backend ("sm80" or "cpu") behind torch-tensor methods.

    Tensors are 2-D [rows, cols] views whose last dimension is contiguous (any row stride). Outputs
    are written in place. stream: a torch.cuda.Stream (CUDA backend) or None (current stream)."""

    def __init__(self, lib_path, backend):
        self.lib = ctypes.CDLL(str(lib_path))
        self.backend = backend
        self.threads = 1
        self.stream = None
        self.last_kernel = None
        for entry in ("rms_norm_fwd", "rms_norm_bwd", "softmax_fwd", "softmax_bwd", "row_sum"):
            fn = getattr(self.lib, f"rlk_{entry}_{backend}")
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(Context)]
            setattr(self, "_" + entry, fn)

    def _ctx(self, plan_only=False):
        stream = None
        if self.backend != "cpu":
            s = self.stream if self.stream is not None else torch.cuda.current_stream()
            stream = ctypes.c_void_p(s.cuda_stream)
        return Context(stream, self.threads, 1 if plan_only else 0, None, 0)

    def _call(self, fn, args, name, plan_only=False):
        ctx = self._ctx(plan_only)
        rc = fn(ctypes.byref(args), ctypes.byref(ctx))
        if rc != 0:
            raise RuntimeError(f"rlk_{name}_{self.backend} returned {rc}")
        self.last_kernel = ctx.kernel.decode() if ctx.kernel else None
        return ctx

    # -- argument structs (built once, reusable for timing) --
    def softmax_args(self, x, y, log, dy=None, dx=None):
        ref = x if x is not None else dx
        out = y
        return SoftmaxArgs(ref.shape[0], ref.shape[1], DTYPE_CODE[ref.dtype], DTYPE_CODE[out.dtype], int(log),
                           _ptr(x), _ld(x), _ptr(y), _ld(y), _ptr(dy), _ld(dy), _ptr(dx), _ld(dx))

    def rms_args(self, x, weight, eps, rbw, y=None, rstd=None, dy=None, dx=None, dweight=None):
        return RmsNormArgs(x.shape[0], x.shape[1], DTYPE_CODE[x.dtype], eps, int(rbw), _ptr(x), _ld(x),
                           _ptr(weight), _ptr(y), _ld(y), _ptr(rstd), _ptr(dy), _ld(dy), _ptr(dx), _ld(dx),
                           _ptr(dweight), None)

    def row_sum_args(self, x, y, mean):
        return RowSumArgs(x.shape[0], x.shape[1], DTYPE_CODE[x.dtype], DTYPE_CODE[y.dtype], int(mean),
                          _ptr(x), _ld(x), _ptr(y))

    # -- ops --
    def softmax_fwd(self, x, log, out_dtype=None, y=None):
        if y is None:
            y = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
        self._call(self._softmax_fwd, self.softmax_args(x, y, log), "softmax_fwd")
        return y

    def softmax_bwd(self, y, dy, log, in_dtype, dx=None):
        if dx is None:
            dx = torch.empty(y.shape, dtype=in_dtype, device=y.device)
        self._call(self._softmax_bwd, self.softmax_args(None, y, log, dy=dy, dx=dx), "softmax_bwd")
        return dx

    def rms_fwd(self, x, weight, eps, rbw, y=None, rstd=None):
        if y is None:
            y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if rstd is None:
            rstd = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        self._call(self._rms_norm_fwd, self.rms_args(x, weight, eps, rbw, y=y, rstd=rstd), "rms_norm_fwd")
        return y, rstd

    def rms_bwd_plan(self, args):
        return self._call(self._rms_norm_bwd, args, "rms_norm_bwd", plan_only=True).workspace_bytes

    def rms_bwd(self, x, weight, eps, rbw, rstd, dy, want_dweight=True, dx=None, dweight=None, workspace=None):
        if dx is None:
            dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if want_dweight and dweight is None:
            dweight = torch.full((x.shape[1],), float("nan"), dtype=x.dtype, device=x.device)
        args = self.rms_args(x, weight, eps, rbw, rstd=rstd, dy=dy, dx=dx, dweight=dweight if want_dweight else None)
        need = self.rms_bwd_plan(args)
        if need and workspace is None:
            workspace = torch.empty(need, dtype=torch.uint8, device=x.device)
        args.workspace = _ptr(workspace) if need else None
        self._call(self._rms_norm_bwd, args, "rms_norm_bwd")
        return dx, (dweight if want_dweight else None)

    def row_sum(self, x, mean, out_dtype=None, y=None):
        if y is None:
            y = torch.empty(x.shape[0], dtype=out_dtype or x.dtype, device=x.device)
        self._call(self._row_sum, self.row_sum_args(x, y, mean), "row_sum")
        return y


# ------------------------------------------------------------------------------------------------
# references (fp64) and comparisons
# ------------------------------------------------------------------------------------------------

SHORT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float64: "f64"}
ULP = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float64: 2.0 ** -52}
TINY = {torch.float32: 1e-30, torch.bfloat16: 1e-30, torch.float16: 2.0 ** -24, torch.float64: 1e-300}


class Report:
    def __init__(self, verbose=False):
        self.failures = []
        self.passed = 0
        self.verbose = verbose
        self.worst = {}

    def ok(self, cond, name, detail=""):
        if cond:
            self.passed += 1
            if self.verbose:
                print(f"  ok   {name} {detail}")
        else:
            self.failures.append(name)
            if len(self.failures) <= 40:
                print(f"  FAIL {name} {detail}", flush=True)
            elif len(self.failures) == 41:
                print("  ... (further failures counted, not printed)", flush=True)
        return cond

    def section(self, fn, *args, **kwargs):
        """Runs one group of checks; an exception (a launcher error, a CUDA fault) is a failure of
        the group, reported with its traceback, and the next group still runs."""
        try:
            fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            self.ok(False, f"{fn.__name__} raised {type(e).__name__}: {e}",
                    "(for the failing launch: CUDA_LAUNCH_BLOCKING=1, or compute-sanitizer)")

    def note_error(self, key, err):
        self.worst[key] = max(self.worst.get(key, 0.0), err)


def _where(a, b, mask):
    idx = mask.nonzero()
    first = tuple(idx[0].tolist())
    return f"{int(mask.sum())} differ, first at {first}: {a[first].item()!r} vs {b[first].item()!r}"


def bitwise_equal(a, b):
    """Equal bits (NaN == NaN with the same payload, -0 != +0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    if a.numel() == 0:
        return True, ""
    int_type = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
    ai, bi = a.contiguous().view(int_type), b.contiguous().view(int_type)
    mask = ai != bi
    if not bool(mask.any()):
        return True, ""
    return False, _where(a, b, mask)


def close(out, ref, rtol, atol):
    """|out - ref| <= atol + rtol |ref| elementwise (ref in fp64); NaN / inf patterns must match.
    Returns (ok, max error relative to the tolerance, detail)."""
    o = out.double()
    nan_o, nan_r = torch.isnan(o), torch.isnan(ref)
    if not torch.equal(nan_o, nan_r):
        return False, float("inf"), "NaN pattern: " + _where(o, ref, nan_o != nan_r)
    inf_r = torch.isinf(ref)
    if bool(inf_r.any()) and not torch.equal(o[inf_r], ref[inf_r]):
        return False, float("inf"), "inf mismatch: " + _where(o, ref, inf_r & (o != ref))
    fin = ~(nan_r | inf_r)
    err = (o - ref).abs()
    if not isinstance(atol, torch.Tensor):
        atol = torch.full_like(ref, float(atol))
    tol = atol + rtol * ref.abs()
    bad = fin & (err > tol)
    ratio = float((err[fin] / tol[fin]).max()) if bool(fin.any()) else 0.0
    if bool(bad.any()):
        return False, ratio, _where(o, ref, bad)
    return True, ratio, ""


def ref_softmax(x, log):
    x64 = x.double()
    return torch.log_softmax(x64, -1) if log else torch.softmax(x64, -1)


def ref_softmax_bwd(y, dy, log):
    """torch autograd in fp64 through softmax / log_softmax evaluated at the point whose output is y
    (x = log y for softmax, x = y for log_softmax: both give back y), cotangent dy."""
    y64, dy64 = y.double(), dy.double()
    x = (y64 if log else torch.log(y64)).detach().requires_grad_(True)
    out = torch.log_softmax(x, -1) if log else torch.softmax(x, -1)
    # out equals y up to fp64 rounding; the backward formulas only use y, so use the exact y
    if log:
        ref = dy64 - torch.exp(y64) * dy64.sum(-1, keepdim=True)
    else:
        ref = y64 * (dy64 - (dy64 * y64).sum(-1, keepdim=True))
    (auto,) = torch.autograd.grad(out, x, dy64)
    return ref, auto


def ref_rms(x, w, eps, rbw):
    x64 = x.double()
    rstd = 1.0 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps)
    h = x64 * rstd
    if w is None:
        y = h
    elif rbw:
        y = w.double() * h.to(x.dtype).double()
    else:
        y = h * w.double()
    return y, rstd.squeeze(-1)


class _RoundST(torch.autograd.Function):
    """Rounding to a dtype with the identity gradient (as autograd treats .to(dtype))."""

    @staticmethod
    def forward(ctx, h, dtype):
        return h.to(dtype).double()

    @staticmethod
    def backward(ctx, g):
        return g, None


def ref_rms_bwd(x, w, eps, rbw, dy):
    """dx, dweight by torch autograd in fp64 through the forward of the convention; and the size of
    dx's two terms (dx itself may cancel to nearly 0, e.g. cols == 1), the error scale."""
    x64 = x.double().detach().requires_grad_(True)
    w64 = w.double().detach().requires_grad_(True) if w is not None else None
    rstd = 1.0 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps)
    h = x64 * rstd
    if w64 is None:
        y = h
    elif rbw:
        y = w64 * _RoundST.apply(h, x.dtype)
    else:
        y = h * w64
    grads = torch.autograd.grad(y, [x64] + ([w64] if w64 is not None else []), dy.double())
    dx = grads[0]
    dweight = grads[1] if w64 is not None else None
    with torch.no_grad():
        g = dy.double() * w.double() if w is not None else dy.double()
        r = rstd.detach()
        terms = (r * g).abs() + (x.double() * r ** 3 * (g * x.double()).sum(-1, keepdim=True) / x.shape[1]).abs()
    return dx, dweight, terms


def randn(shape, dtype, device, seed, scale=1.0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def make_input(rows, cols, dtype, device, seed, scale=1.0, padded=False):
    """A [rows, cols] tensor; padded: a view of a wider buffer whose row stride is a multiple of 64
    elements (16-byte loads) while cols is not a multiple of the chunk (a partial last chunk)."""
    x = randn((rows, cols), dtype, device, seed, scale)
    if not padded:
        return x
    ld = (cols + 64) // 64 * 64
    buf = torch.full((rows, ld), float("nan"), dtype=dtype, device=device)
    buf[:, :cols] = x
    return buf[:, :cols]


def strided_copy(x, pad=3, offset=1):
    """x's values in a buffer with row stride cols + pad, starting `offset` elements in (so neither
    the base nor the row stride is 16-byte aligned): the element-load path."""
    rows, cols = x.shape
    buf = torch.full((offset + rows * (cols + pad) + 8,), float("nan"), dtype=x.dtype, device=x.device)
    view = buf[offset:offset + rows * (cols + pad)].view(rows, cols + pad)[:, :cols]
    view.copy_(x)
    return view


def strided_empty(rows, cols, dtype, device, pad=3, offset=1):
    buf = torch.full((offset + rows * (cols + pad) + 8,), float("nan"), dtype=dtype, device=device)
    return buf[offset:offset + rows * (cols + pad)].view(rows, cols + pad)[:, :cols]


# ------------------------------------------------------------------------------------------------
# checks
# ------------------------------------------------------------------------------------------------

class Sizes:
    def __init__(self, device):
        gpu = device != "cpu"
        # (rows, cols): the register plan (warp per row, CTA per row), partial chunks, the loop plan
        # (rows, cols, padded): padded rows have an aligned stride and a partial last chunk
        self.acc_shapes = [(1, 1, 0), (3, 7, 0), (5, 100, 0), (9, 1000, 0), (9, 1001, 1), (17, 4096, 0),
                           (4, 4100, 1), (3, 8192, 0), (5, 16384, 0), (4, 40000, 0), (3, 151936, 0),
                           (3, 151939, 1)]
        if gpu:
            self.acc_shapes += [(300, 4096, 0), (64, 151936, 0), (2, 300001, 0)]
        # invariance: (full rows, cols, prefix sizes)
        big = [1, 2, 3, 7, 17, 129, 1000]
        # (full rows, cols, prefix sizes, padded)
        self.inv_shapes = [(1100, 4096, big, 0), (1100, 100, big, 0), (300, 1001, big[:6], 1),
                           (60, 12000, [1, 2, 3, 7, 17], 0),  # 512 threads per row (bf16), no prefetch
                           (40, 40000, [1, 2, 3, 7, 17], 0),
                           (140, 151936, [1, 2, 3, 7, 17, 129], 0) if gpu else (20, 151936, [1, 2, 3, 7, 17], 0),
                           (20, 151939, [1, 2, 3, 7, 17], 1)]
        self.windows = [1, 5, 33]


def acc_tolerance(dtype, out_dtype, kind):
    """(rtol, atol) for outputs rounded to out_dtype from fp32 arithmetic."""
    u = ULP[out_dtype]
    if kind == "fwd":
        return (u if out_dtype != torch.float32 else 2e-5), TINY[out_dtype]
    if kind == "rms_fwd":  # w * round(h): h may round to the other neighbour near a tie
        return (2 * u if out_dtype != torch.float32 else 2e-5), TINY[out_dtype]
    raise ValueError(kind)


def check_accuracy(ops, device, rep, sizes):
    print(f"[accuracy vs fp64] backend {ops.backend}", flush=True)
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    eps = 1e-6
    for (rows, cols, padded) in sizes.acc_shapes:
        for dt in dtypes:
            tag = f"{str(dt)[6:]} [{rows}x{cols}]" + (" padded" if padded else "")
            x = make_input(rows, cols, dt, device, seed=rows * 7 + cols, scale=3.0, padded=padded)
            # softmax / log_softmax forward, out = in or fp32
            for log in (0, 1):
                name = "log_softmax" if log else "softmax"
                ref = ref_softmax(x, log)
                for odt in ([dt] if dt == torch.float32 else [dt, torch.float32]):
                    y = ops.softmax_fwd(x, log, odt)
                    rtol, atol = acc_tolerance(dt, odt, "fwd")
                    if log:  # (x - m) - log z: absolute error ~ eps * |x - m|
                        atol = 4 * ULP[torch.float32] * (x.double() - x.double().max(-1, keepdim=True).values).abs() + 1e-6
                    good, r, d = close(y, ref, rtol, atol)
                    rep.note_error(f"{name}_fwd", r)
                    rep.ok(good, f"{name}_fwd {tag} -> {str(odt)[6:]}", d)
                # backward from the rounded forward output and a random cotangent
                for odt in ([dt] if dt == torch.float32 else [dt, torch.float32]):
                    y = ops.softmax_fwd(x, log, odt)
                    dy = randn((rows, cols), odt, device, seed=cols + 11, scale=1.0)
                    dx = ops.softmax_bwd(y, dy, log, dt)
                    ref, auto = ref_softmax_bwd(y, dy, log)
                    if odt == torch.float32:  # the contract's formula is torch's gradient (y to 1e-6)
                        good, _, d = close(auto, ref, 1e-5, 1e-5 * ref.abs().amax(-1, keepdim=True) + 1e-12)
                        rep.ok(good, f"{name}_bwd formula vs autograd {tag}", d)
                    scale = ref.abs().amax(-1, keepdim=True) if cols else ref
                    u = ULP[dt] if dt != torch.float32 else 1e-5
                    good, r, d = close(dx, ref, u, 2 * u * scale + TINY[dt])
                    rep.note_error(f"{name}_bwd", r)
                    rep.ok(good, f"{name}_bwd {tag} y:{str(odt)[6:]}", d)
            # rms_norm forward: no weight, F.rms_norm convention, HF convention
            w = randn((cols,), dt, device, seed=cols + 3, scale=1.0) + 1.0
            for weight, rbw in ((None, 0), (w, 0), (w, 1)):
                y, rstd = ops.rms_fwd(x, weight, eps, rbw)
                ref, ref_rstd = ref_rms(x, weight, eps, rbw)
                rtol, atol = acc_tolerance(dt, dt, "rms_fwd")
                good, r, d = close(y, ref, rtol, atol)
                rep.note_error("rms_norm_fwd", r)
                wn = "none" if weight is None else f"rbw={rbw}"
                rep.ok(good, f"rms_norm_fwd {tag} w:{wn}", d)
                good, r, d = close(rstd, ref_rstd, 1e-5, 0.0)  # fp32 sums of up to 3e5 squares
                rep.ok(good, f"rms_norm_fwd rstd {tag} w:{wn}", d)
                # backward (dx, dweight) with a random cotangent, from our rstd
                dy = randn((rows, cols), dt, device, seed=rows + cols + 5, scale=1.0)
                dx, dw = ops.rms_bwd(x, weight, eps, rbw, rstd, dy, want_dweight=weight is not None)
                rdx, rdw, terms = ref_rms_bwd(x, weight, eps, rbw, dy)
                u = ULP[dt] if dt != torch.float32 else 1e-5
                scale = terms.amax(-1, keepdim=True)
                good, r, d = close(dx, rdx, 2 * u, 2 * u * scale + TINY[dt])
                rep.note_error("rms_norm_bwd_dx", r)
                rep.ok(good, f"rms_norm_bwd dx {tag} w:{wn}", d)
                if weight is not None:
                    good, r, d = close(dw, rdw, 2 * u, 2 * u * rdw.abs().max() + TINY[dt])
                    rep.note_error("rms_norm_bwd_dweight", r)
                    rep.ok(good, f"rms_norm_bwd dweight {tag} w:{wn}", d)
            # row sum / mean, out = in or fp32
            for mean in (0, 1):
                name = "mean" if mean else "sum"
                ref = x.double().sum(-1)
                if mean:
                    ref = ref / cols
                bound = x.double().abs().sum(-1) / (cols if mean else 1)
                for odt in ([dt] if dt == torch.float32 else [dt, torch.float32]):
                    y = ops.row_sum(x, mean, odt)
                    rtol = ULP[odt] if odt != torch.float32 else 1e-6
                    good, r, d = close(y, ref, rtol, 1e-5 * bound + TINY[odt])
                    rep.note_error(f"row_{name}", r)
                    rep.ok(good, f"row_{name} {tag} -> {str(odt)[6:]}", d)


def same_pattern(a, b):
    """NaN positions equal, and the infinities equal (position and sign)."""
    a, b = a.double(), b.double()
    na, nb = torch.isnan(a), torch.isnan(b)
    if not torch.equal(na, nb):
        return False, "NaN pattern: " + _where(a, b, na != nb)
    ia, ib = torch.isinf(a), torch.isinf(b)
    if not torch.equal(ia, ib) or not torch.equal(a[ia], b[ib]):
        return False, "inf pattern: " + _where(a, b, (ia != ib) | (ia & (a != b)))
    return True, ""


def check_semantics(ops, device, rep):
    """Edge cases: NaN / inf patterns equal torch's own op in the same dtype; values close to torch's
    op evaluated in fp64 (torch's 16-bit CPU log_softmax is itself off by several ulps)."""
    print(f"[torch semantics] backend {ops.backend}", flush=True)
    inf, nan = float("inf"), float("nan")
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        tag = str(dt)[6:]
        for cols in (5, 40000):  # register and loop plans
            base = randn((8, cols), torch.float32, "cpu", seed=cols)
            base[0, 1] = -inf                   # one -inf entry
            base[1, :] = -inf                   # all -inf: NaN row
            base[2, 3] = inf                    # +inf: NaN row (inf - inf)
            base[3, 2] = nan                    # NaN entry: NaN row
            base[4, :] = 0.0                    # uniform
            base[5, :] = -inf
            base[5, cols - 1] = 1.0             # one finite entry: one-hot
            base[6, :] *= 1000.0                # large spread: underflow to 0
            base[7, :cols // 2] = -inf          # half masked (a padded vocabulary)
            x = base.to(device=device, dtype=dt)
            for log in (0, 1):
                fn = torch.log_softmax if log else torch.softmax
                ref = fn(x.double(), -1)
                for odt in ([dt] if dt == torch.float32 else [dt, torch.float32]):
                    nm = f"semantics {'log_' if log else ''}softmax {tag}->{str(odt)[6:]} cols={cols}"
                    ours = ops.softmax_fwd(x, log, odt)
                    theirs = fn(x, -1, dtype=odt) if odt != dt else fn(x, -1)
                    good, d = same_pattern(ours, theirs)
                    rep.ok(good, nm + " pattern vs torch", d)
                    rtol = ULP[odt] if odt != torch.float32 else 2e-5
                    atol = TINY[odt]
                    if log:
                        xd = x.double()
                        atol = 4 * ULP[torch.float32] * (xd - xd.max(-1, keepdim=True).values).abs().nan_to_num(0.0) + 1e-6
                    good, _, d = close(ours, ref, rtol, atol)
                    rep.ok(good, nm + " values vs fp64", d)
        # 0 columns: softmax writes nothing; sum 0, mean NaN; rms_norm rstd NaN (0 / 0)
        x0 = torch.empty((3, 0), dtype=dt, device=device)
        y0 = ops.softmax_fwd(x0, 0)
        rep.ok(y0.shape == (3, 0), f"semantics softmax 0 cols {tag}")
        s = ops.row_sum(x0, 0, torch.float32)
        m = ops.row_sum(x0, 1, torch.float32)
        ts, tm = x0.float().sum(-1), x0.float().mean(-1)
        rep.ok(bool((s == 0).all()) and torch.equal(s, ts), f"semantics sum 0 cols {tag}", f"{s.tolist()}")
        rep.ok(bool(torch.isnan(m).all()) and bool(torch.isnan(tm).all()), f"semantics mean 0 cols {tag}", f"{m.tolist()}")
        _, rstd0 = ops.rms_fwd(x0, None, 1e-6, 0)
        rep.ok(bool(torch.isnan(rstd0).all()), f"semantics rms_norm 0 cols rstd NaN {tag}", f"{rstd0.tolist()}")
        # 0 rows: nothing to do, dweight = 0
        xr = torch.empty((0, 64), dtype=dt, device=device)
        wr = torch.ones(64, dtype=dt, device=device)
        _, dwr = ops.rms_bwd(xr, wr, 1e-6, 0, torch.empty(0, device=device), xr)
        rep.ok(bool((dwr == 0).all()), f"semantics rms_norm_bwd 0 rows dweight 0 {tag}")
        # row sums with inf / NaN / -0 / cancellation
        for cols in (5, 4096, 151936):
            base = randn((6, cols), torch.float32, "cpu", seed=cols + 1)
            base[0, 1] = inf
            base[1, 0], base[1, 2] = inf, -inf
            base[2, 3] = nan
            base[3, :] = -0.0
            base[4, :] = 1.0
            x = base.to(device=device, dtype=dt)
            for mean in (0, 1):
                ref = x.double().mean(-1) if mean else x.double().sum(-1)
                bound = x.double().abs().nan_to_num(0.0, 0.0, 0.0).sum(-1) / (cols if mean else 1)
                for odt in ([dt] if dt == torch.float32 else [dt, torch.float32]):
                    nm = f"semantics {'mean' if mean else 'sum'} {tag}->{str(odt)[6:]} cols={cols}"
                    ours = ops.row_sum(x, mean, odt)
                    theirs = (x.mean(-1, dtype=odt) if mean else x.sum(-1, dtype=odt))
                    good, d = same_pattern(ours, theirs)
                    rep.ok(good, nm + " pattern vs torch", d)
                    rtol = ULP[odt] if odt != torch.float32 else 1e-6
                    # ref rounded to odt: a 16-bit sum may overflow to inf (fp16: 151936 ones)
                    good, _, d = close(ours, ref.to(odt).double(), rtol, 1e-5 * bound + TINY[odt])
                    rep.ok(good, nm + " values vs fp64", d)
        # rms_norm against F.rms_norm (rbw = 0) and the HF Python RMSNorm (rbw = 1)
        for cols in (7, 4096, 40000):
            base = randn((5, cols), torch.float32, "cpu", seed=cols + 2)
            base[1, :] = 0.0        # rstd = 1 / sqrt(eps)
            base[2, 0] = inf        # inf -> NaN row
            base[3, :] *= 1e-3
            x = base.to(device=device, dtype=dt)
            w = (randn((cols,), torch.float32, "cpu", seed=5) + 1.0).to(device=device, dtype=dt)
            eps = 1e-6
            xf = x.float()
            hf = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dt)
            rtol = 2 * ULP[dt] if dt != torch.float32 else 2e-5
            for rbw, theirs, tname in ((0, F.rms_norm(x, (cols,), w, eps), "F.rms_norm"), (1, hf, "HF RMSNorm")):
                nm = f"semantics rms_norm rbw={rbw} {tag} cols={cols}"
                ours, _ = ops.rms_fwd(x, w, eps, rbw)
                good, d = same_pattern(ours, theirs)
                rep.ok(good, nm + f" pattern vs {tname}", d)
                good, _, d = close(ours, theirs.double(), rtol, 1e-6)
                rep.ok(good, nm + f" values vs {tname}", d)


def _invariance_case(rep, name, run, full_in, prefixes, windows, layout_run=None):
    """run(rows slice list of inputs) -> list of outputs (row-indexed on dim 0)."""
    full = run([t for t in full_in])
    n = full_in[0].shape[0]
    for m in prefixes:
        if m > n:
            continue
        part = run([t[:m] for t in full_in])
        for i, (a, b) in enumerate(zip(part, full)):
            good, d = bitwise_equal(a, b[:m])
            if not rep.ok(good, f"invariance {name} prefix {m} (output {i})", d):
                return
    for s in windows:
        for m in prefixes:
            if s + m > n:
                continue
            part = run([t[s:s + m] for t in full_in])
            for i, (a, b) in enumerate(zip(part, full)):
                good, d = bitwise_equal(a, b[s:s + m])
                if not rep.ok(good, f"invariance {name} rows [{s}, {s + m}) (output {i})", d):
                    return
    again = run([t for t in full_in])
    for i, (a, b) in enumerate(zip(again, full)):
        good, d = bitwise_equal(a, b)
        rep.ok(good, f"invariance {name} repeat (output {i})", d)
    if layout_run is not None:
        other = layout_run([strided_copy(t) if t.dim() == 2 else t for t in full_in])
        for i, (a, b) in enumerate(zip(other, full)):
            good, d = bitwise_equal(a, b)
            rep.ok(good, f"invariance {name} strided+misaligned layout (output {i})", d)


def check_invariance(ops, device, rep, sizes, threads=None):
    print(f"[bitwise invariance] backend {ops.backend}", flush=True)
    windows = sizes.windows
    for (n, cols, prefixes, padded) in sizes.inv_shapes:
        for dt in (torch.bfloat16, torch.float32):
            tag = f"{str(dt)[6:]} [{n}x{cols}]" + (" padded" if padded else "")
            x = make_input(n, cols, dt, device, seed=n + cols, scale=4.0, padded=padded)
            dy = make_input(n, cols, dt, device, seed=n + cols + 1, padded=padded)
            w = randn((cols,), dt, device, seed=cols) + 1.0

            def strided_out(shape, dtype):
                return strided_empty(shape[0], shape[1], dtype, device)

            for log in (0, 1):
                for odt in ([dt] if dt == torch.float32 else [dt, torch.float32]):
                    nm = f"{'log_' if log else ''}softmax_fwd {tag}->{str(odt)[6:]}"
                    _invariance_case(rep, nm, lambda t: [ops.softmax_fwd(t[0], log, odt)], [x], prefixes, windows,
                                     lambda t: [ops.softmax_fwd(t[0], log, odt, y=strided_out(t[0].shape, odt)).clone()])
            y = ops.softmax_fwd(x, 1, dt)
            for log in (0, 1):
                nm = f"{'log_' if log else ''}softmax_bwd {tag}"
                _invariance_case(rep, nm, lambda t: [ops.softmax_bwd(t[0], t[1], log, dt)], [y, dy], prefixes, windows,
                                 lambda t: [ops.softmax_bwd(t[0], t[1], log, dt, dx=strided_out(t[0].shape, dt)).clone()])
            for rbw in (0, 1):
                nm = f"rms_norm_fwd rbw={rbw} {tag}"
                _invariance_case(rep, nm, lambda t: list(ops.rms_fwd(t[0], w, 1e-6, rbw)), [x], prefixes, windows,
                                 lambda t: [r.clone() for r in ops.rms_fwd(t[0], w, 1e-6, rbw, y=strided_out(t[0].shape, dt))])
            _, rstd = ops.rms_fwd(x, w, 1e-6, 0)
            nm = f"rms_norm_bwd dx {tag}"
            _invariance_case(rep, nm, lambda t: [ops.rms_bwd(t[0], w, 1e-6, 0, t[2], t[1], want_dweight=False)[0]],
                             [x, dy, rstd], prefixes, windows,
                             lambda t: [ops.rms_bwd(t[0], w, 1e-6, 0, t[2], t[1], want_dweight=False,
                                                    dx=strided_out(t[0].shape, dt))[0].clone()])
            # with dweight: dx must not change, dweight bitwise equal run to run and across layouts
            dx0, dw0 = ops.rms_bwd(x, w, 1e-6, 1, rstd, dy)
            dx_nw, _ = ops.rms_bwd(x, w, 1e-6, 1, rstd, dy, want_dweight=False)
            good, d = bitwise_equal(dx0, dx_nw)
            rep.ok(good, f"invariance rms_norm_bwd dx with / without dweight {tag}", d)
            for i in range(3):
                dx1, dw1 = ops.rms_bwd(x, w, 1e-6, 1, rstd, dy)
                good, d = bitwise_equal(dw1, dw0)
                rep.ok(good, f"determinism rms_norm_bwd dweight repeat {i} {tag}", d)
            dx2, dw2 = ops.rms_bwd(strided_copy(x), w, 1e-6, 1, rstd, strided_copy(dy), dx=strided_out(x.shape, dt))
            good, d = bitwise_equal(dw2, dw0)
            rep.ok(good, f"determinism rms_norm_bwd dweight strided layout {tag}", d)
            good, d = bitwise_equal(dx2.clone(), dx0)
            rep.ok(good, f"invariance rms_norm_bwd dx strided layout {tag}", d)
            for mean in (0, 1):
                for odt in ([dt] if dt == torch.float32 else [dt, torch.float32]):
                    nm = f"row_{'mean' if mean else 'sum'} {tag}->{str(odt)[6:]}"
                    _invariance_case(rep, nm, lambda t: [ops.row_sum(t[0], mean, odt)], [x], prefixes, windows,
                                     lambda t: [ops.row_sum(t[0], mean, odt)])
            # other stream (CUDA) / other thread count (CPU): same bits
            if device != "cpu" or threads:
                ref = [ops.softmax_fwd(x, 1, dt), ops.softmax_bwd(y, dy, 0, dt), *ops.rms_fwd(x, w, 1e-6, 1),
                       *ops.rms_bwd(x, w, 1e-6, 1, rstd, dy), ops.row_sum(x, 1, torch.float32)]
                if device != "cpu":
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    ops.stream = side
                    with torch.cuda.stream(side):
                        other = [ops.softmax_fwd(x, 1, dt), ops.softmax_bwd(y, dy, 0, dt), *ops.rms_fwd(x, w, 1e-6, 1),
                                 *ops.rms_bwd(x, w, 1e-6, 1, rstd, dy), ops.row_sum(x, 1, torch.float32)]
                    side.synchronize()
                    ops.stream = None
                    what = "side stream"
                else:
                    saved = ops.threads
                    ops.threads = threads
                    other = [ops.softmax_fwd(x, 1, dt), ops.softmax_bwd(y, dy, 0, dt), *ops.rms_fwd(x, w, 1e-6, 1),
                             *ops.rms_bwd(x, w, 1e-6, 1, rstd, dy), ops.row_sum(x, 1, torch.float32)]
                    ops.threads = saved
                    what = f"{threads} threads vs {saved}"
                for i, (a, b) in enumerate(zip(other, ref)):
                    good, d = bitwise_equal(a, b)
                    rep.ok(good, f"invariance {what} {tag} (output {i})", d)


def run_checks(ops, device, verbose=False, threads=None):
    rep = Report(verbose)
    sizes = Sizes(device)
    t0 = time.time()
    rep.section(check_accuracy, ops, device, rep, sizes)
    rep.section(check_semantics, ops, device, rep)
    rep.section(check_invariance, ops, device, rep, sizes, threads=threads)
    if device != "cpu":
        torch.cuda.synchronize()
    print(f"checks: {rep.passed} passed, {len(rep.failures)} failed ({time.time() - t0:.1f} s)")
    print("worst accuracy error / tolerance: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(rep.worst.items())))
    return rep


# ------------------------------------------------------------------------------------------------
# build
# ------------------------------------------------------------------------------------------------

def build(out_dir):
    nvcc = os.environ.get("NVCC") or next((str(p) for p in (Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc",)
                                           if p.exists()), "nvcc")
    flags = ["-O3", "-std=c++17", "-lineinfo", "--threads", "2", "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr", "-Xptxas", "-v",
             f"-I{ROOT / 'csrc'}", "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"]
    out_dir = Path(out_dir)

    def one(stem):
        obj = out_dir / f"{stem}.o"
        r = subprocess.run([nvcc, "-c", str(ROOT / "csrc/cuda/sm80" / f"{stem}.cu"), "-o", str(obj), *flags],
                           capture_output=True, text=True)
        return stem, obj, r

    t0 = time.time()
    with ThreadPoolExecutor(len(SOURCES)) as pool:
        results = list(pool.map(one, SOURCES))
    spills = []
    for stem, obj, r in results:
        if r.returncode != 0:
            sys.exit(f"nvcc failed on {stem}.cu:\n{r.stderr[-6000:]}")
        for line in (r.stdout + r.stderr).splitlines():
            if "spill" in line and not line.strip().startswith("0 bytes spill") and " 0 bytes spill stores, 0 bytes spill loads" not in line:
                spills.append(f"{stem}: {line.strip()}")
    lib = out_dir / "librowops_sm80.so"
    r = subprocess.run([nvcc, "-shared", *[str(o) for _, o, _ in results], "-o", str(lib)], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"link failed:\n{r.stderr[-4000:]}")
    print(f"built {lib} in {time.time() - t0:.1f} s; spills: {spills if spills else 'none'}")
    return lib


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------

L2_FLUSH_BYTES = 120 << 20  # > 2 x the H100's 50 MB L2
CLOCK_HZ = 2.0e9             # for the spin kernel's length (an upper bound of the SM clock)


def flush_l2(device):
    buf = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    buf.zero_()
    del buf


def gpu_time_us(fn, n_calls, reps=5, warmup=3):
    """Median over reps of the per-call GPU time of n_calls back-to-back calls fn(k), k counting up
    across everything (so the caller gives each call inputs not touched recently). Before each rep a
    spin kernel keeps the GPU busy for longer than queueing the n_calls takes (measured in the
    warm-up), so the events time the kernels, not the host's launch overhead."""
    k = 0
    for _ in range(warmup):
        fn(k)
        k += 1
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):  # queueing cost per call (the queue is short: nothing blocks)
        fn(k)
        k += 1
    per_call_host = (time.perf_counter() - t0) / 3
    torch.cuda.synchronize()
    sleep_cycles = int(min(0.05, max(1e-3, 1.5 * per_call_host * n_calls)) * CLOCK_HZ)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(sleep_cycles)
        start.record()
        for _ in range(n_calls):
            fn(k)
            k += 1
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / n_calls)
    return statistics.median(times)


class Pool:
    """n copies of a random [rows, cols] tensor in one buffer, n = enough for 120 MB (at least 2, at
    most the number of calls): call k reads copy k % n, last read >= 120 MB of traffic earlier (or
    never), so the L2 does not serve it."""

    def __init__(self, rows, cols, dtype, device, calls, seed, scale=1.0, fill=True):
        self.bytes = rows * cols * dtype.itemsize
        self.n = min(calls, max(2, math.ceil(L2_FLUSH_BYTES / max(1, self.bytes))))
        self.buf = torch.empty((self.n * rows, cols), dtype=dtype, device=device)
        if fill:
            g = torch.Generator(device=device).manual_seed(seed)
            self.buf.normal_(0.0, scale, generator=g)
        self.views = [self.buf[i * rows:(i + 1) * rows] for i in range(self.n)]

    def __getitem__(self, k):
        return self.views[k % self.n]


def bench(ops, device, quick=False):
    props = torch.cuda.get_device_properties(device)
    print(f"[timing] {props.name}, {props.multi_processor_count} SMs. Per call: median of 5 reps of 20 "
          f"back-to-back calls, inputs rotated past the L2; GB/s = minimum bytes moved (inputs read once, "
          f"outputs written once) / time; 'ours/torch' = torch time / our time (> 1: ours faster)", flush=True)
    rows_4k = [1, 16, 256, 2048, 16384] if not quick else [16, 2048]
    rows_vocab = [1, 16, 128, 512] if not quick else [16, 128]
    V = 151936
    results = []
    bf16, f32 = torch.bfloat16, torch.float32
    n_calls = 20
    calls = 3 + 5 * n_calls
    eps = 1e-6
    header = f"{'op':<26} {'shape':<15} {'ours us':>9} {'GB/s':>6} | {'baseline':<11} {'us':>9} {'GB/s':>6} {'ours/torch':>10}"
    print(header)
    print("-" * len(header))

    def case(label, shape, bytes_moved, ours_fn, torch_fns):
        flush_l2(device)
        t_ours = gpu_time_us(ours_fn, n_calls)
        for i, (tname, tfn) in enumerate(torch_fns):
            flush_l2(device)
            t = gpu_time_us(tfn, n_calls)
            results.append((label, shape, t_ours, tname, t))
            head = f"{label:<26} {shape:<15} {t_ours:9.2f} {bytes_moved / t_ours / 1e3:6.0f}" if i == 0 else " " * 58
            print(f"{head} | {tname:<11} {t:9.2f} {bytes_moved / t / 1e3:6.0f} {t / t_ours:10.2f}", flush=True)

    def raw(fn, args_list, ctx):
        def call(k):
            rc = fn(ctypes.byref(args_list[k % len(args_list)]), ctypes.byref(ctx))
            if rc != 0:
                raise RuntimeError(f"launcher returned {rc}")
        return call

    def softmax_cases(dt, odt, cols, rows_list, log):
        fn = torch.log_softmax if log else torch.softmax
        name = ("log_softmax" if log else "softmax") + f" {SHORT[dt]}" + (f"->{SHORT[odt]}" if odt != dt else "")
        for rows in rows_list:
            xs = Pool(rows, cols, dt, device, calls, seed=rows, scale=3.0)
            ys = Pool(rows, cols, odt, device, calls, seed=0, fill=False)
            args = [ops.softmax_args(xs[i], ys[i], log) for i in range(xs.n)]
            tfn = (lambda k: fn(xs[k], -1)) if odt == dt else (lambda k: fn(xs[k], -1, dtype=odt))
            case(name, f"[{rows},{cols}]", rows * cols * (dt.itemsize + odt.itemsize),
                 raw(ops._softmax_fwd, args, ops._ctx()), [("torch", tfn)])
            del xs, ys, args

    softmax_cases(bf16, bf16, 4096, rows_4k, 0)
    softmax_cases(bf16, bf16, 4096, rows_4k, 1)
    softmax_cases(bf16, bf16, V, rows_vocab, 0)
    softmax_cases(bf16, bf16, V, rows_vocab, 1)
    softmax_cases(bf16, f32, V, [128] if quick else [16, 128], 1)
    softmax_cases(f32, f32, V, [128] if quick else [16, 128], 1)
    softmax_cases(f32, f32, 4096, [2048] if quick else [256, 16384], 0)

    # rms_norm forward: rbw = 0 vs F.rms_norm, rbw = 1 vs the HF Python RMSNorm
    for rows in rows_4k:
        cols = 4096
        xs = Pool(rows, cols, bf16, device, calls, seed=rows)
        ys = Pool(rows, cols, bf16, device, calls, seed=0, fill=False)
        w = randn((cols,), bf16, device, seed=1) + 1.0
        rstd = torch.empty(rows, dtype=f32, device=device)
        for rbw in (0, 1):
            args = [ops.rms_args(xs[i], w, eps, rbw, y=ys[i], rstd=rstd) for i in range(xs.n)]
            if rbw == 0:
                tfns = [("F.rms_norm", lambda k: F.rms_norm(xs[k], (cols,), w, eps))]
            else:
                def hf(k):
                    h = xs[k].float()
                    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
                    return w * h.to(bf16)
                tfns = [("HF RMSNorm", hf)]
            case(f"rms_norm bf16 rbw={rbw}", f"[{rows},{cols}]", 2 * rows * cols * 2,
                 raw(ops._rms_norm_fwd, args, ops._ctx()), tfns)
        del xs, ys

    # row sum / mean, bf16 in and out, vs x.sum(-1) / x.mean(-1)
    for mean in (0, 1):
        for rows in rows_4k:
            cols = 4096
            xs = Pool(rows, cols, bf16, device, calls, seed=rows)
            ys = torch.empty((xs.n, rows), dtype=bf16, device=device)
            args = [ops.row_sum_args(xs[i], ys[i], mean) for i in range(xs.n)]
            tf = (lambda k: xs[k].mean(-1)) if mean else (lambda k: xs[k].sum(-1))
            case(f"row_{'mean' if mean else 'sum'} bf16", f"[{rows},{cols}]", rows * cols * 2,
                 raw(ops._row_sum, args, ops._ctx()), [("torch", tf)])
            del xs, ys

    # backward: softmax (4096), log_softmax (vocabulary), rms_norm with dweight
    for (cols, rows_list, log) in ((4096, [2048] if quick else [256, 16384], 0), (V, [128] if quick else [16, 128], 1)):
        for rows in rows_list:
            ys = Pool(rows, cols, bf16, device, calls, seed=rows, scale=0.01)
            dys = Pool(rows, cols, bf16, device, calls, seed=rows + 1)
            dxs = Pool(rows, cols, bf16, device, calls, seed=0, fill=False)
            args = [ops.softmax_args(None, ys[i], log, dy=dys[i], dx=dxs[i]) for i in range(ys.n)]
            if log:
                tf = lambda k: torch._log_softmax_backward_data(dys[k], ys[k], -1, bf16)
            else:
                tf = lambda k: torch._softmax_backward_data(dys[k], ys[k], -1, bf16)
            case(f"{'log_' if log else ''}softmax_bwd bf16", f"[{rows},{cols}]", 3 * rows * cols * 2,
                 raw(ops._softmax_bwd, args, ops._ctx()), [("torch", tf)])
            del ys, dys, dxs
    for rows in ([2048] if quick else [256, 2048, 16384]):
        cols = 4096
        xs = Pool(rows, cols, bf16, device, calls, seed=rows)
        dys = Pool(rows, cols, bf16, device, calls, seed=rows + 1)
        dxs = Pool(rows, cols, bf16, device, calls, seed=0, fill=False)
        w = randn((cols,), bf16, device, seed=1) + 1.0
        dw = torch.empty(cols, dtype=bf16, device=device)
        rstd = ops.rms_fwd(xs[0], w, eps, 0)[1]
        args = [ops.rms_args(xs[i], w, eps, 0, rstd=rstd, dy=dys[i], dx=dxs[i], dweight=dw) for i in range(xs.n)]
        ws = torch.empty(max(1, ops.rms_bwd_plan(args[0])), dtype=torch.uint8, device=device)
        for a in args:
            a.workspace = _ptr(ws)
        xg = [xs[i].detach().requires_grad_(True) for i in range(xs.n)]
        wg = w.detach().requires_grad_(True)
        outs = [F.rms_norm(xg[i], (cols,), wg, eps) for i in range(xs.n)]
        tf = lambda k: torch.autograd.grad(outs[k % xs.n], (xg[k % xs.n], wg), dys[k], retain_graph=True)
        case("rms_norm_bwd bf16 +dweight", f"[{rows},{cols}]", 3 * rows * cols * 2,
             raw(ops._rms_norm_bwd, args, ops._ctx()), [("autograd", tf)])
        del xs, dys, dxs, outs, xg
    return results


def summarize(results):
    """The ratio per op family: the worst case and the geometric mean."""
    by = {}
    for label, shape, t_ours, tname, t in results:
        by.setdefault(f"{label} vs {tname}", []).append((t / t_ours, shape))
    print("summary (ours/torch = torch time / our time; >= 0.85 is the target):")
    for key, vals in by.items():
        ratios = [r for r, _ in vals]
        worst = min(vals)
        geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        print(f"  {key:<40} geomean {geo:5.2f}   worst {worst[0]:5.2f} at {worst[1]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", help="use this built sm80 library instead of compiling")
    ap.add_argument("--cpu-lib", help="run the checks against this CPU library (rlk_*_cpu) on CPU tensors")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer timing shapes")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    if a.cpu_lib:
        ops = RowOps(a.cpu_lib, "cpu")
        ops.threads = 2
        rep = run_checks(ops, "cpu", a.verbose, threads=1)
        sys.exit(1 if rep.failures else 0)
    if not torch.cuda.is_available():
        sys.exit("no CUDA device")
    device = "cuda"
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    tmp = tempfile.mkdtemp(prefix="rowops_sm80_")
    lib = a.lib or build(tmp)
    ops = RowOps(lib, "sm80")
    rep = run_checks(ops, device, a.verbose)
    if not a.no_bench:
        try:
            summarize(bench(ops, device, a.quick))
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            rep.ok(False, f"bench raised {type(e).__name__}: {e}")
    if rep.failures:
        print(f"FAILED: {len(rep.failures)} checks: " + "; ".join(rep.failures[:20]))
        sys.exit(1)
    print("ALL CHECKS PASSED")


if __name__ == "__main__":
    main()
