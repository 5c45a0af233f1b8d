"""A live panel of this kernel's snapshot state, built from ipywidgets 8's own widgets.

``%gpu_snapshot widget`` shows it. It reads everything from the server extension's REST API
(``kernels/{id}/status``, ``kernels/{id}/autosave``, ``jobs?kernel_id=``,
``snapshots?notebook_path=``) and offers
Save (with a portable copy when asked), Restore and Delete, with errors shown inline. When a
restore fails because the snapshot's image cannot come back, it offers the ways back into a
fresh kernel the snapshot lists (``error.details.fallback``), and shows their report.

Why a background thread, and why it cannot deadlock the kernel
---------------------------------------------------------------
The panel must keep moving while the kernel is busy: during ``%gpu_snapshot save`` in a
cell, or any long cell while the toolbar saves. Timers on the kernel's event loop only fire
between cells, so a daemon thread polls instead. It cannot deadlock the kernel because:

- it never waits for the shell thread or the kernel's event loop: it only makes HTTP
  requests (each with a timeout) and sets widget traits;
- setting a trait sends a comm message through ipykernel's IOPub thread, which accepts
  messages from any thread through a per-thread pipe and never blocks the sender;
- the one lock it shares with the button handlers (which run on the shell thread) guards
  only trait updates, is never held across a request, and is the only lock either takes;
- button handlers only start jobs (one short POST) and return; progress comes from polls.

A save freezes the whole process, this thread included; it resumes where it stopped. In a
restored copy its first request fails or sees the new incarnation, and the client
re-resolves which kernel slot it now is.

Why the panel never opens a widget after it is shown
----------------------------------------------------
The list of snapshots is one HTML widget and one dropdown, not a row of widgets per
snapshot. A restored kernel's panel updates itself at once, while JupyterLab may be
connecting the notebook to the restored kernel: a widget opened then reaches a connection
that has no widget manager yet, JupyterLab closes its comm, and the row is dead in the
page. Updates of widgets that exist are only state, which the page reloads from the
kernel once its widget manager is attached.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import ipywidgets as w  # type: ignore[import-untyped]

from .._constants import FALLBACK_MODES
from .client import ApiError, ClientError, SnapshotClient
from .panel_html import (
    FALLBACK_EXPLANATIONS,
    FALLBACK_LABELS,
    html_text,
    offered_fallbacks,
    report_html,
    snapshot_html,
)
from .presentation import (
    IDLE_POLICY_FIELDS,
    autosave_text,
    cuda_text,
    death_text,
    estimate_text,
    hibernate_note,
    hibernation_text,
    job_progress_text,
    last_snapshot_text,
    snapshot_size_text,
)

Json = dict[str, Any]

IDLE_POLL_SECONDS = 1.0
BUSY_POLL_SECONDS = 0.25
# Status and the snapshot list cost the server more than the jobs list; refresh them
# less often while idle, and at once when a job ends.
STATUS_EVERY_SECONDS = 3.0
LIST_EVERY_SECONDS = 10.0


class SnapshotPanel(w.VBox):  # type: ignore[misc]  # ipywidgets is untyped
    """Readiness, CUDA state, last snapshot, save progress and this notebook's snapshots."""

    def __init__(
        self,
        client: SnapshotClient,
        *,
        start: bool = True,
        idle_poll: float = IDLE_POLL_SECONDS,
        busy_poll: float = BUSY_POLL_SECONDS,
    ) -> None:
        self.client = client
        self.idle_poll = idle_poll
        self.busy_poll = busy_poll
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._notebook_path: str | None = None
        self._session_id: str | None = None
        self._session_known = False
        self._tracked: dict[str, Json] = {}  # running jobs we show, by id
        self._finished: set[str] | None = None  # ended jobs already reported
        self._poll_error = False
        self._last_status = 0.0
        self._last_list = 0.0
        self.refreshes = 0  # completed polls, for scripts and tests that wait for one

        self.title = w.HTML("<b>GPU snapshots</b>")
        self.close_button = w.Button(
            icon="times", tooltip="Close this panel (it stops asking the server)",
            layout=w.Layout(width="2.5em"),
        )
        self.close_button.on_click(lambda _b: self.close())
        # The death of the kernel this slot ran before: its state is gone, say so first.
        self.death = w.HTML()
        self.death_restore_button = w.Button(
            description="Restore", icon="history", button_style="warning",
            tooltip="Restore the dead kernel's newest snapshot and switch this notebook to it",
            layout=w.Layout(width="auto"),
        )
        self.death_restore_button.on_click(lambda _b: self.restore_after_death())
        self.death_dismiss_button = w.Button(
            description="Dismiss", tooltip="Hide this notice (the snapshot stays)",
            layout=w.Layout(width="auto"),
        )
        self.death_dismiss_button.on_click(lambda _b: self.dismiss_death())
        self.death_box = w.HBox(
            [self.death, self.death_restore_button, self.death_dismiss_button]
        )
        self.death_box.layout.display = "none"
        self._death: Json | None = None
        self.readiness = w.HTML()
        self.cuda = w.HTML()
        self.last = w.HTML()
        self.autosave = w.HTML()
        self.phase = w.Label()
        self.progress = w.FloatProgress(value=0.0, min=0.0, max=1.0, bar_style="info")
        self.progress_box = w.HBox([self.progress, self.phase])
        self.progress_box.layout.display = "none"
        # When this notebook's kernel hibernates once idle, in each tier, and a way to
        # hibernate it now.
        self.hibernation = w.HTML()
        self.hibernate_tier = w.Dropdown(
            options=[("Process saved", "process"), ("GPU released", "gpu")],
            value="process", description="Hibernate", layout=w.Layout(width="16em"),
        )
        self.hibernate_mode = w.Dropdown(
            options=[("Server setting", "default"), ("After", "after"), ("Never", "never")],
            value="default", layout=w.Layout(width="9em"),
        )
        self.hibernate_minutes = w.BoundedFloatText(
            value=30.0, min=0.1, max=10080.0, description="min idle",
            layout=w.Layout(width="12em"),
        )
        self.hibernate_apply = w.Button(
            description="Apply",
            tooltip="Set when this notebook's kernel hibernates once idle, in the chosen tier",
            layout=w.Layout(width="auto"),
        )
        self.hibernate_apply.on_click(lambda _b: self.set_hibernation())
        self.hibernate_button = w.Button(
            description="Hibernate now", icon="moon",
            tooltip="Save this kernel and end its process so that its GPU memory is free; "
            "the next cell wakes it", layout=w.Layout(width="auto"),
        )
        self.hibernate_button.on_click(lambda _b: self.hibernate())
        self.message = w.HTML()
        self.error = w.HTML()
        self.name_input = w.Text(placeholder="name (optional)", layout=w.Layout(width="14em"))
        self.save_button = w.Button(
            description="Save", icon="camera", button_style="primary",
            tooltip="Snapshot this kernel now; it keeps running",
        )
        self.save_button.on_click(lambda _b: self.save())
        self.portable_check = w.Checkbox(
            value=False, description="with a portable copy", indent=False,
            tooltip="Also keep the variables in a portable form (tensors and arrays in "
            "safetensors, the rest through dill): a fresh kernel can load them where the "
            "image cannot come back, e.g. on another GPU or driver. The save takes longer.",
            layout=w.Layout(width="auto"),
        )
        # The ways back into a fresh kernel after a restore whose image could not come
        # back: made now and hidden (see the module notes), shown for the modes offered.
        self.fallback_note = w.HTML()
        self.fallback_buttons: dict[str, Any] = {}
        for mode in FALLBACK_MODES:
            button = w.Button(
                description=FALLBACK_LABELS[mode], tooltip=FALLBACK_EXPLANATIONS[mode],
                layout=w.Layout(width="auto"),
                button_style="warning" if mode == FALLBACK_MODES[-1] else "",
            )
            button.on_click(lambda _b, mode=mode: self.restore_fallback(mode))
            self.fallback_buttons[mode] = button
        self.fallback_dismiss = w.Button(
            description="Not now", tooltip="Hide these choices (the snapshot stays)",
            layout=w.Layout(width="auto"),
        )
        self.fallback_dismiss.on_click(lambda _b: self._offer_fallback(None, []))
        self.fallback_box = w.VBox([
            self.fallback_note,
            w.HBox([*self.fallback_buttons.values(), self.fallback_dismiss]),
        ])
        self.fallback_box.layout.display = "none"
        self._fallback_snapshot: str | None = None  # what the fallback buttons restore
        self._fallback_jobs: set[str] = set()  # restores that took a way back
        self.report = w.HTML()
        # This notebook's snapshots, newest first: what they are, and which one the
        # Restore and Delete buttons act on.
        self.snapshots: dict[str, Json] = {}
        self.snapshot_list = w.HTML()
        self.snapshot_choice = w.Dropdown(
            options=[], value=None, description="Snapshot", layout=w.Layout(width="28em")
        )
        self.restore_button = w.Button(
            description="Restore", icon="history", disabled=True,
            tooltip="Restore the chosen snapshot into a new kernel and switch this notebook "
            "to it", layout=w.Layout(width="auto"),
        )
        self.restore_button.on_click(lambda _b: self.restore_chosen())
        self.delete_button = w.Button(
            description="Delete", icon="trash", disabled=True,
            tooltip="Delete the chosen snapshot", layout=w.Layout(width="auto"),
        )
        self.delete_button.on_click(lambda _b: self.delete_chosen())
        self.confirming_delete: str | None = None  # the snapshot a second click deletes
        # Until the user picks one, the newest is chosen, also when a newer one comes.
        self._user_chose = False
        self._listing = False  # the list is being updated: a change of choice is ours
        self.snapshot_choice.observe(self._choice_changed, names="value")
        super().__init__([
            w.HBox([self.title, self.close_button]), self.death_box,
            self.readiness, self.cuda, self.last,
            self.autosave, self.hibernation,
            w.HBox([self.hibernate_tier, self.hibernate_mode, self.hibernate_minutes,
                    self.hibernate_apply, self.hibernate_button]),
            self.progress_box,
            w.HBox([self.name_input, self.portable_check, self.save_button]),
            self.message, self.error, self.fallback_box, self.report,
            w.HTML("<b>This notebook's snapshots</b>"), self.snapshot_list,
            w.HBox([self.snapshot_choice, self.restore_button, self.delete_button]),
        ])
        if start:
            self.start()

    # -- the poller ------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, name="gpu-snapshot-panel", daemon=True
            )
            self._thread.start()

    def close(self) -> None:
        """Stop polling and close every widget of the panel (their views disappear)."""
        self._stop.set()
        self._wake.set()
        with self._lock:
            for widget in _descendants(self)[:-1]:  # the panel itself last, below
                widget.close()
            super().close()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.refresh()
            interval = self.busy_poll if self._tracked else self.idle_poll
            self._wake.wait(interval)
            self._wake.clear()

    def refresh(self, full: bool = False) -> None:
        """One poll of the server; the thread calls it, and so may anyone else."""
        try:
            if not self._session_known:
                session = self.client.session()
                self._notebook_path = session.get("path") if session else None
                self._session_id = session.get("id") if session else None
                self._session_known = True
            now = time.monotonic()
            ended = self._poll_jobs()
            if full or ended or now - self._last_status >= STATUS_EVERY_SECONDS:
                self._show_status(self.client.status())
                self._show_autosave(self.client.autosave())
                self._last_status = now
            if full or ended or now - self._last_list >= LIST_EVERY_SECONDS:
                self._show_snapshots(self.client.snapshots(self._notebook_path))
                self._last_list = now
            with self._lock:
                if self._poll_error:  # the server answers again
                    self.error.value = ""
                    self._poll_error = False
        except ClientError as exc:
            self._show_poll_error(exc.message)
        except Exception as exc:  # the poller must survive anything and say what it was
            self._show_poll_error(f"panel update failed: {type(exc).__name__}: {exc}")
        finally:
            self.refreshes += 1

    def _show_poll_error(self, message: str) -> None:
        with self._lock:
            self.error.value = html_text(message, "#c62828")
            self._poll_error = True

    def _poll_jobs(self) -> bool:
        """Follow the jobs of this kernel, and ours; True when one has just ended."""
        kernel_id = self.client.kernel_id
        jobs = {str(j["id"]): j for j in self.client.jobs(kernel_id)}
        for job_id in list(self._tracked):
            if job_id not in jobs:  # e.g. a restore, filed under the new kernel
                try:
                    jobs[job_id] = self.client.job(job_id)
                except ApiError as exc:
                    if exc.status != 404:
                        raise
                    # Forgotten by the server (restarted since this copy was saved, or the
                    # job ended long ago): nothing left to follow, and asking again would
                    # stop every later poll at this job.
                    del self._tracked[job_id]
        first_poll = self._finished is None
        finished = self._finished if self._finished is not None else set()
        ended = False
        for job_id, job in jobs.items():
            if job.get("status") == "running":
                self._tracked[job_id] = job
            elif job_id not in finished:
                finished.add(job_id)
                # Jobs that ended before the panel opened are history, not news.
                if job_id in self._tracked or not first_poll:
                    self._tracked.pop(job_id, None)
                    self._job_ended(job)
                    ended = True
        self._finished = finished
        running = [j for j in jobs.values() if j.get("status") == "running"]
        with self._lock:
            if running:
                job = running[0]
                total = float(job.get("total") or 0)
                done = float(job.get("done") or 0)
                self.progress.value = min(done / total, 1.0) if total else 0.0
                self.progress.bar_style = "info"
                self.phase.value = f"{job.get('kind')}: {job_progress_text(job)}"
                self.progress_box.layout.display = "flex"
            else:
                self.progress_box.layout.display = "none"
            self.save_button.disabled = bool(running)
        return ended

    def _job_ended(self, job: Json) -> None:
        result = job.get("result") or {}
        took_fallback = str(job.get("id")) in self._fallback_jobs
        if job.get("status") == "failed" and job.get("kind") == "restore" and not took_fallback:
            error = job.get("error") or {}
            offered = offered_fallbacks((error.get("details") or {}).get("fallback"))
            if offered and job.get("snapshot_id"):
                self._offer_fallback(str(job["snapshot_id"]), offered)
        with self._lock:
            if job.get("status") == "failed":
                error = job.get("error") or {}
                text = error.get("message") or f"{job.get('kind')} failed"
                what = "restore into a fresh kernel" if took_fallback else job.get("kind")
                self.error.value = html_text(f"{what}: {text}", "#c62828")
            elif job.get("kind") == "restore" and isinstance(result.get("fallback"), dict):
                # This kernel is retired as the fresh one takes the notebook over: the
                # report shows for as long as it still runs.
                where = (
                    "this notebook now uses it" if result.get("session_id")
                    else "no notebook was switched to it"
                )
                self.message.value = html_text(
                    f"Restored into a fresh kernel {result.get('kernel_id')}: {where}"
                )
                self.report.value = report_html(result["fallback"])
            elif job.get("kind") == "save" and job.get("reason") == "hibernate":
                # The kernel's own hibernation: the user saved nothing; a cell woke it.
                self.message.value = html_text(
                    f"Woke from hibernation (snapshot {result.get('name')})"
                )
            elif job.get("kind") == "wake":
                self.message.value = html_text("Woke from hibernation")
            elif job.get("kind") == "save":
                self.message.value = html_text(
                    f"Saved {result.get('name')}: {snapshot_size_text(result)}"
                )
            elif job.get("kind") == "restore":
                where = (
                    "this notebook now uses it" if result.get("session_id")
                    else "no notebook was switched to it"
                )
                self.message.value = html_text(
                    f"Restored into kernel {result.get('kernel_id')}: {where}"
                )

    def _show_status(self, status: Json) -> None:
        self._show_death(status.get("death"))
        hibernation = status.get("hibernation") or {}
        with self._lock:
            if hibernation.get("state") in ("requested", "hibernating"):
                # Said before it sleeps: a hibernated kernel's panel cannot update itself.
                self.readiness.value = html_text(
                    "Hibernating: the next cell you run wakes the kernel", "#e65100")
            elif status.get("ready"):
                self.readiness.value = html_text("Snapshot-ready", "#2e7d32")
            else:
                reasons = "; ".join(status.get("reasons") or []) or "no reason given"
                self.readiness.value = html_text(f"Not snapshot-ready: {reasons}", "#c62828")
            cuda = cuda_text(status.get("cuda"))
            estimate = estimate_text(status)
            if estimate:
                cuda += f" {estimate}."
            self.cuda.value = html_text(cuda)
            last = status.get("last_snapshot")
            self.last.value = html_text(
                f"Last snapshot: {last_snapshot_text(last)}" if last else "No snapshot yet"
            )

    def _show_death(self, death: Json | None) -> None:
        with self._lock:
            self._death = death
            if not death:
                self.death_box.layout.display = "none"
                return
            text = html_text(death_text(death, time.time()), "#c62828")
            if self.death.value != text:  # unchanged text sends nothing
                self.death.value = text
            self.death_restore_button.layout.display = "" if death.get("snapshot") else "none"
            self.death_box.layout.display = "flex"

    def _show_autosave(self, state: Json) -> None:
        text = autosave_text(state, time.time())
        idle = hibernation_text(state)
        with self._lock:
            if self.autosave.value != html_text(text):  # unchanged text sends nothing
                self.autosave.value = html_text(text)
            if self.hibernation.value != html_text(idle):
                self.hibernation.value = html_text(idle) if idle else ""

    def _show_snapshots(self, snapshots: list[Json]) -> None:
        newest_first = {str(summary["id"]): summary for summary in reversed(snapshots)}
        now = time.time()
        with self._lock:
            if self._stop.is_set():  # closed meanwhile
                return
            self.snapshots = newest_first
            listing = "".join(
                f"<li>{snapshot_html(summary, now)}</li>" for summary in newest_first.values()
            )
            text = f"<ul>{listing}</ul>" if listing else html_text("None yet.")
            if self.snapshot_list.value != text:  # unchanged text sends nothing
                self.snapshot_list.value = text
            options = [
                (f"{summary.get('name')} ({sid})", sid) for sid, summary in newest_first.items()
            ]
            if list(self.snapshot_choice.options) != options:
                chosen = self.snapshot_choice.value
                keep = self._user_chose and chosen in newest_first
                self._user_chose = keep
                # The one the user chose stays chosen, else the newest; one update reaches
                # the page. A "Really delete?" asked of a list that changed asks again.
                self._listing = True
                try:
                    with self.snapshot_choice.hold_sync():
                        self.snapshot_choice.options = options
                        self.snapshot_choice.value = (
                            chosen if keep else next(iter(newest_first), None)
                        )
                finally:
                    self._listing = False
                self._confirm_delete(None)
            self.restore_button.disabled = self.delete_button.disabled = not newest_first

    # -- actions (button handlers run on the shell thread: start a job, never wait) --------
    def _act(self, what: str, action: Callable[[], Json | None]) -> Json | None:
        with self._lock:
            self.error.value = ""
            self.message.value = ""
        try:
            result = action()
        except ClientError as exc:
            with self._lock:
                self.error.value = html_text(f"{what}: {exc.message}", "#c62828")
            return None
        if result and result.get("status") == "running":
            self._tracked[str(result["id"])] = result
        self._wake.set()
        return result

    def save(self) -> Json | None:
        """The Save button: start a save job of this kernel; the poller shows its progress."""
        name = self.name_input.value.strip() or None
        portable = bool(self.portable_check.value)
        job = self._act("save", lambda: self.client.start_save(name, portable=portable))
        if job is not None:
            self.name_input.value = ""
        return job

    def set_hibernation(self) -> Json | None:
        """The hibernation Apply button: this notebook's idle time before hibernating in
        the chosen tier."""
        mode = self.hibernate_mode.value
        minutes = None if mode == "default" else 0 if mode == "never" else (
            float(self.hibernate_minutes.value))
        field = IDLE_POLICY_FIELDS[self.hibernate_tier.value]
        state = self._act("hibernation", lambda: self.client.autosave({field: minutes}))
        if state is not None:
            self._show_autosave(state)
        return state

    def hibernate(self) -> Json | None:
        """The Hibernate now button: the server hibernates the kernel once this click's
        handling has ended (a kernel never hibernates while it runs something)."""
        state = self._act("hibernate", self.client.hibernate_when_idle)
        if state is not None:
            cuda = self._act("status", self.client.status)
            with self._lock:
                self.message.value = html_text(hibernate_note("process", (cuda or {}).get("cuda")))
                self.readiness.value = html_text(
                    "Hibernating: the next cell you run wakes the kernel", "#e65100")
        return state

    def restore_after_death(self) -> Json | None:
        """The death notice's Restore: the dead kernel's newest snapshot, into this notebook."""
        snapshot = (self._death or {}).get("snapshot")
        if not snapshot:
            return None
        return self._act(
            "restore",
            lambda: self.client.start_restore(
                str(snapshot["id"]), path=self._notebook_path, session_id=self._session_id
            ),
        )

    def dismiss_death(self) -> None:
        """The death notice's Dismiss: the server forgets it, for every client."""

        def dismiss() -> None:
            self.client.dismiss_death()
            self._show_death(None)

        self._act("dismiss", dismiss)

    def restore_chosen(self) -> Json | None:
        """The Restore button: the chosen snapshot, into a new kernel this notebook uses."""
        chosen = self.snapshot_choice.value
        if not chosen:
            return None
        return self._act(
            "restore",
            lambda: self.client.start_restore(
                str(chosen), path=self._notebook_path, session_id=self._session_id
            ),
        )

    def restore_fallback(self, mode: str) -> Json | None:
        """A way-back button: the snapshot whose image could not come back, into a fresh
        kernel that this notebook then uses; the report shows once the job has ended."""
        snapshot_id = self._fallback_snapshot
        if not snapshot_id:
            return None
        self._offer_fallback(None, [])
        with self._lock:
            self.report.value = ""

        def start() -> Json:
            job = self.client.start_restore(
                snapshot_id, path=self._notebook_path, session_id=self._session_id,
                fallback=mode,
            )
            # Known before the poller can see the job end: its failure offers no way back.
            self._fallback_jobs.add(str(job.get("id")))
            return job

        job = self._act("restore into a fresh kernel", start)
        if job is not None:
            with self._lock:
                self.message.value = html_text(
                    f"Restoring into a fresh kernel ({FALLBACK_LABELS[mode].lower()})…")
        return job

    def _offer_fallback(self, snapshot_id: str | None, offered: list[str]) -> None:
        """Show the buttons of the ``offered`` ways back for ``snapshot_id``; hide them
        all with none."""
        with self._lock:
            self._fallback_snapshot = snapshot_id if offered else None
            for mode, button in self.fallback_buttons.items():
                button.layout.display = "" if mode in offered else "none"
            if offered:
                self.fallback_note.value = html_text(
                    "The snapshot's image cannot come back here, but a fresh kernel can get "
                    "back what it kept besides it: "
                    + "; ".join(f"{FALLBACK_LABELS[mode]}: {FALLBACK_EXPLANATIONS[mode]}"
                                for mode in offered) + "."
                )
            self.fallback_box.layout.display = "flex" if offered else "none"

    def delete_chosen(self) -> None:
        """The Delete button: the first click asks, the second deletes the chosen snapshot
        (snapshots cannot be undeleted)."""
        chosen = self.snapshot_choice.value
        if not chosen:
            return
        if self.confirming_delete != chosen:
            self._confirm_delete(str(chosen))
            return
        self._confirm_delete(None)

        def delete() -> None:
            self.client.delete(str(chosen))
            self._show_snapshots(self.client.snapshots(self._notebook_path))

        self._act("delete", delete)

    def _choice_changed(self, _change: Any) -> None:
        if not self._listing:
            self._user_chose = True
            self._confirm_delete(None)

    def _confirm_delete(self, snapshot_id: str | None) -> None:
        self.confirming_delete = snapshot_id
        self.delete_button.description = "Really delete?" if snapshot_id else "Delete"
        self.delete_button.button_style = "danger" if snapshot_id else ""


def _descendants(widget: Any) -> list[Any]:
    """The widget and all widgets inside it, children first, with their layout and style
    models (each of ours has its own; closing the widget leaves them open)."""
    found: list[Any] = []
    for child in getattr(widget, "children", ()):
        found.extend(_descendants(child))
    for part in ("layout", "style"):
        model = getattr(widget, part, None)
        if isinstance(model, w.Widget):
            found.append(model)
    found.append(widget)
    return found
