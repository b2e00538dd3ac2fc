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
    import kvtier.kernels as kernels

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
    code = "import runpy, sys; sys.argv = ['kvtier', '--help']\ntry:\n    runpy.run_module('kvtier', run_name='__main__')\n" \
           "except SystemExit:\n    pass\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "usage: kvtier" in out.stdout and out.stdout.strip().endswith("False"), out.stdout + out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen where CUDA is absent")
def test_demo_in_a_fresh_process_without_triton_interpret():
    """As a user runs it: building the model imports triton, which used to happen before kvtier's kernels could
    choose the interpreter, so every copy failed (and was unwound) and the demo served nothing from kvtier."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "kvtier", "demo", "--prompt-tokens", "48"], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "32 of 32 cacheable tokens" in out.stdout


@pytest.mark.parametrize("text,message", [
    ("cpu_cache_gb: 4\ncpu_cach_gb: 8\n", "unknown key 'cpu_cach_gb' (allowed: cpu_cache_gb,"),  # a wrong key
    ("page_size: sixteen\n", "page_size must be an int >= 1, got 'sixteen'"),  # a wrong type
    ("remote_backend: mooncake\nremote_master: 10.0.0.5:50051\nremote_protocol: udp\n",
     "remote_protocol must be one of ['tcp', 'rdma'], got 'udp'"),  # a bad value
])
def test_config_check_of_a_bad_file_prints_one_line_and_fails(tmp_path, text, message):
    f = tmp_path / "kvtier.yaml"
    f.write_text(text)
    r = subprocess.run([sys.executable, "-m", "kvtier", "config", "check", str(f)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and str(f) in lines[0], r.stderr


def test_config_check_prints_what_a_file_resolves_to(tmp_path, capsys):
    f = tmp_path / "kvtier.json"
    f.write_text('{"cpu_cache_gb": 2, "page_size": 4, "remote_backend": "mooncake", "remote_master": "h:1"}')
    assert cli.main(["config", "check", str(f)]) == 0
    out = capsys.readouterr().out
    assert "cpu_cache_gb: 2.0" in out and "ssd_cache_gb: 0.0" in out and "tokens_per_block: null" in out
    assert "tokens per host block in force: 16" in out and f"host pool per rank: {2 << 30} bytes" in out
    assert "remote tier: mooncake at h:1 over tcp" in out
    assert cli.main(["config", "check", str(tmp_path / "missing.yaml")]) == 1
