"""The notebook of a kernel that died hears of it inside the blank kernel that replaced it:
``%gpu_snapshot status`` and the ``%gpu_snapshot widget`` panel say what killed the kernel
and which snapshot brings it back, and the panel's Dismiss makes the server forget it.

A real ``jupyter server`` subprocess with real python3-snapshot kernels, killed with a
real SIGSEGV.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import psutil

from jupyter_gpu_snapshot.core import procfs
from testkit.magic_fixtures import JupyterServer, NotebookKernel, jupyter_server
from tests.kernel.test_widget import (
    PANEL,
    click_through_comm,
    comm_ids,
    panel_state,
    show_panel,
    wait_panel,
)

__all__ = ["jupyter_server"]  # the fixture, imported for pytest

DEATH_SECONDS = 90.0


def kill_kernel(server: JupyterServer, kernel_id: str) -> None:
    """SIGSEGV to the kernel process under the namespace init of kernel ``kernel_id``."""
    connection = str(server.runtime / f"kernel-{kernel_id}.json")
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        # The init runs nsinit.py itself; its unshare launcher only names it.
        is_init = len(cmdline) > 3 and cmdline[3].endswith("nsinit.py")
        if is_init and connection in cmdline:
            kernel = procfs.kernel_of(proc.pid)
            assert kernel is not None and kernel.pid != proc.pid
            os.kill(kernel.pid, signal.SIGSEGV)
            return
    raise AssertionError(f"no namespace init runs kernel {kernel_id}")


def wait_death(server: JupyterServer, kernel_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + DEATH_SECONDS
    while True:
        death = server.get(f"gpu-snapshot/kernels/{kernel_id}/status")["death"]
        if death is not None:
            return dict(death)
        assert time.monotonic() < deadline, f"kernel {kernel_id}: no death recorded"
        time.sleep(0.2)


def blank_kernel(server: JupyterServer, notebook: NotebookKernel) -> NotebookKernel:
    """The notebook, connected to the kernel the restarter started in the slot.

    Killed early in its life, a kernel comes back on new ports, written to its connection
    file once it runs: connect until the new kernel answers.
    """
    deadline = time.monotonic() + DEATH_SECONDS
    while True:
        try:
            client = server.connect(notebook.kernel_id, timeout=10)
            break
        except RuntimeError:
            assert time.monotonic() < deadline, "the blank kernel never answered"
    return NotebookKernel(server, notebook.path, notebook.session_id, notebook.kernel_id, client)


def test_the_blank_kernel_tells_of_the_death_and_its_snapshot(
    jupyter_server: JupyterServer,
) -> None:
    saved = jupyter_server.open_notebook("death-saved.ipynb")
    bare = jupyter_server.open_notebook("death-bare.ipynb")
    saved.ok("weights = [1, 2, 3]")
    job = jupyter_server.wait_job(
        jupyter_server.start_save(saved.kernel_id, "before-crash")["id"]
    )
    assert job["status"] == "succeeded", job

    kill_kernel(jupyter_server, saved.kernel_id)
    kill_kernel(jupyter_server, bare.kernel_id)
    assert wait_death(jupyter_server, saved.kernel_id)["snapshot"]["name"] == "before-crash"
    assert wait_death(jupyter_server, bare.kernel_id)["snapshot"] is None

    saved = blank_kernel(jupyter_server, saved)
    assert saved.ok("print('weights' in globals())").strip() == "False"
    status = saved.ok("%gpu_snapshot status")
    assert status.startswith(
        "The kernel died (killed by signal 11, SIGSEGV) just now and was restarted without "
        "its state. Its newest snapshot 'before-crash', from just now, can bring it back.\n"
        "  %gpu_snapshot restore before-crash\n"
    ), status
    bare = blank_kernel(jupyter_server, bare)
    assert "and was restarted without its state. There is no snapshot of it to restore." in \
        bare.ok("%gpu_snapshot status")

    cell = show_panel(saved)
    state = panel_state(saved)
    death = saved.ok(f"{PANEL}; print(p.death.value); print(p.death_box.layout.display); "
                     "print(p.death_restore_button.layout.display)").splitlines()
    assert "killed by signal 11, SIGSEGV" in death[0] and "before-crash" in death[0], death
    assert death[1:] == ["flex", ""], death
    assert state["error"] == ""
    show_panel(bare)
    assert bare.ok(f"{PANEL}; print(p.death_box.layout.display, "
                   "p.death_restore_button.layout.display)").strip() == "flex none"

    # Dismiss, clicked as JupyterLab sends it: the notice goes, here and on the server.
    click_through_comm(saved.client, comm_ids(cell)[("ButtonModel", "Dismiss")])
    wait_panel(saved, "p.death_box.layout.display == 'none'")
    status_now = jupyter_server.get(f"gpu-snapshot/kernels/{saved.kernel_id}/status")
    assert status_now["death"] is None
    assert not saved.ok("%gpu_snapshot status").startswith("The kernel died")
    # The other notebook's notice is its own.
    assert jupyter_server.get(f"gpu-snapshot/kernels/{bare.kernel_id}/status")["death"]
