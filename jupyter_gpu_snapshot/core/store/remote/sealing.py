"""Encryption at rest for remote snapshots: AES-256-GCM over fixed-size chunks.

An image file is stored as a run of records, one per ``chunk_bytes`` of plaintext:
``nonce (12) | ciphertext | tag (16)``. Each record is sealed with its own random nonce,
and its associated data binds it to the snapshot id, the file name, its index and the
file's plaintext size, so records cannot be reordered, swapped between files or
snapshots, or cut off at a record boundary without the tag failing.
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
from pathlib import Path

from ...errors import SnapshotError

CIPHER = "AES-256-GCM"
NONCE_BYTES = 12
TAG_BYTES = 16
RECORD_OVERHEAD = NONCE_BYTES + TAG_BYTES
DEFAULT_CHUNK_BYTES = 1 << 20
KEY_BYTES = 32
_AAD_TAG = b"jupyter-gpu-snapshot chunk v1\0"
_KEY_ID_TAG = b"jupyter-gpu-snapshot key id\n"


class DecryptionError(SnapshotError):
    """A record did not authenticate: a wrong key, or data altered in the remote store."""


def key_id(key: bytes) -> str:
    """A short public name for a key, so a wrong key is told apart from damaged data."""
    return hashlib.sha256(_KEY_ID_TAG + key).hexdigest()[:16]


def load_key(path: Path | str) -> bytes:
    """The 256-bit key in ``path``: 32 raw bytes or 64 hex digits, readable by its owner only."""
    path = Path(path)
    hint = "create one with: head -c 32 /dev/urandom > KEYFILE && chmod 600 KEYFILE"
    try:
        info = os.lstat(path)
    except OSError as e:
        raise SnapshotError(
            "encryption key", f"cannot read the key file {path}: {e.strerror}", hint=hint
        ) from e
    if not stat.S_ISREG(info.st_mode):
        raise SnapshotError("encryption key", f"{path} is not a regular file", hint=hint)
    if info.st_mode & 0o077:
        raise SnapshotError(
            "encryption key",
            f"the key file {path} can be read by other users (mode {stat.S_IMODE(info.st_mode):o})",
            hint=f"run: chmod 600 {path}",
        )
    data = path.read_bytes()
    text = data.strip()
    if len(text) == 2 * KEY_BYTES:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    if len(data) == KEY_BYTES:
        return data
    raise SnapshotError(
        "encryption key",
        f"the key file {path} holds {len(data)} bytes; it must hold 32 raw bytes or 64 hex digits",
        hint=hint,
    )


class ChunkSealer:
    """Seals and opens the records of one snapshot's files with one key."""

    def __init__(self, key: bytes, snapshot_id: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        if len(key) != KEY_BYTES:
            raise ValueError("AES-256-GCM needs a 32-byte key")
        # cryptography is imported by the first sealer: a store without a key needs none.
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._aead = AESGCM(key)
        self.key_id = key_id(key)
        self.snapshot_id = snapshot_id
        self.chunk_bytes = chunk_bytes

    def record_count(self, plain_size: int) -> int:
        # An empty file still gets one record, so that its tag vouches for its emptiness.
        return max(1, -(-plain_size // self.chunk_bytes))

    def stored_size(self, plain_size: int) -> int:
        return plain_size + self.record_count(plain_size) * RECORD_OVERHEAD

    def stored_offset(self, plain_offset: int) -> int:
        """Where the record holding ``plain_offset`` (a chunk boundary) starts."""
        assert plain_offset % self.chunk_bytes == 0
        return plain_offset + (plain_offset // self.chunk_bytes) * RECORD_OVERHEAD

    def _aad(self, name: str, index: int, plain_size: int) -> bytes:
        return b"".join(
            (
                _AAD_TAG,
                self.snapshot_id.encode(),
                b"\0",
                name.encode(),
                b"\0",
                struct.pack(">QQ", index, plain_size),
            )
        )

    def seal(self, name: str, index: int, plain_size: int, chunk: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, chunk, self._aad(name, index, plain_size))

    def seal_run(self, name: str, first_index: int, plain_size: int, data: bytes) -> bytes:
        """The records of ``data``, which starts at chunk ``first_index`` of file ``name``."""
        step = self.chunk_bytes
        if not data:
            return self.seal(name, first_index, plain_size, b"")
        return b"".join(
            self.seal(name, first_index + i, plain_size, data[off : off + step])
            for i, off in enumerate(range(0, len(data), step))
        )

    def open_run(self, name: str, first_index: int, plain_size: int, stored: bytes) -> bytes:
        """The plaintext of consecutive records; raises DecryptionError on any bad record."""
        from cryptography.exceptions import InvalidTag

        record = self.chunk_bytes + RECORD_OVERHEAD
        out: list[bytes] = []
        for i, off in enumerate(range(0, max(len(stored), 1), record)):
            piece = stored[off : off + record]
            nonce, sealed = piece[:NONCE_BYTES], piece[NONCE_BYTES:]
            try:
                out.append(
                    self._aead.decrypt(nonce, sealed, self._aad(name, first_index + i, plain_size))
                )
            except InvalidTag as e:
                raise DecryptionError(
                    "decrypt",
                    f"chunk {first_index + i} of {name} in snapshot {self.snapshot_id} does not "
                    "authenticate",
                    hint="the remote object was altered or damaged; delete the remote snapshot",
                ) from e
        return b"".join(out)
