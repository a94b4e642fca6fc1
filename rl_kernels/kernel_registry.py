"""Which backend runs an op, from what this build has and what the device is.

Everything here is read from the extension, which reads csrc/kernels.def: _C.backends() lists the
backends (device kind, compute-capability range, fallback), _C.kernels() the kernels compiled into
this build. An op (an nn.Module class in rl_kernels/modules.py) names the kernel entries it needs;
it is usable on a backend when each entry has a compiled kernel there or along the backend's
fallback chain, and the device fits (sm90: compute capability exactly 9.0, since sm_90a code runs
nowhere else; sm80: >= 8.0; cpu: always).

Routing is per call by the inputs' device: CPU tensors go to the CPU backend even on a GPU machine,
CUDA tensors to the first usable CUDA backend in kernels.def order. ``RL_KERNELS_BACKEND`` (read at
import; a name that is not a backend raises there, naming the variable; "" or "auto" leave routing
by device) or the ``backend=`` argument force one backend; forcing one that cannot run raises
RuntimeError saying why (and naming the variable when it did the forcing). Within a backend, the C
launchers decide per call which kernel takes the arguments (by dtypes and layouts, never by the row
count) and follow the fallbacks of kernels.def; ``last_kernel()`` names the kernel that ran.
"""

from __future__ import annotations

import functools
import os

import torch

from . import _C


def _backend_rows():
    rows = {}
    for code, (name, device, min_cc, max_cc, fallback) in enumerate(_C.backends()):
        rows[name] = {"code": code, "device": device, "min_cc": min_cc, "max_cc": max_cc,
                      "fallback": fallback}
    return rows


_BACKENDS = _backend_rows()
BACKENDS = tuple(_BACKENDS)  # priority order
GPU_BACKENDS = tuple(b for b in BACKENDS if _BACKENDS[b]["device"] == "cuda")
_COMPILED = {(entry, backend) for entry, backend, _ in _C.kernels()}


def _near_miss(value: str) -> str:
    """' (did you mean 'cpu'?)' for 'CPU' or 'cpu ', else ''."""
    near = value.strip().lower()
    return f" (did you mean {near!r}?)" if near != value and near in (*_BACKENDS, "auto") else ""


def _env_backend():
    value = os.environ.get("RL_KERNELS_BACKEND")
    if value is None or value in ("", "auto"):
        return None
    if value not in _BACKENDS:
        raise ValueError(f"RL_KERNELS_BACKEND={value!r} is not a backend{_near_miss(value)}; "
                         f"expected one of {', '.join(BACKENDS)}, or auto, or leave it unset")
    return value


_ENV_BACKEND = _env_backend()


def backend_code(backend: str) -> int:
    """The code _C takes for a backend name."""
    return _BACKENDS[backend]["code"]


def last_kernel() -> str:
    """The kernel that ran the last launch of this thread, e.g. 'gemm_sm90' (or 'gemm_sm80' when
    sm90 could not take the operands' layout)."""
    return _C.last_kernel()


def _ops():
    from .modules import OpModule  # the op classes; imported late (they import the op modules)
    return {cls.op: cls for cls in OpModule.registered()}


def known_ops():
    return sorted(_ops())


def _op_class(name):
    ops = _ops()
    if not isinstance(name, str):
        raise TypeError(f"op name must be a str (one of {', '.join(sorted(ops))}), got "
                        f"{type(name).__name__}")
    if name not in ops:
        raise KeyError(f"unknown op {name!r}; known ops: {', '.join(sorted(ops))}")
    return ops[name]


def check_backend_name(backend) -> None:
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str (one of {', '.join(BACKENDS)}), got "
                        f"{type(backend).__name__}")
    if backend not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r}{_near_miss(backend)}; expected one of "
                         f"{', '.join(BACKENDS)}")


def _env_note(from_env: bool) -> str:
    return f" (set by RL_KERNELS_BACKEND={_ENV_BACKEND})" if from_env else ""


def kernel_chain(entry: str, backend: str) -> list[str]:
    """The compiled kernels that may run `entry` for `backend`, in the order they are tried."""
    chain = []
    while backend is not None:
        if (entry, backend) in _COMPILED:
            chain.append(f"{entry}_{backend}")
        backend = _BACKENDS[backend]["fallback"]
    return chain


@functools.lru_cache(maxsize=None)
def backend_status(op: str, backend: str, device_index: int | None = None) -> tuple[bool, str]:
    """(usable, why not) for running ``op`` on ``backend`` (on CUDA device ``device_index``)."""
    check_backend_name(backend)
    missing = [entry for entry in _op_class(op).kernels if not kernel_chain(entry, backend)]
    if missing:
        return False, f"not compiled ({', '.join(f'{e}_{backend}' for e in missing)} missing from this build)"
    row = _BACKENDS[backend]
    if row["device"] == "cpu":
        return True, ""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    index = torch.cuda.current_device() if device_index is None else device_index
    major, minor = torch.cuda.get_device_capability(index)
    cc = 10 * major + minor
    if cc < row["min_cc"] or (row["max_cc"] and cc > row["max_cc"]):
        want = (f"{row['min_cc'] // 10}.{row['min_cc'] % 10}" if row["min_cc"] == row["max_cc"]
                else f">= {row['min_cc'] // 10}.{row['min_cc'] % 10}")
        return False, f"needs compute capability {want}, device has {major}.{minor}"
    return True, ""


@functools.lru_cache(maxsize=None)
def _resolve(op: str, device_type: str, device_index: int | None, forced: str | None,
             from_env: bool = False) -> str:
    if forced is not None:
        check_backend_name(forced)
    if device_type not in ("cpu", "cuda"):
        raise RuntimeError(f"{op}: tensors on {device_type!r} are not supported (cpu or cuda)")
    if forced is not None and _BACKENDS[forced]["device"] != device_type:
        raise RuntimeError(f"{op}: backend {forced!r}{_env_note(from_env)} runs on "
                           f"{_BACKENDS[forced]['device'].upper()} tensors, got "
                           f"{device_type.upper()} tensors")
    candidates = (forced,) if forced is not None else tuple(
        b for b in BACKENDS if _BACKENDS[b]["device"] == device_type)
    reasons = []
    for backend in candidates:
        usable, why = backend_status(op, backend, device_index)
        if usable:
            return backend
        reasons.append(f"{backend}: {why}")
    where = "cpu" if device_type == "cpu" else f"cuda:{device_index}"
    raise RuntimeError(f"{op}: no usable backend on {where} ({'; '.join(reasons)})"
                       f"{_env_note(from_env)}")


def resolve_backend(op: str, device: torch.device, backend: str | None = None) -> str:
    """The backend that runs ``op`` on tensors of ``device``; ``backend`` (or the environment
    variable RL_KERNELS_BACKEND) forces one."""
    if backend is not None:
        return _resolve(op, device.type, device.index, backend)
    return _resolve(op, device.type, device.index, _ENV_BACKEND, _ENV_BACKEND is not None)


def get_op(name: str, backend: str | None = None) -> torch.nn.Module:
    """An nn.Module running op ``name``. ``backend`` (or RL_KERNELS_BACKEND) forces cpu, sm80 or
    sm90: checked now, and the module then refuses inputs on a device that backend cannot serve.
    None or "auto": the best usable backend for the inputs' device."""
    cls = _op_class(name)
    if backend == "auto":
        backend = None
    forced = backend if backend is not None else _ENV_BACKEND
    if forced is not None:
        check_backend_name(forced)
        usable, why = backend_status(name, forced)
        if not usable:
            raise RuntimeError(f"{name}: backend {forced!r}{_env_note(backend is None)} is not "
                               f"usable: {why}")
    return cls(backend=backend)


def describe() -> list[dict]:
    """One row per (op, backend) in priority order: usable or why not, and the kernels that may run
    each of the op's entries there (first to last in the fallback chain)."""
    rows = []
    for op in known_ops():
        for backend in BACKENDS:
            usable, why = backend_status(op, backend)
            kernels = "; ".join(" > ".join(kernel_chain(entry, backend)) or f"{entry}: none"
                                for entry in _op_class(op).kernels)
            rows.append({"op": op, "backend": backend, "usable": usable, "why_not": why,
                         "kernels": kernels})
    return rows


def format_table(rows=None) -> str:
    rows = describe() if rows is None else rows
    lines = [f"{'op':<12} {'backend':<8} {'usable':<7} {'why not':<24} kernels (of each entry, the first "
             f"that takes a call runs)", "-" * 110]
    for r in rows:
        lines.append(f"{r['op']:<12} {r['backend']:<8} {'yes' if r['usable'] else 'no':<7} "
                     f"{r['why_not'] or '-':<24} {r['kernels']}")
    if _ENV_BACKEND is not None:
        forced = _ENV_BACKEND
        unusable = sorted({r["op"] for r in rows if r["backend"] == forced and not r["usable"]})
        lines.append(f"RL_KERNELS_BACKEND={_ENV_BACKEND}: every call without backend= runs on "
                     f"{_ENV_BACKEND}" + (f"; here that raises for {', '.join(unusable)} (see "
                                          f"'why not')" if unusable else ""))
    return "\n".join(lines)
