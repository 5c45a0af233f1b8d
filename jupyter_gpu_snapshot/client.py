"""The kernel's side of the REST API: find the server, call it, wait for jobs, notice restores.

The ``%gpu_snapshot`` magic and the widget run inside a kernel and talk to the server
extension that launched it. The provisioner puts everything needed into the kernel's
environment (``JUPYTER_GPU_SNAPSHOT_URL``, ``_TOKEN``, ``_KERNEL_ID``), so nothing is guessed
from runtime directories. Only the standard library is used: this module is imported into
every snapshot-ready kernel and must stay light.

A kernel restored from a snapshot is the same process memory in a new process: its
environment names the kernel slot it was saved from until the server, having adopted it
into a new slot, updates ``os.environ`` there (the provisioner's ``post_launch`` does, with
a silent execute request, so only once the cell running at the restore has finished).
``KernelIdentity`` notices the new incarnation (the start time changes; CRIU cannot keep
it) and takes the new kernel id from the environment once the server has set it.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

ENV_URL = "JUPYTER_GPU_SNAPSHOT_URL"
ENV_TOKEN = "JUPYTER_GPU_SNAPSHOT_TOKEN"
ENV_KERNEL_ID = "JUPYTER_GPU_SNAPSHOT_KERNEL_ID"
API_PREFIX = "gpu-snapshot/"

# Requests never block a cell for long: a server that stopped answering is reported, not
# waited for.
REQUEST_TIMEOUT = 10.0
POLL_SECONDS = 0.2
# Polls in a row that may fail (a busy or restarting server) before a wait gives up.
POLL_FAILURES_ALLOWED = 5

Json = dict[str, Any]


class ClientError(Exception):
    """A failure the user reads as one line: the step and the cause (and what to do)."""

    def __init__(
        self, step: str, cause: str, *, hint: str | None = None, message: str | None = None
    ) -> None:
        self.step = step
        self.cause = cause
        self.hint = hint
        # The server's errors come with their message already written the same way.
        self._message = message
        super().__init__(self.message)

    @property
    def message(self) -> str:
        if self._message:
            return self._message
        text = f"{self.step} failed: {self.cause}"
        if self.hint and self.hint not in self.cause:
            text += f". {self.hint}"
        return text


class NoServer(ClientError):
    """The kernel was not started by a Jupyter server with the snapshot extension."""


class ConnectionProblem(ClientError):
    """The server could not be reached, or the connection broke mid-request."""


class ApiError(ClientError):
    """The server answered with an error status."""

    def __init__(
        self,
        status: int,
        step: str,
        cause: str,
        *,
        hint: str | None = None,
        message: str | None = None,
    ) -> None:
        self.status = status
        super().__init__(step, cause, hint=hint, message=message)


class JobFailed(ClientError):
    """A save or restore job ended with ``status == "failed"``."""

    def __init__(self, job: Json) -> None:
        self.job = job
        error = job.get("error") or {}
        super().__init__(
            str(error.get("step") or job.get("phase") or job.get("kind", "job")),
            str(error.get("cause") or error.get("message") or "the server gave no reason"),
            hint=error.get("hint") or None,
            message=error.get("message") or None,
        )


class RestoredWhileWaiting(Exception):
    """This process is a restored copy of a kernel that was waiting for its own save.

    CRIU froze the kernel while the cell waited, and the snapshot holds that waiting cell.
    A restored copy wakes up in the same wait with its TCP connections closed; it must not
    report the save as its own result.
    """

    def __init__(self, job_id: str | None, kernel_id: str, posted_at: float) -> None:
        self.job_id = job_id
        self.kernel_id = kernel_id
        self.posted_at = posted_at
        super().__init__(f"restored from a snapshot taken by job {job_id}")


def _read_small(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def incarnation() -> str:
    """A value that differs between a process and any restored copy of it.

    The boot id and the process's start time (clock ticks after boot): CRIU restores
    memory, pids and namespaces, not the kernel's record of when a process was created.
    The pid alone would not do: a kernel is pid 2 of its own namespace, and so is its copy.
    """
    boot = _read_small("/proc/sys/kernel/random/boot_id").strip()
    stat = _read_small("/proc/self/stat")
    # Fields after the parenthesised command name; starttime is field 22 overall.
    fields = stat.rsplit(")", 1)[-1].split()
    start = fields[19] if len(fields) > 19 else ""
    return f"{boot}:{os.getpid()}:{start}"


_PORT_KEYS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")


def own_ports() -> dict[str, int] | None:
    """The ports this kernel listens on, from the running ipykernel application."""
    try:
        from ipykernel.kernelapp import IPKernelApp
    except ImportError:
        return None
    if not IPKernelApp.initialized():
        return None
    app = IPKernelApp.instance()
    return {key: int(getattr(app, key, 0) or 0) for key in _PORT_KEYS}


def holds_ports_of(summary: Mapping[str, Any]) -> bool:
    """Whether this kernel listens on the ports a restore of ``summary`` would need.

    Every snapshot of a kernel, and every restore of one, listens on that kernel's ports,
    so a snapshot of this kernel's lineage cannot be restored while this kernel runs.
    """
    mine = own_ports()
    theirs = (summary.get("kernel") or {}).get("connection_info") or {}
    if not mine or not theirs:
        return False
    return any(mine[key] and mine[key] == int(theirs.get(key) or 0) for key in _PORT_KEYS)


def namespace_rss_bytes() -> int | None:
    """Resident memory of every process of this kernel's PID namespace, or None.

    That is what CRIU writes for the host side of a snapshot. A snapshot-ready kernel's
    namespace has a /proc of its own (its init mounts one), so /proc lists exactly the
    tree that is dumped. Elsewhere /proc is the host's, and the sum would mean nothing.
    """
    if "nsinit" not in _read_small("/proc/1/cmdline"):
        return None
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        for line in _read_small(f"/proc/{entry}/status").splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
                break
    return total


def snapshot_estimate(status: Mapping[str, Any]) -> tuple[int, int] | None:
    """(host bytes, GPU bytes) a snapshot taken now would hold, from here and the status.

    The GPU layer stages the device memory in host memory before the dump, so both count.
    """
    host = namespace_rss_bytes()
    if host is None:
        return None
    cuda = status.get("cuda") or {}
    return host, int(cuda.get("memory_bytes") or 0)


@dataclass
class ServerLink:
    """Where the server is and how to authenticate, as the provisioner left it."""

    url: str
    token: str
    kernel_id: str

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ServerLink:
        env = os.environ if environ is None else environ
        url = env.get(ENV_URL, "").strip()
        kernel_id = env.get(ENV_KERNEL_ID, "").strip()
        if not url or not kernel_id:
            missing = ENV_URL if not url else ENV_KERNEL_ID
            cause = (
                "this kernel was not started by a Jupyter server with jupyter_gpu_snapshot "
                f"({missing} is not set)"
            )
            hint = (
                "Open the notebook in JupyterLab with the 'Python 3 (snapshots)' kernel, "
                "or use the 'jupyter gpu-snapshot' command line"
            )
            message = f"no Jupyter server to talk to: {cause}. {hint}"
            raise NoServer("connect", cause, hint=hint, message=message)
        if not url.endswith("/"):
            url += "/"
        return cls(url, env.get(ENV_TOKEN, ""), kernel_id)


class KernelIdentity:
    """Which kernel slot of the server this process is, across restores.

    Recorded when the extension loads. In a restored copy (a new incarnation) the kernel id
    in the environment is trusted only once the server has replaced the recorded one.
    """

    def __init__(self, kernel_id: str) -> None:
        self.kernel_id = kernel_id
        self.incarnation = incarnation()
        # Set once this process has found out it is a restored copy of that kernel.
        self.restored_from_kernel: str | None = None

    def changed(self) -> bool:
        return incarnation() != self.incarnation

    def current(self, environ: Mapping[str, str] | None = None) -> str:
        env = os.environ if environ is None else environ
        told = env.get(ENV_KERNEL_ID, "").strip()
        if not self.changed():
            return self.kernel_id
        if not told or told == self.kernel_id:
            raise ClientError(
                "find this kernel",
                "this kernel was restored from a snapshot, and the server has not yet told "
                "it which kernel it is now",
                hint="The server does so as soon as the running cell ends; try again then",
            )
        self.restored_from_kernel = self.kernel_id
        self.kernel_id = told
        self.incarnation = incarnation()
        return told


class SnapshotClient:
    """The REST calls the magic and the widget make, each a short blocking request."""

    def __init__(
        self,
        link: ServerLink | None = None,
        identity: KernelIdentity | None = None,
        timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        # Without a fixed link the environment is read at every request: the server
        # updates it in a kernel restored from a snapshot (new kernel id, maybe new token).
        self._link = link
        self.identity = identity or KernelIdentity(self.link.kernel_id)
        self.timeout = timeout

    @property
    def link(self) -> ServerLink:
        return self._link if self._link is not None else ServerLink.from_env()

    # -- plumbing --------------------------------------------------------------------------
    def request(
        self,
        method: str,
        path: str,
        body: Json | None = None,
        *,
        step: str = "request",
        timeout: float | None = None,
    ) -> Any:
        """One request to ``{url}{path}``; the decoded JSON answer, or None for 204."""
        data = json.dumps(body).encode() if body is not None else None
        link = self.link
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        if link.token:
            headers["Authorization"] = f"token {link.token}"
        target = urllib.parse.urlsplit(link.url)
        try:
            conn = _connection(target, timeout or self.timeout)
            try:
                conn.request(method, target.path + path, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
            finally:
                conn.close()
        except (http.client.HTTPException, OSError) as exc:
            raise ConnectionProblem(
                "connect",
                f"cannot reach the Jupyter server at {link.url} ({_describe(exc)})",
                hint="Is the server still running?",
            ) from None
        if resp.status >= 400:
            raise _api_error(resp.status, resp.reason, raw, step, link.url + path)
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise ApiError(
                resp.status, step, f"the server at {link.url} answered {path} with "
                "something other than JSON", hint=_NO_EXTENSION_HINT,
            ) from None

    def api(self, method: str, path: str, body: Json | None = None, **kw: Any) -> Any:
        return self.request(method, API_PREFIX + path, body, **kw)

    # -- identity --------------------------------------------------------------------------
    @property
    def kernel_id(self) -> str:
        """This kernel's id on the server, followed across restores."""
        return self.identity.current()

    # -- endpoints -------------------------------------------------------------------------
    def status(self) -> Json:
        kid = self.kernel_id
        return dict(self.api("GET", f"kernels/{_q(kid)}/status", step="status"))

    def snapshots(self, notebook_path: str | None = None) -> list[Json]:
        query = f"?notebook_path={_q(notebook_path)}" if notebook_path else ""
        answer = self.api("GET", f"snapshots{query}", step="list")
        return list(answer.get("snapshots", []))

    def snapshot(self, ref: str) -> Json:
        return dict(self.api("GET", f"snapshots/{_q(ref)}", step="find snapshot"))

    def delete(self, ref: str) -> None:
        self.api("DELETE", f"snapshots/{_q(ref)}", step="delete")

    def job(self, job_id: str, *, timeout: float | None = None) -> Json:
        return dict(self.api("GET", f"jobs/{_q(job_id)}", step="job", timeout=timeout))

    def jobs(self, kernel_id: str | None = None) -> list[Json]:
        query = f"?kernel_id={_q(kernel_id)}" if kernel_id else ""
        return list(self.api("GET", f"jobs{query}", step="jobs").get("jobs", []))

    def start_save(self, name: str | None = None, stop: bool = False) -> Json:
        """POST the save; a restored copy of a kernel frozen mid-POST raises Restored…."""
        kernel_id = self.kernel_id
        body: Json = {"stop": stop}
        if name:
            body["name"] = name
        marker = incarnation()
        posted_at = time.time()
        try:
            return dict(self.api("POST", f"kernels/{_q(kernel_id)}/snapshots", body, step="save"))
        except ConnectionProblem:
            # The dump can freeze us before the 202 was read; the copy then finds the
            # connection closed and must not report a failed save.
            if incarnation() != marker:
                raise RestoredWhileWaiting(None, kernel_id, posted_at) from None
            raise

    def start_restore(
        self, ref: str, path: str | None = None, session_id: str | None = None
    ) -> Json:
        """POST the restore of snapshot ``ref`` (an id), refusing one that cannot work."""
        summary = self.snapshot(ref)
        if holds_ports_of(summary):
            raise ClientError(
                "preflight",
                f"snapshot {summary.get('id')} ({summary.get('name')}) was taken from this "
                "kernel (or from the kernel it was restored from), and this kernel holds the "
                "ports the restored one listens on",
                hint="Restore it from JupyterLab's restore dialog, which offers to shut this "
                "kernel down first",
            )
        body: Json = {}
        if path:
            body["path"] = path
        if session_id:
            body["session_id"] = session_id
        return dict(self.api("POST", f"snapshots/{_q(ref)}/restore", body, step="restore"))

    def session(self) -> Json | None:
        """This kernel's session (the notebook it serves), found by kernel id."""
        kid = self.kernel_id
        sessions = self.request("GET", "api/sessions", step="find this notebook") or []
        for session in sessions:
            if (session.get("kernel") or {}).get("id") == kid:
                return dict(session)
        return None

    def wait(
        self,
        job: Json,
        on_update: Callable[[Json], None] | None = None,
        *,
        poll: float | None = None,
        posted_at: float | None = None,
    ) -> Json:
        """Poll ``jobs/{id}`` until the job ends; return it, or raise.

        Raises JobFailed for a failed job and RestoredWhileWaiting when this process turns
        out to be a restored copy of the kernel that was waiting (see the module notes).
        Every request has a timeout, and the incarnation is checked before each poll and
        after each broken one, so a copy notices within one poll interval.
        """
        marker = incarnation()
        kernel_id = self.identity.kernel_id
        started = posted_at if posted_at is not None else time.time()
        interval = POLL_SECONDS if poll is None else poll
        failures = 0
        while job.get("status") == "running":
            time.sleep(interval)
            if incarnation() != marker:
                raise RestoredWhileWaiting(str(job["id"]), kernel_id, started)
            try:
                job = self.job(str(job["id"]), timeout=min(self.timeout, 5.0))
            except ConnectionProblem:
                if incarnation() != marker:
                    raise RestoredWhileWaiting(str(job["id"]), kernel_id, started) from None
                failures += 1
                if failures > POLL_FAILURES_ALLOWED:
                    raise
                continue
            failures = 0
            if on_update is not None:
                on_update(job)
        if job.get("status") == "failed":
            raise JobFailed(job)
        return job

    def snapshot_of(self, restored: RestoredWhileWaiting) -> Json:
        """The snapshot a copy was restored from, given what it knew while waiting."""
        if restored.job_id is not None:
            with contextlib.suppress(ApiError):
                job = self.job(restored.job_id)
                result = job.get("result") or {}
                if result.get("id"):
                    return dict(result)
        # The job is unknown (its 202 never arrived, or the server restarted since): the
        # engine saves one kernel at a time, so it is that kernel's first snapshot since.
        for summary in self.snapshots():
            kernel = summary.get("kernel") or {}
            if (
                kernel.get("kernel_id") == restored.kernel_id
                and float(summary.get("created", 0)) >= restored.posted_at
            ):
                return summary
        raise ClientError(
            "find snapshot",
            "the server no longer knows the snapshot this kernel was restored from",
        )


_NO_EXTENSION_HINT = "Is the jupyter_gpu_snapshot server extension enabled on that server?"


def _q(value: str) -> str:
    return urllib.parse.quote(value, safe="")


def _describe(reason: object) -> str:
    if isinstance(reason, socket.timeout | TimeoutError):
        return "no answer in time"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    text = str(reason) or type(reason).__name__
    return text


def _connection(target: urllib.parse.SplitResult, timeout: float) -> http.client.HTTPConnection:
    if target.scheme == "http+unix":  # a server listening on a Unix socket
        return _UnixHTTPConnection(urllib.parse.unquote(target.netloc), timeout)
    if target.scheme == "https":
        return http.client.HTTPSConnection(
            target.hostname or "localhost", target.port, timeout=timeout
        )
    return http.client.HTTPConnection(target.hostname or "localhost", target.port, timeout=timeout)


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, socket_path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def _api_error(status: int, reason: str, raw: bytes, step: str, url: str) -> ApiError:
    body: Json = {}
    with contextlib.suppress(ValueError):
        parsed = json.loads(raw or b"{}")
        if isinstance(parsed, dict):
            body = parsed
    cause = body.get("cause") or body.get("message") or body.get("reason")
    hint = body.get("hint")
    if status == 403 and not body.get("step"):
        cause = f"the server refused this kernel's token ({cause or reason})"
        hint = "The server may have been restarted with a new token"
    elif status == 404 and not body:
        cause = f"the server has no {url}"
        hint = _NO_EXTENSION_HINT
    return ApiError(
        status,
        str(body.get("step") or step),
        str(cause or f"HTTP {status} {reason}"),
        hint=str(hint) if hint else None,
        message=str(body["message"]) if body.get("step") and body.get("message") else None,
    )


def format_bytes(n: float) -> str:
    size = float(n)
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while size >= 1024 and i < len(units) - 1:
        size /= 1024
        i += 1
    return f"{int(size)} B" if i == 0 else f"{size:.1f} {units[i]}"


def format_age(seconds: float) -> str:
    """A coarse age: the panel re-renders only when this text changes, and every change is
    kernel activity that would keep an idle-culling server from culling the kernel."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return "just now"
    if seconds < 3600:
        return f"{int(seconds // 60)} min ago"
    if seconds < 48 * 3600:
        return f"{int(seconds // 3600)} h ago"
    return f"{int(seconds // 86400)} days ago"
