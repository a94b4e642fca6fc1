"""GPU acceptance of issue 15: a transformers Qwen3 model with the Qwen3-8B layer shape (hidden 4096,
32 query / 8 KV heads of 128, intermediate 12288, vocab 151936; 2 layers, random weights, bf16)
generates on CUDA like a rollout engine; the trainer's recomputed log-probs (other batch sizes,
order, right padding, packing) are bitwise the rollout's under patch(model), strict() finds
nothing, and without rl_kernels (cuBLAS, SDPA) they differ. Plus the mode's aten kernels on CUDA.

Run: python3 -m pytest tests/test_gpu_model.py -q -s   (-s prints the timings)."""

import time

import pytest
import torch
import torch.nn.functional as F

import rl_kernels
from rl_kernels import kernel_registry

pytestmark = pytest.mark.gpu

QWEN3_8B_LAYERS = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, num_hidden_layers=2,
                       max_position_embeddings=4096, tie_word_embeddings=False)
PROMPT_LENGTHS = [700, 95, 1300, 33, 512, 257, 1000, 64]  # batch B = 8
NEW_TOKENS = 32


def _needs_cuda_attention():
    try:
        kernel_registry.resolve_backend("attention", torch.device("cuda"))
    except RuntimeError as exc:
        pytest.skip(f"rl_kernels has no CUDA attention in this build: {exc}")


@pytest.fixture(autouse=True)
def _mode_off_after():
    yield
    rl_kernels.disable_batch_invariant()


@pytest.fixture(scope="module")
def model():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    with torch.device("cuda"):
        built = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3_8B_LAYERS))
    yield built.to(torch.bfloat16).eval()


def _prompts():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, QWEN3_8B_LAYERS["vocab_size"], (n,), generator=gen).tolist()
            for n in PROMPT_LENGTHS]


def _trainer(model, result, order, batches, packed=False, check=None):
    from rl_kernels.integrations.transformers import right_pad, token_logprobs

    seqs = result.sequences()
    logps, ents = {}, {}
    first = 0
    for size in batches:
        chunk = order[first:first + size]
        first += size
        with torch.no_grad(), (check() if check else rl_kernels.batch_invariant(rl_kernels.is_batch_invariant())):
            if packed:
                flat, cu = [], [0]
                for i in chunk:
                    flat += seqs[i]
                    cu.append(len(flat))
                lp, ent = token_logprobs(model, torch.tensor([flat], device="cuda"),
                                         cu_seqlens=torch.tensor(cu, device="cuda"), return_entropy=True)
                offsets = [(0, cu[j]) for j in range(len(chunk))]
            else:
                ids, mask = right_pad([seqs[i] for i in chunk], 0, "cuda")
                lp, ent = token_logprobs(model, ids, mask, return_entropy=True)
                offsets = [(j, 0) for j in range(len(chunk))]
        lp, ent = lp.cpu(), ent.cpu()
        for (row, offset), i in zip(offsets, chunk):
            p, c = len(result.prompts[i]), len(result.completions[i])
            logps[i] = lp[row, offset + p - 1:offset + p - 1 + c]
            ents[i] = ent[row, offset + p - 1:offset + p - 1 + c]
    return logps, ents


def test_gpu_rollout_logprobs_bitwise_equal_trainer(model):
    _needs_cuda_attention()
    from rl_kernels.integrations.transformers import patch, rollout, unpatch

    total = len(PROMPT_LENGTHS) * NEW_TOKENS
    patch(model)
    try:
        rollout(model, _prompts(), NEW_TOKENS)  # warm-up with the timed shapes
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = rollout(model, _prompts(), NEW_TOKENS,
                         generator=torch.Generator(device="cuda").manual_seed(2), check=rl_kernels.strict)
        torch.cuda.synchronize()
        rollout_s = time.perf_counter() - start
        start = time.perf_counter()
        logps, ents = _trainer(model, result, [3, 0, 5, 1, 7, 4, 2, 6], [3, 5], check=rl_kernels.strict)
        torch.cuda.synchronize()
        trainer_s = time.perf_counter() - start
        for i in range(len(PROMPT_LENGTHS)):
            assert torch.equal(logps[i], result.logprobs[i]), i
            assert torch.equal(ents[i], result.entropies[i]), i
        logps, ents = _trainer(model, result, [6, 2, 4, 7, 1, 5, 0, 3], [4, 4], packed=True,
                               check=rl_kernels.strict)
        for i in range(len(PROMPT_LENGTHS)):
            assert torch.equal(logps[i], result.logprobs[i]), ("packed", i)
            assert torch.equal(ents[i], result.entropies[i]), ("packed", i)
    finally:
        unpatch(model)

    rollout(model, _prompts(), NEW_TOKENS)  # warm-up: first calls of each shape build cuDNN plans
    torch.cuda.synchronize()
    start = time.perf_counter()
    native = rollout(model, _prompts(), NEW_TOKENS, generator=torch.Generator(device="cuda").manual_seed(2))
    torch.cuda.synchronize()
    native_rollout_s = time.perf_counter() - start
    logps, _ = _trainer(model, native, [3, 0, 5, 1, 7, 4, 2, 6], [3, 5])
    differ = sum(int((logps[i] != native.logprobs[i]).sum()) for i in range(len(PROMPT_LENGTHS)))
    print(f"\nQwen3-8B layer shape x2, bf16: rl_kernels 0 of {total} differ (rollout {rollout_s:.2f} s, "
          f"trainer {trainer_s:.2f} s); native {differ} of {total} differ (rollout {native_rollout_s:.2f} s)")
    assert differ > 0, "cuBLAS / SDPA were rollout-trainer invariant here: the test could not fail"


def test_gpu_mode_ops_are_rl_kernels_and_batch_invariant():
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen) * scale).to("cuda", torch.bfloat16)

    x, w = randn(1000, 4096), randn(4096, 4096, scale=0.02)
    h = randn(1000, 4096, scale=3)
    norm_w = randn(4096)
    before = {"mm": x @ w.t(), "softmax": torch.softmax(h, -1), "mean": h.float().pow(2).mean(-1),
              "rms_norm": F.rms_norm(h, (4096,), norm_w)}
    with rl_kernels.batch_invariant():
        def ops(rows):
            return {"mm": rows @ w.t(), "linear": F.linear(rows, w), "softmax": torch.softmax(rows, -1),
                    "log_softmax": torch.log_softmax(rows.float(), -1),
                    "mean": rows.float().pow(2).mean(-1), "sum": rows.sum(-1),
                    "rms_norm": F.rms_norm(rows, (4096,), norm_w),
                    "fused_rms_norm": torch._fused_rms_norm(rows, [4096], norm_w, 1e-6)[0]}
        full = ops(h)
        for m in (1, 3, 7, 16, 64, 129):
            part = ops(h[:m])
            for key in full:
                assert torch.equal(part[key], full[key][:m]), (key, m)
        assert torch.equal(full["mm"], rl_kernels.matmul(h, w.t()))
        assert torch.equal(full["softmax"], rl_kernels.softmax(h))
        assert torch.equal(full["rms_norm"], rl_kernels.rms_norm(h, norm_w, torch.finfo(torch.float32).eps))
        g = randn(64, 4096)
        xg, wg = h[:64].clone().requires_grad_(), norm_w.clone().requires_grad_()
        torch._fused_rms_norm(xg, [4096], wg, 1e-6)[0].backward(g)  # _fused_rms_norm_backward
        xf, wf = h[:64].clone().requires_grad_(), norm_w.clone().requires_grad_()
        F.rms_norm(xf, (4096,), wf, 1e-6).backward(g)  # the rms_norm override: rl_kernels' op
    xr, wr = h[:64].clone().requires_grad_(), norm_w.clone().requires_grad_()
    rl_kernels.rms_norm(xr, wr, 1e-6).backward(g)
    assert torch.equal(xg.grad, xr.grad) and torch.equal(wg.grad, wr.grad)
    assert torch.equal(xf.grad, xr.grad) and torch.equal(wf.grad, wr.grad)
    after = {"mm": x @ w.t(), "softmax": torch.softmax(h, -1), "mean": h.float().pow(2).mean(-1),
             "rms_norm": F.rms_norm(h, (4096,), norm_w)}
    for key in before:
        assert torch.equal(before[key], after[key]), key


def test_gpu_sdpa_override():
    _needs_cuda_attention()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, 32, 300, 128, generator=gen).to("cuda", torch.bfloat16)
    k = torch.randn(4, 8, 300, 128, generator=gen).to("cuda", torch.bfloat16)
    with rl_kernels.batch_invariant():
        out = F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        for p in (0, 63, 64, 299):
            step = F.scaled_dot_product_attention(q[:, :, p:p + 1], k[:, :, :p + 1], k[:, :, :p + 1],
                                                  enable_gqa=True)
            assert torch.equal(step, out[:, :, p:p + 1]), p
