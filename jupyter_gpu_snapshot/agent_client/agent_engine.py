"""The engine of an unprivileged process: ``node.engine.NodeEngine``, carried out by the
node agent.

The user's server and CLI hold this instead of a local engine when they go through the
agent (``GPUSnapshot.through_agent``). Snapshots live in the agent's store for the user, and
every question about them (their room, where a restore would put the GPUs) is the agent's
to answer; ``own_dir`` is the user's own directory for what the server keeps beside its
snapshots (the notebooks' autosave choices).
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ..core.errors import InvalidRequest
from ..core.hooks import ProgressCallback, SaveTarget
from ..core.restore import RestoredKernel
from ..core.save import connection_info_json
from ..core.store import Snapshot
from .client import AgentClient
from .protocol import snapshot_from

# The usage count needs numpy; its reports are imported by the calls that return them.
if TYPE_CHECKING:
    from ..core.store import StoreRoom, StoreUsage

SleeperT = TypeVar("SleeperT")


class AgentEngine(Generic[SleeperT]):
    """Saves and restores through the node agent; queries ask it too.

    ``gpu_sleeper`` makes hibernation's gpu tier for this client (``gpu_sleep.AgentGpuSleep``
    with the GPU layer's report and inventory readers, which this package does not import).
    """

    def __init__(self, client: AgentClient, own_dir: Path,
                 gpu_sleeper: Callable[[AgentClient], SleeperT]) -> None:
        self.client = client
        self._own_dir = own_dir
        self._gpu_sleeper = gpu_sleeper

    @property
    def location(self) -> str:
        return f"the node agent's store for you ({self.client.socket_path})"

    @property
    def local_store(self) -> None:
        """The agent holds the store: it recovers it and keeps its cache itself."""
        return None

    @property
    def own_dir(self) -> Path:
        return self._own_dir

    def store_room(self) -> StoreRoom:
        from ..core.store import StoreRoom

        found = self.client.call_sync("store_room")
        free = found.get("free_bytes")
        return StoreRoom(str(found["path"]), int(free) if free is not None else None)

    def trust(self, ref: str) -> Snapshot:
        raise InvalidRequest(
            "trust", "the node agent restores only the snapshots it signed itself",
            hint="a snapshot from elsewhere is trusted by root, on the node, with "
            "'jupyter gpu-snapshot trust'")

    def recover(self) -> None:
        """The agent recovers its store at its own start."""
        return None

    def node_problems(self) -> builtins.list[str]:
        """The agent checks criu at each save, and names any problem then."""
        return []

    def criu_fill(self) -> None:
        """The agent's criu: `jupyter gpu-snapshot check`, run on the node, names it."""
        return None

    def portable_files(self, snapshot: Snapshot) -> contextlib.AbstractContextManager[Path]:
        raise InvalidRequest(
            "preflight", "a portable copy cannot go through the node agent yet: the agent "
            "has no way to hand its checked files to your kernel",
            hint="re-run the recorded cells instead (fallback replay)")

    def gpu_sleep(self) -> SleeperT:
        return self._gpu_sleeper(self.client)

    async def gpu_choice(
        self, snapshot: Snapshot, chosen: builtins.list[str] | None
    ) -> dict[str, Any]:
        found: dict[str, Any] = await self.client.call(
            "gpu_choice", {"ref": snapshot.id, "gpus": chosen})
        return found

    def store_usage(self) -> StoreUsage:
        from ..core.store import SnapshotUsage, StoreUsage

        found = self.client.call_sync("usage")
        return StoreUsage(found["path"], found["disk_bytes"], found["chunks_bytes"],
                          [SnapshotUsage(**s) for s in found["snapshots"]])

    # -- queries (called in worker threads, like the engine's) ------------------------------
    def list(self, notebook_path: str | None = None) -> builtins.list[Snapshot]:
        found = self.client.call_sync("list", {"notebook_path": notebook_path})
        return [snapshot_from(f) for f in found]

    def catalog(self, notebook_path: str | None = None) -> builtins.list[Snapshot]:
        found = self.client.call_sync("catalog", {"notebook_path": notebook_path})
        return [snapshot_from(f) for f in found]

    def get(self, ref: str) -> Snapshot:
        return snapshot_from(self.client.call_sync("get", {"ref": ref}))

    def find_name(self, name: str) -> Snapshot | None:
        found = self.client.call_sync("find_name", {"name": name})
        return snapshot_from(found) if found else None

    def delete(self, ref: str) -> Snapshot:
        return snapshot_from(self.client.call_sync("delete", {"ref": ref}))

    def rename(self, ref: str, new_name: str) -> Snapshot:
        return snapshot_from(self.client.call_sync("rename", {"ref": ref, "name": new_name}))

    # -- the two sequences -----------------------------------------------------------------
    async def save(
        self,
        target: SaveTarget,
        name: str | None = None,
        stop: bool = False,
        progress: ProgressCallback | None = None,
    ) -> Snapshot:
        # A policy's copy (not required) is simply not written through the agent.
        if target.portable is not None and target.portable_required:
            raise InvalidRequest(
                "preflight", "a portable copy cannot be saved through the node agent yet: "
                "the kernel cannot write into the agent's store",
                hint="save without --portable; its cells are recorded all the same")
        fields = await self.client.call(
            "save", {"target": {**dataclasses.asdict(
                dataclasses.replace(target, portable=None)), "connection_info":
                                connection_info_json(target.connection_info)},
                     "name": name, "stop": stop},
            progress)
        return snapshot_from(fields)

    async def restore(
        self,
        ref: str | Snapshot,
        progress: ProgressCallback | None = None,
        gpus: Sequence[str] | None = None,
    ) -> RestoredKernel:
        snapshot_id = ref.id if isinstance(ref, Snapshot) else ref
        found: dict[str, Any] = await self.client.call(
            "restore", {"ref": snapshot_id, "gpus": list(gpus) if gpus is not None else None},
            progress)
        return RestoredKernel(
            int(found["pid"]), found["connection_info"], snapshot_from(found["snapshot"]),
            found.get("timings") or {}, found.get("notes") or {},
        )

    async def check_compatibility(
        self,
        snapshot: Snapshot,
        report: ProgressCallback,
        timings: dict[str, float],
        gpu_targets: Sequence[str] | None = None,
    ) -> None:
        """The agent's restore checks the node itself, with root's view of the files the
        kernel mapped; a check here could only read less."""

