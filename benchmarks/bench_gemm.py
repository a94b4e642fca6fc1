"""det_gemm (each usable GPU backend) vs torch.matmul (cuBLAS), bf16, same process.

Shapes: the Qwen3-8B linear layers (K -> N) for M in {1, 16, 64, 256, 1024, 4096, 16384}, plus
4096^3 and 8192^3. Forward: one GEMM. Backward: dA = g @ W and dB = A^T @ g (what autograd runs)
against the same two cuBLAS GEMMs. Median ms over CUDA events with inputs rotated past L2;
ratio = cuBLAS ms / ours, with cuBLAS and ours interleaved call by call. Floors: FLOP floor = 2MNK / (measured cuBLAS peak), byte floor =
(MK + KN + MN) * 2 bytes / (measured copy bandwidth); both recorded beside the numbers.

Writes benchmarks/results/<gpu>-gemm.json, a table in docs/benchmarks.md and
docs/plots/<gpu>-gemm-tflops.png. Usage: python3 benchmarks/bench_gemm.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rl_kernels  # noqa: E402
from rl_kernels import kernel_registry  # noqa: E402
from common import (ROOT, copies_to_rotate, cuda_median_ms, cuda_paired_median_ms,  # noqa: E402
                    device_name, device_slug, header, record, write_results)

QWEN3_8B = [(4096, 4096), (4096, 1024), (4096, 6144), (4096, 12288), (4096, 24576),
            (12288, 4096), (4096, 151936)]
M_SWEEP = [1, 16, 64, 256, 1024, 4096, 16384]
SQUARE = [4096, 8192]


def measure_ceilings():
    """(bytes/s of a device copy counting read + write, cuBLAS bf16 FLOP/s at 8192^3)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_median_ms(lambda: dst.copy_(src), [()], warmup=3, reps=10)
    bandwidth = 2 * src.numel() / (ms / 1e3)
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = cuda_median_ms(lambda: torch.matmul(a, a), [()], warmup=3, reps=10)
    return bandwidth, 2 * 8192 ** 3 / (ms / 1e3)


def reps_for(flops):
    est_ms = flops / 600e12 * 1e3
    return int(min(50, max(5, 300 / max(est_ms, 1e-3))))


def bench_shape(m, k, n, backends, ceilings, do_backward):
    bandwidth, peak = ceilings
    flops = 2 * m * n * k
    bytes_moved = 2 * (m * k + k * n + m * n)
    floor_ms = max(flops / peak, bytes_moved / bandwidth) * 1e3
    copies = copies_to_rotate(bytes_moved)
    sets = []
    for i in range(copies):
        gen = torch.Generator(device="cuda").manual_seed(i)
        a = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).to(torch.bfloat16)
        g = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
        sets.append((a, w, g))
    reps = reps_for(flops)
    shape = {"M": m, "N": n, "K": k, "floor_ms": floor_ms,
             "flop_floor_ms": flops / peak * 1e3, "byte_floor_ms": bytes_moved / bandwidth * 1e3}
    rows = []
    a0, w0, _ = sets[0]
    ref = a0[:256].double() @ w0.double().t()
    # cuBLAS and every backend interleaved (cuda_paired_median_ms), so all see one thermal state
    fwd = [lambda a, w, g: torch.matmul(a, w.t())] + [
        (lambda a, w, g, b=b: rl_kernels.det_gemm(a, w.t(), backend=b)) for b in backends]
    base_fwd, *fwd_ms = cuda_paired_median_ms(fwd, sets, reps=reps)
    for backend, ms in zip(backends, fwd_ms):
        out = rl_kernels.det_gemm(a0[:256], w0.t(), out_dtype=torch.float32, backend=backend)
        err = (out.double() - ref).abs().max().item()
        rows.append(record("det_gemm", backend, torch.bfloat16, shape, "fwd", ms, "torch.matmul",
                           base_fwd, flops / (ms / 1e3) / 1e12, None, err))
    if do_backward:
        bwd = [lambda a, w, g: (torch.matmul(g, w), torch.matmul(a.t(), g))] + [
            (lambda a, w, g, b=b: (rl_kernels.det_gemm(g, w, backend=b),
                                         rl_kernels.matmul(a.t(), g, backend=b)))
            for b in backends]
        base_bwd, *bwd_ms = cuda_paired_median_ms(bwd, sets, reps=reps)
        for backend, ms in zip(backends, bwd_ms):
            rows.append(record("det_gemm", backend, torch.bfloat16, shape, "bwd", ms,
                               "torch.matmul x2", base_bwd, 2 * flops / (ms / 1e3) / 1e12))
    del sets
    torch.cuda.empty_cache()
    return rows, base_fwd


def table(records):
    lines = ["| M | K | N | pass | backend | ms | cuBLAS ms | ratio | TFLOP/s | floor ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        s = r["shape"]
        lines.append(f"| {s['M']} | {s['K']} | {s['N']} | {r['pass']} | {r['backend']} | "
                     f"{r['ms']:.4f} | {r['baseline_ms']:.4f} | {r['ratio']:.3f} | "
                     f"{r['tflops']:.1f} | {s['floor_ms'] * (2 if r['pass'] == 'bwd' else 1):.4f} |")
    return "\n".join(lines)


def summary(records, backends):
    lines = []
    for backend in backends:
        big = [r for r in records if r["backend"] == backend and r["pass"] == "fwd"
               and r["shape"]["M"] >= 1024]
        small = [r for r in records if r["backend"] == backend and r["pass"] == "fwd"
                 and r["shape"]["M"] <= 64]
        bwd = [r for r in records if r["backend"] == backend and r["pass"] == "bwd"]
        for label, rows in (("fwd M>=1024", big), ("fwd M<=64", small), ("bwd", bwd)):
            if rows:
                ratios = [r["ratio"] for r in rows]
                geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
                lines.append(f"- {backend} {label}: geometric-mean ratio {geo:.3f}, min "
                             f"{min(ratios):.3f}, max {max(ratios):.3f} over {len(rows)} shapes")
    return "\n".join(lines)


def plot(records, backends, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    shapes = sorted({(r["shape"]["K"], r["shape"]["N"]) for r in records
                     if r["shape"]["M"] in M_SWEEP and r["pass"] == "fwd"})
    cols = 4
    fig, axes = plt.subplots(math.ceil(len(shapes) / cols), cols, figsize=(16, 8), squeeze=False)
    for ax, (k, n) in zip(axes.flat, shapes):
        rows = sorted((r for r in records if r["pass"] == "fwd" and r["shape"]["K"] == k
                       and r["shape"]["N"] == n), key=lambda r: r["shape"]["M"])
        ms = sorted({r["shape"]["M"] for r in rows})
        base = {r["shape"]["M"]: r["baseline_ms"] for r in rows}
        ax.plot(ms, [2 * m * n * k / base[m] / 1e9 for m in ms], "k--", label="cuBLAS")
        for backend in backends:
            pts = [(r["shape"]["M"], r["tflops"]) for r in rows if r["backend"] == backend]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=backend)
        ax.set_xscale("log", base=2)
        ax.set_title(f"K={k} N={n}")
        ax.set_xlabel("M")
        ax.set_ylabel("TFLOP/s")
    for ax in list(axes.flat)[len(shapes):]:
        ax.axis("off")
    axes.flat[0].legend()
    fig.suptitle(f"det_gemm vs cuBLAS, bf16, {device_name()}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    print(f"plot: {path}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="M in {1, 64, 4096} only")
    args = parser.parse_args()
    backends = [b for b in ("sm90", "sm80") if kernel_registry.backend_status("det_gemm", b)[0]]
    if not backends:
        sys.exit("no usable GPU backend")
    ceilings = measure_ceilings()
    print(f"ceilings: copy {ceilings[0] / 1e12:.2f} TB/s, cuBLAS bf16 {ceilings[1] / 1e12:.0f} TFLOP/s")
    m_sweep = [1, 64, 4096] if args.quick else M_SWEEP
    problems = [(m, k, n) for (k, n) in QWEN3_8B for m in m_sweep] + [(s, s, s) for s in SQUARE]
    records = []
    for m, k, n in problems:
        rows, base = bench_shape(m, k, n, backends, ceilings, do_backward=m >= 1024 or m == k)
        records += rows
        print(f"M={m:6d} K={k:6d} N={n:6d} cuBLAS {base:8.4f} ms | " + " | ".join(
            f"{r['backend']} {r['pass']} {r['ms']:.4f} ms x{r['ratio']:.2f}" for r in rows),
            flush=True)
    notes = (f"Ceilings measured in this run: device copy {ceilings[0] / 1e12:.2f} TB/s "
             f"(read + write), cuBLAS bf16 {ceilings[1] / 1e12:.0f} TFLOP/s at 8192^3. floor ms = "
             f"max(2MNK / cuBLAS peak, 2(MK + KN + MN) bytes / copy bandwidth); bwd rows: twice "
             f"that. ratio = cuBLAS ms / ours (> 1: faster than cuBLAS).\n\n")
    text = (header("det_gemm vs cuBLAS (bf16)") + notes + summary(records, backends) + "\n\n"
            + table(records) + "\n")
    print(summary(records, backends))
    plot(records, backends, ROOT / "docs" / "plots" / f"{device_slug()}-gemm-tflops.png")
    write_results("gemm", records, text)


if __name__ == "__main__":
    main()
