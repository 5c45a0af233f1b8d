"""The ``%gpu_snapshot`` line magic: save, list, inspect, delete and restore from a notebook.

``%load_ext jupyter_gpu_snapshot`` registers it; snapshot-ready kernels load it at start.
Every command is a short REST call to the server extension that launched the kernel
(see ``client``); nothing here touches CRIU or CUDA itself. ``timeline`` and ``rewind N``
are this kernel's own: they ask its timeline (``timeline``), without the server.

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
- The server tells a restored copy its new kernel id once that cell has ended; until then
  a further command in the same cell says so (``kernel_identity``) instead of addressing
  the kernel the snapshot was taken from.

Failures are one line naming the step and the cause, shown as the cell's error without a
traceback; the kernel keeps running.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from IPython.core import magic_arguments as _ma
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from .._constants import (
    FALLBACK_MODES,
    fallback_offer,
    fallback_report_lines,
    format_bytes,
    rewind_report_lines,
    table,
    timeline_lines,
)
from . import cell_record, portable_request, timeline
from .client import ClientError, JobFailed, RestoredWhileWaiting, ServerLink, SnapshotClient
from .identity import KernelIdentity
from .presentation import (
    IDLE_POLICY_FIELDS,
    autosave_lines,
    format_age,
    hibernate_note,
    idle_policy_line,
    job_progress_text,
    local_time,
    saved_line,
    snapshot_size_text,
    status_lines,
)

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

    from .widget import SnapshotPanel

# IPython's magic_arguments and display are untyped; give them the types they have.
_Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]
magic_arguments = cast("Callable[[], _Decorator]", _ma.magic_arguments)
argument = cast("Callable[..., _Decorator]", _ma.argument)
parse_argstring = cast("Callable[[Any, str], Any]", _ma.parse_argstring)


def _unquoted(name: str | None) -> str | None:
    """``"my-run"`` as ``my-run``: IPython's argument splitting keeps the quotes."""
    if name and len(name) >= 2 and name[0] == name[-1] and name[0] in "'\"":
        return name[1:-1]
    return name


def _display(*objs: Any, **kwargs: Any) -> Any:
    from IPython.display import display

    return display(*objs, **kwargs)  # type: ignore[no-untyped-call]


COMMANDS = ("save", "list", "status", "rm", "restore", "widget", "autosave", "hibernate",
            "timeline", "rewind")
# Answered by this kernel's own timeline, without the server.
_LOCAL_COMMANDS = ("timeline", "rewind")
_TAKES_NAME = {
    "save": "optional", "rm": "required", "restore": "required", "autosave": "optional",
    "hibernate": "optional",
}
HIBERNATE_USAGE = "%gpu_snapshot hibernate [gpu|process] [after 30m|never|default]"
# Hibernation's tiers (the server's hibernation.TIERS): the GPU released with the process
# kept, or the process saved and ended.
HIBERNATE_TIERS = ("gpu", "process")
AUTOSAVE_USAGE = "%gpu_snapshot autosave [on|off|every 10m|status]"
_UNIT_MINUTES = {"s": 1 / 60, "m": 1.0, "min": 1.0, "h": 60.0}


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
        "into a new kernel and switch this notebook to it; widget: a live panel; autosave: "
        "this notebook's autosave policy (on, off, every 10m, status); hibernate: free "
        "this kernel's GPU once this cell ends, and wake it at the next cell (gpu: keep "
        "its process; after 30m, never, default: when it does so by itself once idle); "
        "timeline: what each cell changed, and which cells can be rewound; rewind N: put "
        "the variables back as they were before cell [N].",
    )
    @argument("name", nargs="?", help="snapshot name (save: optional; rm, restore: name or "
              "id); rewind: the cell's execution count")
    @argument("rest", nargs="*", help=argparse.SUPPRESS)
    @argument(
        "--stop",
        action="store_true",
        help="save only: stop this kernel once it is saved (restore it later)",
    )
    @argument(
        "--portable",
        action="store_true",
        help="save only: also write a portable copy of the namespace, which a restore "
        "can load where the image cannot come back (another driver, GPU or none)",
    )
    @argument(
        "--fallback",
        choices=FALLBACK_MODES,
        help="restore only: do not restore the image; start a fresh kernel and load the "
        "portable copy (portable), re-run the recorded cells (replay), or both",
    )
    @argument(
        "--all",
        action="store_true",
        dest="all_notebooks",
        help="list only: every snapshot in the store, not just this notebook's (with a "
        "server token only: a kernel's own credential reaches its notebook's snapshots)",
    )
    @argument(
        "--latest",
        action="store_true",
        help="list only: just the newest snapshot (of each notebook, with --all)",
    )
    @line_cell_magic
    def gpu_snapshot(self, line: str, cell: str | None = None) -> None:
        """Snapshot this kernel (CUDA state included) and restore snapshots.

        Examples::

            %gpu_snapshot save                 # keep running; prints id, size and time
            %gpu_snapshot save before-train --stop
            %gpu_snapshot list
            %gpu_snapshot status
            %gpu_snapshot restore before-train
            %gpu_snapshot save --portable      # also a copy that survives a new driver
            %gpu_snapshot restore before-train --fallback both
            %gpu_snapshot rm before-train
            %gpu_snapshot widget
            %gpu_snapshot list --latest        # what a restart would offer back
            %gpu_snapshot autosave every 10m   # also: on, off, status
            %gpu_snapshot hibernate            # free the GPU now; the next cell wakes it
            %gpu_snapshot hibernate after 30m  # when idle that long; also: never, default
            %gpu_snapshot hibernate gpu        # give the GPU back, keep the process
            %gpu_snapshot hibernate gpu after 10m  # when idle that long; never, default
            %gpu_snapshot timeline on          # keep a point per cell from now on
            %gpu_snapshot timeline             # the points, one per cell
            %gpu_snapshot rewind 12            # back to before cell [12]

        As a cell magic, a process snapshot before a risky cell, then the cell::

            %%gpu_snapshot checkpoint [NAME]   # NAME: before-cell-N by default
        """
        if cell is not None:
            self._checkpoint_then_run(line, cell)
            return
        args = parse_argstring(self.gpu_snapshot, line)
        args.name = _unquoted(args.name)
        command: str = args.command
        if command in _LOCAL_COMMANDS:
            self._timeline_command(command, args)
            return
        _check_usage(command, args.name, args.stop, args.all_notebooks)
        if args.rest and command not in ("autosave", "hibernate"):
            raise UsageError(f"unrecognized arguments: {' '.join(args.rest)}")
        if args.latest and command != "list":
            raise UsageError("--latest only applies to %gpu_snapshot list")
        if args.portable and command != "save":
            raise UsageError("--portable only applies to %gpu_snapshot save")
        if args.fallback and command != "restore":
            raise UsageError("--fallback only applies to %gpu_snapshot restore")
        changes = _autosave_changes(args.name, args.rest) if command == "autosave" else None
        tier = "process"
        if command == "hibernate":
            tier, changes = _hibernate_request(args.name, args.rest)
        try:
            client = self.client()
            if command == "autosave":
                self._autosave(client, changes)
            elif command == "hibernate":
                self._hibernate(client, changes, tier)
            else:
                getattr(self, f"_{command}")(client, args)
        except ClientError as exc:
            raise SnapshotMagicError(f"%gpu_snapshot {command}: {exc.message}") from None

    # -- commands --------------------------------------------------------------------------
    def _checkpoint_then_run(self, line: str, cell: str) -> None:
        """A process snapshot of the kernel as it is before the cell, then the cell. The
        snapshot puts back what the timeline cannot (GPU values, open files, C extensions'
        state): restore it to undo the cell whole."""
        shell = self.shell
        assert shell is not None  # a magic runs in its shell
        words = line.split()
        if not words or words[0] != "checkpoint" or len(words) > 2:
            raise UsageError("as a cell magic: %%gpu_snapshot checkpoint [NAME]")
        name = _unquoted(words[1]) if len(words) == 2 else \
            f"before-cell-{shell.execution_count}"
        args = argparse.Namespace(name=name, stop=False, portable=False)
        self.last_outcome = None  # an interrupted wait leaves none: the cell is not run
        try:
            self._save(self.client(), args)
        except ClientError as exc:
            # The cell is not run: it was asked to run only once its checkpoint exists.
            raise SnapshotMagicError(f"%%gpu_snapshot checkpoint: {exc.message}; the cell "
                                     "did not run") from None
        outcome = self._outcome()
        if outcome is None or outcome.snapshot_id is None:
            raise SnapshotMagicError("%%gpu_snapshot checkpoint: the snapshot was not made; "
                                     "the cell did not run")
        shell.run_cell(cell)  # type: ignore[no-untyped-call]  # IPython is untyped here

    def _switch_timeline(self, on: bool) -> None:
        shell = self.shell
        assert shell is not None  # a magic runs in its shell
        if on:
            kept = timeline.start(shell)
            limit = format_bytes(kept.limit_bytes)
            print("The timeline is on: every cell from the next one is a point to rewind to "
                  f"(its copies may take {limit} of this kernel's memory).")
        else:
            timeline.stop(shell)
            print("The timeline is off: its points and their copies are let go.")

    def _outcome(self) -> SaveOutcome | None:
        return self.last_outcome

    def _timeline_command(self, command: str, args: Any) -> None:
        if args.rest or args.stop or args.portable or args.fallback or args.all_notebooks \
                or args.latest:
            usage = "rewind N" if command == "rewind" else command
            raise UsageError(f"usage: %gpu_snapshot {usage}")
        if command == "timeline" and args.name:
            if args.name not in ("on", "off"):
                raise UsageError("usage: %gpu_snapshot timeline [on|off]")
            self._switch_timeline(args.name == "on")
            return
        kept = timeline.current()
        if kept is None:
            raise SnapshotMagicError(f"%gpu_snapshot {command}: {timeline.TIMELINE_OFF}")
        if command == "timeline":
            print("\n".join(timeline_lines(kept.content())))
            return
        if not args.name or not args.name.lstrip("[").rstrip("]").isdigit():
            raise UsageError("usage: %gpu_snapshot rewind N (N: the execution count of the "
                             "cell to go back before)")
        try:
            report = kept.rewind(int(args.name.lstrip("[").rstrip("]")), from_cell=True)
        except (timeline.KernelBusy, timeline.RewindOutOfRange,
                timeline.RewindFailed) as exc:
            raise SnapshotMagicError(f"%gpu_snapshot rewind: {exc}") from None
        print("\n".join(rewind_report_lines(report)))

    def _save(self, client: SnapshotClient, args: Any) -> None:
        posted_at = time.time()
        job: dict[str, Any] = {}
        if args.stop:
            print("Saving, then stopping this kernel; restore it with %gpu_snapshot restore.")
            sys.stdout.flush()
        try:
            job = client.start_save(args.name, stop=args.stop, portable=args.portable)
            progress = _ProgressLine(self.shell, "Saving")
            try:
                # This cell only waits: the kernel may write its portable copy meanwhile.
                with portable_request.parked():
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
        print(saved_line(summary, job))

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
        if args.all_notebooks and client.own_credential:
            # The server would list this notebook's alone, under a heading for the store.
            message = (
                "--all lists every notebook's snapshots, and this kernel's own credential "
                "reaches its own notebook's only. JupyterLab's snapshot panel and "
                "'jupyter gpu-snapshot list' show them all"
            )
            raise ClientError("list", message, message=message)
        if not args.all_notebooks:
            session = client.session()
            path = session.get("path") if session else None
        snapshots = client.snapshots(path, latest=args.latest)
        scope = f"of {path}" if path else "in the store"
        if not snapshots:
            print(f"No snapshots {scope}.")
            return
        now = time.time()
        # Where each lives matters only with a remote store (then some are not "local").
        located = any(s.get("location", "local") != "local" for s in snapshots)
        header = ("NAME", "ID", "CREATED", "REASON", "SIZE", "NOTEBOOK")
        rows: list[tuple[str, ...]] = [(*header, "LOCATION") if located else header]
        # Newest first (the latest answer already is).
        for s in snapshots if args.latest else reversed(snapshots):
            created = float(s.get("created", 0))
            row = (
                str(s.get("name", "")),
                str(s.get("id", "")),
                f"{local_time(created)} ({format_age(now - created)})",
                str(s.get("reason", "user")),
                snapshot_size_text(s),
                str(s.get("notebook_path") or "-"),
            )
            rows.append((*row, str(s.get("location", "local"))) if located else row)
        if args.latest:
            print(f"Newest snapshot {scope}:" if path else "Newest snapshot of each notebook:")
        else:
            print(f"{len(snapshots)} snapshot(s) {scope}:")
        print(table(rows))

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
            fallback=args.fallback,
        )
        if session:
            # The server retires this kernel once the notebook is switched: this cell may
            # never finish, so say what happens before it does.
            how = (f"into a fresh kernel by its {args.fallback} fallback (the new kernel "
                   "shows what came back at its first cell)" if args.fallback
                   else "into a new kernel")
            print(
                f"Restoring snapshot {summary['id']} ({summary.get('name')}) {how}; "
                f"{session.get('path')} switches to it and this kernel shuts down."
            )
            sys.stdout.flush()
        progress = _ProgressLine(self.shell, "Restoring")
        try:
            job = client.wait(job, progress.update)
        except KeyboardInterrupt:
            _stopped_waiting("restore", job)
            return
        except JobFailed as failed:
            offered = ((failed.job.get("error") or {}).get("details") or {}).get("fallback")
            if not offered:
                raise
            raise ClientError(failed.step, failed.cause, message=failed.message + ". "
                              + fallback_offer(str(summary.get("name")), offered)) from None
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
        notice = (result.get("gpu_remap") or {}).get("notice")
        if notice:
            print(notice.replace("This kernel was", "It was", 1))
        if result.get("fallback"):
            print("\n".join(fallback_report_lines(result["fallback"])))

    def _autosave(self, client: SnapshotClient, changes: dict[str, Any] | None) -> None:
        state = client.autosave(changes)
        print("\n".join(autosave_lines(state, time.time())))

    def _hibernate(self, client: SnapshotClient, changes: dict[str, Any] | None,
                   tier: str) -> None:
        if changes is not None:
            minutes = client.autosave(changes)["policy"].get(IDLE_POLICY_FIELDS[tier]) or 0
            print(idle_policy_line(tier, float(minutes)))
            return
        # This cell is running, and a kernel never hibernates under a running cell: the
        # server does it as soon as this cell has ended.
        client.hibernate_when_idle(tier)
        cuda = client.status().get("cuda") if tier == "process" else None
        print(hibernate_note(tier, cuda))

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


def _autosave_changes(word: str | None, rest: list[str]) -> dict[str, Any] | None:
    """The policy change that ``%gpu_snapshot autosave WORD REST`` asks for; None: status."""
    words = [w.lower() for w in ([word] if word else []) + rest]
    if words in ([], ["status"]):
        return None
    if words == ["on"]:
        return {"enabled": True}
    if words == ["off"]:
        return {"enabled": False}
    if words == ["default"]:
        return {k: None for k in ("enabled", "interval_minutes", "after_cell_minutes",
                                  "during_cell")}
    if len(words) == 2 and words[0] == "every":
        return {"enabled": True, "interval_minutes": parse_minutes(words[1])}
    raise UsageError(f"usage: {AUTOSAVE_USAGE}")


def _hibernate_request(word: str | None, rest: list[str]) -> tuple[str, dict[str, Any] | None]:
    """The tier ``%gpu_snapshot hibernate WORD REST`` names (the process tier unless it
    names one), and the change of that tier's idle time it asks for; None: hibernate now."""
    words = [w.lower() for w in ([word] if word else []) + rest]
    tier = words.pop(0) if words and words[0] in HIBERNATE_TIERS else "process"
    field = IDLE_POLICY_FIELDS[tier]
    if not words:
        return tier, None
    if words == ["never"]:
        return tier, {field: 0}
    if words == ["default"]:
        return tier, {field: None}
    if len(words) == 2 and words[0] == "after":
        never = "hibernate gpu never" if tier == "gpu" else "hibernate never"
        return tier, {field: parse_minutes(words[1], "idle time", never)}
    raise UsageError(f"usage: {HIBERNATE_USAGE}")


def parse_minutes(text: str, what: str = "autosave interval",
                  instead: str = "autosave off") -> float:
    """``10m``, ``90s``, ``1h`` or ``10`` (minutes) as minutes; 0 is refused, naming the
    ``what`` it was for and the command to use ``instead``."""
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number):] or "m"
    try:
        value = float(number) * _UNIT_MINUTES[unit]
    except (KeyError, ValueError):
        raise UsageError(
            f"cannot read {text!r} as an interval: write e.g. 10m, 90s or 1h"
        ) from None
    if not value > 0:
        raise UsageError(f"the {what} must be more than 0; use '{instead}'")
    return value


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


def load(shell: InteractiveShell) -> None:
    """Register the magic, the cell recorder and the portable request (``cell_record``);
    called by ``load_ipython_extension``. Makes no network call."""
    cell_record.install(shell)
    link_kernel_id = None
    with contextlib.suppress(ClientError):  # outside a server: the magic says so when used
        link_kernel_id = ServerLink.from_env().kernel_id
    identity = KernelIdentity(link_kernel_id) if link_kernel_id else None
    shell.register_magics(GPUSnapshotMagics(shell, identity))
