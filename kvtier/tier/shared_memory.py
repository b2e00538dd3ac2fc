"""Host memory that several processes of one machine map: a named segment in ``/dev/shm``, seen as a uint8 tensor.

Ranks whose KV is the same (MLA under TP: the latent is replicated on every TP rank) hold one host pool between
them instead of a copy each: one rank creates the segment, the others open it by name, and once every rank has
mapped it the creator unlinks the name, so the memory goes away with the last process that maps it (a crash leaves
nothing behind in ``/dev/shm``). The segment knows nothing of pools, engines or kernels.
"""

from __future__ import annotations

import mmap
import os
import secrets

import torch

__all__ = ["SharedSegment", "SHM_DIR"]

SHM_DIR = "/dev/shm"


class SharedSegment:
    """A mapped segment of ``nbytes`` bytes; :attr:`tensor` is a uint8 view of it (alive while the segment is)."""

    def __init__(self, name: str, nbytes: int, *, create: bool) -> None:
        if nbytes <= 0:
            raise ValueError(f"a shared segment needs > 0 bytes, got {nbytes}")
        self.name, self.nbytes = name, int(nbytes)
        self.path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:  # the memory itself, now: tmpfs past its size would kill the process on first touch
                os.posix_fallocate(fd, 0, self.nbytes)
            elif os.fstat(fd).st_size != self.nbytes:
                raise ValueError(f"shared segment {self.path} holds {os.fstat(fd).st_size} bytes, not {self.nbytes}")
            self._map = mmap.mmap(fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            if create:
                self.unlink()
            raise
        os.close(fd)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

    @classmethod
    def create(cls, nbytes: int, prefix: str = "kvtier") -> "SharedSegment":
        """A new segment under a fresh random name."""
        return cls(f"{prefix}-{os.getpid()}-{secrets.token_hex(8)}", nbytes, create=True)

    @classmethod
    def open(cls, name: str, nbytes: int) -> "SharedSegment":
        """Map the segment another process created (FileNotFoundError: it is not on this machine)."""
        return cls(name, nbytes, create=False)

    def unlink(self) -> None:
        """Remove the name (mappings stay valid; the memory goes with the last of them). Idempotent."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def inode(self) -> tuple[int, int]:
        """(device, inode) of the segment as this process maps it: equal in every process mapping one segment."""
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and fields[5] == self.path:
                    major, minor = (int(x, 16) for x in fields[3].split(":"))
                    return os.makedev(major, minor), int(fields[4])
        raise LookupError(f"{self.path} is not mapped by this process")
