"""The engine as the CLI and the server hold it, however it is reached: ``NodeEngine``.

Two engines implement it: ``LocalEngine`` (``local_engine.py``), the core's engine run by this
process itself (root), and ``agent_client.agent_engine.AgentEngine``, which asks the node
agent. Callers ask the engine for what they used to find by its type or by digging into its
store: where the snapshots are and how much room is left, whether this process holds the
store (recovery, trust, a remote store's cache), where a restore would put the GPUs, and the
gpu tier of hibernation.
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..core.criu_build import CriuFill
from ..core.hooks import ProgressCallback, SaveTarget
from ..core.recovery import RecoveryReport as RecoveryReport
from ..core.restore import RestoredKernel as RestoredKernel
from ..core.store import Snapshot, SnapshotStore

# Named in signatures only: the usage count needs numpy, the GPU layer the driver's types.
if TYPE_CHECKING:
    from ..core.store import StoreRoom, StoreUsage
    from ..gpu.inventory import GpuInventory
    from ..gpu.sleep import SleepReport


class GpuSleeper(Protocol):
    """What hibernation needs of its gpu tier: ``gpu.sleep.GpuSleep`` where this process runs
    the driver itself, ``agent_client.gpu_sleep.AgentGpuSleep`` where the node agent does.
    Each call blocks."""

    @property
    def read_inventory(self) -> Callable[[], GpuInventory | None]: ...

    def asleep(self, root: int) -> dict[str, Any] | None: ...

    def release(self, root: int, note: dict[str, Any] | None = None) -> SleepReport: ...

    def wake(self, root: int) -> SleepReport: ...


class NodeEngine(Protocol):
    """Saves and restores this node's kernels, and answers for its snapshot store.

    Queries block (callers on an event loop run them in a worker thread); the two sequences
    and the GPU preview are coroutines.
    """

    @property
    def location(self) -> str:
        """Where the snapshots are, as messages name it."""

    @property
    def local_store(self) -> SnapshotStore | None:
        """The store of the snapshots when this process holds it (root), else None: the
        node agent holds it, and keeps it, recovers it and trusts in it itself."""

    @property
    def own_dir(self) -> Path:
        """A directory of this process's user for what the server keeps beside the
        snapshots (the notebooks' autosave choices)."""

    # -- queries -----------------------------------------------------------------------------
    def list(self, notebook_path: str | None = None) -> builtins.list[Snapshot]: ...

    def catalog(self, notebook_path: str | None = None) -> builtins.list[Snapshot]: ...

    def get(self, ref: str) -> Snapshot: ...

    def find_name(self, name: str) -> Snapshot | None: ...

    def delete(self, ref: str) -> Snapshot: ...

    def rename(self, ref: str, new_name: str) -> Snapshot: ...

    def store_usage(self) -> StoreUsage: ...

    def store_room(self) -> StoreRoom: ...

    def trust(self, ref: str) -> Snapshot:
        """Sign an unsigned snapshot with this node's key (after the user's consent)."""

    def recover(self) -> RecoveryReport | None:
        """Commit or clean what killed saves left in the store; None where the node agent
        does that for its store."""

    def node_problems(self) -> builtins.list[str]:
        """Why this node cannot save any kernel now (criu missing or too old), for the
        kernels' status; empty when it can."""

    def criu_fill(self) -> CriuFill | None:
        """Which criu this node restores with and whether it fills memory on several CPUs
        (``core.criu_build``), for the kernels' status; None where the node agent runs
        criu. Blocks: call it in a worker thread."""

    def portable_files(self, snapshot: Snapshot) -> contextlib.AbstractContextManager[Path]:
        """A directory holding the checked portable copy of ``snapshot`` (every file
        compared with its signed digest), removed on leaving; InvalidRequest where this
        engine cannot hand one to a kernel."""

    def gpu_sleep(self) -> GpuSleeper:
        """Hibernation's gpu tier; NotReady where there is no CUDA driver to release with."""

    # -- the sequences -----------------------------------------------------------------------
    async def save(
        self,
        target: SaveTarget,
        name: str | None = None,
        stop: bool = False,
        progress: ProgressCallback | None = None,
    ) -> Snapshot: ...

    async def restore(
        self,
        ref: str | Snapshot,
        progress: ProgressCallback | None = None,
        gpus: Sequence[str] | None = None,
    ) -> RestoredKernel: ...

    async def check_compatibility(
        self,
        snapshot: Snapshot,
        report: ProgressCallback,
        timings: dict[str, float],
        gpu_targets: Sequence[str] | None = None,
    ) -> None: ...

    async def gpu_choice(
        self, snapshot: Snapshot, chosen: builtins.list[str] | None
    ) -> dict[str, Any]:
        """Where a restore of ``snapshot`` would put its GPUs on this node, or why it would
        be refused (``gpu.remap.describe_choice``); nothing is restored or reserved."""
