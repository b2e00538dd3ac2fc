"""``kvtier`` command line. Imports nothing heavy until a command runs (``kvtier --help`` stays fast).

* ``kvtier demo``: a model serves a prompt cold, from a warm device cache, then from kvtier (``--kernels``: a
  store/load round trip of the transfer kernels instead).
* ``kvtier config check FILE [--offline]``: check a kvtier config (YAML or JSON) as the server does at start, short
  of the GPU and the model, on this host (memory for the host pool, the SSD directories, the remote master), and
  print what it resolves to; one verdict line, exit status 1 when the server would refuse it.
* ``kvtier doctor``: what this machine gives kvtier (Python, torch, CUDA, Triton, CuPy, Mooncake, pinned-memory
  and ``/dev/shm`` limits) and a store/load round trip on its GPU (or through the Triton interpreter without one).
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
    demo.add_argument("--prompt-tokens", type=_prompt_tokens, default=None,
                      help="prompt length, at least 32 (default 512 CPU, 8192 GPU)")
    config = sub.add_parser("config", help="kvtier config files",
                            usage="kvtier config check [-h] [--offline] [--ranks N] FILE")
    config_sub = config.add_subparsers(dest="config_command", metavar="check")
    check = config_sub.add_parser("check", help="check a config file on this host and print what it resolves to",
                                  description="Check a kvtier config (YAML or JSON) as the server does at start, "
                                              "short of the GPU and the model: every key, then this host (memory "
                                              "for the host pool, the SSD directories, the remote master). Prints "
                                              "every key as it resolves and one line per check, then one verdict; "
                                              "exits 1 when the server would refuse the file here.")
    check.add_argument("file", help="the config file (.yaml, .yml or .json), as given in $KVTIER_CONFIG")
    check.add_argument("--offline", action="store_true",
                       help="leave the remote master unchecked (do not contact it)")
    check.add_argument("--ranks", type=_positive, default=1,
                       help="the server's ranks on this host (TP x PP x DP there), whose host pools share its memory "
                            "(default 1)")
    sub.add_parser("doctor", help="what this machine gives kvtier, and a transfer round trip on it",
                   description="Versions (Python, torch and its CUDA, Triton, CuPy, Mooncake, SGLang), the GPU, "
                               "the pinned-memory limit and /dev/shm's size, then a store/load round trip of the "
                               "transfer kernels (on the GPU, or through the Triton interpreter without one). Exits "
                               "1 when something kvtier needs is missing or the round trip fails.")
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
    parser.set_defaults(config_parser=config)
    return parser


def main(argv: list | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # the reader went away (kvtier bench | head): no traceback, and no second error at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: list | None) -> int:
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
        if args.config_command is None:
            args.config_parser.error("name what to do: kvtier config check FILE")
        from kvtier.commands import config_check

        return config_check.run(args.file, offline=args.offline, ranks=args.ranks)
    if args.command == "doctor":
        from kvtier.commands import doctor

        return doctor.run()
    if args.command == "inspect":
        from kvtier.commands import inspect_cache

        return inspect_cache.run(args.dir, verify=args.verify, as_json=args.json)
    if args.command == "bench":
        from kvtier.commands import run_bench

        return run_bench.run(args.name, args.out, extra, listing=args.list)
    return 2  # pragma: no cover - argparse rejects unknown commands


def _positive(text: str) -> int:
    """An int >= 1 (argparse reports a bad one with the command's usage)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _prompt_tokens(text: str) -> int:
    """``--prompt-tokens``: an int of at least 32 (argparse reports a bad one with the demo's usage)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int, got {text!r}") from None
    if n < 32:
        raise argparse.ArgumentTypeError(f"must be at least 32 (two pages and a token), got {n}")
    return n


def _demo(parser: argparse.ArgumentParser, args) -> int:
    from rich.console import Console

    from kvtier.commands.steps import step

    console = Console(soft_wrap=True)  # a log gets whole lines; a terminal wraps them itself
    with step(console, "loading torch"):
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
        return 0 if demo.run_kernel_demo(device, console=console, layout=args.layout) else 1
    try:
        ok = demo.run_serve_demo(device, console=console, layout=args.layout or "layer_first",
                                 layerwise=not args.whole, prompt_tokens=args.prompt_tokens)
    except ImportError as e:
        print(f"kvtier demo needs transformers for its model ({e}): pip install 'kvtier[e2e]', or run "
              "kvtier demo --kernels", file=sys.stderr)
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
