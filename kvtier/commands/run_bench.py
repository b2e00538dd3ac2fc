"""``kvtier bench NAME``: run a benchmark of a source checkout (``bench/bench_NAME.py``) with a progress bar, and
leave its JSON, a PNG and its log in one directory.

The benchmarks are scripts beside the package in a clone (the README installs kvtier editable from one), not part
of the package: they are found as ``<checkout>/bench`` and run as their own process (``python bench/bench_NAME.py
--out DIR/NAME.json ARGS``). A bench reports its progress through ``bench/progress.py``: the runner hands it the
write end of a pipe in :data:`PROGRESS_ENV`, and each step arrives as one JSON line ``{"done", "total", "what"}``; a
bench that reports nothing shows a spinner and the elapsed time. The bench's output goes to ``DIR/NAME.log`` and
above the bar. The PNG is the bench's own where it draws one (a PNG it wrote in ``DIR``), else a chart of the
JSON's numbers (its ``summary`` where it has one) drawn here with matplotlib.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

__all__ = ["PROGRESS_ENV", "available", "bench_dir", "plot_numbers", "run"]

PROGRESS_ENV = "KVTIER_BENCH_PROGRESS_FD"  # the pipe's write end, as a file descriptor number
_NUMBERS_PLOTTED = 40  # a generic chart shows at most this many values
SUMMARY_CHARS = 110  # the list shows at most this much of what a bench measures


def bench_dir() -> Path | None:
    """``bench/`` of the checkout the package runs from, or None (an installed wheel has none)."""
    d = Path(__file__).resolve().parents[2] / "bench"
    return d if (d / "progress.py").is_file() else None


def available(root: Path) -> dict[str, str]:
    """Bench name -> what it measures (its docstring's first sentence, without the issue it came from), for every
    ``bench_*.py`` in ``root`` (read, not imported)."""
    out = {}
    for p in sorted(root.glob("bench_*.py")):
        try:
            doc = ast.get_docstring(ast.parse(p.read_text())) or ""
        except SyntaxError:
            doc = ""
        out[p.stem[len("bench_"):]] = summary(doc)
    return out


def summary(doc: str) -> str:
    """A docstring's first sentence (of its first paragraph), issue references and reST quotes dropped."""
    paragraph = " ".join(doc.strip().split("\n\n", 1)[0].split())
    paragraph = re.sub(r"\s*\((issues?|part) [^)]*\)", "", paragraph).replace("``", "`")
    paragraph = re.sub(r":\w+:`", "`", paragraph)  # :mod:`x` -> `x`
    sentence = re.split(r"(?<=[.?!])\s", paragraph, maxsplit=1)[0]
    return textwrap.shorten(sentence, SUMMARY_CHARS, placeholder=" ...")


def run(name: str | None, out_dir: str, extra: list[str], *, listing: bool = False) -> int:
    """Run bench ``name`` (None or ``listing``: list them) into ``out_dir``; its exit status (1: a bad request,
    refused before anything runs)."""
    root = bench_dir()
    if root is None:
        print("kvtier bench: the benchmarks live in a source checkout (bench/ beside the kvtier package), and "
              f"there is none at {Path(__file__).resolve().parents[2] / 'bench'}: clone the repository and "
              "pip install -e it", file=sys.stderr)
        return 1
    benches = available(root)
    if name is None or listing:
        width = max(map(len, benches))
        print("\n".join(f"{n:<{width}}  {doc}" for n, doc in benches.items()))
        return 0
    if name not in benches:
        print(f"kvtier bench: no bench {name!r} in {root} (there are: {', '.join(benches)})", file=sys.stderr)
        return 1
    if "-h" in extra or "--help" in extra:  # the bench's own help: nothing runs, nothing is written
        return subprocess.run([sys.executable, str(root / f"bench_{name}.py"), "--help"], check=False,
                              env=_bench_env(root.parent)).returncode
    if any(a == "--out" or a.startswith("--out=") for a in extra):
        print("kvtier bench: the runner sets the bench's --out; choose the directory with kvtier bench --out DIR",
              file=sys.stderr)
        return 1
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("kvtier bench draws a PNG with matplotlib, which is not installed: pip install 'kvtier[bench]'",
              file=sys.stderr)
        return 1
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    json_path, log_path = out / f"{name}.json", out / f"{name}.log"
    json_path.unlink(missing_ok=True)  # a JSON left by an earlier run never passes for this one's
    started = time.time()
    rc = _run_with_progress(root / f"bench_{name}.py", name, [str(json_path), *extra], log_path)
    if rc != 0:
        print(f"kvtier bench: {name} failed (exit {rc}); its output is in {log_path}", file=sys.stderr)
        return rc
    if not json_path.is_file():
        print(f"kvtier bench: {name} wrote no JSON at {json_path}; its output is in {log_path}", file=sys.stderr)
        return 1
    pngs = sorted(p for p in out.glob("*.png") if p.stat().st_mtime >= started - 1)
    if not pngs:
        pngs = [out / f"{name}.png"]
        plot_numbers(json.loads(json_path.read_text()), pngs[0], title=f"kvtier bench {name}")
    print(f"wrote {json_path}, {', '.join(map(str, pngs))} and {log_path}")
    return 0


def _run_with_progress(script: Path, name: str, args: list[str], log_path: Path) -> int:
    """Run ``script --out ARGS...`` (in this directory, the checkout on its path), its output to ``log_path`` and
    the console, its progress on a bar."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    read_fd, write_fd = os.pipe()
    env = dict(_bench_env(script.parent.parent), **{PROGRESS_ENV: str(write_fd), "PYTHONUNBUFFERED": "1"})
    cmd = [sys.executable, str(script), "--out", *args]
    console = Console(highlight=False)
    with Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[what]}"), TimeElapsedColumn(), console=console) as bar, \
            open(log_path, "w") as log:
        task = bar.add_task(name, total=None, what="")
        try:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, pass_fds=(write_fd,))
        finally:
            os.close(write_fd)  # the child holds the only write end: the reader ends when the child does
        reader = threading.Thread(target=_follow, args=(read_fd, bar, task, name), daemon=True)
        reader.start()
        log.write(" ".join(cmd) + "\n")
        assert proc.stdout is not None  # stdout=PIPE
        for line in proc.stdout:
            log.write(line)
            bar.console.print(line.rstrip("\n"), markup=False, soft_wrap=True)
        rc = proc.wait()
        reader.join(timeout=10)
    return rc


def _bench_env(checkout: Path) -> dict:
    """This environment with the checkout first on the path (a bench imports ``bench.common``)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(checkout), os.environ.get("PYTHONPATH")))))


def _follow(fd: int, bar, task, name: str) -> None:
    """Move the bar by the bench's progress lines until the pipe closes (no terminal: a line per step)."""
    with os.fdopen(fd, "r") as f:
        for line in f:
            try:
                step = json.loads(line)
            except ValueError:
                continue
            done, total, what = step.get("done", 0), step.get("total"), step.get("what", "")
            bar.update(task, completed=done, total=total, what=what)
            if not bar.console.is_terminal:
                bar.console.print(f"{name}: {done}/{total if total is not None else '?'} {what}", markup=False,
                                  soft_wrap=True)


def plot_numbers(result: dict, path: Path, *, title: str) -> None:
    """A bar chart of the numbers in ``result`` (its ``summary`` where it has one; nested keys joined by ``/``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    source = result.get("summary") if isinstance(result.get("summary"), dict) else result
    numbers = list(_numbers(source))[:_NUMBERS_PLOTTED]
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.32 * max(1, len(numbers))))
    if numbers:
        keys, values = zip(*numbers)
        ax.barh(range(len(values)), values, color="tab:blue")
        ax.set_yticks(range(len(keys)), keys, fontsize=8)
        ax.invert_yaxis()
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.4g}", va="center", fontsize=7)
    else:
        ax.text(0.5, 0.5, "no numbers in the result", ha="center", va="center")
        ax.set_axis_off()
    ax.set_title(title + (" (summary)" if source is not result else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _numbers(obj, prefix: str = "", depth: int = 0):
    """(key path, value) of the finite numbers in ``obj`` (dicts two levels deep), in order."""
    if isinstance(obj, bool):
        return
    if isinstance(obj, (int, float)):
        if math.isfinite(obj):
            yield prefix or "value", float(obj)
    elif isinstance(obj, dict) and depth <= 2:
        for k, v in obj.items():
            yield from _numbers(v, f"{prefix}/{k}" if prefix else str(k), depth + 1)
