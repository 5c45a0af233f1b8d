"""Hibernation's gpu tier for a server without root: the node agent gives back the GPU of
the user's kernels and keeps their processes.

``AgentGpuSleep`` has the methods of ``gpu.sleep.GpuSleep`` that hibernation uses. The
agent does each with the GPU sleep of its own CUDA hook, as root, for the caller's own
kernels only; the holder that keeps a kernel's threads stopped is root's and outlives the
request, this server and the agent, so a server started later finds the kernel asleep by
its pid (``asleep``).

This package imports no GPU layer: the server gives the class the report a release or a
wake makes of the agent's answer (``report_from``) and its own reading of the GPUs
(``read_inventory``; NVML tells any user each GPU's free memory and what each process
holds there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ..core.errors import InvalidRequest, NotReady
from .client import AgentClient

ReportT = TypeVar("ReportT")
InventoryT = TypeVar("InventoryT")


class AgentWithoutGpuTier(NotReady):
    """The node agent predates the gpu tier: it knows none of its operations."""


class AgentGpuSleep(Generic[ReportT, InventoryT]):
    """Releases and gives back the GPU of the caller's kernels through the node agent.
    Every call blocks: hibernation makes them in worker threads."""

    def __init__(self, client: AgentClient,
                 report_from: Callable[[dict[str, Any]], ReportT],
                 read_inventory: Callable[[], InventoryT]) -> None:
        self.client = client
        self.report_from = report_from
        self.read_inventory = read_inventory

    def asleep(self, root: int) -> dict[str, Any] | None:
        """The holder's status when the tree sleeps in the gpu tier, else None."""
        try:
            found = self._call("gpu_asleep", {"pid": root})
        except AgentWithoutGpuTier:  # it released no GPU
            return None
        return dict(found) if isinstance(found, dict) else None

    def release(self, root: int, note: dict[str, Any] | None = None) -> ReportT:
        """The agent locks, holds and checkpoints the tree: its GPU is free and it sleeps.
        ``note``: what ``asleep`` tells of this sleep later (JSON, a few KiB at most)."""
        return self.report_from(self._call("gpu_release", {"pid": root, "note": note or {}}))

    def wake(self, root: int) -> ReportT:
        """The agent restores and unlocks the tree, then lets its threads run; a wake that
        fails leaves it asleep."""
        return self.report_from(self._call("gpu_wake", {"pid": root}))

    def _call(self, op: str, args: dict[str, Any]) -> Any:
        try:
            return self.client.call_sync(op, args)
        except InvalidRequest as exc:
            # An agent refuses an operation it does not know as a bad request; only then is
            # it asked what it offers.
            if exc.step != "agent":
                raise
            hello = self.client.call_sync("hello")
            if op in hello.get("operations", ()):
                raise
            raise AgentWithoutGpuTier(
                "hibernate", f"the node agent at {self.client.socket_path} (version "
                f"{hello.get('agent_version')}) does not release GPUs in place",
                hint="ask the machine's administrator to update it; hibernate in the "
                "process tier meanwhile") from None
