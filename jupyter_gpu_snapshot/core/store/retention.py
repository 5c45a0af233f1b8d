"""Which snapshots to delete, and whether an autosave fits on the disk.

Pure functions over snapshot summaries (``Snapshot.summary()``), so that the rules can be
read and tested apart from the store. The rules:

- a snapshot the user named is never deleted;
- autosaves are deleted only when a newer autosave of the same notebook has committed,
  keeping the newest ``keep_autosaves`` of that notebook;
- ``keep_last`` (the operator's setting) keeps the newest N snapshots of a notebook that
  nobody named; 0 keeps all;
- an autosave is skipped, not started, when it would leave less than ``min_free_bytes``
  on the disk or push the autosaves past ``max_autosave_bytes``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..._constants import format_bytes
from .snapshot import is_default_name

AUTOSAVE = "autosave"
USER = "user"

Summary = Mapping[str, Any]


def group_of(summary: Summary) -> str | None:
    """What a snapshot is kept per: its notebook, else the kernel it was taken of."""
    notebook = summary.get("notebook_path")
    if notebook:
        return f"notebook:{notebook}"
    kernel_id = (summary.get("kernel") or {}).get("kernel_id")
    return f"kernel:{kernel_id}" if kernel_id else None


def user_named(summary: Summary) -> bool:
    """Whether the user gave the snapshot its name (a name we generated does not count)."""
    if summary.get("reason", USER) != USER:
        return False
    name = str(summary.get("name") or "")
    kernel_name = str((summary.get("kernel") or {}).get("name") or "")
    generated = {str(summary.get("id")), f"{kernel_name}-{summary.get('id')}"}
    created = float(summary.get("created") or 0)
    return bool(name) and name not in generated and not is_default_name(name, created)


def _newest_first(summaries: Iterable[Summary]) -> list[Summary]:
    return sorted(summaries, key=lambda s: (float(s.get("created", 0)), str(s.get("id"))),
                  reverse=True)


def to_delete(
    summaries: Iterable[Summary], committed: Summary, keep_autosaves: int, keep_last: int
) -> list[str]:
    """Ids to delete now that ``committed`` has committed; never ``committed`` itself."""
    group = group_of(committed)
    if group is None:
        return []
    mine = [s for s in _newest_first(summaries) if group_of(s) == group]
    doomed: list[str] = []
    if committed.get("reason") == AUTOSAVE and keep_autosaves > 0:
        autosaves = [s for s in mine if s.get("reason") == AUTOSAVE]
        doomed += [str(s["id"]) for s in autosaves[keep_autosaves:]]
    if keep_last > 0 and committed.get("notebook_path"):
        unnamed = [s for s in mine if not user_named(s)]
        doomed += [str(s["id"]) for s in unnamed[keep_last:]]
    keep = str(committed.get("id"))
    return [i for i in dict.fromkeys(doomed) if i != keep]


def newest_per_notebook(summaries: Iterable[Summary]) -> list[Summary]:
    """The newest snapshot of each notebook, whatever its reason; newest first.

    Snapshots of kernels that served no notebook are left out: nothing offers them back.
    """
    newest: dict[str, Summary] = {}
    for s in _newest_first(summaries):
        notebook = s.get("notebook_path")
        if notebook and notebook not in newest:
            newest[str(notebook)] = s
    return list(newest.values())


def stored_bytes(summary: Summary) -> int:
    """What a snapshot's save wrote to the store (its pages shared with earlier snapshots
    are not counted again); its size for a summary without that."""
    written = summary.get("new_bytes")
    return int(written) if isinstance(written, int) else int(summary.get("size_bytes", 0))


def autosave_bytes(summaries: Iterable[Summary]) -> int:
    return sum(stored_bytes(s) for s in summaries if s.get("reason") == AUTOSAVE)


@dataclass(frozen=True)
class DiskRoom:
    """What the disk holds now, for deciding whether an autosave may start."""

    free_bytes: int
    autosave_bytes: int
    # Autosaves of this notebook that retention deletes once the new one commits.
    reclaimed_bytes: int = 0
    # Where the store is, as a refusal names it (the node agent's, through it).
    where: str = ""


def autosave_refusal(
    estimate_bytes: int, room: DiskRoom, min_free_bytes: int, max_autosave_bytes: int
) -> str | None:
    """Why an autosave of about ``estimate_bytes`` must not start, or None if it fits.

    The free-disk check counts the new image before retention frees anything, since the
    old autosaves are deleted only once the new one has committed.
    """
    left = room.free_bytes - estimate_bytes
    if left < min_free_bytes:
        where = f" in {room.where}" if room.where else ""
        return (
            f"about {format_bytes(estimate_bytes)} needed, {format_bytes(room.free_bytes)} "
            f"free{where}, and GPUSnapshot.autosave_min_free_bytes keeps "
            f"{format_bytes(min_free_bytes)} free"
        )
    if max_autosave_bytes > 0:
        after = room.autosave_bytes - room.reclaimed_bytes + estimate_bytes
        if after > max_autosave_bytes:
            return (
                f"autosaves would take {format_bytes(after)}, over "
                f"GPUSnapshot.autosave_max_bytes ({format_bytes(max_autosave_bytes)})"
            )
    return None


def reclaimed_by_next_autosave(
    summaries: Iterable[Summary], group: str | None, keep_autosaves: int
) -> int:
    """Bytes of this group's autosaves that the next committed autosave makes obsolete."""
    if group is None or keep_autosaves <= 0:
        return 0
    autosaves = [
        s for s in _newest_first(summaries)
        if group_of(s) == group and s.get("reason") == AUTOSAVE
    ]
    return sum(stored_bytes(s) for s in autosaves[keep_autosaves - 1:])
