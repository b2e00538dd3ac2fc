"""Argument checks shared across kvtier (no torch, no numpy import needed by callers)."""

from __future__ import annotations

import numbers
import os
import re
from typing import Any, Iterable, Mapping, Optional

__all__ = ["is_int", "check_count", "check_int_in", "split_host_port", "same_directory", "directories",
           "model_identity", "PSEUDO_FILE_SYSTEMS", "existing_ancestor", "mount_of", "directory_problem"]


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer: a Python or numpy int, not a bool (``True`` is no count), not a float."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_count(name: str, value: Any, minimum: int = 1, why: str = "") -> int:
    """``value`` as an int, if it is an integer of at least ``minimum``; else ValueError naming ``name`` (and
    ``why`` the minimum is what it is, when given)."""
    if not is_int(value) or value < minimum:
        reason = f" ({why})" if why else ""
        raise ValueError(f"{name} must be an int >= {minimum}{reason}, got {value!r}")
    return int(value)


def check_int_in(name: str, value: Any, lo: int, hi: int, bounds: str = "") -> int:
    """``value`` as an int, if it is an integer in ``[lo, hi)``; else ValueError naming ``name`` and the range
    (``bounds``: how to write it, default ``[lo, hi)``)."""
    if not is_int(value) or not lo <= value < hi:
        raise ValueError(f"{name} must be an int in {bounds or f'[{lo}, {hi})'}, got {value!r}")
    return int(value)


def split_host_port(addr: Any) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as (host, port), the port in 1..65535; ValueError otherwise (a URL's scheme,
    ``mooncake://``, is named as the mistake: it would be taken as part of the host)."""
    if isinstance(addr, str) and "://" in addr:
        scheme = addr.split("://", 1)[0] + "://"
        raise ValueError(f"must be host:port without a scheme: drop {scheme!r} (got {addr!r})")
    host, sep, port = addr.rpartition(":") if isinstance(addr, str) else ("", "", "")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"must be host:port with a port in 1..65535, got {addr!r}")
    return host.strip("[]"), int(port)


def same_directory(dirs: Iterable[str]) -> Optional[tuple[str, str]]:
    """The first two of ``dirs`` that name one directory (after ``~``, links and ``..``), or None."""
    seen: dict[str, str] = {}
    for d in dirs:
        real = os.path.realpath(os.path.expanduser(d))
        if real in seen:
            return seen[real], d
        seen[real] = d
    return None


def directories(spec: Any) -> list[str]:
    """The directories of ``spec`` (a ``;``-separated string, as ``ssd_cache_dir``, or a list), each stripped of
    blanks around it, ``~`` expanded and made absolute (so that a later ``chdir`` moves none); blank entries are
    dropped."""
    items = spec.split(";") if isinstance(spec, str) else list(spec)
    return [os.path.abspath(os.path.expanduser(d.strip())) for d in items if d.strip()]


_JSON_SCALARS = (str, int, float, bool, type(None))


def model_identity(value: Any) -> dict:
    """``value`` as a model identity (what a lower tier's blocks belong to): a non-empty mapping of str keys to JSON
    data (str, number, bool, None, lists and mappings of them), or a non-empty str naming the model. Anything else is
    a ValueError naming the key: an empty identity lets two models of one geometry share blocks, and a value whose
    ``str()`` differs between processes (an object's address) makes every restart refuse the directory."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("model_identity must name the model: got an empty string")
        return {"model": value}
    if not isinstance(value, Mapping):
        raise ValueError(f"model_identity must be a mapping (model path and revision, TP rank and size, ...) or a "
                         f"str naming the model, got {type(value).__name__}")
    if not value:
        raise ValueError("model_identity is empty: name the model (path and revision), TP rank and size, or two "
                         "models of one KV geometry read each other's blocks")

    def check(key: str, v: Any) -> None:
        if isinstance(v, Mapping):
            for k, x in v.items():
                if not isinstance(k, str):
                    raise ValueError(f"model_identity{key} has a key {k!r} that is not a str")
                check(f"{key}[{k!r}]", x)
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                check(f"{key}[{i}]", x)
        elif not isinstance(v, _JSON_SCALARS) or (isinstance(v, float) and v != v):
            raise ValueError(f"model_identity{key} must be JSON data (str, number, bool, None, lists and mappings "
                             f"of them), got {type(v).__name__}: its text may differ between processes")
    check("", value)
    return dict(value)


# File systems that hold no files of a user's (the kernel's views, not storage); tmpfs is memory, not one of them.
PSEUDO_FILE_SYSTEMS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "pstore", "bpf",
    "configfs", "fusectl", "mqueue", "binfmt_misc", "efivarfs", "nsfs", "rpc_pipefs", "selinuxfs", "autofs",
    "hugetlbfs"})
_KERNEL_TREES = ("/proc", "/sys")  # whatever is mounted below them (the cgroup tree's tmpfs) is the kernel's too


def existing_ancestor(path: str) -> str:
    """``path`` itself if it exists, else its nearest ancestor that does (``/`` at worst), resolved."""
    p = os.path.abspath(path)
    for _ in range(p.count(os.sep) + 1):  # bounded: one step up per path component
        if os.path.lexists(p):
            return os.path.realpath(p)
        p = os.path.dirname(p)
    return os.sep


def mount_of(path: str, mountinfo: str = "/proc/self/mountinfo") -> tuple[str, str]:
    """(mount point, file system type) of the file system that holds ``path`` (or would, once it is made), from
    ``mountinfo``; ``("", "")`` where that cannot be read."""
    target = existing_ancestor(path)
    best = ("", "")
    try:
        with open(mountinfo, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return best
    for line in lines:
        before, _, after = line.partition(" - ")
        fields = before.split()
        if len(fields) < 5 or not after:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])  # octal escapes: \040, a blank
        inside = target == point or target.startswith(point.rstrip(os.sep) + os.sep)
        if inside and len(point) >= len(best[0]):  # the deepest mount wins; of equal ones, the last (on top)
            best = (point, after.split()[0])
    return best


def directory_problem(path: str) -> str | None:
    """Why files cannot be kept in directory ``path`` (made if missing) by this user, or None: a file in its place,
    a pseudo file system (``/proc``, ``/sys``, ...), a read-only file system, no write access to it or to the
    directory it would be made in."""
    if os.path.lexists(path) and not os.path.isdir(path):
        return f"{path} exists and is not a directory"
    base = existing_ancestor(path)
    if not os.path.isdir(base):
        return f"{path} cannot be made: {base} is not a directory"
    point, fs = mount_of(path)
    if fs in PSEUDO_FILE_SYSTEMS or any(base == t or base.startswith(t + os.sep) for t in _KERNEL_TREES):
        return (f"{path} is on {point or base} ({fs or 'the kernel'}), a pseudo file system that holds no files: "
                "choose a directory on a disk")
    try:
        read_only = bool(os.statvfs(base).f_flag & os.ST_RDONLY)
    except OSError as e:
        return f"{path}: cannot inspect {base} ({e.strerror})"
    if read_only:
        return f"{path} is on a read-only file system ({point or base})"
    if not os.access(base, os.W_OK | os.X_OK):
        what = "is not writable" if base == os.path.realpath(path) else f"cannot be made: {base} is not writable"
        return f"{path} {what} by this user (uid {os.getuid()})"
    return None
