"""Stores that make false claims about themselves, for the store tier's self-tests.

``open_claims_direct_store`` is a ``[store] factory`` (put this folder on
PYTHONPATH): the POSIX reference store with buffered I/O that reports
``direct_io=True``. On a GPU host, ``suites/real_nvme`` with it must fail
``test_store_direct_io_claim_holds``.
"""

from __future__ import annotations

from pathlib import Path

from tvc.store.gpu_direct import PosixStore


class ClaimsDirectStore(PosixStore):
    """Writes through the page cache (buffered) but reports direct_io=True."""

    def __init__(self, path: Path, pool_bytes: int) -> None:
        super().__init__(path, pool_bytes, direct=False)
        self.direct_io = True


def open_claims_direct_store(path: Path, pool_bytes: int) -> ClaimsDirectStore:
    """``[store] factory``: a :class:`ClaimsDirectStore` at ``path``."""
    return ClaimsDirectStore(Path(path), pool_bytes)
