#!/usr/bin/env python3
"""GPU probe of csrc/cuda/sm80/attention.cu (rlk_attention_fwd_sm80 / rlk_attention_bwd_sm80).

Self-contained: builds the .cu into a shared library with nvcc (plus a few lines of extern "C"
glue that report the C struct layout, checked against the ctypes mirrors), calls the launchers on
torch CUDA tensors through ctypes, and prints a PASS/FAIL table:
  1. accuracy vs an fp64 torch reference (fwd out / lse, bwd dq / dk / dv), next to torch SDPA's
     error on the same inputs;
  2. bitwise invariance: full vs chunked prefill vs token-by-token decode (KV cache with NaN past
     k_len), varlen packing orders, left-padded batch vs packed, batch 1 vs 16 decode, forced
     prefill vs split schedule, repeats, backward run to run and across packing orders;
  3. timing vs torch SDPA backends (prefill fwd 1k / 4k, fwd+bwd 4k, decode B = 1 / 16 / 64 over
     1k / 8k caches).
On a failure it prints where the results differ (sequence, row, head, column, values).

Usage: python3 scripts/attention_sm80_probe.py [--quick] [--skip-timing] [--keep-build DIR]
"""
import argparse
import ctypes
import math
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "csrc", "cuda", "sm80", "attention.cu")
RLK_BF16, RLK_F16 = 1, 2
RLK_UNSUPPORTED = -1
SCHEDULE_AUTO, SCHEDULE_PREFILL, SCHEDULE_SPLIT = 0, 1, 2

GLUE = r"""
#include <stddef.h>
#include "cuda/sm80/attention.cu"
/* offsets of the C structs, for the ctypes mirrors */
extern "C" void rlk_probe_layout(int64_t *o) {
    o[0] = sizeof(rlk_context); o[1] = offsetof(rlk_context, plan_only); o[2] = offsetof(rlk_context, kernel);
    o[3] = offsetof(rlk_context, workspace_bytes); o[4] = sizeof(rlk_attention_tensor);
    o[5] = sizeof(rlk_attention_args); o[6] = offsetof(rlk_attention_args, dtype);
    o[7] = offsetof(rlk_attention_args, softmax_scale); o[8] = offsetof(rlk_attention_args, q_start);
    o[9] = offsetof(rlk_attention_args, q); o[10] = offsetof(rlk_attention_args, lse);
    o[11] = offsetof(rlk_attention_args, dv); o[12] = offsetof(rlk_attention_args, workspace);
    o[13] = offsetof(rlk_attention_args, q_rows); o[14] = offsetof(rlk_attention_args, bad_index);
}
"""


class Context(ctypes.Structure):
    _fields_ = [("stream", ctypes.c_void_p), ("num_threads", ctypes.c_int), ("plan_only", ctypes.c_int),
                ("kernel", ctypes.c_char_p), ("workspace_bytes", ctypes.c_int64)]


class TensorArg(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("batch_stride", ctypes.c_int64), ("row_stride", ctypes.c_int64),
                ("head_stride", ctypes.c_int64)]


class Args(ctypes.Structure):
    _fields_ = [("batch", ctypes.c_int64), ("heads_q", ctypes.c_int64), ("heads_kv", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("max_q_len", ctypes.c_int64), ("max_k_len", ctypes.c_int64),
                ("q_rows", ctypes.c_int64), ("k_rows", ctypes.c_int64), ("dtype", ctypes.c_int), ("causal", ctypes.c_int), ("softmax_scale", ctypes.c_float),
                ("q_start", ctypes.c_void_p), ("q_len", ctypes.c_void_p), ("k_start", ctypes.c_void_p),
                ("k_len", ctypes.c_void_p), ("q", TensorArg), ("k", TensorArg), ("v", TensorArg),
                ("out", TensorArg), ("lse", TensorArg), ("dout", TensorArg), ("dq", TensorArg), ("dk", TensorArg),
                ("dv", TensorArg), ("bad_index", ctypes.c_void_p), ("workspace", ctypes.c_void_p)]


def build(keep_dir=None):
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        sys.exit("needs sm_80 or newer")
    # SASS for this GPU up to sm_90; newer GPUs JIT the compute_90 PTX
    arch = f"{major}{minor}" if major < 9 else "90"
    code = f"sm_{arch}" if major <= 9 else "compute_90"
    out_dir = keep_dir or tempfile.mkdtemp(prefix="attn_probe_")
    os.makedirs(out_dir, exist_ok=True)
    glue = os.path.join(out_dir, "probe_glue.cu")
    with open(glue, "w") as f:
        f.write(GLUE)
    lib = os.path.join(out_dir, "libattention_sm80.so")
    cmd = ["nvcc", "-shared", "-Xcompiler", "-fPIC", "-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr",
           "-Xptxas", "-v", f"-I{os.path.join(ROOT, 'csrc')}", "-gencode", f"arch=compute_{arch},code={code}",
           glue, "-o", lib]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stdout + r.stderr)
        sys.exit("nvcc failed")
    spills = [l for l in r.stderr.splitlines() if "spill" in l and not l.strip().startswith("0 bytes stack frame, 0 bytes spill")]
    print(f"built {lib} for {code} in {time.time() - t0:.0f} s; ptxas spill lines: {spills if spills else 'none'}")
    return ctypes.CDLL(lib)


class Attention:
    def __init__(self, lib):
        self.lib = lib
        for name in ("rlk_attention_fwd_sm80", "rlk_attention_bwd_sm80"):
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.POINTER(Args), ctypes.POINTER(Context)]
            fn.restype = ctypes.c_int
        lib.rlk_attention_fwd_sm80_forced.argtypes = [ctypes.POINTER(Args), ctypes.POINTER(Context), ctypes.c_int]
        lib.rlk_attention_fwd_sm80_forced.restype = ctypes.c_int
        lib.rlk_probe_layout.argtypes = [ctypes.POINTER(ctypes.c_int64)]
        o = (ctypes.c_int64 * 15)()
        lib.rlk_probe_layout(o)
        mine = [ctypes.sizeof(Context), Context.plan_only.offset, Context.kernel.offset, Context.workspace_bytes.offset,
                ctypes.sizeof(TensorArg), ctypes.sizeof(Args), Args.dtype.offset, Args.softmax_scale.offset,
                Args.q_start.offset, Args.q.offset, Args.lse.offset, Args.dv.offset, Args.workspace.offset,
                Args.q_rows.offset, Args.bad_index.offset]
        if list(o) != mine:
            sys.exit(f"ctypes layout mismatch: C {list(o)} vs ctypes {mine}")
        self.last_kernel = None
        self._ws = {}
        # the host-mapped range flag the kernels raise (pinned memory: the same address on the device)
        self.bad_index = torch.zeros(1, dtype=torch.int32, pin_memory=True)

    @staticmethod
    def tensor_arg(t, lse=False):
        if t is None:
            return TensorArg(None, 0, 0, 0)
        nd = 3 if lse else 4
        s = t.stride()
        if t.dim() == nd:
            return TensorArg(t.data_ptr(), s[0], s[1], s[2])
        assert t.dim() == nd - 1
        return TensorArg(t.data_ptr(), 0, s[0], s[1])

    def _args(self, q, k, v, meta, causal, scale, out, lse, dout=None, dq=None, dk=None, dv=None):
        a = Args()
        a.batch = meta["batch"]
        a.heads_q, a.heads_kv, a.head_dim = q.shape[-2], k.shape[-2], q.shape[-1]
        a.max_q_len, a.max_k_len = meta["max_q_len"], meta["max_k_len"]
        a.q_rows, a.k_rows = q.shape[-3], k.shape[-3]
        a.bad_index = self.bad_index.data_ptr()
        a.dtype = RLK_BF16 if q.dtype == torch.bfloat16 else RLK_F16
        a.causal = int(causal)
        a.softmax_scale = scale
        a.q_start, a.q_len = meta["q_start"].data_ptr(), meta["q_len"].data_ptr()
        a.k_start, a.k_len = meta["k_start"].data_ptr(), meta["k_len"].data_ptr()
        a.q, a.k, a.v, a.out = (self.tensor_arg(x) for x in (q, k, v, out))
        a.lse = self.tensor_arg(lse, lse=True)
        a.dout, a.dq, a.dk, a.dv = (self.tensor_arg(x) for x in (dout, dq, dk, dv))
        return a

    def _run(self, fn, a, *extra):
        ctx = Context()
        ctx.stream = torch.cuda.current_stream().cuda_stream
        ctx.plan_only = 1
        rc = fn(ctypes.byref(a), ctypes.byref(ctx), *extra)
        if rc != 0:
            return rc
        n = max(int(ctx.workspace_bytes), 16)
        ws = self._ws.get(n)
        if ws is None:
            ws = self._ws[n] = torch.empty(n, dtype=torch.uint8, device="cuda")
        a.workspace = ws.data_ptr()
        ctx.plan_only = 0
        rc = fn(ctypes.byref(a), ctypes.byref(ctx), *extra)
        self.last_kernel = ctx.kernel.decode() if ctx.kernel else None
        return rc

    def fwd(self, q, k, v, meta, causal, scale=None, schedule=SCHEDULE_AUTO, out=None, lse=None):
        scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        out = torch.empty_like(q) if out is None else out
        if lse is None:
            lse = new_lse(q)
        a = self._args(q, k, v, meta, causal, scale, out, lse)
        rc = self._run(self.lib.rlk_attention_fwd_sm80_forced, a, schedule)
        if rc != 0:
            raise RuntimeError(f"rlk_attention_fwd_sm80 returned {rc}")
        return out, lse

    def bwd(self, q, k, v, out, lse, dout, meta, causal, scale=None):
        scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        a = self._args(q, k, v, meta, causal, scale, out, lse, dout, dq, dk, dv)
        rc = self._run(self.lib.rlk_attention_bwd_sm80, a)
        if rc != 0:
            raise RuntimeError(f"rlk_attention_bwd_sm80 returned {rc}")
        return dq, dk, dv


def new_lse(q):
    """lse as the binding lays it out, [B, Hq, T] ([Hq, T] packed), seen as [B, T, Hq] ([T, Hq])."""
    shape = list(q.shape[:-1])
    shape[-2], shape[-1] = shape[-1], shape[-2]
    return torch.full(shape, float("nan"), dtype=torch.float32, device=q.device).transpose(-1, -2)


def make_meta(q_starts, q_lens, k_starts, k_lens):
    dev = "cuda"
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)
    return {"batch": len(q_lens), "q_start": i32(q_starts), "q_len": i32(q_lens), "k_start": i32(k_starts),
            "k_len": i32(k_lens), "max_q_len": max(q_lens) if q_lens else 0,
            "max_k_len": max(k_lens) if k_lens else 0}


def packed_meta(q_lens, k_lens=None):
    k_lens = q_lens if k_lens is None else k_lens
    qs = [sum(q_lens[:i]) for i in range(len(q_lens))]
    ks = [sum(k_lens[:i]) for i in range(len(k_lens))]
    return make_meta(qs, q_lens, ks, k_lens)


# ----------------------------------------------------------------------------------------------
# references and comparisons
# ----------------------------------------------------------------------------------------------
def ref_attention(q, k, v, causal, scale):
    """q [Tq, Hq, d], k/v [Tk, Hkv, d] (any float dtype) -> out [Tq, Hq, d], lse [Tq, Hq], fp64, bottom-right."""
    Tq, Hq, _ = q.shape
    Tk, Hkv, _ = k.shape
    G = Hq // Hkv
    qd = q.double().transpose(0, 1)
    kd = k.double().repeat_interleave(G, dim=1).transpose(0, 1)
    vd = v.double().repeat_interleave(G, dim=1).transpose(0, 1)
    s = (qd @ kd.transpose(1, 2)) * scale
    if causal:
        i = torch.arange(Tq, device=q.device)[:, None]
        j = torch.arange(Tk, device=q.device)[None, :]
        s = s.masked_fill(j > (Tk - Tq + i), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe[..., None])
    out = p @ vd
    return out.transpose(0, 1), lse.transpose(0, 1)


def bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def where_differs(a, b, names=("row", "head", "col")):
    """'' if bitwise equal, else a description of the first difference."""
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    ne = bits(a) != bits(b)
    n = int(ne.sum())
    if n == 0:
        return ""
    idx = ne.nonzero()[0].tolist()
    loc = ", ".join(f"{nm} {i}" for nm, i in zip(names[-len(idx):], idx))
    va, vb = a[tuple(idx)].item(), b[tuple(idx)].item()
    only_zero_sign = bool(((a == b) | ~ne).all())
    return (f"{n} of {a.numel()} differ; first at {loc}: {va!r} vs {vb!r}"
            + (" (only signed zeros differ)" if only_zero_sign else ""))


def max_err(x, ref):
    """max abs error of x vs ref (fp64), its location and the values there."""
    d = (x.double() - ref).abs()
    d = torch.where(torch.isnan(d), torch.full_like(d, float("inf")), d)
    v, i = d.flatten().max(0)
    idx = list(torch.unravel_index(i, d.shape)) if hasattr(torch, "unravel_index") else [int(i)]
    idx = [int(t) for t in idx]
    return float(v), idx, float(x[tuple(idx)]), float(ref[tuple(idx)])


RESULTS = []


def record(section, name, ok, detail):
    RESULTS.append((section, name, ok, detail))
    print(f"  [{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)


# ----------------------------------------------------------------------------------------------
# 1. accuracy
# ----------------------------------------------------------------------------------------------
def sdpa_one(q, k, v, causal, scale, dout=None):
    """torch SDPA on one sequence ([T, H, d] layout); returns out (and grads if dout)."""
    G = q.shape[1] // k.shape[1]
    qq = q.transpose(0, 1)[None].detach().requires_grad_(dout is not None)
    kk = k.repeat_interleave(G, dim=1).transpose(0, 1)[None].detach().requires_grad_(dout is not None)
    vv = v.repeat_interleave(G, dim=1).transpose(0, 1)[None].detach().requires_grad_(dout is not None)
    o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, scale=scale)
    if dout is None:
        return o[0].transpose(0, 1).detach(), None
    o.backward(dout.transpose(0, 1)[None])
    Hkv = k.shape[1]
    dk = kk.grad[0].transpose(0, 1).reshape(k.shape[0], Hkv, G, -1).sum(2)
    dv = vv.grad[0].transpose(0, 1).reshape(v.shape[0], Hkv, G, -1).sum(2)
    return o[0].transpose(0, 1).detach(), (qq.grad[0].transpose(0, 1), dk, dv)


def test_accuracy(att, quick):
    print("\n== 1. accuracy vs fp64 (packed varlen batch of all lengths; SDPA error on the same inputs)")
    lengths = [1, 2, 63, 64, 65, 127, 511, 512, 513, 1000, 4097]
    if quick:
        lengths = [1, 63, 65, 512, 513, 1000]
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for d in (64, 128):
            for Hq, Hkv in ((8, 2), (4, 4)):
                for causal in (True, False):
                    name = f"{str(dtype)[6:]} d{d} {Hq}:{Hkv} {'causal' if causal else 'full'}"
                    try:
                        accuracy_case(att, lengths, dtype, d, Hq, Hkv, causal, name)
                    except Exception as e:  # noqa: BLE001
                        record("accuracy", name, False, f"exception {e!r}")
                        if "CUDA" in repr(e) or "illegal" in repr(e):
                            raise
    # rows that see no key (causal, q_len > k_len) and k_len = 0
    meta = make_meta([0, 5], [5, 3], [0, 2], [2, 0])
    q = torch.randn(8, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 64, device="cuda", dtype=torch.bfloat16)
    for sched in (SCHEDULE_PREFILL, SCHEDULE_SPLIT):
        out, lse = att.fwd(q, k, k, meta, True, schedule=sched)
        ro, rl = ref_attention(q[:5], k[:2], k[:2], True, 1 / 8)
        e_out = (out[:5].double() - ro).abs().max().item()
        ok = (e_out < 1e-2 and bool(torch.isinf(lse[:3]).all()) and bool((out[:3] == 0).all())
              and bool((out[5:] == 0).all()) and bool(torch.isinf(lse[5:]).all())
              and (lse[3:5].double() - rl[3:5]).abs().max().item() < 1e-3)
        record("accuracy", f"empty rows (L=0, k_len=0) schedule {sched}", ok,
               f"out err {e_out:.2e}, lse rows 0-2 {lse[:3, 0].tolist()}, k_len=0 rows lse {lse[5:, 0].tolist()}")


def accuracy_case(att, lengths, dtype, d, Hq, Hkv, causal, name):
    N = sum(lengths)
    scale = 1.0 / math.sqrt(d)
    q = torch.randn(N, Hq, d, device="cuda", dtype=dtype)
    k = torch.randn(N, Hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(N, Hkv, d, device="cuda", dtype=dtype)
    dout = torch.randn(N, Hq, d, device="cuda", dtype=dtype)
    meta = packed_meta(lengths)
    out, lse = att.fwd(q, k, v, meta, causal, scale)
    dq, dk, dv = att.bwd(q, k, v, out, lse, dout, meta, causal, scale)
    torch.cuda.synchronize()
    eps = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    worst = {}
    start = 0
    for T in lengths:
        sl = slice(start, start + T)
        qs, ks, vs, gs = q[sl], k[sl], v[sl], dout[sl]
        qd, kd, vd = (x.double().requires_grad_() for x in (qs, ks, vs))
        ro, rl = ref_attention(qd, kd, vd, causal, scale)
        ro.backward(gs.double())
        so, sg = sdpa_one(qs, ks, vs, causal, scale, gs)
        refs = {"out": ro.detach(), "lse": rl.detach(), "dq": qd.grad, "dk": kd.grad, "dv": vd.grad}
        mine = {"out": out[sl], "lse": lse[sl], "dq": dq[sl], "dk": dk[sl], "dv": dv[sl]}
        theirs = {"out": so, "lse": None, "dq": sg[0], "dk": sg[1], "dv": sg[2]}
        for key in refs:
            e, idx, got, want = max_err(mine[key], refs[key])
            es = max_err(theirs[key], refs[key])[0] if theirs[key] is not None else 0.0
            scale_ref = refs[key].abs().max().item()
            w = worst.setdefault(key, [0.0, 0.0, None, 0.0, True])
            tol = (1e-4 + 1e-5 * scale_ref) if key == "lse" else (2 * es + eps * max(scale_ref, 1e-3))
            ok = e <= tol
            if e > w[0] or (not ok and w[4]):
                w[0], w[2] = e, f"T={T} (row, head, col)={idx}: {got:.6g} vs {want:.6g}"
            w[1] = max(w[1], es)
            w[3] = max(w[3], scale_ref)
            w[4] = w[4] and ok
        start += T
    ok = all(w[4] for w in worst.values())
    detail = "; ".join(f"{k_} {w[0]:.1e}" + (f"/sdpa {w[1]:.1e}" if k_ != "lse" else "") for k_, w in worst.items())
    if not ok:
        detail += " | worst: " + "; ".join(f"{k_} at {w[2]}" for k_, w in worst.items() if not w[4])
    record("accuracy", name, ok, detail)


# ----------------------------------------------------------------------------------------------
# 2. bitwise invariance
# ----------------------------------------------------------------------------------------------
def check_equal(section, name, a, b, names=("row", "head", "col")):
    msg = where_differs(a, b, names)
    record(section, name, msg == "", msg or "bitwise equal")
    return msg == ""


def test_invariance(att, quick):
    print("\n== 2. bitwise invariance")
    cases = [(torch.bfloat16, 128, 8, 2), (torch.float16, 64, 4, 4)]
    if not quick:
        cases += [(torch.bfloat16, 64, 8, 1), (torch.float16, 128, 4, 2)]
    for dtype, d, Hq, Hkv in cases:
        tag = f"{str(dtype)[6:]} d{d} {Hq}:{Hkv}"
        torch.manual_seed(1)
        chunked_vs_full(att, dtype, d, Hq, Hkv, tag, quick)
        packing_orders(att, dtype, d, Hq, Hkv, tag)
        decode_batches(att, dtype, d, Hq, Hkv, tag)
    bad_ranges(att)
    unsupported(att)


def chunked_vs_full(att, dtype, d, Hq, Hkv, tag, quick):
    """full prefill vs chunked prefill vs token-by-token decode of one sequence, KV cache layout
    [1, Tmax, Hkv, d] whose rows past k_len are NaN (must never be read into the result)."""
    T = 1100
    q = torch.randn(T, Hq, d, device="cuda", dtype=dtype)
    k = torch.randn(T, Hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(T, Hkv, d, device="cuda", dtype=dtype)
    full_meta = packed_meta([T])
    full, full_lse = att.fwd(q, k, v, full_meta, True)
    full_kernel = att.last_kernel
    full_s, full_s_lse = att.fwd(q, k, v, full_meta, True, schedule=SCHEDULE_SPLIT)
    check_equal("invariance", f"{tag} full prefill: prefill vs split schedule (out)", full, full_s)
    check_equal("invariance", f"{tag} full prefill: prefill vs split schedule (lse)", full_lse, full_s_lse, ("row", "head"))
    again, again_lse = att.fwd(q, k, v, full_meta, True)
    check_equal("invariance", f"{tag} repeat full prefill", torch.cat([full.flatten(), full_lse.flatten().view(full.dtype)]),
                torch.cat([again.flatten(), again_lse.flatten().view(full.dtype)]), ("index",))
    chunk_sizes = [1, 7, 64, 100, 512, 1000]
    if quick:
        chunk_sizes = [1, 64, 512]
    for c in chunk_sizes:
        schedules = [SCHEDULE_AUTO] + ([SCHEDULE_PREFILL, SCHEDULE_SPLIT] if c in (1, 64) else [])
        for sched in schedules:
            kc = torch.full((1, T + 64, Hkv, d), float("nan"), device="cuda", dtype=dtype)
            vc = torch.full((1, T + 64, Hkv, d), float("nan"), device="cuda", dtype=dtype)
            out = torch.full_like(q, float("nan"))
            lse = new_lse(q)
            kernels = set()
            for s in range(0, T, c):
                e = min(T, s + c)
                kc[0, s:e] = k[s:e]
                vc[0, s:e] = v[s:e]
                meta = make_meta([s], [e - s], [0], [e])
                # q / out / lse are views of the full tensors: q_start = s addresses the chunk
                att.fwd(q, kc, vc, meta, True, schedule=sched, out=out, lse=lse)
                kernels.add(att.last_kernel)
            label = {0: "auto", 1: "forced prefill", 2: "forced split"}[sched]
            ok = check_equal("invariance", f"{tag} chunk {c} ({label}: {'+'.join(sorted(kernels))}) vs full ({full_kernel}) out",
                             out, full)
            if ok:
                check_equal("invariance", f"{tag} chunk {c} ({label}) lse", lse, full_lse, ("row", "head"))


def packing_orders(att, dtype, d, Hq, Hkv, tag):
    lens = [1000, 513, 1, 64, 2000, 127]
    seqs = [tuple(torch.randn(T, H, d, device="cuda", dtype=dtype) for H in (Hq, Hkv, Hkv, Hq)) for T in lens]
    for causal in (True, False):
        ctag = f"{tag} {'causal' if causal else 'full'}"
        results = {}
        grads = {}
        for order_name, order in (("order A", [0, 1, 2, 3, 4, 5]), ("order B", [4, 2, 5, 0, 3, 1])):
            q = torch.cat([seqs[i][0] for i in order])
            k = torch.cat([seqs[i][1] for i in order])
            v = torch.cat([seqs[i][2] for i in order])
            g = torch.cat([seqs[i][3] for i in order])
            meta = packed_meta([lens[i] for i in order])
            out, lse = att.fwd(q, k, v, meta, causal)
            dq, dk, dv = att.bwd(q, k, v, out, lse, g, meta, causal)
            dq2, dk2, dv2 = att.bwd(q, k, v, out, lse, g, meta, causal)
            if order_name == "order A":
                for nm, x, y in (("dq", dq, dq2), ("dk", dk, dk2), ("dv", dv, dv2)):
                    check_equal("invariance", f"{ctag} backward run to run {nm}", x, y)
            starts = {i: sum(lens[j] for j in order[:pos]) for pos, i in enumerate(order)}
            results[order_name] = {i: (out[starts[i]:starts[i] + lens[i]], lse[starts[i]:starts[i] + lens[i]]) for i in order}
            grads[order_name] = {i: (dq[starts[i]:starts[i] + lens[i]], dk[starts[i]:starts[i] + lens[i]],
                                     dv[starts[i]:starts[i] + lens[i]]) for i in order}
        # each sequence alone (batch 1)
        alone = {}
        for i, T in enumerate(lens):
            alone[i] = att.fwd(seqs[i][0], seqs[i][1], seqs[i][2], packed_meta([T]), causal)
        # left-padded batch [B, Tmax, H, d], NaN padding, q_start = k_start = Tmax - T
        Tmax = max(lens) + 5
        B = len(lens)
        qp = torch.full((B, Tmax, Hq, d), float("nan"), device="cuda", dtype=dtype)
        kp = torch.full((B, Tmax, Hkv, d), float("nan"), device="cuda", dtype=dtype)
        vp = torch.full((B, Tmax, Hkv, d), float("nan"), device="cuda", dtype=dtype)
        for i, T in enumerate(lens):
            qp[i, Tmax - T:], kp[i, Tmax - T:], vp[i, Tmax - T:] = seqs[i][0], seqs[i][1], seqs[i][2]
        pads = [Tmax - T for T in lens]
        outp, lsep = att.fwd(qp, kp, vp, make_meta(pads, lens, pads, lens), causal)
        a_out = torch.cat([results["order A"][i][0] for i in range(B)])
        b_out = torch.cat([results["order B"][i][0] for i in range(B)])
        s_out = torch.cat([alone[i][0] for i in range(B)])
        p_out = torch.cat([outp[i, Tmax - T:] for i, T in enumerate(lens)])
        check_equal("invariance", f"{ctag} varlen order A vs order B (out)", a_out, b_out)
        check_equal("invariance", f"{ctag} varlen packed vs each sequence alone (out)", a_out, s_out)
        check_equal("invariance", f"{ctag} left-padded batch vs packed (out)", p_out, a_out)
        a_lse = torch.cat([results["order A"][i][1] for i in range(B)])
        p_lse = torch.cat([lsep[i, Tmax - T:] for i, T in enumerate(lens)])
        check_equal("invariance", f"{ctag} left-padded batch vs packed (lse)", p_lse, a_lse, ("row", "head"))
        for j, nm in enumerate(("dq", "dk", "dv")):
            x = torch.cat([grads["order A"][i][j] for i in range(B)])
            y = torch.cat([grads["order B"][i][j] for i in range(B)])
            check_equal("invariance", f"{ctag} backward order A vs order B {nm}", x, y)


def decode_batches(att, dtype, d, Hq, Hkv, tag):
    """decode of 16 sequences as one batch vs one at a time vs the last row of each full prefill."""
    B, Tmax = 16, 3000
    gen = torch.Generator().manual_seed(7)
    lens = [int(x) for x in torch.randint(1, Tmax, (B,), generator=gen)]
    lens[0], lens[1], lens[2] = 1, 512, 513
    kc = torch.full((B, Tmax, Hkv, d), float("nan"), device="cuda", dtype=dtype)
    vc = torch.full((B, Tmax, Hkv, d), float("nan"), device="cuda", dtype=dtype)
    qf = [torch.randn(T, Hq, d, device="cuda", dtype=dtype) for T in lens]
    for i, T in enumerate(lens):
        kc[i, :T] = torch.randn(T, Hkv, d, device="cuda", dtype=dtype)
        vc[i, :T] = torch.randn(T, Hkv, d, device="cuda", dtype=dtype)
    qdec = torch.stack([qf[i][-1] for i in range(B)])[:, None]  # [B, 1, Hq, d]
    meta = make_meta([0] * B, [1] * B, [0] * B, lens)
    out16, lse16 = att.fwd(qdec, kc, vc, meta, True)
    kern16 = att.last_kernel
    singles, prefill_rows = [], []
    for i, T in enumerate(lens):
        o1, _ = att.fwd(qdec[i:i + 1], kc[i:i + 1], vc[i:i + 1], make_meta([0], [1], [0], [T]), True)
        singles.append(o1)
        # full prefill of the sequence: q rows 0..T-1 over its own keys, [1, T, H, d] views of the cache
        of, _ = att.fwd(qf[i][None], kc[i:i + 1], vc[i:i + 1], make_meta([0], [T], [0], [T]), True)
        prefill_rows.append(of[:, T - 1:T])
    check_equal("invariance", f"{tag} decode batch 16 ({kern16}) vs batch 1", out16, torch.cat(singles), ("b", "q", "head", "col"))
    check_equal("invariance", f"{tag} decode batch 16 vs last row of full prefill", out16, torch.cat(prefill_rows),
                ("b", "q", "head", "col"))
    out16b, lse16b = att.fwd(qdec, kc, vc, meta, True)
    check_equal("invariance", f"{tag} decode repeat", torch.cat([out16.flatten(), lse16.flatten().view(out16.dtype)]),
                torch.cat([out16b.flatten(), lse16b.flatten().view(out16.dtype)]), ("index",))
    outp, _ = att.fwd(qdec, kc, vc, meta, True, schedule=SCHEDULE_PREFILL)
    check_equal("invariance", f"{tag} decode forced prefill vs split", outp, out16, ("b", "q", "head", "col"))


def bad_ranges(att):
    """a sequence past its storage rows or longer than max_k_len is skipped and raises the flag; the
    other sequences' rows come out as without it."""
    q = torch.randn(300, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(300, 2, 64, device="cuda", dtype=torch.bfloat16)
    good, _ = att.fwd(q, k, k, make_meta([0, 100], [100, 100], [0, 100], [100, 100]), True)
    torch.cuda.synchronize()
    for label, qs, kl in (("past the rows", 250, 100), ("k_len > max_k_len", 100, 120)):
        for sched in (SCHEDULE_PREFILL, SCHEDULE_SPLIT):
            att.bad_index.zero_()
            meta = make_meta([0, qs], [100, 100], [0, 100], [100, kl])
            meta["max_k_len"] = 100
            out, _ = att.fwd(q, k, k, meta, True, schedule=sched)
            torch.cuda.synchronize()
            flag = int(att.bad_index[0])
            same = where_differs(out[:100], good[:100])
            record("invariance", f"bad range ({label}, schedule {sched}) flagged, other sequence intact",
                   flag == 1 and same == "", f"flag {flag}; first sequence: {same or 'bitwise equal'}")
    att.bad_index.zero_()
    meta = make_meta([0, 250], [100, 100], [0, 100], [100, 100])
    dq, dk, dv = att.bwd(q, k, k, good, new_lse(q), q, meta, True)
    torch.cuda.synchronize()
    record("invariance", "bad range backward flagged", int(att.bad_index[0]) == 1, f"flag {int(att.bad_index[0])}")
    att.bad_index.zero_()


def unsupported(att):
    q = torch.randn(4, 2, 96, device="cuda", dtype=torch.bfloat16)
    meta = packed_meta([4])
    try:
        att.fwd(q, q, q, meta, True)
        record("invariance", "head_dim 96 -> RLK_UNSUPPORTED", False, "launched")
    except RuntimeError as e:
        record("invariance", "head_dim 96 -> RLK_UNSUPPORTED", "-1" in str(e), str(e))
    q = torch.randn(4, 2, 68, device="cuda", dtype=torch.bfloat16)[..., :64]  # head stride 68: not 16-byte rows
    try:
        att.fwd(q, q, q, meta, True)
        record("invariance", "row stride % 8 != 0 -> RLK_UNSUPPORTED", False, "launched")
    except RuntimeError as e:
        record("invariance", "row stride % 8 != 0 -> RLK_UNSUPPORTED", "-1" in str(e), str(e))


# ----------------------------------------------------------------------------------------------
# 3. timing
# ----------------------------------------------------------------------------------------------
def bench(fn, reps=20, warmup=3, graph=False):
    """median ms per call (CUDA events); graph=True: the calls are captured in a CUDA graph of `reps`
    calls (launch overhead out of the measurement), median over 5 replays."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / reps)
        return sorted(times)[len(times) // 2]
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def sdpa_backends():
    from torch.nn.attention import SDPBackend
    names = [("cudnn", "CUDNN_ATTENTION"), ("flash", "FLASH_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION")]
    return [(n, getattr(SDPBackend, a)) for n, a in names if hasattr(SDPBackend, a)]


def sdpa_time(backend, q, k, v, causal, backward=False, graph=False):
    """q [B, H, T, d], k/v [B, Hkv, S, d]: ms of one SDPA call (GQA natively where the backend takes
    enable_gqa, else on K/V expanded beforehand), or a string saying why there is none."""
    from torch.nn.attention import sdpa_kernel
    G = q.shape[1] // k.shape[1]
    why = ""
    for native in (True, False):
        kk, vv = (k, v) if native else (k.repeat_interleave(G, 1), v.repeat_interleave(G, 1))
        kw = {"enable_gqa": True} if native and G > 1 else {}
        qq = q
        if backward:
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, kk, vv))
            g = torch.randn_like(q)

        def run():
            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, **kw)
                if backward:
                    o.backward(g)
        for use_graph in ((True, False) if graph and not backward else (False,)):
            try:
                return bench(run, graph=use_graph), ("" if native or G == 1 else " (K/V expanded)")
            except Exception as e:  # noqa: BLE001
                why = str(e).splitlines()[0][:60] if str(e) else repr(e)[:60]
                torch.cuda.synchronize()
    return None, f"n/a ({why})"


def fmt_sdpa(name, r, flops=None, us=False):
    ms, note = r
    if ms is None:
        return f" | {name} {note}"
    if us:
        return f" | {name} {ms * 1e3:.1f} us{note}"
    return f" | {name} {ms:.3f} ms ({flops / ms / 1e9:.0f}){note}"


def test_timing(att, quick):
    print("\n== 3. timing (H100 numbers in /work/shared/FACTS.md: cuDNN fwd 4k 621 TFLOP/s, flash 331)")
    dtype, d, Hq, Hkv = torch.bfloat16, 128, 32, 8
    rows = []
    for T in (1024, 4096):
        B = 16384 // T
        q = torch.randn(B, T, Hq, d, device="cuda", dtype=dtype)
        k = torch.randn(B, T, Hkv, d, device="cuda", dtype=dtype)
        v = torch.randn(B, T, Hkv, d, device="cuda", dtype=dtype)
        meta = make_meta([0] * B, [T] * B, [0] * B, [T] * B)
        flops = 4 * B * Hq * T * T * d / 2
        out, lse = att.fwd(q, k, v, meta, True)
        ms = bench(lambda: att.fwd(q, k, v, meta, True, out=out, lse=lse))
        line = f"prefill fwd T={T} B={B}: ours {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)"
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        for name, be in sdpa_backends():
            line += fmt_sdpa(name, sdpa_time(be, qt, kt, vt, True), flops)
        rows.append(line)
        print("  " + line, flush=True)
        if T == 4096:
            g = torch.randn_like(q)

            def fb():
                o, l_ = att.fwd(q, k, v, meta, True, out=out, lse=lse)
                att.bwd(q, k, v, o, l_, g, meta, True)
            ms = bench(fb, reps=10)
            ms_b = bench(lambda: att.bwd(q, k, v, out, lse, g, meta, True), reps=10)
            line = (f"prefill fwd+bwd T={T} B={B}: ours {ms:.3f} ms ({3.5 * flops / ms / 1e9:.0f} TFLOP/s), "
                    f"bwd alone {ms_b:.3f} ms ({2.5 * flops / ms_b / 1e9:.0f})")
            for name, be in sdpa_backends():
                line += fmt_sdpa(name, sdpa_time(be, qt, kt, vt, True, backward=True), 3.5 * flops)
            rows.append(line)
            print("  " + line, flush=True)
        del q, k, v, out, lse
    for S in (1024, 8192):
        for B in (1, 16, 64):
            q = torch.randn(B, 1, Hq, d, device="cuda", dtype=dtype)
            kc = torch.randn(B, S, Hkv, d, device="cuda", dtype=dtype)
            vc = torch.randn(B, S, Hkv, d, device="cuda", dtype=dtype)
            meta = make_meta([0] * B, [1] * B, [0] * B, [S] * B)
            out, lse = att.fwd(q, kc, vc, meta, True)
            kern = att.last_kernel
            nbytes = 2 * B * S * Hkv * d * 2
            ms = bench(lambda: att.fwd(q, kc, vc, meta, True, out=out, lse=lse), graph=True)
            line = f"decode B={B} cache={S}: ours ({kern}) {ms * 1e3:.1f} us ({nbytes / ms / 1e9:.2f} TB/s)"
            qt = q.transpose(1, 2).contiguous()
            kt, vt = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
            for name, be in sdpa_backends():
                line += fmt_sdpa(name, sdpa_time(be, qt, kt, vt, False, graph=True), us=True)
            rows.append(line)
            print("  " + line, flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer lengths and cases")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--only", choices=["accuracy", "invariance", "timing"], default=None)
    ap.add_argument("--keep-build", default=None, help="folder for the glue source and the .so")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    t0 = time.time()
    att = Attention(build(args.keep_build))
    sections = [args.only] if args.only else ["accuracy", "invariance"] + ([] if args.skip_timing else ["timing"])
    timing_rows = []
    for sec in sections:
        ts = time.time()
        try:
            if sec == "accuracy":
                test_accuracy(att, args.quick)
            elif sec == "invariance":
                test_invariance(att, args.quick)
            else:
                timing_rows = test_timing(att, args.quick)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            record(sec, "section aborted", False, repr(e))
            if "CUDA" in repr(e):
                print("CUDA error: the context is gone, stopping")
                break
        print(f"  ({sec}: {time.time() - ts:.0f} s)")
    print("\n== summary")
    fails = [r for r in RESULTS if not r[2]]
    for sec in ("accuracy", "invariance", "timing"):
        n = [r for r in RESULTS if r[0] == sec]
        if n:
            print(f"  {sec:10s}: {sum(r[2] for r in n)}/{len(n)} PASS")
    for r in fails:
        print(f"  FAIL [{r[0]}] {r[1]}: {r[3]}")
    for line in timing_rows:
        print("  " + line)
    print(f"total {time.time() - t0:.0f} s; {'ALL PASS' if not fails else f'{len(fails)} FAIL'}")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
