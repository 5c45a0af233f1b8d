"""The node agent: ``jupyter gpu-snapshot agent``, run by root once per node.

It listens on a Unix socket and serves unprivileged users' servers, CLIs and magics. Each
connection's caller is the uid the kernel reports for the peer (``SO_PEERCRED``), their
groups the user database's. Every caller gets a realm of their own (``realms``): a store
and a signing key, both root's alone, so that the caller can neither write an image root
will restore nor sign one; a log directory of theirs, where the kernels the agent launches
for them write; and the kernels the agent launched or restored for them.

With ``pods`` (``--pods``: a Kubernetes DaemonSet in the node's pid namespace) the callers
are processes in users' pods, and the pod, as the container runtime reports it
(``pods/identity``), tells them apart, whatever their uid; the agent launches, saves and
restores each kernel inside the caller's container (``pods/entry``), and pids in requests
and answers are the container's.

What each operation does and checks is in ``operations``; what a tree must be to be
dumped (or to have its GPU released) is in ``credentials/ownership``, what an image must
be to be restored in ``credentials/in_images``, and how the kernel's files cross the
privilege line in ``files``. Limits, here: at most ``max_connections`` connections of one
user open at once, each sending its request within ``request_timeout`` seconds and
``MAX_REQUEST_BYTES``, so that no user can take the agent's file descriptors or memory
from the others; and in ``operations``: at most ``max_operations`` saves, restores, GPU
releases or wakes of one user at once, one at a time per kernel, and no save while their
store and their saves under way take ``disk_quota_bytes`` or more.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import grp
import logging
import os
import resource
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any

from .._constants import format_bytes
from .._version import __version__
from ..agent_client.protocol import DEFAULT_SOCKET, MAX_REQUEST_BYTES, Refused, encode
from ..config import GPUSnapshot
from ..core import safe_fs
from ..core.errors import Busy, InvalidRequest, SnapshotError
from ..core.recovery import clean_work_dirs
from . import recovery, workers
from .connections import (
    Peer,
    QuietLog,
    client_gone,
    finish,
    parse_request,
    say_and_close,
)
from .credentials.ownership import Caller
from .operations import Session
from .pods import identity
from .pods.entry import join_node_cgroup_namespace
from .realms import Realm, caller_of, make_realm, pod_caller_of

log = logging.getLogger(__name__)

DEFAULT_STATE_DIR = Path("/var/lib/jupyter-gpu-snapshot")
DEFAULT_RUN_DIR = Path("/run/jupyter-gpu-snapshot")
# Connections one user may hold open at once: their server's and CLIs' requests, each
# save or restore for as long as it runs. Far more than any one user needs; the unit's
# LimitNOFILE= leaves room for this many from each of the node's users.
DEFAULT_MAX_CONNECTIONS = 64
# Seconds a client has, once connected, to send its request line (a client sends it at
# once); an idle connection is closed after that.
DEFAULT_REQUEST_TIMEOUT = 10.0
# Descriptors the agent needs besides its connections (its store, criu's pipes and logs,
# worker threads' files), and the fewest users whose connections at the cap must fit.
FD_HEADROOM = 256
FEW_USERS = 8
# One log line per user and kind of client error in this many seconds: a client that
# floods the agent with bad connections must not flood its log too.
CLIENT_ERROR_LOG_SECONDS = 60.0
# Seconds the agent's stop waits for the operations under way to roll back once told to
# stop; one that is not done by then is left (criu runs on in its own session, and the
# next start recovers what it leaves). systemd gives a unit 90 s to stop.
STOP_GRACE_SECONDS = 20.0


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
        container_bundles: tuple[str, ...] = identity.DEFAULT_BUNDLES,
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
        # Open connections by whose they are (``_count_key``): a uid's, or a pod's.
        self._connections: dict[tuple[str, str], int] = {}
        self._client_errors = QuietLog(CLIENT_ERROR_LOG_SECONDS)
        self._realms: dict[str, Realm] = {}
        # Two first requests of one user at once must make one realm, not two (each with
        # its own count of operations).
        self._realms_lock = asyncio.Lock()
        self._server: asyncio.AbstractServer | None = None
        self._launchers: set[asyncio.Task[Any]] = set()
        # Each realm found at the start, by key, recovered before it serves (``recovery``).
        self._recoveries: dict[str, asyncio.Future[Any]] = {}
        # The connections being served and their operations, which the stop ends.
        self._serving: set[asyncio.Task[Any]] = set()
        self._router: workers.Router | None = None

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
        await self._recovered(caller.realm_key)
        async with self._realms_lock:
            realm = self._realms.get(caller.realm_key)
            if realm is None:
                realm = await asyncio.to_thread(make_realm, caller, self.state_dir,
                                                self.run_dir, self.settings)
                self._realms[caller.realm_key] = realm
        return realm

    def private_temp_dir(self) -> Path:
        """``RUN/tmp``, made root's alone (0700) and checked with every parent up to /."""
        directory = self.run_dir / "tmp"
        # The run directory holds the users' log directories too: they pass through it.
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
        safe_fs.make_private_dirs(directory)
        problems = safe_fs.chain_problems(directory)
        if problems:
            raise SnapshotError(
                "agent", f"the run directory {self.run_dir} is not root's alone: "
                f"{'; '.join(problems)}",
                hint="use a directory that only root can change (--run-dir), such as "
                f"the default {DEFAULT_RUN_DIR}")
        return directory

    async def _start_recovery(self) -> None:
        """criu's work directories that the agent's earlier life left are removed now,
        before the agent serves: only those in its own temporary directory (``RUN/tmp``,
        root's alone), where it makes them; root never looks into /tmp or /dev/shm, where
        every user writes. Then each realm's store is recovered in the background, the
        agent serving meanwhile: a realm serves its first request once its own is done
        (``_recovered``)."""
        removed = await asyncio.to_thread(clean_work_dirs, Path(tempfile.gettempdir()))
        if removed:
            log.info("removed criu's work directories of saves and restores that ended "
                     "with the agent: %s", ", ".join(str(p) for p in removed))
        homes = await asyncio.to_thread(recovery.realm_homes, self.state_dir, self.run_dir)
        for home in homes:
            self._recoveries[home.key] = asyncio.ensure_future(
                asyncio.to_thread(recovery.recover_realm, home, self.settings))

    async def _recovered(self, key: str) -> None:
        """Wait for the recovery of realm ``key``'s store, if it had one to do; a recovery
        that failed is logged, and the realm serves all the same."""
        recovering = self._recoveries.get(key)
        if recovering is None:
            return
        try:
            await asyncio.shield(recovering)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("the recovery of realm %s failed; it serves all the same", key)
        self._recoveries.pop(key, None)

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
    def _use_workers(self) -> None:
        """Each realm's blocking steps in a share of the threads of its own (``workers``),
        from the agent's first step on: the loop's default executor, set once."""
        if self._router is None:
            self._router = workers.Router()
            asyncio.get_running_loop().set_default_executor(self._router)

    async def start(self) -> None:
        self.require_private_state_dir()
        if self.pods and join_node_cgroup_namespace():
            log.info("joined the node's cgroup namespace")
        self._use_workers()
        await self._start_recovery()
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

    async def stop(self) -> int:
        """Stop listening, ask every operation under way to stop (each rolls back as for a
        client that went away) and wait for them ``STOP_GRACE_SECONDS`` at most; the number
        of those still under way then, which the agent leaves: a hung one never holds the
        stop."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        for recovering in self._recoveries.values():
            recovering.cancel()
        serving = set(self._serving)
        for task in serving:
            task.cancel()
        if not serving:
            return 0
        _done, left = await asyncio.wait(serving, timeout=STOP_GRACE_SECONDS)
        if left:
            log.warning("stopping with %d operations still under way after %.0f s; the next "
                        "start recovers what they leave", len(left), STOP_GRACE_SECONDS)
        return len(left)

    async def serve_forever(self) -> int:
        """Serve until SIGTERM (systemd's stop) or SIGINT, then close the socket and stop
        (``stop``): the number of operations left under way. The kernels the agent started
        keep running: they are the users', not the agent's. The handlers are set here
        because a process started in the background by a shell inherits SIGINT ignored,
        and Python's default would not stop it either way.

        The agent's process serves only this: its temporary files (criu's work
        directories, the CUDA broker's and the GPU holders' sockets) go into ``RUN/tmp``,
        root's alone, never into the /tmp every user may write."""
        self._use_workers()
        await asyncio.to_thread(self.require_private_state_dir)
        tempfile.tempdir = str(await asyncio.to_thread(self.private_temp_dir))
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
            left = await self.stop()
        return left

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection: at most ``max_connections`` of one user open at once, the others
        refused at once, before anything is read. Whose it is is fixed here, at accept: its
        peer's process as it is now (``Peer``), and in a pod, the pod, identified from that
        process while it is known to be the one that connected."""
        task = asyncio.current_task()
        assert task is not None
        self._serving.add(task)
        try:
            peer = Peer.of(writer.get_extra_info("socket"), in_pod=self.pods)
        except OSError as exc:
            self._serving.discard(task)
            if exc.errno not in (errno.EMFILE, errno.ENFILE):  # gone already
                writer.transport.abort()
                return
            # No descriptor left for the peer's pidfd: said, as a refusal over the cap is.
            self._client_errors.note("the agent", "descriptors used up", (
                f"connection refused: no descriptor left for its pidfd ({exc})"))
            say_and_close(writer, Busy(
                "agent", "the node agent has no descriptor left to take your connection",
                hint="try again once connections under way end"))
            return
        try:
            key = self._count_key(peer)
            open_now = self._connections.get(key, 0)
            if open_now >= self.max_connections:
                self._client_errors.note(key[1], "connections over the cap", (
                    f"{key[1]}: connection refused, {open_now} open already "
                    "(--max-connections)"))
                say_and_close(writer, Refused(
                    "agent", f"you have {open_now} connections open with the node agent, "
                    f"the most it allows one {'pod' if key[0] == 'pod' else 'user'}",
                    hint="close the connections you no longer use, or wait for your saves "
                    "and restores under way to end"))
                return
            self._connections[key] = open_now + 1
            try:
                await self._answer(reader, writer, peer)
            finally:
                self._connections[key] -= 1
                if not self._connections[key]:
                    del self._connections[key]
                await finish(writer)
        finally:
            peer.close()
            self._serving.discard(task)

    def _count_key(self, peer: Peer) -> tuple[str, str]:
        """Whose connections this one counts among: in a pod, the pod's (its container, as
        its cgroup names it, read while the pidfd says the process that connected is
        still the one at its pid); else, and for a process in no container, its uid's.
        A process cannot leave its container's cgroup, nor count apart by making pid
        namespaces of its own (``unshare -Urpf``)."""
        if self.pods:
            with contextlib.suppress(SnapshotError, OSError):
                container = identity.container_id_of(peer.pid)
                if peer.pidfd is None or identity.pid_of(peer.pidfd) == peer.pid:
                    return ("pod", f"container {container}")
        return ("uid", f"uid {peer.uid}")

    async def _caller(self, peer: Peer) -> Caller:
        """The caller at the other end: their groups as the user database says now and, in
        a pod, the pod as the runtime's records say, read through the connection's own
        pidfd of its peer; the pidfd is closed then."""
        def identify() -> Caller:
            try:
                if not self.pods:
                    return caller_of(peer.uid, peer.gid)
                with peer.pidfd_in_use() as pidfd:
                    if pidfd is None:  # the connection ended first
                        raise SnapshotError("agent", "the connection has ended")
                    return pod_caller_of(peer.pid, peer.uid, peer.gid,
                                         self.container_bundles, pidfd, peer.start)
            finally:
                peer.close()

        return await asyncio.to_thread(identify)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      peer: Peer) -> None:
        """Read the request line, run it, write its answer; errors the client caused are
        answered, and logged in one short line at most (``QuietLog``), never with a
        traceback. Who the caller is is read meanwhile, from the peer as it was when the
        agent accepted the connection."""
        op, uid = "?", peer.uid
        identifying = asyncio.ensure_future(self._caller(peer))
        work: asyncio.Future[Any] | None = None
        try:
            line = await self._request_line(reader)
            if not line:  # connected and closed without a word: no one to answer
                return
            op, args = parse_request(line)
            caller = await identifying
            session = Session(self, caller, writer)
            work = asyncio.ensure_future(session.run(op, args))
            gone = asyncio.ensure_future(client_gone(reader, writer))
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
            # The agent stops: the operation is asked to stop too, and waited for (the
            # stop waits a while for it, then leaves it).
            if work is not None and not work.done():
                work.cancel()
                with contextlib.suppress(BaseException):
                    await work
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
        finally:
            if not identifying.done():
                identifying.cancel()
            elif not identifying.cancelled():
                identifying.exception()  # read: a caller refused unasked is no loop error

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


def run(agent: NodeAgent) -> None:
    """Serve with ``agent`` in this process until it is told to stop (``cmd_agent``).

    Not ``asyncio.run``, which waits for every task and every thread it cancels: an
    operation that hangs on a user's behalf (a thread in a hung file system, criu that never
    ends) would hold the stop for good. What is still under way once ``NodeAgent.stop``
    gave up on it is left, and the process ends without waiting for it."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    left = 0
    try:
        left = loop.run_until_complete(agent.serve_forever())
        pending = asyncio.all_tasks(loop)
        for task in pending:  # launchers' reaping, and the like: they end when cancelled
            task.cancel()
        if pending:
            _done, still = loop.run_until_complete(asyncio.wait(pending, timeout=5))
            left += len(still)
    except KeyboardInterrupt:
        pass
    hung = [t for t in threading.enumerate()
            if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if left or hung:
        logging.shutdown()
        os._exit(0)
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


__all__ = ["DEFAULT_MAX_CONNECTIONS", "DEFAULT_REQUEST_TIMEOUT", "DEFAULT_RUN_DIR",
           "DEFAULT_STATE_DIR", "NodeAgent", "run"]
