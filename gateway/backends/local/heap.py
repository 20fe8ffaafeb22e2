"""The process's heap, tuned for an engine whose tensors come and go in sizes of a few MiB.

glibc serves an allocation below its mmap threshold from the heap, and raises that threshold (up to 32 MiB) each time
a mapped block is freed; so a prefill's activations, each a few MiB, end up in the heap, and the heap, with small
long-lived objects between the freed blocks, cannot shrink: measured, 520 MiB of it lay free at the peak of eight
agent episodes, a quarter of the process. With a fixed threshold of 1 MiB, blocks that large are mapped and go back to
the system when freed; a mapping costs page faults when first written, a few percent of an episode's time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import platform

import structlog

log = structlog.get_logger()

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
THRESHOLD = 1 << 20


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (the tuning calls below are glibc's), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c"))


def map_large_allocations() -> bool:
    """Have glibc map every allocation from ``THRESHOLD`` bytes on; whether it could (not glibc: nothing changes)."""
    libc = _glibc()
    if libc is None:
        return False
    done = bool(libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD))
    if not done:
        log.warning("local.mallopt_failed", parameter="M_MMAP_THRESHOLD", value=THRESHOLD)
    return done


def release_free_memory() -> bool:
    """Collect garbage and hand the heap's free pages back to the system (glibc's ``malloc_trim``): after a phase
    whose tensors are gone (training, an evaluation's engine) the heap keeps its high-water mark otherwise, and the
    next phase's peak adds to it. Whether it could (not glibc: only the collection)."""
    gc.collect()
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))
