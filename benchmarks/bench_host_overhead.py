"""Host overhead per call on tiny shapes: rl_kernels.matmul vs torch.matmul (CPU tensors, and CUDA
tensors when present). Goal: at most 2x torch's per-call time."""

from __future__ import annotations

import sys
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rl_kernels  # noqa: E402
from rl_kernels import _C  # noqa: E402
from common import header, record, write_results  # noqa: E402


def per_call_us(stmt, env, number=20000):
    best = min(timeit.repeat(stmt, globals=env, number=number, repeat=5))
    return best / number * 1e6


def main():
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    records, lines = [], []
    for device in devices:
        a = torch.randn(8, 8, device=device)
        b = torch.randn(8, 8, device=device)
        out = torch.empty(8, 8, device=device)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        env = dict(torch=torch, rl_kernels=rl_kernels, a=a, b=b, out=out, _C=_C)
        code = rl_kernels.kernel_registry.backend_code("cpu" if device == "cpu" else "sm80")
        stream = 0 if device == "cpu" else torch.cuda.current_stream().cuda_stream
        env.update(code=code, stream=stream)
        cases = {
            "torch.matmul": "torch.matmul(a, b)",
            "rl_kernels.matmul": "rl_kernels.matmul(a, b)",
            "rl_kernels.det_gemm": "rl_kernels.det_gemm(a, b)",
            "_C.gemm (preallocated out)": "_C.gemm(a, b, None, out, 1.0, 0.0, code, stream)",
            "torch.utils.dlpack.to_dlpack": "torch.utils.dlpack.to_dlpack(a)",
            "Tensor.__dlpack__": "a.__dlpack__()",
        }
        times = {}
        for name, stmt in cases.items():
            times[name] = per_call_us(stmt, env)
            sync()
        base = times["torch.matmul"]
        lines.append(f"\n### {device} tensors, 8 x 8 x 8 fp32\n\n| call | us per call | x torch.matmul |"
                     f"\n|---|---|---|")
        for name, us in times.items():
            lines.append(f"| {name} | {us:.2f} | {us / base:.2f} |")
            records.append(record("host_overhead:" + name, "cpu" if device == "cpu" else "gpu",
                                  torch.float32, {"M": 8, "N": 8, "K": 8, "device": device}, "fwd",
                                  us / 1e3, "torch.matmul", base / 1e3))
    table = header("Host overhead per call (tiny shapes)") + "\n".join(lines) + "\n"
    print(table)
    write_results("host-overhead", records, table)


if __name__ == "__main__":
    main()
