"""The C heap's policy for tensor-sized blocks: reuse freed memory instead of mapping it anew.

glibc serves a large block with a fresh memory mapping, and hands the free top of its heap back
to the kernel. A training step frees and allocates many blocks of the same sizes (the
attention's (B, L, A) tensors are 12.8 MB at batch 32, 196 locations, A 512), and each fresh
mapping is page-faulted in and zeroed by the kernel again: about 5,600 page faults for one
such tensor and its sum. Kept mapped, the same blocks are reused. PyTorch's CPU performance
guide recommends jemalloc or tcmalloc for this reason; this gets the same effect from glibc's
own `mallopt`. The measured effect on the training step is in docs/benchmarks.md.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
#: glibc's largest mmap threshold on 64-bit: blocks up to this size come from the heap.
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
TRIM_NEVER = 2**31 - 1  # the heap's free top stays mapped for the next step


def keep_freed_memory() -> bool:
    """Serve blocks up to 32 MiB from the heap and keep freed heap memory mapped, for this
    process and the processes it forks (loader workers). A process's peak resident memory then
    stays in use until it exits. False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # musl and others: no libc.so.6, or no mallopt
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_NEVER))
