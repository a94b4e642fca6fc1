"""Batch-invariant mode: torch's own ops (mm, softmax, mean, sdpa, ...) on rl_kernels' kernels.

    with rl_kernels.batch_invariant():
        logits = model(input_ids).logits       # every GEMM, softmax, row reduction, RMSNorm and
                                               # attention of the model runs on rl_kernels

While the mode is on, aten kernels registered with ``torch.library.Library("aten", "IMPL")`` take
the calls of the ops in ``covered_ops()`` on CPU and CUDA tensors and run them on rl_kernels, whose
results for one row do not depend on the rows around it (the batch size, the position in the batch,
padding, chunking). Leaving the mode destroys that library: the dispatcher's previous kernels come
back exactly (the registrations are a stack per dispatch key; nothing is copied or wrapped).

Covered (docs/operators/batch_invariant.md has the table and the reasons):
  * mm, addmm, bmm, baddbmm, mv -> the rl_kernels GEMM (torch.matmul, F.linear and nn.Linear reach
    these through their decompositions; transposed weights are read in place, no copy);
  * _softmax, _log_softmax and their backward ops -> rl_kernels softmax over any dim;
  * sum.dim_IntList, mean.dim -> rl_kernels row sums. The reduced dims are moved last (a copy when
    they are not already last), so each output element is summed in an order fixed by the reduced
    extent alone, whatever the other dims are. Full reductions (no dim, or every dim) are left to
    torch: they have no rows to keep apart, and one long row would be slow on a GPU;
  * rms_norm (and _fused_rms_norm / _fused_rms_norm_backward on CUDA) -> rl_kernels.rms_norm;
  * scaled_dot_product_attention without attn_mask and dropout (is_causal with as many queries as
    keys, or non-causal; GQA; scale) -> rl_kernels.attention.
Everything else, and every covered op called with a dtype, device or argument the kernels do not
take (integer matmuls, fp64 on CUDA, an sdpa attn_mask, empty tensors ...), runs torch's original
kernel, unchanged. ``rl_kernels.strict()`` names such calls.

The mode is process-wide (all threads) and re-entrant: nested blocks and ``batch_invariant(False)``
inside an enabled block work as expected, and blocks open in several threads at once stay on until
the last one closes (blocks that ask for opposite states at once raise RuntimeError). Turning the
mode on or off registers or destroys aten kernels, which torch does not guard against calls running
in other threads at that moment: a program whose threads run torch ops while another enters or leaves
the mode can crash. Such a program turns it on once (``enable_batch_invariant()``) before its
threads start.
Not supported: torch.compile of code that relies on the mode (Inductor generates its own
reductions and GEMM calls; the compiled graph also keeps whatever the mode was when it was traced).
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings

import torch

from .ops import attention as _attention_mod
from .ops import row_ops as _row_ops
from .ops.gemm import gemm_scalar, launch_gemm

__all__ = ["batch_invariant", "enable_batch_invariant", "disable_batch_invariant",
           "is_batch_invariant", "covered_ops", "covers"]

_CPU_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16, torch.float64))
_CUDA_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16))
_HALF = frozenset((torch.bfloat16, torch.float16))
_strided = torch.strided


def _ok(t) -> bool:
    """A dense tensor of a dtype the rl_kernels kernels take on its device."""
    if t.layout is not _strided:
        return False
    if t.is_cpu:
        return t.dtype in _CPU_DTYPES
    return t.is_cuda and t.dtype in _CUDA_DTYPES


# --------------------------------------------------------------------------------------------
# GEMMs
# --------------------------------------------------------------------------------------------

def _mm_ok(a, b):
    return (a.dim() == 2 and b.dim() == 2 and a.dtype is b.dtype and _ok(a) and _ok(b)
            and a.device == b.device and a.shape[1] == b.shape[0] and a.shape[0] > 0
            and b.shape[1] > 0)


def _mm(a, b):
    return launch_gemm(a, b, None, None, 1.0, 0.0, None, a.dtype)


def _real(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _scalars_ok(dtype, *scalars):
    """alpha and beta finite and, for 16- and 32-bit operands, within fp32's range (torch refuses a
    larger one: the fallback raises its error)."""
    for x in scalars:
        if not _real(x):
            return False
        try:
            gemm_scalar("addmm", "alpha", x, dtype)
        except ValueError:
            return False
    return True


def _addmm_ok(c, a, b, beta=1, alpha=1):
    return (_mm_ok(a, b) and c.dtype is a.dtype and _ok(c) and c.device == a.device
            and c.dim() <= 2 and _scalars_ok(a.dtype, beta, alpha)
            and _broadcasts(c.shape, (a.shape[0], b.shape[1])))


def _broadcasts(shape, target):
    if len(shape) > len(target):
        return False
    for s, t in zip(reversed(shape), reversed(target)):
        if s != t and s != 1:
            return False
    return True


def _addmm(c, a, b, beta=1, alpha=1):
    m, n = a.shape[0], b.shape[1]
    if beta == 0:
        c = None
    elif not (c.dim() >= 1 and c.shape[-1] == n and (c.dim() == 1 or c.shape[0] in (1, m))):
        c = c.expand(m, n).contiguous()  # a column or a scalar: materialized
    elif n > 1 and c.stride(-1) != 1:
        c = c.contiguous()
    return launch_gemm(a, b, c, None, float(alpha), float(beta), None, a.dtype)


def _bmm_ok(a, b):
    return (a.dim() == 3 and b.dim() == 3 and a.dtype is b.dtype and _ok(a) and _ok(b)
            and a.device == b.device and a.shape[0] == b.shape[0] and a.shape[2] == b.shape[1]
            and a.shape[0] > 0 and a.shape[1] > 0 and b.shape[2] > 0)


def _bmm(a, b):
    return launch_gemm(a, b, None, None, 1.0, 0.0, None, a.dtype)


def _baddbmm_ok(c, a, b, beta=1, alpha=1):
    return (_bmm_ok(a, b) and c.dtype is a.dtype and _ok(c) and c.device == a.device
            and _scalars_ok(a.dtype, beta, alpha)
            and _broadcasts(c.shape, (a.shape[0], a.shape[1], b.shape[2])))


def _baddbmm(c, a, b, beta=1, alpha=1):
    batch, m, n = a.shape[0], a.shape[1], b.shape[2]
    if beta == 0:
        c = None
    else:
        while c.dim() < 3:
            c = c.unsqueeze(0)
        if not (c.shape[2] == n and c.shape[1] in (1, m) and c.shape[0] in (1, batch)):
            c = c.expand(batch, m, n).contiguous()
        elif n > 1 and c.stride(-1) != 1:
            c = c.contiguous()
    return launch_gemm(a, b, c, None, float(alpha), float(beta), None, a.dtype)


def _mv_ok(a, v):
    return (a.dim() == 2 and v.dim() == 1 and a.dtype is v.dtype and _ok(a) and _ok(v)
            and a.device == v.device and a.shape[1] == v.shape[0] and a.shape[0] > 0)


def _mv(a, v):
    return launch_gemm(a, v.unsqueeze(1), None, None, 1.0, 0.0, None, a.dtype).squeeze(1)


# --------------------------------------------------------------------------------------------
# softmax / log_softmax and their backward
# --------------------------------------------------------------------------------------------

def _softmax_ok(x, dim, half_to_float):
    if not (_ok(x) and x.dim() > 0 and x.numel() > 0 and -x.dim() <= dim < x.dim()):
        return False
    return not half_to_float or (x.dtype in _HALF and x.is_cuda)  # (torch: not on the CPU)


def _to_rows(x, dim):
    """x with `dim` moved last, as contiguous [rows, cols], and the moved shape."""
    moved = x if dim in (-1, x.dim() - 1) else x.movedim(dim, -1)
    rows = moved.reshape(-1, moved.shape[-1])
    if (rows.shape[1] > 1 and rows.stride(1) != 1) or (rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]):
        rows = rows.contiguous()
    return rows, moved.shape


def _from_rows(y, moved_shape, dim, ndim):
    y = y.view(moved_shape)
    if dim in (-1, ndim - 1):
        return y
    return y.movedim(-1, dim).contiguous()  # torch's softmax returns a contiguous tensor


def _softmax_any(x, dim, half_to_float, log):
    rows, shape = _to_rows(x, dim)
    out_dtype = torch.float32 if half_to_float else x.dtype
    y = _row_ops._softmax_impl(rows, out_dtype, log, "auto")
    return _from_rows(y, shape, dim, x.dim())


def _softmax(x, dim, half_to_float):
    return _softmax_any(x, dim, half_to_float, False)


def _log_softmax(x, dim, half_to_float):
    return _softmax_any(x, dim, half_to_float, True)


def _softmax_bwd_ok(grad, out, dim, input_dtype):
    if not (_ok(grad) and _ok(out) and grad.dtype is out.dtype and grad.shape == out.shape
            and grad.device == out.device and out.dim() > 0 and out.numel() > 0
            and -out.dim() <= dim < out.dim()):
        return False
    return input_dtype == out.dtype or (out.dtype == torch.float32 and input_dtype in _HALF)


def _softmax_bwd_any(grad, out, dim, input_dtype, log):
    y, shape = _to_rows(out, dim)
    dy, _ = _to_rows(grad, dim)
    dx = _row_ops._softmax_backward_impl(y, dy, input_dtype, log, "auto")
    return _from_rows(dx, shape, dim, out.dim())


def _softmax_backward(grad, out, dim, input_dtype):
    return _softmax_bwd_any(grad, out, dim, input_dtype, False)


def _log_softmax_backward(grad, out, dim, input_dtype):
    return _softmax_bwd_any(grad, out, dim, input_dtype, True)


# --------------------------------------------------------------------------------------------
# sum / mean over dims
# --------------------------------------------------------------------------------------------

def _reduced_dims(x, dim):
    """The sorted, wrapped reduced dims, or None when the call is not a partial reduction of a
    tensor with at least one dim (no dim, all dims, or a 0-d tensor) or names a dim out of range or
    twice (torch's own kernel then raises its error)."""
    nd = x.dim()
    if dim is None or nd == 0:
        return None
    dims = sorted(d % nd if -nd <= d < nd else nd for d in dim)
    if not dims or dims[-1] >= nd or len(dims) == nd or len(set(dims)) != len(dims):
        return None
    return dims


def _sum_ok(x, dim, keepdim=False, dtype=None):
    if not (_ok(x) and x.numel() > 0):
        return False
    if dtype is not None and dtype != x.dtype and not (dtype == torch.float32 and x.dtype in _HALF):
        return False
    return _reduced_dims(x, dim) is not None


def _row_reduce(x, dim, keepdim, dtype, mean):
    dims = _reduced_dims(x, dim)
    nd = x.dim()
    kept = [d for d in range(nd) if d not in dims]
    out_shape = [1 if d in dims else x.shape[d] for d in range(nd)] if keepdim else \
        [x.shape[d] for d in kept]
    if dims != list(range(nd - len(dims), nd)):
        x = x.permute(*kept, *dims)  # reduced dims last (the reshape below copies)
    rows = x.reshape(_prod(x.shape[:len(kept)]), -1)
    if (rows.shape[1] > 1 and rows.stride(1) != 1) or (rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]):
        rows = rows.contiguous()
    y = _row_ops._row_sum_impl(rows, dtype or x.dtype, mean, "auto")
    return y.view(out_shape)


def _prod(sizes):
    n = 1
    for s in sizes:
        n *= s
    return n


def _sum(x, dim, keepdim=False, dtype=None):
    return _row_reduce(x, dim, keepdim, dtype, False)


def _mean(x, dim, keepdim=False, dtype=None):
    return _row_reduce(x, dim, keepdim, dtype, True)


# --------------------------------------------------------------------------------------------
# RMSNorm
# --------------------------------------------------------------------------------------------

def _norm_cols(x, normalized_shape):
    n = len(normalized_shape)
    if n == 0 or n > x.dim() or tuple(x.shape[x.dim() - n:]) != tuple(normalized_shape):
        return 0
    return _prod(normalized_shape)


def _rms_norm_ok(x, normalized_shape, weight=None, eps=None):
    if not (_ok(x) and x.numel() > 0 and _norm_cols(x, normalized_shape) > 0):
        return False
    if eps is not None and not _real(eps):
        return False
    return weight is None or (weight.dtype is x.dtype and weight.device == x.device
                              and tuple(weight.shape) == tuple(normalized_shape)
                              and weight.layout is _strided)


def _default_eps(x, eps):
    if eps is not None:
        return float(eps)
    return torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps


def _rms_norm(x, normalized_shape, weight=None, eps=None):
    """aten::rms_norm (CompositeImplicitAutograd): the public op, so autograd goes through
    rl_kernels' own backward."""
    cols = _norm_cols(x, normalized_shape)
    w = None if weight is None else weight.reshape(cols)
    y = _row_ops.rms_norm(x.reshape(-1, cols), w, _default_eps(x, eps))
    return y.view(x.shape)


def _fused_rms_norm_ok(x, normalized_shape, weight=None, eps=None):
    return x.dtype is not torch.float64 and _rms_norm_ok(x, normalized_shape, weight, eps)


def _fused_rms_norm(x, normalized_shape, weight=None, eps=None):
    cols = _norm_cols(x, normalized_shape)
    rows = _row_ops._rows(x.reshape(-1, cols))
    w = None if weight is None else weight.reshape(cols).contiguous()
    y, rstd = _row_ops._rms_norm_impl(rows, w, _default_eps(x, eps), False, "auto")
    nd = len(normalized_shape)
    return y.view(x.shape), rstd.view(*x.shape[:x.dim() - nd], *([1] * nd))


def _fused_rms_norm_backward_ok(grad, x, normalized_shape, rstd, weight, output_mask):
    return (_fused_rms_norm_ok(x, normalized_shape, weight) and grad.dtype is x.dtype
            and grad.shape == x.shape and rstd.dtype == torch.float32
            and rstd.numel() * _norm_cols(x, normalized_shape) == x.numel())


def _fused_rms_norm_backward(grad, x, normalized_shape, rstd, weight, output_mask):
    cols = _norm_cols(x, normalized_shape)
    rows = _row_ops._rows(x.reshape(-1, cols))
    dy = _row_ops._rows(grad.reshape(-1, cols))
    w = None if weight is None else weight.reshape(cols).contiguous()
    need_dw = weight is not None and bool(output_mask[1])
    dx, dw = _row_ops._rms_norm_backward_impl(rows, w, rstd.reshape(-1).contiguous(), dy, 1e-6,
                                              False, need_dw, "auto")
    return (dx.view(x.shape) if output_mask[0] else None,
            dw.view(weight.shape) if need_dw else None)


# --------------------------------------------------------------------------------------------
# scaled_dot_product_attention
# --------------------------------------------------------------------------------------------

def _sdpa_ok(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
             enable_gqa=False):
    if attn_mask is not None or dropout_p != 0.0:
        return False
    if not (q.dim() == 4 and k.dim() == 4 and v.dim() == 4 and _ok(q) and q.dtype is k.dtype
            and q.dtype is v.dtype and q.device == k.device and q.device == v.device):
        return False
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        return False
    if q.numel() == 0 or k.numel() == 0:
        return False
    hq, hk = q.shape[1], k.shape[1]
    if hq != hk and not (enable_gqa and hq % hk == 0):
        return False
    if is_causal and q.shape[2] != k.shape[2]:
        return False  # torch aligns the causal mask top-left, rl_kernels bottom-right
    if scale is not None and not (_real(scale) and scale >= 0):
        return False  # (rl_kernels' running max is of the raw scores: scale >= 0)
    if q.is_cuda:
        if q.dtype not in _HALF or q.shape[3] not in _attention_mod.CUDA_HEAD_DIMS:
            return False
    return True


def _sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
          enable_gqa=False):
    out = _attention_mod.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                   causal=bool(is_causal), softmax_scale=scale)
    return out.transpose(1, 2)


# --------------------------------------------------------------------------------------------
# The table and the registration
# --------------------------------------------------------------------------------------------

_BACKEND_KEYS = ("CPU", "CUDA")
# op name -> (predicate, implementation, dispatch keys)
_TABLE = {
    "mm": (_mm_ok, _mm, _BACKEND_KEYS),
    "addmm": (_addmm_ok, _addmm, _BACKEND_KEYS),
    "bmm": (_bmm_ok, _bmm, _BACKEND_KEYS),
    "baddbmm": (_baddbmm_ok, _baddbmm, _BACKEND_KEYS),
    "mv": (_mv_ok, _mv, _BACKEND_KEYS),
    "_softmax": (_softmax_ok, _softmax, _BACKEND_KEYS),
    "_log_softmax": (_softmax_ok, _log_softmax, _BACKEND_KEYS),
    "_softmax_backward_data": (_softmax_bwd_ok, _softmax_backward, _BACKEND_KEYS),
    "_log_softmax_backward_data": (_softmax_bwd_ok, _log_softmax_backward, _BACKEND_KEYS),
    "sum.dim_IntList": (_sum_ok, _sum, _BACKEND_KEYS),
    "mean.dim": (_sum_ok, _mean, _BACKEND_KEYS),
    # torch's CPU rms_norm decomposes into pow / mean.dim / rsqrt / mul; on CUDA it calls these
    "_fused_rms_norm": (_fused_rms_norm_ok, _fused_rms_norm, ("CUDA",)),
    "_fused_rms_norm_backward": (_fused_rms_norm_backward_ok, _fused_rms_norm_backward, ("CUDA",)),
    # CompositeImplicitAutograd ops: overridden at that alias key, above autograd, so the
    # replacement's own autograd (rl_kernels' backward) is recorded
    "rms_norm": (_rms_norm_ok, _rms_norm, ("CompositeImplicitAutograd",)),
    "scaled_dot_product_attention": (_sdpa_ok, _sdpa, ("CompositeImplicitAutograd",)),
}
# the dispatch key whose computed kernel is the original of an alias-key override
_ORIGINAL_KEY = {"CompositeImplicitAutograd": "CPU"}

_lock = threading.RLock()
_library = None          # the torch.library.Library holding the registrations while on
_active: dict = {}       # OpOverload -> predicate, for covers() and strict()
_blocks: dict = {}       # thread ident -> the enabled flags of its open batch_invariant() blocks
_outside_blocks = False  # the state enable / disable_batch_invariant() set, for when no block is open


def _overload(name):
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _make_kernel(predicate, impl, original):
    call_original = original.call_boxed

    def kernel(keyset, *args, **kwargs):
        if predicate(*args, **kwargs):
            return impl(*args, **kwargs)
        return call_original(keyset, *args, **kwargs)

    return kernel


def _register():
    global _library
    lib = torch.library.Library("aten", "IMPL")
    active = {}
    try:
        with warnings.catch_warnings():
            # "Overriding a previously registered kernel": that is the point; destroy() restores it
            warnings.simplefilter("ignore", UserWarning)
            for name, (predicate, impl, keys) in _TABLE.items():
                for key in keys:
                    try:
                        original = torch.library.get_kernel(f"aten::{name}",
                                                            _ORIGINAL_KEY.get(key, key))
                    except RuntimeError:
                        continue  # no kernel there (e.g. CUDA in a CPU-only torch): nothing to replace
                    lib.impl(name, _make_kernel(predicate, impl, original), key, with_keyset=True)
                    active[_overload(name)] = predicate
    except BaseException:
        lib._destroy()
        raise
    _library = lib
    _active.clear()
    _active.update(active)


def _unregister():
    global _library
    lib, _library = _library, None
    _active.clear()
    if lib is not None:
        lib._destroy()


def _apply() -> None:
    """Registers or unregisters so that the mode is what the open blocks ask for (they agree:
    batch_invariant.__enter__), or with none open what enable / disable_batch_invariant() set.
    Called with _lock held."""
    innermost = [flags[-1] for flags in _blocks.values()]
    on = innermost[0] if innermost else _outside_blocks
    if on and _library is None:
        _register()
    elif not on and _library is not None:
        _unregister()


def enable_batch_invariant() -> None:
    """Turn the mode on (process-wide) for as long as no batch_invariant() block says otherwise;
    a no-op when it is on."""
    global _outside_blocks
    with _lock:
        _outside_blocks = True
        _apply()


def disable_batch_invariant() -> None:
    """Turn the mode off, restoring torch's previous kernels exactly, for as long as no
    batch_invariant() block says otherwise; a no-op when it is off."""
    global _outside_blocks
    with _lock:
        _outside_blocks = False
        _apply()


def is_batch_invariant() -> bool:
    """Whether the mode is on."""
    return _library is not None


class batch_invariant(contextlib.ContextDecorator):
    """Context manager (and decorator): the mode is on (or off, with enabled=False) inside; on exit
    it is what the blocks still open ask for, or with none open what enable / disable_batch_invariant()
    set, so blocks nest. The mode is process-wide: blocks open in several threads at once must ask for
    the same state (the registration is taken down when the last of them closes, not the first); a
    block that asks for the other state raises RuntimeError."""

    def __init__(self, enabled: bool = True):
        if not isinstance(enabled, bool):
            raise TypeError(f"batch_invariant(): enabled must be a bool, got {type(enabled).__name__}")
        self.enabled = enabled

    def _recreate_cm(self):  # as a decorator: a fresh instance per call (threads, recursion)
        return type(self)(self.enabled)

    def __enter__(self):
        me = threading.get_ident()
        with _lock:
            others = {flags[-1] for thread, flags in _blocks.items() if thread != me}
            if others and others != {self.enabled}:
                raise RuntimeError(
                    f"batch_invariant({self.enabled}): another thread is inside a "
                    f"batch_invariant({not self.enabled}) block; the mode is process-wide, so "
                    f"blocks open at the same time must agree")
            _blocks.setdefault(me, []).append(self.enabled)
            try:
                _apply()
            except BaseException:
                self._close(me)
                raise
        return self

    @staticmethod
    def _close(me):
        flags = _blocks[me]
        flags.pop()
        if not flags:
            del _blocks[me]

    def __exit__(self, *exc):
        me = threading.get_ident()
        with _lock:
            flags = _blocks.get(me)
            if not flags:
                raise RuntimeError("batch_invariant: __exit__ without a matching __enter__ in this "
                                   "thread")
            self._close(me)
            _apply()
        return False


def covered_ops() -> list:
    """The aten overloads the mode replaces (names like 'aten::mm'), whether on or off."""
    return [f"aten::{name}" for name in _TABLE]


def covers(func, args=(), kwargs=None) -> bool:
    """True when the mode is on and its kernel (not torch's original) takes this call of `func`
    (an OpOverload such as torch.ops.aten.mm.default)."""
    predicate = _active.get(func)
    if predicate is None:
        return False
    try:
        return bool(predicate(*args, **(kwargs or {})))
    except Exception:
        return False
