"""Shared test helpers. GPU tests carry @pytest.mark.gpu and skip cleanly without CUDA."""

import math

import pytest
import torch

import rl_kernels

HAS_CUDA = torch.cuda.is_available()

# Qwen3-8B linear layers as (K, N): q/o, k/v, fused qkv, gate/up, fused gate+up, down, LM head
QWEN3_8B_SHAPES = [(4096, 4096), (4096, 1024), (4096, 6144), (4096, 12288), (4096, 24576),
                   (12288, 4096), (4096, 151936)]


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_threads():
    yield
    rl_kernels.set_num_threads(0)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in fp64."""
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def randn(*shape, dtype=torch.float32, device="cpu", seed=0, scale=1.0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    base = torch.float64 if dtype == torch.float64 else torch.float32
    return (torch.randn(shape, generator=gen, dtype=base) * scale).to(device=device, dtype=dtype)


# Relative error of a GEMM against fp64 of the same (rounded) inputs, by output dtype: fp32
# accumulation leaves ~1e-7 per element; a bf16/fp16 output adds its own rounding.
GEMM_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def pack_sequences(parts):
    """Packed (q, k, v, cu_seqlens) of [1, T, H, d] (q, k, v) sequences; cu_seqlens int32 on their
    device."""
    cu = [0]
    for q, _, _ in parts:
        cu.append(cu[-1] + q.shape[1])
    return (torch.cat([p[0][0] for p in parts]), torch.cat([p[1][0] for p in parts]),
            torch.cat([p[2][0] for p in parts]), torch.tensor(cu, dtype=torch.int32, device=parts[0][0].device))


def attention_reference(q, k, v, causal=True, scale=None):
    """fp64 attention of [B, Tq, Hq, d] / [B, Tk, Hkv, d] with every row real (on q's device): out
    [B, Tq, Hq, d] and lse [B, Hq, Tq]. Bottom-right causal mask; a row that sees no key gets out 0,
    lse -inf. Differentiable (rows without keys get no gradient)."""
    q, k, v = q.double(), k.double(), v.double()
    tq, hq, d = q.shape[1:]
    tk, hkv = k.shape[1:3]
    scale = d ** -0.5 if scale is None else scale
    k = k.repeat_interleave(hq // hkv, dim=2)
    v = v.repeat_interleave(hq // hkv, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    rows = torch.arange(tq, device=q.device)[:, None] + (tk - tq)
    masked = (torch.arange(tk, device=q.device)[None, :] > rows) if causal else \
        torch.zeros(tq, tk, dtype=torch.bool, device=q.device)
    seen = ~masked.all(-1, keepdim=True)  # [tq, 1]: rows that see at least one key
    s = s.masked_fill(masked & seen, -math.inf)  # rows without keys stay finite, then zeroed
    p = torch.softmax(s, -1) * seen
    lse = torch.logsumexp(s, -1).masked_fill(~seen[:, 0], -math.inf)
    return torch.einsum("bhij,bjhd->bihd", p, v), lse


def rescale_profile_qkv(t, hq, hkv, d, dtype, device="cpu", seed=0):
    """q, k, v [1, t, h, d] whose scores, for every row, follow one profile over the key position
    that crosses the attention contract's rescale threshold (m moves only when a score beats it by
    2^8) both ways: scaled scores (log2 units, default scale) rising ~9 a block over keys 0-199 (m
    moves every block), flat to 699 (never), a jump of ~22 at 700 inside a segment, then rising
    ~4.6 a block from 900 (m moves every other block)."""
    j = torch.arange(t, dtype=torch.float64)
    profile = torch.where(j < 200, 0.2 * j, torch.full_like(j, 40.0))
    profile = torch.where(j >= 700, torch.full_like(j, 70.0), profile)
    profile = torch.where(j >= 900, 70.0 + 0.1 * (j - 900), profile)
    q = randn(1, t, hq, d, seed=seed, scale=0.1)
    k = randn(1, t, hkv, d, seed=seed + 1, scale=0.1)
    q[..., 0] = 4.0 * math.sqrt(d / 64)
    k[0, :, :, 0] = profile[:, None].float()
    v = randn(1, t, hkv, d, seed=seed + 2)
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v))


@pytest.fixture
def nan_allocations(monkeypatch):
    """torch.empty / empty_like hand out NaN-filled memory while the test runs (what an
    uninitialized allocation may hold, on any device): a row a kernel leaves unwritten shows up as
    NaN."""
    empty, empty_like = torch.empty, torch.empty_like

    def garbage(t):
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: garbage(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: garbage(empty_like(*a, **kw)))


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def grads_of(fn, q, k, v, cotangent):
    """(out, dq, dk, dv) of fn(q, k, v) -> out with the given cotangent, on fresh leaf copies."""
    q, k, v = leaves(q, k, v)
    out = fn(q, k, v)
    out.backward(cotangent.to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad
