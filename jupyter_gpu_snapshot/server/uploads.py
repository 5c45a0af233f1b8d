"""What this server owes the remote store (``c.GPUSnapshot.remote_url``), and sending it.

A committed snapshot is owed to the remote store until its upload completes: the save
job uploads it at once (``after_save``); an upload that failed, was given up for a
shutdown or was cut off by a crash goes up again in a retry pass (``start_retries``);
the snapshots a shutdown saved go up with what is left of its budget
(``upload_on_shutdown``). ``SnapshotService`` owns one ``Uploads`` when a remote store
is set; the app starts the retries and the shutdown uploads through it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from ..core.errors import Busy, SnapshotError
from ..core.hooks import Progress
from ..core.store import Snapshot
from ..node.engine import NodeEngine
from .jobs import SNAPSHOT_KEY_PREFIX, Job, JobRunner, snapshot_key
from .remote_sync import RemoteSync, UploadStopped


class Uploads:
    """The uploads of local snapshots to the remote store: after a save, again, at shutdown."""

    def __init__(
        self, engine: NodeEngine, remote: RemoteSync, jobs: JobRunner, log: logging.Logger
    ) -> None:
        self.engine = engine
        self.remote = remote
        self.jobs = jobs
        self.log = log
        self._retries: asyncio.Future[list[str]] | None = None
        self._retry_again = False

    async def owe(self, snapshot_id: str) -> None:
        """Called by the save job once its snapshot committed: it is owed until uploaded
        (shutdown saves upload later, and a crash may come first)."""
        await asyncio.to_thread(self.remote.pending.mark, snapshot_id)

    async def after_save(
        self, snapshot: Snapshot, report: Callable[[Progress], None], obsolete: list[str]
    ) -> dict[str, Any]:
        """Upload a committed snapshot, then remove the remote copies of what retention
        removed locally; a failed upload keeps those, so the remote never loses more.

        Called by the save job, which holds the snapshot meanwhile. Once the remote
        answers, what it still lacks goes up too (``start_retries``).
        """
        outcome = await self.remote.upload(
            snapshot, report, self.jobs.claimed(SNAPSHOT_KEY_PREFIX)
        )
        if outcome["status"] == "uploaded":
            for snapshot_id in obsolete:
                try:
                    await self.remote.delete(snapshot_id)
                except SnapshotError as exc:
                    self.log.warning(
                        "gpu-snapshot: retention could not remove %s from %s: %s",
                        snapshot_id, self.remote.url, exc,
                    )
            self.start_retries()
        return outcome

    # -- retries ---------------------------------------------------------------------------
    def start_retries(self) -> None:
        """Upload again, in the background, the local snapshots whose upload has not
        completed (failed, given up at shutdown, cut off by a crash).

        Called by ``GPUSnapshotApp`` once the server listens and by ``after_save`` once a
        save's own upload succeeded. One pass runs at a time; a call during a pass runs
        another after it.
        """
        if self._retries is not None and not self._retries.done():
            self._retry_again = True
            return
        self._retry_again = False
        self._retries = asyncio.ensure_future(self.upload_pending())

    async def upload_pending(self) -> list[str]:
        """Upload the pending snapshots one at a time, each as an ``upload`` job; stops at
        the first failure (the remote does not answer: the next pass tries again).
        Returns the ids uploaded."""
        uploaded: list[str] = []
        while True:
            for snapshot_id in await asyncio.to_thread(self.remote.pending.ids):
                if self.remote.stopping.is_set():
                    return uploaded
                try:
                    snapshot = await asyncio.to_thread(self.engine.get, snapshot_id)
                    snapshot.require_trusted("upload")
                except SnapshotError as exc:  # deleted meanwhile, or not ours to upload
                    self.log.info("gpu-snapshot: no upload owed for %s: %s", snapshot_id, exc)
                    await asyncio.to_thread(self.remote.pending.clear, snapshot_id)
                    continue
                try:
                    job = self.jobs.start(
                        Job("upload", None, snapshot.id, reason="retry"),
                        [snapshot_key(snapshot.id)],
                        functools.partial(self._retry_upload, snapshot=snapshot),
                    )
                except Busy:
                    continue  # a save's own upload or a restore holds it: a later pass
                await self.jobs.wait(job)
                if job.status != "succeeded":
                    return uploaded
                uploaded.append(snapshot.id)
            if not self._retry_again:
                return uploaded
            self._retry_again = False

    async def _retry_upload(self, job: Job, snapshot: Snapshot) -> dict[str, Any]:
        self.log.info("gpu-snapshot: uploading %s to %s again (its upload had not completed)",
                      snapshot.id, self.remote.url)
        self.jobs.progress(job)(Progress("uploading"))
        outcome = await self.remote.upload(snapshot, self.jobs.progress(job),
                                           self.jobs.claimed(SNAPSHOT_KEY_PREFIX))
        if outcome["status"] != "uploaded":
            error = outcome["error"]
            kind = UploadStopped if error["code"] == UploadStopped.code else SnapshotError
            raise kind(error["step"], error["cause"], hint=error["hint"])
        return {**snapshot.summary(), "upload": outcome}

    # -- shutdown --------------------------------------------------------------------------
    def stopped_uploads(self) -> list[str]:
        """The snapshots of save jobs whose upload was given up for a shutdown's saves."""
        return [
            str(job.snapshot_id) for job in reversed(self.jobs.recent())
            if job.kind == "save" and job.snapshot_id and job.result
            and ((job.result.get("upload") or {}).get("error") or {}).get("code")
            == UploadStopped.code
        ]

    async def upload_on_shutdown(self, snapshot_ids: list[str], seconds: float) -> None:
        """Upload the snapshots the shutdown saved, within what is left of its budget.

        Called by ``GPUSnapshotApp.stop_extension`` after every kernel is saved locally;
        an upload that outlasts the budget is given up (the snapshot stays local).
        """
        deadline = time.monotonic() + seconds
        for snapshot_id in snapshot_ids:
            left = deadline - time.monotonic()
            if left <= 0:
                self.log.warning(
                    "gpu-snapshot: snapshot %s is saved locally, not uploaded: the shutdown "
                    "budget is spent (GPUSnapshot.shutdown_budget)", snapshot_id,
                )
                continue
            try:
                snapshot = await asyncio.to_thread(self.engine.get, snapshot_id)
            except SnapshotError as exc:
                self.log.warning("gpu-snapshot: not uploading %s: %s", snapshot_id, exc)
                continue
            upload = asyncio.ensure_future(
                self.remote.upload(snapshot, lambda _p: None, {snapshot_id})
            )
            done, _ = await asyncio.wait({upload}, timeout=left)
            if not done:
                self.remote.stopping.set()
            outcome = await upload
            if outcome["status"] != "uploaded":
                self.log.warning(
                    "gpu-snapshot: snapshot %s is saved locally, not uploaded: %s",
                    snapshot_id, outcome["error"]["message"],
                )
