"""The commands that run the engine's two sequences: save a kernel, and restore a snapshot as
a standalone kernel (or, with ``--fallback``, bring its work back into a fresh one) that
``jupyter console --existing`` reaches by the connection file printed."""

from __future__ import annotations

import argparse
import json
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._constants import fallback_report_lines, format_bytes
from ..core.errors import InvalidRequest, NotFound, SnapshotError
from ..core.hooks import SaveTarget
from .interrupts import run_interruptibly
from .output import ProgressBar, print_json, say, stderr_is_terminal, warn
from .settings import engine, node_snapshots
from .snapshots import fetch

if TYPE_CHECKING:
    from ..core.store import Snapshot
    from ..node.engine import NodeEngine
    from ..node.fallback import Say


def _runtime_dir() -> Path:
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir())


def _kernel_pid_from_id(kernel_id: str) -> tuple[int, Path]:
    import contextlib

    import psutil

    connection_file = _runtime_dir() / f"kernel-{kernel_id}.json"
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


def _describe(snapshot: Snapshot) -> str:
    t = snapshot.manifest.get("timings", {})
    return (
        f"saved {snapshot.name} ({snapshot.id}): {format_bytes(snapshot.size_bytes)} "
        f"({format_bytes(snapshot.new_bytes)} new), "
        f"kernel paused {t.get('pause', 0):.2f} s, total {t.get('total', 0):.2f} s"
    )


def cmd_save(args: argparse.Namespace) -> int:
    node_engine = engine(args)
    if args.kernel_id:
        from ..node.save_requests import kernel_history, portable_writer

        pid, connection_file = _kernel_pid_from_id(args.kernel_id)
        info = json.loads(connection_file.read_text())
        target = SaveTarget(
            pid=pid, kernel_id=args.kernel_id,
            history=run_interruptibly(kernel_history(info)),
            portable=portable_writer(info) if args.portable else None)
    else:
        if args.portable:
            raise InvalidRequest("preflight", "--portable needs --kernel-id: the kernel "
                                 "writes its copy when asked on its connection")
        target = SaveTarget(pid=args.pid)
    with ProgressBar(not args.json and stderr_is_terminal()) as bar:
        snapshot = run_interruptibly(
            node_engine.save(target, name=args.name, stop=args.stop, progress=bar)
        )
    if args.json:
        print_json(snapshot.summary())
    else:
        say(_describe(snapshot))
        for warning in snapshot.manifest.get("warnings", []):
            warn(f"[yellow]warning:[/] {warning}")
    return 0


def write_connection_file(info: dict[str, Any], directory: Path | None = None) -> Path:
    """A connection file for ``jupyter console --existing``, written by jupyter_client (0600)."""
    from jupyter_client.connect import write_connection_file as write

    directory = directory or _runtime_dir()
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = directory / f"kernel-{uuid.uuid4()}.json"
    fields = dict(info)
    key = fields.pop("key", "")
    write(str(path), key=key.encode() if isinstance(key, str) else key, **fields)
    return path


def cmd_restore(args: argparse.Namespace) -> int:
    from ..node.gpus import parse_gpu_choice, remap_notice

    if args.fallback:
        return _fall_back(args)
    gpus = parse_gpu_choice(args.gpus) if args.gpus is not None else None
    node = node_snapshots(args)
    with ProgressBar(not args.json and stderr_is_terminal()) as bar:
        snapshot = fetch(node, args.snapshot, bar)
        try:
            restored = run_interruptibly(
                node.engine.restore(snapshot, progress=bar, gpus=gpus))
        except SnapshotError as exc:
            from ..node import fallback

            offered = fallback.offer_for(exc, snapshot)
            if offered:
                exc.hint = (f"{exc.hint}; " if exc.hint else "") + (
                    "its work can still come back in a fresh kernel: jupyter gpu-snapshot "
                    f"restore {snapshot.name} --fallback {'|'.join(offered)}")
            raise
    connection_file = write_connection_file(restored.connection_info)
    result = {
        "snapshot": restored.snapshot.id,
        "pid": restored.pid,
        "kernel_pid": restored.kernel_pid,
        "connection_file": str(connection_file),
        "timings": restored.timings,
        "gpu_remap": restored.notes.get("gpu_remap"),
    }
    if args.json:
        print_json(result)
    else:
        notice = remap_notice(restored.notes.get("gpu_remap"))
        say(
            f"restored {restored.snapshot.name} as pid {restored.pid} "
            f"(kernel pid {restored.kernel_pid}) in {restored.timings['total']:.2f} s\n"
            + (notice + "\n" if notice else "")
            + f"connect with: jupyter console --existing {connection_file}"
        )
    return 0


def _fall_back(args: argparse.Namespace) -> int:
    """``restore --fallback``: a fresh standalone kernel, given the work back
    (``node.fallback``), left running for ``jupyter console --existing``."""
    from ..node import fallback

    if args.gpus is not None:
        raise InvalidRequest("preflight", "--gpus chooses where an image restores; "
                             "--fallback starts a fresh kernel")
    node = node_snapshots(args)
    found = node.find(args.snapshot)
    fallback.require_offered(found.snapshot, args.fallback)
    with ProgressBar(False) as bar:
        snapshot = (fetch(node, args.snapshot, bar)
                    if fallback.needs_portable_files(args.fallback) else found.snapshot)
    report_line = (lambda text: None) if args.json else say
    connection_file, report = run_interruptibly(
        _fresh_kernel_with(node.engine, snapshot, args.fallback, report_line))
    if args.json:
        print_json({"snapshot": snapshot.id, "connection_file": str(connection_file),
                    "fallback": report})
    else:
        say("\n".join(fallback_report_lines(report))
            + f"\nconnect with: jupyter console --existing {connection_file}")
    return 0


async def _fresh_kernel_with(
    node_engine: NodeEngine, snapshot: Snapshot, mode: str, report_line: Say
) -> tuple[Path, dict[str, Any]]:
    """Start a kernel that outlives this command, and give it the work back."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
    from jupyter_client.manager import AsyncKernelManager

    from ..node import fallback

    saved = str(snapshot.manifest["kernel"]["name"])
    try:
        KernelSpecManager().get_kernel_spec(saved)
        kernel_name = saved
    except NoSuchKernel:
        kernel_name = "python3"
    report_line(f"starting a fresh {kernel_name} kernel")
    km = AsyncKernelManager(kernel_name=kernel_name)
    await km.start_kernel(independent=True)
    client = km.client()
    client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
    try:
        await client.wait_for_ready(timeout=120)
        report = await fallback.bring_back(
            fallback.FreshKernel(client, km.is_alive), node_engine, snapshot, mode,
            report_line)
    except BaseException:
        await km.shutdown_kernel(now=True)
        raise
    finally:
        client.stop_channels()
    return write_connection_file(dict(km.get_connection_info())), report
