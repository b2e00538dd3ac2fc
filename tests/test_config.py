"""TierConfig: defaults, the three sources (dict, YAML/JSON file, KVTIER_CONFIG), and errors naming key and choices."""

from __future__ import annotations

import json

import pytest

from kvtier.config import ENV_VAR, TierConfig


def test_defaults():
    c = TierConfig()
    assert (c.cpu_cache_gb, c.page_size, c.host_layout, c.transfer_mode, c.num_programs, c.layerwise,
            c.eviction_policy, c.ssd_cache_gb, c.ssd_cache_dir) == (16.0, 16, "layer_first", "auto", None, True,
                                                                   "lru", 0.0, None)
    assert c.cpu_cache_bytes == 16 << 30


def test_from_dict_round_trip():
    d = {"cpu_cache_gb": 2, "page_size": 64, "host_layout": "page_first", "transfer_mode": "staged",
         "num_programs": 4, "layerwise": False, "ssd_cache_gb": 100, "ssd_cache_dir": "/tmp/x"}
    c = TierConfig.from_dict(d)
    assert c.cpu_cache_gb == 2.0 and isinstance(c.cpu_cache_gb, float)
    assert TierConfig.from_dict(c.to_dict()) == c
    assert {k: getattr(c, k) for k in d} == {**d, "cpu_cache_gb": 2.0, "ssd_cache_gb": 100.0}


@pytest.mark.parametrize("page,given,want", [(1, None, 16), (2, None, 16), (3, None, 18), (16, None, 16),
                                             (64, None, 64), (1, 1, 1), (1, 64, 64), (16, 32, 32)])
def test_the_host_block_is_a_multiple_of_the_page_of_at_least_16_tokens_by_default(page, given, want):
    assert TierConfig(page_size=page, tokens_per_block=given).block_tokens == want


def test_unknown_key_names_it_and_the_allowed_keys():
    with pytest.raises(ValueError, match=r"kvtier config: unknown key 'cpu_cach_gb' \(allowed: cpu_cache_gb, "
                                         r"page_size, tokens_per_block, host_layout, transfer_mode"):
        TierConfig.from_dict({"cpu_cach_gb": 4})


@pytest.mark.parametrize("key,value,message", [
    ("cpu_cache_gb", 0, r"cpu_cache_gb must be a number > 0"),
    ("cpu_cache_gb", -1.5, r"cpu_cache_gb must be a number > 0"),
    ("cpu_cache_gb", "16", r"cpu_cache_gb must be a number > 0"),
    ("cpu_cache_gb", float("inf"), r"cpu_cache_gb must be a number > 0"),
    ("cpu_cache_gb", True, r"cpu_cache_gb must be a number > 0"),
    ("page_size", 0, r"page_size must be an int >= 1, got 0"),
    ("tokens_per_block", 24, r"tokens_per_block must be null or a multiple of page_size \(16\), got 24"),
    ("tokens_per_block", 0, r"tokens_per_block must be null or a multiple of page_size"),
    ("tokens_per_block", "32", r"tokens_per_block must be null or a multiple of page_size"),
    ("page_size", 16.0, r"page_size must be an int >= 1, got 16.0"),
    ("page_size", True, r"page_size must be an int >= 1, got True"),
    ("host_layout", "x", r"host_layout must be one of \['layer_first', 'page_first'\], got 'x'"),
    ("transfer_mode", "fast", r"transfer_mode must be one of \['auto', 'direct', 'staged'\], got 'fast'"),
    ("num_programs", 0, r"num_programs must be an int >= 1 or null, got 0"),
    ("num_programs", "8", r"num_programs must be an int >= 1 or null"),
    ("layerwise", "yes", r"layerwise must be true or false, got 'yes'"),
    ("eviction_policy", "lfu", r"eviction_policy must be one of \['lru'\], got 'lfu'"),
    ("ssd_cache_gb", -1, r"ssd_cache_gb must be a number >= 0"),
    ("ssd_cache_dir", "", r"ssd_cache_dir must be a non-empty string or null"),
    ("ssd_cache_dir", 3, r"ssd_cache_dir must be a non-empty string or null"),
    ("ssd_cache_dir", " ; ", r"ssd_cache_dir names no directory"),
    ("ssd_cache_gb", 10, r"ssd_cache_gb > 0 needs ssd_cache_dir"),
    ("ssd_io_threads", 0, r"ssd_io_threads must be an int >= 1, got 0"),
    ("ssd_direct_io", "no", r"ssd_direct_io must be true or false"),
    ("ssd_wipe_mismatch", 1, r"ssd_wipe_mismatch must be true or false"),
    ("ssd_write_policy", "write_around", r"ssd_write_policy must be one of \['write_through', 'write_back'\]"),
    ("ssd_admission", "never", r"ssd_admission must be one of \['cost', 'always'\]"),
    ("ssd_read_gbps", 0, r"ssd_read_gbps must be a number > 0 or null"),
    ("prefill_tokens_per_s", "1e4", r"prefill_tokens_per_s must be a number > 0 or null, got the string"),
    ("remote_backend", "redis", r"remote_backend must be null or one of \['mooncake'\], got 'redis'"),
    ("remote_backend", "mooncake", r"remote_backend needs remote_master"),
    ("remote_master", "localhost", r"remote_master must be host:port .*, got 'localhost'"),
    ("remote_master", ":50051", r"remote_master must be host:port .*, got ':50051'"),
    ("remote_master", "127.0.0.1:0", r"remote_master must be host:port with a port in 1..65535"),
    ("remote_master", "127.0.0.1:99999", r"remote_master must be host:port with a port in 1..65535"),
    ("cpu_cache_gb", 1e300, r"cpu_cache_gb must be a number > 0 and <= 1048576"),
    ("ssd_cache_gb", 1e300, r"ssd_cache_gb must be a number >= 0 and <= 1048576"),
    ("ssd_cache_dir", "/x;/x/", r"ssd_cache_dir names one directory twice \('/x' and '/x/'\)"),
    ("remote_protocol", "udp", r"remote_protocol must be one of \['tcp', 'rdma'\], got 'udp'"),
    ("remote_local_hostname", "", r"remote_local_hostname must be a non-empty string"),
    ("remote_segment_gb", -1, r"remote_segment_gb must be a number >= 0"),
    ("remote_timeout_s", 0, r"remote_timeout_s must be a number > 0"),
    ("remote_required", "no", r"remote_required must be true or false"),
    ("remote_admission", "never", r"remote_admission must be one of \['cost', 'always'\]"),
    ("remote_read_gbps", -2, r"remote_read_gbps must be a number > 0 or null"),
])
def test_bad_values_name_the_key_and_what_is_allowed(key, value, message):
    with pytest.raises(ValueError, match="kvtier config: " + message):
        TierConfig.from_dict({key: value})


@pytest.mark.parametrize("given,message", [
    ({"ssd_cache_dir": "/nvme0/kvtier", "ssd_write_policy": "write_back"},
     "ssd_cache_dir, ssd_write_policy set but the tier is off: set ssd_cache_gb > 0"),
    ({"remote_master": "10.0.0.1:50051", "remote_protocol": "rdma"},
     "remote_master, remote_protocol set but the tier is off: set remote_backend"),
])
def test_a_tiers_settings_without_the_key_that_turns_it_on_are_refused(given, message):
    """They were accepted and ignored: the operator who forgot ssd_cache_gb got no SSD tier and no word of it."""
    with pytest.raises(ValueError, match="kvtier config: " + message):
        TierConfig.from_dict(given)
    on = {"ssd_cache_gb": 1} if "ssd_cache_dir" in given else {"remote_backend": "mooncake"}
    assert TierConfig.from_dict({**given, **on}).given_keys == set(given) | set(on)


def test_yaml_and_json_files(tmp_path):
    y = tmp_path / "tier.yaml"
    y.write_text("cpu_cache_gb: 0.5\npage_size: 32\nnum_programs: null\nlayerwise: false\n")
    assert TierConfig.from_file(y) == TierConfig(cpu_cache_gb=0.5, page_size=32, layerwise=False)
    j = tmp_path / "tier.json"
    j.write_text(json.dumps({"transfer_mode": "direct", "host_layout": "page_first"}))
    assert TierConfig.from_file(str(j)) == TierConfig(transfer_mode="direct", host_layout="page_first")
    empty = tmp_path / "empty.yml"
    empty.write_text("")
    assert TierConfig.from_file(empty) == TierConfig()


def test_file_errors(tmp_path):
    bad = tmp_path / "tier.yaml"
    bad.write_text("page_size: 3\nhost_layot: page_first\n")
    with pytest.raises(ValueError, match=r"unknown key 'host_layot'.*tier\.yaml"):
        TierConfig.from_file(bad)
    lst = tmp_path / "list.json"
    lst.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a mapping"):
        TierConfig.from_file(lst)
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ValueError, match="invalid JSON"):
        TierConfig.from_file(broken)
    with pytest.raises(ValueError, match=r"must end in \.yaml, \.yml or \.json"):
        TierConfig.from_file(tmp_path / "tier.toml")
    with pytest.raises(ValueError, match="cannot read"):
        TierConfig.from_file(tmp_path / "missing.yaml")


def test_from_env(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert TierConfig.from_env() == TierConfig()
    path = tmp_path / "c.yaml"
    path.write_text("cpu_cache_gb: 3\n")
    monkeypatch.setenv(ENV_VAR, str(path))
    assert TierConfig.from_env().cpu_cache_gb == 3.0
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "nope.yaml"))
    with pytest.raises(ValueError, match="cannot read"):
        TierConfig.from_env()


def test_a_yaml_number_read_as_a_string_gets_a_hint(tmp_path):
    f = tmp_path / "kvtier.yaml"
    f.write_text("cpu_cache_gb: 1.0e6\n")  # YAML 1.1: no sign in the exponent, so a string
    with pytest.raises(ValueError, match=r"got the string '1\.0e6' \(YAML reads a number like 1\.0e6 as a string"):
        TierConfig.from_file(f)


@pytest.mark.parametrize("name, text", [("kvtier.yaml", "page_size: 16\npage_size: 32\n"),
                                        ("kvtier.json", '{"page_size": 16, "page_size": 32}')])
def test_a_key_given_twice_is_an_error(tmp_path, name, text):
    """The last one used to win silently."""
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(ValueError, match="key 'page_size' is given twice"):
        TierConfig.from_file(f)


def test_the_ssd_tier_from_yaml_and_the_environment(tmp_path, monkeypatch):
    y = tmp_path / "tier.yaml"
    y.write_text("ssd_cache_gb: 512\nssd_cache_dir: /nvme0/kv; /nvme1/kv\nssd_write_policy: write_back\n"
                 "ssd_admission: always\nssd_io_threads: 8\nssd_read_gbps: 6.5\n")
    monkeypatch.setenv("KVTIER_CONFIG", str(y))
    c = TierConfig.from_env()
    assert c.ssd_cache_bytes == 512 << 30 and c.ssd_dirs == ["/nvme0/kv", "/nvme1/kv"]
    assert (c.ssd_write_policy, c.ssd_admission, c.ssd_io_threads, c.ssd_read_gbps) == ("write_back", "always", 8, 6.5)
    d = TierConfig()
    assert (d.ssd_cache_gb, d.ssd_write_policy, d.ssd_admission, d.ssd_direct_io) == (
        0.0, "write_through", "cost", True)


def test_the_remote_tier_from_yaml(tmp_path):
    y = tmp_path / "tier.yaml"
    y.write_text("remote_backend: mooncake\nremote_master: 10.0.0.5:50051\nremote_protocol: rdma\n"
                 "remote_device: mlx5_0\nremote_segment_gb: 8\nremote_timeout_s: 2.5\nremote_required: false\n")
    c = TierConfig.from_file(y)
    assert (c.remote_backend, c.remote_master, c.remote_protocol, c.remote_device) == (
        "mooncake", "10.0.0.5:50051", "rdma", "mlx5_0")
    assert c.remote_segment_bytes == 8 << 30 and c.remote_timeout_s == 2.5 and c.remote_required is False
    d = TierConfig()
    assert (d.remote_backend, d.remote_protocol, d.remote_metadata_server, d.remote_required) == (
        None, "tcp", "P2PHANDSHAKE", True)


@pytest.mark.parametrize("addr, scheme", [("mooncake://10.0.0.5:50051", "mooncake://"),
                                          ("tcp://127.0.0.1:50051", "tcp://")])
def test_a_master_address_with_a_scheme_names_the_scheme(addr, scheme):
    """The scheme was taken as part of the host, and the tier then advised starting a master at that 'host'."""
    with pytest.raises(ValueError, match=f"remote_master must be host:port without a scheme: drop '{scheme}'"):
        TierConfig.from_dict({"remote_backend": "mooncake", "remote_master": addr})


def test_a_number_in_quotes_gets_no_yaml_hint():
    """TierConfig(cpu_cache_gb="4") was told about YAML's reading of 1.0e6."""
    with pytest.raises(ValueError, match=r"got the string '4' \(a number in quotes: give the number itself\)$"):
        TierConfig(cpu_cache_gb="4")


@pytest.mark.parametrize("case", ["directory", "missing"])
def test_kvtier_config_naming_no_file_names_the_variable(tmp_path, monkeypatch, case):
    """A directory or a missing file in $KVTIER_CONFIG was reported without naming the variable."""
    target = tmp_path if case == "directory" else tmp_path / "nope.yaml"
    monkeypatch.setenv(ENV_VAR, str(target))
    with pytest.raises(ValueError) as e:
        TierConfig.from_env()
    message = str(e.value)
    assert message.endswith("(the file $KVTIER_CONFIG names)")
    assert {"directory": f"{tmp_path} is a directory: name the config file in it",
            "missing": f"cannot read {target}: No such file or directory"}[case] in message


def test_host_layouts_are_the_geometrys():
    from kvtier import config, geometry

    assert config.HOST_LAYOUTS == geometry.HOST_LAYOUTS


def test_reading_a_config_imports_neither_torch_nor_numba(tmp_path):
    """A one-line config took 3-4 s of CPU (10 s beside SGLang) to import torch and numba for two constants."""
    import subprocess
    import sys

    f = tmp_path / "kvtier.yaml"
    f.write_text("cpu_cache_gb: 2\nhost_layout: page_first\nssd_cache_gb: 1\nssd_cache_dir: /tmp/x\n")
    code = ("import sys; from kvtier.config import TierConfig; TierConfig.from_file(sys.argv[1]); "
            "print(sorted(m for m in ('torch', 'numba', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(f)], check=False, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_dict_is_a_config_for_kvtier_and_other_types_are_named():
    """KVTier(kv, {...}) raised AttributeError: 'dict' object has no attribute 'ssd_cache_gb'."""
    import torch

    from kvtier.kernels import PagedKV
    from kvtier.tier import KVTier

    bufs = [torch.zeros(64, 1, 8, dtype=torch.float16) for _ in range(2)]
    kv = PagedKV.mha(bufs[:1], bufs[1:], page_size=16)
    tier = KVTier(kv, {"cpu_cache_gb": 1 / 1024, "page_size": 16, "host_layout": "page_first"})
    try:
        assert tier.config == TierConfig(cpu_cache_gb=1 / 1024, host_layout="page_first")
        assert tier.layout == "page_first"
    finally:
        tier.destroy()
    with pytest.raises(ValueError, match="kvtier config: unknown key 'cpu_cach_gb'"):
        KVTier(kv, {"cpu_cach_gb": 1})
    with pytest.raises(TypeError, match="KVTier: config must be a TierConfig, a mapping of its keys or None "
                                        r"\(\$KVTIER_CONFIG\), got str"):
        KVTier(kv, "kvtier.yaml")
