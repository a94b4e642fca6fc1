"""Which backend runs an op: SM90 -> SM80 -> CPU, by what is compiled and what the device is.

A backend is usable for an op when every kernel file it needs is compiled into ``rl_kernels._C``
and the device fits (sm90: compute capability exactly 9.0, since sm_90a code runs nowhere else;
sm80: capability >= 8.0; cpu: always). Routing is per call by the inputs' device: CPU tensors go to
the CPU backend even on a GPU machine. ``RL_KERNELS_BACKEND=cpu|sm80|sm90`` (read at import) or the
``backend=`` argument force one backend; forcing one that cannot run raises RuntimeError saying why.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

from . import _C

BACKENDS = ("sm90", "sm80", "cpu")
BACKEND_CODES = {"cpu": _C.BACKEND_CPU, "sm80": _C.BACKEND_SM80, "sm90": _C.BACKEND_SM90}
GPU_BACKENDS = ("sm90", "sm80")

# op name -> (module, class, {backend: kernel files it needs})
_OPS = {
    "matmul": ("rl_kernels.ops.gemm", "MatmulOp",
               {"sm90": ("gemm_sm90",), "sm80": ("gemm_sm80",), "cpu": ()}),
    "addmm": ("rl_kernels.ops.gemm", "AddmmOp",
              {"sm90": ("gemm_sm90",), "sm80": ("gemm_sm80",), "cpu": ()}),
    "gemm": ("rl_kernels.ops.gemm", "GemmOp",
             {"sm90": ("gemm_sm90",), "sm80": ("gemm_sm80",), "cpu": ()}),
    "det_gemm": ("rl_kernels.ops.det_gemm", "DetGemmOp",
                 {"sm90": ("gemm_sm90",), "sm80": ("gemm_sm80",), "cpu": ()}),
    "linear_logp": ("rl_kernels.ops.linear_logp", "LinearLogpOp",
                    {"sm90": ("gemm_sm90", "linear_logp_sm80", "gemm_fp32_sm80"),
                     "sm80": ("linear_logp_sm80", "gemm_sm80", "gemm_fp32_sm80"), "cpu": ()}),
}

_COMPILED = frozenset(_C.compiled_kernels())
_ENV_BACKEND = os.environ.get("RL_KERNELS_BACKEND") or None


def known_ops():
    return sorted(_OPS)


def _op_entry(name):
    if name not in _OPS:
        raise KeyError(f"unknown op {name!r}; known ops: {', '.join(known_ops())}")
    return _OPS[name]


def _check_backend_name(backend):
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")


@functools.lru_cache(maxsize=None)
def backend_status(op: str, backend: str, device_index: int | None = None) -> tuple[bool, str]:
    """(usable, why not) for running ``op`` on ``backend`` (on CUDA device ``device_index``)."""
    _check_backend_name(backend)
    needs = _op_entry(op)[2]
    if backend not in needs:
        return False, f"{op} has no {backend} kernel"
    missing = [k for k in needs[backend] if k not in _COMPILED]
    if missing:
        return False, f"not compiled ({', '.join(missing)} missing from this build)"
    if backend == "cpu":
        return True, ""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    index = torch.cuda.current_device() if device_index is None else device_index
    major, minor = torch.cuda.get_device_capability(index)
    if backend == "sm90" and (major, minor) != (9, 0):
        return False, f"needs compute capability 9.0 (sm_90a), device has {major}.{minor}"
    if backend == "sm80" and major < 8:
        return False, f"needs compute capability >= 8.0, device has {major}.{minor}"
    return True, ""


@functools.lru_cache(maxsize=None)
def _resolve(op: str, device_type: str, device_index: int | None, forced: str | None) -> str:
    if forced is not None:
        _check_backend_name(forced)
    if device_type == "cpu":
        if forced not in (None, "cpu"):
            raise RuntimeError(f"{op}: backend {forced!r} runs on CUDA tensors, got CPU tensors")
        return "cpu"
    if device_type != "cuda":
        raise RuntimeError(f"{op}: tensors on {device_type!r} are not supported (cpu or cuda)")
    if forced == "cpu":
        raise RuntimeError(f"{op}: backend 'cpu' runs on CPU tensors, got CUDA tensors")
    candidates = (forced,) if forced is not None else GPU_BACKENDS
    reasons = []
    for backend in candidates:
        usable, why = backend_status(op, backend, device_index)
        if usable:
            return backend
        reasons.append(f"{backend}: {why}")
    raise RuntimeError(f"{op}: no usable backend on cuda:{device_index} ({'; '.join(reasons)})")


def resolve_backend(op: str, device: torch.device, backend: str | None = None) -> str:
    """The backend that runs ``op`` on tensors of ``device``; ``backend`` (or the environment
    variable RL_KERNELS_BACKEND) forces one."""
    return _resolve(op, device.type, device.index, backend or _ENV_BACKEND)


def get_op(name: str, backend: str | None = None) -> torch.nn.Module:
    """An nn.Module running op ``name``. ``backend`` (or RL_KERNELS_BACKEND) forces cpu, sm80 or
    sm90: checked now, and the module then refuses inputs on a device that backend cannot serve."""
    module_name, class_name, _ = _op_entry(name)
    forced = backend or _ENV_BACKEND
    if forced is not None:
        _check_backend_name(forced)
        usable, why = backend_status(name, forced)
        if not usable:
            raise RuntimeError(f"{name}: backend {forced!r} is not usable: {why}")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(backend=backend)


def describe() -> list[dict]:
    """One row per (op, backend): usable or why not, in priority order."""
    rows = []
    for op in known_ops():
        for backend in BACKENDS:
            usable, why = backend_status(op, backend)
            rows.append({"op": op, "backend": backend, "usable": usable, "why_not": why})
    return rows


def format_table(rows=None) -> str:
    rows = describe() if rows is None else rows
    lines = [f"{'op':<12} {'backend':<8} {'usable':<7} why not", "-" * 60]
    for r in rows:
        lines.append(f"{r['op']:<12} {r['backend']:<8} {'yes' if r['usable'] else 'no':<7} "
                     f"{r['why_not']}")
    return "\n".join(lines)
