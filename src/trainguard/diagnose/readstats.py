"""What a diagnosis read and what it left out, for ``--json``'s ``stats`` and the closing line of
the text output: a "no failure found" must say how much it looked at and what it could not read."""

from __future__ import annotations

from typing import Any

from trainguard.diagnose.linesplit import LINE_CAP

MAX_LISTED = 100


def _count(reasons) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in reasons:
        out[r] = out.get(r, 0) + 1
    return dict(sorted(out.items()))


def read_stats(scans: list, max_bytes: int | None) -> dict[str, Any]:
    """``files_read``, ``compressed`` (files, bytes in, text out), ``skipped`` and ``partial``
    (file, reason, detail), ``lines_cut`` (lines over the line cap)."""
    comp = [s for s in scans if s.read.compression]
    skipped = [s for s in scans if s.read.skipped]
    partial = [s for s in scans if s.read.partial]
    return {
        "files_read": sum(1 for s in scans if s.bytes),
        "compressed": {
            "files": len(comp),
            "bytes_in": sum(s.read.raw_bytes for s in comp),
            "bytes_out": sum(s.read.decompressed for s in comp),
            "bytes_scanned": sum(s.bytes for s in comp),
        },
        "encodings": sorted({s.read.encoding for s in scans if s.bytes and s.read.encoding != "utf-8"}),
        # listed up to MAX_LISTED files each (a run of thousands of rank logs): the counts are whole
        "skipped": [{"file": str(s.source.path), "reason": s.read.skipped, "detail": s.read.detail}
                    for s in skipped[:MAX_LISTED]],  # fmt: skip
        "skipped_count": _count(s.read.skipped for s in skipped),
        "partial": [{"file": str(s.source.path), "reason": s.read.partial, "detail": s.read.detail}
                    for s in partial[:MAX_LISTED]],  # fmt: skip
        "partial_count": _count(s.read.partial for s in partial),
        "lines_cut": sum(s.read.cuts.lines for s in scans),
        "line_cap": LINE_CAP,
        "max_bytes_per_file": max_bytes,
    }


def size(n: int) -> str:
    """12.3 MB, 4.1 KB, 512 B: a small log read is not "0.0 MB" (which reads as nothing read)."""
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} KB" if n >= 1000 else f"{n} B"


def read_line(s: dict[str, Any]) -> str:
    """The closing line: ``(3 files, 12.0 MB scanned ...)``."""
    files = s.get("files", 0)
    read = s.get("files_read", files)
    parts = [f"{files} files{f' ({read} read)' if read != files else ''}, {size(s.get('bytes', 0))} scanned"]
    comp = s.get("compressed") or {}
    if comp.get("files"):
        parts.append(f"{size(comp['bytes_out'])} decompressed from {comp['files']} compressed "
                     f"file(s) ({size(comp['bytes_in'])} read)")  # fmt: skip
    if s.get("encodings"):
        parts.append("decoded from " + ", ".join(s["encodings"]))
    skipped = s.get("skipped_count") or {}
    if skipped:
        parts.append(f"{sum(skipped.values())} skipped (" + ", ".join(f"{k}: {v}" for k, v in skipped.items()) + ")")
    partial = s.get("partial_count") or {}
    if partial:
        parts.append(f"{sum(partial.values())} read in part (" + ", ".join(f"{k}: {v}" for k, v in partial.items()) + ")")
    if s.get("lines_cut"):
        parts.append(f"{s['lines_cut']} line(s) over {s.get('line_cap', LINE_CAP) >> 10} KB cut to their "
                     "first and last half")  # fmt: skip
    return "(" + "; ".join(parts) + ")"
