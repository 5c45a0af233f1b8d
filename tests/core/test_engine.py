"""Scenarios for the snapshot engine: real kernels, real CRIU, state checked after restore.

Each scenario sets up state that pickling-based tools cannot save (a generator mid-way, a
closure, an open file, a live thread), snapshots, restores and checks it all came back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
import time
from pathlib import Path

import psutil
import pytest

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.errors import InvalidRequest, NotFound, SnapshotError
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.store import SnapshotStore, digest
from jupyter_gpu_snapshot.core.store.manifest import FORMAT_VERSION
from testkit import stored_pages
from testkit.pid_taker import PidTaken, take_pid
from tests.conftest import KernelHandle, execute, run

STATE_SETUP = """
import hashlib, random, threading, time
import numpy as np

answer = 42
words = {"a": [1, 2, 3], "b": "snapshot"}
big = np.random.default_rng(1).random(25_000_000)          # ~200 MB of float64
big_digest = hashlib.sha256(big.tobytes()).hexdigest()
squares = (i * i for i in range(100))
[next(squares) for _ in range(3)]                            # now at 3: next is 9
add_five = (lambda k: lambda x: x + k)(5)
fh = open(DATA_PATH)
fh.read(5)
random.seed(1234); random.random()
rng = np.random.default_rng(99); rng.random(3)
ticks = [0]
def _tick():
    while True:
        ticks[0] += 1
        time.sleep(0.01)
threading.Thread(target=_tick, daemon=True).start()
time.sleep(0.1)
"""

STATE_PROBE = """
import json as _json
print(_json.dumps({
    "answer": answer,
    "words": words,
    "big": hashlib.sha256(big.tobytes()).hexdigest() == big_digest,
    "big_len": int(big.size),
    "closure": add_five(1),
    "file_pos": fh.tell(),
    "py_rng": hash(random.getstate()),
    "np_rng": _json.dumps(rng.bit_generator.state, default=str),
}))
"""


def _set_state(kernel: KernelHandle, tmp_path: Path) -> dict[str, object]:
    data = tmp_path / "data.txt"
    data.write_text("hello snapshot world")
    kernel.execute(f"DATA_PATH = {str(data)!r}\n" + STATE_SETUP, timeout=120)
    return _probe(kernel.execute)


def _probe(execute: object) -> dict[str, object]:
    assert callable(execute)
    return dict(json.loads(execute(STATE_PROBE).strip().splitlines()[-1]))


def _ticks(execute: object) -> int:
    """The background thread's count once it has moved on (at most 30 s later)."""
    assert callable(execute)
    return int(execute(
        "_seen, _until = ticks[0], time.monotonic() + 30\n"
        "while ticks[0] == _seen and time.monotonic() < _until:\n"
        "    time.sleep(0.01)\n"
        "print(ticks[0])").strip())


def _save(engine: SnapshotEngine, kernel: KernelHandle, **kwargs: object) -> object:
    target = SaveTarget(
        pid=kernel.root_pid,
        connection_info=kernel.km.get_connection_info(),
        kernel_name="python3-snapshot",
    )
    return run(engine.save(target, **kwargs))  # type: ignore[arg-type]


def _listed(store: SnapshotStore) -> list[str]:
    return [s.id for s in store.list()]


def _no_partials(store: SnapshotStore) -> None:
    leftovers = [p.name for p in store.root.iterdir() if p.name.startswith(".partial-")]
    assert leftovers == []


def test_save_keep_running_then_kernel_continues(engine, store, kernel, tmp_path):
    before = _set_state(kernel, tmp_path)
    snap = _save(engine, kernel, name="keep-running")
    assert _listed(store) == [snap.id]
    # The kernel was only paused: same state, and it keeps computing.
    assert _probe(kernel.execute) == before
    t1 = _ticks(kernel.execute)
    assert _ticks(kernel.execute) > t1
    kernel.execute("answer += 1")
    assert "43" in kernel.execute("print(answer)")

    manifest = snap.manifest
    assert manifest["format"] == FORMAT_VERSION and manifest["signature"]["value"]
    assert manifest["name"] == "keep-running"
    assert manifest["kernel"]["connection_info"]["key"]
    assert manifest["versions"]["criu"].startswith("4.")
    assert {"suspend", "dump", "resume", "commit", "total", "pause"} <= set(manifest["timings"])
    assert all(len(f["digest"]) == 64 for f in manifest["files"].values())
    # Only the kernel's own log may be recreated at restore, and only in the log directory.
    assert [Path(p).parent for p in manifest["kernel"]["log_files"]] == [
        store.policy.kernel_log_dir()
    ]
    # Snapshots are secrets: the store and everything in it are private.
    assert stat.S_IMODE(store.root.stat().st_mode) == 0o700
    assert stat.S_IMODE(snap.path.stat().st_mode) == 0o700
    for f in snap.path.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    _no_partials(store)


def test_save_stop_restore_brings_back_all_state(engine, store, kernel, tmp_path, restored):
    before = _set_state(kernel, tmp_path)
    root = kernel.root_pid
    _save(engine, kernel, name="stopped", stop=True)
    kernel.km.provisioner.process.wait(timeout=10)
    assert not procfs.tree_alive(root)

    back = run(engine.restore("stopped"))
    client = restored.connect(back.connection_info, back.pid)
    run_code = lambda code: execute(client, code)  # noqa: E731
    assert _probe(run_code) == before
    assert run_code("print(next(squares))").strip() == "9"
    assert run_code("print(repr(fh.read(4)))").strip() == "' sna'"
    t1 = _ticks(run_code)
    assert _ticks(run_code) > t1, "the background thread stopped counting"
    assert "43" in run_code("answer += 1; print(answer)")
    # Inside its namespace the kernel keeps its pid; outside it has a fresh one.
    assert procfs.namespace_init(back.kernel_pid) == back.pid


def test_restore_twice_from_one_snapshot(engine, kernel, tmp_path, restored):
    before = _set_state(kernel, tmp_path)
    snap = _save(engine, kernel, stop=True)
    kernel.km.provisioner.process.wait(timeout=10)
    for _ in range(2):
        back = run(engine.restore(snap.id))
        client = restored.connect(back.connection_info, back.pid)
        assert _probe(lambda code, c=client: execute(c, code)) == before
        client.stop_channels()
        procfs.kill_tree(back.pid)


def test_restore_while_original_runs_is_refused(engine, store, kernel, tmp_path):
    before = _set_state(kernel, tmp_path)
    snap = _save(engine, kernel)
    phases: list[str] = []
    with pytest.raises(SnapshotError) as err:
        run(engine.restore(snap.id, lambda p: phases.append(p.phase)))
    assert err.value.step == "preflight" and err.value.code == "ports_in_use"
    assert "in use. Is the original kernel" in err.value.message
    assert err.value.details["ports"]
    # Refused before the checksum pass, which is wasted on a restore that cannot run.
    assert "verify" not in phases
    assert _probe(kernel.execute) == before
    assert _listed(store) == [snap.id]


def _occupy_pid(pid: int) -> psutil.Process | None:
    """A process that has exactly ``pid`` now; None if another process has it already."""
    try:
        return take_pid(pid, ["/bin/sleep", "600"])
    except PidTaken:
        return None


def test_restore_after_original_pids_are_taken(engine, kernel, tmp_path, restored):
    before = _set_state(kernel, tmp_path)
    root, kpid = kernel.root_pid, kernel.kernel_pid
    snap = _save(engine, kernel, stop=True)
    kernel.km.provisioner.process.wait(timeout=10)
    squatters = [_occupy_pid(root), _occupy_pid(kpid)]
    try:
        back = run(engine.restore(snap.id))
        client = restored.connect(back.connection_info, back.pid)
        assert _probe(lambda code: execute(client, code)) == before
        assert back.pid not in (root, kpid)
    finally:
        for proc in squatters:
            if proc is not None:
                proc.kill()


CANARY_WATCH = """
import os, threading, time
def _watch():
    while not os.path.exists(TRIGGER):
        time.sleep(0.02)
    # Written aside and renamed: the test never reads a canary half written.
    with open(CANARY + ".tmp", "w") as f:
        f.write("the image ran")
    os.rename(CANARY + ".tmp", CANARY)
threading.Thread(target=_watch, daemon=True).start()
"""


class CriuCalls:
    """The real criu runner, recording each restore's argv and the pid it restored."""

    def __init__(self, engine: SnapshotEngine) -> None:
        self.argvs: list[list[str]] = []
        self.pids: list[int] = []
        real = engine.criu.run

        async def recorded(argv: list[str], log_path: Path, **kw: object) -> object:
            result = await real(argv, log_path, **kw)  # type: ignore[arg-type]
            self.argvs.append(argv)
            pidfile = argv[argv.index("--pidfile") + 1]
            with contextlib.suppress(FileNotFoundError):
                self.pids.append(int(await asyncio.to_thread(Path(pidfile).read_text)))
            return result

        engine.criu.run = recorded  # type: ignore[method-assign,assignment]


def test_altered_image_is_caught_while_criu_restores_and_never_runs(
    engine, store, kernel, tmp_path, restored
):
    trigger, canary = tmp_path / "trigger", tmp_path / "canary"
    kernel.execute(f"TRIGGER, CANARY = {str(trigger)!r}, {str(canary)!r}\n" + CANARY_WATCH)
    snap = _save(engine, kernel, stop=True)
    kernel.km.provisioner.process.wait(timeout=10)
    trigger.touch()  # from now on, any run of the image's code writes the canary
    pages = stored_pages.largest_chunked(snap.path)
    # A page of the image, in the store's pack: the recipe still matches its manifest and
    # the assembled file keeps its size; only its digest, checked while criu runs, can tell.
    page = stored_pages.flip_page_byte(store.root, snap.path, pages)
    calls = CriuCalls(engine)
    with pytest.raises(SnapshotError) as err:
        run(engine.restore(snap.id))
    assert err.value.step == "verify"
    assert f"image file {pages}" in err.value.message and "digest" in err.value.message
    assert len(calls.argvs) == 1 and "--leave-stopped" in calls.argvs[0]
    assert len(calls.pids) == 1, "criu did not restore the tree"
    deadline = time.monotonic() + 60
    while procfs.tree_alive(calls.pids[0]):
        assert time.monotonic() < deadline, "the stopped tree was not killed"
        time.sleep(0.05)
    assert not canary.exists(), "code of the altered image ran"
    assert procfs.ports_in_use(snap.connection_info) == []

    # The same scenario without the alteration does run the image: the canary can appear.
    stored_pages.flip_page_byte(store.root, snap.path, pages, page)
    back = run(engine.restore(snap.id))
    restored.roots.append(back.pid)
    deadline = time.monotonic() + 60
    while not canary.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert canary.read_text() == "the image ran"
    assert back.timings["verify"] > 0 and back.timings["restore"] > 0

    (snap.path / f"{pages}.chunks").unlink()
    procfs.kill_tree(back.pid)
    with pytest.raises(SnapshotError, match="missing"):
        run(engine.restore(snap.id))


def test_image_edited_with_its_digest_recomputed_is_refused(engine, store, kernel, tmp_path):
    kernel.execute("secret = 41")
    snap = _save(engine, kernel, stop=True)
    kernel.km.provisioner.process.wait(timeout=10)
    pages = stored_pages.largest_chunked(snap.path)
    stored_pages.flip_page_byte(store.root, snap.path, pages)
    edited = tmp_path / pages
    edited.write_bytes(stored_pages.assembled(store.root, snap.path, pages))
    manifest = json.loads((snap.path / "manifest.json").read_text())
    fd = os.open(edited, os.O_RDONLY)
    try:
        manifest["files"][pages]["digest"] = digest.digest_files(
            [(fd, edited.stat().st_size)], manifest["digest"])[0]
    finally:
        os.close(fd)
    (snap.path / "manifest.json").write_text(json.dumps(manifest))
    calls = CriuCalls(engine)
    with pytest.raises(SnapshotError) as err:
        run(engine.restore(snap.id))
    assert err.value.step == "verify" and "altered" in err.value.message
    assert calls.argvs == [], "criu ran on a forged snapshot"
    assert store.get(snap.id).status == "damaged"


@pytest.mark.parametrize("bad", ["../x", "a/b", ".hidden", "", "x" * 65, "name with space", ".."])
def test_bad_names_are_refused_and_nothing_changes(engine, store, kernel, bad):
    kernel.execute("x = 1")
    with pytest.raises(InvalidRequest) as err:
        _save(engine, kernel, name=bad)
    assert err.value.step == "preflight" and "invalid snapshot name" in err.value.message
    with pytest.raises(SnapshotError):
        run(engine.restore(bad))
    assert _listed(store) == []
    assert "1" in kernel.execute("print(x)")


def test_unknown_snapshot_and_duplicate_name(engine, store, kernel):
    with pytest.raises(NotFound, match="no snapshot 'nope'"):
        run(engine.restore("nope"))
    with pytest.raises(NotFound):
        engine.delete("20260101T000000Z-deadbeef")
    _save(engine, kernel, name="once")
    with pytest.raises(InvalidRequest, match="exists already"):
        _save(engine, kernel, name="once")
    assert len(_listed(store)) == 1
