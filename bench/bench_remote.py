"""The remote tier (Mooncake Store over loopback TCP) against Mooncake's own batch calls, in one run.

One ``mooncake_master`` and one segment-holder process that mounts the store's only segment (both killed by pid at
the end); every client mounts none, so every value crosses loopback TCP, for kvtier and the raw client alike. Per
cell (``--cells``: a host layout, ``LAYOUT:zero_copy`` or ``LAYOUT:staged``): kvtier's put (instance A stores fresh
blocks, D2H skipped, until its put job drains) and fetch (instance B ``lookup_tiers`` then ``wait``, every byte
compared with A's), the raw client's ``batch_put_from`` / ``batch_get_into`` of the same values (``raw``, and
``raw_ranges`` in kvtier's ranges), the hit latency of a ``--hit-tokens`` prefix and the workers' CPU per block.
The JSON's ``method`` says how each is timed. Summary: ``remote_put_over_raw``, ``remote_get_over_raw`` (the worst
shipped cell), the GB/s, ``hit_8k_ms``; ``--runs N`` runs the whole bench N times, each in its own process, and
takes medians over runs.

Run: ``python bench/bench_remote.py --runs 5 --out bench/results/remote_cpu.json`` (about 12 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("GLOG_minloglevel", "1")  # Mooncake's INFO lines off; its warnings (queue-full, failures) stay

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (ROOT, SkipCopies, call_us, command, kill, machine, png_beside, pyplot, read_json,  # noqa: E402
                          save_png, write_json)
from kvtier.config import TierConfig  # noqa: E402
from kvtier.geometry import KVGeometry  # noqa: E402
from kvtier.index import page_hashes  # noqa: E402
from kvtier.storage.block_format import ALIGN, BlockHeader, pack_block_header  # noqa: E402
from kvtier.tier import HostBlockPool, KVTier, remote_tier  # noqa: E402
from kvtier.tier.remote_tier import BATCH_BYTES, MAX_BATCH_BLOCKS, _checksum, _ranges  # noqa: E402
from tests.kv_helpers import make_kv  # noqa: E402
from tests.mooncake_master import Master  # noqa: E402

MiB = 1 << 20
IDENTITY = {"model": "bench-remote", "revision": "0", "tp_rank": 0, "tp_size": 1}
MC_ENV = ("MC_TCP_LANES_PER_PEER", "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER",
          "MC_TCP_ADMISSION_TIMEOUT_MS", "MC_TCP_SLICE_SIZE", "GLOG_minloglevel")

HOLDER = """
import sys
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup("127.0.0.1", "P2PHANDSHAKE", int(sys.argv[2]), 16 << 20, "tcp", "", sys.argv[1])
print("ready" if rc == 0 else f"failed {rc}", flush=True)
sys.stdin.read()  # until the bench closes the pipe or kills this process
"""


@dataclasses.dataclass
class Stores:
    """The processes and clients of one run; :meth:`close` stops them (the processes by pid)."""

    master: Master
    holder: subprocess.Popen
    raw: object  # MooncakeDistributedStore

    @classmethod
    def start(cls, log_dir: str, segment_bytes: int) -> "Stores":
        master = Master(log_dir)
        holder = None
        try:
            log = open(os.path.join(log_dir, "holder.log"), "ab")
            holder = subprocess.Popen([sys.executable, "-c", HOLDER, master.addr, str(segment_bytes)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
            log.close()
            line = holder.stdout.readline().decode().strip()
            if line != "ready":
                raise RuntimeError(f"the segment holder did not start ({line!r}, log in {log_dir})")
            from mooncake.store import MooncakeDistributedStore
            raw = MooncakeDistributedStore()
            rc = raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master.addr)
            if rc != 0:
                raise RuntimeError(f"raw client set-up failed ({rc})")
            return cls(master, holder, raw)
        except BaseException:
            if holder is not None:
                kill(holder)
            master.kill()
            raise

    def close(self) -> None:
        try:
            self.raw.close()
        finally:
            kill(self.holder)
            self.master.kill()


def med(xs):
    return statistics.median(xs) if xs else None


def q(xs, f):
    s = sorted(xs)
    return s[min(len(s) - 1, int(f * len(s)))] if s else None


class Bench:
    """One cell: a host layout (and ``variant``: ``zero_copy``, the remote tier hands Mooncake the block's own ranges,
    as before staging, or ``staged``, every block staged, whatever the layout), instances A (puts) and B (fetches),
    the raw client's buffers."""

    def __init__(self, args, stores: Stores, geo: KVGeometry, layout: str, max_blocks: int,
                 variant: str = "") -> None:
        self.args, self.stores, self.geo, self.layout = args, stores, geo, layout
        self.name = layout + (f":{variant}" if variant else "")
        self.V = ALIGN + geo.block_bytes  # value bytes: header + block
        self.batch = max(1, min(MAX_BATCH_BLOCKS, BATCH_BYTES // geo.block_bytes))
        # Pools of 2x the largest prefix: a put queue holds up to half the pool, a fetch takes up to half of it.
        saved = remote_tier.STAGE_RANGES
        if variant == "zero_copy":
            remote_tier.STAGE_RANGES = 1 << 30  # no block is staged
        elif variant == "staged":
            remote_tier.STAGE_RANGES = 0  # every block is staged
        try:
            self.a = self._tier(2 * max_blocks + 2, skip_store_copy=True, seed=1)
            self.b = self._tier(2 * max_blocks + 2, skip_store_copy=False, seed=2)
        finally:
            remote_tier.STAGE_RANGES = saved
        self.staged = self.a.lower_tier("remote").medium.staged
        rng = np.random.default_rng(7)
        flat = self.a.pool.host.view(-1).view(torch.uint8).numpy()
        step = 256 * MiB
        for off in range(0, flat.size, step):
            flat[off:off + step] = rng.integers(0, 256, min(step, flat.size - off), np.uint8)
        # raw buffers: values back to back, registered with the raw client
        self.src = rng.integers(0, 256, max_blocks * self.V, np.uint8)
        self.dst = np.zeros(max_blocks * self.V, np.uint8)
        for buf in (self.src, self.dst):
            rc = stores.raw.register_buffer(buf.ctypes.data, buf.nbytes)
            if rc != 0:
                raise RuntimeError(f"register_buffer failed ({rc})")
        # the ranges kvtier hands Mooncake for a block of this cell, as sizes in value order
        rows = self.a.pool.block_rows(0)
        self.range_sizes = [self.V] if self.staged else [ALIGN] + [n for _, n in _ranges(rows)]
        self.ranges_per_value = len(self.range_sizes)
        self._tag = 0

    def _tier(self, num_blocks: int, *, skip_store_copy: bool, seed: int) -> KVTier:
        geo, a = self.geo, self.args
        kv = make_kv(geo, 2 * geo.page_size, "cpu", torch.Generator().manual_seed(seed))
        cfg = TierConfig(page_size=geo.page_size, tokens_per_block=geo.page_size, cpu_cache_gb=1.0,
                         host_layout=self.layout, remote_backend="mooncake", remote_master=self.stores.master.addr,
                         remote_local_hostname="127.0.0.1", remote_segment_gb=0.0,
                         remote_timeout_s=a.remote_timeout_s, remote_admission="always",
                         remote_key_prefix=f"bench-{self.name.replace(':', '-')}")
        pool = HostBlockPool(geo, num_blocks, layout=self.layout)
        return KVTier(kv, cfg, pool=pool, executor=SkipCopies(skip=("store",)) if skip_store_copy else None,
                      model_identity=IDENTITY)

    def close(self) -> None:
        for buf in (self.src, self.dst):
            self.stores.raw.unregister_buffer(buf.ctypes.data)
        self.a.destroy()
        self.b.destroy()

    # --- one repetition's parts ---

    def fresh_tokens(self, n: int) -> np.ndarray:
        self._tag += 1
        return np.arange(n * self.geo.page_size, dtype=np.int64) + self._tag * 1_000_000  # keys: per layout prefix

    def kvtier_put(self, toks: np.ndarray) -> dict:
        a, n = self.a, toks.size // self.geo.page_size
        a.reset()  # empty A: the store takes the first n blocks (random bytes)
        s0 = a.stats()
        slots = torch.arange(toks.size, dtype=torch.int64) % a.kv.buffers[0].shape[0]  # no copy reads them
        t0 = time.perf_counter()
        task = a.store(toks, None, slots)
        a.wait(task)  # finalized: the blocks enter the index and the remote put job is submitted
        t1 = time.perf_counter()
        while a.stats()["remote_blocks_pending_put"]:  # each wait is bounded by remote_timeout_s
            a.lower_tier("remote").drain(wait=True)
        t2 = time.perf_counter()
        s1 = a.stats()
        put = s1["remote_blocks_put"] - s0["remote_blocks_put"]
        job_s = s1["remote_seconds_put"] - s0["remote_seconds_put"]
        return {"blocks": n, "blocks_put": put,
                "blocks_failed": s1["remote_blocks_put_failed"] - s0["remote_blocks_put_failed"],
                "blocks_dropped": s1["remote_blocks_put_dropped"] - s0["remote_blocks_put_dropped"],
                "store_to_submit_s": t1 - t0, "wall_s": t2 - t0, "job_s": job_s,
                "gbps": put * self.V / (t2 - t0) / 1e9, "job_gbps": put * self.V / job_s / 1e9 if job_s else None,
                "block_ids": a.index.match(toks, None, touch=False).block_ids}

    def kvtier_fetch(self, toks: np.ndarray, src_ids) -> dict:
        b, n = self.b, toks.size // self.geo.page_size
        b.reset()  # empty B
        s0 = b.stats()
        t0 = time.perf_counter()
        hit = b.lookup_tiers(toks, None)
        t1 = time.perf_counter()
        task = hit.read
        if task is not None:
            b.wait(task)
        t2 = time.perf_counter()
        s1 = b.stats()
        got = s1["pages_fetched"] - s0["pages_fetched"]
        job_s = s1["remote_seconds_fetch"] - s0["remote_seconds_fetch"]
        m = b.index.match(toks, None, touch=False)
        k = min(len(m.block_ids), len(src_ids))  # the blocks fetched (a failed get stops at its first miss)
        equal = all(np.array_equal(b.pool.block_rows(int(x)), self.a.pool.block_rows(int(y)))
                    for x, y in zip(m.block_ids[:k], src_ids[:k]))
        return {"blocks": n, "blocks_fetched": got, "status": None if task is None else task.status,
                "blocks_corrupt": s1["remote_blocks_corrupt"] - s0["remote_blocks_corrupt"],
                "blocks_missing": s1["remote_blocks_missing"] - s0["remote_blocks_missing"],
                "lookup_s": t1 - t0, "wall_s": t2 - t0, "get_job_s": job_s,
                "gbps": got * self.V / (t2 - t0) / 1e9, "get_job_gbps": got * self.V / job_s / 1e9 if job_s else None,
                "bytes_equal": bool(equal)}

    def _calls(self, fn, keys, value_args):
        codes = []
        t0 = time.perf_counter()
        for a in range(0, len(keys), self.batch):
            b = min(a + self.batch, len(keys))
            codes += fn(keys[a:b], *(v[a:b] for v in value_args))
        return time.perf_counter() - t0, codes

    def raw(self, n: int, *, ranges: bool) -> dict:
        """Raw put then get of ``n`` fresh values (one range each, or kvtier's ranges for this layout)."""
        st, V = self.stores.raw, self.V
        self._tag += 1
        keys = [f"raw/{self.name}/{self._tag}/{i}" for i in range(n)]
        if ranges:
            offs = np.concatenate(([0], np.cumsum(self.range_sizes)[:-1])).tolist()
            ptrs = lambda buf: [[buf.ctypes.data + i * V + o for o in offs] for i in range(n)]  # noqa: E731
            put, get, sizes = st.batch_put_from_multi_buffers, st.batch_get_into_multi_buffers, [self.range_sizes] * n
        else:
            ptrs = lambda buf: [buf.ctypes.data + i * V for i in range(n)]  # noqa: E731
            put, get, sizes = st.batch_put_from, st.batch_get_into, [V] * n
        put_s, pc = self._calls(put, keys, (ptrs(self.src), sizes))
        self.dst[:n * V] = 0
        get_s, gc = self._calls(get, keys, (ptrs(self.dst), sizes))
        put_ok = sum(c == 0 for c in pc)
        get_ok = sum(c == V for c in gc)
        good = [i for i in range(n) if pc[i] == 0 and gc[i] == V]
        equal = all(np.array_equal(self.src[i * V:(i + 1) * V], self.dst[i * V:(i + 1) * V]) for i in good)
        st.batch_remove(keys, True)
        return {"values": n, "put_ok": put_ok, "get_ok": get_ok, "put_s": put_s, "get_s": get_s,
                "put_gbps": put_ok * V / put_s / 1e9, "get_gbps": get_ok * V / get_s / 1e9,
                "put_codes": sorted(set(map(int, pc))), "get_codes": sorted(set(map(int, gc))),
                "bytes_equal": bool(equal)}

    def raw_probe(self, n: int) -> float:
        """Seconds of ``batch_is_exist`` over ``n`` keys held (kvtier's probe, raw)."""
        st, V = self.stores.raw, self.V
        self._tag += 1
        keys = [f"rawp/{self.name}/{self._tag}/{i}" for i in range(n)]
        self._calls(st.batch_put_from, keys, ([[self.src.ctypes.data + i * V for i in range(n)], [V] * n]))
        t0 = time.perf_counter()
        st.batch_is_exist(keys)
        s = time.perf_counter() - t0
        st.batch_remove(keys, True)
        return s

    def worker_cpu(self, reps: int = 50) -> dict:
        """Median microseconds per block of what the remote workers do besides the Mooncake call (on their
        thread, holding the GIL): the payload checksum, the header, the ranges, the key, the staging copy."""
        a = self.a
        rows = a.pool.block_rows(1)
        slot = np.empty(self.geo.block_bytes, np.uint8).reshape(rows.shape)
        toks = np.arange(self.geo.page_size, dtype=np.int64)
        medium = a.lower_tier("remote").medium
        fns = {"checksum_block": lambda: _checksum(rows), "checksum_staged": lambda: _checksum(slot),
               "header_pack": lambda: pack_block_header(BlockHeader(medium.fingerprint, 0, 12345, toks,
                                                                    self.geo.block_bytes, 678)),
               "ranges": lambda: _ranges(rows), "key": lambda: medium.keys(np.array([12345], np.uint64)),
               "staging_copy": lambda: np.copyto(slot, rows)}
        out = {}
        for name, fn in fns.items():
            fn()
            out[name] = med(call_us(fn, reps))
        per_block = out["checksum_block"] + out["header_pack"] + out["key"] + (
            out["staging_copy"] if self.staged else out["ranges"])
        out["put_path_us_per_block"] = per_block  # the get path: the same with the header unpacked instead
        return out

    def remove_kvtier(self, toks: np.ndarray) -> None:
        keys = self.a.lower_tier("remote").medium.keys(page_hashes(toks, self.geo.page_size, None))
        self.stores.raw.batch_remove(keys, True)

    # --- the measurements ---

    def throughput(self, n: int, reps: int) -> dict:
        rows = []
        for rep in range(reps + 1):  # the first is the warm-up
            toks = self.fresh_tokens(n)
            raw_first = rep % 2 == 1  # neither side always puts right after the last repetition's removals
            if raw_first:
                raw, raw_r = self.raw(n, ranges=False), self.raw(n, ranges=True)
            put = self.kvtier_put(toks)
            if not raw_first:
                raw, raw_r = self.raw(n, ranges=False), self.raw(n, ranges=True)
            fetch = self.kvtier_fetch(toks, put.pop("block_ids"))
            self.remove_kvtier(toks)
            rows.append({"warmup": rep == 0, "raw_first": raw_first, "kvtier_put": put, "kvtier_fetch": fetch,
                         "raw": raw, "raw_ranges": raw_r})
            print(f"  {self.name} rep {rep}{' (warm-up)' if rep == 0 else ''}: put kvtier {put['gbps']:.3f} "
                  f"(job {put['job_gbps'] or 0:.3f}) raw {raw['put_gbps']:.3f} raw_ranges {raw_r['put_gbps']:.3f}"
                  f" | get kvtier {fetch['gbps']:.3f} raw {raw['get_gbps']:.3f} raw_ranges {raw_r['get_gbps']:.3f}"
                  f" GB/s | kvtier put {put['blocks_put']}/{n} fetched {fetch['blocks_fetched']}/{n}", flush=True)
        timed = [r for r in rows if not r["warmup"]]
        col = lambda part, key: [r[part][key] for r in timed if r[part][key] is not None]  # noqa: E731
        medians = {"kvtier_put_gbps": ("kvtier_put", "gbps"), "kvtier_put_job_gbps": ("kvtier_put", "job_gbps"),
                   "kvtier_fetch_gbps": ("kvtier_fetch", "gbps"),
                   "kvtier_fetch_get_job_gbps": ("kvtier_fetch", "get_job_gbps"),
                   **{f"{p}_{op}_gbps": (p, f"{op}_gbps") for p in ("raw", "raw_ranges") for op in ("put", "get")}}
        out = {"blocks": n, "bytes_per_rep": n * self.V, "ranges_per_value": self.ranges_per_value,
               "staged": self.staged, **{k: med(col(*where)) for k, where in medians.items()},
               "kvtier_blocks_put_failed": sum(col("kvtier_put", "blocks_failed")),
               "kvtier_blocks_not_fetched": sum(r["kvtier_fetch"]["blocks"] - r["kvtier_fetch"]["blocks_fetched"]
                                                for r in timed),
               "raw_ranges_failed": sum(2 * n - r["raw_ranges"]["put_ok"] - r["raw_ranges"]["get_ok"]
                                        for r in timed),
               "raw_failed": sum(2 * n - r["raw"]["put_ok"] - r["raw"]["get_ok"] for r in timed),
               "bytes_equal": all(r["kvtier_fetch"]["bytes_equal"] and r["raw"]["bytes_equal"]
                                  and r["raw_ranges"]["bytes_equal"] for r in rows),
               "all_fetched": all(r["kvtier_fetch"]["blocks_fetched"] == n for r in rows),
               "reps": rows}
        out["put_over_raw"] = out["kvtier_put_gbps"] / out["raw_put_gbps"]
        out["put_job_over_raw"] = (out["kvtier_put_job_gbps"] / out["raw_put_gbps"]
                                   if out["kvtier_put_job_gbps"] else None)
        out["get_over_raw"] = out["kvtier_fetch_gbps"] / out["raw_get_gbps"]
        # the same from each repetition's own pair (the machine's speed drifts between repetitions)
        out["put_over_raw_paired"] = med([r["kvtier_put"]["gbps"] / r["raw"]["put_gbps"] for r in timed])
        out["get_over_raw_paired"] = med([r["kvtier_fetch"]["gbps"] / r["raw"]["get_gbps"] for r in timed])
        return out

    def hit(self, n: int, reps: int) -> dict:
        rows = []
        for rep in range(reps + 1):
            toks = self.fresh_tokens(n)
            put = self.kvtier_put(toks)  # untimed here: the prefix instance A put
            fetch = self.kvtier_fetch(toks, put.pop("block_ids"))
            raw = self.raw(n, ranges=False)
            self.remove_kvtier(toks)
            rows.append({"warmup": rep == 0, "kvtier_put": put, "kvtier_fetch": fetch,
                         "raw_get_s": raw["get_s"], "raw_get_ok": raw["get_ok"], "raw_put_ok": raw["put_ok"]})
            print(f"  {self.name} hit {n * self.geo.page_size} tokens rep {rep}"
                  f"{' (warm-up)' if rep == 0 else ''}: kvtier {fetch['wall_s'] * 1e3:.1f} ms "
                  f"({fetch['blocks_fetched']}/{n} blocks) raw get {raw['get_s'] * 1e3:.1f} ms", flush=True)
        timed = [r for r in rows if not r["warmup"]]
        ms = [r["kvtier_fetch"]["wall_s"] * 1e3 for r in timed]
        raw_ms = [r["raw_get_s"] * 1e3 for r in timed]
        probe_ms = [self.raw_probe(n) * 1e3 for _ in range(3)]
        return {"tokens": n * self.geo.page_size, "blocks": n, "bytes": n * self.V,
                "kvtier_ms": med(ms), "kvtier_ms_p20": q(ms, 0.2), "kvtier_ms_p80": q(ms, 0.8),
                "kvtier_lookup_ms": med([r["kvtier_fetch"]["lookup_s"] * 1e3 for r in timed]),
                "kvtier_fetch_job_ms": med([r["kvtier_fetch"]["get_job_s"] * 1e3 for r in timed]),  # probe + get
                "raw_get_ms": med(raw_ms), "raw_probe_ms": med(probe_ms),
                "kvtier_over_raw_time": med(ms) / med(raw_ms),
                "all_fetched": all(r["kvtier_fetch"]["blocks_fetched"] == n for r in timed),
                "bytes_equal": all(r["kvtier_fetch"]["bytes_equal"] for r in rows), "reps": rows}


def plot(res: dict, path: str) -> None:
    plt = pyplot()
    cells = list(res["cells"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.4), gridspec_kw={"width_ratios": [2.2, 1]})
    ax = axes[0]
    label = lambda c: c.replace(":zero_copy", "\n(zero-copy, before)")  # noqa: E731
    s = res["summary"]  # per cell: the run's figures, or their medians over runs
    groups = [(f"{op}\n{label(c)}", c, op) for op in ("put", "get") for c in cells]
    bars = [("kvtier", lambda c, op: s[f"{c}/kvtier_put_gbps"] if op == "put" else s[f"{c}/kvtier_fetch_gbps"]),
            ("raw batch_put_from / batch_get_into", lambda c, op: s[f"{c}/raw_{op}_gbps"]),
            ("raw, in kvtier's ranges per value", lambda c, op: s[f"{c}/raw_ranges_{op}_gbps"])]
    w = 0.8 / len(bars)
    x = np.arange(len(groups))
    for i, (name, fn) in enumerate(bars):
        vals = [fn(c, op) or 0.0 for _, c, op in groups]
        ax.bar(x + i * w, vals, w, label=name)
        for xi, v in zip(x + i * w, vals):
            ax.text(xi, v, f"{v:.2f}", ha="center", va="bottom", fontsize=6)
    ax.set_xticks(x + w * (len(bars) - 1) / 2, [g[0] for g in groups], fontsize=7)
    runs = s.get("runs", 1)
    ax.set_ylabel("GB/s (value bytes, median" + (f" of {runs} runs' medians)" if runs > 1 else ")"))
    g = res["geometry"]
    ax.set_title(f"remote tier vs raw Mooncake, loopback TCP, {res['machine']['cpus']} CPUs: "
                 f"{res['cells'][cells[0]]['throughput']['blocks']} values of {g['value_bytes'] / MiB:.2f} MiB "
                 f"per rep", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1]
    hits = [(c, res["cells"][c]["hit"]) for c in cells if res["cells"][c].get("hit")]
    for i, (_c, h) in enumerate(hits):
        ax.bar(i - 0.2, h["kvtier_ms"], 0.4, color="C0", label="kvtier lookup_tiers -> wait(fetch)" if i == 0 else None)
        ax.bar(i + 0.2, h["raw_get_ms"], 0.4, color="C1", label="raw batch_get_into" if i == 0 else None)
        ax.text(i - 0.2, h["kvtier_ms"], f"{h['kvtier_ms']:.0f}", ha="center", va="bottom", fontsize=7)
        ax.text(i + 0.2, h["raw_get_ms"], f"{h['raw_get_ms']:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(hits)), [label(c) for c, _ in hits], fontsize=8)
    ax.set_ylabel("ms (median)")
    if hits:
        ax.set_title(f"instance B's hit of a {hits[0][1]['tokens']}-token prefix ({hits[0][1]['bytes'] / MiB:.0f} MiB)",
                     fontsize=9)
        ax.set_ylim(0, 1.25 * max(max(h["kvtier_ms"], h["raw_get_ms"]) for _, h in hits))
    ax.legend(fontsize=7, loc="upper center", ncol=1)
    save_png(fig, path)


RUN_KEYS = ("put_over_raw", "put_job_over_raw", "get_over_raw", "put_over_raw_paired", "get_over_raw_paired",
            "kvtier_put_gbps", "kvtier_fetch_gbps", "raw_put_gbps", "raw_get_gbps", "raw_ranges_put_gbps",
            "raw_ranges_get_gbps")  # a cell's figures that take a median over runs
CELL_KEYS = ("ranges_per_value", "staged", "kvtier_blocks_put_failed", "kvtier_blocks_not_fetched")


def summarize(res: dict) -> dict:
    """The worst of the tier's cells (variant cells, ``:zero_copy`` and ``:staged``, are not the tier as it ships:
    reported apart), every cell's figures, the hit latency of the default host layout."""
    per = {c: e["throughput"] for c, e in res["cells"].items()}
    shipped = [c for c in per if ":" not in c] or list(per)
    worst_put = min(shipped, key=lambda c: per[c]["put_over_raw"])
    worst_get = min(shipped, key=lambda c: per[c]["get_over_raw"])
    s = {"remote_put_over_raw": per[worst_put]["put_over_raw"], "remote_put_worst_cell": worst_put,
         "remote_get_over_raw": per[worst_get]["get_over_raw"], "remote_get_worst_cell": worst_get,
         "kvtier_put_gbps": per[worst_put]["kvtier_put_gbps"], "raw_put_gbps": per[worst_put]["raw_put_gbps"],
         "kvtier_fetch_gbps": per[worst_get]["kvtier_fetch_gbps"], "raw_get_gbps": per[worst_get]["raw_get_gbps"]}
    hits = {c: e["hit"] for c, e in res["cells"].items() if "hit" in e}
    default = "layer_first" if "layer_first" in hits else next(iter(hits), None)
    if default is not None:
        h = hits[default]
        s.update(hit_8k_ms=h["kvtier_ms"], hit_8k_raw_get_ms=h["raw_get_ms"], hit_8k_over_raw=h["kvtier_over_raw_time"],
                 hit_tokens=h["tokens"], hit_cell=default, hit_all_fetched=h["all_fetched"])
    for c, t in per.items():
        s.update({f"{c}/{k}": t[k] for k in RUN_KEYS + CELL_KEYS})
        s[f"{c}/raw_ranges_values_failed"] = t["raw_ranges_failed"]
    for c, h in hits.items():
        s.update({f"{c}/hit_ms": h["kvtier_ms"], f"{c}/hit_raw_get_ms": h["raw_get_ms"],
                  f"{c}/hit_all_fetched": h["all_fetched"]})
    s["bytes_equal"] = all(t["bytes_equal"] for t in per.values()) and all(h["bytes_equal"] for h in hits.values())
    return s




def merge_runs(runs: list[dict]) -> dict:
    """One result from independent runs: the first run's cells and hit latency, every run's summary under
    ``runs``, and a summary of per-run medians (``CELL/KEY``), each ratio's values by run (``CELL/KEY_runs``) and
    its worst run; the worst cell is the one of the lowest median."""
    res = dict(runs[0])
    res["runs"] = [{"summary": r["summary"], "seconds": r["seconds"]} for r in runs]
    res["seconds"] = sum(r["seconds"] for r in runs)
    first = runs[0]["summary"]
    s = dict(first)
    cells = list(runs[0]["cells"])
    for c in cells:
        for key in RUN_KEYS:
            vals = [r["summary"][f"{c}/{key}"] for r in runs if r["summary"].get(f"{c}/{key}") is not None]
            if not vals:
                continue
            s[f"{c}/{key}"] = med(vals)
            if key.endswith("_over_raw"):
                s[f"{c}/{key}_runs"] = vals
                s[f"{c}/{key}_worst_run"] = min(vals)
        for key in ("kvtier_blocks_put_failed", "kvtier_blocks_not_fetched", "raw_ranges_values_failed"):
            s[f"{c}/{key}"] = sum(r["summary"][f"{c}/{key}"] for r in runs)
    shipped = [c for c in cells if ":" not in c] or cells
    for op, rate, raw in (("put", "kvtier_put_gbps", "raw_put_gbps"), ("get", "kvtier_fetch_gbps", "raw_get_gbps")):
        worst = min(shipped, key=lambda c: s[f"{c}/{op}_over_raw"])
        s[f"remote_{op}_over_raw"], s[f"remote_{op}_worst_cell"] = s[f"{worst}/{op}_over_raw"], worst
        s[f"remote_{op}_over_raw_worst_run"] = min(min(s[f"{c}/{op}_over_raw_runs"]) for c in shipped)
        s[rate] = s[f"{worst}/{rate}"]
        s[raw] = s[f"{worst}/{raw}"]
    s["runs"] = len(runs)
    s["bytes_equal"] = all(r["summary"]["bytes_equal"] for r in runs)
    res["summary"] = s
    return res


def _run_children(args, argv_of) -> dict:
    """``args.runs`` runs of this bench, each in a fresh process (the hit latency in the first only), merged."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-remote-runs-") as d:
        for i in range(args.runs):
            out = os.path.join(d, f"run{i}.json")
            cmd = [sys.executable, os.path.abspath(__file__), *argv_of(i), "--runs", "1", "--no-plot", "--out", out]
            print(f"run {i + 1}/{args.runs}: {' '.join(cmd[2:])}", flush=True)
            subprocess.run(cmd, check=True)
            runs.append(read_json(out))
    return merge_runs(runs)


def _write(res: dict, args, took: str) -> None:
    """The JSON at ``args.out`` and, unless ``--no-plot``, its PNG beside it."""
    write_json(args.out, res)
    print(f"wrote {args.out} ({took})")
    if not args.no_plot:
        try:
            plot(res, png_beside(args.out))
        except Exception as e:  # matplotlib missing: the JSON is the result
            print("plot skipped:", e)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", default="layer_first,page_first,layer_first:zero_copy",
                    help="host layouts, comma-separated; LAYOUT:zero_copy: the tier without staging (as before it);"
                         " LAYOUT:staged: every block staged")
    ap.add_argument("--hit-cells", default="layer_first,page_first", help="cells of the hit latency")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=256, help="blocks per throughput repetition")
    ap.add_argument("--hit-tokens", type=int, default=8192, help="prefix of the hit latency (0: skip it)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--hit-reps", type=int, default=5)
    ap.add_argument("--segment-gb", type=float, default=4.0, help="the holder's segment (the store's capacity)")
    ap.add_argument("--remote-timeout-s", type=float, default=30.0,
                    help="remote_timeout_s of the instances (a stage is one whole get: 5 s, the default, is short "
                         "for 900 MiB at the zero-copy layer_first rate)")
    ap.add_argument("--runs", type=int, default=1,
                    help="independent runs, each in a process of its own; the summary takes medians over them")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "remote_cpu.json"))
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--plot", metavar="JSON", help="only draw the PNG of an earlier run's JSON (next to it)")
    args = ap.parse_args(argv)
    if args.plot:
        plot(read_json(args.plot), png_beside(args.plot))
        return 0
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    if args.runs > 1:
        def argv_of(i: int) -> list[str]:
            keep = {k: v for k, v in vars(args).items() if k not in ("runs", "out", "no_plot", "plot")}
            if i:
                keep["hit_tokens"] = 0
            return [a for k, v in keep.items() for a in (f"--{k.replace('_', '-')}", str(v))]
        res = _run_children(args, argv_of)
        res["command"], res["args"] = command(), vars(args)
        print(json.dumps({k: v for k, v in res["summary"].items() if "/" not in k}, indent=1))
        _write(res, args, f"{res['seconds']:.0f} s in {args.runs} runs")
        return 0
    cells = [c for c in args.cells.split(",") if c]
    hit_cells = [c for c in args.hit_cells.split(",") if c] if args.hit_tokens else []
    geo = KVGeometry(args.layers, args.kv_heads, args.head_dim, torch.float16, page_size=args.block_tokens)
    hit_blocks = args.hit_tokens // args.block_tokens
    t_start = time.perf_counter()
    res = {"summary": {}, "method": {
        "topology": "one mooncake_master and one segment-holder process (the store's only segment) on 127.0.0.1; "
                    "kvtier instances A, B and the raw client mount no segment: every value crosses loopback TCP",
        "kvtier_put": "A.store of fresh blocks (D2H skipped: SkipCopies; the pool holds random bytes) -> "
                      "A.wait (finalize: index insert, RemoteLink.entered submits the put job) -> "
                      "A.lower_tier('remote').drain(wait=True) until no put is pending; gbps = blocks put x value "
                      "bytes / that wall time (the summary's figure: it counts everything the tier adds). "
                      "job_gbps: the put job's own seconds on its thread (remote_seconds_put), "
                      "without the owner's side",
        "kvtier_fetch": "B (empty pool, admission 'always') lookup_tiers -> wait(fetch task): probe "
                        "(batch_is_exist), allocation, get (batch_get_into_multi_buffers into B's pool, or its "
                        "staging buffer), header and payload checks, index insert; gbps = blocks fetched x value "
                        "bytes / that wall time",
        "raw": "one MooncakeDistributedStore client: batch_put_from / batch_get_into of the same number of values "
               "of the same bytes, one registered range per value, in batches of the tier's (BATCH_BYTES, "
               "MAX_BATCH_BLOCKS); wall time over the batches",
        "raw_ranges": "the same with each value in the ranges kvtier hands Mooncake in that cell (multi-buffer "
                      "calls): 1 when staged, header + block rows otherwise",
        "hit": "B's lookup_tiers -> wait(fetch) for a fresh prefix of hit_tokens; raw: batch_get_into of the same "
               "values; raw_probe_ms: batch_is_exist over its keys",
        "reps": "fresh keys every repetition (removed after it), one warm-up then medians; kvtier and raw alternate "
                "within a repetition; *_over_raw: median kvtier GB/s over median raw GB/s (the summary's), "
                "*_over_raw_paired: the median of each repetition's own ratio",
        "bytes": "GB/s = 1e9 bytes/s of value bytes (4 KiB header + block) on every side",
        "zero_copy": "a ':zero_copy' cell builds the tier with remote_tier.STAGE_RANGES out of reach: every block "
                     "is handed to Mooncake in its own ranges (the tier before staging)",
        "staged": "a ':staged' cell builds the tier with remote_tier.STAGE_RANGES at 0: every block is staged"},
        "machine": machine(),
        "geometry": {"num_layers": geo.num_layers, "num_kv_heads": geo.num_kv_heads, "head_dim": geo.head_dim,
                     "dtype": "float16", "block_tokens": geo.page_size, "block_bytes": geo.block_bytes,
                     "value_bytes": ALIGN + geo.block_bytes,
                     "batch_blocks": max(1, min(MAX_BATCH_BLOCKS, BATCH_BYTES // geo.block_bytes))},
        "mooncake_env": {k: os.environ.get(k) for k in MC_ENV},
        "args": vars(args),
        "command": command(),
        "cells": {}}
    try:
        from importlib.metadata import version
        res["versions"] = {"mooncake": version("mooncake-transfer-engine-non-cuda"), "torch": torch.__version__,
                           "xxhash": version("xxhash"), "numpy": np.__version__}
    except Exception as e:  # the JSON is the result either way
        res["versions"] = {"error": str(e)}
    log_dir = tempfile.mkdtemp(prefix="kvtier-bench-remote-")
    print(f"block {geo.block_bytes} B, value {ALIGN + geo.block_bytes} B, {args.blocks} blocks per rep, "
          f"hit {args.hit_tokens} tokens; logs in {log_dir}", flush=True)
    stores = Stores.start(log_dir, int(args.segment_gb * (1 << 30)))
    try:
        for cell in cells:
            layout, _, variant = cell.partition(":")
            t = time.perf_counter()
            b = Bench(args, stores, geo, layout, max(args.blocks, hit_blocks if cell in hit_cells else 0),
                      variant=variant)
            try:
                print(f"{cell}: set up in {time.perf_counter() - t:.1f} s ({b.ranges_per_value} ranges per value, "
                      f"{'staged' if b.staged else 'zero-copy'})", flush=True)
                entry = {"ranges_per_value": b.ranges_per_value, "staged": b.staged, "worker_cpu_us": b.worker_cpu(),
                         "throughput": b.throughput(args.blocks, args.reps)}
                if cell in hit_cells and hit_blocks:
                    entry["hit"] = b.hit(hit_blocks, args.hit_reps)
                entry["seconds"] = time.perf_counter() - t
                res["cells"][cell] = entry
            finally:
                b.close()
    finally:
        stores.close()
    res["seconds"] = time.perf_counter() - t_start
    res["summary"] = summarize(res)
    print(json.dumps(res["summary"], indent=1))
    _write(res, args, f"{res['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
