"""linear_logp on CUDA: accuracy vs fp64 at full Qwen3-8B head size, bitwise row invariance,
deterministic backward, memory, bad targets without a host sync. Skipped without CUDA."""

import functools

import pytest
import torch

import rl_kernels
from rl_kernels import _C, kernel_registry
from conftest import HAS_CUDA, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (HAS_CUDA and kernel_registry.backend_status("linear_logp", "sm80")[0]),
    reason="no usable GPU linear_logp backend")]


GPU_BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(
    not (HAS_CUDA and kernel_registry.backend_status("linear_logp", b)[0]), reason=f"{b} not usable"))
    for b in ("sm90", "sm80")]


def cuda_randn(*shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, generator=gen, device="cuda") * scale).to(dtype)


def problem(n, d, v, seed=0, bias=False):
    h = cuda_randn(n, d, seed=seed)
    w = cuda_randn(v, d, seed=seed + 1, scale=d ** -0.5 * 2)
    b = cuda_randn(v, seed=seed + 2) if bias else None
    gen = torch.Generator(device="cuda").manual_seed(seed + 3)
    t = torch.randint(0, v, (n,), device="cuda", generator=gen)
    return h, w, b, t


def autograd_grads(h, w, b, t, g_logp, g_ent, fn):
    """(d hidden, d weight, d bias) of logp . g_logp + entropy . g_ent through fn (linear_logp's API)."""
    leaves = [x.detach().clone().requires_grad_() for x in (h, w, b)]
    logp, ent = fn(leaves[0], leaves[1], t, leaves[2], return_entropy=True)
    torch.autograd.backward((logp, ent), (g_logp.to(logp.dtype), g_ent.to(ent.dtype)))
    return [x.grad for x in leaves]


def check_backward_vs_fp64_and_deterministic(h, w, b, t, g_logp, g_ent, backend):
    ours = functools.partial(rl_kernels.linear_logp, backend=backend)
    got = autograd_grads(h, w, b, t, g_logp, g_ent, ours)
    want = autograd_grads(h.double(), w.double(), b.double(), t, g_logp, g_ent,
                          rl_kernels.NativeLinearLogpOp(torch.float64))
    for name, x, ref in zip(("hidden", "weight", "bias"), got, want):
        assert rel_err(x, ref) <= 1.5e-2, name
    for x, y in zip(got, autograd_grads(h, w, b, t, g_logp, g_ent, ours)):
        assert torch.equal(x, y)


def fp64_reference(h, w, t, b=None, temperature=1.0, rows=None):
    rows = slice(None) if rows is None else rows
    return rl_kernels.NativeLinearLogpOp(torch.float64)(
        h[rows], w, t[rows], b, temperature=temperature, return_entropy=True)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("n,d,v,bias,temperature", [
    (1, 64, 1000, False, 1.0), (37, 100, 5003, True, 0.7), (1024, 2048, 32768, False, 1.0),
    (4096, 4096, 151936, False, 1.0), (512, 4096, 151936, True, 0.7)])
def test_accuracy_vs_fp64(backend, n, d, v, bias, temperature):
    h, w, b, t = problem(n, d, v, bias=bias)
    if n == 512:  # large logits (lse ~ 50): where truncating tensor-core accumulation shows
        w = w * 3
        t[::2] = (h.float() @ w.float().t()).argmax(-1)[::2]
    logp, ent = rl_kernels.linear_logp(h, w, t, b, temperature=temperature, return_entropy=True,
                                       backend=backend)
    rows = slice(0, min(n, 512))
    ref_logp, ref_ent = fp64_reference(h, w, t, b, temperature, rows)
    assert (logp[rows].double() - ref_logp).abs().max() <= 1e-4
    assert (ent[rows].double() - ref_ent).abs().max() <= 1e-4


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_rows_bitwise_invariant_at_qwen3_head(backend):
    h, w, _, t = problem(4096, 4096, 151936, seed=10)
    full, full_ent = rl_kernels.linear_logp(h, w, t, return_entropy=True, backend=backend)
    for m in (1, 3, 17, 129, 1000):
        logp, ent = rl_kernels.linear_logp(h[:m], w, t[:m], return_entropy=True, backend=backend)
        assert torch.equal(logp, full[:m]) and torch.equal(ent, full_ent[:m]), f"N={m}"
    for shift in (5, 37, 128):
        shifted = rl_kernels.linear_logp(torch.cat([h[:shift], h]), w, torch.cat([t[:shift], t]),
                                         backend=backend)
        assert torch.equal(shifted[shift:], full), f"shift {shift}"
    for _ in range(5):
        assert torch.equal(rl_kernels.linear_logp(h, w, t, backend=backend), full)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_rows_bitwise_invariant_when_the_last_units_are_shared(backend):
    """At V = 32768 (43 vocabulary splits) the units of 1024 rows fill 2.6 rounds of an H100's 66
    clusters, so sm90 shares the last ones' tiles between clusters, a split's row states handed over
    mid-split; 300 and 700 rows share other pieces, 1-129 rows none. Each row's bits must not care."""
    h, w, b, t = problem(1024, 256, 32768, seed=60, bias=True)
    full, full_ent = rl_kernels.linear_logp(h, w, t, b, return_entropy=True, backend=backend)
    ref_logp, ref_ent = fp64_reference(h, w, t, b, rows=slice(0, 1024, 7))
    assert (full[::7].double() - ref_logp).abs().max() <= 1e-4
    assert (full_ent[::7].double() - ref_ent).abs().max() <= 1e-4
    for m in (1, 3, 17, 129, 300, 700, 1000):
        logp, ent = rl_kernels.linear_logp(h[:m], w, t[:m], b, return_entropy=True, backend=backend)
        assert torch.equal(logp, full[:m]) and torch.equal(ent, full_ent[:m]), f"N={m}"
    for _ in range(3):
        assert torch.equal(rl_kernels.linear_logp(h, w, t, b, backend=backend), full)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_unaligned_hidden_base_gives_the_same_bits(backend):
    """hidden rows starting 2 bytes past a 16-byte boundary (row stride still a multiple of 16 bytes):
    the same kernel and the same bits, forward and backward."""
    h, w, b, t = problem(300, 256, 9000, seed=80, bias=True)
    buf = torch.empty(300 * 256 + 1, dtype=torch.bfloat16, device="cuda")
    h_off = buf[1:].view(300, 256)
    h_off.copy_(h)
    ref, ref_ent = rl_kernels.linear_logp(h, w, t, b, return_entropy=True, backend=backend)
    kernel = kernel_registry.last_kernel()
    out, out_ent = rl_kernels.linear_logp(h_off, w, t, b, return_entropy=True, backend=backend)
    assert kernel_registry.last_kernel() == kernel
    assert torch.equal(out, ref) and torch.equal(out_ent, ref_ent)
    g = cuda_randn(300, dtype=torch.float32, seed=81)
    grads = []
    for x in (h, h_off):
        x = x.detach().clone() if x is h else x.detach()
        x.requires_grad_()
        grads.append(torch.autograd.grad(rl_kernels.linear_logp(x, w, t, b, backend=backend), x, g)[0])
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_ignore_index_and_bad_target_flag_without_sync(backend):
    h, w, _, t = problem(64, 128, 3000, seed=20)
    t[5] = -100
    logp, ent = rl_kernels.linear_logp(h, w, t, return_entropy=True, backend=backend)
    assert logp[5] == 0 and ent[5] == 0
    bad = t.clone()
    bad[9] = 3000
    out = rl_kernels.linear_logp(h, w, bad, backend=backend)  # returns at once; the row is NaN
    torch.cuda.synchronize()
    assert torch.isnan(out[9]) and torch.equal(out[torch.arange(64) != 9],
                                               logp[torch.arange(64) != 9])
    with pytest.raises(ValueError, match="target: an earlier linear_logp call"):
        rl_kernels.linear_logp(h, w, t, backend=backend)
    assert torch.equal(rl_kernels.linear_logp(h, w, t, backend=backend), logp)  # flag cleared


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_backward_vs_fp64_and_deterministic(backend):
    h, w, b, t = problem(300, 256, 9000, seed=30, bias=True)
    t[7] = -100
    g_logp = cuda_randn(300, dtype=torch.float32, seed=31)
    g_ent = cuda_randn(300, dtype=torch.float32, seed=32)
    check_backward_vs_fp64_and_deterministic(h, w, b, t, g_logp, g_ent, backend)


@pytest.mark.skipif(not (HAS_CUDA and kernel_registry.backend_status("gemm", "sm90")[0]),
                    reason="sm90 not usable")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,cols,bias", [(300, 4096, True), (17, 385, True), (1, 1000, False),
                                            (129, 4096, False)])
def test_fused_dlogits_equal_gemm_then_dlogits(rows, cols, bias, dtype):
    """The backward's fused SM90 dz (z in registers) gives the bits of the two-step path: the SM90
    GEMM into fp32 logits, then the elementwise dz kernel adding the bias. Covers a target inside and
    outside the chunk, an ignored row, temperature, the register-store tail (cols = 385)."""
    v0, d, inv_t = 64, 256, 1 / 0.7
    h, w, b, t = problem(rows, d, v0 + cols, seed=70, bias=bias)
    h, w = h.to(dtype), w.to(dtype)
    b = None if b is None else b.to(dtype)
    t[0] = -100
    w_chunk, b_chunk = w[v0:], None if b is None else b[v0:]
    z_full = h.float() @ w.float().t() + (0 if b is None else b.float())
    lse = torch.logsumexp(z_full * inv_t, dim=1)
    ent = cuda_randn(rows, dtype=torch.float32, seed=71).abs()
    g_logp = cuda_randn(rows, dtype=torch.float32, seed=72)
    g_ent = cuda_randn(rows, dtype=torch.float32, seed=73)
    stream = torch.cuda.current_stream().cuda_stream
    sm90 = kernel_registry.backend_code("sm90")
    fused = torch.empty(rows, cols, dtype=dtype, device="cuda")
    _C.linear_logp_dlogits(h, w_chunk, b_chunk, t, lse, ent, g_logp, g_ent, fused, v0, inv_t, -100,
                           sm90, stream)
    assert kernel_registry.last_kernel() == "linear_logp_dlogits_sm90"
    logits = rl_kernels.det_gemm(h, w_chunk.t(), out_dtype=torch.float32, backend="sm90")
    assert kernel_registry.last_kernel() == "gemm_sm90"
    two_step = torch.empty_like(fused)
    _C.linear_logp_dz(logits, b_chunk, t, lse, ent, g_logp, g_ent, two_step, v0, inv_t, -100, sm90,
                      stream)
    assert kernel_registry.last_kernel() == "linear_logp_dz_sm80"  # sm90 has no elementwise dz
    assert torch.equal(fused, two_step)
    assert torch.equal(fused[0], torch.zeros_like(fused[0]))
    # and against fp64 (the dz formula of rl_kernels.h)
    s = (h.double() @ w_chunk.double().t() + (0 if b_chunk is None else b_chunk.double())) * inv_t
    p = torch.exp(s - lse.double()[:, None])
    onehot = torch.zeros_like(p)
    inside = (t >= v0) & (t < v0 + cols)
    onehot[inside, (t[inside] - v0)] = 1
    ref = (g_logp.double()[:, None] * (onehot - p)
           - g_ent.double()[:, None] * p * (s - lse.double()[:, None] + ent.double()[:, None])) * inv_t
    ref[0] = 0
    assert rel_err(fused, ref) <= 1e-2


@pytest.mark.parametrize("n,d,v", [(1000, 512, 20000),
                                   # dH at 1024 rows, D = 5120 is 160 tiles of 128 x 256: sm90 runs it
                                   # stream-K (the backward gives its GEMMs scratch memory); 17 rows in waves
                                   (1024, 5120, 16484)])
def test_grad_hidden_rows_invariant(n, d, v):
    h, w, _, t = problem(n, d, v, seed=40)
    g = cuda_randn(n, dtype=torch.float32, seed=41)

    def grad_hidden(rows):
        x = h[rows].clone().requires_grad_()
        logp = rl_kernels.linear_logp(x, w, t[rows])
        (grad,) = torch.autograd.grad(logp, x, g[rows])
        return grad

    full = grad_hidden(slice(0, n))
    for rows in (slice(0, 1), slice(0, 17), slice(500, 629)):
        assert torch.equal(grad_hidden(rows), full[rows])


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_backward_with_one_block_of_65600_rows(backend):
    """A small head (D = 64, V = 96) puts all 65,600 rows in one block of the backward, so dW and db
    are GEMMs over K = 65,600 rows: on sm90 the K-chained GEMMs, which fail without the scratch
    memory that the backward plans for them. Gradients vs fp64 with random cotangents, twice."""
    n, d, v = 65600, 64, 96
    h, w, b, t = problem(n, d, v, seed=80, bias=True)
    g_logp = cuda_randn(n, dtype=torch.float32, seed=81)
    g_ent = cuda_randn(n, dtype=torch.float32, seed=82)
    check_backward_vs_fp64_and_deterministic(h, w, b, t, g_logp, g_ent, backend)


@pytest.mark.parametrize("n", [4096, 16384])
def test_memory_stays_small_at_qwen3_head(n):
    h, w, _, t = problem(n, 4096, 151936, seed=50)
    h.requires_grad_()
    w.requires_grad_()
    logp = rl_kernels.linear_logp(h, w, t)
    torch.cuda.synchronize()
    g = torch.ones_like(logp)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        rl_kernels.linear_logp(h, w, t)
    fwd_extra = (torch.cuda.max_memory_allocated() - base) / 2**20
    assert fwd_extra <= 64, f"forward used {fwd_extra:.0f} MB extra"  # O(N), no [N, V] logits
    grads_mb = (h.numel() + w.numel()) * 2 / 2**20
    torch.cuda.reset_peak_memory_stats()
    torch.autograd.grad(logp, (h, w), g)
    bwd_extra = (torch.cuda.max_memory_allocated() - base) / 2**20 - grads_mb
    assert bwd_extra <= 256, f"backward used {bwd_extra:.0f} MB beyond the gradients"


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_fp32_inputs_reach_fp32_accuracy(backend):
    """fp32 never runs as TF32: sm80 on the FFMA GEMM, sm90 as bf16 parts (three planes per operand,
    six exact bf16 products in fp32 chains, the bias one more column of the planes)."""
    h, w, b, t = problem(700, 96, 9000, seed=60, bias=True)
    h, w, b = h.float(), w.float(), b.float()
    t[3] = -100
    logp, ent = rl_kernels.linear_logp(h, w, t, b, temperature=0.8, return_entropy=True,
                                       backend=backend)
    ref_logp, ref_ent = fp64_reference(h, w, t, b, 0.8)
    assert (logp.double() - ref_logp).abs().max() <= 1e-5
    assert (ent.double() - ref_ent).abs().max() <= 1e-5
    part = rl_kernels.linear_logp(h[100:117], w, t[100:117], b, temperature=0.8, backend=backend)
    assert torch.equal(part, logp[100:117])
    # 5000 rows: logits in chunks of 4096 rows x 3072 columns (700 rows: one chunk of all 9000)
    many = torch.cat([h, cuda_randn(4300, 96, dtype=torch.float32, seed=61)])
    t_many = torch.cat([t, torch.randint(0, 9000, (4300,), device="cuda")])
    assert torch.equal(rl_kernels.linear_logp(many, w, t_many, b, temperature=0.8, backend=backend)[:700], logp)
    x = h[:50].clone().requires_grad_()
    g = cuda_randn(50, dtype=torch.float32, seed=62)
    grad, = torch.autograd.grad(rl_kernels.linear_logp(x, w, t[:50], b, backend=backend), x, g)
    x64 = h[:50].double().requires_grad_()
    ref = rl_kernels.NativeLinearLogpOp(torch.float64)(x64, w.double(), t[:50], b.double())
    grad64, = torch.autograd.grad(ref, x64, g.double())
    assert rel_err(grad, grad64) <= 1e-5


@pytest.mark.skipif(not (HAS_CUDA and kernel_registry.backend_status("linear_logp", "sm90")[0]),
                    reason="sm90 not usable")
def test_fp32_backward_on_bf16_parts():
    """sm90's fp32 backward runs its three products on bf16 parts (linear_logp_bwd_fp32_sm90): at D =
    2048 with a bias, V = 9000 in two vocabulary chunks (4608 + 4392 columns) and, for 8000 rows within the
    240 MB budget, three blocks of 2688 rows. Gradients of logp . g + entropy . g' (random cotangents,
    temperature 0.8, an ignored row) against fp64 within fp32's error and memory within 256 MB; a row's dH
    bitwise the same alone, among a few or across a block boundary; the whole backward repeatable."""
    n, d, v = 8000, 2048, 9000
    h = cuda_randn(n, d, dtype=torch.float32, seed=100)
    w = cuda_randn(v, d, dtype=torch.float32, seed=101, scale=d ** -0.5 * 2)
    b = cuda_randn(v, dtype=torch.float32, seed=102)
    t = torch.randint(0, v, (n,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(103))
    t[7] = -100
    t[8] = 4608  # the second chunk's first column
    g_logp = cuda_randn(n, dtype=torch.float32, seed=104)
    g_ent = cuda_randn(n, dtype=torch.float32, seed=105)
    ours = functools.partial(rl_kernels.linear_logp, backend="sm90", temperature=0.8)
    got = autograd_grads(h, w, b, t, g_logp, g_ent, ours)
    # the backward op on this thread (autograd's runs on its own, where last_kernel() is its own)
    _, ent, lse = torch.ops.rl_kernels.linear_logp(h, w, b, t, 0.8, -100, "sm90")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    direct = torch.ops.rl_kernels.linear_logp_backward(h, w, b, t, lse, ent, g_logp, g_ent, 0.8, -100, "sm90")
    assert kernel_registry.last_kernel() == "linear_logp_bwd_fp32_sm90"
    extra = (torch.cuda.max_memory_allocated() - base) / 2**20 - (h.numel() + w.numel() + b.numel()) * 4 / 2**20
    assert extra <= 256, f"backward used {extra:.0f} MB beyond the gradients"
    for x, y in zip(direct, got):
        assert torch.equal(x, y)
    want = autograd_grads(h.double(), w.double(), b.double(), t, g_logp, g_ent,
                          functools.partial(rl_kernels.NativeLinearLogpOp(torch.float64), temperature=0.8))
    for name, x, ref in zip(("hidden", "weight", "bias"), got, want):
        assert rel_err(x, ref) <= 1e-5, name
    assert (got[0][7] == 0).all()
    for x, y in zip(got, autograd_grads(h, w, b, t, g_logp, g_ent, ours)):
        assert torch.equal(x, y)
    for rows in (slice(0, 1), slice(100, 117), slice(2680, 2700), slice(7990, 8000)):
        part = autograd_grads(h[rows], w, b, t[rows], g_logp[rows], g_ent[rows], ours)
        assert torch.equal(part[0], got[0][rows]), rows


@pytest.mark.skipif(not (HAS_CUDA and kernel_registry.backend_status("linear_logp", "sm90")[0]),
                    reason="sm90 not usable")
def test_fp32_parts_in_row_blocks_and_vocabulary_chunks():
    """sm90's fp32 forward at D = 2048 with a bias holds hidden's planes for blocks of up to 10880 rows
    and weight's for chunks of whole splits in the rest of 256 MB: 12000 rows run as two blocks of 6000,
    V = 20000 as chunks of 15360 and 4640 columns (17 rows: one chunk). Every row's results equal those
    of the same row alone or among a few, and its error against fp64 stays within fp32's."""
    n, d, v = 12000, 2048, 20000
    h = cuda_randn(n, d, dtype=torch.float32, seed=90)
    w = cuda_randn(v, d, dtype=torch.float32, seed=91, scale=d ** -0.5 * 2)
    b = cuda_randn(v, dtype=torch.float32, seed=92)
    t = torch.randint(0, v, (n,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(93))
    t[5] = -100
    t[8000] = 15360 + 7  # the last chunk, and rows of the second block
    t[8001] = 15359
    logp, ent = rl_kernels.linear_logp(h, w, t, b, return_entropy=True, backend="sm90")
    assert kernel_registry.last_kernel() == "linear_logp_fwd_fp32_sm90"
    for rows in (slice(0, 1), slice(3, 20), slice(5990, 6010), slice(7999, 8130), slice(11999, 12000)):
        part, part_ent = rl_kernels.linear_logp(h[rows], w, t[rows], b, return_entropy=True, backend="sm90")
        assert torch.equal(part, logp[rows]) and torch.equal(part_ent, ent[rows]), rows
    check = torch.cat([torch.arange(0, 64), torch.arange(5990, 6010), torch.arange(7990, 8010),
                       torch.arange(11936, 12000)]).cuda()
    ref_logp, ref_ent = fp64_reference(h.double(), w.double(), t, b.double(), rows=check)
    assert (logp[check].double() - ref_logp).abs().max() <= 1e-5
    assert (ent[check].double() - ref_ent).abs().max() <= 1e-5
    assert logp[5] == 0 and ent[5] == 0
