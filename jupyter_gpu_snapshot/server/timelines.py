"""The timelines of the server's kernels: ``GET kernels/{id}/timeline`` and
``POST kernels/{id}/rewind`` ask the kernel through here.

The kernel keeps its timeline and makes the rewind itself (``node/timeline_requests.py``
asks it on its control channel, without blocking the event loop). What the server adds is
what only it knows: which of its kernels the id names, whether that kernel was launched
snapshot-ready (others keep no timeline), whether it sleeps in hibernation (no process to
ask), and whether one of its jobs holds the kernel (a save dumping it, a restore taking its
slot), during which a rewind would change what the job works on. Each rewind made is told
to every client as an event of the rewind/v1 schema, so that every view of the notebook
marks the cells whose effects are gone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .._constants import KERNEL_DISPLAY_NAME
from ..core.errors import Busy, NotReady
from ..launch.provisioner import SnapshotReadyProvisioner
from ..node.timeline_requests import cell_count, kernel_timeline, rewind_kernel
from .service import SnapshotService


class KernelTimelines:
    """Asks the server's kernels for their timelines and rewinds.

    Made by ``wiring.build_server_parts``; called by the handlers of ``kernels/{id}/timeline``
    and ``kernels/{id}/rewind``. ``rewound(data)`` is called after each rewind that took
    effect, with ``{"kernel_id", "report"}`` (the server emits it as an event).
    """

    def __init__(
        self,
        service: SnapshotService,
        rewound: Callable[[dict[str, Any]], None] | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        self.service = service
        self._rewound = rewound or (lambda _data: None)
        self.log = log or logging.getLogger(__name__)
        # One rewind per kernel at a time: a second would be measured against a timeline
        # that the first is changing.
        self._rewinding: set[str] = set()

    def _connection_info(self, kernel_id: str, step: str) -> dict[str, Any]:
        """The connection info of a kernel of this server whose process runs."""
        km = self.service.kernel(kernel_id)
        if not isinstance(getattr(km, "provisioner", None), SnapshotReadyProvisioner):
            # Answered at once: such a kernel would leave the request unanswered, and a
            # client that asks after each cell would wait for nothing every time.
            raise NotReady(
                step, f"kernel {kernel_id} is not snapshot-ready: only kernels of a "
                "snapshot-ready kernelspec keep a timeline",
                hint=f"switch the notebook to the '{KERNEL_DISPLAY_NAME}' kernel")
        sleeping = self.service.sleepers.describe(kernel_id)
        # "requested": it hibernates once its cell ends, and runs until then.
        if sleeping and sleeping.get("state") != "requested":
            raise NotReady(
                step, f"kernel {kernel_id} is {sleeping['state']}: it has no timeline to "
                "ask while it sleeps", hint="wake it first (run a cell, or POST "
                "kernels/{kernel_id}/wake), then ask again")
        info: dict[str, Any] = km.get_connection_info(session=False)
        return info

    async def timeline(self, kernel_id: str) -> dict[str, Any]:
        """The kernel's timeline, as its TIMELINE_REPLY says it (``status`` left out)."""
        return await kernel_timeline(self._connection_info(kernel_id, "timeline"))

    async def rewind(self, kernel_id: str, before: int) -> dict[str, Any]:
        """Rewind the kernel to before cell ``before``; the kernel's report."""
        before = cell_count(before)
        info = self._connection_info(kernel_id, "rewind")
        job = self.service.running_job(kernel_id)
        if job is not None:
            raise Busy("rewind", f"a {job.kind} job ({job.id}) on kernel {kernel_id} is "
                       "under way", hint="wait for it to finish, then rewind",
                       details={"in_use_by": job.kind, "job_id": job.id})
        if kernel_id in self._rewinding:
            raise Busy("rewind", f"a rewind of kernel {kernel_id} is under way",
                       hint="wait for it to finish, then ask again",
                       details={"in_use_by": "rewind"})
        self._rewinding.add(kernel_id)
        try:
            report = await rewind_kernel(info, before)
        finally:
            self._rewinding.discard(kernel_id)
        self.log.info("gpu-snapshot: kernel %s rewound to before cell [%s]; undone: %s",
                      kernel_id, before, report.get("undone"))
        try:
            self._rewound({"kernel_id": kernel_id, "report": report})
        except Exception:  # a broken event sink must not turn a rewind made into an error
            self.log.exception("gpu-snapshot: could not emit the rewind of kernel %s",
                               kernel_id)
        return report
