"""The CUDA driver calls the ``cuda`` backend makes, through cuda-python.

A thin layer: each method makes one driver call and raises :class:`CudaError` (with the
``CUresult`` name) when it fails. Keeping the driver behind this class lets tests replace
it with a recording fake that checks which context each call ran in.

cuda-python raises (rather than returning a ``CUresult``) when no driver library can be
loaded; :class:`CudaDriver` turns that into
:class:`~kvshare.runtime.errors.BackendUnavailableError` with the reason.
"""

from __future__ import annotations

from typing import Any

from kvshare.runtime.errors import BackendError, BackendUnavailableError

__all__ = ["CudaDriver", "CudaError"]


class CudaError(BackendError):
    """A CUDA driver call returned an error."""

    def __init__(self, call: str, code: Any) -> None:
        self.call = call
        self.code = int(code)
        self.code_name = getattr(code, "name", str(code))
        super().__init__(f"{call} failed: {self.code_name}")

    @property
    def out_of_memory(self) -> bool:
        """Whether the device had no memory for the call."""
        return self.code_name == "CUDA_ERROR_OUT_OF_MEMORY"


class CudaDriver:
    """cuda-python's driver bindings, one method per call the backend needs."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver
        except ImportError as exc:
            raise BackendUnavailableError(f"cuda-python is not installed ({exc})") from None
        self._cu = driver
        try:
            self._check("cuInit", driver.cuInit(0))
        except CudaError as exc:
            raise BackendUnavailableError(f"the CUDA driver cannot start: {exc}") from None
        except RuntimeError as exc:  # cuda-python raises when it finds no driver library
            raise BackendUnavailableError(f"no CUDA driver on this machine: {exc}") from None

    def _check(self, call: str, result: tuple[Any, ...]) -> Any:
        code = result[0]
        if code != self._cu.CUresult.CUDA_SUCCESS:
            raise CudaError(call, code)
        if len(result) == 1:
            return None
        return result[1] if len(result) == 2 else result[1:]

    # --- devices and contexts ---------------------------------------------------------

    def device_get(self, ordinal: int) -> Any:
        return self._check("cuDeviceGet", self._cu.cuDeviceGet(ordinal))

    def vmm_supported(self, device: Any) -> bool:
        attribute = (
            self._cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        )
        return bool(
            self._check("cuDeviceGetAttribute", self._cu.cuDeviceGetAttribute(attribute, device))
        )

    def primary_ctx_retain(self, device: Any) -> Any:
        return self._check("cuDevicePrimaryCtxRetain", self._cu.cuDevicePrimaryCtxRetain(device))

    def primary_ctx_release(self, device: Any) -> None:
        self._check("cuDevicePrimaryCtxRelease", self._cu.cuDevicePrimaryCtxRelease(device))

    def ctx_push(self, context: Any) -> None:
        self._check("cuCtxPushCurrent", self._cu.cuCtxPushCurrent(context))

    def ctx_pop(self) -> None:
        self._check("cuCtxPopCurrent", self._cu.cuCtxPopCurrent())

    # --- virtual memory -------------------------------------------------------------------

    def _prop(self, device: Any) -> Any:
        cu = self._cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = int(device)
        return prop

    def granularity(self, device: Any) -> int:
        option = self._cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        result = self._cu.cuMemGetAllocationGranularity(self._prop(device), option)
        return int(self._check("cuMemGetAllocationGranularity", result))

    def mem_address_reserve(self, size: int, alignment: int) -> int:
        return int(
            self._check("cuMemAddressReserve", self._cu.cuMemAddressReserve(size, alignment, 0, 0))
        )

    def mem_address_free(self, address: int, size: int) -> None:
        self._check("cuMemAddressFree", self._cu.cuMemAddressFree(address, size))

    def mem_create(self, size: int, device: Any) -> Any:
        return self._check("cuMemCreate", self._cu.cuMemCreate(size, self._prop(device), 0))

    def mem_release(self, handle: Any) -> None:
        self._check("cuMemRelease", self._cu.cuMemRelease(handle))

    def mem_map(self, address: int, size: int, handle: Any) -> None:
        self._check("cuMemMap", self._cu.cuMemMap(address, size, 0, handle, 0))

    def mem_set_access(self, address: int, size: int, device: Any) -> None:
        cu = self._cu
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = int(device)
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._check("cuMemSetAccess", cu.cuMemSetAccess(address, size, [access], 1))

    def mem_unmap(self, address: int, size: int) -> None:
        self._check("cuMemUnmap", self._cu.cuMemUnmap(address, size))

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self._check("cuMemGetInfo", self._cu.cuMemGetInfo())
        return int(free), int(total)

    # --- events (the device fence) ----------------------------------------------------------

    def event_create(self) -> Any:
        flags = self._cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        return self._check("cuEventCreate", self._cu.cuEventCreate(flags))

    def event_record(self, event: Any, stream: int) -> None:
        self._check("cuEventRecord", self._cu.cuEventRecord(event, self._cu.CUstream(stream)))

    def event_synchronize(self, event: Any) -> None:
        self._check("cuEventSynchronize", self._cu.cuEventSynchronize(event))

    def event_destroy(self, event: Any) -> None:
        self._check("cuEventDestroy", self._cu.cuEventDestroy(event))
