"""criu fills a restored kernel's memory on several CPUs (scripts/criu-patches).

Real kernels, real criu, each layout of the store: pages kept by content reach criu's
workers as stripes of its stream, one pipe each (or, from a server without stripes, on the
one pipe, into memory the workers populated first); pages kept whole are read in place by
the workers. Each run checks the kernel's state came back, that the workers ran (or, with
one asked for, that criu filled the memory alone), and that their pids lie above every pid
and thread id of the restored tree, which they must never take.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from jupyter_gpu_snapshot.core import image_server, procfs
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
    r"(Populating|Reading) (\d+) bytes of ([\w ]+?) on (\d+) workers \(pids from (\d+)\)")


@dataclass(frozen=True)
class Scenario:
    name: str
    by_content: bool
    workers: int | None  # CRIU_FILL_WORKERS; None: criu's default (the CPUs, up to 8)
    expect: str | None  # what the workers did, as the log says it, or None: no workers
    stripes: bool = True  # whether the image server offers a pages image in stripes


SCENARIOS = [
    Scenario("by content: stripes of the stream read by workers", True, 2,
             "Reading pages from 2 stripes"),
    Scenario("by content, no stripes offered: populated by workers", True, 2,
             "Populating premapped memory", stripes=False),
    Scenario("whole files, in place: read by workers", False, 2, "Reading pages"),
    Scenario("whole files, criu's default", False, None, "Reading pages"),
    Scenario("one worker asked for: criu alone", False, 1, None),
]


def _no_stripes(name: str) -> tuple[str, image_server.Stripe | None] | None:
    """The image server as one without stripes sees their names: files it does not have."""
    return None if "@" in name else (name, None)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_memory_filled_on_several_cpus_comes_back_whole(
    scenario: Scenario, tmp_path: Path, kernel, restored, monkeypatch
):
    if not scenario.stripes:
        monkeypatch.setattr(image_server.Stripe, "of", staticmethod(_no_stripes))
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
    assert {f"{verb} {what}" for verb, _, what, _, _ in filled} == {scenario.expect}
    assert sum(int(size) for _, size, *_ in filled) >= 96 << 20
    assert all(int(n) >= 2 for *_, n, _ in filled)
    served = back.notes["images"]
    assert served["stripes"] == (2 if scenario.expect.endswith("stripes") else 0)
    taken = {tid for p in procfs.tree(back.pid)
             for tid in (procfs.ns_pid(t.id) for t in p.threads())}
    assert min(int(first) for *_, first in filled) > max(taken)
