"""The notebooks of notebooks/, executed cell by cell as a reader would run them.

Every cell runs with nbclient in a ``python3-snapshot`` kernel that a real ``jupyter server``
with the extension started for the notebook's session, so ``%gpu_snapshot`` and the REST
calls reach the server as they do from JupyterLab. Where a notebook asks the reader to act
in JupyterLab (a markdown cell tagged ``restore-here`` or ``reboot-here``), the test does
the same through the REST API that JupyterLab uses, then runs the rest of the cells in the
restored kernel. A cell that raises fails the test; the executed notebooks are written to
test-artifacts/notebooks/.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nbformat
import pytest
from jupyter_client.asynchronous import AsyncKernelClient
from nbclient import NotebookClient

from testkit.gpu_check import no_gpu_reason
from testkit.jupyter_processes import JupyterProcess, JupyterStarter, jupyter_processes

__all__ = ["jupyter_processes"]  # the fixture, imported for pytest

REPO = Path(__file__).parents[2]
NOTEBOOKS = REPO / "notebooks"
ARTIFACTS = REPO / "test-artifacts" / "notebooks"
KERNEL = "python3-snapshot"


class NotebookRun:
    """One notebook of notebooks/, run in the kernels of ``server`` as JupyterLab would."""

    def __init__(self, server: JupyterProcess, name: str, cell_timeout: int = 300) -> None:
        self.server = server
        self.path = name  # relative to the server's root, as JupyterLab names it
        shutil.copy(NOTEBOOKS / name, server.root / name)
        self.nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        self.client = NotebookClient(
            self.nb, timeout=cell_timeout, kernel_name=KERNEL, interrupt_on_timeout=False,
            resources={"metadata": {"path": str(server.root)}},
        )
        self.client.reset_execution_trackers()
        self.next_cell = 0
        self.kernel_id: str | None = None

    def new_session(self) -> dict[str, Any]:
        """What opening the notebook in JupyterLab does: a session with a fresh kernel."""
        session: dict[str, Any] = self.server.request(
            "POST", "api/sessions",
            {"path": self.path, "type": "notebook", "name": self.path, "kernel": {"name": KERNEL}},
        )
        return session

    def open(self) -> str:
        """Open the notebook and connect to its fresh kernel."""
        kernel_id = str(self.new_session()["kernel"]["id"])
        self.attach(kernel_id)
        return kernel_id

    def attach(self, kernel_id: str) -> None:
        """Connect the notebook client to a kernel of the server (fresh or restored)."""
        if self.client.kc is not None:
            self.client.kc.stop_channels()
        connection_file = self.server.runtime_dir / f"kernel-{kernel_id}.json"
        kc = AsyncKernelClient()
        kc.load_connection_file(str(connection_file))
        # No heartbeat: it gives a kernel 1 s to answer its first ping, and a GPU kernel just
        # restored may take longer while its pages come back; a dead one still times out.
        kc.start_channels(hb=False)
        asyncio.run(kc.wait_for_ready(timeout=60))
        self.client.kc = kc
        self.kernel_id = kernel_id

    def run_until(self, tag: str | None = None) -> None:
        """Run the code cells up to the cell tagged ``tag`` (or to the end)."""
        cells = self.nb.cells
        while self.next_cell < len(cells):
            cell = cells[self.next_cell]
            if tag is not None and tag in cell.metadata.get("tags", []):
                self.next_cell += 1
                return
            if cell.cell_type == "code":
                asyncio.run(self.client.async_execute_cell(cell, self.next_cell))
            self.next_cell += 1
        if tag is not None:
            raise AssertionError(f"{self.path} has no cell tagged {tag!r}")

    def shut_down(self) -> None:
        """Kernel > Shut Down Kernel: the session and its kernel go."""
        for session in self.server.get("api/sessions"):
            if session["path"] == self.path:
                self.server.request("DELETE", f"api/sessions/{session['id']}")
        if self.client.kc is not None:
            self.client.kc.stop_channels()
            self.client.kc = None

    def restore(self, snapshot_id: str, **body: Any) -> dict[str, Any]:
        """The restore dialog: restore into this notebook; connect to the restored kernel."""
        job = self.server.request("POST", f"gpu-snapshot/snapshots/{snapshot_id}/restore", body)
        job = self.server.wait_job(job)
        assert job["status"] == "succeeded", job["error"]
        self.attach(job["result"]["kernel_id"])
        return job

    def outputs(self) -> str:
        """All text the executed cells printed or returned."""
        texts = []
        for cell in self.nb.cells:
            for output in cell.get("outputs", []):
                if "text" in output:
                    texts.append(output["text"])
                elif "data" in output:
                    texts.append(output["data"].get("text/plain", ""))
        return "\n".join(texts)

    def save(self) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / self.path
        nbformat.write(self.nb, path)
        return path

    def close(self) -> None:
        if self.client.kc is not None:
            self.client.kc.stop_channels()

    def __enter__(self) -> NotebookRun:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Disconnects, and keeps the notebook as far as it ran, failed or not."""
        self.close()
        self.save()


@pytest.fixture
def jupyter_server(jupyter_processes: JupyterStarter) -> Callable[..., JupyterProcess]:
    def start(name: str, config: str = "") -> JupyterProcess:
        return jupyter_processes(ARTIFACTS / f"{name}-server.log", app="server", config=config)

    return start


def snapshots_of(server: JupyterProcess, path: str) -> list[dict[str, Any]]:
    listing = server.get(f"gpu-snapshot/snapshots?notebook_path={path}")["snapshots"]
    return [s for s in listing if s["notebook_path"] == path]


@pytest.mark.timeout(240)
def test_quickstart_saves_breaks_and_restores(jupyter_server: Any) -> None:
    server = jupyter_server("01-quickstart")
    with NotebookRun(server, "01-quickstart.ipynb") as run:
        first_kernel = run.open()
        run.run_until("restore-here")
        saved = snapshots_of(server, run.path)
        assert len(saved) == 1
        assert "scores now: {}" in run.outputs()
        # What the notebook asks of the reader: shut the kernel down, restore from the dialog.
        run.shut_down()
        job = run.restore(saved[0]["id"], path=run.path)
        assert job["result"]["kernel_id"] != first_kernel
        run.run_until()
    out = run.outputs()
    assert "scores are back: {" in out
    assert "the random generator goes on where it was at the snapshot" in out
    assert "restored from a snapshot" in out  # the closing %gpu_snapshot status


@pytest.mark.timeout(240)
def test_api_and_cli_notebook_runs(jupyter_server: Any) -> None:
    server = jupyter_server("03-api-and-cli")
    with NotebookRun(server, "03-api-and-cli.ipynb") as run:
        run.open()
        run.run_until()
    out = run.outputs()
    assert "phases seen: preflight" in out
    assert "DELETE: 204" in out
    assert server.get("gpu-snapshot/snapshots")["snapshots"] == []




GPU_REASON = no_gpu_reason()


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.skipif(GPU_REASON is not None, reason=f"GPU notebook: {GPU_REASON}")
def test_pytorch_training_survives_a_server_restart(jupyter_server: Any) -> None:
    config = "c.GPUSnapshot.snapshot_on_shutdown = True\n"
    server = jupyter_server("02-pytorch-before", config)
    with NotebookRun(
        server, "02-pytorch-training-survives-reboot.ipynb", cell_timeout=600
    ) as run:
        run.open()
        run.run_until("reboot-here")
        run.close()
        # The reader stops the server (as a reboot would) and starts it again.
        assert server.stop() == 0
        server = jupyter_server("02-pytorch-after", config)
        run.server = server
        shutdown = [s for s in snapshots_of(server, run.path) if s["reason"] == "shutdown"]
        assert len(shutdown) == 1, snapshots_of(server, run.path)
        # Opening the notebook starts a fresh kernel; "Restore" in the offer replaces it.
        fresh = run.new_session()
        run.restore(shutdown[0]["id"], path=run.path, session_id=fresh["id"])
        run.run_until()
    assert "losses after the restore match the uninterrupted run" in run.outputs()
    if os.environ.get("JGS_GPU_RESULTS"):
        print(run.outputs())
