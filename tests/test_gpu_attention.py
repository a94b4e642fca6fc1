"""attention on the CUDA backends (sm90, sm80): accuracy of out / lse / dq / dk / dv vs fp64 and
vs torch SDPA's error, bitwise prefill == chunked prefill == token-by-token decode (split-KV),
packing, padding, batch 1 vs 16 decode, CUDA-graph decode, the Qwen3-8B shape, stale NaN in the
cache, deterministic backward, bad ranges flagged without a sync, absent ranges (None) equal to
spelled-out ones, uninitialized out / lse fully written (bad key ranges included), and a decode call
launching our kernels alone. Skipped without CUDA (and per backend when it has no attention kernels
or cannot run on the device)."""


import math

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import rl_kernels
from rl_kernels import kernel_registry
from conftest import (HAS_CUDA, attention_reference, grads_of, leaves, pack_sequences, rel_err,
                      rescale_profile_qkv)

pytestmark = pytest.mark.gpu


def _usable(backend):
    return HAS_CUDA and kernel_registry.backend_status("attention", backend)[0]


GPU_BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(not _usable(b), reason=f"{b} not usable"))
                for b in ("sm90", "sm80")]
DTYPES = [torch.bfloat16, torch.float16]
# the floor under "no worse than SDPA": a quarter of the dtype's epsilon, relative
FLOOR = {torch.bfloat16: 2.0 ** -10, torch.float16: 2.0 ** -13}
SDPA_FACTOR = 2.0


def _ran_on(kernel, entry, backend):
    """kernel (kernel_registry.last_kernel()) is one of entry's kernels on backend's chain; a
    launcher may name its variant (attention_fwd_split_sm80 for attention_fwd_sm80)."""
    return any(kernel.startswith(entry) and kernel.endswith(name[len(entry):].rsplit("_", 1)[-1])
               for name in kernel_registry.kernel_chain(entry, backend))


def cuda_randn(*shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, generator=gen, device="cuda") * scale).to(dtype)


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def qkv(b, tq, tk, hq, hkv, d, dtype=torch.bfloat16, seed=0):
    return (cuda_randn(b, tq, hq, d, dtype=dtype, seed=seed, scale=1.5),
            cuda_randn(b, tk, hkv, d, dtype=dtype, seed=seed + 1),
            cuda_randn(b, tk, hkv, d, dtype=dtype, seed=seed + 2))


def sdpa(q, k, v, causal):
    """torch SDPA on [B, T, H, d] (square q / k when causal: SDPA aligns its mask top-left)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


# --------------------------------------------------------------------------------------------
# Accuracy
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (4, 1)])
@pytest.mark.parametrize("t", [1, 2, 127, 1000, 4097])
def test_accuracy_vs_fp64_and_sdpa(backend, dtype, d, causal, hq, hkv, t):
    """out, lse, dq, dk, dv vs fp64 (random cotangent): errors no worse than SDPA's on the same
    inputs (times SDPA_FACTOR, above a floor). The fp64 reference covers the first and last KV
    heads' groups (heads are independent), so 4097 tokens stay cheap."""
    b = 1 if t > 1000 else 2
    q, k, v = qkv(b, t, t, hq, hkv, d, dtype, seed=t + d)
    cot = cuda_randn(b, t, hq, d, dtype=dtype, seed=t + d + 3)
    fn = lambda q, k, v: rl_kernels.attention(q, k, v, causal=causal, backend=backend)  # noqa: E731
    got = grads_of(fn, q, k, v, cot)  # (the backward runs on autograd's device thread)
    theirs = grads_of(lambda q, k, v: sdpa(q, k, v, causal), q, k, v, cot)
    group = hq // hkv
    kv_heads = sorted({0, hkv - 1})
    q_heads = [h for g in kv_heads for h in range(g * group, (g + 1) * group)]
    want = grads_of(lambda q, k, v: attention_reference(q, k, v, causal)[0], q[:, :, q_heads].double(),
                    k[:, :, kv_heads].double(), v[:, :, kv_heads].double(), cot[:, :, q_heads])
    # one key (t = 1): out = v, so dq = dk = 0 exactly; errors are then measured against 1% of
    # dv's norm (the cotangent's scale) rather than a zero norm
    norm_floor = 1e-2 * want[3].norm().item()
    for name, mine, sd, ref, heads in zip(("out", "dq", "dk", "dv"), got, theirs, want,
                                          (q_heads, q_heads, kv_heads, kv_heads)):
        assert mine.dtype == dtype and torch.isfinite(mine).all(), name
        denom = max(ref.norm().item(), norm_floor)
        err = (mine[:, :, heads].double() - ref).norm().item() / denom
        sdpa_err = (sd[:, :, heads].double() - ref).norm().item() / denom
        assert err <= max(SDPA_FACTOR * sdpa_err, FLOOR[dtype]), \
            f"{name}: rel err {err:.3g} vs SDPA's {sdpa_err:.3g}"
    out, lse = rl_kernels.attention(q, k, v, causal=causal, return_lse=True, backend=backend)
    assert _ran_on(kernel_registry.last_kernel(), "attention_fwd", backend)
    assert lse.dtype == torch.float32 and lse.shape == (b, hq, t)
    assert torch.equal(out, got[0])
    ref_lse = attention_reference(q[:, :, q_heads], k[:, :, kv_heads], v[:, :, kv_heads], causal)[1]
    assert (lse[:, q_heads].double() - ref_lse).abs().max() <= 1e-4


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("tq,tk", [(1, 1000), (1, 4097), (127, 1000), (64, 4097), (5, 3)])
def test_decode_and_chunk_shapes_vs_fp64(backend, dtype, causal, tq, tk):
    """q shorter (or longer) than k, causal bottom-right: vs fp64 (SDPA has no bottom-right mask)."""
    q, k, v = qkv(2, tq, tk, 32, 8, 128, dtype, seed=tq * 7 + tk)
    out, lse = rl_kernels.attention(q, k, v, causal=causal, return_lse=True, backend=backend)
    ref, ref_lse = attention_reference(q, k, v, causal)
    assert rel_err(out, ref) <= {torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    assert (lse[seen].double() - ref_lse[seen]).abs().max() <= 1e-4
    if not seen.all():  # rows before the first key: exactly 0
        assert torch.equal(out[:, :tq - tk], torch.zeros_like(out[:, :tq - tk]))


def test_cuda_rejects_what_only_the_cpu_takes():
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    q, k, v = qkv(1, 4, 4, 4, 2, 40, seed=1)
    with pytest.raises(ValueError, match="head dim 40 is not supported on CUDA"):
        rl_kernels.attention(q, k, v)
    q, k, v = qkv(1, 4, 4, 4, 2, 64, torch.float32, seed=2)
    with pytest.raises(TypeError, match="CUDA attention takes bfloat16 or float16"):
        rl_kernels.attention(q, k, v)
    with pytest.raises(TypeError, match="on cuda"):
        rl_kernels.attention(q.bfloat16(), k.bfloat16().cpu(), v.bfloat16())


# --------------------------------------------------------------------------------------------
# Bitwise invariance
# --------------------------------------------------------------------------------------------

T_DECODE = 2000


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
def test_prefill_chunked_prefill_and_decode_bitwise(backend, dtype, d):
    q, k, v = qkv(1, T_DECODE, T_DECODE, 32, 8, d, dtype, seed=10 + d)
    full, full_lse = rl_kernels.attention(q, k, v, return_lse=True, backend=backend)
    for chunk in (1, 7, 64, 100, 512, 1000):
        bounds = list(range(0, T_DECODE, chunk)) + [T_DECODE]
        sliced, cached, ranged = [], [], torch.zeros_like(full)
        k_cache = torch.full((1, T_DECODE + 48, 8, d), float("nan"), dtype=dtype, device="cuda")
        v_cache = k_cache.clone()
        for s, e in zip(bounds, bounds[1:]):
            out, lse = rl_kernels.attention(q[:, s:e], k[:, :e], v[:, :e], return_lse=True,
                                            backend=backend)
            sliced.append(out)
            assert torch.equal(lse, full_lse[..., s:e]), f"chunk {chunk}: lse of {s}:{e}"
            if chunk >= 64:  # q_start / q_len / k_len ranges in the full tensors
                out = rl_kernels.attention(q, k, v, q_start=i32([s]), q_len=i32([e - s]),
                                           k_len=i32([e]), backend=backend)
                ranged[:, s:e] = out[:, s:e]
            cached.append(rl_kernels.attention_with_kvcache(
                q[:, s:e], k_cache, v_cache, i32([s]), k_new=k[:, s:e], v_new=v[:, s:e],
                backend=backend))
        assert torch.equal(torch.cat(sliced, 1), full), f"chunk {chunk}, sliced"
        assert torch.equal(torch.cat(cached, 1), full), f"chunk {chunk}, KV cache"
        if chunk >= 64:
            assert torch.equal(ranged, full), f"chunk {chunk}, ranges"
    for _ in range(3):  # repeats
        assert torch.equal(rl_kernels.attention(q, k, v, backend=backend), full)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_qwen3_8b_prefill_vs_decode_of_last_64_tokens(backend):
    t, tail = 4096, 64
    q, k, v = qkv(1, t, t, 32, 8, 128, seed=20)
    full, full_lse = rl_kernels.attention(q, k, v, return_lse=True, backend=backend)
    k_cache = torch.full((1, t + 64, 8, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    v_cache = k_cache.clone()
    k_cache[:, :t - tail], v_cache[:, :t - tail] = k[:, :t - tail], v[:, :t - tail]
    for p in range(t - tail, t):
        out, lse = rl_kernels.attention_with_kvcache(q[:, p:p + 1], k_cache, v_cache, p,
                                                     k_new=k[:, p:p + 1], v_new=v[:, p:p + 1],
                                                     return_lse=True, backend=backend)
        assert torch.equal(out, full[:, p:p + 1]), f"decoded row {p}"
        assert torch.equal(lse, full_lse[..., p:p + 1]), f"lse of decoded row {p}"
    # the last 64 rows as one chunk over the cache, too
    chunk = rl_kernels.attention_with_kvcache(q[:, t - tail:], k_cache, v_cache, t, backend=backend)
    assert torch.equal(chunk, full[:, t - tail:])


def _sequences(lengths, hq=32, hkv=8, d=128, seed=30):
    return [qkv(1, n, n, hq, hkv, d, seed=seed + 3 * i) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("causal", [True, False])
def test_packing_orders_and_padding_bitwise(backend, causal):
    lengths = [2000, 5, 0, 64, 65, 513, 1]
    seqs = _sequences(lengths)
    alone = [rl_kernels.attention(*s, causal=causal, return_lse=True, backend=backend) for s in seqs]
    for order in ([0, 1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1, 0], [3, 0, 6, 2, 5, 1, 4]):
        q, k, v, cu = pack_sequences([seqs[i] for i in order])
        out, lse = rl_kernels.attention(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                        return_lse=True, backend=backend)
        for slot, i in enumerate(order):
            s, e = int(cu[slot]), int(cu[slot + 1])
            assert torch.equal(out[s:e], alone[i][0][0]), f"order {order}: sequence {i}"
            assert torch.equal(lse[:, s:e], alone[i][1][0]), f"order {order}: lse of sequence {i}"
    t = 2048
    for side in ("left", "right"):
        pq = torch.full((len(lengths), t, 32, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
        pk = torch.full((len(lengths), t, 8, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
        pv = pk.clone()
        starts = [t - n if side == "left" else 0 for n in lengths]
        for b, (s, n) in enumerate(zip(starts, lengths)):
            pq[b, s:s + n], pk[b, s:s + n], pv[b, s:s + n] = (x[0] for x in seqs[b])
        start, length = i32(starts), i32(lengths)
        out = rl_kernels.attention(pq, pk, pv, causal=causal, q_start=start, q_len=length,
                                   k_start=start, k_len=length, backend=backend)
        for b, (s, n) in enumerate(zip(starts, lengths)):
            assert torch.equal(out[b, s:s + n], alone[b][0][0]), f"{side} padding, sequence {b}"
            pad = torch.ones(t, dtype=torch.bool, device="cuda")
            pad[s:s + n] = False
            assert torch.equal(out[b, pad], torch.zeros_like(out[b, pad])), f"{side} padding rows"


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_forward_repeats_bitwise_with_many_tiles_per_cta(backend):
    # ~2,000 tiles of 128 rows on ~132 SMs: the sm90 prefill CTAs take tiles from a counter, so which
    # CTA runs a tile (and after which tile: the Q and K/V ring carried over) changes run to run
    lengths = [1500, 3, 700, 129, 2100, 64]
    seqs = _sequences(lengths, seed=90)
    q, k, v, cu = pack_sequences(seqs)
    first = rl_kernels.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, return_lse=True, backend=backend)
    for _ in range(4):
        again = rl_kernels.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, return_lse=True, backend=backend)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    for i, s in enumerate(seqs):
        alone = rl_kernels.attention(*s, return_lse=True, backend=backend)
        a, e = int(cu[i]), int(cu[i + 1])
        assert torch.equal(first[0][a:e], alone[0][0]), f"sequence {i}"
        assert torch.equal(first[1][:, a:e], alone[1][0]), f"lse of sequence {i}"
        sq, sk, sv = s
        ref_out, ref_lse = attention_reference(sq[:, :, :4], sk[:, :, :1], sv[:, :, :1])  # kv head 0's group
        assert (alone[0][:, :, :4].double() - ref_out).abs().max() <= 2e-2, f"sequence {i} vs fp64"
        assert (alone[1][:, :4].double() - ref_lse).abs().max() <= 1e-4, f"lse of sequence {i} vs fp64"


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_decode_batch_1_vs_16_and_stale_nan(backend):
    """16 caches of different lengths, NaN past each length: one batched decode step equals each
    sequence decoded alone and its prefill's row."""
    lengths = [1, 2, 63, 64, 65, 127, 511, 512, 513, 1000, 1023, 1024, 1025, 1999, 2000, 37]
    seqs = _sequences(lengths, seed=40)
    q, k, v, cu = pack_sequences(seqs)
    prefill = rl_kernels.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, backend=backend)
    k_cache = torch.full((16, 2048, 8, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    v_cache = k_cache.clone()
    for b, n in enumerate(lengths):
        k_cache[b, :n - 1], v_cache[b, :n - 1] = seqs[b][1][0, :n - 1], seqs[b][2][0, :n - 1]
    q_last = torch.stack([s[0][0, -1:] for s in seqs])
    k_last = torch.stack([s[1][0, -1:] for s in seqs])
    v_last = torch.stack([s[2][0, -1:] for s in seqs])
    seqlens = i32([n - 1 for n in lengths])
    # sm90: the batched step (16 x 8 x 4 segment CTAs, more than one wave) merges in the combine
    # kernel, each sequence alone (one wave) in the split kernel's clusters: `one` == `batched` below
    # is the proof that both merges give the same bits
    batched = rl_kernels.attention_with_kvcache(q_last, k_cache, v_cache, seqlens, k_new=k_last,
                                                v_new=v_last, backend=backend)
    assert torch.isfinite(batched).all()
    for b, n in enumerate(lengths):
        assert torch.equal(batched[b, 0], prefill[int(cu[b + 1]) - 1]), f"sequence {b} vs prefill"
        one = rl_kernels.attention_with_kvcache(q_last[b:b + 1], k_cache[b:b + 1],
                                                v_cache[b:b + 1], n, backend=backend)
        assert torch.equal(one, batched[b:b + 1]), f"sequence {b} alone"
    # zero-filled tails give the same bits as NaN-filled ones
    clean_k, clean_v = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    clean = rl_kernels.attention_with_kvcache(q_last, clean_k, clean_v, seqlens + 1, backend=backend)
    assert torch.equal(clean, batched)
    # a cache of 4608 rows: 9 segments, more than a cluster of sm90's split kernel holds (8); the same
    # bits
    wide_k = torch.cat([clean_k, torch.zeros_like(clean_k)[:, :2560]], 1)
    wide_v = torch.cat([clean_v, torch.zeros_like(clean_v)[:, :2560]], 1)
    wide = rl_kernels.attention_with_kvcache(q_last, wide_k, wide_v, seqlens + 1, backend=backend)
    assert torch.equal(wide, batched)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 128), (torch.float16, 64)])
@pytest.mark.parametrize("hq,hkv,tq", [(2, 2, 1), (8, 1, 1), (32, 8, 2), (4, 2, 3),
                                       (8, 1, 2), (32, 8, 3), (16, 2, 5)])
def test_split_few_rows_and_full_tiles_bitwise(backend, dtype, d, hq, hkv, tq):
    """sm90's split kernel runs its products transposed, the tile's rows as wgmma's N = 8, when a
    tile's (query, head in group) rows are at most 8 (tq * hq / hkv <= 8: the first four shapes),
    and as 64-row products otherwise: either way the last tq rows over a cache equal the prefill's
    rows and lse bitwise, for caches ending inside a block, at a segment boundary, inside the second
    segment and past a cluster's 8 segments (the combine kernel)."""
    for t in (37, 512, 1000, 4500):
        q, k, v = qkv(1, t, t, hq, hkv, d, dtype, seed=t + hq + tq)
        full, full_lse = rl_kernels.attention(q, k, v, return_lse=True, backend=backend)
        out, lse = rl_kernels.attention_with_kvcache(q[:, t - tq:], k, v, t, return_lse=True,
                                                     backend=backend)
        assert torch.equal(out, full[:, t - tq:]), f"{t} keys: out"
        assert torch.equal(lse, full_lse[..., t - tq:]), f"{t} keys: lse"


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rescale_threshold_both_ways_vs_fp64_and_decode_bitwise(backend, dtype):
    """Scores that move the contract's reference max every block, never, by a jump inside a segment
    and every other block (tests/conftest.py): out no worse than SDPA's vs fp64, lse vs fp64, and
    decode (split kernels) and chunked prefill rows bitwise equal the prefill's."""
    t = 1100
    q, k, v = rescale_profile_qkv(t, 32, 8, 128, dtype, device="cuda")
    full, full_lse = rl_kernels.attention(q, k, v, return_lse=True, backend=backend)
    ref, ref_lse = attention_reference(q, k, v)
    err, sdpa_err = rel_err(full, ref), rel_err(sdpa(q, k, v, True), ref)
    assert err <= max(SDPA_FACTOR * sdpa_err, FLOOR[dtype]), f"rel err {err:.3g} vs SDPA's {sdpa_err:.3g}"
    assert ((full_lse.double() - ref_lse).abs() / ref_lse.abs().clamp(min=1)).max() <= 1e-5
    rows = [0, 63, 64, 127, 199, 200, 450, 699, 700, 701, 763, 899, 960, 1099]
    k_cache = torch.zeros(len(rows), t, 8, 128, dtype=dtype, device="cuda")
    k_cache[:], v_cache = k[0], v[0].expand(len(rows), -1, -1, -1).clone()
    out, lse = rl_kernels.attention_with_kvcache(q[0, rows].unsqueeze(1), k_cache, v_cache,
                                                 i32([p + 1 for p in rows]), return_lse=True, backend=backend)
    assert torch.equal(out[:, 0], full[0, rows]) and torch.equal(lse[..., 0], full_lse[0, :, rows].T)
    bounds = [0, 150, 650, 730, 1100]
    chunks = [rl_kernels.attention(q[:, s:e], k[:, :e], v[:, :e], backend=backend)
              for s, e in zip(bounds, bounds[1:])]
    assert torch.equal(torch.cat(chunks, 1), full)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_long_cache_decode_vs_prefill(backend):
    """Caches past 16 segments of 512 keys (the combine kernel reads a row's segment records 16 at
    a time: 8193 keys = one record in the second batch, 16384 = two full batches, 17000 = 34
    records): one batched decode step equals each sequence's prefill row and lse bitwise, and the
    fp64 reference within bf16 rounding."""
    lengths = [8193, 16384, 17000]
    seqs = _sequences(lengths, hq=4, hkv=1, seed=70)
    k_cache = torch.full((3, max(lengths) + 8, 1, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    v_cache = k_cache.clone()
    for b, n in enumerate(lengths):
        k_cache[b, :n], v_cache[b, :n] = seqs[b][1][0], seqs[b][2][0]
    q_last = torch.stack([s[0][0, -1:] for s in seqs])
    out, lse = rl_kernels.attention_with_kvcache(q_last, k_cache, v_cache, i32(lengths), return_lse=True,
                                                 backend=backend)
    for b, (q, k, v) in enumerate(seqs):
        full, full_lse = rl_kernels.attention(q, k, v, return_lse=True, backend=backend)
        assert torch.equal(out[b], full[0, -1:]), f"sequence {b} ({lengths[b]} keys) vs prefill"
        assert torch.equal(lse[b], full_lse[0, :, -1:]), f"lse of sequence {b} vs prefill"
        ref, _ = attention_reference(q[:, -1:], k, v)
        assert rel_err(out[b:b + 1], ref) < 4e-3, f"sequence {b} vs fp64"


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_cuda_graph_decode_step(backend):
    """A captured decode step (k_new appended at cache_seqlens, a device tensor) replayed at new
    positions gives each position's prefill row."""
    t = 700
    seqs = _sequences([t, t], seed=50)
    q, k, v = (torch.cat(x) for x in zip(*seqs))
    prefill = rl_kernels.attention(q, k, v, backend=backend)
    k_cache = torch.full((2, 1024, 8, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    v_cache = k_cache.clone()
    offsets = (0, 37)  # sequence 1 runs 37 positions behind sequence 0
    start = 500
    for b, o in enumerate(offsets):
        k_cache[b, :start - o], v_cache[b, :start - o] = k[b, :start - o], v[b, :start - o]
    static_q = torch.zeros(2, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
    static_k = torch.zeros(2, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
    static_v = static_k.clone()
    seqlens = i32([start - o for o in offsets])

    def load(p):
        for b, o in enumerate(offsets):
            static_q[b], static_k[b], static_v[b] = q[b, p - o:p - o + 1], k[b, p - o:p - o + 1], \
                v[b, p - o:p - o + 1]
            seqlens[b] = p - o

    def step():
        return rl_kernels.attention_with_kvcache(static_q, k_cache, v_cache, seqlens, k_new=static_k,
                                                 v_new=static_v, backend=backend)

    load(start)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for p in range(start, t):
        load(p)
        graph.replay()
        for b, o in enumerate(offsets):
            assert torch.equal(captured[b, 0], prefill[b, p - o]), f"position {p - o} of {b}"
    torch.cuda.synchronize()


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_backward_deterministic_and_dq_rows_invariant(backend):
    seqs = _sequences([1500, 70, 1], seed=60)
    cots = [cuda_randn(*s[0].shape, seed=61 + i) for i, s in enumerate(seqs)]
    fn = lambda q, k, v: rl_kernels.attention(q, k, v, backend=backend)  # noqa: E731
    alone = [grads_of(fn, *s, c) for s, c in zip(seqs, cots)]
    for _ in range(3):
        again = grads_of(fn, *seqs[0], cots[0])
        assert all(torch.equal(x, y) for x, y in zip(again, alone[0])), "run to run"
    order = [2, 0, 1]
    q, k, v, cu = pack_sequences([seqs[i] for i in order])
    cot = torch.cat([cots[i][0] for i in order])
    packed_fn = lambda q, k, v: rl_kernels.attention(q, k, v, cu_seqlens_q=cu,  # noqa: E731
                                                     cu_seqlens_k=cu, backend=backend)
    packed = grads_of(packed_fn, q, k, v, cot)
    for _ in range(2):
        assert all(torch.equal(x, y) for x, y in zip(grads_of(packed_fn, q, k, v, cot), packed))
    for slot, i in enumerate(order):
        s, e = int(cu[slot]), int(cu[slot + 1])
        for name, x, y in zip(("out", "dq", "dk", "dv"), packed, alone[i]):
            assert torch.equal(x[s:e], y[0]), f"{name} of sequence {i}"


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("causal", [True, False])
def test_backward_packed_and_left_padded_bitwise(backend, causal):
    """Every sequence's dq, dk, dv bitwise the same alone, packed in another order and left-padded
    in a batch (NaN in the padding of q, k, v and the cotangent: never read), with GQA 4:1, empty
    sequences and lengths off the 64- and 128-row tiles; and the backend runs its own backward
    kernel (sm90: wgmma) when it has one."""
    assert kernel_registry.kernel_chain("attention_bwd", backend)[0] == f"attention_bwd_{backend}"
    lengths = [700, 5, 0, 64, 129, 1, 257]
    seqs = _sequences(lengths, hq=8, hkv=2, seed=100)
    cots = [cuda_randn(*s[0].shape, seed=110 + i) for i, s in enumerate(seqs)]
    fn = lambda q, k, v: rl_kernels.attention(q, k, v, causal=causal, backend=backend)  # noqa: E731
    alone = [grads_of(fn, *s, c) for s, c in zip(seqs, cots)]
    order = [3, 0, 5, 2, 6, 4, 1]
    q, k, v, cu = pack_sequences([seqs[i] for i in order])
    cot = torch.cat([cots[i][0] for i in order])
    packed = grads_of(lambda q, k, v: rl_kernels.attention(  # noqa: E731
        q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, backend=backend), q, k, v, cot)
    for slot, i in enumerate(order):
        s, e = int(cu[slot]), int(cu[slot + 1])
        for name, x, y in zip(("out", "dq", "dk", "dv"), packed, alone[i]):
            assert torch.equal(x[s:e], y[0]), f"packed: {name} of sequence {i}"
    t = 768
    pq, pk, pv, pc = (torch.full((len(lengths), t, h, 128), float("nan"), dtype=torch.bfloat16,
                                 device="cuda") for h in (8, 2, 2, 8))
    starts = [t - n for n in lengths]
    for b, (st, n) in enumerate(zip(starts, lengths)):
        pq[b, st:], pk[b, st:], pv[b, st:] = (x[0] for x in seqs[b])
        pc[b, st:] = cots[b][0]
    start, length = i32(starts), i32(lengths)
    padded = grads_of(lambda q, k, v: rl_kernels.attention(  # noqa: E731
        q, k, v, causal=causal, q_start=start, q_len=length, k_start=start, k_len=length,
        backend=backend), pq, pk, pv, pc)
    for b, (st, n) in enumerate(zip(starts, lengths)):
        for name, x, y in zip(("out", "dq", "dk", "dv"), padded, alone[b]):
            assert torch.equal(x[b, st:], y[0]), f"left padding: {name} of sequence {b}"
            assert torch.equal(x[b, :st], torch.zeros_like(x[b, :st])), f"{name} padding rows"


@pytest.mark.parametrize("causal", [True, False])
def test_backward_long_sequence_sm90_vs_sm80(causal):
    """One 33,000-token sequence (sm90: 258 key tiles and 258 query tiles of 128 per head, more CTAs
    per head than the GPU holds at once): dq, dk, dv bitwise equal run to run, and the two backends'
    gradients (different MMA instructions, so not bitwise) within bf16 rounding of each other."""
    if not (_usable("sm90") and _usable("sm80")):
        pytest.skip("needs both the sm90 and the sm80 backends")
    q, k, v = qkv(1, 33000, 33000, 4, 2, 128, seed=200)
    cot = cuda_randn(1, 33000, 4, 128, seed=201)

    def grads(backend):
        return grads_of(lambda q, k, v: rl_kernels.attention(q, k, v, causal=causal, backend=backend),
                        q, k, v, cot)

    sm90, again, sm80 = grads("sm90"), grads("sm90"), grads("sm80")
    for name, x, y, z in zip(("out", "dq", "dk", "dv"), sm90, again, sm80):
        assert torch.equal(x, y), f"{name} run to run"
        assert rel_err(x, z) <= 1e-2, f"{name}: sm90 vs sm80 {rel_err(x, z):.3g}"


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("tq,tk", [(127, 1000), (64, 300), (300, 64), (1, 129)])
def test_backward_chunk_shapes_vs_fp64(backend, causal, tq, tk):
    """Gradients when q is shorter or longer than k (causal aligned bottom-right, so SDPA cannot be
    the reference): dq, dk, dv vs fp64 with a random cotangent; rows that see no key get dq = 0."""
    q, k, v = qkv(2, tq, tk, 8, 2, 128, seed=tq * 3 + tk)
    cot = cuda_randn(2, tq, 8, 128, seed=tq + tk)
    got = grads_of(lambda q, k, v: rl_kernels.attention(q, k, v, causal=causal, backend=backend),
                   q, k, v, cot)
    want = grads_of(lambda q, k, v: attention_reference(q, k, v, causal)[0], q.double(), k.double(),
                    v.double(), cot)
    for name, mine, ref in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel_err(mine, ref) <= 1e-2, f"{name}: {rel_err(mine, ref):.3g}"
    if causal and tq > tk:
        assert torch.equal(got[1][:, :tq - tk], torch.zeros_like(got[1][:, :tq - tk]))


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_streams_and_get_op(backend):
    q, k, v = qkv(2, 1000, 1000, 32, 8, 128, seed=70)
    want = rl_kernels.attention(q, k, v, backend=backend)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = rl_kernels.attention(q, k, v, backend=backend)
    side.synchronize()
    assert torch.equal(on_side, want)
    op = kernel_registry.get_op("attention", backend=backend)
    assert torch.equal(op(q, k, v), want)
    assert _ran_on(kernel_registry.last_kernel(), "attention_fwd", backend)


def test_backends_each_self_consistent_not_necessarily_equal():
    """sm80 and sm90 may differ in bits (different MMA instructions); each agrees with itself
    between prefill and decode, and both are close to each other."""
    if not (_usable("sm80") and _usable("sm90")):
        pytest.skip("needs both sm80 and sm90")
    q, k, v = qkv(1, 1100, 1100, 32, 8, 128, seed=80)
    full = {b: rl_kernels.attention(q, k, v, backend=b) for b in ("sm80", "sm90")}
    for b in ("sm80", "sm90"):
        for p in (0, 511, 512, 1099):
            row = rl_kernels.attention_with_kvcache(q[:, p:p + 1], k, v, p + 1, backend=b)
            assert torch.equal(row, full[b][:, p:p + 1]), f"{b}: row {p}"
    assert rel_err(full["sm80"], full["sm90"]) <= 8e-3


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_bad_range_is_flagged_and_raised_on_the_next_call(backend):
    q, k, v = (x[0] for x in qkv(1, 100, 100, 4, 2, 64, seed=90))
    good = rl_kernels.attention(q, k, v, cu_seqlens_q=i32([0, 50, 100]),
                                cu_seqlens_k=i32([0, 50, 100]), max_seqlen_q=50, max_seqlen_k=50,
                                backend=backend)
    # the second sequence's keys run past the 100 rows: no host check (max_seqlen given, CUDA
    # cu_seqlens), the kernels flag it; the call itself returns
    rl_kernels.attention(q, k, v, cu_seqlens_q=i32([0, 50, 100]), cu_seqlens_k=i32([0, 60, 130]),
                         max_seqlen_q=50, max_seqlen_k=70, backend=backend)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="cu_seqlens"):
        rl_kernels.attention(q, k, v, cu_seqlens_q=i32([0, 50, 100]),
                             cu_seqlens_k=i32([0, 50, 100]), max_seqlen_q=50, max_seqlen_k=50,
                             backend=backend)
    # the flag is cleared once raised
    again = rl_kernels.attention(q, k, v, cu_seqlens_q=i32([0, 50, 100]),
                                 cu_seqlens_k=i32([0, 50, 100]), max_seqlen_q=50, max_seqlen_k=50,
                                 backend=backend)
    assert torch.equal(again, good)
    # a KV-cache overflow on CUDA is flagged the same way
    cache = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16, device="cuda")
    new = torch.zeros(1, 3, 2, 64, dtype=torch.bfloat16, device="cuda")
    rl_kernels.attention_with_kvcache(q[None, :1], cache, cache.clone(), i32([7]), k_new=new,
                                      v_new=new, backend=backend)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="cache_seqlens"):
        rl_kernels.attention(q[None], k[None], v[None], backend=backend)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_compile_packed_on_gpu(backend):
    """With CUDA cu_seqlens and max_seqlen given nothing is read on the host: fullgraph compiles."""
    def loss(q, k, v, cu):
        out = rl_kernels.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=700,
                                   max_seqlen_k=700, backend=backend)
        return (out.float() ** 2).sum()

    compiled = torch.compile(loss, fullgraph=True, dynamic=True, backend="aot_eager")
    q, k, v = leaves(*(x[0] for x in qkv(1, 1000, 1000, 32, 8, 128, seed=100)))
    cu = i32([0, 300, 1000])
    got, want = compiled(q, k, v, cu), loss(q, k, v, cu)
    assert torch.equal(got, want)
    assert all(torch.equal(x, y) for x, y in zip(torch.autograd.grad(got, (q, k, v)),
                                                 torch.autograd.grad(want, (q, k, v))))


# --------------------------------------------------------------------------------------------
# Absent ranges (None) and rows written by the kernels (out / lse not pre-filled)
# --------------------------------------------------------------------------------------------

# (b, tq, tk): the prefill schedule (tq * G > 64), the split schedule (decode, and a chunk of 16
# queries: 16 * G = 64 rows)
SCHEDULE_SHAPES = [(2, 130, 700), (3, 1, 1100), (2, 16, 600)]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("b,tq,tk", SCHEDULE_SHAPES)
def test_none_ranges_bitwise_equal_explicit_ranges(backend, b, tq, tk):
    """The op with q_start / q_len / k_start / k_len absent (None: start 0, max_q_len / max_k_len
    rows) equals the op with them spelled out: out, lse, dq, dk, dv bitwise, in both schedules."""
    q, k, v = qkv(b, tq, tk, 32, 8, 128, seed=110 + tq)
    cot = cuda_randn(*q.shape, seed=111 + tq)
    spelled = (i32([0] * b), i32([tq] * b), i32([0] * b), i32([tk] * b))

    def run(ranges):
        ql, kl, vl = leaves(q, k, v)
        out, lse = torch.ops.rl_kernels.attention(ql, kl, vl, *ranges, tq, tk, True, 0.125, backend)
        out.backward(cot)
        return out.detach(), lse, ql.grad, kl.grad, vl.grad

    want = run(spelled)
    for absent in ((0, 1, 2, 3), (0, 2), (1, 3), (3,)):
        ranges = tuple(None if i in absent else r for i, r in enumerate(spelled))
        for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), run(ranges), want):
            assert torch.equal(x, y), f"{name} with ranges {absent} absent"


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("tq,cached", [(9, 5), (40, 20)])  # split schedule; prefill schedule
def test_uninitialized_out_and_lse_every_row_written(backend, tq, cached, nan_allocations):
    """Calls without q ranges get NaN-filled out / lse (nan_allocations): every row comes back
    written, the rows that see no key (causal, more queries than keys) as exactly 0 / -inf, and
    bitwise equal to the zero-filled call with the ranges spelled out."""
    q, k, v = qkv(2, tq, cached, 32, 8, 128, seed=120 + tq)
    rows_without_keys = tq - cached
    k_cache = torch.full((2, 64, 8, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    v_cache = k_cache.clone()
    k_cache[:, :cached], v_cache[:, :cached] = k, v
    zeros, q_len, k_len = i32([0, 0]), i32([tq, tq]), i32([cached, cached])
    want, want_lse = rl_kernels.attention(q, k, v, q_start=zeros, q_len=q_len, k_start=zeros,
                                          k_len=k_len, return_lse=True, backend=backend)
    calls = {
        "attention": lambda: rl_kernels.attention(q, k, v, return_lse=True, backend=backend),
        "kvcache tensor": lambda: rl_kernels.attention_with_kvcache(
            q, k_cache, v_cache, k_len, return_lse=True, backend=backend),
        "kvcache int": lambda: rl_kernels.attention_with_kvcache(
            q, k_cache, v_cache, cached, return_lse=True, backend=backend),
        "kvcache int, new keys": lambda: rl_kernels.attention_with_kvcache(
            q, k_cache.clone(), v_cache.clone(), cached - 3, k_new=k[:, -3:], v_new=v[:, -3:],
            return_lse=True, backend=backend),
        "kvcache tensor, new keys": lambda: rl_kernels.attention_with_kvcache(
            q, k_cache.clone(), v_cache.clone(), k_len - 3, k_new=k[:, -3:], v_new=v[:, -3:],
            return_lse=True, backend=backend),
    }
    for name, call in calls.items():
        out, lse = call()
        assert not torch.isnan(out).any() and not torch.isnan(lse).any(), name
        assert torch.equal(out[:, :rows_without_keys], torch.zeros_like(out[:, :rows_without_keys])), name
        assert torch.equal(lse[..., :rows_without_keys],
                           torch.full_like(lse[..., :rows_without_keys], -math.inf)), name
        assert torch.equal(out, want) and torch.equal(lse, want_lse), name
    out, lse = rl_kernels.attention_with_kvcache(q, k_cache, v_cache, 0, return_lse=True,
                                                 backend=backend)
    assert torch.equal(out, torch.zeros_like(out)), "an empty cache: every row 0"
    assert torch.equal(lse, torch.full_like(lse, -math.inf)), "an empty cache: every lse -inf"


def _flagged(call, backend):
    """call()'s results, once the attention call after it has raised for the bad range it flagged
    (which also clears the flag)."""
    result = call()
    torch.cuda.synchronize()
    q, k, v = qkv(1, 2, 2, 4, 2, 64, seed=139)
    with pytest.raises(ValueError, match="cu_seqlens / cache_seqlens"):
        rl_kernels.attention(q, k, v, backend=backend)
    return result


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("tq", [1, 40])  # split schedule; prefill schedule (40 * 4 rows > 64)
def test_bad_key_range_with_uninitialized_out_writes_its_rows_and_flags(backend, tq,
                                                                         nan_allocations):
    """A sequence whose key range is out of bounds, in a call without q ranges (out / lse NaN-filled
    by nan_allocations): cache_seqlens past the cache, a negative cache_seqlens under appended keys,
    a k_len past k's rows. Its rows come back 0 / -inf, the other sequences' rows equal each alone,
    and the next call raises."""
    t_max = 64
    q, k, v = qkv(3, tq, t_max, 32, 8, 128, seed=130 + tq)
    cases = {  # name: (call, index of the bad sequence, the good ones alone)
        "cache_seqlens past the cache": (
            lambda: rl_kernels.attention_with_kvcache(q, k, v, i32([50, t_max + 30, 45]),
                                                      return_lse=True, backend=backend), 1,
            lambda b, kc, vc: rl_kernels.attention_with_kvcache(
                q[b:b + 1], k[b:b + 1], v[b:b + 1], [50, 0, 45][b], return_lse=True, backend=backend)),
        "negative cache_seqlens, new keys": (
            lambda: rl_kernels.attention_with_kvcache(q, kc, vc, i32([-1, 40, 30]), k_new=k[:, :2],
                                                      v_new=v[:, :2], return_lse=True, backend=backend), 0,
            lambda b, kc, vc: rl_kernels.attention_with_kvcache(  # (the cache holds the new keys)
                q[b:b + 1], kc[b:b + 1], vc[b:b + 1], [0, 42, 32][b], return_lse=True, backend=backend)),
        "k_len past the rows": (
            lambda: rl_kernels.attention(q, k, v, k_len=i32([t_max, t_max + 6, 10]), return_lse=True,
                                         backend=backend), 1,
            lambda b, kc, vc: rl_kernels.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1],
                                                   k_len=i32([[t_max, 0, 10][b]]), return_lse=True,
                                                   backend=backend)),
    }
    for name, (call, bad, alone) in cases.items():
        kc, vc = k.clone(), v.clone()
        out, lse = _flagged(call, backend)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any(), name
        assert torch.equal(out[bad], torch.zeros_like(out[bad])), f"{name}: rows of the bad sequence"
        assert torch.equal(lse[bad], torch.full_like(lse[bad], -math.inf)), f"{name}: its lse"
        for b in range(3):
            if b != bad:
                want, want_lse = alone(b, kc, vc)
                assert torch.equal(out[b:b + 1], want) and torch.equal(lse[b:b + 1], want_lse), \
                    f"{name}: sequence {b}"


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_int_cache_seqlens_equals_tensor_cache_seqlens(backend):
    """An int cache_seqlens (no k_len tensor: every sequence has max_k_len keys; new keys land by
    slice copy) gives the bits of the same lengths as a tensor, and the same cache."""
    q, k, v = qkv(3, 4, 1000, 32, 8, 128, seed=140)
    for n, t_new in ((1000, 0), (600, 4), (0, 4), (995, 4)):
        caches = [(torch.cat([k, k], 1), torch.cat([v, v], 1)) for _ in range(2)]
        new = dict(k_new=k[:, n:n + t_new], v_new=v[:, n:n + t_new]) if t_new else {}
        got = rl_kernels.attention_with_kvcache(q, *caches[0], n, return_lse=True, backend=backend, **new)
        want = rl_kernels.attention_with_kvcache(q, *caches[1], i32([n] * 3), return_lse=True,
                                                 backend=backend, **new)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"{n} + {t_new}"
        assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def _kernels_of(call):
    """Names of the CUDA kernels one call launches (profiled after a warm-up call)."""
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_decode_call_launches_our_kernels_and_the_append_only(backend):
    """A decode step runs the split and combine kernels (sm90, caches up to 4096 keys in a grid of
    one wave: the split kernel alone, its clusters merge) and nothing else: no range tensors, no
    zero-filled out, no -inf lse; with new keys and an int cache_seqlens, two copies beside them.
    A prefill call without ranges runs the prefill kernel alone (sm90: after a memset of its tile
    counter, the persistent kernel's work queue)."""
    q, k, v = qkv(2, 1, 1024, 32, 8, 128, seed=150)
    k_cache, v_cache = torch.cat([k, k], 1), torch.cat([v, v], 1)
    lengths = i32([1000, 700])
    new = dict(k_new=k[:, :1], v_new=v[:, :1])
    q_prefill = k[:, :300].repeat_interleave(4, 2)  # [2, 300, 32, 128]: the prefill schedule
    for name, call, others in (
            ("tensor cache_seqlens", lambda: rl_kernels.attention_with_kvcache(
                q, k_cache, v_cache, lengths, backend=backend), 0),
            ("int cache_seqlens", lambda: rl_kernels.attention_with_kvcache(
                q, k_cache, v_cache, 1000, backend=backend), 0),
            ("int cache_seqlens, new keys", lambda: rl_kernels.attention_with_kvcache(
                q, k_cache, v_cache, 1000, backend=backend, **new), 2),
            ("prefill without ranges", lambda: rl_kernels.attention(
                q_prefill, k[:, :300], v[:, :300], backend=backend), 1 if backend == "sm90" else 0)):
        kernels = _kernels_of(call)
        ours = [n for n in kernels if "attention" in n]
        assert len(ours) == (1 if name.startswith("prefill") or backend == "sm90" else 2), f"{name}: {kernels}"
        assert len(kernels) - len(ours) == others, f"{name}: {kernels}"
        if name.startswith("prefill"):
            assert all(n.startswith("Memset") for n in kernels if n not in ours), f"{name}: {kernels}"
