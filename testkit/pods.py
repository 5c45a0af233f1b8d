"""Pods for the tests, built from the parts a kubelet's container runtime uses: the CI
machines have no Kubernetes, and Debian's podman does not start containers on them (crun
refuses their hybrid cgroup layout, runc fails to mount the cgroups into its root, and root
lacks CAP_SYS_RESOURCE for the default rlimits).

A ``Pod`` has its own mount, pid, network, uts, ipc and cgroup namespaces; its own cgroup
in each of this machine's hierarchies; its own root file system, in which this machine's
directories stand for the node image, read-only (``pod_init``); a veth pair to this
machine with an address of its own, as a CNI plugin gives; and the volumes it is given,
read-write at the path asked for, and device nodes as a device plugin hands them out.
``add_container`` gives it further containers (a root and mounts of their own, the pod's
other namespaces), as a sidecar with ``shareProcessNamespace``. Processes are started in
it with ``argv``, which enters the pod's cgroup, every one of its namespaces and the
container's root, as the runtime starts a container's process. Deleting the pod kills its
PID 1 and with it every process in it, as a pod's deletion does.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import psutil

from testkit.pod_init import host_cgroup_mounts

REPO = Path(__file__).resolve().parents[1]
POD_INIT = Path(__file__).with_name("pod_init.py")
# Each pod's cgroup, in every hierarchy: a kubelet's pod slice.
POD_CGROUPS = "jgs-test-pods"
READY_SECONDS = 60.0


def gpu_devices(gpus: int) -> tuple[str, ...]:
    """What the NVIDIA device plugin gives a container with ``gpus`` GPUs: their nodes, the
    control and UVM nodes (and the capability folder where there is one)."""
    wanted = [f"/dev/nvidia{i}" for i in range(gpus)] + [
        "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-caps"]
    return tuple(d for d in wanted if Path(d).exists())


class PodError(RuntimeError):
    """The pod could not be made."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def cgroup_dirs(name: str) -> list[Path]:
    """The pod's cgroup in each of this machine's hierarchies (v1 controllers and the
    unified one)."""
    return [Path(point) / POD_CGROUPS / name for point, _kind, _options in host_cgroup_mounts()]


def image_paths() -> list[str]:
    """The directories this checkout runs from (the repository, the environment, the
    interpreter and every folder on its path): the pods' image holds them at the same
    places, wherever this machine keeps them."""
    found = [REPO, Path(sys.prefix), Path(sys.base_prefix)]
    found += [Path(p) for p in sys.path if p and Path(p).is_dir()]
    return sorted({str(p.resolve()) for p in found})


def make_cgroup(cgroup: Path) -> None:
    """The pod's ``cgroup`` under the pods' one; a v1 cpuset takes its parent's CPUs and
    memory nodes, as a runtime sets them (an empty cpuset admits no process)."""
    for level in (cgroup.parent, cgroup):
        level.mkdir(exist_ok=True)
        for inherited in ("cpuset.cpus", "cpuset.mems"):
            own = level / inherited
            parents = level.parent / inherited  # none in cgroup v2's root: inherited there
            if own.exists() and parents.exists() and not own.read_text().strip():
                own.write_text(parents.read_text())


class Pod:
    """A running pod named ``name``; ``volumes`` maps this machine's directories to the
    paths the pod sees them at; ``devices`` are this machine's device nodes (or folders of
    them) the pod gets in its /dev, as a device plugin allocates GPUs. ``ip`` is its
    address, reachable from this machine."""

    def __init__(self, name: str, workdir: Path, volumes: Mapping[Path, str],
                 devices: Sequence[str] = ()) -> None:
        self.name = f"{name}-{uuid.uuid4().hex[:6]}"
        self.workdir = workdir / self.name
        self.workdir.mkdir(parents=True)
        subnet = f"10.{random.randrange(100, 250)}.{random.randrange(0, 250)}"
        self.host_ip, self.ip = f"{subnet}.1", f"{subnet}.2"
        self.host_end = f"jgsp{uuid.uuid4().hex[:8]}"
        self.cgroups = cgroup_dirs(self.name)
        for cgroup in self.cgroups:
            make_cgroup(cgroup)
        (self.workdir / "rootfs").mkdir()
        self.containers: list[Container] = []
        self._enter_cgroups = "".join(
            f'echo $$ > "{c}/cgroup.procs" && ' for c in self.cgroups)
        self._runtime = self._start_init(
            self.workdir / "rootfs", volumes, devices, container=False,
            enter=["unshare", "--mount", "--uts", "--ipc", "--net", "--pid", "--cgroup",
                   "--fork", "--kill-child", "--propagation", "private", "--"])
        try:
            self._wait_ready(self._runtime)
            self.init_pid = self._only_child(self._runtime)
            self._connect()
        except BaseException:
            self.delete()
            raise

    def _start_init(
        self, root: Path, volumes: Mapping[Path, str], devices: Sequence[str], *,
        container: bool, enter: list[str],
    ) -> subprocess.Popen[bytes]:
        spec = {
            "root": str(root),
            "hostname": self.name,
            "container": container,
            "volumes": {str(host): pod for host, pod in volumes.items()},
            "devices": list(devices),
            "image_paths": image_paths(),
        }
        with open(root.parent / f"{root.name}.log", "wb") as init_log:
            return subprocess.Popen(
                ["sh", "-c", self._enter_cgroups + 'exec "$@"', "pod-runtime", *enter,
                 sys.executable, "-I", "-S", str(POD_INIT), json.dumps(spec)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=init_log,
                env={"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")},
            )

    def add_container(self, name: str, volumes: Mapping[Path, str],
                      devices: Sequence[str] = ()) -> Container:
        """Another container of the pod: its own root and mounts (``volumes``, ``devices``),
        the pod's network, pid, uts, ipc and cgroup namespaces, as a sidecar with
        ``shareProcessNamespace``."""
        root = self.workdir / name
        root.mkdir()
        holder = self._start_init(
            root, volumes, devices, container=True,
            enter=["nsenter", "-t", str(self.init_pid), "-n", "-i", "-u", "-p", "-C", "--",
                   "unshare", "--mount", "--propagation", "private", "--"])
        started = Container(self, name, holder)
        self.containers.append(started)
        self._wait_ready(holder, root)
        started.pid = self._only_child(holder)
        return started

    def _wait_ready(self, init: subprocess.Popen[bytes], root: Path | None = None) -> None:
        assert init.stdout is not None
        line = init.stdout.readline()
        if line.strip() != b"ready":
            init.wait(timeout=READY_SECONDS)
            log = (root or self.workdir / "rootfs").with_suffix(".log")
            raise PodError(f"pod {self.name} did not start: {log.read_text(errors='replace')}")

    def _only_child(self, init: subprocess.Popen[bytes]) -> int:
        children = psutil.Process(init.pid).children()
        if len(children) != 1:
            raise PodError(f"pod {self.name}: no single process under {init.args}")
        return int(children[0].pid)

    def _connect(self) -> None:
        """A veth pair from this machine into the pod, each end with an address."""
        _ip("link", "add", self.host_end, "type", "veth", "peer", "name", "eth0",
            "netns", str(self.init_pid))
        _ip("addr", "add", f"{self.host_ip}/30", "dev", self.host_end)
        _ip("link", "set", self.host_end, "up")
        inside = ["nsenter", "-t", str(self.init_pid), "-n", "ip"]
        # The default route leads to this machine, where the tests' cluster services
        # listen (``service_address``).
        for args in (["addr", "add", f"{self.ip}/30", "dev", "eth0"],
                     ["link", "set", "eth0", "up"],
                     ["route", "add", "default", "via", self.host_ip]):
            subprocess.run([*inside, *args], check=True, capture_output=True, timeout=30)

    def argv(self, *command: str, workdir: str = "/", user: str | None = None) -> list[str]:
        """``command`` as a process of the pod's first container, in ``workdir``, as
        ``user`` (a name; else root): in the pod's cgroup, all its namespaces and that
        container's root."""
        return self.enter(self.init_pid, command, workdir, user)

    def enter(self, holder: int, command: Sequence[str], workdir: str,
              user: str | None) -> list[str]:
        """``command`` in the container whose root process on this machine is ``holder``."""
        as_user = [] if user is None else [
            "setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", "--"]
        return ["sh", "-c", self._enter_cgroups + 'exec "$@"', "pod-exec",
                "nsenter", "-t", str(holder), "-m", "-u", "-i", "-n", "-p", "-C",
                # nsenter would open a directory named to --wd outside the pod's root.
                "-r", "-w", "--", *as_user, "sh", "-c", 'cd "$0" && exec "$@"', workdir,
                *command]

    def holds(self, pid: int) -> bool:
        """Whether process ``pid`` runs in the pod: in its network namespace and its cgroup
        (a process the runtime starts in the pod is no child of its PID 1)."""
        try:
            same_network = (os.stat(f"/proc/{pid}/ns/net").st_ino
                            == os.stat(f"/proc/{self.init_pid}/ns/net").st_ino)
            with open(f"/proc/{pid}/cgroup") as cgroups:
                lines = [line.strip() for line in cgroups if line.strip()]
        except OSError:  # ended, or not ours to read (this machine's own init)
            return False
        # Only the hierarchies the pods have cgroups in: a hierarchy that no one mounted
        # (one that criu's zdtm suite named and left) holds every process at its root.
        mounted = {options for _point, _kind, options in host_cgroup_mounts()}
        ours = [line for line in lines if line.split(":")[1] in mounted | {""}]
        return same_network and bool(ours) and all(
            line.endswith(f"/{POD_CGROUPS}/{self.name}") for line in ours)

    def delete(self) -> None:
        """Kills the pod: PID 1 first, which takes every process of its pid namespace with
        it; then its network, cgroups and root."""
        with contextlib.suppress(ProcessLookupError, AttributeError):
            os.kill(self.init_pid, signal.SIGKILL)
        for init in [self._runtime, *(c.holder for c in self.containers)]:
            with contextlib.suppress(ProcessLookupError):
                init.kill()
            init.wait(timeout=60)
            if init.stdout is not None:
                init.stdout.close()
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", self.host_end)
        deadline = time.monotonic() + 30
        for cgroup in self.cgroups:
            while cgroup.exists():
                try:
                    cgroup.rmdir()
                except OSError:  # its last processes are still being reaped
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)


class Container:
    """A further container of a pod (``Pod.add_container``)."""

    def __init__(self, pod: Pod, name: str, holder: subprocess.Popen[bytes]) -> None:
        self.pod = pod
        self.name = name
        self.holder = holder
        self.pid = 0  # the host pid of the process that holds its mount namespace

    def argv(self, *command: str, workdir: str = "/", user: str | None = None) -> list[str]:
        """``command`` as a process of this container (see ``Pod.argv``)."""
        return self.pod.enter(self.pid, command, workdir, user)


def write_runtime_record(pod: Pod, bundles: Path, namespace: str, pod_name: str,
                         container: str = "notebook") -> None:
    """What containerd records of the pod's container, in its bundle under ``bundles``:
    the Kubernetes pod it belongs to (``namespace``/``pod_name``, with a uid of its own) in
    ``config.json``'s annotations, and the host pid of its init in ``init.pid``. An agent in
    the node's namespaces tells by this record which pod a process runs in. The bundle is
    named by the container's id, which the runtime gives the container's cgroup as its last
    component: the pod's name here. The runtime's directories and files are root's and
    writable by nobody else, and a record that is not is refused."""
    bundle = bundles / pod.name
    for directory in (bundles, bundle):
        directory.mkdir(mode=0o755, exist_ok=True)
        directory.chmod(0o755)  # whatever the umask
    annotations = {
        "io.kubernetes.cri.sandbox-namespace": namespace,
        "io.kubernetes.cri.sandbox-name": pod_name,
        "io.kubernetes.cri.sandbox-uid": str(uuid.uuid4()),
        "io.kubernetes.cri.container-name": container,
        "io.kubernetes.cri.container-type": "container",
    }
    record = {
        "config.json": json.dumps({"ociVersion": "1.0.2", "annotations": annotations}),
        "init.pid": str(pod.init_pid),
    }
    for name, text in record.items():
        (bundle / name).write_text(text)
        (bundle / name).chmod(0o644)


@contextlib.contextmanager
def service_address() -> Iterator[str]:
    """An address of this machine's that every pod reaches through its default route, as
    pods reach a cluster's Service: on the loopback interface, removed on leaving."""
    address = f"10.96.{random.randrange(0, 250)}.{random.randrange(2, 250)}/32"
    _ip("addr", "add", address, "dev", "lo")
    try:
        yield address.split("/")[0]
    finally:
        _ip("addr", "del", address, "dev", "lo")


@contextlib.contextmanager
def pods(workdir: Path) -> Iterator[list[Pod]]:
    """The pods a test makes, deleted when it ends, whatever happened."""
    made: list[Pod] = []
    try:
        yield made
    finally:
        for pod in made:
            pod.delete()
