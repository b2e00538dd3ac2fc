"""Host blocks in a Mooncake Store: the client of a ``mooncake_master`` and of the segments its clients mount.

A value is one block: its 4 KiB header (:mod:`kvtier.storage.block_format`: fingerprint, namespace, chain hash,
tokens, payload length and checksum) followed by the block's KV bytes, put from and got into registered memory
(the header from the caller's header buffer, the payload from its CPU block's byte ranges, or both from one staging
buffer: Mooncake's TCP transport moves each range as a transfer of its own, so the tier stages blocks that are not
one range). A key names
a block by the store's key prefix, the fingerprint and the chain hash, so a stale key, a hash collision or a
corrupted value is caught by the header checks of the reader, never served.

This module knows neither the engine nor the kernels; it calls the Mooncake Python client
(``mooncake-transfer-engine``, the ``kvtier[remote]`` extra). Its calls block; the tier runs them off the engine's
threads and bounds how long it waits for them.
"""

from __future__ import annotations

import socket
import threading
from typing import Optional, Sequence

from kvtier._checks import split_host_port

__all__ = ["MooncakeStore", "RemoteStoreError", "block_key", "Ranges", "CODE_UNREACHABLE", "unreachable", "gone",
           "transfer_failed"]

Ranges = Sequence[tuple[int, int]]  # (address, bytes) of registered memory, in value order

# Mooncake error codes (mooncake-store/include/types.h) the tier tells apart; other negatives are per-key failures.
CODE_NOT_FOUND = -704
CODE_UNREACHABLE = (-900, -901)  # RPC_FAIL, the master did not answer (dead, stopped, unreachable)
# The value is not there to read: not found, its replica not ready, gone, or its lease expired.
CODE_GONE = (CODE_NOT_FOUND, -703, -707, -710, -712)
# The holder did not serve the value: TRANSFER_FAIL (dead, hung, or a size mismatch), its segment or client unknown
# to the master (-101, -103). Not the rest of the -8xx range (CHECKSUM_MISMATCH, -801, is corruption).
CODE_TRANSFER_FAIL = (-800, -101, -103)


class RemoteStoreError(RuntimeError):
    """The remote store cannot be used (not installed, master not reachable, set-up or registration failed)."""


def block_key(prefix: str, fingerprint: bytes, chain_hash: int) -> str:
    """The key of a block: ``{prefix}/{fingerprint hex}/{chain hash hex}``."""
    return f"{prefix}/{fingerprint.hex()}/{int(chain_hash):016x}"


def _split(addr: str) -> tuple[str, int]:
    try:
        return split_host_port(addr)
    except ValueError as e:
        raise RemoteStoreError(f"kvtier: remote_master {e}") from None


def check_reachable(master: str, timeout_s: float) -> None:
    """Raise a :class:`RemoteStoreError` naming ``master`` unless a TCP connection to it opens within the
    timeout (Mooncake's own set-up retries for about 90 s before it gives up)."""
    host, port = _split(master)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as e:
        raise RemoteStoreError(
            f"kvtier: the Mooncake master at {master} is not reachable ({e.strerror or e}); start it "
            f"(mooncake_master --rpc_port={port}) or set remote_required: false to run without the remote tier"
        ) from None


class MooncakeStore:
    """A Mooncake Store client, set up and connected to ``master`` (``host:port``).

    Args:
        master: the ``mooncake_master`` RPC address.
        protocol: ``"tcp"`` or ``"rdma"``.
        device: RDMA devices (``""`` for TCP).
        local_hostname: the address other clients reach this one's segment at.
        metadata_server: Mooncake's metadata service (``"P2PHANDSHAKE"``: none).
        segment_bytes: memory this client mounts into the store (0: it only reads and writes others' segments).
        buffer_bytes: the client's own transfer buffer (zero-copy calls do not use it).
        tenant: Mooncake's tenant id.
        timeout_s: how long set-up may take.

    Raises:
        RemoteStoreError: the client is not installed, the master is not reachable, or set-up fails.
    """

    def __init__(self, master: str, *, protocol: str = "tcp", device: str = "", local_hostname: str = "localhost",
                 metadata_server: str = "P2PHANDSHAKE", segment_bytes: int = 0, buffer_bytes: int = 16 << 20,
                 tenant: str = "default", timeout_s: float = 10.0) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise RemoteStoreError(f"kvtier: the remote tier needs the Mooncake client ({e}): pip install "
                                   "'kvtier[remote]' (and apt-get install libibverbs1)") from None
        check_reachable(master, min(timeout_s, 5.0))
        self.master, self.protocol = master, protocol
        self._store = MooncakeDistributedStore()
        result: list = []
        th = threading.Thread(target=lambda: result.append(self._store.setup(
            local_hostname, metadata_server, int(segment_bytes), int(buffer_bytes), protocol, device, master,
            None, False, "", tenant)), name="kvtier-mooncake-setup", daemon=True)
        th.start()
        th.join(timeout_s)
        if not result:
            raise RemoteStoreError(f"kvtier: Mooncake set-up with the master at {master} took more than "
                                   f"{timeout_s:g} s")
        if result[0] != 0:
            raise RemoteStoreError(f"kvtier: Mooncake set-up with the master at {master} failed (code {result[0]},"
                                   f" protocol {protocol!r}, local hostname {local_hostname!r})")
        self._closed = False

    def register(self, address: int, nbytes: int) -> None:
        """Register memory that values are put from and got into."""
        code = self._store.register_buffer(int(address), int(nbytes))
        if code != 0:
            raise RemoteStoreError(f"kvtier: Mooncake could not register {nbytes} bytes of memory (code {code})")

    def put(self, keys: list[str], values: list[Ranges]) -> list[int]:
        """Store each key's value from its ranges; per key 0 (stored, or already there) or a negative code."""
        return list(self._store.batch_put_from_multi_buffers(
            keys, [[a for a, _ in v] for v in values], [[n for _, n in v] for v in values]))

    def get(self, keys: list[str], values: list[Ranges]) -> list[int]:
        """Read each key's value into its ranges; per key the bytes read (the value's size, which must equal the
        ranges' total) or a negative code (not found, size mismatch, unreachable)."""
        return list(self._store.batch_get_into_multi_buffers(
            keys, [[a for a, _ in v] for v in values], [[n for _, n in v] for v in values]))

    def size(self, key: str) -> int:
        """The bytes of ``key``'s value, as the master records them (no transfer), or a negative code."""
        return int(self._store.get_size(key))

    def exists(self, keys: list[str]) -> list[int]:
        """Per key 1 (held), 0 (not held) or a negative code."""
        return list(self._store.batch_is_exist(keys))

    def remove(self, keys: list[str]) -> list[int]:
        return list(self._store.batch_remove(keys, True))

    def close(self) -> None:
        """Unmount this client's segment (its values leave the store) and disconnect; idempotent."""
        if not self._closed:
            self._closed = True
            self._store.close()


def unreachable(code: Optional[int]) -> bool:
    """Whether a call's code says the master did not answer."""
    return code in CODE_UNREACHABLE


def gone(code: Optional[int]) -> bool:
    """Whether a get's code says the value is not in the store (any more)."""
    return code in CODE_GONE


def transfer_failed(code: Optional[int]) -> bool:
    """Whether a get's code says the transfer of a value the master knows failed: its holder dead (at once:
    connection refused) or hung (after Mooncake's own transfer timeout, about a minute), or the value not the size
    of the ranges read into (at once; :meth:`MooncakeStore.size` tells them apart)."""
    return code in CODE_TRANSFER_FAIL
