"""A Jupyter server (``jupyter server``, ``jupyter lab``) in its own process, as a user or
systemd runs it: the one way the tests and the benchmarks start, wait for, stop and kill
one. What they say to it (REST, kernel websockets, ZMQ) is theirs.

Standard library, psutil and the package's own in-kernel REST client only, so that the
benchmarks, run as scripts, import it as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from jupyter_gpu_snapshot.kernel.client import ConnectionProblem, ServerLink, SnapshotClient
from testkit.processes import free_port, power_loss, shut_down


class ServerStartError(RuntimeError):
    """The server exited, or did not answer in time, or answered without the extension."""


class JupyterServerProcess:
    """``jupyter <app>`` in its own process, started at construction.

    It listens on ``host``:``port`` (a free port unless given), or on the Unix socket
    ``sock``; ``token`` (a fresh one unless given) is the one it accepts. ``env`` is its
    whole environment, ``options`` its further command-line options (its configuration
    files are the caller's, found through ``env``); ``launcher`` runs it through another
    command (e.g. into other namespaces). Its stdout and stderr go to ``log_path``,
    appended to with ``append_log``. With ``new_session`` it leads a process group of its
    own, which ``stop`` and ``kill`` end whole. ``stop`` SIGKILLs it (its group) if it still
    runs ``stop_timeout`` s after SIGTERM.
    """

    def __init__(
        self,
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        options: Sequence[str] = (),
        app: str = "server",
        host: str = "127.0.0.1",
        port: int | None = None,
        sock: Path | None = None,
        token: str | None = None,
        launcher: Sequence[str] = (),
        cwd: Path | None = None,
        append_log: bool = False,
        new_session: bool = False,
        stop_timeout: float = 60,
    ) -> None:
        self.app = app
        self.host = host
        self.sock = sock
        self.port = free_port() if port is None and sock is None else port
        self.token = token if token is not None else secrets.token_hex(16)
        self.url = (
            f"http+unix://{urllib.parse.quote(str(sock), safe='')}/" if sock is not None
            else f"http://{host}:{self.port}/"
        )
        self.log_path = log_path
        self.new_session = new_session
        self.stop_timeout = stop_timeout
        where = (
            [f"--ServerApp.sock={sock}"] if sock is not None
            else [f"--ServerApp.ip={host}", f"--ServerApp.port={self.port}"]
        )
        # `python -m jupyter <app>` finds the subcommand also where the environment's
        # scripts are not beside the interpreter (a --target install on the GPU machine).
        module = ["jupyter_server"] if app == "server" else ["jupyter", app]
        self.argv = [
            *launcher, sys.executable, "-m", *module, "--no-browser", *where,
            "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
            "--allow-root", *options,
        ]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab" if append_log else "wb") as log:
            self.proc: subprocess.Popen[bytes] = subprocess.Popen(
                self.argv, env=None if env is None else dict(env), cwd=cwd,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=new_session,
            )

    @property
    def name(self) -> str:
        return f"jupyter {self.app}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    # -- its log ---------------------------------------------------------------------------
    @property
    def log(self) -> str:
        """All it wrote so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.splitlines()[-lines:])

    # -- until it answers ------------------------------------------------------------------
    def client(self, timeout: float = 30) -> SnapshotClient:
        """The in-kernel REST client, with the server's token (and no kernel of its own)."""
        return SnapshotClient(ServerLink(self.url, self.token, kernel_id=""), timeout=timeout)

    def _answers(self, deadline: float, extension: bool) -> bool:
        """Whether ``api/status`` answers 200 (and, with ``extension``, the extension's
        snapshot listing too); ServerStartError when it exited or lacks the extension."""
        if self.proc.poll() is not None:
            raise ServerStartError(
                f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
        client = self.client()
        try:
            status, _, _ = client.exchange(
                "GET", "api/status", timeout=max(1.0, min(30.0, deadline - time.monotonic())))
        except ConnectionProblem:
            return False
        if status != 200:
            return False
        if extension:
            status, reason, _ = client.exchange("GET", "gpu-snapshot/snapshots", timeout=60)
            if status != 200:
                raise ServerStartError(
                    f"{self.name} answered {status} ({reason}) for gpu-snapshot/snapshots: is "
                    f"the jupyter_gpu_snapshot server extension enabled?\n{self.log_tail()}")
        return True

    def _not_started(self, timeout: float) -> ServerStartError:
        return ServerStartError(f"{self.name} did not answer in {timeout} s:\n{self.log_tail()}")

    def wait_ready(
        self, timeout: float = 60, *, interval: float = 0.2, extension: bool = False
    ) -> None:
        """Until it answers (see ``_answers``); a server that does not is stopped, and
        ServerStartError raised with its log."""
        deadline = time.monotonic() + timeout
        try:
            while not self._answers(deadline, extension):
                if time.monotonic() > deadline:
                    raise self._not_started(timeout)
                time.sleep(interval)
        except BaseException:
            self.stop()  # a server that never came up must not outlive its caller
            raise

    async def ready(
        self, timeout: float = 60, *, interval: float = 0.2, extension: bool = False
    ) -> None:
        """``wait_ready`` for a caller on an event loop, which goes on meanwhile."""
        deadline = time.monotonic() + timeout
        try:
            while not await asyncio.to_thread(self._answers, deadline, extension):
                if time.monotonic() > deadline:
                    raise self._not_started(timeout)
                await asyncio.sleep(interval)
        except BaseException:
            await asyncio.to_thread(self.stop)
            raise

    # -- its end ---------------------------------------------------------------------------
    async def exited(self, timeout: float = 90.0) -> int:
        """Its exit status, once it has exited; TimeoutError if it runs ``timeout`` s on."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not stop in {timeout} s:\n{self.log_tail()}")
            await asyncio.sleep(0.1)
        return int(self.proc.returncode)

    def stop(self, timeout: float | None = None) -> int:
        """Ends it as a node's shutdown does (SIGTERM), SIGKILLs it if it still runs
        ``timeout`` s (``stop_timeout``) later; its exit status."""
        return shut_down(self.proc, self.stop_timeout if timeout is None else timeout,
                         group=self.new_session)

    def kill(self) -> None:
        """SIGKILL, at once (to its group with ``new_session``)."""
        if self.proc.poll() is None:
            if self.new_session:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                self.proc.kill()
            self.proc.wait()

    def power_loss(self, kernel_ids: Iterable[str] = ()) -> None:
        """SIGKILL it, its children (criu included) and every process of these kernels, all
        at once, as a node's power loss does."""
        power_loss(self.proc.pid, kernel_ids)
        self.proc.wait()
