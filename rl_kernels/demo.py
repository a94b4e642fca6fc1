"""python -m rl_kernels demo: does the trainer recompute the rollout's token log-probs bit for bit?

Builds a small Qwen3-architecture transformers model with random weights (no download), generates
like an RL rollout engine (prompts of different lengths, left-padded prefill, token-by-token
decode with the KV cache at batch B), then recomputes every generated token's log-prob like a
trainer (one forward over prompt + completion, other batch sizes, another order, right padding).
It does this twice, with transformers' own kernels (sdpa attention) and with rl_kernels
(rl_kernels.integrations.transformers.patch: rl_kernels attention + batch_invariant()), and prints
how many generated tokens' log-probs differ and the time of each phase.

Runs on the GPU (bf16) when one is there and rl_kernels has CUDA attention, else on the CPU (fp32).
Environment: RL_KERNELS_DEMO_DEVICE=cpu|cuda, RL_KERNELS_DEMO_DTYPE=float32|bfloat16,
RL_KERNELS_DEMO_TOKENS=<new tokens per prompt>. ``python -m rl_kernels.demo --help`` takes the
same as options.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

import rl_kernels
from rl_kernels import kernel_registry

SIZES = {  # (hidden, intermediate, layers, heads, kv heads, head dim, vocab, prompt lengths, batches)
    "cpu": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64, vocab_size=8192, lengths=(16, 300),
                batch=8, new_tokens=32, trainer_batches=(3, 5)),
    "cuda": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=4,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                 lengths=(100, 1500), batch=16, new_tokens=64, trainer_batches=(5, 11)),
}


def _cuda_attention_usable():
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    try:
        kernel_registry.resolve_backend("attention", torch.device("cuda"))
    except RuntimeError as exc:
        return False, str(exc)
    return True, ""


def _pick_device(requested):
    if requested == "cpu":
        return "cpu", ""
    usable, why = _cuda_attention_usable()
    if requested == "cuda" and not usable:
        raise SystemExit(f"demo: cannot run on CUDA: {why}")
    return ("cuda", "") if usable else ("cpu", why)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def build_model(device, dtype, size):
    import transformers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    transformers.logging.set_verbosity_error()
    config = Qwen3Config(**{k: v for k, v in size.items() if k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "vocab_size")}, max_position_embeddings=4096,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    return model.to(dtype).eval()


def run_case(model, prompts, size, device, patched):
    from rl_kernels.integrations.transformers import patch, right_pad, rollout, token_logprobs, unpatch

    if patched:
        patch(model)
    try:
        generator = torch.Generator(device=device)
        # warm-up with the timed run's shapes: on CUDA, first calls of a shape build cuBLAS / cuDNN
        # plans (measured on an H100: torch's first rollout here 3.7 s, the next ones 0.44 s)
        warm_tokens = size["new_tokens"] if device == "cuda" else 2
        rollout(model, prompts, warm_tokens, generator=generator.manual_seed(0))
        _sync(device)
        start = time.perf_counter()
        result = rollout(model, prompts, size["new_tokens"], generator=generator.manual_seed(1))
        _sync(device)
        rollout_s = time.perf_counter() - start

        seqs = result.sequences()
        order = list(range(len(seqs)))[1::2] + list(range(len(seqs)))[::2]  # another order
        for _ in range(2 if device == "cuda" else 1):  # CUDA: the second pass is timed
            differ = total = 0
            worst = 0.0
            _sync(device)
            start = time.perf_counter()
            first = 0
            for count in size["trainer_batches"]:
                chunk = order[first:first + count]
                first += count
                ids, mask = right_pad([seqs[i] for i in chunk], 0, device)
                with torch.no_grad():
                    logp = token_logprobs(model, ids, mask).cpu()
                for row, i in enumerate(chunk):
                    p, c = len(result.prompts[i]), len(result.completions[i])
                    mine, theirs = logp[row, p - 1:p - 1 + c], result.logprobs[i]
                    differ += int((mine != theirs).sum())
                    worst = max(worst, float((mine - theirs).abs().max()))
                    total += c
            _sync(device)
            trainer_s = time.perf_counter() - start

        violations = None
        if patched:  # what strict() finds in the trainer's forward (nothing, when all is well)
            ids, mask = right_pad([seqs[i] for i in order[:2]], 0, device)
            with torch.no_grad(), rl_kernels.strict("warn") as check:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    token_logprobs(model, ids, mask)
            violations = check.violations
        return differ, total, worst, rollout_s, trainer_s, violations
    finally:
        if patched:
            unpatch(model)


_ENV_OPTIONS = (("RL_KERNELS_DEMO_DEVICE", "--device"), ("RL_KERNELS_DEMO_DTYPE", "--dtype"),
                ("RL_KERNELS_DEMO_TOKENS", "--tokens"))


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl_kernels.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="default: RL_KERNELS_DEMO_DEVICE, else auto")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"),
                        help="default: RL_KERNELS_DEMO_DTYPE, else bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--tokens", type=_positive_int, default=0,
                        help="generated tokens per prompt (default: RL_KERNELS_DEMO_TOKENS, else the size's)")
    # the environment's values go through the same checks, as options before the command line's
    from_env = [arg for name, option in _ENV_OPTIONS for arg in
                ((option, os.environ[name]) if os.environ.get(name) else ())]
    args = parser.parse_args(from_env + ([] if argv is None else list(argv)))
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("demo: needs transformers (pip install transformers)")
        return 1

    device, why_not_cuda = _pick_device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device == "cuda" else torch.float32)
    size = dict(SIZES[device])
    if args.tokens:
        size["new_tokens"] = args.tokens
    model = build_model(device, dtype, size)
    gen = torch.Generator().manual_seed(1)
    low, high = size["lengths"]
    lengths = torch.randint(low, high + 1, (size["batch"],), generator=gen).tolist()
    prompts = [torch.randint(1, size["vocab_size"], (n,), generator=gen).tolist() for n in lengths]

    where = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"rl_kernels {rl_kernels.__version__} demo on {where}, {str(dtype).replace('torch.', '')}"
          + (f"  [not on the GPU: {why_not_cuda}]" if why_not_cuda and torch.cuda.is_available() else ""))
    params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen3 architecture, random weights, {size['num_hidden_layers']} layers, hidden "
          f"{size['hidden_size']}, {size['num_attention_heads']}/{size['num_key_value_heads']} heads of "
          f"{size['head_dim']}, vocab {size['vocab_size']} ({params / 1e6:.0f}M parameters)")
    print(f"rollout: {len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens, left-padded "
          f"prefill + {size['new_tokens']} decode steps with the KV cache (batch {len(prompts)})")
    print(f"trainer: one forward over prompt + completion, right-padded batches of "
          f"{' and '.join(map(str, size['trainer_batches']))} in another order\n")

    rows = []
    for label, patched in (("transformers + torch kernels (sdpa)", False),
                           ("rl_kernels (patch + batch_invariant)", True)):
        differ, total, worst, rollout_s, trainer_s, violations = run_case(model, prompts, size,
                                                                          device, patched)
        rows.append((label, differ, total, worst, rollout_s, trainer_s, violations))
    print(f"{'':38} {'log-probs that differ':>22} {'max |diff|':>11} {'rollout s':>10} {'trainer s':>10}")
    for label, differ, total, worst, rollout_s, trainer_s, _ in rows:
        print(f"{label:38} {f'{differ} of {total}':>22} {worst:>11.3g} {rollout_s:>10.2f} {trainer_s:>10.2f}")
    violations = rows[1][6]
    print("times: wall clock after a warm-up with the same shapes; the trainer's include the "
          "comparison")
    print("\nrl_kernels.strict() in the trainer's forward: "
          + ("no op that may break batch invariance" if not violations else
             "; ".join(f"{v.op} x{v.count}" for v in violations)))
    ok = rows[1][1] == 0
    print("result: the trainer's log-probs are bitwise the rollout's with rl_kernels"
          if ok else "result: FAIL, rl_kernels' log-probs differ")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
