"""The kernels that hibernation holds asleep, and what the rest of the server may ask of them.

A kernel is here from the start of its hibernation until it is awake again
(``SleepingKernel``), with the messages its clients sent meanwhile; and a kernel that asked
to hibernate once its running cell ends is here until it does. ``Hibernation`` changes
these records; the service reads them (a kernel's status, a save refused while its kernel
sleeps with its GPU released, the snapshots that retention and deletes leave alone), and
so do the REST API and the websocket connections. Made before both, and handed to both.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..core.errors import NotFound
from .jobs import JobRunner

GPU_TIER = "gpu"
PROCESS_TIER = "process"
TIERS = (GPU_TIER, PROCESS_TIER)
HIBERNATING = "hibernating"
HIBERNATED = "hibernated"
WAKING = "waking"


class HeldClient(Protocol):
    """What hibernation needs of a client's websocket connection
    (``connections.HibernationAwareConnection``)."""

    @property
    def kernel_id(self) -> str: ...

    def deliver(self, raw: Any) -> None: ...
    def answer(self, channel: str, msg_type: str, content: dict[str, Any],
               parent: dict[str, Any]) -> None: ...
    def kernel_info(self) -> dict[str, Any] | None: ...
    async def rejoin(self) -> None: ...


@dataclass
class HeldMessage:
    client: HeldClient
    raw: Any
    channel: str
    header: dict[str, Any]


@dataclass
class SleepingKernel:
    """A kernel from the start of its hibernation until it is awake again."""

    kernel_id: str
    state: str
    notebook_path: str | None
    gpu_bytes: int
    host_bytes: int
    tier: str = PROCESS_TIER
    root_pid: int | None = None  # the sleeping tree's, in the gpu tier
    # What it held on each GPU (UUID -> bytes), in the gpu tier: what its wake needs there.
    gpu_memory: dict[str, int] = field(default_factory=dict)
    requested: float = field(default_factory=time.time)
    since: float | None = None  # when its process ended
    snapshot_id: str | None = None
    job_id: str | None = None
    error: dict[str, Any] | None = None
    wake_when_saved: bool = False
    # Moving from the gpu tier to the process tier: a save that fails leaves it asleep.
    moving: bool = False
    held: list[HeldMessage] = field(default_factory=list)
    # Clients that connected while the kernel had no process: they re-join it on waking
    # even if they sent nothing meanwhile.
    joined: list[HeldClient] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kernel_id": self.kernel_id,
            "state": self.state,
            "tier": self.tier,
            "notebook_path": self.notebook_path,
            "gpu_bytes_freed": self.gpu_bytes if self.since is not None else 0,
            "host_bytes_freed": (self.host_bytes if self.since is not None
                                 and self.tier == PROCESS_TIER else 0),
            "gpu_bytes": self.gpu_bytes,
            "host_bytes": self.host_bytes,
            "since": self.since,
            "snapshot_id": self.snapshot_id,
            "job_id": self.job_id,
            "last_wake_error": self.error,
            "held_messages": len(self.held),
        }


class Sleepers:
    """The kernels hibernating, hibernated or waking (``kernels``), and those asked to
    hibernate once idle (``when_idle``, kernel id -> tier); changed by ``Hibernation``
    only, read by everyone else through the queries here."""

    def __init__(self, jobs: JobRunner) -> None:
        # The job runner that hibernation's saves run in: a save that has just committed
        # names the snapshot its kernel wakes from before its hibernation has ended.
        self.jobs = jobs
        self.kernels: dict[str, SleepingKernel] = {}
        self.when_idle: dict[str, str] = {}

    def state(self, kernel_id: str) -> str | None:
        sleeper = self.kernels.get(kernel_id)
        return sleeper.state if sleeper is not None else None

    def describe(self, kernel_id: str) -> dict[str, Any] | None:
        """A kernel's hibernation as ``GET hibernation`` lists it, or None."""
        sleeper = self.kernels.get(kernel_id)
        if sleeper is not None:
            return sleeper.to_dict()
        if kernel_id in self.when_idle:
            return {"kernel_id": kernel_id, "state": "requested",
                    "tier": self.when_idle[kernel_id]}
        return None

    def listing(self) -> list[dict[str, Any]]:
        return [s.to_dict() for s in self.kernels.values()]

    def wakes_from(self) -> set[str]:
        """The snapshots the kernels hibernating or hibernated now wake from, which
        neither retention nor a delete takes; one whose save has just committed counts
        before its hibernation has ended."""
        held: set[str] = set()
        for sleeper in self.kernels.values():
            snapshot_id = sleeper.snapshot_id
            if snapshot_id is None and sleeper.job_id is not None:
                with contextlib.suppress(NotFound):
                    snapshot_id = self.jobs.get(sleeper.job_id).snapshot_id
            if snapshot_id:
                held.add(snapshot_id)
        return held
