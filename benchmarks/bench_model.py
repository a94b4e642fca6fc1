"""A Qwen3-8B-width model, native transformers vs rl_kernels (patch(model) + batch_invariant mode +
token_logprobs), same process, alternating.

Model: transformers Qwen3 from a config with random weights: 4 layers of the Qwen3-8B shape (hidden
4096, 32 query / 8 KV heads of 128, intermediate 12288) and its 151,936-token head, bf16.
- trainer step: forward + backward of a per-token log-prob loss over 8 x 2048 tokens. Native:
  logits materialized, fp32 log_softmax, gather (sdpa attention). Ours: patch(model) and
  token_logprobs (linear_logp on the hidden states, no logits), backward inside the mode.
- forward alone: the same without the backward (no grad).
- decode step: one token per sequence at batch 1 and 32 against a KV cache prefilled to 1024
  (native: torch's default SDPA choice, and SDPA with cuDNN excluded), timed over blocks of
  DECODE_BLOCK steps inside one `batch_invariant()` as a rollout loop holds it (rollout() does);
  the mode's enter + exit, paid once per block there, is reported on its own.
Each timing is the median of CUDA-event times after warm-up, native and ours alternating step by
step. Time per op class from one profiled step each (CUDA kernel names bucketed: GEMM, attention,
norms, head / softmax, elementwise and other).

Writes benchmarks/results/<gpu>-model.json and a section of docs/benchmarks.md.
Usage: python3 benchmarks/bench_model.py [--layers 4] [--batch 8] [--seq 2048]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import statistics
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rl_kernels  # noqa: E402
from common import header, write_results  # noqa: E402
from rl_kernels.integrations.transformers import patch, token_logprobs  # noqa: E402

BUCKETS = (("attention", ("attention", "flash", "fmha", "cudnn", "sdpa")),
           ("norms", ("rms_norm", "norm")),
           ("head", ("linear_logp", "softmax", "logsumexp", "log_softmax", "nll", "gather", "dlogit", "dz")),
           ("gemm", ("gemm", "sm90", "sm80", "nvjet", "cutlass", "cublas", "xmma", "wgmma")))


def bucket(name):
    low = name.lower()
    for label, keys in BUCKETS:
        if any(k in low for k in keys):
            return label
    return "elementwise/other"


def build_model(layers):
    import transformers
    transformers.logging.set_verbosity_error()
    config = transformers.Qwen3Config(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                                      num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                      num_hidden_layers=layers, max_position_embeddings=8192,
                                      tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen3ForCausalLM(config)
    return model.to(torch.bfloat16)


def native_logprobs(model, ids):
    logits = model(input_ids=ids).logits[:, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def timed(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


DECODE_BLOCK = 8


def enter_and_exit_mode():
    with rl_kernels.batch_invariant():
        pass


def alternate(fns, reps, warmup=2):
    """Median ms of each fn, calls alternating (who goes first rotates)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for i in range(reps):
        for j in range(len(fns)):
            k = (i + j) % len(fns)
            times[k].append(timed(fns[k]))
    return [statistics.median(t) for t in times]


def by_class(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            label = bucket(event.name)
            totals[label] = totals.get(label, 0.0) + event.device_time_total / 1e3
    return {k: round(v, 2) for k, v in sorted(totals.items())}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    native = build_model(args.layers)
    ours = patch(copy.deepcopy(native))  # same weights; no patch/unpatch between timed calls
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(1, 151936, (args.batch, args.seq), device="cuda", generator=gen)
    advantages = torch.randn(args.batch, args.seq - 1, device="cuda", generator=gen)

    def native_step():
        (-(native_logprobs(native, ids) * advantages).sum()).backward()

    def ours_step():
        with rl_kernels.batch_invariant():
            (-(token_logprobs(ours, ids) * advantages).sum()).backward()

    def native_forward():
        with torch.no_grad():
            native_logprobs(native, ids)

    def ours_forward():
        with torch.no_grad():
            token_logprobs(ours, ids)

    records, lines = [], ["| measure | native ms | rl_kernels ms | ratio (native / ours) |", "|---|---|---|---|"]

    def report(name, native_ms, ours_ms, extra=None):
        rec = {"op": "model", "pass": name, "ms": ours_ms, "baseline": "transformers native",
               "baseline_ms": native_ms, "ratio": native_ms / ours_ms, "gpu": torch.cuda.get_device_name(),
               "torch": torch.__version__, "shape": {"layers": args.layers, "batch": args.batch, "seq": args.seq}}
        rec.update(extra or {})
        records.append(rec)
        lines.append(f"| {name} | {native_ms:.2f} | {ours_ms:.2f} | {native_ms / ours_ms:.3f} |")
        print(lines[-1], flush=True)

    native_ms, ours_ms = alternate([native_step, ours_step], args.reps)
    classes = {"native": by_class(native_step), "rl_kernels": by_class(ours_step)}
    native.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    report(f"trainer step ({args.batch} x {args.seq} tokens, fwd + bwd)", native_ms, ours_ms,
           {"ms_by_class": classes})
    native_ms, ours_ms = alternate([native_forward, ours_forward], args.reps)
    report("forward (log-probs, no grad)", native_ms, ours_ms)

    import transformers
    for batch in (1, 32):
        prompt = torch.randint(1, 151936, (batch, 1024), device="cuda", generator=gen)
        token = prompt[:, -1:]

        def decoder(model, mode):
            # a block of DECODE_BLOCK steps under one mode (a rollout loop holds it; per step,
            # entering it would cost more than the step's kernels); the cache grows by one token
            # per step (1024 -> ~1180 over the timed blocks)
            cache = transformers.DynamicCache(config=model.config)
            with torch.no_grad(), mode():
                model(input_ids=prompt, past_key_values=cache, use_cache=True)

            def go():
                with torch.no_grad(), mode():
                    for _ in range(DECODE_BLOCK):
                        model(input_ids=token, past_key_values=cache, use_cache=True)
            return go

        # torch's default SDPA on an H100 takes cuDNN, whose plan is built per key length: a decode
        # step (one key more each time) then pays a plan build per layer; the second native variant
        # excludes cuDNN, as a user who meets that would
        no_cudnn = functools.partial(sdpa_kernel, [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
        blocks = alternate([decoder(native, contextlib.nullcontext), decoder(native, no_cudnn),
                            decoder(ours, rl_kernels.batch_invariant)], reps=10, warmup=3)
        native_ms, no_cudnn_ms, ours_ms = (ms / DECODE_BLOCK for ms in blocks)
        report(f"decode step, batch {batch} (cache ~1024)", native_ms, ours_ms)
        report(f"decode step, batch {batch} (cache ~1024), native SDPA without cuDNN", no_cudnn_ms, ours_ms)
    mode_ms = statistics.median(timed(enter_and_exit_mode) for _ in range(20))
    lines.append(f"\nbatch_invariant() enter + exit (once per rollout loop): {mode_ms:.2f} ms")
    records.append({"op": "model", "pass": "batch_invariant enter + exit", "ms": mode_ms,
                    "gpu": torch.cuda.get_device_name(), "torch": torch.__version__})
    text = (header(f"Qwen3-8B-width model ({args.layers} layers + 151,936-token head), native transformers "
                   f"vs rl_kernels") + "\n".join(lines) + "\n\nTime by op class (ms, one profiled trainer step): "
            + f"native {classes['native']}; rl_kernels {classes['rl_kernels']}\n")
    print(text)
    write_results("model", records, text)


if __name__ == "__main__":
    main()
