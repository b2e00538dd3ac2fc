"""A real ``mooncake_master`` on free loopback ports for the remote-tier tests, stopped by its pid."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_state(pid: int) -> str:
    """The state letter of process ``pid`` in ``/proc`` (R, S, T for stopped, ...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def stop(pid: int, timeout_s: float = 5.0) -> None:
    """SIGSTOP ``pid`` and wait until the kernel shows it stopped: on a loaded machine a process answers for a
    few more milliseconds after the signal is sent."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while process_state(pid) not in ("T", "t"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {pid} did not stop within {timeout_s} s")
        time.sleep(0.001)


def master_binary() -> Optional[str]:
    """The ``mooncake_master`` console script of this interpreter's environment (or on PATH)."""
    here = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    return here if os.path.exists(here) else shutil.which("mooncake_master")


def require_mooncake() -> str:
    """The master binary; the test is skipped without the ``kvtier[remote]`` extra, unless
    ``KVTIER_REQUIRE_REMOTE=1`` (CI), where a missing install fails it."""
    path = master_binary()
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        path = None
    if path is None:
        if os.environ.get("KVTIER_REQUIRE_REMOTE") == "1":
            pytest.fail("KVTIER_REQUIRE_REMOTE=1 but the Mooncake client or mooncake_master is not installed")
        pytest.skip("needs the kvtier[remote] extra (mooncake-transfer-engine-non-cuda)")
    return path


class Master:
    """One ``mooncake_master`` process on ``127.0.0.1``; :attr:`addr` is its RPC address."""

    def __init__(self, log_dir: str, port: Optional[int] = None, flags: tuple[str, ...] = ()) -> None:
        self.binary = require_mooncake()
        self.flags = flags  # more command-line flags, e.g. ("--client_ttl=60",)
        self.port = port or free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.log_dir = log_dir
        self.proc: Optional[subprocess.Popen] = None
        self.start()

    def start(self, timeout_s: float = 15.0) -> None:
        log = open(os.path.join(self.log_dir, f"mooncake_master_{self.port}.log"), "ab")
        self.proc = subprocess.Popen(
            [self.binary, f"--rpc_port={self.port}", "--rpc_address=127.0.0.1", "--metrics_host=127.0.0.1",
             f"--metrics_port={free_port()}", "--enable_metric_reporting=false", *self.flags],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode} (log in {self.log_dir})")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"mooncake_master did not listen on {self.addr} within {timeout_s} s")

    def kill(self) -> None:
        """SIGKILL by pid and reap (idempotent)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        """Stop the master (:func:`stop`): it keeps its sockets but answers nothing (a hung server)."""
        assert self.proc is not None
        stop(self.proc.pid)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)


@pytest.fixture
def mooncake_master(tmp_path):
    m = Master(str(tmp_path))
    try:
        yield m
    finally:
        if m.proc is not None and m.proc.poll() is None:
            m.resume()  # a paused master must run to die cleanly
        m.kill()
