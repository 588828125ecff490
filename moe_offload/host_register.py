"""Pin memory that torch did not allocate (the expert store's shared-memory mapping) and let the
device read it in place.

torch exposes no ``cudaHostGetDevicePointer``, so the runtime is called through ctypes, on the very
``libcudart`` that torch loaded (found in ``/proc/self/maps``), so that device selection and the
primary context are the ones torch uses.
"""
from __future__ import annotations

import ctypes
import functools
import os

import torch

HOST_REGISTER_PORTABLE = 1
HOST_REGISTER_MAPPED = 2


def _loaded_cudart_paths() -> list[str]:
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "/" in line}
    return sorted(p for p in paths if os.path.basename(p).startswith("libcudart"))


@functools.cache
def _cudart() -> ctypes.CDLL:
    torch.cuda.init()
    candidates = _loaded_cudart_paths() + ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    for candidate in candidates:
        try:
            lib = ctypes.CDLL(candidate)
            break
        except OSError:
            continue
    else:
        raise RuntimeError(f"cannot load the CUDA runtime (tried {candidates})")
    lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    lib.cudaHostGetDevicePointer.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_uint]
    lib.cudaGetErrorName.argtypes = [ctypes.c_int]
    lib.cudaGetErrorName.restype = ctypes.c_char_p
    return lib


def _check(err: int, what: str) -> None:
    if err != 0:
        raise RuntimeError(f"{what} failed: {_cudart().cudaGetErrorName(err).decode()} ({err})")


def host_register(ptr: int, nbytes: int, device: torch.device) -> int:
    """Register ``[ptr, ptr + nbytes)`` as pinned, mapped, portable memory; returns its device pointer."""
    lib = _cudart()
    with torch.cuda.device(device):
        _check(lib.cudaHostRegister(ptr, nbytes, HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED), "cudaHostRegister")
    try:
        return pinned_device_pointer(ptr, device)
    except RuntimeError:
        lib.cudaHostUnregister(ptr)
        raise


def pinned_device_pointer(ptr: int, device: torch.device) -> int:
    """The device address of pinned memory (registered, or ``torch.empty(..., pin_memory=True)``)."""
    with torch.cuda.device(device):
        device_ptr = ctypes.c_void_p()
        _check(_cudart().cudaHostGetDevicePointer(ctypes.byref(device_ptr), ptr, 0), "cudaHostGetDevicePointer")
    return device_ptr.value


def host_unregister(ptr: int) -> None:
    _check(_cudart().cudaHostUnregister(ptr), "cudaHostUnregister")


class _MappedHostMemory:
    """Lets ``torch.as_tensor`` wrap a device pointer without a copy. torch keeps this object, and
    through it ``owner``, alive for as long as any tensor over the memory lives."""

    def __init__(self, device_ptr: int, nbytes: int, owner: object):
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (device_ptr, False),
            "strides": None,
            "version": 3,
        }


def mapped_device_bytes(device_ptr: int, nbytes: int, device: torch.device, owner: object) -> torch.Tensor:
    """A ``uint8 [nbytes]`` CUDA tensor over mapped host memory: kernels read the host pages over PCIe."""
    tensor = torch.as_tensor(_MappedHostMemory(device_ptr, nbytes, owner), device=device)
    if tensor.data_ptr() != device_ptr:
        raise RuntimeError(f"torch copied mapped host memory to {tensor.device} instead of viewing it")
    return tensor


def pinned_device_view(pinned: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over pinned host memory (mapped: the device reads and writes it over PCIe), of
    ``pinned``'s shape and dtype, so torch sees its copies as device-to-device (capturable in a
    CUDA graph) and kernels read it zero-copy."""
    nbytes = pinned.numel() * pinned.element_size()
    device_ptr = pinned_device_pointer(pinned.data_ptr(), device)
    return mapped_device_bytes(device_ptr, nbytes, device, owner=pinned).view(pinned.dtype).view(pinned.shape)
