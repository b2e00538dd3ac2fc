"""``kvtier config check FILE``: a kvtier config checked as the server checks it at start, short of the GPU and the
model, on the host that runs the check.

First the file (every key, as :class:`~kvtier.config.TierConfig` checks it: a bad key is one line naming it), then
this host: the host pool against the memory the server may pin (SGLang's rule when SGLang is installed, else
kvtier's), the SSD directories (exist or can be made, writable, not on a pseudo file system, not in use by another
store, room for ``ssd_cache_gb``), and the remote tier (its client installed, the master answering within a bound;
``offline`` leaves the master unchecked). Prints every key as it resolves, what follows from them and one line per
check, then one verdict: the last line of stdout with exit status 0, or one line on stderr with exit status 1.

Imports neither torch, numba nor SGLang: SGLang's measure of available memory is read from its file.
"""

from __future__ import annotations

import ctypes.util
import dataclasses
import fcntl
import importlib.util
import ipaddress
import os
import socket
import sys
import warnings

from kvtier._checks import (
    directory_problem,
    existing_ancestor,
    mount_of,
    split_host_port,
)
from kvtier.config import TierConfig

__all__ = ["KVTIER_RESERVE_GIB", "MASTER_WAIT_S", "Finding", "available_memory_bytes", "host_findings", "run"]

GIB = 1 << 30
KVTIER_RESERVE_GIB = 2.0  # kvtier.tier.host_pool.DEFAULT_RESERVE_GB, without importing torch (a test keeps them equal)
# sglang.srt.mem_cache.pool_host.base.HICACHE_HOST_MEMORY_RESERVE_BYTES (a test keeps them equal)
SGLANG_RESERVE_BYTES = 10 * GIB
MASTER_WAIT_S = 5.0  # the longest wait for the master's answer (the tier's own check waits as long)
NOT_A_REQUEST = b"\0" * 64  # kvtier.tier.master_probe.NOT_A_REQUEST: no valid header, the master drops the connection
SSD_FILE_NAME = "kvtier_blocks.bin"  # kvtier.storage.ssd_store.FILE_NAME (a test keeps them equal)


@dataclasses.dataclass(frozen=True)
class Finding:
    """One check's result: ``status`` is ``ok``, ``fail``, ``unchecked`` or ``note``; ``text`` names the key."""

    status: str
    text: str


def gib(n: float) -> str:
    """Bytes in GiB, to the MiB: 64 GiB, 0.125 GiB, 18.805 GiB."""
    return f"{n / GIB:.3f}".rstrip("0").rstrip(".") + " GiB"


def available_memory_bytes() -> int | None:
    """Host memory available for new allocations, as the server measures it without SGLang
    (:func:`kvtier.tier.host_pool.available_memory_bytes`: psutil, else /proc/meminfo's MemAvailable)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run(path: str, *, offline: bool = False, ranks: int = 1) -> int:
    """Check ``path`` for ``ranks`` ranks on this host; print as the module docstring says; the exit status."""
    try:
        config = TierConfig.from_file(path)
    except ValueError as e:
        print(" ".join(str(e).split()), file=sys.stderr)  # one line
        return 1
    print(f"# {path}: every key as it resolves (defaults filled in)")
    for key, value in config.to_dict().items():
        print(f"{key}: {yaml_value(value)}")
    print("# what follows from them")
    for line in derived(config):
        print(line)
    print("# checks on this host (those that need no GPU and no model)")
    findings = host_findings(config, offline=offline, ranks=ranks)
    for f in findings:
        print(f"{f.status.upper() if f.status == 'fail' else f.status:<9}  {f.text}")
    failed = [f.text for f in findings if f.status == "fail"]
    if failed:
        print(f"kvtier config: {path}: the server would refuse it on this host: " + "; ".join(failed),
              file=sys.stderr)
        return 1
    unchecked = [f.text.split(":", 1)[0] for f in findings if f.status == "unchecked"]
    print(f"# {path}: valid, and every check on this host passed"
          + (f" ({', '.join(unchecked)} not checked)" if unchecked else ""))
    return 0


def yaml_value(value) -> str:
    """A resolved value as YAML writes it (null, true, "")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return '""' if value == "" else str(value)


def derived(config: TierConfig) -> list[str]:
    out = [f"tokens per host block in force: {config.block_tokens}",
           f"host pool per rank: {gib(config.cpu_cache_bytes)}"]
    if config.ssd_cache_gb > 0:
        n = len(config.ssd_dirs)
        out.append(f"SSD tier per rank: {gib(config.ssd_cache_bytes)} over {n} director{'y' if n == 1 else 'ies'} "
                   f"({gib(config.ssd_cache_bytes / n)} each): " + ", ".join(config.ssd_dirs))
    if config.remote_backend is not None:
        out.append(f"remote tier: {config.remote_backend} at {config.remote_master} over {config.remote_protocol}, "
                   f"{gib(config.remote_segment_bytes)} of this host's memory given to the store")
    return out


def host_findings(config: TierConfig, *, offline: bool = False, ranks: int = 1) -> list[Finding]:
    """Every check of ``config`` on this host (``ranks``: the server's ranks on it), in the order the server meets
    them."""
    out = host_memory(config, ranks)
    if config.ssd_cache_gb > 0:
        out += ssd_directories(config)
    if config.remote_backend is not None:
        out += remote_tier(config, offline=offline)
    return out


# --- host memory ---


def host_memory(config: TierConfig, ranks: int = 1) -> list[Finding]:
    """The host pools of ``ranks`` ranks against what the server may pin: SGLang's rule where SGLang is installed
    (what is available, bounded by the container's cgroup limits, less a 10 GiB reserve, divided between the
    host's ranks; a default pool shrinks to the share), else kvtier's (what is available less 2 GiB)."""
    pool = config.cpu_cache_bytes
    rule = _sglang_rule()
    avail: int | None
    if rule is not None:
        avail, reserve = rule
        arithmetic = f"by SGLang's rule: {gib(avail)} available (its measure: bounded by the cgroup limits)"
    else:
        avail = available_memory_bytes()
        if avail is None:
            return [Finding("unchecked", "cpu_cache_gb: this host's available memory is unknown")]
        reserve = int(KVTIER_RESERVE_GIB * GIB)
        arithmetic = f"{gib(avail)} available"
    host = max(avail - reserve, 0)
    share = host // ranks
    arithmetic += f" - {gib(reserve)} reserve = {gib(host)} for this host's ranks"
    if ranks > 1:
        arithmetic += f", / {ranks} ranks = {gib(share)} a rank"
    if pool <= share:
        room = f": room for {host // pool} ranks' pools" if ranks == 1 else ""
        return [Finding("ok", f"cpu_cache_gb: a host pool of {gib(pool)} per rank fits ({arithmetic}){room}")]
    from kvtier.sglang import MIN_HOST_SHARE_BYTES

    if rule is not None and "cpu_cache_gb" not in config.given_keys and share >= MIN_HOST_SHARE_BYTES:
        return [Finding("ok", f"cpu_cache_gb not set: under SGLang the default host pool of {gib(pool)} shrinks to "
                              f"{gib(share)} a rank ({arithmetic}); set cpu_cache_gb to choose")]
    many = f"{ranks} ranks' host pools of {gib(pool)}" if ranks > 1 else f"a host pool of {gib(pool)} per rank"
    return [Finding("fail", f"cpu_cache_gb: {many} do{'' if ranks > 1 else 'es'} not fit this host ({arithmetic}): "
                            "lower cpu_cache_gb, or check on the host that serves")]


def _sglang_rule() -> tuple[int, int] | None:
    """(available bytes, reserve bytes) by SGLang's HiCache rule, or None without SGLang. SGLang's measure is its
    own function, read from its file: importing the sglang package imports torch and takes seconds."""
    spec = importlib.util.find_spec("sglang")  # finds the package without importing it
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "srt", "mem_cache", "host_memory.py")
    try:
        source = importlib.util.spec_from_file_location("kvtier_sglang_host_memory", path)
        if source is None or source.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(source)
        source.loader.exec_module(module)
        measure = module.available_host_memory_bytes
    except (OSError, ImportError, AttributeError):  # another layout of SGLang: through its package, slowly
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its platform warnings (no CUDA here, ...) are not this check's
            from sglang.srt.mem_cache import host_memory
            measure = host_memory.available_host_memory_bytes
    return int(measure(allow_cgroup_fallback=True)), SGLANG_RESERVE_BYTES


# --- SSD directories ---


def ssd_directories(config: TierConfig) -> list[Finding]:
    """Each directory usable (:func:`kvtier._checks.directory_problem`), not in use by another store, and each file
    system with room for the block files of the directories on it."""
    dirs = config.ssd_dirs
    share = config.ssd_cache_bytes // len(dirs)
    out: list[Finding] = []
    need: dict[int, list] = {}  # file system -> [free bytes, bytes still to allocate, directories, mount point]
    for d in dirs:
        problem = directory_problem(d)
        if problem is not None:
            out.append(Finding("fail", f"ssd_cache_dir: {problem}"))
            continue
        holder = _lock_holder(os.path.join(d, SSD_FILE_NAME + ".lock"))
        if holder:
            out.append(Finding("fail", f"ssd_cache_dir: {d} is in use by a running SSD store ({holder}): give each "
                                       "engine instance and TP rank a directory of its own"))
            continue
        base = existing_ancestor(d)
        st = os.statvfs(base)
        have = _allocated(os.path.join(d, SSD_FILE_NAME))  # a block file already there keeps its room
        entry = need.setdefault(os.stat(base).st_dev, [st.f_bavail * st.f_frsize, 0, [], mount_of(d)])
        entry[1] += max(0, share - have)
        entry[2].append(d)
        point, fs = mount_of(d)
        made = "" if os.path.isdir(d) else " (made at start)"
        note = "; tmpfs is memory: its blocks take host memory and do not outlive a reboot" if fs == "tmpfs" else ""
        out.append(Finding("ok", f"ssd_cache_dir: {d}{made}: writable, on {fs or '?'} ({point or base})"
                                 f"{' holding ' + gib(have) + ' of block file' if have else ''}{note}"))
    for free, missing, names, (point, _) in need.values():
        where = ", ".join(names)
        if missing > free:
            out.append(Finding("fail", f"ssd_cache_gb: {config.ssd_cache_gb:g} GiB over {len(dirs)} directories "
                                       f"needs {gib(missing)} more on the file system of {where} ({point or '?'}), "
                                       f"which has {gib(free)} free: lower ssd_cache_gb or free space"))
        else:
            out.append(Finding("ok", f"ssd_cache_gb: {gib(missing)} to allocate on the file system of {where} "
                                     f"({point or '?'}), {gib(free)} free"))
    return out


def _allocated(path: str) -> int:
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return 0


def _lock_holder(lock_path: str) -> str:
    """Non-empty (how it knows) when a store holds ``lock_path``'s lock; the lock is only tested, never kept."""
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return ""  # no lock file: no store ever opened the directory, or it cannot be read (the store says so)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return f"{lock_path} is locked"
    finally:
        os.close(fd)  # closing drops a lock this test took
    return ""


# --- remote tier ---


def remote_tier(config: TierConfig, *, offline: bool) -> list[Finding]:
    """The Mooncake client installed and loadable, the master answering, and this instance reachable by others."""
    out: list[Finding] = []
    if importlib.util.find_spec("mooncake") is None:
        out.append(Finding("fail", "remote_backend: mooncake needs the Mooncake client, which is not installed: "
                                   "pip install 'kvtier[remote]' (Python 3.11 to 3.13)"))
    elif ctypes.util.find_library("ibverbs") is None:
        out.append(Finding("fail", "remote_backend: the Mooncake client links libibverbs, which this host lacks "
                                   "(even for TCP): apt-get install libibverbs1"))
    else:
        out.append(Finding("ok", "remote_backend: the Mooncake client is installed"))
    master = config.remote_master
    assert master is not None  # TierConfig requires it with remote_backend
    if offline:
        out.append(Finding("unchecked", f"remote_master: {master} not contacted (--offline)"))
    else:
        out.append(master_answers(master, min(config.remote_timeout_s, MASTER_WAIT_S)))
    host, _ = split_host_port(master)
    if config.remote_local_hostname in ("localhost", "127.0.0.1", "::1") and not _loopback(host):
        out.append(Finding("note", f"remote_local_hostname: {config.remote_local_hostname} is where other "
                                   f"instances reach this one's segment; with a master at {master} they are on "
                                   "other hosts: give this host's routable address"))
    return out


def master_answers(master: str, timeout_s: float) -> Finding:
    """Whether the master answers within ``timeout_s``: a connection opens, and bytes that are no request make it
    close the connection, as a live ``mooncake_master`` does at once (the tier's own probe,
    :mod:`kvtier.tier.master_probe`; the kernel accepts a stopped master's connections, so a connect cannot tell)."""
    host, port = split_host_port(master)
    start = f"start mooncake_master there (--rpc_port={port}), or check with --offline"
    try:
        conn = socket.create_connection((host, port), timeout=timeout_s)
    except TimeoutError:
        return Finding("fail", f"remote_master: {master} did not answer within {timeout_s:g} s: {start}")
    except OSError as e:
        return Finding("fail", f"remote_master: {master} is not reachable ({e.strerror or e}): {start}")
    with conn:
        try:
            conn.sendall(NOT_A_REQUEST)
            conn.recv(1)  # a master closes the connection: b"", or a reset
        except TimeoutError:
            return Finding("fail", f"remote_master: {master} accepts connections but did not answer within "
                                   f"{timeout_s:g} s: a stopped or hung mooncake_master, or no mooncake_master")
        except OSError:
            pass
    return Finding("ok", f"remote_master: {master} answers")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
