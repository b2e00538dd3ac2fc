"""Disk space held in a file of its own for another file to grow into.

A block file is preallocated whole, so its writes never find the disk full; its journal grows and shrinks. The journal
keeps the most it can take allocated in a reserve file beside it: when the disk is full (another program took the
rest), the journal gives back reserve pages and writes into them, and takes them back once it has compacted.
"""

from __future__ import annotations

import errno
import os

from kvtier.storage.block_format import ALIGN

__all__ = ["Reserve", "preallocate"]


def preallocate(fd: int, nbytes: int) -> None:
    """Allocate the first ``nbytes`` of the file ``fd`` now, so that writes into them never find the disk full (a
    full disk raises OSError ENOSPC here instead); a file system without fallocate gets a sparse file of that
    size."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, nbytes)


class Reserve:
    """``nbytes`` (whole pages) allocated in the file at ``path`` (created, or resized if present).

    Raises OSError (ENOSPC) when the disk has not that much room."""

    def __init__(self, path: str, nbytes: int) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not self.refill(nbytes):
                raise OSError(errno.ENOSPC, f"no room for {nbytes} bytes of reserve", path)
        except BaseException:
            self.close()
            raise

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return os.fstat(self._fd).st_size

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` (rounded up to whole pages, at most what is held) to the disk."""
        os.ftruncate(self._fd, max(0, self.nbytes - -(-nbytes // ALIGN) * ALIGN))

    def refill(self, nbytes: int) -> bool:
        """Hold ``nbytes`` (whole pages, at least 0) again; False when the disk has no room for them (what could be
        allocated stays held)."""
        want = max(0, -(-nbytes // ALIGN) * ALIGN)
        if self.nbytes > want:
            os.ftruncate(self._fd, want)
            return True
        if want == 0:
            return True
        try:
            preallocate(self._fd, want)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                return False
            raise
        return True

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
