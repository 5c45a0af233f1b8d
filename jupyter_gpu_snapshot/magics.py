"""The ``%gpu_snapshot`` line magic: save, list, inspect, delete and restore from a notebook.

``%load_ext jupyter_gpu_snapshot`` registers it; snapshot-ready kernels load it at start.
Every command is a short REST call to the server extension that launched the kernel
(see ``client``); nothing here touches CRIU or CUDA itself.

Saving from inside a running cell
---------------------------------
``%gpu_snapshot save`` asks the server for a save job (``POST kernels/{id}/snapshots``) and
then polls ``jobs/{id}`` every 0.2 s with short request timeouts. The server freezes and
dumps this very process while the cell sits in that loop, so:

- The kernel that keeps running is frozen for the dump and thawed by CRIU; the loop simply
  continues (its sockets were left alone) and prints the snapshot's id, size and times.
  Nothing waits on the kernel's own event loop or shell thread, so nothing can deadlock.
- A restored copy wakes up in the same loop, in a new process: CRIU closed its TCP
  connections (``--tcp-close``). Before each poll, and after any broken request, the loop
  compares the process's incarnation (boot id and start time; CRIU keeps neither) with
  the one it recorded before waiting. A copy sees them differ, stops waiting at
  once and prints ``restored from snapshot <id>``, asking the server which snapshot the
  save job produced (or, if the job is gone, the first snapshot of that kernel since).
- ``save --stop`` ends this kernel when the dump completes, so only a restored copy prints.

Failures are one line naming the step and the cause, shown as the cell's error without a
traceback; the kernel keeps running.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from IPython.core import magic_arguments as _ma
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class

from .client import (
    ClientError,
    KernelIdentity,
    RestoredWhileWaiting,
    ServerLink,
    SnapshotClient,
    format_age,
    format_bytes,
    snapshot_estimate,
)

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

    from .widget import SnapshotPanel

# IPython's magic_arguments and display are untyped; give them the types they have.
_Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]
magic_arguments = cast("Callable[[], _Decorator]", _ma.magic_arguments)
argument = cast("Callable[..., _Decorator]", _ma.argument)
parse_argstring = cast("Callable[[Any, str], Any]", _ma.parse_argstring)


def _display(*objs: Any, **kwargs: Any) -> Any:
    from IPython.display import display

    return display(*objs, **kwargs)  # type: ignore[no-untyped-call]


COMMANDS = ("save", "list", "status", "rm", "restore", "widget")
_TAKES_NAME = {"save": "optional", "rm": "required", "restore": "required"}


class SnapshotMagicError(Exception):
    """A failed command, shown as one line instead of a traceback."""

    def _render_traceback_(self) -> list[str]:
        # IPython prints this list instead of a traceback.
        return [f"\x1b[0;31m{self}\x1b[0m"]


@dataclass
class SaveOutcome:
    """What the last ``save`` in this process ended with (for scripts and tests)."""

    snapshot_id: str | None
    restored: bool
    summary: dict[str, Any]


@magics_class
class GPUSnapshotMagics(Magics):
    """Holds the kernel's identity across restores and the last outcome and panel."""

    def __init__(self, shell: InteractiveShell, identity: KernelIdentity | None = None) -> None:
        super().__init__(shell)
        self.identity = identity
        self.last_outcome: SaveOutcome | None = None
        self.panel: SnapshotPanel | None = None

    def client(self) -> SnapshotClient:
        link = ServerLink.from_env()  # says clearly when there is no server
        if self.identity is None:
            self.identity = KernelIdentity(link.kernel_id)
        return SnapshotClient(identity=self.identity)

    @magic_arguments()
    @argument(
        "command",
        choices=COMMANDS,
        help="save: snapshot this kernel; list: this notebook's snapshots; status: readiness, "
        "CUDA state and the running job; rm: delete a snapshot; restore: restore a snapshot "
        "into a new kernel and switch this notebook to it; widget: a live panel.",
    )
    @argument("name", nargs="?", help="snapshot name (save: optional; rm, restore: name or id)")
    @argument(
        "--stop",
        action="store_true",
        help="save only: stop this kernel once it is saved (restore it later)",
    )
    @argument(
        "--all",
        action="store_true",
        dest="all_notebooks",
        help="list only: every snapshot in the store, not just this notebook's",
    )
    @line_magic
    def gpu_snapshot(self, line: str) -> None:
        """Snapshot this kernel (CUDA state included) and restore snapshots.

        Examples::

            %gpu_snapshot save                 # keep running; prints id, size and time
            %gpu_snapshot save before-train --stop
            %gpu_snapshot list
            %gpu_snapshot status
            %gpu_snapshot restore before-train
            %gpu_snapshot rm before-train
            %gpu_snapshot widget
        """
        args = parse_argstring(self.gpu_snapshot, line)
        command: str = args.command
        _check_usage(command, args.name, args.stop, args.all_notebooks)
        try:
            client = self.client()
            getattr(self, f"_{command}")(client, args)
        except ClientError as exc:
            raise SnapshotMagicError(f"%gpu_snapshot {command}: {exc.message}") from None

    # -- commands --------------------------------------------------------------------------
    def _save(self, client: SnapshotClient, args: Any) -> None:
        posted_at = time.time()
        job: dict[str, Any] = {}
        if args.stop:
            print("Saving, then stopping this kernel; restore it with %gpu_snapshot restore.")
            sys.stdout.flush()
        try:
            job = client.start_save(args.name, stop=args.stop)
            progress = _ProgressLine(self.shell, "Saving")
            try:
                job = client.wait(job, progress.update, posted_at=posted_at)
            finally:
                progress.close()
        except RestoredWhileWaiting as restored:
            self._report_restored(client, restored)
            return
        except KeyboardInterrupt:
            _stopped_waiting("save", job)
            return
        summary = dict(job.get("result") or {})
        self.last_outcome = SaveOutcome(summary.get("id"), False, summary)
        print(_saved_line(summary, job))

    def _report_restored(self, client: SnapshotClient, restored: RestoredWhileWaiting) -> None:
        try:
            summary = client.snapshot_of(restored)
        except ClientError as exc:
            self.last_outcome = SaveOutcome(None, True, {})
            print(
                "This kernel was restored from a snapshot taken while this cell waited for it "
                f"(which one is unknown: {exc.message})."
            )
            return
        self.last_outcome = SaveOutcome(summary.get("id"), True, summary)
        print(
            f"This kernel was restored from snapshot {summary.get('id')} "
            f"({summary.get('name')}), taken while this cell waited for it."
        )

    def _list(self, client: SnapshotClient, args: Any) -> None:
        path = None
        if not args.all_notebooks:
            session = client.session()
            path = session.get("path") if session else None
        snapshots = client.snapshots(path)
        scope = f"of {path}" if path else "in the store"
        if not snapshots:
            print(f"No snapshots {scope}.")
            return
        now = time.time()
        rows: list[tuple[str, ...]] = [("NAME", "ID", "CREATED", "SIZE", "NOTEBOOK")]
        for s in reversed(snapshots):  # newest first
            created = float(s.get("created", 0))
            rows.append((
                str(s.get("name", "")),
                str(s.get("id", "")),
                f"{_local_time(created)} ({format_age(now - created)})",
                format_bytes(int(s.get("size_bytes", 0))),
                str(s.get("notebook_path") or "-"),
            ))
        print(f"{len(snapshots)} snapshot(s) {scope}:")
        print(_table(rows))

    def _status(self, client: SnapshotClient, args: Any) -> None:
        print("\n".join(status_lines(client.status(), client.identity)))

    def _rm(self, client: SnapshotClient, args: Any) -> None:
        summary = client.snapshot(args.name)
        client.delete(str(summary["id"]))
        print(f"Deleted snapshot {summary['id']} ({summary.get('name')}).")

    def _restore(self, client: SnapshotClient, args: Any) -> None:
        summary = client.snapshot(args.name)
        session = client.session()
        job = client.start_restore(
            str(summary["id"]),
            path=session.get("path") if session else None,
            session_id=session.get("id") if session else None,
        )
        if session:
            # The server retires this kernel once the notebook is switched: this cell may
            # never finish, so say what happens before it does.
            print(
                f"Restoring snapshot {summary['id']} ({summary.get('name')}) into a new kernel; "
                f"{session.get('path')} switches to it and this kernel shuts down."
            )
            sys.stdout.flush()
        progress = _ProgressLine(self.shell, "Restoring")
        try:
            job = client.wait(job, progress.update)
        except KeyboardInterrupt:
            _stopped_waiting("restore", job)
            return
        finally:
            progress.close()
        result = job.get("result") or {}
        if result.get("session_id"):
            where = "the notebook now uses it"
        else:
            where = "no notebook session was switched to it (this kernel has none)"
        print(
            f"Restored snapshot {summary['id']} ({summary.get('name')}) into kernel "
            f"{result.get('kernel_id')}: {where}."
        )

    def _widget(self, client: SnapshotClient, args: Any) -> None:
        from .widget import SnapshotPanel  # ipywidgets only when asked for

        if self.panel is not None:
            self.panel.close()
        self.panel = SnapshotPanel(client)
        _display(self.panel)


def _stopped_waiting(kind: str, job: dict[str, Any]) -> None:
    if not job.get("id"):
        print(f"Interrupted before the {kind} was asked for; nothing was started.")
        return
    print(
        f"Stopped waiting; the {kind} goes on in the server (job {job['id']}). "
        "%gpu_snapshot status shows how it ends."
    )


def _check_usage(command: str, name: str | None, stop: bool, all_notebooks: bool) -> None:
    takes = _TAKES_NAME.get(command)
    if takes == "required" and not name:
        raise UsageError(f"%gpu_snapshot {command} needs a snapshot name or id")
    if takes is None and name:
        raise UsageError(f"%gpu_snapshot {command} takes no name (got {name!r})")
    if stop and command != "save":
        raise UsageError("--stop only applies to %gpu_snapshot save")
    if all_notebooks and command != "list":
        raise UsageError("--all only applies to %gpu_snapshot list")


class _ProgressLine:
    """One output line updated in place while a job runs (only in a kernel with a frontend)."""

    def __init__(self, shell: Any, verb: str) -> None:
        self.verb = verb
        self.handle: Any = None
        self.enabled = getattr(shell, "kernel", None) is not None

    def update(self, job: dict[str, Any]) -> None:
        if not self.enabled or job.get("status") != "running":
            return
        text = f"{self.verb}: {job_progress_text(job)}"
        if self.handle is None:
            self.handle = _display({"text/plain": text}, raw=True, display_id=True)
        else:
            self.handle.update({"text/plain": text}, raw=True)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.update({"text/plain": ""}, raw=True)


def job_progress_text(job: dict[str, Any]) -> str:
    phase = str(job.get("phase", ""))
    done, total = int(job.get("done") or 0), int(job.get("total") or 0)
    if total:
        return f"{phase} {format_bytes(done)} of {format_bytes(total)}"
    return phase


def _saved_line(summary: dict[str, Any], job: dict[str, Any]) -> str:
    timings = summary.get("timings") or {}
    total = timings.get("total")
    if total is None and job.get("finished") and job.get("started"):
        total = float(job["finished"]) - float(job["started"])
    took = f" in {float(total):.1f} s" if total is not None else ""
    paused = timings.get("pause")
    pause = f" (kernel paused {float(paused):.2f} s)" if paused is not None else ""
    created = _local_time(float(summary.get("created", time.time())))
    return (
        f"Saved snapshot {summary.get('id')} ({summary.get('name')}) at {created}: "
        f"{format_bytes(int(summary.get('size_bytes', 0)))}{took}{pause}."
    )


def status_lines(status: dict[str, Any], identity: KernelIdentity | None = None) -> list[str]:
    """``kernels/{id}/status`` as the lines ``%gpu_snapshot status`` prints."""
    kid = status.get("kernel_id", "?")
    lines = []
    if status.get("ready"):
        lines.append(f"Kernel {kid}: ready to snapshot.")
    else:
        reasons = "; ".join(status.get("reasons") or []) or "no reason given"
        lines.append(f"Kernel {kid}: not snapshot-ready: {reasons}.")
    if identity is not None and identity.restored_from_kernel:
        lines.append(f"This process was restored from a snapshot of kernel "
                     f"{identity.restored_from_kernel}.")
    lines.append(cuda_text(status.get("cuda")))
    estimate = estimate_text(status)
    if estimate:
        lines.append(estimate + ".")
    last = status.get("last_snapshot")
    if last:
        lines.append(f"Last snapshot: {last_snapshot_text(last)}.")
    else:
        lines.append("No snapshot of this notebook yet.")
    job = status.get("job")
    if job and job.get("status") == "running":
        lines.append(f"Running: {job.get('kind')} job {job.get('id')}, {job_progress_text(job)}.")
    return lines


def cuda_text(cuda: dict[str, Any] | None) -> str:
    if cuda is None:  # the kernel loaded the CUDA driver, and no GPU layer can say more
        return "CUDA: state unknown (the server cannot inspect it)."
    if cuda.get("state") in (None, "none"):
        return "CUDA: not in use by this kernel."
    text = f"CUDA: {cuda.get('state')}"
    memory = cuda.get("memory_bytes")
    if memory is not None:
        text += f", {format_bytes(int(memory))} of GPU memory in use"
    return text + "."


def last_snapshot_text(summary: dict[str, Any]) -> str:
    created = float(summary.get("created", 0))
    return (
        f"{summary.get('name')} ({summary.get('id')}), {format_age(time.time() - created)}, "
        f"{format_bytes(int(summary.get('size_bytes', 0)))}"
    )


def estimate_text(status: dict[str, Any]) -> str | None:
    estimate = snapshot_estimate(status)
    if estimate is None:
        return None
    host, gpu = estimate
    text = f"A snapshot now would hold about {format_bytes(host + gpu)}"
    if gpu:
        text += f" ({format_bytes(host)} host memory, {format_bytes(gpu)} GPU memory)"
    return text


def _local_time(epoch: float) -> str:
    return datetime.fromtimestamp(epoch).strftime("%Y-%m-%d %H:%M:%S")


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def load(shell: InteractiveShell) -> None:
    """Register the magic; called by ``load_ipython_extension``. Makes no network call."""
    link_kernel_id = None
    with contextlib.suppress(ClientError):  # outside a server: the magic says so when used
        link_kernel_id = ServerLink.from_env().kernel_id
    identity = KernelIdentity(link_kernel_id) if link_kernel_id else None
    shell.register_magics(GPUSnapshotMagics(shell, identity))
