"""criu fills a restored kernel's memory on several CPUs (scripts/criu-patches).

On a stock criu (make test-stock-criu), which has no ``--fill-workers`` and never asks for
a pages image in place, a restore depends only on the layout: the first scenario of each
layout restores the kernel whole the way criu does by itself, on one thread, pages by
content from the stream's pipe, and the image streamer hands no pack over; the others
would run that same restore again, and are skipped.

Real kernels, real criu, each layout of the store: pages kept by content are handed over
in place by the image streamer and read by criu's fill workers from the store's packs, where
the streamer says they lie (or, from a server that never hands them over so or says it
wrongly, read by criu alone from the one pipe of the stream); pages kept whole are read
from the snapshot's files by the workers. Each run checks the kernel's state came back,
how criu filled the memory (on how many workers, or alone), and that the workers' thread
ids lie above every pid and thread id of the restored tree, which they must never take.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.criu import CriuRunner
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.launch.liveness import kernel_answers
from testkit.criu_fill import criu_fills_on_workers
from testkit.criu_wrappers import install, keeps_the_restore_log
from testkit.image_servers import (
    a_run_of_no_length,
    offering_extents_changed_by,
    offering_no_extents,
    the_last_run_twice,
)
from tests.conftest import execute, run

# 96 MiB of memory only this state produces, past the 64 MiB from which workers are used.
STATE = """
import hashlib, numpy as np
block = np.random.default_rng(20261128).integers(0, 2**63, size=12 << 20, dtype=np.int64)
print(hashlib.sha256(block.tobytes()).hexdigest())
"""
CHECK = "print(hashlib.sha256(block.tobytes()).hexdigest())"
# criu's log, of the memory its fill workers read: bytes, how, on how many, their first tid.
FILLED = re.compile(r"Read (\d+) bytes of pages-\d+\.img( in place from \d+ files)? "
                    r"on (\d+) workers?(?: \(tids from (\d+)\))?")


@dataclass(frozen=True)
class Scenario:
    name: str
    by_content: bool
    workers: int | None  # --fill-workers; None: criu's default (the CPUs, up to 8)
    # How the workers read the pages ("in place", "from the image"), or None: criu alone.
    expect: str | None
    # What the image streamer says of where a pages image lies ("as it lies", "nothing", or
    # a name of EXTENTS_MALFORMED), and what criu logs of it, if it refuses them.
    extents: str = "as it lies"
    refused: str | None = None


EXTENTS_MALFORMED = {"a run of no length": a_run_of_no_length,
                     "the last run twice": the_last_run_twice}


def _extents_offered(scenario: Scenario) -> contextlib.AbstractContextManager[None]:
    if scenario.extents == "nothing":
        return offering_no_extents()
    if scenario.extents in EXTENTS_MALFORMED:
        return offering_extents_changed_by(EXTENTS_MALFORMED[scenario.extents])
    return contextlib.nullcontext()


SCENARIOS = [
    Scenario("by content: the packs read in place by workers", True, 2, "in place"),
    Scenario("by content, one worker asked for: the packs read in place by it", True, 1,
             "in place"),
    Scenario("by content, nothing handed over in place: criu alone, through the pipe", True,
             2, None, extents="nothing", refused=" sends pages-\\d+\\.img through a pipe"),
    Scenario("by content, a run of no length: refused, criu alone, through the pipe", True, 2,
             None, extents="a run of no length", refused="'s place of .* is malformed"),
    Scenario("by content, runs overlapping: refused, criu alone, through the pipe", True, 2,
             None, extents="the last run twice", refused="'s place of .* is malformed"),
    Scenario("whole files, criu's default", False, None, "from the image"),
    Scenario("whole files, one worker asked for: criu alone", False, 1, None),
]


def _first_of_its_layout(scenario: Scenario) -> bool:
    return scenario is next(s for s in SCENARIOS if s.by_content == scenario.by_content)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_memory_filled_on_several_cpus_comes_back_whole(
    scenario: Scenario, tmp_path: Path, kernel, restored
):
    fills = criu_fills_on_workers()
    if not fills and not _first_of_its_layout(scenario):
        pytest.skip("stock criu restores this layout the same whatever the workers or the "
                    "place offered: the layout's first scenario runs that restore")
    store = SnapshotStore(tmp_path / "store", chunk_images=scenario.by_content)
    engine = SnapshotEngine(store, kernel_answers=kernel_answers)
    expected = kernel.execute(STATE).strip()
    target = SaveTarget(pid=kernel.root_pid, connection_info=kernel.km.get_connection_info(),
                        kernel_name="python3-snapshot")
    snap = run(engine.save(target, name="filled", stop=True))
    kernel.km.provisioner.process.wait(timeout=10)

    log = tmp_path / "restore.log"
    # Stock criu refuses an option it does not know.
    workers = scenario.workers if fills else None
    criu = CriuRunner(install(tmp_path, keeps_the_restore_log(log, workers)))
    with _extents_offered(scenario):
        back = run(SnapshotEngine(store, criu, kernel_answers=kernel_answers).restore(snap.id))
    client = restored.connect(back.connection_info, back.pid)
    assert execute(client, CHECK).strip() == expected

    text = log.read_text(errors="replace")
    filled = FILLED.findall(text)
    served = back.notes["images"]
    if not fills:
        assert filled == []
        assert (served["read_in_place"], served["files_handed"]) == (0, 0)
        return
    if scenario.refused is not None:
        assert re.search(rf"The streamer{scenario.refused}", text)
    if scenario.expect is None:
        assert filled == []
        # Whole files are not served; a server that hands nothing over in place, or whose
        # place criu refused.
        handed = 1 if scenario.by_content and scenario.extents != "nothing" else 0
        assert served["read_in_place"] == handed
        return
    assert filled, "criu's log says nothing of its fill workers"
    assert {"in place" if how else "from the image" for _, how, _, _ in filled} \
        == {scenario.expect}
    assert sum(int(size) for size, *_ in filled) >= 96 << 20
    big = max(filled, key=lambda f: int(f[0]))
    if scenario.workers == 1:
        assert int(big[2]) == 1
        return
    # The kernel's 96 MiB are pieces enough for two workers.
    assert int(big[2]) >= 2
    in_place = scenario.expect == "in place"
    assert (served["read_in_place"], served["files_handed"]) == ((1, 1) if in_place else (0, 0))
    taken = {tid for p in procfs.tree(back.pid)
             for tid in (procfs.ns_pid(t.id) for t in p.threads())}
    assert min(int(first) for *_, first in filled if first) > max(taken)


# A child forked from the kernel after the state: its memory is the kernel's, shared
# copy-on-write, but for the first 8 MiB of the block, which it changes. It writes the
# digest of its block to a file once ready, and again on each SIGUSR1.
FORKED_CHILD = """
import os, signal
child_digest = {path!r}
def _write_digest(*_):
    with open(child_digest + ".part", "w") as f:
        f.write(hashlib.sha256(block.tobytes()).hexdigest())
    os.rename(child_digest + ".part", child_digest)
child = os.fork()
if child == 0:
    block[: 1 << 20] += 1
    signal.signal(signal.SIGUSR1, _write_digest)
    _write_digest()
    while True:
        signal.pause()
print(child)
"""
SHARED = re.compile(r"nr_shared_pages:\s+(\d+)")


def _child_digest(path: Path, ask: int | None = None) -> str:
    """The digest the forked child wrote, once it is ready, or the one it writes when
    ``ask``, its pid, sends it SIGUSR1."""
    if ask is not None:
        path.unlink(missing_ok=True)
        os.kill(ask, signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while not path.exists():
        assert time.monotonic() < deadline, "the forked child wrote no digest"
        time.sleep(0.05)
    return path.read_text()


def _host_pid(root: int, pid_in_kernel: int) -> int:
    """The pid, seen from here, of the kernel's process whose pid it sees as ``pid_in_kernel``
    (a snapshot-ready kernel has a pid namespace of its own)."""
    return next(p.pid for p in procfs.tree(root) if procfs.ns_pid(p.pid) == pid_in_kernel)


def _private_bytes(pid: int) -> int:
    """Memory only this process maps (its pages no other shares)."""
    return int(psutil.Process(pid).memory_full_info().uss)


def test_a_forked_childs_pages_are_compared_and_stay_shared(
    tmp_path: Path, kernel, restored
):
    """A child forked from the kernel (a DataLoader worker, say) holds the kernel's memory
    copy-on-write. The workers that read its pages in place compare each with the
    parent's, as criu does, and write only those that differ: its memory comes back right
    and stays shared."""
    store = SnapshotStore(tmp_path / "store", chunk_images=True)
    engine = SnapshotEngine(store, kernel_answers=kernel_answers)
    expected = kernel.execute(STATE).strip()
    digest_file = tmp_path / "child-digest"
    child_in_kernel = int(kernel.execute(FORKED_CHILD.format(path=str(digest_file))).strip())
    child = _host_pid(kernel.root_pid, child_in_kernel)
    child_expected = _child_digest(digest_file)
    assert child_expected != expected
    child_private_before = _private_bytes(child)
    target = SaveTarget(pid=kernel.root_pid, connection_info=kernel.km.get_connection_info(),
                        kernel_name="python3-snapshot")
    snap = run(engine.save(target, name="forked", stop=True))
    kernel.km.provisioner.process.wait(timeout=10)

    log = tmp_path / "restore.log"
    fills = criu_fills_on_workers()
    criu = CriuRunner(install(tmp_path, keeps_the_restore_log(log, 2 if fills else None)))
    back = run(SnapshotEngine(store, criu, kernel_answers=kernel_answers).restore(snap.id))
    client = restored.connect(back.connection_info, back.pid)
    assert execute(client, CHECK).strip() == expected
    child_back = _host_pid(back.pid, child_in_kernel)
    assert _child_digest(digest_file, ask=child_back) == child_expected

    if not fills:
        # criu's own loop compares the child's pages with its parent's too.
        assert _private_bytes(child_back) < child_private_before + (16 << 20)
        return
    text = log.read_text(errors="replace")
    filled = FILLED.findall(text)
    # The kernel's pages and the child's, each image read in place by two workers.
    big = [f for f in filled if int(f[0]) >= 96 << 20]
    assert len(big) == 2 and all(how and int(n) == 2 for _, how, n, _ in big), filled
    assert back.notes["images"]["read_in_place"] == 2
    # Every unchanged page of the 88 MiB the child shares is left shared, not copied.
    shared = [int(n) for n in SHARED.findall(text)]
    assert max(shared) >= (88 << 20) // 4096, shared
    assert _private_bytes(child_back) < child_private_before + (16 << 20)
