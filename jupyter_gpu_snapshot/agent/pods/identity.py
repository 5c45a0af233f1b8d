"""Which Kubernetes pod a process on this node runs in, as the kernel and the container
runtime say it: for a node agent run as a DaemonSet in the node's PID namespace, whose
callers are processes in users' pods. Users of different pods may share one uid, so the
pod, not the uid, tells them apart; nothing of it comes from the request.

- The container: the last component of the process's cgroup, which the runtime names
  after the container's id (``cri-containerd-ID.scope`` and the like with the systemd
  cgroup driver, the bare id with cgroupfs). A container's processes cannot leave its
  cgroup. Where it is delegated to them, they can make cgroups below it and enter them:
  a process in one is refused, whether its name is no container's or another pod's
  container's (the check below).
- The pod: the annotations the runtime wrote into that container's OCI bundle
  (``config.json``), in directories of root's that nobody else can change, read without
  following a link.
- The check: the process shares the PID and network namespaces of the container's init,
  whose pid the runtime recorded in the bundle. A process whose cgroup names a container
  it does not run in (a delegated cgroup named after another pod's container) is refused.

The process is the one that connected, identified when the agent accepts the connection
(``server``), through the pidfd the kernel gives of it (``SO_PEERPIDFD``): held from the
first read to the last, it tells whether the caller lived throughout, so a pid reused
meanwhile is never taken for it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import stat
from collections.abc import Sequence
from dataclasses import dataclass

from ...agent_client.protocol import Refused
from ...core.safe_fs import DIR_FLAGS, kind_of, open_regular

DEFAULT_BUNDLES: tuple[str, ...] = (
    "/run/containerd/io.containerd.runtime.v2.task/k8s.io/{id}",  # containerd's CRI plugin
    "/run/containers/storage/overlay-containers/{id}/userdata",  # CRI-O
)

# What runtimes put around a container's id in its cgroup's name: the systemd cgroup
# driver's scopes (containerd, CRI-O, cri-dockerd) and CRI-O's cgroupfs directory. The
# cgroupfs driver of the others names the cgroup by the bare id.
_SCOPE_PREFIXES = ("cri-containerd-", "cri-o-", "crio-", "docker-")
_CGROUPFS_PREFIXES = ("crio-",)
_CONTAINER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
# Kubernetes names: namespaces and pods are DNS-1123 subdomains, containers DNS-1123 labels.
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_DNS_LABEL_NAME = re.compile(_DNS_LABEL)
# A pod's uid is a UUID, or a hash of its manifest for a static pod.
_POD_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")

# The annotations of the pod in a container's config.json: (namespace, pod, pod uid,
# container), as each runtime writes them.
_ANNOTATION_SETS = (
    ("io.kubernetes.cri.sandbox-namespace", "io.kubernetes.cri.sandbox-name",
     "io.kubernetes.cri.sandbox-uid", "io.kubernetes.cri.container-name"),  # containerd
    ("io.kubernetes.pod.namespace", "io.kubernetes.pod.name",
     "io.kubernetes.pod.uid", "io.kubernetes.container.name"),  # CRI-O
)
# Where the runtime keeps the host pid of the container's init: containerd's bundle,
# CRI-O's userdata directory.
_INIT_PID_FILES = ("init.pid", "pidfile")
# A config.json holds the container's whole spec (mounts, environment, ...): far below this.
_MAX_CONFIG_BYTES = 4 << 20
_MAX_PID_FILE_BYTES = 64

_HINT = ("in a Kubernetes deployment the node agent serves only processes of pods' "
         "containers, as the node's container runtime (containerd or CRI-O) runs them")


class NotInPod(Refused):
    """The caller's pod could not be told for certain: it runs in no container of a pod,
    or what the kernel and the runtime say of it does not agree."""


def _refuse(cause: str) -> NotInPod:
    return NotInPod("agent", cause, hint=_HINT)


@dataclass(frozen=True)
class PodIdentity:
    """The pod and container a process runs in."""

    namespace: str
    pod: str
    pod_uid: str
    container: str
    container_id: str
    # The host pid of the container's init, as the runtime recorded it.
    init_pid: int

    @property
    def realm_name(self) -> str:
        return f"{self.namespace}/{self.pod}"


# -- the container, from the cgroup --------------------------------------------------------

def _cgroup_path(pid: int) -> str:
    """The cgroup v2 path of ``pid`` where it has one below the root, else its first v1
    one (a hybrid machine whose runtime uses the v1 hierarchies)."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
    except (FileNotFoundError, ProcessLookupError) as exc:
        raise _refuse(f"process {pid} has ended") from exc
    except OSError as exc:
        raise _refuse(f"the cgroup of process {pid} cannot be read: {exc.strerror}") from exc
    entries = [line.split(":", 2) for line in lines]
    entries = [e for e in entries if len(e) == 3]
    unified = [path for hierarchy, controllers, path in entries
               if hierarchy == "0" and not controllers]
    if unified and unified[0] != "/":
        return unified[0]
    # A v1 hierarchy of controllers, or systemd's: the runtimes put a container in those. A
    # hierarchy only named (``name=...``, as criu's zdtm suite leaves them) holds every
    # process at its root and says nothing of containers.
    legacy = [path for hierarchy, controllers, path in entries
              if hierarchy != "0" and (not controllers.startswith("name=")
                                       or controllers == "name=systemd")]
    if legacy:
        return legacy[0]
    return unified[0] if unified else ""


def _undecorated(name: str) -> str | None:
    """The container id in a cgroup's ``name``; None for a systemd unit of anything else."""
    if name.endswith(".scope"):
        for prefix in _SCOPE_PREFIXES:
            if name.startswith(prefix):
                return name[len(prefix):-len(".scope")]
        return None
    if name.endswith(".slice"):
        return None
    for prefix in _CGROUPFS_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def container_id_of(pid: int) -> str:
    """The id of the container process ``pid`` runs in, from its cgroup's name."""
    path = _cgroup_path(pid)
    name = path.rstrip("/").rsplit("/", 1)[-1]
    container_id = _undecorated(name)
    if container_id is None or not _CONTAINER_ID.fullmatch(container_id):
        where = f"cgroup {path}" if path else "no cgroup"
        raise _refuse(f"process {pid} runs in {where}, which is no container's")
    return container_id


# -- the bundle, read only through directories of root's -----------------------------------

def _trust_problem(info: os.stat_result) -> str | None:
    """Why a file or directory of ``info`` could be changed by someone other than root."""
    if info.st_uid != 0:
        return f"is owned by uid {info.st_uid}, not by root"
    writers = [who for who, bit in (("group", 0o020), ("others", 0o002))
               if info.st_mode & bit]
    # A sticky directory of root's (/tmp) lets nobody else rename or remove the entries of
    # root's below it, and every entry on the way is checked to be root's. The runtimes'
    # own state directories are never writable by others.
    if writers and not (stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX):
        return f"is writable by {' and '.join(writers)} (mode {info.st_mode & 0o7777:o})"
    return None


def _require_trusted(fd: int, path: str) -> None:
    problem = _trust_problem(os.fstat(fd))
    if problem is not None:
        raise _refuse(f"the container runtime's {path} {problem}")


def _describe_unopenable(name: str, dir_fd: int, path: str, exc: OSError) -> NotInPod:
    """Why ``name`` could not be opened: a link or a file of the wrong kind (refused by
    ``O_NOFOLLOW``, ``O_DIRECTORY`` or ``open_regular``), or the system's own error."""
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, None):
        try:
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except OSError:
            pass
        else:
            return _refuse(f"the container runtime's {path} is {kind_of(mode)}, not what "
                           "a runtime keeps there")
    return _refuse(f"the container runtime's {path} cannot be opened: "
                   f"{exc.strerror or exc}")


def _open_bundle(path: str) -> int | None:
    """An fd of directory ``path``, reached from / one component at a time without
    following a link, each component root's and writable by nobody else; None if it does
    not exist."""
    names = [name for name in path.split("/") if name]
    if not path.startswith("/") or any(name in (".", "..") for name in names):
        raise _refuse(f"the container bundle path {path} is not an absolute plain path")
    fd = os.open("/", DIR_FLAGS)
    try:
        _require_trusted(fd, "/")
        walked = ""
        for name in names:
            walked += "/" + name
            try:
                next_fd = os.open(name, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                os.close(fd)
                return None
            except OSError as exc:
                raise _describe_unopenable(name, fd, walked, exc) from exc
            os.close(fd)
            fd = next_fd
            _require_trusted(fd, walked)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_trusted(name: str, dir_fd: int, path: str, limit: int) -> bytes | None:
    """The contents of regular file ``name`` in ``dir_fd``, root's and writable by nobody
    else; None if there is none."""
    try:
        fd, size = open_regular(name, dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _describe_unopenable(name, dir_fd, path, exc) from exc
    try:
        _require_trusted(fd, path)
        if size > limit:
            raise _refuse(f"the container runtime's {path} has {size} bytes, more than "
                          f"{limit}")
        return os.read(fd, limit + 1)
    finally:
        os.close(fd)


def _pod_annotations(config: bytes, path: str) -> tuple[str, str, str, str]:
    """(namespace, pod, pod uid, container) from a container's OCI ``config.json``."""
    try:
        spec = json.loads(config)
    except ValueError as exc:
        raise _refuse(f"the container runtime's {path} is not JSON") from exc
    annotations = spec.get("annotations") if isinstance(spec, dict) else None
    if not isinstance(annotations, dict):
        annotations = {}
    for keys in _ANNOTATION_SETS:
        values = [annotations.get(key) for key in keys]
        if all(isinstance(value, str) for value in values):
            namespace, pod, pod_uid, container = (str(value) for value in values)
            break
    else:
        raise _refuse(f"the container runtime's {path} names no pod and container: the "
                      "container is not a Kubernetes pod's")
    for what, value, pattern, longest in (
        ("namespace", namespace, _DNS_SUBDOMAIN, 253), ("pod name", pod, _DNS_SUBDOMAIN, 253),
        ("pod uid", pod_uid, _POD_UID, 128), ("container name", container, _DNS_LABEL_NAME, 63),
    ):
        if len(value) > longest or not pattern.fullmatch(value):
            raise _refuse(f"the container runtime's {path} gives the {what} {value[:300]!r}, "
                          "which Kubernetes does not allow")
    return namespace, pod, pod_uid, container


def _init_pid(bundle_fd: int, bundle: str) -> int:
    for name in _INIT_PID_FILES:
        data = _read_trusted(name, bundle_fd, f"{bundle}/{name}", _MAX_PID_FILE_BYTES)
        if data is None:
            continue
        text = data.decode("ascii", errors="replace").strip()
        if not text.isdigit() or int(text) <= 0:
            raise _refuse(f"the container runtime's {bundle}/{name} holds no pid")
        return int(text)
    raise _refuse(f"the container bundle {bundle} records no init pid (none of "
                  f"{', '.join(_INIT_PID_FILES)}): the container is not running")


# -- the namespaces ------------------------------------------------------------------------

def _namespace(pid: int, kind: str, whose: str) -> tuple[int, int]:
    try:
        info = os.stat(f"/proc/{pid}/ns/{kind}")
    except (FileNotFoundError, ProcessLookupError) as exc:
        raise _refuse(f"{whose} (pid {pid}) has ended") from exc
    except OSError as exc:
        raise _refuse(f"the {kind} namespace of {whose} (pid {pid}) cannot be read: "
                      f"{exc.strerror}") from exc
    return info.st_dev, info.st_ino


def _require_same_namespaces(pid: int, init_pid: int, container_id: str) -> None:
    for kind in ("pid", "net"):
        caller = _namespace(pid, kind, f"process {pid}")
        init = _namespace(init_pid, kind, f"the init of container {container_id}")
        if caller != init:
            raise _refuse(
                f"process {pid} is in the cgroup of container {container_id} but not in its "
                f"{kind} namespace (that of its init, pid {init_pid}): it does not run in "
                "that container")


# -- the whole -----------------------------------------------------------------------------

def _find_bundle(pid: int, container_id: str, bundles: Sequence[str]) -> tuple[str, int]:
    """The first of ``bundles`` that exists for the container, and an fd of it."""
    for template in bundles:
        bundle = template.format(id=container_id)
        bundle_fd = _open_bundle(bundle)
        if bundle_fd is not None:
            return bundle, bundle_fd
    raise _refuse(f"process {pid} runs in container {container_id}, which no Kubernetes "
                  f"container runtime on this node keeps (looked in {', '.join(bundles)})")


def _read_identity(pid: int, bundles: Sequence[str]) -> PodIdentity:
    container_id = container_id_of(pid)
    bundle, bundle_fd = _find_bundle(pid, container_id, bundles)
    try:
        config_path = f"{bundle}/config.json"
        config = _read_trusted("config.json", bundle_fd, config_path, _MAX_CONFIG_BYTES)
        if config is None:
            raise _refuse(f"the container bundle {bundle} has no config.json")
        namespace, pod, pod_uid, container = _pod_annotations(config, config_path)
        init_pid = _init_pid(bundle_fd, bundle)
    finally:
        os.close(bundle_fd)
    _require_same_namespaces(pid, init_pid, container_id)
    return PodIdentity(namespace, pod, pod_uid, container, container_id, init_pid)


def _alive(pidfd: int) -> bool:
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return False
    return True


def identify(pid: int, bundles: Sequence[str] = DEFAULT_BUNDLES,
             pidfd: int | None = None) -> PodIdentity:
    """The pod of process ``pid``, a pid of the node's PID namespace (the agent's own).

    ``bundles``: where the runtimes keep each container's OCI bundle, ``{id}`` for the
    container's id; the first that exists is read. ``pidfd``: a pidfd of the process that
    must be at ``pid`` throughout (the one that connected, ``SO_PEERPIDFD``); without it,
    one is opened now."""
    if pidfd is not None:
        if pid_of(pidfd) != pid:
            raise _refuse(f"process {pid} has ended")
        return _identify_alive(pid, bundles, pidfd)
    try:
        own = os.pidfd_open(pid)
    except ProcessLookupError as exc:
        raise _refuse(f"process {pid} has ended") from exc
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise _refuse(f"{pid} is not a process id") from exc
        raise
    try:
        return _identify_alive(pid, bundles, own)
    finally:
        os.close(own)


def pid_of(pidfd: int) -> int:
    """The pid, in the agent's namespace, of the process of ``pidfd``; 0 once it ended
    (its ``fdinfo`` says -1 then). The process of a pidfd keeps its pid while it lives."""
    with open(f"/proc/self/fdinfo/{pidfd}", encoding="ascii") as info:
        for line in info:
            if line.startswith("Pid:"):
                return max(int(line.split()[1]), 0)
    return 0


def _identify_alive(pid: int, bundles: Sequence[str], pidfd: int) -> PodIdentity:
    """``_read_identity`` of ``pid``, checked to be ``pidfd``'s process from before the
    first read to after the last: a pid reused meanwhile is never taken for it."""
    try:
        identity = _read_identity(pid, bundles)
    except NotInPod as exc:
        # What a process that ended meanwhile left unreadable says nothing of it.
        if not _alive(pidfd):
            raise _refuse(f"process {pid} has ended") from exc
        raise
    if not _alive(pidfd):
        raise _refuse(f"process {pid} has ended")
    return identity
