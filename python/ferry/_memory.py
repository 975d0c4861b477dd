"""What memory a Python object holds: its address, size and device.

Ferry registers memory by address; applications hold it in objects:
torch tensors (CPU or CUDA), CuPy and Numba arrays
(``__cuda_array_interface__``), anything that speaks DLPack
(``__dlpack__``), and host buffers (the buffer protocol). ``describe``
finds the range and the device of each, so ``Engine.register(tensor)``
needs no pointer arithmetic and no location string. It never touches the
bytes: device memory is not readable by the CPU.

Only C-contiguous objects are accepted: a strided view's bytes are not one
range, and registering its bounding range would expose memory the view
does not own.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ferry import errors
from ferry.errors import FerryError


@dataclass(frozen=True)
class Memory:
    addr: int
    length: int
    # "cuda:N" for device memory, "cpu:0" for host memory, "*" where the
    # engine is to find out from the pointer (CUDA array interface).
    location: str
    readonly: bool = False


def _bad(message: str) -> FerryError:
    return FerryError(errors.INVALID_ARGUMENT, message)


def _is_contiguous(shape: Sequence[int], strides: Sequence[int],
                   itemsize: int) -> bool:
    """C-contiguous: byte strides as a packed row-major array's, except
    along dimensions of size 1, whose stride never moves (producers put
    anything there)."""
    step = itemsize
    for dim, stride in zip(reversed(list(shape)), reversed(list(strides))):
        if int(dim) != 1 and int(stride) != step:
            return False
        step *= max(int(dim), 1)
    return True


def _from_torch(t: Any) -> Memory:
    if not t.is_contiguous():
        raise _bad("the tensor is not contiguous: register "
                   "tensor.contiguous() (a copy) or its base tensor")
    device = t.device
    if device.type == "cuda":
        location = f"cuda:{device.index if device.index is not None else 0}"
    elif device.type == "cpu":
        location = "cpu:0"
    else:
        raise _bad(f"tensors on '{device.type}' are not supported: only "
                   "cpu and cuda")
    return Memory(int(t.data_ptr()), int(t.element_size() * t.numel()),
                  location)


def _from_cai(obj: Any) -> Memory:
    cai = obj.__cuda_array_interface__
    ptr, readonly = cai["data"]
    shape = [int(d) for d in cai["shape"]]
    itemsize = int(cai["typestr"][2:]) if len(cai["typestr"]) > 2 else 0
    if itemsize <= 0:
        raise _bad(f"unknown typestr {cai['typestr']!r} in "
                   "__cuda_array_interface__")
    strides = cai.get("strides")
    if strides is not None and not _is_contiguous(shape, strides, itemsize):
        raise _bad("the array is not C-contiguous (its "
                   "__cuda_array_interface__ has strides); register a "
                   "contiguous copy")
    # The interface does not say which GPU: the engine asks the driver.
    return Memory(int(ptr or 0), math.prod(shape) * itemsize, "*",
                  bool(readonly))


# DLPack's C structures (dlpack.h, ABI stable since v0.2).
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8),
                ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice),
                ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


_KDL_CPU, _KDL_CUDA, _KDL_CUDA_HOST, _KDL_CUDA_MANAGED = 1, 2, 3, 13

_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _from_dlpack(obj: Any) -> Memory:
    capsule = obj.__dlpack__()
    # The capsule stays unconsumed ("dltensor"), so its destructor gives
    # the producer's manager back; `obj`, which the caller keeps alive
    # while registered, owns the bytes.
    try:
        tensor = _DLTensor.from_address(
            _capsule_pointer(capsule, b"dltensor"))
    except ValueError as e:  # A versioned capsule, or not DLPack at all.
        raise _bad(f"__dlpack__ gave no unversioned DLPack capsule ({e}); "
                   "pass the object's data_ptr() or CUDA array "
                   "interface instead") from e
    kind, device = tensor.device.device_type, tensor.device.device_id
    if kind in (_KDL_CPU, _KDL_CUDA_HOST):
        location = "cpu:0"
    elif kind in (_KDL_CUDA, _KDL_CUDA_MANAGED):
        location = f"cuda:{device}"
    else:
        raise _bad(f"DLPack device type {kind} is not supported: only CPU "
                   "and CUDA memory")
    dtype = tensor.dtype
    if (dtype.bits * dtype.lanes) % 8 != 0:
        raise _bad(f"DLPack dtype of {dtype.bits} bits x {dtype.lanes} "
                   "lanes is not whole bytes")
    itemsize = dtype.bits * dtype.lanes // 8
    shape = [tensor.shape[i] for i in range(tensor.ndim)]
    if tensor.strides:
        strides = [tensor.strides[i] * itemsize for i in range(tensor.ndim)]
        if not _is_contiguous(shape, strides, itemsize):
            raise _bad("the DLPack tensor is not C-contiguous; register a "
                       "contiguous copy")
    return Memory((tensor.data or 0) + tensor.byte_offset,
                  math.prod(shape) * itemsize, location)


def describe(obj: Any, buffer_address=None) -> Optional[Memory]:
    """The memory `obj` holds, or None if it is none of the kinds above
    but a buffer-protocol object (the caller then uses memoryview)."""
    if callable(getattr(obj, "data_ptr", None)) and hasattr(obj, "device"):
        return _from_torch(obj)
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_cai(obj)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        try:
            memoryview(obj).release()  # A host buffer: the usual path.
            return None
        except TypeError:
            return _from_dlpack(obj)
    return None
