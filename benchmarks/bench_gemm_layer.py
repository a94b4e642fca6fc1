"""det_gemm vs cuBLAS on the GEMMs of one Qwen3-8B decoder layer (+ the LM head), at the token
counts RL batches really have: the figure that counts is the layer's time, not one shape's.

Shapes (K -> N, as transformers runs them: k_proj and v_proj are separate nn.Linear layers):
q 4096->4096, k 4096->1024, v 4096->1024, o 4096->4096, gate 4096->12288, up 4096->12288,
down 12288->4096, and the head 4096->151936.
Regimes:
- train: forward + backward (dX = G @ W, dW = G^T @ X) at 24 token counts drawn from a seeded
  log-uniform distribution on [200, 20000] (not rounded);
- prefill: the forward at the same counts;
- decode: the forward at batch sizes 1, 2, 3, 5, 8, 13, 24, 32, 48, 64, 100, 128, 200, 256, with the
  weight-read bandwidth (K * N * 2 bytes / time) against the measured copy ceiling.
Per regime: the time-weighted ratio (sum of cuBLAS ms / sum of ours over every shape and count),
the geometric mean and the worst (count, shape). cuBLAS and ours interleaved call by call
(benchmarks/common.py), inputs rotated past L2, medians of CUDA events.

Writes benchmarks/results/<gpu>-gemm-layer.json and a section of docs/benchmarks.md.
Usage: python3 benchmarks/bench_gemm_layer.py [--quick] [--backend sm90]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rl_kernels  # noqa: E402
from rl_kernels import kernel_registry  # noqa: E402
from common import (copies_to_rotate, cuda_median_ms, cuda_paired_median_ms, header,  # noqa: E402
                    record, write_results)

LAYER = {"q": (4096, 4096), "k": (4096, 1024), "v": (4096, 1024), "o": (4096, 4096),
         "gate": (4096, 12288), "up": (4096, 12288), "down": (12288, 4096), "head": (4096, 151936)}
DECODE_BATCHES = [1, 2, 3, 5, 8, 13, 24, 32, 48, 64, 100, 128, 200, 256]


def token_counts(n=24, seed=12345, low=200, high=20000):
    rng = random.Random(seed)
    return sorted(int(math.exp(rng.uniform(math.log(low), math.log(high)))) for _ in range(n))


def copy_bandwidth():
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_median_ms(lambda: dst.copy_(src), [()], warmup=3, reps=10)
    return 2 * src.numel() / (ms / 1e3)


def operands(m, k, n, with_grad):
    bytes_per_set = 2 * (m * k + k * n + (m * n if with_grad else 0))
    sets = []
    for i in range(copies_to_rotate(bytes_per_set)):
        gen = torch.Generator(device="cuda").manual_seed(i)
        a = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).to(torch.bfloat16)
        g = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16) if with_grad else None
        sets.append((a, w, g))
    return sets


def estimated_ms(m, k, n):
    """The GEMM's time at 600 TFLOP/s."""
    return 2 * m * k * n / 600e12 * 1e3


def reps_for(m, k, n):
    return int(min(30, max(5, 200 / max(estimated_ms(m, k, n), 1e-3))))


def sleep_us_for(m, k, n):
    """GPU time queued ahead per timed call: decode-sized calls (kernels of 10-40 us, about their
    host cost) drained the default 50 us and timed the host in single runs (2-4x outliers)."""
    return 200 if estimated_ms(m, k, n) < 0.04 else 50


def measure(m, name, backend, train):
    """(cuBLAS ms, ours ms) of the forward, and of the backward when training."""
    k, n = LAYER[name]
    sets = operands(m, k, n, train)
    fwd = [lambda a, w, g: torch.matmul(a, w.t()),
           lambda a, w, g: rl_kernels.det_gemm(a, w.t(), backend=backend)]
    timing = {"reps": reps_for(m, k, n), "sleep_us": sleep_us_for(m, k, n)}
    times = {"fwd": cuda_paired_median_ms(fwd, sets, **timing)}
    if train:
        bwd = [lambda a, w, g: (torch.matmul(g, w), torch.matmul(g.t(), a)),
               lambda a, w, g: (rl_kernels.det_gemm(g, w, backend=backend),
                                rl_kernels.matmul(g.t(), a, backend=backend))]
        times["bwd"] = cuda_paired_median_ms(bwd, sets, **timing)
    del sets
    torch.cuda.empty_cache()
    return times


def regime_summary(label, rows):
    """rows: (count, name, cuBLAS ms, ours ms)."""
    ratios = [c / o for _, _, c, o in rows]
    worst = min(rows, key=lambda r: r[2] / r[3])
    weighted = sum(r[2] for r in rows) / sum(r[3] for r in rows)
    geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
    return {"regime": label, "time_weighted_ratio": weighted, "geomean_ratio": geo,
            "worst_ratio": worst[2] / worst[3], "worst": f"M={worst[0]} {worst[1]}"}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="8 token counts, 6 decode batches")
    parser.add_argument("--backend", default="sm90")
    args = parser.parse_args()
    if not kernel_registry.backend_status("det_gemm", args.backend)[0]:
        sys.exit(f"backend {args.backend} not usable here")
    counts = token_counts()[::3] if args.quick else token_counts()
    batches = DECODE_BATCHES[::2] + [256] if args.quick else DECODE_BATCHES
    bandwidth = copy_bandwidth()
    print(f"copy ceiling {bandwidth / 1e9:.0f} GB/s (read + write); token counts {counts}", flush=True)
    records, per_regime = [], {"train": [], "prefill": [], "decode": []}
    for m in counts:
        for name in LAYER:
            t = measure(m, name, args.backend, train=True)
            k, n = LAYER[name]
            shape = {"M": m, "K": k, "N": n, "layer": name}
            (cf, of), (cb, ob) = t["fwd"], t["bwd"]
            per_regime["prefill"].append((m, name, cf, of))
            per_regime["train"].append((m, name, cf + cb, of + ob))
            records.append(record("det_gemm", args.backend, torch.bfloat16, shape, "fwd", of,
                                  "torch.matmul", cf, 2 * m * k * n / (of / 1e3) / 1e12))
            records.append(record("det_gemm", args.backend, torch.bfloat16, shape, "fwd+bwd", of + ob,
                                  "torch.matmul x3", cf + cb, 6 * m * k * n / ((of + ob) / 1e3) / 1e12))
            print(f"M={m:6d} {name:5s} fwd x{cf / of:.3f}  fwd+bwd x{(cf + cb) / (of + ob):.3f}", flush=True)
    for m in batches:
        for name in LAYER:
            (cf, of) = measure(m, name, args.backend, train=False)["fwd"]
            k, n = LAYER[name]
            gbs = 2 * k * n / (of / 1e3) / 1e9
            per_regime["decode"].append((m, name, cf, of))
            rec = record("det_gemm", args.backend, torch.bfloat16, {"M": m, "K": k, "N": n, "layer": name},
                         "decode", of, "torch.matmul", cf)
            rec["weight_gbs"] = gbs
            rec["weight_gbs_fraction_of_copy"] = gbs * 1e9 / bandwidth
            records.append(rec)
            print(f"B={m:4d} {name:5s} x{cf / of:.3f}  {gbs:6.0f} GB/s ({gbs * 1e9 / bandwidth:.0%} of copy)",
                  flush=True)
    summaries = [regime_summary(label, rows) for label, rows in per_regime.items()]
    decode_by_batch = {}
    for m in batches:
        rows = [r for r in per_regime["decode"] if r[0] == m]
        decode_by_batch[m] = sum(r[2] for r in rows) / sum(r[3] for r in rows)
    records.append({"summary": summaries, "decode_layer_ratio_by_batch": decode_by_batch,
                    "copy_bandwidth_gbs": bandwidth / 1e9, "token_counts": counts})
    lines = ["| regime | time-weighted ratio | geomean | worst (shape) |", "|---|---|---|---|"]
    for s in summaries:
        lines.append(f"| {s['regime']} | {s['time_weighted_ratio']:.3f} | {s['geomean_ratio']:.3f} | "
                     f"{s['worst_ratio']:.3f} ({s['worst']}) |")
    lines += ["", "Decode, layer ratio (sum of cuBLAS ms / ours over the 8 GEMMs) by batch size:", "",
              "| batch | " + " | ".join(str(m) for m in batches) + " |",
              "|---|" + "---|" * len(batches),
              "| ratio | " + " | ".join(f"{decode_by_batch[m]:.2f}" for m in batches) + " |", "",
              "Decode weight-read bandwidth at batch <= 8 (fraction of the copy ceiling):", ""]
    for r in records[:-1]:
        if r.get("pass") == "decode" and r["shape"]["M"] <= 8:
            lines.append(f"- B={r['shape']['M']} {r['shape']['layer']}: {r['weight_gbs']:.0f} GB/s "
                         f"({r['weight_gbs_fraction_of_copy']:.0%})")
    text = (header(f"Qwen3-8B layer GEMMs at RL token counts ({args.backend} vs cuBLAS, bf16)")
            + f"Token counts: {counts}. ratio = cuBLAS ms / ours.\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    write_results("gemm-layer", records, text)


if __name__ == "__main__":
    main()
