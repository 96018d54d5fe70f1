"""Zero-copy torch tensors over raw device addresses, through DLPack and ctypes.

The ``cuda`` backend needs a torch tensor over memory it mapped itself, without a C++
extension. A DLPack capsule describes the memory; ``torch.from_dlpack`` wraps it without
copying and without asking the driver about the pointer (which an unmapped part of a
reservation could not answer).
"""

from __future__ import annotations

import ctypes
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["DEVICE_CPU", "DEVICE_CUDA", "tensor_from_address"]

DEVICE_CPU = 1  # kDLCPU
DEVICE_CUDA = 2  # kDLCUDA
_UINT = 1  # kDLUInt


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# torch reads a managed tensor's (null) deleter when the tensor's storage dies, which may
# be after every Python object of the caller is gone: the descriptors live for the process.
# One per reservation, a few hundred bytes each.
_keepalive: list[object] = []
_keepalive_lock = threading.Lock()


def tensor_from_address(
    address: int, size: int, *, device_type: int, device_id: int
) -> torch.Tensor:
    """A 1-D uint8 tensor over ``size`` bytes at ``address`` on the given DLPack device."""
    from torch.utils.dlpack import from_dlpack

    shape = (ctypes.c_int64 * 1)(size)
    strides = (ctypes.c_int64 * 1)(1)
    managed = _DLManagedTensor()
    managed.dl_tensor.data = address
    managed.dl_tensor.device = _DLDevice(device_type, device_id)
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = _DLDataType(_UINT, 8, 1)
    managed.dl_tensor.shape = shape
    managed.dl_tensor.strides = strides
    managed.dl_tensor.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = None
    with _keepalive_lock:
        _keepalive.append((managed, shape, strides))
    capsule = _capsule_new(ctypes.addressof(managed), b"dltensor", None)
    return from_dlpack(capsule)
