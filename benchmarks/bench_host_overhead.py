"""Host overhead per call on tiny shapes: rl_kernels.matmul vs torch.matmul, and a KV-cache decode
step (rl_kernels.attention_with_kvcache in its forms, rl_kernels.attention) vs torch SDPA (CPU
tensors, and CUDA tensors when present). Goal: at most 2x torch's per-call time. The shapes are
tiny so that the time is the host's: what a call costs beyond its kernels."""

from __future__ import annotations

import sys
import timeit
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rl_kernels  # noqa: E402
from rl_kernels import _C  # noqa: E402
from common import header, record, write_results  # noqa: E402


def per_call_us(stmt, env, number=20000):
    best = min(timeit.repeat(stmt, globals=env, number=number, repeat=5))
    return best / number * 1e6


def attention_cases(device):
    """A decode step on a tiny KV cache: B = 1, one query, 4 / 1 heads, 64 cached keys of 128."""
    cuda = device == "cuda"
    dtype, d = (torch.bfloat16, 64) if cuda else (torch.float32, 16)
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, 1, 4, d, device=device, generator=gen).to(dtype)
    k_cache, v_cache = (torch.randn(1, 128, 1, d, device=device, generator=gen).to(dtype) for _ in range(2))
    k_new, v_new = (torch.randn(1, 1, 1, d, device=device, generator=gen).to(dtype) for _ in range(2))
    qt, kt, vt = q.transpose(1, 2), k_cache[:, :64].transpose(1, 2), v_cache[:, :64].transpose(1, 2)
    lengths = torch.full((1,), 64, dtype=torch.int32, device=device)
    env = dict(torch=torch, F=F, rl_kernels=rl_kernels, q=q, k_cache=k_cache, v_cache=v_cache,
               k_new=k_new, v_new=v_new, qt=qt, kt=kt, vt=vt, lengths=lengths,
               k=k_cache[:, :64], v=v_cache[:, :64])
    cases = {
        "torch SDPA (GQA)": "F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)",
        "attention_with_kvcache(cache_seqlens tensor)":
            "rl_kernels.attention_with_kvcache(q, k_cache, v_cache, lengths)",
        "attention_with_kvcache(cache_seqlens int)":
            "rl_kernels.attention_with_kvcache(q, k_cache, v_cache, 64)",
        "attention_with_kvcache(int, k_new / v_new)":
            "rl_kernels.attention_with_kvcache(q, k_cache, v_cache, 64, k_new=k_new, v_new=v_new)",
        "attention_with_kvcache(tensor, k_new / v_new)":
            "rl_kernels.attention_with_kvcache(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new)",
        "attention(q, k, v, causal=False)": "rl_kernels.attention(q, k, v, causal=False)",
    }
    return env, cases, {"B": 1, "Tq": 1, "T_cache": 64, "Hq": 4, "Hkv": 1, "d": d, "device": device}, dtype


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
    threads = rl_kernels.get_num_threads()
    rl_kernels.set_num_threads(1)  # CPU attention: no OpenMP fork / join in a host-time number
    for device in devices:
        env, cases, shape, dtype = attention_cases(device)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        times = {}
        for name, stmt in cases.items():
            times[name] = per_call_us(stmt, env, number=2000)
            sync()
        base = times["torch SDPA (GQA)"]
        lines.append(f"\n### {device} tensors, decode step: B = 1, 4 / 1 heads, d = {shape['d']}, 64 "
                     f"cached keys, {str(dtype).replace('torch.', '')} (CPU kernels on 1 thread)"
                     f"\n\n| call | us per call | x SDPA |\n|---|---|---|")
        for name, us in times.items():
            lines.append(f"| {name} | {us:.2f} | {us / base:.2f} |")
            records.append(record("host_overhead:" + name, "cpu" if device == "cpu" else "gpu", dtype,
                                  shape, "decode", us / 1e3, "torch SDPA", base / 1e3))
    rl_kernels.set_num_threads(threads)
    table = header("Host overhead per call (tiny shapes)") + "\n".join(lines) + "\n"
    print(table)
    write_results("host-overhead", records, table)


if __name__ == "__main__":
    main()
