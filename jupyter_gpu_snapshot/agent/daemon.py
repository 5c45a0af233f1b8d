"""The node agent: ``jupyter gpu-snapshot agent``, run by root once per node.

It listens on a Unix socket and serves unprivileged users' servers, CLIs and magics. Each
connection's caller is the uid the kernel reports for the peer (``SO_PEERCRED``), their
groups the user database's. Every caller gets a realm of their own:

- a store, ``STATE/users/UID/snapshots``, and a signing key beside it, both root's alone:
  the caller can neither write an image root will restore nor sign one, and lists,
  restores, renames and deletes only their own snapshots;
- a log directory, ``RUN/users/UID/logs``, theirs, where the kernels the agent launches
  for them write (the agent chooses the name; the kernel opens it as the caller);
- the kernels the agent launched or restored for them (``launched.json``).

With ``pods`` (``--pods``: a Kubernetes DaemonSet in the node's pid namespace) the callers
are processes in users' pods, and the pod, as the container runtime reports it
(``pod_callers``), tells them apart, whatever their uid: each pod owner's realm is kept by
the pod's namespace and name, ``STATE/pods/NAMESPACE/NAME`` and ``RUN/pods/NAMESPACE/NAME/logs``
(which the pod mounts at that same path). The agent launches, saves and restores each
kernel inside the caller's container, running its own programs there (``containers``), and
pids in requests and answers are the container's.

Hibernation's gpu tier goes through the agent too: ``gpu_release`` gives back the GPU of
one of those kernels and keeps its process, ``gpu_wake`` brings it back, ``gpu_asleep``
says whether it sleeps (``gpu/sleep.py``). The agent does them with the GPU sleep of the
caller's CUDA hook; the holder it starts runs as root, in its own session, and outlives the
request and the agent, which finds it again by the kernel's root pid.

What each operation checks is in ``_Session``; what a tree must be to be dumped (or to have
its GPU released) is in ``ownership``, what an image must be to be restored in
``image_creds``. Limits: at most ``max_operations`` saves, restores, GPU releases or wakes
of one user at once, one at a time per kernel, and no save while their store and
their saves under way take ``disk_quota_bytes`` or more; at most ``max_connections``
connections of one user open at once, each sending its request within
``request_timeout`` seconds and ``MAX_REQUEST_BYTES``, so that no user can take the
agent's file descriptors or memory from the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import grp
import json
import logging
import os
import pwd
import re
import resource
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from .._constants import ENV_CUDA_BROKER, format_bytes
from .._version import __version__
from ..agent_client.protocol import (
    DEFAULT_SOCKET,
    MAX_REQUEST_BYTES,
    OPERATIONS,
    Refused,
    encode,
    snapshot_fields,
)
from ..config import GPUSnapshot
from ..core import locks, procfs, safe_fs
from ..core.criu import CriuExtras
from ..core.errors import InvalidRequest, NotReady, SnapshotError
from ..core.hooks import Progress, RestoreContext, SaveContext, SaveTarget, SnapshotHook
from ..core.sequences import finish_despite_cancel
from ..launch.liveness import kernel_answers
from ..launch.provisioner import NSINIT, wait_for_namespace_init
from ..node.gpus import GpuSleep, SleepReport
from ..node.local_engine import LocalEngine, make_engine
from . import (
    caller_files,
    containers,
    criu_credentials,
    external_files,
    image_creds,
    pod_callers,
    reopened_files,
)
from .containers import ContainerEntry
from .ownership import Caller, PodCaller, require_own_tree

log = logging.getLogger(__name__)

DEFAULT_STATE_DIR = Path("/var/lib/jupyter-gpu-snapshot")
DEFAULT_RUN_DIR = Path("/run/jupyter-gpu-snapshot")
# The manifest's section of the files dumped as external: criu's key -> path.
EXTERNAL_FILES = "external_files"
# Matched whole (fullmatch): "$" would also let a name end in a newline.
_KERNEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
# Connections one user may hold open at once: their server's and CLIs' requests, each
# save or restore for as long as it runs. Far more than any one user needs; the unit's
# LimitNOFILE= leaves room for this many from each of the node's users.
DEFAULT_MAX_CONNECTIONS = 64
# Seconds a client has, once connected, to send its request line (a client sends it at
# once); an idle connection is closed after that.
DEFAULT_REQUEST_TIMEOUT = 10.0
# Seconds a client has to read a reply before its connection is dropped.
REPLY_TIMEOUT = 60.0
# Descriptors the agent needs besides its connections (its store, criu's pipes and logs,
# worker threads' files), and the fewest users whose connections at the cap must fit.
FD_HEADROOM = 256
FEW_USERS = 8
# How often an operation whose client half-closed the connection checks that the client
# is still there to read the answer (``_client_gone``).
HANGUP_POLL_SECONDS = 0.5
# One log line per user and kind of client error in this many seconds: a client that
# floods the agent with bad connections must not flood its log too.
CLIENT_ERROR_LOG_SECONDS = 60.0
# What the launcher (root until nsinit drops to the caller) runs with: nothing of the
# caller's environment, which could name libraries for root to load (LD_PRELOAD).
_LAUNCHER_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
# What a GPU release leaves with its holder for a server that asks later (the kernel's id):
# it rides on the holder's command line, which is root's and which every user can read.
MAX_SLEEP_NOTE_BYTES = 4096


def peer_ids(sock: socket.socket) -> tuple[int, int]:
    """The uid and gid of the process at the other end of ``sock``, as the kernel says
    (``SO_PEERCRED``): one system call, for the connection count of ``_serve``."""
    _pid, uid, gid = peer_credentials(sock)
    return uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """The pid (in the agent's pid namespace), uid and gid of the process at the other
    end of ``sock`` when it connected (``SO_PEERCRED``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def pod_caller_of(pid: int, uid: int, gid: int, bundles: tuple[str, ...]) -> PodCaller:
    """The caller ``uid`` in the pod process ``pid`` runs in, as the container runtime's
    records say (``pod_callers``); a process in no pod is refused."""
    pod = pod_callers.identify(pid, bundles)
    user = caller_of(uid, gid)
    return PodCaller(user.uid, user.gid, user.groups, pod.realm_name, peer_pid=pid)


def caller_of(uid: int, gid: int) -> Caller:
    """The caller ``uid`` with their groups as the user database says now (it may ask a
    directory server: called in a thread)."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:  # a uid with no name (a container's arbitrary uid): its gid alone
        return Caller(uid, gid, frozenset({gid}), str(uid))
    groups = frozenset(os.getgrouplist(entry.pw_name, entry.pw_gid))
    return Caller(uid, entry.pw_gid, groups, entry.pw_name)


class CallerCredentials(SnapshotHook):
    """Refuses, right before criu runs, a tree or an image whose processes are not (or would
    not be) the caller's own unprivileged ones: CRIU restores credentials from the image.

    The check before a dump repeats the one ``op_save`` made before the engine's preflight,
    closer to the moment criu freezes the tree (the hook runs last); what is left of the
    window is said in ``ownership``."""

    def __init__(self, caller: Caller) -> None:
        self.caller = caller

    def _pids_of_container(self, extras: CriuExtras) -> None:
        """For a caller in a pod, criu runs in their container: it names processes by
        their pids there (``PidView``)."""
        if isinstance(self.caller, PodCaller):
            extras.pids.to_criu = functools.partial(_seen_in_container, self.caller.peer_pid)
            extras.pids.from_criu = functools.partial(_agent_task, self.caller.peer_pid)

    async def before_dump(self, ctx: SaveContext) -> None:
        self._pids_of_container(ctx.criu)
        await asyncio.to_thread(require_own_tree, ctx.root_pid, self.caller)
        # Every file of the tree dumped as external: the restore then opens none by its
        # path as root (external_files, reopened_files).
        found = await asyncio.to_thread(external_files.external_files, ctx.root_pid)
        ctx.criu.externals = sorted(found)
        ctx.manifest[EXTERNAL_FILES] = found

    async def after_dump(self, ctx: SaveContext, error: BaseException | None) -> None:
        # An image the agent could never restore is refused now, while the kernel still
        # runs (the save rolls back), not at the restore. A stopping dump has ended the
        # kernel: its image is kept, and the restore names what it cannot reopen.
        if error is None and not ctx.stop:
            try:
                await asyncio.to_thread(reopened_files.plan_openings, ctx.images_dir,
                                        ctx.manifest.get(EXTERNAL_FILES) or {})
            except InvalidRequest as refused:
                raise InvalidRequest(
                    "save", f"the node agent could not restore this kernel: {refused.cause}",
                    hint=refused.hint) from None

    async def before_restore(self, ctx: RestoreContext) -> None:
        assert ctx.images_dir is not None
        self._pids_of_container(ctx.criu)
        await asyncio.to_thread(
            image_creds.check_image_credentials, ctx.images_dir, self.caller)
        # criu, root, opens none of the paths of the caller's files: they are opened as
        # the caller and handed to it (caller_files).
        recorded = ctx.snapshot.manifest.get(EXTERNAL_FILES)
        openings = await asyncio.to_thread(
            reopened_files.plan_openings, ctx.images_dir,
            recorded if isinstance(recorded, dict) else {})
        # In a pod, each path is the caller's container's (its root, its links).
        root = (f"/proc/{self.caller.peer_pid}/root" if isinstance(self.caller, PodCaller)
                else None)
        opened = await asyncio.to_thread(
            caller_files.open_for_criu, openings, self.caller, root=root)
        for key, fd in opened.items():
            # The caller's opening stands for the file, whoever else offered one.
            replaced = ctx.criu.inherited_fds.pop(key, None)
            if replaced is not None:
                os.close(replaced)
            ctx.criu.inherited_fds[key] = fd


@dataclasses.dataclass
class Realm:
    """One user's share of the agent: their store, logs, kernels and running operations."""

    caller: Caller
    engine: LocalEngine
    checks: CallerCredentials
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

    def act_as(self, caller: Caller) -> None:
        """Give criu and the checks of the engine ``caller``'s credentials, as the user
        database says now: their gid and groups may have changed since the realm was made
        (the uid, its key, cannot). Called only while no save or restore of theirs runs."""
        self.caller = caller
        self.checks.caller = caller
        criu = self.engine.criu
        criu.dump_as = criu_credentials.dump_command(caller)
        criu.restore_as = criu_credentials.restore_command(caller)
        self.engine.store.log_owner = (caller.uid, caller.gid)
        if isinstance(caller, PodCaller):
            # criu runs in the caller's container, with the agent's own files: its loader,
            # the CUDA plugin's stand-in and its broker's socket among them.
            entry = ContainerEntry.of(caller.peer_pid)
            criu.dump_as = entry.prefix() + _through_agent_root(criu.dump_as)
            criu.restore_as = entry.prefix() + _through_agent_root(criu.restore_as)
            criu.program = ContainerEntry.program
            criu.path = containers.in_agent
            criu.path_variables = frozenset({"PATH", ENV_CUDA_BROKER})
            criu.action_scripts = False
            # The kernel listens on its container's loopback.
            self.engine.kernel_answers = functools.partial(_answers_in_pod, caller.peer_pid)

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
        realm's is the last to run an operation, whose process may be gone)."""
        asked, caller = pid, caller or self.caller
        roots = self.launched()
        if isinstance(caller, PodCaller):
            found = containers.agent_pid(pid, caller.peer_pid, containers.tree_pids(roots))
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
        return self.engine.gpu_sleep()


class NodeAgent:
    """The agent's state: settings, each user's realm, and the socket server."""

    def __init__(
        self,
        socket_path: Path = DEFAULT_SOCKET,
        state_dir: Path = DEFAULT_STATE_DIR,
        run_dir: Path = DEFAULT_RUN_DIR,
        socket_mode: int = 0o666,
        socket_group: str | None = None,
        max_operations: int = 2,
        disk_quota_bytes: int = 0,
        settings: GPUSnapshot | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        pods: bool = False,
        container_bundles: tuple[str, ...] = pod_callers.DEFAULT_BUNDLES,
    ) -> None:
        self.socket_path = socket_path
        self.state_dir = state_dir
        self.run_dir = run_dir
        self.socket_mode = socket_mode
        self.socket_group = socket_group
        self.max_operations = max_operations
        self.disk_quota_bytes = disk_quota_bytes
        self.max_connections = max_connections
        self.request_timeout = request_timeout
        self.settings = settings or GPUSnapshot()
        # Serving users' pods from the node's namespaces (a DaemonSet): callers are told
        # apart by pod, each kernel runs in its user's container (docs/cluster.md).
        self.pods = pods
        self.container_bundles = container_bundles
        # Open connections by the peer's uid, and in pods mode its pid namespace (``_serve``).
        self._connections: dict[tuple[int, int], int] = {}
        self._client_errors = _QuietLog(CLIENT_ERROR_LOG_SECONDS)
        self._realms: dict[str, Realm] = {}
        # Two first requests of one user at once must make one realm, not two (each with
        # its own count of operations).
        self._realms_lock = asyncio.Lock()
        self._server: asyncio.AbstractServer | None = None
        self._launchers: set[asyncio.Task[Any]] = set()

    def reap(self, launcher: asyncio.subprocess.Process) -> None:
        """Wait for a kernel's launcher in the background, reading what it says."""
        async def reaped() -> None:
            assert launcher.stderr is not None
            await launcher.stderr.read()
            await launcher.wait()

        task = asyncio.ensure_future(reaped())
        self._launchers.add(task)
        task.add_done_callback(self._launchers.discard)

    # -- realms ----------------------------------------------------------------------------
    async def realm(self, caller: Caller) -> Realm:
        async with self._realms_lock:
            realm = self._realms.get(caller.realm_key)
            if realm is None:
                realm = await asyncio.to_thread(self._make_realm, caller)
                self._realms[caller.realm_key] = realm
        return realm

    def _make_realm(self, caller: Caller) -> Realm:
        # A user's, by uid; or a pod's, by NAMESPACE/NAME (DNS names: no "." or "..").
        own = (Path("pods", caller.name) if isinstance(caller, PodCaller)
               else Path("users", str(caller.uid)))
        home = self.state_dir / own
        safe_fs.make_private_dirs(home)
        # The users' log directories: the parents are root's, so no user can swap one
        # for a link; each user's own directory is theirs alone. A pod mounts its own at
        # the same path, where its kernels write.
        for depth in range(1, len(own.parts) + 1):
            level = self.run_dir.joinpath(*own.parts[:depth])
            level.mkdir(parents=True, exist_ok=True, mode=0o755)
            os.chmod(level, 0o755)
        log_dir = self.run_dir / own / "logs"
        log_dir.mkdir(exist_ok=True, mode=0o700)
        if log_dir.is_symlink() or not log_dir.is_dir():
            raise SnapshotError("agent", f"{log_dir} is not a directory")
        os.chown(log_dir, caller.uid, caller.gid, follow_symlinks=False)
        os.chmod(log_dir, 0o700, follow_symlinks=False)
        settings = GPUSnapshot(
            parent=None, config=self.settings.config,
            store_dir=str(home / "snapshots"), signing_key_file=str(home / "signing.key"),
        )
        engine = make_engine(settings, kernel_log_dir=lambda: log_dir, follow_links=False)
        # Last: its check before the dump is the one nearest to criu.
        checks = CallerCredentials(caller)
        engine.hooks.append(checks)
        realm = Realm(caller, engine, checks, log_dir, home / "launched.json")
        realm.act_as(caller)
        return realm

    def require_private_state_dir(self) -> None:
        """Refuse a state directory that someone but root could change: what root restores
        and the keys it signs with live there. Its ``users`` directory is made (0700) and
        checked with every parent up to /."""
        users = self.state_dir / "users"
        safe_fs.make_private_dirs(users)
        problems = safe_fs.chain_problems(users)
        if problems:
            raise SnapshotError(
                "agent", f"the state directory {self.state_dir} is not root's alone: "
                f"{'; '.join(problems)}",
                hint="use a directory that only root can change (--state-dir), such as "
                f"the default {DEFAULT_STATE_DIR}")

    # -- the socket ------------------------------------------------------------------------
    async def start(self) -> None:
        self.require_private_state_dir()
        if self.pods and containers.join_node_cgroup_namespace():
            log.info("joined the node's cgroup namespace")
        self.socket_path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        asyncio.get_running_loop().set_exception_handler(self._on_loop_error)
        self._server = await asyncio.start_unix_server(
            self._serve, str(self.socket_path), limit=MAX_REQUEST_BYTES)
        if self.socket_group:
            os.chown(self.socket_path, -1, grp.getgrnam(self.socket_group).gr_gid)
        os.chmod(self.socket_path, self.socket_mode)
        log.info("jupyter-gpu-snapshot agent %s listening on %s (mode %o%s)%s; at most %d "
                 "connections per user, each with %g s to send its request", __version__,
                 self.socket_path, self.socket_mode,
                 f", group {self.socket_group}" if self.socket_group else "",
                 ", serving pods" if self.pods else "",
                 self.max_connections, self.request_timeout)
        self._warn_of_few_descriptors()

    def _warn_of_few_descriptors(self) -> None:
        """Say so when the descriptor limit would let a handful of users at their
        connection cap shut every other user out (systemd's default soft limit is 1,024;
        the unit sets more)."""
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        users = (soft - FD_HEADROOM) // max(self.max_connections, 1)
        if soft != resource.RLIM_INFINITY and users < FEW_USERS:
            log.warning(
                "only %d open files allowed (RLIMIT_NOFILE): %d users at their %d connections "
                "each would leave none for the others; raise it (LimitNOFILE= in the unit) or "
                "lower --max-connections", soft, max(users, 0), self.max_connections)

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """asyncio logs each failed accept with a traceback and tries again a second
        later: out of descriptors, that is a traceback a second for as long as it lasts.
        One line a minute says as much."""
        error = context.get("exception")
        if isinstance(error, OSError) and "accept" in str(context.get("message")):
            soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            self._client_errors.note(
                "the agent", "failed accepts", f"cannot accept connections: {error.strerror} "
                f"({len(self._connections)} users connected, {sum(self._connections.values())} "
                f"connections; RLIMIT_NOFILE {soft}); trying again every second",
                level=logging.WARNING)
            return
        loop.default_exception_handler(context)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    async def serve_forever(self) -> None:
        """Serve until SIGTERM (systemd's stop) or SIGINT, then close the socket. The
        kernels the agent started keep running: they are the users', not the agent's.
        The handlers are set here because a process started in the background by a shell
        inherits SIGINT ignored, and Python's default would not stop it either way."""
        await self.start()
        assert self._server is not None
        serving = asyncio.ensure_future(self._server.serve_forever())
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, serving.cancel)
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await serving
            log.info("jupyter-gpu-snapshot agent stopping")
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)
            await self.stop()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection: at most ``max_connections`` of one uid open at once, the others
        refused at once, before anything is read."""
        try:
            pid, uid, gid = peer_credentials(writer.get_extra_info("socket"))
            # Pods of one uid are different users: each is counted apart, by its pid
            # namespace (one stat, before anything is read).
            key = (uid, os.stat(f"/proc/{pid}/ns/pid").st_ino if self.pods else 0)
        except OSError:  # gone already
            writer.transport.abort()
            return
        open_now = self._connections.get(key, 0)
        if open_now >= self.max_connections:
            self._client_errors.note(f"uid {uid}", "connections over the cap", (
                f"uid {uid}: connection refused, {open_now} open already (--max-connections)"))
            _say_and_close(writer, Refused(
                "agent", f"you have {open_now} connections open with the node agent, the "
                "most it allows one user",
                hint="close the connections you no longer use, or wait for your saves and "
                "restores under way to end"))
            return
        self._connections[key] = open_now + 1
        try:
            await self._answer(reader, writer, pid, uid, gid)
        finally:
            self._connections[key] -= 1
            if not self._connections[key]:
                del self._connections[key]
            await _finish(writer)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      pid: int, uid: int, gid: int) -> None:
        """Read the request line, run it, write its answer; errors the client caused are
        answered, and logged in one short line at most (``_QuietLog``), never with a
        traceback."""
        op = "?"
        try:
            line = await self._request_line(reader)
            if not line:  # connected and closed without a word: no one to answer
                return
            op, args = _parse_request(line)
            caller: Caller = await (
                asyncio.to_thread(pod_caller_of, pid, uid, gid, self.container_bundles)
                if self.pods else asyncio.to_thread(caller_of, uid, gid))
            session = _Session(self, caller, writer)
            work = asyncio.ensure_future(session.run(op, args))
            gone = asyncio.ensure_future(_client_gone(reader, writer))
            # A client that closes its end asks the operation to stop: the engine rolls
            # back as for a Ctrl-C.
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                log.info("%s closed the connection: stopping %s", caller.name, op)
                work.cancel()
            gone.cancel()
            result = await work
            writer.write(encode({"result": result}))
        except asyncio.CancelledError:
            pass
        except InvalidRequest as exc:
            if exc.step == "agent":  # the request itself, not what it asked for
                self._client_errors.note(f"uid {uid}", "bad requests",
                                         f"uid {uid}: {exc.message}")
            writer.write(encode({"error": exc.to_dict()}))
        except SnapshotError as exc:
            writer.write(encode({"error": exc.to_dict()}))
        except Exception as exc:  # one clear message, never a dropped connection
            log.exception("agent: %s of uid %d failed", op, uid)
            writer.write(encode({"error": SnapshotError(
                "agent", f"{type(exc).__name__}: {exc}").to_dict()}))

    async def _request_line(self, reader: asyncio.StreamReader) -> bytes:
        """The request line, within ``request_timeout`` and ``MAX_REQUEST_BYTES``; b"" if
        the client closed without sending anything."""
        try:
            return await asyncio.wait_for(reader.readline(), self.request_timeout)
        except asyncio.TimeoutError:
            raise InvalidRequest(
                "agent", f"no request line within {self.request_timeout:g} s of connecting",
                hint="send the request right after connecting, as one JSON line") from None
        except ValueError:  # the StreamReader's limit: no newline in MAX_REQUEST_BYTES
            raise InvalidRequest(
                "agent", f"the request line is longer than "
                f"{format_bytes(MAX_REQUEST_BYTES)}, the most the node agent reads",
                hint="send one JSON object on one line; a launch's environment must be "
                "smaller") from None
        except (ConnectionError, OSError):
            return b""


def _parse_request(line: bytes) -> tuple[str, dict[str, Any]]:
    """The operation and arguments of a request line; InvalidRequest naming what is wrong."""
    shape = 'send {"op": NAME, "args": {...}} on one line'
    try:
        request = json.loads(line)
    except ValueError as exc:  # not UTF-8 or not JSON
        raise InvalidRequest("agent", f"the request is not JSON: {exc}", hint=shape) from None
    if not isinstance(request, dict):
        raise InvalidRequest(
            "agent", f"the request is a JSON {type(request).__name__}, not an object",
            hint=shape)
    op, args = request.get("op"), request.get("args")
    if op not in OPERATIONS:
        raise InvalidRequest("agent", f"unknown operation {op!r}",
                             hint=f"one of {', '.join(OPERATIONS)}")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise InvalidRequest("agent", f"args must be a JSON object, not {type(args).__name__}",
                             hint=f'send {{"op": "{op}", "args": {{...}}}}')
    return str(op), args


def _say_and_close(writer: asyncio.StreamWriter, error: SnapshotError) -> None:
    """One error line, then the connection closed, without waiting: a client that does not
    read it (its buffer full) is cut off rather than holding a descriptor."""
    with contextlib.suppress(OSError, ConnectionError, RuntimeError):
        writer.write(encode({"error": error.to_dict()}))
    if writer.transport.get_write_buffer_size():
        writer.transport.abort()
    else:
        writer.close()


async def _finish(writer: asyncio.StreamWriter) -> None:
    """Send what is left of the answer, within ``REPLY_TIMEOUT``, and close."""
    try:
        await asyncio.wait_for(writer.drain(), REPLY_TIMEOUT)
    except (OSError, ConnectionError, asyncio.TimeoutError):
        writer.transport.abort()
        return
    writer.close()


class _QuietLog:
    """Errors logged at most once per origin and kind every ``seconds``, with the number
    of those left unsaid since: enough to see who does what, never a line per connection
    of a client that opens thousands."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        # (who, kind) -> (when it was last logged, how many since)
        self._last: dict[tuple[str, str], tuple[float, int]] = {}

    def note(self, who: str, kind: str, line: str, level: int = logging.INFO) -> None:
        now = time.monotonic()
        last, unsaid = self._last.get((who, kind), (-self.seconds, 0))
        if now - last < self.seconds:
            self._last[(who, kind)] = (last, unsaid + 1)
            return
        self._last[(who, kind)] = (now, 0)
        if unsaid:
            line += f" ({unsaid} more {kind} of {who} unlogged before this)"
        log.log(level, "%s", line)


class _Session:
    """One request of one caller."""

    def __init__(self, agent: NodeAgent, caller: Caller, writer: asyncio.StreamWriter) -> None:
        self.agent = agent
        self.caller = caller
        self.writer = writer

    def progress(self, p: Progress) -> None:
        with contextlib.suppress(OSError, ConnectionError, RuntimeError):
            self.writer.write(encode({"progress": dataclasses.asdict(p)}))

    async def run(self, op: str, args: dict[str, Any]) -> Any:
        realm = await self.agent.realm(self.caller)
        handler: Callable[[Realm, dict[str, Any]], Any] = getattr(self, f"op_{op}")
        return await handler(realm, args)

    # -- queries ---------------------------------------------------------------------------
    async def op_hello(self, realm: Realm, args: dict[str, Any]) -> dict[str, Any]:
        used = await asyncio.to_thread(_used_bytes, realm)
        return {
            "agent_version": __version__,
            "user": {"uid": self.caller.uid, "gid": self.caller.gid, "name": self.caller.name,
                     "groups": sorted(self.caller.groups)},
            "store": str(realm.engine.store.root),
            "log_dir": str(realm.log_dir),
            "operations": list(OPERATIONS),
            "limits": {"max_operations": self.agent.max_operations,
                       "disk_quota_bytes": self.agent.disk_quota_bytes,
                       "used_bytes": used,
                       "max_connections": self.agent.max_connections},
        }

    async def op_list(self, realm: Realm, args: dict[str, Any]) -> list[dict[str, Any]]:
        found = await asyncio.to_thread(realm.engine.list, args.get("notebook_path"))
        return [snapshot_fields(s) for s in found]

    async def op_catalog(self, realm: Realm, args: dict[str, Any]) -> list[dict[str, Any]]:
        found = await asyncio.to_thread(realm.engine.catalog, args.get("notebook_path"))
        return [snapshot_fields(s) for s in found]

    async def op_get(self, realm: Realm, args: dict[str, Any]) -> dict[str, Any]:
        return snapshot_fields(await asyncio.to_thread(realm.engine.get, _text(args, "ref")))

    async def op_find_name(self, realm: Realm, args: dict[str, Any]) -> dict[str, Any] | None:
        found = await asyncio.to_thread(realm.engine.find_name, _text(args, "name"))
        return snapshot_fields(found) if found else None

    async def op_delete(self, realm: Realm, args: dict[str, Any]) -> dict[str, Any]:
        return snapshot_fields(await asyncio.to_thread(realm.engine.delete, _text(args, "ref")))

    async def op_rename(self, realm: Realm, args: dict[str, Any]) -> dict[str, Any]:
        renamed = await asyncio.to_thread(
            realm.engine.rename, _text(args, "ref"), _text(args, "name"))
        return snapshot_fields(renamed)

    async def op_usage(self, realm: Realm, args: dict[str, Any]) -> dict[str, Any]:
        found = await asyncio.to_thread(realm.engine.store_usage)
        return found.to_dict()

    async def op_store_room(self, realm: Realm, args: dict[str, Any]) -> dict[str, Any]:
        """The caller's store and the free space of its file system (the sidebar, autosave's
        disk admission)."""
        found = await asyncio.to_thread(realm.engine.store_room)
        return found.to_dict()

    async def op_gpu_choice(self, realm: Realm, args: dict[str, Any]) -> dict[str, Any]:
        """Where a restore of one of the caller's snapshots would put its GPUs, read with the
        agent's driver and inventory: the user's own process may not see them all."""
        gpus = args.get("gpus")
        if gpus is not None and (not isinstance(gpus, list)
                                 or not all(isinstance(g, str) for g in gpus)):
            raise InvalidRequest("preflight", "gpus must be a list of strings")
        snapshot = await asyncio.to_thread(realm.engine.get, _text(args, "ref"))
        snapshot.require_trusted("preflight")
        return await realm.engine.gpu_choice(snapshot, gpus)

    # -- launching -------------------------------------------------------------------------
    async def op_launch(self, realm: Realm, args: dict[str, Any]) -> dict[str, Any]:
        """Start a kernel tree for the caller: ``unshare`` and nsinit as root, then nsinit
        drops to the caller before it opens anything or runs the kernel."""
        argv = args.get("argv")
        env = args.get("env") or {}
        kernel_id = _text(args, "kernel_id")
        cwd = str(args.get("cwd") or pwd_home(self.caller))
        if (not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv)
                or not isinstance(env, dict)
                or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
            raise InvalidRequest("launch", "argv must be a list of strings and env a mapping "
                                 "of strings")
        if not _KERNEL_ID.fullmatch(kernel_id):
            raise InvalidRequest("launch", f"kernel_id {kernel_id!r} is not a plain name")
        if not os.path.isabs(cwd):
            raise InvalidRequest("launch", f"cwd {cwd!r} is not an absolute path")
        log_path = realm.log_dir / f"kernel-{kernel_id}.log"
        if isinstance(self.caller, PodCaller):
            # In the caller's container: its nsinit, named by the caller, runs as the
            # caller once the agent's own code has set up the tree (``enter_container``).
            nsinit = args.get("nsinit")
            if (not isinstance(nsinit, list) or len(nsinit) != 2
                    or not all(isinstance(p, str) and os.path.isabs(p) for p in nsinit)):
                raise InvalidRequest(
                    "launch", "this node agent starts kernels in your container: the "
                    "request must name the container's Python and nsinit.py (nsinit)",
                    hint="use the same version of jupyter_gpu_snapshot in the image")
            entry = await asyncio.to_thread(ContainerEntry.of, self.caller.peer_pid)
            command = [*entry.prefix({"log": str(log_path), "as": self.caller.id_spec,
                                      "cwd": cwd, "nsinit": nsinit}), *argv]
            script = nsinit[1]
        else:
            command = [
                shutil.which("unshare") or "unshare", "--pid", "--fork", "--",
                sys.executable, "-I", "-S", str(NSINIT), "--log", str(log_path),
                "--as", self.caller.id_spec, "--cwd", cwd, "--env-stdin", "--", *argv,
            ]
            script = str(NSINIT)
        launcher = await asyncio.create_subprocess_exec(
            *command, env=_LAUNCHER_ENV, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, start_new_session=True,
        )
        try:
            root = await self._started(launcher, env, log_path, script)
            await asyncio.to_thread(realm.remember, root)
        except BaseException:
            # A launch that does not end with its kernel recorded leaves no kernel behind,
            # whatever stopped it. Above all a client that closed the connection (this task
            # cancelled): no one learns the kernel's pid, so no one would shut it down or
            # save it, and it would hold its memory (its GPU's too) for nothing.
            if launcher.returncode is None:  # else its pid may be another's by now
                _kill_launch(launcher.pid)
            raise
        finally:
            # The launcher ends with the tree; reaped then.
            self.agent.reap(launcher)
        log.info("launched kernel %s for %s: pid %d", kernel_id, self.caller.name, root)
        return {"pid": self._seen_by_caller(root), "log_path": str(log_path)}

    def _seen_by_caller(self, pid: int) -> int:
        """Process ``pid`` of the agent's as the caller names it: in a pod, by its pid
        there."""
        if not isinstance(self.caller, PodCaller):
            return pid
        seen = containers.pid_seen_by(pid, self.caller.peer_pid)
        if seen is None:
            raise SnapshotError("agent", f"process {pid} is not in your container")
        return seen

    async def _started(self, launcher: asyncio.subprocess.Process, env: dict[str, str],
                       log_path: Path, script: str) -> int:
        """The host pid of the launched tree's namespace init, once it runs."""
        assert launcher.stdin is not None and launcher.stderr is not None
        # The kernel's environment reaches nsinit on a pipe and is applied only once it
        # runs as the caller.
        launcher.stdin.write(json.dumps(env).encode())
        await launcher.stdin.drain()
        launcher.stdin.close()
        try:
            return await asyncio.to_thread(wait_for_namespace_init, launcher.pid, script=script)
        except RuntimeError as exc:
            with contextlib.suppress(ProcessLookupError):
                launcher.kill()
            said = (await launcher.stderr.read()).decode(errors="replace").strip()[-500:]
            await launcher.wait()
            raise SnapshotError("launch", f"the kernel did not start: {said or exc}",
                                hint=f"see {log_path}") from exc

    # -- save and restore ------------------------------------------------------------------
    async def op_save(self, realm: Realm, args: dict[str, Any]) -> dict[str, Any]:
        target_fields = args.get("target")
        if not isinstance(target_fields, dict) or not isinstance(target_fields.get("pid"), int):
            raise InvalidRequest("save", "target must name the kernel's pid")
        known = {f.name for f in dataclasses.fields(SaveTarget)}
        target = SaveTarget(**{k: v for k, v in target_fields.items() if k in known})
        target.pid = await asyncio.to_thread(self._own_tree, realm, target.pid, "save")
        with self._operation(realm):
            reserved = await self._admit_under_quota(realm, target.pid)
            try:
                snapshot = await realm.engine.save(
                    target, name=args.get("name"), stop=bool(args.get("stop")),
                    progress=self.progress)
            finally:
                realm.reserved_bytes -= reserved
        return snapshot_fields(snapshot)

    async def _admit_under_quota(self, realm: Realm, root: int) -> int:
        """Refuse a save while the user's store and their saves under way take their quota
        or more; else reserve what this one may write (the tree's resident memory, which
        its image cannot exceed on the host's side) until it ends, and return that.

        One check at a time per user: of two saves asked for at once, the second counts
        the first's reservation. A save admitted may still end above the quota."""
        quota = self.agent.disk_quota_bytes
        if not quota:
            return 0
        async with realm.quota_lock:
            used = await asyncio.to_thread(_used_bytes, realm)
            pending = realm.reserved_bytes
            if used + pending >= quota:
                under_way = (f" and your saves under way up to {format_bytes(pending)} more"
                             if pending else "")
                raise Refused(
                    "preflight", f"your snapshots use {format_bytes(used)}{under_way}, of "
                    f"your {format_bytes(quota)}",
                    hint="delete snapshots you no longer need (jupyter gpu-snapshot rm "
                    "NAME)" + (", or wait for your saves under way to end" if pending else ""))
            estimate = await asyncio.to_thread(procfs.tree_rss, root)
            realm.reserved_bytes += estimate
            return estimate

    async def op_restore(self, realm: Realm, args: dict[str, Any]) -> dict[str, Any]:
        gpus = args.get("gpus")
        with self._operation(realm):
            restored = await realm.engine.restore(_text(args, "ref"), self.progress, gpus)
        await asyncio.to_thread(realm.remember, restored.pid)
        return {
            "pid": self._seen_by_caller(restored.pid),
            "connection_info": restored.connection_info,
            "snapshot": snapshot_fields(restored.snapshot),
            "timings": restored.timings,
            "notes": restored.notes,
        }

    def _own_tree(self, realm: Realm, pid: int, step: str) -> int:
        """The root of the tree of process ``pid``, refused unless the agent launched or
        restored it for the caller and every process of it is their own (``ownership``)."""
        root = realm.root_of(pid, step, self.caller)
        require_own_tree(root, self.caller, step)
        return root

    # -- hibernation's gpu tier ------------------------------------------------------------
    async def op_gpu_release(self, realm: Realm, args: dict[str, Any]) -> dict[str, Any]:
        """Give back the GPU of one of the caller's kernels and keep its process: a failure
        leaves it running with CUDA unlocked (``GpuSleep.release``).

        Between the ownership check and the holder's stop, a process of the tree could still
        exec a setuid program (see ``ownership``); the holder would then stop it, and the
        driver move its GPU memory into its own host memory: none of it reaches the caller."""
        note = _sleep_note(args)
        report = await self._on_own_kernel(
            realm, _pid(args), "release the GPU", lambda sleep, root: sleep.release(root, note))
        return report.to_dict()

    async def op_gpu_wake(self, realm: Realm, args: dict[str, Any]) -> dict[str, Any]:
        """Give the kernel its GPU back and let its threads run; a failure leaves it asleep
        (``GpuSleep.wake``)."""
        report = await self._on_own_kernel(
            realm, _pid(args), "wake", lambda sleep, root: sleep.wake(root))
        return report.to_dict()

    async def op_gpu_asleep(self, realm: Realm, args: dict[str, Any]) -> dict[str, Any] | None:
        """The holder's status (its note among it) while the kernel sleeps, else None."""
        pid = _pid(args)
        try:
            root = await asyncio.to_thread(self._own_tree, realm, pid, "hibernate")
            sleep = await asyncio.to_thread(realm.gpu_sleep)
        except (Refused, NotReady):
            # Another's tree tells the caller nothing; and without a driver the agent
            # released no GPU.
            return None
        return await asyncio.to_thread(sleep.asleep, root)

    async def _on_own_kernel(self, realm: Realm, pid: int, step: str,
                             act: Callable[[GpuSleep, int], SleepReport]) -> SleepReport:
        """``act`` on the caller's kernel tree of ``pid``, counted among their operations,
        holding the kernel's lock (the one its saves take). It runs in a worker thread,
        which cannot be stopped: a client that goes away gets no answer, but the lock and
        the count hold until the thread has ended."""
        if isinstance(self.caller, PodCaller):
            raise Refused(
                step, "this node agent does not yet release or give back the GPU of a "
                "kernel in a pod", hint="hibernate to the process tier (its snapshot) instead")
        root = await asyncio.to_thread(self._own_tree, realm, pid, step)

        def locked() -> SleepReport:
            with realm.engine.store.locks.hold(locks.kernel_key(root), f"kernel pid {root}",
                                               step, note=f"{step} of kernel pid {root}"):
                return act(realm.gpu_sleep(), root)

        with self._operation(realm):
            # Nothing waits for the event: the thread runs to its end whatever is asked.
            return await finish_despite_cancel(
                asyncio.ensure_future(asyncio.to_thread(locked)), asyncio.Event())

    @contextlib.contextmanager
    def _operation(self, realm: Realm) -> Any:
        """One of the caller's at most ``max_operations`` saves, restores, GPU releases or
        wakes at once, run with this connection's credentials (``Realm.act_as``)."""
        if realm.operations and realm.caller != self.caller:
            # The engine has one set of credentials at a time, those of the operations
            # under way: this request's differ (the user database changed in between).
            raise Refused(
                "preflight", "your groups changed while a snapshot operation of yours was "
                "under way", hint="wait for it to end, then ask again")
        if realm.operations >= self.agent.max_operations:
            raise Refused(
                "preflight", f"you already have {realm.operations} snapshot operations "
                f"under way, the most this node allows one user",
                hint="wait for one to end, then ask again")
        realm.act_as(self.caller)
        realm.operations += 1
        try:
            yield
        finally:
            realm.operations -= 1


async def _client_gone(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Returns once no one is left to read the answer; what the client sends after its
    request line is read and ignored.

    The end of what the client sends (EOF) is not enough: a client may shut down only its
    writing side once it has sent its request (``shutdown(SHUT_WR)``, ``nc -N``) and still
    wait for the answer. So after EOF the socket itself is asked: a Unix socket reports
    POLLHUP once the peer has shut down both sides or closed it (Linux sets POLLHUP when
    both directions are shut, POLLRDHUP alone for a half-close), and POLLERR on a reset. A
    write that failed (a progress report to a closed socket) closes the transport, which
    counts too. Polled every ``HANGUP_POLL_SECONDS``, only while such a client's operation
    runs: the event loop's own selector would report the readable EOF without end."""
    with contextlib.suppress(ConnectionError, OSError):
        while await reader.read(1 << 16):
            pass
    sock = writer.get_extra_info("socket")
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLHUP)
    while not writer.transport.is_closing():
        if any(events & (select.POLLHUP | select.POLLERR | select.POLLNVAL)
               for _fd, events in poller.poll(0)):
            return
        await asyncio.sleep(HANGUP_POLL_SECONDS)


def _through_agent_root(prefix: list[str]) -> list[str]:
    """A command prefix of the agent's programs (setpriv), run in a user's container with
    the agent's own loader and files (``ContainerEntry.program``)."""
    return [*ContainerEntry.program(prefix[0]), *prefix[1:]] if prefix else []


async def _answers_in_pod(peer_pid: int, connection_info: dict[str, Any],
                          timeout: float) -> bool:
    """Whether the kernel at ``connection_info`` answers, asked from the network of
    process ``peer_pid``'s container."""
    return await containers.in_network_of(
        peer_pid, lambda: asyncio.run(kernel_answers(connection_info, timeout)))


def _seen_in_container(peer_pid: int, pid: int) -> int:
    """Process ``pid`` of the agent's by its pid in process ``peer_pid``'s container."""
    seen = containers.pid_seen_by(pid, peer_pid)
    if seen is None:
        raise Refused("save", f"process {pid} is not in your container")
    return seen


def _agent_task(peer_pid: int, seen: int) -> int:
    """Our pid of what criu, in process ``peer_pid``'s container, calls ``seen``."""
    found = containers.agent_task(seen, peer_pid)
    if found is None:
        raise SnapshotError("restore", f"process {seen} of your container is not found")
    return found


def _kill_launch(launcher_pid: int) -> None:
    """SIGKILL a launcher and the tree under it. The launcher is stopped first, so that it
    forks nothing once its children are listed; its child is the namespace's init, whose
    death takes every process of the namespace with it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(launcher_pid, signal.SIGSTOP)
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(launcher_pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    with contextlib.suppress(ProcessLookupError):
        os.kill(launcher_pid, signal.SIGKILL)


def pwd_home(caller: Caller) -> str:
    try:
        return pwd.getpwuid(caller.uid).pw_dir
    except KeyError:
        return "/"


def _text(args: dict[str, Any], key: str) -> str:
    value = args.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidRequest("agent", f"{key} must be a non-empty string")
    return value


def _pid(args: dict[str, Any]) -> int:
    value = args.get("pid")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidRequest("agent", "pid must be the kernel's process id, a positive integer")
    return value


def _sleep_note(args: dict[str, Any]) -> dict[str, Any]:
    note = args.get("note") or {}
    if not isinstance(note, dict) or len(json.dumps(note)) > MAX_SLEEP_NOTE_BYTES:
        raise InvalidRequest("agent", f"note must be a JSON object of at most "
                             f"{format_bytes(MAX_SLEEP_NOTE_BYTES)}")
    return note


def _used_bytes(realm: Realm) -> int:
    """The bytes the user's store takes on disk: ``StoreUsage.disk_bytes`` already counts
    the page packs (``chunks_bytes`` is their share of it)."""
    return realm.engine.store_usage().disk_bytes


__all__ = ["NodeAgent", "caller_of", "peer_ids"]
