"""Running the ``criu`` binary and turning its log into errors people can act on."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from .errors import NotReady, SnapshotError

MIN_VERSION = (4, 2)

# CRIU prefixes its error lines like "(00.123456) Error (criu/sk-inet.c:93): ...".
_ERROR_LINE = re.compile(r"^\(\s*[\d.]+\)\s+(?:\d+:\s+)?Error \([^)]*\):\s*(.*)$")
_PORT = re.compile(r"port (\d+)")
# Logged as errors on every run on some systems without affecting the outcome; the CUDA
# plugin logs the second for every process of the tree that holds no CUDA state.
_BENIGN = re.compile(r"Can't setup RLIMIT_NOFILE|"
                     r"cuda_plugin: Failed to launch cuda-checkpoint to retrieve restore tid")

# What a cause in CRIU's log means for the user, first match wins.
_KNOWN_CAUSES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"unix: Can't bind.*Address already in use"),
     "a Unix socket name the kernel listened on is taken by another process (libcuda's "
     "socket of a CUDA process started since the save, say)"),
    (re.compile(r"Address already in use"),
     "a port of the kernel is in use; is the original kernel (or another restore) still running?"),
    (re.compile(r"No space left on device"), "the disk holding the snapshot store is full"),
    (re.compile(r"has bad size|bad size"),
     "a file the kernel had open has changed size since the snapshot"),
    (re.compile(r"Can't get rlimit \d+: Operation not permitted"),
     "criu may not read another user's process limits here (this root lacks "
     "CAP_SYS_RESOURCE, as some sandboxes' does); the node agent saves such kernels as "
     "their user (jupyter gpu-snapshot agent, docs/cluster.md)"),
    (re.compile(r"Operation not permitted|Permission denied|CAP_"),
     "criu lacks privileges; run as root or grant CAP_CHECKPOINT_RESTORE and CAP_SYS_ADMIN"),
    (re.compile(r"handle_device_vma plugin failed|Can't handle non-regular mapping"),
     "the kernel maps a device file that CRIU cannot dump (for example /dev/nvidia0 mapped "
     "by OpenCL or Vulkan: only CUDA's own mappings are checkpointed)"),
    (re.compile(r"No such file or directory"),
     "a file the kernel had open is missing on this machine"),
]


def _same_pid(pid: int) -> int:
    return pid


@dataclass(frozen=True)
class PidView:
    """How a criu run names our processes and threads, and back: the same pids, except
    for a criu that a node agent runs inside a user's container, in its pid namespace
    (``agent/pods/pids``). Part of the engine's ``CriuLaunch``; read by criu's command
    line, the restore's pid file and the CUDA plugin's broker."""

    to_criu: Callable[[int], int] = _same_pid
    from_criu: Callable[[int], int] = _same_pid


def _program_itself(path: str) -> list[str]:
    return [path]


@dataclass(frozen=True)
class CriuLaunch:
    """How criu runs: as this process is, by default; for the node agent, as one caller's
    operation needs (``agent/realms.engine_launch``). Given to ``CriuRunner`` when it is
    made and never changed after, as jupyter_client hands a provisioner its configuration.

    - ``dump_as``, ``restore_as``: the commands ``criu dump`` and ``criu restore`` run
      under, with the credentials the node agent gives criu for one user's kernel
      (``agent/credentials/criu_runs_as``); a dump under other uids runs in criu's
      ``--unprivileged`` mode;
    - for a node agent that runs criu inside a user's container (``agent/pods/entry``):
      ``program``, how the criu binary at a path is run (through the agent's own loader);
      ``path``, how criu names a path of ours (through the agent's root);
      ``path_variables``, the variables of criu's environment that list such paths; and
      ``action_scripts``, whether criu may run an action script (a shell script, which
      the container's own shell would run there);
    - ``pids``: how criu names our processes (``PidView``)."""

    dump_as: tuple[str, ...] = ()
    restore_as: tuple[str, ...] = ()
    program: Callable[[str], list[str]] = _program_itself
    path: Callable[[str], str] = str
    path_variables: frozenset[str] = frozenset()
    action_scripts: bool = True
    pids: PidView = field(default_factory=PidView)


@dataclass
class CriuExtras:
    """What hooks add to one criu run: a plugin directory (``--libdir``), variables for its
    environment, a longer ``--timeout`` (seconds criu allows for seizing the tree), and,
    at restore, whether the tasks stay stopped for the engine to continue them, and files
    already opened that criu restores instead of opening their paths (``--inherit-fd``;
    by criu's name for each: the path without its leading slash)."""

    libdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    timeout: int | None = None
    leave_stopped: bool = True
    inherited_fds: dict[str, int] = field(default_factory=dict)
    # What each of those stands for, by criu's name, for messages: criu names a file it got
    # as a descriptor by that descriptor ("File fd/46 has bad size").
    file_names: dict[str, str] = field(default_factory=dict)
    # At dump: files criu writes as external (``file[MNT:INODE]``), not as their paths.
    externals: list[str] = field(default_factory=list)
    # The engine's (``CriuLaunch.pids``), set when the run's context is made.
    pids: PidView = field(default_factory=PidView)

    def argv(self, path: Callable[[str], str] = str) -> list[str]:
        """criu's options for these extras, each of our paths as ``path`` names it."""
        argv = ["--libdir", path(self.libdir)] if self.libdir else []
        for external in self.externals:
            argv += ["--external", external]
        for key, fd in self.inherited_fds.items():
            argv += ["--inherit-fd", f"fd[{fd}]:{key}"]
        return argv + (["--timeout", str(self.timeout)] if self.timeout else [])

    def close_inherited(self) -> None:
        """Close the inherited descriptors: criu has its own copies once it ran."""
        fds, self.inherited_fds = list(self.inherited_fds.values()), {}
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass(frozen=True)
class CriuRun:
    """One finished criu invocation."""

    argv: list[str]
    returncode: int
    seconds: float
    log_path: Path
    # With ``track_children``: criu's children seen while it ran (pid → start time).
    children: dict[int, float] = field(default_factory=dict)
    # The deadline it was killed at (``CriuRunner.timeout``), if it ran that long.
    timed_out: float | None = None


# How often a restore's criu is looked at for new children: criu forks the tree's init in
# its first moments, then reads the pages for seconds.
_CHILD_TICK_EARLY = 0.01
_CHILD_EARLY_SECONDS = 2.0
_CHILD_TICK = 0.05


# ``--inherit-fd fd[N]:KEY``, and criu's name of such a file in its messages.
_INHERITED = re.compile(r"fd\[(\d+)\]:(.+)")
_FD_NAME = re.compile(r"(/proc/self/)?\bfd/(\d+)\b")
# criu's copy of an inherited descriptor, taken as it is used (``inherit_fd_lookup_id``).
_INHERITED_COPY = re.compile(r"Found id (\S+) \(fd (\d+)\) in inherit fd list")


def _children(pid: int) -> dict[int, float]:
    with contextlib.suppress(psutil.Error):
        return {child.pid: child.create_time()
                for child in psutil.Process(pid).children(recursive=True)}
    return {}


def describe_exit(returncode: int) -> str:
    """How a criu run ended, from its status alone."""
    if returncode < 0:
        return f"criu was killed by signal {-returncode}"
    if returncode > 128:  # a shell or wrapper reports a killed criu as 128 + signal
        return f"criu was killed by signal {returncode - 128}"
    return f"criu exited with status {returncode}"


def explain_log(log_path: Path, returncode: int) -> str:
    """One line naming the cause of a failed criu run, taken from its log."""
    if returncode < 0:
        return describe_exit(returncode)
    errors: list[str] = []
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                match = _ERROR_LINE.match(line.strip())
                if match and not _BENIGN.search(match.group(1)):
                    errors.append(match.group(1).strip())
    except OSError:
        return f"criu exited with status {returncode} and left no log"
    if not errors:
        return describe_exit(returncode)
    joined = " | ".join(errors)
    for pattern, meaning in _KNOWN_CAUSES:
        if pattern.search(joined):
            port = _PORT.search(joined)
            detail = f" (port {port.group(1)})" if port and "port" in meaning else ""
            return f"{meaning}{detail}; criu said: {errors[0]}"
    return f"criu said: {errors[0]}"


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def parse_version(text: str) -> tuple[int, ...] | None:
    match = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not match:
        return None
    return tuple(int(g) for g in match.groups() if g is not None)


class CriuRunner:
    """Builds criu command lines and runs them without blocking the event loop."""

    def __init__(self, criu_path: str = "criu", ghost_limit: int | None = None,
                 launch: CriuLaunch | None = None, timeout: float | None = None) -> None:
        self.criu_path = criu_path
        self.ghost_limit = ghost_limit
        self.launch = launch or CriuLaunch()
        # Seconds one run may take before criu is killed (``c.GPUSnapshot.criu_timeout``):
        # for a criu that hangs (a file it opens that never answers), far above any run
        # that works. None: no limit.
        self.timeout = timeout
        self._version: tuple[int, ...] | None = None

    def with_launch(self, launch: CriuLaunch) -> CriuRunner:
        """A runner of the same criu that runs it as ``launch`` says (its version, once
        read, is not asked again)."""
        runner = CriuRunner(self.criu_path, self.ghost_limit, launch, self.timeout)
        runner._version = self._version
        return runner

    def executable(self) -> str:
        found = shutil.which(self.criu_path)
        if not found:
            raise NotReady(
                "preflight",
                f"criu not found (looked for {self.criu_path!r})",
                hint="install criu >= 4.2 (scripts/install-criu.sh does it on Debian)",
            )
        return found

    def version(self) -> tuple[int, ...]:
        if self._version is None:
            out = subprocess.run(
                [self.executable(), "--version"], capture_output=True, text=True, check=False
            )
            parsed = parse_version(out.stdout)
            if parsed is None:
                raise NotReady("preflight", f"cannot read criu's version from {out.stdout!r}")
            self._version = parsed
        return self._version

    def require_version(self) -> str:
        version = self.version()
        text = ".".join(map(str, version))
        if version[:2] < MIN_VERSION:
            raise NotReady(
                "preflight",
                f"criu {text} is too old; version 4.2 or newer is needed",
                hint="run scripts/install-criu.sh, or install a newer criu",
            )
        return text

    def dump_argv(
        self,
        pid: int,
        images: Path,
        work: Path,
        *,
        leave_running: bool,
        action_script: Path | None = None,
        extras: CriuExtras | None = None,
    ) -> list[str]:
        argv = [
            *self.launch.dump_as, *self.launch.program(self.executable()), "dump",
            "-t", str(self.launch.pids.to_criu(pid)),
            "-D", self.launch.path(str(images)), "-W", self.launch.path(str(work)),
            "-o", "dump.log", "-v4",
            # Established ZMQ connections are closed; clients reconnect with the same
            # connection file. --tcp-established would need a network lock.
            "--tcp-close",
            # A client that connects while the tree is frozen (a heartbeat that timed out
            # during a long CUDA checkpoint) waits in a listen queue; it is dropped and
            # reconnects, as every connection does at restore with --tcp-close.
            "--skip-in-flight",
            "--file-locks",
            # The namespace's own mounts (its /proc) are dumped; the host's mounts it
            # inherited are recorded as external and bound back at restore.
            "--external", "mnt[]",
        ]
        if self.launch.dump_as:
            argv.append("--unprivileged")
        if leave_running:
            argv.append("--leave-running")
        if action_script is not None and self.launch.action_scripts:
            argv += ["--action-script", self.launch.path(str(action_script))]
        if self.ghost_limit is not None:
            argv += ["--ghost-limit", str(self.ghost_limit)]
        return argv + (extras.argv(self.launch.path) if extras else [])

    def restore_argv(
        self, images: Path, work: Path, pidfile: Path, *, leave_stopped: bool = False,
        extras: CriuExtras | None = None, stream: bool = False,
    ) -> list[str]:
        argv = [
            *self.launch.restore_as, *self.launch.program(self.executable()), "restore",
            "-D", self.launch.path(str(images)), "-W", self.launch.path(str(work)),
            "-o", "restore.log", "-v4", "--tcp-close", "--file-locks",
            "--restore-detached", "--pidfile", self.launch.path(str(pidfile)),
            # The counterpart of --external mnt[] at dump: bind the host's mounts back.
            "--ext-mount-map", "auto", "--root", "/",
        ]
        if stream:
            # The images come from an ImageStreamer listening in ``images``, not from files.
            argv.append("--stream")
        if leave_stopped:
            # The tasks stay stopped: no code of the image runs until the caller continues
            # them, so the images can be checked while criu reads them.
            argv.append("--leave-stopped")
        return argv + (extras.argv(self.launch.path) if extras else [])

    async def run(
        self,
        argv: list[str],
        log_path: Path,
        *,
        on_tick: Callable[[], None] | None = None,
        tick_seconds: float = 0.2,
        pass_fds: tuple[int, ...] = (),
        env: dict[str, str] | None = None,
        track_children: bool = False,
    ) -> CriuRun:
        """Run criu to completion, calling ``on_tick`` while it runs (for progress).

        ``track_children`` notes criu's children as they appear: a restore's tree hangs
        below them, and a criu that dies midway leaves them orphaned for the caller to
        kill (``CriuRun.children``). A criu still running after ``timeout`` seconds is
        killed, with its session (``CriuRun.timed_out``)."""
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            # Its own session: a Ctrl-C meant for the CLI must not reach criu while it has
            # its parasite code inside the kernel, where a killed criu can take it down.
            start_new_session=True,
            pass_fds=pass_fds,
            env=self._environment(env),
        )
        wait = asyncio.ensure_future(proc.communicate())
        children: dict[int, float] = {}
        timed_out = None
        while True:
            if track_children:
                children.update(await asyncio.to_thread(_children, proc.pid))
            early = time.monotonic() - started < _CHILD_EARLY_SECONDS
            done, _ = await asyncio.wait(
                {wait}, timeout=(_CHILD_TICK_EARLY if early else min(tick_seconds, _CHILD_TICK))
                if track_children else tick_seconds)
            if done:
                break
            if self.timeout and timed_out is None and time.monotonic() - started > self.timeout:
                timed_out = self.timeout
                # Its session: criu, and a wrapper or a prefix that runs it.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            if on_tick:
                on_tick()
        _, stderr = wait.result()
        if stderr and proc.returncode:
            await asyncio.to_thread(_append, log_path, b"\n-- criu stderr --\n" + stderr[-4000:])
        return CriuRun(argv, proc.returncode or 0, time.monotonic() - started, log_path,
                       children, timed_out)

    def _environment(self, env: dict[str, str] | None) -> dict[str, str] | None:
        """criu's environment: ours with ``env``, each path of ours in the variables that
        list paths as criu names it."""
        if not env and not self.launch.path_variables:
            return None
        merged = {**os.environ, **(env or {})}
        for name in self.launch.path_variables & merged.keys():
            merged[name] = os.pathsep.join(
                self.launch.path(entry) if entry.startswith("/") else entry
                for entry in merged[name].split(os.pathsep))
        return merged

    def check_output(self) -> tuple[bool, str]:
        out = subprocess.run(
            [self.executable(), "check"], capture_output=True, text=True, check=False
        )
        text = (out.stdout + out.stderr).strip()
        return out.returncode == 0, text

    @staticmethod
    def failure(step: str, run: CriuRun, kept_log: Path | None,
                file_names: Mapping[str, str] | None = None) -> SnapshotError:
        """The error of a failed run; ``file_names`` (criu's key -> path, as
        ``CriuExtras.file_names``) name the files criu got as descriptors."""
        if run.timed_out is not None:
            return SnapshotError(
                step, f"criu did not finish within {run.timed_out:.0f} s and was stopped",
                hint="is a file system of the kernel's files hung? The limit is "
                "c.GPUSnapshot.criu_timeout", log_path=kept_log)
        cause = explain_log(run.log_path, run.returncode)
        return SnapshotError(
            step, _named_files(cause, run.log_path, run.argv, file_names or {}),
            log_path=kept_log)


def _named_files(text: str, log_path: Path, argv: list[str],
                 file_names: Mapping[str, str]) -> str:
    """``text`` with each descriptor criu got (``--inherit-fd fd[N]:KEY``) that it names
    as ``fd/N`` named by its file instead. criu moves each into its store of descriptors
    and takes a fresh copy at each use, whose number its log says ("Found id KEY (fd N)"):
    the copy taken last before the first error naming ``fd/N`` is the one it means."""
    if not file_names:
        return text
    names: dict[str, str] = {}
    for option, value in itertools.pairwise(argv):
        found = _INHERITED.fullmatch(value) if option == "--inherit-fd" else None
        if found is not None and found.group(2) in file_names:
            names[found.group(1)] = file_names[found.group(2)]
    # What the log says of a number wins over the number criu was handed: criu's copy of
    # one descriptor may take the number another was handed as.
    copies: dict[str, str] = {}
    meant: dict[str, str] = {}
    with contextlib.suppress(OSError), open(log_path, errors="replace") as log:
        for line in log:
            copy = _INHERITED_COPY.search(line)
            if copy is not None and copy.group(1) in file_names:
                copies[copy.group(2)] = file_names[copy.group(1)]
            elif _ERROR_LINE.match(line.strip()):
                for number in _FD_NAME.findall(line):
                    if number[1] in copies:
                        meant.setdefault(number[1], copies[number[1]])
    names.update(meant)
    if not names:
        return text
    return _FD_NAME.sub(lambda m: names.get(m.group(2), m.group(0)), text)
