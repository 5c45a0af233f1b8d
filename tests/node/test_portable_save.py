"""The portable copy inside the save sequence, on real kernels with real CRIU: a copy is
of one moment (a running cell ends first), a policy's copy that cannot wait is given up
while the save goes on, and a copy the user asked for that cannot be written fails the
save at its step with nothing listed and the kernel running on.

Scenarios as data, as CRIU's zdtm writes them; every run checks that the kernel survived
and what the store lists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.errors import SnapshotError
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.store import PARTIAL_PREFIX
from jupyter_gpu_snapshot.node.save_requests import kernel_history, portable_writer
from tests.conftest import KernelHandle, run

pytestmark = pytest.mark.timeout(120)

# A cell that runs while the save asks for the copy, and changes the state as it ends: once
# the copy waits for it (a copy that may wait), or once the file at {released} exists (the
# test makes it after the save, whose copy gave up meanwhile).
RUNNING_CELL = """
import os, time
from jupyter_gpu_snapshot.kernel import portable_request
while not os.path.exists({released!r}) and not (
        {until_the_copy_waits} and portable_request._GATE._waiting_writers):
    time.sleep(0.01)
stage = 'after the cell'
"""


@dataclass(frozen=True)
class Scenario:
    id: str
    required: bool  # the user asked (the save fails without its copy) or a policy did
    budget_seconds: float | None  # how long the kernel waits for the running cell
    outcome: str  # "copied", "given-up" or "failed"


SCENARIOS = [
    Scenario("asked-waits-for-the-cell", True, None, "copied"),
    Scenario("policy-gives-up", False, 0.5, "given-up"),
    Scenario("asked-cannot-wait", True, 0.5, "failed"),
]


def _until_replied(kernel: KernelHandle, msg_id: str) -> None:
    while kernel.client.get_shell_msg(timeout=30)["parent_header"].get("msg_id") != msg_id:
        pass


def _connection(kernel: KernelHandle) -> dict[str, object]:
    return dict(kernel.km.get_connection_info(session=False))


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.id)
def test_the_copy_is_of_one_moment_or_given_up(
    scenario: Scenario, kernel: KernelHandle, engine: SnapshotEngine, tmp_path: Path
) -> None:
    released = tmp_path / "released"
    kernel.execute("stage = 'before the cell'; numbers = list(range(1000))")
    info = _connection(kernel)
    history = run(kernel_history(info))
    assert history is not None and history["cells"][-1]["defined"] == ["stage", "numbers"]
    # Sent without waiting for it: the save asks while the cell runs.
    cell = kernel.client.execute(RUNNING_CELL.format(
        released=str(released), until_the_copy_waits=scenario.budget_seconds is None))
    try:
        target = SaveTarget(pid=kernel.root_pid, history=history,
                            portable=portable_writer(info, scenario.budget_seconds),
                            portable_required=scenario.required)
        if scenario.outcome == "failed":
            with pytest.raises(SnapshotError) as failed:
                run(engine.save(target, name=scenario.id))
            assert failed.value.step == "portable" and "CellStillRunning" in str(failed.value)
            snapshot = None
        else:
            snapshot = run(engine.save(target, name=scenario.id))
    finally:
        released.touch()
        _until_replied(kernel, cell)
    # The kernel survived whatever happened, and answers.
    assert kernel.execute("print(stage, len(numbers))").strip() == "after the cell 1000"
    listed = engine.list()
    if snapshot is None:
        assert listed == []
        assert not [p for p in engine.store.root.iterdir() if p.name.startswith(PARTIAL_PREFIX)]
        return
    assert [s.id for s in listed] == [snapshot.id]
    portable_files = [name for name in snapshot.manifest["files"] if name.startswith("portable.")]
    if scenario.outcome == "given-up":
        assert "portable" not in snapshot.manifest and portable_files == []
        assert any("no portable copy" in w for w in snapshot.manifest["warnings"])
        return
    assert snapshot.summary()["fallback"] == ["portable", "replay", "both"]
    assert set(portable_files) == set(snapshot.manifest["portable"]["files"])
    # Of one moment: the cell had ended when the copy was written.
    with engine.portable_files(snapshot) as directory:
        pickled = [name for name in portable_files if ".stage." in name]
        assert pickled, portable_files
        report = json.loads((directory / "portable.report.json").read_text())
        assert {"stage", "numbers"} <= {entry["name"] for entry in report["carried"]}
        assert b"after the cell" in (directory / pickled[0]).read_bytes()
