"""The key that signs manifests, kept outside the store.

A snapshot is code that root will run, so only manifests signed with this node's key are
trusted: HMAC-SHA256 over a canonical JSON encoding of everything but the signature. Nodes
that share a store share the key file.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

import blake3

from .. import safe_fs
from ..errors import SnapshotError

ALGORITHM = "HMAC-SHA256"
KEY_BYTES = 32
SIGNATURE_FIELD = "signature"


def canonical(manifest: dict[str, Any]) -> bytes:
    """The bytes that are signed: sorted keys, no spaces, ASCII, no NaN."""
    body = {k: v for k, v in manifest.items() if k != SIGNATURE_FIELD}
    return json.dumps(
        body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


class SigningKey:
    """An HMAC key; ``load`` reads (or on first use creates) its 0600 key file."""

    def __init__(self, secret: bytes, path: Path | None = None) -> None:
        if len(secret) < 16:
            raise ValueError("a signing key needs at least 16 bytes")
        self._secret = secret
        self.path = path

    @property
    def key_id(self) -> str:
        """Names the key in manifests without revealing it."""
        return hashlib.sha256(b"jupyter-gpu-snapshot key id\n" + self._secret).hexdigest()[:16]

    def derive(self, context: str) -> bytes:
        """A 32-byte key for another use (``context`` names it), from which neither this key
        nor a key of another context can be computed."""
        return bytes(blake3.blake3(self._secret, derive_key_context=context).digest())

    def sign(self, manifest: dict[str, Any]) -> dict[str, Any]:
        value = hmac.new(self._secret, canonical(manifest), hashlib.sha256).hexdigest()
        return {"algorithm": ALGORITHM, "key_id": self.key_id, "value": value}

    def problem(self, manifest: dict[str, Any]) -> str | None:
        """Why ``manifest``'s signature is not this key's, or None when it is."""
        signature = manifest.get(SIGNATURE_FIELD)
        if signature is None:
            return "it is unsigned"
        if not isinstance(signature, dict) or signature.get("algorithm") != ALGORITHM:
            return "its signature is malformed"
        expected = self.sign(manifest)["value"]
        if not hmac.compare_digest(str(signature.get("value", "")), expected):
            if signature.get("key_id") != self.key_id:
                return f"it was signed with another key ({signature.get('key_id')!s:.16})"
            return "its signature does not match: the manifest was altered"
        return None

    @classmethod
    def load(cls, path: Path) -> SigningKey:
        """Read the key file, creating it (0600, in a 0700 directory) on first use."""
        try:
            safe_fs.make_private_dirs(path.parent)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                return cls._create(path)
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode):
                    raise _key_error(path, "it is not a regular file")
                if info.st_uid != os.geteuid():
                    raise _key_error(path, f"it is owned by uid {info.st_uid}, not by us")
                if info.st_mode & 0o077:
                    raise _key_error(
                        path, f"its mode is {info.st_mode & 0o777:o}: others may read it",
                        hint=f"chmod 600 {path}",
                    )
                text = os.read(fd, 4096).decode("ascii", "replace").strip()
            finally:
                os.close(fd)
        except OSError as exc:
            raise _key_error(path, exc.strerror or str(exc)) from exc
        try:
            return cls(bytes.fromhex(text), path)
        except ValueError as exc:
            raise _key_error(path, "it holds no hex key of 16 bytes or more") from exc

    @classmethod
    def _create(cls, path: Path) -> SigningKey:
        secret = secrets.token_bytes(KEY_BYTES)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, secret.hex().encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # never replaces a key another process made meanwhile
        except FileExistsError:
            os.unlink(tmp)
            return cls.load(path)
        os.unlink(tmp)
        return cls(secret, path)


def _key_error(path: Path, cause: str, hint: str | None = None) -> SnapshotError:
    return SnapshotError(
        "signing key",
        f"cannot use the signing key {path}: {cause}",
        hint=hint or "fix or remove it, or set c.GPUSnapshot.signing_key_file",
    )
