"""The first tier of hibernation on real processes: their threads held by a real holder
under ptrace, their CUDA state kept by the scripted driver (``testkit/fake_driver.py``).

Each scenario is a row; every run checks, at its end, that the process either runs with
its CUDA state running and every thread free, or sleeps with every thread but the driver's
restore thread stopped, and that the driver saw no thread run during a checkpoint, restore or
unlock.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.errors import NotReady, SnapshotError
from jupyter_gpu_snapshot.gpu.driver import (
    CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_ERROR_UNKNOWN,
    ProcessState,
)
from jupyter_gpu_snapshot.gpu.sleep import GpuSleep, holders_dir
from testkit.fake_driver import GIB, RESTORE_THREAD_CODE, FakeCudaDriver, FakeGpus, fake_cuda_env

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="holding threads needs root")

# A process with CUDA state (for the fake driver), a restore thread, a ticking thread and a
# ticking child process: each tick appends a byte to its file.
TARGET = RESTORE_THREAD_CODE + textwrap.dedent("""
    import os, subprocess, sys, threading, time
    def tick(path):
        with open(path, "ab", buffering=0) as f:
            while True:
                f.write(b"."); time.sleep(0.005)
    # The child has no CUDA state: the fake driver reads that from its environment.
    env = {k: v for k, v in os.environ.items() if k != "JGS_FAKE_CUDA"}
    child_code = ("import sys, time\\nf = open(sys.argv[1], 'ab', buffering=0)\\n"
                  "while True:\\n    f.write(b'.'); time.sleep(0.005)")
    child = subprocess.Popen([sys.executable, "-c", child_code, sys.argv[2]], env=env)
    threading.Thread(target=tick, args=(sys.argv[1],), daemon=True).start()
    while True:
        time.sleep(0.01)
""")


@dataclass
class Target:
    proc: subprocess.Popen[bytes]
    thread_ticks: Path
    child_ticks: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ticking(self) -> bool:
        """Whether both the thread and the child process move on."""
        before = (self.thread_ticks.stat().st_size, self.child_ticks.stat().st_size)
        time.sleep(0.3)
        after = (self.thread_ticks.stat().st_size, self.child_ticks.stat().st_size)
        return after[0] > before[0] and after[1] > before[1]

    def still(self) -> bool:
        before = (self.thread_ticks.stat().st_size, self.child_ticks.stat().st_size)
        time.sleep(0.3)
        return (self.thread_ticks.stat().st_size, self.child_ticks.stat().st_size) == before


@pytest.fixture
def target(tmp_path: Path) -> Iterator[Target]:
    ticks, child_ticks = tmp_path / "thread", tmp_path / "child"
    ticks.touch()
    child_ticks.touch()
    proc = subprocess.Popen([sys.executable, "-c", TARGET, str(ticks), str(child_ticks)],
                            env={**os.environ, **fake_cuda_env(4 * GIB)})
    found = Target(proc, ticks, child_ticks)
    deadline = time.monotonic() + 10
    while not (ticks.stat().st_size and child_ticks.stat().st_size):
        assert time.monotonic() < deadline, "the target never ticked"
        time.sleep(0.05)
    yield found
    procfs.kill_tree(proc.pid)
    proc.wait()


@pytest.fixture
def driver() -> FakeCudaDriver:
    return FakeCudaDriver()


@pytest.fixture
def sleep(driver: FakeCudaDriver, tmp_path: Path) -> GpuSleep:
    base = Path("/tmp") if len(str(tmp_path)) > 60 else tmp_path
    return GpuSleep(driver, holders_dir(base), lock_timeout=1.0)


def held_as_the_driver_wants(target: Target, driver: FakeCudaDriver) -> bool:
    """Every thread of the tree is in a ptrace stop, but the driver's restore thread."""
    restore_tid = driver.restore_thread_id(target.pid)
    for proc in procfs.tree(target.pid):
        for tid, state in procfs.thread_states(proc.pid).items():
            if tid != restore_tid and state != "t":
                return False
    return True


def sleeping(target: Target, driver: FakeCudaDriver, sleep: GpuSleep) -> bool:
    return (driver.state(target.pid) == ProcessState.CHECKPOINTED
            and sleep.asleep(target.pid) is not None
            and held_as_the_driver_wants(target, driver) and target.still())


def running(target: Target, driver: FakeCudaDriver, sleep: GpuSleep) -> bool:
    return (driver.state(target.pid) == ProcessState.RUNNING
            and sleep.asleep(target.pid) is None and target.ticking())


def test_release_then_wake_holds_every_thread_and_lets_them_all_run_again(
    target: Target, driver: FakeCudaDriver, sleep: GpuSleep,
) -> None:
    released = sleep.release(target.pid)
    assert released.held_threads >= 3  # the main and ticking threads, the child
    assert set(released.timings) == {"lock", "hold", "checkpoint"}
    assert sleeping(target, driver, sleep)
    woken = sleep.wake(target.pid)
    assert {"restore", "unlock", "run"} <= set(woken.timings)
    assert running(target, driver, sleep)
    assert driver.ops(target.pid) == ["lock", "checkpoint", "restore", "unlock"]
    assert driver.protocol_breaches() == []
    # And again: a kernel sleeps as often as it idles.
    sleep.release(target.pid)
    assert sleeping(target, driver, sleep)
    sleep.wake(target.pid)
    assert running(target, driver, sleep)
    assert driver.protocol_breaches() == []


def test_a_killed_holder_takes_the_kernel_with_it_never_left_running_checkpointed(
    target: Target, driver: FakeCudaDriver, sleep: GpuSleep,
) -> None:
    sleep.release(target.pid)
    status = sleep.asleep(target.pid)
    assert status is not None
    holder_pid = int(status["holder_pid"])
    os.kill(holder_pid, signal.SIGTERM)  # ignored: only SIGKILL ends a holder
    assert sleeping(target, driver, sleep)
    child = procfs.tree(target.pid)[1].pid
    os.kill(holder_pid, signal.SIGKILL)
    assert target.proc.wait(timeout=10) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while procfs.tree_alive(child):
        assert time.monotonic() < deadline, "the held child process outlived its holder"
        time.sleep(0.05)
    assert driver.protocol_breaches() == []


@dataclass
class Failure:
    op: str
    code: int
    times: int
    step: str


RELEASE_FAILURES = [
    Failure("lock", CUDA_ERROR_UNKNOWN, 1, "release the GPU"),
    Failure("checkpoint", CUDA_ERROR_UNKNOWN, 1, "release the GPU"),
]


@pytest.mark.parametrize("failure", RELEASE_FAILURES, ids=lambda f: f.op)
def test_a_release_that_fails_leaves_the_kernel_running_with_its_gpu(
    target: Target, driver: FakeCudaDriver, sleep: GpuSleep, failure: Failure,
) -> None:
    driver.fail(failure.op, failure.code, failure.times)
    with pytest.raises(SnapshotError) as raised:
        sleep.release(target.pid)
    assert raised.value.step == failure.step
    assert failure.op in str(raised.value.cause).lower()
    assert running(target, driver, sleep)
    assert driver.protocol_breaches() == []


def test_a_wake_without_gpu_memory_leaves_the_kernel_asleep_then_wakes_later(
    target: Target, driver: FakeCudaDriver, sleep: GpuSleep,
) -> None:
    sleep.release(target.pid)
    driver.fail("restore", CUDA_ERROR_OUT_OF_MEMORY, times=3)
    with pytest.raises(SnapshotError) as raised:
        sleep.wake(target.pid)
    assert "sleeps on" in raised.value.cause
    assert "not enough free memory" in (raised.value.hint or "")
    assert sleeping(target, driver, sleep)
    sleep.wake(target.pid)
    assert running(target, driver, sleep)
    assert driver.protocol_breaches() == []


def test_a_process_without_cuda_state_has_no_gpu_to_release(
    sleep: GpuSleep, tmp_path: Path,
) -> None:
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(NotReady, match="holds no CUDA state"):
            sleep.release(plain.pid)
        assert sleep.asleep(plain.pid) is None
    finally:
        plain.kill()
        plain.wait()


def test_a_node_short_of_host_memory_refuses_the_release_before_touching_the_kernel(
    target: Target, driver: FakeCudaDriver, sleep: GpuSleep,
) -> None:
    short = GpuSleep(driver, sleep.holders, 1.0, read_inventory=FakeGpus(driver),
                     memory_available=lambda: 2 * GIB)
    with pytest.raises(NotReady) as refused:
        short.release(target.pid)
    assert "4.0 GiB of GPU memory would move into host memory" in refused.value.cause
    assert "2.0 GiB of it is available" in refused.value.cause
    assert "process tier" in (refused.value.hint or "")
    assert driver.ops(target.pid) == []
    assert running(target, driver, sleep)


def test_hand_over_stops_the_tree_and_hold_stopped_puts_it_back_to_sleep(
    target: Target, driver: FakeCudaDriver, sleep: GpuSleep,
) -> None:
    """The move to the process tier: criu takes the tree from the holder stopped, and a
    dump that fails gives it back, without any of its threads running in between."""
    sleep.release(target.pid)
    sleep.hand_over(target.pid)
    assert sleep.asleep(target.pid) is None
    assert procfs.tree_stopped(target.pid) and target.still()
    assert driver.state(target.pid) == ProcessState.CHECKPOINTED
    sleep.hold_stopped(target.pid, {"kernel_id": "k"})
    assert sleeping(target, driver, sleep)
    assert sleep.asleep(target.pid)["kernel_id"] == "k"  # type: ignore[index]
    sleep.wake(target.pid)
    assert running(target, driver, sleep)
    assert driver.ops(target.pid) == ["lock", "checkpoint", "restore", "unlock"]
    assert driver.protocol_breaches() == []


def test_recovery_holds_a_tree_its_dump_left_stopped_before_waking_it(
    target: Target, driver: FakeCudaDriver, sleep: GpuSleep, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A saver killed after the hand-over: the server's next start wakes the kernel, held
    until its CUDA state runs again."""
    from jupyter_gpu_snapshot.core import recovery
    from jupyter_gpu_snapshot.node import local_engine

    monkeypatch.setattr(recovery, "work_base", lambda: sleep.holders.parent)
    monkeypatch.setattr(local_engine, "work_base", lambda: sleep.holders.parent)
    sleep.release(target.pid)
    sleep.hand_over(target.pid)
    assert local_engine.wake_kernel(target.pid, driver.status) == []
    assert running(target, driver, sleep)
    assert driver.protocol_breaches() == []
