"""The running-cell scenario of ``%gpu_snapshot save`` with CUDA state, on a real GPU.

The same scenario as in test_magic.py, with a PyTorch tensor on the GPU: the CUDA driver
locks and checkpoints the process while the cell waits in the magic, the original keeps
computing on the GPU afterwards, and a restored copy wakes up in the wait, says which
snapshot it came from, and still has its tensor on the GPU. Skipped, with the reason shown,
only where there is no NVIDIA driver.
"""

from __future__ import annotations

import json
import re

import pytest

from testkit.gpu_check import no_gpu_reason
from testkit.magic_fixtures import JupyterServer, NotebookKernel, jupyter_server, ok
from tests.kernel.test_magic import SAVE_IN_A_CELL, SAVED, _restore_alone, notebook

__all__ = ["jupyter_server", "notebook"]  # fixtures, imported for pytest




pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(no_gpu_reason() is not None, reason=f"GPU test: {no_gpu_reason()}"),
]

CUDA_STATE = """
import torch
x = torch.arange(50_000_000, device="cuda", dtype=torch.float32)  # 200 MB on the GPU
def checksum():
    return float(x.double().sum().item())  # computed on the GPU
expected = checksum()
print(torch.cuda.memory_allocated() >> 20)
"""


def test_save_from_a_running_cell_with_cuda_state_and_its_restored_copy(
    jupyter_server: JupyterServer, notebook: NotebookKernel
) -> None:
    assert int(notebook.ok(CUDA_STATE, timeout=300)) >= 190
    status = notebook.ok("%gpu_snapshot status")
    assert f"Kernel {notebook.kernel_id}: ready to snapshot." in status, status
    cuda_line = next(line for line in status.splitlines() if line.startswith("CUDA:"))
    assert cuda_line != "CUDA: not in use by this kernel.", status

    cell = notebook.run(SAVE_IN_A_CELL.format(args="gpu-mid-cell"), timeout=300)
    assert cell.status == "ok", cell
    saved = SAVED.search(cell.stdout)
    assert saved, cell.stdout
    # The original computes on the GPU again, with its tensor intact.
    assert notebook.ok("print(checksum() == expected, cell_finished)") == "True True\n"
    print(f"status: {status!r}\nsave: {cell.stdout!r}")

    jupyter_server.shutdown_kernel(notebook.kernel_id)  # the copy needs its ports
    job = _restore_alone(jupyter_server, saved["id"])
    copy = jupyter_server.connect(str(job["result"]["kernel_id"]))
    seen = json.loads(ok(
        copy,
        "import json; print(json.dumps([cap.stdout.splitlines(), checksum() == expected, "
        "woke]))",
        timeout=300,
    ))
    assert seen[0][-1] == (
        f"This kernel was restored from snapshot {saved['id']} (gpu-mid-cell), "
        "taken while this cell waited for it."
    )
    assert seen[1] is True
    assert float(job["started"]) <= float(seen[2]) <= float(job["finished"]) + 1.0
    status = ok(copy, "%gpu_snapshot status")
    assert re.search(r"restored from a snapshot of kernel", status), status
    print(f"restored status: {status!r}")
