"""Per-kernel credentials: what a snapshot-ready kernel calls the server with.

A kernel's memory ends up in every snapshot of it, so it must never hold the server's
token. It gets ``gpusnap-kernel.<kernel id>.<HMAC of the id>`` instead, made with a secret
that stays in the server process; the extension's handlers accept it for that kernel's
routes and the snapshot API only, and the server's own API does not know it at all.
"""

from __future__ import annotations

import hashlib
import hmac

PREFIX = "gpusnap-kernel"


def kernel_token(secret: str, kernel_id: str) -> str:
    """The credential of kernel ``kernel_id``; ``secret`` is hex and never leaves the server."""
    mac = hmac.new(bytes.fromhex(secret), f"{PREFIX}:{kernel_id}".encode(), hashlib.sha256)
    return f"{PREFIX}.{kernel_id}.{mac.hexdigest()}"


def kernel_of_token(secret: str, token: str) -> str | None:
    """The kernel id ``token`` was made for with ``secret``, or None."""
    parts = token.split(".")
    if not secret or len(parts) != 3 or parts[0] != PREFIX:
        return None
    return parts[1] if hmac.compare_digest(kernel_token(secret, parts[1]), token) else None
