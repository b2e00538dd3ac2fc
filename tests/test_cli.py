"""The ``kvtier`` command line: the demo serves from kvtier and fails on a mismatch; help, version, errors."""

import os
import subprocess
import sys

import pytest
import torch

from kvtier import cli, demo

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ARGS = ["--device", DEVICE] if DEVICE == "cuda" else []


def test_demo_serves_from_kvtier_and_matches_the_device_cache(capsys):
    pytest.importorskip("transformers")
    assert cli.main(["demo", *ARGS, "--prompt-tokens", "96"]) == 0
    out = capsys.readouterr().out
    assert "80 of 80 cacheable tokens" in out and "identical" in out
    if DEVICE == "cpu":
        assert "TTFT" not in out.split("served three ways")[1].split("\n")[2]  # no timings from the interpreter


def test_serve_demo_reports_lost_kv(monkeypatch):
    pytest.importorskip("transformers")
    from kvtier.tier import KVTier

    real = KVTier.load_layerwise

    def lossy(self, tokens, ns, slots, **kw):  # the first loaded page comes back zeroed: the demo must notice
        task = real(self, tokens, ns, slots, **kw)
        self.wait(task)
        for b in self.kv.buffers:
            b[slots[:16]] = 0
        return task

    monkeypatch.setattr(KVTier, "load_layerwise", lossy)
    assert demo.run_serve_demo(DEVICE, prompt_tokens=96) is False


def test_kernel_demo_round_trip_is_exact():
    assert cli.main(["demo", "--kernels", *ARGS]) == 0


def test_kernel_demo_reports_a_mismatch(monkeypatch):
    from kvtier import kernels

    real_load = kernels.load_pages

    def lossy_load(kv, host, slots, block_ids, **kw):  # drops the last page: the demo must notice
        real_load(kv, host, slots[:-kv.geometry.page_size], block_ids[:-1], **kw)

    monkeypatch.setattr(kernels, "load_pages", lossy_load)
    assert demo.run_kernel_demo(DEVICE) is False


def test_bare_kvtier_prints_help(capsys):
    assert cli.main([]) == 0
    assert "usage: kvtier" in capsys.readouterr().out


def test_version(capsys):
    from kvtier import __version__

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"kvtier {__version__}"


def test_cli_rejects_unknown_command():
    with pytest.raises(SystemExit):
        cli.main(["bogus"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_demo_on_cuda_without_a_gpu_is_a_clear_error(capsys):
    assert cli.main(["demo", "--device", "cuda"]) == 2
    assert "CUDA is not available here" in capsys.readouterr().err


def test_python_m_kvtier_and_help_import_no_torch():
    code = "import runpy, sys; sys.argv = ['kvtier', '--help']\n" \
           "try:\n    runpy.run_module('kvtier', run_name='__main__')\n" \
           "except SystemExit:\n    pass\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert "usage: kvtier" in out.stdout and out.stdout.strip().endswith("False"), out.stdout + out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen where CUDA is absent")
def test_demo_in_a_fresh_process_without_triton_interpret():
    """As a user runs it: building the model imports triton, which used to happen before kvtier's kernels could
    choose the interpreter, so every copy failed (and was unwound) and the demo served nothing from kvtier. Into a
    log (no terminal) it says each step as it starts, the first before torch is imported: the first demo showed
    nothing for ~160 s while numba compiled the index."""
    import time

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "kvtier", "demo", "--prompt-tokens", "48"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        first = proc.stdout.readline()
        first_s = time.monotonic() - t0
        rest, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, first + rest
    assert first == "kvtier demo: loading torch ...\n"
    assert "32 of 32 cacheable tokens" in rest
    steps = [line[:-4].split(" (", 1)[0] for line in rest.splitlines() if line.endswith(" ...")]
    assert steps == ["kvtier demo: loading transformers, numba and kvtier's tier", "kvtier demo: building the model",
                     "kvtier demo: preparing the host index", "kvtier demo: serving the prompt three ways"], rest
    assert "numba compiles it on the first run" in rest and "preparing the host index: done in" in rest
    print(f"first line after {first_s:.2f} s")


@pytest.mark.parametrize("text,message", [
    ("cpu_cache_gb: 4\ncpu_cach_gb: 8\n", "unknown key 'cpu_cach_gb' (allowed: cpu_cache_gb,"),  # a wrong key
    ("page_size: sixteen\n", "page_size must be an int >= 1, got 'sixteen'"),  # a wrong type
    ("cpu_cache_gb: 1.0e-12\n", "cpu_cache_gb 1e-12 GiB is less than one byte"),  # divided by zero in the check
    ("remote_backend: mooncake\nremote_master: 10.0.0.5:50051\nremote_protocol: udp\n",
     "remote_protocol must be one of ['tcp', 'rdma'], got 'udp'"),  # a bad value
])
def test_config_check_of_a_bad_file_prints_one_line_and_fails(tmp_path, text, message):
    f = tmp_path / "kvtier.yaml"
    f.write_text(text)
    r = subprocess.run([sys.executable, "-m", "kvtier", "config", "check", str(f)], check=False, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and str(f) in lines[0], r.stderr


def test_config_check_fails_a_host_pool_this_host_cannot_hold(tmp_path, capsys):
    """The check said valid, then the server refused the pool for want of memory."""
    f = tmp_path / "big.yaml"
    f.write_text("cpu_cache_gb: 1048576\n")
    assert cli.main(["config", "check", str(f)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cpu_cache_gb: a host pool of 1048576 GiB per rank does not fit this host" in err[0]


def test_config_check_prints_what_a_file_resolves_to(tmp_path, capsys):
    f = tmp_path / "kvtier.json"
    f.write_text('{"cpu_cache_gb": 0.5, "page_size": 4, "remote_backend": "mooncake", "remote_master": "h:1"}')
    assert cli.main(["config", "check", "--offline", str(f)]) == 0
    out = capsys.readouterr().out
    assert "cpu_cache_gb: 0.5" in out and "ssd_cache_gb: 0.0" in out and "tokens_per_block: null" in out
    assert "layerwise: true" in out and 'remote_device: ""' in out  # as YAML writes them
    assert "tokens per host block in force: 16" in out and "host pool per rank: 0.5 GiB" in out
    assert "remote tier: mooncake at h:1 over tcp, 4 GiB of this host's memory given to the store" in out
    assert out.splitlines()[-1] == f"# {f}: valid, and every check on this host passed (remote_master not checked)"
    assert cli.main(["config", "check", str(tmp_path / "missing.yaml")]) == 1


def _check(path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier", "config", "check", *args, str(path)], check=False,
                          capture_output=True, text=True, timeout=120)


def _refused(r: subprocess.CompletedProcess) -> str:
    """The one line a refused config prints on stderr (exit status 1)."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stdout + r.stderr
    assert lines[0].startswith("kvtier config: ")
    return lines[0]


def _passed(r: subprocess.CompletedProcess) -> str:
    """The verdict of a config that passed: stdout's last line (exit status 0, nothing on stderr)."""
    assert r.returncode == 0 and r.stderr == "", r.stdout + r.stderr
    return r.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("case", ["proc", "sys", "file", "under_a_file", "read_only"])
def test_config_check_refuses_ssd_directories_the_tier_cannot_use(tmp_path, case):
    """/proc/kvtier passed the check, then the tier failed at start; a file in its place failed with 'File exists'."""
    if case == "read_only" and os.getuid() == 0:
        target = "/sys/fs/cgroup/kvtier"  # tmpfs below /sys: root may write there, yet it is the kernel's
    else:
        (tmp_path / "a_file").write_text("x")
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        target = {"proc": "/proc/kvtier", "sys": "/sys/kvtier", "file": str(tmp_path / "a_file"),
                  "under_a_file": str(tmp_path / "a_file" / "kvtier"), "read_only": str(ro / "kvtier")}[case]
    f = tmp_path / "kvtier.yaml"
    f.write_text(f"cpu_cache_gb: 0.01\nssd_cache_gb: 0.01\nssd_cache_dir: {target}\n")
    line = _refused(_check(f))
    assert f"ssd_cache_dir: {target}" in line
    assert {"proc": "a pseudo file system", "sys": "a pseudo file system", "file": "exists and is not a directory",
            "under_a_file": "is not a directory",
            "read_only": "not writable" if os.getuid() else "pseudo"}[case] in line
    assert not os.path.exists(target) or case in ("file", "proc", "sys")  # the check made nothing


def test_config_check_refuses_an_ssd_size_the_disk_cannot_hold(tmp_path):
    """The README's /nvme0;/nvme1 passed the check on a machine without such disks."""
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    f = tmp_path / "kvtier.yaml"
    f.write_text(f"cpu_cache_gb: 0.01\nssd_cache_gb: {2 * free / 2**30 + 1}\n"
                 f"ssd_cache_dir: {tmp_path}/nvme0/kvtier;{tmp_path}/nvme1/kvtier\n")
    line = _refused(_check(f))
    assert "ssd_cache_gb:" in line and "more on the file system of" in line and "lower ssd_cache_gb" in line
    assert not (tmp_path / "nvme0").exists()


def test_config_check_refuses_a_directory_a_running_store_holds(tmp_path):
    from kvtier.storage import SsdStore, fingerprint

    f = tmp_path / "kvtier.yaml"
    f.write_text(f"cpu_cache_gb: 0.01\nssd_cache_gb: 0.01\nssd_cache_dir: {tmp_path / 'ssd'}\n")
    assert _passed(_check(f)).endswith("valid, and every check on this host passed")
    (tmp_path / "ssd").mkdir()
    with SsdStore(str(tmp_path / "ssd"), capacity_bytes=1 << 20, block_bytes=4096, fingerprint=fingerprint(model="m")):
        line = _refused(_check(f))
    assert f"ssd_cache_dir: {tmp_path / 'ssd'} is in use by a running SSD store" in line
    assert _passed(_check(f)).endswith("passed")  # the store closed: the lock went with it


def test_config_check_asks_the_master(tmp_path):
    """A master with nothing listening passed the check; the server then refused to start."""
    from tests.mooncake_master import Master, free_port

    f = tmp_path / "kvtier.yaml"
    f.write_text(f"cpu_cache_gb: 0.01\nremote_backend: mooncake\nremote_master: 127.0.0.1:{free_port()}\n")
    line = _refused(_check(f))
    assert "remote_master: 127.0.0.1:" in line and "is not reachable (Connection refused)" in line
    assert _passed(_check(f, "--offline")).endswith("(remote_master not checked)")
    master = Master(str(tmp_path))
    try:
        f.write_text(f"cpu_cache_gb: 0.01\nremote_backend: mooncake\nremote_master: {master.addr}\n"
                     "remote_timeout_s: 1\n")
        r = _check(f)
        assert _passed(r).endswith("every check on this host passed")
        assert f"ok         remote_master: {master.addr} answers" in r.stdout
        master.pause()  # stopped: the kernel still accepts its connections
        try:
            line = _refused(_check(f))
        finally:
            master.resume()
        assert f"remote_master: {master.addr} accepts connections but did not answer within 1 s" in line
    finally:
        master.kill()


def test_config_check_refuses_a_master_url():
    """remote_master: mooncake://10.0.0.5:50051 passed (the scheme taken as part of the host)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "kvtier.yaml")
        with open(f, "w") as fh:
            fh.write("remote_backend: mooncake\nremote_master: mooncake://10.0.0.5:50051\n")
        line = _refused(_check(f, "--offline"))
    assert "remote_master must be host:port without a scheme: drop 'mooncake://'" in line


def _readme_yaml() -> str:
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")) as fh:
        readme = fh.read()
    return readme.split("cat > kvtier.yaml <<'YAML'\n", 1)[1].split("\nYAML\n", 1)[0] + "\n"


def test_config_check_of_the_readmes_yaml(tmp_path):
    """It printed '# kvtier.yaml: valid', then that 64 GiB does not fit, and exited 1. As written it passes only
    on a host that serves it; with this host's sizes and directories it passes here."""
    f = tmp_path / "kvtier.yaml"
    text = _readme_yaml()
    f.write_text(text)
    r = _check(f)
    if r.returncode:
        assert "valid" not in r.stdout and ("cpu_cache_gb" in _refused(r) or "ssd_cache" in _refused(r))
    here = (text.replace("cpu_cache_gb: 64 ", "cpu_cache_gb: 0.25 ").replace("ssd_cache_gb: 512 ", "ssd_cache_gb: 0.5 ")
            .replace("/nvme0/kvtier;/nvme1/kvtier", f"{tmp_path}/nvme0/kvtier;{tmp_path}/nvme1/kvtier"))
    assert here.count(str(tmp_path)) == 2 and "0.25" in here and "0.5" in here
    f.write_text(here)
    r = _check(f)
    assert _passed(r) == f"# {f}: valid, and every check on this host passed"
    assert "SSD tier per rank: 0.5 GiB over 2 directories (0.25 GiB each)" in r.stdout


def test_config_check_prints_the_host_share_arithmetic(tmp_path):
    """Under SGLang it printed 18.80 GiB available, less 10, as 8.20 GiB (two measures of available memory)."""
    import re

    f = tmp_path / "kvtier.yaml"
    f.write_text("cpu_cache_gb: 0.01\n")
    line = next(x for x in _check(f).stdout.splitlines() if x.split()[:2] == ["ok", "cpu_cache_gb:"])
    got = re.search(r"([\d.]+) GiB available.* - ([\d.]+) GiB reserve = ([\d.]+) GiB for this host's ranks", line)
    available, reserve, usable = map(float, got.groups())
    assert abs(available - reserve - usable) <= 0.0011, line
    try:
        import sglang  # noqa: F401
    except ImportError:
        assert reserve == 2.0 and "SGLang" not in line
    else:
        assert reserve == 10.0 and "by SGLang's rule" in line
    line = next(x for x in _check(f, "--ranks", "4").stdout.splitlines() if x.split()[:2] == ["ok", "cpu_cache_gb:"])
    got = re.search(r"= ([\d.]+) GiB for this host's ranks, / 4 ranks = ([\d.]+) GiB a rank", line)
    host, rank = map(float, got.groups())
    assert abs(host / 4 - rank) <= 0.0011, line


@pytest.mark.parametrize("text", ["cpu_cach_gb: 4\n", "cpu_cache_gb: 0.01\n"], ids=["typo", "valid"])
def test_config_check_imports_no_torch(tmp_path, text):
    """A one-line typo took 3-4 s of CPU (torch), ~10 s beside SGLang (whose rule a valid file is checked by)."""
    import time

    f = tmp_path / "kvtier.yaml"
    f.write_text(text)
    code = ("import sys; from kvtier import cli; rc = cli.main(['config', 'check', sys.argv[1]]); "
            "print(rc, sorted(m for m in ('torch', 'numba', 'sglang', 'triton') if m in sys.modules))")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code, str(f)], check=False, capture_output=True, text=True,
                         timeout=60)
    took = time.monotonic() - t0
    want = "1 []" if "cach_" in text else "0 []"
    assert out.stdout.strip().splitlines()[-1] == want, out.stdout + out.stderr
    assert ("unknown key 'cpu_cach_gb'" in out.stderr) == ("cach_" in text)
    print(f"config check ({text.strip()}): {took:.2f} s")


def test_config_check_follows_sglangs_rule():
    """Its measure of available memory and its reserve are SGLang's (read without importing SGLang)."""
    base = pytest.importorskip("sglang.srt.mem_cache.pool_host.base")
    from sglang.srt.mem_cache.host_memory import available_host_memory_bytes

    from kvtier.commands.config_check import SGLANG_RESERVE_BYTES, _sglang_rule

    assert SGLANG_RESERVE_BYTES == base.HICACHE_HOST_MEMORY_RESERVE_BYTES
    available, reserve = _sglang_rule()
    drift = 512 << 20  # the machine's memory moves between two readings
    assert abs(available - available_host_memory_bytes(allow_cgroup_fallback=True)) < drift
    assert abs(available - reserve - base.host_memory_budget_bytes(1 << 30)) < drift  # one rank outside a server


def test_the_constants_config_check_and_doctor_name_without_importing_them_are_the_tiers():
    from kvtier.commands import config_check, doctor
    from kvtier.sglang import SUPPORTED_SGLANG_VERSION
    from kvtier.storage.ssd_store import FILE_NAME
    from kvtier.tier.host_pool import DEFAULT_RESERVE_GB
    from kvtier.tier.master_probe import NOT_A_REQUEST

    assert config_check.KVTIER_RESERVE_GIB == DEFAULT_RESERVE_GB and config_check.SSD_FILE_NAME == FILE_NAME
    assert config_check.NOT_A_REQUEST == NOT_A_REQUEST and doctor.SGLANG == SUPPORTED_SGLANG_VERSION


# --- CLI odds ---


def test_config_without_a_subcommand_says_what_to_run(capsys):
    """It named the missing argument 'config_command'."""
    with pytest.raises(SystemExit) as e:
        cli.main(["config"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "kvtier config check" in err and "config_command" not in err


def test_demo_prompt_tokens_error_shows_the_demos_usage(capsys):
    """It showed the top-level usage."""
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--prompt-tokens", "8"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: kvtier demo")
    assert "argument --prompt-tokens: must be at least 32 (two pages and a token), got 8" in err


# --- kvtier inspect: a real cache written by SsdStore, read through python -m kvtier ---

INSPECT_BLOCK = 3000  # payload bytes: one 4 KiB page padded


def _write_cache(dirs: list, journal: bool = True) -> dict:
    """Blocks in two namespaces put through SsdStore over ``dirs``; what was written, per namespace."""
    import numpy as np

    from kvtier.index import DEFAULT_NAMESPACE_SEED
    from kvtier.storage import Block, SsdStore, fingerprint
    from kvtier.storage.block_format import ALIGN

    default = DEFAULT_NAMESPACE_SEED - (1 << 64) if DEFAULT_NAMESPACE_SEED >= 1 << 63 else DEFAULT_NAMESPACE_SEED
    spaces = [default] * 5 + [-7] * 2  # slots 0..6, striped round robin over the directories
    with SsdStore(";".join(map(str, dirs)), capacity_bytes=len(dirs) * 8 * 2 * ALIGN, block_bytes=INSPECT_BLOCK,
                  fingerprint=fingerprint(model="inspect-test"), tokens_per_block=16 if journal else None) as s:
        s.put(list(range(7)), [Block(ns, 100 + i, np.arange(16) + i, np.full(INSPECT_BLOCK, i, np.uint8))
                               for i, ns in enumerate(spaces)])
        s.free([6])  # the last block leaves: 6 held
    return {"blocks": 6, "default": 5, "other": 1, "slots": 8 * len(dirs)}


def _inspect(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier", "inspect", *map(str, args)], check=False,
                          capture_output=True, text=True, timeout=120)


def _digests(root) -> dict:
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() + f":{p.stat().st_mtime_ns}"
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("journal", [True, False], ids=["journal", "headers"])
def test_inspect_counts_what_the_store_wrote(tmp_path, journal):
    import json

    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    wrote = _write_cache(dirs, journal)
    r = _inspect(";".join(map(str, dirs)), "--json", "--verify")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    total, files = out["total"], out["files"]
    assert total["blocks"] == wrote["blocks"] and total["slots"] == wrote["slots"] and total["bad_blocks"] == 0
    assert total["verified_blocks"] == wrote["blocks"] and total["payload_bytes"] == wrote["blocks"] * INSPECT_BLOCK
    assert [f["blocks"] for f in files] == [3, 3]  # slots 0, 2, 4 and 1, 3, 5
    ns = {}
    for f in files:
        assert f["slot_payload_bytes"] == INSPECT_BLOCK and f["num_slots"] == 8 and not f["truncated"]
        assert f["source"] == ("journal" if journal else "headers")
        assert f["journal"]["state"] == ("ok" if journal else "missing")
        for k, v in f["namespaces"].items():
            ns[k] = ns.get(k, 0) + v
    assert ns == {total["default_namespace"]: wrote["default"], f"{(1 << 64) - 7:016x}": wrote["other"]}
    assert len({f["fingerprint"] for f in files}) == 1 and total["namespaces"] == 2
    r = _inspect(";".join(map(str, dirs)))  # the tables
    health = "sound" if journal else "journal missing: blocks listed from the slot headers"
    assert r.returncode == 0 and health in r.stdout and "default 3" in r.stdout, r.stdout + r.stderr


def test_inspect_reads_the_directory_list_as_ssd_cache_dir_does(tmp_path):
    """'a;a/' was surveyed twice (every count doubled) and 'a; b' looked for ' b'."""
    import json

    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    wrote = _write_cache(dirs, True)
    r = _inspect(f"{dirs[0]};{dirs[0]}/; {dirs[1]} ;", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["total"]["blocks"] == wrote["blocks"]


def test_inspect_verify_finds_a_flipped_payload_byte(tmp_path):
    import json

    _write_cache([tmp_path])
    r = _inspect(tmp_path, "--json")
    f = json.loads(r.stdout)["files"][0]
    path = tmp_path / "kvtier_blocks.bin"
    data = bytearray(path.read_bytes())
    data[4096 + 2 * f["slot_bytes"] + 4096 + 17] ^= 0xFF  # slot 2's payload
    path.write_bytes(bytes(data))
    assert json.loads(_inspect(tmp_path, "--json").stdout)["total"]["blocks"] == 6  # without --verify: unseen
    r = _inspect(tmp_path, "--json", "--verify")
    assert r.returncode == 2
    v = json.loads(r.stdout)["files"][0]["verification"]
    assert v["checked"] == 6 and v["bad"] == 1 and v["reasons"]["payload"] == 1 and v["bad_slots"] == [2]
    r = _inspect(tmp_path, "--verify")
    assert r.returncode == 2 and "1 of 6 blocks fail their checks" in r.stdout


def test_inspect_changes_no_byte_of_the_cache(tmp_path):
    """Also where a starting tier would repair: a damaged journal (rebuilt at open) and a truncated file (its
    length restored); inspect reports both and leaves every file as it was."""
    _write_cache([tmp_path])
    journal = tmp_path / "kvtier_blocks.bin.journal"
    journal.write_bytes(b"\0" * 8 + journal.read_bytes()[8:])  # a damaged head
    blocks = tmp_path / "kvtier_blocks.bin"
    with open(blocks, "r+b") as fh:
        fh.truncate(4096 + 5 * 8192)  # slots 5.. are gone
    before = _digests(tmp_path)
    for args in ((), ("--verify",), ("--json", "--verify")):
        r = _inspect(tmp_path, *args)
        assert r.returncode == 0, r.stdout + r.stderr
    assert "journal invalid" in _inspect(tmp_path).stdout and "truncated" in _inspect(tmp_path).stdout
    assert _digests(tmp_path) == before


def test_inspect_of_a_cache_holding_no_block_says_so(tmp_path):
    """It printed 'namespaces 0:' and nothing after."""
    from kvtier.storage import SsdStore, fingerprint

    with SsdStore(str(tmp_path), capacity_bytes=1 << 20, block_bytes=4096, fingerprint=fingerprint(model="m"),
                  tokens_per_block=16):
        pass
    r = _inspect(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if "namespaces" in x)
    assert "none (no block held)" in line, r.stdout


@pytest.mark.parametrize("case", ["missing", "empty", "not_a_block_file"])
def test_inspect_of_a_directory_that_is_no_cache_is_one_line(tmp_path, case):
    target = tmp_path / "cache"
    if case != "missing":
        target.mkdir()
    if case == "not_a_block_file":
        (target / "kvtier_blocks.bin").write_bytes(b"not a block file" * 512)
    r = _inspect(target)
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(target) in lines[0], r.stderr
    assert {"missing": "no such directory", "empty": "holds no kvtier SSD cache",
            "not_a_block_file": "is not a kvtier block file"}[case] in lines[0]


# --- kvtier bench: a real bench run through python -m kvtier ---


def _png_size(path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (after checking the signature and the chunk's CRC)."""
    import struct
    import zlib

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and zlib.crc32(data[12:16 + length]) == struct.unpack(">I", data[16 + length:20 + length])[0]
    return struct.unpack(">II", data[16:24])


def test_bench_runs_the_ssd_bench_with_progress_and_writes_json_and_png(tmp_path):
    import json

    pytest.importorskip("matplotlib")
    out = tmp_path / "results"
    r = subprocess.run([sys.executable, "-m", "kvtier", "bench", "ssd", "--out", str(out), "--", "--dir",
                        str(tmp_path / "disk"), "--bytes", str(32 << 20), "--reps", "1", "--recovery-blocks", "500",
                        "--layouts", "page_first", "--io-threads", "2"], check=False, capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads((out / "ssd.json").read_text())
    assert result["args"]["reps"] == 1 and result["summary"]["raw_write_gbps"] > 0
    assert result["disk"]["tier"]["page_first"][0]["blocks"] == 14  # 32 MiB of 2.25 MiB blocks, read back equal
    assert min(_png_size(out / "ssd.png")) > 100
    assert "raw write" in (out / "ssd.log").read_text()  # the bench's own output
    assert "ssd: 5/5" in r.stdout  # its steps (3 raw patterns, the tier, recovery) reached the runner through the pipe


def test_bench_requests_refused_before_anything_runs(tmp_path):
    def bench(*args):
        return subprocess.run([sys.executable, "-m", "kvtier", "bench", *args], check=False, capture_output=True,
                              text=True, timeout=60, cwd=tmp_path)

    listing = bench()
    assert listing.returncode == 0 and "ssd " in listing.stdout and "index " in listing.stdout
    for args, message in ((("nope",), "no bench 'nope'"), (("ssd", "--", "--out", "x"), "sets the bench's --out")):
        r = bench(*args)
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr
    assert not any(tmp_path.iterdir())  # nothing was written


def test_bench_list_and_a_benchs_help(tmp_path):
    """The list named benches by issue numbers a user cannot look up; kvtier bench X -- --help printed the help and
    exited 1 ('wrote no JSON')."""
    listing = subprocess.run([sys.executable, "-m", "kvtier", "bench"], check=False, capture_output=True, text=True,
                             timeout=60)
    assert listing.returncode == 0 and "issue" not in listing.stdout and "``" not in listing.stdout, listing.stdout
    assert all(len(line) <= 140 for line in listing.stdout.splitlines())
    r = subprocess.run([sys.executable, "-m", "kvtier", "bench", "ssd", "--", "--help"], check=False,
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0 and "usage: bench_ssd.py" in r.stdout and r.stderr == "", r.stdout + r.stderr
    assert not any(tmp_path.iterdir())  # nothing ran, nothing was written


def test_the_package_imports_no_bench_module():
    code = ("import sys; import kvtier.cli, kvtier.commands.run_bench, kvtier.commands.inspect_cache; "
            "print(sorted(m for m in sys.modules if m == 'bench' or m.startswith('bench.')))")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60, cwd="/")
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
