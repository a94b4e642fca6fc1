"""Shared benchmark plumbing: CUDA-event timing with rotation, the result-record format, and
writing JSON (benchmarks/results/) plus a markdown table (docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS_TABLE = ROOT / "docs" / "benchmarks.md"
L2_BYTES_DEFAULT = 50 << 20  # H100: 50 MB (H200: 60 MB); the device's own size where CUDA is up


def l2_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size or L2_BYTES_DEFAULT
    return L2_BYTES_DEFAULT


def commit() -> str:
    if os.environ.get("RL_KERNELS_COMMIT"):  # set by whoever copied the tree without .git
        return os.environ["RL_KERNELS_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def device_slug() -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", device_name()).strip("-").lower()


def record(op, backend, dtype, shape, pass_, ms, baseline, baseline_ms, tflops=None,
           extra_mem_mb=None, max_abs_err=None):
    """One result in the shared format (fields that do not apply are None)."""
    return {"op": op, "backend": backend, "dtype": str(dtype).replace("torch.", ""),
            "shape": shape, "pass": pass_, "ms": ms, "baseline": baseline,
            "baseline_ms": baseline_ms,
            "ratio": (baseline_ms / ms) if (ms and baseline_ms) else None,
            "tflops": tflops, "extra_mem_mb": extra_mem_mb, "max_abs_err": max_abs_err,
            "gpu": device_name(), "torch": torch.__version__, "commit": commit()}


def copies_to_rotate(bytes_per_set: int) -> int:
    """Input sets needed so that rotating among them does not measure the L2 cache."""
    return max(1, min(24, -(-3 * l2_bytes() // max(1, bytes_per_set))))


def cuda_median_ms(fn, sets, warmup=3, reps=20) -> float:
    """Median of per-call GPU times (CUDA events), cycling through the argument sets. A sleep
    kernel is queued first so the host enqueues every call while the GPU is busy: the events then
    time the kernels, not the host's launch gaps (host cost per call: bench_host_overhead.py)."""
    for i in range(warmup):
        fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    torch.cuda._sleep(SLEEP_CYCLES_PER_CALL * reps)
    for i, (start, end) in enumerate(events):
        start.record()
        fn(*sets[i % len(sets)])
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


SLEEP_CYCLES_PER_CALL = 100_000  # ~50 us at 2 GHz: more than the host needs to enqueue a call


def host_us_per_call(fn, args, calls=50) -> float:
    """Wall-clock microseconds per call of fn(*args) in a loop ending in one synchronize: the host
    cost of a call when it exceeds its kernels' time (small decode steps)."""
    fn(*args)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def cuda_paired_median_ms(fns, sets, warmup=3, reps=20, sleep_us=50) -> list[float]:
    """Median GPU ms of each fn in fns, measured interleaved: rep i runs every fn once, starting
    with a different one each rep, and every call takes the next argument set in turn, so no call
    finds its inputs in L2 from the call before (give enough sets, copies_to_rotate). An H100 under sustained tensor-core load sits
    at its 700 W cap with the SM clock wandering between ~1.2 and 1.5 GHz as it heats
    (docs/perf-notes.md), so timing a kernel and its baseline one after the other measures the
    thermal history as much as the kernels; interleaved, both see the same conditions.
    sleep_us: GPU time queued per call ahead of the timed calls (raise it for calls whose host cost
    exceeds their kernel time, or the events time the host)."""
    calls = 0
    for _ in range(warmup):
        for fn in fns:
            fn(*sets[calls % len(sets)])
            calls += 1
    torch.cuda.synchronize()
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
               for _ in range(reps)] for _ in fns]
    torch.cuda._sleep(SLEEP_CYCLES_PER_CALL * sleep_us // 50 * reps * len(fns))
    for i in range(reps):
        for j in range(len(fns)):
            k = (i + j) % len(fns)
            start, end = events[k][i]
            start.record()
            fns[k](*sets[calls % len(sets)])
            end.record()
            calls += 1
    torch.cuda.synchronize()
    return [statistics.median(s.elapsed_time(e) for s, e in per_fn) for per_fn in events]


def cpu_median_s(fn, reps=5, warmup=1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def write_results(name: str, records: list[dict], table_md: str) -> Path:
    """Writes benchmarks/results/<gpu>-<name>.json and replaces this benchmark's section of
    docs/benchmarks.md."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    slug = device_slug()
    path = RESULTS / f"{slug}-{name}.json"
    path.write_text(json.dumps(records, indent=1))
    begin, end = f"<!-- begin {slug}-{name} -->", f"<!-- end {slug}-{name} -->"
    text = DOCS_TABLE.read_text() if DOCS_TABLE.exists() else "# Benchmarks\n\n"
    section = f"{begin}\n{table_md.rstrip()}\n{end}"
    if begin in text:
        text = text[:text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    DOCS_TABLE.parent.mkdir(parents=True, exist_ok=True)
    DOCS_TABLE.write_text(text)
    return path


def header(title: str) -> str:
    return (f"## {title}\n\n{device_name()}, torch {torch.__version__}, commit {commit()}, "
            f"{time.strftime('%Y-%m-%d')}.\n\n")
