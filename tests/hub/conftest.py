"""A real JupyterHub, run as root, spawning the single-user servers of two real Unix users as
their own uids, unprivileged, behind its real proxy: a node of a shared deployment.

Fixtures:

- ``unix_users`` and ``user_paths`` (session, ``testkit/unix_users.py``): the two Unix users,
  and the paths they need.
- ``hub_environment`` (module): environment added to every user's server; override it.
- ``hub_config`` (module): extra traitlets configuration of the hub; override it.
- ``hub`` (module): the running hub, a :class:`Hub`. A module's tests share it; each test
  starts the servers it needs and the hub stops them all at the end of the module.

Everything here runs as root (``useradd``, a hub that setuids): the tests do too.
"""

from __future__ import annotations

import contextlib
import http.cookiejar
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

import psutil
import pytest
import requests

from testkit.processes import free_port
from testkit.unix_users import NOTEBOOKS, VENV, UnixUser, kill_all, poll

# The interpreter that runs the tests runs the hub and the users' servers, extension included
# (the venv's etc/jupyter enables it).
SINGLEUSER = VENV / "bin" / "jupyterhub-singleuser"
JUPYTERHUB = VENV / "bin" / "jupyterhub"
CONFIG_FILE = Path(__file__).with_name("jupyterhub_config.py")
SERVICE = "jgs-tests"
PASSWORD = "jgs-hub-tests-password"
# criu lives in /usr/local/sbin; a test runner's PATH may lack the sbin directories.
SYSTEM_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")

# Seconds, for a busy two-core machine: a server's spawn (the spawner's own timeouts too)...
START_TIMEOUT = 240.0
# ...the hub and its proxy coming up, a server or the hub stopping, one HTTP request.
HUB_TIMEOUT = 120.0
STOP_TIMEOUT = 120.0
REQUEST_TIMEOUT = 60.0


# -- the hub ---------------------------------------------------------------------------------
class HubError(AssertionError):
    pass


def _name(user: str | UnixUser) -> str:
    return user if isinstance(user, str) else user.name


class Hub:
    """A running JupyterHub, its proxy, and the users' servers it spawned.

    What the next spawns get: ``cmd`` (the venv's jupyterhub-singleuser), ``args`` (after
    ``--ServerApp.root_dir=~/notebooks``) and ``environment``, set on this object, plus what
    ``start_server`` adds for one spawn. Set them before ``start_server``; a running server
    keeps what it was started with.
    """

    def __init__(self, directory: Path, users: tuple[UnixUser, ...],
                 environment: Mapping[str, str], config: Mapping[str, Any]) -> None:
        self.directory = directory
        self.users = {user.name: user for user in users}
        self.cmd: list[str] = [str(SINGLEUSER)]
        self.args: list[str] = []
        self.environment: dict[str, str] = dict(environment)
        self._spawns: dict[str, dict[str, Any]] = {}
        self._tokens: dict[str, str] = {}
        self.log_path = directory / "hub.log"
        self.proxy_pid: int | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.service_token = os.urandom(32).hex()
        self.hub_port, self.proxy_port, self.proxy_api_port = self._ports(3)
        self.url = f"http://127.0.0.1:{self.proxy_port}"
        self.session = requests.Session()
        # Tokens only: a cookie one answer sets must not speak for the next request's user.
        self.session.cookies.set_policy(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))
        self._config = dict(config)

    @staticmethod
    def _ports(count: int) -> list[int]:
        ports: set[int] = set()
        while len(ports) < count:
            ports.add(free_port())
        return sorted(ports)

    # -- diagnostics -------------------------------------------------------------------------
    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 80) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def fail(self, message: str) -> NoReturn:
        raise HubError(f"{message}\n---- hub log, last lines ({self.log_path}) ----\n"
                       f"{self.log_tail()}")

    # -- start and stop ----------------------------------------------------------------------
    def start(self) -> None:
        path = os.pathsep.join(dict.fromkeys(
            [str(VENV / "bin"), *os.environ.get("PATH", "").split(os.pathsep), *SYSTEM_PATH]
        ))
        proxy = shutil.which("configurable-http-proxy", path=path)
        if proxy is None:
            raise HubError("configurable-http-proxy is not on PATH: "
                           "run scripts/install-hub-deps.sh (make system)")
        settings = {
            "hub_port": self.hub_port,
            "proxy_port": self.proxy_port,
            "proxy_api_port": self.proxy_api_port,
            "proxy_command": proxy,
            "users": sorted(self.users),
            "password": PASSWORD,
            "service": SERVICE,
            "service_token": self.service_token,
            "cmd": self.cmd,
            "notebooks": NOTEBOOKS,
            "start_timeout": int(START_TIMEOUT),
            "log_level": "INFO",
            "config": self._config,
        }
        (self.directory / "settings.json").write_text(json.dumps(settings, indent=1))
        self._write_spawns()
        # Nothing of the test process's environment (its secrets, its JUPYTER_* dirs): the
        # hub passes on only Spawner.env_keep, and this is all there is to keep.
        env = {"PATH": path, "HOME": str(self.directory), "JGS_HUB_DIR": str(self.directory)}
        env.update({k: os.environ[k] for k in ("LANG", "LC_ALL") if k in os.environ})
        with open(self.log_path, "wb") as log:
            # Its own process group: the teardown ends whatever it leaves.
            self.process = subprocess.Popen(
                [str(JUPYTERHUB), "-f", str(CONFIG_FILE)],
                cwd=self.directory, env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        # Through the proxy: the hub answers and has routed itself there.
        poll(self._up, HUB_TIMEOUT, self.fail, "the hub answering through its proxy")
        whoami = self.api("GET", "user")
        if "admin" not in whoami.get("roles", []):
            self.fail(f"the test's service has no admin role: {whoami}")
        pid_file = self.directory / "proxy.pid"
        self.proxy_pid = int(pid_file.read_text()) if pid_file.exists() else None

    def _up(self) -> bool | None:
        assert self.process is not None
        if self.process.poll() is not None:
            self.fail(f"the hub exited with {self.process.returncode}")
        try:
            response = self.session.get(f"{self.url}/hub/api/", timeout=REQUEST_TIMEOUT)
        except requests.ConnectionError:
            return None
        return True if response.status_code == 200 else None

    def close(self) -> None:
        """Stops the servers through the hub, then the hub (which stops its proxy); kills
        what is left of them; fails if any of it survives."""
        notes: list[str] = []
        if self.process is not None and self.process.poll() is None:
            for name in self.users:
                try:
                    if self.server(name) is not None:
                        self.stop_server(name)
                except (HubError, requests.RequestException) as e:
                    notes.append(f"stopping {name}'s server: {str(e).splitlines()[0]}")
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                notes.append(f"the hub did not stop in {STOP_TIMEOUT:.0f}s on SIGTERM")
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.session.close()
        leftovers = self._leftovers()
        if leftovers:
            notes.append("left running, killed: " + "; ".join(
                f"{p.pid} {' '.join(p.info['cmdline'] or [])}" for p in leftovers))
        survivors = kill_all(leftovers)
        if notes:
            print("hub teardown: " + "\n".join(notes))
        if survivors:
            self.fail(f"still running after SIGKILL: {[p.pid for p in survivors]}")

    def _leftovers(self) -> list[psutil.Process]:
        """Our proxy and every process of the hub's users."""
        uids = {user.uid for user in self.users.values()}
        found = []
        for proc in psutil.process_iter(["uids", "cmdline"]):
            cmdline = proc.info.get("cmdline") or []
            uids_of = proc.info.get("uids")
            ours = uids_of is not None and bool(uids & {uids_of.real, uids_of.effective})
            proxy = proc.pid == self.proxy_pid or (
                any("configurable-http-proxy" in arg for arg in cmdline)
                and str(self.proxy_api_port) in " ".join(cmdline)
            )
            if ours or proxy:
                found.append(proc)
        return found

    # -- the hub's REST API, as its admin ----------------------------------------------------
    def api(self, method: str, path: str, json: Any = None,
            expect: Iterable[int] = (200,)) -> Any:
        """``/hub/api/<path>`` with the admin token; its JSON (None when empty)."""
        response = self.session.request(
            method, f"{self.url}/hub/api/{path}", json=json, timeout=REQUEST_TIMEOUT,
            headers={"Authorization": f"token {self.service_token}"},
        )
        if response.status_code not in tuple(expect):
            self.fail(f"{method} /hub/api/{path}: {response.status_code} {response.text[:500]}")
        return response.json() if response.content else None

    def server(self, user: str | UnixUser) -> dict[str, Any] | None:
        """The hub's model of the user's server (``ready``, ``pending``, ``url``...), None
        when they have none."""
        model = self.api("GET", f"users/{_name(user)}")
        server: dict[str, Any] | None = model.get("servers", {}).get("")
        return server

    def _write_spawns(self) -> None:
        # Every user's, in one file: the hook of one spawn must not see another's half-written.
        spawn = {"cmd": self.cmd, "args": self.args, "environment": self.environment,
                 "users": self._spawns}
        temporary = self.directory / "spawn.json.tmp"
        temporary.write_text(json.dumps(spawn, indent=1))
        temporary.replace(self.directory / "spawn.json")

    def start_server(self, user: str | UnixUser, environment: Mapping[str, str] | None = None,
                     cmd: list[str] | None = None, args: list[str] | None = None) -> int:
        """Spawns the user's server as the hub's admin would, or a user from the spawn page;
        once the hub says it is ready, its pid. ``environment``, ``cmd`` and ``args`` are
        for this spawn only, on top of (``args``: after) the hub's."""
        name = _name(user)
        self._spawns[name] = {"environment": dict(environment or {}), "cmd": cmd,
                              "args": list(args or [])}
        self._write_spawns()
        self.api("POST", f"users/{name}/server", expect=(201, 202))

        def ready() -> bool | None:
            server = self.server(name)
            if server is None:
                self.fail(f"{name}'s server failed to start")
            return True if server["ready"] else None

        poll(ready, START_TIMEOUT + 30, self.fail, f"{name}'s server ready")
        return self.server_pid(name)

    def stop_server(self, user: str | UnixUser) -> None:
        """Stops the user's server through the hub, as its idle culler does; returns once
        the hub has no server for them and the server's process has ended."""
        name = _name(user)
        pids = self._singleuser_pids(name)
        self.api("DELETE", f"users/{name}/server", expect=(202, 204))

        def stopped() -> bool | None:
            server = self.server(name)
            return True if server is None else None

        poll(stopped, STOP_TIMEOUT, self.fail, f"{name}'s server stopped")
        procs = []
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                procs.append(psutil.Process(pid))
        _, alive = psutil.wait_procs(procs, timeout=STOP_TIMEOUT)
        if alive:
            self.fail(f"{name}'s server process {[p.pid for p in alive]} outlived its stop")

    # -- the users' side ---------------------------------------------------------------------
    def user_token(self, user: str | UnixUser) -> str:
        """An API token of the user, issued by the hub's admin (one per user and hub)."""
        name = _name(user)
        if name not in self._tokens:
            token = self.api("POST", f"users/{name}/tokens", expect=(200, 201),
                             json={"note": "tests/hub", "expires_in": 6 * 3600})
            self._tokens[name] = token["token"]
        return self._tokens[name]

    def user_api(self, user: str | UnixUser, method: str, path: str, json: Any = None,
                 token: str | None = None) -> requests.Response:
        """``/user/<user>/<path>`` through the proxy, with the user's token (or ``token``),
        redirects not followed; the whole response, already read."""
        name = _name(user)
        return self.session.request(
            method, f"{self.url}/user/{name}/{path.lstrip('/')}", json=json,
            headers={"Authorization": f"token {token or self.user_token(name)}"},
            timeout=REQUEST_TIMEOUT, allow_redirects=False,
        )

    def _singleuser_pids(self, name: str) -> list[int]:
        uid = self.users[name].uid
        found = []
        for proc in psutil.process_iter(["uids", "cmdline"]):
            uids = proc.info.get("uids")
            cmdline = proc.info.get("cmdline") or []
            if uids is not None and uids.real == uid and any(
                os.path.basename(arg) == SINGLEUSER.name for arg in cmdline[:3]
            ):
                found.append(proc.pid)
        return found

    def server_pid(self, user: str | UnixUser) -> int:
        """The pid of the user's jupyterhub-singleuser process (run as their uid)."""
        name = _name(user)
        pids = self._singleuser_pids(name)
        if len(pids) != 1:
            self.fail(f"{name} runs {len(pids)} jupyterhub-singleuser processes: {pids}")
        return pids[0]


@pytest.fixture(scope="module")
def hub_environment() -> dict[str, str]:
    """Environment variables every user's server gets (the module's ``hub.environment`` at
    the start); a test module overrides this fixture, e.g. with an agent's socket path."""
    return {}


@pytest.fixture(scope="module")
def hub_config() -> dict[str, Any]:
    """Traitlets configuration merged last into the hub's, as a nested dict
    (``{"JupyterHub": {"services": [...]}}``); a test module overrides this fixture."""
    return {}


@pytest.fixture(scope="module")
def hub(
    unix_users: tuple[UnixUser, UnixUser],
    user_paths: dict[Path, int],
    hub_environment: dict[str, str],
    hub_config: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Hub]:
    """A JupyterHub as root on free loopback ports, its proxy, no user server yet."""
    # pytest's temporary directories are root's alone: the tokens and the database in it too.
    running = Hub(tmp_path_factory.mktemp("hub"), unix_users, hub_environment, hub_config)
    began = time.monotonic()
    try:
        running.start()
        print(f"hub: up in {time.monotonic() - began:.1f}s at {running.url}")
        yield running
    finally:
        running.close()
