"""Per-kernel credentials: what a snapshot-ready kernel calls the server with.

A kernel's memory ends up in every snapshot of it, so it must never hold the server's
token. Each launch of a kernel gets ``gpusnap-kernel.<kernel id>.<HMAC>`` instead, the HMAC
made with a secret that stays in the server process over the kernel id and a random value
of that launch: a restart of the kernel gets a new credential. The provisioner holds the
credential while that launch's tree runs, and the server accepts it only as long as the
provisioner holds it (``server/kernel_credentials.py``); the server's own API does not know
it at all.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from .._constants import KERNEL_TOKEN_PREFIX as PREFIX


def new_kernel_token(secret: str, kernel_id: str) -> str:
    """A new credential for a launch of kernel ``kernel_id``; ``secret`` is hex and never
    leaves the server."""
    launch = secrets.token_hex(16)
    mac = hmac.new(
        bytes.fromhex(secret), f"{PREFIX}:{kernel_id}:{launch}".encode(), hashlib.sha256
    )
    return f"{PREFIX}.{kernel_id}.{mac.hexdigest()}"


def kernel_id_of_token(token: str) -> str | None:
    """The kernel id ``token`` names if it has the form of a kernel's credential, else None.

    Only the form: whether a running kernel holds it is the server's question."""
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != PREFIX or not parts[1] or not parts[2]:
        return None
    return parts[1]


def same_token(held: str | None, presented: str) -> bool:
    """Whether ``presented`` is ``held``, compared in constant time."""
    return held is not None and hmac.compare_digest(held.encode(), presented.encode())
