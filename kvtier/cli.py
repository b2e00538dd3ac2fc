"""``kvtier`` command line. Imports nothing heavy until a command runs (``kvtier --help`` stays fast).

* ``kvtier demo``: a model serves a prompt cold, from a warm device cache, then from kvtier (``--kernels``: a
  store/load round trip of the transfer kernels instead).
* ``kvtier config check FILE``: validate a kvtier config (YAML or JSON) as the server would, and print what it
  resolves to (every key, and the values derived from them); a bad file prints one line and exits with 1.
* ``kvtier inspect DIR``: a read-only look at an SSD cache directory (or a ``;``-separated list): per block file the
  fingerprint, slot geometry, blocks held, bytes, namespaces and journal health; ``--verify`` checks every held
  block's header and payload; ``--json`` for scripts.
* ``kvtier bench [NAME] [--out DIR] [-- ARGS]``: run ``bench/bench_NAME.py`` of the source checkout with a progress
  bar, leaving ``NAME.json``, a PNG and ``NAME.log`` in DIR; without NAME, the list of benches.
* ``kvtier --version``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional


def _parser() -> argparse.ArgumentParser:
    from kvtier import __version__

    parser = argparse.ArgumentParser(prog="kvtier", description="kvtier: a host-side tier for prefix KV caches")
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="serve a prompt from kvtier after the device cache is dropped",
                          description="A random-weight Qwen3 serves one prompt cold, from a warm device cache, and "
                                      "from kvtier after the device cache is dropped; --kernels runs a store/load "
                                      "round trip of the transfer kernels instead. Fails on any mismatch.")
    demo.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    demo.add_argument("--kernels", action="store_true", help="the transfer kernels' round trip only")
    demo.add_argument("--layout", choices=["layer_first", "page_first"], default=None,
                      help="host block layout (default: layer_first; page_first for --kernels)")
    demo.add_argument("--whole", action="store_true", help="load the prefix whole, not layer by layer")
    demo.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (default 512 CPU, 8192 GPU)")
    config = sub.add_parser("config", help="kvtier config files")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser("check", help="validate a config file and print what it resolves to",
                                  description="Validate a kvtier config (YAML or JSON) with the checks the server "
                                              "runs, and print every key as it resolves (defaults filled in) and "
                                              "the values derived from them. Exits 1 on a bad file.")
    check.add_argument("file", help="the config file (.yaml, .yml or .json), as given in $KVTIER_CONFIG")
    inspect = sub.add_parser("inspect", help="what an SSD cache directory holds, and whether it is sound",
                             description="Read-only: per block file, the fingerprint, slot geometry, blocks held, "
                                         "bytes, namespaces and the journal's health; --verify reads every held "
                                         "block back and checks it. Exits 1 when a directory is not an SSD cache, "
                                         "2 when --verify finds bad blocks.")
    inspect.add_argument("dir", help="the SSD cache directory, or several separated by ';' (as ssd_cache_dir)")
    inspect.add_argument("--verify", action="store_true", help="check every held block's header and payload")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of tables")
    bench = sub.add_parser("bench", help="run a benchmark of the source checkout: progress bar, JSON, PNG",
                           usage="kvtier bench [-h] [--list] [--out DIR] [NAME] [-- BENCH_ARGS ...]",
                           description="Run bench/bench_NAME.py of the checkout kvtier runs from, with a progress "
                                       "bar; DIR gets NAME.json, a PNG (the bench's own, or a chart of the JSON's "
                                       "summary) and NAME.log. Arguments after -- go to the bench (python "
                                       "bench/bench_NAME.py --help lists them). Without NAME: the list.")
    bench.add_argument("name", nargs="?", help="the bench (bench/bench_NAME.py)")
    bench.add_argument("--out", default="bench-out", help="directory of the results (default: ./bench-out)")
    bench.add_argument("--list", action="store_true", help="list the benches and what each measures")
    return parser


def main(argv: Optional[list] = None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []  # kvtier bench NAME -- the bench's arguments
    args = parser.parse_args(argv[:len(argv) - len(extra) - 1] if "--" in argv else argv)
    if extra and args.command != "bench":
        parser.error("arguments after -- go to a bench: kvtier bench NAME -- ARGS")
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "demo":
        return _demo(parser, args)
    if args.command == "config":
        return _config_check(args.file)
    if args.command == "inspect":
        from kvtier.commands import inspect_cache

        return inspect_cache.run(args.dir, verify=args.verify, as_json=args.json)
    if args.command == "bench":
        from kvtier.commands import run_bench

        return run_bench.run(args.name, args.out, extra, listing=args.list)
    return 2  # pragma: no cover - argparse rejects unknown commands


def _config_check(path: str) -> int:
    from kvtier.config import TierConfig

    try:
        config = TierConfig.from_file(path)
    except ValueError as e:
        print(" ".join(str(e).split()), file=sys.stderr)  # one line
        return 1
    print(f"# {path}: valid; every key as it resolves")
    for key, value in config.to_dict().items():
        print(f"{key}: {'null' if value is None else value}")
    print("# derived")
    print(f"tokens per host block in force: {config.block_tokens}")
    print(f"host pool per rank: {config.cpu_cache_bytes} bytes")
    if config.ssd_cache_gb > 0:
        print(f"SSD tier per rank: {config.ssd_cache_bytes} bytes over {len(config.ssd_dirs)} directories: "
              + ", ".join(config.ssd_dirs))
    if config.remote_backend is not None:
        print(f"remote tier: {config.remote_backend} at {config.remote_master} over {config.remote_protocol}, "
              f"{config.remote_segment_bytes} bytes mounted")
    return _check_host_memory(config)


def _check_host_memory(config) -> int:
    """The server's host memory check, on this host: 1 (with one line) when one rank's pool does not fit. With
    SGLang installed, by SGLang's rule (what is available less its 10 GiB reserve, shared by the host's ranks: a
    default pool shrinks to that share, a configured one must fit it); else by kvtier's (available less 2 GiB)."""
    from kvtier.sglang import MIN_HOST_SHARE_BYTES, host_budget
    from kvtier.tier.host_pool import DEFAULT_RESERVE_GB, available_memory_bytes

    avail, gib = available_memory_bytes(), 1 << 30
    budget = host_budget(config.cpu_cache_bytes)
    if budget is not None:
        usable, rule = budget, "SGLang's rule: 10 GiB kept in reserve, the rest shared by this host's ranks"
    elif avail is not None:
        usable, rule = avail - int(DEFAULT_RESERVE_GB * gib), f"{DEFAULT_RESERVE_GB:g} GiB kept in reserve"
    else:
        return 0
    shown = "unknown" if avail is None else f"{avail / gib:.2f} GiB"
    print(f"host memory available here: {shown}; by {rule}: {max(0, usable) / gib:.2f} GiB for a rank, room for "
          f"{max(0, usable) // config.cpu_cache_bytes} ranks' host pools")
    if config.cpu_cache_bytes <= usable:
        return 0
    if budget is not None and "cpu_cache_gb" not in config.given_keys and usable >= MIN_HOST_SHARE_BYTES:
        print(f"the default host pool of {config.cpu_cache_gb:g} GiB shrinks to {usable / gib:.2f} GiB a rank under "
              "SGLang (set cpu_cache_gb to choose)")
        return 0
    print(f"kvtier config: a host pool of {config.cpu_cache_gb:g} GiB does not fit this host ({shown} available; "
          f"{rule}): lower cpu_cache_gb, or check on the host that serves", file=sys.stderr)
    return 1


def _demo(parser: argparse.ArgumentParser, args) -> int:
    if args.prompt_tokens is not None and args.prompt_tokens < 32:
        parser.error("--prompt-tokens must be at least 32")
    import torch

    cuda = torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        print("kvtier demo: --device cuda, but CUDA is not available here (torch "
              f"{torch.__version__}, built {'with' if torch.version.cuda else 'without'} CUDA); "
              "run without --device to use the CPU", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if cuda else "cpu")
    if device == "cpu" and cuda:  # CPU tensors beside a GPU: the interpreter, chosen before triton is imported
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--device cpu must be chosen before kvtier.kernels is imported")
        os.environ["TRITON_INTERPRET"] = "1"
    from kvtier import demo

    if args.kernels:
        return 0 if demo.run_kernel_demo(device, layout=args.layout) else 1
    try:
        ok = demo.run_serve_demo(device, layout=args.layout or "layer_first", layerwise=not args.whole,
                                 prompt_tokens=args.prompt_tokens)
    except ImportError as e:
        print(f"kvtier demo needs transformers for its model ({e}): pip install 'kvtier[e2e]', or run "
              "kvtier demo --kernels", file=sys.stderr)
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
