"""The engine of an unprivileged process: ``SnapshotEngine``'s interface, carried out by
the node agent.

The user's server and CLI hold this instead of a ``SnapshotEngine`` when they go through
the agent (``GPUSnapshot.through_agent``). Snapshots live in the agent's store for the
user; ``store`` here is the user's own directory for what the server keeps beside its
snapshots (the notebooks' autosave choices), and holds no snapshot.
"""

from __future__ import annotations

import builtins
import dataclasses
from collections.abc import Sequence
from typing import Any

from ..core.compatibility import NodeCompatibility
from ..core.engine import SnapshotEngine
from ..core.hooks import ProgressCallback, SaveTarget
from ..core.restore import RestoredKernel
from ..core.save import connection_info_json
from ..core.snapshot import Snapshot
from ..core.store import SnapshotStore
from ..core.usage import SnapshotUsage, StoreUsage
from .client import AgentClient
from .protocol import snapshot_from


class AgentEngine(SnapshotEngine):
    """Saves and restores through the node agent; queries ask it too."""

    def __init__(self, client: AgentClient, store: SnapshotStore) -> None:
        super().__init__(store=store, hooks=(), compatibility=NodeCompatibility(gpus=None))
        self.client = client

    @property
    def location(self) -> str:
        return f"the node agent's store for you ({self.client.socket_path})"

    def store_usage(self) -> StoreUsage:
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
        fields = await self.client.call(
            "save", {"target": {**dataclasses.asdict(target), "connection_info":
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

