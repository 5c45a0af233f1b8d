"""The node agent's launch of a kernel tree for a caller (``Session.op_launch``):
``unshare`` and nsinit as root, then nsinit drops to the caller before it opens anything
or runs the kernel; in a pod, the same inside the caller's container (``pods/entry``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from ..core.errors import InvalidRequest, SnapshotError
from ..launch.provisioner import NSINIT, wait_for_namespace_init
from .credentials.ownership import Caller, PodCaller
from .pods.entry import ContainerEntry
from .realms import Realm

log = logging.getLogger(__name__)

# Matched whole (fullmatch): "$" would also let a name end in a newline.
_KERNEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
# What the launcher (root until nsinit drops to the caller) runs with: nothing of the
# caller's environment, which could name libraries for root to load (LD_PRELOAD).
_LAUNCHER_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}


async def launch_kernel(caller: Caller, realm: Realm, kernel_id: str, args: dict[str, Any],
                        reap: Callable[[asyncio.subprocess.Process], None]) -> tuple[int, Path]:
    """Start the kernel tree ``args`` asks for; its root's pid (the agent's) and its log.
    ``reap`` waits for the launcher in the background."""
    argv = args.get("argv")
    env = args.get("env") or {}
    cwd = str(args.get("cwd") or pwd_home(caller))
    if (not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv)
            or not isinstance(env, dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise InvalidRequest("launch", "argv must be a list of strings and env a mapping "
                             "of strings")
    if not _KERNEL_ID.fullmatch(kernel_id):
        raise InvalidRequest("launch", f"kernel_id {kernel_id!r} is not a plain name")
    if not os.path.isabs(cwd):
        raise InvalidRequest("launch", f"cwd {cwd!r} is not an absolute path")
    log_path = realm.log_dir / f"kernel-{kernel_id}.log"
    if isinstance(caller, PodCaller):
        # In the caller's container: its nsinit, named by the caller, runs as the
        # caller once the agent's own code has set up the tree (``pods/entry_program``).
        nsinit = args.get("nsinit")
        if (not isinstance(nsinit, list) or len(nsinit) != 2
                or not all(isinstance(p, str) and os.path.isabs(p) for p in nsinit)):
            raise InvalidRequest(
                "launch", "this node agent starts kernels in your container: the "
                "request must name the container's Python and nsinit.py (nsinit)",
                hint="use the same version of jupyter_gpu_snapshot in the image")
        entry = await asyncio.to_thread(ContainerEntry.of, caller.peer_pid,
                                        caller.peer_start or None)
        command = [*entry.prefix({"log": str(log_path), "as": caller.id_spec,
                                  "cwd": cwd, "nsinit": nsinit}), *argv]
        script = nsinit[1]
    else:
        command = [
            shutil.which("unshare") or "unshare", "--pid", "--fork", "--",
            sys.executable, "-I", "-S", str(NSINIT), "--log", str(log_path),
            "--as", caller.id_spec, "--cwd", cwd, "--env-stdin", "--", *argv,
        ]
        script = str(NSINIT)
    launcher = await asyncio.create_subprocess_exec(
        *command, env=_LAUNCHER_ENV, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        root = await _started(launcher, env, log_path, script)
        await asyncio.to_thread(realm.remember, root)
    except BaseException:
        # A launch that does not end with its kernel recorded leaves no kernel behind,
        # whatever stopped it. Above all a client that closed the connection (this task
        # cancelled): no one learns the kernel's pid, so no one would shut it down or
        # save it, and it would hold its memory (its GPU's too) for nothing.
        if launcher.returncode is None:  # else its pid may be another's by now
            _kill_launch(launcher.pid)
        raise
    finally:
        # The launcher ends with the tree; reaped then.
        reap(launcher)
    log.info("launched kernel %s for %s: pid %d", kernel_id, caller.name, root)
    return root, log_path


async def _started(launcher: asyncio.subprocess.Process, env: dict[str, str],
                   log_path: Path, script: str) -> int:
    """The host pid of the launched tree's namespace init, once it runs."""
    assert launcher.stdin is not None and launcher.stderr is not None
    # The kernel's environment reaches nsinit on a pipe and is applied only once it
    # runs as the caller.
    launcher.stdin.write(json.dumps(env).encode())
    await launcher.stdin.drain()
    launcher.stdin.close()
    try:
        return await asyncio.to_thread(wait_for_namespace_init, launcher.pid, script=script)
    except RuntimeError as exc:
        with contextlib.suppress(ProcessLookupError):
            launcher.kill()
        said = (await launcher.stderr.read()).decode(errors="replace").strip()[-500:]
        await launcher.wait()
        raise SnapshotError("launch", f"the kernel did not start: {said or exc}",
                            hint=f"see {log_path}") from exc


def _kill_launch(launcher_pid: int) -> None:
    """SIGKILL a launcher and the tree under it. The launcher is stopped first, so that it
    forks nothing once its children are listed; its child is the namespace's init, whose
    death takes every process of the namespace with it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(launcher_pid, signal.SIGSTOP)
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(launcher_pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    with contextlib.suppress(ProcessLookupError):
        os.kill(launcher_pid, signal.SIGKILL)


def pwd_home(caller: Caller) -> str:
    try:
        return pwd.getpwuid(caller.uid).pw_dir
    except KeyError:
        return "/"
