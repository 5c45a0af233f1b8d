"""The commands about one kernel process: whether it is snapshot-ready (``status``), and
waking it when a killed save left it stopped or with its CUDA locked (``resume``)."""

from __future__ import annotations

import argparse

from ..core import procfs
from ..core.errors import NotReady
from .output import print_json, say, warn


def cmd_status(args: argparse.Namespace) -> int:
    kernel = procfs.inspect_kernel(args.pid)
    data = {
        "pid": kernel.kernel_pid,
        "root_pid": kernel.root_pid,
        "ready": kernel.ready,
        "problems": kernel.problems,
        "connection_file": str(kernel.connection_file) if kernel.connection_file else None,
    }
    if args.json:
        print_json(data)
    else:
        why = "; ".join(kernel.problems)
        state = "snapshot-ready" if kernel.ready else f"not snapshot-ready: {why}"
        say(f"kernel pid {kernel.kernel_pid}: {state}")
    return 0 if kernel.ready else 1


def cmd_resume(args: argparse.Namespace) -> int:
    """Bring back a kernel that a killed save left stopped or with its CUDA locked."""
    from ..node.gpus import resume_tree

    kernel = procfs.inspect_kernel(args.pid)
    if not args.force and not procfs.is_snapshot_ready_kernel(kernel):
        raise NotReady(
            "resume",
            f"pid {args.pid} is not in a snapshot-ready kernel's process tree",
            hint="pass --force to wake its process tree anyway",
        )
    resumed = resume_tree(kernel.root_pid)
    if resumed.no_driver is not None:
        say(f"woke pids {resumed.pids}; no CUDA to resume ({resumed.no_driver})")
        return 0
    for problem in resumed.problems:
        warn(f"[red]error:[/] {problem}")
    running = ", ".join(str(pid) for pid in resumed.cuda_running) or "none"
    say(f"woke pids {resumed.pids}; CUDA running again in: {running}")
    return 2 if resumed.problems else 0
