"""rl_kernels.strict(): name every op that may break batch invariance, where it is called.

    with rl_kernels.batch_invariant(), rl_kernels.strict():
        logp = token_logprobs(model, ids, mask)     # raises BatchInvarianceError at the first op
                                                    # not known to be batch-invariant
    with rl_kernels.strict("warn") as check:
        model(ids)
    print(check.report())                           # every such op, its call site and count

A TorchDispatchMode: it sees each aten op that runs on a tensor inside the block (forward and
backward; composite ops after they decompose) and judges it, before the op runs:

  allowed   every rl_kernels op; pointwise ops (torch.Tag.pointwise); views; copies, casts,
            concatenation, padding, indexing and scattering WITHOUT accumulation (index, gather,
            embedding, index_put(accumulate=False), scatter without reduce ...); factories; ops
            whose answer is exact whatever the order (max, min, argmax, any, all, comparisons,
            equal, stable sorts); any op whose tensor inputs are all integer or bool (integer
            arithmetic is exact in any order); and, while rl_kernels.batch_invariant() is on, the
            calls of aten ops that the mode's kernels take (not the calls it hands back to torch);
  refused   matmuls and floating-point reductions, softmax, norms and attention that do not run on
            rl_kernels (torch picks kernels and reduction splits by shape); floating-point scans
            (cumsum); accumulation whose order depends on the indices (scatter_add, index_add,
            index_put(accumulate=True), embedding_dense_backward); unstable sorts and topk (the
            order of ties); random ops (the stream a row draws from depends on the batch); and
            anything not listed, as unknown.

mode="raise" (default) raises BatchInvarianceError naming the op, the reason and the call site:
the first Python frame outside torch and rl_kernels (and, when that frame is inside an installed
library such as transformers, also the first frame of your own code). mode="warn" runs everything,
warns once per (op, call site) and keeps counts: ``report()`` (text) and ``violations`` (records).

Caveat (CPU only): torch's CPU pointwise kernels run a SIMD body and a scalar tail, and a few
functions (silu and sigmoid in fp32, rsqrt in bf16 ...) can differ in the last bit between the two,
so an element's bits may depend on where it falls in the flattened tensor. Tensors whose inner
dimension is a multiple of 64 elements never reach a tail; strict() does not check for this.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import warnings
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .batch_invariant import covered_ops, covers, is_batch_invariant

__all__ = ["strict", "BatchInvarianceError", "BatchInvarianceWarning", "Violation"]


class BatchInvarianceError(RuntimeError):
    """An op that is not known to be batch-invariant ran inside rl_kernels.strict()."""


class BatchInvarianceWarning(UserWarning):
    """strict(mode="warn"): an op that is not known to be batch-invariant ran."""


@dataclass
class Violation:
    op: str        # e.g. "aten.mm.default"
    site: str      # "file:line in function", plus "(from file:line in function)" for library code
    reason: str
    count: int


# --------------------------------------------------------------------------------------------
# Classification of ops (by their packet name: "aten::add_" and "aten::add" share "add")
# --------------------------------------------------------------------------------------------

_MATMUL = "a matmul not on rl_kernels (torch picks GEMM kernels and split-K by shape)"
_REDUCTION = ("a floating-point reduction not on rl_kernels (torch picks its reduction order and "
              "splits by shape)")
_SOFTMAX = "a softmax not on rl_kernels (a row reduction whose order torch picks by shape)"
_NORM = "a normalization not on rl_kernels (a row reduction whose order torch picks by shape)"
_ATTENTION = ("attention not on rl_kernels (torch's SDPA backends pick tiles and KV splits by "
              "shape; prefill and decode rows differ)")
_SCAN = "a floating-point scan (cumsum / cumprod: the order of partial sums is the kernel's)"
_ACCUMULATE = "accumulation into shared rows (the order of the adds depends on the indices/batch)"
_SORT = "an unstable sort / topk (the order of equal values may depend on the size)"
_RANDOM = "a random op (the random stream a row draws from depends on the batch)"
_UNKNOWN = "not known to be batch-invariant (not on strict()'s allowlist)"
_FULL_REDUCTION = ("a floating-point reduction over every element (it mixes all rows of the batch; "
                   "batch_invariant() leaves full reductions to torch)")

_REFUSED_FLOAT = {}  # packet -> reason; allowed when no floating-point tensor is involved
for _names, _reason in (
        (("mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "dot", "vdot", "matmul", "linear",
          "addbmm", "addr", "outer", "einsum", "tensordot", "_addmm_activation", "_int_mm",
          "_scaled_mm", "chain_matmul", "linalg_multi_dot", "bilinear", "_trilinear",
          "conv1d", "conv2d", "conv3d", "convolution", "_convolution", "cudnn_convolution",
          "mkldnn_convolution", "convolution_backward", "_convolution_double_backward"), _MATMUL),
        (("sum", "mean", "nansum", "nanmean", "prod", "var", "std", "var_mean", "std_mean",
          "norm", "linalg_vector_norm", "linalg_norm", "frobenius_norm", "nuclear_norm",
          "logsumexp", "logcumsumexp", "dist", "cdist", "_cdist_forward", "trace",
          "cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d_forward",
          "nll_loss_backward", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
          "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div",
          "cosine_similarity", "pairwise_distance", "_euclidean_dist", "sum_to_size",
          "renorm", "histc", "bincount", "_weight_norm_interface"), _REDUCTION),
        (("_softmax", "_log_softmax", "softmax", "log_softmax", "_softmax_backward_data",
          "_log_softmax_backward_data", "_safe_softmax", "_masked_softmax"), _SOFTMAX),
        (("rms_norm", "_fused_rms_norm", "_fused_rms_norm_backward", "layer_norm",
          "native_layer_norm", "native_layer_norm_backward", "group_norm", "native_group_norm",
          "native_group_norm_backward", "batch_norm", "native_batch_norm",
          "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
          "native_batch_norm_backward", "instance_norm", "_batch_norm_with_update",
          "_batch_norm_no_update", "batch_norm_backward"), _NORM),
        (("scaled_dot_product_attention", "_scaled_dot_product_attention_math",
          "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
          "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
          "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
          "_efficient_attention_forward", "_scaled_dot_product_flash_attention_backward",
          "_scaled_dot_product_flash_attention_for_cpu_backward",
          "_scaled_dot_product_efficient_attention_backward",
          "_scaled_dot_product_cudnn_attention_backward", "_flash_attention_backward",
          "_efficient_attention_backward", "_scaled_dot_product_attention_math_for_mps"),
         _ATTENTION),
        (("cumsum", "cumprod", "_cumsum", "_cumprod", "cumulative_trapezoid", "trapezoid",
          "trapz"), _SCAN),
        (("scatter_add", "index_add", "scatter_reduce", "embedding_dense_backward", "embedding_backward", "_embedding_bag",
          "_embedding_bag_forward_only", "_embedding_bag_backward", "embedding_bag",
          "_embedding_bag_dense_backward", "index_reduce", "segment_reduce",
          "_segment_reduce_backward", "_unsafe_masked_index_put_accumulate"), _ACCUMULATE),
        (("sort", "argsort", "msort", "topk", "kthvalue", "median", "nanmedian", "mode",
          "quantile", "nanquantile"), _SORT)):
    for _name in _names:
        _REFUSED_FLOAT[_name] = _reason

# ops that move, copy, cast, pad, index or scatter values without arithmetic between elements,
# factories, and ops whose result is exact in any order
_ALLOWED = frozenset("""
    clone copy _copy_from _copy_from_and_resize _to_copy to _to_dtype contiguous cat concat
    concatenate stack hstack vstack dstack _unsafe_view view _reshape_alias reshape flatten
    unflatten flip fliplr flipud roll rot90 repeat tile repeat_interleave expand_as
    constant_pad_nd pad _pad_enum _pad_circular reflection_pad1d reflection_pad2d
    replication_pad1d replication_pad2d narrow_copy tril triu tril_indices triu_indices
    fill zero detach_ resize resize_as set record_stream _local_scalar_dense item lift_fresh
    lift_fresh_copy is_nonzero is_same_size equal isin bucketize searchsorted
    index index_select gather take take_along_dim embedding masked_select nonzero nonzero_static
    argwhere index_put _index_put_impl put index_copy index_fill masked_scatter scatter
    slice_scatter select_scatter diagonal_scatter as_strided_scatter slice_backward select_backward diagonal_backward
    as_strided_copy unfold_backward expand_copy permute_copy view_copy t_copy transpose_copy
    unsqueeze_copy squeeze_copy split_copy split_with_sizes_copy unbind_copy slice_copy
    select_copy alias_copy detach_copy _unsafe_index _unsafe_index_put _unsafe_masked_index
    one_hot
    empty empty_like empty_strided empty_permuted new_empty new_empty_strided zeros zeros_like
    new_zeros ones ones_like new_ones full full_like new_full scalar_tensor arange range
    linspace logspace eye tensor _efficientzerotensor sym_constrain_range
    _assert_async _assert_scalar _functional_assert_async _assert_tensor_metadata
    max min amax amin aminmax argmax argmin any all cummax cummin _cummax_helper
    _cummin_helper unique _unique _unique2 unique_dim unique_consecutive count_nonzero
    _has_compatible_shallow_copy_type _to_cpu _pin_memory pin_memory _conj _neg_view
    resolve_conj resolve_neg _nested_tensor_from_mask
""".split())

def _packet(func) -> str:
    """The op's name without namespace and in-place underscore: add_ -> add, _softmax stays."""
    name = func._schema.name.split("::", 1)[-1]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b


def _floating_involved(args, kwargs) -> bool:
    for t in _tensors(args, kwargs):
        if t.is_floating_point() or t.is_complex():
            return True
    return False


def _overload(name):
    packet, _, overload = name.split("::", 1)[1].partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


_COVERED_OVERLOADS = frozenset(_overload(name) for name in covered_ops())
_COVERED = frozenset(name.split("::", 1)[1].split(".")[0] for name in covered_ops())
_HAS_CIA = torch._C._dispatch_has_kernel_for_dispatch_key


class _Kind:
    ALLOW, DECOMPOSE, REFUSE_FLOAT, RANDOM = range(4)


_kinds: dict = {}  # OpOverload -> (kind, reason)


def _classify(func):
    cached = _kinds.get(func)
    if cached is not None:
        return cached
    namespace = func.namespace
    packet = _packet(func)
    tags = set(func.tags) | _functional_tags(func, packet)
    if namespace == "rl_kernels":
        kind = (_Kind.ALLOW, "")
    elif namespace == "aten" and _HAS_CIA(func.name(), "CompositeImplicitAutograd"):
        # a composite seen before it decomposed (inference_mode): judged by what it runs
        kind = (_Kind.DECOMPOSE, _UNKNOWN)
    elif packet in _REFUSED_FLOAT:
        kind = (_Kind.REFUSE_FLOAT, _REFUSED_FLOAT[packet])
    elif torch.Tag.nondeterministic_seeded in tags:
        kind = (_Kind.RANDOM, _RANDOM)
    elif torch.Tag.pointwise in tags or func.is_view or packet in _ALLOWED:
        kind = (_Kind.ALLOW, "")
    else:
        kind = (_Kind.REFUSE_FLOAT, _UNKNOWN)
    _kinds[func] = kind
    return kind


def _functional_tags(func, packet):
    """The tags of the functional form of an in-place or out= overload (masked_fill_.Scalar ->
    masked_fill.Scalar), which carries tags such as pointwise that the variant may lack."""
    if func.namespace != "aten":
        return set()
    overload = func._overloadname
    candidates = [overload]
    if overload.endswith("out"):
        candidates = [overload[:-len("_out")] if overload.endswith("_out") else "default"]
    packet_ops = getattr(torch.ops.aten, packet, None)
    for name in candidates:
        op = getattr(packet_ops, name, None) if packet_ops is not None else None
        if op is not None and op is not func:
            return set(op.tags)
    return set()


def _argument(func, args, kwargs, name, default):
    if name in kwargs:
        return kwargs[name]
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            return args[i] if i < len(args) else default
    return default


def _verdict(func, args, kwargs):
    """None when the call is allowed, else the reason it is refused (or _DECOMPOSE)."""
    kind, reason = _classify(func)
    if kind == _Kind.ALLOW:
        packet = _packet(func)
        if packet in ("index_put", "_unsafe_index_put", "_index_put_impl", "put") and \
                _argument(func, args, kwargs, "accumulate", False):
            return None if not _floating_involved(args, kwargs) else _ACCUMULATE
        if packet in ("scatter",) and _argument(func, args, kwargs, "reduce", None) is not None:
            return None if not _floating_involved(args, kwargs) else _ACCUMULATE
        return None
    if kind == _Kind.RANDOM:
        return reason
    if kind == _Kind.DECOMPOSE:
        return _DECOMPOSE
    # REFUSE_FLOAT: matmuls, reductions, scans, accumulation, sorts, unknown ops
    if covers(func, args, kwargs):
        return None
    packet = _packet(func)
    if packet in ("sort", "argsort") and _argument(func, args, kwargs, "stable", False):
        return None  # a stable sort's order is fixed by the values alone
    if not _floating_involved(args, kwargs):
        return None
    if packet in ("sum", "mean") and _full_reduction(func, args, kwargs):
        return _FULL_REDUCTION
    if func in _COVERED_OVERLOADS:
        if is_batch_invariant():
            return (reason + "; rl_kernels.batch_invariant() is on but hands this call to torch "
                    "(its dtype, device or arguments are not ones the rl_kernels kernels take)")
        return reason + "; run it inside rl_kernels.batch_invariant()"
    if packet in _COVERED:
        return reason + f"; batch_invariant() covers other overloads of {packet}, not {func}"
    return reason


def _full_reduction(func, args, kwargs):
    if func._overloadname in ("default", "out", "dtype_out") and "dim" not in kwargs and \
            not any(a.name == "dim" for a in func._schema.arguments):
        return True
    dim = _argument(func, args, kwargs, "dim", None)
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor):
        return False
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return True
    dims = {d % x.dim() for d in dim} if x.dim() else set()
    return len(dims) == x.dim()


_DECOMPOSE = object()


# --------------------------------------------------------------------------------------------
# Call sites
# --------------------------------------------------------------------------------------------

def _dir_of(module):
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


_SKIP_DIRS = (_dir_of(torch), _dir_of(sys.modules[__name__.rsplit(".", 1)[0]]))
_STDLIB = os.path.dirname(os.path.abspath(os.__file__)) + os.sep


def _is_library(filename):
    return ("site-packages" + os.sep in filename or "dist-packages" + os.sep in filename
            or filename.startswith(_STDLIB) or filename.startswith("<"))


def _frame_text(frame):
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def call_site():
    """(text, frame): the first frame outside torch and rl_kernels and, if that one is library
    code (site-packages, the standard library), also the first frame of the user's code after it;
    in a backward pass, the autograd node too."""
    frame = sys._getframe(1)
    first = user = None
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith(_SKIP_DIRS):
            if first is None:
                first = frame
                if not _is_library(filename):
                    break
            elif not _is_library(filename):
                user = frame
                break
        frame = frame.f_back
    if first is None:
        site = "<no Python frame outside torch / rl_kernels>"
    elif user is None:
        site = _frame_text(first)
    else:
        site = f"{_frame_text(first)} (from {_frame_text(user)})"
    node = torch._C._current_autograd_node()
    if node is not None:
        site += f" [backward of {node.name()}]"
    return site, (user or first)


# --------------------------------------------------------------------------------------------
# The mode
# --------------------------------------------------------------------------------------------

class strict(TorchDispatchMode):
    """Context manager: raise (mode="raise") or record and warn (mode="warn") when an op that is
    not known to be batch-invariant runs on a tensor inside it. See the module docstring."""

    Error = BatchInvarianceError
    Warning = BatchInvarianceWarning

    def __init__(self, mode: str = "raise"):
        super().__init__()
        if mode not in ("raise", "warn"):
            raise ValueError(f"strict(): mode must be 'raise' or 'warn', got {mode!r}")
        self.mode = mode
        self._lock = threading.Lock()
        self._counts: dict = collections.OrderedDict()  # (op, site, reason) -> count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = _verdict(func, args, kwargs)
        if reason is _DECOMPOSE:
            # a composite op seen undecomposed (inference_mode): judge what it decomposes into
            with self:
                result = func.decompose(*args, **kwargs)
            if result is not NotImplemented:
                return result
            reason = None if not _floating_involved(args, kwargs) else _UNKNOWN
        if reason is not None:
            self._violation(str(func), reason)
        return func(*args, **kwargs)

    def _violation(self, op, reason):
        site, frame = call_site()
        if self.mode == "raise":
            raise BatchInvarianceError(f"{op} is {reason}. Called at {site}.")
        key = (op, site, reason)
        with self._lock:
            first = key not in self._counts
            self._counts[key] = self._counts.get(key, 0) + 1
        if first:
            message = f"rl_kernels.strict: {op} is {reason}. Called at {site}."
            if frame is None:
                warnings.warn(message, BatchInvarianceWarning, stacklevel=2)
            else:  # point the warning at the call site, not at this file
                warnings.warn_explicit(message, BatchInvarianceWarning, frame.f_code.co_filename,
                                       frame.f_lineno, module=frame.f_globals.get("__name__"),
                                       registry=frame.f_globals.setdefault("__warningregistry__", {}))

    @property
    def violations(self) -> list:
        """One Violation per (op, call site), in the order first seen (mode="warn")."""
        with self._lock:
            return [Violation(op, site, reason, count)
                    for (op, site, reason), count in self._counts.items()]

    def clear(self) -> None:
        with self._lock:
            self._counts.clear()

    def report(self) -> str:
        """A table of the ops strict(mode="warn") saw that are not known to be batch-invariant."""
        found = self.violations
        if not found:
            return "rl_kernels.strict: no op that may break batch invariance ran"
        lines = [f"rl_kernels.strict: {sum(v.count for v in found)} call(s) of "
                 f"{len({v.op for v in found})} op(s) that may break batch invariance:"]
        for v in found:
            lines.append(f"  {v.count:>6} x {v.op} at {v.site}\n           {v.reason}")
        return "\n".join(lines)
