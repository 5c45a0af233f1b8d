"""A kernel's timeline: one point per cell, each keeping copies of what the cell changed,
and the rewind that puts the namespace back to how it was before a cell.

The state "before cell N" is the state after the newest point whose count is < N. To
rewind to it, every name changed (or deleted) by the cells >= N gets back its value as of
then: the entry of the newest older point that changed it, else the base (points merged
when the limits dropped them), else, for a name created after the timeline started and
unknown to the base, nothing: the name is removed. Names the timeline cannot resolve
(present before it started, or forgotten with the base) make N not rewindable.

All state is guarded by one lock: cells record in the shell's thread, requests come on the
control thread.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..portable import is_user_name
from .copies import ABSENT, Entry, Recycled, copy_point, size_of
from .fingerprint import Walk, fingerprints
from .restore import prepare, protected_ids
from .scope import reachable

CAVEAT = ("changes to files on disk, to other modules' globals, and mutations the timeline "
          "cannot see are not undone")
BUSY = "a cell is running: wait for it or interrupt it, then rewind"
_UNSEEN_SHOWN = 5


class KernelBusy(Exception):
    """A cell runs: a rewind would race it."""


class RewindOutOfRange(Exception):
    """No rewind to before that count is possible now."""


class RewindFailed(Exception):
    """The rewind could not be prepared or made; the namespace is as it was."""


@dataclass
class Point:
    count: int
    ok: bool
    changed: list[str]
    deleted: list[str]
    entries: dict[str, Entry]
    at: float

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries.values())

    def content(self) -> dict[str, Any]:
        uncopied = [{"name": name, "reason": entry.reason}
                    for name, entry in self.entries.items() if entry.kind == "uncopied"]
        return {"count": self.count, "ok": self.ok, "changed": list(self.changed),
                "deleted": list(self.deleted), "bytes": self.nbytes,
                "uncopied": uncopied, "at": self.at}


class Timeline:
    """The points of one shell's cells, and the rewind."""

    def __init__(self, shell: Any, limit_bytes: int, max_points: int) -> None:
        self.shell = shell
        self.limit_bytes = limit_bytes
        self.max_points = max_points
        self.lock = threading.RLock()
        self.points: list[Point] = []
        self.base: dict[str, Entry] = {}
        self.base_complete = True
        self.dropped = 0
        self.running = 0
        self._digests: dict[tuple[Any, ...], bytes] = {}
        self.unseen: dict[str, str] = {}
        self._fingerprints: dict[str, int] = {}
        self._ids: dict[str, int] = {}
        with self.lock:
            self._start_over()

    # -- the shell's events (its thread) --------------------------------------------------
    def pre_run_cell(self, info: Any) -> None:
        with self.lock:
            self.running += 1
            try:
                self._outside_cells()
            except Exception as exc:
                self._start_over()
                print(f"The timeline could not record what changed outside cells "
                      f"({type(exc).__name__}: {exc}); earlier cells can no longer be "
                      "rewound.", file=sys.stderr, flush=True)

    def post_run_cell(self, result: Any) -> None:
        with self.lock:
            self.running = max(0, self.running - 1)
            info = getattr(result, "info", None)
            count = getattr(result, "execution_count", None)
            if info is None or count is None or not info.store_history:
                return
            try:
                with _collector_paused():
                    self.record(int(count), bool(result.success), info.raw_cell or "")
            except (Exception, KeyboardInterrupt) as exc:
                # Never a traceback after the user's cell (an interrupt while a big copy
                # was taken included): one line, and a timeline that knows only what it
                # can be sure of from here on.
                self._start_over()
                why = "interrupted" if isinstance(exc, KeyboardInterrupt) else \
                    f"{type(exc).__name__}: {exc}"
                print(f"The timeline could not record cell [{count}] ({why}); cells before "
                      "it can no longer be rewound.", file=sys.stderr, flush=True)

    # -- recording ---------------------------------------------------------------------------
    def user_names(self) -> list[str]:
        hidden = self.shell.user_ns_hidden
        return [name for name, value in self.shell.user_ns.items()
                if is_user_name(name) and not (name in hidden and hidden[name] is value)]

    def _start_over(self) -> None:
        """Know the namespace as it is now, without copies: the names in it now are ones
        the timeline cannot put back."""
        self.points.clear()
        self.base.clear()
        self.base_complete = True
        names = self.user_names()
        self.initial = set(names)
        walk = Walk({})
        self._fingerprints = fingerprints(self.shell.user_ns, names, lambda name: True, walk)
        self._ids = {name: id(self.shell.user_ns[name]) for name in names}
        self._digests = walk.fresh
        self.unseen = walk.unseen

    def record(self, count: int, ok: bool, raw_cell: str) -> Point:
        """The point of the cell ``count`` that just ended."""
        if self.points and self.points[-1].count >= count:
            self._start_over()  # the counts started again (%reset): so does the timeline
        namespace = self.shell.user_ns
        names = self.user_names()
        scope = reachable(self._python(raw_cell), namespace)
        walk = Walk(self._digests)
        now = fingerprints(namespace, names, scope.__contains__, walk)
        changed = [name for name in names if now[name] != self._fingerprints.get(name)]
        deleted = [name for name in self._fingerprints if name not in now]
        # Room first, for what this point will hold: the copies let go of lend their
        # memory to the new ones, and the timeline never holds more than its limit.
        recycled = Recycled()
        sizes = [size_of(namespace[name]) for name in changed]
        self._keep_within_limits(sum(size for size in sizes if size <= self.limit_bytes),
                                 adding=True, recycled=recycled)
        entries = copy_point(namespace, changed, walk.by_reference, self.limit_bytes,
                             recycled)
        recycled.arrays.clear()
        entries.update((name, ABSENT) for name in deleted)
        point = Point(count, ok, changed, deleted, entries, time.time())
        self._fingerprints = now
        self._ids = {name: id(namespace[name]) for name in names}
        self._digests = walk.fresh
        self.unseen = walk.unseen
        self.points.append(point)
        self._keep_within_limits()
        return point

    def _outside_cells(self) -> None:
        """Names bound, rebound or deleted since the last point by code that was no cell
        (a silent execution, a user expression: the portable fallback's load) belong to
        the state after the newest point: they are copied into it (into the base where
        there is none), so that rewinds see them. Changes in place outside cells are not
        looked for (a cheap check of identities only)."""
        namespace = self.shell.user_ns
        names = self.user_names()
        moved = [name for name in names if self._ids.get(name) != id(namespace[name])]
        gone = [name for name in self._ids if name not in namespace]
        if not moved and not gone:
            return
        walk = Walk(self._digests)
        self._fingerprints.update(fingerprints(namespace, moved, lambda name: True, walk))
        self._digests = {**self._digests, **walk.fresh}
        entries = copy_point(namespace, moved, walk.by_reference, self.limit_bytes)
        entries.update((name, ABSENT) for name in gone)
        for name in gone:
            self._fingerprints.pop(name, None)
        (self.points[-1].entries if self.points else self.base).update(entries)
        self._ids = {name: id(namespace[name]) for name in names}
        self._keep_within_limits()

    def _python(self, raw_cell: str) -> str:
        try:
            return str(self.shell.transform_cell(raw_cell))
        except Exception:
            return "globals()"  # unreadable: every name could be reached

    @property
    def nbytes(self) -> int:
        return sum(point.nbytes for point in self.points) + \
            sum(entry.nbytes for entry in self.base.values())

    def _keep_within_limits(self, coming: int = 0, adding: bool = False,
                            recycled: Recycled | None = None) -> None:
        """Drop the oldest points into the base until within the limits (with room for
        ``coming`` bytes, and for one more point when ``adding``); a base that still does
        not fit is forgotten (rewinds that need it stop being possible), and at last the
        newest copies themselves. The copies let go of go to ``recycled``."""
        let_go = recycled or Recycled()
        room = self.limit_bytes - min(coming, self.limit_bytes)
        points = self.max_points - (1 if adding else 0)
        kept = 0 if adding else 1
        while len(self.points) > points or \
                (len(self.points) > kept and self.nbytes > room):
            oldest = self.points.pop(0)
            for name, entry in oldest.entries.items():
                let_go.give(self.base.get(name))
                self.base[name] = entry
            self.dropped += 1
        if self.nbytes > room and self.base:
            for entry in self.base.values():
                let_go.give(entry)
            self.base.clear()
            self.base_complete = False
        room = self.limit_bytes
        for point in self.points:
            for name, entry in list(point.entries.items()):
                if self.nbytes <= room:
                    return
                if entry.kind == "copy":
                    point.entries[name] = Entry(
                        "uncopied", live_id=entry.live_id,
                        reason="dropped: the timeline's memory limit was reached")

    # -- what a rewind needs -----------------------------------------------------------------
    def _resolve(self, name: str, index: int) -> tuple[Entry, int] | None:
        """A name's entry as of before the point at ``index``, with its age; None where
        the timeline does not know it."""
        for older in range(index - 1, -1, -1):
            entry = self.points[older].entries.get(name)
            if entry is not None:
                return entry, older
        if name in self.base:
            return self.base[name], -1
        if self.base_complete and name not in self.initial:
            return ABSENT, -1
        return None

    def _names_from(self, index: int) -> list[str]:
        names: dict[str, None] = {}
        for point in self.points[index:]:
            names.update(dict.fromkeys(point.entries))
        return list(names)

    def rewindable(self) -> list[int]:
        """The counts N for which every name changed from [N] on has a known value before
        it: some older point has it, or the base, or it did not exist yet. A name is not
        known before its first point, where neither the base nor its absence says so."""
        first: dict[str, int] = {}
        for index, point in enumerate(self.points):
            for name in point.entries:
                first.setdefault(name, index)
        blocked = max((index for name, index in first.items()
                       if name not in self.base
                       and not (self.base_complete and name not in self.initial)),
                      default=-1)
        return [point.count for point in self.points[blocked + 1:]]

    def content(self) -> dict[str, Any]:
        with self.lock:
            return {"status": "ok", "on": True, "running": self.running > 0,
                    "points": [point.content() for point in self.points],
                    "rewindable": self.rewindable(), "bytes": self.nbytes,
                    "limit_bytes": self.limit_bytes, "dropped": self.dropped}

    # -- the rewind --------------------------------------------------------------------------
    def rewind(self, before: int, from_cell: bool = False) -> dict[str, Any]:
        """Put the namespace back to before cell ``before``; the report.

        ``from_cell``: asked by the running cell itself (the magic), the one cell that
        may run meanwhile. Otherwise the caller holds user code still.
        """
        with self.lock:
            if self.running > (1 if from_cell else 0):
                raise KernelBusy(BUSY)
            rewindable = self.rewindable()
            if before not in rewindable:
                raise RewindOutOfRange(_out_of_range(before, rewindable))
            index = next(i for i, point in enumerate(self.points) if point.count == before)
            names = self._names_from(index)
            targets: dict[str, tuple[Entry, int]] = {}
            for name in names:
                resolved = self._resolve(name, index)
                assert resolved is not None  # rewindable said so
                targets[name] = resolved
            namespace = self.shell.user_ns
            untouched = [name for name in self.user_names() if name not in targets]
            try:
                plan = prepare(namespace, targets, protected_ids(namespace, untouched),
                               {id(namespace[name]): namespace[name] for name in untouched})
            except Exception as exc:
                raise RewindFailed(f"preparing the copies to put back failed "
                                   f"({type(exc).__name__}: {exc}); nothing was changed"
                                   ) from exc
            try:
                plan.apply()
            except Exception as exc:  # checked while preparing: not expected to happen
                raise RewindFailed(f"putting the values back failed part way "
                                   f"({type(exc).__name__}: {exc})") from exc
            undone = [point.count for point in self.points[index:]]
            del self.points[index:]
            self._relearn(list(plan.binds), plan.removes)
            return {"before": before, "undone": undone, "restored": list(plan.binds),
                    "removed": list(plan.removes), "not_restored": plan.not_restored,
                    "caveats": self._caveats()}

    def _relearn(self, rebound: list[str], removed: list[str]) -> None:
        """The fingerprints of the names the rewind wrote: the next cell's changes are
        measured from the state the rewind made."""
        for name in removed:
            self._fingerprints.pop(name, None)
        # Digested afresh (deep): the rewind wrote into arrays whose old digests are kept.
        walk = Walk(self._digests)
        namespace = self.shell.user_ns
        present = [name for name in rebound if name in namespace]
        self._fingerprints.update(fingerprints(namespace, present, lambda name: True, walk))
        self._ids = {name: id(namespace[name]) for name in self.user_names()}
        self._digests = {**self._digests, **walk.fresh}
        self.unseen.update(walk.unseen)

    def _caveats(self) -> list[str]:
        caveats = [CAVEAT]
        namespace = self.shell.user_ns
        unseen = [(name, why) for name, why in self.unseen.items() if name in namespace]
        for name, why in unseen[:_UNSEEN_SHOWN]:
            caveats.append(f"{name}: {why}; a change to it in place may not be undone")
        if len(unseen) > _UNSEEN_SHOWN:
            caveats.append(f"{len(unseen) - _UNSEEN_SHOWN} more names are seen in part only")
        return caveats


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The walk makes many short-lived tuples, freed as it goes; left on, the cyclic
    collector would run over the user's whole heap in the middle of it (tens of ms)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def _out_of_range(before: int, rewindable: list[int]) -> str:
    if not rewindable:
        return (f"cannot rewind to before cell {before}: no cell can be rewound now "
                "(the timeline has no point it can go back to)")
    shown = ", ".join(str(count) for count in rewindable)
    return f"cannot rewind to before cell {before}: the cells that can be are {shown}"
