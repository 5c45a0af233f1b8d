"""The node agent's stores made whole at its start, as a server's start makes its own: what
the agent's own end (``kill -9``, systemd's restart, the OOM killer, a rolling update of
the DaemonSet) left in the middle of a save or a restore.

For every realm found in the state directory (``realm_homes``), before the realm serves
its first request (``server.NodeAgent.realm`` waits for it):

- the store is recovered by ``core/recovery``: a complete image is committed and listed, a
  partial one removed (its kernel woken, when it still runs) or, when its kernel is gone,
  kept aside as ``.unfinished-ID``; criu's work directories of the dead agent go;
- every save the agent had under way when it ended (``SavesUnderWay``, a file of root's in
  the realm's state) whose kernel no longer runs gets a death notice: a line in the
  kernel's log, in nsinit's form (``core.kernel_log``), which names the snapshot that holds
  its state, or says that none does; the server's record of the death reads it there. The
  line is written through a descriptor the kernel's user opened (``files.opener``), as
  every file of theirs the agent touches (``core.user_paths``: the kernel's log).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pwd
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._constants import KERNEL_DEATH_PREFIX
from ..config import GPUSnapshot
from ..core import procfs, safe_fs
from ..core.errors import SnapshotError
from ..core.recovery import RecoveryReport, recover_store
from ..core.store import Snapshot
from ..core.user_paths import UserPath
from ..node.local_engine import LocalEngine, wake_kernel
from .credentials.ownership import Caller
from .files.opener import CallerFiles
from .realms import store_engine

log = logging.getLogger(__name__)

SAVES_FILE = "saves-under-way.json"


@dataclass(frozen=True)
class RealmHome:
    """A realm's directories as the state and run directories hold them: ``key`` is the
    realm's key (``Caller.realm_key``)."""

    key: str
    state: Path  # STATE/users/UID or STATE/pods/NAMESPACE/NAME
    log_dir: Path  # RUN/users/UID/logs or RUN/pods/NAMESPACE/NAME/logs


def realm_homes(state_dir: Path, run_dir: Path) -> list[RealmHome]:
    """The realms the agent kept before: a user's by uid, a pod owner's by namespace and
    name. Entries of any other shape are none of the agent's and are left alone."""
    found = []
    users = state_dir / "users"
    with contextlib.suppress(OSError):
        for home in sorted(users.iterdir()):
            if home.name.isdigit() and home.is_dir() and not home.is_symlink():
                found.append(RealmHome(home.name, home, run_dir / "users" / home.name / "logs"))
    with contextlib.suppress(OSError):
        for namespace in sorted((state_dir / "pods").iterdir()):
            for home in sorted(namespace.iterdir()):
                if home.is_dir() and not home.is_symlink():
                    name = f"{namespace.name}/{home.name}"
                    found.append(RealmHome(f"pod:{name}", home,
                                           run_dir / "pods" / namespace.name / home.name / "logs"))
    return found


class SavesUnderWay:
    """The saves of one realm that the agent has under way, in ``STATE/.../saves-under-way
    .json`` (root's): each kernel's root pid, its start, its id and whether the save stops
    it. Written when a save starts and again when it ends, however it ends: what is left at
    the agent's start are saves it did not see through."""

    # One writer at a time (a user's saves end in threads of their own); few writes, so one
    # lock for every realm's file.
    _lock = threading.Lock()

    def __init__(self, path: Path) -> None:
        self.path = path

    def begin(self, root_pid: int, kernel_id: str | None, stop: bool) -> str:
        """Note a save of the tree ``root_pid``; its token, for ``end``. Blocking."""
        token = f"{root_pid}-{time.monotonic_ns()}"
        with self._lock:
            saves = self._read()
            saves[token] = {"root_pid": root_pid, "root_started": procfs.start_time(root_pid),
                            "kernel_id": kernel_id, "stop": stop, "at": time.time()}
            self._write(saves)
        return token

    def end(self, token: str) -> None:
        with self._lock:
            saves = self._read()
            if saves.pop(token, None) is not None:
                self._write(saves)

    def left(self) -> list[dict[str, Any]]:
        """The saves noted and never ended, oldest first."""
        with self._lock:
            return sorted(self._read().values(), key=lambda s: float(s.get("at") or 0))

    def clear(self) -> None:
        with self._lock, contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _read(self) -> dict[str, dict[str, Any]]:
        found = safe_fs.read_json_object(self.path)
        return {str(k): v for k, v in (found or {}).items() if isinstance(v, dict)}

    def _write(self, saves: dict[str, dict[str, Any]]) -> None:
        staged = self.path.with_suffix(".new")
        staged.write_text(json.dumps(saves))
        os.replace(staged, self.path)


def recover_realm(home: RealmHome, settings: GPUSnapshot) -> RecoveryReport:
    """Recover the store of the realm at ``home`` and give a death notice to each kernel
    that a save the agent did not see through left dead. Blocking: called in a thread,
    once per realm, at the agent's start."""
    engine = store_engine(home.state, home.log_dir, settings)
    report = recover_store(engine.store, wake=wake_kernel)
    for snapshot in report.committed:
        log.warning("realm %s: snapshot %s (%s) of a save the agent did not finish was "
                    "complete: committed and listed", home.key, snapshot.name, snapshot.id)
    for path, why in report.kept:
        log.warning("realm %s: %s kept aside: %s", home.key, path, why)
    if report.removed:
        log.info("realm %s: removed what saves the agent did not finish left: %s", home.key,
                 ", ".join(str(p) for p in report.removed))
    saves = SavesUnderWay(home.state / SAVES_FILE)
    for save in saves.left():
        _notice(home, engine, report, save)
    saves.clear()
    return report


def _notice(home: RealmHome, engine: LocalEngine, report: RecoveryReport,
            save: dict[str, Any]) -> None:
    """The death notice of the kernel of ``save``, which the agent did not see through,
    if that kernel no longer runs."""
    root_pid = int(save.get("root_pid") or 0)
    started = save.get("root_started")
    if root_pid <= 0 or procfs.same_process(root_pid, started):
        return  # it runs (woken by the recovery if the save had stopped it)
    kernel = f"kernel {save.get('kernel_id') or ''} (pid {root_pid})".replace("  ", " ")
    held = _snapshot_of(engine, root_pid, started, float(save.get("at") or 0))
    if held is not None:
        text = (f"stopped by a save that the node agent did not see through (it ended "
                f"meanwhile); snapshot {held.name} ({held.id}) holds its state")
        logs = list(held.manifest["kernel"].get("log_files") or [])
    else:
        kept = [str(path) for path, _why in report.kept]
        text = ("ended during a save that the node agent did not see through (it ended "
                "meanwhile); no snapshot holds its state"
                + (f" (what its dump wrote is kept aside in {', '.join(kept)})" if kept else ""))
        logs = []
    log.warning("realm %s: %s %s", home.key, kernel, text)
    for path in logs:
        try:
            _append_as_owner(home, str(path), f"{KERNEL_DEATH_PREFIX}{text}\n")
        except (OSError, SnapshotError) as exc:
            log.warning("realm %s: the death notice of %s could not be written to %s: %s",
                        home.key, kernel, path, exc)


def _snapshot_of(engine: LocalEngine, root_pid: int, started: Any, since: float
                 ) -> Snapshot | None:
    """The newest listed snapshot of the tree ``root_pid`` (started at ``started``) taken
    at ``since`` or later."""
    found = None
    for snapshot in engine.list():
        kernel = snapshot.manifest.get("kernel") or {}
        same_start = (started is None or kernel.get("root_started") is None
                      or abs(float(kernel["root_started"]) - float(started)) < 0.5)
        if (kernel.get("root_pid") == root_pid and same_start
                and float(snapshot.manifest.get("created") or 0) >= since - 1
                and (found is None or snapshot.created > found.created)):
            found = snapshot
    return found


def _append_as_owner(home: RealmHome, path: str, line: str) -> None:
    """Append ``line`` to the kernel log at ``path`` through a descriptor its user opened
    (``files.opener``): the log's directory is theirs. Only a regular file is written to."""
    if Path(path).parent != home.log_dir:
        raise SnapshotError("recover", f"{path} is not in the realm's log directory")
    owner = os.stat(home.log_dir, follow_symlinks=False)
    files = CallerFiles(_owner_of(owner.st_uid, owner.st_gid))
    try:
        fd = files.open(path, os.O_WRONLY | os.O_APPEND, UserPath.KERNEL_LOG)
    finally:
        files.close()
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SnapshotError("recover", f"the kernel log {path} is not a regular file")
        os.set_blocking(fd, True)
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _owner_of(uid: int, gid: int) -> Caller:
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return Caller(uid, gid, frozenset({gid}), str(uid))
    return Caller(uid, gid, frozenset(os.getgrouplist(entry.pw_name, gid)), entry.pw_name)


__all__ = ["SAVES_FILE", "RealmHome", "SavesUnderWay", "realm_homes", "recover_realm"]
