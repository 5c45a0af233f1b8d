"""The snapshot store: signed snapshots on local disk, their pages kept by content, and their
copies in object storage.

This is the store's face. Everything outside ``core/store/`` (the engine beside it, node/,
the server, the CLI, the agent) imports these names, never the store's modules; lint-imports
keeps it so, and tests/project/test_store_face.py keeps the server and the CLI to a
snapshot's view and its rules. docs/architecture.md maps the rooms behind the face.

Who needs which names:

- a snapshot as everyone reads it: ``Snapshot``, ``DAMAGED``, ``is_snapshot_id``,
  ``new_snapshot_id``, ``validate_name``, ``default_name`` (a save nobody named);
- the store, its paths and what it accepts (node/, the agent, config): ``SnapshotStore``,
  ``ManifestPolicy``, ``fallbacks_offered``, ``default_store_dir``, ``default_key_file``,
  ``default_kernel_log_dir``;
- a save (core/save.py): ``DumpFollower``, ``FollowedFile``, ``ManifestProblem``,
  ``bounded_history``, ``is_portable_file``, ``portable_problem``, ``DUMP_COMPLETE_FILE``;
- a restore (core/restore.py): ``ImageStreamer``, ``ImageFile``; a node's record of its
  libraries (core/compatibility.py): ``digest_files``, ``preferred_algorithm``;
- the layout that recovery finishes (core/recovery.py): the ``*_PREFIX`` names,
  ``DRAFT_FILE``, ``ASSEMBLY_LOCK``, ``MEMORY_DIR``, ``assembly_key``;
- listings and sizes (core/engine.py, node/, the agent's client): ``SnapshotIndex``,
  ``store_usage``, ``StoreUsage``, ``StoreRoom``, ``SnapshotUsage``;
- which snapshots to keep (the server's autosave, node/): ``to_delete``,
  ``newest_per_notebook``, ``group_of``, ``DiskRoom``, ``autosave_bytes``,
  ``autosave_refusal``, ``reclaimed_by_next_autosave``;
- copies in object storage (node/): ``RemoteStore``, ``RemoteSnapshot``,
  ``RemoteStoreError``, ``SnapshotCache``, ``PendingUploads``, ``load_key``, ``describe``.

The names whose rooms need numpy or worker processes (the packs, the streamer, the usage
count) are imported when first named (``__getattr__`` below): a listing, which reads the
manifests alone, imports none of them. Outside the store, a module that only names them in
signatures imports them for the type checker alone, and a call that uses one imports it in
its body.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .digest import digest_files, preferred_algorithm
from .index import SnapshotIndex
from .manifest import (
    ManifestPolicy,
    ManifestProblem,
    bounded_history,
    fallbacks_offered,
    is_portable_file,
    portable_problem,
)
from .remote import RemoteSnapshot, RemoteStore, RemoteStoreError, SnapshotCache, load_key
from .remote.objects import describe
from .remote.pending import PendingUploads
from .retention import (
    DiskRoom,
    autosave_bytes,
    autosave_refusal,
    group_of,
    newest_per_notebook,
    reclaimed_by_next_autosave,
    to_delete,
)
from .snapshot import (
    DAMAGED,
    Snapshot,
    default_name,
    is_snapshot_id,
    new_snapshot_id,
    validate_name,
)
from .staging import (
    ASSEMBLED_PREFIX,
    ASSEMBLY_LOCK,
    MEMORY_ASSEMBLY_PREFIX,
    MEMORY_DIR,
    assembly_key,
)
from .store import (
    DELETING_PREFIX,
    DRAFT_FILE,
    DUMP_COMPLETE_FILE,
    PARTIAL_PREFIX,
    UNFINISHED_PREFIX,
    SnapshotStore,
    default_kernel_log_dir,
    default_key_file,
    default_store_dir,
)

if TYPE_CHECKING:
    from .packs import DumpFollower, FollowedFile
    from .streamer import ImageFile, ImageStreamer
    from .usage import SnapshotUsage, StoreRoom, StoreUsage, store_usage

# Each name imported on its first use, and the room it lives in.
_ROOM_OF_HEAVY_NAME = {
    "DumpFollower": "packs",
    "FollowedFile": "packs",
    "ImageFile": "streamer",
    "ImageStreamer": "streamer",
    "SnapshotUsage": "usage",
    "StoreRoom": "usage",
    "StoreUsage": "usage",
    "store_usage": "usage",
}

__all__ = [
    "ASSEMBLED_PREFIX",
    "ASSEMBLY_LOCK",
    "DAMAGED",
    "DELETING_PREFIX",
    "DRAFT_FILE",
    "DUMP_COMPLETE_FILE",
    "MEMORY_ASSEMBLY_PREFIX",
    "MEMORY_DIR",
    "PARTIAL_PREFIX",
    "UNFINISHED_PREFIX",
    "DiskRoom",
    "DumpFollower",
    "FollowedFile",
    "ImageFile",
    "ImageStreamer",
    "ManifestPolicy",
    "ManifestProblem",
    "PendingUploads",
    "RemoteSnapshot",
    "RemoteStore",
    "RemoteStoreError",
    "Snapshot",
    "SnapshotCache",
    "SnapshotIndex",
    "SnapshotStore",
    "SnapshotUsage",
    "StoreRoom",
    "StoreUsage",
    "assembly_key",
    "autosave_bytes",
    "autosave_refusal",
    "bounded_history",
    "default_kernel_log_dir",
    "default_key_file",
    "default_name",
    "default_store_dir",
    "describe",
    "digest_files",
    "fallbacks_offered",
    "group_of",
    "is_portable_file",
    "is_snapshot_id",
    "load_key",
    "new_snapshot_id",
    "newest_per_notebook",
    "portable_problem",
    "preferred_algorithm",
    "reclaimed_by_next_autosave",
    "store_usage",
    "to_delete",
    "validate_name",
]


def __getattr__(name: str) -> Any:
    """A heavy name, imported from its room on first use and kept (PEP 562)."""
    room = _ROOM_OF_HEAVY_NAME.get(name)
    if room is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{room}"), name)
    globals()[name] = value
    return value
