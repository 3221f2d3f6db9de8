"""The CUDA runtime library torch loaded into this process, for the one call torch's own `torch.cuda.cudart()`
bindings lack: `cudaGetLastError`.

A failed runtime call (cudaHostRegister of memory that cannot be pinned, say) stays recorded as the thread's last
error until someone reads it; torch's next kernel-launch check (`C10_CUDA_KERNEL_LAUNCH_CHECK`, which calls
`cudaGetLastError`) then reports it as that kernel's failure. Where a failure is handled here (pinning is best effort),
reading it clears it. The record lives in the runtime library instance that made the call, so it must be torch's
libcudart (found in /proc/self/maps and opened with RTLD_NOLOAD: never a second copy), not cuda-python's.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

__all__ = ["clear_last_error", "loaded_library"]


def loaded_library(name_prefix: str) -> ctypes.CDLL | None:
    """The already loaded shared library whose file name starts with `name_prefix`, or None (never loads one)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = dict.fromkeys(line.split(maxsplit=5)[5] for line in maps.splitlines()
                          if len(line.split(maxsplit=5)) == 6 and "/" in line.split(maxsplit=5)[5])
    for path in paths:
        if Path(path).name.startswith(name_prefix):
            try:
                return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            except OSError:
                continue
    return None


def clear_last_error() -> int | None:
    """Reads (so clears) this thread's last CUDA runtime error in torch's libcudart: the error it held (0: none), or
    None when no libcudart is loaded (a torch linked statically to it: nothing to reach)."""
    cudart = loaded_library("libcudart.so")
    if cudart is None:
        return None
    return int(cudart.cudaGetLastError())
