"""Checking image files against their manifest's digests while they stream in.

The manifest names its digest algorithm (``"digest"``, sha256 when absent) and gives each
file's hex digest under that name. For sha256, files larger than the store's tree chunk
carry the sha256 of their chunks' sha256s (``images._legacy_sha256``): each chunk then
downloads and hashes on its own thread, and the file's digest is put together at the end.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ...errors import SnapshotError
from ..digest import TREE_CHUNK, TREE_TAG


class Hasher(Protocol):
    def update(self, data: bytes, /) -> object: ...

    def hexdigest(self) -> str: ...

    def digest(self) -> bytes: ...


def _blake3() -> Hasher:
    from blake3 import blake3

    return blake3(max_threads=blake3.AUTO)


def hasher_factory(algorithm: str) -> Callable[[], Hasher]:
    if algorithm == "blake3":
        return _blake3
    if algorithm in hashlib.algorithms_guaranteed:
        return lambda: hashlib.new(algorithm)
    raise SnapshotError(
        "download",
        f"the manifest uses the digest algorithm {algorithm!r}, which this version cannot check",
        hint="upgrade jupyter_gpu_snapshot on this node",
    )


def manifest_algorithm(manifest: dict[str, Any]) -> str:
    named = manifest.get("digest", "sha256")
    if isinstance(named, dict):
        named = named.get("algorithm", "sha256")
    return str(named)


@dataclass(frozen=True)
class FileCheck:
    """How one file's bytes are checked: its expected digest and the segments hashed alone.

    ``segment_bytes`` is 0 when the whole file is one stream; otherwise each segment of that
    size gets its own digest, and the file's digest is the tree digest of them.
    """

    name: str
    size: int
    algorithm: str
    expected: str
    segment_bytes: int

    def new_hasher(self) -> Hasher:
        return hasher_factory(self.algorithm)()

    def segments(self) -> list[tuple[int, int]]:
        """(offset, length) of the pieces that may be fetched and hashed in parallel."""
        if not self.segment_bytes:
            return [(0, self.size)]
        step = self.segment_bytes
        return [(off, min(step, self.size - off)) for off in range(0, self.size, step)]

    def combine(self, parts: list[Hasher]) -> str:
        if not self.segment_bytes:
            return parts[0].hexdigest()
        return hashlib.sha256(TREE_TAG + b"".join(p.digest() for p in parts)).hexdigest()


def file_check(manifest: dict[str, Any], name: str) -> FileCheck:
    """The check of ``name`` as its manifest describes it; refuses entries without a digest."""
    algorithm = manifest_algorithm(manifest)
    hasher_factory(algorithm)  # refuse an unknown algorithm before anything is fetched
    entry = manifest.get("files", {}).get(name)
    expected = None
    if isinstance(entry, dict):
        expected = entry.get(algorithm) or entry.get("digest")
    if not isinstance(expected, str) or not isinstance(entry, dict):
        raise SnapshotError(
            "download", f"the manifest gives no {algorithm} digest for {name}",
            hint="the snapshot's manifest is damaged; delete the remote snapshot",
        )
    size = int(entry["size"])
    tree = algorithm == "sha256" and size > TREE_CHUNK
    return FileCheck(name, size, algorithm, expected, TREE_CHUNK if tree else 0)


def sidecar_check(name: str, size: int, sha256: str) -> FileCheck:
    """The check of a file outside the manifest's list (e.g. a signature), by its upload digest."""
    return FileCheck(name, size, "sha256", sha256, 0)
