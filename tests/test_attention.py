"""attention on the CPU backend: values, lse and gradients vs fp64 (causal / full, GQA, odd head
dims, decode and chunk shapes, empty sequences), bitwise invariance (prefill vs chunked prefill vs
KV-cache decode, packing, padding, batch size, threads, repeats, layouts, stale cache),
deterministic backward, opcheck, torch.compile, the registry op, and argument errors."""

import math

import pytest
import torch

import rl_kernels
from rl_kernels import kernel_registry
from conftest import (attention_reference, grads_of, leaves, pack_sequences, randn, rel_err,
                      rescale_profile_qkv)

# rel_err of out against fp64 of the same rounded inputs: fp32 keeps ~1e-7 per element; bf16 / fp16
# add the output rounding (and P rounded to the dtype for the PV product).
OUT_TOL = {torch.float32: 2e-6, torch.bfloat16: 6e-3, torch.float16: 8e-4}
GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}
LSE_TOL = 1e-5  # lse is fp32 for every dtype (computed from the rounded inputs)


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


def qkv(b, tq, tk, hq, hkv, d, dtype=torch.float32, seed=0):
    """q [b, tq, hq, d], k / v [b, tk, hkv, d]; q scaled up so softmax rows are not flat."""
    return (randn(b, tq, hq, d, dtype=dtype, seed=seed, scale=1.5),
            randn(b, tk, hkv, d, dtype=dtype, seed=seed + 1),
            randn(b, tk, hkv, d, dtype=dtype, seed=seed + 2))


# --------------------------------------------------------------------------------------------
# Accuracy vs fp64
# --------------------------------------------------------------------------------------------

SHAPES = [  # (hq, hkv, d, tq, tk)
    (4, 1, 64, 1000, 1000),  # GQA 4:1, prefill across 16 blocks and a segment boundary
    (4, 2, 128, 127, 127),  # GQA 2:1, blocks of 64 and a partial one
    (2, 2, 40, 1, 1),  # MHA, odd head dim, one key
    (2, 2, 40, 2, 2),
    (4, 1, 40, 1, 1000),  # decode: one query over 1000 keys
    (4, 2, 64, 127, 1000),  # chunk: the last 127 queries over 1000 keys
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv,d,tq,tk", SHAPES)
def test_forward_and_lse_match_fp64(dtype, causal, hq, hkv, d, tq, tk):
    b = 1 if tq * tk >= 10 ** 6 else 2
    q, k, v = qkv(b, tq, tk, hq, hkv, d, dtype, seed=tq + tk + d)
    out, lse = rl_kernels.attention(q, k, v, causal=causal, return_lse=True)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (b, hq, tq)
    assert kernel_registry.last_kernel() == "attention_fwd_cpu"
    ref, ref_lse = attention_reference(q, k, v, causal)
    assert rel_err(out, ref) <= OUT_TOL[dtype]
    assert (lse.double() - ref_lse).abs().max() <= LSE_TOL
    if tq * tk < 10 ** 6:  # an explicit scale
        out2 = rl_kernels.attention(q, k, v, causal=causal, softmax_scale=0.3)
        assert rel_err(out2, attention_reference(q, k, v, causal, scale=0.3)[0]) <= OUT_TOL[dtype]
    assert torch.equal(rl_kernels.attention(q, k, v, causal=causal), out)


def test_fp64_forward_is_exact_to_rounding():
    q, k, v = qkv(1, 100, 600, 4, 2, 24, torch.float64, seed=3)
    out, lse = rl_kernels.attention(q, k, v, return_lse=True)
    assert lse.dtype == torch.float64
    # fp64 takes softmax_scale as the double it is (the other dtypes round it to fp32 first)
    ref, ref_lse = attention_reference(q, k, v, scale=24 ** -0.5)
    assert rel_err(out, ref) <= 1e-13 and (lse - ref_lse).abs().max() <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rescale_threshold_both_ways_vs_fp64_and_decode_bitwise(dtype):
    """Scores that move the contract's reference max every block, never, by a jump inside a segment
    and every other block: out and lse vs fp64 (p up to 2^8 must not cost accuracy), decode and
    chunked prefill rows bitwise equal the prefill's."""
    t = 1100
    q, k, v = rescale_profile_qkv(t, 4, 2, 64, dtype)
    full, full_lse = rl_kernels.attention(q, k, v, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v)
    # scores near 280 (lse ~35) cost fp32 digits in any implementation: bound by torch's own error
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        *(x.float().transpose(1, 2) for x in (q, k, v)), is_causal=True, enable_gqa=True).transpose(1, 2)
    assert rel_err(full, ref) <= max(OUT_TOL[dtype], 1.5 * rel_err(sdpa, ref))
    assert ((full_lse.double() - ref_lse).abs() / ref_lse.abs().clamp(min=1)).max() <= LSE_TOL
    for p in (0, 63, 64, 127, 199, 200, 450, 699, 700, 701, 763, 899, 960, 1099):
        out, lse = rl_kernels.attention_with_kvcache(q[:, p:p + 1], k, v, p + 1, return_lse=True)
        assert torch.equal(out, full[:, p:p + 1]) and torch.equal(lse, full_lse[..., p:p + 1]), f"row {p}"
    bounds = [0, 150, 650, 730, 1100]
    chunks = [rl_kernels.attention(q[:, s:e], k[:, :e], v[:, :e]) for s, e in zip(bounds, bounds[1:])]
    assert torch.equal(torch.cat(chunks, 1), full)


def test_query_rows_past_the_keys_see_nothing():
    """Tq > Tk, causal bottom-right: the first Tq - Tk rows sit before key 0 (out 0, lse -inf)."""
    q, k, v = qkv(1, 5, 3, 2, 1, 16, seed=4)
    out, lse = rl_kernels.attention(q, k, v, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v)
    assert torch.equal(out[:, :2], torch.zeros_like(out[:, :2]))
    assert torch.equal(lse[..., :2], torch.full_like(lse[..., :2], -math.inf))
    assert rel_err(out, ref) <= 2e-6 and (lse[..., 2:].double() - ref_lse[..., 2:]).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv,d,tq,tk", [(4, 1, 64, 1000, 1000), (4, 2, 40, 127, 600),
                                            (2, 2, 128, 1, 130)])
def test_gradients_random_cotangents_vs_fp64(dtype, causal, hq, hkv, d, tq, tk):
    b = 1 if tq * tk >= 10 ** 6 else 2
    q, k, v = qkv(b, tq, tk, hq, hkv, d, dtype, seed=tq + 7)
    cotangent = randn(b, tq, hq, d, seed=tq + 8)
    got = grads_of(lambda q, k, v: rl_kernels.attention(q, k, v, causal=causal), q, k, v, cotangent)
    want = grads_of(lambda q, k, v: attention_reference(q, k, v, causal)[0], q.double(), k.double(),
                    v.double(), cotangent)
    assert rel_err(got[0], want[0]) <= OUT_TOL[dtype]
    for name, x, ref in zip(("dq", "dk", "dv"), got[1:], want[1:]):
        assert x.dtype == dtype, name
        assert rel_err(x, ref) <= GRAD_TOL[dtype], name
    assert kernel_registry.last_kernel() == "attention_bwd_cpu"


@pytest.mark.parametrize("causal", [True, False])
def test_gradcheck_fp64(causal):
    # 70 queries over 75 keys: two key blocks, rows that see part of a block, GQA 2:1
    q, k, v = leaves(*qkv(1, 70, 75, 2, 1, 4, torch.float64, seed=5))
    fn = lambda q, k, v: rl_kernels.attention(q, k, v, causal=causal, softmax_scale=0.7)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)
    # packed: three sequences, one of them empty
    q, k, v = leaves(*(t[0] for t in qkv(1, 9, 11, 2, 2, 3, torch.float64, seed=6)))
    cu_q, cu_k = i32([0, 4, 4, 9]), i32([0, 5, 5, 11])
    packed = lambda q, k, v: rl_kernels.attention(  # noqa: E731
        q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert torch.autograd.gradcheck(packed, (q, k, v), fast_mode=True)


def test_empty_sequences_and_zero_length_rows_packed():
    """cu_seqlens with repeated entries: a sequence without queries, one without keys (out 0,
    lse -inf), rows past the last sequence untouched (0); gradients of unused rows are 0."""
    hq, hkv, d = 4, 2, 16
    q_lens, k_lens = [3, 0, 4, 0, 2], [5, 0, 0, 6, 70]
    q = randn(11, hq, d, seed=9, scale=1.5)  # 9 rows in sequences + 2 trailing
    k, v = randn(83, hkv, d, seed=10), randn(83, hkv, d, seed=11)  # 81 + 2 trailing
    cu_q = i32([0, 3, 3, 7, 7, 9])
    cu_k = i32([0, 5, 5, 5, 11, 81])
    assert torch.equal(cu_q.diff(), i32(q_lens)) and torch.equal(cu_k.diff(), i32(k_lens))
    cot = randn(11, hq, d, seed=12)
    for causal in (True, False):
        ql, kl, vl = leaves(q, k, v)
        out, lse = rl_kernels.attention(ql, kl, vl, causal=causal, cu_seqlens_q=cu_q,
                                        cu_seqlens_k=cu_k, return_lse=True)
        assert lse.shape == (hq, 11)
        out.backward(cot)
        for b in range(5):
            qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
            if qe == qs:
                continue
            r_leaves = leaves(q[qs:qe].double()[None], k[ks:ke].double()[None],
                              v[ks:ke].double()[None])
            ref, ref_lse = attention_reference(*r_leaves, causal)
            if k_lens[b] == 0:
                assert torch.equal(out[qs:qe], torch.zeros_like(out[qs:qe]))
                assert torch.equal(lse[:, qs:qe], torch.full_like(lse[:, qs:qe], -math.inf))
                assert torch.equal(ql.grad[qs:qe], torch.zeros_like(ql.grad[qs:qe]))
                continue
            assert rel_err(out[qs:qe], ref[0]) <= 2e-6
            assert (lse[:, qs:qe].double() - ref_lse[0]).abs().max() <= 1e-5
            ref.backward(cot[qs:qe].double()[None])
            assert rel_err(ql.grad[qs:qe], r_leaves[0].grad[0]) <= 1e-5
            assert rel_err(kl.grad[ks:ke], r_leaves[1].grad[0]) <= 1e-5
            assert rel_err(vl.grad[ks:ke], r_leaves[2].grad[0]) <= 1e-5
        # rows outside every sequence, and the keys of the sequence without queries
        assert torch.equal(out[9:], torch.zeros_like(out[9:]))
        assert torch.equal(lse[:, 9:], torch.full_like(lse[:, 9:], -math.inf))
        assert torch.equal(ql.grad[9:], torch.zeros_like(ql.grad[9:]))
        for rows in (slice(5, 11), slice(81, 83)):
            assert torch.equal(kl.grad[rows], torch.zeros_like(kl.grad[rows]))
            assert torch.equal(vl.grad[rows], torch.zeros_like(vl.grad[rows]))


def test_zero_length_rows_in_a_padded_batch():
    q, k, v = qkv(3, 5, 6, 2, 1, 8, seed=13)
    q_len, k_len = i32([5, 0, 5]), i32([6, 6, 0])
    ql, kl, vl = leaves(q, k, v)
    out, lse = rl_kernels.attention(ql, kl, vl, q_len=q_len, k_len=k_len, return_lse=True)
    assert torch.equal(out[1:], torch.zeros_like(out[1:]))
    assert torch.equal(lse[1:], torch.full_like(lse[1:], -math.inf))
    assert rel_err(out[:1], attention_reference(q[:1], k[:1], v[:1])[0]) <= 2e-6
    out.backward(randn(*out.shape, seed=14))
    assert torch.equal(ql.grad[1:], torch.zeros_like(ql.grad[1:]))
    assert torch.equal(kl.grad[1:], torch.zeros_like(kl.grad[1:]))
    assert torch.equal(vl.grad[1:], torch.zeros_like(vl.grad[1:]))
    empty = rl_kernels.attention(q[:0], k[:0], v[:0])
    assert empty.shape == (0, 5, 2, 8)
    out, lse = rl_kernels.attention(q[:, :0], k[:, :0], v[:, :0], return_lse=True)
    assert out.shape == (3, 0, 2, 8) and lse.shape == (3, 2, 0)


# --------------------------------------------------------------------------------------------
# Bitwise invariance
# --------------------------------------------------------------------------------------------

T_LONG = 1100  # two segment boundaries (512, 1024) and a partial block at the end


@pytest.fixture(scope="module")
def long_sequence():
    """One bf16 sequence of T_LONG tokens, GQA 4:2, d 64; the causal prefill out and lse."""
    q, k, v = qkv(1, T_LONG, T_LONG, 4, 2, 64, torch.bfloat16, seed=20)
    out, lse = rl_kernels.attention(q, k, v, return_lse=True)
    return q, k, v, out, lse


@pytest.mark.parametrize("chunk", [7, 64, 100, 512, 1000])  # 1: the token-by-token decode test
def test_chunked_prefill_bitwise_equals_prefill(long_sequence, chunk):
    q, k, v, full, full_lse = long_sequence
    bounds = list(range(0, T_LONG, chunk)) + [T_LONG]
    sliced, ranged, cached = [], torch.zeros_like(full), []
    ranged_lse = torch.full_like(full_lse, -math.inf)
    k_cache = torch.full((1, T_LONG + 64, 2, 64), float("nan"), dtype=torch.bfloat16)
    v_cache = k_cache.clone()
    for s, e in zip(bounds, bounds[1:]):
        # (a) the chunk's queries over the keys so far, as separate tensors (bottom-right causal)
        out, lse = rl_kernels.attention(q[:, s:e], k[:, :e], v[:, :e], return_lse=True)
        sliced.append(out)
        assert torch.equal(lse, full_lse[..., s:e]), f"lse of chunk {s}:{e}"
        # (b) the same rows addressed in the full tensors with q_start / q_len / k_len
        out, lse = rl_kernels.attention(q, k, v, q_start=i32([s]), q_len=i32([e - s]), k_len=i32([e]),
                                        return_lse=True)
        assert torch.equal(out[:, :s], torch.zeros_like(out[:, :s]))
        assert torch.equal(out[:, e:], torch.zeros_like(out[:, e:]))
        ranged[:, s:e] = out[:, s:e]
        ranged_lse[..., s:e] = lse[..., s:e]
        # (c) a KV cache (stale NaN past its length) the chunk's keys are appended to
        cached.append(rl_kernels.attention_with_kvcache(q[:, s:e], k_cache, v_cache, s,
                                                        k_new=k[:, s:e], v_new=v[:, s:e]))
    assert torch.equal(torch.cat(sliced, 1), full)
    assert torch.equal(ranged, full) and torch.equal(ranged_lse, full_lse)
    assert torch.equal(torch.cat(cached, 1), full)
    assert torch.equal(k_cache[:, :T_LONG], k) and torch.equal(v_cache[:, :T_LONG], v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_token_by_token_decode_bitwise_equals_prefill(dtype):
    """Every decode step (one query, k_new / v_new appended to the cache) gives the prefill's row;
    cache_seqlens as an int and as an int32 tensor; return_lse too."""
    t = 600
    q, k, v = qkv(1, t, t, 4, 1, 40, dtype, seed=21)
    full, full_lse = rl_kernels.attention(q, k, v, return_lse=True)
    k_cache = torch.full((1, t + 3, 1, 40), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    for p in range(t):
        seqlens = p if p % 2 else i32([p])
        out, lse = rl_kernels.attention_with_kvcache(q[:, p:p + 1], k_cache, v_cache, seqlens,
                                                     k_new=k[:, p:p + 1], v_new=v[:, p:p + 1],
                                                     return_lse=True)
        assert torch.equal(out, full[:, p:p + 1]), f"position {p}"
        assert torch.equal(lse, full_lse[..., p:p + 1]), f"lse at position {p}"
    # the same rows with the cache already filled (no k_new), and as non-causal over keys 0..p
    for p in (0, 63, 64, 511, 512, 599):
        assert torch.equal(rl_kernels.attention_with_kvcache(q[:, p:p + 1], k_cache, v_cache, p + 1),
                           full[:, p:p + 1])
        assert torch.equal(rl_kernels.attention(q[:, p:p + 1], k[:, :p + 1], v[:, :p + 1],
                                                causal=False), full[:, p:p + 1])


def test_stale_nan_cache_past_seqlens_changes_no_bit():
    q, k, v = qkv(2, 4, 300, 4, 2, 64, torch.bfloat16, seed=22)
    lens = [300, 129]
    clean_k, clean_v = torch.zeros(2, 512, 2, 64, dtype=torch.bfloat16), torch.zeros(
        2, 512, 2, 64, dtype=torch.bfloat16)
    clean_k[:, :300], clean_v[:, :300] = k, v
    stale_k, stale_v = clean_k.clone(), clean_v.clone()
    for b, n in enumerate(lens):
        stale_k[b, n:], stale_v[b, n:] = float("nan"), float("inf")
    for causal in (True, False):
        want = rl_kernels.attention_with_kvcache(q, clean_k, clean_v, i32(lens), causal=causal)
        got = rl_kernels.attention_with_kvcache(q, stale_k, stale_v, i32(lens), causal=causal)
        assert torch.isfinite(got).all() and torch.equal(got, want)
        for b, n in enumerate(lens):  # and the same as the sequence alone, unpadded
            alone = rl_kernels.attention(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], causal=causal)
            assert torch.equal(got[b:b + 1], alone)


def _sequences(lengths, hq=4, hkv=2, d=64, dtype=torch.bfloat16, seed=30):
    """One [1, T, H, d] (q, k, v) per length."""
    return [qkv(1, n, n, hq, hkv, d, dtype, seed=seed + 3 * i) for i, n in enumerate(lengths)]


PACK_LENGTHS = [1100, 5, 0, 64, 65, 300, 1]


@pytest.mark.parametrize("causal", [True, False])
def test_packed_sequences_bitwise_equal_alone_in_any_order(causal):
    seqs = _sequences(PACK_LENGTHS)
    alone = [rl_kernels.attention(q, k, v, causal=causal, return_lse=True) for q, k, v in seqs]
    for order in ([0, 1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1, 0], [3, 0, 6, 2, 5, 1, 4]):
        q, k, v, cu = pack_sequences([seqs[i] for i in order])
        out, lse = rl_kernels.attention(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                        return_lse=True)
        for pos, i in enumerate(order):
            s, e = int(cu[pos]), int(cu[pos + 1])
            assert torch.equal(out[s:e], alone[i][0][0]), f"sequence {i} at slot {pos}"
            assert torch.equal(lse[:, s:e], alone[i][1][0]), f"lse of sequence {i} at slot {pos}"


def test_packed_chunks_of_different_sequences_bitwise_equal_prefill():
    """A packed batch of chunks (q shorter than k, different offsets) gives each prefill's rows."""
    seqs = _sequences([700, 300, 90], seed=40)
    full = [rl_kernels.attention(q, k, v) for q, k, v in seqs]
    chunks = [(0, 513, 700), (1, 1, 300), (2, 64, 90)]  # (sequence, chunk start, end)
    q = torch.cat([seqs[i][0][0, s:e] for i, s, e in chunks])
    k = torch.cat([seqs[i][1][0, :e] for i, s, e in chunks])
    v = torch.cat([seqs[i][2][0, :e] for i, s, e in chunks])
    cu_q = i32([0, 187, 486, 512])
    cu_k = i32([0, 700, 1000, 1090])
    out = rl_kernels.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    for slot, (i, s, e) in enumerate(chunks):
        assert torch.equal(out[cu_q[slot]:cu_q[slot + 1]], full[i][0, s:e]), f"chunk {slot}"


@pytest.mark.parametrize("causal", [True, False])
def test_left_and_right_padding_bitwise_equal_packed(causal):
    """A padded [B, T, H, d] batch whose padding rows hold NaN: each sequence's rows equal the
    packed unpadded result; padding rows of out are 0 and of lse -inf."""
    lengths = [1100, 70, 513]
    seqs = _sequences(lengths, seed=50)
    q, k, v, cu = pack_sequences(seqs)
    packed, packed_lse = rl_kernels.attention(q, k, v, causal=causal, cu_seqlens_q=cu,
                                              cu_seqlens_k=cu, return_lse=True)
    t = 1120
    for side in ("left", "right", "mixed"):
        pq = torch.full((3, t, 4, 64), float("nan"), dtype=torch.bfloat16)
        pk = torch.full((3, t, 2, 64), float("nan"), dtype=torch.bfloat16)
        pv = pk.clone()
        starts = []
        for b, n in enumerate(lengths):
            s = {"left": t - n, "right": 0, "mixed": (7, 0, 300)[b]}[side]
            starts.append(s)
            pq[b, s:s + n], pk[b, s:s + n], pv[b, s:s + n] = (x[0] for x in seqs[b])
        start, length = i32(starts), i32(lengths)
        out, lse = rl_kernels.attention(pq, pk, pv, causal=causal, q_start=start, q_len=length,
                                        k_start=start, k_len=length, return_lse=True)
        for b, n in enumerate(lengths):
            s, c = starts[b], int(cu[b])
            assert torch.equal(out[b, s:s + n], packed[c:c + n]), f"{side} padding, sequence {b}"
            assert torch.equal(lse[b, :, s:s + n], packed_lse[:, c:c + n])
            pad = torch.ones(t, dtype=torch.bool)
            pad[s:s + n] = False
            assert torch.equal(out[b, pad], torch.zeros_like(out[b, pad]))
            assert torch.equal(lse[b][:, pad], torch.full_like(lse[b][:, pad], -math.inf))


def test_batch_of_five_bitwise_equals_batch_of_one():
    q, k, v = qkv(5, 530, 530, 4, 2, 64, torch.bfloat16, seed=60)
    full, lse = rl_kernels.attention(q, k, v, return_lse=True)
    for b in range(5):
        alone, alone_lse = rl_kernels.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], return_lse=True)
        assert torch.equal(alone, full[b:b + 1]) and torch.equal(alone_lse, lse[b:b + 1])
    # decode: 5 sequences with different cache lengths in one call vs each alone
    lens = [1, 64, 65, 512, 529]
    qd = q[:, :1]
    batched = rl_kernels.attention_with_kvcache(qd, k, v, i32(lens))
    for b, n in enumerate(lens):
        one = rl_kernels.attention_with_kvcache(qd[b:b + 1], k[b:b + 1], v[b:b + 1], n)
        assert torch.equal(batched[b:b + 1], one)
        # query 0 placed at position n - 1 (bottom-right): the same as a 1-query attention call
        assert torch.equal(one, rl_kernels.attention(qd[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n]))


def test_strided_layouts_bitwise_equal_contiguous():
    """A fused qkv projection's views, and [B, H, T, d] transposed: the same bits as contiguous."""
    qkv_proj = randn(2, 300, 4 + 2 + 2, 64, dtype=torch.bfloat16, seed=70)
    q, k, v = qkv_proj[:, :, :4], qkv_proj[:, :, 4:6], qkv_proj[:, :, 6:]
    want = rl_kernels.attention(q.contiguous(), k.contiguous(), v.contiguous())
    assert torch.equal(rl_kernels.attention(q, k, v), want)
    bhtd = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]
    assert torch.equal(rl_kernels.attention(*bhtd), want)
    cot = randn(2, 300, 4, 64, dtype=torch.bfloat16, seed=71)
    fn = lambda q, k, v: rl_kernels.attention(q, k, v)  # noqa: E731
    contiguous = grads_of(fn, q.contiguous(), k.contiguous(), v.contiguous(), cot)
    for layout in ((q, k, v), bhtd):
        assert all(torch.equal(x, y) for x, y in zip(grads_of(fn, *layout, cot), contiguous))


def test_thread_count_and_repeats_change_no_bit():
    q, k, v = qkv(2, 700, 700, 4, 2, 64, torch.float32, seed=80)
    cot = randn(2, 700, 4, 64, seed=81)
    fn = lambda q, k, v: rl_kernels.attention(q, k, v)  # noqa: E731
    want = grads_of(fn, q, k, v, cot)
    for threads in (1, 2, 3):
        rl_kernels.set_num_threads(threads)
        got = grads_of(fn, q, k, v, cot)
        assert all(torch.equal(x, y) for x, y in zip(got, want)), f"{threads} threads"
    rl_kernels.set_num_threads(0)
    for _ in range(3):
        assert all(torch.equal(x, y) for x, y in zip(grads_of(fn, q, k, v, cot), want))


def test_backward_rows_invariant_to_batch_composition():
    """dq rows (and the sequence's dk / dv) of a sequence alone, packed with others and padded."""
    seqs = _sequences([600, 70, 1], hq=4, hkv=1, d=40, dtype=torch.float32, seed=90)
    cots = [randn(*s[0].shape, seed=91 + i) for i, s in enumerate(seqs)]
    fn = lambda q, k, v: rl_kernels.attention(q, k, v)  # noqa: E731
    alone = [grads_of(fn, *s, c) for s, c in zip(seqs, cots)]
    order = [2, 0, 1]
    q, k, v, cu = pack_sequences([seqs[i] for i in order])
    cot = torch.cat([cots[i][0] for i in order])
    packed = grads_of(lambda q, k, v: rl_kernels.attention(q, k, v, cu_seqlens_q=cu,
                                                           cu_seqlens_k=cu), q, k, v, cot)
    for slot, i in enumerate(order):
        s, e = int(cu[slot]), int(cu[slot + 1])
        for name, x, y in zip(("out", "dq", "dk", "dv"), packed, alone[i]):
            assert torch.equal(x[s:e], y[0]), f"{name} of sequence {i}"
    # sequence 0 left-padded in a batch of 2 with sequence 1 (NaN in the padding)
    t = 640
    pads = [torch.full((2, t) + x.shape[2:], float("nan")) for x in seqs[0]]
    pad_cot = torch.zeros(2, t, 4, 40)
    for b, (s, n) in enumerate(((40, 600), (0, 70))):
        for dst, src in zip(pads, seqs[b]):
            dst[b, s:s + n] = src[0]
        pad_cot[b, s:s + n] = cots[b][0]
    start, length = i32([40, 0]), i32([600, 70])
    padded = grads_of(lambda q, k, v: rl_kernels.attention(q, k, v, q_start=start, q_len=length,
                                                           k_start=start, k_len=length),
                      *pads, pad_cot)
    for name, x, y in zip(("out", "dq", "dk", "dv"), padded, alone[0]):
        assert torch.equal(x[0, 40:], y[0]), f"{name} of the left-padded sequence"
        assert torch.equal(x[0, :40], torch.zeros_like(x[0, :40])), f"{name} padding"
    for name, x, y in zip(("out", "dq", "dk", "dv"), padded, alone[1]):
        assert torch.equal(x[1, :70], y[0]), f"{name} of the right-padded sequence"


def test_kvcache_append_with_batch_and_chunk_bitwise():
    """Batch of 3 caches at different lengths, a 5-token chunk appended to each: rows equal each
    sequence's prefill; cache_seqlens is not updated; the cache holds the new keys."""
    seqs = _sequences([200, 65, 520], hq=4, hkv=2, d=64, seed=100)
    full = [rl_kernels.attention(*s) for s in seqs]
    before = [195, 60, 515]
    k_cache = torch.full((3, 600, 2, 64), float("nan"), dtype=torch.bfloat16)
    v_cache = k_cache.clone()
    for b, n in enumerate(before):
        k_cache[b, :n], v_cache[b, :n] = seqs[b][1][0, :n], seqs[b][2][0, :n]
    q = torch.stack([s[0][0, n:n + 5] for s, n in zip(seqs, before)])
    k_new = torch.stack([s[1][0, n:n + 5] for s, n in zip(seqs, before)])
    v_new = torch.stack([s[2][0, n:n + 5] for s, n in zip(seqs, before)])
    seqlens = i32(before)
    out = rl_kernels.attention_with_kvcache(q, k_cache, v_cache, seqlens, k_new=k_new, v_new=v_new)
    assert torch.equal(seqlens, i32(before))
    for b, n in enumerate(before):
        assert torch.equal(out[b], full[b][0, n:n + 5]), f"sequence {b}"
        assert torch.equal(k_cache[b, n:n + 5], k_new[b]) and torch.equal(v_cache[b, n:n + 5], v_new[b])
        assert torch.isnan(k_cache[b, n + 5:]).all()


# --------------------------------------------------------------------------------------------
# Absent ranges (None) and rows written by the kernels (out / lse not pre-filled)
# --------------------------------------------------------------------------------------------

def _op_grads(ranges, q, k, v, max_q, max_k, causal, cot):
    """out, lse, dq, dk, dv of the registered op (through autograd) with the given four ranges."""
    q, k, v = leaves(q, k, v)
    out, lse = torch.ops.rl_kernels.attention(q, k, v, *ranges, max_q, max_k, causal, 0.3, "auto")
    out.backward(cot)
    return out.detach(), lse, q.grad, k.grad, v.grad


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("short", [False, True])  # max_q_len / max_k_len below the rows
def test_none_ranges_bitwise_equal_explicit_ranges(causal, packed, short):
    """Each of the 16 subsets of (q_start, q_len, k_start, k_len) given as None equals the call with
    those ranges spelled out (starts 0, lengths max_q_len / max_k_len): out, lse, dq, dk, dv bitwise.
    Packed [T, H, d] tensors with no range at all are one sequence."""
    b = 1 if packed else 3
    q, k, v = qkv(b, 70, 75, 4, 2, 16, seed=190)
    cot = randn(*q.shape, seed=191)
    if packed:
        q, k, v, cot = q[0], k[0], v[0], cot[0]
    max_q, max_k = (67, 70) if short else (70, 75)
    spelled = (i32([0] * b), i32([max_q] * b), i32([0] * b), i32([max_k] * b))
    want = _op_grads(spelled, q, k, v, max_q, max_k, causal, cot)
    if short:  # rows past max_q_len are outside every sequence: 0 / -inf, and the op keeps them so
        assert torch.equal(want[0][..., max_q:, :, :], torch.zeros_like(want[0][..., max_q:, :, :]))
        assert torch.isinf(want[1][..., max_q:]).all()
    for subset in range(16):
        ranges = tuple(None if subset >> i & 1 else r for i, r in enumerate(spelled))
        got = _op_grads(ranges, q, k, v, max_q, max_k, causal, cot)
        for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            assert torch.equal(x, y), f"{name} with ranges {[r is None for r in ranges]}"


def test_public_calls_without_ranges_equal_spelled_out_ranges():
    """attention() without ranges (no range tensors: None down to the kernels) and with q_len alone
    (q_start None) equal the call with every range given, forward, lse and gradients bitwise."""
    q, k, v = qkv(2, 40, 50, 4, 2, 16, seed=192)
    cot = randn(*q.shape, seed=193)
    zeros, tq, tk = i32([0, 0]), i32([40, 40]), i32([50, 50])

    def fn(**ranges):
        return lambda q, k, v: rl_kernels.attention(q, k, v, **ranges)

    want = grads_of(fn(q_start=zeros, q_len=tq, k_start=zeros, k_len=tk), q, k, v, cot)
    for ranges in ({}, {"q_len": tq}, {"k_len": tk}, {"q_len": tq, "k_start": zeros, "k_len": tk}):
        got = grads_of(fn(**ranges), q, k, v, cot)
        assert all(torch.equal(x, y) for x, y in zip(got, want)), f"ranges {sorted(ranges)}"
    lse = rl_kernels.attention(q, k, v, return_lse=True)[1]
    assert torch.equal(lse, rl_kernels.attention(q, k, v, q_len=tq, k_len=tk, return_lse=True)[1])


def test_max_seqlen_below_the_rows_without_ranges_is_still_refused():
    """No ranges means all T rows; a max_seqlen_q below T keeps that meaning (a q_len tensor of T,
    which the launcher refuses) rather than silently computing max_seqlen_q rows."""
    q, k, v = qkv(1, 10, 10, 2, 1, 8, seed=194)
    with pytest.raises(ValueError, match="q_start, q_len, k_start, k_len"):
        rl_kernels.attention(q, k, v, max_seqlen_q=9)
    with pytest.raises(ValueError, match="q_start, q_len, k_start, k_len"):
        rl_kernels.attention(q, k, v, max_seqlen_k=9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_uninitialized_out_and_lse_every_row_written(nan_allocations, dtype):
    """The no-range calls hand the kernels uninitialized out / lse: every row comes back written,
    rows that see no key (causal, more queries than keys) as exactly 0 / -inf, and bitwise equal
    to the zero-filled call with ranges spelled out."""
    q, k, v = qkv(2, 9, 5, 4, 2, 16, dtype, seed=195)  # rows 0 .. 3 see no key
    k_cache = torch.cat([k, torch.full_like(k, math.nan)], 1)  # stale NaN past the cache length
    v_cache = torch.cat([v, torch.full_like(v, math.nan)], 1)
    zeros, tq, tk = i32([0, 0]), i32([9, 9]), i32([5, 5])
    want, want_lse = rl_kernels.attention(q, k, v, q_start=zeros, q_len=tq, k_start=zeros, k_len=tk,
                                          return_lse=True)
    calls = {
        "attention": lambda: rl_kernels.attention(q, k, v, return_lse=True),
        "kvcache tensor": lambda: rl_kernels.attention_with_kvcache(q, k_cache, v_cache, tk,
                                                                    return_lse=True),
        "kvcache int": lambda: rl_kernels.attention_with_kvcache(q, k_cache, v_cache, 5,
                                                                 return_lse=True),
        "kvcache int, new keys": lambda: rl_kernels.attention_with_kvcache(
            q, k_cache.clone(), v_cache.clone(), 2, k_new=k[:, 2:], v_new=v[:, 2:], return_lse=True),
        "kvcache tensor, new keys": lambda: rl_kernels.attention_with_kvcache(
            q, k_cache.clone(), v_cache.clone(), i32([2, 2]), k_new=k[:, 2:], v_new=v[:, 2:],
            return_lse=True),
    }
    for name, call in calls.items():
        out, lse = call()
        assert not torch.isnan(out).any() and not torch.isnan(lse).any(), name
        assert torch.equal(out[:, :4], torch.zeros_like(out[:, :4])), f"{name}: rows without keys"
        assert torch.equal(lse[..., :4], torch.full_like(lse[..., :4], -math.inf)), name
        assert torch.equal(out, want) and torch.equal(lse, want_lse), name
    # a cache with nothing in it: every row sees no key
    out, lse = rl_kernels.attention_with_kvcache(q, k_cache, v_cache, 0, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all() and (lse < 0).all()


def test_decode_calls_build_no_range_or_filled_tensors(monkeypatch):
    """A decode step (tensor or int cache_seqlens, with or without new keys) and a call without
    ranges build no zeros / full tensors: no ranges, no pre-filled out or lse."""
    q, k, v = qkv(2, 1, 8, 4, 2, 16, seed=196)
    k_cache, v_cache = torch.cat([k, k], 1), torch.cat([v, v], 1)
    calls = [lambda: rl_kernels.attention_with_kvcache(q, k_cache, v_cache, i32([8, 5])),
             lambda: rl_kernels.attention_with_kvcache(q, k_cache, v_cache, 8),
             lambda: rl_kernels.attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), 7,
                                                       k_new=k[:, :1], v_new=v[:, :1]),
             lambda: rl_kernels.attention_with_kvcache(q, k_cache.clone(), v_cache.clone(),
                                                       i32([7, 3]), k_new=k[:, :1], v_new=v[:, :1]),
             lambda: rl_kernels.attention(q, k, v)]
    want = [call() for call in calls]

    def refuse(name):
        def factory(*args, **kwargs):
            raise AssertionError(f"torch.{name} in a call without ranges")
        return factory

    for name in ("zeros", "zeros_like", "full", "full_like"):
        monkeypatch.setattr(torch, name, refuse(name))
    for call, expected in zip(calls, want):
        assert torch.equal(call(), expected)


def test_int_cache_seqlens_equals_tensor_cache_seqlens():
    """An int cache_seqlens (no k_len tensor: every sequence has max_k_len keys; new keys land by
    slice copy) gives the bits of the same lengths as a tensor, and the same cache."""
    q, k, v = qkv(3, 4, 40, 4, 2, 16, torch.bfloat16, seed=197)
    for n, t_new in ((36, 0), (30, 4), (0, 4), (36, 4)):
        caches = [(torch.cat([k, k], 1), torch.cat([v, v], 1)) for _ in range(2)]
        new = dict(k_new=k[:, n:n + t_new], v_new=v[:, n:n + t_new]) if t_new else {}
        got = rl_kernels.attention_with_kvcache(q, *caches[0], n, return_lse=True, **new)
        want = rl_kernels.attention_with_kvcache(q, *caches[1], i32([n] * 3), return_lse=True, **new)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"{n} + {t_new}"
        assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@pytest.mark.parametrize("seqlens,new,match", [
    (9, 0, r"cache_seqlens 9 is outside the cache of 8 rows$"),
    (-1, 0, r"cache_seqlens -1 is outside the cache of 8 rows$"),
    (-1, 2, r"cache_seqlens -1 is outside the cache of 8 rows with 2 keys appended"),
    (7, 2, r"cache_seqlens 7 is outside the cache of 8 rows with 2 keys appended"),
    ([3, 9], 0, r"cache_seqlens overflow the cache of 8 rows \(largest cache_seqlens 9\)"),
    ([3, -2], 0, r"cache_seqlens must be >= 0"),
    ([6, 3], 3, r"cache_seqlens plus the 3 appended keys overflow the cache of 8 rows"),
])
def test_bad_cache_seqlens_still_raise_and_leave_the_cache(seqlens, new, match):
    """Out-of-range cache_seqlens, int or tensor, raise naming cache_seqlens before anything is
    written: the cache is left as it was."""
    q = randn(2, 1, 4, 16, seed=198)
    k_cache, v_cache = randn(2, 8, 2, 16, seed=199), randn(2, 8, 2, 16, seed=200)
    before = k_cache.clone(), v_cache.clone()
    kv_new = dict(k_new=randn(2, new, 2, 16, seed=201), v_new=randn(2, new, 2, 16, seed=202)) \
        if new else {}
    lengths = i32(seqlens) if isinstance(seqlens, list) else seqlens
    with pytest.raises(ValueError, match=match):
        rl_kernels.attention_with_kvcache(q, k_cache, v_cache, lengths, **kv_new)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_opcheck_and_compile_with_none_ranges():
    q, k, v = leaves(*qkv(2, 30, 35, 4, 2, 8, seed=203))
    for ranges in ((None, None, None, None), (None, i32([30, 20]), None, i32([35, 25]))):
        args = (q, k, v, *ranges, 30, 35, True, 0.3, "auto")
        torch.library.opcheck(torch.ops.rl_kernels.attention.default, args)
        with torch.no_grad():
            out, lse = torch.ops.rl_kernels.attention(*args)
        torch.library.opcheck(torch.ops.rl_kernels.attention_backward.default,
                              (q.detach(), k.detach(), v.detach(), out, lse,
                               randn(*out.shape, seed=204), *ranges, 30, 35, True, 0.3, "auto"))

    def loss(q, k, v):
        out, lse = rl_kernels.attention(q, k, v, return_lse=True)
        return (out * out).sum() + lse.clamp_min(-5).sum()

    compiled = torch.compile(loss, fullgraph=True, dynamic=True, backend="aot_eager")
    for t in (20, 33):
        q, k, v = leaves(*qkv(2, t, t + 3, 4, 2, 16, seed=t))
        got, want = compiled(q, k, v), loss(q, k, v)
        assert torch.equal(got, want)
        assert all(torch.equal(x, y) for x, y in zip(torch.autograd.grad(got, (q, k, v)),
                                                     torch.autograd.grad(want, (q, k, v))))


# --------------------------------------------------------------------------------------------
# torch.library, torch.compile, registry
# --------------------------------------------------------------------------------------------

def test_opcheck():
    q, k, v = leaves(*qkv(2, 70, 75, 4, 2, 8, seed=110))
    ranges = (i32([0, 3]), i32([70, 60]), i32([0, 5]), i32([75, 65]))
    args = (q, k, v, *ranges, 70, 75, True, 0.3, "auto")
    torch.library.opcheck(torch.ops.rl_kernels.attention.default, args)
    with torch.no_grad():
        out, lse = torch.ops.rl_kernels.attention(*args)
    torch.library.opcheck(torch.ops.rl_kernels.attention_backward.default,
                          (q.detach(), k.detach(), v.detach(), out, lse, randn(*out.shape, seed=1),
                           *ranges, 70, 75, True, 0.3, "auto"))
    # packed (3-D) tensors
    q, k, v = leaves(*(t[0] for t in qkv(1, 20, 30, 2, 1, 8, seed=111)))
    ranges = (i32([0, 5]), i32([5, 15]), i32([0, 10]), i32([10, 20]))
    torch.library.opcheck(torch.ops.rl_kernels.attention.default,
                          (q, k, v, *ranges, 15, 20, False, 0.5, "auto"))


def test_compile_fullgraph_forward_backward_equals_eager():
    def loss(q, k, v, q_len, k_len):
        out, lse = rl_kernels.attention(q, k, v, q_len=q_len, k_len=k_len, return_lse=True)
        return (out.float() * out.float()).sum() + lse.clamp_min(-5).sum()

    compiled = torch.compile(loss, fullgraph=True, dynamic=True, backend="aot_eager")
    for t in (70, 130):
        q, k, v = leaves(*qkv(2, t, t, 4, 2, 16, seed=t))
        q_len, k_len = i32([t, t - 3]), i32([t, t - 1])
        got, want = compiled(q, k, v, q_len, k_len), loss(q, k, v, q_len, k_len)
        assert torch.equal(got, want)
        assert all(torch.equal(x, y) for x, y in zip(torch.autograd.grad(got, (q, k, v)),
                                                     torch.autograd.grad(want, (q, k, v))))


def test_compile_fullgraph_packed_cu_seqlens():
    """The packed (varlen) form is what a trainer compiles. Fails today: _ranges_from_cu_seqlens
    calls cu_seqlens.tolist() for CPU tensors even when max_seqlen is given, which fullgraph
    cannot trace (data-dependent guard)."""
    def fn(q, k, v, cu):
        return rl_kernels.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=60,
                                    max_seqlen_k=60)

    q, k, v = leaves(*(t[0] for t in qkv(1, 100, 100, 2, 1, 16, seed=120)))
    cu = i32([0, 40, 100])
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    got, want = compiled(q, k, v, cu), fn(q, k, v, cu)
    assert torch.equal(got, want)
    cot = randn(*got.shape, seed=121)
    assert all(torch.equal(x, y) for x, y in zip(torch.autograd.grad(got, (q, k, v), cot),
                                                 torch.autograd.grad(want, (q, k, v), cot)))


def test_registry_op_and_last_kernel():
    q, k, v = qkv(1, 30, 30, 4, 2, 16, seed=130)
    op = rl_kernels.get_op("attention")
    assert isinstance(op, rl_kernels.AttentionOp)
    want = rl_kernels.attention(q, k, v, causal=False)
    assert torch.equal(op(q, k, v, causal=False), want)
    assert kernel_registry.last_kernel() == "attention_fwd_cpu"
    forced = rl_kernels.get_op("attention", backend="cpu")
    assert torch.equal(forced(q, k, v, causal=False), want)
    assert torch.equal(rl_kernels.attention(q, k, v, causal=False, backend="cpu"), want)
    assert kernel_registry.resolve_backend("attention", torch.device("cpu")) == "cpu"


def test_double_backward_raises():
    q, k, v = leaves(*qkv(1, 6, 6, 2, 1, 8, seed=140))
    out = rl_kernels.attention(q, k, v)
    (dq,) = torch.autograd.grad((out * randn(*out.shape, seed=141)).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="second-order"):
        dq.sum().backward()


# --------------------------------------------------------------------------------------------
# Bad arguments
# --------------------------------------------------------------------------------------------

def _bad(case):
    q, k, v = qkv(2, 5, 6, 4, 2, 16, seed=150)
    pq, pk, pv = q[0], k[0], v[0]  # packed 3-D
    cu_q, cu_k = i32([0, 2, 5]), i32([0, 3, 6])
    cache = torch.zeros(2, 8, 2, 16)
    new = torch.zeros(2, 2, 2, 16)
    a, kv = rl_kernels.attention, rl_kernels.attention_with_kvcache
    return {
        "heads": lambda: a(q, k[:, :, :1].expand(2, 6, 3, 16), v[:, :, :1].expand(2, 6, 3, 16)),
        "dtype": lambda: a(q, k.double(), v),
        "dtype_v": lambda: a(q, k, v.to(torch.bfloat16)),
        "int_dtype": lambda: a(q.long(), k.long(), v.long()),
        "not_tensor": lambda: a(q, k.tolist(), v),
        "kv_shape": lambda: a(q, k, v[:, :5]),
        "head_dim": lambda: a(q, k[..., :8], v[..., :8]),
        "ndim": lambda: a(pq, pk, pv),
        "mixed_ndim": lambda: a(q, pk, pv),
        "cu_dtype": lambda: a(pq, pk, pv, cu_seqlens_q=cu_q.long(), cu_seqlens_k=cu_k.long()),
        "cu_increasing": lambda: a(pq, pk, pv, cu_seqlens_q=i32([0, 4, 3]), cu_seqlens_k=cu_k),
        "cu_from_zero": lambda: a(pq, pk, pv, cu_seqlens_q=i32([1, 2, 5]), cu_seqlens_k=cu_k),
        "cu_range": lambda: a(pq, pk, pv, cu_seqlens_q=cu_q, cu_seqlens_k=i32([0, 3, 7])),
        "cu_pair": lambda: a(pq, pk, pv, cu_seqlens_q=cu_q),
        "cu_count": lambda: a(pq, pk, pv, cu_seqlens_q=cu_q, cu_seqlens_k=i32([0, 6])),
        "cu_max": lambda: a(pq, pk, pv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=2),
        "cu_4d": lambda: a(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k),
        "q_len_long": lambda: a(q, k, v, q_len=i32([5, 6])),
        "q_len_negative": lambda: a(q, k, v, q_len=i32([5, -1])),
        "k_range": lambda: a(q, k, v, k_start=i32([0, 2]), k_len=i32([6, 5])),
        "q_start_range": lambda: a(q, k, v, q_start=i32([1, 0]), q_len=i32([5, 5])),
        "len_dtype": lambda: a(q, k, v, q_len=torch.tensor([5, 5])),
        "len_shape": lambda: a(q, k, v, q_len=i32([5, 5, 5])),
        "start_alone": lambda: a(q, k, v, k_start=i32([0, 0])),
        "causal": lambda: a(q, k, v, causal=1),
        "return_lse": lambda: a(q, k, v, return_lse="yes"),
        "scale_str": lambda: a(q, k, v, softmax_scale="0.5"),
        "scale_inf": lambda: a(q, k, v, softmax_scale=math.inf),
        "scale_negative": lambda: a(q, k, v, softmax_scale=-0.5),
        "overflow": lambda: kv(q[:, :1], cache, cache.clone(), i32([3, 7]), k_new=new, v_new=new),
        "overflow_int": lambda: kv(q[:, :1], cache, cache.clone(), 7, k_new=new, v_new=new),
        "seqlens_dtype": lambda: kv(q[:, :1], cache, cache.clone(), torch.tensor([3, 3])),
        "seqlens_type": lambda: kv(q[:, :1], cache, cache.clone(), 3.0),
        "seqlens_past": lambda: kv(q[:, :1], cache, cache.clone(), i32([3, 9])),
        "new_pair": lambda: kv(q[:, :1], cache, cache.clone(), 3, k_new=new),
        "new_dtype": lambda: kv(q[:, :1], cache, cache.clone(), 3, k_new=new.double(), v_new=new),
        "cache_batch": lambda: kv(q[:, :1], cache[:1], cache[:1], 3),
        "kv_causal": lambda: kv(q[:, :1], cache, cache.clone(), 3, causal=None),
        "backend": lambda: a(q, k, v, backend="sm80"),
        "backend_name": lambda: a(q, k, v, backend="tpu"),
    }[case]


@pytest.mark.parametrize("case,exc,match", [
    ("heads", ValueError, r"q has 4 heads, not a multiple of k's 3"),
    ("dtype", TypeError, r"k is torch.float64 .* but q is torch.float32"),
    ("dtype_v", TypeError, r"v is torch.bfloat16"),
    ("int_dtype", TypeError, r"q has dtype torch.int64"),
    ("not_tensor", TypeError, r"k must be a torch.Tensor"),
    ("kv_shape", ValueError, r"k \(2, 6, 2, 16\) and v \(2, 5, 2, 16\) differ"),
    ("head_dim", ValueError, r"k has head dim 8, q 16"),
    ("ndim", ValueError, r"q must be \[B, T, H, d\]"),
    ("mixed_ndim", ValueError, r"q, k, v must all be"),
    ("cu_dtype", TypeError, r"cu_seqlens_q must be int32"),
    ("cu_increasing", ValueError, r"cu_seqlens_q must increase from 0"),
    ("cu_from_zero", ValueError, r"cu_seqlens_q must increase from 0"),
    ("cu_range", ValueError, r"cu_seqlens_k must increase from 0 to at most 6"),
    ("cu_pair", ValueError, r"give both cu_seqlens_q and cu_seqlens_k"),
    ("cu_count", ValueError, r"cu_seqlens_q has 2 sequences, cu_seqlens_k 1"),
    ("cu_max", ValueError, r"max_seqlen for cu_seqlens_q is 2, but a sequence has 3 rows"),
    ("cu_4d", ValueError, r"with cu_seqlens, q must be packed"),
    ("q_len_long", ValueError, r"q_start, q_len, k_start, k_len"),
    ("q_len_negative", ValueError, r"q_start, q_len, k_start, k_len"),
    ("k_range", ValueError, r"q_start, q_len, k_start, k_len"),
    ("q_start_range", ValueError, r"q_start, q_len, k_start, k_len"),
    ("len_dtype", TypeError, r"q_len must be int32"),
    ("len_shape", ValueError, r"q_len must be 1-D of length 2"),
    ("start_alone", ValueError, r"k_start needs k_len"),
    ("causal", TypeError, r"causal must be a bool, got int"),
    ("return_lse", TypeError, r"return_lse must be a bool"),
    ("scale_str", TypeError, r"softmax_scale must be a real number"),
    ("scale_inf", ValueError, r"softmax_scale must be finite"),
    ("scale_negative", ValueError, r"softmax_scale must be finite and >= 0"),
    ("overflow", ValueError, r"cache_seqlens plus the 2 appended keys overflow the cache of 8"),
    ("overflow_int", ValueError, r"cache_seqlens 7 is outside the cache of 8 rows with 2 keys"),
    ("seqlens_dtype", TypeError, r"cache_seqlens must be int32"),
    ("seqlens_type", TypeError, r"cache_seqlens must be an int or an int32 tensor"),
    ("seqlens_past", ValueError, r"cache_seqlens overflow the cache of 8 rows"),
    ("new_pair", ValueError, r"give both k_new and v_new"),
    ("new_dtype", ValueError, r"k_new must be \[B, Tn, Hkv, d\]"),
    ("cache_batch", ValueError, r"k_cache has batch 1, q 2"),
    ("kv_causal", TypeError, r"causal must be a bool"),
    ("backend", RuntimeError, r"backend 'sm80' runs on CUDA tensors"),
    ("backend_name", ValueError, r"unknown backend 'tpu'"),
])
def test_bad_arguments(case, exc, match):
    with pytest.raises(exc, match=match):
        _bad(case)()


def test_cache_overflow_leaves_the_cache_untouched():
    q = randn(2, 1, 4, 16, seed=160)
    k_cache, v_cache = randn(2, 8, 2, 16, seed=161), randn(2, 8, 2, 16, seed=162)
    before = k_cache.clone(), v_cache.clone()
    new = randn(2, 3, 2, 16, seed=163)
    with pytest.raises(ValueError, match="cache_seqlens"):
        rl_kernels.attention_with_kvcache(q, k_cache, v_cache, i32([0, 6]), k_new=new, v_new=new)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_negative_cache_seqlens_is_refused():
    """Fails today: cache_seqlens -1 with one new token gives k_len 0, so the range check passes;
    _append's position -1 wraps to the cache's last row (overwriting it) and out is silently 0."""
    q = randn(1, 1, 2, 16, seed=170)
    k_cache, v_cache = randn(1, 8, 1, 16, seed=171), randn(1, 8, 1, 16, seed=172)
    before = k_cache.clone()
    new = randn(1, 1, 1, 16, seed=173)
    with pytest.raises(ValueError, match="cache_seqlens"):
        rl_kernels.attention_with_kvcache(q, k_cache, v_cache, i32([-1]), k_new=new, v_new=new)
    assert torch.equal(k_cache, before)


def test_kvcache_append_lands_in_a_strided_cache():
    """Fails today: a cache whose head dim is not contiguous is copied by _check_qkv, and k_new /
    v_new are appended to that copy, so the caller's cache never receives them (the next decode
    step reads stale keys)."""
    q = randn(1, 1, 2, 16, seed=180)
    k_cache = torch.zeros(1, 1, 16, 8).permute(0, 3, 1, 2)  # [1, 8, 1, 16], head-dim stride 8
    v_cache = torch.zeros(1, 1, 16, 8).permute(0, 3, 1, 2)
    k_new, v_new = randn(1, 2, 1, 16, seed=181), randn(1, 2, 1, 16, seed=182)
    rl_kernels.attention_with_kvcache(q, k_cache, v_cache, 3, k_new=k_new, v_new=v_new)
    assert torch.equal(k_cache[:, 3:5], k_new) and torch.equal(v_cache[:, 3:5], v_new)
