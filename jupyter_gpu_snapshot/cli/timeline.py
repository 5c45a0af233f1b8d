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
from pathlib import Path
from typing import Any, TypeVar

from .._constants import rewind_report_lines, timeline_lines
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
        lines = timeline_lines(
            timeline, rewind_hint=f"jupyter gpu-snapshot rewind {args.kernel} --before N")
        if timeline.get("running"):
            # The magic asks from its own running cell; here it is news.
            lines.append("A cell is running now: a rewind is refused until it ends (or is "
                         "interrupted).")
        say("\n".join(lines))
    return 0


def cmd_rewind(args: argparse.Namespace) -> int:
    from ..node.timeline_requests import cell_count, rewind_kernel

    before = cell_count(args.before)
    report = ask(rewind_kernel(connection_info(args.kernel), before), "rewind", args.kernel)
    if args.json:
        print_json({"report": report})
    else:
        say("\n".join(rewind_report_lines(report)))
    return 0
