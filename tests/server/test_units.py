"""Pieces of the server extension that need no server: jobs, the kernel-facing URL, and how
a kernel's refusals map to statuses."""

from __future__ import annotations

import asyncio
import threading
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any

import pytest
from jupyter_server.services.kernels.kernelmanager import ServerKernelManager

from jupyter_gpu_snapshot.core.errors import Busy, NoAnswer, SnapshotError
from jupyter_gpu_snapshot.core.hooks import Progress
from jupyter_gpu_snapshot.node.timeline_requests import refusal
from jupyter_gpu_snapshot.server.app import GPUSnapshotApp, kernel_facing_url
from jupyter_gpu_snapshot.server.handlers import status_of
from jupyter_gpu_snapshot.server.jobs import FINISHED_JOBS_KEPT, Job, JobRunner
from jupyter_gpu_snapshot.server.jupyter_server_internals import last_activity


@pytest.mark.parametrize(
    ("ip", "sock", "certfile", "expected"),
    [
        ("127.0.0.1", "", "", "http://127.0.0.1:8888/base/"),
        ("", "", "", "http://localhost:8888/base/"),
        ("0.0.0.0", "", "", "http://127.0.0.1:8888/base/"),
        ("::", "", "", "http://[::1]:8888/base/"),
        ("node7.example", "", "/c.pem", "https://node7.example:8888/base/"),
        ("", "/run/j.sock", "", "http+unix://%2Frun%2Fj.sock/base/"),
    ],
)
def test_kernels_reach_the_server_over_loopback(
    ip: str, sock: str, certfile: str, expected: str
) -> None:
    app: Any = SimpleNamespace(ip=ip, port=8888, base_url="/base/", sock=sock, certfile=certfile)
    assert kernel_facing_url(app) == expected


def test_the_extensions_objects_are_asked_for_only_once_the_server_loaded_it() -> None:
    app = GPUSnapshotApp()
    with pytest.raises(RuntimeError, match="initialize_settings"):
        app.parts  # noqa: B018
    assert app.current_activity() is None
    assert app.last_shutdown is None


async def test_a_claimed_key_refuses_a_second_job_until_the_first_ends() -> None:
    seen: list[tuple[str, str]] = []
    runner = JobRunner(on_change=lambda j: seen.append((j.status, j.phase)))
    gate = asyncio.Event()

    async def body(job: Job) -> dict[str, Any]:
        await gate.wait()
        return {"ok": True}

    first = runner.start(Job("save", "k1"), ["kernel:k1"], body)
    with pytest.raises(Busy, match=first.id):
        runner.start(Job("save", "k1"), ["kernel:k1"], body)
    other = runner.start(Job("save", "k2"), ["kernel:k2"], body)
    assert [j.id for j in runner.running()] == [first.id, other.id]
    gate.set()
    assert await runner.wait(first, timeout=5)
    assert first.status == "succeeded" and first.result == {"ok": True}
    assert seen[-1] == ("succeeded", "done")
    again = runner.start(Job("save", "k1"), ["kernel:k1"], body)
    assert await runner.wait(again, timeout=5)


async def test_failures_become_the_jobs_error_and_release_the_key() -> None:
    runner = JobRunner()

    async def refused(job: Job) -> dict[str, Any]:
        raise SnapshotError("dump", "criu was killed by signal 9")

    async def buggy(job: Job) -> dict[str, Any]:
        job.phase = "commit"
        raise KeyError("oops")

    job = runner.start(Job("save", "k"), ["kernel:k"], refused)
    await runner.wait(job, timeout=5)
    assert job.status == "failed" and job.error is not None
    assert job.error["message"] == "dump failed: criu was killed by signal 9"
    job = runner.start(Job("save", "k"), ["kernel:k"], buggy)
    await runner.wait(job, timeout=5)
    assert job.error is not None and job.error["step"] == "commit"
    assert "KeyError" in job.error["cause"]
    assert runner.busy_with("kernel:k") is None


async def test_progress_from_worker_threads_lands_on_the_loop() -> None:
    threads: list[int] = []
    runner = JobRunner(on_change=lambda j: threads.append(threading.get_ident()))
    done = asyncio.Event()

    async def body(job: Job) -> dict[str, Any]:
        report = runner.progress(job)
        await asyncio.to_thread(report, Progress("commit", 5, 10))
        # The report reached the loop before the thread's return did: it is applied now.
        assert (job.phase, job.done, job.total) == ("commit", 5, 10)
        report(Progress("done", 10, 10))  # the job's own end sets "done"
        assert job.phase == "commit"
        done.set()
        return {}

    job = runner.start(Job("save", "k"), ["kernel:k"], body)
    await runner.wait(job, timeout=5)
    assert done.is_set() and job.status == "succeeded"
    assert set(threads) == {threading.get_ident()}


async def test_old_finished_jobs_are_forgotten_running_ones_never() -> None:
    runner = JobRunner()
    gate = asyncio.Event()

    async def held(job: Job) -> dict[str, Any]:
        await gate.wait()
        return {}

    async def quick(job: Job) -> dict[str, Any]:
        return {}

    running = runner.start(Job("save", "held"), ["kernel:held"], held)
    finished = []
    for i in range(FINISHED_JOBS_KEPT + 5):
        job = runner.start(Job("save", f"k{i}"), [f"kernel:k{i}"], quick)
        await runner.wait(job, timeout=5)
        finished.append(job)
    assert runner.get(running.id) is running
    assert runner.recent()[0] is running
    kept = [j for j in runner.recent() if j.status != "running"]
    assert len(kept) == FINISHED_JOBS_KEPT
    assert kept[0] is finished[-1]
    gate.set()
    await runner.wait(running, timeout=5)


def test_a_kernel_still_starting_has_no_last_activity_yet() -> None:
    # jupyter_server sets the trait once the kernel runs; the scheduler may look earlier.
    starting = ServerKernelManager()
    assert last_activity(starting) is None
    started = ServerKernelManager()
    started.last_activity = datetime.fromtimestamp(1_700_000_000, tz=timezone.utc)
    assert last_activity(started) == 1_700_000_000


@pytest.mark.parametrize(("ename", "code", "status"), [
    ("KernelBusy", "kernel_busy", 409),
    ("RewindOutOfRange", "rewind_out_of_range", 400),
    ("RewindFailed", "rewind_failed", 500),
    ("TimelineOff", "not_ready", 409),
    ("ZeroDivisionError", "failed", 500),
])
def test_a_kernels_refusal_keeps_its_words_and_name_and_has_one_status(
    ename: str, code: str, status: int,
) -> None:
    error = refusal("rewind", {"status": "error", "ename": ename, "evalue": "because",
                               "traceback": []})
    assert (error.code, status_of(error)) == (code, status)
    assert (error.message, error.details) == ("rewind failed: because", {"ename": ename})
    assert status_of(NoAnswer("timeline", "no answer")) == 502
