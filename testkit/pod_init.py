"""PID 1 of a test pod (``testkit.pods``): run by ``unshare`` in the pod's new mount, pid,
network, uts, ipc and cgroup namespaces, it builds the pod's root file system as a container
runtime does, then reaps the pod's processes until it is killed. With ``"container": true``
in its spec it builds the root of another container of the pod instead, in a mount
namespace of its own inside the pod's other namespaces, and holds it.

The root: a tmpfs with the node image's directories bound read-only (this machine's /usr,
/etc, ... stand for the image the pods run), a private /tmp, /run and /dev, a fresh /proc
of the pod's pid namespace, /sys read-only with the pod's own cgroup hierarchies mounted
under it (seen from the pod's cgroup namespace), and the pod's volumes bound read-write.

Standard library only: it runs as ``python -I -S``. Argument: the pod's spec, JSON.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

# Not part of the node image: each pod has its own (or none).
PRIVATE = {"proc", "sys", "dev", "tmp", "run", "home", "mnt", "media", "lost+found"}
MNT_DETACH = 2
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, timeout=30)


def bind(source: str, target: Path, *, read_only: bool, recursive: bool = True) -> None:
    mount("--rbind" if recursive else "--bind", source, str(target))
    if read_only:
        mount("-o", "remount,bind,ro", str(target))


def host_cgroup_mounts() -> list[tuple[str, str, str]]:
    """(mount point, type, options) of this machine's cgroup hierarchies."""
    found = []
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            _source, point, kind, options = line.split()[:4]
            if kind in ("cgroup", "cgroup2"):
                kept = [o for o in options.split(",") if o not in ("rw", "ro", "relatime")
                        and not o.startswith(("nosuid", "nodev", "noexec"))]
                found.append((point, kind, ",".join(kept)))
    return found


def build_root(root: Path, spec: dict[str, object]) -> None:
    mount("-t", "tmpfs", "-o", "mode=0755", "pod-root", str(root))
    for entry in os.scandir("/"):
        target = root / entry.name
        if entry.is_symlink():
            target.symlink_to(os.readlink(entry.path))
        elif entry.is_dir() and entry.name not in PRIVATE:
            target.mkdir()
            bind(entry.path, target, read_only=True)
    for private in ("tmp", "run", "home"):
        (root / private).mkdir(exist_ok=True)
        mount("-t", "tmpfs", "-o", "mode=1777" if private == "tmp" else "mode=0755",
              f"pod-{private}", str(root / private))
    # The image's own paths where this machine keeps them in a private directory (a
    # checkout under /tmp): bound read-only at the same place.
    image_paths = spec.get("image_paths")
    assert isinstance(image_paths, list)
    for path in image_paths:
        inside = root / str(path).lstrip("/")
        if not inside.exists():
            inside.mkdir(parents=True)
            bind(str(path), inside, read_only=True)
    volumes = spec.get("volumes")
    assert isinstance(volumes, dict)
    for host_path, pod_path in volumes.items():
        inside = root / str(pod_path).lstrip("/")
        inside.mkdir(parents=True, exist_ok=True)
        bind(str(host_path), inside, read_only=False)
    devices = spec.get("devices")
    assert isinstance(devices, list)
    build_dev(root / "dev", [str(d) for d in devices])
    (root / "sys").mkdir()
    # Without this machine's mounts under /sys: the pod mounts its own cgroups there.
    bind("/sys", root / "sys", read_only=True, recursive=False)
    cgroups = root / "sys" / "fs" / "cgroup"
    mount("-t", "tmpfs", "-o", "mode=0755", "pod-cgroup", str(cgroups))
    for point, kind, options in host_cgroup_mounts():
        if point == "/sys/fs/cgroup":  # the unified hierarchy alone
            mount("-t", kind, "-o", options or "rw", kind, str(cgroups))
            continue
        inside = cgroups / os.path.relpath(point, "/sys/fs/cgroup")
        inside.mkdir(parents=True, exist_ok=True)
        mount("-t", kind, *(["-o", options] if options else []), kind, str(inside))
    (root / "proc").mkdir()


def build_dev(dev: Path, devices: list[str]) -> None:
    """A /dev of the basic nodes and the pod's ``devices`` (paths under /dev)."""
    dev.mkdir()
    mount("-t", "tmpfs", "-o", "mode=0755,nosuid", "pod-dev", str(dev))
    for path in [f"/dev/{name}" for name in DEVICES] + devices:
        inside = dev / os.path.relpath(path, "/dev")
        if os.path.isdir(path):
            inside.mkdir(parents=True)
        else:
            inside.parent.mkdir(parents=True, exist_ok=True)
            inside.touch()
        mount("--rbind", path, str(inside))
    (dev / "pts").mkdir()
    mount("-t", "devpts", "-o", "newinstance,ptmxmode=0666,mode=0620", "devpts", str(dev / "pts"))
    (dev / "ptmx").symlink_to("pts/ptmx")
    (dev / "shm").mkdir()
    mount("-t", "tmpfs", "-o", "mode=1777", "pod-shm", str(dev / "shm"))
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        (dev / name).symlink_to(target)


def enter_root(root: Path) -> None:
    """pivot_root into ``root``, the old root stacked on it and then detached (runc's way:
    no directory for the old root is needed). By system calls: util-linux's umount reads
    /proc, which the new root has not mounted yet."""
    os.chdir(root)
    subprocess.run(["pivot_root", ".", "."], check=True, capture_output=True)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(b".", MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), "umount2 of the old root")
    os.chdir("/")
    mount("-t", "proc", "-o", "nosuid,nodev,noexec", "proc", "/proc")


def reap_forever() -> None:
    """PID 1's duty: collect the pod's orphans. SIGTERM ends the pod (and, as PID 1 exits,
    every process in it)."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        try:
            os.wait()
        except ChildProcessError:
            signal.pause()


def main() -> None:
    spec = json.loads(sys.argv[1])
    build_root(Path(spec["root"]), spec)
    enter_root(Path(spec["root"]))
    if not spec.get("container"):
        Path("/proc/sys/kernel/hostname").write_text(spec["hostname"])
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True, capture_output=True)
    print("ready", flush=True)
    sys.stdout.close()
    os.close(1)
    if spec.get("container"):
        # Another container of the pod: its mount namespace lives as long as this holder,
        # which the pod's end kills with every other process of the pod.
        while True:
            signal.pause()
    reap_forever()


if __name__ == "__main__":
    try:
        main()
    except subprocess.CalledProcessError as exc:
        sys.exit(f"pod_init: {' '.join(map(str, exc.cmd))}: {exc.stderr.decode().strip()}")
