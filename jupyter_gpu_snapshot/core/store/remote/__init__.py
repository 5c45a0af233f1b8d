"""Snapshots in object storage: upload, download into the local cache, list, delete.

The local store stays the place snapshots are saved to and restored from; a remote store
(any fsspec URL) keeps copies that another node can download. See docs/remote.md.
"""

from .cache import SnapshotCache
from .objects import RemoteSnapshot, RemoteStoreError
from .sealing import ChunkSealer, DecryptionError, load_key
from .store import RemoteStore

__all__ = [
    "ChunkSealer",
    "DecryptionError",
    "RemoteSnapshot",
    "RemoteStore",
    "RemoteStoreError",
    "SnapshotCache",
    "load_key",
]
