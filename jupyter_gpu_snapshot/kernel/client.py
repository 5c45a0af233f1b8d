"""The kernel's side of the REST API: find the server, call it, wait for jobs, notice restores.

The ``%gpu_snapshot`` magic and the widget run inside a kernel and talk to the server
extension that launched it. The provisioner puts everything needed into the kernel's
environment (``JUPYTER_GPU_SNAPSHOT_URL``, ``_TOKEN``, ``_KERNEL_ID``), so nothing is guessed
from runtime directories. Only the standard library is used: this module is imported into
every snapshot-ready kernel and must stay light.

Which kernel slot this process is, across restores, is ``kernel_identity``'s business.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._constants import API_PREFIX, ENV_KERNEL_ID, ENV_TOKEN, ENV_URL, KERNEL_TOKEN_PREFIX
from .identity import (
    IdentityUnknown,
    KernelIdentity,
    holds_ports_of,
    incarnation,
)

# Set by jupyter_server in the environment of every kernel it starts for a notebook.
ENV_SERVER_SESSION = "JPY_SESSION_NAME"

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
            if env.get(ENV_SERVER_SESSION):
                # A notebook's kernel of a Jupyter server, only not on our kernelspec.
                cause = (
                    "this kernel is not snapshot-ready: it runs a kernel other than "
                    "'Python 3 (snapshots)', which alone starts kernels so that they can be "
                    f"saved ({missing} is not set)"
                )
                hint = (
                    "Switch the notebook to 'Python 3 (snapshots)' with Kernel > Change "
                    "Kernel..., then run this again"
                )
                raise NoServer("connect", cause, hint=hint, message=f"{cause}. {hint}")
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

    @property
    def own_credential(self) -> bool:
        """Whether this kernel calls with a credential of its own, which reaches its own
        kernel and its notebook's snapshots only (rather than with a server token an
        operator gave the kernels)."""
        return self.link.token.startswith(f"{KERNEL_TOKEN_PREFIX}.")

    # -- plumbing --------------------------------------------------------------------------
    def exchange(
        self, method: str, path: str, body: Json | None = None, *, timeout: float | None = None
    ) -> tuple[int, str, bytes]:
        """Send one request to ``{url}{path}``; the status, reason and raw body, unchecked.

        Raises ConnectionProblem when the server cannot be reached.
        """
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
                return resp.status, resp.reason, resp.read()
            finally:
                conn.close()
        except (http.client.HTTPException, OSError) as exc:
            raise ConnectionProblem(
                "connect",
                f"cannot reach the Jupyter server at {link.url} ({_describe(exc)})",
                hint="Is the server still running?",
            ) from None

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
        link = self.link
        status, reason, raw = self.exchange(method, path, body, timeout=timeout)
        if status >= 400:
            raise _api_error(status, reason, raw, step, link.url + path)
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise ApiError(
                status, step, f"the server at {link.url} answered {path} with "
                "something other than JSON", hint=_NO_EXTENSION_HINT,
            ) from None

    def api(self, method: str, path: str, body: Json | None = None, **kw: Any) -> Any:
        return self.request(method, f"{API_PREFIX}/{path}", body, **kw)

    # -- identity --------------------------------------------------------------------------
    @property
    def kernel_id(self) -> str:
        """This kernel's id on the server, followed across restores."""
        try:
            return self.identity.current()
        except IdentityUnknown as exc:
            raise ClientError(
                "find this kernel",
                str(exc),
                hint="The server does so as soon as the running cell ends; try again then",
            ) from None

    # -- endpoints -------------------------------------------------------------------------
    def status(self) -> Json:
        kid = self.kernel_id
        return dict(self.api("GET", f"kernels/{_q(kid)}/status", step="status"))

    def dismiss_death(self) -> None:
        """Forget the death of this kernel slot's last kernel (the status's ``death``)."""
        self.api("DELETE", f"kernels/{_q(self.kernel_id)}/death", step="dismiss")

    def snapshots(self, notebook_path: str | None = None, latest: bool = False) -> list[Json]:
        params = {"notebook_path": notebook_path} if notebook_path else {}
        if latest:
            params["latest"] = "true"
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        answer = self.api("GET", f"snapshots{query}", step="list")
        return list(answer.get("snapshots", []))

    def autosave(self, changes: Json | None = None) -> Json:
        """This kernel's autosave state; with ``changes``, set its notebook's policy first."""
        path = f"kernels/{_q(self.kernel_id)}/autosave"
        if changes is None:
            return dict(self.api("GET", path, step="autosave"))
        return dict(self.api("PUT", path, changes, step="autosave"))

    def hibernate_when_idle(self, tier: str = "process") -> Json:
        """Ask the server to hibernate this kernel in ``tier`` once the running cell has
        ended (gpu: the GPU released, the process kept; process: saved and ended)."""
        path = f"kernels/{_q(self.kernel_id)}/hibernate"
        return dict(self.api("POST", path, {"when_idle": True, "tier": tier},
                             step="hibernate"))

    def snapshot(self, ref: str) -> Json:
        return dict(self.api("GET", f"snapshots/{_q(ref)}", step="find snapshot"))

    def delete(self, ref: str) -> None:
        self.api("DELETE", f"snapshots/{_q(ref)}", step="delete")

    def job(self, job_id: str, *, timeout: float | None = None) -> Json:
        return dict(self.api("GET", f"jobs/{_q(job_id)}", step="job", timeout=timeout))

    def jobs(self, kernel_id: str | None = None) -> list[Json]:
        query = f"?kernel_id={_q(kernel_id)}" if kernel_id else ""
        return list(self.api("GET", f"jobs{query}", step="jobs").get("jobs", []))

    def start_save(
        self, name: str | None = None, stop: bool = False, *, portable: bool = False
    ) -> Json:
        """POST the save; a restored copy of a kernel frozen mid-POST raises Restored….

        ``portable``: the snapshot also keeps a portable copy of the namespace, which a
        fresh kernel can load where the image cannot come back.
        """
        kernel_id = self.kernel_id
        body: Json = {"stop": stop}
        if name:
            body["name"] = name
        if portable:  # only when asked: servers without portable copies refuse the field
            body["portable"] = True
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
        self,
        ref: str,
        path: str | None = None,
        session_id: str | None = None,
        *,
        fallback: str | None = None,
    ) -> Json:
        """POST the restore of snapshot ``ref`` (an id), refusing one that cannot work.

        ``fallback`` ("portable", "replay" or "both"): no image restore; a fresh kernel
        gets back what the snapshot kept besides its image, and the job's result carries
        the report (``result["fallback"]``).
        """
        body: Json = {}
        if path:
            body["path"] = path
        if session_id:
            body["session_id"] = session_id
        if fallback is not None:
            # A fresh kernel listens on ports of its own: no need to check the snapshot's.
            body["fallback"] = fallback
            return dict(self.api("POST", f"snapshots/{_q(ref)}/restore", body, step="restore"))
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
        return dict(self.api("POST", f"snapshots/{_q(ref)}/restore", body, step="restore"))

    def session(self) -> Json | None:
        """This kernel's session (the notebook it serves), found by kernel id."""
        # Through the extension: this kernel's credential does not open the server's API.
        kid = self.kernel_id
        answer = self.api("GET", f"kernels/{_q(kid)}/session", step="find this notebook")
        session = (answer or {}).get("session")
        return dict(session) if session else None

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
