"""Node compatibility: a snapshot records its node, and a node that cannot run it refuses the
restore before criu runs, naming every difference.

One real kernel (numpy imported, a private copy of libz loaded with ctypes) is saved and
stopped once. Each scenario alters what its signed manifest claims (re-signed with the
store's key, as a snapshot of another node would be) or the files on disk, restores, and
checks: the refusal names the difference, criu never ran, the snapshot is still listed. The
same snapshot, unaltered, then restores with its state.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpu_snapshot.core import compatibility
from jupyter_gpu_snapshot.core.compatibility import (
    FileDigests,
    NodeCompatibility,
    NodeGpus,
    gpu_differences,
)
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.errors import Incompatible
from jupyter_gpu_snapshot.core.hooks import Progress, SaveTarget
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.core.store.manifest import FORMAT_VERSION
from jupyter_gpu_snapshot.core.store.snapshot import Snapshot
from tests.conftest import RestoredTrees, execute, run, start_kernel, stop_kernel
from tests.core.test_engine import CriuCalls

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"
LIBZ = next(p for p in (Path("/usr/lib/x86_64-linux-gnu/libz.so.1"), Path("/lib/libz.so.1"),
                        Path("/usr/lib/aarch64-linux-gnu/libz.so.1")) if p.exists())

SETUP = """
import ctypes
import numpy as np
zlib_copy = ctypes.CDLL(LIB_PATH)
zlib_copy.zlibVersion.restype = ctypes.c_char_p
values = np.arange(1000) * 3
print(zlib_copy.zlibVersion().decode())
"""


@dataclass
class Saved:
    store: SnapshotStore
    engine: SnapshotEngine
    snapshot: Snapshot
    library: Path
    zlib_version: str
    gpus: list[NodeGpus | None]

    @property
    def manifest_path(self) -> Path:
        return self.snapshot.path / "manifest.json"

    def manifest(self) -> dict[str, Any]:
        return dict(json.loads(self.manifest_path.read_text()))

    def write_signed(self, manifest: dict[str, Any]) -> None:
        manifest["signature"] = self.store.key.sign(manifest)
        self.manifest_path.write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Saved]:
    root = tmp_path_factory.mktemp("compat")
    library = root / "lib" / "libz-copy.so.1"
    library.parent.mkdir()
    shutil.copyfile(LIBZ, library)
    store = SnapshotStore(root / "store")
    gpus: list[NodeGpus | None] = [None]
    engine = SnapshotEngine(store, compatibility=NodeCompatibility(gpus=lambda: gpus[0]))
    handle = start_kernel()
    try:
        out = handle.execute(f"LIB_PATH = {str(library)!r}\n" + SETUP, timeout=120)
        target = SaveTarget(pid=handle.root_pid, connection_info=handle.km.get_connection_info(),
                            kernel_name="python3-snapshot")
        snapshot = run(engine.save(target, name="compat", stop=True))
        handle.km.provisioner.process.wait(timeout=10)
    finally:
        stop_kernel(handle)
    yield Saved(store, engine, snapshot, library, out.strip().splitlines()[-1], gpus)


def test_a_save_records_its_node(saved):
    node = saved.snapshot.manifest["node"]
    assert saved.snapshot.manifest["format"] == FORMAT_VERSION
    assert node["cpu"]["arch"] and node["cpu"]["flags"] == compatibility.cpu_facts()["flags"]
    assert node["kernel"] == compatibility.kernel_facts()
    files = {f["path"]: f for f in node["mapped_files"]["files"]}
    # The interpreter, numpy's own extension and the library loaded by hand are all there.
    assert str(saved.library) in files and files[str(saved.library)]["size"] == LIBZ.stat().st_size
    assert any("_multiarray_umath" in p for p in files)
    assert any("libpython" in p or "/bin/python" in p for p in files)
    assert all(len(f["digest"]) == 64 for f in files.values())
    assert saved.snapshot.manifest["timings"]["environment"] >= 0


def _claim(change: Callable[[dict[str, Any]], None]) -> Callable[[Saved], Callable[[], None]]:
    """A scenario that alters what the signed manifest claims; undone by the original."""

    def alter(saved: Saved) -> Callable[[], None]:
        original = saved.manifest_path.read_bytes()
        manifest = saved.manifest()
        change(manifest)
        saved.write_signed(manifest)
        return lambda: saved.manifest_path.write_bytes(original)

    return alter


def _add_flag(manifest: dict[str, Any]) -> None:
    manifest["node"]["cpu"]["flags"] += ["avx10_fake", "amx_fake", "sha9_fake"]


def _other_kernel(manifest: dict[str, Any]) -> None:
    manifest["node"]["kernel"]["release"] = "5.4.0-200-generic"


def _other_arch(manifest: dict[str, Any]) -> None:
    manifest["node"]["cpu"]["arch"] = "aarch64"
    manifest["node"]["kernel"]["machine"] = "aarch64"


def _on_a_gpu(manifest: dict[str, Any]) -> None:
    manifest["gpu"] = {
        "driver_version": "580.159.04",
        "devices": [{"index": 0, "uuid": "GPU-0000", "name": H100}],
        "processes": [{"pid": 10, "ns_pid": 2, "gpu_bytes": 1 << 20,
                       "devices": {"GPU-0000": 1 << 20}}],
    }


def _everything(manifest: dict[str, Any]) -> None:
    _add_flag(manifest)
    _other_kernel(manifest)
    _on_a_gpu(manifest)


def _change_library(saved: Saved) -> Callable[[], None]:
    original = saved.library.read_bytes()
    changed = bytearray(original)
    changed[len(changed) // 2] ^= 0xFF  # same size: only the digest can tell
    saved.library.write_bytes(bytes(changed))
    return lambda: saved.library.write_bytes(original)


def _remove_library(saved: Saved) -> Callable[[], None]:
    aside = saved.library.with_suffix(".aside")
    saved.library.rename(aside)
    return lambda: aside.rename(saved.library)


def _library_and_flag(saved: Saved) -> Callable[[], None]:
    undo_claim = _claim(_add_flag)(saved)
    undo_file = _change_library(saved)
    return lambda: (undo_file(), undo_claim())


@dataclass(frozen=True)
class Scenario:
    name: str
    alter: Callable[[Saved], Callable[[], None]]
    kinds: tuple[str, ...]
    names: tuple[str, ...]  # what the message must name; "{lib}" is the library copy
    gpus: NodeGpus | None = None


SCENARIOS = [
    Scenario("cpu-flag", _claim(_add_flag), ("cpu",),
             ("lacks 3 feature flag(s)", "amx_fake", "avx10_fake", "sha9_fake",
              "same CPU generation")),
    Scenario("kernel-release", _claim(_other_kernel), ("kernel",),
             ("5.4.0-200-generic", "same Linux kernel series")),
    Scenario("architecture", _claim(_other_arch), ("cpu", "kernel"), ("aarch64",)),
    Scenario("library-changed", _change_library, ("files",),
             ("{lib} (other content)", "same Python environment")),
    Scenario("library-missing", _remove_library, ("files",), ("missing here: {lib}",)),
    Scenario("gpu-model", _claim(_on_a_gpu), ("gpu",),
             (f"GPU 0 is a {A100}, it was a {H100}", "same GPU models"),
             NodeGpus("580.159.04", (A100,))),
    Scenario("gpu-absent", _claim(_on_a_gpu), ("gpu",), ("no NVIDIA GPU can be read",)),
    Scenario("every-difference", _claim(_everything), ("cpu", "kernel", "gpu", "gpu"),
             ("avx10_fake", "5.4.0-200-generic", "the restore has 2", "branch 550"),
             NodeGpus("550.54.15", (H100, H100))),
    Scenario("library-and-flag", _library_and_flag, ("cpu", "files"),
             ("avx10_fake", "{lib} (other content)")),
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_a_node_that_cannot_run_the_snapshot_refuses_before_criu(saved, scenario):
    undo = scenario.alter(saved)
    saved.gpus[0] = scenario.gpus
    calls = CriuCalls(saved.engine)
    try:
        with pytest.raises(Incompatible) as err:
            run(saved.engine.restore(saved.snapshot.id))
    finally:
        del saved.engine.criu.run  # CriuCalls' recorder; the class's method again
        saved.gpus[0] = None
        undo()
    error = err.value
    assert error.step == "compatibility" and error.code == "incompatible_node"
    assert error.message.startswith(f"compatibility failed: snapshot {saved.snapshot.id}")
    for text in scenario.names:
        assert text.replace("{lib}", str(saved.library)) in error.message, error.message
    assert tuple(d["kind"] for d in error.details["differences"]) == scenario.kinds
    assert calls.argvs == [], "criu ran for a snapshot this node cannot run"
    assert [s.id for s in saved.store.list()] == [saved.snapshot.id]


def test_the_same_node_restores_and_a_format_2_manifest_skips_what_it_cannot_check(saved):
    # Last in the module: the scenarios above must each have left everything as it was.
    for label in ("current format", "format 2"):
        undo = _claim(_as_format_2)(saved) if label == "format 2" else (lambda: None)
        messages: list[str] = []
        trees = RestoredTrees()
        try:
            back = run(saved.engine.restore(saved.snapshot.id, partial(_keep_message,
                                                                       into=messages)))
            client = trees.connect(back.connection_info, back.pid)
            out = execute(client, "print(zlib_copy.zlibVersion().decode(), int(values.sum()))")
        finally:
            trees.close()
            undo()
        assert out.split() == [saved.zlib_version, str(3 * 999 * 1000 // 2)], label
        assert "compatibility" in back.timings, label
        skipped = [m for m in messages if m.startswith("note: snapshot format 2")]
        assert bool(skipped) == (label == "format 2"), messages


def _as_format_2(manifest: dict[str, Any]) -> None:
    manifest["format"] = 2
    del manifest["node"]


def _keep_message(progress: Progress, into: list[str]) -> None:
    if progress.message:
        into.append(progress.message)


def test_a_second_save_digests_only_what_changed(tmp_path):
    """The digest cache: a second save of the same kernel reads no mapped file again."""
    store = SnapshotStore(tmp_path / "store")
    engine = SnapshotEngine(store)
    handle = start_kernel()
    try:
        handle.execute("import numpy as np; a = np.ones(10)", timeout=120)
        target = SaveTarget(pid=handle.root_pid, connection_info=handle.km.get_connection_info(),
                            kernel_name="python3-snapshot")
        first = run(engine.save(target))
        digests = engine.compatibility.digests
        files = len(first.manifest["node"]["mapped_files"]["files"])
        assert digests.misses == files and digests.hits == 0
        second = run(engine.save(target))
        assert digests.misses == files and digests.hits == files
        assert (second.manifest["node"]["mapped_files"]["files"]
                == first.manifest["node"]["mapped_files"]["files"])
    finally:
        stop_kernel(handle)


# -- the comparisons themselves, with made-up nodes ----------------------------------------
def _gpu_section(*models: str, driver: str = "580.159.04", used: bool = True) -> dict[str, Any]:
    return {
        "driver_version": driver,
        "devices": [{"index": i, "uuid": f"GPU-{i}", "name": m} for i, m in enumerate(models)],
        "processes": [{"pid": 7, "ns_pid": 2, "devices": {"GPU-0": 1}}] if used else [],
    }


@pytest.mark.parametrize(
    ("saved_gpus", "node", "targets", "expected"),
    [
        (_gpu_section(H100), NodeGpus("580.65.06", (H100,)), None, []),
        (_gpu_section(H100, used=False), NodeGpus("550.1", (A100, A100)), None, []),
        (None, None, None, []),
        (_gpu_section(H100), None, None,
         ["the snapshot holds CUDA state, and no NVIDIA GPU can be read on this node"]),
        (_gpu_section(H100), NodeGpus("580.1", (A100,)), None,
         [f"other GPU models: GPU 0 is a {A100}, it was a {H100}"]),
        (_gpu_section(H100, H100), NodeGpus("580.1", (H100,)), None,
         [f"the snapshot's node had 2 GPU(s) ({H100}, {H100}), the restore has 1 ({H100})"]),
        (_gpu_section(H100), NodeGpus("570.86.10", (H100,)), None,
         ["the NVIDIA driver is 570.86.10 (branch 570), the snapshot's node had 580.159.04 "
          "(branch 580)"]),
        # Targets chosen for a remap replace this node's GPUs in the comparison.
        (_gpu_section(H100), NodeGpus("580.1", (A100, H100)), [H100], []),
        (_gpu_section(H100), NodeGpus("580.1", (H100, A100)), [A100],
         [f"other GPU models: GPU 0 is a {A100}, it was a {H100}"]),
    ],
    ids=["same", "unused", "none", "no-gpu-here", "model", "count", "driver-branch",
         "target-same-model", "target-other-model"],
)
def test_gpu_differences(saved_gpus, node, targets, expected):
    assert gpu_differences(saved_gpus, node, targets) == expected


def test_missing_cpu_flags_are_named_up_to_five_then_counted():
    here = compatibility.cpu_facts()
    found = compatibility.Findings()
    extra = [f"fake{i:02d}" for i in range(8)]
    compatibility.cpu_differences({**here, "flags": here["flags"] + extra}, found)
    assert found.refusals == [("cpu", "this CPU lacks 8 feature flag(s) the snapshot's node "
                               "had: fake00, fake01, fake02, fake03, fake04 and 3 more")]


@pytest.mark.parametrize(
    ("release", "refused", "warned"),
    [("same", False, False), ("patch", False, True), ("series", True, False)],
)
def test_kernel_series_refuses_and_patch_level_warns(release, refused, warned):
    here = compatibility.kernel_facts()
    major, minor = compatibility.kernel_series(here["release"]).split(".")
    other = {"same": here["release"], "patch": f"{major}.{minor}.99999-other",
             "series": f"{major}.{int(minor) + 1}.0"}[release]
    found = compatibility.Findings()
    compatibility.kernel_differences({**here, "release": other}, found)
    assert bool(found.refusals) == refused and bool(found.warnings) == warned


def test_the_digest_cache_sees_a_rewrite_at_the_same_size_and_mtime(tmp_path):
    path = tmp_path / "lib.so"
    path.write_bytes(b"a" * 4096)
    cache = FileDigests()
    first = cache.describe(str(path), "blake3")
    stat = path.stat()
    time.sleep(0.05)  # past the clock tick of the first write's ctime
    path.write_bytes(b"b" * 4096)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # mtime set back; ctime is not
    second = cache.describe(str(path), "blake3")
    assert first and second and first["digest"] != second["digest"] and cache.misses == 2
    assert cache.describe(str(tmp_path / "gone"), "blake3") is None
    assert cache.describe(str(path), "blake3") == second and cache.hits == 1


def test_a_fresh_cache_trusts_a_recorded_identity_only_while_the_file_keeps_it(tmp_path):
    """A server started after the save (an empty cache) digests only what changed since."""
    path = tmp_path / "lib.so"
    path.write_bytes(b"a" * 4096)
    recorded = FileDigests().describe(str(path), "blake3")
    assert recorded and len(recorded["identity"]) == 4
    # Another digest with the same identity is taken as recorded: the file is not read.
    claimed = {**recorded, "digest": "0" * 64}
    fresh = FileDigests()
    assert fresh.describe(str(path), "blake3", recorded=claimed)["digest"] == "0" * 64
    assert fresh.misses == 0
    # Rewritten at the same size and mtime: the ctime differs, so it is read again.
    stat = path.stat()
    time.sleep(0.05)
    path.write_bytes(b"b" * 4096)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    again = FileDigests().describe(str(path), "blake3", recorded=recorded)
    assert again and again["digest"] != recorded["digest"]
