"""When an idle kernel hibernates: hibernation's setting, and the clock it reads idleness on.

The setting is two idle times, one per tier (``hibernation``): ``hibernate_after_minutes``
(the process tier: saved, its process ended) and ``release_gpu_after_minutes`` (the gpu
tier: its GPU released, its process kept); 0 is never. The server's come from
``c.GPUSnapshot``; a notebook may choose its own (``%gpu_snapshot hibernate [gpu] after
30m``), kept beside its autosave choices in the same per-notebook record
(``notebook_policies``, ``PUT kernels/{id}/autosave``).

Idleness is read on the server's own clock of the kernel, its ``last_activity``: it moves on
every message of the kernel's IOPub channel (a cell's start, its output, its end).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ..config import GPUSnapshot
from .jupyter_server_internals import last_activity

# What a notebook may choose of hibernation, and the JSON types each field accepts.
HIBERNATION_FIELDS: Mapping[str, tuple[type, ...]] = {
    "hibernate_after_minutes": (int, float),
    "release_gpu_after_minutes": (int, float),
}

# Minutes of idleness after which one kernel hibernates in a tier (its notebook's choice,
# else the server's setting); handed to ``Hibernation`` by the app.
IdleMinutes = Callable[[str], Awaitable[float]]


@dataclass(frozen=True)
class HibernationPolicy:
    """Hibernation's setting in force for one notebook (or the server's)."""

    # The process tier: saved and its process ended, after this long idle; 0 never.
    hibernate_after_minutes: float
    # The gpu tier: its GPU released and its process kept, after this long idle; 0 never.
    release_gpu_after_minutes: float

    @classmethod
    def from_settings(cls, settings: GPUSnapshot) -> HibernationPolicy:
        """The server's setting (``c.GPUSnapshot``)."""
        return cls(
            hibernate_after_minutes=float(settings.hibernate_after_minutes),
            release_gpu_after_minutes=float(settings.release_gpu_after_minutes),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def last_active(km: Any) -> float:
    """When the server last heard from the kernel on its IOPub channel (seconds since the
    epoch); 0 while it has no such time, the least recently used of all."""
    return last_activity(km) or 0.0


def idle_seconds(km: Any, now: float | None = None) -> float | None:
    """Seconds since the server last heard from the kernel on its IOPub channel; None
    while the server has no such time (its start has not completed)."""
    last = last_activity(km)
    if last is None:
        return None
    return max(0.0, (time.time() if now is None else now) - last)
