"""Reading how a kernel ended from the line its namespace init wrote into the kernel's log.

Each scenario runs the real ``nsinit`` (in its own PID namespace, as the provisioner runs
it) over a tiny command that ends the way a kernel might, into one shared log, as a kernel
slot's restarts do.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import psutil

from jupyter_gpu_snapshot._constants import KERNEL_DEATH_PREFIX
from jupyter_gpu_snapshot.core.kernel_log import KernelEnd, kernel_death_cause, log_size
from jupyter_gpu_snapshot.launch.provisioner import namespaced_command, wait_for_namespace_init

SEGFAULT = "import os, signal; print('working', flush=True); os.kill(os.getpid(), signal.SIGSEGV)"


def run_under_nsinit(log: Path, code: str, timeout: float = 60) -> int:
    """Run ``python -c code`` as nsinit's kernel; nsinit's exit status."""
    assert shutil.which("unshare"), "util-linux unshare is needed"
    command = namespaced_command([sys.executable, "-c", code], log)
    return subprocess.run(command, timeout=timeout, check=False).returncode


def test_the_last_end_in_the_log_is_the_cause(tmp_path: Path) -> None:
    log = tmp_path / "kernel.log"
    assert run_under_nsinit(log, SEGFAULT) != 0
    assert kernel_death_cause(log) == "killed by signal 11 (SIGSEGV)"
    assert KernelEnd.parse(kernel_death_cause(log)).to_dict() == {
        "code": "signal", "cause": "killed by signal 11 (SIGSEGV)", "signal": 11,
        "signal_name": "SIGSEGV", "exit_status": None,
    }

    # The slot's next kernel writes to the same log; its end is the one read now.
    second_start = log_size(log)
    run_under_nsinit(log, "print('second kernel'); raise SystemExit(3)")
    assert kernel_death_cause(log) == "exited with status 3"
    assert kernel_death_cause(log, start=second_start) == "exited with status 3"
    end = KernelEnd.parse(kernel_death_cause(log))
    assert (end.code, end.exit_status, end.signal) == ("exit", 3, None)


def test_a_tree_killed_at_once_leaves_no_cause_not_an_older_one(tmp_path: Path) -> None:
    log = tmp_path / "kernel.log"
    run_under_nsinit(log, SEGFAULT)
    start = log_size(log)
    proc = subprocess.Popen(
        namespaced_command([sys.executable, "-c", "import time; time.sleep(120)"], log)
    )
    try:
        init = wait_for_namespace_init(proc.pid, timeout=30)
        psutil.Process(init).kill()  # PID 1 dies first: nobody writes how the kernel ended
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert kernel_death_cause(log, start=start) is None
    # Read from the beginning, the first kernel's end is still there.
    assert kernel_death_cause(log) == "killed by signal 11 (SIGSEGV)"


def test_no_log_no_cause(tmp_path: Path) -> None:
    assert kernel_death_cause(tmp_path / "missing.log") is None
    assert log_size(tmp_path / "missing.log") == 0
    plain = tmp_path / "plain.log"
    plain.write_text("a kernel that was not launched by nsinit\n")
    assert kernel_death_cause(plain) is None
    assert KernelEnd.parse(None).code == "unknown"


def test_a_log_that_is_no_regular_file_is_neither_waited_on_nor_followed(
    tmp_path: Path,
) -> None:
    """The node agent reads a kernel's log as root, in a directory the kernel's user
    writes: a FIFO put there must not hold the reading thread, and a link must not make
    root read the file it points to."""
    fifo = tmp_path / "kernel-fifo.log"
    os.mkfifo(fifo)
    causes: list[str | None] = []
    reader = threading.Thread(target=lambda: causes.append(kernel_death_cause(fifo)),
                              daemon=True)
    reader.start()
    reader.join(timeout=30)
    waited = reader.is_alive()
    if waited:  # a writer lets the blocked open return, so that the thread ends
        with open(fifo, "wb"):
            pass
        reader.join(timeout=30)
    assert not waited, "reading a FIFO at the kernel's log waited for a writer"
    assert causes == [None]

    elsewhere = tmp_path / "not-a-log"
    elsewhere.write_text(f"{KERNEL_DEATH_PREFIX}killed by signal 9 (SIGKILL)\n")
    link = tmp_path / "kernel-link.log"
    link.symlink_to(elsewhere)
    assert kernel_death_cause(link) is None
