"""Host memory page-locked ("pinned") for asynchronous copies from the GPU, without holding Python's lock: torch's
own way (`cudaHostRegister` through its Python binding) holds it for as long as the kernel takes to lock the pages,
about half a second per GB, and every other thread of the process, the training's included, waits. Here the driver's
`cuMemHostRegister` is called through ctypes, which lets go of the lock for the call."""

from __future__ import annotations

import ctypes
import weakref

import torch

_PORTABLE = 1  # CU_MEMHOSTREGISTER_PORTABLE, as torch pins: pinned for every CUDA context
_driver: ctypes.CDLL | None = None


def _cuda_driver() -> ctypes.CDLL:
    global _driver
    if _driver is None:
        driver = ctypes.CDLL("libcuda.so.1")  # a CDLL's calls release Python's lock (a PyDLL's would not)
        driver.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        driver.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        _driver = driver
    return _driver


def pin(storage: torch.UntypedStorage) -> None:
    """Page-lock a CPU storage's memory for as long as the storage lives, from any thread that has used CUDA (the
    driver pins in the thread's current context)."""
    driver = _cuda_driver()
    address, size = storage.data_ptr(), storage.nbytes()
    error = driver.cuMemHostRegister_v2(address, size, _PORTABLE)
    if error:
        raise RuntimeError(f"pinning {size / 2**30:.2f} GiB of host memory for the background checkpoint failed "
                           f"(CUDA driver error {error}): free host memory, or set --checkpoint.async_save=false")
    weakref.finalize(storage, driver.cuMemHostUnregister, address).atexit = False  # the driver may be gone by then
