"""A kernel that dies right after its save, through a real server: the save's job fails
naming the death, the complete snapshot is listed with the warning, and the notebook is
told the kernel died and offered that snapshot.

criu dumps the kernel for real and leaves it running; then the kernel gets SIGSEGV, as a JAX
kernel did when its threads ran while CUDA was checkpointed.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpu_snapshot.core.store import SnapshotStore
from testkit.criu_wrappers import install, signals_the_kernel_after_the_dump

from .conftest import Api, Json, KernelConnector
from .test_kernel_death import wait_death


@pytest.fixture
def criu_path(tmp_path: Path) -> str:
    return install(tmp_path, signals_the_kernel_after_the_dump(signal.SIGSEGV))


@pytest.fixture
def server_config() -> Json:
    # The restarter looks every half second instead of every 3 s.
    return {"KernelRestarter": {"time_to_dead": 0.5}}


# The commit as it comes, and one that lands seconds after the restarter saw the death
# (as on a loaded machine): the death is offered the snapshot either way.
COMMIT_DELAYS = {"commit as it comes": 0.0, "commit after the death is seen": 3.0}


@pytest.mark.parametrize("commit", COMMIT_DELAYS)
async def test_a_kernel_dying_after_its_save_fails_the_job_keeps_the_image_and_tells_the_notebook(
    api: Api, kernel_socket: KernelConnector, jp_serverapp: Any,
    monkeypatch: pytest.MonkeyPatch, commit: str,
) -> None:
    commit_snapshot = SnapshotStore.commit

    def later_commit(store: SnapshotStore, *args: Any, **kwargs: Any) -> Any:
        time.sleep(COMMIT_DELAYS[commit])  # in the save's worker thread
        return commit_snapshot(store, *args, **kwargs)

    monkeypatch.setattr(SnapshotStore, "commit", later_commit)
    kernel_id = (await api.open_notebook("work/crash.ipynb"))["kernel"]["id"]
    await (await kernel_socket(kernel_id)).execute("weights = [1, 2, 3]")

    job = await api.wait(await api.save(kernel_id, name="last-words"))
    assert job["status"] == "failed", job
    said = r"the kernel died \d+\.\d s after its dump: killed by signal 11 \(SIGSEGV\)"
    assert job["error"]["step"] == "resume" and re.fullmatch(said, job["error"]["cause"]), job
    # The image is whole and listed, and says what happened to its kernel.
    listed = await api.snapshots()
    assert [s["name"] for s in listed] == ["last-words"]
    assert listed[0]["warnings"] == [job["error"]["cause"]]

    # The notebook is told, and offered that snapshot; the slot holds a blank kernel.
    death = (await wait_death(api, kernel_id))["death"]
    assert death["cause"] == "killed by signal 11 (SIGSEGV)" and death["restarted"] is True
    assert death["snapshot"]["name"] == "last-words"
    ws = await kernel_socket(kernel_id)
    assert (await ws.execute("print('weights' in globals())", timeout=90)).strip() == "False"
