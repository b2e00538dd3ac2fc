"""TierConfig: the host tier's settings, from a YAML/JSON file, the ``KVTIER_CONFIG`` environment variable or a dict.

Keys (FlexKV-like; every key is optional, unknown keys are an error that names the allowed ones):

* ``cpu_cache_gb`` (float > 0, default 16): size of the pinned host pool in GiB (2**30 bytes), **per rank**: with
  TP each rank pins its own pool for its shard of the heads, so a host pins ``cpu_cache_gb`` times its local ranks.
  The pool holds ``floor(cpu_cache_gb * 2**30 / block_bytes)`` blocks of one page of every layer, K and V. Under
  SGLang it must fit the rank's share of host memory (what is available, less SGLang's 10 GiB reserve, divided
  between the ranks of the host); elsewhere, what is available less 2 GiB.
* ``page_size`` (int >= 1, default 16): tokens per engine page. It must equal the engine's page size (SGLang's
  ``--page-size``); the manager rejects a KV pool whose ``PagedKV`` was built with another page size.
* ``tokens_per_block`` (int or null, default null): tokens per host block, the unit of the host index, the host pool
  and every copy (FlexKV's name); a multiple of ``page_size``. Null picks the smallest multiple of ``page_size``
  that is at least :data:`MIN_TOKENS_PER_BLOCK`: at engine page 1 one index node, one hash and one copy run per
  token would make the index slower than the engine's own tree (bench/results/index_cpu.json). A host hit is
  block-granular (the device tree keeps the engine's page granularity).
* ``host_layout`` (``"layer_first"`` | ``"page_first"``, default ``"layer_first"``): ``layer_first`` keeps each layer
  contiguous over blocks (a block's page of it K then V), so a layerwise load's per-layer copy of a run of blocks is one
  contiguous region (one copy-engine copy, long sequential host reads for the direct kernel); the all-layer kernels run
  at the same speed in both layouts (bench/results/transfer_h200.json). ``page_first`` keeps a block contiguous, which
  an SSD tier will want for spilling whole blocks; its per-layer copies are a row per block (one 2-D copy-engine copy
  per run: the copy engine moves short rows slowly, so page-1 layerwise loads take the direct kernel).
* ``transfer_mode`` (``"auto"`` | ``"direct"`` | ``"staged"``, default ``"auto"``): ``auto`` stores through the
  staged path (copy engine: leaves the SMs to the forward pass, and a store can overlap a load) and loads through
  it too when a whole load, or one layer of a layerwise load, moves >= 4 MiB (from there the copy outlasts its
  host issue) and its host blocks run long enough for the copy engine (a fragmented pool's short runs go
  through the direct kernel, whose speed does not depend on them); smaller loads go through the direct kernel (no
  staging hop, lowest latency, cheap to issue), and so do layerwise loads from a ``page_first`` pool whose layer
  slice of a block is under 64 KiB (the copy engine moves short rows slowly). See
  :mod:`kvtier.tier.transfer_policy`.
* ``num_programs`` (int >= 1 or null, default null): persistent programs (SMs) of the direct kernel; null picks the
  kernel's tuned default (``kvtier.kernels.Tuning().programs``, more for short bursts).
* ``layerwise`` (bool, default true): engine adapters load host hits layer by layer (``KVTier.load_layerwise``)
  instead of whole (``KVTier.load``).
* ``eviction_policy`` (a registered name, default ``"lru"``): which unlocked host blocks leave first when the pool
  is full (:mod:`kvtier.index.eviction`; ``lru``: least recently used leaf first, the index's own heap order;
  a policy registered with :func:`~kvtier.index.register_eviction_policy` is valid here once registered).
* ``ssd_cache_gb`` (float >= 0, default 0): size of the SSD tier in GiB over all its directories, per rank (0: no
  SSD tier). Its block files are preallocated at start (a full disk fails there, not while serving).
* ``ssd_cache_dir`` (str or null): the SSD tier's directories, several separated by ``;`` (FlexKV's form): one block
  file each, blocks striped round robin so a batch reads and writes every disk at once. Required when
  ``ssd_cache_gb`` > 0; created if missing. What a previous process made durable there is served after a restart.
* ``ssd_io_threads`` (int >= 1, default 4): requests each batch keeps in flight on the disks.
* ``ssd_direct_io`` (bool, default true): O_DIRECT reads and writes (no page-cache copy; the file system's buffered
  IO where it refuses O_DIRECT, said once in the log).
* ``ssd_write_policy`` (``"write_through"`` | ``"write_back"``, default ``"write_through"``): ``write_through``
  writes every block that enters the CPU tier to the SSD as well (off the engine's threads), so a CPU eviction costs
  nothing and a crash loses only the blocks still queued; ``write_back`` writes a block only when the CPU tier
  evicts it (fewer writes; the block's CPU memory is held until its write is durable, so the tier evicts ahead of
  need, keeping 1/16 of the pool free or being written, raised to the largest store that found too few).
* ``ssd_admission`` (``"cost"`` | ``"always"``, default ``"cost"``): ``cost`` serves an SSD hit only when reading it
  (behind the reads already queued) is faster than recomputing it (:mod:`kvtier.tier.admission`).
* ``ssd_read_gbps`` (float > 0 or null, default null): the SSD read bandwidth admission assumes; null: the tier's
  measured reads.
* ``prefill_tokens_per_s`` (float > 0 or null, default null): the engine's prefill rate admission compares with;
  null: what the engine reports (``KVTier.note_prefill``: its prefills, those past a cached prefix apart).
* ``ssd_wipe_mismatch`` (bool, default false): a block file in ``ssd_cache_dir`` written for another model, layout
  or TP rank is wiped and recreated; by default it is left alone and the tier refuses to start, naming the file.
* ``remote_backend`` (``"mooncake"`` or null, default null): the remote tier behind the CPU (and SSD) tiers, a
  Mooncake Store shared by kvtier instances (SGLang HiCache's ``--hicache-storage-backend mooncake``, LMCache's
  ``mooncakestore://``); needs the ``kvtier[remote]`` extra and a running ``mooncake_master``.
* ``remote_master`` (``host:port``): the master's RPC address (SGLang's ``MOONCAKE_MASTER``); required with a
  remote backend.
* ``remote_protocol`` (``"tcp"`` | ``"rdma"``, default ``"tcp"``) and ``remote_device`` (str, default ``""``):
  Mooncake's transport and RDMA devices (``MOONCAKE_PROTOCOL``, ``MOONCAKE_DEVICE``).
* ``remote_local_hostname`` (str, default ``"localhost"``): the address other clients reach this one's segment at
  (``MOONCAKE_LOCAL_HOSTNAME``; a routable address across machines).
* ``remote_metadata_server`` (str, default ``"P2PHANDSHAKE"``): Mooncake's metadata service (``P2PHANDSHAKE``:
  none needed).
* ``remote_segment_gb`` (float >= 0, default 4): memory this instance mounts into the store, GiB
  (``MOONCAKE_GLOBAL_SEGMENT_SIZE``; 0: it only uses other clients' segments).
* ``remote_timeout_s`` (float > 0, default 5): the longest kvtier waits for one remote call; a call past it, or
  an unreachable master, marks the tier down (puts dropped, no fetches) until the master answers again.
* ``remote_required`` (bool, default true): a master not reachable at start is an error; false: start without
  the remote tier, with a warning.
* ``remote_key_prefix`` (str, default ``"kvtier"``) and ``remote_tenant`` (str, default ``"default"``): the first
  part of every key, and Mooncake's tenant id (``tenant_id``).
* ``remote_admission`` (``"cost"`` | ``"always"``, default ``"cost"``) and ``remote_read_gbps`` (float > 0 or
  null): as ``ssd_admission`` and ``ssd_read_gbps``, for fetches from the remote tier.
* ``prefetch_policy`` (``"best_effort"`` | ``"wait_complete"`` | ``"timeout"``, default ``"timeout"``): what a
  waiting request does while its prefix is being read from the SSD or the remote tier (SGLang HiCache's
  ``--hicache-storage-prefetch-policy``, same names and default): ``best_effort`` is admitted at once (what the read
  has not brought by then is recomputed), ``wait_complete`` waits for the read, ``timeout`` waits at most
  ``prefetch_timeout_base + prefetch_timeout_per_ki_token * tokens / 1024`` seconds from its first blocked
  admission. Under SGLang 0.5.23 the scheduler holds a request back only with ``--enable-lmcache`` (kvtier
  answers the hooks that flag turns on; LMCache itself is not imported): without it every policy acts as
  ``best_effort``, and the start-up log says so (:mod:`kvtier.sglang.prefetch`).
* ``prefetch_threshold`` (int >= 0, default 256): a read that brings fewer tokens is not waited for (HiCache's
  ``prefetch_threshold``).
* ``prefetch_timeout_base`` (float >= 0, default 1.0) and ``prefetch_timeout_per_ki_token`` (float >= 0, default
  0.25): the ``timeout`` policy's wait, in seconds (HiCache's names and SGLang 0.5.23's defaults).
* ``prefetch_idle_poll_s`` (float >= 0, default 0.002): while requests wait for their reads and none holds device KV
  (the scheduler has nothing to run), each scheduler round blocks up to this long for one of the reads instead of
  returning to a loop that spins, which takes the GIL from the threads the reads run on; new arrivals are seen at
  most this late. 0: never blocks.
* ``metrics_port`` (int 0..65535 or null, default null): kvtier's own Prometheus endpoint,
  ``http://0.0.0.0:PORT/metrics`` (the process of rank r, its torch.distributed rank, serves on PORT + r); 0: a
  free port on every rank (logged); null: none. Under SGLang with
  ``--enable-metrics`` kvtier's metrics are on SGLang's ``/metrics`` as well (:mod:`kvtier.observe.metrics`).
* ``log_transfers`` (bool, default true): one INFO line per completed transfer on the ``kvtier.transfers`` logger
  (:mod:`kvtier.observe.transfer_log`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any, ClassVar

from kvtier._checks import directories, is_int, same_directory, split_host_port

ENV_VAR = "KVTIER_CONFIG"
# kvtier.geometry.HOST_LAYOUTS, named here so that reading a config imports neither torch nor numba (a test keeps
# the two equal); the eviction policies' registry is imported only for a policy other than the built-in one.
HOST_LAYOUTS: tuple[str, ...] = ("page_first", "layer_first")
BUILTIN_EVICTION_POLICY = "lru"
# The smallest host block by default (tokens): see ``tokens_per_block`` above and docs/DESIGN.md ("Tuned constants").
MIN_TOKENS_PER_BLOCK = 16
TRANSFER_MODES: tuple[str, ...] = ("auto", "direct", "staged")
SSD_WRITE_POLICIES: tuple[str, ...] = ("write_through", "write_back")
SSD_ADMISSIONS: tuple[str, ...] = ("cost", "always")
REMOTE_BACKENDS: tuple[str, ...] = ("mooncake",)
REMOTE_PROTOCOLS: tuple[str, ...] = ("tcp", "rdma")
PREFETCH_POLICIES: tuple[str, ...] = ("best_effort", "wait_complete", "timeout")  # HiCache's


MAX_GB = float(1 << 20)  # the largest size a *_gb key takes (1 PiB): larger ones are typos
# keys that only act when the key after them turns their tier on
_TIER_SWITCHES = (("ssd_", "ssd_cache_gb", "ssd_cache_gb > 0"), ("remote_", "remote_backend", "remote_backend"))


def default_tokens_per_block(page_size: int) -> int:
    """The smallest multiple of ``page_size`` that is at least :data:`MIN_TOKENS_PER_BLOCK`."""
    return page_size * max(1, -(-MIN_TOKENS_PER_BLOCK // page_size))


def _error(msg: str) -> ValueError:
    return ValueError(f"kvtier config: {msg}")


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _got(v: Any) -> str:
    """How a bad value is shown; a string that reads as a number says so: YAML 1.1 reads ``1.0e6`` (no sign in the
    exponent) as a string, and a number in quotes (YAML, JSON or Python) is a string too."""
    if isinstance(v, str):
        try:
            float(v)
        except ValueError:
            return repr(v)
        if re.fullmatch(r"\s*[-+]?(\d[\d_]*\.?[\d_]*|\.\d[\d_]*)[eE]\d+\s*", v):
            return f"the string {v!r} (YAML reads a number like 1.0e6 as a string: write 1.0e+6 or 1000000)"
        return f"the string {v!r} (a number in quotes: give the number itself)"
    return repr(v)


def _unique_keys(path: str):
    """A JSON ``object_pairs_hook`` that refuses a key given twice (the last one would silently win)."""
    def hook(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise _error(f"{path}: key {key!r} is given twice")
            seen[key] = value
        return seen
    return hook


def _unique_key_loader(yaml, path: str):
    """PyYAML's safe loader, refusing a key given twice in a mapping."""
    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
            for key in keys:
                if keys.count(key) > 1:
                    raise _error(f"{path}: key {key!r} is given twice")
            return super().construct_mapping(node, deep=deep)
    return Loader


@dataclasses.dataclass(frozen=True)
class TierConfig:
    """Host tier settings; see the module docstring for each key. Build with :meth:`from_dict`, :meth:`from_file`
    or :meth:`from_env` (all validate); the constructor validates too."""

    # the keys the mapping or file it was built from gave (:meth:`from_dict`); none for a config built in code
    given_keys: ClassVar[frozenset] = frozenset()

    cpu_cache_gb: float = 16.0
    page_size: int = 16
    tokens_per_block: int | None = None
    host_layout: str = "layer_first"
    transfer_mode: str = "auto"
    num_programs: int | None = None
    layerwise: bool = True
    eviction_policy: str = "lru"
    ssd_cache_gb: float = 0.0
    ssd_cache_dir: str | None = None
    ssd_io_threads: int = 4
    ssd_direct_io: bool = True
    ssd_write_policy: str = "write_through"
    ssd_admission: str = "cost"
    ssd_read_gbps: float | None = None
    prefill_tokens_per_s: float | None = None
    ssd_wipe_mismatch: bool = False
    remote_backend: str | None = None
    remote_master: str | None = None
    remote_protocol: str = "tcp"
    remote_device: str = ""
    remote_local_hostname: str = "localhost"
    remote_metadata_server: str = "P2PHANDSHAKE"
    remote_segment_gb: float = 4.0
    remote_timeout_s: float = 5.0
    remote_required: bool = True
    remote_key_prefix: str = "kvtier"
    remote_tenant: str = "default"
    remote_admission: str = "cost"
    remote_read_gbps: float | None = None
    prefetch_policy: str = "timeout"
    prefetch_threshold: int = 256
    prefetch_timeout_base: float = 1.0
    prefetch_timeout_per_ki_token: float = 0.25
    prefetch_idle_poll_s: float = 0.002
    metrics_port: int | None = None
    log_transfers: bool = True

    def __post_init__(self) -> None:
        if not _is_number(self.cpu_cache_gb) or not 0 < self.cpu_cache_gb <= MAX_GB:
            raise _error(f"cpu_cache_gb must be a number > 0 and <= {MAX_GB:.0f} (GiB), got {_got(self.cpu_cache_gb)}")
        if self.cpu_cache_bytes < 1:
            raise _error(f"cpu_cache_gb {self.cpu_cache_gb!r} GiB is less than one byte: give the pool's size in GiB")
        if not is_int(self.page_size) or self.page_size < 1:
            raise _error(f"page_size must be an int >= 1, got {_got(self.page_size)}")
        if self.tokens_per_block is not None and (
                not is_int(self.tokens_per_block) or self.tokens_per_block < 1
                or self.tokens_per_block % self.page_size):
            raise _error(f"tokens_per_block must be null or a multiple of page_size ({self.page_size}), got "
                         f"{_got(self.tokens_per_block)}")
        if self.host_layout not in HOST_LAYOUTS:
            raise _error(f"host_layout must be one of {sorted(HOST_LAYOUTS)}, got {self.host_layout!r}")
        if self.transfer_mode not in TRANSFER_MODES:
            raise _error(f"transfer_mode must be one of {list(TRANSFER_MODES)}, got {self.transfer_mode!r}")
        if self.num_programs is not None and (not is_int(self.num_programs) or self.num_programs < 1):
            raise _error(f"num_programs must be an int >= 1 or null, got {_got(self.num_programs)}")
        if not isinstance(self.layerwise, bool):
            raise _error(f"layerwise must be true or false, got {self.layerwise!r}")
        if self.eviction_policy != BUILTIN_EVICTION_POLICY:
            from kvtier.index.eviction import eviction_policy_names

            if self.eviction_policy not in eviction_policy_names():
                raise _error(f"eviction_policy must be one of {eviction_policy_names()}, got "
                             f"{self.eviction_policy!r}")
        if not _is_number(self.ssd_cache_gb) or not 0 <= self.ssd_cache_gb <= MAX_GB:
            raise _error(f"ssd_cache_gb must be a number >= 0 and <= {MAX_GB:.0f} (GiB), got "
                         f"{_got(self.ssd_cache_gb)}")
        if self.ssd_cache_dir is not None and (not isinstance(self.ssd_cache_dir, str) or not self.ssd_cache_dir):
            raise _error(f"ssd_cache_dir must be a non-empty string or null, got {self.ssd_cache_dir!r}")
        if self.ssd_cache_gb > 0 and self.ssd_cache_dir is None:
            raise _error("ssd_cache_gb > 0 needs ssd_cache_dir (one or more directories separated by ';')")
        if self.ssd_cache_dir is not None and not any(d.strip() for d in self.ssd_cache_dir.split(";")):
            raise _error(f"ssd_cache_dir names no directory: {self.ssd_cache_dir!r}")
        twice = same_directory(d.strip() for d in (self.ssd_cache_dir or "").split(";") if d.strip())
        if twice:
            raise _error(f"ssd_cache_dir names one directory twice ({twice[0]!r} and {twice[1]!r}): name each once")
        if not is_int(self.ssd_io_threads) or self.ssd_io_threads < 1:
            raise _error(f"ssd_io_threads must be an int >= 1, got {_got(self.ssd_io_threads)}")
        for key in ("ssd_direct_io", "ssd_wipe_mismatch"):
            if not isinstance(getattr(self, key), bool):
                raise _error(f"{key} must be true or false, got {getattr(self, key)!r}")
        if self.ssd_write_policy not in SSD_WRITE_POLICIES:
            raise _error(f"ssd_write_policy must be one of {list(SSD_WRITE_POLICIES)}, got {self.ssd_write_policy!r}")
        if self.ssd_admission not in SSD_ADMISSIONS:
            raise _error(f"ssd_admission must be one of {list(SSD_ADMISSIONS)}, got {self.ssd_admission!r}")
        for key in ("ssd_read_gbps", "prefill_tokens_per_s", "remote_read_gbps"):
            v = getattr(self, key)
            if v is not None and (not _is_number(v) or v <= 0):
                raise _error(f"{key} must be a number > 0 or null, got {_got(v)}")
        self._check_remote()
        self._check_prefetch()
        if self.metrics_port is not None and (not is_int(self.metrics_port) or not 0 <= self.metrics_port <= 65535):
            raise _error(f"metrics_port must be an int in 0..65535 or null, got {_got(self.metrics_port)}")
        if not isinstance(self.log_transfers, bool):
            raise _error(f"log_transfers must be true or false, got {self.log_transfers!r}")
        self._check_tiers_on()
        object.__setattr__(self, "cpu_cache_gb", float(self.cpu_cache_gb))
        object.__setattr__(self, "ssd_cache_gb", float(self.ssd_cache_gb))

    def _check_tiers_on(self) -> None:
        """A tier's settings given while the tier is off are a mistake (the operator meant the tier on), not
        something to ignore."""
        for prefix, switch, on in _TIER_SWITCHES:
            if getattr(self, switch):
                continue
            given = [f.name for f in dataclasses.fields(self) if f.name.startswith(prefix) and f.name != switch
                     and getattr(self, f.name) != f.default]
            if given:
                raise _error(f"{', '.join(given)} set but the tier is off: set {on} to turn it on, or drop them")

    def _check_prefetch(self) -> None:
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise _error(f"prefetch_policy must be one of {list(PREFETCH_POLICIES)}, got {self.prefetch_policy!r}")
        if not is_int(self.prefetch_threshold) or self.prefetch_threshold < 0:
            raise _error(f"prefetch_threshold must be an int >= 0 (tokens), got {_got(self.prefetch_threshold)}")
        for key in ("prefetch_timeout_base", "prefetch_timeout_per_ki_token", "prefetch_idle_poll_s"):
            v = getattr(self, key)
            if not _is_number(v) or v < 0:
                raise _error(f"{key} must be a number >= 0 (seconds), got {_got(v)}")

    def prefetch_timeout_s(self, tokens: int) -> float:
        """How long the ``timeout`` policy holds back a request whose read brings ``tokens`` tokens."""
        return self.prefetch_timeout_base + self.prefetch_timeout_per_ki_token * tokens / 1024

    def _check_remote(self) -> None:
        if self.remote_backend is not None and self.remote_backend not in REMOTE_BACKENDS:
            raise _error(f"remote_backend must be null or one of {list(REMOTE_BACKENDS)}, got "
                         f"{self.remote_backend!r}")
        if self.remote_backend is not None and self.remote_master is None:
            raise _error("remote_backend needs remote_master (the mooncake_master address, host:port)")
        if self.remote_master is not None:
            try:
                split_host_port(self.remote_master)
            except ValueError as e:
                raise _error(f"remote_master {e}") from None
        if self.remote_protocol not in REMOTE_PROTOCOLS:
            raise _error(f"remote_protocol must be one of {list(REMOTE_PROTOCOLS)}, got {self.remote_protocol!r}")
        for key in ("remote_device", "remote_local_hostname", "remote_metadata_server", "remote_key_prefix",
                    "remote_tenant"):
            v = getattr(self, key)
            if not isinstance(v, str) or (not v and key != "remote_device"):
                raise _error(f"{key} must be a{'' if key == 'remote_device' else ' non-empty'} string, got {v!r}")
        if not _is_number(self.remote_segment_gb) or not 0 <= self.remote_segment_gb <= MAX_GB:
            raise _error(f"remote_segment_gb must be a number >= 0 and <= {MAX_GB:.0f} (GiB), got "
                         f"{_got(self.remote_segment_gb)}")
        if not _is_number(self.remote_timeout_s) or self.remote_timeout_s <= 0:
            raise _error(f"remote_timeout_s must be a number > 0 (seconds), got {_got(self.remote_timeout_s)}")
        if not isinstance(self.remote_required, bool):
            raise _error(f"remote_required must be true or false, got {self.remote_required!r}")
        if self.remote_admission not in SSD_ADMISSIONS:
            raise _error(f"remote_admission must be one of {list(SSD_ADMISSIONS)}, got {self.remote_admission!r}")

    @property
    def remote_segment_bytes(self) -> int:
        return int(self.remote_segment_gb * (1 << 30))

    @property
    def block_tokens(self) -> int:
        """Tokens per host block in force: ``tokens_per_block``, or its default for ``page_size``."""
        return self.tokens_per_block or default_tokens_per_block(self.page_size)

    @property
    def cpu_cache_bytes(self) -> int:
        return int(self.cpu_cache_gb * (1 << 30))

    @property
    def ssd_cache_bytes(self) -> int:
        return int(self.ssd_cache_gb * (1 << 30))

    @property
    def ssd_dirs(self) -> list[str]:
        """The SSD tier's directories (``ssd_cache_dir`` split at ``;``, blanks dropped, ``~`` expanded, absolute)."""
        return directories(self.ssd_cache_dir or "")

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TierConfig:
        """Build from a mapping of the keys above.

        Raises:
            ValueError: a key is unknown (the message lists the allowed keys) or a value is out of range.
        """
        if not isinstance(d, Mapping):
            raise _error(f"expected a mapping of settings, got {type(d).__name__}")
        allowed = cls.keys()
        for key in d:
            if key not in allowed:
                raise _error(f"unknown key {key!r} (allowed: {', '.join(allowed)})")
        config = cls(**dict(d))
        object.__setattr__(config, "given_keys", frozenset(d))
        return config

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> TierConfig:
        """Read a ``.yaml``/``.yml`` or ``.json`` file holding one mapping of the keys above (empty file: defaults)."""
        path = os.fspath(path)
        ext = os.path.splitext(path)[1].lower()
        if os.path.isdir(path):
            raise _error(f"{path} is a directory: name the config file in it (.yaml, .yml or .json)")
        if ext not in (".yaml", ".yml", ".json"):
            raise _error(f"{path}: the file must end in .yaml, .yml or .json")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise _error(f"cannot read {path}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise _error(f"cannot read {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        if ext == ".json":
            try:
                data = json.loads(text, object_pairs_hook=_unique_keys(path)) if text.strip() else {}
            except json.JSONDecodeError as e:
                raise _error(f"{path}: invalid JSON: {e}") from None
        else:
            try:
                import yaml
            except ImportError:  # pragma: no cover - pyyaml is a dependency
                raise ImportError("reading a YAML kvtier config needs PyYAML: pip install pyyaml") from None
            try:
                data = yaml.load(text, Loader=_unique_key_loader(yaml, path))
            except yaml.YAMLError as e:
                raise _error(f"{path}: invalid YAML: {e}") from None
            data = {} if data is None else data
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{e} (in {path})") from None

    @classmethod
    def from_env(cls, var: str = ENV_VAR) -> TierConfig:
        """Read the file named by ``$KVTIER_CONFIG``; defaults when the variable is unset or empty."""
        path = os.environ.get(var, "").strip()
        if not path:
            return cls()
        try:
            return cls.from_file(path)
        except ValueError as e:
            raise ValueError(f"{e} (the file ${var} names)") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
