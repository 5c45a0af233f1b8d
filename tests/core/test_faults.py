"""The fault suite, in the manner of CRIU's zdtm: scenarios as data, every run checked.

The saving process is SIGKILLed at each phase of a save (``testkit/fault_saver.py``, which
saves as the CLI does), for keep-running and stopping saves. Then the store is recovered as
a server start does, and every run asserts the same contract:
- the kernel is alive and answers, or a complete listed snapshot holds its state (restored
  and checked here), or both, as the row says;
- nothing partial is listed or left behind;
- the earlier snapshot is byte-identical.

A second table kills the work on page packs (images kept by content, ``core/store/packs/``) at
its points (``testkit/fault_points.py``): a commit while it writes its pack, after the pack and
before the recipes, after its rename and before the whole files go; a delete; the delete's
collector between a rewritten pack and the removal of the old one. After each: nothing
partial is listed, every earlier snapshot verifies and restores, and a later save and a
collection leave the packs as the collector's contract says.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.errors import SnapshotError
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.recovery import recover_store
from jupyter_gpu_snapshot.core.store import SnapshotStore, digest
from jupyter_gpu_snapshot.core.store.packs import (
    CHUNKS_DIR,
    ID_BYTES,
    PAGE,
    PLAN_SUFFIX,
    REPACK_BELOW,
    recipe_name,
    recipe_voids,
)
from testkit.criu_wrappers import install, kill_saver_while_writing_pages
from testkit.fault_points import POINTS
from tests.conftest import KernelHandle, RestoredTrees, execute, run, start_kernel, stop_kernel

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Fault:
    """One row: where the saver dies, and what must be true afterwards."""

    phase: str  # the engine phase whose first report kills the saver
    stop: bool
    kernel_lives: bool
    snapshot_kept: bool
    after_bytes: int = 0  # with the phase: only once this many bytes are reported done
    criu_kills_saver: bool = False  # criu's wrapper kills the saver while criu writes pages

    @property
    def id(self) -> str:
        where = "dump-mid" if self.criu_kills_saver else self.phase
        return f"{where}-{'stop' if self.stop else 'keep'}"


FAULTS = [
    Fault("preflight", stop=False, kernel_lives=True, snapshot_kept=False),
    Fault("preflight", stop=True, kernel_lives=True, snapshot_kept=False),
    Fault("suspend", stop=False, kernel_lives=True, snapshot_kept=False),
    Fault("suspend", stop=True, kernel_lives=True, snapshot_kept=False),
    # Reported right before criu starts.
    Fault("dump", stop=False, kernel_lives=True, snapshot_kept=False),
    Fault("dump", stop=True, kernel_lives=True, snapshot_kept=False),
    # criu goes on without its saver and completes the image.
    Fault("none", stop=False, kernel_lives=True, snapshot_kept=True, criu_kills_saver=True),
    Fault("none", stop=True, kernel_lives=False, snapshot_kept=True, criu_kills_saver=True),
    Fault("resume", stop=False, kernel_lives=True, snapshot_kept=True),
    Fault("resume", stop=True, kernel_lives=False, snapshot_kept=True),
    Fault("commit", stop=False, kernel_lives=True, snapshot_kept=True, after_bytes=1),
    Fault("commit", stop=True, kernel_lives=False, snapshot_kept=True, after_bytes=1),
]


def tree_digest(path: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())
    }


def kill_saver_at(
    store: SnapshotStore, pid: int, fault: Fault, tmp_path: Path, name: str | None = None
) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "testkit.fault_saver", str(store.root), str(pid), fault.phase,
            "--after-bytes", str(fault.after_bytes)]
    if fault.stop:
        argv.append("--stop")
    if name:
        argv += ["--name", name]
    if fault.criu_kills_saver:
        argv += ["--criu", install(tmp_path, kill_saver_while_writing_pages())]
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def wait_for_criu_to_finish(store: SnapshotStore, timeout: float = 60) -> None:
    """criu runs on after its saver died; a server starting meanwhile leaves it be."""
    deadline = time.monotonic() + timeout
    while any(procfs.criu_working_on(p) for p in store.root.iterdir()):
        assert time.monotonic() < deadline, "criu still runs"
        time.sleep(0.05)


def assert_nothing_partial(store: SnapshotStore) -> None:
    leftovers = [p.name for p in store.root.iterdir() if p.name.startswith(".")]
    assert leftovers == []


@pytest.mark.parametrize("fault", FAULTS, ids=[f.id for f in FAULTS])
def test_saver_killed(fault: Fault, store: SnapshotStore, tmp_path: Path, restored: RestoredTrees):
    kernel = start_kernel()
    try:
        kernel.execute("import numpy as np; counter = 41; data = np.arange(4_000_000)")
        engine = SnapshotEngine(store)
        earlier = run(engine.save(SaveTarget(pid=kernel.root_pid), name="earlier"))
        before = tree_digest(earlier.path)
        kernel.execute("counter = 42")

        died = kill_saver_at(store, kernel.kernel_pid, fault, tmp_path)
        assert died.returncode == -9, died.stderr
        wait_for_criu_to_finish(store)
        report = recover_store(store)

        assert report.kept == []
        assert_nothing_partial(store)
        assert tree_digest(earlier.path) == before
        later = [s for s in store.list() if s.id != earlier.id]
        recovered = [s.manifest.get("recovered") for s in later]
        assert recovered == ([True] if fault.snapshot_kept else [])
        assert procfs.tree_alive(kernel.root_pid) == fault.kernel_lives
        if fault.kernel_lives:
            assert kernel.execute("counter += 1; print(counter)").strip() == "43"
    finally:
        stop_kernel(kernel)
    if fault.snapshot_kept:
        store.verify(later[0])
        back = run(engine.restore(later[0]))
        client = restored.connect(back.connection_info, back.pid)

        assert execute(client, "print(counter, int(data[-1]))").split() == ["42", "3999999"]


def test_a_failed_commit_of_a_stopping_save_keeps_the_image(
    store: SnapshotStore, kernel: KernelHandle, monkeypatch: pytest.MonkeyPatch,
    restored: RestoredTrees,
):
    """The kernel is gone once a stopping dump is done: its image must outlive the error."""
    import errno

    kernel.execute("counter = 42")
    engine = SnapshotEngine(store)

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(store, "commit", disk_full)
        with pytest.raises(SnapshotError) as err:
            run(engine.save(SaveTarget(pid=kernel.root_pid), stop=True))
    assert err.value.step == "commit" and "recover" in err.value.message
    assert not procfs.tree_alive(kernel.root_pid)
    assert store.list() == []

    report = recover_store(store)
    (snapshot,) = report.committed
    assert_nothing_partial(store)
    back = run(engine.restore(snapshot))

    client = restored.connect(back.connection_info, back.pid)
    assert execute(client, "print(counter)").strip() == "42"


@dataclass(frozen=True)
class PackFault:
    """One row of work on the page packs: which operation dies, and at which point."""

    operation: str  # "save" (keep-running, through testkit/fault_saver.py) or "delete"
    point: str  # a point of testkit/fault_points.py
    listed_as: str  # what the killed save left listed: "recovered", "committed" or "none"

    @property
    def id(self) -> str:
        return f"{self.operation}-{self.point}"


PACK_FAULTS = [
    # A pack without ids: the recovery commits the image again, the collector drops the pack.
    PackFault("save", "writing-pack", listed_as="recovered"),
    # Pages in the store that no recipe names yet: the recovery's commit finds them there.
    PackFault("save", "pack-written", listed_as="recovered"),
    # Published, its whole files still beside their recipes.
    PackFault("save", "renamed", listed_as="committed"),
    PackFault("delete", "deleting", listed_as="none"),
    PackFault("delete", "pack-rewritten", listed_as="none"),
]
assert {f.point for f in PACK_FAULTS} == set(POINTS)


def _subprocess(argv: list[str]) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def assert_packs_whole(store: SnapshotStore) -> None:
    """What the collector promises once it ran: every pack complete (its ids beside it, one
    page per id) and at least half live, every page a snapshot needs in a pack, nothing else
    in ``chunks/`` but the remembered plans of live recipes, and each snapshot directory
    holding its manifest's files only (a file kept as a recipe, never also whole)."""
    recipes = []
    for snapshot in store.list():
        files = snapshot.manifest["files"]
        present = sorted(p.name for p in snapshot.path.iterdir())
        expected = sorted(["manifest.json"] + [
            recipe_name(name) if "chunks" in entry else name
            for name, entry in files.items()
        ])
        assert present == expected, snapshot.id
        recipes += [(snapshot.path / recipe_name(n)).read_bytes()
                    for n, entry in files.items() if "chunks" in entry]
    live = np.unique(np.concatenate([recipe_voids(r) for r in recipes]))
    directory = store.root / CHUNKS_DIR
    names = sorted(os.listdir(directory))
    plans = {n.removesuffix(PLAN_SUFFIX) for n in names if n.endswith(PLAN_SUFFIX)}
    assert plans <= {digest.blake3_hex(r) for r in recipes}
    names = [n for n in names if not n.endswith(PLAN_SUFFIX)]
    packs = sorted({n.removesuffix(".pack") for n in names if n.endswith(".pack")})
    assert names == sorted(f"{p}{suffix}" for p in packs for suffix in (".ids", ".pack"))
    held = []
    for pack in packs:
        ids = (directory / f"{pack}.ids").read_bytes()
        assert (directory / f"{pack}.pack").stat().st_size * ID_BYTES == (
            len(ids) * PAGE)
        mine = recipe_voids(ids)
        assert np.isin(mine, live).sum() >= REPACK_BELOW * len(mine), pack
        held.append(mine)
    assert np.isin(live, np.concatenate(held) if held else live[:0]).all()


@pytest.mark.parametrize("fault", PACK_FAULTS, ids=[f.id for f in PACK_FAULTS])
def test_pack_work_killed(
    fault: PackFault, store: SnapshotStore, restored: RestoredTrees,
):
    kernel = start_kernel()
    engine = SnapshotEngine(store)
    try:
        # "first" holds pages of its own, most of its pack: deleting it rewrites the pack.
        kernel.execute("import numpy as np; counter = 41; data = np.arange(2_000_000); "
                       "junk = np.random.default_rng(1).bytes(64 << 20)")
        first = run(engine.save(SaveTarget(pid=kernel.root_pid), name="first"))
        kernel.execute("del junk; counter = 42")
        second = run(engine.save(SaveTarget(pid=kernel.root_pid), name="second"))
        # New pages for the killed save to write.
        kernel.execute("counter = 43; fresh = np.random.default_rng(2).bytes(8 << 20)")

        if fault.operation == "save":
            died = _subprocess(["testkit.fault_saver", str(store.root), str(kernel.kernel_pid),
                                "none", "--die-at", fault.point, "--name", "killed"])
        else:
            died = _subprocess(["testkit.fault_points", str(store.root), first.id, fault.point])
        assert died.returncode == -9, died.stderr
        wait_for_criu_to_finish(store)
        report = recover_store(store)

        assert report.kept == []
        assert_nothing_partial(store)
        listed = {s.name: s for s in store.list()}
        kept = {"first", "second"} - ({"first"} if fault.operation == "delete" else set())
        killed = listed.pop("killed", None)
        assert set(listed) == kept
        assert (killed is not None) == (fault.listed_as != "none")
        if killed is not None:
            assert bool(killed.manifest.get("recovered")) == (fault.listed_as == "recovered")
            store.verify(killed)
        for snapshot in listed.values():
            store.verify(snapshot)
        assert kernel.execute("counter += 1; print(counter)").strip() == "44"

        later = run(engine.save(SaveTarget(pid=kernel.root_pid), name="later"))
        store.collect_garbage()
        assert_packs_whole(store)
        store.verify(later)
    finally:
        stop_kernel(kernel)
    back = run(engine.restore(second))
    client = restored.connect(back.connection_info, back.pid)
    assert execute(client, "print(counter, int(data[-1]))").split() == ["42", "1999999"]
    if killed is not None:
        restored.close()  # the same kernel's ports: one restore at a time
        restored.roots.clear()
        restored.clients.clear()
        back = run(engine.restore(killed))
        client = restored.connect(back.connection_info, back.pid)
        assert execute(client, "print(counter, len(fresh))").split() == ["43", str(8 << 20)]
