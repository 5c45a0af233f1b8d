"""A keep-running save reports success only for a kernel that survived it.

Scenarios as data: criu dumps the kernel for real and leaves it running, then something ends
(or freezes) the kernel right after the dump, as JAX's threads did when they ran while CUDA
was checkpointed. Every run checks the contract: the save fails naming the death, and the
complete image is listed, with the warning in its manifest, and restores the kernel's state.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.criu import CriuRunner
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.errors import SnapshotError
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.launch.liveness import kernel_answers
from testkit.criu_wrappers import install, signals_the_kernel_after_the_dump
from tests.conftest import KernelHandle, RestoredTrees, execute, run


@dataclass(frozen=True)
class AfterTheDump:
    """What happens to the kernel once criu has dumped it and let it run."""

    signal: signal.Signals | None
    says: str  # what the save's error says (a pattern)

    @property
    def id(self) -> str:
        return self.signal.name if self.signal else "nothing"


ROWS = [
    AfterTheDump(None, ""),
    AfterTheDump(signal.SIGSEGV, r"the kernel died \d+\.\d s after its dump: killed by signal 11 "
                 r"\(SIGSEGV\)"),
    AfterTheDump(signal.SIGKILL, r"the kernel died \d+\.\d s after its dump: killed by signal 9 "
                 r"\(SIGKILL\)"),
    # Alive but frozen: it never answers kernel_info.
    AfterTheDump(signal.SIGSTOP, r"the kernel \(pid \d+\) has not answered for 3 s since its "
                 r"dump"),
]


def engine_for(store: SnapshotStore, row: AfterTheDump, tmp_path: Path) -> SnapshotEngine:
    criu = None
    if row.signal is not None:
        criu = CriuRunner(install(tmp_path, signals_the_kernel_after_the_dump(row.signal)))
    engine = SnapshotEngine(store, criu, kernel_answers=kernel_answers)
    engine.kernel_answer_seconds = 3.0
    return engine


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_a_kernel_that_did_not_survive_its_save_fails_the_save_and_keeps_the_image(
        row: AfterTheDump, store: SnapshotStore, kernel: KernelHandle, tmp_path: Path,
        restored: RestoredTrees):
    kernel.execute("state = list(range(1000))")
    pid = kernel.kernel_pid
    target = SaveTarget(pid=kernel.root_pid, connection_info=kernel.km.get_connection_info())
    engine = engine_for(store, row, tmp_path)
    try:
        snapshot = run(engine.save(target, name="saved"))
    except SnapshotError as err:
        assert row.signal is not None, err
        said = err
    else:
        assert row.signal is None
        assert "warnings" not in snapshot.manifest
        assert kernel.execute("print(len(state))").strip() == "1000"
        return
    # The save names the death; its image is complete, listed and says so too.
    assert said.step == "resume", said.message
    assert re.fullmatch(row.says, said.cause), said.message
    if row.signal is not signal.SIGSTOP:
        assert not procfs.tree_alive(pid)
    listed = store.list()
    assert [s.name for s in listed] == ["saved"]
    warning = listed[0].manifest["warnings"][-1]
    assert warning == said.cause
    store.verify(listed[0])
    if row.signal is signal.SIGSTOP:
        procfs.kill_tree(kernel.root_pid)
    # The kept image holds the state the kernel had at the save.
    kernel.client.stop_channels()
    back = run(SnapshotEngine(store).restore(listed[0].id))
    client = restored.connect(back.connection_info, back.pid)
    assert execute(client, "print(len(state))").strip() == "1000"
