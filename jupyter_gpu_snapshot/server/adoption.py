"""A restarted server takes back the live kernels that a killed server left running.

Snapshot-ready kernels run in their own PID namespace and session, with no pipes to the
server, so a server killed with SIGKILL leaves them alive. To find them again, every server
keeps a record of its snapshot-ready kernels and their sessions in the runtime dir
(``gpu_snapshot/servers/server-PID.json``, 0600: it holds the kernels' keys). At start, the
records of servers that no longer run are read: live kernels are adopted under the same
kernel ids, with the same sessions for their notebooks; the connection files of dead ones
are removed; then the record goes.

The record follows the kernels every ``RECORD_SECONDS``, and also at once whenever a
kernel's tree starts to run (a launch, a restart, a restore's or an orphan's adoption, a
wake), before that start is reported to anyone: a server SIGKILLed right after it answered
a kernel's start still leaves that kernel in its record (``SnapshotReadyProvisioner``'s
``on_kernel_tree`` hook).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from jupyter_core.paths import jupyter_runtime_dir
from jupyter_core.utils import ensure_async
from tornado import web

from ..core import procfs, safe_fs
from ..launch.provisioner import (
    ADOPT_KWARG,
    Adoption,
    SnapshotReadyProvisioner,
    on_kernel_tree,
)
from .kernel_env import refresh_kernel_env

# How often the record follows the server's kernels and sessions.
RECORD_SECONDS = 2.0
# Environment refreshes still waiting for a busy kernel; held so they are not collected.
_REFRESHING: set[asyncio.Future[bool]] = set()


def records_dir(runtime_dir: Path | None = None) -> Path:
    return Path(runtime_dir or jupyter_runtime_dir()) / "gpu_snapshot" / "servers"


@dataclass
class AdoptionReport:
    """What a start did with the kernels of dead servers; logged by the caller."""

    adopted: list[str] = field(default_factory=list)  # kernel ids
    sessions: list[str] = field(default_factory=list)  # session ids brought back
    dead: list[str] = field(default_factory=list)  # kernel ids whose process is gone
    failed: dict[str, str] = field(default_factory=dict)  # kernel id -> why


def _write_private(path: Path, data: dict[str, Any]) -> None:
    for directory in (path.parent.parent, path.parent):
        directory.mkdir(mode=0o700, exist_ok=True)
    staged = path.with_suffix(".new")
    staged.unlink(missing_ok=True)
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    # Complete once replaced: a SIGKILLed server loses nothing the page cache holds. No
    # fsync: a node that goes down takes the kernels with it, and an fsync behind a save's
    # gigabytes would hold up every kernel start for seconds.
    os.replace(staged, path)


class KernelRecord:
    """Keeps this server's record current while it runs; made, started and stopped by the
    app. Made before the server takes requests, it records each kernel tree as it starts."""

    def __init__(
        self,
        kernel_manager: Any,
        session_manager: Any,
        log: logging.Logger,
        directory: Path | None = None,
    ) -> None:
        self.kernel_manager = kernel_manager
        self.session_manager = session_manager
        self.log = log
        me = psutil.Process()
        self.path = (directory or records_dir()) / f"server-{me.pid}.json"
        self._server = {"pid": me.pid, "started": me.create_time()}
        self._last: dict[str, Any] | None = None
        self._started: dict[int, float | None] = {}  # root pid -> start time, read once
        self._task: asyncio.Task[None] | None = None
        # The record's own thread for its file work: a kernel's start waits for the record,
        # never behind a save's reads and writes in the loop's shared worker threads.
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpu-snapshot-record")
        # Kernels whose tree runs but which the kernel manager lists only once their start
        # has completed (jupyter_client adds a kernel after its launch returns).
        self._starting: dict[str, Any] = {}  # kernel id -> its kernel manager
        # One update at a time: an older view written after a newer one would drop a
        # kernel that has just been recorded.
        self._writing = asyncio.Lock()
        on_kernel_tree(kernel_manager, self.tree_runs)

    async def snapshot(self) -> dict[str, Any]:
        """This server's snapshot-ready kernels and their sessions, as the record holds them."""
        sessions: list[dict[str, Any]] = []
        if self.session_manager is not None:
            sessions = list(await ensure_async(self.session_manager.list_sessions()))
        listed = list(self.kernel_manager.list_kernel_ids())
        managers = {kernel_id: self.kernel_manager.get_kernel(kernel_id) for kernel_id in listed}
        for kernel_id, km in list(self._starting.items()):
            if kernel_id in managers or not _running_tree(km):
                del self._starting[kernel_id]  # listed now, or its start failed
            else:
                managers[kernel_id] = km
        kernels: dict[str, Any] = {}
        for kernel_id, km in managers.items():
            root = _running_tree(km)
            if root is None:
                continue
            info = {k: v.decode() if isinstance(v, bytes) else v
                    for k, v in km.get_connection_info(session=False).items()}
            kernels[kernel_id] = {
                "kernel_name": km.kernel_name,
                "connection_file": km.connection_file,
                "connection_info": info,
                "root_pid": root,
                "root_started": await self._start_time(root),
                "sessions": [
                    {k: s.get(k) for k in ("id", "path", "name", "type")}
                    for s in sessions if (s.get("kernel") or {}).get("id") == kernel_id
                ],
            }
        return {"server": self._server, "kernels": kernels}

    async def _start_time(self, root: int) -> float | None:
        if root not in self._started:
            self._started[root] = await asyncio.get_running_loop().run_in_executor(
                self._io, procfs.start_time, root)
        return self._started[root]

    async def update(self) -> None:
        async with self._writing:
            data = await self.snapshot()
            if data != self._last:
                await asyncio.get_running_loop().run_in_executor(
                    self._io, _write_private, self.path, data)
                self._last = data

    async def tree_runs(self, provisioner: SnapshotReadyProvisioner) -> None:
        """Called by the provisioner once a kernel's tree runs, before its launch returns:
        the record holds the kernel before anyone learns that it started."""
        self._starting[str(provisioner.kernel_id)] = provisioner.parent
        try:
            await self.update()
        except Exception as exc:  # the kernel runs all the same; the next update retries
            self.log.warning("gpu-snapshot: could not record kernel %s in %s: %s",
                             provisioner.kernel_id, self.path, exc)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._follow())

    async def _follow(self) -> None:
        while True:
            try:
                await self.update()
            except Exception as exc:  # a record a little out of date is no reason to stop
                self.log.warning("gpu-snapshot: could not update %s: %s", self.path, exc)
            await asyncio.sleep(RECORD_SECONDS)

    def stop(self) -> None:
        """Called by the app as the server stops: its kernels stop with it."""
        on_kernel_tree(self.kernel_manager, None)
        if self._task is not None:
            self._task.cancel()
        self._io.shutdown(wait=False)
        self.path.unlink(missing_ok=True)


def _running_tree(km: Any) -> int | None:
    """The root pid of a snapshot-ready kernel's running tree; None for other kernels and
    for a hibernated one."""
    provisioner = getattr(km, "provisioner", None)
    if not isinstance(provisioner, SnapshotReadyProvisioner) or not provisioner.root_pid:
        return None
    return int(provisioner.root_pid)


async def adopt_orphans(
    kernel_manager: Any,
    session_manager: Any,
    log: logging.Logger,
    directory: Path | None = None,
) -> AdoptionReport:
    """Adopt the live kernels of servers that died; called by the app once it listens."""
    report = AdoptionReport()
    base = directory or records_dir()
    paths = await asyncio.to_thread(lambda: sorted(base.glob("server-*.json")) if base.is_dir()
                                    else [])
    for path in paths:
        record = await asyncio.to_thread(safe_fs.read_json_object, path)
        server = (record or {}).get("server") or {}
        if server.get("pid") == os.getpid():
            continue
        if await asyncio.to_thread(
                procfs.same_process, int(server.get("pid") or 0), server.get("started")):
            continue  # another live server's kernels
        for kernel_id, kernel in ((record or {}).get("kernels") or {}).items():
            await _adopt_one(kernel_manager, session_manager, kernel_id, kernel, report, log)
        await asyncio.to_thread(path.unlink, missing_ok=True)
    return report


async def _adopt_one(
    kernel_manager: Any,
    session_manager: Any,
    kernel_id: str,
    kernel: dict[str, Any],
    report: AdoptionReport,
    log: logging.Logger,
) -> None:
    if kernel_id in kernel_manager:
        return
    root = int(kernel.get("root_pid") or 0)
    alive = await asyncio.to_thread(
        lambda: procfs.same_process(root, kernel.get("root_started")) and procfs.tree_alive(root)
    )
    if not alive:
        report.dead.append(kernel_id)
        await asyncio.to_thread(_remove_connection_file, kernel.get("connection_file"),
                                kernel_id)
        return
    launch = {ADOPT_KWARG: Adoption(root, kernel["connection_info"], None)}
    try:
        await ensure_async(kernel_manager.start_kernel(
            kernel_id=kernel_id, kernel_name=kernel.get("kernel_name"), **launch
        ))
        ready = getattr(kernel_manager.get_kernel(kernel_id), "ready", None)
        if ready is not None:
            await ready
    except Exception as exc:
        report.failed[kernel_id] = f"{type(exc).__name__}: {exc}"
        log.warning("gpu-snapshot: could not adopt kernel %s (pid %s): %s", kernel_id, root, exc)
        return
    report.adopted.append(kernel_id)
    _tell_new_server(kernel_manager.get_kernel(kernel_id), log)
    if session_manager is None:
        return
    for session in kernel.get("sessions") or []:
        try:
            await session_manager.get_session(session_id=session["id"])
            continue  # the session is there already
        except web.HTTPError as exc:
            if exc.status_code != 404:
                raise
        await session_manager.save_session(
            session["id"], path=session.get("path"), name=session.get("name"),
            type=session.get("type"), kernel_id=kernel_id,
        )
        report.sessions.append(str(session["id"]))


def _remove_connection_file(path: str | None, kernel_id: str) -> None:
    """Remove a dead kernel's connection file (it holds its key); only the one it names."""
    if not path:
        return
    file = Path(path)
    if file.name == f"kernel-{kernel_id}.json" and not file.is_symlink():
        with contextlib.suppress(OSError):
            file.unlink()


def _tell_new_server(km: Any, log: logging.Logger) -> None:
    """Give an adopted kernel this server's URL and credential, without waiting for it.

    Its ``os.environ`` still names the server that launched it, so %gpu_snapshot inside it
    would call that one. A kernel in the middle of a cell answers only after that cell.
    """
    provisioner = getattr(km, "provisioner", None)
    env = provisioner.server_env() if isinstance(provisioner, SnapshotReadyProvisioner) else {}
    if not env:
        return
    task = asyncio.ensure_future(refresh_kernel_env(km, env, log))
    _REFRESHING.add(task)
    task.add_done_callback(_REFRESHING.discard)
