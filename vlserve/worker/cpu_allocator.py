"""glibc malloc settings for CPU serving: keep freed tensor memory in the heap instead of unmapping it.

By default glibc serves every allocation above a (dynamic, at most 32 MiB) threshold with its own mmap and unmaps
it on free, so each large temporary a CPU forward makes (a tower's `[P, 4E]` MLP activation, a prefill's logits)
is faulted in page by page again on every use. In the VMs these machines are, a fresh 8 MiB output cost
`x * x` 7-8 ms against 1 ms into a reused buffer. vLLM-CPU avoids this by preloading tcmalloc; here the same
effect comes from two `mallopt` calls made once per process before the model runs: no mmap below 1 GiB, and no
trimming of the heap's top. Set $VLSERVE_CPU_MALLOC_TUNING=0 to leave glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 30  # allocations at least this big still get their own mapping
DISABLE_ENV = "VLSERVE_CPU_MALLOC_TUNING"


@functools.cache
def tune_cpu_allocator() -> bool:
    """Apply the settings once per process; whether they took effect (False off glibc or when switched off)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    if not ok:
        logger.debug("mallopt refused the CPU allocator settings; glibc's defaults stay")
    return ok
