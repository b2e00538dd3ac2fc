"""One-off work a command does before its results (imports, a model, the index's compile), said as it starts: in a
terminal a spinner with the elapsed time, then a line saying how long it took; elsewhere (a log) a plain line when
it starts and one when it ends."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

__all__ = ["step"]


@contextlib.contextmanager
def step(console, what: str, note: str = "", *, prefix: str = "kvtier demo") -> Iterator[None]:
    """Run the body as the step ``what`` (``note``: why it may take long), shown on ``console`` (rich)."""
    t0 = time.monotonic()
    if console.is_terminal:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        if note:  # a line of its own: the spinner's line keeps to the terminal's width
            console.print(f"[dim]{what} {note}[/dim]", highlight=False)
        with Progress(SpinnerColumn(), TextColumn(what), TimeElapsedColumn(), console=console,
                      transient=True) as progress:
            progress.add_task(what, total=None)
            yield
        took = time.monotonic() - t0
        if took >= 1:
            console.print(f"[dim]{what}: {took:.1f} s[/dim]", highlight=False)
        return
    console.print(f"{prefix}: {what}{' ' + note if note else ''} ...", markup=False, highlight=False)
    console.file.flush()
    yield
    console.print(f"{prefix}: {what}: done in {time.monotonic() - t0:.1f} s", markup=False, highlight=False)
