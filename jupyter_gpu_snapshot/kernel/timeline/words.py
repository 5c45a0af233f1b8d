"""The timeline and a rewind's report in words, as ``%gpu_snapshot timeline`` and
``%gpu_snapshot rewind N`` print them."""

from __future__ import annotations

import time
from typing import Any


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def timeline_lines(content: dict[str, Any]) -> list[str]:
    """The points, oldest first, and what can be rewound to."""
    points = content.get("points") or []
    lines = [f"Timeline: {len(points)} point(s), {_size(int(content.get('bytes', 0)))} of "
             f"{_size(int(content.get('limit_bytes', 0)))}"
             + (f"; {content['dropped']} older point(s) dropped for the limits"
                if content.get("dropped") else "") + "."]
    rewindable = set(content.get("rewindable") or [])
    for point in points:
        when = time.strftime("%H:%M:%S", time.localtime(float(point.get("at", 0))))
        parts = []
        if point.get("changed"):
            parts.append("changed " + _names(point["changed"]))
        if point.get("deleted"):
            parts.append("deleted " + _names(point["deleted"]))
        what = "; ".join(parts) or "changed nothing the timeline sees"
        failed = "" if point.get("ok", True) else " (raised)"
        mark = "" if point["count"] in rewindable else " [cannot rewind to before it]"
        lines.append(f"  [{point['count']}]{failed} {when}, {_size(int(point.get('bytes', 0)))}:"
                     f" {what}{mark}")
        for item in point.get("uncopied") or []:
            lines.append(f"      not kept: {item['name']}: {item['reason']}")
    if rewindable:
        lines.append("Rewind with %gpu_snapshot rewind N, N one of: "
                     + ", ".join(str(count) for count in sorted(rewindable)) + ".")
    else:
        lines.append("Nothing can be rewound now.")
    return lines


def report_lines(report: dict[str, Any]) -> list[str]:
    """What came back, what could not and why, and the caveats."""
    undone = report.get("undone") or []
    lines = [f"Rewound to before cell [{report.get('before')}]: the effects of "
             f"{len(undone)} cell(s) are undone ("
             + ", ".join(f"[{count}]" for count in undone) + ")."]
    if report.get("restored"):
        lines.append("Put back as they were: " + _names(report["restored"], 20) + ".")
    if report.get("removed"):
        lines.append("Removed (they did not exist then): " + _names(report["removed"], 20)
                     + ".")
    if not report.get("restored") and not report.get("removed"):
        lines.append("No name needed to change.")
    for item in report.get("not_restored") or []:
        lines.append(f"Could not put back {item['name']}: {item['reason']}; it keeps its "
                     "current value.")
    for caveat in report.get("caveats") or []:
        lines.append(f"Note: {caveat}.")
    return lines
