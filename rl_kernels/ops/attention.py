"""attention: causal / full GQA attention whose rows are bitwise the same in training, prefill,
chunked prefill and KV-cache decode (contract and reasons: csrc/ops/attention.h,
docs/operators/attention.md).

Reads top-down: the public functions (flash-attention's conventions: [B, T, H, d] batches or packed
[total, H, d] with cu_seqlens; a KV cache [B, Tmax, Hkv, d] with cache_seqlens) -> per-sequence
ranges (q_start, q_len, k_start, k_len) -> the torch.library op ``rl_kernels::attention`` (fake
implementation, autograd through ``rl_kernels::attention_backward``) -> ``_C``.

A query row's output depends on its q, the keys/values at positions 0..p of its own sequence, the
head dim and the scale only: keys are reduced in blocks (64 keys; 128 on sm90) and segments of 512
aligned at each sequence's first real key, in increasing order, whatever the batch, the packing,
the padding, the chunking or the number of queries in the call. Positions count from each sequence's first real key
and causal masking is aligned bottom-right (query i of q_len sits at key position
k_len - q_len + i), as flash-attention does and as a KV-cache decode step needs.
"""

from __future__ import annotations

import math

import torch

from .. import _C
from .common import (LIBRARY, DeviceErrorFlag, backend_and_stream, backend_arg, check_tensor,
                     eager_direct, integer, real_number)

CUDA_HEAD_DIMS = (64, 128)
BAD_RANGE = DeviceErrorFlag("cu_seqlens / cache_seqlens: an earlier attention call on CUDA saw a "
                            "sequence range outside its tensors or a cache overflow; its rows were "
                            "not computed")


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------

def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
              softmax_scale: float | None = None, cu_seqlens_q: torch.Tensor | None = None,
              cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
              max_seqlen_k: int | None = None, q_start: torch.Tensor | None = None,
              q_len: torch.Tensor | None = None, k_start: torch.Tensor | None = None,
              k_len: torch.Tensor | None = None, return_lse: bool = False,
              backend: str | None = None):
    """softmax(q k^T * softmax_scale [causal mask]) v per query head; GQA when Hq is a multiple of
    Hkv (query head h reads key/value head h // (Hq // Hkv)).

    q [B, Tq, Hq, d], k and v [B, Tk, Hkv, d]: a batch of B sequences, all rows real unless
    q_start / q_len / k_start / k_len (int32 [B]) give each sequence's real rows (left or right
    padding: rows outside come back as 0). Or packed: q [total_q, Hq, d], k and v [total_k, Hkv, d]
    with cu_seqlens_q / cu_seqlens_k (int32 [n + 1], increasing from 0). softmax_scale defaults to
    1 / sqrt(d). Returns out like q and, with return_lse, the log-sum-exp in fp32 ([B, Hq, Tq], or
    [Hq, total_q] packed). bf16 / fp16 (head dims 64 and 128 on CUDA), also fp32 / fp64 on CPU.
    Differentiable in q, k and v."""
    q, k, v = _check_qkv("attention", q, k, v)
    scale = _scale("attention", softmax_scale, q.shape[-1])
    causal = _check_bool("attention", "causal", causal)
    return_lse = _check_bool("attention", "return_lse", return_lse)
    backend = backend_arg("attention", backend)
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    if packed:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("attention(): give both cu_seqlens_q and cu_seqlens_k (or neither)")
        if any(x is not None for x in (q_start, q_len, k_start, k_len)):
            raise ValueError("attention(): q_start / q_len / k_start / k_len describe a padded "
                             "[B, T, H, d] batch; with cu_seqlens the ranges come from cu_seqlens")
        if q.dim() != 3:
            raise ValueError(f"attention(): with cu_seqlens, q must be packed [total, H, d], got "
                             f"{q.dim()}-D")
        q_start, q_len, max_seqlen_q = _ranges_from_cu_seqlens(
            "cu_seqlens_q", cu_seqlens_q, q.shape[0], _max_seqlen("max_seqlen_q", max_seqlen_q, q.shape[0]),
            q.device)
        k_start, k_len, max_seqlen_k = _ranges_from_cu_seqlens(
            "cu_seqlens_k", cu_seqlens_k, k.shape[0], _max_seqlen("max_seqlen_k", max_seqlen_k, k.shape[0]),
            q.device)
        if q_len.shape != k_len.shape:
            raise ValueError(f"attention(): cu_seqlens_q has {q_len.shape[0]} sequences, "
                             f"cu_seqlens_k {k_len.shape[0]}")
    else:
        if q.dim() != 4:
            raise ValueError(f"attention(): q must be [B, T, H, d] (or packed [total, H, d] with "
                             f"cu_seqlens), got {q.dim()}-D")
        batch = q.shape[0]
        max_seqlen_q = q.shape[1] if max_seqlen_q is None else _max_seqlen("max_seqlen_q", max_seqlen_q,
                                                                           q.shape[1])
        max_seqlen_k = k.shape[1] if max_seqlen_k is None else _max_seqlen("max_seqlen_k", max_seqlen_k,
                                                                           k.shape[1])
        q_start, q_len = _ranges("q", q_start, q_len, batch, q.shape[1], max_seqlen_q, q.device)
        k_start, k_len = _ranges("k", k_start, k_len, batch, k.shape[1], max_seqlen_k, q.device)
    args = (q, k, v, q_start, q_len, k_start, k_len, max_seqlen_q, max_seqlen_k, causal, scale,
            backend)
    if eager_direct(q, k, v):
        out, lse = _forward_impl(*args)
    else:
        out, lse = torch.ops.rl_kernels.attention(*args)
    return (out, lse) if return_lse else out


def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           cache_seqlens, *, k_new: torch.Tensor | None = None,
                           v_new: torch.Tensor | None = None, causal: bool = True,
                           softmax_scale: float | None = None, return_lse: bool = False,
                           backend: str | None = None):
    """Decode and chunked prefill against a contiguous KV cache, as flash_attn_with_kvcache.

    q [B, Tq, Hq, d]; k_cache, v_cache [B, Tmax, Hkv, d]; cache_seqlens: int32 [B] (or an int)
    keys already cached per sequence. k_new / v_new [B, Tn, Hkv, d], if given, are first written into
    the cache at positions cache_seqlens .. cache_seqlens + Tn - 1 (in place; cache_seqlens is not
    updated). Then each sequence's Tq queries attend to its cache_seqlens (+ Tn) keys, the queries
    being the last Tq positions (causal: aligned bottom-right). Not differentiable."""
    q, k, v = _check_qkv("attention_with_kvcache", q, k_cache, v_cache)  # k, v: head dim contiguous
    if q.dim() != 4:
        raise ValueError(f"attention_with_kvcache(): q must be [B, T, H, d], got {q.dim()}-D")
    batch, t_max = q.shape[0], k_cache.shape[1]
    if k_cache.shape[0] != batch:
        raise ValueError(f"attention_with_kvcache(): k_cache has batch {k_cache.shape[0]}, q {batch}")
    scale = _scale("attention_with_kvcache", softmax_scale, q.shape[-1])
    causal = _check_bool("attention_with_kvcache", "causal", causal)
    return_lse = _check_bool("attention_with_kvcache", "return_lse", return_lse)
    backend = backend_arg("attention_with_kvcache", backend)
    cached = _cache_seqlens(cache_seqlens, batch, q.device)
    if (k_new is None) != (v_new is None):
        raise ValueError("attention_with_kvcache(): give both k_new and v_new (or neither)")
    t_new = 0
    if k_new is not None:
        for name, new in (("k_new", k_new), ("v_new", v_new)):
            check_tensor("attention_with_kvcache", name, new)
            if new.dim() != 4 or new.shape[0] != batch or new.shape[2:] != k_cache.shape[2:] \
                    or new.dtype != k_cache.dtype or new.device != k_cache.device:
                raise ValueError(f"attention_with_kvcache(): {name} must be [B, Tn, Hkv, d] like the "
                                 f"cache ({k_cache.dtype}), got {tuple(new.shape)} {new.dtype}")
        if k_new.shape != v_new.shape:
            raise ValueError("attention_with_kvcache(): k_new and v_new differ in shape")
        t_new = k_new.shape[1]
        # what _forward_impl would refuse the call for, checked before the cache is written: a
        # backend that cannot run on q's device, an earlier call's bad range
        backend_and_stream("attention", q.device, backend)
        BAD_RANGE.raise_if_set()
    if type(cached) is int:
        if not 0 <= cached <= t_max - t_new:
            raise ValueError(f"attention_with_kvcache(): cache_seqlens {cached} is outside the cache "
                             f"of {t_max} rows" + (f" with {t_new} keys appended" if t_new else ""))
        # every sequence has the same keys: no k_len tensor (None: max_k_len keys each), and the
        # new keys land in one slice of the cache
        k_len, max_k_len = None, cached + t_new
        if t_new:
            k_cache[:, cached:cached + t_new] = k_new
            v_cache[:, cached:cached + t_new] = v_new
    else:
        k_len, max_k_len = (cached + t_new if t_new else cached), t_max  # (no add without new keys)
        if not cached.is_cuda:  # free to check here; on CUDA the kernels flag a bad range (no sync)
            if batch and int(cached.min()) < 0:
                raise ValueError(f"attention_with_kvcache(): cache_seqlens must be >= 0, got "
                                 f"{cached.tolist()[:8]}")
            if batch and int(k_len.max()) > t_max:
                raise ValueError(f"attention_with_kvcache(): cache_seqlens " +
                                 (f"plus the {t_new} appended keys " if t_new else "") +
                                 f"overflow the cache of {t_max} rows (largest cache_seqlens "
                                 f"{int(cached.max())})")
        elif t_new:  # a negative start could hide in cached + t_new: give such a sequence k_len -1
            k_len = torch.where(cached < 0, -1, k_len)  # (past t_max the kernels see it themselves)
        # (without appended keys k_len is cached itself, which the kernels check against [0, t_max])
        if t_new:
            _append(k_cache, v_cache, k_new, v_new, cached)  # into the caller's cache, any strides
    if t_new and (k is not k_cache or v is not v_cache):  # the kernels read a head-dim-contiguous copy
        k, v = k_cache.contiguous(), v_cache.contiguous()
    # the queries are all of q's rows and the keys start at row 0: no range tensors (None)
    out, lse = _forward_impl(q, k, v, None, None, None, k_len, q.shape[1], max_k_len, causal, scale,
                             backend)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------------------------
# Argument handling
# --------------------------------------------------------------------------------------------

_QKV_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _check_qkv(op, q, k, v):
    # (q's dtype, device and dim read once: this runs on every call, each attribute costs ~0.1 us)
    dtype = device = ndim = None
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(op, name, t)
        t_dtype, t_device, t_ndim = t.dtype, t.device, t.dim()
        if t_dtype not in _QKV_DTYPES:
            raise TypeError(f"{op}(): {name} has dtype {t_dtype}; expected bfloat16 or float16 "
                            f"(float32 / float64 on the CPU)")
        if dtype is None:
            dtype, device, ndim = t_dtype, t_device, t_ndim
        elif t_dtype != dtype or t_device != device:
            raise TypeError(f"{op}(): {name} is {t_dtype} on {t_device} but q is {dtype} on "
                            f"{device}")
        if t_ndim != ndim or t_ndim not in (3, 4):
            raise ValueError(f"{op}(): q, k, v must all be [B, T, H, d] or all packed [T, H, d]; "
                             f"got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D")
    k_shape = k.shape
    if k_shape != v.shape:
        raise ValueError(f"{op}(): k {tuple(k_shape)} and v {tuple(v.shape)} differ")
    d, heads_q, heads_kv = q.shape[-1], q.shape[-2], k_shape[-2]
    if k_shape[-1] != d:
        raise ValueError(f"{op}(): k has head dim {k_shape[-1]}, q {d}")
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"{op}(): q has {heads_q} heads, not a multiple of k's {heads_kv} (GQA)")
    if q.is_cuda:
        if d not in CUDA_HEAD_DIMS:
            raise ValueError(f"{op}(): head dim {d} is not supported on CUDA (64 or 128; CPU "
                             f"tensors take any)")
        if dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"{op}(): CUDA attention takes bfloat16 or float16, got {dtype}")
    return _head_dim_contiguous(q), _head_dim_contiguous(k), _head_dim_contiguous(v)


def _head_dim_contiguous(t):
    """t, or a contiguous copy when its head dim is strided: the head dim must be contiguous;
    everything else may be strided. (stride()[-1] first: a tuple read is the cheapest test, and
    this runs on every call.)"""
    return t.contiguous() if t.stride()[-1] != 1 and t.shape[-1] > 1 else t


def _aligned_rows(t):
    """t, or a contiguous copy when it is a CUDA tensor whose rows are not 16-byte aligned: CUDA
    operands are presented with aligned rows (as the binding presents GEMM operands), so a view's
    offset never decides whether a kernel can take it. Runs inside the op (real tensors)."""
    misaligned = t.is_cuda and (t.data_ptr() % 16 != 0 or any(
        s * t.element_size() % 16 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1))
    return t.contiguous() if misaligned else t


def _check_bool(op, name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{op}(): {name} must be a bool, got {type(value).__name__}")
    return value


def _scale(op, softmax_scale, d):
    if softmax_scale is None:
        return 1.0 / math.sqrt(d) if d > 0 else 1.0  # (no head dim: every score is 0 at any scale)
    scale = real_number(op, "softmax_scale", softmax_scale)
    if not math.isfinite(scale) or scale < 0:
        # the contract's running max is of the raw scores: the max of the scaled ones for scale >= 0
        raise ValueError(f"{op}(): softmax_scale must be finite and >= 0, got {scale}")
    return scale


def _max_seqlen(name, value, rows):
    """max_seqlen_q / max_seqlen_k checked: an int in [0, rows] (the rows of the q or k storage); None
    stays None (the caller computes it)."""
    if value is None or isinstance(value, torch.SymInt):
        return value
    value = integer("attention", name, value)
    if not 0 <= value <= rows:
        raise ValueError(f"attention(): {name} is {value}, outside [0, {rows}] (the rows of "
                         f"{name[-1]})")
    return value


def _int32_vector(name, t, length, device, op="attention"):
    check_tensor(op, name, t)
    if t.dtype != torch.int32:
        raise TypeError(f"{op}(): {name} must be int32 (as flash-attention's), got {t.dtype}")
    if t.dim() != 1 or (length is not None and t.shape[0] != length):
        raise ValueError(f"{op}(): {name} must be 1-D" +
                         (f" of length {length}" if length is not None else "") +
                         f", got shape {tuple(t.shape)}")
    return t.to(device).contiguous()


def _ranges_from_cu_seqlens(name, cu, rows, max_len, device):
    """(start, len, max_len) of packed sequences. cu_seqlens is read and checked on the host when
    that costs nothing (CPU, eager) or when max_len must be computed from it; otherwise (CUDA with
    max_len, or under torch.compile) it is not read: the launchers check every range (the CPU one
    raises, CUDA kernels flag it for the next call)."""
    cu = _int32_vector(name, cu, None, device)
    if cu.shape[0] < 1:
        raise ValueError(f"attention(): {name} needs at least one entry (0)")
    start, length = cu[:-1], cu[1:] - cu[:-1]
    if max_len is None or (not cu.is_cuda and not torch.compiler.is_compiling()):
        values = cu.tolist()
        if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])) or values[-1] > rows:
            raise ValueError(f"attention(): {name} must increase from 0 to at most {rows} (the "
                             f"packed rows); got {values[:8]}{' ...' if len(values) > 8 else ''}")
        longest = max((b - a for a, b in zip(values, values[1:])), default=0)
        max_len = longest if max_len is None else max_len
        if max_len < longest:
            raise ValueError(f"attention(): max_seqlen for {name} is {max_len}, but a sequence has "
                             f"{longest} rows")
    return start, length, max_len


def _ranges(which, start, length, batch, rows, max_len, device):
    """Per-sequence (start, len) of a [B, T, H, d] batch: all T rows, or the given ones. None stands
    for start 0 and len max_len (csrc/ops/attention.h), so that a batch without padding builds no
    tensors; all T rows with another max_len keep a len tensor (the launchers refuse it)."""
    if start is None and length is None:
        if max_len == rows:
            return None, None
        return None, torch.full((batch,), rows, dtype=torch.int32, device=device)
    if length is None:
        raise ValueError(f"attention(): {which}_start needs {which}_len")
    length = _int32_vector(f"{which}_len", length, batch, device)
    if start is not None:
        start = _int32_vector(f"{which}_start", start, batch, device)
    return start, length


def _cache_seqlens(cache_seqlens, batch, device):
    """cache_seqlens checked: an int as an int, a tensor as an int32 [batch] on device."""
    if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, torch.Tensor)):
        raise TypeError(f"attention_with_kvcache(): cache_seqlens must be an int or an int32 tensor, "
                        f"got {type(cache_seqlens).__name__}")
    if isinstance(cache_seqlens, int):
        return int(cache_seqlens)  # (its range is checked against the cache by the caller)
    return _int32_vector("cache_seqlens", cache_seqlens, batch, device, "attention_with_kvcache")


def _append(k_cache, v_cache, k_new, v_new, cached):
    """k_cache[b, cached[b] + j] = k_new[b, j] (v likewise), in one indexed copy per tensor. Positions
    outside the cache are clamped into it: such a call is refused (CPU at once, CUDA through the
    kernels' flag), and clamping keeps the copy itself in bounds."""
    batch, t_new = k_new.shape[:2]
    t_max = k_cache.shape[1]
    # int32 cached + the int64 arange is computed in int64: no overflow before the clamp
    positions = (cached[:, None] + torch.arange(t_new, device=cached.device)).clamp_(0, t_max - 1)
    rows = torch.arange(batch, device=cached.device)[:, None].expand(batch, t_new)
    k_cache[rows, positions] = k_new
    v_cache[rows, positions] = v_new


# --------------------------------------------------------------------------------------------
# torch.library ops and autograd
# --------------------------------------------------------------------------------------------

# q_start / q_len / k_start / k_len: None means start 0 / len max_q_len or max_k_len for every
# sequence (csrc/ops/attention.h), which spares a call the small tensors of ranges it does not have
LIBRARY.define(
    "attention(Tensor q, Tensor k, Tensor v, Tensor? q_start, Tensor? q_len, Tensor? k_start, "
    "Tensor? k_len, int max_q_len, int max_k_len, bool causal, float softmax_scale, str backend) "
    "-> (Tensor, Tensor)")
LIBRARY.define(
    "attention_backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dout, "
    "Tensor? q_start, Tensor? q_len, Tensor? k_start, Tensor? k_len, int max_q_len, int max_k_len, "
    "bool causal, float softmax_scale, str backend) -> (Tensor, Tensor, Tensor)")


def _new_like(t, zeros=False):
    """A new tensor of t's shape, dtype and device for an output or gradient of t: in t's layout
    (empty_like), unless that leaves the head dim strided, which the kernels cannot write (empty_like
    orders the dims of an overlapping view, an expanded k, say, by their strides): then contiguous."""
    new = torch.empty_like(t)
    if new.stride()[-1] != 1 and new.shape[-1] > 1:
        new = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return new.zero_() if zeros else new


def _lse_shape(q):
    return (q.shape[0], q.shape[2], q.shape[1]) if q.dim() == 4 else (q.shape[1], q.shape[0])


def _forward_impl(q, k, v, q_start, q_len, k_start, k_len, max_q_len, max_k_len, causal, scale,
                  backend):
    BAD_RANGE.raise_if_set()
    code, stream = backend_and_stream("attention", q.device, backend)
    q, k, v = _aligned_rows(q), _aligned_rows(k), _aligned_rows(v)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if q_start is None and q_len is None and max_q_len == q.shape[-3]:
        # the sequences cover every row, and the launchers write every row of a sequence (one
        # whose key range is out of bounds included, csrc/ops/attention.h): nothing to fill
        out = _new_like(q)
        lse = torch.empty(_lse_shape(q), device=q.device, dtype=lse_dtype)
    else:  # rows outside the sequences stay 0 / -inf
        out = _new_like(q, zeros=True)
        lse = torch.full(_lse_shape(q), -math.inf, device=q.device, dtype=lse_dtype)
    _C.attention_fwd(q, k, v, out, lse, q_start, q_len, k_start, k_len, max_q_len, max_k_len,
                     causal, scale, BAD_RANGE.address(q.device), code, stream)
    return out, lse


def _backward_impl(q, k, v, out, lse, dout, q_start, q_len, k_start, k_len, max_q_len, max_k_len,
                   causal, scale, backend):
    BAD_RANGE.raise_if_set()
    code, stream = backend_and_stream("attention", q.device, backend)
    q, k, v, out, dout = (_aligned_rows(x) for x in (q, k, v, out, dout))
    dq, dk, dv = _new_like(q, zeros=True), _new_like(k, zeros=True), _new_like(v, zeros=True)
    _C.attention_bwd(q, k, v, out, lse, dout, dq, dk, dv, q_start, q_len, k_start, k_len,
                     max_q_len, max_k_len, causal, scale, BAD_RANGE.address(q.device), code, stream)
    return dq, dk, dv


for _key in ("CPU", "CUDA"):
    LIBRARY.impl("attention", _forward_impl, _key)
    LIBRARY.impl("attention_backward", _backward_impl, _key)


@torch.library.register_fake("rl_kernels::attention")
def _forward_fake(q, k, v, q_start, q_len, k_start, k_len, max_q_len, max_k_len, causal, scale,
                  backend):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return _new_like(q), q.new_empty(_lse_shape(q), dtype=lse_dtype)


@torch.library.register_fake("rl_kernels::attention_backward")
def _backward_fake(q, k, v, out, lse, dout, q_start, q_len, k_start, k_len, max_q_len, max_k_len,
                   causal, scale, backend):
    return _new_like(q), _new_like(k), _new_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, q_start, q_len, k_start, k_len, max_q_len, max_k_len, causal, scale, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, q_start, q_len, k_start, k_len)
    ctx.options = (max_q_len, max_k_len, causal, scale, backend)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, q_start, q_len, k_start, k_len = ctx.saved_tensors
    dq, dk, dv = torch.ops.rl_kernels.attention_backward(
        q, k, v, out, lse, grad_out.contiguous(), q_start, q_len, k_start, k_len, *ctx.options)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


torch.library.register_autograd("rl_kernels::attention", _backward, setup_context=_setup_context)


def _double_backward(ctx, *grads):
    raise RuntimeError("attention: second-order gradients (a backward through its gradient, "
                       "create_graph=True) are not implemented")


torch.library.register_autograd("rl_kernels::attention_backward", _double_backward,
                                setup_context=lambda ctx, inputs, output: None)
