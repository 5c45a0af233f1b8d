"""Each caller's share of the node agent, a realm: their store and signing key, their log
directory, the kernels the agent launched or restored for them, and their operations under
way; and the engine each of their operations runs, built for the caller as they are then.

A realm is a user's, by uid (``STATE/users/UID``, ``RUN/users/UID/logs``), or, for an
agent that serves pods, a pod owner's, by the pod's namespace and name
(``STATE/pods/NAMESPACE/NAME``, ``RUN/pods/NAMESPACE/NAME/logs``). The store and the key
are root's alone; the log directory is the caller's. ``NodeAgent.realm`` makes each once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import pwd
import threading
from pathlib import Path
from typing import Any

import psutil

from .._constants import ENV_CUDA_BROKER
from ..agent_client.protocol import Refused
from ..config import GPUSnapshot
from ..core import safe_fs
from ..core.criu import CriuLaunch, PidView
from ..core.errors import SnapshotError
from ..launch.liveness import kernel_answers
from ..node.gpus import GpuSleep
from ..node.local_engine import EngineLaunch, LocalEngine, make_engine
from .caller_hook import CallerCredentials
from .credentials import criu_runs_as
from .credentials.ownership import Caller, PodCaller
from .files.opener import CallerFiles
from .pods import identity, pids
from .pods.entry import ContainerEntry, in_agent, in_network_of
from .workers import REALM_THREADS, Pool


def caller_of(uid: int, gid: int) -> Caller:
    """The caller ``uid`` with their groups as the user database says now (it may ask a
    directory server: called in a thread)."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:  # a uid with no name (a container's arbitrary uid): its gid alone
        return Caller(uid, gid, frozenset({gid}), str(uid))
    groups = frozenset(os.getgrouplist(entry.pw_name, entry.pw_gid))
    return Caller(uid, entry.pw_gid, groups, entry.pw_name)


def pod_caller_of(pid: int, uid: int, gid: int, bundles: tuple[str, ...],
                  pidfd: int | None = None, start: int = 0) -> PodCaller:
    """The caller ``uid`` in the pod process ``pid`` runs in, as the container runtime's
    records say (``pods/identity``); a process in no pod is refused. ``pidfd`` and
    ``start``: of the process that connected, as the agent accepted it."""
    pod = identity.identify(pid, bundles, pidfd)
    user = caller_of(uid, gid)
    return PodCaller(user.uid, user.gid, user.groups, pod.realm_name, peer_pid=pid,
                     peer_start=start)


def engine_launch(caller: Caller) -> EngineLaunch:
    """How the engine of one operation of ``caller`` runs criu and reaches their kernel:
    criu with the credentials ``credentials/criu_runs_as`` gives them; their files opened
    as them, by a helper of theirs (``files/opener``: its ``close`` ends it); in a pod,
    criu inside their container with the agent's own files, its loader, the CUDA plugin's
    stand-in and its broker's socket among them, naming processes by their pids there,
    and every path of theirs resolved in their container's root; and the caller's checks
    last. Reads the caller's container (blocking: call in a thread)."""
    dump_as = tuple(criu_runs_as.dump_command(caller))
    restore_as = tuple(criu_runs_as.restore_command(caller))
    checks = (CallerCredentials(caller),)
    if not isinstance(caller, PodCaller):
        return EngineLaunch(CriuLaunch(dump_as=dump_as, restore_as=restore_as),
                            files=CallerFiles(caller), hooks=checks)
    entry = ContainerEntry.of(caller.peer_pid, caller.peer_start or None)
    criu = CriuLaunch(
        dump_as=(*entry.prefix(), *_through_agent_root(dump_as)),
        restore_as=(*entry.prefix(), *_through_agent_root(restore_as)),
        program=ContainerEntry.program, path=in_agent,
        path_variables=frozenset({"PATH", ENV_CUDA_BROKER}), action_scripts=False,
        pids=PidView(to_criu=functools.partial(pids.seen_in_container, caller.peer_pid),
                     from_criu=functools.partial(pids.agent_task_of, caller.peer_pid)))
    # The kernel listens on its container's loopback.
    return EngineLaunch(criu, functools.partial(_answers_in_pod, caller.peer_pid),
                        files=CallerFiles(caller, root=f"/proc/{caller.peer_pid}/root"),
                        hooks=checks)


def _through_agent_root(prefix: tuple[str, ...]) -> list[str]:
    """A command prefix of the agent's programs (setpriv), run in a user's container with
    the agent's own loader and files (``ContainerEntry.program``)."""
    return [*ContainerEntry.program(prefix[0]), *prefix[1:]] if prefix else []


async def _answers_in_pod(peer_pid: int, connection_info: dict[str, Any],
                          timeout: float) -> bool:
    """Whether the kernel at ``connection_info`` answers, asked from the network of
    process ``peer_pid``'s container."""
    return await in_network_of(
        peer_pid, lambda: asyncio.run(kernel_answers(connection_info, timeout)))


@dataclasses.dataclass
class Realm:
    """One user's share of the agent: their store, logs, kernels and running operations.

    ``shared`` is the engine of their store, with the node's hooks and no caller's launch:
    the queries use it, and each save, restore, GPU release or wake runs an engine built
    from it for the caller who asks (``engine_for``)."""

    caller: Caller
    shared: LocalEngine
    log_dir: Path
    launched_file: Path
    operations: int = 0
    # launched.json's writers: launches and restores of one user run at once, each in a
    # thread (asyncio.to_thread).
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    # The quota's admission: what the user's saves under way may still write (each one's
    # estimate, until it ends), and one check at a time, so that two saves asked for at
    # once cannot both see the room only one of them has.
    reserved_bytes: int = 0
    quota_lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    # The worker threads this user's steps run in, at most a share of the agent's
    # (``workers``): one user's hung steps hold only theirs.
    workers: Pool = dataclasses.field(default_factory=lambda: Pool("a realm", REALM_THREADS))

    @property
    def state_home(self) -> Path:
        """``STATE/users/UID`` or ``STATE/pods/NAMESPACE/NAME``: root's alone."""
        return self.launched_file.parent

    def engine_for(self, caller: Caller) -> LocalEngine:
        """An engine of this realm's store that runs as ``caller``, with their credentials
        as the user database says now (their gid and groups may have changed since the
        realm was made; the uid, its key, cannot). Its ``files`` are closed by whoever
        asked for it, once done. Blocking: call in a thread."""
        return self.shared.with_launch(engine_launch(caller))

    def launched(self) -> dict[int, float]:
        """The roots of the trees the agent launched or restored for this user that still
        run: pid -> start time (a pid reused by another process does not count)."""
        try:
            recorded = json.loads(self.launched_file.read_text())
        except (OSError, ValueError):
            recorded = {}
        alive: dict[int, float] = {}
        for pid_text, started in recorded.items():
            with contextlib.suppress(psutil.Error, ValueError):
                if abs(psutil.Process(int(pid_text)).create_time() - float(started)) < 0.01:
                    alive[int(pid_text)] = float(started)
        return alive

    def remember(self, pid: int) -> None:
        with self.lock:
            kernels = self.launched()
            kernels[pid] = psutil.Process(pid).create_time()
            tmp = self.launched_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({str(p): t for p, t in kernels.items()}))
            os.replace(tmp, self.launched_file)

    def root_of(self, pid: int, step: str = "save", caller: Caller | None = None) -> int:
        """The launched tree that process ``pid`` belongs to; refused if none. A caller in
        a pod names the process by its pid there: ``caller``, the one asking now (the
        realm's maker's process may be gone)."""
        asked, caller = pid, caller or self.caller
        roots = self.launched()
        if isinstance(caller, PodCaller):
            found = pids.agent_pid(pid, caller.peer_pid, pids.tree_pids(roots))
            pid = 0 if found is None else found
        if pid in roots:
            return pid
        with contextlib.suppress(psutil.Error):
            for parent in ([] if pid <= 0 else psutil.Process(pid).parents()):
                if parent.pid in roots:
                    return parent.pid
        raise Refused(
            step, f"process {asked} is not a kernel the node agent launched or restored "
            f"for you ({caller.name})",
            hint="start the kernel from a server that uses the agent",
        )

    def gpu_sleep(self) -> GpuSleep:
        """Hibernation's gpu tier with the CUDA hook of this user's engine. Its holders are
        root's, in root's directory of them, each found by its kernel's root pid: a
        holder started before a restart of the agent is found again."""
        return self.shared.gpu_sleep()


def make_realm(caller: Caller, state_dir: Path, run_dir: Path,
               settings: GPUSnapshot) -> Realm:
    """The realm of ``caller``, its directories made (or checked) on the way. Blocking."""
    # A user's, by uid; or a pod's, by NAMESPACE/NAME (DNS names: no "." or "..").
    own = (Path("pods", caller.name) if isinstance(caller, PodCaller)
           else Path("users", str(caller.uid)))
    home = state_dir / own
    safe_fs.make_private_dirs(home)
    # The users' log directories: the parents are root's, so no user can swap one
    # for a link; each user's own directory is theirs alone. A pod mounts its own at
    # the same path, where its kernels write.
    for depth in range(1, len(own.parts) + 1):
        level = run_dir.joinpath(*own.parts[:depth])
        level.mkdir(parents=True, exist_ok=True, mode=0o755)
        os.chmod(level, 0o755)
    log_dir = run_dir / own / "logs"
    log_dir.mkdir(exist_ok=True, mode=0o700)
    if log_dir.is_symlink() or not log_dir.is_dir():
        raise SnapshotError("agent", f"{log_dir} is not a directory")
    os.chown(log_dir, caller.uid, caller.gid, follow_symlinks=False)
    os.chmod(log_dir, 0o700, follow_symlinks=False)
    return Realm(caller, store_engine(home, log_dir, settings), log_dir,
                 home / "launched.json", workers=Pool(caller.name, REALM_THREADS))


def store_engine(home: Path, log_dir: Path, settings: GPUSnapshot) -> LocalEngine:
    """The engine of the store of the realm at ``home`` (``STATE/users/UID``,
    ``STATE/pods/NAMESPACE/NAME``), whose kernels write their logs in ``log_dir``: the
    node's hooks, no caller's launch."""
    store_settings = GPUSnapshot(
        parent=None, config=settings.config,
        store_dir=str(home / "snapshots"), signing_key_file=str(home / "signing.key"),
    )
    return make_engine(store_settings, kernel_log_dir=lambda: log_dir)
