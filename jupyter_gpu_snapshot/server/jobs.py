"""Save and restore jobs: tasks on the server's event loop, one operation per kernel.

A request claims the keys of what it touches (``kernel:ID``, ``snapshot:ID``) before it is
answered, so a second operation on the same kernel is refused at once (409) instead of
queueing behind the first. Jobs report progress by updating their ``Job`` record; every
change goes to the ``on_change`` sink (the server emits it as a jupyter_events event).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import Busy, NotFound, SnapshotError
from ..core.hooks import Progress

# Finished jobs kept for GET jobs/{id}; clients poll a job within seconds of its end.
FINISHED_JOBS_KEPT = 200
JOB_ID_PATTERN = r"[0-9a-f]{32}"
# What a job claims of a snapshot; ``JobRunner.claimed`` lists them by this prefix.
SNAPSHOT_KEY_PREFIX = "snapshot:"


def kernel_key(kernel_id: str) -> str:
    """The key a job that works on kernel ``kernel_id`` claims (a save, a restore's slot)."""
    return f"kernel:{kernel_id}"


def snapshot_key(snapshot_id: str) -> str:
    """The key a job that reads or writes snapshot ``snapshot_id`` claims."""
    return f"{SNAPSHOT_KEY_PREFIX}{snapshot_id}"


@dataclass
class Job:
    """One save or restore, as clients see it (``to_dict`` is the API's Job object)."""

    kind: str
    kernel_id: str | None
    snapshot_id: str | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    status: str = "running"
    phase: str = "preflight"
    done: int = 0
    total: int = 0
    started: float = field(default_factory=time.time)
    finished: float | None = None
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    reason: str = "user"
    # The kernel whose own credential asked for the job, if one did: it may follow the job
    # (a restore's kernel_id is the new kernel's). Not part of the API's Job.
    requested_by: str | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "kernel_id": self.kernel_id,
            "snapshot_id": self.snapshot_id,
            "status": self.status,
            "phase": self.phase,
            "done": self.done,
            "total": self.total,
            "started": self.started,
            "finished": self.finished,
            "result": self.result,
            "error": self.error,
            "reason": self.reason,
        }


JobBody = Callable[[Job], Awaitable[dict[str, Any]]]


class JobRunner:
    """Runs jobs as asyncio tasks and keeps the running and recently finished ones."""

    def __init__(
        self,
        on_change: Callable[[Job], None] | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        self._on_change = on_change or (lambda _job: None)
        self.log = log or logging.getLogger(__name__)
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._claims: dict[str, Job] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    # -- starting --------------------------------------------------------------------------
    def busy_with(self, key: str) -> Job | None:
        """The running job that holds ``key``, if any."""
        return self._claims.get(key)

    def start(self, job: Job, keys: Iterable[str], body: JobBody) -> Job:
        """Claim ``keys`` for ``job`` and run ``body(job)`` in a task.

        Raises Busy when another job holds one of the keys. Nothing awaits between the
        check and the claim, so of concurrent requests exactly one wins.
        """
        keys = list(dict.fromkeys(keys))
        for key in keys:
            holder = self._claims.get(key)
            if holder is not None:
                what = key.replace(":", " ", 1)
                raise Busy(
                    "preflight",
                    f"a {holder.kind} job ({holder.id}) on {what} is under way",
                    hint="wait for it to finish, then try again",
                )
        for key in keys:
            self._claims[key] = job
        self._jobs[job.id] = job
        self._tasks[job.id] = asyncio.create_task(self._run(job, body))
        self._emit(job)
        return job

    async def _run(self, job: Job, body: JobBody) -> None:
        try:
            result = await body(job)
        except SnapshotError as exc:
            self._finish(job, error=exc.to_dict())
        except asyncio.CancelledError:
            self._finish(job, error=SnapshotError(job.phase, "the job was cancelled").to_dict())
            raise
        except Exception as exc:
            # Anything else is a bug of ours; the user still gets the step and the cause.
            self.log.exception("gpu-snapshot %s job %s failed", job.kind, job.id)
            cause = f"{type(exc).__name__}: {exc}"
            self._finish(job, error=SnapshotError(job.phase, cause).to_dict())
        else:
            self._finish(job, result=result)
        finally:
            for key in [k for k, holder in self._claims.items() if holder is job]:
                del self._claims[key]
            self._tasks.pop(job.id, None)
            self._forget_old()

    def hand_over(self, job: Job, release: Iterable[str], claim: Iterable[str]) -> None:
        """Let a running job give up some keys and hold others until it ends.

        Called by a save job once its snapshot committed: its upload goes on holding the
        snapshot, while the kernel is free for the next operation.
        """
        for key in claim:
            self._claims.setdefault(key, job)
        for key in release:
            if self._claims.get(key) is job:
                del self._claims[key]

    def claimed(self, prefix: str) -> set[str]:
        """What the running jobs hold under ``prefix`` (e.g. ``snapshot:``), prefix removed."""
        return {k[len(prefix):] for k in self._claims if k.startswith(prefix)}

    def _finish(
        self,
        job: Job,
        *,
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> None:
        job.finished = time.time()
        job.result, job.error = result, error
        if error is None:
            job.status, job.phase = "succeeded", "done"
        else:
            job.status = "failed"
            self.log.warning("gpu-snapshot %s job %s: %s", job.kind, job.id, error["message"])
        self._emit(job)

    def _forget_old(self) -> None:
        finished = [j for j in self._jobs.values() if j.status != "running"]
        for job in finished[: max(0, len(finished) - FINISHED_JOBS_KEPT)]:
            del self._jobs[job.id]

    # -- progress --------------------------------------------------------------------------
    def progress(self, job: Job) -> Callable[[Progress], None]:
        """An engine progress callback that updates ``job``; call it on the event loop.

        The engine also reports from worker threads (checksums); those reports are handed
        to the loop, since jobs and events belong to it.
        """
        loop = asyncio.get_running_loop()
        loop_thread = threading.get_ident()

        def apply(p: Progress) -> None:
            # "done" is the job's own final phase, set when its result is known.
            if job.status != "running" or p.phase == "done":
                return
            job.phase, job.done, job.total = p.phase, p.done, p.total
            self._emit(job)

        def report(p: Progress) -> None:
            if threading.get_ident() == loop_thread:
                apply(p)
            else:
                loop.call_soon_threadsafe(apply, p)

        return report

    def _emit(self, job: Job) -> None:
        try:
            self._on_change(job)
        except Exception:  # a broken event sink must not fail the job
            self.log.exception("gpu-snapshot: could not emit the event of job %s", job.id)

    # -- queries ---------------------------------------------------------------------------
    def get(self, job_id: str) -> Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFound(
                "lookup",
                f"no job {job_id!r}",
                hint="jobs are kept in memory for a while after they end, and not across "
                "server restarts",
            )
        return job

    def recent(self, kernel_id: str | None = None) -> list[Job]:
        """Running jobs first, then finished ones, newest first within each."""
        jobs = [j for j in self._jobs.values() if kernel_id is None or j.kernel_id == kernel_id]
        jobs.sort(key=lambda j: j.started, reverse=True)
        return [j for j in jobs if j.status == "running"] + [
            j for j in jobs if j.status != "running"
        ]

    def running(self) -> list[Job]:
        return [j for j in self._jobs.values() if j.status == "running"]

    async def wait(self, job: Job, timeout: float | None = None) -> bool:
        """Wait for ``job`` to end, at most ``timeout`` seconds; True when it has ended."""
        task = self._tasks.get(job.id)
        if task is None:
            return job.status != "running"
        done, _ = await asyncio.wait({task}, timeout=timeout)
        return bool(done)

    async def drain(self, timeout: float) -> list[Job]:
        """Wait up to ``timeout`` seconds for every running job; return those still running."""
        tasks = set(self._tasks.values())
        if tasks:
            await asyncio.wait(tasks, timeout=max(0.0, timeout))
        return self.running()
