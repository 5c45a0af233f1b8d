"""The snapshot-ready provisioner behaves like the default one, and launches kernels the
way a restore needs them: own PID namespace, own session, no parent polling, no pipes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from jupyter_gpu_snapshot._constants import KERNEL_DEATH_PREFIX
from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.launch import nsinit
from jupyter_gpu_snapshot.launch.provisioner import (
    NSINIT,
    AdoptedProcess,
    namespaced_command,
    wait_for_namespace_init,
)
from testkit.pid_taker import take_pid
from tests.conftest import KernelError, KernelHandle, reply_to, start_kernel, wait_for_output


def _nspid(pid: int) -> list[str]:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return line.split()[1:]
    return []


def test_kernel_runs_under_its_own_namespace_init(kernel: KernelHandle):
    root, kpid = kernel.root_pid, kernel.kernel_pid
    low, high = nsinit.KERNEL_PIDS
    assert _nspid(root)[-1] == "1" and low <= int(_nspid(kpid)[-1]) < high
    assert procfs.pid_namespace(kpid) != procfs.pid_namespace(os.getpid())
    # The init leads its own session inside the namespace; the kernel lives in it.
    assert os.getsid(root) == root and os.getsid(kpid) == root
    assert "JPY_PARENT_PID" not in psutil.Process(kpid).environ()
    inspected = procfs.inspect_kernel(kpid)
    assert inspected.ready, inspected.problems
    assert inspected.root_pid == root
    log = kernel.km.provisioner.log_path
    kernel.execute("import sys; print('to-the-log', file=sys.__stderr__, flush=True)")
    deadline = time.monotonic() + 60
    while "to-the-log" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "to-the-log" in log.read_text()


def test_interrupt_reaches_the_kernel(kernel: KernelHandle):
    # Not stop_on_error: ipykernel would abort a request that reached it before it noticed
    # the interrupted cell's error reply had gone out.
    msg_id = kernel.client.execute("import time; print('started', flush=True); time.sleep(600)",
                                   stop_on_error=False)
    wait_for_output(kernel.client, msg_id, "started")
    kernel.km.interrupt_kernel()
    reply = reply_to(kernel.client, msg_id)
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    assert "2" in kernel.execute("print(1 + 1)")


def test_restart_gives_a_fresh_kernel_and_ends_the_old_tree(kernel: KernelHandle):
    kernel.execute("marker = 'old'")
    old_root = kernel.root_pid
    kernel.km.restart_kernel(now=True)
    kernel.client.wait_for_ready(timeout=60)
    assert kernel.root_pid != old_root
    assert not procfs.tree_alive(old_root)
    with pytest.raises(KernelError, match="NameError"):
        kernel.execute("print(marker)")


def test_shutdown_and_kill_leave_nothing_running(kernel: KernelHandle):
    root, kpid = kernel.root_pid, kernel.kernel_pid
    launcher = kernel.km.provisioner.process.pid
    kernel.client.stop_channels()
    kernel.km.shutdown_kernel()
    for pid in (root, kpid, launcher):
        assert not procfs.tree_alive(pid), pid

    other = start_kernel()
    root, launcher = other.root_pid, other.km.provisioner.process.pid
    other.client.stop_channels()
    other.km.shutdown_kernel(now=True)  # the kill path
    assert not procfs.tree_alive(root) and not procfs.tree_alive(launcher)


def test_the_kernel_log_says_what_ended_the_kernel(kernel: KernelHandle):
    log = kernel.km.provisioner.log_path
    os.kill(kernel.kernel_pid, signal.SIGSEGV)
    expected = f"{KERNEL_DEATH_PREFIX}killed by signal 11 (SIGSEGV)"
    # nsinit writes the line as it reaps the kernel, then exits with the namespace; its
    # parent, unshare, may have reaped it already.
    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(kernel.root_pid).wait(timeout=30)
    assert log.read_text().splitlines()[-1] == expected


def test_nsinit_keeps_the_death_prefix_of_the_package():
    from jupyter_gpu_snapshot.launch import nsinit

    assert nsinit.DEATH_PREFIX == KERNEL_DEATH_PREFIX
    assert nsinit.describe_end(3) == "exited with status 3"


def test_a_child_gone_while_listed_does_not_end_the_wait_for_the_init(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The launcher's children are listed, then each is asked its command line: one that
    ended in between (unshare's own fork, say) is no failure of the launch."""
    ended = subprocess.Popen(["sleep", "60"])
    gone = psutil.Process(ended.pid)
    ended.kill()
    ended.wait()
    listed = psutil.Process.children

    def with_one_gone(self: psutil.Process, recursive: bool = False) -> list[psutil.Process]:
        return [gone, *listed(self, recursive=recursive)]

    monkeypatch.setattr(psutil.Process, "children", with_one_gone)
    launcher = subprocess.Popen(namespaced_command(
        [sys.executable, "-c", "import time; time.sleep(120)"], tmp_path / "kernel.log"))
    try:
        init = wait_for_namespace_init(launcher.pid, timeout=30)
        assert str(NSINIT) in psutil.Process(init).cmdline()
        psutil.Process(init).kill()
        launcher.wait(timeout=30)
    finally:
        launcher.kill()
        launcher.wait()


def test_an_ended_trees_pid_taken_by_another_process_is_not_the_kernel(kernel: KernelHandle):
    """A kernel's tree is held as the process it was: once it ended and a stranger got its
    pid (as a pid wrap gives it), the stranger is neither seen as the kernel nor killed with
    it, whether the tree was launched here or adopted."""
    root = kernel.root_pid
    adopted = AdoptedProcess(root, procfs.held(root))
    kernel.client.stop_channels()
    psutil.Process(root).kill()
    kernel.km.provisioner.process.wait(timeout=30)
    stranger = take_pid(root, ["/bin/sleep", "600"])
    try:
        assert adopted.poll() == 0
        with pytest.raises(ProcessLookupError):
            adopted.kill()
        kernel.km.shutdown_kernel(now=True)
        assert stranger.is_running() and stranger.status() != psutil.STATUS_ZOMBIE
    finally:
        stranger.kill()
