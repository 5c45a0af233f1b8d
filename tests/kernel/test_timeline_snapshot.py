"""The timeline across a process snapshot: a snapshot-ready kernel saved and stopped, then
restored, keeps its timeline (it lives in the kernel's memory, which the image carries), and
a rewind in the restored kernel goes back past the save, to before a cell that ran before it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from jupyter_gpu_snapshot._constants import REWIND_REPLY, REWIND_REQUEST
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from tests.conftest import KernelHandle, RestoredTrees, run, start_kernel, stop_kernel
from tests.kernel.test_cell_record import request
from tests.kernel.test_timeline import cell, state

pytestmark = pytest.mark.timeout(240)

FIRST = """
import numpy as np, pandas as pd
x = 1
items = [1]
arr = np.arange(4.0)
frame = pd.DataFrame({"a": [1, 2]})
"""


@pytest.fixture
def kernel() -> Iterator[KernelHandle]:
    handle = start_kernel(env={"JUPYTER_GPU_SNAPSHOT_TIMELINE": "on"})
    try:
        yield handle
    finally:
        stop_kernel(handle)


def test_a_restored_kernel_rewinds_past_the_save_it_came_from(
        engine: SnapshotEngine, kernel: KernelHandle, restored: RestoredTrees) -> None:
    cell(kernel.client, FIRST)
    before = state(kernel.client)
    second, _ = cell(kernel.client, "x = 2; items.append(2); arr *= 10; frame['a'] += 1")
    target = SaveTarget(pid=kernel.root_pid, connection_info=kernel.km.get_connection_info(),
                        kernel_name="python3-snapshot")
    snapshot = run(engine.save(target, stop=True))
    kernel.km.provisioner.process.wait(timeout=30)

    back = run(engine.restore(snapshot.id))
    client = restored.connect(back.connection_info, back.pid)
    third, _ = cell(client, "x = 3; items.append(3); del frame")

    reply = request(client, REWIND_REQUEST, {"before": second})
    assert reply["msg_type"] == REWIND_REPLY
    content = reply["content"]
    assert content["status"] == "ok", content
    report = content["report"]
    # The cell run before the save and the one run after the restore are both undone.
    assert report["undone"][0] == second and third in report["undone"], report
    assert "frame" in report["restored"], report
    after = state(client)
    assert after == {**before, "names": after["names"]}, (before, after)
    assert set(before["names"]) <= set(after["names"])
