"""The node reboot flow with real server processes: SIGTERM saves the kernels, the next
server lists those snapshots for their notebooks and restores one into the notebook."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

from testkit.processes import kernel_processes

from .conftest import NOTEBOOK, ServerProcesses


async def test_sigterm_saves_kernels_and_the_next_server_restores_them(
    server_processes: ServerProcesses,
) -> None:
    node = server_processes
    first = await node.start("before")
    kernel_id, ws = await first.open_notebook_kernel(node.kernel_ids)
    await ws.execute("trained = {'epoch': 12, 'loss': 0.125}")
    ws.close()

    # What systemd does when the node shuts down.
    first.proc.send_signal(signal.SIGTERM)
    assert await first.exited() == 0, first.log
    assert "gpu-snapshot: saved kernel" in first.log, first.log
    assert kernel_processes(kernel_id) == []

    # The next boot: a new server process with the same configuration.
    second = await node.start("after")
    listed = await second.api.snapshots(notebook_path=NOTEBOOK)
    assert len(listed) == 1, listed
    snapshot = listed[0]
    assert snapshot["reason"] == "shutdown" and snapshot["kernel"]["kernel_id"] == kernel_id

    new_id = await second.restore_into_notebook(snapshot["id"], node.kernel_ids)
    ws = await second.kernel(new_id)
    assert (await ws.execute("print(trained['epoch'], trained['loss'])")).split() == [
        "12", "0.125",
    ]
    ws.close()

    # `jupyter server stop` takes the same way out and saves the restored kernel.
    stop = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "jupyter_server", "stop", str(second.port)],
        env=node.env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert stop.returncode == 0, stop.stderr
    await second.exited()
    assert kernel_processes(new_id) == []
    store = node.store()
    saved = store.list(NOTEBOOK)
    assert [s.manifest["kernel"]["kernel_id"] for s in saved] == [kernel_id, new_id]
    for s in saved:
        store.verify(s)
