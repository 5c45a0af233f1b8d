"""criu fills a restored kernel's memory on several CPUs (scripts/criu-patches).

Real kernels, real criu, each layout of the store: pages kept by content reach criu through
its stream, and their memory is populated by workers before criu copies into it; pages kept
whole are read by the workers themselves. Each run checks the kernel's state came back, that
the workers ran (or, with one asked for, that criu filled the memory alone), and that their
pids lie above every pid and thread id of the restored tree, which they must never take.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.criu import CriuRunner
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.launch.liveness import kernel_answers
from testkit.criu_wrappers import install, keeps_the_restore_log
from tests.conftest import execute, run

# 96 MiB of memory only this state produces, past the 64 MiB from which workers are used.
STATE = """
import hashlib, numpy as np
block = np.random.default_rng(20261128).integers(0, 2**63, size=12 << 20, dtype=np.int64)
print(hashlib.sha256(block.tobytes()).hexdigest())
"""
CHECK = "print(hashlib.sha256(block.tobytes()).hexdigest())"
FILLED = re.compile(
    r"(Populating|Reading) (\d+) bytes of \w+ ?\w* on (\d+) workers \(pids from (\d+)\)")


@dataclass(frozen=True)
class Scenario:
    name: str
    by_content: bool
    workers: int | None  # CRIU_FILL_WORKERS; None: criu's default (the CPUs, up to 8)
    expect: str | None  # the log's verb, or None: no workers


SCENARIOS = [
    Scenario("by content, streamed: populated by workers", True, 2, "Populating"),
    Scenario("whole files, in place: read by workers", False, 2, "Reading"),
    Scenario("whole files, criu's default", False, None, "Reading"),
    Scenario("one worker asked for: criu alone", False, 1, None),
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_memory_filled_on_several_cpus_comes_back_whole(
    scenario: Scenario, tmp_path: Path, kernel, restored
):
    store = SnapshotStore(tmp_path / "store", chunk_images=scenario.by_content)
    engine = SnapshotEngine(store, kernel_answers=kernel_answers)
    expected = kernel.execute(STATE).strip()
    target = SaveTarget(pid=kernel.root_pid, connection_info=kernel.km.get_connection_info(),
                        kernel_name="python3-snapshot")
    snap = run(engine.save(target, name="filled", stop=True))
    kernel.km.provisioner.process.wait(timeout=10)

    log = tmp_path / "restore.log"
    criu = CriuRunner(install(tmp_path, keeps_the_restore_log(log, scenario.workers)))
    back = run(SnapshotEngine(store, criu, kernel_answers=kernel_answers).restore(snap.id))
    client = restored.connect(back.connection_info, back.pid)
    assert execute(client, CHECK).strip() == expected

    filled = FILLED.findall(log.read_text(errors="replace"))
    if scenario.expect is None:
        assert filled == []
        return
    assert filled, "criu filled no memory on workers"
    assert {verb for verb, *_ in filled} == {scenario.expect}
    assert sum(int(size) for _, size, _, _ in filled) >= 96 << 20
    assert all(int(n) >= 2 for _, _, n, _ in filled)
    taken = {tid for p in procfs.tree(back.pid)
             for tid in (procfs.ns_pid(t.id) for t in p.threads())}
    assert min(int(first) for *_, first in filled) > max(taken)
