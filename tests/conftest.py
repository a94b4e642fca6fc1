"""Shared test helpers. GPU tests carry @pytest.mark.gpu and skip cleanly without CUDA."""

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
