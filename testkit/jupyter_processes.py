"""A real ``jupyter lab`` or ``jupyter server`` process for the browser and notebook tests.

Each server gets its own config, data, runtime and snapshot directories under a test's
tmp_path, a token, and a free port on 127.0.0.1. Starting again in the same directory is
a restart: same notebooks, same store, same config.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.server_process import JupyterServerProcess

BIN = Path(sys.executable).parent
START_TIMEOUT = 60
# The extension built in this source tree (jlpm build:prod in labextension/), if any.
SOURCE_LABEXTENSION = Path(__file__).parents[1] / "jupyter_gpu_snapshot" / "labextension"
LABEXTENSION_NAME = "jupyter-gpu-snapshot"


def until_job_ends(
    get: Callable[[str], Any], job: dict[str, Any], timeout: float
) -> dict[str, Any]:
    """The job's last state, polled through ``get`` (a GET of the server's API) until it
    no longer runs; TimeoutError if it still runs after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while job["status"] == "running":
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job['id']} still runs after {timeout} s: {job}")
        time.sleep(0.2)
        job = get(f"gpu-snapshot/jobs/{job['id']}")
    return job


class JupyterProcess(JupyterServerProcess):
    """``jupyter <app>`` (lab unless said) with its directories under ``base``: a config
    file there holding ``config``, and its notebooks, data, runtime and store."""

    def __init__(
        self, base: Path, log_path: Path, *, app: str = "lab", config: str = "",
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.base = base
        self.root.mkdir(parents=True, exist_ok=True)
        config_dir = base / "config"
        config_dir.mkdir(exist_ok=True)
        if app == "lab":
            config = lab_test_config(base) + config
        (config_dir / "jupyter_server_config.py").write_text(config)
        env = dict(
            os.environ,
            JUPYTER_CONFIG_DIR=str(config_dir),
            JUPYTER_DATA_DIR=str(base / "data"),
            JUPYTER_RUNTIME_DIR=str(self.runtime_dir),
            JUPYTER_GPU_SNAPSHOT_DIR=str(base / "store"),
            IPYTHONDIR=str(base / "ipython"),
            PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            **(extra_env or {}),
        )
        options = [
            # Enabled by the installed jupyter-config file too; named here so that the tests
            # also run from a source tree that is only on PYTHONPATH.
            '--ServerApp.jpserver_extensions={"jupyter_gpu_snapshot": True}',
            f"--ServerApp.root_dir={self.root}",
        ]
        if app == "lab":
            settings = base / "lab-settings"
            # No news or update toasts over the screenshots.
            notification = settings / "@jupyterlab" / "apputils-extension"
            notification.mkdir(parents=True, exist_ok=True)
            (notification / "notification.jupyterlab-settings").write_text(
                json.dumps({"fetchNews": "false", "checkForUpdates": False})
            )
            options += [
                f"--LabApp.user_settings_dir={settings}",
                f"--LabApp.workspaces_dir={base / 'workspaces'}",
            ]
        super().__init__(log_path, env=env, options=options, app=app, new_session=True)

    @property
    def root(self) -> Path:
        return self.base / "notebooks"

    @property
    def runtime_dir(self) -> Path:
        return self.base / "runtime"

    def request(self, method: str, endpoint: str, body: Any = None) -> Any:
        """One REST call with the token, sent by the in-kernel client; the decoded JSON
        answer (None when empty); ApiError for an error status."""
        return self.client(timeout=30).request(method, endpoint, body)

    def get(self, endpoint: str) -> Any:
        return self.request("GET", endpoint)

    def wait_job(self, job: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
        return until_job_ends(self.get, job, timeout)


def lab_test_config(base: Path) -> str:
    """The lines of a lab server's config that the browser tests need.

    Galata's in-page helpers come as a labextension shipped with JupyterLab; they reach
    the application through ``window.jupyterapp``. These are the two settings of
    ``jupyterlab.galata.configure_jupyter_server`` that load them: the rest of that helper
    (no token, no XSRF check, a fixed port, a temporary root) would undo what the
    tests set up here.
    """
    import jupyterlab  # here: the notebook tests use this module where JupyterLab is absent

    paths = []
    if (SOURCE_LABEXTENSION / "package.json").exists():
        # The tree under test wins over an installed copy: extra paths come first.
        extra = base / "labextensions"
        shutil.copytree(SOURCE_LABEXTENSION, extra / LABEXTENSION_NAME, dirs_exist_ok=True)
        paths.append(str(extra))
    paths.append(str(Path(jupyterlab.__file__).parent / "galata"))
    return (
        f"c.LabServerApp.extra_labextensions_path = {paths!r}\n"
        "c.LabApp.expose_app_in_browser = True\n"
    )


def start_jupyter(
    base: Path, log_path: Path, *, app: str = "lab", config: str = "",
    extra_env: dict[str, str] | None = None,
) -> JupyterProcess:
    """Starts ``jupyter <app>`` with its directories under ``base``; waits until it answers,
    with the extension.

    Raises ServerStartError (a RuntimeError) with the server's log when it exits, answers
    without the extension or does not answer in time.
    """
    server = JupyterProcess(base, log_path, app=app, config=config, extra_env=extra_env)
    server.wait_ready(START_TIMEOUT, interval=0.3, extension=True)
    return server


JupyterStarter = Callable[..., JupyterProcess]


@pytest.fixture
def jupyter_processes(tmp_path: Path) -> Iterator[JupyterStarter]:
    """``start_jupyter`` under the test's tmp_path, given a log path and its options: a
    start that fails fails the test, with the server's log; all are stopped at its end."""
    started: list[JupyterProcess] = []

    def start(log_path: Path, **options: Any) -> JupyterProcess:
        try:
            server = start_jupyter(tmp_path, log_path, **options)
        except RuntimeError as exc:
            pytest.fail(str(exc))
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
