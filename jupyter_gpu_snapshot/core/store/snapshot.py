"""One snapshot as its readers see it: its id and name, and the ``Snapshot`` view of its
signed manifest (fields, trust status, the summary shown to clients).

The store (``store.py``) makes these views; everyone else reads them. Ids and names
are checked here before any of them becomes a path in the store.
"""

from __future__ import annotations

import re
import secrets
import time
import unicodedata
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import InvalidRequest, SnapshotError
from .manifest import ID_PATTERN, NAME_PATTERN, fallbacks_offered

# The schema's own patterns, so an id or name accepted here is one a manifest may carry.
_ID = re.compile(ID_PATTERN)
_NAME = re.compile(NAME_PATTERN)

OK, UNSIGNED, DAMAGED = "ok", "unsigned", "damaged"

# A default name ends in the local time of its save, and a number when that one was taken.
_DEFAULT_SUFFIX = re.compile(r"-(\d\d\.\d\d)(?:-\d+)?$")
# How long before the manifest's ``created`` a save may have picked its default name.
_NAMED_BEFORE_CREATED = 300


def validate_name(name: str) -> str:
    if not _NAME.fullmatch(name) or name.endswith((".", "-")) or ".." in name:
        raise InvalidRequest(
            "preflight",
            f"invalid snapshot name {name!r}",
            hint="use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit",
        )
    return name


def default_name(notebook_path: str | None, kernel_name: str, when: float) -> str:
    """What a save nobody named is called: its notebook's name and the local time,
    ``demo-14.32`` (the kernelspec's name for a kernel without a notebook), valid by
    ``validate_name``. Called by the save, which adds ``-2``, ``-3``... while it is taken."""
    stem = PurePosixPath(notebook_path).stem if notebook_path else kernel_name
    ascii_stem = unicodedata.normalize("NFKD", stem).encode("ascii", "ignore").decode()
    stem = re.sub(r"[^A-Za-z0-9_]+", "-", ascii_stem).strip("-_")[:50].rstrip("-_")
    stamp = time.strftime("%H.%M", time.localtime(when))
    return validate_name(f"{stem or 'snapshot'}-{stamp}")


def is_default_name(name: str, created: float) -> bool:
    """Whether ``name`` is one ``default_name`` gave a save that began at about ``created``
    (retention keeps the snapshots the user named)."""
    match = _DEFAULT_SUFFIX.search(name)
    if match is None:
        return False
    start = int(created) - _NAMED_BEFORE_CREATED
    return any(time.strftime("%H.%M", time.localtime(t)) == match.group(1)
               for t in range(start, int(created) + 61, 60))


def is_snapshot_id(ref: str) -> bool:
    """Whether ``ref`` is an id (else a name); also tells snapshot directories in the store
    from everything else there."""
    return bool(_ID.fullmatch(ref))


def new_snapshot_id(now: float | None = None) -> str:
    """A fresh id: the UTC time of the save, then random hex (two saves in one second)."""
    stamp = datetime.fromtimestamp(now or time.time(), tz=timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{secrets.token_hex(4)}"


@dataclass(frozen=True)
class Snapshot:
    """A committed snapshot: its directory, its manifest and whether it may be trusted.

    ``status`` is ``ok`` (signed by this node's key and valid), ``unsigned`` (written before
    manifests were signed; ``jupyter gpu-snapshot trust`` signs it) or ``damaged``
    (``problem`` says why). Only ``ok`` snapshots are ever restored.
    """

    id: str
    path: Path
    manifest: dict[str, Any]
    status: str = OK
    problem: str | None = None
    # Where its notebook is now, when it moved since the save (``node.notebook_moves``);
    # the signed manifest keeps the path it was saved from.
    moved_notebook: str | None = None

    @property
    def trusted(self) -> bool:
        return self.status == OK

    def _field(self, *keys: str) -> Any:
        value: Any = self.manifest
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    @property
    def name(self) -> str:
        value = self._field("name")
        return value if isinstance(value, str) and value else self.id

    @property
    def created(self) -> float:
        value = self._field("created")
        return float(value) if isinstance(value, (int, float)) else 0.0

    @property
    def size_bytes(self) -> int:
        files = self._field("files")
        if not isinstance(files, dict):
            return 0
        return sum(int(f["size"]) for f in files.values()
                   if isinstance(f, dict) and isinstance(f.get("size"), int))

    @property
    def new_bytes(self) -> int:
        """What this save wrote to the store: the files it kept whole, the pages the store
        lacked and the recipes (the manifest's ``stored``). A snapshot written before images
        were chunked has no ``stored``: all of it was written."""
        stored = self._field("stored")
        if not isinstance(stored, dict):
            return self.size_bytes
        return sum(value for key in ("whole_bytes", "new_page_bytes", "recipe_bytes")
                   if isinstance(value := stored.get(key), int))

    @property
    def notebook_path(self) -> str | None:
        """The notebook the snapshot belongs to: where it is now."""
        return self.moved_notebook or self.saved_notebook_path

    @property
    def saved_notebook_path(self) -> str | None:
        """The notebook's path when the snapshot was saved, as the manifest says."""
        value = self._field("kernel", "notebook_path")
        return value if isinstance(value, str) and value else None

    @property
    def execution_count(self) -> int | None:
        """The count of the last cell the kernel ran before the save, when it said."""
        cells = (self._field("history") or {}).get("cells")
        counts = [c["count"] for c in cells or [] if isinstance(c, dict)
                  and isinstance(c.get("count"), int)]
        return max(counts) if counts else None

    @property
    def connection_info(self) -> dict[str, Any]:
        self.require_trusted()
        return dict(self.manifest["kernel"]["connection_info"])

    def require_trusted(self, step: str = "verify") -> None:
        if self.status == UNSIGNED:
            raise SnapshotError(
                step,
                f"snapshot {self.id} is unsigned: {self.problem}",
                hint="it was written before snapshots were signed. If you know where it came "
                f"from, sign it with 'jupyter gpu-snapshot trust {self.id}'",
            )
        if self.status != OK:
            raise SnapshotError(
                step,
                f"snapshot {self.id} is damaged and is not used: {self.problem}",
                hint="delete it",
            )

    def summary(self) -> dict[str, Any]:
        """What may be shown to clients: everything but the kernel's HMAC key."""
        kernel = self._field("kernel")
        kernel = dict(kernel) if isinstance(kernel, dict) and self.status != DAMAGED else {}
        info = kernel.get("connection_info")
        info = dict(info) if isinstance(info, dict) else {}
        info.pop("key", None)
        kernel["connection_info"] = info

        def shown(key: str, default: Any) -> Any:
            return default if self.status == DAMAGED else self.manifest.get(key, default)

        return {
            "id": self.id,
            "name": self.name if self.status != DAMAGED else self.id,
            "status": self.status,
            "problem": self.problem,
            "created": self.created,
            "created_iso": datetime.fromtimestamp(self.created, tz=timezone.utc).isoformat(),
            "size_bytes": self.size_bytes,
            "new_bytes": self.new_bytes,
            "host": shown("host", None),
            "notebook_path": self.notebook_path if self.status != DAMAGED else None,
            "saved_notebook_path": (self.saved_notebook_path if self.status != DAMAGED
                                    else None),
            "kernel": kernel,
            "reason": shown("reason", "user"),
            "timings": shown("timings", {}),
            "gpu": shown("gpu", None),
            "versions": shown("versions", {}),
            "warnings": shown("warnings", []),
            "recovered": bool(shown("recovered", False)),
            # What a fallback could bring back if the image cannot come back.
            "fallback": fallbacks_offered(self.manifest) if self.trusted else [],
            "cells_recorded": len((shown("history", None) or {}).get("cells", [])),
            "execution_count": self.execution_count if self.status != DAMAGED else None,
        }
