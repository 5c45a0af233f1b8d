"""The commands about a kernel's timeline: ``timeline`` lists its points, one per cell, and
``rewind`` puts the kernel back to how it was before one of its cells.

Both ask the kernel itself on its control channel (``node/timeline_requests.py``, as the
server does): no server is needed. The kernel is named by its id, whose connection file
``kernel-<id>.json`` is in the Jupyter runtime directory (found as ``jupyter console
--existing`` finds it), or by the path of its connection file.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Coroutine
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from .._constants import format_bytes
from ..core.errors import NotFound, SnapshotError
from .output import print_json, say

T = TypeVar("T")


def connection_file(kernel: str) -> Path:
    """The connection file of the kernel named by ``kernel``: a path (or a file's name in
    the runtime directory), else a whole kernel id; never a guess among several kernels,
    since a rewind of the wrong one undoes someone's work."""
    from jupyter_client.connect import find_connection_file
    from jupyter_core.paths import jupyter_runtime_dir

    named = kernel if kernel.endswith(".json") or "/" in kernel else f"kernel-{kernel}.json"
    try:
        return Path(find_connection_file(named)).resolve()
    except OSError:
        raise NotFound(
            "lookup", f"no connection file {named} (looked in the current directory and in "
            f"{jupyter_runtime_dir()})",
            hint="name the kernel by its whole id (GET /api/kernels lists them) or by the "
            "path of its connection file") from None


def connection_info(kernel: str) -> dict[str, Any]:
    """The connection info of the kernel named by ``kernel``: an id or a connection file."""
    path = connection_file(kernel)
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SnapshotError("lookup", f"cannot read the connection file {path}: {exc}") \
            from None
    if not isinstance(info, dict) or "control_port" not in info:
        raise SnapshotError("lookup", f"{path} is not a kernel's connection file (it names "
                            "no control port)")
    return info


def ask(work: Coroutine[Any, Any, T], step: str, kernel: str) -> T:
    """Run one request to the kernel; Ctrl-C stops waiting for its answer, and says what
    that means: the kernel goes on with what it was asked."""
    import asyncio

    try:
        return asyncio.run(work)
    except KeyboardInterrupt:
        raise SnapshotError(
            step, "interrupted while waiting for the kernel's answer; the kernel goes on "
            "with what it was asked",
            hint=f"'jupyter gpu-snapshot timeline {kernel}' shows where it stands") from None


def cmd_timeline(args: argparse.Namespace) -> int:
    from ..node.timeline_requests import kernel_timeline

    timeline = ask(kernel_timeline(connection_info(args.kernel)), "timeline", args.kernel)
    if args.json:
        print_json(timeline)
    else:
        say("\n".join(timeline_lines(timeline, args.kernel)))
    return 0


def cmd_rewind(args: argparse.Namespace) -> int:
    from ..node.timeline_requests import cell_count, rewind_kernel

    before = cell_count(args.before)
    report = ask(rewind_kernel(connection_info(args.kernel), before), "rewind", args.kernel)
    if args.json:
        print_json({"report": report})
    else:
        say("\n".join(rewind_lines(report)))
    return 0


def _cells(counts: list[int]) -> str:
    return ", ".join(f"[{count}]" for count in counts)


def timeline_lines(timeline: dict[str, Any], kernel: str) -> list[str]:
    """A timeline (TIMELINE_REPLY) as lines a person reads: each point, oldest first, what
    it holds and what it could not copy; then what a rewind can go back to."""
    points = timeline.get("points") or []
    lines = [
        f"{len(points)} point(s) on the timeline, holding "
        f"{format_bytes(timeline.get('bytes') or 0)} of host memory "
        f"(limit {format_bytes(timeline.get('limit_bytes') or 0)})."
    ]
    for point in points:
        at = point.get("at")
        when = datetime.fromtimestamp(at).strftime("%H:%M:%S") if at else "-"
        said = []
        if not point.get("ok", True):
            said.append("raised an error (its changes up to it are kept)")
        if point.get("changed"):
            said.append("changed " + ", ".join(point["changed"]))
        if point.get("deleted"):
            said.append("deleted " + ", ".join(point["deleted"]))
        lines.append(f"  [{point.get('count')}] {when}  {format_bytes(point.get('bytes') or 0)}"
                     f"  {'; '.join(said) or 'changed nothing the timeline sees'}")
        lines.extend(f"      not copied: {entry.get('name')} ({entry.get('reason')})"
                     for entry in point.get("uncopied") or [])
    if timeline.get("dropped"):
        lines.append(f"The {timeline['dropped']} oldest point(s) were dropped to stay within "
                     "the limit.")
    rewindable = timeline.get("rewindable") or []
    if rewindable:
        lines.append(f"It can go back to before cell {_cells(rewindable)}: "
                     f"jupyter gpu-snapshot rewind {kernel} --before N")
    else:
        lines.append("Nothing to go back to yet: the timeline takes a point after each cell.")
    if timeline.get("running"):
        lines.append("A cell is running now: a rewind is refused until it ends (or is "
                     "interrupted).")
    return lines


def rewind_lines(report: dict[str, Any]) -> list[str]:
    """A rewind's report as lines a person reads: what came back, what could not and why,
    and what a rewind never undoes."""
    undone = report.get("undone") or []
    lines = [f"Rewound to before cell [{report.get('before')}]: "
             + (f"the effects of cell(s) {_cells(undone)} are gone."
                if undone else "no cell's effects had to go.")]
    if report.get("restored"):
        lines.append("Back as they were: " + ", ".join(report["restored"]))
    if report.get("removed"):
        lines.append("Removed (they did not exist then): " + ", ".join(report["removed"]))
    lines.extend(f"Not back: {entry.get('name')}: {entry.get('reason')}"
                 for entry in report.get("not_restored") or [])
    lines.extend(f"Note: {caveat}" for caveat in report.get("caveats") or [])
    return lines
