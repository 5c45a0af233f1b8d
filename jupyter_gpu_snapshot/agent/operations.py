"""What the node agent does for a caller: one handler per operation of the protocol
(``agent_client/protocol.OPERATIONS``), each ``op_NAME`` of a ``Session``.

- queries of the caller's store: ``hello``, ``list``, ``catalog``, ``get``, ``find_name``,
  ``delete``, ``rename``, ``usage``, ``store_room``, ``gpu_choice``;
- ``launch`` (``launching``);
- ``save`` and ``restore``, each with an engine built for the caller as they are now
  (``Realm.engine_for``), under the quota;
- hibernation's gpu tier: ``gpu_release`` gives back the GPU of one of the caller's
  kernels and keeps its process, ``gpu_wake`` brings it back, ``gpu_asleep`` says whether
  it sleeps (``gpu/sleep.py``), with the GPU sleep of the realm's CUDA hook; the holder
  it starts runs as root, in its own session, and outlives the request and the agent,
  which finds it again by the kernel's root pid.

Limits: at most ``max_operations`` saves, restores, GPU releases or wakes of one user at
once, one at a time per kernel, and no save while their store and their saves under way
take ``disk_quota_bytes`` or more.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from .._constants import format_bytes
from .._version import __version__
from ..agent_client.protocol import OPERATIONS, Refused, encode, snapshot_fields
from ..core import locks, procfs
from ..core.errors import InvalidRequest, NotReady, SnapshotError
from ..core.hooks import Progress, SaveTarget
from ..core.sequences import finish_despite_cancel
from ..node.gpus import GpuSleep, SleepReport
from . import launching, requests, workers
from .credentials.ownership import Caller, PodCaller, require_own_tree
from .pods import pids
from .pods.entry_program import start_ticks
from .realms import Realm
from .recovery import SAVES_FILE, SavesUnderWay

# What reaches into a pod caller's container through the process that connected.
PEER_OPERATIONS = frozenset({"launch", "save", "restore", "gpu_release", "gpu_wake",
                             "gpu_asleep"})
# What a GPU release leaves with its holder for a server that asks later (the kernel's id):
# it rides on the holder's command line, which is root's and which every user can read.
MAX_SLEEP_NOTE_BYTES = 4096


class Agent(Protocol):
    """What a session uses of the agent that serves it (``server.NodeAgent``)."""

    max_operations: int
    disk_quota_bytes: int
    max_connections: int

    async def realm(self, caller: Caller) -> Realm: ...

    def reap(self, launcher: asyncio.subprocess.Process) -> None: ...


class Session:
    """One request of one caller: ``run`` calls the handler of its operation, ``op_NAME``
    (``server.NodeAgent`` makes one per request line)."""

    def __init__(self, agent: Agent, caller: Caller, writer: asyncio.StreamWriter) -> None:
        self.agent = agent
        self.caller = caller
        self.writer = writer

    def progress(self, p: Progress) -> None:
        with contextlib.suppress(OSError, ConnectionError, RuntimeError):
            self.writer.write(encode({"progress": dataclasses.asdict(p)}))

    async def run(self, op: str, args: dict[str, Any]) -> Any:
        # Every field of its kind before anything is done for the request.
        requests.check(op, args)
        if op in PEER_OPERATIONS:
            await asyncio.to_thread(self._require_peer)
        realm = await self.agent.realm(self.caller)
        handler: Callable[[Realm, dict[str, Any]], Any] = getattr(self, f"op_{op}")
        # Its blocking steps in the caller's share of the agent's threads.
        with workers.serve_realm(realm.workers):
            return await handler(realm, args)

    def _require_peer(self) -> None:
        """In a pod, the operations that reach into the caller's container go through the
        process that connected: refused once that process has ended (its pid may be
        another's by then; ``pods/entry`` checks again where it enters)."""
        caller = self.caller
        if not isinstance(caller, PodCaller) or not caller.peer_start:
            return
        try:
            same = start_ticks(caller.peer_pid) == caller.peer_start
        except (OSError, ValueError):
            same = False
        if not same:
            raise Refused("agent", f"the process that connected (pid {caller.peer_pid}) has "
                          "ended", hint="ask from a process that stays until the answer comes")

    # -- queries ---------------------------------------------------------------------------
    async def op_hello(self, realm: Realm, args: dict[str, Any]) -> dict[str, Any]:
        used = await asyncio.to_thread(_used_bytes, realm)
        return {
            "agent_version": __version__,
            "user": {"uid": self.caller.uid, "gid": self.caller.gid, "name": self.caller.name,
                     "groups": sorted(self.caller.groups)},
            "store": str(realm.shared.store.root),
            "log_dir": str(realm.log_dir),
            "operations": list(OPERATIONS),
            "limits": {"max_operations": self.agent.max_operations,
                       "disk_quota_bytes": self.agent.disk_quota_bytes,
                       "used_bytes": used,
                       "max_connections": self.agent.max_connections},
        }

    async def op_list(self, realm: Realm, args: dict[str, Any]) -> list[dict[str, Any]]:
        found = await asyncio.to_thread(realm.shared.list, args.get("notebook_path"))
        return [snapshot_fields(s) for s in found]

    async def op_catalog(self, realm: Realm, args: dict[str, Any]) -> list[dict[str, Any]]:
        found = await asyncio.to_thread(realm.shared.catalog, args.get("notebook_path"))
        return [snapshot_fields(s) for s in found]

    async def op_get(self, realm: Realm, args: dict[str, Any]) -> dict[str, Any]:
        return snapshot_fields(await asyncio.to_thread(realm.shared.get, _text(args, "ref")))

    async def op_find_name(self, realm: Realm, args: dict[str, Any]) -> dict[str, Any] | None:
        found = await asyncio.to_thread(realm.shared.find_name, _text(args, "name"))
        return snapshot_fields(found) if found else None

    async def op_delete(self, realm: Realm, args: dict[str, Any]) -> dict[str, Any]:
        return snapshot_fields(await asyncio.to_thread(realm.shared.delete, _text(args, "ref")))

    async def op_rename(self, realm: Realm, args: dict[str, Any]) -> dict[str, Any]:
        renamed = await asyncio.to_thread(
            realm.shared.rename, _text(args, "ref"), _text(args, "name"))
        return snapshot_fields(renamed)

    async def op_usage(self, realm: Realm, args: dict[str, Any]) -> dict[str, Any]:
        found = await asyncio.to_thread(realm.shared.store_usage)
        return found.to_dict()

    async def op_store_room(self, realm: Realm, args: dict[str, Any]) -> dict[str, Any]:
        """The caller's store and the free space of its file system (the sidebar, autosave's
        disk admission)."""
        found = await asyncio.to_thread(realm.shared.store_room)
        return found.to_dict()

    async def op_gpu_choice(self, realm: Realm, args: dict[str, Any]) -> dict[str, Any]:
        """Where a restore of one of the caller's snapshots would put its GPUs, read with the
        agent's driver and inventory: the user's own process may not see them all."""
        gpus = args.get("gpus")
        if gpus is not None and (not isinstance(gpus, list)
                                 or not all(isinstance(g, str) for g in gpus)):
            raise InvalidRequest("preflight", "gpus must be a list of strings")
        snapshot = await asyncio.to_thread(realm.shared.get, _text(args, "ref"))
        snapshot.require_trusted("preflight")
        return await realm.shared.gpu_choice(snapshot, gpus)

    # -- launching -------------------------------------------------------------------------
    async def op_launch(self, realm: Realm, args: dict[str, Any]) -> dict[str, Any]:
        """Start a kernel tree for the caller (``launching``)."""
        root, log_path = await launching.launch_kernel(
            self.caller, realm, _text(args, "kernel_id"), args, self.agent.reap)
        return {"pid": self._seen_by_caller(root), "log_path": str(log_path)}

    def _seen_by_caller(self, pid: int) -> int:
        """Process ``pid`` of the agent's as the caller names it: in a pod, by its pid
        there."""
        if not isinstance(self.caller, PodCaller):
            return pid
        seen = pids.pid_seen_by(pid, self.caller.peer_pid)
        if seen is None:
            raise SnapshotError("agent", f"process {pid} is not in your container")
        return seen

    # -- save and restore ------------------------------------------------------------------
    async def op_save(self, realm: Realm, args: dict[str, Any]) -> dict[str, Any]:
        target_fields = args.get("target")
        if not isinstance(target_fields, dict) or not isinstance(target_fields.get("pid"), int):
            raise InvalidRequest("save", "target must name the kernel's pid")
        known = {f.name for f in dataclasses.fields(SaveTarget)}
        target = SaveTarget(**{k: v for k, v in target_fields.items() if k in known})
        target.pid = await asyncio.to_thread(self._own_tree, realm, target.pid, "save")
        stop = bool(args.get("stop"))
        # Noted until it ends, so that an agent killed meanwhile names its kernel at its
        # next start (``recovery``).
        saves = SavesUnderWay(realm.state_home / SAVES_FILE)
        under_way = await asyncio.to_thread(saves.begin, target.pid, target.kernel_id, stop)
        try:
            return await self._save(realm, target, args.get("name"), stop)
        finally:
            await asyncio.to_thread(saves.end, under_way)

    async def _save(self, realm: Realm, target: SaveTarget, name: str | None,
                    stop: bool) -> dict[str, Any]:
        with self._operation(realm):
            engine = await asyncio.to_thread(realm.engine_for, self.caller)
            try:
                reserved = await self._admit_under_quota(realm, target.pid)
                try:
                    snapshot = await engine.save(target, name=name, stop=stop,
                                                 progress=self.progress)
                finally:
                    realm.reserved_bytes -= reserved
            finally:
                await asyncio.to_thread(engine.files.close)
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
            engine = await asyncio.to_thread(realm.engine_for, self.caller)
            try:
                restored = await engine.restore(_text(args, "ref"), self.progress, gpus)
            finally:
                await asyncio.to_thread(engine.files.close)
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
            with realm.shared.store.locks.hold(locks.kernel_key(root), f"kernel pid {root}",
                                               step, note=f"{step} of kernel pid {root}"):
                return act(realm.gpu_sleep(), root)

        with self._operation(realm):
            # Nothing waits for the event: the thread runs to its end whatever is asked.
            return await finish_despite_cancel(
                asyncio.ensure_future(asyncio.to_thread(locked)), asyncio.Event())

    @contextlib.contextmanager
    def _operation(self, realm: Realm) -> Iterator[None]:
        """One of the caller's at most ``max_operations`` saves, restores, GPU releases or
        wakes at once. Each runs an engine of its own, built for this connection's caller
        (``Realm.engine_for``): two of one user's operations never share credentials."""
        if realm.operations >= self.agent.max_operations:
            raise Refused(
                "preflight", f"you already have {realm.operations} snapshot operations "
                f"under way, the most this node allows one user",
                hint="wait for one to end, then ask again")
        realm.operations += 1
        try:
            yield
        finally:
            realm.operations -= 1


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
    return realm.shared.store_usage().disk_bytes
