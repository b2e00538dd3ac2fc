"""Whether a ``mooncake_master`` answers, asked without Mooncake's client.

Mooncake's client set-up holds the GIL for as long as it waits for the master, and retries for minutes (20 tries of
its 30 s RPC timeout) against a master that accepts connections but never answers (stopped, or wedged): every Python
thread of the process stops with it. The kernel accepts a stopped master's connections, so a TCP connect cannot
tell; this probe sends bytes that are no request, which a live master answers by closing the connection at once,
and waits for that, releasing the GIL.
"""

from __future__ import annotations

import socket

from kvtier._checks import split_host_port
from kvtier.storage.mooncake_store import RemoteStoreError

__all__ = ["check_master_answers", "NOT_A_REQUEST"]

NOT_A_REQUEST = b"\0" * 64  # longer than an RPC header, with no valid magic: the master drops the connection


def check_master_answers(master: str, timeout_s: float) -> None:
    """Raise a :class:`RemoteStoreError` naming ``master`` if it accepts a connection but does not react to it
    within ``timeout_s``. A master that refuses the connection (or cannot be resolved) passes: the client's own
    check reports that."""
    try:
        host, port = split_host_port(master)
        conn = socket.create_connection((host, port), timeout=timeout_s)
    except (OSError, ValueError):
        return
    with conn:
        try:
            conn.sendall(NOT_A_REQUEST)
            conn.recv(1)  # the master closes the connection (b"", or a reset)
        except socket.timeout:
            raise RemoteStoreError(
                f"kvtier: the Mooncake master at {master} accepts connections but did not answer within "
                f"{timeout_s:g} s (stopped or hung); start it again, or set remote_required: false to run without "
                "the remote tier") from None
        except OSError:
            return
