"""``jupyter gpu-snapshot``: check the machine, and save, list, restore and delete snapshots.

It works without a running server: ``save`` takes a kernel's pid or id, ``restore`` brings
a kernel back standalone and prints a connection file for ``jupyter console --existing``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import uuid
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jupyter_core.paths import jupyter_runtime_dir
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn
from rich.table import Table

from .._constants import KERNEL_NAME, format_bytes
from ..config import GPUSnapshot
from ..core import procfs, retention
from ..core.engine import Progress as EngineProgress
from ..core.engine import SaveTarget, SnapshotEngine
from ..core.errors import NotFound, SnapshotError
from ..core.store import Snapshot
from ..engines import make_engine
from .checks import run_checks

out = Console()
err = Console(stderr=True)


def _print_json(data: Any) -> None:
    # Plain JSON for programs: rich would colour it wherever FORCE_COLOR is set (ipykernel
    # sets it, so `!jupyter gpu-snapshot list --json` in a cell got escape codes).
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def _engine(args: argparse.Namespace) -> SnapshotEngine:
    kwargs: dict[str, Any] = {}
    if args.store:
        kwargs["store_dir"] = args.store
    if args.criu:
        kwargs["criu_path"] = args.criu
    return make_engine(GPUSnapshot(**kwargs))


class _ProgressBar:
    """Shows engine progress on stderr; silent with --json or when stderr is no terminal."""

    def __init__(self, enabled: bool) -> None:
        self.bar = Progress(
            TextColumn("{task.description:>9}"), BarColumn(), DownloadColumn(),
            console=err, transient=True, disable=not enabled,
        )
        self.task: TaskID | None = None

    def __enter__(self) -> _ProgressBar:
        self.bar.__enter__()
        self.task = self.bar.add_task("preflight", total=None)
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.__exit__(None, None, None)

    def __call__(self, p: EngineProgress) -> None:
        assert self.task is not None
        self.bar.update(self.task, description=p.phase, completed=p.done, total=p.total or None)



def _kernel_pid_from_id(kernel_id: str) -> tuple[int, Path]:
    connection_file = Path(jupyter_runtime_dir()) / f"kernel-{kernel_id}.json"
    import psutil

    matching = {
        proc.pid
        for proc in psutil.process_iter(["cmdline"])
        if str(connection_file) in (proc.info.get("cmdline") or [])
    }
    # The launcher and the namespace init carry the kernel's command line too; the kernel
    # is the innermost of them.
    for pid in matching:
        with contextlib.suppress(psutil.Error):
            if not any(child.pid in matching for child in psutil.Process(pid).children()):
                return pid, connection_file
    raise NotFound(
        "lookup",
        f"no running kernel with id {kernel_id} (looked for {connection_file})",
        hint="'jupyter gpu-snapshot save --pid PID' takes the kernel's process id instead",
    )


def cmd_check(args: argparse.Namespace) -> int:
    engine = _engine(args)
    checks = run_checks(engine.criu, engine.store)
    if args.json:
        _print_json([c.__dict__ for c in checks])
    else:
        table = Table(show_header=False, box=None)
        for c in checks:
            missing = "[red]MISSING[/]" if c.required else "[yellow]--[/]"
            mark = "[green]ok[/]" if c.ok else missing
            table.add_row(mark, c.name, c.detail + (f"  [dim]({c.fix})[/]" if c.fix else ""))
        out.print(table)
    failed = [c for c in checks if c.required and not c.ok]
    if failed and not args.json:
        names = ", ".join(c.name for c in failed)
        err.print(f"[red]{len(failed)} requirement(s) missing:[/] {names}")
    return 1 if failed else 0


def cmd_kernelspec(args: argparse.Namespace) -> int:
    from ..launch.kernelspec import install

    dest = install(user=args.user, prefix=args.prefix)
    out.print(f"installed kernelspec {KERNEL_NAME} in {dest}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    summaries = [s.summary() for s in _engine(args).list(args.notebook)]
    if args.latest:
        # What a restart offers back: the newest snapshot of each notebook, newest first.
        summaries = [dict(s) for s in retention.newest_per_notebook(summaries)]
    if args.json:
        _print_json(summaries)
        return 0
    if not summaries:
        out.print("no snapshots")
        return 0
    table = Table("name", "id", "created", "reason", "size", "notebook")
    for s in summaries:
        created = datetime.fromtimestamp(s["created"]).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(
            s["name"], s["id"], created, s["reason"], format_bytes(s["size_bytes"]),
            s["notebook_path"] or "",
        )
    out.print(table)
    return 0


def _describe(snapshot: Snapshot) -> str:
    t = snapshot.manifest.get("timings", {})
    return (
        f"saved {snapshot.name} ({snapshot.id}): {format_bytes(snapshot.size_bytes)}, "
        f"kernel paused {t.get('pause', 0):.2f} s, total {t.get('total', 0):.2f} s"
    )


def cmd_save(args: argparse.Namespace) -> int:
    engine = _engine(args)
    if args.kernel_id:
        pid, _ = _kernel_pid_from_id(args.kernel_id)
        target = SaveTarget(pid=pid, kernel_id=args.kernel_id)
    else:
        target = SaveTarget(pid=args.pid)
    with _ProgressBar(not args.json and err.is_terminal) as bar:
        snapshot = asyncio.run(engine.save(target, name=args.name, stop=args.stop, progress=bar))
    if args.json:
        _print_json(snapshot.summary())
    else:
        out.print(_describe(snapshot))
    return 0


def write_connection_file(info: dict[str, Any], directory: Path | None = None) -> Path:
    directory = directory or Path(jupyter_runtime_dir())
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = directory / f"kernel-{uuid.uuid4()}.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(info, f, indent=2)
    return path


def cmd_restore(args: argparse.Namespace) -> int:
    engine = _engine(args)
    with _ProgressBar(not args.json and err.is_terminal) as bar:
        restored = asyncio.run(engine.restore(args.snapshot, progress=bar))
    connection_file = write_connection_file(restored.connection_info)
    result = {
        "snapshot": restored.snapshot.id,
        "pid": restored.pid,
        "kernel_pid": restored.kernel_pid,
        "connection_file": str(connection_file),
        "timings": restored.timings,
    }
    if args.json:
        _print_json(result)
    else:
        out.print(
            f"restored {restored.snapshot.name} as pid {restored.pid} "
            f"(kernel pid {restored.kernel_pid}) in {restored.timings['total']:.2f} s\n"
            f"connect with: jupyter console --existing {connection_file}"
        )
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    snapshot = _engine(args).delete(args.snapshot)
    out.print(f"deleted {snapshot.name} ({snapshot.id})")
    return 0


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
        _print_json(data)
    else:
        why = "; ".join(kernel.problems)
        state = "snapshot-ready" if kernel.ready else f"not snapshot-ready: {why}"
        out.print(f"kernel pid {kernel.kernel_pid}: {state}")
    return 0 if kernel.ready else 1


def cmd_resume(args: argparse.Namespace) -> int:
    """Bring back a kernel that a killed save left stopped or with its CUDA locked."""
    from ..gpu.checkpoint import CudaCheckpoint
    from ..gpu.driver import load_driver

    kernel = procfs.inspect_kernel(args.pid)
    pids = [p.pid for p in procfs.tree(kernel.root_pid)]
    procfs.continue_tree(kernel.root_pid)
    status = load_driver()
    if status.driver is None:
        out.print(f"woke pids {pids}; no CUDA to resume ({status.problem})")
        return 0
    cuda = CudaCheckpoint(status.driver)
    holders = cuda.holders(pids)
    problems = cuda.resume_all(holders)
    for problem in problems:
        err.print(f"[red]error:[/] {problem}", highlight=False)
    resumed = ", ".join(str(p.pid) for p in holders) or "none"
    out.print(f"woke pids {pids}; CUDA running again in: {resumed}")
    return 2 if problems else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jupyter gpu-snapshot",
        description="Snapshot live Jupyter kernels (CUDA state included) and restore them.",
    )
    parser.add_argument("--store", help="snapshot store directory (default: the configured one)")
    parser.add_argument("--criu", help="criu executable to use")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("check", help="check criu, privileges, kernel features and the GPU driver")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("kernelspec", help=f"manage the {KERNEL_NAME} kernelspec")
    ks = p.add_subparsers(dest="action", required=True)
    pi = ks.add_parser("install", help="install the 'Python 3 (snapshots)' kernelspec")
    where = pi.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="install for this user only")
    where.add_argument("--sys-prefix", dest="prefix", action="store_const", const=sys.prefix,
                       help="install into this Python environment (default)")
    where.add_argument("--prefix", help="install under this prefix")
    pi.set_defaults(func=cmd_kernelspec)

    p = sub.add_parser("list", help="list snapshots")
    p.add_argument("--notebook", help="only the snapshots of this notebook path")
    p.add_argument(
        "--latest", action="store_true",
        help="only the newest snapshot of each notebook (autosave, shutdown or user)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("save", help="snapshot a running kernel")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--pid", type=int, help="process id of the kernel")
    target.add_argument("--kernel-id", help="Jupyter kernel id (from the server's /api/kernels)")
    p.add_argument("--name", help="snapshot name (letters, digits, '.', '_', '-')")
    p.add_argument("--stop", action="store_true", help="end the kernel after the snapshot")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_save)

    p = sub.add_parser("restore", help="restore a snapshot as a standalone kernel")
    p.add_argument("snapshot", help="snapshot name or id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_restore)

    p = sub.add_parser("rm", help="delete a snapshot")
    p.add_argument("snapshot", help="snapshot name or id")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser(
        "resume",
        help="wake a kernel that an interrupted save left stopped or with CUDA locked",
    )
    p.add_argument("--pid", type=int, required=True, help="process id of the kernel")
    p.set_defaults(func=cmd_resume)

    p = sub.add_parser("status", help="say whether a kernel process is snapshot-ready")
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except SnapshotError as exc:
        err.print(f"[red]error:[/] {exc.message}", highlight=False)
        return 2
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    return code

