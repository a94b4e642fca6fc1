"""What every op module shares: the torch.library namespace, dtype codes for _C, the backend and raw
stream of a call, the eager fast-path test, and argument checks with torch-like messages."""

from __future__ import annotations

import ctypes
import numbers

import torch

from .. import _C
from ..kernel_registry import BACKENDS, backend_code, resolve_backend

LIBRARY = torch.library.Library("rl_kernels", "DEF")

DTYPE_CODES = {torch.float32: _C.DTYPE_F32, torch.bfloat16: _C.DTYPE_BF16,
               torch.float16: _C.DTYPE_F16, torch.float64: _C.DTYPE_F64}
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

_resolved: dict = {}  # (op, device, backend) -> backend code: routing never changes in a process
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def backend_and_stream(op: str, device: torch.device, backend: str | None) -> tuple[int, int]:
    """(backend code for _C, raw CUDA stream handle or 0 on the CPU) for a call of `op` on tensors
    of `device`; backend None or "auto" picks the best usable one."""
    key = (op, device, backend)
    try:
        code = _resolved.get(key)
    except TypeError:  # an unhashable backend= (a list, ...): check_backend below says so
        code = None
    if code is None:
        check_backend(op, backend)
        name = resolve_backend(op, device, None if backend == "auto" else backend)
        code = _resolved[key] = backend_code(name)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        # torch.cuda.current_stream().cuda_stream costs ~5 us; the raw getter well under 1 us.
        return code, _raw_stream(index)
    return code, 0


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # Parameter disables __torch_function__


def eager_direct(*tensors) -> bool:
    """True when a call can skip the torch.library dispatcher: eager mode, plain tensors or
    parameters (None allowed), and no autograd graph to record. Otherwise the call goes through the
    registered op (torch.compile, tensor subclasses, autograd). It runs on every call, so it stays
    a flat loop."""
    if _is_compiling():
        return False
    grad = _grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) not in _PLAIN_TENSORS or (grad and t.requires_grad):
            return False
    return True


def type_name(value) -> str:
    """The type of value as an error message names it: 'list', 'NoneType', 'numpy.int64'."""
    cls = type(value)
    module = cls.__module__
    if module == "builtins":
        return cls.__qualname__
    return f"{module.split('.')[0]}.{cls.__qualname__}"


_BACKEND_ARGS = frozenset((*BACKENDS, "auto"))


def check_backend(op: str, backend) -> None:
    """backend= of a public function: None, "auto" or a backend name (TypeError / ValueError naming
    the argument otherwise; a near miss such as 'CPU' or 'cpu ' is pointed out)."""
    if backend is None or (type(backend) is str and backend in _BACKEND_ARGS):
        return
    choices = f"None, 'auto', {', '.join(repr(b) for b in BACKENDS)}"
    if not isinstance(backend, str):
        raise TypeError(f"{op}(): backend must be a str ({choices}), got {type_name(backend)}")
    near = backend.strip().lower()
    hint = f" (did you mean {near!r}?)" if near in _BACKEND_ARGS else ""
    raise ValueError(f"{op}(): unknown backend {backend!r}{hint}; expected {choices}")


def backend_arg(op: str, backend) -> str:
    """backend= checked (check_backend), as the op schema's string: None is "auto" (not
    `backend or "auto"`, which would let '', 0 or False through as "auto")."""
    check_backend(op, backend)
    return "auto" if backend is None else backend


def check_tensor(op: str, name: str, value) -> None:
    """TypeError naming the argument unless value is a torch.Tensor."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}(): {name} must be a torch.Tensor, got {type_name(value)}")
    if value.layout is not torch.strided:
        raise TypeError(f"{op}(): {name} must be a dense (strided) tensor, got layout {value.layout}")


def check_float_tensors(op: str, **tensors) -> None:
    """Every argument a dense float tensor of one dtype (rl_kernels does not promote dtypes)."""
    dtype = None
    for name, t in tensors.items():
        check_tensor(op, name, t)
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}(): {name} has dtype {t.dtype}; expected float32, bfloat16, "
                            f"float16 or float64")
        if dtype is not None and t.dtype != dtype:
            first = next(iter(tensors))
            raise TypeError(f"{op}(): {name} has dtype {t.dtype} but {first} has {dtype}; "
                            f"rl_kernels does not promote dtypes (torch.matmul does not either)")
        dtype = t.dtype


def real_number(op: str, name: str, value) -> float:
    """value as a Python float: real numbers, numpy scalars and 0-d tensors; not bool, str, None,
    and not a tensor that requires grad (the ops take scalars as constants: its gradient would be
    silently lost)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{op}(): {name} must be a real number or a 0-d real tensor, got a "
                            f"{value.dim()}-d {value.dtype} tensor")
        _check_no_grad(op, name, value)
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{op}(): {name} must be a real number, got {type_name(value)}")
    try:
        return float(value)
    except OverflowError:  # an int past float64's range
        raise ValueError(f"{op}(): {name} (an int of {int(value).bit_length()} bits) does not fit "
                         f"in a float64") from None


def integer(op: str, name: str, value) -> int:
    """value as a Python int: int, numpy integers and 0-d integer tensors (as torch takes an int
    argument); not bool, float, str or None."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.is_floating_point() or value.is_complex() \
                or value.dtype == torch.bool:
            raise TypeError(f"{op}(): {name} must be an int or a 0-d integer tensor, got a "
                            f"{value.dim()}-d {value.dtype} tensor")
        return int(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{op}(): {name} must be an int, got {type_name(value)}")
    return int(value)


def boolean(op: str, name: str, value) -> bool:
    """value as a Python bool: bool or numpy.bool_; not 0/1, strings or None."""
    if isinstance(value, bool) or type_name(value) in ("numpy.bool", "numpy.bool_"):
        return bool(value)
    raise TypeError(f"{op}(): {name} must be a bool, got {type_name(value)}")


def _check_no_grad(op: str, name: str, value: torch.Tensor) -> None:
    if value.requires_grad and torch.is_grad_enabled():
        raise TypeError(f"{op}(): {name} is a tensor that requires grad, but {op} takes {name} as "
                        f"a constant and computes no gradient for it; pass {name}.item() or "
                        f"{name}.detach()")


class DeviceErrorFlag:
    """A pinned host int32 that CUDA kernels set (host-mapped memory, no sync) when they meet bad
    data that could not be checked before the launch without a sync (a target id, a sequence range).
    The next call of the op reads it (no sync either) and raises ValueError with `message`."""

    def __init__(self, message: str):
        self.message = message
        self._flags: dict[int, torch.Tensor] = {}  # device index -> the pinned tensor (owns the memory)
        # the same ints as ctypes objects, read on every call of the op: a plain load (~0.1 us),
        # where flag[0].item() builds a tensor view first (a few us)
        self._values: list[ctypes.c_int32] = []

    def address(self, device: torch.device) -> int:
        """The flag's address for kernels on `device` (0 on the CPU: CPU kernels raise at once)."""
        if device.type != "cuda":
            return 0
        index = device.index if device.index is not None else torch.cuda.current_device()
        flag = self._flags.get(index)
        if flag is None:
            flag = self._flags[index] = torch.zeros(1, dtype=torch.int32, pin_memory=True)
            self._values.append(ctypes.c_int32.from_address(flag.data_ptr()))
        return flag.data_ptr()

    def raise_if_set(self) -> None:
        for value in self._values:
            if value.value != 0:
                value.value = 0
                raise ValueError(self.message)


def prod(sizes) -> int:
    count = 1
    for size in sizes:
        count = count * size
    return count


__all__ = ["DTYPE_CODES", "DeviceErrorFlag", "FLOAT_DTYPES", "LIBRARY", "backend_and_stream", "backend_arg",
           "boolean", "check_backend", "check_float_tensors", "check_tensor", "eager_direct",
           "integer", "prod", "real_number", "type_name"]
