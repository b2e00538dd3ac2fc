"""``kvtier inspect DIR``: what an SSD cache holds and whether it is sound, as tables (rich) or JSON.

Exit status: 0; 1 when a directory is not an SSD cache (one line on stderr); 2 when ``--verify`` finds bad blocks.
"""

from __future__ import annotations

import json
import sys

from kvtier.storage.survey import FileSurvey, SurveyError, namespace_hex, survey_dirs

__all__ = ["run"]


def run(dirs: str, *, verify: bool, as_json: bool) -> int:
    try:
        files = survey_dirs(dirs, verify=verify)
    except (SurveyError, OSError) as e:
        print(f"kvtier inspect: {e}", file=sys.stderr)
        return 1
    total = _total(files)
    if as_json:
        print(json.dumps({"files": [f.to_dict() for f in files], "total": total}, indent=1))
    else:
        _render(files, total)
    return 2 if verify and total["bad_blocks"] else 0


def _total(files: list[FileSurvey]) -> dict:
    namespaces: dict[int, int] = {}
    for f in files:
        for ns, n in f.namespaces.items():
            namespaces[ns] = namespaces.get(ns, 0) + n
    checked = [f.verification for f in files if f.verification is not None]
    return {"files": len(files), "slots": sum(f.num_slots for f in files), "blocks": sum(f.blocks for f in files),
            "payload_bytes": sum(f.payload_bytes for f in files), "file_bytes": sum(f.file_bytes for f in files),
            "namespaces": len(namespaces), "default_namespace": _default_namespace(),
            "fingerprints": len({f.fingerprint for f in files}),
            "verified_blocks": sum(v.checked for v in checked) if checked else None,
            "bad_blocks": sum(v.bad for v in checked) if checked else None}


def _health(f: FileSurvey) -> list[str]:
    """Findings about a file's health, worst first; empty when sound."""
    out = []
    v = f.verification
    if v is not None and v.bad:
        why = ", ".join(f"{n} {k}" for k, n in v.reasons.items() if n)
        out.append(f"[red]{v.bad} of {v.checked} blocks fail their checks[/] ({why}; file-local slots "
                   f"{', '.join(map(str, v.bad_slots))}{' ...' if v.bad > len(v.bad_slots) else ''}): a read "
                   "treats each as a miss and frees its slot")
    if f.truncated:
        out.append(f"[yellow]truncated[/]: {f.file_bytes} of {f.expected_bytes} bytes; the slots past its end are "
                   "empty (a starting tier restores the length)")
    j = f.journal
    if j.state != "ok":
        why = f" ({j.problem})" if j.problem else ""
        out.append(f"[yellow]journal {j.state}[/]{why}: blocks listed from the slot headers; a starting tier "
                   "rebuilds the journal from them")
    elif j.damaged_pages:
        out.append(f"[yellow]{j.damaged_pages} of {j.pages} journal pages torn at its end[/]: an append a crash "
                   "cut short (never acknowledged); a starting tier cuts them off")
    return out


def _default_namespace() -> str:
    from kvtier.index import DEFAULT_NAMESPACE_SEED

    return namespace_hex(DEFAULT_NAMESPACE_SEED)


def _namespace_label(ns: int) -> str:
    return "default" if namespace_hex(ns) == _default_namespace() else namespace_hex(ns)


def _render(files: list[FileSurvey], total: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    for f in files:
        t = Table(title=f.path, show_header=False, title_justify="left")
        t.add_column("what", style="bold")
        t.add_column("value")
        t.add_row("fingerprint", f"{f.fingerprint} (a digest of the model identity, geometry and layout; the "
                                 "fields are not stored)")
        t.add_row("slots", f"{f.num_slots} of {_size(f.slot_payload_bytes)} payload ({f.slot_bytes} bytes each "
                           f"with its header), {f.tokens_per_block or '?'} tokens per block")
        t.add_row("blocks held", f"{f.blocks} of {f.num_slots} ({100 * f.blocks / f.num_slots:.1f}%), "
                                 f"{_size(f.payload_bytes)} of payload (from the {f.source})")
        t.add_row("bytes", f"{_size(f.file_bytes)} file, {_size(f.allocated_bytes)} on disk; journal "
                           f"{_size(f.journal.bytes)}")
        t.add_row("namespaces", _namespaces(f.namespaces))
        j = f.journal
        t.add_row("journal", f"{j.state}" + (f", {j.pages} record pages, {j.damaged_pages} damaged" if j.state == "ok"
                                             else ""))
        v = f.verification
        t.add_row("verified", "no (--verify reads every held block)" if v is None else
                  f"{v.checked} blocks read back, {v.bad} bad")
        findings = _health(f)
        t.add_row("health", "\n".join(findings) if findings else "[green]sound[/]")
        console.print(t)
    if len(files) > 1:
        console.print(f"[bold]total[/]: {total['blocks']} blocks in {total['slots']} slots over {total['files']} "
                      f"files, {_size(total['payload_bytes'])} of payload, {total['namespaces']} namespaces"
                      + ("" if total["fingerprints"] == 1 else
                         f"; [red]{total['fingerprints']} different fingerprints[/] (a tier opens only its own)"))


def _namespaces(namespaces: dict[int, int], shown: int = 8) -> str:
    """``N: label blocks, ...`` (the first ``shown``), or that no block is held."""
    if not namespaces:
        return "none (no block held)"
    return f"{len(namespaces)}: " + ", ".join(
        f"{_namespace_label(ns)} {n} blocks" for ns, n in list(namespaces.items())[:shown]) + (
        " ..." if len(namespaces) > shown else "")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"  # pragma: no cover
