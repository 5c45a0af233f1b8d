"""The kernel's side of the REST API: find the server, call it, wait for jobs, notice restores.

The ``%gpu_snapshot`` magic and the widget run inside a kernel and talk to the server
extension that launched it. The provisioner puts everything needed into the kernel's
environment (``JUPYTER_GPU_SNAPSHOT_URL``, ``_TOKEN``, ``_KERNEL_ID``), so nothing is guessed
from runtime directories. Only the standard library is used: this module is imported into
every snapshot-ready kernel and must stay light.

A kernel restored from a snapshot is the same process memory in a new process: its
environment still names the kernel slot it was saved from. ``KernelIdentity`` notices the
new incarnation (host pid and start time change; CRIU cannot keep either) and asks the
server which kernel slot the process now belongs to.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
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


def host_pid() -> int:
    """This process's pid as the host sees it.

    Snapshot-ready kernels run in their own PID namespace, where ``os.getpid()`` is small
    and is restored unchanged by CRIU. /proc is the host's procfs (the namespace gets no
    /proc of its own), so /proc/self names the host pid, which changes on every restore.
    """
    with contextlib.suppress(OSError, ValueError):
        return int(Path("/proc/self").readlink().name)
    return os.getpid()


def incarnation() -> str:
    """A value that differs between a process and any restored copy of it.

    Boot id, host pid and the start time (ticks after boot): CRIU restores memory, not the
    kernel's bookkeeping of when and as which pid the process was created.
    """
    boot = _read_small("/proc/sys/kernel/random/boot_id").strip()
    stat = _read_small("/proc/self/stat")
    # Fields after the parenthesised command name; starttime is field 22 overall.
    fields = stat.rsplit(")", 1)[-1].split()
    start = fields[19] if len(fields) > 19 else ""
    return f"{boot}:{host_pid()}:{start}"


_PORT_KEYS = ("ip", "shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")


def _ports_of(info: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(str(info.get(k)) for k in _PORT_KEYS)


def own_ports() -> tuple[Any, ...] | None:
    """The address and ports this kernel listens on, from the running ipykernel app."""
    try:
        from ipykernel.kernelapp import IPKernelApp
    except ImportError:
        return None
    if not IPKernelApp.initialized():
        return None
    app = IPKernelApp.instance()
    return _ports_of({k: getattr(app, k, None) for k in _PORT_KEYS})


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

    Recorded once when the extension loads; re-resolved through the server when the
    process finds itself in a new incarnation (a restored copy).
    """

    def __init__(self, kernel_id: str) -> None:
        self.kernel_id = kernel_id
        self.incarnation = incarnation()
        # Set once this process has found out it is a restored copy.
        self.restored_from_kernel: str | None = None

    def changed(self) -> bool:
        return incarnation() != self.incarnation

    def adopt(self, kernel_id: str) -> None:
        if kernel_id != self.kernel_id:
            self.restored_from_kernel = self.kernel_id
        self.kernel_id = kernel_id
        self.incarnation = incarnation()


class SnapshotClient:
    """The REST calls the magic and the widget make, each a short blocking request."""

    def __init__(
        self,
        link: ServerLink,
        identity: KernelIdentity | None = None,
        timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        self.link = link
        self.identity = identity or KernelIdentity(link.kernel_id)
        self.timeout = timeout

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
        req = urllib.request.Request(self.link.url + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.link.token:
            req.add_header("Authorization", f"token {self.link.token}")
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise _api_error(exc, step, self.link.url) from None
        except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise ConnectionProblem(
                "connect",
                f"cannot reach the Jupyter server at {self.link.url} ({_describe(reason)})",
                hint="Is the server still running?",
            ) from None
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise ApiError(
                200, step, f"the server at {self.link.url} answered {path} with something "
                "other than JSON", hint=_NO_EXTENSION_HINT,
            ) from None

    def api(self, method: str, path: str, body: Json | None = None, **kw: Any) -> Any:
        return self.request(method, API_PREFIX + path, body, **kw)

    # -- identity --------------------------------------------------------------------------
    @property
    def kernel_id(self) -> str:
        """This kernel's id on the server, re-resolved once after a restore."""
        if self.identity.changed():
            self.identity.adopt(self._resolve_kernel_id())
        return self.identity.kernel_id

    def _resolve_kernel_id(self) -> str:
        """The kernel slot a restored copy of this process was adopted into.

        Every snapshot of one kernel lineage listens on the same ports, and a port can be
        held by one process only, so the live kernel that a restore of a snapshot with our
        ports produced is this process.
        """
        ports = own_ports()
        if ports is None:
            raise ClientError(
                "find this kernel",
                "this process was restored from a snapshot, and it is not an ipykernel "
                "whose ports could identify it",
            )
        ours = {
            str(s["id"])
            for s in self.snapshots()
            if _ports_of((s.get("kernel") or {}).get("connection_info") or {}) == ports
        }
        alive = {
            str(k.get("id"))
            for k in self.request("GET", "api/kernels", step="find this kernel") or []
        }
        for job in self.jobs():  # newest first
            result = job.get("result") or {}
            if (
                job.get("kind") == "restore"
                and job.get("status") == "succeeded"
                and job.get("snapshot_id") in ours
                and result.get("kernel_id") in alive
            ):
                return str(result["kernel_id"])
        raise ClientError(
            "find this kernel",
            "this process was restored from a snapshot, but the server has no record of "
            "restoring it",
            hint="Was it restored outside this server? Restore snapshots through JupyterLab",
        )

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
        poll: float = POLL_SECONDS,
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
        failures = 0
        while job.get("status") == "running":
            time.sleep(poll)
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


def _api_error(exc: urllib.error.HTTPError, step: str, url: str) -> ApiError:
    body: Json = {}
    with contextlib.suppress(Exception):
        parsed = json.loads(exc.read() or b"{}")
        if isinstance(parsed, dict):
            body = parsed
    cause = body.get("cause") or body.get("message") or body.get("reason")
    hint = body.get("hint")
    if exc.code == 403 and not cause:
        cause = "the server refused this kernel's token"
        hint = "The server may have been restarted with a new token"
    elif exc.code == 404 and not body:
        cause = f"the server at {url} has no {exc.url.removeprefix(url)}"
        hint = _NO_EXTENSION_HINT
    return ApiError(
        exc.code,
        str(body.get("step") or step),
        str(cause or f"HTTP {exc.code} {exc.reason}"),
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
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{int(seconds)} s ago"
    if seconds < 3600:
        return f"{int(seconds // 60)} min ago"
    if seconds < 86400:
        return f"{seconds / 3600:.1f} h ago"
    return f"{seconds / 86400:.1f} days ago"
