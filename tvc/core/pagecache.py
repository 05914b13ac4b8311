"""How much of a file sits in the kernel's page cache (``mincore``), and dropping it.

A store that claims to bypass the page cache (``O_DIRECT``, GPUDirect Storage)
leaves no resident page of what it wrote; ``mincore(2)`` on a read-only mapping
observes that (as util-linux ``fincore`` does). Linux only; elsewhere
:func:`resident_pages` returns None.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import sys
from pathlib import Path

_PROT_READ = 0x1
_MAP_SHARED = 0x1
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                          ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                             ctypes.POINTER(ctypes.c_ubyte)]
    return libc


def resident_pages(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """``(resident, total)`` pages (``mmap.PAGESIZE``) of a regular file in the cache.

    ``(0, 0)`` for an empty file; None where it cannot be observed (not Linux, not a
    regular file, the mapping or ``mincore`` refused).
    """
    libc = _libc()
    p = Path(path)
    if libc is None or not p.is_file():
        return None
    size = p.stat().st_size
    if size == 0:
        return 0, 0
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(p, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            return None
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                return None
            return sum(v & 1 for v in vec), pages
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)


def drop_cached(path: str | os.PathLike[str]) -> bool:
    """Write back and evict a file's pages (``fsync``, ``POSIX_FADV_DONTNEED``).

    Returns False where the platform has no such advice.
    """
    if not hasattr(os, "posix_fadvise"):
        return False
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return True
        finally:
            os.close(fd)
    return False
