"""C reference GEMM (CPU backend) vs torch.matmul on the same thread count. Goal: within 4x of
torch fp32. Also bf16 (torch uses native bf16 dot instructions without a fixed order, we convert
to fp32 and keep one fma order). Usage: python3 benchmarks/bench_cpu_gemm.py"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rl_kernels  # noqa: E402
from common import cpu_median_s, header, record, write_results  # noqa: E402

SHAPES = [(512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (1, 4096, 4096),
          (64, 4096, 4096), (256, 4096, 1024)]


def main():
    threads = torch.get_num_threads()
    rl_kernels.set_num_threads(threads)
    records = []
    lines = [f"Threads: {threads} (torch and rl_kernels alike).\n",
             "| M | N | K | dtype | rl_kernels ms | torch ms | ratio (torch / ours) | "
             "rl_kernels GFLOP/s |", "|---|---|---|---|---|---|---|---|"]
    for m, n, k in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            a = torch.randn(m, k).to(dtype)
            w = torch.randn(n, k).to(dtype)
            reps = 3 if m * n * k >= 2**32 else 7
            ours = cpu_median_s(lambda: rl_kernels.matmul(a, w.t()), reps=reps)
            base = cpu_median_s(lambda: torch.matmul(a, w.t()), reps=reps)
            flops = 2 * m * n * k
            records.append(record("matmul", "cpu", dtype, {"M": m, "N": n, "K": k,
                                                           "threads": threads},
                                  "fwd", ours * 1e3, "torch.matmul", base * 1e3,
                                  flops / ours / 1e12))
            lines.append(f"| {m} | {n} | {k} | {str(dtype)[6:]} | {ours * 1e3:.2f} | "
                         f"{base * 1e3:.2f} | {base / ours:.2f} | {flops / ours / 1e9:.0f} |")
            print(lines[-1], flush=True)
    write_results("cpu-gemm", records, header("CPU reference GEMM vs torch.matmul")
                  + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
