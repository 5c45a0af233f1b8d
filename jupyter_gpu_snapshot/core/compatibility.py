"""Whether this node can run a snapshot: what a save records about its node, and the check a
restore makes once the manifest is authenticated and before criu runs.

Recorded at save, in the signed manifest's ``node`` section:
- ``cpu``: the architecture and the CPU feature flags (``/proc/cpuinfo``);
- ``kernel``: the Linux release and machine (``uname``);
- ``mapped_files``: every regular file the kernel's processes had mapped privately (the
  interpreter, every shared library, locale data), with its size and digest.
The GPUs are the ``gpu`` section the GPU layer writes when the kernel holds CUDA state.

Refused at restore, in one error that lists every difference:
- CPU flags the saving node had and this one lacks: the image's code may use them (numpy and
  torch pick AVX-512 or AMX kernels at import), and would die of SIGILL;
- another architecture, or another kernel major.minor: the vDSO and what criu restores
  (mappings, namespaces, sockets) are specific to a kernel series;
- a mapped file that is missing or has other content: criu maps it again from its path, so
  the restored code would run with another library under it;
- another GPU model, GPU count or driver branch (the driver's user-space part is in the image).
Warned only: a kernel release that differs below major.minor (a patch or a local build).

Manifests of format 2 carry no ``node`` section; their restore skips those checks and says so.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import socket
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import Incompatible
from .file_access import OWN_FILES, FileAccess
from .store import digest_files, preferred_algorithm
from .user_paths import UserPath

# Named in a message; the rest of a long list is counted.
SHOWN = 5
_KERNEL_SERIES = re.compile(r"^(\d+)\.(\d+)")


@dataclass(frozen=True)
class NodeGpus:
    """This node's GPUs as the check compares them: driver version and models by index.

    Built from the GPU layer's inventory by whoever builds the engine (``local_engine.py``), so
    that the core imports no GPU code.
    """

    driver_version: str
    models: tuple[str, ...]


GpuReader = Callable[[], "NodeGpus | None"]


def cpu_facts() -> dict[str, Any]:
    """Architecture, model name and feature flags of this node's CPU."""
    flags: list[str] = []
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            key = key.strip()
            # x86 says "flags", arm64 says "Features"; every core lists the same.
            if key in ("flags", "Features") and not flags:
                flags = sorted(set(value.split()))
            elif key == "model name" and not model:
                model = value.strip()
            if flags and model:
                break
    return {"arch": platform.machine(), "model": model, "flags": flags}


def kernel_facts() -> dict[str, Any]:
    return {"release": platform.release(), "machine": platform.machine()}


def node_facts() -> dict[str, Any]:
    """The cheap facts of the ``node`` section (the mapped files come later, from a thread)."""
    return {"hostname": socket.gethostname(), "cpu": cpu_facts(), "kernel": kernel_facts()}


def kernel_series(release: str) -> str:
    """``6.18`` of ``6.18.44-fc-v782``: the part whose change refuses a restore."""
    found = _KERNEL_SERIES.match(release)
    return f"{found[1]}.{found[2]}" if found else release


def driver_branch(version: str) -> str:
    """``580`` of ``580.159.04``."""
    return version.split(".", 1)[0]


class FileDigests:
    """Digests of regular files, cached by (device, inode, size, mtime, ctime).

    Only ever a shortcut: a file that changed has another mtime or ctime (ctime cannot be
    set back from user space), so a hit is the file that was digested. Lives as long as the
    engine (a server's lifetime); thread-safe.
    """

    def __init__(self, max_entries: int = 20000) -> None:
        self.max_entries = max_entries
        self._cache: dict[tuple[object, ...], str] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def describe(
        self, path: str, algorithm: str, cancel: threading.Event | None = None,
        recorded: dict[str, Any] | None = None, files: FileAccess = OWN_FILES,
    ) -> dict[str, Any] | None:
        """``{"path", "size", "digest", "identity"}`` of a regular file, or None when there is
        none. A ``recorded`` entry (from an authenticated manifest) whose identity and size
        the file still has gives its digest without reading the file, as a cache hit does:
        a server started after the save restores without digesting every library again.
        ``files`` opens it: as the kernel's user, for the node agent."""
        try:
            fd = files.open(path, os.O_RDONLY, UserPath.MAPPED_FILE)
        except OSError:
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                return None
            identity = [info.st_dev, info.st_ino, info.st_mtime_ns, info.st_ctime_ns]
            key = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns,
                   algorithm)
            with self._lock:
                found = self._cache.get(key)
            if (found is None and recorded is not None
                    and recorded.get("identity") == identity
                    and recorded.get("size") == info.st_size):
                found = str(recorded["digest"])
                with self._lock:
                    self._cache[key] = found
            if found is None:
                found = digest_files([(fd, info.st_size)], algorithm, cancel=cancel)[0]
                with self._lock:
                    self.misses += 1
                    if len(self._cache) >= self.max_entries:
                        self._cache.pop(next(iter(self._cache)))
                    self._cache[key] = found
            else:
                with self._lock:
                    self.hits += 1
            return {"path": path, "size": info.st_size, "digest": found, "identity": identity}
        finally:
            os.close(fd)


@dataclass
class Findings:
    """What a restore would get wrong on this node: refusals, warnings, checks skipped."""

    refusals: list[tuple[str, str]] = field(default_factory=list)  # (kind, what differs)
    warnings: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def refuse(self, kind: str, text: str) -> None:
        self.refusals.append((kind, text))


_ADVICE = {
    "cpu": "the same CPU generation (a CPU with every flag listed)",
    "kernel": "the same Linux kernel series and architecture",
    "files": "the same Python environment (container image, virtualenv or conda env) at the "
    "same paths, or put the files back as they were at the save",
    "gpu": "the same GPU models and count, and the same NVIDIA driver branch",
}


def _listed(items: Sequence[str]) -> str:
    shown = ", ".join(items[:SHOWN])
    rest = len(items) - SHOWN
    return shown + (f" and {rest} more" if rest > 0 else "")


def cpu_differences(saved: dict[str, Any], found: Findings) -> None:
    here = cpu_facts()
    if saved.get("arch") != here["arch"]:
        found.refuse("cpu", f"the CPU is {here['arch']}, the snapshot's node was "
                     f"{saved.get('arch')}")
        return
    missing = sorted(set(saved.get("flags", [])) - set(here["flags"]))
    if missing:
        found.refuse("cpu", f"this CPU lacks {len(missing)} feature flag(s) the snapshot's "
                     f"node had: {_listed(missing)}")


def kernel_differences(saved: dict[str, Any], found: Findings) -> None:
    here = kernel_facts()
    release, machine = str(saved.get("release", "")), str(saved.get("machine", ""))
    if machine != here["machine"] or kernel_series(release) != kernel_series(here["release"]):
        found.refuse("kernel", f"the Linux kernel is {here['release']} ({here['machine']}), "
                     f"the snapshot's node ran {release} ({machine})")
    elif release != here["release"]:
        found.warnings.append(f"the Linux kernel is {here['release']}, the snapshot's node ran "
                              f"{release} (same series {kernel_series(release)})")


def file_differences(
    saved: dict[str, Any], digests: FileDigests, found: Findings,
    cancel: threading.Event | None = None, files: FileAccess = OWN_FILES,
) -> None:
    algorithm = str(saved.get("algorithm"))
    missing: list[str] = []
    changed: list[str] = []
    for entry in saved.get("files", []):
        path = str(entry["path"])
        now = digests.describe(path, algorithm, cancel, recorded=entry, files=files)
        if now is None:
            missing.append(path)
        elif now["size"] != entry["size"]:
            changed.append(f"{path} ({now['size']} bytes, {entry['size']} at the save)")
        elif now["digest"] != entry["digest"]:
            changed.append(f"{path} (other content)")
    if missing:
        found.refuse("files", f"{len(missing)} file(s) the kernel had mapped are missing here: "
                     f"{_listed(missing)}")
    if changed:
        found.refuse("files", f"{len(changed)} file(s) the kernel had mapped differ here: "
                     f"{_listed(changed)}")


def gpu_differences(
    saved: dict[str, Any] | None,
    node: NodeGpus | None,
    targets: Sequence[str] | None = None,
) -> list[str]:
    """How the GPUs a restore would use differ from those of the save; empty when they match.

    ``targets`` are the models of the GPUs chosen for the restore, in the order of the
    process's devices; by default this node's GPUs by index. A kernel that held no CUDA
    state has nothing to compare.
    """
    if not saved or not saved.get("processes"):
        return []
    if node is None:
        return ["the snapshot holds CUDA state, and no NVIDIA GPU can be read on this node"]
    found = []
    before = [str(d.get("name")) for d in sorted(saved.get("devices", []),
                                                   key=lambda d: int(d.get("index", 0)))]
    now = list(node.models if targets is None else targets)
    if len(before) != len(now):
        found.append(f"the snapshot's node had {len(before)} GPU(s) "
                     f"({_listed(before)}), the restore has {len(now)} ({_listed(now)})")
    else:
        other = [f"GPU {i} is a {new}, it was a {old}"
                 for i, (old, new) in enumerate(zip(before, now, strict=True)) if old != new]
        if other:
            found.append(f"other GPU models: {_listed(other)}")
    saved_driver = str(saved.get("driver_version", ""))
    if saved_driver and driver_branch(saved_driver) != driver_branch(node.driver_version):
        found.append(f"the NVIDIA driver is {node.driver_version} (branch "
                     f"{driver_branch(node.driver_version)}), the snapshot's node had "
                     f"{saved_driver} (branch {driver_branch(saved_driver)})")
    return found


class NodeCompatibility:
    """Records this node's facts at save and compares a snapshot's with them at restore.

    ``gpus`` reads this node's GPUs (None without a driver); it is called only for snapshots
    that hold CUDA state. ``digests`` caches file digests across saves and restores.
    """

    def __init__(self, gpus: GpuReader | None = None) -> None:
        self._gpus = gpus or (lambda: None)
        self.digests = FileDigests()

    def record_files(
        self, paths: Sequence[str], cancel: threading.Event | None = None,
        files: FileAccess = OWN_FILES,
    ) -> dict[str, Any]:
        """The ``mapped_files`` section for ``paths``, each opened by ``files``; blocking,
        run in a worker thread by ``SnapshotEngine.save`` while criu dumps."""
        algorithm = preferred_algorithm()
        started = time.monotonic()
        found = [e for p in paths
                 if (e := self.digests.describe(p, algorithm, cancel, files=files))]
        return {"algorithm": algorithm, "files": found,
                "seconds": round(time.monotonic() - started, 4)}

    def differences(
        self,
        manifest: dict[str, Any],
        gpu_targets: Sequence[str] | None = None,
        cancel: threading.Event | None = None,
        files: FileAccess = OWN_FILES,
    ) -> Findings:
        """Every way ``manifest``'s node differs from this one; blocking (file digests).

        Called by ``SnapshotEngine.restore`` on an authenticated manifest only.
        """
        found = Findings()
        node = manifest.get("node")
        if not node:
            found.skipped.append(
                f"snapshot format {manifest.get('format')} records no CPU, kernel or mapped "
                "files of its node: those checks are skipped"
            )
        else:
            if "cpu" in node:
                cpu_differences(node["cpu"], found)
            if "kernel" in node:
                kernel_differences(node["kernel"], found)
            if "mapped_files" in node:
                file_differences(node["mapped_files"], self.digests, found, cancel, files)
            else:
                found.skipped.append("the save recorded no mapped files (it was committed by a "
                                     "recovery): the environment check is skipped")
        gpu = manifest.get("gpu")
        if gpu and gpu.get("processes"):
            for text in gpu_differences(gpu, self._gpus(), gpu_targets):
                found.refuse("gpu", text)
        return found


def refusal(snapshot_id: str, saved_on: str, findings: Findings) -> Incompatible:
    """The one error that names every difference and what to do about each kind."""
    kinds = list(dict.fromkeys(kind for kind, _ in findings.refusals))
    where = f" (saved on {saved_on})" if saved_on else ""
    return Incompatible(
        "compatibility",
        f"snapshot {snapshot_id}{where} cannot run on this node ({socket.gethostname()}): "
        + "; ".join(text for _, text in findings.refusals),
        hint="restore it on a node with " + "; and with ".join(_ADVICE[k] for k in kinds),
        details={"differences": [{"kind": k, "text": t} for k, t in findings.refusals]},
    )
