"""``jupyter gpu-snapshot``: check the machine, and save, list, restore and delete snapshots.

It works without a running server: ``save`` takes a kernel's pid or id, ``restore`` brings
a kernel back standalone and prints a connection file for ``jupyter console --existing``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import uuid
from collections.abc import Coroutine, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from jupyter_client import connect
from jupyter_core.paths import jupyter_runtime_dir
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn
from rich.table import Table

from .._constants import KERNEL_NAME, fallback_report_lines, format_bytes
from ..agent.pods.identity import DEFAULT_BUNDLES
from ..agent.server import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_REQUEST_TIMEOUT,
    DEFAULT_RUN_DIR,
    DEFAULT_STATE_DIR,
    NodeAgent,
)
from ..agent_client.client import AgentClient
from ..agent_client.protocol import DEFAULT_SOCKET
from ..config import GPUSnapshot
from ..core import procfs
from ..core.errors import (
    InvalidRequest,
    NotFound,
    NotReady,
    SnapshotError,
)
from ..core.hooks import Progress as EngineProgress
from ..core.hooks import SaveTarget
from ..core.store import Snapshot
from ..node import fallback
from ..node.checks import check_this_node
from ..node.engine import NodeEngine
from ..node.gpus import parse_gpu_choice, remap_notice, resume_tree
from ..node.remotes import BOTH, LOCAL, REMOTE
from ..node.save_requests import kernel_history, portable_writer
from ..node.snapshots import NodeSnapshots
from .servers import chosen_servers

out = Console()
err = Console(stderr=True)
T = TypeVar("T")


class _Interrupted(Exception):
    """Ctrl-C reached a save or restore, which stopped at a safe point and rolled back."""


def _run_interruptibly(work: Coroutine[Any, Any, T]) -> T:
    """Run an engine coroutine; the first Ctrl-C asks it to stop safely, later ones wait.

    criu runs in its own session and does not see the Ctrl-C; the engine waits for it,
    then rolls back in order. A raw KeyboardInterrupt would tear the event loop down in
    the middle of that rollback.
    """

    async def supervise() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(work)
        loop.add_signal_handler(signal.SIGINT, task.cancel)
        try:
            return await task
        except asyncio.CancelledError:
            raise _Interrupted() from None
        finally:
            loop.remove_signal_handler(signal.SIGINT)

    return asyncio.run(supervise())


def _say(text: str) -> None:
    """A message on stdout as plain lines: never wrapped, so ids and paths copy whole."""
    sys.stdout.write(text + "\n")


def _columns(rows: list[list[str]]) -> str:
    """Rows as aligned columns, no cell ever cut or wrapped (the terminal may fold a long line)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _print_json(data: Any) -> None:
    # Plain JSON for programs: rich would colour it wherever FORCE_COLOR is set (ipykernel
    # sets it, so `!jupyter gpu-snapshot list --json` in a cell got escape codes).
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def _settings(args: argparse.Namespace) -> GPUSnapshot:
    kwargs: dict[str, Any] = {}
    if args.store:
        kwargs["store_dir"] = args.store
    if args.criu:
        kwargs["criu_path"] = args.criu
    return GPUSnapshot(**kwargs)


def _node(args: argparse.Namespace) -> NodeSnapshots:
    # Not root: the node agent saves and restores for this user (docs/cluster.md).
    return NodeSnapshots.from_settings(_settings(args))


def _engine(args: argparse.Namespace) -> NodeEngine:
    return _node(args).engine


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


def _agent_report(settings: GPUSnapshot) -> tuple[bool, list[str]]:
    """Whether the node agent answers this user, and what it allows them, in lines."""
    client = AgentClient(settings.agent_socket)
    try:
        hello = client.call_sync("hello")
    except SnapshotError as exc:
        return False, [f"MISSING\tnode agent\t{exc.message}"]
    user, limits = hello["user"], hello["limits"]
    quota = limits["disk_quota_bytes"]
    return True, [
        f"ok\tnode agent\t{client.socket_path} answers (version {hello['agent_version']})",
        f"ok\tyou\t{user['name']} (uid {user['uid']}, gid {user['gid']}), as the kernel "
        "says of this process",
        f"ok\tyour store\t{hello['store']} (root's; only you can list, restore, rename or "
        "delete its snapshots)",
        f"ok\tyour kernel logs\t{hello['log_dir']}",
        f"ok\tyou may\t{', '.join(hello['operations'])}",
        f"ok\tlimits\t{limits['max_operations']} operations at once (saves, restores, GPU "
        "releases and wakes); disk "
        + (f"{format_bytes(limits['used_bytes'])} used of {format_bytes(quota)}" if quota
           else f"{format_bytes(limits['used_bytes'])} used, no quota"),
    ]


def cmd_check(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if settings.through_agent() or (os.geteuid() != 0 and settings.use_agent != "never"):
        reachable, lines = _agent_report(settings)
        if args.json:
            _print_json({"agent": reachable, "lines": lines})
        else:
            for line in lines:
                _say(line)
            if not reachable:
                _say("Without root, snapshots need the node agent (docs/cluster.md).")
        return 0 if reachable else 1
    checks = check_this_node(settings)
    if args.json:
        _print_json([c.__dict__ for c in checks])
    elif not out.is_terminal:
        for c in checks:
            mark = "ok" if c.ok else "MISSING" if c.required else "--"
            _say(f"{mark}\t{c.name}\t{c.detail}" + (f" ({c.fix})" if c.fix else ""))
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
        err.print(f"[red]{len(failed)} requirement(s) missing:[/] {names}", soft_wrap=True)
    return 1 if failed else 0


def parse_bytes(text: str) -> int:
    """``200G``, ``512M``, ``1T`` or plain bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def cmd_agent(args: argparse.Namespace) -> int:
    from traitlets.config import Config
    from traitlets.config.loader import ConfigFileNotFound, PyFileConfigLoader

    if os.geteuid() != 0:
        raise InvalidRequest("agent", "the node agent runs as root",
                             hint="start it with systemd or by hand as root (docs/cluster.md)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    # The realms' settings are built from this config, not from the GPUSnapshot object:
    # --criu goes into it too.
    config = Config()
    if args.config:
        path = Path(args.config).absolute()
        try:
            config = PyFileConfigLoader(path.name, str(path.parent)).load_config()
        except ConfigFileNotFound as exc:
            raise InvalidRequest("agent", f"no config file {path}") from exc
    if args.criu:
        config.GPUSnapshot.criu_path = args.criu
    agent = NodeAgent(
        socket_path=Path(args.socket), state_dir=Path(args.state_dir),
        run_dir=Path(args.run_dir), socket_mode=args.socket_mode,
        socket_group=args.socket_group, max_operations=args.max_operations,
        disk_quota_bytes=parse_bytes(args.disk_quota), settings=GPUSnapshot(config=config),
        max_connections=args.max_connections, request_timeout=args.request_timeout,
        pods=args.pods, container_bundles=tuple(args.container_bundles or DEFAULT_BUNDLES),
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(agent.serve_forever())
    return 0


def cmd_kernelspec(args: argparse.Namespace) -> int:
    from ..launch.kernelspec import install

    dest = install(user=args.user, prefix=args.prefix)
    _say(f"installed kernelspec {KERNEL_NAME} in {dest}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    node = _node(args)
    # --latest: what a restart offers back, the newest trusted snapshot of each notebook.
    summaries = node.summaries(node.remote_snapshots(), args.notebook, latest=args.latest)
    if args.json:
        _print_json(summaries)
        return 0
    if not summaries:
        _say("no snapshots")
        return 0
    rows = [["NAME", "ID", "CREATED", "REASON", "SIZE", "NEW", "NOTEBOOK", "LOCATION",
             "STATUS"]]
    for s in summaries:
        created = datetime.fromtimestamp(s["created"]).strftime("%Y-%m-%d %H:%M:%S")
        status = "ok" if s["status"] == "ok" else f"{s['status']}: {s['problem']}"
        rows.append([
            s["name"], s["id"], created, s["reason"], format_bytes(s["size_bytes"]),
            format_bytes(s["new_bytes"]), s["notebook_path"] or "-", s["location"], status,
        ])
    _say(_columns(rows))
    return 0


def cmd_du(args: argparse.Namespace) -> int:
    """What the local store takes on disk, and what deleting each snapshot would free."""
    found = _engine(args).store_usage()
    if args.json:
        _print_json(found.to_dict())
        return 0
    rows = [["NAME", "ID", "SIZE", "NEW", "FREES"]]
    for s in found.snapshots:
        rows.append([s.name, s.id, format_bytes(s.size_bytes), format_bytes(s.new_bytes),
                     format_bytes(s.frees_bytes)])
    if len(rows) > 1:
        _say(_columns(rows))
    _say(f"{format_bytes(found.disk_bytes)} on disk in {found.path} "
         f"({format_bytes(found.chunks_bytes)} of it in page packs)")
    return 0


TRUST_WARNING = """Snapshot {id} is unsigned: this node did not write it, or wrote it before
snapshots were signed. Restoring a snapshot runs its memory and registers as the user that
restores it (root, for criu), so an altered snapshot runs whatever code was put into it.
Trust it only if you know where it came from and that nobody else could change it."""


def cmd_trust(args: argparse.Namespace) -> int:
    """Sign an unsigned snapshot with this node's key, after a warning."""
    engine = _engine(args)
    snapshot = engine.get(args.snapshot)
    if snapshot.status != "unsigned":
        snapshot.require_trusted("trust")
        out.print(f"{snapshot.name} ({snapshot.id}) is signed by this node already")
        return 0
    err.print(TRUST_WARNING.format(id=snapshot.id), highlight=False)
    if not args.yes:
        if not sys.stdin.isatty():
            err.print("[red]not trusted:[/] confirm with --yes when not on a terminal")
            return 1
        if input("Trust and sign it? [y/N] ").strip().lower() not in ("y", "yes"):
            err.print("not trusted")
            return 1
    trusted = engine.trust(snapshot.id)
    out.print(f"trusted {trusted.name} ({trusted.id}): signed with this node's key")
    return 0


def _describe(snapshot: Snapshot) -> str:
    t = snapshot.manifest.get("timings", {})
    return (
        f"saved {snapshot.name} ({snapshot.id}): {format_bytes(snapshot.size_bytes)} "
        f"({format_bytes(snapshot.new_bytes)} new), "
        f"kernel paused {t.get('pause', 0):.2f} s, total {t.get('total', 0):.2f} s"
    )


def cmd_save(args: argparse.Namespace) -> int:
    engine = _engine(args)
    if args.kernel_id:
        pid, connection_file = _kernel_pid_from_id(args.kernel_id)
        info = json.loads(connection_file.read_text())
        target = SaveTarget(
            pid=pid, kernel_id=args.kernel_id,
            history=_run_interruptibly(kernel_history(info)),
            portable=portable_writer(info) if args.portable else None)
    else:
        if args.portable:
            raise InvalidRequest("preflight", "--portable needs --kernel-id: the kernel "
                                 "writes its copy when asked on its connection")
        target = SaveTarget(pid=args.pid)
    with _ProgressBar(not args.json and err.is_terminal) as bar:
        snapshot = _run_interruptibly(
            engine.save(target, name=args.name, stop=args.stop, progress=bar)
        )
    if args.json:
        _print_json(snapshot.summary())
    else:
        _say(_describe(snapshot))
        for warning in snapshot.manifest.get("warnings", []):
            err.print(f"[yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
    return 0


def write_connection_file(info: dict[str, Any], directory: Path | None = None) -> Path:
    """A connection file for ``jupyter console --existing``, written by jupyter_client (0600)."""
    directory = directory or Path(jupyter_runtime_dir())
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = directory / f"kernel-{uuid.uuid4()}.json"
    fields = dict(info)
    key = fields.pop("key", "")
    connect.write_connection_file(
        str(path), key=key.encode() if isinstance(key, str) else key, **fields
    )
    return path


def _fetch(node: NodeSnapshots, ref: str, bar: _ProgressBar) -> Snapshot:
    """The local snapshot ``ref`` names; a remote-only one is downloaded into the store
    first, as the server does: judged by this node's signing key and checked against this
    node's host before anything of it is fetched, every digest checked while it streams.
    Raises NotFound when neither side has it."""
    found = node.find(ref)
    if found.local:
        return found.snapshot
    if found.snapshot.trusted:
        asyncio.run(node.engine.check_compatibility(found.snapshot, bar, {}))
    bar(EngineProgress("downloading", 0, found.snapshot.size_bytes))
    return node.download(
        found.snapshot, lambda done, total: bar(EngineProgress("downloading", done, total)))


def cmd_download(args: argparse.Namespace) -> int:
    """Fetch a remote snapshot into the local store (what a restore of one does first)."""
    node = _node(args)
    node.require_remote("download")
    with _ProgressBar(err.is_terminal) as bar:
        snapshot = _fetch(node, args.snapshot, bar)
    _say(f"{snapshot.name} ({snapshot.id}) is in {node.engine.location}")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    if args.fallback:
        return _fall_back(args)
    gpus = parse_gpu_choice(args.gpus) if args.gpus is not None else None
    node = _node(args)
    with _ProgressBar(not args.json and err.is_terminal) as bar:
        snapshot = _fetch(node, args.snapshot, bar)
        try:
            restored = _run_interruptibly(
                node.engine.restore(snapshot, progress=bar, gpus=gpus))
        except SnapshotError as exc:
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
        _print_json(result)
    else:
        notice = remap_notice(restored.notes.get("gpu_remap"))
        _say(
            f"restored {restored.snapshot.name} as pid {restored.pid} "
            f"(kernel pid {restored.kernel_pid}) in {restored.timings['total']:.2f} s\n"
            + (notice + "\n" if notice else "")
            + f"connect with: jupyter console --existing {connection_file}"
        )
    return 0


def _fall_back(args: argparse.Namespace) -> int:
    """``restore --fallback``: a fresh standalone kernel, given the work back
    (``node.fallback``), left running for ``jupyter console --existing``."""
    if args.gpus is not None:
        raise InvalidRequest("preflight", "--gpus chooses where an image restores; "
                             "--fallback starts a fresh kernel")
    node = _node(args)
    found = node.find(args.snapshot)
    fallback.require_offered(found.snapshot, args.fallback)
    with _ProgressBar(False) as bar:
        snapshot = (_fetch(node, args.snapshot, bar)
                    if fallback.needs_portable_files(args.fallback) else found.snapshot)
    say = (lambda text: None) if args.json else _say
    connection_file, report = _run_interruptibly(
        _fresh_kernel_with(node.engine, snapshot, args.fallback, say))
    if args.json:
        _print_json({"snapshot": snapshot.id, "connection_file": str(connection_file),
                     "fallback": report})
    else:
        _say("\n".join(fallback_report_lines(report))
             + f"\nconnect with: jupyter console --existing {connection_file}")
    return 0


async def _fresh_kernel_with(
    engine: NodeEngine, snapshot: Snapshot, mode: str, say: fallback.Say
) -> tuple[Path, dict[str, Any]]:
    """Start a kernel that outlives this command, and give it the work back."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
    from jupyter_client.manager import AsyncKernelManager

    saved = str(snapshot.manifest["kernel"]["name"])
    try:
        KernelSpecManager().get_kernel_spec(saved)
        kernel_name = saved
    except NoSuchKernel:
        kernel_name = "python3"
    say(f"starting a fresh {kernel_name} kernel")
    km = AsyncKernelManager(kernel_name=kernel_name)
    await km.start_kernel(independent=True)
    client = km.client()
    client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
    try:
        await client.wait_for_ready(timeout=120)
        report = await fallback.bring_back(
            fallback.FreshKernel(client, km.is_alive), engine, snapshot, mode, say)
    except BaseException:
        await km.shutdown_kernel(now=True)
        raise
    finally:
        client.stop_channels()
    return write_connection_file(dict(km.get_connection_info())), report


def cmd_rm(args: argparse.Namespace) -> int:
    """Delete the local copy, the remote copy or both (--where)."""
    node = _node(args)
    deleted = node.delete(node.find(args.snapshot), args.where)
    if deleted.remote:
        _say(f"deleted {deleted.snapshot.id} from {node.remote_url}")
    if deleted.local:
        _say(f"deleted {deleted.snapshot.name} ({deleted.snapshot.id})")
    return 0


def cmd_upload(args: argparse.Namespace) -> int:
    """Upload a local snapshot to the remote store (what a save does by itself)."""
    node = _node(args)
    node.require_remote("upload")
    snapshot = node.engine.get(args.snapshot)
    with _ProgressBar(err.is_terminal) as bar:
        uploaded = node.upload(
            snapshot, lambda done, total: bar(EngineProgress("uploading", done, total)))
    _say(f"uploaded {snapshot.name} ({snapshot.id}) to {uploaded.url}")
    return 0


def cmd_rename(args: argparse.Namespace) -> int:
    """Rename the local snapshot, then its remote copy (its re-signed manifest goes up).

    A remote-only snapshot is refused: it is renamed where a copy is. A remote that fails
    leaves the local rename done and says that the remote copy keeps its old name (exit 1).
    """
    node = _node(args)
    found = node.find(args.snapshot)
    node.check_rename(found, args.name)
    snapshot, remote = node.rename(found, args.name)
    _say(f"renamed {args.snapshot} to {snapshot.name} ({snapshot.id})")
    if remote is None or remote["status"] == "none":
        return 0
    if remote["status"] == "failed":
        err.print(
            f"[yellow]warning:[/] {remote['error']['message']}. Run 'jupyter gpu-snapshot "
            f"rename {snapshot.id} {snapshot.name}' again once the remote store answers.",
            highlight=False, soft_wrap=True,
        )
        return 1
    _say(f"renamed its copy in {node.remote_url}")
    return 0


def cmd_recover(args: argparse.Namespace) -> int:
    """What a server start does: commit complete images of killed saves, clean the rest."""
    report = _engine(args).recover()
    if report is None:
        _say("the node agent recovers its store itself, at its start")
        return 0
    for snapshot in report.committed:
        _say(f"committed {snapshot.name} ({snapshot.id}), left by a save that was killed")
    for path, why in report.kept:
        err.print(
            f"kept {path}: {why}; look at it, then delete it by hand",
            highlight=False, soft_wrap=True,
        )
    removed = report.removed
    _say(f"removed {len(removed)} stale working director{'y' if len(removed) == 1 else 'ies'}")
    return 1 if report.kept else 0


def cmd_hibernation(args: argparse.Namespace) -> int:
    """The hibernated kernels of the running servers (or of the one --url names)."""
    kernels: list[dict[str, Any]] = []
    for server in chosen_servers(args.url, args.token):
        listing = server.call("GET", "hibernation", step="list")
        kernels += [{**k, "server": server.url} for k in listing["kernels"]]
    if args.json:
        _print_json(kernels)
        return 0
    if not kernels:
        _say("no hibernated kernels")
        return 0
    rows = [["KERNEL", "STATE", "TIER", "NOTEBOOK", "GPU FREED", "SINCE", "SNAPSHOT", "SERVER"]]
    for k in kernels:
        since = datetime.fromtimestamp(k["since"]).strftime("%Y-%m-%d %H:%M:%S") \
            if k.get("since") else "-"
        rows.append([
            k["kernel_id"], k["state"], k.get("tier") or "process", k.get("notebook_path") or "-",
            format_bytes(k.get("gpu_bytes_freed") or 0), since, k.get("snapshot_id") or "-",
            k["server"],
        ])
    _say(_columns(rows))
    return 0


def _server_of(args: argparse.Namespace) -> Any:
    """The running server that has kernel ``args.kernel_id``."""
    for server in chosen_servers(args.url, args.token):
        with contextlib.suppress(SnapshotError):
            server.call("GET", f"kernels/{args.kernel_id}/status", step="lookup")
            return server
    raise NotFound("lookup", f"no running server has kernel {args.kernel_id!r}",
                   hint="'jupyter gpu-snapshot hibernation' lists the hibernated kernels")


def cmd_hibernate(args: argparse.Namespace) -> int:
    state = _server_of(args).call(
        "POST", f"kernels/{args.kernel_id}/hibernate", {"when_idle": True, "tier": args.tier},
        step="hibernate")
    _say(f"kernel {args.kernel_id}: {state['state']}"
         + (" (as soon as it is idle)" if state["state"] == "requested" else ""))
    return 0


def cmd_wake(args: argparse.Namespace) -> int:
    state = _server_of(args).call("POST", f"kernels/{args.kernel_id}/wake", step="wake")
    _say(f"kernel {args.kernel_id}: {state['state']} (job {state.get('job_id') or '-'})")
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
        _say(f"kernel pid {kernel.kernel_pid}: {state}")
    return 0 if kernel.ready else 1


def cmd_resume(args: argparse.Namespace) -> int:
    """Bring back a kernel that a killed save left stopped or with its CUDA locked."""
    kernel = procfs.inspect_kernel(args.pid)
    if not args.force and not procfs.is_snapshot_ready_kernel(kernel):
        raise NotReady(
            "resume",
            f"pid {args.pid} is not in a snapshot-ready kernel's process tree",
            hint="pass --force to wake its process tree anyway",
        )
    resumed = resume_tree(kernel.root_pid)
    if resumed.no_driver is not None:
        _say(f"woke pids {resumed.pids}; no CUDA to resume ({resumed.no_driver})")
        return 0
    for problem in resumed.problems:
        err.print(f"[red]error:[/] {problem}", highlight=False, soft_wrap=True)
    running = ", ".join(str(pid) for pid in resumed.cuda_running) or "none"
    _say(f"woke pids {resumed.pids}; CUDA running again in: {running}")
    return 2 if resumed.problems else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jupyter gpu-snapshot",
        description="Snapshot live Jupyter kernels (CUDA state included) and restore them.",
    )
    parser.add_argument("--store", help="snapshot store directory (default: the configured one)")
    parser.add_argument("--criu", help="criu executable to use")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("check", help="check criu, privileges, kernel features and the GPU driver")
    p.add_argument("--json", action="store_true",
                   help="print the checks as a JSON list instead of lines")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser(
        "agent", help="run the node agent (as root): snapshots for users without root")
    p.add_argument("--socket", default=str(DEFAULT_SOCKET), help="Unix socket to listen on")
    p.add_argument("--socket-mode", default="0666", type=lambda v: int(v, 8),
                   help="the socket's mode, octal (default 0666: every local user)")
    p.add_argument("--socket-group", help="the socket's group (with --socket-mode 0660)")
    p.add_argument("--state-dir", default=str(DEFAULT_STATE_DIR),
                   help="where each user's store and signing key live (root's alone)")
    p.add_argument("--run-dir", default=str(DEFAULT_RUN_DIR),
                   help="where each user's kernel logs live")
    p.add_argument("--max-operations", type=int, default=2,
                   help="saves and restores one user may have under way at once")
    p.add_argument("--disk-quota", default="0",
                   help="bytes of snapshots per user before saves are refused (e.g. 200G; "
                   "0: none)")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help="connections one user may hold open at once; more are refused "
                   f"(default {DEFAULT_MAX_CONNECTIONS})")
    p.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT,
                   help="seconds a client has to send its request once connected "
                   f"(default {DEFAULT_REQUEST_TIMEOUT:g})")
    p.add_argument("--pods", action="store_true",
                   help="serve users' pods from the node's namespaces (a Kubernetes DaemonSet "
                   "with hostPID): callers are told apart by pod, as the container runtime "
                   "reports it, and kernels are launched, saved and restored inside their "
                   "container (docs/cluster.md)")
    p.add_argument("--container-bundles", action="append", metavar="TEMPLATE",
                   help="with --pods: where the container runtime keeps each container's OCI "
                   "bundle, {id} for the container's id; repeatable (default: containerd's "
                   "and CRI-O's)")
    p.add_argument("--config", help="a Jupyter config file (Python) with the c.GPUSnapshot "
                   "settings for every user's saves and restores, e.g. "
                   "/etc/jupyter/jupyter_gpu_snapshot_agent_config.py; root runs it, so "
                   "only root may be able to change it")
    p.set_defaults(func=cmd_agent)

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
    p.add_argument("--json", action="store_true",
                   help="print the snapshots' summaries as a JSON list (with 'location': "
                   "local, remote or both)")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser(
        "du", help="the local store's bytes on disk, and what deleting each snapshot frees"
    )
    p.add_argument("--json", action="store_true",
                   help="print the store's disk_bytes and chunks_bytes, and each snapshot's "
                   "size_bytes, new_bytes, own_bytes, sole_page_bytes and frees_bytes, as JSON")
    p.set_defaults(func=cmd_du)

    p = sub.add_parser("save", help="snapshot a running kernel")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--pid", type=int, help="process id of the kernel")
    target.add_argument("--kernel-id", help="Jupyter kernel id (from the server's /api/kernels)")
    p.add_argument("--name", help="snapshot name (letters, digits, '.', '_', '-')")
    p.add_argument("--stop", action="store_true", help="end the kernel after the snapshot")
    p.add_argument("--portable", action="store_true",
                   help="also write a portable copy of the namespace (with --kernel-id), "
                   "for 'restore --fallback' where the image cannot come back")
    p.add_argument("--json", action="store_true",
                   help="print the new snapshot's summary as JSON (no progress bar)")
    p.set_defaults(func=cmd_save)

    p = sub.add_parser(
        "restore",
        help="restore a snapshot as a standalone kernel (a remote-only one is downloaded first)",
    )
    p.add_argument("snapshot", help="snapshot name or id")
    p.add_argument("--gpus", metavar="LIST",
                   help="GPUs of this node for the process's devices, cuda:0 first, by index "
                   "or UUID (e.g. 1,0); default: the same GPUs if they have room, else GPUs "
                   "of the same model with room")
    p.add_argument("--fallback", choices=fallback.MODES,
                   help="do not restore the image: start a fresh kernel and load the "
                   "portable copy (portable), re-run the recorded cells (replay), or both")
    p.add_argument("--json", action="store_true",
                   help="print pid, kernel pid, connection file, timings and the GPU remap "
                   "as JSON")
    p.set_defaults(func=cmd_restore)

    p = sub.add_parser(
        "trust", help="sign an unsigned snapshot with this node's key (after a warning)"
    )
    p.add_argument("snapshot", help="snapshot id")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.set_defaults(func=cmd_trust)

    p = sub.add_parser("rm", help="delete a snapshot (by id also when unsigned or damaged)")
    p.add_argument("snapshot", help="snapshot name or id")
    p.add_argument(
        "--where", choices=(LOCAL, REMOTE, BOTH), default=BOTH,
        help="which copies to delete when a remote store is set (default: both)",
    )
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("upload", help="upload a local snapshot to the remote store")
    p.add_argument("snapshot", help="snapshot name or id")
    p.set_defaults(func=cmd_upload)
    p = sub.add_parser(
        "download", help="fetch a remote snapshot into the local store (checked as it streams)"
    )
    p.add_argument("snapshot", help="snapshot name or id")
    p.set_defaults(func=cmd_download)
    p = sub.add_parser("rename", help="give a snapshot another name (its manifest is re-signed)")
    p.add_argument("snapshot", help="snapshot name or id")
    p.add_argument("name", help="the new name: 1-64 letters, digits, '.', '_' or '-'")
    p.set_defaults(func=cmd_rename)

    p = sub.add_parser(
        "resume",
        help="wake a kernel that an interrupted save left stopped or with CUDA locked",
    )
    p.add_argument("--pid", type=int, required=True, help="process id of the kernel")
    p.add_argument("--force", action="store_true",
                   help="wake the process tree even if it is not a snapshot-ready kernel")
    p.set_defaults(func=cmd_resume)

    p = sub.add_parser(
        "recover",
        help="commit complete images that killed saves left, and remove stale work (as a "
        "server start does)",
    )
    p.set_defaults(func=cmd_recover)

    def server_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--url", help="the Jupyter server's URL (default: every running server "
                       "of this user, from the Jupyter runtime directory)")
        p.add_argument("--token", help="the server's token, with --url")

    p = sub.add_parser("hibernation", help="list the hibernated kernels of the running servers")
    server_options(p)
    p.add_argument("--json", action="store_true", help="print them as JSON")
    p.set_defaults(func=cmd_hibernation)

    p = sub.add_parser("hibernate", help="hibernate a server's kernel (once its cell ends)")
    p.add_argument("kernel_id", help="the kernel's id (GET /api/kernels)")
    p.add_argument("--tier", choices=("gpu", "process"), default="process",
                   help="gpu: release its GPU and keep its process (wakes in seconds); "
                   "process: save it and end its process (frees host memory too)")
    server_options(p)
    p.set_defaults(func=cmd_hibernate)

    p = sub.add_parser("wake", help="wake a hibernated kernel of a server")
    p.add_argument("kernel_id", help="the kernel's id (jupyter gpu-snapshot hibernation)")
    server_options(p)
    p.set_defaults(func=cmd_wake)

    p = sub.add_parser("status", help="say whether a kernel process is snapshot-ready")
    p.add_argument("--pid", type=int, required=True, help="process id of the kernel")
    p.add_argument("--json", action="store_true",
                   help="print readiness, problems and connection file as JSON")
    p.set_defaults(func=cmd_status)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except SnapshotError as exc:
        err.print(f"[red]error:[/] {exc.message}", highlight=False, soft_wrap=True)
        return 2
    except (KeyboardInterrupt, _Interrupted):
        err.print(
            "interrupted: stopped at a safe point and rolled back; the kernel keeps running",
            highlight=False,
        )
        return 130
    return code

