"""The CUDA driver API over ctypes, for tests on softgpu's emulated GPUs
(run_pytest.sh puts its libcuda.so.1 first on LD_LIBRARY_PATH), and
objects that hold device memory the ways applications' objects do: the
CUDA array interface (CuPy), DLPack, and torch's tensor methods (duck-typed:
torch is not installed in CI)."""

import ctypes
import math

_lib = None


def driver():
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL("libcuda.so.1")
        check(_lib.cuInit(0), "cuInit")
    return _lib


def check(result, what):
    if result != 0:
        raise RuntimeError(f"{what} failed: CUresult {result}")


def use_device(device):
    lib = driver()
    dev = ctypes.c_int()
    check(lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev),
          "cuDevicePrimaryCtxRetain")
    check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def alloc(device, nbytes):
    use_device(device)
    ptr = ctypes.c_uint64()
    check(driver().cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)),
          "cuMemAlloc")
    return ptr.value


def free(ptr):
    driver().cuMemFree_v2(ctypes.c_uint64(ptr))


def to_device(ptr, data):
    check(driver().cuMemcpyHtoD_v2(ctypes.c_uint64(ptr), data,
                                   ctypes.c_size_t(len(data))), "cuMemcpyHtoD")


def from_device(ptr, nbytes):
    buf = ctypes.create_string_buffer(nbytes)
    check(driver().cuMemcpyDtoH_v2(buf, ctypes.c_uint64(ptr),
                                   ctypes.c_size_t(nbytes)), "cuMemcpyDtoH")
    return buf.raw


def pattern(nbytes, seed):
    block = bytes((i * 31 + seed * 7 + 1) & 0xFF for i in range(251))
    return (block * (nbytes // len(block) + 1))[:nbytes]


class DeviceArray:
    """A C-contiguous uint8 array in device memory, CuPy-style."""

    def __init__(self, device, shape, strides=None):
        self.device = device
        self.shape = tuple(shape)
        self.nbytes = math.prod(self.shape)
        self.ptr = alloc(device, self.nbytes)
        self._strides = strides

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": "|u1",
                "data": (self.ptr, False), "strides": self._strides,
                "version": 3}

    def free(self):
        free(self.ptr)


class TorchLike:
    """torch.Tensor's memory methods over device memory (torch is not
    installed here; Ferry duck-types tensors)."""

    class _Device:
        def __init__(self, index):
            self.type, self.index = "cuda", index

    def __init__(self, device, nbytes, contiguous=True):
        self.device = TorchLike._Device(device)
        self._ptr = alloc(device, nbytes)
        self._n = nbytes
        self._contiguous = contiguous

    def data_ptr(self):
        return self._ptr

    def element_size(self):
        return 2  # float16, as KV caches often are.

    def numel(self):
        return self._n // 2

    def is_contiguous(self):
        return self._contiguous

    def free(self):
        free(self._ptr)


# DLPack's structures, written here again on purpose rather than imported
# from ferry._memory: a producer sharing the consumer's definitions would
# hide a layout mistake in them.
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


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class DLPackArray:
    """Device memory exported through DLPack (float32, 1-D)."""

    def __init__(self, device, nbytes):
        self.device = device
        self.nbytes = nbytes
        self.ptr = alloc(device, nbytes)
        self._shape = (ctypes.c_int64 * 1)(nbytes // 4)
        self._managed = _DLManagedTensor()
        t = self._managed.dl_tensor
        t.data = self.ptr
        t.device = _DLDevice(2, device)  # kDLCUDA
        t.ndim = 1
        t.dtype = _DLDataType(2, 32, 1)  # float32
        t.shape = self._shape
        t.strides = None
        t.byte_offset = 0

    def __dlpack__(self, stream=None):
        # No deleter: this object owns the structure.
        return _capsule_new(ctypes.addressof(self._managed), b"dltensor", None)

    def __dlpack_device__(self):
        return (2, self.device)

    def free(self):
        free(self.ptr)
